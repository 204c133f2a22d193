#pragma once
// NOTE: sm90_visitor_tma_warpspecialized.hpp uses NumericArrayConverter without including it.
#include <cutlass/numeric_conversion.h>

#include "coda/kernel/args.hpp"
#include "coda/kernel/nodes/common.cuh"
#include "coda/kernel/nodes/fp8_tile_store.cuh"
#include "coda/kernel/nodes/global_access.cuh"
#include "coda/kernel/nodes/row_partials.cuh"
#include "coda/programs/formulas.hpp"

namespace coda::kernel {

// ---------------------------------------------------------------------------------------------
// RmsnormBackwardNode<CtaTile, HStore>: the B1 epilogue in one node. The accumulator is g = dz · W;
// the children give dres (C), r (per row), γ (per column), ZdZ (per row) and x (an Sm90AuxLoad,
// TMA from the epilogue's producer warp, on pingpong; LoadAhead on cooperative tiles:
// fusions/rmsnorm_backward.cuh). Per element:
//   dx = dres + r·(g·γ − x·r·ZdZ)   returned (D; may alias C)
//   h  = x·r·γ                      -> bf16 (M, N)
//   dγ partial[n, m-tile] += g·x·r  one register per column over the tile
// h leaves through HStore, a stock bf16 Sm90AuxStore held in this node (its own swizzled ring,
// TMA stores in step with D's), or, with HStore = void, from registers: a 32-bit store per
// column pair (fragment elements (2j, 2j+1) are adjacent columns, N % 8 == 0, so a pair is
// wholly inside or outside), or, with HStore = Fp8TileStore<CtaTile>, quantized (FP8 B1: the
// weight gradient's 128x1 copy of h; its arguments ride beside B1's, and it finishes at the
// tile's end). dγ is merged across the lanes sharing a column (shuffles), then across the warps
// through the collective's store buffer (fixed order, so the result is deterministic), and
// written once per (column, M-tile) as PartialLayout::per_column. Replaces a topological visitor
// whose fp32 fragments lived in a 1040-byte stack frame and whose stock column reduction had
// 205-way shared-memory bank conflicts (docs/experiments.md).
// ---------------------------------------------------------------------------------------------
template <class CtaTile, class HStore = void>
struct RmsnormBackwardNode : NoWorkspaceNoProducerLoads {
  static constexpr int kCtaM = cute::size<0>(CtaTile{});
  static constexpr int kCtaN = cute::size<1>(CtaTile{});
  static constexpr bool kHQuantized = std::is_same_v<HStore, Fp8TileStore<CtaTile>>;
  static constexpr bool kHStored = !kHQuantized;  // bf16 h_out, from registers or by TMA
  static constexpr bool kHByTma = kHStored && !std::is_void_v<HStore>;
  static constexpr bool kHHeld = kHByTma || kHQuantized;  // h leaves through h_store
  using HStoreOrNone = std::conditional_t<kHHeld, HStore, NoAuxStore>;
  struct SharedStorage {
    typename HStoreOrNone::SharedStorage h;
  };
  struct QuantizedHArguments {
    RmsnormBackwardArgs b1;
    Fp8TileStoreArguments h;
  };
  using Arguments = std::conditional_t<kHQuantized, QuantizedHArguments, RmsnormBackwardArgs>;
  struct Params {
    RmsnormBackwardArgs args;
    typename HStoreOrNone::Params h;
  };
  static RmsnormBackwardArgs const& b1_of(Arguments const& a) {
    if constexpr (kHQuantized) {
      return a.b1;
    } else {
      return a;
    }
  }

  template <class ProblemShape>
  static Params to_underlying_arguments(ProblemShape const& shape, Arguments const& a,
                                        void* workspace) {
    if constexpr (kHQuantized) {
      return {a.b1, HStore::to_underlying_arguments(shape, a.h, workspace)};
    } else if constexpr (kHByTma) {
      return {a, held_store_params<HStore>(shape, a.h_out, a.ldh, workspace)};
    } else {
      return {a, {}};
    }
  }
  template <class ProblemShape>
  static bool can_implement(ProblemShape const& shape, Arguments const& args) {
    auto [M, N, K, L] = cute::append<4>(shape, 1);
    RmsnormBackwardArgs const& a = b1_of(args);
    bool ok = true;
    if constexpr (kHQuantized) ok = HStore::can_implement(shape, args.h);
    // x is read by TMA: 16-byte aligned rows; so is h when it leaves by TMA.
    return ok && a.x && (a.h_out != nullptr) == kHStored && a.dgamma_partials && N % 2 == 0 &&
           a.ldx % 8 == 0 && (!kHStored || a.ldh % (kHByTma ? 8 : 2) == 0);
  }
  CUTLASS_HOST_DEVICE RmsnormBackwardNode() {}
  // h_store keeps a pointer to its Params: it gets the kernel's (p.h), not this node's copy.
  CUTLASS_HOST_DEVICE RmsnormBackwardNode(Params const& p, SharedStorage const& s)
      : params(p.args), h_store(p.h, s.h) {}
  RmsnormBackwardArgs params;
  HStoreOrNone h_store;

  template <int kThreads, class HCallbacks, class GTensor, class CTensor, class ColState,
            class CtaCoords, class ShapeMNL, class Lanes>
  struct ConsumerStoreCallbacks : cf::EmptyConsumerStoreCallbacks {
    CUTLASS_DEVICE ConsumerStoreCallbacks(HCallbacks&& hcb, GTensor gh, CTensor c, ColState dg,
                                          CtaCoords cta, ShapeMNL shape, Lanes lanes, int tile_m,
                                          int tile_n, int thread_idx, RmsnormBackwardArgs const& p)
        : h_cb(cute::forward<HCallbacks>(hcb)),
          tC_gH(gh),
          tC_c(c),
          rDgamma(dg),
          tC_cta(cta),
          shape_mnl(shape),
          lanes(lanes),
          tile_m(tile_m),
          tile_n(tile_n),
          full_tile(tile_inside<CtaTile>(tile_m, tile_n, int(cute::get<0>(shape)),
                                         int(cute::get<1>(shape)))),
          thread_idx(thread_idx),
          params(p) {}
    HCallbacks h_cb;   // the held store's callbacks (TMA aux store or quantizing), if any
    GTensor tC_gH;     // (CPY,CPY_M,CPY_N,EPI_M,EPI_N) global h of this tile (bf16)
    CTensor tC_c;      // its absolute (m, n, l) coordinates
    ColState rDgamma;  // one slot per column (stride 0 along M)
    CtaCoords tC_cta;  // CTA-relative (m, n) of every element
    ShapeMNL shape_mnl;
    Lanes lanes;
    int tile_m, tile_n;
    bool full_tile;  // the tile lies wholly inside (M, N): no per-pair bounds checks
    int thread_idx;
    RmsnormBackwardArgs const& params;

    static constexpr int kEpiN = decltype(cute::size<4>(std::declval<GTensor>()))::value;

    template <class ElementAccumulator, class ElementC, class ElementR, class ElementG,
              class ElementZ, class ElementX, int F>
    CUTLASS_DEVICE cutlass::Array<float, F> visit(cutlass::Array<ElementAccumulator, F> const& acc,
                                                  int epi_v, int epi_m, int epi_n,
                                                  cutlass::Array<ElementC, F> const& dres,
                                                  cutlass::Array<ElementR, F> const& r,
                                                  cutlass::Array<ElementG, F> const& gamma,
                                                  cutlass::Array<ElementZ, F> const& zdz,
                                                  cutlass::Array<ElementX, F> const& x) {
      static_assert(F % 2 == 0, "fragments hold whole column pairs");
      auto g_h = tC_gH(cute::_, cute::_, cute::_, epi_m, epi_n);
      auto c = tC_c(cute::_, cute::_, cute::_, epi_m, epi_n);
      auto dg_mn = rDgamma(cute::_, cute::_, cute::_, epi_m, epi_n);
      cutlass::Array<float, F> dx;
      [[maybe_unused]] cutlass::Array<float, F> h_frg;  // h for HStore
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < F; i += 2) {
        const int e = epi_v * F + i;
        float h[2];
        CUTLASS_PRAGMA_UNROLL
        for (int j = 0; j < 2; ++j) {
          const float g = float(acc[i + j]), rr = float(r[i + j]), ga = float(gamma[i + j]);
          const float xs = float(x[i + j]);
          dx[i + j] =
              programs::RmsnormBackwardDx{}(g, float(dres[i + j]), xs, rr, ga, float(zdz[i + j]));
          h[j] = programs::NormalizedScaled{}(xs, rr, ga);
          dg_mn(e + j) += programs::GradTimesNormalized{}(g, xs, rr);
        }
        if constexpr (kHHeld) {
          h_frg[i] = h[0];
          h_frg[i + 1] = h[1];
        } else if (kHStored && (full_tile || cute::elem_less(c(e), shape_mnl))) {
          *reinterpret_cast<uint32_t*>(&g_h(e)) = pack_bf16_pair(h[0], h[1]);
        }
      }
      if constexpr (kHHeld) h_cb.visit(acc, epi_v, epi_m, epi_n, h_frg);
      return dx;
    }

    CUTLASS_DEVICE void postreduce(int epi_m, int epi_n, int store_iteration,
                                   bool issue_smem_store) {
      if constexpr (kHByTma) h_cb.postreduce(epi_m, epi_n, store_iteration, issue_smem_store);
    }
    CUTLASS_DEVICE void tma_store(int epi_m, int epi_n, int store_iteration, bool issue_tma_store) {
      if constexpr (kHByTma) h_cb.tma_store(epi_m, epi_n, store_iteration, issue_tma_store);
    }
    // The quantized h: staged by every subtile's visit, quantized once the tile is whole.
    CUTLASS_DEVICE void end() {
      if constexpr (kHQuantized) h_cb.end();
    }

    template <class STensor, class SyncFn, class VTensor>
    CUTLASS_DEVICE void reduce(STensor&& smem_buffer, SyncFn const& sync_fn, int, int,
                               bool is_last_iteration, VTensor) {
      if (!is_last_iteration) return;
      // 1. The lanes holding the same columns (different rows) merge into the column lane.
      auto f = cute::filter(rDgamma);
      lanes.for_each_column_merge_step([&](int lane_delta) {
        CUTLASS_PRAGMA_UNROLL
        for (int i = 0; i < cute::size(f); ++i)
          f(i) += __shfl_down_sync(0xffffffff, f(i), lane_delta);
      });
      // 2. The warps (each holds different rows of every column: 4 per warpgroup, 8 when two
      // cooperative warpgroups share the tile), through the store buffer, in a fixed order.
      constexpr int kWarps = kThreads / 32;
      static_assert(kCtaN * kWarps * sizeof(float) <=
                        decltype(cute::cosize(smem_buffer.layout()))::value *
                            sizeof(typename cute::remove_cvref_t<STensor>::value_type),
                    "dγ reduction needs (warps x tile N) floats of the store buffer");
      float* sbuf = reinterpret_cast<float*>(cute::raw_pointer_cast(smem_buffer.data()));
      const int warp = thread_idx / 32;
      sync_fn();
      if (lanes.column_lane) {
        // The state has stride 0 along M: the subtiles of one epi_n (and the slots of one
        // column within a subtile) hold one value; epi_m = 0 covers every column.
        CUTLASS_PRAGMA_UNROLL
        for (int epi_n = 0; epi_n < kEpiN; ++epi_n) {
          auto dg_n = rDgamma(cute::_, cute::_, cute::_, _0{}, epi_n);
          auto cta_n = tC_cta(cute::_, cute::_, cute::_, _0{}, epi_n);
          CUTLASS_PRAGMA_UNROLL
          for (int i = 0; i < int(cute::size(dg_n)); ++i)
            sbuf[warp * kCtaN + int(cute::get<1>(cta_n(i)))] = dg_n(i);
        }
      }
      sync_fn();
      const bool cta_in_bounds = tile_m * kCtaM < int(cute::get<0>(shape_mnl)) &&
                                 tile_n * kCtaN < int(cute::get<1>(shape_mnl));
      if (cta_in_bounds) {
        const int64_t cols_padded = (int64_t(cute::get<1>(shape_mnl)) + kCtaN - 1) / kCtaN * kCtaN;
        for (int col = thread_idx; col < kCtaN; col += kWarps * 32) {
          float sum = 0.0f;
          CUTLASS_PRAGMA_UNROLL
          for (int w = 0; w < kWarps; ++w) sum += sbuf[w * kCtaN + col];
          params.dgamma_partials[int64_t(tile_n) * kCtaN + col + cols_padded * tile_m] = sum;
        }
      }
      sync_fn();
    }
  };

  template <bool ReferenceSrc, class... Args>
  CUTLASS_DEVICE auto get_consumer_store_callbacks(cf::ConsumerStoreArgs<Args...> const& args) {
    using namespace cute;
    constexpr int kThreads = decltype(size(args.tiled_copy))::value;
    static_assert(kThreads == 128 || kThreads == 256,
                  "RmsnormBackwardNode: one warpgroup (pingpong) or two (cooperative) per tile");
    auto [M, N, K, L] = args.problem_shape_mnkl;
    auto [m, n, k, l] = args.tile_coord_mnkl;
    auto shape_mnl = make_shape(M, N, L);
    using bf16 = cutlass::bfloat16_t;
    Tensor tC_gH = partition_tile<ReferenceSrc>(args, shape_mnl,
                                                reinterpret_cast<bf16*>(params.h_out), params.ldh);
    Tensor tC_c = partition_coords<ReferenceSrc>(args, shape_mnl);
    auto rDgamma = make_column_state<ReferenceSrc, CtaTile>(args, 0.0f);
    auto tC_cta = cta_coords<ReferenceSrc>(args);
    auto lanes = warp_lanes<ReferenceSrc>(args);
    auto h_cb = [&] {
      if constexpr (kHHeld) {
        return h_store.template get_consumer_store_callbacks<ReferenceSrc>(args);
      } else {
        return cf::EmptyConsumerStoreCallbacks{};
      }
    }();
    return ConsumerStoreCallbacks<kThreads, decltype(h_cb), decltype(tC_gH), decltype(tC_c),
                                  decltype(rDgamma), decltype(tC_cta), decltype(shape_mnl),
                                  decltype(lanes)>(cute::move(h_cb), tC_gH, tC_c, rDgamma, tC_cta,
                                                   shape_mnl, lanes, int(m), int(n),
                                                   args.thread_idx, params);
  }
};

}  // namespace coda::kernel
