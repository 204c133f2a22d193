#pragma once
#include "coda/kernel/fusions/common.cuh"
#include "coda/kernel/nodes/rmsnorm_backward.cuh"

namespace coda::kernel {

// B1 (RMSNorm backward in the epilogue of g = dz · W, operands kXW):
//   dx = dres (C) + r·(g·γ − x·r·ZdZ)  -> D (may alias C: an in-place accumulate into dres)
//   h_out = x·r·γ                       -> global (the node's own stores)
//   dγ partial[n, m-tile] = Σ g·x·r     -> per-column partials (PartialLayout::per_column)
// One node (nodes/rmsnorm_backward.cuh); dres, r, γ and ZdZ come from the stock load nodes.
template <>
struct FusionOf<Program::kRmsnormBackward> {
  using ElementC = bfloat16_t;
  using ElementD = bfloat16_t;
  using Args = RmsnormBackwardArgs;
  template <class EpilogueDesc>
  struct Build {
    using Tile = typename EpilogueDesc::TileShape;
    using Callbacks =
        cf::Sm90EVT<RmsnormBackwardNode<Tile>, cf::Sm90SrcFetch<bfloat16_t>, RowVector<Tile, float>,
                    ColumnVector<Tile, bfloat16_t, float>, RowVector<Tile, float>>;
    static typename Callbacks::Arguments arguments(Args const& a) {
      return {{},
              {a.r, 0.0f, {}},
              {reinterpret_cast<const bfloat16_t*>(a.gamma), bfloat16_t(0), {}},
              {a.zdz, 0.0f, {}},
              a};
    }
  };
};

}  // namespace coda::kernel
