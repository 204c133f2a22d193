#pragma once
#include "coda/kernel/fusions/common.cuh"

namespace coda::kernel {

// F1: x = acc + residual (C);  h = x ⊙ γ (aux store);  S = Σ_tile x² (per-row partials);  D = x
template <>
struct FusionOf<Program::kResidualRmsnormPartial> {
  using ElementC = bfloat16_t;
  using ElementD = bfloat16_t;
  using Args = ResidualRmsnormPartialArgs;
  template <class EpilogueDesc>
  struct Build {
    using Tile = typename EpilogueDesc::TileShape;
    using X =
        cf::Sm90EVT<ComputeNode<epilogue::Plus>, cf::Sm90AccFetch, cf::Sm90SrcFetch<bfloat16_t>>;
    using H = cf::Sm90EVT<typename AuxStoreNode<EpilogueDesc, bfloat16_t>::type,
                          cf::Sm90EVT<ComputeNode<epilogue::Multiplies>, cf::Sm90AccFetch,
                                      ColumnVector<Tile, bfloat16_t, float>>>;
    using S = cf::Sm90EVT<RowPartialSum<Tile>,
                          cf::Sm90EVT<ComputeNode<epilogue::Square>, cf::Sm90AccFetch>>;
    // x is computed once and fed as the "accumulator" of the three output trees.
    using Callbacks = cf::Sm90SplitTreeVisitor<X, cf::Sm90AccFetch, H, S>;

    static typename Callbacks::Arguments arguments(Args const& a) {
      return {
          {{}, {}, {}},  // x = acc + C
          {{{}, {reinterpret_cast<const bfloat16_t*>(a.gamma), bfloat16_t(0), {}}, {}},  // x ⊙ γ
           {reinterpret_cast<bfloat16_t*>(a.h), {a.ldh, cute::_1{}, 0}}},                // store h
          {{{}, {}}, {a.sumsq_partials, 0.0f, {}}},  // Σ x² partials
          {}};                                       // D = x
    }
  };
};

}  // namespace coda::kernel
