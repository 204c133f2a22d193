#pragma once
#include "coda/kernel/fusions/residual_rmsnorm_tree.cuh"
#include "coda/kernel/nodes/fp8_tile_store.cuh"
#include "coda/kernel/nodes/load_ahead.cuh"

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
    using Tree = ResidualRmsnormTree<Tile, LoadAhead<Tile, true>, Fp8TileStore<Tile>>;
    using Callbacks = typename Tree::Callbacks;

    static typename Callbacks::Arguments arguments(Args const& a, GemmProblem const& p) {
      return Tree::arguments({reinterpret_cast<const bfloat16_t*>(p.c), p.ldc}, a.gamma,
                             {a.h, a.h_t}, a.sumsq_partials);
    }
  };
};

}  // namespace coda::kernel
