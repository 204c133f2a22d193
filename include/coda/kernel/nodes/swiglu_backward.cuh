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
// SwigluBackwardNode<CtaTile>: the whole B2 epilogue in one node; its one child is da (the
// accumulator). Output column n owns the interleaved pair (2n, 2n+1) of z and dz, read and written
// as one 32-bit element:
//   (g, u) = z pair;  dg, du, a = SwiGluBackward(g, u, da)
//   dz pair -> global memory (uint32, (M, N));  returns a (D);  ZdZ partial += g·dg + u·du
// z and dz move between global memory and registers directly (no shared-memory staging): each
// thread holds adjacent column pairs, so a quad of lanes covers 32 contiguous bytes of a row and
// every sector is used whole. L2 is asked for the tile's z when its epilogue starts; subtile loads
// run one subtile ahead where registers allow; dz is stored from visit. ZdZ stays in one register
// per row over the tile and is merged across the lanes sharing the row once, at the end (per_row
// partials, like OnlineLseReduction).
// Requires N % 4 == 0 and 16-byte aligned rows; the op layer checks N % 8 == 0 for TMA already.
// ---------------------------------------------------------------------------------------------
template <class CtaTile>
struct SwigluBackwardNode : ConsumerOnlyNode<SwigluBackwardArgs> {
  static constexpr int kZBuffers = cute::size<1>(CtaTile{}) > 128 ? 1 : 2;
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

  template <class GTensor, class CTensor, class ZTensor, class RowState, class CoordTensor,
            class Residue, class Lanes, class ShapeMNL>
  struct ConsumerStoreCallbacks : cf::EmptyConsumerStoreCallbacks {
    CUTLASS_DEVICE ConsumerStoreCallbacks(GTensor gz, GTensor gdz, CTensor cz, ZTensor rz,
                                          RowState zdz, CoordTensor c, Residue r,
                                          Lanes lanes, ShapeMNL shape, int tile_m, int tile_n,
                                          int thread_idx, int num_threads, Params const& p)
        : tC_gZ(gz), tC_gDz(gdz), tC_cZ(cz), tC_rZ(rz), rZdZ(zdz), tCcD(c),
          residue(r), lanes(lanes), shape_mnl(shape), tile_m(tile_m), tile_n(tile_n),
          full_tile(tile_inside<CtaTile>(tile_m, tile_n, int(cute::get<0>(shape)),
                                         int(cute::get<1>(shape)))),
          thread_idx(thread_idx), num_threads(num_threads), params(p) {}
    GTensor tC_gZ, tC_gDz;  // (CPY,CPY_M,CPY_N,EPI_M,EPI_N) global z / dz of this tile
    CTensor tC_cZ;          // their absolute (m, n, l) coordinates
    ZTensor tC_rZ;          // (CPY,CPY_M,CPY_N,kZBuffers) subtiles of z in registers
    RowState rZdZ;          // one slot per row (stride 0 along N)
    CoordTensor tCcD;       // thread-relative coordinates (for the row partials)
    Residue residue;
    Lanes lanes;
    ShapeMNL shape_mnl;
    int tile_m, tile_n;
    bool full_tile;               // the tile lies wholly inside (M, N): no per-pair bounds checks
    int thread_idx, num_threads;  // within the threads that run this epilogue
    Params const& params;

    // One subtile from global memory into registers, a 64-bit access per pair of adjacent
    // columns (nodes/global_access.cuh): a pair starts at an even column and N % 4 == 0, so it is
    // wholly inside the problem or wholly outside; only its row can be past M.
    template <class Regs>
    CUTLASS_DEVICE void load_pairs(Regs&& regs, int epi_m, int epi_n) {
      auto g = tC_gZ(cute::_, cute::_, cute::_, epi_m, epi_n);
      auto c = tC_cZ(cute::_, cute::_, cute::_, epi_m, epi_n);
      CUTLASS_PRAGMA_UNROLL
      for (int e = 0; e < int(cute::size(regs)); e += 2) {
        uint2 v = make_uint2(0u, 0u);  // rows past M: z = 0 adds exactly 0 to ZdZ
        if (full_tile || cute::elem_less(c(e), shape_mnl))
          v = __ldg(reinterpret_cast<const uint2*>(&g(e)));
        regs(e) = v.x;
        regs(e + 1) = v.y;
      }
    }
    // Subtiles are visited epi_m fastest (the collective's loop order, fully unrolled). With two
    // register buffers the z of subtile s + 1 is loaded while subtile s is computed; tiles wider
    // than 128 columns hold 192+ accumulator registers per thread and keep one buffer.
    static constexpr int kEpiM = decltype(cute::size<3>(std::declval<GTensor>()))::value;
    static constexpr int kEpiN = decltype(cute::size<4>(std::declval<GTensor>()))::value;
    CUTLASS_DEVICE void load_z(int s) {
      if (s >= kEpiM * kEpiN) return;
      const int epi_m = s % kEpiM, epi_n = s / kEpiM;
      load_pairs(tC_rZ(cute::_, cute::_, cute::_, s % kZBuffers), epi_m, epi_n);
    }

    // Once per tile, before its subtiles: ask L2 for the tile's whole z (128-byte lines, spread
    // over the epilogue's threads), so that only the first subtile's loads wait for DRAM.
    CUTLASS_DEVICE void begin() {
      constexpr int kCtaM = cute::size<0>(CtaTile{}), kCtaN = cute::size<1>(CtaTile{});
      constexpr int kLinesPerRow = kCtaN * 4 / 128;
      const int M = int(cute::get<0>(shape_mnl)), N = int(cute::get<1>(shape_mnl));
      const int row0 = tile_m * kCtaM, col0 = tile_n * kCtaN;
      for (int i = thread_idx; i < kCtaM * kLinesPerRow; i += num_threads) {
        const int row = row0 + i / kLinesPerRow, col = col0 + (i % kLinesPerRow) * 32;
        if (row < M && col < N) {
          const uint32_t* p = params.z + int64_t(row) * params.ldz + col;
          asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
        }
      }
    }

    CUTLASS_DEVICE void begin_loop(int epi_m, int epi_n) {
      const int s = epi_n * kEpiM + epi_m;
      if (kZBuffers == 1 || s == 0) load_z(s);
      if (kZBuffers == 2) load_z(s + 1);
    }

    template <class ElementAccumulator, class ElementInput, int F>
    CUTLASS_DEVICE cutlass::Array<float, F> visit(cutlass::Array<ElementAccumulator, F> const&,
                                                  int epi_v, int epi_m, int epi_n,
                                                  cutlass::Array<ElementInput, F> const& da) {
      auto z_frg = cute::recast<cutlass::Array<uint32_t, F>>(
          cute::coalesce(tC_rZ(cute::_, cute::_, cute::_, (epi_n * kEpiM + epi_m) % kZBuffers)));
      cutlass::Array<uint32_t, F> const& z = z_frg(epi_v);
      auto g_dz = tC_gDz(cute::_, cute::_, cute::_, epi_m, epi_n);
      auto c = tC_cZ(cute::_, cute::_, cute::_, epi_m, epi_n);
      static_assert(F % 2 == 0, "fragments hold whole column pairs");
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
      // dz straight to global memory, one 64-bit store per column pair (see load_pairs).
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
    // z is only read: the const is cast away so z and dz share one tensor type.
    Tensor tC_gZ = partition_tile<ReferenceSrc>(args, shape_mnl, const_cast<uint32_t*>(params.z),
                                                params.ldz);
    Tensor tC_gDz = partition_tile<ReferenceSrc>(args, shape_mnl, params.dz, params.lddz);
    Tensor tC_cZ = partition_coords<ReferenceSrc>(args, shape_mnl);
    Tensor tC_rZ = make_tensor<uint32_t>(append(take<0, 3>(shape(tC_gZ)), Int<kZBuffers>{}));
    auto rZdZ = make_row_state<ReferenceSrc, CtaTile>(args, 0.0f);
    auto lanes = warp_lanes<ReferenceSrc>(args);
    return ConsumerStoreCallbacks<decltype(tC_gZ), decltype(tC_cZ), decltype(tC_rZ),
                                  decltype(rZdZ), decltype(args.tCcD), decltype(args.residue_tCcD),
                                  decltype(lanes), decltype(shape_mnl)>(
        tC_gZ, tC_gDz, tC_cZ, tC_rZ, rZdZ, args.tCcD, args.residue_tCcD, lanes, shape_mnl,
        int(m), int(n), args.thread_idx, int(size(args.tiled_copy)), params);
  }
};

}  // namespace coda::kernel
