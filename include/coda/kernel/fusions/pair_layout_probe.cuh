#pragma once
#include "coda/kernel/fusions/common.cuh"
#include "coda/kernel/nodes/pair_layout_probe.cuh"

namespace coda::kernel {

template <>
struct FusionOf<Program::kPairLayoutProbe> {
  using ElementC = void;
  using ElementD = bfloat16_t;
  using Args = PlainArgs;
  template <class EpilogueDesc>
  struct Build {
    using Callbacks = PairLayoutProbe;
    static typename Callbacks::Arguments arguments(Args const&) { return {}; }
  };
};

}  // namespace coda::kernel
