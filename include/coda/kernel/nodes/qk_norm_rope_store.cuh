#pragma once
// NOTE: sm90_visitor_tma_warpspecialized.hpp uses NumericArrayConverter without including it.
#include <cutlass/arch/barrier.h>
#include <cutlass/numeric_conversion.h>

#include "coda/kernel/args.hpp"
#include "coda/kernel/nodes/common.cuh"
#include "coda/programs/formulas.hpp"
#include "coda/programs/rope.hpp"

namespace coda::kernel {

// ---------------------------------------------------------------------------------------------
// QkNormRopeStore<CtaTile>: the root of F3 with QK-norm (docs/math.md F3q). Its inputs are the
// accumulator and r; visit stages u = r[m] · acc, in fp32, over the whole 128x128 CTA tile in
// shared memory. After the tile's last subtile (end) the cooperative epilogue's 256 threads
// finish it: each warp takes 16 rows, each lane 4 adjacent columns of a row (two RoPE pairs), so
// a head of d columns is d / 4 adjacent lanes and its Σu² one shuffle tree. Q and K heads get
//   s = rsqrt(Σu² / d + eps),  qkv = rope(γ ⊙ (u · s), pos[m], freq[n]),  qk_pre = u;
// V heads qkv = u. The node writes qkv and qk_pre itself (the program has no D) with 8-byte
// stores, a warp's row contiguous. Elements past M or N are neither read nor written.
//
// head_dim divides the tile's 128 columns (8, 16, 32, 64 or 128), so every head lies in one
// tile and in one aligned group of lanes; the op layer checks it.
// ---------------------------------------------------------------------------------------------
template <class CtaTile>
struct QkNormRopeStore : NoWorkspaceNoProducerLoads {
  static constexpr int kTileM = cute::size<0>(CtaTile{});
  static constexpr int kTileN = cute::size<1>(CtaTile{});
  static_assert(kTileM == 128 && kTileN == 128, "QkNormRopeStore normalizes 128x128 tiles");
  static constexpr int kThreads = 256;  // the cooperative epilogue's two warpgroups
  static constexpr int kRowsPerWarp = kTileM / (kThreads / 32);
  // A staged row: 128 floats and 8 more, so that the 64-bit stores of visit (a quad's 8 columns
  // on each of 4 rows per half-warp phase) fall in distinct banks.
  static constexpr int kPitch = kTileN + 8;
  // The collective builder asks a destination-less tree for an element type (its aux output).
  using ElementAux = cutlass::bfloat16_t;

  struct SharedStorage {
    alignas(16) cute::array_aligned<float, kTileM * kPitch> tile;
  };
  using Arguments = RmsnormQkNormRopeArgs;
  using Params = Arguments;

  template <class ProblemShape>
  static constexpr Params to_underlying_arguments(ProblemShape const&, Arguments const& a, void*) {
    return a;
  }
  template <class ProblemShape>
  static bool can_implement(ProblemShape const&, Arguments const& a) {
    // The finish moves 4 bf16 (8 bytes) per lane: rows and head-norm weights 8-byte aligned.
    const auto aligned8 = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 8 == 0; };
    const int d = a.head_dim;
    return a.qkv && a.qk_pre && a.q_gamma && a.k_gamma && a.pos && a.freq_hi && a.freq_lo &&
           d >= 8 && kTileN % d == 0 && a.q_width % d == 0 && a.normed_width % d == 0 &&
           0 < a.q_width && a.q_width < a.normed_width && a.ld_qkv % 4 == 0 &&
           a.ld_qk_pre % 4 == 0 && a.ld_qk_pre >= a.normed_width && aligned8(a.qkv) &&
           aligned8(a.qk_pre) && aligned8(a.q_gamma) && aligned8(a.k_gamma);
  }
  CUTLASS_HOST_DEVICE QkNormRopeStore() {}
  CUTLASS_HOST_DEVICE QkNormRopeStore(Params const& p, SharedStorage const& s)
      : params(p), smem(const_cast<float*>(s.tile.data())) {}
  Params params;
  float* smem = nullptr;

  template <class CoordTensor, class Residue>
  struct ConsumerStoreCallbacks : cf::EmptyConsumerStoreCallbacks {
    CUTLASS_DEVICE ConsumerStoreCallbacks(CoordTensor c, Residue r, float* tile, int64_t row0,
                                          int64_t col0, int rows_here, int cols_here, int thread,
                                          Params const& p)
        : tCcD(c),
          residue(r),
          tile(tile),
          row0(row0),
          col0(col0),
          rows_here(rows_here),
          cols_here(cols_here),
          thread(thread),
          params(p) {}
    CoordTensor tCcD;  // (CPY,CPY_M,CPY_N,EPI_M,EPI_N) CTA-relative (m, n) of each element
    Residue residue;   // the CTA-relative extent of the problem
    float* tile;
    int64_t row0, col0;  // the tile's first element in the problem
    int rows_here, cols_here;
    int thread;
    Params const& params;

    template <class ElementAccumulator, int F>
    CUTLASS_DEVICE cutlass::Array<float, F> visit(cutlass::Array<ElementAccumulator, F> const&,
                                                  int epi_v, int epi_m, int epi_n,
                                                  cutlass::Array<float, F> const& acc,
                                                  cutlass::Array<float, F> const& r) {
      static_assert(F % 2 == 0, "the staging stores column pairs");
      auto coords = tCcD(cute::_, cute::_, cute::_, epi_m, epi_n);
      cutlass::Array<float, F> u;
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < F; i += 2) {
        // Elements i and i + 1 are columns n and n + 1 of one row (the accumulator's pairs,
        // tests/gpu/gemm_programs_test.cpp's PairLayoutProbe; N is even, so both are in or out).
        const auto c = coords(epi_v * F + i);
        const bool in = cute::elem_less(c, residue);
        u[i] = in ? acc[i] * r[i] : 0.0f;
        u[i + 1] = in ? acc[i + 1] * r[i] : 0.0f;
        *reinterpret_cast<float2*>(&tile[int(cute::get<0>(c)) * kPitch + int(cute::get<1>(c))]) =
            make_float2(u[i], u[i + 1]);
      }
      return u;
    }

    CUTLASS_DEVICE void end() {
      auto sync = [] {
        cutlass::arch::NamedBarrier::sync(kThreads,
                                          cutlass::arch::ReservedNamedBarriers::EpilogueBarrier);
      };
      sync();  // every subtile staged
      // A CTA wholly past N (clusters along N round the grid up) has nothing to write.
      if (rows_here > 0 && cols_here > 0) finish();
      sync();  // the next tile stages over this one only after every read
    }

   private:
    CUTLASS_DEVICE void finish() const {
      const Params& p = params;
      const int warp = thread / 32, lane = thread % 32, col = 4 * lane, d = p.head_dim;
      const int64_t n = col0 + col;
      const bool in_n = col < cols_here;
      const int kind = n < p.q_width ? 0 : n < p.normed_width ? 1 : 2;  // Q, K, V
      // This lane's head-norm weights and the frequencies of its two pairs (the pair's second
      // column has the first's frequency).
      float g[4] = {1.f, 1.f, 1.f, 1.f};
      programs::RopeFrequency f[2] = {};
      if (in_n && kind < 2) {
        const bf16* gamma = (kind == 0 ? p.q_gamma : p.k_gamma) + n % d;
        const uint2 w = *reinterpret_cast<const uint2*>(gamma);  // 4 bf16, 8-byte aligned
        const float2 g01 = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&w.x));
        const float2 g23 = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&w.y));
        g[0] = g01.x, g[1] = g01.y, g[2] = g23.x, g[3] = g23.y;
        f[0] = {p.freq_hi[n], p.freq_lo[n]};
        f[1] = {p.freq_hi[n + 2], p.freq_lo[n + 2]};
      }
      const float inv_d = 1.0f / float(d);
      const int group = d / 4;  // the lanes of one head: a power of two, 2..32
      for (int i = 0; i < kRowsPerWarp; ++i) {
        const int row = warp * kRowsPerWarp + i;
        if (row >= rows_here) break;  // the same for the whole warp
        const float4 u = *reinterpret_cast<const float4*>(&tile[row * kPitch + col]);
        float ss = u.x * u.x + u.y * u.y + u.z * u.z + u.w * u.w;
        for (int o = group / 2; o > 0; o /= 2) ss += __shfl_xor_sync(0xffffffffu, ss, o);
        if (!in_n) continue;
        const int64_t m = row0 + row;
        auto* out = reinterpret_cast<uint2*>(p.qkv + m * p.ld_qkv + n);
        if (kind == 2) {
          *out = pack(u.x, u.y, u.z, u.w);
          continue;
        }
        const float s = programs::Rstd{}(ss, inv_d, p.eps);
        const int32_t pm = p.pos[m];
        float c0, s0, c1, s1, y[4];
        programs::rope_cos_sin<float>(pm, f[0], c0, s0);
        programs::rope_cos_sin<float>(pm, f[1], c1, s1);
        epilogue::RopeRotate{}(g[0] * (u.x * s), g[1] * (u.y * s), c0, s0, y[0], y[1]);
        epilogue::RopeRotate{}(g[2] * (u.z * s), g[3] * (u.w * s), c1, s1, y[2], y[3]);
        *out = pack(y[0], y[1], y[2], y[3]);
        *reinterpret_cast<uint2*>(p.qk_pre + m * p.ld_qk_pre + n) = pack(u.x, u.y, u.z, u.w);
      }
    }
    static CUTLASS_DEVICE uint2 pack(float a, float b, float c, float d) {
      const __nv_bfloat162 lo = __floats2bfloat162_rn(a, b), hi = __floats2bfloat162_rn(c, d);
      return make_uint2(*reinterpret_cast<const uint32_t*>(&lo),
                        *reinterpret_cast<const uint32_t*>(&hi));
    }
  };

  template <bool ReferenceSrc, class... Args>
  CUTLASS_DEVICE auto get_consumer_store_callbacks(cf::ConsumerStoreArgs<Args...> const& args) {
    static_assert(decltype(cute::size(args.tiled_mma))::value == kThreads,
                  "QkNormRopeStore needs the cooperative schedule's 256 epilogue threads");
    auto [M, N, K, L] = args.problem_shape_mnkl;
    auto [m, n, k, l] = args.tile_coord_mnkl;
    auto tCcCta = cta_coords<ReferenceSrc>(args);
    const int64_t row0 = int64_t(m) * kTileM, col0 = int64_t(n) * kTileN;
    const int64_t rows = int64_t(M) - row0, cols = int64_t(N) - col0;
    const int rows_here = int(rows < kTileM ? rows : kTileM);
    const int cols_here = int(cols < kTileN ? cols : kTileN);
    return ConsumerStoreCallbacks<decltype(tCcCta), decltype(args.residue_cD)>(
        tCcCta, args.residue_cD, smem, row0, col0, rows_here, cols_here, int(args.thread_idx),
        params);
  }
};

}  // namespace coda::kernel
