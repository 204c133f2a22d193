#pragma once
#include "coda/kernel/fusions/common.cuh"
#include "coda/kernel/nodes/load_ahead.cuh"
#include "coda/kernel/nodes/rmsnorm_backward.cuh"

namespace coda::kernel {

// B1 (RMSNorm backward in the epilogue of g = dz · W, operands kXW):
//   dx = dres (C) + r·(g·γ − x·r·ZdZ)  -> D (may alias C: an in-place accumulate into dres)
//   h_out = x·r·γ                       -> global (the node's own stores)
//   dγ partial[n, m-tile] = Σ g·x·r     -> per-column partials (PartialLayout::per_column)
// One node (nodes/rmsnorm_backward.cuh); dres, r, γ and ZdZ come from the stock load nodes, x
// from one of two leaves:
//   - pingpong (64-row epilogue subtiles): Sm90AuxLoad, TMA from the epilogue's producer warp on
//     C's pipeline, up to four subtiles ahead. When the consumer read x itself one subtile ahead
//     (until run 47), B1 QKV at K = 2048 ran 1.2x its GEMM;
//   - cooperative 256x128: LoadAhead (nodes/load_ahead.cuh), the consumer's own loads one
//     subtile ahead. The TMA ring's 32 KB cost that configuration one of its four 48 KB mainloop
//     stages, and it ran 1-4% slower (run 47, docs/performance-notes.md).
template <>
struct FusionOf<Program::kRmsnormBackward> {
  using ElementC = bfloat16_t;
  using ElementD = bfloat16_t;
  using Args = RmsnormBackwardArgs;
  template <class EpilogueDesc>
  struct Build {
    using Tile = typename EpilogueDesc::TileShape;
    static constexpr bool kXByTma = cute::size<0>(typename EpilogueDesc::EpilogueTile{}) == 64;
    using XTma = AuxLoadNode<EpilogueDesc, bfloat16_t>;
    using XLoad = std::conditional_t<kXByTma, typename XTma::type, LoadAhead<Tile>>;
    using Callbacks =
        cf::Sm90EVT<RmsnormBackwardNode<Tile>, cf::Sm90SrcFetch<bfloat16_t>, RowVector<Tile, float>,
                    ColumnVector<Tile, bfloat16_t, float>, RowVector<Tile, float>, XLoad>;
    static typename XLoad::Arguments x_arguments(Args const& a) {
      if constexpr (kXByTma) {
        return XTma::arguments(a.x, a.ldx);
      } else {
        return {reinterpret_cast<const bfloat16_t*>(a.x), a.ldx};
      }
    }
    static typename Callbacks::Arguments arguments(Args const& a) {
      return {{},
              {a.r, 0.0f, {}},
              {reinterpret_cast<const bfloat16_t*>(a.gamma), bfloat16_t(0), {}},
              {a.zdz, 0.0f, {}},
              x_arguments(a),
              a};
    }
  };
};

}  // namespace coda::kernel
