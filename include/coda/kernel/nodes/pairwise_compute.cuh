#pragma once
// NOTE: sm90_visitor_tma_warpspecialized.hpp uses NumericArrayConverter without including it.
#include <cutlass/numeric_conversion.h>

#include "coda/kernel/nodes/common.cuh"

namespace coda::kernel {

// ---------------------------------------------------------------------------------------------
// PairwiseCompute<Fn, ElementOutput>: out = Fn{}(params, child fragments...) with the children's
// fragments passed raw. Fn is a default-constructible struct with
//   struct Arguments {...};   (may be empty)
//   template <int F, class... In> Array<float, F> operator()(Arguments const&, Array<In, F>
//   const&...)
// ---------------------------------------------------------------------------------------------
template <class Fn, class ElementOutput>
struct PairwiseCompute {
  struct SharedStorage {};
  using Arguments = typename Fn::Arguments;
  using Params = Arguments;

  template <class ProblemShape>
  static constexpr Params to_underlying_arguments(ProblemShape const&, Arguments const& a, void*) {
    return a;
  }
  template <class ProblemShape>
  static bool can_implement(ProblemShape const&, Arguments const&) {
    return true;
  }
  template <class ProblemShape>
  static size_t get_workspace_size(ProblemShape const&, Arguments const&) {
    return 0;
  }
  template <class ProblemShape>
  static cutlass::Status initialize_workspace(ProblemShape const&, Arguments const&, void*,
                                              cudaStream_t, cutlass::CudaHostAdapter* = nullptr) {
    return cutlass::Status::kSuccess;
  }

  CUTLASS_HOST_DEVICE PairwiseCompute() {}
  CUTLASS_HOST_DEVICE PairwiseCompute(Params const& p, SharedStorage const&) : params(p) {}
  Params params;

  CUTLASS_DEVICE bool is_producer_load_needed() const { return false; }
  CUTLASS_DEVICE bool is_C_load_needed() const { return false; }

  template <class... Args>
  CUTLASS_DEVICE auto get_producer_load_callbacks(cf::ProducerLoadArgs<Args...> const&) {
    return cf::EmptyProducerLoadCallbacks{};
  }

  struct ConsumerStoreCallbacks : cf::EmptyConsumerStoreCallbacks {
    CUTLASS_DEVICE explicit ConsumerStoreCallbacks(Params const& p) : params(p) {}
    Params const& params;

    template <class ElementAccumulator, class... ElementInputs, int F>
    CUTLASS_DEVICE cutlass::Array<ElementOutput, F> visit(
        cutlass::Array<ElementAccumulator, F> const&, int, int, int,
        cutlass::Array<ElementInputs, F> const&... inputs) {
      const cutlass::Array<float, F> out = Fn{}(params, inputs...);
      return cutlass::NumericArrayConverter<ElementOutput, float, F>{}(out);
    }
  };

  template <bool ReferenceSrc, class... Args>
  CUTLASS_DEVICE auto get_consumer_store_callbacks(cf::ConsumerStoreArgs<Args...> const&) {
    return ConsumerStoreCallbacks(params);
  }
};

}  // namespace coda::kernel
