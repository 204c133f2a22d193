#pragma once
#include "coda/kernel/fusions/common.cuh"
#include "coda/kernel/nodes/rmsnorm_backward.cuh"

namespace coda::kernel {

// B1 (RMSNorm backward in the epilogue of g = dz · W, operands kXW):
//   dx = dres (C) + r·(g·γ − x·r·ZdZ)  -> D (may alias C: an in-place accumulate into dres)
//   h_out = x·r·γ                       -> global (the node's own stores)
//   dγ partial[n, m-tile] = Σ g·x·r     -> per-column partials (PartialLayout::per_column)
// One node (nodes/rmsnorm_backward.cuh); dres, r, γ, ZdZ and x come from the stock load nodes.
// x is loaded by TMA from the epilogue's producer warp (Sm90AuxLoad, on C's pipeline), up to four
// subtiles ahead; until run 47 the node read it itself, one subtile ahead, and B1 QKV at K = 2048
// ran 1.2x its GEMM (docs/performance-notes.md).
template <>
struct FusionOf<Program::kRmsnormBackward> {
  using ElementC = bfloat16_t;
  using ElementD = bfloat16_t;
  using Args = RmsnormBackwardArgs;
  template <class EpilogueDesc>
  struct Build {
    using Tile = typename EpilogueDesc::TileShape;
    using XLoad = AuxLoadNode<EpilogueDesc, bfloat16_t>;
    using Callbacks =
        cf::Sm90EVT<RmsnormBackwardNode<Tile>, cf::Sm90SrcFetch<bfloat16_t>, RowVector<Tile, float>,
                    ColumnVector<Tile, bfloat16_t, float>, RowVector<Tile, float>,
                    typename XLoad::type>;
    static typename Callbacks::Arguments arguments(Args const& a) {
      return {{},
              {a.r, 0.0f, {}},
              {reinterpret_cast<const bfloat16_t*>(a.gamma), bfloat16_t(0), {}},
              {a.zdz, 0.0f, {}},
              XLoad::arguments(a.x, a.ldx),
              a};
    }
  };
};

}  // namespace coda::kernel
