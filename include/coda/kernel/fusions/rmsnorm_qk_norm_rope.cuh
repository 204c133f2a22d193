#pragma once
#include "coda/kernel/fusions/common.cuh"
#include "coda/kernel/nodes/qk_norm_rope_store.cuh"

namespace coda::kernel {

// F3 with QK-norm (Qwen3): u = r[m] · acc staged over the tile; (q, k) = rope(γ ⊙ rmsnorm_head(u));
// v = u; qk_pre = u on the Q and K columns (QkNormRopeStore). No D: the node stores both outputs.
template <>
struct FusionOf<Program::kRmsnormQkNormRope> : FusionTypes<void, void, RmsnormQkNormRopeArgs> {
  template <class EpilogueDesc>
  struct Build {
    using Tile = typename EpilogueDesc::TileShape;
    using Callbacks = cf::Sm90EVT<QkNormRopeStore<Tile>, cf::Sm90AccFetch, RowVector<Tile, float>>;
    static typename Callbacks::Arguments arguments(Args const& a) {
      return {{}, {a.r, 0.0f, {}}, a};
    }
  };
};

}  // namespace coda::kernel
