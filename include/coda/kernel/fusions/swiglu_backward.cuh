#pragma once
#include "coda/kernel/fusions/common.cuh"
#include "coda/kernel/nodes/swiglu_backward.cuh"

namespace coda::kernel {

// B2 (SwiGLU backward in the epilogue of da = dx_out · W_down, operands kXW):
//   (g, u) = z pair;  dg, du, a = SwiGluBackward(g, u, da)
//   dz pair -> D (uint32, (M, I));  a -> global (bf16, (M, I));  ZdZ partial += g·dg + u·du
// z is the GEMM's source C and dz its destination D, one 32-bit element per (g, u) pair. The
// epilogue's producer warp loads z by TMA ahead of the consumer, and dz goes out by TMA through
// the same shared-memory buffer (the builder reuses C's buffers for D when both have the same
// width); a leaves through a stock aux store of bf16 held in the node
// (nodes/swiglu_backward.cuh). Three C stages keep the epilogue at 32 KB of shared memory, so
// the mainloop gets six stages like the plain GEMM: B2 runs 1.07x slower with four mainloop
// stages than with five, and 1.04x its GEMM with z (and its 32 KB) taken away. With the node
// reading z itself, one subtile ahead, B2 was latency-bound at K = 2048 (1.5x its GEMM;
// docs/experiments.md).
template <>
struct FusionOf<Program::kSwigluBackward> : FusionTypes<uint32_t, uint32_t, SwigluBackwardArgs> {
  static constexpr int kStagesC = 3;
  static KernelOperands operands(Args const& a, GemmProblem const&) {
    return {a.z, a.ldz, a.dz, a.lddz};
  }
  template <class EpilogueDesc>
  struct Build {
    using Tile = typename EpilogueDesc::TileShape;
    using AStore = typename AuxStoreNode<EpilogueDesc, bfloat16_t>::type;
    using Callbacks =
        cf::Sm90EVT<SwigluBackwardNode<Tile, AStore>, cf::Sm90AccFetch, cf::Sm90SrcFetch<uint32_t>>;
    // a goes to the problem's D pointer (p.d, p.ldd), which the op layer fills with a.
    static typename Callbacks::Arguments arguments(Args const& a, GemmProblem const& p) {
      return {{}, {}, {a, p.d, p.ldd}};
    }
  };
};

}  // namespace coda::kernel
