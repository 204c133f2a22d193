#pragma once
#include "coda/kernel/fusions/residual_rmsnorm_tree.cuh"

namespace coda::kernel {

// F1: x = acc + residual;  h = x ⊙ γ (aux store);  S = Σ_tile x² (per-row partials);  D = x
// The residual (the problem's p.c) is an Sm90AuxLoad, not the source C. With a bf16 C the builder
// reuses C's shared memory for D, so a C stage is not freed until the TMA store of D from it is
// done, and it turns off the delayed TMA store. Avoiding both changed nothing measurable (within
// 2% at the configurations the heuristic picks; docs/experiments.md).
template <>
struct FusionOf<Program::kResidualRmsnormPartial>
    : FusionTypes<void, bfloat16_t, ResidualRmsnormPartialArgs> {
  template <class EpilogueDesc>
  struct Build {
    using Residual = AuxLoadNode<EpilogueDesc, bfloat16_t>;
    using Tree = ResidualRmsnormTree<typename EpilogueDesc::TileShape, typename Residual::type,
                                     typename AuxStoreNode<EpilogueDesc, bfloat16_t>::type>;
    using Callbacks = typename Tree::Callbacks;

    static typename Callbacks::Arguments arguments(Args const& a, GemmProblem const& p) {
      return Tree::arguments(Residual::arguments(p.c, p.ldc), a.gamma,
                             {reinterpret_cast<bfloat16_t*>(a.h), {a.ldh, cute::_1{}, 0}},
                             a.sumsq_partials);
    }
  };
};

}  // namespace coda::kernel
