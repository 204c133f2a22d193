#pragma once
#include "coda/kernel/fusions/common.cuh"
#include "coda/kernel/nodes/fp8_tile_store.cuh"
#include "coda/kernel/nodes/load_ahead.cuh"
#include "coda/kernel/nodes/row_sum_squares.cuh"

namespace coda::kernel {

// F1 with h in FP8: x = acc + residual;  h = bf16(x ⊙ γ) quantized in 1x128 blocks and as the
// transposed 128x1 copy (Fp8TileStore);  S = Σ_tile x² (per-row partials);  D = x.
// The bf16 F1 (residual_rmsnorm.cuh) with its h store replaced: the same h, bit for bit, as F1's
// bf16 h through the cast kernel. The residual comes by LoadAhead (the consumer's own loads, one
// subtile ahead), not by a TMA ring: the staged tile (33 KB), D's two subtiles (16 KB) and no
// ring leave the mainloop five 32.5 KB stages, where a ring of three left it four.
template <>
struct FusionOf<Program::kResidualRmsnormFp8>
    : FusionTypes<void, bfloat16_t, ResidualRmsnormFp8Args> {
  template <class EpilogueDesc>
  struct Build {
    using Tile = typename EpilogueDesc::TileShape;
    using X = cf::Sm90EVT<ComputeNode<epilogue::Plus>, cf::Sm90AccFetch, LoadAhead<Tile>>;
    using H = cf::Sm90EVT<Fp8TileStore<Tile>,
                          cf::Sm90EVT<ComputeNode<epilogue::Multiplies>, cf::Sm90AccFetch,
                                      ColumnVector<Tile, bfloat16_t, float>>>;
    using S = cf::Sm90EVT<RowSumOfSquares<Tile>, cf::Sm90AccFetch>;
    using Callbacks = cf::Sm90SplitTreeVisitor<X, cf::Sm90AccFetch, H, S>;

    static typename Callbacks::Arguments arguments(Args const& a, GemmProblem const& p) {
      return {
          {{}, {reinterpret_cast<const bfloat16_t*>(p.c), p.ldc}, {}},  // x = acc + residual
          {{{}, {reinterpret_cast<const bfloat16_t*>(a.gamma), bfloat16_t(0), {}}, {}},  // x ⊙ γ
           {a.h, a.h_t}},            // quantize h
          {{}, {a.sumsq_partials}},  // Σ x² partials
          {}};                       // D = x
    }
  };
};

}  // namespace coda::kernel
