#pragma once
#include "coda/kernel/fusions/common.cuh"
#include "coda/kernel/nodes/fp8_pair_decode.cuh"
#include "coda/kernel/nodes/fp8_tile_store.cuh"
#include "coda/kernel/nodes/swiglu_backward.cuh"

namespace coda::kernel {

// B2 over FP8 operands (da = dx_out · W_down from dx_out's 1x128 codes and W_downᵀ's 128x128
// codes; N = I):
//   (g, u) = z pair;  dg, du = SwiGluBackward(g, u, da);  ZdZ partial += g·dg + u·du
//   dz = (dg, du) rounded to bf16 pairs, quantized in 1x128 blocks along its 2I columns and as
//   dzᵀ (Fp8TileStore, PairsInHalves: a 128-column tile of da is 256 columns of dz, two blocks,
//   each quantized once its two subtiles are staged)
// z is the kernel's C (32-bit pairs, TMA by the epilogue's producer warp, as B2); no D and no a:
// the FP8 forward keeps F2's aᵀ for the down-projection's weight gradient. dz's codes are those
// of bf16 B2's dz through the cast kernel.
template <>
struct FusionOf<Program::kSwigluBackwardFp8> : FusionTypes<uint32_t, void, SwigluBackwardFp8Args> {
  // Two C stages (z's subtiles, 16 KB each) leave the mainloop four stages beside the staged
  // tile; three left it three.
  static constexpr int kStagesC = 2;
  static KernelOperands operands(Args const& a, GemmProblem const&) {
    return {a.z, a.ldz, nullptr, 0};
  }
  template <class EpilogueDesc>
  struct Build {
    using Tile = typename EpilogueDesc::TileShape;
    using Dz = cf::Sm90EVT<SwigluBackwardNode<Tile, WithoutOutput>, cf::Sm90AccFetch,
                           cf::Sm90SrcFetch<uint32_t>>;
    using Callbacks = cf::Sm90EVT<Fp8TileStore<Tile, fp8_staging::PairsInHalves>, Dz>;
    static typename Callbacks::Arguments arguments(Args const& a) {
      SwigluBackwardArgs b;
      b.z = a.z;
      b.ldz = a.ldz;
      b.zdz_partials = a.zdz_partials;
      return {{{}, {}, {b, nullptr, 0}}, {a.dz, a.dz_t, a.dz_copy, a.ld_dz_copy}};
    }
  };
};

// B2 with z in FP8 (F2's kRmsnormSwigluFp8Z codes): as kSwigluBackwardFp8, z the kernel's C as
// 16-bit e4m3 code pairs (half B2's C bytes), decoded with their block scales (Fp8PairDecode)
// into the bf16 pairs SwigluBackwardNode reads. Bit for bit kSwigluBackwardFp8 given the decoded
// z in bf16 (exact there).
template <>
struct FusionOf<Program::kSwigluBackwardFp8Z>
    : FusionTypes<uint16_t, void, SwigluBackwardFp8ZArgs> {
  // 16-bit C subtiles (8 KB each). The builder marks C's ring for reuse as D's (16-bit C, the
  // store node's bf16 stand-in for D), which the collective drops for want of a D; gemm.cuh's
  // check of that reuse asks C for more stages than D's two, so C takes three.
  static constexpr int kStagesC = 3;
  static KernelOperands operands(Args const& a, GemmProblem const&) {
    return {a.z, a.ldz, nullptr, 0};
  }
  template <class EpilogueDesc>
  struct Build {
    using Tile = typename EpilogueDesc::TileShape;
    using Z = cf::Sm90EVT<Fp8PairDecode<Tile>, cf::Sm90SrcFetch<uint16_t>>;
    using Dz = cf::Sm90EVT<SwigluBackwardNode<Tile, WithoutOutput>, cf::Sm90AccFetch, Z>;
    using Callbacks = cf::Sm90EVT<Fp8TileStore<Tile, fp8_staging::PairsInHalves>, Dz>;
    static typename Callbacks::Arguments arguments(Args const& a) {
      SwigluBackwardArgs b;
      // The node reads z from its child; its z and ldz are only checked (present, rows 16-byte
      // aligned: ldz pairs of 2 bytes, a multiple of 8, is a multiple of 4).
      b.z = reinterpret_cast<const uint32_t*>(a.z);
      b.ldz = a.ldz;
      b.zdz_partials = a.zdz_partials;
      return {{{}, {{}, {a.z_scales, a.ld_z_scales}}, {b, nullptr, 0}}, {a.dz, a.dz_t, nullptr, 0}};
    }
  };
};

}  // namespace coda::kernel
