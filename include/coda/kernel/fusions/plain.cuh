#pragma once
#include "coda/kernel/fusions/common.cuh"

namespace coda::kernel {

// D = acc
template <>
struct FusionOf<Program::kPlain> : FusionTypes<void, bfloat16_t, PlainArgs> {
  template <class EpilogueDesc>
  struct Build {
    using Callbacks = cf::Sm90AccFetch;
    static typename Callbacks::Arguments arguments(Args const&) { return {}; }
  };
};

}  // namespace coda::kernel
