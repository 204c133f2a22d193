#pragma once
// Direct global-memory access from epilogue nodes (RmsnormBackwardNode's h on cooperative tiles,
// LoadAhead; the bf16 pair packing is B2's too): the thread's share of a tile of a row-major
// (M, N) tensor, partitioned exactly like the collective's D, its coordinates, whether a tile
// needs bounds checks at all, and bf16 pairs as 32-bit words. Fragment elements (2j, 2j+1) are
// adjacent columns of one row (PairLayoutProbe checks this per schedule), so a pair moves as one
// 32-bit word (bf16) or one half of a 64-bit access (32-bit elements).

#include <cuda_bf16.h>

#include <cute/tensor.hpp>
#include <cutlass/epilogue/fusion/sm90_visitor_tma_warpspecialized.hpp>

#include "coda/kernel/nodes/common.cuh"

namespace coda::kernel {

CUTLASS_DEVICE float2 unpack_bf16_pair(uint32_t bits) {
  __nv_bfloat162 v;
  memcpy(&v, &bits, 4);
  return __bfloat1622float2(v);
}
CUTLASS_DEVICE uint32_t pack_bf16_pair(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  uint32_t bits;
  memcpy(&bits, &v, 4);
  return bits;
}

// (CPY,CPY_M,CPY_N,EPI_M,EPI_N) view of this tile of a row-major (M, N) tensor (leading dimension
// ld), or of its absolute (m, n, l) coordinates when called without a pointer.
template <bool ReferenceSrc, class StoreArgs, class Shape, class Engine>
CUTLASS_DEVICE auto partition_tile(StoreArgs const& args, cute::Tensor<Engine, Shape> const& t) {
  return cf::detail::sm90_partition_for_epilogue<ReferenceSrc>(
      t, args.tile_shape_mnk, args.tile_coord_mnkl, args.epi_tile, args.tiled_copy,
      args.thread_idx);
}
template <bool ReferenceSrc, class StoreArgs, class ShapeMNL, class T>
CUTLASS_DEVICE auto partition_tile(StoreArgs const& args, ShapeMNL const& shape_mnl, T* ptr,
                                   int64_t ld) {
  using namespace cute;
  return partition_tile<ReferenceSrc>(
      args, make_tensor(make_gmem_ptr(ptr), shape_mnl, make_stride(ld, _1{}, int64_t(0))));
}
template <bool ReferenceSrc, class StoreArgs, class ShapeMNL>
CUTLASS_DEVICE auto partition_coords(StoreArgs const& args, ShapeMNL const& shape_mnl) {
  return partition_tile<ReferenceSrc>(args, cute::make_identity_tensor(shape_mnl));
}

// The tile (tile_m, tile_n) lies wholly inside (M, N): its accesses need no bounds checks.
template <class CtaTile>
CUTLASS_DEVICE bool tile_inside(int tile_m, int tile_n, int M, int N) {
  return (tile_m + 1) * int(cute::size<0>(CtaTile{})) <= M &&
         (tile_n + 1) * int(cute::size<1>(CtaTile{})) <= N;
}

}  // namespace coda::kernel
