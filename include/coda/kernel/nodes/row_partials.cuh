#pragma once
// Per-row (or per-column) state kept in registers over a whole CTA tile by the nodes that reduce
// along N (OnlineLseReduction, SwigluBackwardNode) or along M (RmsnormBackwardNode's dγ), and the
// pieces around it: which lanes of a warp share a row or a column, the merges across them, and
// the one store per (row, N-tile) into a PartialLayout::per_row buffer (row fastest, rows padded to
// the tile, one column of partials per N-tile).

#include <cute/tensor.hpp>
#include <cutlass/epilogue/fusion/sm90_visitor_tma_warpspecialized.hpp>

#include "coda/kernel/nodes/common.cuh"

namespace coda::kernel {

// How a warp's lanes lay over the epilogue tile, as CUTLASS's column reduction derives it from the
// tiled copy: lanes along N share rows, lanes along M share columns. `row_lane` is the lane left
// holding a row's value after the merge along N, `column_lane` the one holding a column's value
// after the merge along M.
template <class LaneLayout>
struct WarpLanes {
  LaneLayout lane_layout_MN;  // (lanes along M, lanes along N) -> lane index
  bool row_lane, column_lane;

  // Calls merge(lane_delta) for each shfl_down step that folds the lanes along N (the lanes
  // sharing a row) into the row lane.
  template <class Merge>
  CUTLASS_DEVICE void for_each_row_merge_step(Merge&& merge) const {
    CUTLASS_PRAGMA_UNROLL
    for (int offset = cute::size<1>(lane_layout_MN) / 2; offset > 0; offset /= 2) {
      merge(lane_layout_MN(_0{}, offset));
    }
  }
  // The same along M (the lanes sharing a column), into the column lane.
  template <class Merge>
  CUTLASS_DEVICE void for_each_column_merge_step(Merge&& merge) const {
    CUTLASS_PRAGMA_UNROLL
    for (int offset = cute::size<0>(lane_layout_MN) / 2; offset > 0; offset /= 2) {
      merge(lane_layout_MN(offset, _0{}));
    }
  }
};

template <bool ReferenceSrc, class StoreArgs>
CUTLASS_DEVICE auto warp_lanes(StoreArgs const& args) {
  using namespace cute;
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
  auto lane_mn = idx2crd(inv_lane_layout_MN(cutlass::canonical_lane_idx()), shape(lane_layout_MN));
  Layout tv2warp = Layout<Shape<Int<cutlass::NumThreadsPerWarp>, W, _1>, Stride<_0, _1, _0>>{};
  Layout ref2warp = composition(tv2warp, ref_layout_MN);
  Layout warp_layout_MN = make_layout(filter(get<0>(ref2warp)), filter(get<1>(ref2warp)));
  static_assert(decltype(size<1>(warp_layout_MN))::value == 1,
                "per-row reductions assume one warp across N per row (true for sm90 wgmma)");
  return WarpLanes<decltype(lane_layout_MN)>{lane_layout_MN, get<1>(lane_mn) == 0,
                                             get<0>(lane_mn) == 0};
}

// A register tensor with one slot per row (stride (1, 0)) or per column (stride (0, 1)) the thread
// visits: a (CTA_M, CTA_N) layout with that stride, partitioned exactly as the epilogue partitions
// coordinates. (CPY,CPY_M,CPY_N,EPI_M,EPI_N)
template <bool ReferenceSrc, class CtaTile, class StoreArgs, class StrideMN>
CUTLASS_DEVICE auto make_tile_state(StoreArgs const& args, StrideMN stride, float init) {
  using namespace cute;
  Tensor view = make_tensor(make_gmem_ptr(static_cast<float*>(nullptr)),
                            make_layout(take<0, 2>(CtaTile{}), stride));
  Tensor state = make_tensor_like<float>(cf::detail::sm90_partition_for_epilogue<ReferenceSrc>(
      view, args.epi_tile, args.tiled_copy, args.thread_idx));
  fill(state, init);
  return state;
}
template <bool ReferenceSrc, class CtaTile, class StoreArgs>
CUTLASS_DEVICE auto make_row_state(StoreArgs const& args, float init) {
  return make_tile_state<ReferenceSrc, CtaTile>(args, cute::make_stride(_1{}, _0{}), init);
}
template <bool ReferenceSrc, class CtaTile, class StoreArgs>
CUTLASS_DEVICE auto make_column_state(StoreArgs const& args, float init) {
  return make_tile_state<ReferenceSrc, CtaTile>(args, cute::make_stride(_0{}, _1{}), init);
}

// Where a tile's per-row partials go: per_row layout, rows padded to the tile.
struct RowPartialsTarget {
  int row0;         // absolute row of the thread's first element
  int rows_padded;  // M rounded up to the tile's M
  int64_t column;   // N-tile index * rows_padded
  bool in_bounds;   // false for a CTA wholly past N (a cluster partly out of the problem)
};

template <class CtaTile, class Residue>
CUTLASS_DEVICE RowPartialsTarget row_partials_target(int M, int N, Residue const& residue,
                                                     int tile_n) {
  const int cta_m = int(cute::size<0>(CtaTile{}));
  const int cta_n = int(cute::size<1>(CtaTile{}));
  const int rows_padded = (M + cta_m - 1) / cta_m * cta_m;
  return {M - int(cute::get<0>(residue)), rows_padded, int64_t(tile_n) * rows_padded,
          tile_n * cta_n < N};
}

// Calls store(index into the partial buffer, i, epi_m) once per row slot of the thread (epi_n = 0
// covers every row: the state has stride 0 along N). Rows past M but inside the tile land in the
// padding; nothing is written past it, nor for a CTA past the last N-tile (clusters along N
// round the grid up: such a CTA has no column in the buffer).
template <class CoordTensor, class Store>
CUTLASS_DEVICE void for_each_row_slot(CoordTensor const& tCcD, RowPartialsTarget const& t,
                                      Store&& store) {
  if (!t.in_bounds) return;
  CUTLASS_PRAGMA_UNROLL
  for (int epi_m = 0; epi_m < int(cute::size<3>(tCcD)); ++epi_m) {
    auto c_m = tCcD(cute::_, cute::_, cute::_, epi_m, _0{});
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < int(cute::size(c_m)); ++i) {
      const int row = t.row0 + int(cute::get<0>(c_m(i)));
      if (row < t.rows_padded) store(t.column + row, i, epi_m);
    }
  }
}

// Per-row sums a node keeps in registers over a tile (a row state of zeros), with what their one
// store at the end of the tile needs: SwigluBackwardNode's ZdZ, RowSumOfSquares. slots(epi_m,
// epi_n) is a subtile's view for visit; store(partials), at the last subtile, folds the sums
// across the lanes that share each row and, from the row lane, writes one per_row partial per row
// slot.
template <class CtaTile, class RowState, class CoordTensor, class Residue, class Lanes,
          class ShapeMNL>
struct RowSums {
  RowState state;    // one slot per row (stride 0 along N)
  CoordTensor tCcD;  // thread-relative coordinates of the elements
  Residue residue;
  Lanes lanes;
  ShapeMNL shape_mnl;
  int tile_n;

  CUTLASS_DEVICE auto slots(int epi_m, int epi_n) {
    return state(cute::_, cute::_, cute::_, epi_m, epi_n);
  }
  CUTLASS_DEVICE void store(float* partials) {
    auto f = cute::filter(state);
    lanes.for_each_row_merge_step([&](int lane_delta) {
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < cute::size(f); ++i)
        f(i) += __shfl_down_sync(0xffffffff, f(i), lane_delta);
    });
    if (!lanes.row_lane) return;
    const auto target = row_partials_target<CtaTile>(
        int(cute::get<0>(shape_mnl)), int(cute::get<1>(shape_mnl)), residue, tile_n);
    for_each_row_slot(tCcD, target, [&](int64_t idx, int i, int epi_m) {
      partials[idx] = state(cute::_, cute::_, cute::_, epi_m, _0{})(i);
    });
  }
};

template <bool ReferenceSrc, class CtaTile, class StoreArgs>
CUTLASS_DEVICE auto make_row_sums(StoreArgs const& args) {
  auto [M, N, K, L] = args.problem_shape_mnkl;
  auto [m, n, k, l] = args.tile_coord_mnkl;
  auto shape_mnl = cute::make_shape(M, N, L);
  auto state = make_row_state<ReferenceSrc, CtaTile>(args, 0.0f);
  auto lanes = warp_lanes<ReferenceSrc>(args);
  return RowSums<CtaTile, decltype(state), decltype(args.tCcD), decltype(args.residue_tCcD),
                 decltype(lanes), decltype(shape_mnl)>{state,       args.tCcD, args.residue_tCcD,
                                                       lanes,       shape_mnl, int(n)};
}

}  // namespace coda::kernel
