#pragma once
#include "coda/kernel/fusions/common.cuh"
#include "coda/programs/formulas.hpp"

namespace coda::kernel {

// B1 (RMSNorm backward in the epilogue of g = dz · W, operands kXW):
//   dx = dres (C) + r·(g·γ − x·r·ZdZ)  -> D (may alias C: an in-place accumulate into dres)
//   h_out = x·r·γ                       -> aux store
//   dγ partial[n, m-tile] = Σ g·x·r     -> per-column partials (PartialLayout::per_column)
// A DAG (every node fp32): x, r, γ, ZdZ are loaded once and shared by the three outputs.
template <>
struct FusionOf<Program::kRmsnormBackward> {
  using ElementC = bfloat16_t;
  using ElementD = bfloat16_t;
  using Args = RmsnormBackwardArgs;
  template <class EpilogueDesc>
  struct Build {
    using Tile = typename EpilogueDesc::TileShape;
    using XLoad = cutlass::epilogue::collective::detail::AuxLoadDescriptor<
        EpilogueDesc, cutlass::layout::RowMajor, bfloat16_t>;
    using X = cf::Sm90AuxLoad<XLoad::Stages, typename EpilogueDesc::EpilogueTile, bfloat16_t,
                              typename XLoad::Stride, typename XLoad::SmemLayoutAtom,
                              typename XLoad::CopyOpS2R>;
    using DgammaPartial =
        cf::Sm90RowReduction<cutlass::plus, cutlass::plus, cutlass::plus, 0, Tile, float, float,
                             kRound, cute::Stride<cute::_0, cute::_1, int64_t>, 4, true,
                             /*FinalReduction=*/false>;
    using Callbacks = cf::Sm90TopologicalVisitor<
        float,
        cute::tuple<cute::seq<>, cute::seq<>, cute::seq<>, cute::seq<>, cute::seq<>, cute::seq<>,
                    cute::seq<0, 1, 2, 3, 4, 5>, cute::seq<2, 3, 4>, cute::seq<7>,
                    cute::seq<0, 2, 3>, cute::seq<9>, cute::seq<6, 8, 10>>,
        cf::Sm90AccFetch,                                       // 0 g
        cf::Sm90SrcFetch<bfloat16_t>,                           // 1 dres
        X,                                                      // 2 x
        RowVector<Tile, float>,                                 // 3 r
        ColumnVector<Tile, bfloat16_t, float>,                  // 4 γ
        RowVector<Tile, float>,                                 // 5 ZdZ
        ComputeNode<programs::RmsnormBackwardDx>,               // 6 dx
        ComputeNode<programs::NormalizedScaled>,                // 7 x r γ
        typename AuxStoreNode<EpilogueDesc, bfloat16_t>::type,  // 8 store h_out
        ComputeNode<programs::GradTimesNormalized>,             // 9 g x r
        DgammaPartial,                                          // 10 dγ partials
        ComputeNode<TakeFirst>>;                                // 11 D = dx
    static typename Callbacks::Arguments arguments(Args const& a) {
      return {{},
              {},
              {reinterpret_cast<const bfloat16_t*>(a.x), bfloat16_t(0), {a.ldx, cute::_1{}, 0}},
              {a.r, 0.0f, {}},
              {reinterpret_cast<const bfloat16_t*>(a.gamma), bfloat16_t(0), {}},
              {a.zdz, 0.0f, {}},
              {},
              {},
              {reinterpret_cast<bfloat16_t*>(a.h_out), {a.ldh, cute::_1{}, 0}},
              {},
              {a.dgamma_partials, 0.0f, {}},
              {}};
    }
  };
};

}  // namespace coda::kernel
