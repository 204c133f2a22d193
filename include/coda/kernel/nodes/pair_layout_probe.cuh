#pragma once
// NOTE: sm90_visitor_tma_warpspecialized.hpp uses NumericArrayConverter without including it.
#include <cutlass/numeric_conversion.h>

#include "coda/kernel/nodes/common.cuh"

namespace coda::kernel {

// ---------------------------------------------------------------------------------------------
// PairLayoutProbe: D[m, n] = 1 where element 2j of the thread's fragment sits at an even column
// and element 2j+1 at the next column of the same row; 0 otherwise. Tests assert D == 1.
// ---------------------------------------------------------------------------------------------
struct PairLayoutProbe : cf::Sm90VisitorImpl<> {
  using cf::Sm90VisitorImpl<>::Sm90VisitorImpl;

  template <class CoordTensor>
  struct ConsumerStoreCallbacks : cf::EmptyConsumerStoreCallbacks {
    CUTLASS_DEVICE explicit ConsumerStoreCallbacks(CoordTensor c) : tCcD(c) {}
    CoordTensor tCcD;

    template <class ElementAccumulator, int F>
    CUTLASS_DEVICE cutlass::Array<float, F> visit(cutlass::Array<ElementAccumulator, F> const&,
                                                  int epi_v, int epi_m, int epi_n) {
      cutlass::Array<float, F> out;
      auto c = tCcD(cute::_, cute::_, cute::_, epi_m, epi_n);
      CUTLASS_PRAGMA_UNROLL
      for (int j = 0; j < F / 2; ++j) {
        const auto a = c(epi_v * F + 2 * j), b = c(epi_v * F + 2 * j + 1);
        const bool ok = cute::get<1>(a) % 2 == 0 && cute::get<1>(b) == cute::get<1>(a) + 1 &&
                        cute::get<0>(b) == cute::get<0>(a);
        out[2 * j] = out[2 * j + 1] = ok ? 1.0f : 0.0f;
      }
      return out;
    }
  };

  template <bool ReferenceSrc, class... Args>
  CUTLASS_DEVICE auto get_consumer_store_callbacks(cf::ConsumerStoreArgs<Args...> const& args) {
    auto tCcCta = cta_coords<ReferenceSrc>(args);
    return ConsumerStoreCallbacks<decltype(tCcCta)>(tCcCta);
  }
};

}  // namespace coda::kernel
