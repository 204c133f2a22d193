#pragma once
// The persistent tile scheduler of programs whose output block spans two CTA tiles along N: each
// CTA gets its tiles in pairs, (m, 2j) then (m, 2j + 1), back to back. F2 with FP8 a needs it: a
// 1x128 block of a is 256 columns of z, two 128-wide tiles, so the first tile stages its half of
// the block in shared memory and the second completes and quantizes it
// (nodes/fp8_tile_store.cuh, SwigluOfPairedTiles).
//
// Work is scheduled in units of TileM x 2·TileN: the stock persistent scheduler runs over a tile
// twice as wide (its swizzle, raster order and clusters apply to units; a 1x2 cluster gets
// neighbouring units, so its CTAs share A's rows as before), and each unit runs as its two
// tiles. A unit's second tile past N is an ordinary out-of-bounds tile (zero-filled loads,
// clipped stores), as a cluster's rounding already makes.

#include <cute/tensor.hpp>
#include <cutlass/gemm/kernel/tile_scheduler.hpp>

namespace coda::kernel {

struct PairedAlongN {};  // the scheduler tag (GemmUniversal's last template argument)

class PairedAlongNScheduler : public cutlass::gemm::kernel::detail::PersistentTileSchedulerSm90 {
  using Base = cutlass::gemm::kernel::detail::PersistentTileSchedulerSm90;

  template <class Tile>
  static constexpr auto unit_tile(Tile) {
    using namespace cute;
    return make_shape(get<0>(Tile{}), get<1>(Tile{}) * _2{}, get<2>(Tile{}));
  }

 public:
  using Params = Base::Params;
  using Arguments = Base::Arguments;
  using WorkTileInfo = Base::WorkTileInfo;

  template <class ProblemShapeMNKL, class TileShape, class ClusterShape>
  static Params to_underlying_arguments(ProblemShapeMNKL problem, TileShape tile,
                                        ClusterShape cluster, cutlass::KernelHardwareInfo const& hw,
                                        Arguments const& arguments, void* workspace = nullptr,
                                        const uint32_t epilogue_subtile = 1,
                                        uint32_t ktile_start_alignment_count = 1u) {
    return Base::to_underlying_arguments(problem, unit_tile(tile), cluster, hw, arguments,
                                         workspace, epilogue_subtile, ktile_start_alignment_count);
  }

  template <class ProblemShapeMNK, class BlockShape, class ClusterShape>
  static dim3 get_grid_shape(Params const& params, ProblemShapeMNK problem, BlockShape tile,
                             ClusterShape cluster, cutlass::KernelHardwareInfo hw,
                             Arguments arguments = Arguments{}, bool truncate = true) {
    return Base::get_grid_shape(params, problem, unit_tile(tile), cluster, hw, arguments, truncate);
  }

  CUTLASS_HOST_DEVICE PairedAlongNScheduler() {}
  CUTLASS_DEVICE explicit PairedAlongNScheduler(Params const& params) : Base(params) {}

  template <class ClusterShape>
  CUTLASS_DEVICE WorkTileInfo initial_work_tile_info(ClusterShape) {
    return get_current_work();
  }

  // The unit's tile: N_idx counts units in the base scheduler and tiles here.
  CUTLASS_DEVICE WorkTileInfo get_current_work() const {
    WorkTileInfo w = Base::get_current_work();
    if (w.is_valid()) w.N_idx = 2 * w.N_idx + int32_t(second_);
    return w;
  }

  // `count` tiles on: the second tile of the unit, or the base scheduler's next unit(s).
  CUTLASS_DEVICE void advance_to_next_work(uint32_t count = 1) {
    const uint32_t steps = second_ + count;
    second_ = steps & 1u;
    Base::advance_to_next_work(steps >> 1);
  }

  CUTLASS_DEVICE bool is_last_tile(WorkTileInfo& work, uint32_t count = 1) const {
    const uint32_t steps = second_ + count;
    if (steps < 2) return false;  // the next tile is this unit's second one
    return Base::is_last_tile(work, steps >> 1);
  }

  CUTLASS_DEVICE auto fetch_next_work(WorkTileInfo) {
    advance_to_next_work();
    return cute::make_tuple(get_current_work(), true);
  }
  template <class Pipeline, class PipelineState>
  CUTLASS_DEVICE auto fetch_next_work(WorkTileInfo work, Pipeline&, PipelineState) {
    return fetch_next_work(work);
  }

 private:
  uint32_t second_ = 0;  // 1 on a unit's second tile
};

}  // namespace coda::kernel

namespace cutlass::gemm::kernel::detail {
template <class ArchTag, class TileShape, class ClusterShape, uint32_t SchedulerPipelineStageCount>
struct TileSchedulerSelector<coda::kernel::PairedAlongN, ArchTag, TileShape, ClusterShape,
                             SchedulerPipelineStageCount> {
  using Scheduler = coda::kernel::PairedAlongNScheduler;
};
}  // namespace cutlass::gemm::kernel::detail
