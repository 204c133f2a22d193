#pragma once
#include "coda/kernel/fusions/common.cuh"
#include "coda/kernel/nodes/fp8_row_store.cuh"
#include "coda/kernel/nodes/fp8_tile_store.cuh"
#include "coda/kernel/paired_scheduler.cuh"

namespace coda::kernel {

// F2 with a in FP8: z = r[m] · acc (D, interleaved g,u);  a = bf16(silu(z_g) · z_u) quantized in
// 1x128 blocks and as the transposed 128x1 copy (Fp8TileStore, SwigluOfPairedTiles).
// A 128-column tile of z holds 64 columns of a, half a block: the scheduler runs each CTA's
// tiles in pairs along N (PairedAlongN), the first stages its half, the second completes and
// quantizes the block. a's codes are those of bf16 F2's a through the cast kernel, bit for bit.
template <>
struct FusionOf<Program::kRmsnormSwigluFp8> : FusionTypes<void, bfloat16_t, RmsnormSwigluFp8Args> {
  using Scheduler = PairedAlongN;
  template <class EpilogueDesc>
  struct Build {
    using Tile = typename EpilogueDesc::TileShape;
    using Z =
        cf::Sm90EVT<ComputeNode<epilogue::Multiplies>, cf::Sm90AccFetch, RowVector<Tile, float>>;
    using Callbacks = cf::Sm90EVT<Fp8TileStore<Tile, fp8_staging::SwigluOfPairedTiles>, Z>;
    static typename Callbacks::Arguments arguments(Args const& a) {
      return {{{}, {a.r, 0.0f, {}}, {}}, {a.a, a.a_t, a.a_copy, a.ld_a_copy}};
    }
  };
};

}  // namespace coda::kernel

namespace coda::kernel {

// F2 with a and z in FP8: as kRmsnormSwigluFp8, and z itself, rounded to bf16, quantized in its
// rows from the registers (Fp8RowStore: one 128-column tile of z is one 1x128 block of each of
// its rows; no staged tile, so the mainloop keeps kRmsnormSwigluFp8's stages), in front of a's
// store, which gets z's values unchanged. No D: B2 and the recomputed aᵀ read z's codes. z's
// codes are those of the bf16 z of kRmsnormSwigluFp8 through the cast kernel, bit for bit; a's
// are kRmsnormSwigluFp8's.
template <>
struct FusionOf<Program::kRmsnormSwigluFp8Z> : FusionTypes<void, void, RmsnormSwigluFp8ZArgs> {
  using Scheduler = PairedAlongN;
  template <class EpilogueDesc>
  struct Build {
    using Tile = typename EpilogueDesc::TileShape;
    using Z = typename FusionOf<Program::kRmsnormSwigluFp8>::template Build<EpilogueDesc>::Z;
    using ZStore = cf::Sm90EVT<Fp8RowStore<Tile>, Z>;
    using Callbacks = cf::Sm90EVT<Fp8TileStore<Tile, fp8_staging::SwigluOfPairedTiles>, ZStore>;
    static typename Callbacks::Arguments arguments(Args const& a) {
      const RmsnormSwigluFp8Args& f2 = a.f2;
      return {{{{}, {f2.r, 0.0f, {}}, {}}, a.z},
              {f2.a, f2.a_t, f2.a_copy, f2.ld_a_copy}};
    }
  };
};

}  // namespace coda::kernel
