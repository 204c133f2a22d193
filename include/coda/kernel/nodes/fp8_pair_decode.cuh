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
// The scales are read by the consumer threads one subtile ahead (as LoadAhead reads its tensor):
// a subtile's pair columns lie in one block, so each element's scale is its row's in the
// subtile's block, and a thread holds two rows (the GMMA accumulator's row slots): two reads
// per thread and subtile, where one per element took 64 per thread and tile.
// ---------------------------------------------------------------------------------------------
struct Fp8PairDecodeArguments {
  const float* scales = nullptr;  // block b of row m at b · ld_scales + m
  int64_t ld_scales = 0;
};

template <class CtaTile>
struct Fp8PairDecode : ConsumerOnlyNode<Fp8PairDecodeArguments> {
  using ConsumerOnlyNode<Fp8PairDecodeArguments>::ConsumerOnlyNode;
  static constexpr int kPairsPerBlock = 64;  // a 1x128 block of z holds 64 (g, u) pairs
  static_assert(cute::size<1>(CtaTile{}) % kPairsPerBlock == 0,
                "a CTA tile's pair columns are whole blocks of z");
  // Not ld_scales >= M: the launch checks the problem with its extents rounded up to 8
  // (kernel/gemm.cuh), so M here may exceed the real one; the op layer checks ld_scales against
  // the real M.
  template <class ProblemShape>
  static bool can_implement(ProblemShape const&, Arguments const& a) {
    return a.scales != nullptr && a.ld_scales > 0;
  }

  template <class CoordTensor, class Residue, class ScaleRegs>
  struct ConsumerStoreCallbacks : cf::EmptyConsumerStoreCallbacks {
    CUTLASS_DEVICE ConsumerStoreCallbacks(CoordTensor c, Residue r, ScaleRegs s, int64_t row0,
                                          int64_t col0, Params const& p)
        : tCcD(c), residue(r), tC_s(s), row0(row0), col0(col0), params(p) {}
    CoordTensor tCcD;    // (CPY,CPY_M,CPY_N,EPI_M,EPI_N) CTA-relative (m, n) of each element
    Residue residue;     // the CTA-relative extent of the problem
    ScaleRegs tC_s;      // (row slot, 2) two subtiles' scales of this thread's two rows
    int64_t row0, col0;  // the CTA tile's first row and pair column
    Params const& params;

    static constexpr int kEpiM = decltype(cute::size<3>(std::declval<CoordTensor>()))::value;
    static constexpr int kEpiN = decltype(cute::size<4>(std::declval<CoordTensor>()))::value;
    static_assert(kPairsPerBlock % (decltype(cute::size<1>(CtaTile{}))::value / kEpiN) == 0,
                  "a subtile's pair columns lie in one block of z");

    // Subtile s's scales into buffer s % 2: this thread's two rows' (the GMMA accumulator's row
    // slots r and r + 8, r % 16 < 8: fp8_tile::row_slot) in the subtile's block; 0 past M, and
    // where the block starts past N (a CTA of a cluster wholly past N).
    CUTLASS_DEVICE void load(int s) {
      if (s >= kEpiM * kEpiN) return;
      const int epi_m = s % kEpiM, epi_n = s / kEpiM;
      auto c = tCcD(cute::_, cute::_, cute::_, epi_m, epi_n);
      const int64_t block = (col0 + int64_t(cute::get<1>(c(0)))) / kPairsPerBlock;
      const bool block_in = block * kPairsPerBlock - col0 < int64_t(cute::get<1>(residue));
      const float* col = params.scales + block * params.ld_scales + row0;
      const int r0 = fp8_tile::slot_row0(int(cute::get<0>(c(0))));
      CUTLASS_PRAGMA_UNROLL
      for (int k = 0; k < 2; ++k) {
        const int m = r0 + 8 * k;
        tC_s(k, s % 2) = block_in && m < int(cute::get<0>(residue)) ? __ldg(col + m) : 0.0f;
      }
    }

    // Subtiles are visited epi_m fastest (the collective's loop order, fully unrolled): subtile
    // s + 1's scales are read while subtile s is computed.
    CUTLASS_DEVICE void begin_loop(int epi_m, int epi_n) {
      const int s = epi_n * kEpiM + epi_m;
      if (s == 0) load(0);
      load(s + 1);
    }

    template <class ElementAccumulator, class ElementInput, int F>
    CUTLASS_DEVICE cutlass::Array<uint32_t, F> visit(cutlass::Array<ElementAccumulator, F> const&,
                                                     int epi_v, int epi_m, int epi_n,
                                                     cutlass::Array<ElementInput, F> const& codes) {
      // The raw 16-bit words of C: a converted copy would be the pair's value, not its codes.
      static_assert(std::is_same_v<ElementInput, uint16_t>, "z must arrive as raw e4m3 pairs");
      auto coords = tCcD(cute::_, cute::_, cute::_, epi_m, epi_n);
      const int buffer = (epi_n * kEpiM + epi_m) % 2;
      cutlass::Array<uint32_t, F> out;
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < F; ++i) {
        const bool upper = fp8_tile::row_slot(int(cute::get<0>(coords(epi_v * F + i)))) == 1;
        const float s = upper ? tC_s(1, buffer) : tC_s(0, buffer);
        const float2 gu = fp8_tile::decode2(codes[i]);
        out[i] = pack_bf16_pair(gu.x * s, gu.y * s);
      }
      return out;
    }
  };

  template <bool ReferenceSrc, class... Args>
  CUTLASS_DEVICE auto get_consumer_store_callbacks(cf::ConsumerStoreArgs<Args...> const& args) {
    using namespace cute;
    auto [m, n, k, l] = args.tile_coord_mnkl;
    static_assert(decltype(size(args.tiled_mma))::value == fp8_tile::kThreads,
                  "Fp8PairDecode's row slots are the cooperative schedule's 64xN warpgroup MMAs");
    auto tCcCta = cta_coords<ReferenceSrc>(args);
    Tensor tC_s = make_tensor<float>(make_shape(_2{}, _2{}));
    return ConsumerStoreCallbacks<decltype(tCcCta), decltype(args.residue_cD), decltype(tC_s)>(
        tCcCta, args.residue_cD, tC_s, int64_t(m) * size<0>(CtaTile{}),
        int64_t(n) * size<1>(CtaTile{}), params);
  }
};

}  // namespace coda::kernel
