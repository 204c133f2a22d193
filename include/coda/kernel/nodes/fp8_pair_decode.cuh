#pragma once
// NOTE: sm90_visitor_tma_warpspecialized.hpp uses NumericArrayConverter without including it.
#include <cutlass/numeric_conversion.h>

#include "coda/kernel/fp8_tile.cuh"
#include "coda/kernel/nodes/common.cuh"
#include "coda/kernel/nodes/global_access.cuh"  // bf16 pair packing

namespace coda::kernel {

// ---------------------------------------------------------------------------------------------
// Fp8PairDecode<CtaTile>: an FP8 z for B2 (fusions/swiglu_backward_fp8.cuh, kSwigluBackwardFp8Z).
// Its child is the kernel's C, z's e4m3 codes read as one 16-bit (g, u) pair per output column;
// it returns each pair decoded, code · scale of its 1x128 block along z's 2I columns (the pair
// in column n sits in z's block 2n / 128), as the bf16 pair SwigluBackwardNode reads. The
// decoded values are exact in bf16 (4 significant bits, power-of-two scales; only values below
// 2^-133, from blocks whose amax is under 2^-118, would round). Elements past M decode as 0
// (TMA fills their codes with 0; no scale is read for them).
// ---------------------------------------------------------------------------------------------
struct Fp8PairDecodeArguments {
  const float* scales = nullptr;  // block b of row m at b · ld_scales + m
  int64_t ld_scales = 0;
};

template <class CtaTile>
struct Fp8PairDecode : ConsumerOnlyNode<Fp8PairDecodeArguments> {
  using ConsumerOnlyNode<Fp8PairDecodeArguments>::ConsumerOnlyNode;
  // Not ld_scales >= M: the launch checks the problem with its extents rounded up to 8
  // (kernel/gemm.cuh), so M here may exceed the real one; the op layer checks ld_scales against
  // the real M.
  template <class ProblemShape>
  static bool can_implement(ProblemShape const&, Arguments const& a) {
    return a.scales != nullptr && a.ld_scales > 0;
  }

  template <class CoordTensor, class Residue>
  struct ConsumerStoreCallbacks : cf::EmptyConsumerStoreCallbacks {
    CUTLASS_DEVICE ConsumerStoreCallbacks(CoordTensor c, Residue r, int64_t row0, int64_t col0,
                                          Params const& p)
        : tCcD(c), residue(r), row0(row0), col0(col0), params(p) {}
    CoordTensor tCcD;    // (CPY,CPY_M,CPY_N,EPI_M,EPI_N) CTA-relative (m, n) of each element
    Residue residue;     // the CTA-relative extent of the problem
    int64_t row0, col0;  // the CTA tile's first row and pair column
    Params const& params;

    template <class ElementAccumulator, class ElementInput, int F>
    CUTLASS_DEVICE cutlass::Array<uint32_t, F> visit(cutlass::Array<ElementAccumulator, F> const&,
                                                     int epi_v, int epi_m, int epi_n,
                                                     cutlass::Array<ElementInput, F> const& codes) {
      // The raw 16-bit words of C: a converted copy would be the pair's value, not its codes.
      static_assert(std::is_same_v<ElementInput, uint16_t>, "z must arrive as raw e4m3 pairs");
      auto coords = tCcD(cute::_, cute::_, cute::_, epi_m, epi_n);
      cutlass::Array<uint32_t, F> out;
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < F; ++i) {
        const auto c = coords(epi_v * F + i);
        float s = 0.0f;
        if (cute::elem_less(c, residue)) {
          const int64_t block = (col0 + int64_t(cute::get<1>(c))) / 64;
          s = __ldg(params.scales + block * params.ld_scales + row0 + int64_t(cute::get<0>(c)));
        }
        const float2 gu = fp8_tile::decode2(codes[i]);
        out[i] = pack_bf16_pair(gu.x * s, gu.y * s);
      }
      return out;
    }
  };

  template <bool ReferenceSrc, class... Args>
  CUTLASS_DEVICE auto get_consumer_store_callbacks(cf::ConsumerStoreArgs<Args...> const& args) {
    auto [m, n, k, l] = args.tile_coord_mnkl;
    auto tCcCta = cta_coords<ReferenceSrc>(args);
    return ConsumerStoreCallbacks<decltype(tCcCta), decltype(args.residue_cD)>(
        tCcCta, args.residue_cD, int64_t(m) * cute::size<0>(CtaTile{}),
        int64_t(n) * cute::size<1>(CtaTile{}), params);
  }
};

}  // namespace coda::kernel
