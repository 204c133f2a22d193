#pragma once
#include <cuda_bf16.h>

#include "coda/epilogue/elementwise.hpp"
#include "coda/kernel/fusions/common.cuh"
#include "coda/kernel/nodes/pairwise_compute.cuh"

namespace coda::kernel {

// B2 (SwiGLU backward in the epilogue of da = dx_out · W_down, operands kXW; output column n owns
// the interleaved pair (2n, 2n+1) of z and dz, read and written as one 32-bit element):
//   (g, u) = z pair;  dg, du, a = SwiGluBackward(g, u, da)
//   dz pair -> aux store (uint32, (M, I));  a -> D (bf16, (M, I));  ZdZ partial += g·dg + u·du
// The input tree packs da (fp32 bits, high word) with the raw z pair (low word) into one 64-bit
// lane value, so the three output trees share one load of z and one accumulator read.
namespace swiglu_backward {

CUTLASS_DEVICE float2 unpack_pair(uint32_t bits) {
  __nv_bfloat162 v;
  memcpy(&v, &bits, 4);
  return __bfloat1622float2(v);
}
CUTLASS_DEVICE uint32_t pack_pair(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  uint32_t bits;
  memcpy(&bits, &v, 4);
  return bits;
}
CUTLASS_DEVICE void unpack(uint64_t packed, float& da, float& g, float& u) {
  da = __uint_as_float(static_cast<uint32_t>(packed >> 32));
  const float2 gu = unpack_pair(static_cast<uint32_t>(packed));
  g = gu.x;
  u = gu.y;
}

struct Pack {  // (da fp32, z pair) -> one 64-bit value
  struct Arguments {};
  template <int F>
  CUTLASS_DEVICE cutlass::Array<uint64_t, F> operator()(Arguments const&,
                                                        cutlass::Array<float, F> const& da,
                                                        cutlass::Array<uint32_t, F> const& z) const {
    cutlass::Array<uint64_t, F> out;
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < F; ++i)
      out[i] = (static_cast<uint64_t>(__float_as_uint(da[i])) << 32) | z[i];
    return out;
  }
};

// Which of SwiGluBackward's results an output tree takes.
enum class Output { kDz, kA, kZdZ };
template <Output O>
struct Take {
  struct Arguments {};
  template <int F>
  CUTLASS_DEVICE auto operator()(Arguments const&, cutlass::Array<uint64_t, F> const& p) const {
    using T = std::conditional_t<O == Output::kDz, uint32_t, float>;
    cutlass::Array<T, F> out;
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < F; ++i) {
      float da, g, u, dg, du, a;
      unpack(p[i], da, g, u);
      epilogue::SwiGluBackward{}(g, u, da, dg, du, a);
      if constexpr (O == Output::kDz) out[i] = pack_pair(dg, du);
      if constexpr (O == Output::kA) out[i] = a;
      if constexpr (O == Output::kZdZ) out[i] = g * dg + u * du;
    }
    return out;
  }
};

}  // namespace swiglu_backward

template <>
struct FusionOf<Program::kSwigluBackward> {
  using ElementC = void;
  using ElementD = bfloat16_t;
  using Args = SwigluBackwardArgs;
  template <class EpilogueDesc>
  struct Build {
    using Tile = typename EpilogueDesc::TileShape;
    using ZLoad = cutlass::epilogue::collective::detail::AuxLoadDescriptor<
        EpilogueDesc, cutlass::layout::RowMajor, uint32_t>;
    using DzStore = cutlass::epilogue::collective::detail::AuxStoreDescriptor<
        EpilogueDesc, cutlass::layout::RowMajor, uint32_t>;
    using Z = cf::Sm90AuxLoad<ZLoad::Stages, typename EpilogueDesc::EpilogueTile, uint32_t,
                              typename ZLoad::Stride, typename ZLoad::SmemLayoutAtom,
                              typename ZLoad::CopyOpS2R>;
    template <swiglu_backward::Output O, class Element>
    using Take = cf::Sm90EVT<PairwiseCompute<swiglu_backward::Take<O>, Element>, cf::Sm90AccFetch>;
    using Packed =
        cf::Sm90EVT<PairwiseCompute<swiglu_backward::Pack, uint64_t>, cf::Sm90AccFetch, Z>;
    using Dz = cf::Sm90EVT<cf::Sm90AuxStore<DzStore::Stages, typename EpilogueDesc::EpilogueTile,
                                            uint32_t, kRound, typename DzStore::Stride,
                                            typename DzStore::SmemLayoutAtom,
                                            typename DzStore::CopyOpR2S>,
                           Take<swiglu_backward::Output::kDz, uint32_t>>;
    using ZdZ = cf::Sm90EVT<RowPartialSum<Tile>, Take<swiglu_backward::Output::kZdZ, float>>;
    using Callbacks =
        cf::Sm90SplitTreeVisitor<Packed, Take<swiglu_backward::Output::kA, float>, Dz, ZdZ>;

    static typename Callbacks::Arguments arguments(Args const& a) {
      return {{{}, {a.z, 0u, {a.ldz, cute::_1{}, 0}}, {}},  // pack (da, z pair)
              {{{}, {}}, {a.dz, {a.lddz, cute::_1{}, 0}}},  // dz pairs
              {{{}, {}}, {a.zdz_partials, 0.0f, {}}},       // ZdZ partials
              {{}, {}}};                                     // D = a
    }
  };
};

}  // namespace coda::kernel
