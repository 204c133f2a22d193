#pragma once
// NOTE: sm90_visitor_tma_warpspecialized.hpp uses NumericArrayConverter without including it.
#include <cutlass/numeric_conversion.h>

#include "coda/kernel/nodes/common.cuh"
#include "coda/programs/formulas.hpp"

namespace coda::kernel {

// ---------------------------------------------------------------------------------------------
// CrossEntropyGrad: inputs (logit, lse, scale, target) as fp32 fragments (targets < 2^24 are
// exact in fp32); out = programs::CrossEntropyGrad with the one-hot taken from the element's
// absolute column. Coordinates from the collective's (tCcD, residue_tCcD): absolute column =
// N − residue + tCcD (see nodes/online_lse.cuh). Columns past N produce 0.
// ---------------------------------------------------------------------------------------------
struct CrossEntropyGradArguments {
  float z_loss = 0.0f;
};

struct CrossEntropyGradNode : ConsumerOnlyNode<CrossEntropyGradArguments> {
  using Params = CrossEntropyGradArguments;
  using Arguments = Params;

  using ConsumerOnlyNode<CrossEntropyGradArguments>::ConsumerOnlyNode;

  template <class CoordTensor, class Residue>
  struct ConsumerStoreCallbacks : cf::EmptyConsumerStoreCallbacks {
    CUTLASS_DEVICE ConsumerStoreCallbacks(CoordTensor c, Residue r, int n, float z)
        : tCcD(c), residue(r), N(n), z_loss(z) {}
    CoordTensor tCcD;  // thread-relative coordinates
    Residue residue;   // (M, N) − thread's first element
    int N;
    float z_loss;

    template <class ElementAccumulator, int F>
    CUTLASS_DEVICE cutlass::Array<float, F> visit(cutlass::Array<ElementAccumulator, F> const&,
                                                  int epi_v, int epi_m, int epi_n,
                                                  cutlass::Array<float, F> const& logit,
                                                  cutlass::Array<float, F> const& lse,
                                                  cutlass::Array<float, F> const& scale,
                                                  cutlass::Array<float, F> const& target) {
      cutlass::Array<float, F> out;
      auto c = tCcD(cute::_, cute::_, cute::_, epi_m, epi_n);
      const int col0 = N - int(cute::get<1>(residue));
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < F; ++i) {
        const auto ci = c(epi_v * F + i);
        const int col = col0 + int(cute::get<1>(ci));
        out[i] = cute::elem_less(ci, residue)
                     ? programs::CrossEntropyGrad{}(logit[i], lse[i], scale[i],
                                                    int(target[i]) == col, z_loss)
                     : 0.0f;
      }
      return out;
    }
  };

  template <bool ReferenceSrc, class... Args>
  CUTLASS_DEVICE auto get_consumer_store_callbacks(cf::ConsumerStoreArgs<Args...> const& args) {
    auto [M, N, K, L] = args.problem_shape_mnkl;
    return ConsumerStoreCallbacks<decltype(args.tCcD), decltype(args.residue_tCcD)>(
        args.tCcD, args.residue_tCcD, int(N), params.z_loss);
  }
};

}  // namespace coda::kernel
