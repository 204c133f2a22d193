#pragma once
#include "coda/kernel/fusions/common.cuh"

namespace coda::kernel {

// D = acc
template <>
struct FusionOf<Program::kPlain> : FusionTypes<void, bfloat16_t, PlainArgs> {
  // On FP8 operands, CUTLASS's promotion: under OverlappedPromotion the plain GEMM ran 1.03-1.09x
  // cuBLASLt's speed at 1B / 8B shapes with K <= 16384 but 0.92-0.99x at K = 28672 and 0.74-0.82x
  // at K = 57344 (gemm.cuh); one kernel serves every K.
  static constexpr bool kPromotionUnderMma = false;
  template <class EpilogueDesc>
  struct Build {
    using Callbacks = cf::Sm90AccFetch;
    static typename Callbacks::Arguments arguments(Args const&) { return {}; }
  };
};

}  // namespace coda::kernel
