#pragma once
// Shared plumbing of our epilogue visitor nodes (nodes/*.cuh): the nodes the stock CUTLASS sm90 set
// lacks, written to the same node protocol (Arguments -> to_underlying_arguments
// -> Params, SharedStorage, per-tile consumer callbacks: begin / visit / reduce / postreduce /
// tma_store / end):
//   - PairwiseCompute: an n-ary map over raw (unconverted) child fragments, so integer inputs such
//     as fixed-point RoPE frequencies reach the functor bit-exact;
//   - HalfWidthStore: the 2->1 pairwise output (SwiGLU a), staged in its own smem ring and written
//   by
//     TMA in lock-step with the collective's D store pipeline;
//   - OnlineLseReduction: per-row online (max, sum-exp) over a tile's valid columns, merged across
//     the lanes that share a row, written as per-tile partials; picks the target logit;
//   - PairLayoutProbe: writes 1 where the fragment pairing assumption holds (tests only).
// Every node indexes the thread's elements through a coordinate tensor, never by assuming which
// (row, col) a thread holds. NOTE: the collective's args.tCcD holds coordinates relative to the
// thread's first element (paired with args.residue_tCcD); nodes that need the element's place in
// the CTA tile partition args.cD (CTA-relative, paired with args.residue_cD) instead: cta_coords().

#include <cutlass/cutlass.h>
#include <cutlass/numeric_conversion.h>

#include <cfloat>
#include <cute/tensor.hpp>
#include <cutlass/epilogue/fusion/sm90_visitor_tma_warpspecialized.hpp>

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

// The parts of the node protocol every custom node here shares: no workspace (its host-side
// statics) and no producer loads (the producer hooks). Nodes derive from it.
struct NoWorkspaceNoProducerLoads {
  template <class ProblemShape, class Arguments>
  static size_t get_workspace_size(ProblemShape const&, Arguments const&) {
    return 0;
  }
  template <class ProblemShape, class Arguments>
  static cutlass::Status initialize_workspace(ProblemShape const&, Arguments const&, void*,
                                              cudaStream_t, cutlass::CudaHostAdapter* = nullptr) {
    return cutlass::Status::kSuccess;
  }
  CUTLASS_DEVICE bool is_producer_load_needed() const { return false; }
  CUTLASS_DEVICE bool is_C_load_needed() const { return false; }
  template <class... ProducerArgs>
  CUTLASS_DEVICE auto get_producer_load_callbacks(cf::ProducerLoadArgs<ProducerArgs...> const&) {
    return cf::EmptyProducerLoadCallbacks{};
  }
};

// A node whose Params are its Arguments and that has no shared memory either. A node derives
// from it, takes its constructors (`using ConsumerOnlyNode<Args>::ConsumerOnlyNode;`) and adds
// get_consumer_store_callbacks.
template <class Args>
struct ConsumerOnlyNode : NoWorkspaceNoProducerLoads {
  struct SharedStorage {};
  using Arguments = Args;
  using Params = Args;

  template <class ProblemShape>
  static constexpr Params to_underlying_arguments(ProblemShape const&, Arguments const& a, void*) {
    return a;
  }
  template <class ProblemShape>
  static bool can_implement(ProblemShape const&, Arguments const&) {
    return true;
  }
  CUTLASS_HOST_DEVICE ConsumerOnlyNode() {}
  CUTLASS_HOST_DEVICE ConsumerOnlyNode(Params const& p, SharedStorage const&) : params(p) {}
  Params params;
};

// The collective's source C as the stock Sm90SrcFetch gives it, or, with `present` false, 0
// without loading C at all (no TMA load, no shared-memory read: the collective asks
// is_C_load_needed at run time). B1's dres: absent where the residual stream's own gradient does
// not enter (the QKV norm's and the LM head's backward), which saves zero-filling dx and reading
// it back.
struct OptionalSourceArgs {
  bool present = true;
};
struct OptionalSource : ConsumerOnlyNode<OptionalSourceArgs> {
  using ConsumerOnlyNode<OptionalSourceArgs>::ConsumerOnlyNode;
  CUTLASS_DEVICE bool is_producer_load_needed() const { return params.present; }
  CUTLASS_DEVICE bool is_C_load_needed() const { return params.present; }

  template <class SrcTensor>
  struct ConsumerStoreCallbacks : cf::EmptyConsumerStoreCallbacks {
    CUTLASS_DEVICE ConsumerStoreCallbacks(SrcTensor const& c, bool present)
        : tCrC(c), present(present) {}
    SrcTensor const& tCrC;  // (CPY,CPY_M,CPY_N)
    bool present;
    template <class ElementAccumulator, int FragmentSize>
    CUTLASS_DEVICE auto visit(cutlass::Array<ElementAccumulator, FragmentSize> const&, int epi_v,
                              int, int) {
      using Fragment = cutlass::Array<typename SrcTensor::value_type, FragmentSize>;
      if (present) return cute::recast<Fragment>(tCrC)(epi_v);
      Fragment zero;
      zero.fill(typename SrcTensor::value_type(0));
      return zero;
    }
  };
  template <bool ReferenceSrc, class... Args>
  CUTLASS_DEVICE auto get_consumer_store_callbacks(cf::ConsumerStoreArgs<Args...> const& args) {
    using SrcTensor = std::decay_t<decltype(args.tCrC)>;
    return ConsumerStoreCallbacks<SrcTensor>(args.tCrC, params.present);
  }
};

// Stands in for a held aux store (B1's h, B2's a) where the output leaves from registers or is
// not written.
struct NoAuxStore {
  struct SharedStorage {};
  struct Params {};
  CUTLASS_HOST_DEVICE NoAuxStore() {}
  CUTLASS_HOST_DEVICE NoAuxStore(Params const&, SharedStorage const&) {}
};
// As a node's output store: the output is not written (B2 in FP8: the backward reads the copy of
// a its forward quantized instead).
struct WithoutOutput {};

// Params of a stock bf16 Sm90AuxStore that a node holds for one of its outputs (B1's h, B2's a):
// a row-major (M, N) tensor at ptr with leading dimension ld (elements).
template <class Store, class ProblemShape>
typename Store::Params held_store_params(ProblemShape const& shape, void* ptr, int64_t ld,
                                         void* workspace) {
  typename Store::Arguments out{static_cast<cutlass::bfloat16_t*>(ptr), {}};
  cute::get<0>(out.dAux) = ld;
  return Store::to_underlying_arguments(shape, out, workspace);
}

}  // namespace coda::kernel
