#pragma once
// NOTE: sm90_visitor_tma_warpspecialized.hpp uses NumericArrayConverter without including it.
#include <cutlass/arch/barrier.h>
#include <cutlass/numeric_conversion.h>

#include "coda/kernel/fp8_tile.cuh"
#include "coda/kernel/nodes/common.cuh"

namespace coda::kernel {

// ---------------------------------------------------------------------------------------------
// Fp8TileStore<CtaTile>: the quantizing output of docs/math.md §6. Its input, rounded to bf16,
// is staged over the whole 128x128 CTA tile in shared memory (visit); after the tile's last
// subtile (end) the 256 threads of the cooperative epilogue quantize it as the cast kernels do
// (fp8_tile.cuh): `rows` gets the 1x128 row blocks (the tile's columns are one block), `cols` the
// transposed 128x1 copy (the tile's rows are one block). Either output may be left out (null
// codes). Elements past M or N stage as 0. Returns its input unchanged.
//
// A 1x128 block must lie in one tile, so the tile is 128 wide along N, and 128 tall for the
// transposed copy; the cooperative schedule (two warp groups on one tile) gives the 256 threads.
// ---------------------------------------------------------------------------------------------
struct Fp8TileStoreArguments {
  Fp8Output rows;
  Fp8Output cols;
};

template <class CtaTile>
struct Fp8TileStore : NoWorkspaceNoProducerLoads {
  static_assert(cute::size<0>(CtaTile{}) == fp8_tile::kTile &&
                    cute::size<1>(CtaTile{}) == fp8_tile::kTile,
                "Fp8TileStore quantizes 128x128 tiles");
  struct SharedStorage {
    alignas(16) cute::array_aligned<unsigned char, fp8_tile::kSmemBytes> smem;
  };
  using Arguments = Fp8TileStoreArguments;
  using Params = Arguments;

  template <class ProblemShape>
  static constexpr Params to_underlying_arguments(ProblemShape const&, Arguments const& a, void*) {
    return a;
  }
  template <class ProblemShape>
  static bool can_implement(ProblemShape const&, Arguments const& a) {
    return (a.rows.codes == nullptr || a.rows.scales != nullptr) &&
           (a.cols.codes == nullptr || a.cols.scales != nullptr);
  }
  CUTLASS_HOST_DEVICE Fp8TileStore() {}
  CUTLASS_HOST_DEVICE Fp8TileStore(Params const& p, SharedStorage const& s)
      : params(p), smem(const_cast<unsigned char*>(s.smem.data())) {}
  Params params;
  unsigned char* smem = nullptr;

  template <class CoordTensor, class Residue>
  struct ConsumerStoreCallbacks : cf::EmptyConsumerStoreCallbacks {
    CUTLASS_DEVICE ConsumerStoreCallbacks(CoordTensor c, Residue r, fp8_tile::Staged s,
                                          fp8_tile::TilePlace t, int thread, Params const& p)
        : tCcD(c), residue(r), staged(s), place(t), thread(thread), params(p) {}
    CoordTensor tCcD;  // (CPY,CPY_M,CPY_N,EPI_M,EPI_N) CTA-relative (m, n) of each element
    Residue residue;   // the CTA-relative extent of the problem
    fp8_tile::Staged staged;
    fp8_tile::TilePlace place;
    int thread;
    Params const& params;

    template <class ElementAccumulator, class ElementInput, int F>
    CUTLASS_DEVICE cutlass::Array<ElementInput, F> visit(
        cutlass::Array<ElementAccumulator, F> const&, int epi_v, int epi_m, int epi_n,
        cutlass::Array<ElementInput, F> const& x) {
      static_assert(F % 2 == 0, "the staging stores column pairs");
      auto coords = tCcD(cute::_, cute::_, cute::_, epi_m, epi_n);
      auto* words = reinterpret_cast<__nv_bfloat162*>(staged.tile);
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < F; i += 2) {
        // Elements i and i + 1 are columns n and n + 1 of one row (the accumulator's pairs,
        // tests/gpu/gemm_programs_test.cpp's PairLayoutProbe; N is even, so both are in or out).
        const auto c = coords(epi_v * F + i);
        const bool in = cute::elem_less(c, residue);
        words[(int(cute::get<0>(c)) * fp8_tile::kPitch + int(cute::get<1>(c))) / 2] =
            __floats2bfloat162_rn(in ? static_cast<float>(x[i]) : 0.0f,
                                  in ? static_cast<float>(x[i + 1]) : 0.0f);
      }
      return x;
    }

    CUTLASS_DEVICE void end() {
      auto sync = [] {
        cutlass::arch::NamedBarrier::sync(fp8_tile::kThreads,
                                          cutlass::arch::ReservedNamedBarriers::EpilogueBarrier);
      };
      sync();  // every subtile staged
      // A CTA wholly past N (clusters along N round the grid up) has nothing to write.
      if (place.cols_here > 0 && place.rows_here > 0) {
        if (params.rows.codes)
          fp8_tile::quantize_rows<fp8_tile::Blocks::kRows>(staged, place, params.rows, thread);
        if (params.cols.codes)
          fp8_tile::quantize_columns<fp8_tile::Blocks::kRows>(staged, place, params.cols, thread);
      }
      sync();  // the next tile stages over this one only after every read
    }
  };

  template <bool ReferenceSrc, class... Args>
  CUTLASS_DEVICE auto get_consumer_store_callbacks(cf::ConsumerStoreArgs<Args...> const& args) {
    static_assert(decltype(cute::size(args.tiled_mma))::value == fp8_tile::kThreads,
                  "Fp8TileStore needs the cooperative schedule's 256 epilogue threads");
    auto [M, N, K, L] = args.problem_shape_mnkl;
    auto [m, n, k, l] = args.tile_coord_mnkl;
    auto tCcCta = cta_coords<ReferenceSrc>(args);
    const fp8_tile::TilePlace t = fp8_tile::place(int64_t(m), int64_t(n), int64_t(M), int64_t(N));
    return ConsumerStoreCallbacks<decltype(tCcCta), decltype(args.residue_cD)>(
        tCcCta, args.residue_cD, fp8_tile::staged(smem), t, int(args.thread_idx), params);
  }
};

}  // namespace coda::kernel
