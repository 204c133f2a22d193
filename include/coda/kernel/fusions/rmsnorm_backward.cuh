#pragma once
#include "coda/kernel/fusions/common.cuh"
#include "coda/kernel/nodes/load_ahead.cuh"
#include "coda/kernel/nodes/rmsnorm_backward.cuh"

namespace coda::kernel {

// B1 (RMSNorm backward in the epilogue of g = dz · W, operands kXW):
//   dx = dres (C) + r·(g·γ − x·r·ZdZ)  -> D (may alias C: an in-place accumulate into dres;
//                                          without dres, args.dres false, C is not read)
//   h_out = x·r·γ                       -> global
//   dγ partial[n, m-tile] = Σ g·x·r     -> per-column partials (PartialLayout::per_column)
// One node (nodes/rmsnorm_backward.cuh); dres by OptionalSource, r, γ and ZdZ from the stock
// load nodes. x and
// h go one of two ways:
//   - pingpong (64-row epilogue subtiles): x by Sm90AuxLoad, TMA from the epilogue's producer
//     warp on C's pipeline, StagesC subtiles ahead; h by a stock bf16 aux store held in the node
//     (TMA, in step with D's stores). Three C stages keep the epilogue at 32 KB, so the mainloop
//     keeps its six stages. B1 QKV at 1B runs 1.08-1.09x its GEMM under ncu so, 1.11-1.13x with h
//     stored from registers and 1.2x with the consumer reading x itself (docs/experiments.md);
//   - cooperative 256x128: x by LoadAhead (nodes/load_ahead.cuh), the consumer's own loads one
//     subtile ahead, and h from registers: neither takes shared memory. An x ring's 32 KB would
//     cost that configuration one of its four 48 KB mainloop stages (1-4% slower, measured).
//     kStagesC is per fusion, so its C ring has three stages too (24 KB; four mainloop stages
//     either way).
template <>
struct FusionOf<Program::kRmsnormBackward>
    : FusionTypes<bfloat16_t, bfloat16_t, RmsnormBackwardArgs> {
  static constexpr int kStagesC = 3;
  template <class EpilogueDesc>
  struct Build {
    using Tile = typename EpilogueDesc::TileShape;
    static constexpr bool kXByTma = cute::size<0>(typename EpilogueDesc::EpilogueTile{}) == 64;
    using XTma = AuxLoadNode<EpilogueDesc, bfloat16_t>;
    using XLoad = std::conditional_t<kXByTma, typename XTma::type, LoadAhead<Tile>>;
    using HStore =
        std::conditional_t<kXByTma, typename AuxStoreNode<EpilogueDesc, bfloat16_t>::type, void>;
    using Callbacks =
        cf::Sm90EVT<RmsnormBackwardNode<Tile, HStore>, OptionalSource, RowVector<Tile, float>,
                    ColumnVector<Tile, bfloat16_t, float>, RowVector<Tile, float>, XLoad>;
    static typename XLoad::Arguments x_arguments(Args const& a) {
      if constexpr (kXByTma) {
        return XTma::arguments(a.x, a.ldx);
      } else {
        return {reinterpret_cast<const bfloat16_t*>(a.x), a.ldx};
      }
    }
    static typename Callbacks::Arguments arguments(Args const& a) {
      return {{a.dres},
              {a.r, 0.0f, {}},
              {reinterpret_cast<const bfloat16_t*>(a.gamma), bfloat16_t(0), {}},
              {a.zdz, 0.0f, {}},
              x_arguments(a),
              a};
    }
  };
};

}  // namespace coda::kernel
