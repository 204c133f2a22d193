#pragma once
// NOTE: sm90_visitor_tma_warpspecialized.hpp uses NumericArrayConverter without including it.
#include <cutlass/numeric_conversion.h>

#include "coda/kernel/nodes/common.cuh"

namespace coda::kernel {

// ---------------------------------------------------------------------------------------------
// PairwiseCompute<Fn, ElementOutput>: out = Fn{}(params, child fragments...) with the children's
// fragments passed raw, and the result converted to ElementOutput unless already of that type.
// Fn is a default-constructible struct with
//   struct Arguments {...};   (may be empty)
//   template <int F, class... In> Array<T, F> operator()(Arguments const&, Array<In, F> const&...)
// ---------------------------------------------------------------------------------------------
template <class Fn, class ElementOutput>
struct PairwiseCompute : ConsumerOnlyNode<typename Fn::Arguments> {
  using Params = typename Fn::Arguments;
  using Arguments = Params;
  using SharedStorage = typename ConsumerOnlyNode<Params>::SharedStorage;

  using ConsumerOnlyNode<typename Fn::Arguments>::ConsumerOnlyNode;

  struct ConsumerStoreCallbacks : cf::EmptyConsumerStoreCallbacks {
    CUTLASS_DEVICE explicit ConsumerStoreCallbacks(Params const& p) : params(p) {}
    Params const& params;

    template <class ElementAccumulator, class... ElementInputs, int F>
    CUTLASS_DEVICE cutlass::Array<ElementOutput, F> visit(
        cutlass::Array<ElementAccumulator, F> const&, int, int, int,
        cutlass::Array<ElementInputs, F> const&... inputs) {
      const auto out = Fn{}(params, inputs...);
      using Produced = typename decltype(out)::Element;
      if constexpr (std::is_same_v<Produced, ElementOutput>) {
        return out;  // raw results (e.g. packed bit patterns) pass unconverted
      } else {
        return cutlass::NumericArrayConverter<ElementOutput, Produced, F>{}(out);
      }
    }
  };

  template <bool ReferenceSrc, class... Args>
  CUTLASS_DEVICE auto get_consumer_store_callbacks(cf::ConsumerStoreArgs<Args...> const&) {
    return ConsumerStoreCallbacks(this->params);
  }
};

}  // namespace coda::kernel
