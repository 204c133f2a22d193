#pragma once
#include "coda/kernel/fusions/common.cuh"
#include "coda/kernel/nodes/online_lse.cuh"

namespace coda::kernel {

// F4: ℓ = r[m] · acc;  online (max, sumexp) partials over valid columns;  pick ℓ[m, target[m]]
template <class ElementD_>
struct RmsnormLseFusion {
  using ElementC = void;
  using ElementD = ElementD_;
  using Args = RmsnormLseArgs;
  template <class EpilogueDesc>
  struct Build {
    using Tile = typename EpilogueDesc::TileShape;
    using L =
        cf::Sm90EVT<ComputeNode<epilogue::Multiplies>, cf::Sm90AccFetch, RowVector<Tile, float>>;
    using Callbacks = cf::Sm90EVT<OnlineLseReduction<Tile, int64_t>, L, RowVector<Tile, int64_t>>;
    static typename Callbacks::Arguments arguments(Args const& a) {
      return {{{}, {a.r, 0.0f, {}}, {}},
              {a.targets, int64_t(-1), {}},
              {a.max_partials, a.sum_partials, a.target_logit}};
    }
  };
};
template <>
struct FusionOf<Program::kRmsnormLse> : RmsnormLseFusion<void> {};
template <>
struct FusionOf<Program::kRmsnormLseLogits> : RmsnormLseFusion<bfloat16_t> {};

}  // namespace coda::kernel
