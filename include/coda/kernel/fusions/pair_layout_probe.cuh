#pragma once
#include "coda/kernel/fusions/common.cuh"
#include "coda/kernel/nodes/pair_layout_probe.cuh"

namespace coda::kernel {

template <>
struct FusionOf<Program::kPairLayoutProbe> : FusionTypes<void, bfloat16_t, PlainArgs> {
  template <class EpilogueDesc>
  struct Build {
    using Callbacks = PairLayoutProbe;
    static typename Callbacks::Arguments arguments(Args const&) { return {}; }
  };
};

}  // namespace coda::kernel
