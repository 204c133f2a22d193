#pragma once
// NOTE: sm90_visitor_tma_warpspecialized.hpp uses NumericArrayConverter without including it.
#include <cutlass/numeric_conversion.h>

#include "coda/epilogue/elementwise.hpp"
#include "coda/kernel/args.hpp"
#include "coda/kernel/nodes/common.cuh"
#include "coda/kernel/nodes/global_access.cuh"
#include "coda/kernel/nodes/row_partials.cuh"

namespace coda::kernel {

// ---------------------------------------------------------------------------------------------
// SwigluBackwardNode<CtaTile>: the whole B2 epilogue in one node; its children are da (the
// accumulator) and z (the source C, loaded by TMA: fusions/swiglu_backward.cuh). Output column n
// owns the interleaved pair (2n, 2n+1) of z and dz, read and written as one 32-bit element:
//   (g, u) = z pair;  dg, du, a = SwiGluBackward(g, u, da)
//   dz pair -> global memory (uint32, (M, N));  returns a (D);  ZdZ partial += g·dg + u·du
// dz goes from registers straight to global memory: each thread holds adjacent column pairs, so
// a quad of lanes covers 32 contiguous bytes of a row and every sector is used whole. Rows past M
// arrive as z = 0 (TMA fills out-of-bounds elements with zeros), which adds exactly 0 to ZdZ.
// ZdZ stays in one register per row over the tile and is merged across the lanes sharing the row
// once, at the end (per_row partials, like OnlineLseReduction).
// Requires N % 4 == 0 and 16-byte aligned rows; the op layer checks N % 8 == 0 for TMA already.
// ---------------------------------------------------------------------------------------------
template <class CtaTile>
struct SwigluBackwardNode : ConsumerOnlyNode<SwigluBackwardArgs> {
  using Params = SwigluBackwardArgs;
  using Arguments = Params;

  template <class ProblemShape>
  static bool can_implement(ProblemShape const& shape, Arguments const& a) {
    auto [M, N, K, L] = cute::append<4>(shape, 1);
    return a.z && a.dz && a.zdz_partials && N % 4 == 0 && a.ldz % 4 == 0 && a.lddz % 4 == 0;
  }

  CUTLASS_HOST_DEVICE SwigluBackwardNode() {}
  CUTLASS_HOST_DEVICE SwigluBackwardNode(Params const& p, SharedStorage const&) : params(p) {}
  Params params;

  template <class GTensor, class CTensor, class RowState, class CoordTensor, class Residue,
            class Lanes, class ShapeMNL>
  struct ConsumerStoreCallbacks : cf::EmptyConsumerStoreCallbacks {
    CUTLASS_DEVICE ConsumerStoreCallbacks(GTensor gdz, CTensor cz, RowState zdz, CoordTensor c,
                                          Residue r, Lanes lanes, ShapeMNL shape, int tile_m,
                                          int tile_n, Params const& p)
        : tC_gDz(gdz), tC_cZ(cz), rZdZ(zdz), tCcD(c), residue(r), lanes(lanes), shape_mnl(shape),
          tile_n(tile_n),
          full_tile(tile_inside<CtaTile>(tile_m, tile_n, int(cute::get<0>(shape)),
                                         int(cute::get<1>(shape)))),
          params(p) {}
    GTensor tC_gDz;      // (CPY,CPY_M,CPY_N,EPI_M,EPI_N) global dz of this tile
    CTensor tC_cZ;       // its absolute (m, n, l) coordinates
    RowState rZdZ;       // one slot per row (stride 0 along N)
    CoordTensor tCcD;    // thread-relative coordinates (for the row partials)
    Residue residue;
    Lanes lanes;
    ShapeMNL shape_mnl;
    int tile_n;
    bool full_tile;  // the tile lies wholly inside (M, N): no per-pair bounds checks
    Params const& params;

    template <class ElementAccumulator, class ElementInput, class ElementZ, int F>
    CUTLASS_DEVICE cutlass::Array<float, F> visit(cutlass::Array<ElementAccumulator, F> const&,
                                                  int epi_v, int epi_m, int epi_n,
                                                  cutlass::Array<ElementInput, F> const& da,
                                                  cutlass::Array<ElementZ, F> const& z) {
      // The collective hands C over in its own register type; a converted (float) copy of the
      // packed pairs would be garbage, so insist on the raw 32-bit words.
      static_assert(std::is_same_v<ElementZ, uint32_t>, "z must arrive as raw bf16 pairs");
      static_assert(F % 2 == 0, "fragments hold whole column pairs");
      auto g_dz = tC_gDz(cute::_, cute::_, cute::_, epi_m, epi_n);
      auto c = tC_cZ(cute::_, cute::_, cute::_, epi_m, epi_n);
      uint32_t dz[F];
      auto zdz_mn = rZdZ(cute::_, cute::_, cute::_, epi_m, epi_n);
      cutlass::Array<float, F> a;
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < F; ++i) {
        const float2 gu = unpack_bf16_pair(z[i]);
        float dg, du;
        epilogue::SwiGluBackward{}(gu.x, gu.y, static_cast<float>(da[i]), dg, du, a[i]);
        dz[i] = pack_bf16_pair(dg, du);
        zdz_mn(epi_v * F + i) += gu.x * dg + gu.y * du;
      }
      // dz straight to global memory, one 64-bit store per two column pairs: a pair starts at an
      // even column and N % 4 == 0, so it is wholly inside the problem or wholly outside; only its
      // row can be past M.
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < F; i += 2) {
        const int e = epi_v * F + i;
        if (full_tile || cute::elem_less(c(e), shape_mnl))
          *reinterpret_cast<uint2*>(&g_dz(e)) = make_uint2(dz[i], dz[i + 1]);
      }
      return a;
    }

    template <class STensor, class SyncFn, class VTensor>
    CUTLASS_DEVICE void reduce(STensor&&, SyncFn const&, int, int, bool is_last_iteration,
                               VTensor) {
      if (!is_last_iteration) return;
      auto f = cute::filter(rZdZ);
      lanes.for_each_row_merge_step([&](int lane_delta) {
        CUTLASS_PRAGMA_UNROLL
        for (int i = 0; i < cute::size(f); ++i)
          f(i) += __shfl_down_sync(0xffffffff, f(i), lane_delta);
      });
      if (!lanes.row_lane) return;
      const auto target = row_partials_target<CtaTile>(
          int(cute::get<0>(shape_mnl)), int(cute::get<1>(shape_mnl)), residue, tile_n);
      for_each_row_slot(tCcD, target, [&](int64_t idx, int i, int epi_m) {
        params.zdz_partials[idx] = rZdZ(cute::_, cute::_, cute::_, epi_m, _0{})(i);
      });
    }
  };

  template <bool ReferenceSrc, class... Args>
  CUTLASS_DEVICE auto get_consumer_store_callbacks(cf::ConsumerStoreArgs<Args...> const& args) {
    using namespace cute;
    auto [M, N, K, L] = args.problem_shape_mnkl;
    auto [m, n, k, l] = args.tile_coord_mnkl;
    auto shape_mnl = make_shape(M, N, L);
    Tensor tC_gDz = partition_tile<ReferenceSrc>(args, shape_mnl, params.dz, params.lddz);
    Tensor tC_cZ = partition_coords<ReferenceSrc>(args, shape_mnl);
    auto rZdZ = make_row_state<ReferenceSrc, CtaTile>(args, 0.0f);
    auto lanes = warp_lanes<ReferenceSrc>(args);
    return ConsumerStoreCallbacks<decltype(tC_gDz), decltype(tC_cZ), decltype(rZdZ),
                                  decltype(args.tCcD), decltype(args.residue_tCcD),
                                  decltype(lanes), decltype(shape_mnl)>(
        tC_gDz, tC_cZ, rZdZ, args.tCcD, args.residue_tCcD, lanes, shape_mnl, int(m), int(n),
        params);
  }
};

}  // namespace coda::kernel
