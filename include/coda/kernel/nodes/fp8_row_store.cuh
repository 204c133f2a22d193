#pragma once
// NOTE: sm90_visitor_tma_warpspecialized.hpp uses NumericArrayConverter without including it.
#include <cutlass/numeric_conversion.h>

#include "coda/kernel/fp8_tile.cuh"
#include "coda/kernel/nodes/common.cuh"
#include "coda/kernel/nodes/global_access.cuh"  // bf16 pair packing

namespace coda::kernel {

// ---------------------------------------------------------------------------------------------
// Fp8RowStore<CtaTile>: its child's values, rounded to bf16, quantized in 1x128 blocks along the
// rows of a 128x128 CTA tile (one block per row) straight from the registers: no staged tile, no
// shared memory, no barrier. Each thread keeps its bf16 pairs of the tile (two rows, 32 columns
// each under the cooperative schedule's 64xN warpgroup MMAs: rows r and r + 8, r = the lane / 4
// within its warp's 16) and their amax per row; at the tile's end the four lanes of a quad, which
// share those rows, take the max over the row's 128 columns, and every thread writes its codes.
// The codes and scales are fp8_tile::quantize_rows's of the same bf16 values, bit for bit (the
// amax as |bits|, E4m3::scale and inverse, encode2). It returns its child's values unchanged.
// F2's z in FP8 (fusions/rmsnorm_swiglu_fp8.cuh, kRmsnormSwigluFp8Z) and the rows of
// Fp8TileStore<WholeTile> (F1's h). The row slots and the quad are the GMMA accumulator's
// layout, which the GPU tests check bit for bit against the cast kernels.
// ---------------------------------------------------------------------------------------------
template <class CtaTile>
struct Fp8RowStore : ConsumerOnlyNode<Fp8Output> {
  using ConsumerOnlyNode<Fp8Output>::ConsumerOnlyNode;
  static_assert(cute::size<0>(CtaTile{}) == fp8_tile::kTile &&
                    cute::size<1>(CtaTile{}) == fp8_tile::kTile,
                "Fp8RowStore quantizes the rows of 128x128 tiles");

  template <class ProblemShape>
  static bool can_implement(ProblemShape const& shape, Arguments const& a) {
    auto [M, N, K, L] = cute::append<4>(shape, 1);
    // Codes go out as 16-bit column pairs: N even, rows 2-byte aligned.
    return a.codes != nullptr && a.scales != nullptr && N % 2 == 0 && a.ld % 2 == 0;
  }

  template <class CoordTensor, class Residue, class Values>
  struct ConsumerStoreCallbacks : cf::EmptyConsumerStoreCallbacks {
    CUTLASS_DEVICE ConsumerStoreCallbacks(CoordTensor c, Residue r, Values v, int64_t tile_m,
                                          int64_t tile_n, int64_t rows, int64_t cols,
                                          Params const& p)
        : tCcD(c), residue(r), tC_v(v), tile_m(tile_m), tile_n(tile_n), rows(rows), cols(cols),
          params(p) {}
    CoordTensor tCcD;  // (CPY,CPY_M,CPY_N,EPI_M,EPI_N) CTA-relative (m, n) of each element
    Residue residue;   // the CTA-relative extent of the problem
    Values tC_v;       // (pairs of a subtile, subtiles) the bf16 pairs, 0 outside the problem
    int64_t tile_m, tile_n;
    int64_t rows, cols;  // the output's extent
    Params const& params;
    uint32_t amax[2] = {0u, 0u};  // per row slot (row % 16 < 8, >= 8), as |bits|

    static constexpr int kEpiM = decltype(cute::size<3>(std::declval<CoordTensor>()))::value;
    static constexpr int kEpiN = decltype(cute::size<4>(std::declval<CoordTensor>()))::value;
    static constexpr int kPairs = decltype(cute::size<0>(std::declval<Values>()))::value;

    template <class ElementAccumulator, class ElementInput, int F>
    CUTLASS_DEVICE cutlass::Array<float, F> visit(cutlass::Array<ElementAccumulator, F> const&,
                                                  int epi_v, int epi_m, int epi_n,
                                                  cutlass::Array<ElementInput, F> const& x) {
      static_assert(F % 2 == 0, "fragments hold whole column pairs");
      auto coords = tCcD(cute::_, cute::_, cute::_, epi_m, epi_n);
      auto pairs = tC_v(cute::_, epi_n * kEpiM + epi_m);
      cutlass::Array<float, F> out;
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < F; i += 2) {
        // Elements i and i + 1 are columns n and n + 1 of one row (the accumulator's pairs; N is
        // even, so both are in or out).
        const auto c = coords(epi_v * F + i);
        const bool in = cute::elem_less(c, residue);
        const uint32_t pair = pack_bf16_pair(in ? float(x[i]) : 0.0f, in ? float(x[i + 1]) : 0.0f);
        pairs((epi_v * F + i) / 2) = pair;
        const uint32_t mags = fp8_tile::pair_magnitudes(pair);
        const uint32_t m = max(fp8_tile::low_amax(mags), fp8_tile::high_amax(mags));
        const bool upper = (int(cute::get<0>(c)) & 8) != 0;
        amax[0] = upper ? amax[0] : max(amax[0], m);
        amax[1] = upper ? max(amax[1], m) : amax[1];
        out[i] = float(x[i]);
        out[i + 1] = float(x[i + 1]);
      }
      return out;
    }

    CUTLASS_DEVICE void end() {
      using epilogue::E4m3;
      const int64_t row0 = tile_m * fp8_tile::kTile, col0 = tile_n * fp8_tile::kTile;
      if (col0 >= cols) return;  // a CTA wholly past N (clusters along N round the grid up)
      float sc[2], inv[2];
      CUTLASS_PRAGMA_UNROLL
      for (int k = 0; k < 2; ++k) {
        uint32_t m = amax[k];
        m = max(m, __shfl_xor_sync(0xffffffffu, m, 1));
        m = max(m, __shfl_xor_sync(0xffffffffu, m, 2));
        sc[k] = E4m3::scale(fp8_tile::as_amax(m));
        inv[k] = E4m3::inverse(sc[k]);
      }
      // The scales of rows past M up to a multiple of 4 too (amax 0: scale 1): the GEMM's TMA
      // reads whole 16 bytes of them.
      const int64_t rows_scaled = ScaleLayout::row_scales_ld(rows);
      CUTLASS_PRAGMA_UNROLL
      for (int s = 0; s < kEpiM * kEpiN; ++s) {
        auto coords = tCcD(cute::_, cute::_, cute::_, s % kEpiM, s / kEpiM);
        CUTLASS_PRAGMA_UNROLL
        for (int j = 0; j < kPairs; ++j) {  // the one thread holding column 0 of a row writes
          const auto c = coords(2 * j);
          const int r = int(cute::get<0>(c));
          if (int(cute::get<1>(c)) == 0 && row0 + r < rows_scaled)
            params.scales[tile_n * params.ld_scales + row0 + r] = (r & 8) ? sc[1] : sc[0];
        }
      }
      CUTLASS_PRAGMA_UNROLL
      for (int s = 0; s < kEpiM * kEpiN; ++s) {
        auto coords = tCcD(cute::_, cute::_, cute::_, s % kEpiM, s / kEpiM);
        CUTLASS_PRAGMA_UNROLL
        for (int j = 0; j < kPairs; ++j) {
          const auto c = coords(2 * j);
          if (!cute::elem_less(c, residue)) continue;
          const int r = int(cute::get<0>(c)), n = int(cute::get<1>(c));
          const float k_inv = (r & 8) ? inv[1] : inv[0];
          const uint32_t pair = tC_v(j, s);
          const uint16_t codes = E4m3::encode2(fp8_tile::low_value(pair) * k_inv,
                                               fp8_tile::high_value(pair) * k_inv);
          *reinterpret_cast<uint16_t*>(params.codes + (row0 + r) * params.ld + col0 + n) = codes;
        }
      }
    }
  };

  // The callbacks writing `out` (Fp8TileStore<WholeTile> holds them for its rows).
  template <bool ReferenceSrc, class StoreArgs>
  CUTLASS_DEVICE static auto callbacks(StoreArgs const& args, Fp8Output const& out) {
    using namespace cute;
    static_assert(decltype(size(args.tiled_mma))::value == fp8_tile::kThreads,
                  "Fp8RowStore's row slots are the cooperative schedule's 64xN warpgroup MMAs");
    auto [M, N, K, L] = args.problem_shape_mnkl;
    auto [m, n, k, l] = args.tile_coord_mnkl;
    auto tCcCta = cta_coords<ReferenceSrc>(args);
    constexpr int kPerSubtile = decltype(size(take<0, 3>(shape(tCcCta))))::value;
    constexpr int kSubtiles = decltype(size<3>(tCcCta) * size<4>(tCcCta))::value;
    Tensor tC_v = make_tensor<uint32_t>(make_shape(Int<kPerSubtile / 2>{}, Int<kSubtiles>{}));
    return ConsumerStoreCallbacks<decltype(tCcCta), decltype(args.residue_cD), decltype(tC_v)>(
        tCcCta, args.residue_cD, tC_v, int64_t(m), int64_t(n), int64_t(M), int64_t(N), out);
  }

  template <bool ReferenceSrc, class... Args>
  CUTLASS_DEVICE auto get_consumer_store_callbacks(cf::ConsumerStoreArgs<Args...> const& args) {
    return callbacks<ReferenceSrc>(args, params);
  }
};

}  // namespace coda::kernel
