#pragma once
// The programs of OPS.md as CUTLASS sm90 epilogue visitor trees. Every formula comes from the
// shared functors in coda/epilogue and coda/programs (the CPU reference executor runs the same
// ones); this file only wires operands to nodes. One Fusion per kernel::Program:
//   ElementC / ElementD  - the source (C) and destination (D) element types (void = none)
//   Args                 - the host-side operand struct from args.hpp
//   Build<EpilogueDesc>  - Callbacks (the visitor tree) and arguments(Args) for its nested Arguments

#include <cutlass/epilogue/collective/collective_builder.hpp>
#include <cutlass/epilogue/fusion/sm90_callbacks_tma_warpspecialized.hpp>
#include <cutlass/epilogue/fusion/sm90_visitor_compute_tma_warpspecialized.hpp>
#include <cutlass/epilogue/fusion/sm90_visitor_load_tma_warpspecialized.hpp>
#include <cutlass/epilogue/fusion/sm90_visitor_store_tma_warpspecialized.hpp>

#include "coda/epilogue/elementwise.hpp"
#include "coda/kernel/args.hpp"
#include "coda/kernel/nodes.cuh"
#include "coda/programs/rope.hpp"

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

template <class ScalarFn>
using ComputeNode = cf::Sm90Compute<OnFragments<ScalarFn>::template Fn, float, float, kRound>;

// Vector operands. Per-row vectors use scalar loads (alignment 1) so a ragged M never reads past
// the end; per-column vectors are 16-byte aligned and N is a multiple of 8.
template <class Tile, class T>
using RowVector = cf::Sm90ColBroadcast<0, Tile, T, T, cute::Stride<cute::_1, cute::_0, int64_t>, 1>;
template <class Tile, class T, class Compute = T>
using ColumnVector = cf::Sm90RowBroadcast<0, Tile, T, Compute, cute::Stride<cute::_0, cute::_1, int64_t>>;

// Per-row partial sums over a tile's columns, left unreduced across N-tiles:
// PartialLayout::per_row (rows padded to the tile, row index fastest).
template <class Tile>
using RowPartialSum = cf::Sm90ColReduction<cutlass::plus, cutlass::plus, cutlass::plus, 0, Tile,
                                           float, float, kRound, cute::Stride<cute::_1, cute::_0, int64_t>,
                                           4, true, /*FinalReduction=*/false>;

template <class EpilogueDesc, class Element>
struct AuxStoreNode {
  using D = cutlass::epilogue::collective::detail::AuxStoreDescriptor<EpilogueDesc,
                                                                       cutlass::layout::RowMajor, Element>;
  using type = cf::Sm90AuxStore<D::Stages, typename EpilogueDesc::EpilogueTile, Element, kRound,
                                typename D::Stride, typename D::SmemLayoutAtom, typename D::CopyOpR2S>;
};

template <Program P>
struct FusionOf;

// D = acc
template <>
struct FusionOf<Program::kPlain> {
  using ElementC = void;
  using ElementD = bfloat16_t;
  using Args = PlainArgs;
  template <class EpilogueDesc>
  struct Build {
    using Callbacks = cf::Sm90AccFetch;
    static typename Callbacks::Arguments arguments(Args const&) { return {}; }
  };
};

// F1: x = acc + residual (C);  h = x ⊙ γ (aux store);  S = Σ_tile x² (per-row partials);  D = x
template <>
struct FusionOf<Program::kResidualRmsnormPartial> {
  using ElementC = bfloat16_t;
  using ElementD = bfloat16_t;
  using Args = ResidualRmsnormPartialArgs;
  template <class EpilogueDesc>
  struct Build {
    using Tile = typename EpilogueDesc::TileShape;
    using X = cf::Sm90EVT<ComputeNode<epilogue::Plus>, cf::Sm90AccFetch, cf::Sm90SrcFetch<bfloat16_t>>;
    using H = cf::Sm90EVT<typename AuxStoreNode<EpilogueDesc, bfloat16_t>::type,
                          cf::Sm90EVT<ComputeNode<epilogue::Multiplies>, cf::Sm90AccFetch,
                                      ColumnVector<Tile, bfloat16_t, float>>>;
    using S = cf::Sm90EVT<RowPartialSum<Tile>,
                          cf::Sm90EVT<ComputeNode<epilogue::Square>, cf::Sm90AccFetch>>;
    // x is computed once and fed as the "accumulator" of the three output trees.
    using Callbacks = cf::Sm90SplitTreeVisitor<X, cf::Sm90AccFetch, H, S>;

    static typename Callbacks::Arguments arguments(Args const& a) {
      return {
          {{}, {}, {}},                                                  // x = acc + C
          {{{}, {reinterpret_cast<const bfloat16_t*>(a.gamma), bfloat16_t(0), {}}, {}},  // x ⊙ γ
           {reinterpret_cast<bfloat16_t*>(a.h), {a.ldh, cute::_1{}, 0}}},  // store h
          {{{}, {}}, {a.sumsq_partials, 0.0f, {}}},                      // Σ x² partials
          {}};                                                           // D = x
    }
  };
};

// F2: z = r[m] · acc (D, interleaved g,u);  a = silu(z_g) · z_u (half width, own TMA store)
template <>
struct FusionOf<Program::kRmsnormSwiglu> {
  using ElementC = void;
  using ElementD = bfloat16_t;
  using Args = RmsnormSwigluArgs;
  template <class EpilogueDesc>
  struct Build {
    using Tile = typename EpilogueDesc::TileShape;
    using Z = cf::Sm90EVT<ComputeNode<epilogue::Multiplies>, cf::Sm90AccFetch, RowVector<Tile, float>>;
    using Callbacks = cf::Sm90EVT<HalfWidthStore<EpilogueDesc, epilogue::SwiGlu, bfloat16_t>, Z>;
    static typename Callbacks::Arguments arguments(Args const& a) {
      return {{{}, {a.r, 0.0f, {}}, {}}, {reinterpret_cast<bfloat16_t*>(a.a), a.lda}};
    }
  };
};

// F3: (q, k) = rope(r[m] · acc, pos[m], freq[n]); v = r[m] · acc (freq = 0 on V columns)
struct RopeFragment {
  struct Arguments {};
  template <int F>
  CUTLASS_DEVICE cutlass::Array<float, F> operator()(
      Arguments const&, cutlass::Array<float, F> const& acc, cutlass::Array<float, F> const& r,
      cutlass::Array<int32_t, F> const& pos, cutlass::Array<uint32_t, F> const& hi,
      cutlass::Array<uint32_t, F> const& lo) const {
    cutlass::Array<float, F> out;
    CUTLASS_PRAGMA_UNROLL
    for (int j = 0; j < F / 2; ++j) {
      float c, s;
      programs::rope_cos_sin<float>(pos[2 * j], programs::RopeFrequency{hi[2 * j], lo[2 * j]}, c, s);
      epilogue::RopeRotate{}(acc[2 * j] * r[2 * j], acc[2 * j + 1] * r[2 * j], c, s, out[2 * j],
                             out[2 * j + 1]);
    }
    return out;
  }
};

template <>
struct FusionOf<Program::kRmsnormRope> {
  using ElementC = void;
  using ElementD = bfloat16_t;
  using Args = RmsnormRopeArgs;
  template <class EpilogueDesc>
  struct Build {
    using Tile = typename EpilogueDesc::TileShape;
    using Callbacks = cf::Sm90EVT<PairwiseCompute<RopeFragment, float>, cf::Sm90AccFetch,
                                  RowVector<Tile, float>, RowVector<Tile, int32_t>,
                                  ColumnVector<Tile, uint32_t>, ColumnVector<Tile, uint32_t>>;
    static typename Callbacks::Arguments arguments(Args const& a) {
      return {{}, {a.r, 0.0f, {}}, {a.pos, 0, {}}, {a.freq_hi, 0u, {}}, {a.freq_lo, 0u, {}}, {}};
    }
  };
};

// F4: ℓ = r[m] · acc;  online (max, sumexp) partials over valid columns;  pick ℓ[m, target[m]]
template <class ElementD_>
struct RmsnormLseFusion {
  using ElementC = void;
  using ElementD = ElementD_;
  using Args = RmsnormLseArgs;
  template <class EpilogueDesc>
  struct Build {
    using Tile = typename EpilogueDesc::TileShape;
    using L = cf::Sm90EVT<ComputeNode<epilogue::Multiplies>, cf::Sm90AccFetch, RowVector<Tile, float>>;
    using Callbacks = cf::Sm90EVT<OnlineLseReduction<Tile, int64_t>, L, RowVector<Tile, int64_t>>;
    static typename Callbacks::Arguments arguments(Args const& a) {
      return {{{}, {a.r, 0.0f, {}}, {}},
              {a.targets, int64_t(-1), {}},
              {a.max_partials, a.sum_partials, a.target_logit}};
    }
  };
};
template <> struct FusionOf<Program::kRmsnormLse> : RmsnormLseFusion<void> {};
template <> struct FusionOf<Program::kRmsnormLseLogits> : RmsnormLseFusion<bfloat16_t> {};

template <>
struct FusionOf<Program::kPairLayoutProbe> {
  using ElementC = void;
  using ElementD = bfloat16_t;
  using Args = PlainArgs;
  template <class EpilogueDesc>
  struct Build {
    using Callbacks = PairLayoutProbe;
    static typename Callbacks::Arguments arguments(Args const&) { return {}; }
  };
};

}  // namespace coda::kernel
