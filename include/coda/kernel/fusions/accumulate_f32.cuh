#pragma once
#include "coda/kernel/fusions/common.cuh"

namespace coda::kernel {

// D = acc + D in fp32: the kernel's source C and destination D are the same fp32 matrix, read and
// written tile by tile (each element once), so a weight gradient accumulates over micro-batches
// without a bf16 rounding or a second pass.
template <>
struct FusionOf<Program::kAccumulateF32> : FusionTypes<float, float, AccumulateF32Args> {
  static KernelOperands operands(Args const& a, GemmProblem const&) {
    return {a.d, a.ldd, a.d, a.ldd};
  }
  template <class EpilogueDesc>
  struct Build {
    using Callbacks = cf::Sm90EVT<cf::Sm90Compute<cutlass::plus, float, float, kRound>,
                                  cf::Sm90AccFetch, cf::Sm90SrcFetch<float>>;
    static typename Callbacks::Arguments arguments(Args const&) { return {}; }
  };
};

}  // namespace coda::kernel
