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
// share those rows, take the max over the row's 128 columns, and exchange their codes by
// shuffles so that each lane stores 16 contiguous columns of a row at once (16-byte stores).
// The codes and scales are fp8_tile::quantize_rows's of the same bf16 values, bit for bit (the
// amax as |bits|, E4m3::scale and inverse, encode2). It returns its child's values unchanged.
// F2's z in FP8 (fusions/rmsnorm_swiglu_fp8.cuh, kRmsnormSwigluFp8Z) and the rows of
// Fp8TileStore<WholeTile> (F1's h). The row slots and the quad (fp8_tile::row_slot, quad_lane)
// are the GMMA accumulator's layout, which the GPU tests check bit for bit against the casts.
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
    // Codes go out 16 columns at a time: N a multiple of 16, rows 16-byte aligned.
    return a.codes != nullptr && a.scales != nullptr && N % 16 == 0 && a.ld % 16 == 0 &&
           reinterpret_cast<uintptr_t>(a.codes) % 16 == 0;
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
    static_assert(kEpiM == 1 && kEpiN == 4 && kPairs == 8,
                  "Fp8RowStore takes 128x32 subtiles: per thread 8 pairs, two rows by four groups");

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
        const bool upper = fp8_tile::row_slot(int(cute::get<0>(c))) == 1;
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
      // Lane q of a quad holds columns 8j + 2q, + 1 of its two rows (see below): lane 0 holds
      // column 0 and writes the rows' scales, and those of rows past M up to a multiple of 4 too
      // (amax 0: scale 1), since the GEMM's TMA reads whole 16 bytes of them.
      auto first = tCcD(0, 0, 0, 0, 0);
      const int q = fp8_tile::quad_lane(int(cute::get<1>(first)));
      const int r0 = fp8_tile::slot_row0(int(cute::get<0>(first)));
      const int64_t rows_scaled = ScaleLayout::row_scales_ld(rows);
      if (q == 0) {
        CUTLASS_PRAGMA_UNROLL
        for (int k = 0; k < 2; ++k)
          if (row0 + r0 + 8 * k < rows_scaled)
            params.scales[tile_n * params.ld_scales + row0 + r0 + 8 * k] = sc[k];
      }
      // The codes, 16 bits (a column pair) each: u[k][j] holds row slot k's columns 8j + 2q, + 1
      // (q = the lane's place in its quad). Pair p of subtile s is row slot p % 2, column group
      // 4s + p / 2 (the 64xN accumulator's order: (2 columns, 2 rows, N / 8 groups)).
      uint32_t u[2][16];
      CUTLASS_PRAGMA_UNROLL
      for (int s = 0; s < kEpiN; ++s) {
        CUTLASS_PRAGMA_UNROLL
        for (int p = 0; p < kPairs; ++p) {
          const int k = p % 2;
          const uint32_t pair = tC_v(p, s);
          u[k][4 * s + p / 2] = E4m3::encode2(fp8_tile::low_value(pair) * inv[k],
                                              fp8_tile::high_value(pair) * inv[k]);
        }
      }
      // A quad exchanges them so that lane q holds column groups 8g + 2q and 8g + 2q + 1 of
      // each row whole (16 contiguous bytes, g = 0, 1): three shuffles per row and g, then one
      // 16-byte store, where each lane storing its own pairs took 16 two-byte stores.
      CUTLASS_PRAGMA_UNROLL
      for (int k = 0; k < 2; ++k) {
        const int r = r0 + 8 * k;
        CUTLASS_PRAGMA_UNROLL
        for (int g = 0; g < 2; ++g) {
          // mine(t): this lane's units of lane t's two column groups, low half the first.
          auto mine = [&](int t) {
            uint32_t v = 0u;
            CUTLASS_PRAGMA_UNROLL
            for (int c = 0; c < 4; ++c) {
              const int j = 8 * g + 2 * c;
              v = t == c ? (u[k][j] | u[k][j + 1] << 16) : v;
            }
            return v;
          };
          // Lane q ^ d's units of this lane's groups, placed at that lane's 16 bits of each
          // group's 8 bytes by a shift (a register array indexed by q would go to the stack).
          uint64_t first_group = 0u, second_group = 0u;
          CUTLASS_PRAGMA_UNROLL
          for (int d = 0; d < 4; ++d) {
            const uint32_t v = d == 0 ? mine(q) : __shfl_xor_sync(0xffffffffu, mine(q ^ d), d);
            const int at = 16 * (q ^ d);
            first_group |= uint64_t(v & 0xffffu) << at;
            second_group |= uint64_t(v >> 16) << at;
          }
          const uint4 codes = make_uint4(uint32_t(first_group), uint32_t(first_group >> 32),
                                         uint32_t(second_group), uint32_t(second_group >> 32));
          const int n = 64 * g + 16 * q;  // the 16 columns' first, CTA-relative
          // N is a multiple of 16: the 16 columns are wholly in or out.
          if (r < int(cute::get<0>(residue)) && n < int(cute::get<1>(residue)))
            *reinterpret_cast<uint4*>(params.codes + (row0 + r) * params.ld + col0 + n) = codes;
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
