#pragma once
// NOTE: sm90_visitor_tma_warpspecialized.hpp uses NumericArrayConverter without including it.
#include <cutlass/arch/barrier.h>
#include <cutlass/numeric_conversion.h>

#include "coda/epilogue/elementwise.hpp"
#include "coda/kernel/fp8_tile.cuh"
#include "coda/kernel/nodes/common.cuh"
#include "coda/kernel/nodes/fp8_row_store.cuh"

namespace coda::kernel {

// ---------------------------------------------------------------------------------------------
// Fp8TileStore<CtaTile, Staging>: the quantizing output of docs/math.md §6. Its input, rounded
// to bf16, is staged in shared memory as 128x128 tiles of the output tensor (visit); when a
// staged tile is complete, the 256 threads of the cooperative epilogue quantize it as the cast
// kernels do (fp8_tile.cuh): `rows` gets the 1x128 row blocks (the staged tile's columns are one
// block), `cols` the transposed 128x1 copy (its rows are one block). Either output may be left
// out (null codes); `copy`, when set, gets the staged bf16 values themselves (what a cast kernel
// would read: the tests compare codes and scales with the cast of this copy). Elements past M or
// the output's columns stage as 0. Under WholeTile the rows leave from the registers instead
// (Fp8RowStore: the same codes and scales), and a tile is staged only for `cols` or `copy`: F1
// with h's rows alone (the FP8 block's) neither stages nor waits at a barrier.
//
// Staging says how the CTA tile's elements land in staged tiles, which output tile each is and
// when it is complete (below). The CTA tile is 128x128 and the schedule cooperative (two warp
// groups on one tile): the staged tile's 128 rows are the CTA tile's, and its passes use the
// 256 threads.
// ---------------------------------------------------------------------------------------------
struct Fp8TileStoreArguments {
  Fp8Output rows;
  Fp8Output cols;
  bf16* copy = nullptr;  // (M, output columns), leading dimension ld_copy; tests
  int64_t ld_copy = 0;
};

namespace fp8_staging {
// The CTA tile is the staged tile, element for element; quantized at the tile's end into block
// column n. F1's h, B1's h_out.
struct WholeTile {
  static constexpr int kParts = 1;           // staged tiles per CTA tile
  static constexpr bool kAtEndLoop = false;  // complete at end(), not after a subtile
  CUTLASS_HOST_DEVICE static int64_t output_cols(int64_t n) { return n; }
  CUTLASS_DEVICE static int64_t block_col(int64_t tile_n, int part) { return tile_n + part; }
  CUTLASS_DEVICE static bool completes(int64_t) { return true; }
  template <class T>
  CUTLASS_DEVICE static void stage(__nv_bfloat16* tile, int row, int col, int64_t, T x0, T x1,
                                   bool in) {
    *reinterpret_cast<__nv_bfloat162*>(tile + row * fp8_tile::kPitch + col) =
        __floats2bfloat162_rn(in ? float(x0) : 0.0f, in ? float(x1) : 0.0f);
  }
};

// The input is z (fp32) over a 128x128 tile of interleaved (gate, up) pairs; each pair stages
// silu(g)·u, so a CTA tile fills 64 columns: tile n fills columns 64·(n % 2) .. +63 of staged
// tile n / 2, whose other half the tile before it filled (PairedAlongN runs them back to back),
// and the odd tile's end quantizes it. F2's a.
struct SwigluOfPairedTiles {
  static constexpr int kParts = 1;
  static constexpr bool kAtEndLoop = false;
  CUTLASS_HOST_DEVICE static int64_t output_cols(int64_t n) { return n / 2; }
  CUTLASS_DEVICE static int64_t block_col(int64_t tile_n, int) { return tile_n / 2; }
  CUTLASS_DEVICE static bool completes(int64_t tile_n) { return tile_n % 2 == 1; }
  template <class T>
  CUTLASS_DEVICE static void stage(__nv_bfloat16* tile, int row, int col, int64_t tile_n, T g, T u,
                                   bool in) {
    const float a = in ? epilogue::SwiGlu{}(float(g), float(u)) : 0.0f;
    tile[row * fp8_tile::kPitch + 64 * int(tile_n % 2) + col / 2] = __float2bfloat16_rn(a);
  }
};

// The input is packed bf16 pairs (one 32-bit word per CTA column: the output's columns 2c and
// 2c + 1), so the CTA tile is 128x256 of the output, two staged tiles: column c's pair stages
// at columns 2(c % 64), +1 of part c / 64, and each part is quantized after the subtile that
// completes it (end_loop), into block column 2n + part. B2's dz.
struct PairsInHalves {
  static constexpr int kParts = 2;
  static constexpr bool kAtEndLoop = true;
  CUTLASS_HOST_DEVICE static int64_t output_cols(int64_t n) { return 2 * n; }
  CUTLASS_DEVICE static int64_t block_col(int64_t tile_n, int part) { return 2 * tile_n + part; }
  CUTLASS_DEVICE static bool completes(int64_t) { return true; }
  // Columns c and c + 1 (c even: a fragment's pair): four output columns, one 8-byte store.
  CUTLASS_DEVICE static void stage(__nv_bfloat16* tile, int row, int col, int64_t, uint32_t p0,
                                   uint32_t p1, bool in) {
    *reinterpret_cast<uint2*>(tile + row * fp8_tile::kPitch + 2 * (col % 64)) =
        in ? make_uint2(p0, p1) : make_uint2(0u, 0u);
  }
};
}  // namespace fp8_staging

template <class CtaTile, class Staging = fp8_staging::WholeTile>
struct Fp8TileStore : NoWorkspaceNoProducerLoads {
  static_assert(cute::size<0>(CtaTile{}) == fp8_tile::kTile &&
                    cute::size<1>(CtaTile{}) == fp8_tile::kTile,
                "Fp8TileStore quantizes 128x128 tiles");
  using ElementAux = cutlass::bfloat16_t;  // what D would hold; lets the collective run with no D
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
  static bool can_implement(ProblemShape const& shape, Arguments const& a) {
    auto [M, N, K, L] = cute::append<4>(shape, 1);
    // Whole 16-byte chunks of codes (8-column chunks of the copy) per 8 columns: the passes
    // write 8 codes at a time and take the output's columns a multiple of 16.
    return Staging::output_cols(int64_t(N)) % 16 == 0 &&
           (a.rows.codes == nullptr || a.rows.scales != nullptr) &&
           (a.cols.codes == nullptr || a.cols.scales != nullptr) &&
           (a.copy == nullptr || a.ld_copy % 8 == 0) &&
           // kRowsInRegisters writes the rows' codes as 16-bit column pairs
           (!kRowsInRegisters || a.rows.codes == nullptr || a.rows.ld % 2 == 0);
  }
  CUTLASS_HOST_DEVICE Fp8TileStore() {}
  CUTLASS_HOST_DEVICE Fp8TileStore(Params const& p, SharedStorage const& s)
      : params(p), smem(const_cast<unsigned char*>(s.smem.data())) {}
  Params params;
  unsigned char* smem = nullptr;

  // WholeTile's rows from the registers (the row blocks are the CTA tile's rows).
  static constexpr bool kRowsInRegisters = std::is_same_v<Staging, fp8_staging::WholeTile>;
  struct NoRows {};

  template <class CoordTensor, class Residue, class Rows>
  struct ConsumerStoreCallbacks : cf::EmptyConsumerStoreCallbacks {
    CUTLASS_DEVICE ConsumerStoreCallbacks(CoordTensor c, Residue r, fp8_tile::Staged s,
                                          int64_t tile_m, int64_t tile_n, int64_t rows,
                                          int64_t cols, int thread, Params const& p, Rows rw)
        : tCcD(c),
          residue(r),
          staged(s),
          tile_m(tile_m),
          tile_n(tile_n),
          rows(rows),
          cols(cols),
          thread(thread),
          params(p),
          row_store(rw) {}
    CoordTensor tCcD;  // (CPY,CPY_M,CPY_N,EPI_M,EPI_N) CTA-relative (m, n) of each element
    Residue residue;   // the CTA-relative extent of the problem
    fp8_tile::Staged staged;
    int64_t tile_m, tile_n;  // the CTA tile's coordinates
    int64_t rows, cols;      // the output tensor's extent
    int thread;
    Params const& params;
    Rows row_store;  // Fp8RowStore's callbacks under kRowsInRegisters

    // Whether tiles are staged at all: the rows of kRowsInRegisters need no staged tile.
    CUTLASS_DEVICE bool stages() const {
      return !kRowsInRegisters || params.cols.codes != nullptr || params.copy != nullptr;
    }

    static constexpr int kEpiM = decltype(cute::size<3>(std::declval<CoordTensor>()))::value;
    static constexpr int kEpiN = decltype(cute::size<4>(std::declval<CoordTensor>()))::value;
    static_assert(kEpiN % Staging::kParts == 0, "a staged tile is whole subtiles");

    template <class ElementAccumulator, class ElementInput, int F>
    CUTLASS_DEVICE cutlass::Array<float, F> visit(cutlass::Array<ElementAccumulator, F> const& acc,
                                                  int epi_v, int epi_m, int epi_n,
                                                  cutlass::Array<ElementInput, F> const& x) {
      static_assert(F % 2 == 0, "the staging takes column pairs");
      if constexpr (kRowsInRegisters) {
        if (params.rows.codes) row_store.visit(acc, epi_v, epi_m, epi_n, x);
      }
      auto coords = tCcD(cute::_, cute::_, cute::_, epi_m, epi_n);
      if (stages()) {
        CUTLASS_PRAGMA_UNROLL
        for (int i = 0; i < F; i += 2) {
          // Elements i and i + 1 are columns n and n + 1 of one row (the accumulator's pairs,
          // tests/gpu/gemm_programs_test.cpp's PairLayoutProbe; N is even, so both are in or out).
          const auto c = coords(epi_v * F + i);
          Staging::stage(staged.tile, int(cute::get<0>(c)), int(cute::get<1>(c)), tile_n, x[i],
                         x[i + 1], bool(cute::elem_less(c, residue)));
        }
      }
      // The collective's D takes float values (a packed input's D is void: nothing to return).
      cutlass::Array<float, F> out;
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < F; ++i) {
        if constexpr (std::is_same_v<ElementInput, uint32_t>) {
          out[i] = 0.0f;
        } else {
          out[i] = static_cast<float>(x[i]);
        }
      }
      return out;
    }

    CUTLASS_DEVICE void end_loop(int epi_m, int epi_n) {
      if constexpr (Staging::kAtEndLoop) {
        constexpr int kPerPart = kEpiN / Staging::kParts;
        if (epi_m == kEpiM - 1 && (epi_n + 1) % kPerPart == 0) flush(epi_n / kPerPart);
      }
    }

    CUTLASS_DEVICE void end() {
      if constexpr (kRowsInRegisters) {
        if (params.rows.codes) row_store.end();
      }
      if constexpr (!Staging::kAtEndLoop) {
        if (stages() && Staging::completes(tile_n)) flush(0);
      }
    }

    // Every thread's staging of the tile done, quantize it (and copy it), then every read of it
    // done before the next staging writes over it.
    CUTLASS_DEVICE void flush(int part) {
      auto sync = [] {
        cutlass::arch::NamedBarrier::sync(fp8_tile::kThreads,
                                          cutlass::arch::ReservedNamedBarriers::EpilogueBarrier);
      };
      sync();
      const fp8_tile::TilePlace t =
          fp8_tile::place(tile_m, Staging::block_col(tile_n, part), rows, cols);
      // A CTA wholly past N (clusters along N round the grid up) has nothing to write.
      if (t.cols_here > 0 && t.rows_here > 0) {
        if (params.copy) copy_out(t);
        if (!kRowsInRegisters && params.rows.codes)
          fp8_tile::quantize_rows<fp8_tile::Blocks::kRows>(staged, t, params.rows, thread);
        if (params.cols.codes)
          fp8_tile::quantize_columns<fp8_tile::Blocks::kRows>(staged, t, params.cols, thread);
      }
      sync();
    }

    // The staged bf16 tile to `copy`, 16 bytes (8 columns) at a time.
    CUTLASS_DEVICE void copy_out(const fp8_tile::TilePlace& t) const {
      constexpr int kChunks = fp8_tile::kTile / 8;  // per row
      for (int i = thread; i < fp8_tile::kTile * kChunks; i += fp8_tile::kThreads) {
        const int r = i / kChunks, c = 8 * (i % kChunks);
        if (r < t.rows_here && c < t.cols_here)
          *reinterpret_cast<uint4*>(params.copy + (t.row0 + r) * params.ld_copy + t.col0 + c) =
              *reinterpret_cast<const uint4*>(staged.tile + r * fp8_tile::kPitch + c);
      }
    }
  };

  template <bool ReferenceSrc, class... Args>
  CUTLASS_DEVICE auto get_consumer_store_callbacks(cf::ConsumerStoreArgs<Args...> const& args) {
    static_assert(decltype(cute::size(args.tiled_mma))::value == fp8_tile::kThreads,
                  "Fp8TileStore needs the cooperative schedule's 256 epilogue threads");
    auto [M, N, K, L] = args.problem_shape_mnkl;
    auto [m, n, k, l] = args.tile_coord_mnkl;
    auto tCcCta = cta_coords<ReferenceSrc>(args);
    auto rows_cb = [&] {
      if constexpr (kRowsInRegisters) {
        return Fp8RowStore<CtaTile>::template callbacks<ReferenceSrc>(args, params.rows);
      } else {
        return NoRows{};
      }
    }();
    return ConsumerStoreCallbacks<decltype(tCcCta), decltype(args.residue_cD), decltype(rows_cb)>(
        tCcCta, args.residue_cD, fp8_tile::staged(smem), int64_t(m), int64_t(n), int64_t(M),
        Staging::output_cols(int64_t(N)), int(args.thread_idx), params, rows_cb);
  }
};

}  // namespace coda::kernel
