#pragma once
// The Hopper executor: CUTLASS 4.2's sm90 warp-specialized persistent GEMM (TMA + wgmma, fp32
// accumulate) with an epilogue visitor tree built from our programs (fusions/*.cuh). One explicit
// instantiation of GemmLauncher<Config, Program, Operands>::run per translation unit, which
// includes the program's fusion header (fusions/*.cuh) before this one.

#include <cutlass/cutlass.h>
#include <cutlass/gemm/device/gemm_universal_adapter.h>

#include <cute/tensor.hpp>
#include <cutlass/detail/blockwise_scale_layout.hpp>
#include <cutlass/epilogue/collective/collective_builder.hpp>
#include <cutlass/gemm/collective/collective_builder.hpp>
#include <cutlass/gemm/kernel/gemm_universal.hpp>
#include <cutlass/util/packed_stride.hpp>
#include <type_traits>
#include <utility>

#include "coda/kernel/args.hpp"
#include "coda/kernel/fusions/common.cuh"
#include "coda/kernel/overlapped_promotion.cuh"
#include "coda/kernel/runtime.hpp"

namespace coda::kernel {

// ---- configurations -------------------------------------------------------------------------
template <int TileM, int TileN, int TileK, int ClusterM, int ClusterN, bool Cooperative,
          bool PromotionUnderMma>
struct KernelConfig {
  // The blockwise FP8 mainloop's order (table.def; the bf16 mainloop has no promotion).
  static constexpr bool kPromotionUnderMma = PromotionUnderMma;
  using TileShape = cute::Shape<cute::Int<TileM>, cute::Int<TileN>, cute::Int<TileK>>;
  using ClusterShape = cute::Shape<cute::Int<ClusterM>, cute::Int<ClusterN>, cute::_1>;
  using MainloopSchedule =
      std::conditional_t<Cooperative, cutlass::gemm::KernelTmaWarpSpecializedCooperative,
                         cutlass::gemm::KernelTmaWarpSpecializedPingpong>;
  using EpilogueSchedule =
      std::conditional_t<Cooperative, cutlass::epilogue::TmaWarpSpecializedCooperative,
                         cutlass::epilogue::TmaWarpSpecialized>;
  // NOTE: cooperative splits the tile's M across two consumer warpgroups (64 rows each per wgmma);
  // pingpong gives each warpgroup a whole tile and overlaps one's epilogue with the other's MMA.
  static_assert(!Cooperative || TileM % 128 == 0, "cooperative tiles need M divisible by 128");
  static_assert(TileN % 32 == 0, "epilogue subtiles are 32 columns wide");
};

template <Config C>
struct ConfigOf;
#define CODA_CONFIG(name, str, tile_m, tile_n, tile_k, cluster_m, cluster_n, cooperative, \
                    promotion_under_mma)                                                  \
  template <>                                                                             \
  struct ConfigOf<Config::k##name> {                                                      \
    using type = KernelConfig<tile_m, tile_n, tile_k, cluster_m, cluster_n, cooperative,  \
                              promotion_under_mma>;                                       \
  };
#include "coda/kernel/table.def"

// A fusion may set C's stage count (kStagesC; 0 keeps the builder's): B2 keeps three so its
// mainloop gets six stages (fusions/swiglu_backward.cuh). The count reaches both the collective's
// C ring (WithStagesC) and the descriptor the fusion builds its nodes from (DescriptorWith), so an
// AuxLoadNode's ring, which rides C's pipeline, gets the same count.
template <class F, class = void>
struct FusionStagesC : std::integral_constant<int, 0> {};
template <class F>
struct FusionStagesC<F, std::void_t<decltype(F::kStagesC)>>
    : std::integral_constant<int, F::kStagesC> {};
template <class Desc, int StagesCOverride>
struct DescriptorWithStagesC : Desc {
  static constexpr int StagesC = StagesCOverride;
};
template <class Desc, int StagesC>
using DescriptorWith = std::conditional_t<StagesC == 0, Desc, DescriptorWithStagesC<Desc, StagesC>>;
template <class Op, int StagesC>
struct WithStagesC {
  static_assert(StagesC == 0, "kStagesC needs the sm90 TMA warp-specialized epilogue collective");
  using type = Op;
};
template <int SC, int SD, int FS, bool Reuse, bool Delay, class... Rest, int StagesC>
struct WithStagesC<
    cutlass::epilogue::collective::CollectiveEpilogue<
        cutlass::epilogue::Sm90TmaWarpSpecialized<SC, SD, FS, Reuse, Delay>, Rest...>,
    StagesC> {
  // With C's buffers reused for D, a store holds its buffer until the TMA has read it: C needs a
  // stage more than D has in flight.
  static_assert(StagesC == 0 || !Reuse || StagesC > SD, "C / D reuse needs StagesC > StagesD");
  using type = cutlass::epilogue::collective::CollectiveEpilogue<
      cutlass::epilogue::Sm90TmaWarpSpecialized<StagesC == 0 ? SC : StagesC, SD, FS, Reuse, Delay>,
      Rest...>;
};

// A configuration with PromotionUnderMma runs the blockwise FP8 mainloop with each k-tile's
// promotion under the next one's MMAs (OverlappedPromotion); the others CUTLASS's loop, which
// waits for a k-tile's MMAs before promoting it. Which program runs on which is table.def's, and
// which K the plain GEMM takes it to is the heuristic's (src/heuristic.cpp fp8_config).
// OverlappedPromotion needs one B scale per tile (it checks): the weight gradient's per-column
// scales keep CUTLASS's loop (overlapped_promotion.cuh says why).

// A fusion may name its tile scheduler tag (Scheduler); the stock persistent scheduler otherwise.
// F2 with FP8 a runs each CTA's tiles in pairs along N (paired_scheduler.cuh).
template <class F, class = void>
struct FusionScheduler {
  using type = cutlass::gemm::PersistentScheduler;
};
template <class F>
struct FusionScheduler<F, std::void_t<typename F::Scheduler>> {
  using type = typename F::Scheduler;
};

// How each operand layout reaches the mainloop: the element type, the CUTLASS layout tags (with
// the scale layout, for the blockwise FP8 operands) and the kernel schedule.
template <Operands O>
struct OperandTraits;
struct Bf16Operands {
  using Element = cutlass::bfloat16_t;
  static constexpr bool kBlockwise = false;
};
template <>
struct OperandTraits<Operands::kXWt> : Bf16Operands {
  using A = cutlass::layout::RowMajor;
  using B = cutlass::layout::ColumnMajor;  // B(k, n) = W[n, k]: K-major
};
template <>
struct OperandTraits<Operands::kXW> : Bf16Operands {
  using A = cutlass::layout::RowMajor;
  using B = cutlass::layout::RowMajor;  // B(k, n) = W[k, n]: N-major
};
template <>
struct OperandTraits<Operands::kXtY> : Bf16Operands {
  using A = cutlass::layout::ColumnMajor;  // A(m, k) = X[k, m]: M-major
  using B = cutlass::layout::RowMajor;
};
// Blockwise FP8 (CUTLASS 4.2's MainloopSm90TmaGmmaWarpSpecializedBlockwiseFP8): both operands
// K-major; A's scales per 1x128 block, M-major (TMA-loaded when a tile holds 32+ rows); B's per
// 128x128 block (K-major) or per 1x128 block (N-major). args.hpp's ScaleLayout says where.
template <int GranularityN, cute::GMMA::Major MajorSFB>
struct Fp8Operands {
  using Element = cutlass::float_e4m3_t;
  static constexpr bool kBlockwise = true;
  using Scales = cutlass::detail::Sm90BlockwiseScaleConfig<1, GranularityN, ScaleLayout::kBlock,
                                                           cute::GMMA::Major::MN, MajorSFB>;
  using LayoutSFA = decltype(Scales::deduce_layoutSFA());
  using LayoutSFB = decltype(Scales::deduce_layoutSFB());
  using A = cute::tuple<cutlass::layout::RowMajor, LayoutSFA>;
  using B = cute::tuple<cutlass::layout::ColumnMajor, LayoutSFB>;

  // ((1, M4), (128, KB), 1) with strides ((0, 1), (0, ld), ld · KB), M4 = M rounded up to 4: TMA
  // loads of the scales move 16-byte rows (the scales of rows past M scale no stored output).
  static LayoutSFA layout_sfa(int m, int k, int64_t ld) {
    using namespace cute;
    const int kb = int(ScaleLayout::blocks(k));
    m = int(ScaleLayout::row_scales_ld(m));
    return make_layout(
        make_shape(make_shape(Int<1>{}, m), make_shape(Int<ScaleLayout::kBlock>{}, kb), 1),
        make_stride(make_stride(_0{}, _1{}), make_stride(_0{}, int(ld)), int(ld) * kb));
  }
  static LayoutSFB layout_sfb(int n, int k, int64_t ld) {
    using namespace cute;
    const int kb = int(ScaleLayout::blocks(k));
    if constexpr (MajorSFB == GMMA::Major::K) {  // ((128, NB), (128, KB), 1), ((0, ld), (0, 1), ..)
      const int nb = int(ScaleLayout::blocks(n));
      return make_layout(
          make_shape(make_shape(Int<GranularityN>{}, nb),
                     make_shape(Int<ScaleLayout::kBlock>{}, kb), 1),
          make_stride(make_stride(_0{}, int(ld)), make_stride(_0{}, _1{}), int(ld) * nb));
    } else {  // ((1, N), (128, KB), 1), ((0, 1), (0, ld), ..)
      return make_layout(
          make_shape(make_shape(Int<GranularityN>{}, n), make_shape(Int<ScaleLayout::kBlock>{}, kb),
                     1),
          make_stride(make_stride(_0{}, _1{}), make_stride(_0{}, int(ld)), int(ld) * kb));
    }
  }
};
template <>
struct OperandTraits<Operands::kFp8XWt> : Fp8Operands<ScaleLayout::kBlock, cute::GMMA::Major::K> {};
template <>
struct OperandTraits<Operands::kFp8XYt> : Fp8Operands<1, cute::GMMA::Major::MN> {};

template <class Cfg, bool Blockwise>
using MainloopScheduleOf = std::conditional_t<
    !Blockwise, typename Cfg::MainloopSchedule,
    std::conditional_t<std::is_same_v<typename Cfg::MainloopSchedule,
                                      cutlass::gemm::KernelTmaWarpSpecializedCooperative>,
                       cutlass::gemm::KernelTmaWarpSpecializedCooperativeFP8Blockwise,
                       cutlass::gemm::KernelTmaWarpSpecializedPingpongFP8Blockwise>>;

// Puts the leading dimension into the one dynamic stride of a rank-2(+batch) CuTe stride.
template <class Stride>
Stride with_leading_dimension(Stride s, int64_t ld) {
  if constexpr (cute::is_static<cute::remove_cvref_t<decltype(cute::get<0>(s))>>::value) {
    cute::get<1>(s) = ld;
  } else {
    cute::get<0>(s) = ld;
  }
  return s;
}

// The operands' element type (bf16 or e4m3) comes from the layout; the epilogue programs are the
// same for both, since they see fp32 accumulators (the FP8 mainloop applies the block scales).
template <Config C, Program P, Operands O>
struct GemmLauncher {
  using Operand = OperandTraits<O>;
  using ElementAB = typename Operand::Element;
  static constexpr int kAlignAB = 128 / cutlass::sizeof_bits<ElementAB>::value;  // 16-byte TMA rows
  using Cfg = typename ConfigOf<C>::type;
  using Fusion = FusionOf<P>;
  using TileShape = typename Cfg::TileShape;
  using ClusterShape = typename Cfg::ClusterShape;
  using ElementC = typename Fusion::ElementC;
  using ElementD = typename Fusion::ElementD;
  using LayoutC = cutlass::layout::RowMajor;
  // 16-byte TMA rows of C (8 when C is void: the builder still asks for an alignment).
  static constexpr int kAlignC =
      std::is_void_v<ElementC> ? 8 : 128 / cutlass::sizeof_bits<ElementC>::value;
  // 16-byte TMA rows of D.
  static constexpr int kAlignD =
      std::is_void_v<ElementD> ? 8 : 128 / cutlass::sizeof_bits<ElementD>::value;

  using EpilogueTileType = cutlass::epilogue::collective::EpilogueTileAuto;
  using EpilogueDesc = DescriptorWith<
      cutlass::epilogue::collective::detail::EpilogueDescriptor<
          TileShape, EpilogueTileType, ElementC, ElementD, typename Cfg::EpilogueSchedule>,
      FusionStagesC<Fusion>::value>;
  using Build = typename Fusion::template Build<EpilogueDesc>;
  using Callbacks = typename Build::Callbacks;

  using CollectiveEpilogue = typename WithStagesC<
      typename cutlass::epilogue::collective::CollectiveBuilder<
          cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
          EpilogueTileType, float, float, ElementC, LayoutC, kAlignC, ElementD, LayoutC, kAlignD,
          typename Cfg::EpilogueSchedule, Callbacks>::CollectiveOp,
      FusionStagesC<Fusion>::value>::type;

  using BuiltMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElementAB, typename Operand::A, kAlignAB,
      ElementAB, typename Operand::B, kAlignAB, float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename CollectiveEpilogue::SharedStorage))>,
      MainloopScheduleOf<Cfg, Operand::kBlockwise>>::CollectiveOp;
  static_assert(!Cfg::kPromotionUnderMma || Operand::kBlockwise,
                "a PromotionUnderMma configuration takes blockwise FP8 operands");
  using CollectiveMainloop = std::conditional_t<Cfg::kPromotionUnderMma,
                                                OverlappedPromotion<BuiltMainloop>, BuiltMainloop>;

  using Kernel = cutlass::gemm::kernel::GemmUniversal<cute::Shape<int, int, int, int>,
                                                      CollectiveMainloop, CollectiveEpilogue,
                                                      typename FusionScheduler<Fusion>::type>;
  using Adapter = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;

  // Programmatic dependent launch needs the kernels' waits (griddepcontrol.wait), which CUTLASS
  // compiles in only under CUTLASS_ENABLE_GDC_FOR_SM90 (CMakeLists.txt sets it for every CUDA
  // unit): a unit built without it launches without PDL rather than with PDL and no waits.
#ifdef CUTLASS_ENABLE_GDC_FOR_SM90
  static constexpr bool kWaitsCompiled = true;
#else
  static constexpr bool kWaitsCompiled = false;
#endif

  static cudaError_t run(const GemmProblem& p, const void* fusion_args,
                         const SchedulerOptions& sched, cudaStream_t stream) {
    // First: it may throw (a bad CODA_PROGRAMMATIC_LAUNCH) before anything is allocated.
    const bool pdl = kWaitsCompiled && programmatic_launch();
    using StrideC = typename Kernel::StrideC;
    using StrideD = typename Kernel::StrideD;
    const auto& fa = *static_cast<const typename Fusion::Args*>(fusion_args);

    int device = 0;
    cudaError_t err = cudaGetDevice(&device);
    if (err != cudaSuccess) return err;
    cutlass::KernelHardwareInfo hw;
    hw.device_id = device;
    DeviceProps props;
    err = device_props(device, &props);
    if (err != cudaSuccess) return err;
    hw.sm_count = props.multiprocessors;

    const KernelOperands operands = kernel_operands(p, fa);
    const ElementC* c_pointer = nullptr;
    if constexpr (!std::is_void_v<ElementC>) c_pointer = static_cast<const ElementC*>(operands.c);
    ElementD* d_pointer = nullptr;
    if constexpr (!std::is_void_v<ElementD>) d_pointer = static_cast<ElementD*>(operands.d);

    typename Adapter::Arguments args{
        cutlass::gemm::GemmUniversalMode::kGemm,
        {p.m, p.n, p.k, 1},
        mainloop_arguments(p),
        {build_arguments(fa, p), c_pointer,
         with_leading_dimension(cutlass::make_cute_packed_stride(StrideC{}, {p.m, p.n, 1}),
                                operands.ldc),
         d_pointer,
         with_leading_dimension(cutlass::make_cute_packed_stride(StrideD{}, {p.m, p.n, 1}),
                                operands.ldd)},
        hw};
    using RasterOption = cutlass::gemm::kernel::detail::RasterOrderOptions;
    args.scheduler.max_swizzle_size = sched.swizzle;
    args.scheduler.raster_order =
        sched.raster == coda::kernel::Raster::kAlongM   ? RasterOption::AlongM
        : sched.raster == coda::kernel::Raster::kAlongN ? RasterOption::AlongN
                                                        : RasterOption::Heuristic;

    // CUTLASS asks each operand's contiguous extent to be a multiple of its 16-byte alignment
    // (it derives strides from extents); the TMA asks it of the row strides and starts only, which
    // the op layer checks. Loads zero-fill past the extents; D's store writes whole 16-byte
    // granules, zeros past N (the contract in ops.hpp). So the check sees the extents rounded up
    // to 8 and the run the real ones (an N, K or Xᵀ·Y M of any size).
    auto check = args;
    const auto up8 = [](int e) { return (e + 7) / 8 * 8; };
    check.problem_shape = {up8(p.m), up8(p.n), up8(p.k), 1};
    Adapter gemm;
    if (gemm.can_implement(check) != cutlass::Status::kSuccess) return cudaErrorInvalidValue;
    const size_t workspace_bytes = Adapter::get_workspace_size(args);
    void* workspace = nullptr;
    if (workspace_bytes > 0) {
      err = cudaMallocAsync(&workspace, workspace_bytes, stream);
      if (err != cudaSuccess) return err;
    }
    cutlass::Status status = gemm.initialize(args, workspace, stream);
    if (status == cutlass::Status::kSuccess)
      status = gemm.run(stream, /*cuda_adapter=*/nullptr, pdl);
    if (workspace) cudaFreeAsync(workspace, stream);
    if (status != cutlass::Status::kSuccess) return cudaErrorLaunchFailure;
    return cudaGetLastError();
  }

 private:
  static typename CollectiveMainloop::Arguments mainloop_arguments(const GemmProblem& p) {
    using StrideA = typename Kernel::StrideA;
    using StrideB = typename Kernel::StrideB;
    const auto* a = static_cast<const ElementAB*>(p.a);
    const auto* b = static_cast<const ElementAB*>(p.b);
    const auto stride_a =
        with_leading_dimension(cutlass::make_cute_packed_stride(StrideA{}, {p.m, p.k, 1}), p.lda);
    const auto stride_b =
        with_leading_dimension(cutlass::make_cute_packed_stride(StrideB{}, {p.n, p.k, 1}), p.ldb);
    if constexpr (Operand::kBlockwise) {
      return {a,         stride_a,
              b,         stride_b,
              p.scale_a, Operand::layout_sfa(p.m, p.k, p.ld_scale_a),
              p.scale_b, Operand::layout_sfb(p.n, p.k, p.ld_scale_b)};
    } else {
      return {a, stride_a, b, stride_b};
    }
  }
  // Whether Op<F> is well-formed (C++17 detection; the CUDA units compile as C++17).
  template <template <class> class Op, class F, class = void>
  struct Detected : std::false_type {};
  template <template <class> class Op, class F>
  struct Detected<Op, F, std::void_t<Op<F>>> : std::true_type {};
  // The visitor tree's arguments from the program's Args, or from Args and the problem for a
  // fusion whose tree loads a problem operand itself (F1 reads p.c through Sm90AuxLoad).
  template <class B>
  using ArgumentsWithProblem = decltype(B::arguments(std::declval<typename Fusion::Args const&>(),
                                                     std::declval<GemmProblem const&>()));
  static auto build_arguments(typename Fusion::Args const& fa, const GemmProblem& p) {
    if constexpr (Detected<ArgumentsWithProblem, Build>::value) {
      return Build::arguments(fa, p);
    } else {
      return Build::arguments(fa);
    }
  }
  // C and D are the problem's p.c and p.d, or, for a fusion that defines
  // operands(Args, GemmProblem), its own (B2: z as C, loaded by the epilogue's producer warp, and
  // dz as D; the problem's p.d, a, then leaves through an aux store its tree holds).
  template <class F>
  using OwnOperands = decltype(F::operands(std::declval<typename F::Args const&>(),
                                           std::declval<GemmProblem const&>()));
  static KernelOperands kernel_operands(const GemmProblem& p, typename Fusion::Args const& fa) {
    if constexpr (Detected<OwnOperands, Fusion>::value) {
      return Fusion::operands(fa, p);
    } else {
      return {p.c, p.ldc, p.d, p.ldd};
    }
  }
};

}  // namespace coda::kernel
