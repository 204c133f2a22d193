#pragma once
#include "coda/kernel/fusions/common.cuh"
#include "coda/kernel/nodes/fp8_tile_store.cuh"
#include "coda/kernel/nodes/load_ahead.cuh"
#include "coda/kernel/nodes/rmsnorm_backward.cuh"

namespace coda::kernel {

// B1 over FP8 operands (g = dz · W from dz's 1x128 codes and Wᵀ's 128x128 codes):
//   dx = dres (C) + r·(g·γ − x·r·ZdZ)   -> D (bf16; may alias C; without dres C is not read)
//   h_out = x·r·γ, rounded to bf16      -> its transposed 128x1 copy quantized (the weight
//                                          gradient dW = dzᵀ · h_out contracts it over tokens)
//   dγ partial[n, m-tile] = Σ g·x·r     -> per-column partials (PartialLayout::per_column)
// B1's node on the cooperative tile (x by LoadAhead), its h held by a quantizing store
// (Fp8TileStore: staged over the tile, quantized at the tile's end). h_out is the normalized
// input r·(x ⊙ γ): the forward's F1 writes x ⊙ γ, whose r is known only after the fold, so the
// weight gradient's operand comes from here. Its codes are those of bf16 B1's h_out through the
// cast kernel.
template <>
struct FusionOf<Program::kRmsnormBackwardFp8>
    : FusionTypes<bfloat16_t, bfloat16_t, RmsnormBackwardFp8Args> {
  static constexpr int kStagesC = 3;
  template <class EpilogueDesc>
  struct Build {
    using Tile = typename EpilogueDesc::TileShape;
    using Node = RmsnormBackwardNode<Tile, Fp8TileStore<Tile>>;
    using Callbacks = cf::Sm90EVT<Node, OptionalSource, RowVector<Tile, float>,
                                  ColumnVector<Tile, bfloat16_t, float>, RowVector<Tile, float>,
                                  LoadAhead<Tile, true>>;
    static typename Callbacks::Arguments arguments(Args const& a) {
      const RmsnormBackwardArgs& b = a.b1;
      return {{b.dres},
              {b.r, 0.0f, {}},
              {reinterpret_cast<const bfloat16_t*>(b.gamma), bfloat16_t(0), {}},
              {b.zdz, 0.0f, {}},
              {reinterpret_cast<const bfloat16_t*>(b.x), b.ldx},
              {b, {Fp8Output{}, a.h_t, a.h_copy, a.ld_h_copy}}};
    }
  };
};

}  // namespace coda::kernel
