#pragma once
#include "coda/kernel/fusions/common.cuh"
#include "coda/kernel/nodes/half_width_store.cuh"

namespace coda::kernel {

// F2: z = r[m] · acc (D, interleaved g,u);  a = silu(z_g) · z_u (half width, own TMA store)
template <>
struct FusionOf<Program::kRmsnormSwiglu> : FusionTypes<void, bfloat16_t, RmsnormSwigluArgs> {
  template <class EpilogueDesc>
  struct Build {
    using Tile = typename EpilogueDesc::TileShape;
    using Z =
        cf::Sm90EVT<ComputeNode<epilogue::Multiplies>, cf::Sm90AccFetch, RowVector<Tile, float>>;
    using Callbacks = cf::Sm90EVT<HalfWidthStore<EpilogueDesc, epilogue::SwiGlu, bfloat16_t>, Z>;
    static typename Callbacks::Arguments arguments(Args const& a) {
      return {{{}, {a.r, 0.0f, {}}, {}}, {reinterpret_cast<bfloat16_t*>(a.a), a.lda}};
    }
  };
};

}  // namespace coda::kernel
