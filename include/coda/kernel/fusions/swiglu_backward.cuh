#pragma once
#include "coda/kernel/fusions/common.cuh"
#include "coda/kernel/nodes/swiglu_backward.cuh"

namespace coda::kernel {

// B2 (SwiGLU backward in the epilogue of da = dx_out · W_down, operands kXW):
//   (g, u) = z pair;  dg, du, a = SwiGluBackward(g, u, da)
//   dz pair -> global (uint32, (M, I));  a -> D (bf16, (M, I));  ZdZ partial += g·dg + u·du
// z is the GEMM's source C, one 32-bit element per (g, u) pair, so the epilogue's producer warp
// loads it by TMA, up to four subtiles ahead of the consumer (StagesC). Until run 47 the node
// read z itself, one subtile ahead, and B2 was latency-bound at K = 2048 (1.5x its GEMM,
// docs/performance-notes.md). One node does the rest (nodes/swiglu_backward.cuh); dz leaves by
// TMA through a stock aux store of 32-bit pairs held inside it. An earlier
// version split the work over three output trees with z and dz staged in shared memory by the
// stock aux load/store nodes: 2-7x its plain GEMM on the H200.
template <>
struct FusionOf<Program::kSwigluBackward> {
  using ElementC = uint32_t;
  using ElementD = bfloat16_t;
  using Args = SwigluBackwardArgs;
  static const void* source(Args const& a) { return a.z; }
  static int64_t source_ld(Args const& a) { return a.ldz; }
  template <class EpilogueDesc>
  struct Build {
    using Tile = typename EpilogueDesc::TileShape;
    using DzStore = typename AuxStoreNode<EpilogueDesc, uint32_t>::type;
    using Callbacks = cf::Sm90EVT<SwigluBackwardNode<Tile, DzStore>, cf::Sm90AccFetch,
                                  cf::Sm90SrcFetch<uint32_t>>;
    static typename Callbacks::Arguments arguments(Args const& a) { return {{}, {}, a}; }
  };
};

}  // namespace coda::kernel
