#pragma once
// NOTE: sm90_visitor_tma_warpspecialized.hpp uses NumericArrayConverter without including it.
#include <cutlass/numeric_conversion.h>

#include "coda/kernel/nodes/common.cuh"
#include "coda/kernel/nodes/global_access.cuh"
#include "coda/programs/rope.hpp"

namespace coda::kernel {

// ---------------------------------------------------------------------------------------------
// RopeCosSin<CtaTile>: a leaf that returns, for each column pair (2j, 2j+1) of the thread's
// fragment, the pair's RoPE (cos, sin) in elements (2j, 2j+1): (1, 0) on V columns, read from a
// cos / sin cache (programs::rope_cos_sin_cache) for rows whose position it holds, else computed
// from the fixed-point frequencies as F3 does (programs::rope_cos_sin). The consumer threads read
// them one subtile ahead, as LoadAhead does, so the loads overlap the previous subtile's math.
//
// Why: F3's whole excess over its GEMM was forming the angle and its sine and cosine, 6-7
// instructions per pair (run 98). Here a subtile whose rows are all cached and whose columns lie
// in one Q / K head costs one 8-byte load per pair at a compile-time offset from its row's entry.
// ---------------------------------------------------------------------------------------------
struct RopeCosSinArgs {
  const int32_t* pos = nullptr;       // (M)
  const uint32_t* freq_hi = nullptr;  // (N) programs::RopeFrequency, for rows not cached
  const uint32_t* freq_lo = nullptr;  // (N)
  const float2* cos_sin = nullptr;    // (positions, head_dim / 2)
  int32_t positions = 0;
  int32_t head_dim = 0;
  int32_t rotated = 0;  // columns [0, rotated) are Q / K heads; V after
};

template <class CtaTile, int kAhead = 2>
struct RopeCosSin : ConsumerOnlyNode<RopeCosSinArgs> {
  static constexpr int kAhead1 = kAhead + 1;  // register slots: the subtile and those ahead
  using Params = RopeCosSinArgs;
  using Arguments = Params;

  template <class ProblemShape>
  static bool can_implement(ProblemShape const& shape, Arguments const& a) {
    auto [M, N, K, L] = cute::append<4>(shape, 1);
    return a.pos && a.freq_hi && a.freq_lo && a.cos_sin && a.positions > 0 && a.head_dim > 0 &&
           a.head_dim % 2 == 0 && a.rotated >= 0 && a.rotated <= int(N) &&
           a.rotated % a.head_dim == 0;
  }

  CUTLASS_HOST_DEVICE RopeCosSin() {}
  CUTLASS_HOST_DEVICE RopeCosSin(Params const& p, SharedStorage const&) : params(p) {}
  Params params;

  template <class CTensor, class RTensor>
  struct ConsumerStoreCallbacks : cf::EmptyConsumerStoreCallbacks {
    CUTLASS_DEVICE ConsumerStoreCallbacks(CTensor c, RTensor r, Params const& p, int m_rows)
        : tC_c(c), tC_r(r), params(p), M(m_rows) {}
    CTensor tC_c;  // (CPY,CPY_M,CPY_N,EPI_M,EPI_N) absolute (m, n, l) of each element
    RTensor tC_r;  // (pairs, 2): two subtiles of (cos, sin)
    Params const& params;
    int M;

    static constexpr int kEpiM = decltype(cute::size<3>(std::declval<CTensor>()))::value;
    static constexpr int kEpiN = decltype(cute::size<4>(std::declval<CTensor>()))::value;
    static constexpr int kElems =
        decltype(cute::size(cute::take<0, 3>(cute::shape(std::declval<CTensor>()))))::value;

    // Any pair: V, cached, or computed.
    CUTLASS_DEVICE float2 one_pair(int n, int32_t p) const {
      if (n >= params.rotated) return make_float2(1.0f, 0.0f);
      if (static_cast<uint32_t>(p) < static_cast<uint32_t>(params.positions))
        return __ldg(params.cos_sin + (int64_t(p) * (params.head_dim / 2) +
                                       (n % params.head_dim) / 2));
      float c, s;
      programs::rope_cos_sin<float>(
          p, programs::RopeFrequency{__ldg(params.freq_hi + n), __ldg(params.freq_lo + n)}, c, s);
      return make_float2(c, s);
    }

    CUTLASS_DEVICE void load(int s) {
      if (s >= kEpiM * kEpiN) return;
      const int epi_m = s % kEpiM, epi_n = s / kEpiM;
      auto c = tC_c(cute::_, cute::_, cute::_, epi_m, epi_n);
      auto regs = tC_r(cute::_, s % kAhead1);
      const int n0 = int(cute::get<1>(c(0)));
      // The thread's columns in this subtile, relative to n0 (compile-time after unrolling).
      int dmin = 0, dmax = 0;
      CUTLASS_PRAGMA_UNROLL
      for (int e = 0; e < kElems; e += 2) {
        const int d = int(cute::get<1>(c(e))) - n0;
        dmin = min(dmin, d);
        dmax = max(dmax, d);
      }
      // Each distinct row's position is loaded once: rows repeat across the thread's pairs, and
      // the comparisons fold at compile time (the coordinates differ by constants).
      int32_t pos[kElems / 2];
      bool cached = true;
      CUTLASS_PRAGMA_UNROLL
      for (int e = 0; e < kElems; e += 2) {
        const int m = int(cute::get<0>(c(e)));
        bool seen = false;
        CUTLASS_PRAGMA_UNROLL
        for (int f = 0; f < e; f += 2) {
          if (!seen && int(cute::get<0>(c(f))) == m) {
            pos[e / 2] = pos[f / 2];
            seen = true;
          }
        }
        if (!seen) {
          pos[e / 2] = m < M ? __ldg(params.pos + m) : 0;
          cached = cached &&
                   static_cast<uint32_t>(pos[e / 2]) < static_cast<uint32_t>(params.positions);
        }
      }
      const int hd = params.head_dim;
      const int in_head = (hd & (hd - 1)) == 0 ? (n0 & (hd - 1)) : n0 % hd;
      // Every pair of the subtile is a V column (rotated by 0: the cache's position-0 entries,
      // cos 1 and sin 0), or every pair lies in one Q / K head on a cached row.
      const bool all_v = n0 + dmin >= params.rotated && dmax - dmin < hd;
      const bool one_head = n0 + dmax < params.rotated && in_head + dmin >= 0 &&
                            in_head + dmax < hd;
      // Entry (pos, in_head / 2 + d / 2): a compile-time offset d / 2 from the row's first entry
      // (positions * head_dim / 2 < 2^31: checked by the op). Two loops rather than a select per
      // pair, which the compiler would widen to 64-bit address arithmetic per pair.
      if (all_v) {
        const float2* first = params.cos_sin - dmin / 2;
        CUTLASS_PRAGMA_UNROLL
        for (int e = 0; e < kElems; e += 2)
          regs(e / 2) = __ldg(first + (int(cute::get<1>(c(e))) - n0) / 2);
      } else if (cached && one_head) {
        const int half = hd / 2;
        CUTLASS_PRAGMA_UNROLL
        for (int e = 0; e < kElems; e += 2) {
          const float2* first = params.cos_sin + (pos[e / 2] * half + in_head / 2);
          regs(e / 2) = __ldg(first + (int(cute::get<1>(c(e))) - n0) / 2);
        }
      } else {
        CUTLASS_PRAGMA_UNROLL
        for (int e = 0; e < kElems; e += 2)
          regs(e / 2) = one_pair(int(cute::get<1>(c(e))), pos[e / 2]);
      }
    }

    // Subtiles are visited epi_m fastest (the collective's loop order, fully unrolled): subtile
    // s + kAhead is loaded while subtile s is computed.
    CUTLASS_DEVICE void begin_loop(int epi_m, int epi_n) {
      const int s = epi_n * kEpiM + epi_m;
      if (s == 0) {
        CUTLASS_PRAGMA_UNROLL
        for (int i = 0; i < kAhead; ++i) load(i);
      }
      load(s + kAhead);
    }

    template <class ElementAccumulator, int F>
    CUTLASS_DEVICE cutlass::Array<float, F> visit(cutlass::Array<ElementAccumulator, F> const&,
                                                  int epi_v, int epi_m, int epi_n) {
      static_assert(F % 2 == 0, "fragments hold whole column pairs");
      auto regs = tC_r(cute::_, (epi_n * kEpiM + epi_m) % kAhead1);
      cutlass::Array<float, F> out;
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < F / 2; ++i) {
        const float2 cs = regs(epi_v * (F / 2) + i);
        out[2 * i] = cs.x;
        out[2 * i + 1] = cs.y;
      }
      return out;
    }
  };

  template <bool ReferenceSrc, class... Args>
  CUTLASS_DEVICE auto get_consumer_store_callbacks(cf::ConsumerStoreArgs<Args...> const& args) {
    using namespace cute;
    auto [M, N, K, L] = args.problem_shape_mnkl;
    auto shape_mnl = make_shape(M, N, L);
    Tensor tC_c = partition_coords<ReferenceSrc>(args, shape_mnl);
    constexpr int kPairs = decltype(size(take<0, 3>(shape(tC_c))))::value / 2;
    Tensor tC_r = make_tensor<float2>(make_shape(Int<kPairs>{}, Int<kAhead + 1>{}));
    return ConsumerStoreCallbacks<decltype(tC_c), decltype(tC_r)>(
        tC_c, tC_r, params, int(M));
  }
};

}  // namespace coda::kernel
