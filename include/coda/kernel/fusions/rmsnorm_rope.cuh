#pragma once
#include "coda/kernel/fusions/common.cuh"
#include "coda/kernel/nodes/pairwise_compute.cuh"
#include "coda/programs/rope.hpp"

namespace coda::kernel {

// F3: z = r[m] · acc + b[n]; (q, k) = rope(z, pos[m], freq[n]); v = z (freq = 0 on V columns;
// b = 0 without a bias: the broadcast's null default)
struct RopeFragment {
  struct Arguments {};
  template <int F>
  CUTLASS_DEVICE cutlass::Array<float, F> operator()(
      Arguments const&, cutlass::Array<float, F> const& acc, cutlass::Array<float, F> const& r,
      cutlass::Array<float, F> const& bias, cutlass::Array<int32_t, F> const& pos,
      cutlass::Array<uint32_t, F> const& hi, cutlass::Array<uint32_t, F> const& lo) const {
    cutlass::Array<float, F> out;
    CUTLASS_PRAGMA_UNROLL
    for (int j = 0; j < F / 2; ++j) {
      float c, s;
      programs::rope_cos_sin<float>(pos[2 * j], programs::RopeFrequency{hi[2 * j], lo[2 * j]}, c,
                                    s);
      epilogue::RopeRotate{}(acc[2 * j] * r[2 * j] + bias[2 * j],
                             acc[2 * j + 1] * r[2 * j] + bias[2 * j + 1], c, s, out[2 * j],
                             out[2 * j + 1]);
    }
    return out;
  }
};

template <>
struct FusionOf<Program::kRmsnormRope> : FusionTypes<void, bfloat16_t, RmsnormRopeArgs> {
  template <class EpilogueDesc>
  struct Build {
    using Tile = typename EpilogueDesc::TileShape;
    using Callbacks =
        cf::Sm90EVT<PairwiseCompute<RopeFragment, float>, cf::Sm90AccFetch, RowVector<Tile, float>,
                    ColumnVector<Tile, bfloat16_t, float>, RowVector<Tile, int32_t>,
                    ColumnVector<Tile, uint32_t>, ColumnVector<Tile, uint32_t>>;
    static typename Callbacks::Arguments arguments(Args const& a) {
      return {{},
              {a.r, 0.0f, {}},
              {reinterpret_cast<bfloat16_t const*>(a.bias), bfloat16_t(0), {}},
              {a.pos, 0, {}},
              {a.freq_hi, 0u, {}},
              {a.freq_lo, 0u, {}},
              {}};
    }
  };
};

}  // namespace coda::kernel
