#pragma once
#include "coda/kernel/fusions/common.cuh"
#include "coda/kernel/nodes/row_sum_squares.cuh"

namespace coda::kernel {

// F1's visitor tree, shared by the bf16 F1 (residual_rmsnorm.cuh) and F1 with FP8 h
// (residual_rmsnorm_fp8.cuh), which differ in how the residual arrives (ResidualLeaf) and where
// h goes (HOut):  x = acc + residual;  HOut(x ⊙ γ);  S = Σ_tile x² (per-row partials);  D = x.
// x is computed once and fed as the "accumulator" of the three output trees.
template <class Tile, class ResidualLeaf, class HOut>
struct ResidualRmsnormTree {
  using X = cf::Sm90EVT<ComputeNode<epilogue::Plus>, cf::Sm90AccFetch, ResidualLeaf>;
  using H = cf::Sm90EVT<HOut, cf::Sm90EVT<ComputeNode<epilogue::Multiplies>, cf::Sm90AccFetch,
                                          ColumnVector<Tile, bfloat16_t, float>>>;
  using S = cf::Sm90EVT<RowSumOfSquares<Tile>, cf::Sm90AccFetch>;
  using Callbacks = cf::Sm90SplitTreeVisitor<X, cf::Sm90AccFetch, H, S>;

  static typename Callbacks::Arguments arguments(typename ResidualLeaf::Arguments residual,
                                                 const bf16* gamma, typename HOut::Arguments h_out,
                                                 float* sumsq_partials) {
    return {
        {{}, residual, {}},                                                                  // x
        {{{}, {reinterpret_cast<const bfloat16_t*>(gamma), bfloat16_t(0), {}}, {}}, h_out},  // h
        {{}, {sumsq_partials}},  // Σ x² partials
        {}};                     // D = x
  }
};

}  // namespace coda::kernel
