#pragma once
// NOTE: sm90_visitor_tma_warpspecialized.hpp uses NumericArrayConverter without including it.
#include <cutlass/numeric_conversion.h>

#include "coda/epilogue/online_softmax.hpp"
#include "coda/kernel/nodes/common.cuh"
#include "coda/kernel/nodes/row_partials.cuh"

namespace coda::kernel {

// ---------------------------------------------------------------------------------------------
// OnlineLseReduction<CtaTile, Target>: child inputs (logits float, targets Target). Keeps per-row
// online (max, sum-exp) state in registers over the whole tile (subtiles are visited N-outer,
// M-inner, so a row's state lives until the last subtile), merges it across the lanes holding the
// same row, and writes one partial per (row, N-tile) into max/sum buffers laid out as
// PartialLayout::per_row (row fastest, rows padded to the tile). Columns past N never enter the
// state. The element whose global column equals targets[row] is written to target_logit[row].
// Returns the logits unchanged (so D can hold them when materialized).
//
// Coordinates come from the collective's (args.tCcD, args.residue_tCcD) pair, the one CUTLASS's
// own reductions use: tCcD is relative to the thread's first element and residue_tCcD is
// (M, N) minus that element, so an element's absolute coordinate is (M, N) − residue + tCcD.
// ---------------------------------------------------------------------------------------------
struct OnlineLseArguments {
  float* max_partials = nullptr;
  float* sum_partials = nullptr;
  float* target_logit = nullptr;  // (M)
};

template <class CtaTile, class Target>
struct OnlineLseReduction : ConsumerOnlyNode<OnlineLseArguments> {
  using Params = OnlineLseArguments;
  using Arguments = Params;
  using ElementAux = cutlass::bfloat16_t;  // what D would hold; lets the collective run with no D
  template <class ProblemShape>
  static bool can_implement(ProblemShape const&, Arguments const& a) {
    return a.max_partials && a.sum_partials && a.target_logit;
  }

  using ConsumerOnlyNode<OnlineLseArguments>::ConsumerOnlyNode;

  template <class RowState, class CoordTensor, class Residue, class Lanes>
  struct ConsumerStoreCallbacks : cf::EmptyConsumerStoreCallbacks {
    CUTLASS_DEVICE ConsumerStoreCallbacks(RowState mx, RowState sm, CoordTensor c, Residue r,
                                          Lanes lanes, int m, int n, int tile_n, Params const& p)
        : rMax(mx), rSum(sm), tCcD(c), residue(r), lanes(lanes), M(m), N(n), tile_n(tile_n),
          params(p) {}
    RowState rMax, rSum;  // (CPY,CPY_M,CPY_N,EPI_M,EPI_N), stride 0 along N: one slot per row
    CoordTensor tCcD;     // thread-relative coordinates
    Residue residue;      // (M, N) − thread's first element
    Lanes lanes;
    int M, N, tile_n;
    Params const& params;

    template <class ElementAccumulator, class ElementLogit, int F>
    CUTLASS_DEVICE cutlass::Array<ElementLogit, F> visit(
        cutlass::Array<ElementAccumulator, F> const&, int epi_v, int epi_m, int epi_n,
        cutlass::Array<ElementLogit, F> const& logits, cutlass::Array<Target, F> const& targets) {
      auto rMax_mn = rMax(cute::_, cute::_, cute::_, epi_m, epi_n);
      auto rSum_mn = rSum(cute::_, cute::_, cute::_, epi_m, epi_n);
      auto cD_mn = tCcD(cute::_, cute::_, cute::_, epi_m, epi_n);
      const int col0 =
          N - int(cute::get<1>(residue));  // absolute column of the thread's first element
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < F; ++i) {
        const auto c = cD_mn(epi_v * F + i);
        if (!cute::elem_less(c, residue)) continue;
        const float x = static_cast<float>(logits[i]);
        epilogue::OnlineMaxSumExp<float>::add(rMax_mn(epi_v * F + i), rSum_mn(epi_v * F + i), x);
        // Targets are vocabulary indices (< 2^31) or ignore_index: a 32-bit compare suffices.
        if (static_cast<int>(targets[i]) == col0 + int(cute::get<1>(c))) {
          params.target_logit[M - int(cute::get<0>(residue)) + int(cute::get<0>(c))] = x;
        }
      }
      return logits;
    }

    template <class STensor, class SyncFn, class VTensor>
    CUTLASS_DEVICE void reduce(STensor&&, SyncFn const&, int, int, bool is_last_iteration,
                               VTensor) {
      if (!is_last_iteration) return;
      // Merge across the lanes that hold the same rows (a row's columns within a warp).
      auto fMax = cute::filter(rMax);
      auto fSum = cute::filter(rSum);
      lanes.for_each_row_merge_step([&](int lane_delta) {
        CUTLASS_PRAGMA_UNROLL
        for (int i = 0; i < cute::size(fMax); ++i) {
          const float om = __shfl_down_sync(0xffffffff, fMax(i), lane_delta);
          const float os = __shfl_down_sync(0xffffffff, fSum(i), lane_delta);
          const auto merged = epilogue::OnlineMaxSumExp<float>::merge({fMax(i), fSum(i)}, {om, os});
          fMax(i) = merged.max;
          fSum(i) = merged.sum;
        }
      });
      if (!lanes.row_lane) return;
      const auto target = row_partials_target<CtaTile>(M, N, residue, tile_n);
      for_each_row_slot(tCcD, target, [&](int64_t idx, int i, int epi_m) {
        params.max_partials[idx] = rMax(cute::_, cute::_, cute::_, epi_m, _0{})(i);
        params.sum_partials[idx] = rSum(cute::_, cute::_, cute::_, epi_m, _0{})(i);
      });
    }
  };

  template <bool ReferenceSrc, class... Args>
  CUTLASS_DEVICE auto get_consumer_store_callbacks(cf::ConsumerStoreArgs<Args...> const& args) {
    auto [M, N, K, L] = args.problem_shape_mnkl;
    auto [m, n, k, l] = args.tile_coord_mnkl;
    auto lanes = warp_lanes<ReferenceSrc>(args);
    auto rMax = make_row_state<ReferenceSrc, CtaTile>(args, -INFINITY);
    auto rSum = make_row_state<ReferenceSrc, CtaTile>(args, 0.0f);
    return ConsumerStoreCallbacks<decltype(rMax), decltype(args.tCcD), decltype(args.residue_tCcD),
                                  decltype(lanes)>(rMax, rSum, args.tCcD, args.residue_tCcD, lanes,
                                                   int(M), int(N), int(n), params);
  }
};

}  // namespace coda::kernel
