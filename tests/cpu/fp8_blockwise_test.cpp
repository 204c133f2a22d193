// The blockwise FP8 recipe on the host (reference/fp8.hpp) against the recipe written out
// separately: each block's scale from its own amax and each code from the e4m3 functor (tested
// bit for bit in fp8_test.cpp), the dequantization error of the format, and the blockwise GEMM
// against the fp64 matmul of the dequantized operands. Ragged shapes:
// M, N, K not multiples of 128.

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "coda/reference/fp8.hpp"
#include "support/numeric.hpp"

namespace coda::reference {
namespace {

using epilogue::E4m3;
using testing::max_rel_error;
using V = std::vector<double>;

// Values whose magnitude varies by orders of magnitude from row to row and column to column, so
// that the blocks get different scales.
V spread_values(int64_t rows, int64_t cols, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> u(-1, 1);
  std::uniform_int_distribution<int> e(-12, 12);
  std::vector<int> row_exp(rows), col_exp(cols);
  for (auto& x : row_exp) x = e(rng);
  for (auto& x : col_exp) x = e(rng) / 2;
  V v(rows * cols);
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < cols; ++j)
      v[i * cols + j] = std::ldexp(u(rng), row_exp[i] + col_exp[j]);
  return v;
}

// The recipe for one element, independently of quantize_blockwise: its block's amax over the
// clipped block, the scale and the code.
void expect_blockwise(const BlockQuantized& q, const V& v, int64_t br, int64_t bc) {
  ASSERT_EQ(q.codes.size(), v.size());
  for (int64_t i = 0; i < q.rows; ++i)
    for (int64_t j = 0; j < q.cols; ++j) {
      const int64_t i0 = i / br * br, j0 = j / bc * bc;
      float amax = 0;
      for (int64_t a = i0; a < std::min(q.rows, i0 + br); ++a)
        for (int64_t b = j0; b < std::min(q.cols, j0 + bc); ++b)
          amax = std::max(amax, std::fabs(float(v[a * q.cols + b])));
      const float s = E4m3::scale(amax);
      ASSERT_EQ(q.scale_at(i, j), s) << i << "," << j;
      ASSERT_EQ(q.code_at(i, j), E4m3::encode(float(v[i * q.cols + j]) / s)) << i << "," << j;
      // Dequantized within half a step: 2^-4 relative for normal codes, 2^-10 · s below them.
      const double x = float(v[i * q.cols + j]), err = std::fabs(q.value(i, j) - x);
      EXPECT_LE(err, std::max(std::fabs(x) / 16, std::ldexp(double(s), -10))) << i << "," << j;
    }
}

TEST(Fp8Blockwise, QuantizesEachBlockWithItsOwnScale) {
  const int64_t rows = 130, cols = 300;  // ragged in both block shapes
  const V v = spread_values(rows, cols, 1);
  for (const auto& [br, bc] : {std::pair<int64_t, int64_t>{1, 128}, {128, 128}}) {
    const auto q = quantize_blockwise(MatrixRef<double>::row_major(v.data(), rows, cols), br, bc);
    EXPECT_EQ(q.grid_rows(), (rows + br - 1) / br);
    EXPECT_EQ(q.grid_cols(), 3);
    expect_blockwise(q, v, br, bc);
  }
}

TEST(Fp8Blockwise, TransposedCopyIsTheTransposeQuantizedAlongItsRows) {
  // The 128x1 copy along M that a weight-gradient GEMM reads.
  const int64_t rows = 200, cols = 24;
  const V v = spread_values(rows, cols, 2);
  V t(cols * rows);
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < cols; ++j) t[j * rows + i] = v[i * cols + j];
  const auto qt = quantize_blockwise(MatrixRef<double>::transposed(v.data(), cols, rows), 1, 128);
  const auto qe = quantize_blockwise(MatrixRef<double>::row_major(t.data(), cols, rows), 1, 128);
  EXPECT_EQ(qt.codes, qe.codes);
  EXPECT_EQ(qt.scales, qe.scales);
  expect_blockwise(qt, t, 1, 128);
}

TEST(Fp8Blockwise, NanOrInfinityPoisonsOnlyItsBlock) {
  const int64_t rows = 2, cols = 256;
  V v = spread_values(rows, cols, 3);
  v[0 * cols + 5] = std::numeric_limits<double>::quiet_NaN();
  v[1 * cols + 200] = std::numeric_limits<double>::infinity();
  const auto q = quantize_blockwise(MatrixRef<double>::row_major(v.data(), rows, cols), 1, 128);
  EXPECT_TRUE(std::isnan(q.scale_at(0, 0)));
  EXPECT_TRUE(std::isnan(q.scale_at(1, 200)));
  EXPECT_TRUE(std::isnan(q.value(0, 77)));
  EXPECT_TRUE(std::isfinite(q.scale_at(0, 128)) && std::isfinite(q.scale_at(1, 0)));
  EXPECT_TRUE(std::isfinite(q.value(0, 130)) && std::isfinite(q.value(1, 127)));
}

V matmul_t(const V& a, const V& b, int64_t m, int64_t n, int64_t k) {  // a · bᵀ in fp64
  V d(m * n, 0.0);
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j)
      for (int64_t p = 0; p < k; ++p) d[i * n + j] += a[i * k + p] * b[j * k + p];
  return d;
}

struct GemmCase {
  int64_t m, n, k, b_block_rows;  // B blocks: 128 (weights) or 1 (a wgrad's token operand)
};

class Fp8GemmTest : public ::testing::TestWithParam<GemmCase> {};

TEST_P(Fp8GemmTest, BlockwiseGemmIsTheMatmulOfTheDequantizedOperands) {
  const auto [M, N, K, bb] = GetParam();
  const V a = spread_values(M, K, 10 + M), b = spread_values(N, K, 20 + N);
  const auto qa = quantize_blockwise(MatrixRef<double>::row_major(a.data(), M, K), 1, 128);
  const auto qb = quantize_blockwise(MatrixRef<double>::row_major(b.data(), N, K), bb, 128);
  const V want = matmul_t(qa.dequantized(), qb.dequantized(), M, N, K);
  EXPECT_LT(max_rel_error(gemm_fp8_blockwise<double>(qa, qb), want), 1e-14);
  // fp32 partial sums inside each K block (what the tensor cores' accumulator does between
  // promotions): within 128 roundings of the block's Σ|a·b|.
  const V f32 = gemm_fp8_blockwise<double, float>(qa, qb);
  const V da = qa.dequantized(), db = qb.dequantized();
  for (int64_t i = 0; i < M; ++i)
    for (int64_t j = 0; j < N; ++j) {
      double bound = 0;
      for (int64_t p = 0; p < K; ++p) bound += std::fabs(da[i * K + p] * db[j * K + p]);
      EXPECT_LE(std::fabs(f32[i * N + j] - want[i * N + j]), 128 * std::ldexp(bound, -24))
          << i << "," << j;
    }
  // And against the unquantized product: within what the operands' quantization errors allow,
  // |Σ a'b' - Σ ab| <= Σ |a| e_b + |b| e_a + e_a e_b, with e the format's half step.
  const V exact = matmul_t(a, b, M, N, K);
  auto half_step = [](const BlockQuantized& q, const V& v, int64_t i, int64_t k) {
    return std::max(std::fabs(double(float(v[i * q.cols + k]))) / 16,
                    std::ldexp(double(q.scale_at(i, k)), -10));
  };
  for (int64_t i = 0; i < M; ++i)
    for (int64_t j = 0; j < N; ++j) {
      double bound = 0;
      for (int64_t p = 0; p < K; ++p) {
        const double ea = half_step(qa, a, i, p), eb = half_step(qb, b, j, p);
        bound += std::fabs(a[i * K + p]) * eb + std::fabs(b[j * K + p]) * ea + ea * eb;
      }
      EXPECT_LE(std::fabs(want[i * N + j] - exact[i * N + j]), bound * (1 + 1e-9)) << i << "," << j;
    }
}

INSTANTIATE_TEST_SUITE_P(Shapes, Fp8GemmTest,
                         ::testing::Values(GemmCase{1, 8, 128, 128}, GemmCase{19, 40, 300, 128},
                                           GemmCase{131, 136, 256, 128},
                                           GemmCase{24, 16, 200, 1}));

TEST(Fp8Blockwise, BadArgumentsAreRefused) {
  const V a = spread_values(4, 256, 7), b = spread_values(8, 128, 8);
  const auto qa = quantize_blockwise(MatrixRef<double>::row_major(a.data(), 4, 256), 1, 128);
  const auto qb = quantize_blockwise(MatrixRef<double>::row_major(b.data(), 8, 128), 128, 128);
  EXPECT_THROW(gemm_fp8_blockwise<double>(qa, qb), Error);  // K 256 vs 128
  const auto q64 = quantize_blockwise(MatrixRef<double>::row_major(a.data(), 4, 256), 1, 64);
  EXPECT_THROW(gemm_fp8_blockwise<double>(q64, q64), Error);  // not blocked in 128
  EXPECT_THROW(quantize_blockwise(MatrixRef<double>::row_major(a.data(), 4, 256), 0, 128), Error);
}

}  // namespace
}  // namespace coda::reference
