// The op API refuses bad arguments with a coda::Error naming the argument and the expected vs
// actual value, before it touches the device: these checks run (and are tested) on machines
// without a GPU. The views point at addresses that are never dereferenced.

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <functional>
#include <string>

#include "coda/kernel/aux_kernels.hpp"
#include "coda/ops.hpp"

namespace coda::ops {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e.what();
  }
  ADD_FAILURE() << "expected coda::Error";
  return {};
}

TensorView bf16_matrix(uintptr_t address, int64_t rows, int64_t cols, int64_t ld = 0) {
  return TensorView::matrix(reinterpret_cast<void*>(address), DType::kBF16, rows, cols,
                            ld ? ld : cols, 0);
}
TensorView f32_vector(uintptr_t address, int64_t n) {
  return TensorView::vector(reinterpret_cast<void*>(address), DType::kF32, n, 0);
}

TEST(OpArguments, SizesAreCheckedWithTheirValues) {
  EXPECT_THAT(error_of([] {
                gemm(bf16_matrix(256, 0, 16), bf16_matrix(512, 16, 16), bf16_matrix(768, 0, 16),
                     nullptr);
              }),
              AllOf(HasSubstr("coda::ops::gemm"), HasSubstr("M=0")));
  // The plain GEMM takes any N (its D clipped by the TMA store), not a row stride the TMA cannot
  // address: N = 12 needs d's rows padded to 16.
  EXPECT_THAT(error_of([] {
                gemm(bf16_matrix(256, 4, 16), bf16_matrix(512, 12, 16), bf16_matrix(768, 4, 12),
                     nullptr);
              }),
              AllOf(HasSubstr("d needs a row stride >= 12 of a multiple of 16 bytes"),
                    HasSubstr("got 12 elements")));
  EXPECT_THAT(error_of([] {
                gemm_xty(bf16_matrix(256, 5, 12), bf16_matrix(512, 5, 16), bf16_matrix(768, 12, 16),
                         nullptr);
              }),
              HasSubstr("x needs a row stride >= 12 of a multiple of 16 bytes"));
  // A program whose nodes map column pairs 16 bytes at a time still needs N % 8.
  EXPECT_THAT(error_of([] {
                gemm_residual_rmsnorm_partial(
                    bf16_matrix(256, 4, 16), bf16_matrix(512, 12, 16), bf16_matrix(768, 4, 12, 16),
                    bf16_matrix(1024, 12, 1), bf16_matrix(1280, 4, 12, 16),
                    bf16_matrix(1536, 4, 12, 16), f32_vector(2048, 4), nullptr);
              }),
              AllOf(HasSubstr("N must be a multiple of 8"), HasSubstr("got 12")));
  EXPECT_THAT(error_of([] {
                gemm_rmsnorm_swiglu(bf16_matrix(256, 4, 16), bf16_matrix(512, 24, 16),
                                    f32_vector(1024, 4), bf16_matrix(768, 4, 24),
                                    bf16_matrix(1024, 4, 12), nullptr);
              }),
              AllOf(HasSubstr("2I (w_gu's rows) must be a multiple of 16"), HasSubstr("got 24")));
}

TEST(OpArguments, ShapesDtypesAndStridesAreNamedWithExpectedAndActual) {
  // d has the wrong shape.
  EXPECT_THAT(error_of([] {
                gemm(bf16_matrix(256, 4, 16), bf16_matrix(512, 8, 16), bf16_matrix(768, 4, 16),
                     nullptr);
              }),
              AllOf(HasSubstr("d must have shape (4, 8), got (4, 16)")));
  // w is float32.
  EXPECT_THAT(error_of([] {
                gemm(bf16_matrix(256, 4, 16),
                     TensorView::matrix(reinterpret_cast<void*>(512), DType::kF32, 8, 16, 16, 0),
                     bf16_matrix(768, 4, 8), nullptr);
              }),
              HasSubstr("w must be bfloat16, got float32"));
  // A row stride that is not 16 bytes: 12 bf16 elements.
  EXPECT_THAT(
      error_of([] {
        gemm(bf16_matrix(256, 4, 8, 12), bf16_matrix(512, 8, 8), bf16_matrix(768, 4, 8), nullptr);
      }),
      AllOf(HasSubstr("x needs a row stride >= 8 of a multiple of 16 bytes"), HasSubstr("got 12")));
  // A vector where a matrix belongs, and a matrix where a vector belongs.
  EXPECT_THAT(error_of([] {
                first_layer_rmsnorm(bf16_matrix(256, 4, 16), bf16_matrix(512, 1, 16), 1e-5f,
                                    bf16_matrix(768, 4, 16), f32_vector(1024, 4), nullptr);
              }),
              HasSubstr("gamma must be a vector of 16 elements"));
}

TEST(OpArguments, NullAndMisalignedPointersAreNamed) {
  EXPECT_THAT(error_of([] {
                gemm(bf16_matrix(256, 4, 16), bf16_matrix(0, 16, 16), bf16_matrix(768, 4, 16),
                     nullptr);
              }),
              HasSubstr("w is null"));
  EXPECT_THAT(error_of([] {
                gemm(bf16_matrix(256 + 2, 4, 16), bf16_matrix(512, 16, 16), bf16_matrix(768, 4, 16),
                     nullptr);
              }),
              AllOf(HasSubstr("x must be 16-byte aligned"), HasSubstr("0x102")));
  EXPECT_THAT(error_of([] {
                rope_backward(
                    bf16_matrix(256, 4, 16), bf16_matrix(512, 4, 16), TensorView{},
                    TensorView::vector(nullptr, DType::kI32, 4, 0),
                    TensorView::matrix(reinterpret_cast<void*>(1024), DType::kI32, 2, 16, 16, 0),
                    64, bf16_matrix(768, 4, 16), f32_vector(1024, 4), nullptr);
              }),
              HasSubstr("pos is null"));
}

TEST(OpArguments, HostMemoryIsRefusedBeforeAnyLaunch) {
  // The views say where their memory is; one on the host (device -1) is named as it is checked,
  // before any device query (so also on a machine without a GPU).
  EXPECT_THAT(error_of([] {
                TensorView d = bf16_matrix(768, 4, 16);
                d.device = -1;
                gemm(bf16_matrix(256, 4, 16), bf16_matrix(512, 16, 16), d, nullptr);
              }),
              HasSubstr("coda::ops::gemm: d is host memory (device -1)"));
}

TEST(OpArguments, TheRopeBackwardKernelRefusesRowsItCannotReadAsWords) {
  // The kernel layer under ops::rope_backward (which asks for 16-byte alignment) reads bf16 pairs
  // as 32-bit words: an odd-element pointer is an error, not a misaligned-address fault.
  const uint32_t* words = reinterpret_cast<const uint32_t*>(uintptr_t(1024));
  const auto* fake = reinterpret_cast<const kernel::bf16*>(uintptr_t(256));
  const auto* odd = reinterpret_cast<const kernel::bf16*>(uintptr_t(512 + 2));
  EXPECT_THAT(error_of([&] {
                kernel::rope_backward(fake, odd, nullptr, reinterpret_cast<const int32_t*>(1024),
                                      words, words, 4, 16, 64,
                                      reinterpret_cast<kernel::bf16*>(uintptr_t(768)),
                                      reinterpret_cast<float*>(1024), nullptr);
              }),
              AllOf(HasSubstr("dy must be 4-byte aligned"), HasSubstr("0x202")));
}

TEST(OpArguments, TableAndPartialShapesAreNamed) {
  EXPECT_THAT(error_of([] {
                rope_backward(
                    bf16_matrix(256, 4, 16), bf16_matrix(512, 4, 16), TensorView{},
                    TensorView::vector(reinterpret_cast<void*>(1024), DType::kI32, 4, 0),
                    TensorView::matrix(reinterpret_cast<void*>(1024), DType::kI32, 2, 8, 8, 0), 64,
                    bf16_matrix(768, 4, 16), f32_vector(1024, 4), nullptr);
              }),
              AllOf(HasSubstr("rope_table must have shape (2, 16), got (2, 8)")));
  EXPECT_THAT(error_of([] {
                rmsnorm_fold(TensorView::matrix(nullptr, DType::kF32, 1, 128, 128, 0), 64, 1e-5f,
                             f32_vector(1024, 128), nullptr);
              }),
              HasSubstr("sumsq_partials is null"));
}

TEST(OpArguments, QkNormHeadsAndAliasesAreNamed) {
  const auto i32 = [](uintptr_t address, int64_t rows, int64_t cols) {
    return rows == 1 ? TensorView::vector(reinterpret_cast<void*>(address), DType::kI32, cols, 0)
                     : TensorView::matrix(reinterpret_cast<void*>(address), DType::kI32, rows, cols,
                                          cols, 0);
  };
  const auto bf16_vector = [](uintptr_t address, int64_t n) {
    return TensorView::vector(reinterpret_cast<void*>(address), DType::kBF16, n, 0);
  };
  // head_dim 96 does not divide the forward's 128-column tile.
  const programs::QkNorm wide{{2, 1, 96}, 1e-6};
  EXPECT_THAT(error_of([&] {
                gemm_rmsnorm_qk_norm_rope(bf16_matrix(256, 4, 16), bf16_matrix(512, 384, 16),
                                          f32_vector(1024, 4), bf16_vector(2048, 96),
                                          bf16_vector(4096, 96), wide, i32(8192, 1, 4),
                                          i32(16384, 2, 384), bf16_matrix(32768, 4, 384),
                                          bf16_matrix(65536, 4, 288), nullptr);
              }),
              AllOf(HasSubstr("coda::ops::gemm_rmsnorm_qk_norm_rope"),
                    HasSubstr("head_dim must divide 128"), HasSubstr("got 96")));
  // The backward's output may not alias an input it reads.
  const programs::QkNorm qk{{2, 1, 64}, 1e-6};
  const uintptr_t qkv = 1 << 16;
  EXPECT_THAT(error_of([&] {
                qk_norm_rope_backward(
                    bf16_matrix(1 << 12, 4, 192), bf16_matrix(qkv, 4, 256),
                    bf16_matrix(1 << 17, 4, 256), bf16_vector(1 << 18, 64),
                    bf16_vector(1 << 19, 64), qk, i32(1 << 20, 1, 4), i32(1 << 21, 2, 256), 128,
                    bf16_matrix(qkv, 4, 256), f32_vector(1 << 22, 4),
                    TensorView::matrix(reinterpret_cast<void*>(uintptr_t(1) << 23), DType::kF32,
                                       qk_norm_backward_partials_rows(4), 128, 128, 0),
                    f32_vector(1 << 24, 64), f32_vector(1 << 25, 64), nullptr);
              }),
              HasSubstr("dqkv_pre must not alias qkv"));
}

TEST(OpArguments, SplitRopeTableKeepsBothWords) {
  const std::vector<programs::RopeFrequency> t{{1, 2}, {3, 4}, {0xffffffffu, 0}};
  std::vector<uint32_t> hi, lo;
  split_rope_table(t, hi, lo);
  EXPECT_EQ(hi, (std::vector<uint32_t>{1, 3, 0xffffffffu}));
  EXPECT_EQ(lo, (std::vector<uint32_t>{2, 4, 0}));
}

TensorView typed(uintptr_t address, DType t, int64_t rows, int64_t cols, int64_t ld = 0) {
  return TensorView::matrix(reinterpret_cast<void*>(address), t, rows, cols, ld ? ld : cols, 0);
}

TEST(OpArguments, Fp8OperandsAndScalesAreChecked) {
  const auto e4 = DType::kE4M3, f = DType::kF32;
  // K = 40: a multiple of 8 but not of 16 (16-byte rows of e4m3).
  EXPECT_THAT(error_of([&] {
                gemm_fp8(typed(256, e4, 4, 40, 48), typed(512, f, 1, 4), typed(768, e4, 8, 40, 48),
                         typed(1024, f, 1, 1), bf16_matrix(1280, 4, 8), nullptr);
              }),
              AllOf(HasSubstr("coda::ops::gemm_fp8"), HasSubstr("K must be a multiple of 16"),
                    HasSubstr("got 40")));
  // x in bf16 where e4m3 codes are expected.
  EXPECT_THAT(error_of([&] {
                gemm_fp8(bf16_matrix(256, 4, 32), typed(512, f, 1, 4), typed(768, e4, 8, 32),
                         typed(1024, f, 1, 1), bf16_matrix(1280, 4, 8), nullptr);
              }),
              AllOf(HasSubstr("x must be float8_e4m3fn"), HasSubstr("got bfloat16")));
  // 1x128 scales of 6 rows need a row stride of at least 8 (6 rounded up to 4) for the TMA.
  EXPECT_THAT(
      error_of([&] {
        gemm_fp8(typed(256, e4, 6, 256), typed(512, f, 2, 6, 6), typed(768, e4, 8, 256),
                 typed(1024, f, 1, 2), bf16_matrix(1280, 6, 8), nullptr);
      }),
      AllOf(HasSubstr("x_scales needs a row stride >= 8 and a multiple of 4"), HasSubstr("got 6")));
  // 128x128 scales of the wrong grid.
  EXPECT_THAT(error_of([&] {
                gemm_fp8(typed(256, e4, 4, 256), typed(512, f, 2, 4), typed(768, e4, 136, 256),
                         typed(1024, f, 1, 2), bf16_matrix(1280, 4, 136), nullptr);
              }),
              HasSubstr("w_scales must be fp32 scales of shape (2, 2), got (1, 2)"));
  // Scale layouts with 32-bit strides: 2 K blocks of rows 2^30 apart span 2^31 entries.
  EXPECT_THAT(error_of([&] {
                gemm_fp8(typed(256, e4, 4, 256), typed(512, f, 2, 4, int64_t(1) << 30),
                         typed(768, e4, 8, 256), typed(1024, f, 1, 2), bf16_matrix(1280, 4, 8),
                         nullptr);
              }),
              HasSubstr("the scales must span fewer than 2^31 entries"));
  // The weight gradient accumulates into fp32.
  EXPECT_THAT(error_of([&] {
                gemm_fp8_xyt(typed(256, e4, 8, 32), typed(512, f, 1, 8), typed(768, e4, 8, 32),
                             typed(1024, f, 1, 8), bf16_matrix(1280, 8, 8), true, nullptr);
              }),
              AllOf(HasSubstr("gemm_fp8_xyt (accumulate)"), HasSubstr("d must be float32")));
  EXPECT_THAT(error_of([&] {
                quantize_fp8_rows(bf16_matrix(256, 4, 32), TensorView{}, TensorView{}, TensorView{},
                                  TensorView{}, nullptr);
              }),
              HasSubstr("neither codes nor codes_t is wanted"));
  // The transposed copy's codes cover the tokens padded to 16.
  EXPECT_THAT(error_of([&] {
                quantize_fp8_rows(bf16_matrix(256, 20, 32), TensorView{}, TensorView{},
                                  typed(512, e4, 32, 20, 32), typed(1024, f, 1, 32), nullptr);
              }),
              HasSubstr("codes_t must have shape (32, 32), got (32, 20)"));
  // A weight's transpose: N and K multiples of 16 (16-byte rows both ways), wᵀ's shapes.
  EXPECT_THAT(error_of([&] {
                transpose_fp8_blocks(typed(256, e4, 24, 32), typed(512, f, 1, 1),
                                     typed(768, e4, 32, 24), typed(1024, f, 1, 1), nullptr);
              }),
              AllOf(HasSubstr("coda::ops::transpose_fp8_blocks"),
                    HasSubstr("both multiples of 16, got (24, 32)")));
  EXPECT_THAT(error_of([&] {
                transpose_fp8_blocks(typed(256, e4, 32, 144), typed(512, f, 1, 2),
                                     typed(768, e4, 32, 144), typed(1024, f, 2, 1), nullptr);
              }),
              HasSubstr("codes_t must have shape (144, 32), got (32, 144)"));
  EXPECT_THAT(error_of([&] {
                transpose_fp8_blocks(typed(256, e4, 32, 144), typed(512, f, 1, 1),
                                     typed(768, e4, 144, 32), typed(1024, f, 2, 1), nullptr);
              }),
              HasSubstr("scales must be fp32 scales of shape (1, 2), got (1, 1)"));
  EXPECT_THAT(error_of([&] {  // in place (a square weight): refused, not raced
                transpose_fp8_blocks(typed(256, e4, 32, 32), typed(512, f, 1, 1),
                                     typed(256, e4, 32, 32), typed(1024, f, 1, 1), nullptr);
              }),
              HasSubstr("codes must not alias codes_t"));
}

// The FP8 programs' own checks, each before anything reaches the device: operand names, the
// widths their quantized outputs need, the outputs' shapes.
TEST(OpArguments, Fp8ProgramArgumentsAreChecked) {
  const auto e4 = DType::kE4M3, f = DType::kF32;
  const TensorView none{};
  // F2: 2I = 48 is a multiple of 16 but a's codes need I a multiple of 16.
  EXPECT_THAT(error_of([&] {
                gemm_fp8_rmsnorm_swiglu(
                    typed(256, e4, 4, 32), typed(512, f, 1, 4), typed(768, e4, 48, 32),
                    typed(1024, f, 1, 1), f32_vector(1280, 4), bf16_matrix(1536, 4, 48),
                    typed(1792, e4, 4, 24, 32), typed(2048, f, 1, 4), none, none, nullptr);
              }),
              AllOf(HasSubstr("coda::ops::gemm_fp8_rmsnorm_swiglu"),
                    HasSubstr("2I (w_gu's rows) must be a multiple of 32"), HasSubstr("got 48")));
  // F2's operand names: h's scales of the wrong grid.
  EXPECT_THAT(error_of([&] {
                gemm_fp8_rmsnorm_swiglu(
                    typed(256, e4, 4, 256), typed(512, f, 1, 4), typed(768, e4, 64, 256),
                    typed(1024, f, 1, 2), f32_vector(1280, 4), bf16_matrix(1536, 4, 64),
                    typed(1792, e4, 4, 32), typed(2048, f, 1, 4), none, none, nullptr);
              }),
              HasSubstr("h_scales must be fp32 scales of shape (2, 4), got (1, 4)"));
  EXPECT_THAT(error_of([&] {
                gemm_fp8_rmsnorm_swiglu(typed(256, e4, 4, 32), typed(512, f, 1, 4),
                                        typed(768, e4, 64, 32), typed(1024, f, 1, 1),
                                        f32_vector(1280, 4), bf16_matrix(1536, 4, 64), none, none,
                                        none, none, nullptr);
              }),
              HasSubstr("neither a nor a_t is wanted"));
  // B1: the transposed copy of h_out covers the tokens padded to 16.
  EXPECT_THAT(error_of([&] {
                gemm_fp8_rmsnorm_backward(
                    typed(256, e4, 20, 32), typed(512, f, 1, 20), typed(768, e4, 32, 32),
                    typed(1024, f, 1, 1), bf16_matrix(1280, 20, 32), f32_vector(1536, 20),
                    TensorView::vector(reinterpret_cast<void*>(1792), DType::kBF16, 32, 0),
                    f32_vector(2048, 20), bf16_matrix(2304, 20, 32), bf16_matrix(2560, 20, 32),
                    typed(2816, e4, 32, 20, 32), typed(3072, f, 1, 32), typed(3328, f, 1, 32),
                    nullptr);
              }),
              AllOf(HasSubstr("coda::ops::gemm_fp8_rmsnorm_backward"),
                    HasSubstr("h_t must have shape (32, 32), got (32, 20)")));
  // B2: z holds the interleaved pairs, twice dz's GEMM width.
  EXPECT_THAT(error_of([&] {
                gemm_fp8_swiglu_backward(
                    typed(256, e4, 4, 32), typed(512, f, 1, 4), typed(768, e4, 16, 32),
                    typed(1024, f, 1, 1), bf16_matrix(1280, 4, 16), typed(1536, e4, 4, 32),
                    typed(1792, f, 1, 4), none, none, typed(2048, f, 1, 4), nullptr);
              }),
              AllOf(HasSubstr("coda::ops::gemm_fp8_swiglu_backward"),
                    HasSubstr("z must have shape (4, 32), got (4, 16)")));
  EXPECT_THAT(error_of([&] {
                gemm_fp8_swiglu_backward(
                    bf16_matrix(256, 4, 32), typed(512, f, 1, 4), typed(768, e4, 16, 32),
                    typed(1024, f, 1, 1), bf16_matrix(1280, 4, 32), typed(1536, e4, 4, 32),
                    typed(1792, f, 1, 4), none, none, typed(2048, f, 1, 4), nullptr);
              }),
              AllOf(HasSubstr("dx_out must be float8_e4m3fn"), HasSubstr("got bfloat16")));
  // F1 with a bf16 h on FP8 operands runs the bf16 program's checks: h may not alias residual.
  EXPECT_THAT(error_of([&] {
                gemm_fp8_residual_rmsnorm_bf16(
                    typed(256, e4, 4, 32), typed(512, f, 1, 4), typed(768, e4, 16, 32),
                    typed(1024, f, 1, 1), bf16_matrix(1280, 4, 16),
                    TensorView::vector(reinterpret_cast<void*>(1536), DType::kBF16, 16, 0),
                    bf16_matrix(1792, 4, 16), bf16_matrix(1280, 4, 16), typed(2048, f, 1, 16),
                    nullptr);
              }),
              AllOf(HasSubstr("coda::ops::gemm_fp8_residual_rmsnorm_bf16"),
                    HasSubstr("h must not alias residual")));
  // F3 on FP8 operands: the RoPE table's two rows span the QKV width.
  EXPECT_THAT(error_of([&] {
                gemm_fp8_rmsnorm_rope(
                    typed(256, e4, 4, 32), typed(512, f, 1, 4), typed(768, e4, 16, 32),
                    typed(1024, f, 1, 1), f32_vector(1280, 4), none,
                    TensorView::vector(reinterpret_cast<void*>(1536), DType::kI32, 4, 0),
                    typed(1792, DType::kI32, 2, 8), bf16_matrix(2048, 4, 16), nullptr);
              }),
              AllOf(HasSubstr("coda::ops::gemm_fp8_rmsnorm_rope"),
                    HasSubstr("rope_table must have shape (2, 16), got (2, 8)")));
}

TEST(OpArguments, Fp8SplitPassArgumentsAreChecked) {
  const auto e4 = DType::kE4M3, f = DType::kF32;
  const TensorView none{};
  // B2's pass: z is (M, 2I) of da's (M, I); its partials per row and 128 columns of da.
  EXPECT_THAT(error_of([&] {
                fp8_swiglu_backward_quantize(bf16_matrix(256, 4, 32), bf16_matrix(512, 4, 48),
                                             none, typed(768, e4, 4, 64), typed(1024, f, 1, 4),
                                             none, none, typed(1280, f, 1, 128), nullptr);
              }),
              AllOf(HasSubstr("coda::ops::fp8_swiglu_backward_quantize"),
                    HasSubstr("z must have shape (4, 64), got (4, 48)")));
  EXPECT_THAT(error_of([&] {
                fp8_swiglu_backward_quantize(bf16_matrix(256, 4, 32), bf16_matrix(512, 4, 64),
                                             none, typed(768, e4, 4, 64), typed(1024, f, 1, 4),
                                             none, none, typed(1280, f, 1, 64), nullptr);
              }),
              HasSubstr("zdz_partials must have shape (1, 128), got (1, 64)"));
  // B1's pass: g (M, H) bf16, H a multiple of 16, dγ partials per column and 128 rows.
  EXPECT_THAT(error_of([&] {
                fp8_rmsnorm_backward_quantize(
                    bf16_matrix(256, 4, 24), bf16_matrix(512, 4, 24), f32_vector(768, 4),
                    TensorView::vector(reinterpret_cast<void*>(1024), DType::kBF16, 24, 0),
                    f32_vector(1280, 4), none, bf16_matrix(1536, 4, 24), typed(1792, e4, 24, 16),
                    typed(2048, f, 1, 24), typed(2304, f, 1, 128), nullptr);
              }),
              AllOf(HasSubstr("coda::ops::fp8_rmsnorm_backward_quantize"),
                    HasSubstr("H a multiple of 16"), HasSubstr("got (4, 24)")));
  EXPECT_THAT(error_of([&] {
                fp8_rmsnorm_backward_quantize(
                    bf16_matrix(256, 4, 32), bf16_matrix(512, 4, 32), f32_vector(768, 4),
                    TensorView::vector(reinterpret_cast<void*>(1024), DType::kBF16, 32, 0),
                    f32_vector(1280, 4), none, bf16_matrix(1536, 4, 32), typed(1792, e4, 32, 16),
                    typed(2048, f, 1, 32), typed(2304, f, 1, 32), nullptr);
              }),
              HasSubstr("dgamma_partials must have shape (1, 128), got (1, 32)"));
  // B3 and its cast in one pass: the width a multiple of 16, the table spanning it, the ZdZ
  // partials per row and 128 columns.
  const TensorView pos = TensorView::vector(reinterpret_cast<void*>(1536), DType::kI32, 4, 0);
  EXPECT_THAT(error_of([&] {
                fp8_rope_backward_quantize(bf16_matrix(256, 4, 24), bf16_matrix(512, 4, 24), pos,
                                           typed(1792, DType::kI32, 2, 24), typed(768, e4, 4, 24),
                                           typed(1024, f, 1, 4), none, none, typed(1280, f, 1, 128),
                                           nullptr);
              }),
              AllOf(HasSubstr("coda::ops::fp8_rope_backward_quantize"),
                    HasSubstr("N a multiple of 16"), HasSubstr("got (4, 24)")));
  EXPECT_THAT(error_of([&] {
                fp8_rope_backward_quantize(bf16_matrix(256, 4, 32), bf16_matrix(512, 4, 32), pos,
                                           typed(1792, DType::kI32, 2, 16), typed(768, e4, 4, 32),
                                           typed(1024, f, 1, 4), none, none, typed(1280, f, 1, 128),
                                           nullptr);
              }),
              HasSubstr("rope_table must have shape (2, 32), got (2, 16)"));
  EXPECT_THAT(error_of([&] {
                fp8_rope_backward_quantize(bf16_matrix(256, 4, 32), bf16_matrix(512, 4, 32), pos,
                                           typed(1792, DType::kI32, 2, 32), typed(768, e4, 4, 32),
                                           typed(1024, f, 1, 4), none, none, typed(1280, f, 1, 32),
                                           nullptr);
              }),
              HasSubstr("zdz_partials must have shape (1, 128), got (1, 32)"));
  EXPECT_THAT(error_of([&] {
                fp8_rope_backward_quantize(bf16_matrix(256, 4, 32), bf16_matrix(512, 4, 32), pos,
                                           typed(1792, DType::kI32, 2, 32), none, none, none, none,
                                           typed(1280, f, 1, 128), nullptr);
              }),
              HasSubstr("neither dpre nor dpre_t is wanted"));
}

TEST(OpArguments, Fp8ZArgumentsAreChecked) {
  const auto e4 = DType::kE4M3, f = DType::kF32;
  const TensorView none{};
  // F2 with z in FP8: z's codes are its point.
  EXPECT_THAT(error_of([&] {
                gemm_fp8_rmsnorm_swiglu_fp8_z(
                    typed(256, e4, 4, 32), typed(512, f, 1, 4), typed(768, e4, 64, 32),
                    typed(1024, f, 1, 1), f32_vector(1280, 4), none, none, typed(1792, e4, 4, 32),
                    typed(2048, f, 1, 4), none, none, nullptr);
              }),
              AllOf(HasSubstr("coda::ops::gemm_fp8_rmsnorm_swiglu_fp8_z"), HasSubstr("z is null")));
  EXPECT_THAT(error_of([&] {
                gemm_fp8_rmsnorm_swiglu_fp8_z(typed(256, e4, 4, 32), typed(512, f, 1, 4),
                                              typed(768, e4, 64, 32), typed(1024, f, 1, 1),
                                              f32_vector(1280, 4), typed(1536, e4, 4, 64),
                                              typed(1600, f, 1, 3), typed(1792, e4, 4, 32),
                                              typed(2048, f, 1, 4), none, none, nullptr);
              }),
              HasSubstr("z_scales must be fp32 scales of shape (1, 4), got (1, 3)"));
  // B2 from an FP8 z: codes, not bf16 pairs, with their scales.
  EXPECT_THAT(error_of([&] {
                gemm_fp8_swiglu_backward_fp8_z(typed(256, e4, 4, 32), typed(512, f, 1, 4),
                                               typed(768, e4, 16, 32), typed(1024, f, 1, 1),
                                               bf16_matrix(1280, 4, 32), typed(1408, f, 1, 4),
                                               typed(1536, e4, 4, 32), typed(1792, f, 1, 4), none,
                                               none, typed(2048, f, 1, 4), nullptr);
              }),
              AllOf(HasSubstr("coda::ops::gemm_fp8_swiglu_backward_fp8_z"),
                    HasSubstr("z must be float8_e4m3fn"), HasSubstr("got bfloat16")));
  EXPECT_THAT(error_of([&] {
                gemm_fp8_swiglu_backward_fp8_z(typed(256, e4, 4, 32), typed(512, f, 1, 4),
                                               typed(768, e4, 16, 32), typed(1024, f, 1, 1),
                                               typed(1280, e4, 4, 32), typed(1408, f, 2, 4),
                                               typed(1536, e4, 4, 32), typed(1792, f, 1, 4), none,
                                               none, typed(2048, f, 1, 4), nullptr);
              }),
              HasSubstr("z_scales must be fp32 scales of shape (1, 4), got (2, 4)"));
  // a's copy from an FP8 z: 2I a multiple of 32.
  EXPECT_THAT(error_of([&] {
                quantize_fp8_swiglu_t_fp8_z(typed(256, e4, 4, 48), typed(512, f, 1, 4),
                                            typed(768, e4, 24, 16), typed(1024, f, 1, 24), nullptr);
              }),
              AllOf(HasSubstr("coda::ops::quantize_fp8_swiglu_t_fp8_z"),
                    HasSubstr("2I a multiple of 32"), HasSubstr("got (4, 48)")));
}

// The FP8 epilogue placement: fused and split are what they say for every program; auto splits
// B2 at any K, B1 up to kFp8B1SplitMaxK and F2z up to kFp8F2zSplitMaxK (a GEMM past it fuses: the
// measured table of docs/experiments.md).
TEST(OpArguments, Fp8EpiloguePlacementByProgramAndReductionExtent) {
  const Fp8EpiloguePlacement before = fp8_epilogue_placement();
  using P = Fp8SplitProgram;
  const int64_t beyond = kFp8B1SplitMaxK + 128;
  set_fp8_epilogue_placement(Fp8EpiloguePlacement::kFused);
  for (const P p : {P::kF2z, P::kB1, P::kB2})
    for (const int64_t k : {int64_t(4096), beyond}) EXPECT_FALSE(fp8_epilogue_split(p, k));
  set_fp8_epilogue_placement(Fp8EpiloguePlacement::kSplit);
  for (const P p : {P::kF2z, P::kB1, P::kB2})
    for (const int64_t k : {int64_t(4096), beyond}) EXPECT_TRUE(fp8_epilogue_split(p, k));
  set_fp8_epilogue_placement(Fp8EpiloguePlacement::kAuto);
  EXPECT_TRUE(fp8_epilogue_split(P::kB2, 4096));
  EXPECT_TRUE(fp8_epilogue_split(P::kB2, beyond));
  EXPECT_TRUE(fp8_epilogue_split(P::kB1, 28672));  // 8B gate/up's backward
  EXPECT_TRUE(fp8_epilogue_split(P::kB1, kFp8B1SplitMaxK));
  EXPECT_FALSE(fp8_epilogue_split(P::kB1, 57344));  // 70B gate/up's backward
  EXPECT_TRUE(fp8_epilogue_split(P::kF2z, 2048));   // 1B gate/up
  EXPECT_TRUE(fp8_epilogue_split(P::kF2z, 4096));   // 8B
  EXPECT_FALSE(fp8_epilogue_split(P::kF2z, 8192));  // 70B
  set_fp8_epilogue_placement(before);
}

}  // namespace
}  // namespace coda::ops
