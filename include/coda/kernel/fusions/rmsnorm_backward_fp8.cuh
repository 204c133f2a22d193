#pragma once
#include "coda/kernel/fusions/common.cuh"
#include "coda/kernel/nodes/fp8_tile_store.cuh"
#include "coda/kernel/nodes/load_ahead.cuh"
#include "coda/kernel/nodes/rmsnorm_backward.cuh"

namespace coda::kernel {

// B1 over FP8 operands (g = dz · W from dz's 1x128 codes and Wᵀ's 128x128 codes):
//   dx = dres (C) + r·(g·γ − x·r·ZdZ)  -> D (bf16; may alias C) and, rounded to bf16, quantized
//                                         in 1x128 blocks and as dxᵀ (Fp8TileStore)
//   dγ partial[n, m-tile] = Σ g·x·r     -> per-column partials (PartialLayout::per_column)
// B1's node on the cooperative tile (x by LoadAhead) without h: the FP8 forward keeps F1's hᵀ
// for the weight gradient. dx's codes are those of bf16 B1's dx through the cast kernel.
template <>
struct FusionOf<Program::kRmsnormBackwardFp8>
    : FusionTypes<bfloat16_t, bfloat16_t, RmsnormBackwardFp8Args> {
  static constexpr int kStagesC = 3;
  template <class EpilogueDesc>
  struct Build {
    using Tile = typename EpilogueDesc::TileShape;
    using Dx = cf::Sm90EVT<RmsnormBackwardNode<Tile, WithoutOutput>, cf::Sm90SrcFetch<bfloat16_t>,
                           RowVector<Tile, float>, ColumnVector<Tile, bfloat16_t, float>,
                           RowVector<Tile, float>, LoadAhead<Tile>>;
    using Callbacks = cf::Sm90EVT<Fp8TileStore<Tile>, Dx>;
    static typename Callbacks::Arguments arguments(Args const& a) {
      const RmsnormBackwardArgs& b = a.b1;
      return {{{},
               {b.r, 0.0f, {}},
               {reinterpret_cast<const bfloat16_t*>(b.gamma), bfloat16_t(0), {}},
               {b.zdz, 0.0f, {}},
               {reinterpret_cast<const bfloat16_t*>(b.x), b.ldx},
               b},
              {a.dx, a.dx_t}};
    }
  };
};

}  // namespace coda::kernel
