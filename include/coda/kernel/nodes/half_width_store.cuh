#pragma once
// NOTE: sm90_visitor_tma_warpspecialized.hpp uses NumericArrayConverter without including it.
#include <cutlass/numeric_conversion.h>

#include "coda/kernel/nodes/common.cuh"

namespace coda::kernel {

// ---------------------------------------------------------------------------------------------
// HalfWidthStore<EpilogueDesc, PairFn, Element>: for each adjacent pair (2j, 2j+1) of its input,
// stores PairFn{}(x[2j], x[2j+1]) at column (n/2) of a (M, N/2) row-major output; returns its input
// unchanged (the caller keeps the full-width tensor too).
// ---------------------------------------------------------------------------------------------
template <class EpilogueDesc, class PairFn, class Element>
struct HalfWidthStore : NoWorkspaceNoProducerLoads {
  using CtaTile = typename EpilogueDesc::TileShape;
  using EpiTile = typename EpilogueDesc::EpilogueTile;
  static constexpr int Stages = EpilogueDesc::StagesD;
  static constexpr int EpiM = cute::size<0>(EpiTile{});
  static constexpr int EpiN = cute::size<1>(EpiTile{});
  static constexpr int HalfN = EpiN / 2;
  static_assert(HalfN * sizeof(Element) % 16 == 0, "TMA needs a 16-byte inner box");

  using StrideMNL = cute::Stride<int64_t, _1, int64_t>;
  // Unswizzled row-major half subtile; rows are HalfN * 2 bytes (32 B for a 32-wide subtile).
  using SmemLayoutTma =
      cute::Layout<cute::Shape<Int<EpiM>, Int<HalfN>>, cute::Stride<Int<HalfN>, _1>>;
  using SmemLayout = cute::Layout<cute::Shape<Int<EpiM>, Int<HalfN>, Int<Stages>>,
                                  cute::Stride<Int<HalfN>, _1, Int<EpiM * HalfN>>>;

  struct SharedStorage {
    alignas(128) cute::array_aligned<Element, cute::cosize_v<SmemLayout>> smem;
  };

  struct Arguments {
    Element* ptr = nullptr;  // (M, N/2) row-major
    int64_t ld = 0;          // row stride in elements
  };

  struct Params {
    using Tma = decltype(cute::make_tma_copy(
        cute::SM90_TMA_STORE{},
        cute::make_tensor(static_cast<Element*>(nullptr),
                          cute::make_layout(cute::make_shape(0, 0, 0), StrideMNL{})),
        SmemLayoutTma{}));
    Tma tma;
  };

  template <class ProblemShape>
  static Params to_underlying_arguments(ProblemShape const& shape, Arguments const& a, void*) {
    auto [M, N, K, L] = cute::append<4>(shape, 1);
    auto gmem = cute::make_tensor(
        a.ptr, cute::make_layout(cute::make_shape(M, N / 2, L), StrideMNL{a.ld, _1{}, 0}));
    return {cute::make_tma_copy(cute::SM90_TMA_STORE{}, gmem, SmemLayoutTma{})};
  }
  template <class ProblemShape>
  static bool can_implement(ProblemShape const& shape, Arguments const& a) {
    auto [M, N, K, L] = cute::append<4>(shape, 1);
    return a.ptr != nullptr && N % 2 == 0 && a.ld >= N / 2 && (a.ld * sizeof(Element)) % 16 == 0;
  }
  CUTLASS_HOST_DEVICE HalfWidthStore() {}
  CUTLASS_HOST_DEVICE HalfWidthStore(Params const& p, SharedStorage const& s)
      : params_ptr(&p), smem(const_cast<Element*>(s.smem.data())) {}
  Params const* params_ptr = nullptr;
  Element* smem = nullptr;

  template <class CoordTensor, class RegTensor, class SmemTensor, class TmaSmem, class TmaGmem>
  struct ConsumerStoreCallbacks : cf::EmptyConsumerStoreCallbacks {
    CUTLASS_DEVICE ConsumerStoreCallbacks(CoordTensor c, RegTensor r, SmemTensor s, TmaSmem ts,
                                          TmaGmem tg, Params const* p)
        : tCcD(c), rHalf(r), sHalf(s), bSG_s(ts), bSG_g(tg), params_ptr(p) {}
    CoordTensor tCcD;  // (CPY,CPY_M,CPY_N,EPI_M,EPI_N) CTA-relative (m, n) of each element
    RegTensor rHalf;   // half of one subtile's values for this thread
    SmemTensor sHalf;  // (EPI_M, HalfN, PIPE)
    TmaSmem bSG_s;     // (TMA,TMA_M,TMA_N,PIPE)
    TmaGmem bSG_g;     // (TMA,TMA_M,TMA_N,EPI_M,EPI_N)
    Params const* params_ptr;

    template <class ElementAccumulator, class ElementInput, int F>
    CUTLASS_DEVICE cutlass::Array<ElementInput, F> visit(
        cutlass::Array<ElementAccumulator, F> const&, int epi_v, int, int,
        cutlass::Array<ElementInput, F> const& x) {
      static_assert(F % 2 == 0, "pairwise store needs an even fragment");
      CUTLASS_PRAGMA_UNROLL
      for (int j = 0; j < F / 2; ++j) {
        rHalf(epi_v * (F / 2) + j) =
            Element(PairFn{}(static_cast<float>(x[2 * j]), static_cast<float>(x[2 * j + 1])));
      }
      return x;
    }

    CUTLASS_DEVICE void postreduce(int epi_m, int epi_n, int store_iteration,
                                   bool issue_smem_store) {
      if (!issue_smem_store) return;
      const int stage = store_iteration % Stages;
      auto coords = tCcD(cute::_, cute::_, cute::_, epi_m, epi_n);
      CUTLASS_PRAGMA_UNROLL
      for (int j = 0; j < cute::size(rHalf); ++j) {
        const auto c = coords(2 * j);  // the pair's first column
        const int row = cute::get<0>(c) - epi_m * EpiM;
        const int col = (cute::get<1>(c) - epi_n * EpiN) / 2;
        sHalf(row, col, stage) = rHalf(j);
      }
    }

    CUTLASS_DEVICE void tma_store(int epi_m, int epi_n, int store_iteration, bool issue_tma_store) {
      if (!issue_tma_store) return;
      const int stage = store_iteration % Stages;
      cute::copy(params_ptr->tma, bSG_s(cute::_, cute::_, cute::_, stage),
                 bSG_g(cute::_, cute::_, cute::_, epi_m, epi_n));
    }
  };

  template <bool ReferenceSrc, class... Args>
  CUTLASS_DEVICE auto get_consumer_store_callbacks(cf::ConsumerStoreArgs<Args...> const& args) {
    using namespace cute;
    auto [M, N, K, L] = args.problem_shape_mnkl;
    auto [m, n, k, l] = args.tile_coord_mnkl;
    Tensor mHalf = params_ptr->tma.get_tma_tensor(make_shape(M, N / 2, L));
    Tensor gHalf = local_tile(mHalf, make_shape(size<0>(CtaTile{}), size<1>(CtaTile{}) / _2{}),
                              make_coord(m, n, l));  // (CTA_M, CTA_N/2)
    Tensor gHalf_epi =
        flat_divide(gHalf, make_shape(Int<EpiM>{}, Int<HalfN>{}));  // (EPI_M,HalfN,#M,#N)
    Tensor sHalf = make_tensor(make_smem_ptr(smem), SmemLayout{});  // (EPI_M,HalfN,PIPE)
    ThrCopy thr = params_ptr->tma.get_slice(_0{});
    Tensor bSG_s = thr.partition_S(sHalf);
    Tensor bSG_g = thr.partition_D(gHalf_epi);
    constexpr int kPerSubtile = decltype(size(take<0, 3>(shape(args.tCcD))))::value;
    Tensor rHalf = make_tensor<Element>(Int<kPerSubtile / 2>{});
    auto tCcCta = cta_coords<ReferenceSrc>(args);
    return ConsumerStoreCallbacks<decltype(tCcCta), decltype(rHalf), decltype(sHalf),
                                  decltype(bSG_s), decltype(bSG_g)>(tCcCta, rHalf, sHalf, bSG_s,
                                                                    bSG_g, params_ptr);
  }
};

}  // namespace coda::kernel
