#pragma once
// The programs of docs/math.md as CUTLASS sm90 epilogue visitor trees, one header per program in
// include/coda/kernel/fusions/ (so a change to one program recompiles only its kernels). Every
// formula comes from the shared functors in coda/epilogue and coda/programs (the CPU reference
// executor runs the same ones); these files only wire operands to nodes. One Fusion per Program:
//   ElementC / ElementD  - the source (C) and destination (D) element types (void = none)
//   Args                 - the host-side operand struct from args.hpp
//   Build<EpilogueDesc>  - Callbacks (the visitor tree) and arguments(Args) for its nested
//   Arguments

#include <cutlass/epilogue/collective/collective_builder.hpp>
#include <cutlass/epilogue/fusion/sm90_callbacks_tma_warpspecialized.hpp>
#include <cutlass/epilogue/fusion/sm90_visitor_compute_tma_warpspecialized.hpp>
#include <cutlass/epilogue/fusion/sm90_visitor_load_tma_warpspecialized.hpp>
#include <cutlass/epilogue/fusion/sm90_visitor_store_tma_warpspecialized.hpp>

#include "coda/epilogue/elementwise.hpp"
#include "coda/kernel/args.hpp"
#include "coda/kernel/nodes/common.cuh"

namespace coda::kernel {

using cutlass::bfloat16_t;
constexpr auto kRound = cutlass::FloatRoundStyle::round_to_nearest;

// Lifts a scalar functor of coda::epilogue to the fragment-array form Sm90Compute calls.
template <class ScalarFn>
struct OnFragments {
  template <class Frag>
  struct Fn {
    template <class... Frags>
    CUTLASS_HOST_DEVICE Frag operator()(Frag const& a, Frags const&... rest) const {
      Frag out;
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < Frag::kElements; ++i) out[i] = ScalarFn{}(a[i], rest[i]...);
      return out;
    }
  };
};

// Returns its first input: the root of a DAG whose other inputs are side outputs (stores,
// reductions).
struct TakeFirst {
  template <class T, class... Rest>
  CUTLASS_HOST_DEVICE T operator()(T a, Rest...) const {
    return a;
  }
};

template <class ScalarFn>
using ComputeNode = cf::Sm90Compute<OnFragments<ScalarFn>::template Fn, float, float, kRound>;

// Vector operands. Per-row vectors use scalar loads (alignment 1) so a ragged M never reads past
// the end; per-column vectors are 16-byte aligned and N is a multiple of 8.
template <class Tile, class T>
using RowVector = cf::Sm90ColBroadcast<0, Tile, T, T, cute::Stride<cute::_1, cute::_0, int64_t>, 1>;
template <class Tile, class T, class Compute = T>
using ColumnVector =
    cf::Sm90RowBroadcast<0, Tile, T, Compute, cute::Stride<cute::_0, cute::_1, int64_t>>;

// Per-row partial sums over a tile's columns, left unreduced across N-tiles:
// PartialLayout::per_row (rows padded to the tile, row index fastest).
template <class Tile>
using RowPartialSum =
    cf::Sm90ColReduction<cutlass::plus, cutlass::plus, cutlass::plus, 0, Tile, float, float, kRound,
                         cute::Stride<cute::_1, cute::_0, int64_t>, 4, true,
                         /*FinalReduction=*/false>;

template <class EpilogueDesc, class Element>
struct AuxStoreNode {
  using D =
      cutlass::epilogue::collective::detail::AuxStoreDescriptor<EpilogueDesc,
                                                                cutlass::layout::RowMajor, Element>;
  using type =
      cf::Sm90AuxStore<D::Stages, typename EpilogueDesc::EpilogueTile, Element, kRound,
                       typename D::Stride, typename D::SmemLayoutAtom, typename D::CopyOpR2S>;
};

// A row-major (M, N) operand loaded by TMA from the epilogue's producer warp into its own smem
// ring, on C's load pipeline (StagesC subtiles ahead of the consumer), read into registers with
// the vectorized smem load the builder picks for a source of this type.
template <class EpilogueDesc, class Element>
struct AuxLoadNode {
  using D =
      cutlass::epilogue::collective::detail::AuxLoadDescriptor<EpilogueDesc,
                                                               cutlass::layout::RowMajor, Element>;
  using type = cf::Sm90AuxLoad<D::Stages, typename EpilogueDesc::EpilogueTile, Element,
                               typename D::Stride, typename D::SmemLayoutAtom,
                               typename D::CopyOpS2R>;
  // Arguments for a tensor at ptr with leading dimension ld (elements).
  static typename type::Arguments arguments(const void* ptr, int64_t ld) {
    typename D::Stride stride{};
    cute::get<0>(stride) = ld;
    return {reinterpret_cast<const Element*>(ptr), Element(0), stride};
  }
};

template <Program P>
struct FusionOf;

// The source (C) and destination (D) element types of a fusion (void: none) and its operand struct.
template <class ElementC_, class ElementD_, class Args_>
struct FusionTypes {
  using ElementC = ElementC_;
  using ElementD = ElementD_;
  using Args = Args_;
};

}  // namespace coda::kernel
