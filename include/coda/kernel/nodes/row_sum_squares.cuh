#pragma once
#include "coda/kernel/nodes/common.cuh"
#include "coda/kernel/nodes/row_partials.cuh"

namespace coda::kernel {

// ---------------------------------------------------------------------------------------------
// RowSumOfSquares<CtaTile>: S[row] = Σ x² over the tile's columns, x the child's fragment (F1's
// x = acc + residual), as PartialLayout::per_row partials (one per row and N-tile). One register
// per row over the tile, merged across the lanes that share the row once, at the end, like
// SwigluBackwardNode's ZdZ. It takes the place of CUTLASS's Sm90ColReduction, whose visit tests
// every element's coordinates against the residue: F1 on pingpong 128x128 had 261 ISETP and 413
// IMAD per thread and tile with it, 69 and 313 with this node (the plain GEMM: 46 and 191;
// docs/experiments.md). (Sm90ColReduction's VisitCheckOOB = false
// would drop the same tests; this node is what was measured.)
// No test is needed here: an element past M or N is 0 + 0 (TMA fills the operands' and the
// residual's out-of-bounds elements with zeros) and adds exactly 0; rows past M land in the
// padding of the partials and nothing is written for a tile wholly past N.
// Returns its input, so it can sit in a side tree of Sm90SplitTreeVisitor.
// ---------------------------------------------------------------------------------------------
template <class CtaTile>
struct RowSumOfSquares : NoWorkspaceNoProducerLoads {
  struct SharedStorage {};
  struct Arguments {
    float* partials = nullptr;  // per_row layout, rows padded to the tile
  };
  using Params = Arguments;

  template <class ProblemShape>
  static constexpr Params to_underlying_arguments(ProblemShape const&, Arguments const& a, void*) {
    return a;
  }
  template <class ProblemShape>
  static bool can_implement(ProblemShape const&, Arguments const& a) {
    return a.partials != nullptr;
  }
  CUTLASS_HOST_DEVICE RowSumOfSquares() {}
  CUTLASS_HOST_DEVICE RowSumOfSquares(Params const& p, SharedStorage const&) : params(p) {}
  Params params;

  template <class Sums>
  struct ConsumerStoreCallbacks : cf::EmptyConsumerStoreCallbacks {
    CUTLASS_DEVICE ConsumerStoreCallbacks(Sums s, Params const& p) : sums(s), params(p) {}
    Sums sums;  // RowSums: S per row over the tile
    Params const& params;

    template <class ElementAccumulator, class ElementInput, int F>
    CUTLASS_DEVICE cutlass::Array<ElementInput, F> visit(
        cutlass::Array<ElementAccumulator, F> const&, int epi_v, int epi_m, int epi_n,
        cutlass::Array<ElementInput, F> const& x) {
      auto s_mn = sums.slots(epi_m, epi_n);
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < F; ++i) {
        const float v = static_cast<float>(x[i]);
        s_mn(epi_v * F + i) = fmaf(v, v, s_mn(epi_v * F + i));
      }
      return x;
    }

    template <class STensor, class SyncFn, class VTensor>
    CUTLASS_DEVICE void reduce(STensor&&, SyncFn const&, int, int, bool is_last_iteration,
                               VTensor) {
      if (is_last_iteration) sums.store(params.partials);
    }
  };

  template <bool ReferenceSrc, class... Args>
  CUTLASS_DEVICE auto get_consumer_store_callbacks(cf::ConsumerStoreArgs<Args...> const& args) {
    auto sums = make_row_sums<ReferenceSrc, CtaTile>(args);
    return ConsumerStoreCallbacks<decltype(sums)>(sums, params);
  }
};

}  // namespace coda::kernel
