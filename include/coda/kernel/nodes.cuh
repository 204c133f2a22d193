#pragma once
// Epilogue visitor nodes the stock CUTLASS sm90 set lacks (HOPPER_NOTES.md), written to the same
// node protocol (Arguments -> to_underlying_arguments -> Params, SharedStorage, per-tile consumer
// callbacks: begin / visit / reduce / postreduce / tma_store / end):
//   - PairwiseCompute: an n-ary map over raw (unconverted) child fragments, so integer inputs such
//     as fixed-point RoPE frequencies reach the functor bit-exact;
//   - HalfWidthStore: the 2->1 pairwise output (SwiGLU a), staged in its own smem ring and written by
//     TMA in lock-step with the collective's D store pipeline;
//   - OnlineLseReduction: per-row online (max, sum-exp) over a tile's valid columns, merged across
//     the lanes that share a row, written as per-tile partials; picks the target logit;
//   - PairLayoutProbe: writes 1 where the fragment pairing assumption holds (tests only).
// Every node indexes the thread's elements through a coordinate tensor, never by assuming which
// (row, col) a thread holds. NOTE: the collective's args.tCcD holds coordinates relative to the
// thread's first element (paired with args.residue_tCcD); nodes that need the element's place in the
// CTA tile partition args.cD (CTA-relative, paired with args.residue_cD) instead: cta_coords().

#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>
#include <cutlass/epilogue/fusion/sm90_visitor_tma_warpspecialized.hpp>
#include <cutlass/numeric_conversion.h>

#include <cfloat>

#include "coda/epilogue/online_softmax.hpp"

namespace coda::kernel {

namespace cf = cutlass::epilogue::fusion;
using cute::_0;
using cute::_1;
using cute::Int;

// (CPY,CPY_M,CPY_N,EPI_M,EPI_N) CTA-relative (m, n) of each element this thread visits, in the
// order of the visited fragments.
template <bool ReferenceSrc, class StoreArgs>
CUTLASS_DEVICE auto cta_coords(StoreArgs const& args) {
  return cf::detail::sm90_partition_for_epilogue<ReferenceSrc>(args.cD, args.epi_tile,
                                                               args.tiled_copy, args.thread_idx);
}

// ---------------------------------------------------------------------------------------------
// PairwiseCompute<Fn, ElementOutput>: out = Fn{}(params, child fragments...) with the children's
// fragments passed raw. Fn is a default-constructible struct with
//   struct Arguments {...};   (may be empty)
//   template <int F, class... In> Array<float, F> operator()(Arguments const&, Array<In, F> const&...)
// ---------------------------------------------------------------------------------------------
template <class Fn, class ElementOutput>
struct PairwiseCompute {
  struct SharedStorage {};
  using Arguments = typename Fn::Arguments;
  using Params = Arguments;

  template <class ProblemShape>
  static constexpr Params to_underlying_arguments(ProblemShape const&, Arguments const& a, void*) {
    return a;
  }
  template <class ProblemShape>
  static bool can_implement(ProblemShape const&, Arguments const&) { return true; }
  template <class ProblemShape>
  static size_t get_workspace_size(ProblemShape const&, Arguments const&) { return 0; }
  template <class ProblemShape>
  static cutlass::Status initialize_workspace(ProblemShape const&, Arguments const&, void*,
                                              cudaStream_t, cutlass::CudaHostAdapter* = nullptr) {
    return cutlass::Status::kSuccess;
  }

  CUTLASS_HOST_DEVICE PairwiseCompute() {}
  CUTLASS_HOST_DEVICE PairwiseCompute(Params const& p, SharedStorage const&) : params(p) {}
  Params params;

  CUTLASS_DEVICE bool is_producer_load_needed() const { return false; }
  CUTLASS_DEVICE bool is_C_load_needed() const { return false; }

  template <class... Args>
  CUTLASS_DEVICE auto get_producer_load_callbacks(cf::ProducerLoadArgs<Args...> const&) {
    return cf::EmptyProducerLoadCallbacks{};
  }

  struct ConsumerStoreCallbacks : cf::EmptyConsumerStoreCallbacks {
    CUTLASS_DEVICE explicit ConsumerStoreCallbacks(Params const& p) : params(p) {}
    Params const& params;

    template <class ElementAccumulator, class... ElementInputs, int F>
    CUTLASS_DEVICE cutlass::Array<ElementOutput, F> visit(
        cutlass::Array<ElementAccumulator, F> const&, int, int, int,
        cutlass::Array<ElementInputs, F> const&... inputs) {
      const cutlass::Array<float, F> out = Fn{}(params, inputs...);
      return cutlass::NumericArrayConverter<ElementOutput, float, F>{}(out);
    }
  };

  template <bool ReferenceSrc, class... Args>
  CUTLASS_DEVICE auto get_consumer_store_callbacks(cf::ConsumerStoreArgs<Args...> const&) {
    return ConsumerStoreCallbacks(params);
  }
};

// ---------------------------------------------------------------------------------------------
// HalfWidthStore<EpilogueDesc, PairFn, Element>: for each adjacent pair (2j, 2j+1) of its input,
// stores PairFn{}(x[2j], x[2j+1]) at column (n/2) of a (M, N/2) row-major output; returns its input
// unchanged (the caller keeps the full-width tensor too).
// ---------------------------------------------------------------------------------------------
template <class EpilogueDesc, class PairFn, class Element>
struct HalfWidthStore {
  using CtaTile = typename EpilogueDesc::TileShape;
  using EpiTile = typename EpilogueDesc::EpilogueTile;
  static constexpr int Stages = EpilogueDesc::StagesD;
  static constexpr int EpiM = cute::size<0>(EpiTile{});
  static constexpr int EpiN = cute::size<1>(EpiTile{});
  static constexpr int HalfN = EpiN / 2;
  static_assert(HalfN * sizeof(Element) % 16 == 0, "TMA needs a 16-byte inner box");

  using StrideMNL = cute::Stride<int64_t, _1, int64_t>;
  // Unswizzled row-major half subtile; rows are HalfN * 2 bytes (32 B for a 32-wide subtile).
  using SmemLayoutTma = cute::Layout<cute::Shape<Int<EpiM>, Int<HalfN>>, cute::Stride<Int<HalfN>, _1>>;
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
    auto gmem = cute::make_tensor(a.ptr, cute::make_layout(cute::make_shape(M, N / 2, L),
                                                           StrideMNL{a.ld, _1{}, 0}));
    return {cute::make_tma_copy(cute::SM90_TMA_STORE{}, gmem, SmemLayoutTma{})};
  }
  template <class ProblemShape>
  static bool can_implement(ProblemShape const& shape, Arguments const& a) {
    auto [M, N, K, L] = cute::append<4>(shape, 1);
    return a.ptr != nullptr && N % 2 == 0 && a.ld >= N / 2 && (a.ld * sizeof(Element)) % 16 == 0;
  }
  template <class ProblemShape>
  static size_t get_workspace_size(ProblemShape const&, Arguments const&) { return 0; }
  template <class ProblemShape>
  static cutlass::Status initialize_workspace(ProblemShape const&, Arguments const&, void*,
                                              cudaStream_t, cutlass::CudaHostAdapter* = nullptr) {
    return cutlass::Status::kSuccess;
  }

  CUTLASS_HOST_DEVICE HalfWidthStore() {}
  CUTLASS_HOST_DEVICE HalfWidthStore(Params const& p, SharedStorage const& s)
      : params_ptr(&p), smem(const_cast<Element*>(s.smem.data())) {}
  Params const* params_ptr = nullptr;
  Element* smem = nullptr;

  CUTLASS_DEVICE bool is_producer_load_needed() const { return false; }
  CUTLASS_DEVICE bool is_C_load_needed() const { return false; }
  template <class... Args>
  CUTLASS_DEVICE auto get_producer_load_callbacks(cf::ProducerLoadArgs<Args...> const&) {
    return cf::EmptyProducerLoadCallbacks{};
  }

  template <class CoordTensor, class RegTensor, class SmemTensor, class TmaSmem, class TmaGmem>
  struct ConsumerStoreCallbacks : cf::EmptyConsumerStoreCallbacks {
    CUTLASS_DEVICE ConsumerStoreCallbacks(CoordTensor c, RegTensor r, SmemTensor s, TmaSmem ts,
                                          TmaGmem tg, Params const* p)
        : tCcD(c), rHalf(r), sHalf(s), bSG_s(ts), bSG_g(tg), params_ptr(p) {}
    CoordTensor tCcD;    // (CPY,CPY_M,CPY_N,EPI_M,EPI_N) CTA-relative (m, n) of each element
    RegTensor rHalf;     // half of one subtile's values for this thread
    SmemTensor sHalf;    // (EPI_M, HalfN, PIPE)
    TmaSmem bSG_s;       // (TMA,TMA_M,TMA_N,PIPE)
    TmaGmem bSG_g;       // (TMA,TMA_M,TMA_N,EPI_M,EPI_N)
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

    CUTLASS_DEVICE void postreduce(int epi_m, int epi_n, int store_iteration, bool issue_smem_store) {
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
                              make_coord(m, n, l));                           // (CTA_M, CTA_N/2)
    Tensor gHalf_epi = flat_divide(gHalf, make_shape(Int<EpiM>{}, Int<HalfN>{}));  // (EPI_M,HalfN,#M,#N)
    Tensor sHalf = make_tensor(make_smem_ptr(smem), SmemLayout{});          // (EPI_M,HalfN,PIPE)
    ThrCopy thr = params_ptr->tma.get_slice(_0{});
    Tensor bSG_s = thr.partition_S(sHalf);
    Tensor bSG_g = thr.partition_D(gHalf_epi);
    constexpr int kPerSubtile = decltype(size(take<0, 3>(shape(args.tCcD))))::value;
    Tensor rHalf = make_tensor<Element>(Int<kPerSubtile / 2>{});
    auto tCcCta = cta_coords<ReferenceSrc>(args);
    return ConsumerStoreCallbacks<decltype(tCcCta), decltype(rHalf), decltype(sHalf),
                                  decltype(bSG_s), decltype(bSG_g)>(
        tCcCta, rHalf, sHalf, bSG_s, bSG_g, params_ptr);
  }
};

// ---------------------------------------------------------------------------------------------
// OnlineLseReduction<CtaTile, Target>: child inputs (logits float, targets Target). Keeps per-row
// online (max, sum-exp) state in registers over the whole tile (subtiles are visited N-outer,
// M-inner, so a row's state lives until the last subtile), merges it across the lanes holding the
// same row, and writes one partial per (row, N-tile) into max/sum buffers laid out as
// PartialLayout::per_row (row fastest, rows padded to the tile). Columns past N never enter the
// state. The element whose global column equals targets[row] is written to target_logit[row].
// Returns the logits unchanged (so D can hold them when materialized).
// ---------------------------------------------------------------------------------------------
template <class CtaTile, class Target>
struct OnlineLseReduction {
  using ElementAux = cutlass::bfloat16_t;  // what D would hold; lets the collective run with no D
  struct SharedStorage {};
  struct Arguments {
    float* max_partials = nullptr;
    float* sum_partials = nullptr;
    float* target_logit = nullptr;  // (M)
  };
  using Params = Arguments;

  template <class ProblemShape>
  static constexpr Params to_underlying_arguments(ProblemShape const&, Arguments const& a, void*) {
    return a;
  }
  template <class ProblemShape>
  static bool can_implement(ProblemShape const&, Arguments const& a) {
    return a.max_partials && a.sum_partials && a.target_logit;
  }
  template <class ProblemShape>
  static size_t get_workspace_size(ProblemShape const&, Arguments const&) { return 0; }
  template <class ProblemShape>
  static cutlass::Status initialize_workspace(ProblemShape const&, Arguments const&, void*,
                                              cudaStream_t, cutlass::CudaHostAdapter* = nullptr) {
    return cutlass::Status::kSuccess;
  }

  CUTLASS_HOST_DEVICE OnlineLseReduction() {}
  CUTLASS_HOST_DEVICE OnlineLseReduction(Params const& p, SharedStorage const&) : params(p) {}
  Params params;

  CUTLASS_DEVICE bool is_producer_load_needed() const { return false; }
  CUTLASS_DEVICE bool is_C_load_needed() const { return false; }
  template <class... Args>
  CUTLASS_DEVICE auto get_producer_load_callbacks(cf::ProducerLoadArgs<Args...> const&) {
    return cf::EmptyProducerLoadCallbacks{};
  }

  template <class ArgsTuple>
  struct ConsumerStoreCallbacks : cf::EmptyConsumerStoreCallbacks {
    CUTLASS_DEVICE ConsumerStoreCallbacks(ArgsTuple&& t, Params const& p)
        : args_tuple(cute::forward<ArgsTuple>(t)), params(p) {}
    ArgsTuple args_tuple;
    Params const& params;

    template <class ElementAccumulator, class ElementLogit, int F>
    CUTLASS_DEVICE cutlass::Array<ElementLogit, F> visit(
        cutlass::Array<ElementAccumulator, F> const&, int epi_v, int epi_m, int epi_n,
        cutlass::Array<ElementLogit, F> const& logits, cutlass::Array<Target, F> const& targets) {
      auto& [rMax, rSum, tCcD, residue, m0, n0, lane_layout_MN, lane_mn, gBufMax, gBufSum] =
          args_tuple;
      auto rMax_mn = rMax(cute::_, cute::_, cute::_, epi_m, epi_n);
      auto rSum_mn = rSum(cute::_, cute::_, cute::_, epi_m, epi_n);
      auto cD_mn = tCcD(cute::_, cute::_, cute::_, epi_m, epi_n);
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < F; ++i) {
        const auto c = cD_mn(epi_v * F + i);
        if (!cute::elem_less(c, residue)) continue;
        const float x = static_cast<float>(logits[i]);
        float& mx = rMax_mn(epi_v * F + i);
        float& sm = rSum_mn(epi_v * F + i);
        // One exp per element: rescale the running sum only when the max moves.
        if (x > mx) {
          sm = sm * epilogue::OnlineMaxSumExp<float>::scaled(mx, x) + 1.0f;
          mx = x;
        } else {
          sm += __expf(x - mx);
        }
        if (static_cast<int64_t>(targets[i]) == static_cast<int64_t>(n0 + cute::get<1>(c))) {
          params.target_logit[m0 + cute::get<0>(c)] = x;
        }
      }
      return logits;
    }

    template <class STensor, class SyncFn, class VTensor>
    CUTLASS_DEVICE void reduce(STensor&&, SyncFn const&, int, int, bool is_last_iteration,
                               VTensor) {
      if (!is_last_iteration) return;
      auto& [rMax, rSum, tCcD, residue, m0, n0, lane_layout_MN, lane_mn, gBufMax, gBufSum] =
          args_tuple;
      // Merge across the lanes that hold the same rows (the columns of a row within a warp).
      auto fMax = cute::filter(rMax);
      auto fSum = cute::filter(rSum);
      CUTLASS_PRAGMA_UNROLL
      for (int offset = cute::size<1>(lane_layout_MN) / 2; offset > 0; offset /= 2) {
        const int lane_delta = lane_layout_MN(_0{}, offset);
        CUTLASS_PRAGMA_UNROLL
        for (int i = 0; i < cute::size(fMax); ++i) {
          const float om = __shfl_down_sync(0xffffffff, fMax(i), lane_delta);
          const float os = __shfl_down_sync(0xffffffff, fSum(i), lane_delta);
          const auto merged = epilogue::OnlineMaxSumExp<float>::merge({fMax(i), fSum(i)}, {om, os});
          fMax(i) = merged.max;
          fSum(i) = merged.sum;
        }
      }
      if (cute::get<1>(lane_mn) == 0) {
        cute::copy_aligned(rMax, gBufMax);
        cute::copy_aligned(rSum, gBufSum);
      }
    }
  };

  template <bool ReferenceSrc, class... Args>
  CUTLASS_DEVICE auto get_consumer_store_callbacks(cf::ConsumerStoreArgs<Args...> const& args) {
    using namespace cute;
    // Lanes sharing a row: the same construction as CUTLASS's column reduction.
    Layout ref_layout_MN = [&]() {
      auto mn_shape = shape(typename decltype(args.tiled_copy)::Tiler_MN{});
      if constexpr (ReferenceSrc) {
        return right_inverse(args.tiled_copy.get_layoutS_TV()).with_shape(mn_shape);
      } else {
        return right_inverse(args.tiled_copy.get_layoutD_TV()).with_shape(mn_shape);
      }
    }();
    using W = Int<decltype(args.tiled_copy)::TiledNumThr::value / cutlass::NumThreadsPerWarp>;
    Layout tv2lane = Layout<Shape<Int<cutlass::NumThreadsPerWarp>, W, _1>, Stride<_1, _0, _0>>{};
    Layout ref2lane = composition(tv2lane, ref_layout_MN);
    Layout lane_layout_MN = make_layout(filter(get<0>(ref2lane)), filter(get<1>(ref2lane)));
    Layout inv_lane_layout_MN = right_inverse(lane_layout_MN);
    auto lane_mn = idx2crd(inv_lane_layout_MN(cutlass::canonical_lane_idx()), shape(lane_layout_MN));
    Layout tv2warp = Layout<Shape<Int<cutlass::NumThreadsPerWarp>, W, _1>, Stride<_0, _1, _0>>{};
    Layout ref2warp = composition(tv2warp, ref_layout_MN);
    Layout warp_layout_MN = make_layout(filter(get<0>(ref2warp)), filter(get<1>(ref2warp)));
    static_assert(decltype(size<1>(warp_layout_MN))::value == 1,
                  "OnlineLseReduction assumes one warp across N per row (true for sm90 wgmma)");

    auto [M, N, K, L] = args.problem_shape_mnkl;
    auto [m, n, k, l] = args.tile_coord_mnkl;
    const auto cta_m = size<0>(CtaTile{});
    const auto cta_n = size<1>(CtaTile{});
    // Per-row partial buffers: (round_up(M, CTA_M), ceil(N / CTA_N)), row fastest.
    const int rows_padded = static_cast<int>(cute::ceil_div(M, cta_m) * cta_m);
    auto buf_layout = make_layout(make_shape(rows_padded, cta_n), make_stride(_1{}, _0{}));
    auto gMax = make_tensor(make_gmem_ptr(params.max_partials + int64_t(n) * rows_padded), buf_layout);
    auto gSum = make_tensor(make_gmem_ptr(params.sum_partials + int64_t(n) * rows_padded), buf_layout);
    Tensor gMax_tile = local_tile(gMax, take<0, 2>(CtaTile{}), make_coord(m, _0{}));  // (CTA_M,CTA_N)
    Tensor gSum_tile = local_tile(gSum, take<0, 2>(CtaTile{}), make_coord(m, _0{}));
    Tensor tCgMax = cf::detail::sm90_partition_for_epilogue<ReferenceSrc>(
        gMax_tile, args.epi_tile, args.tiled_copy, args.thread_idx);  // (CPY,CPY_M,CPY_N,EPI_M,EPI_N)
    Tensor tCgSum = cf::detail::sm90_partition_for_epilogue<ReferenceSrc>(
        gSum_tile, args.epi_tile, args.tiled_copy, args.thread_idx);
    Tensor rMax = make_tensor_like<float>(tCgMax);  // stride 0 along N: one slot per row
    Tensor rSum = make_tensor_like<float>(tCgSum);
    fill(rMax, -INFINITY);
    fill(rSum, 0.0f);
    const int m0 = static_cast<int>(m) * static_cast<int>(cta_m);
    const int n0 = static_cast<int>(n) * static_cast<int>(cta_n);
    auto t = make_tuple(rMax, rSum, cta_coords<ReferenceSrc>(args), args.residue_cD, m0, n0,
                        lane_layout_MN, lane_mn, tCgMax, tCgSum);
    return ConsumerStoreCallbacks<decltype(t)>(cute::move(t), params);
  }
};

// ---------------------------------------------------------------------------------------------
// PairLayoutProbe: D[m, n] = 1 where element 2j of the thread's fragment sits at an even column
// and element 2j+1 at the next column of the same row; 0 otherwise. Tests assert D == 1.
// ---------------------------------------------------------------------------------------------
struct PairLayoutProbe : cf::Sm90VisitorImpl<> {
  using cf::Sm90VisitorImpl<>::Sm90VisitorImpl;

  template <class CoordTensor>
  struct ConsumerStoreCallbacks : cf::EmptyConsumerStoreCallbacks {
    CUTLASS_DEVICE explicit ConsumerStoreCallbacks(CoordTensor c) : tCcD(c) {}
    CoordTensor tCcD;

    template <class ElementAccumulator, int F>
    CUTLASS_DEVICE cutlass::Array<float, F> visit(cutlass::Array<ElementAccumulator, F> const&,
                                                  int epi_v, int epi_m, int epi_n) {
      cutlass::Array<float, F> out;
      auto c = tCcD(cute::_, cute::_, cute::_, epi_m, epi_n);
      CUTLASS_PRAGMA_UNROLL
      for (int j = 0; j < F / 2; ++j) {
        const auto a = c(epi_v * F + 2 * j), b = c(epi_v * F + 2 * j + 1);
        const bool ok = cute::get<1>(a) % 2 == 0 && cute::get<1>(b) == cute::get<1>(a) + 1 &&
                        cute::get<0>(b) == cute::get<0>(a);
        out[2 * j] = out[2 * j + 1] = ok ? 1.0f : 0.0f;
      }
      return out;
    }
  };

  template <bool ReferenceSrc, class... Args>
  CUTLASS_DEVICE auto get_consumer_store_callbacks(cf::ConsumerStoreArgs<Args...> const& args) {
    auto tCcCta = cta_coords<ReferenceSrc>(args);
    return ConsumerStoreCallbacks<decltype(tCcCta)>(tCcCta);
  }
};

}  // namespace coda::kernel
