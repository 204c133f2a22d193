#pragma once
// NOTE: sm90_visitor_tma_warpspecialized.hpp uses NumericArrayConverter without including it.
#include <cutlass/numeric_conversion.h>

#include "coda/kernel/nodes/common.cuh"
#include "coda/kernel/nodes/global_access.cuh"

namespace coda::kernel {

// ---------------------------------------------------------------------------------------------
// LoadAhead<CtaTile, WholeTile>: a leaf that returns the thread's fragment of a row-major (M, N)
// bf16 tensor, read by the consumer threads themselves from global memory into registers one
// subtile ahead, or with WholeTile the whole tile's at the first subtile (all its loads in flight
// at once, for a register per column pair of every subtile; a 32-bit load per column pair; fragment
// elements (2j, 2j+1) are adjacent columns and N % 2 == 0, so a pair is wholly inside or outside;
// rows past M read as 0). It costs no shared memory, where Sm90AuxLoad (TMA from the producer warp,
// up to four subtiles ahead) costs a ring of four subtiles: B1 on cooperative 256x128 uses this
// one, because there the ring took one of the mainloop's four stages and B1 ran 1-4% slower
// (docs/experiments.md).
// ---------------------------------------------------------------------------------------------
struct LoadAheadArgs {
  const cutlass::bfloat16_t* ptr = nullptr;
  int64_t ld = 0;  // elements
};

template <class CtaTile, bool WholeTile = false>
struct LoadAhead : ConsumerOnlyNode<LoadAheadArgs> {
  using Params = LoadAheadArgs;
  using Arguments = Params;

  template <class ProblemShape>
  static bool can_implement(ProblemShape const& shape, Arguments const& a) {
    auto [M, N, K, L] = cute::append<4>(shape, 1);
    return a.ptr && N % 2 == 0 && a.ld % 2 == 0;
  }

  using ConsumerOnlyNode<LoadAheadArgs>::ConsumerOnlyNode;

  template <class GTensor, class CTensor, class RTensor, class ShapeMNL>
  struct ConsumerStoreCallbacks : cf::EmptyConsumerStoreCallbacks {
    CUTLASS_DEVICE ConsumerStoreCallbacks(GTensor g, CTensor c, RTensor r, ShapeMNL shape,
                                          bool full_tile)
        : tC_g(g), tC_c(c), tC_r(r), shape_mnl(shape), full_tile(full_tile) {}
    GTensor tC_g;  // (CPY,CPY_M,CPY_N,EPI_M,EPI_N) this tile of the tensor
    CTensor tC_c;  // its absolute (m, n, l) coordinates
    RTensor tC_r;  // (pairs, 2 or every subtile) subtiles in registers, a bf16 pair per slot
    ShapeMNL shape_mnl;
    bool full_tile;  // the tile lies wholly inside (M, N): no per-pair bounds checks

    static constexpr int kEpiM = decltype(cute::size<3>(std::declval<GTensor>()))::value;
    static constexpr int kEpiN = decltype(cute::size<4>(std::declval<GTensor>()))::value;
    static constexpr int kSlots = decltype(cute::size<1>(std::declval<RTensor>()))::value;

    CUTLASS_DEVICE void load(int s) {
      if (s >= kEpiM * kEpiN) return;
      const int epi_m = s % kEpiM, epi_n = s / kEpiM;
      auto regs = tC_r(cute::_, s % kSlots);
      auto g = tC_g(cute::_, cute::_, cute::_, epi_m, epi_n);
      auto c = tC_c(cute::_, cute::_, cute::_, epi_m, epi_n);
      CUTLASS_PRAGMA_UNROLL
      for (int e = 0; e < 2 * int(cute::size(regs)); e += 2) {
        uint32_t v = 0u;
        if (full_tile || cute::elem_less(c(e), shape_mnl))
          v = __ldg(reinterpret_cast<const unsigned int*>(&g(e)));
        regs(e / 2) = v;
      }
    }

    // Subtiles are visited epi_m fastest (the collective's loop order, fully unrolled): subtile
    // s + 1 is loaded while subtile s is computed, or every subtile before the first.
    CUTLASS_DEVICE void begin_loop(int epi_m, int epi_n) {
      const int s = epi_n * kEpiM + epi_m;
      if constexpr (WholeTile) {
        if (s == 0) {
          CUTLASS_PRAGMA_UNROLL
          for (int t = 0; t < kEpiM * kEpiN; ++t) load(t);
        }
      } else {
        if (s == 0) load(0);
        load(s + 1);
      }
    }

    template <class ElementAccumulator, int F>
    CUTLASS_DEVICE cutlass::Array<cutlass::bfloat16_t, F> visit(
        cutlass::Array<ElementAccumulator, F> const&, int epi_v, int epi_m, int epi_n) {
      static_assert(F % 2 == 0, "fragments hold whole column pairs");
      auto regs = tC_r(cute::_, (epi_n * kEpiM + epi_m) % kSlots);
      cutlass::Array<cutlass::bfloat16_t, F> out;
      uint32_t* pairs = reinterpret_cast<uint32_t*>(out.data());
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < F / 2; ++i) pairs[i] = regs(epi_v * (F / 2) + i);
      return out;
    }
  };

  template <bool ReferenceSrc, class... Args>
  CUTLASS_DEVICE auto get_consumer_store_callbacks(cf::ConsumerStoreArgs<Args...> const& args) {
    using namespace cute;
    auto [M, N, K, L] = args.problem_shape_mnkl;
    auto [m, n, k, l] = args.tile_coord_mnkl;
    auto shape_mnl = make_shape(M, N, L);
    using bf16 = cutlass::bfloat16_t;
    // Only read: the const is cast away for the partitioning helper.
    Tensor tC_g = partition_tile<ReferenceSrc>(args, shape_mnl, const_cast<bf16*>(params.ptr),
                                               params.ld);
    Tensor tC_c = partition_coords<ReferenceSrc>(args, shape_mnl);
    constexpr int kPairs = decltype(size(take<0, 3>(shape(tC_g))))::value / 2;
    constexpr int kSubtiles = decltype(size<3>(tC_g) * size<4>(tC_g))::value;
    constexpr int kSlots = WholeTile ? kSubtiles : 2;
    Tensor tC_r = make_tensor<uint32_t>(make_shape(Int<kPairs>{}, Int<kSlots>{}));
    const bool full = tile_inside<CtaTile>(int(m), int(n), int(M), int(N));
    return ConsumerStoreCallbacks<decltype(tC_g), decltype(tC_c), decltype(tC_r),
                                  decltype(shape_mnl)>(tC_g, tC_c, tC_r, shape_mnl, full);
  }
};

}  // namespace coda::kernel
