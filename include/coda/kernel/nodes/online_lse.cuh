#pragma once
// NOTE: sm90_visitor_tma_warpspecialized.hpp uses NumericArrayConverter without including it.
#include <cutlass/numeric_conversion.h>

#include "coda/epilogue/online_softmax.hpp"
#include "coda/kernel/nodes/common.cuh"

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

  CUTLASS_HOST_DEVICE OnlineLseReduction() {}
  CUTLASS_HOST_DEVICE OnlineLseReduction(Params const& p, SharedStorage const&) : params(p) {}
  Params params;

  template <class RowState, class CoordTensor, class Residue, class LaneLayout>
  struct ConsumerStoreCallbacks : cf::EmptyConsumerStoreCallbacks {
    CUTLASS_DEVICE ConsumerStoreCallbacks(RowState mx, RowState sm, CoordTensor c, Residue r,
                                          LaneLayout lanes, bool reduced_lane, int m, int n,
                                          int tile_n, int rows_padded, Params const& p)
        : rMax(mx),
          rSum(sm),
          tCcD(c),
          residue(r),
          lane_layout_MN(lanes),
          is_reduced_lane(reduced_lane),
          M(m),
          N(n),
          tile_n(tile_n),
          rows_padded(rows_padded),
          params(p) {}
    RowState rMax, rSum;  // (CPY,CPY_M,CPY_N,EPI_M,EPI_N), stride 0 along N: one slot per row
    CoordTensor tCcD;     // thread-relative coordinates
    Residue residue;      // (M, N) − thread's first element
    LaneLayout lane_layout_MN;
    bool is_reduced_lane;
    int M, N, tile_n, rows_padded;
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
        float& mx = rMax_mn(epi_v * F + i);
        float& sm = rSum_mn(epi_v * F + i);
        // One exp per element: the running sum is rescaled only when the max moves.
        if (x > mx) {
          sm = sm * epilogue::OnlineMaxSumExp<float>::scaled(mx, x) + 1.0f;
          mx = x;
        } else {
          sm += __expf(x - mx);
        }
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
      CUTLASS_PRAGMA_UNROLL
      for (int offset = cute::size<1>(lane_layout_MN) / 2; offset > 0; offset /= 2) {
        const int lane_delta = lane_layout_MN(_0{}, offset);
        CUTLASS_PRAGMA_UNROLL
        for (int i = 0; i < cute::size(fMax); ++i) {
          const float om = __shfl_down_sync(0xffffffff, fMax(i), lane_delta);
          const float os = __shfl_down_sync(0xffffffff, fSum(i), lane_delta);
          const auto merged = epilogue::OnlineMaxSumExp<float>::merge({fMax(i), fSum(i)}, {om, os});
          fMax(i) = merged.max;
          fSum(i) = merged.sum;
        }
      }
      if (!is_reduced_lane) return;
      // One store per (row, N-tile). Rows past M but inside the tile land in the padding.
      const int row0 = M - int(cute::get<0>(residue));
      float* pmax = params.max_partials + int64_t(tile_n) * rows_padded;
      float* psum = params.sum_partials + int64_t(tile_n) * rows_padded;
      CUTLASS_PRAGMA_UNROLL
      for (int epi_m = 0; epi_m < int(cute::size<3>(tCcD)); ++epi_m) {
        auto c_m = tCcD(cute::_, cute::_, cute::_, epi_m, _0{});
        auto mx_m = rMax(cute::_, cute::_, cute::_, epi_m, _0{});
        auto sm_m = rSum(cute::_, cute::_, cute::_, epi_m, _0{});
        CUTLASS_PRAGMA_UNROLL
        for (int i = 0; i < int(cute::size(c_m)); ++i) {
          const int row = row0 + int(cute::get<0>(c_m(i)));
          if (row < rows_padded) {
            pmax[row] = mx_m(i);
            psum[row] = sm_m(i);
          }
        }
      }
    }
  };

  template <bool ReferenceSrc, class... Args>
  CUTLASS_DEVICE auto get_consumer_store_callbacks(cf::ConsumerStoreArgs<Args...> const& args) {
    using namespace cute;
    // Lanes sharing a row: the same construction as CUTLASS's column reduction.
    Layout ref_layout_MN = [&]() {
      auto mn_shape = shape(typename decltype(args.tiled_copy)::Tiler_MN{});
      if constexpr (ReferenceSrc) {
        return right_inverse(args.tiled_copy.get_layoutS_TV()).with_shape(mn_shape);
      } else {
        return right_inverse(args.tiled_copy.get_layoutD_TV()).with_shape(mn_shape);
      }
    }();
    using W = Int<decltype(args.tiled_copy)::TiledNumThr::value / cutlass::NumThreadsPerWarp>;
    Layout tv2lane = Layout<Shape<Int<cutlass::NumThreadsPerWarp>, W, _1>, Stride<_1, _0, _0>>{};
    Layout ref2lane = composition(tv2lane, ref_layout_MN);
    Layout lane_layout_MN = make_layout(filter(get<0>(ref2lane)), filter(get<1>(ref2lane)));
    Layout inv_lane_layout_MN = right_inverse(lane_layout_MN);
    auto lane_mn =
        idx2crd(inv_lane_layout_MN(cutlass::canonical_lane_idx()), shape(lane_layout_MN));
    Layout tv2warp = Layout<Shape<Int<cutlass::NumThreadsPerWarp>, W, _1>, Stride<_0, _1, _0>>{};
    Layout ref2warp = composition(tv2warp, ref_layout_MN);
    Layout warp_layout_MN = make_layout(filter(get<0>(ref2warp)), filter(get<1>(ref2warp)));
    static_assert(decltype(size<1>(warp_layout_MN))::value == 1,
                  "OnlineLseReduction assumes one warp across N per row (true for sm90 wgmma)");

    auto [M, N, K, L] = args.problem_shape_mnkl;
    auto [m, n, k, l] = args.tile_coord_mnkl;
    // Register state with one slot per row: partition a (CTA_M, CTA_N) layout with stride 0 along
    // N exactly as the coordinates are partitioned, then allocate registers like it.
    Tensor row_view = make_tensor(make_gmem_ptr(static_cast<float*>(nullptr)),
                                  make_layout(take<0, 2>(CtaTile{}), make_stride(_1{}, _0{})));
    Tensor tCrow = cf::detail::sm90_partition_for_epilogue<ReferenceSrc>(
        row_view, args.epi_tile, args.tiled_copy,
        args.thread_idx);  // (CPY,CPY_M,CPY_N,EPI_M,EPI_N)
    Tensor rMax = make_tensor_like<float>(tCrow);
    Tensor rSum = make_tensor_like<float>(tCrow);
    fill(rMax, -INFINITY);
    fill(rSum, 0.0f);
    const int cta_m = int(size<0>(CtaTile{}));
    const int rows_padded = int((M + cta_m - 1) / cta_m) * cta_m;
    return ConsumerStoreCallbacks<decltype(rMax), decltype(args.tCcD), decltype(args.residue_tCcD),
                                  decltype(lane_layout_MN)>(
        rMax, rSum, args.tCcD, args.residue_tCcD, lane_layout_MN, get<1>(lane_mn) == 0, int(M),
        int(N), int(n), rows_padded, params);
  }
};

}  // namespace coda::kernel
