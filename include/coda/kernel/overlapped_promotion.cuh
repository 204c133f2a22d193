#pragma once
// The blockwise FP8 mainloop with each k-tile's promotion under the next k-tile's MMAs.
//
// CUTLASS 4.2's blockwise mainloop (MainloopSm90TmaGmmaWarpSpecializedBlockwiseFP8) issues a
// k-tile's wgmmas into a temporary accumulator, waits for all of them, and only then adds the
// temporary, scaled by the k-tile's block scales, into the result: during that promotion (64
// FFMAs a thread for a 64x128 warpgroup tile) the warpgroup has no MMA in flight, and since both
// warpgroups of a cooperative tile wait on the same stages they promote at the same time and the
// tensor cores idle. OverlappedPromotion<Base> keeps Base's loads, shared storage and parameters
// and replaces its consumer loop: two temporaries alternate, k-tile i + 1's wgmmas are issued
// into one before k-tile i's (the other) is waited for and promoted, so the promotion runs while
// the tensor cores work. The result is the same sum in the same order (each k-tile's partial
// product, scaled, added to the result in k order), so the outputs are bit for bit Base's.
//
// Cost: 64 more accumulator registers a thread (three 64x128 fragments: 192 of the 232 the
// cooperative kernel gives its MMA warpgroups). A stage is held as in Base, until the k-tile
// after it has been issued and its own MMAs are done and promoted; its scales are read before
// its wgmmas are issued, as Base reads them (mma below says why that order is needed).

#include <cute/tensor.hpp>
#include <cutlass/gemm/collective/collective_builder.hpp>

namespace coda::kernel {

template <class Base>
struct OverlappedPromotion : Base {
  using typename Base::ElementBlockScale;
  using typename Base::MainloopPipeline;
  using typename Base::Params;
  using typename Base::PipelineState;
  using typename Base::TensorStorage;
  using typename Base::TiledMma;
  using typename Base::TileShape;

  // One promotion per k-tile: the k-tile is one scale block deep.
  static_assert(cute::size<2>(TileShape{}) == Base::ScaleGranularityK,
                "OverlappedPromotion promotes once per k-tile: the tile's K must be the scales' K");
  static_assert(Base::ScaleMsPerTile > 1, "A's scales are per row (1x128 blocks)");
  // B's scale is one per tile (128x128 blocks: forward and data gradient). Under per-column
  // scales (the weight gradient's 1x128 · 1x128) a k-tile's scales are 34 registers a thread,
  // and holding them a step ahead, next to the three accumulators, spills.
  static_assert(Base::ScaleNsPerTile == 1, "B's scales are per 128x128 block");

  template <class FrgTensorC>
  CUTLASS_DEVICE void mma(MainloopPipeline pipeline, PipelineState smem_pipe_read,
                          FrgTensorC& accum, int k_tile_count, int thread_idx,
                          TensorStorage& shared_tensors, Params const&) {
    using namespace cute;
    static_assert(is_rmem<FrgTensorC>::value, "the accumulator lives in registers");

    Tensor sA = make_tensor(make_smem_ptr(shared_tensors.smem_A.data()),
                            typename Base::SmemLayoutA{});  // (BLK_M, BLK_K, PIPE)
    Tensor sB = make_tensor(make_smem_ptr(shared_tensors.smem_B.data()),
                            typename Base::SmemLayoutB{});  // (BLK_N, BLK_K, PIPE)
    // The scales as (BLK_M, BLK_N, (BLK_K, PIPE)) views broadcast over the other extent, so that a
    // thread's partition of them lines up with its accumulator elements.
    using SFA = typename Base::SmemLayoutSFA;
    using SFB = typename Base::SmemLayoutSFB;
    Tensor sSFA = make_tensor(
        make_smem_ptr(shared_tensors.smem_SFA.data()),
        make_layout(make_shape(get<0>(shape(SFA{})), get<1>(TileShape{}),
                               make_shape(get<1>(shape(SFA{})), get<2>(shape(SFA{})))),
                    make_stride(get<0>(stride(SFA{})), _0{},
                                make_stride(get<1>(stride(SFA{})), get<2>(stride(SFA{}))))));
    Tensor sSFB = make_tensor(
        make_smem_ptr(shared_tensors.smem_SFB.data()),
        make_layout(make_shape(get<0>(TileShape{}), get<0>(shape(SFB{})),
                               make_shape(get<1>(shape(SFB{})), get<2>(shape(SFB{})))),
                    make_stride(_0{}, get<0>(stride(SFB{})),
                                make_stride(get<1>(stride(SFB{})), get<2>(stride(SFB{}))))));

    constexpr int kWarpGroups = size(TiledMma{}) / cutlass::NumThreadsPerWarpGroup;
    const int warp_group =
        __shfl_sync(0xffffffffu, thread_idx / cutlass::NumThreadsPerWarpGroup, 0);
    TiledMma tiled_mma;
    auto wg_mma = tiled_mma.get_slice(
        make_layout(Int<kWarpGroups>{}, Int<cutlass::NumThreadsPerWarpGroup>{})(warp_group));
    Tensor tCsSFA = tiled_mma.get_slice(thread_idx).partition_C(sSFA);  // (MMA, M, N, (K, PIPE))
    Tensor tCsSFB = tiled_mma.get_slice(thread_idx).partition_C(sSFB);
    Tensor tCrA = wg_mma.make_fragment_A(wg_mma.partition_A(sA));  // (MMA, M, K, PIPE)
    Tensor tCrB = wg_mma.make_fragment_B(wg_mma.partition_B(sB));  // (MMA, N, K, PIPE)
    constexpr int kBlocks = decltype(size<2>(tCrA))::value;        // wgmmas along K per k-tile

    auto issue = [&](auto& acc, int stage) {
      cute::warpgroup_fence_operand(acc);
      cute::warpgroup_arrive();
      tiled_mma.accumulate_ = GMMA::ScaleOut::Zero;
      CUTLASS_PRAGMA_UNROLL
      for (int kb = 0; kb < kBlocks; ++kb) {
        cute::gemm(tiled_mma, tCrA(_, _, kb, stage), tCrB(_, _, kb, stage), acc);
        tiled_mma.accumulate_ = GMMA::ScaleOut::One;
      }
      cute::warpgroup_commit_batch();
      cute::warpgroup_fence_operand(acc);
    };

    // A k-tile's scales, read from its stage once its wgmmas are out: each accumulator element's
    // A-row scale times B's.
    using Scales = decltype(make_tensor_like<ElementBlockScale>(tCsSFA(_, _, _, _0{})));
    auto load_scales = [&](int stage, Scales& sa) {
      Tensor sb = make_tensor_like<ElementBlockScale>(tCsSFB(_, _, _, _0{}));
      copy(tCsSFA(_, _, _, make_coord(_0{}, stage)), sa);
      copy(tCsSFB(_, _, _, make_coord(_0{}, stage)), sb);
      const ElementBlockScale b = sb(_0{});
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < size(filter_zeros(sa)); ++i) filter_zeros(sa)(i) *= b;
    };
    // accum += acc · scales.
    auto promote = [&](auto& acc, Scales const& sa) {
      cute::warpgroup_fence_operand(acc);
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < size(accum); ++i) accum(i) += acc(i) * sa(i);
      cute::warpgroup_fence_operand(acc);
    };

    Tensor acc0 = make_fragment_like(accum);
    Tensor acc1 = make_fragment_like(accum);
    Scales sa0, sa1;
    clear(accum);
    cute::warpgroup_fence_operand(accum);

    PipelineState smem_pipe_release = smem_pipe_read;
    // k-tile 0 into acc0.
    pipeline.consumer_wait(smem_pipe_read);
    load_scales(smem_pipe_read.index(), sa0);
    issue(acc0, smem_pipe_read.index());
    ++smem_pipe_read;

    // Read k-tile k's scales, issue k into one temporary, wait for k - 1's (the other) and promote
    // it, release k - 1's stage. Every warp reads a stage's scales before it issues the stage's
    // wgmmas: a stage is released (here, or the last one by mma_tail) once its wgmma group is
    // complete, which proves that all four warps of the warpgroup have issued it, and under a
    // cluster only one thread of the warpgroup arrives on the stage's empty barrier, so nothing
    // else holds the release back for a warp still behind. Read after the issue, a lagging warp's
    // scales could come from the producer's refill of the stage (the next tile's, on a CTA that
    // runs more than one tile): wrong z from F2 under memcheck, whose slow shared-memory loads
    // open that window. Two scale sets are live at a time (a few registers: one scale per row).
    auto step = [&](auto& acc_next, Scales& sa_next, auto& acc_prev, Scales const& sa_prev) {
      pipeline.consumer_wait(smem_pipe_read);
      load_scales(smem_pipe_read.index(), sa_next);
      issue(acc_next, smem_pipe_read.index());
      cute::warpgroup_wait<1>();
      promote(acc_prev, sa_prev);
      ++smem_pipe_read;
      pipeline.consumer_release(smem_pipe_release);
      ++smem_pipe_release;
    };
    int k = 1;
    CUTLASS_PRAGMA_NO_UNROLL
    for (; k + 1 < k_tile_count; k += 2) {
      step(acc1, sa1, acc0, sa0);
      step(acc0, sa0, acc1, sa1);
    }
    // k - 1, the last k-tile issued, is in acc0.
    if (k < k_tile_count) {
      step(acc1, sa1, acc0, sa0);
      cute::warpgroup_wait<0>();
      promote(acc1, sa1);
    } else {
      cute::warpgroup_wait<0>();
      promote(acc0, sa0);
    }
    // The last k-tile's stage is released by mma_tail (Base's), as Base's mma leaves it.
    cute::warpgroup_fence_operand(accum);
  }
};

}  // namespace coda::kernel
