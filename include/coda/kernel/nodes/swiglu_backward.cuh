#pragma once
// NOTE: sm90_visitor_tma_warpspecialized.hpp uses NumericArrayConverter without including it.
#include <cutlass/numeric_conversion.h>

#include "coda/epilogue/elementwise.hpp"
#include "coda/kernel/args.hpp"
#include "coda/kernel/nodes/common.cuh"
#include "coda/kernel/nodes/global_access.cuh"  // bf16 pair packing
#include "coda/kernel/nodes/row_partials.cuh"
#include "coda/programs/formulas.hpp"

namespace coda::kernel {

// ---------------------------------------------------------------------------------------------
// SwigluBackwardNode<CtaTile, AStore>: the whole B2 epilogue in one node; its children are da
// (the accumulator) and z (the source C, loaded by TMA: fusions/swiglu_backward.cuh). Output
// column n owns the interleaved pair (2n, 2n+1) of z and dz, read and written as one 32-bit
// element:
//   (g, u) = z pair;  dg, du, a = SwiGluBackward(g, u, da)
//   returns the dz pair (D, uint32, (M, N));  a -> AStore (bf16, (M, N));  ZdZ += g·dg + u·du
// dz is the collective's D, so it goes out through the shared-memory buffer z came in by (C / D
// reuse). AStore is a stock Sm90AuxStore of bf16 held inside this node: a goes through its own
// swizzled ring and leaves by TMA in lock-step with D's store pipeline. With AStore =
// WithoutOutput, a is not written (the FP8 backward reads the aᵀ its forward quantized) and dz
// only returned (to the quantizing store of fusions/swiglu_backward_fp8.cuh). Rows past M arrive as
// z = 0 (TMA fills out-of-bounds elements with zeros), which adds exactly 0 to ZdZ, and TMA clips
// the stores. ZdZ stays in one register per row over the tile and is merged across the
// lanes sharing the row once, at the end (per_row partials, like OnlineLseReduction).
// ---------------------------------------------------------------------------------------------
template <class CtaTile, class AStore>
struct SwigluBackwardNode : NoWorkspaceNoProducerLoads {
  static constexpr bool kAStored = !std::is_same_v<AStore, WithoutOutput>;
  using AStoreOrNone = std::conditional_t<kAStored, AStore, NoAuxStore>;
  struct SharedStorage {
    typename AStoreOrNone::SharedStorage a;
  };
  struct Arguments {
    SwigluBackwardArgs args;
    void* a;  // the problem's D: bf16 (M, N), leading dimension lda
    int64_t lda;
  };
  struct Params {
    SwigluBackwardArgs args;
    typename AStoreOrNone::Params a;
  };

  template <class ProblemShape>
  static Params to_underlying_arguments(ProblemShape const& shape, Arguments const& a,
                                        void* workspace) {
    if constexpr (kAStored) {
      return {a.args, held_store_params<AStore>(shape, a.a, a.lda, workspace)};
    } else {
      return {a.args, {}};
    }
  }
  template <class ProblemShape>
  static bool can_implement(ProblemShape const& shape, Arguments const& a) {
    auto [M, N, K, L] = cute::append<4>(shape, 1);
    // dz's pointer is the collective's D (the op layer passes it); without a stored a the
    // program has no D either.
    return a.args.z && a.args.zdz_partials && N % 8 == 0 && a.args.ldz % 4 == 0 &&
           (!kAStored || (a.args.dz && a.a && a.args.lddz % 4 == 0 && a.lda % 8 == 0));
  }
  CUTLASS_HOST_DEVICE SwigluBackwardNode() {}
  // a_store keeps a pointer to its Params: it gets the kernel's (p.a), not this node's copy.
  CUTLASS_HOST_DEVICE SwigluBackwardNode(Params const& p, SharedStorage const& s)
      : params(p.args), a_store(p.a, s.a) {}
  SwigluBackwardArgs params;
  AStoreOrNone a_store;

  template <class ACallbacks, class Sums>
  struct ConsumerStoreCallbacks : cf::EmptyConsumerStoreCallbacks {
    CUTLASS_DEVICE ConsumerStoreCallbacks(ACallbacks&& a, Sums sums, SwigluBackwardArgs const& p)
        : a_cb(cute::forward<ACallbacks>(a)), zdz(sums), params(p) {}
    ACallbacks a_cb;  // the stock aux store's callbacks: registers -> smem -> TMA (or none)
    Sums zdz;         // RowSums: ZdZ per row over the tile
    SwigluBackwardArgs const& params;

    template <class ElementAccumulator, class ElementInput, class ElementZ, int F>
    CUTLASS_DEVICE cutlass::Array<uint32_t, F> visit(
        cutlass::Array<ElementAccumulator, F> const& acc, int epi_v, int epi_m, int epi_n,
        cutlass::Array<ElementInput, F> const& da, cutlass::Array<ElementZ, F> const& z) {
      // The collective hands C over in its own register type; a converted (float) copy of the
      // packed pairs would be garbage, so insist on the raw 32-bit words.
      static_assert(std::is_same_v<ElementZ, uint32_t>, "z must arrive as raw bf16 pairs");
      cutlass::Array<uint32_t, F> dz;
      auto zdz_mn = zdz.slots(epi_m, epi_n);
      cutlass::Array<float, F> a;
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < F; ++i) {
        const float2 gu = unpack_bf16_pair(z[i]);
        float dg, du;
        epilogue::SwiGluBackward{}(gu.x, gu.y, static_cast<float>(da[i]), dg, du, a[i]);
        dz[i] = pack_bf16_pair(dg, du);
        zdz_mn(epi_v * F + i) += programs::PairDot{}(gu.x, gu.y, dg, du);
      }
      if constexpr (kAStored) a_cb.visit(acc, epi_v, epi_m, epi_n, a);
      return dz;
    }

    CUTLASS_DEVICE void postreduce(int epi_m, int epi_n, int store_iteration,
                                   bool issue_smem_store) {
      if constexpr (kAStored) a_cb.postreduce(epi_m, epi_n, store_iteration, issue_smem_store);
    }
    CUTLASS_DEVICE void tma_store(int epi_m, int epi_n, int store_iteration, bool issue_tma_store) {
      if constexpr (kAStored) a_cb.tma_store(epi_m, epi_n, store_iteration, issue_tma_store);
    }

    template <class STensor, class SyncFn, class VTensor>
    CUTLASS_DEVICE void reduce(STensor&&, SyncFn const&, int, int, bool is_last_iteration,
                               VTensor) {
      if (is_last_iteration) zdz.store(params.zdz_partials);
    }
  };

  template <bool ReferenceSrc, class... Args>
  CUTLASS_DEVICE auto get_consumer_store_callbacks(cf::ConsumerStoreArgs<Args...> const& args) {
    auto a_cb = [&] {
      if constexpr (kAStored) {
        return a_store.template get_consumer_store_callbacks<ReferenceSrc>(args);
      } else {
        return cf::EmptyConsumerStoreCallbacks{};
      }
    }();
    auto zdz = make_row_sums<ReferenceSrc, CtaTile>(args);
    return ConsumerStoreCallbacks<decltype(a_cb), decltype(zdz)>(cute::move(a_cb), zdz, params);
  }
};

}  // namespace coda::kernel
