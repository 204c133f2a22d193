#pragma once
#include "coda/kernel/fusions/common.cuh"
#include "coda/kernel/nodes/cross_entropy_grad.cuh"

namespace coda::kernel {

// B4 (cross-entropy backward in the epilogue of the recomputed ℓ = r ⊙ (h · W_vocabᵀ), kXWt):
//   dℓ = (exp(ℓ − lse)·(1 + 2λ·lse) − onehot(target))·scale   -> D (bf16, M x V)
//   ZdZ partial[m, n-tile] = Σ ℓ·dℓ                              -> per-row partials (not / H)
// A fp32 DAG: ℓ is computed once and feeds the gradient and the reduction.
template <>
struct FusionOf<Program::kRmsnormCrossEntropyBackward>
    : FusionTypes<void, bfloat16_t, RmsnormCrossEntropyBackwardArgs> {
  template <class EpilogueDesc>
  struct Build {
    using Tile = typename EpilogueDesc::TileShape;
    using TargetAsFloat = cf::Sm90ColBroadcast<0, Tile, int64_t, float,
                                               cute::Stride<cute::_1, cute::_0, int64_t>, 1>;
    using Callbacks = cf::Sm90TopologicalVisitor<
        float,
        cute::tuple<cute::seq<>, cute::seq<>, cute::seq<0, 1>, cute::seq<>, cute::seq<>, cute::seq<>,
                    cute::seq<2, 3, 4, 5>, cute::seq<2, 6>, cute::seq<7>, cute::seq<6, 8>>,
        cf::Sm90AccFetch,                            // 0 acc
        RowVector<Tile, float>,                      // 1 r
        ComputeNode<epilogue::Multiplies>,           // 2 ℓ = acc · r
        RowVector<Tile, float>,                      // 3 lse
        RowVector<Tile, float>,                      // 4 scale
        TargetAsFloat,                               // 5 target
        CrossEntropyGradNode,                        // 6 dℓ
        ComputeNode<epilogue::Multiplies>,           // 7 ℓ · dℓ
        RowPartialSum<Tile>,                         // 8 ZdZ partials
        ComputeNode<TakeFirst>>;                     // 9 D = dℓ
    static typename Callbacks::Arguments arguments(Args const& a) {
      return {{},
              {a.r, 0.0f, {}},
              {},
              {a.lse, 0.0f, {}},
              {a.scale, 0.0f, {}},
              {a.targets, int64_t(-1), {}},
              {a.z_loss},
              {},
              {a.zdz_partials, 0.0f, {}},
              {}};
    }
  };
};

}  // namespace coda::kernel
