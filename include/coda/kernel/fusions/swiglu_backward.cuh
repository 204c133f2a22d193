#pragma once
#include "coda/kernel/fusions/common.cuh"
#include "coda/kernel/nodes/swiglu_backward.cuh"

namespace coda::kernel {

// B2 (SwiGLU backward in the epilogue of da = dx_out · W_down, operands kXW):
//   (g, u) = z pair;  dg, du, a = SwiGluBackward(g, u, da)
//   dz pair -> global (uint32, (M, I));  a -> D (bf16, (M, I));  ZdZ partial += g·dg + u·du
// One node does all three (nodes/swiglu_backward.cuh). An earlier version split the work over
// three output trees fed by a 64-bit (da, z) value, with z and dz staged in shared memory by the
// stock aux load/store nodes: 2-7x its plain GEMM on the H200 (docs/performance-notes.md).
template <>
struct FusionOf<Program::kSwigluBackward> {
  using ElementC = void;
  using ElementD = bfloat16_t;
  using Args = SwigluBackwardArgs;
  template <class EpilogueDesc>
  struct Build {
    using Tile = typename EpilogueDesc::TileShape;
    using Callbacks = cf::Sm90EVT<SwigluBackwardNode<Tile>, cf::Sm90AccFetch>;
    static typename Callbacks::Arguments arguments(Args const& a) { return {{}, a}; }
  };
};

}  // namespace coda::kernel
