#pragma once
// Shared pieces of the FP8 GPU tests (fp8_gemm_test.cu, fp8_programs_test.cpp): wide-range test
// values, the kernels' scale and code layouts of a host-quantized tensor, operands on the device,
// byte-exact and GEMM-tolerance comparisons.

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "coda/kernel/args.hpp"
#include "coda/reference/fp8.hpp"
#include "coda/tensor.hpp"
#include "support/bf16.hpp"
#include "support/device.hpp"
#include "support/gpu_check.hpp"
#include "support/numeric.hpp"

namespace coda::kernel {

using reference::BlockQuantized;

// Values over many binades: each 8x8 patch scaled by its own power of two, so blocks of one
// tensor get different scales; a few zeros.
inline std::vector<double> wide_values(int64_t rows, int64_t cols, testing::Rng& rng) {
  std::vector<double> v(size_t(rows * cols));
  std::vector<int> patch_exp(size_t(((rows + 7) / 8) * ((cols + 7) / 8)));
  for (int& e : patch_exp) e = int(rng.integer(-24, 8));
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < cols; ++j)
      v[i * cols + j] = testing::round_bf16(
          std::ldexp(rng.uniform(-1, 1), patch_exp[(i / 8) * ((cols + 7) / 8) + j / 8]));
  v[0] = 0.0;
  return v;
}

inline int64_t pad(int64_t n, int64_t q) { return (n + q - 1) / q * q; }

// 1x128 scales of q in the kernels' layout: (kb, r) at kb · ld + r; rows past q up to ld are 1.
inline std::vector<float> row_scales(const BlockQuantized& q, int64_t ld) {
  std::vector<float> s(size_t(q.grid_cols() * ld), 1.0f);
  for (int64_t kb = 0; kb < q.grid_cols(); ++kb)
    for (int64_t r = 0; r < q.rows; ++r) s[kb * ld + r] = q.scale_at(r, kb * 128);
  return s;
}
// Codes of q with row stride ld (zero past q's columns).
inline std::vector<uint8_t> padded_codes(const BlockQuantized& q, int64_t ld) {
  std::vector<uint8_t> c(size_t(q.rows * ld), 0);
  for (int64_t i = 0; i < q.rows; ++i)
    for (int64_t j = 0; j < q.cols; ++j) c[i * ld + j] = q.code_at(i, j);
  return c;
}

inline void expect_same_bytes(const std::string& what, const std::vector<uint8_t>& got,
                              const std::vector<uint8_t>& want) {
  ASSERT_EQ(got.size(), want.size()) << what;
  size_t bad = 0, first = 0;
  for (size_t i = 0; i < got.size(); ++i)
    if (got[i] != want[i] && bad++ == 0) first = i;
  EXPECT_EQ(bad, 0u) << what << ": first at " << first << " (" << int(got[first]) << " vs "
                     << int(want[first]) << ")";
}
inline void expect_same_floats(const std::string& what, const std::vector<float>& got,
                               const std::vector<float>& want) {
  ASSERT_EQ(got.size(), want.size()) << what;
  size_t bad = 0, first = 0;
  for (size_t i = 0; i < got.size(); ++i)
    if (std::memcmp(&got[i], &want[i], 4) != 0 && bad++ == 0) first = i;
  EXPECT_EQ(bad, 0u) << what << ": first at " << first << " (" << got[first] << " vs "
                     << want[first] << ")";
}

inline TensorView dev(const void* p, DType t, int64_t rows, int64_t cols, int64_t ld) {
  return TensorView::matrix(p, t, rows, cols, ld, 0);
}

// One FP8 GEMM's operands on the device, in the layouts ScaleLayout describes.
struct Fp8Operand {
  DeviceBuffer<uint8_t> codes;
  DeviceBuffer<float> scales;
  int64_t ld_scales;
};
inline Fp8Operand upload_rows(const BlockQuantized& q) {
  const int64_t ld = pad(q.rows, 4);
  return {DeviceBuffer<uint8_t>(q.codes), DeviceBuffer<float>(row_scales(q, ld)), ld};
}
inline Fp8Operand upload_blocks(const BlockQuantized& q) {
  return {DeviceBuffer<uint8_t>(q.codes), DeviceBuffer<float>(q.scales), q.grid_cols()};
}

// v (rows, cols) row-major quantized on the host in (block_rows x 128) blocks.
inline BlockQuantized quantized(const std::vector<double>& v, int rows, int cols, int block_rows) {
  return reference::quantize_blockwise(MatrixRef<double>::row_major(v.data(), rows, cols),
                                       block_rows, 128);
}

// The problem (M, N, K) over a and b, their scales included; no C or D yet.
inline GemmProblem fp8_problem(const Shape& s, const Fp8Operand& a, const Fp8Operand& b) {
  GemmProblem p{s.m, s.n, s.k, a.codes.get(), s.k, b.codes.get(), s.k};
  p.scale_a = a.scales.get();
  p.ld_scale_a = a.ld_scales;
  p.scale_b = b.scales.get();
  p.ld_scale_b = b.ld_scales;
  return p;
}

inline void expect_close(const std::string& what, const std::vector<double>& out,
                         const std::vector<double>& ref) {
  ASSERT_EQ(out.size(), ref.size()) << what;
  double scale = 0.0;
  for (double r : ref) scale = std::max(scale, std::fabs(r));
  size_t bad = 0;
  double worst = 0.0;
  for (size_t i = 0; i < out.size(); ++i) {
    ASSERT_TRUE(std::isfinite(out[i])) << what << ": element " << i << " not written";
    const double e = std::fabs(out[i] - ref[i]);
    worst = std::max(worst, e / scale);
    if (e > 0x1p-8 * std::fabs(ref[i]) + 0x1p-10 * scale) ++bad;
  }
  EXPECT_EQ(bad, 0u) << what << ": worst error " << worst << " of max|ref| " << scale;
}

}  // namespace coda::kernel
