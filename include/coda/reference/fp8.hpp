#pragma once
// The blockwise FP8 recipe on the host (docs/math.md §6): tensors quantized to e4m3 in blocks with
// one power-of-two fp32 scale each, and the GEMM over such operands with its partial sums scaled
// and promoted once per 128-wide block of K. The oracle the FP8 programs will be checked against,
// in CI.
//
// In fp64 each K block's partial sum is exact (an e4m3 product has at most 8 significant bits and
// lies in [2^-18, 448^2], so 128 of them sum without rounding, and the scales are powers of two):
// the blockwise GEMM is the matmul of the dequantized operands up to the rounding of the fp64 sum
// over blocks. With Acc = float the partial sums round as a fp32 accumulator does; between blocks
// the sum is Real, as the promotion makes it.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "coda/common/check.hpp"
#include "coda/epilogue/fp8.hpp"
#include "coda/reference/executor.hpp"

namespace coda::reference {

// A (rows, cols) tensor quantized in blocks of (block_rows, block_cols): the e4m3 codes row-major
// and one fp32 scale per block, row-major over the block grid. Blocks on the ragged edge hold
// fewer elements; their amax covers only those.
struct BlockQuantized {
  int64_t rows = 0, cols = 0;
  int64_t block_rows = 1, block_cols = 128;
  std::vector<uint8_t> codes;
  std::vector<float> scales;

  int64_t grid_rows() const { return (rows + block_rows - 1) / block_rows; }
  int64_t grid_cols() const { return (cols + block_cols - 1) / block_cols; }
  float scale_at(int64_t i, int64_t j) const {
    return scales[(i / block_rows) * grid_cols() + j / block_cols];
  }
  uint8_t code_at(int64_t i, int64_t j) const { return codes[i * cols + j]; }
  // q · s: exact in fp64 (and in fp32 but for underflow below 2^-149).
  double value(int64_t i, int64_t j) const {
    return double(epilogue::E4m3::decode(code_at(i, j))) * double(scale_at(i, j));
  }
  std::vector<double> dequantized() const {
    std::vector<double> v(static_cast<size_t>(rows * cols));
    for (int64_t i = 0; i < rows; ++i)
      for (int64_t j = 0; j < cols; ++j) v[i * cols + j] = value(i, j);
    return v;
  }
};

// Quantizes v in (block_rows, block_cols) blocks from its values as fp32 (what a GPU epilogue
// holds): per block amax -> E4m3::scale -> E4m3::quantize. A NaN or infinity makes its block's
// scale NaN. A transposed MatrixRef gives the 128x1 copy along M that weight gradients read.
template <class T>
BlockQuantized quantize_blockwise(const MatrixRef<T>& v, int64_t block_rows, int64_t block_cols) {
  CODA_CHECK(v.data != nullptr && v.rows > 0 && v.cols > 0,
             "quantize_blockwise: v must be a non-empty matrix, got (", v.rows, ", ", v.cols, ")");
  CODA_CHECK(block_rows > 0 && block_cols > 0, "quantize_blockwise: blocks must be positive, got ",
             block_rows, "x", block_cols);
  BlockQuantized q{v.rows, v.cols, block_rows, block_cols, {}, {}};
  q.codes.resize(static_cast<size_t>(v.rows * v.cols));
  q.scales.resize(static_cast<size_t>(q.grid_rows() * q.grid_cols()));
  for (int64_t bi = 0; bi < q.grid_rows(); ++bi) {
    for (int64_t bj = 0; bj < q.grid_cols(); ++bj) {
      const int64_t i0 = bi * block_rows, i1 = std::min(v.rows, i0 + block_rows);
      const int64_t j0 = bj * block_cols, j1 = std::min(v.cols, j0 + block_cols);
      float amax = 0.0f;
      for (int64_t i = i0; i < i1; ++i)
        for (int64_t j = j0; j < j1; ++j) {
          const float a = std::fabs(static_cast<float>(v.at(i, j)));
          amax = std::isnan(a) || std::isnan(amax) ? NAN : std::max(amax, a);
        }
      const float s = epilogue::E4m3::scale(amax);
      q.scales[bi * q.grid_cols() + bj] = s;
      for (int64_t i = i0; i < i1; ++i)
        for (int64_t j = j0; j < j1; ++j)
          q.codes[i * v.cols + j] = epilogue::E4m3::quantize(static_cast<float>(v.at(i, j)), s);
    }
  }
  return q;
}

// D = A · Bᵀ from blockwise operands A (M, K) and B (N, K), both blocked along K in k_block
// columns (A 1 x k_block; B k_block x k_block for weights, 1 x k_block for a wgrad's tokens):
// per K block, the e4m3 products summed in Acc, then scaled by A's and B's block scales and added
// to the Real result. Returns (M, N) row-major.
template <class Real, class Acc = Real>
std::vector<Real> gemm_fp8_blockwise(const BlockQuantized& a, const BlockQuantized& b,
                                     int64_t k_block = 128) {
  CODA_CHECK(a.cols == b.cols, "gemm_fp8_blockwise: A is (", a.rows, ", ", a.cols, ") and B is (",
             b.rows, ", ", b.cols, "): the K extents differ");
  CODA_CHECK(a.block_cols == k_block && b.block_cols == k_block,
             "gemm_fp8_blockwise: A and B must be blocked along K in ", k_block,
             " columns, got A ", a.block_rows, "x", a.block_cols, ", B ", b.block_rows, "x",
             b.block_cols);
  // Each code decoded once (a table of the 256 values), not once per product: the same values
  // summed in the same order.
  const auto decoded = [](const BlockQuantized& q) {
    std::vector<Acc> table(256);
    for (int c = 0; c < 256; ++c)
      table[c] = static_cast<Acc>(epilogue::E4m3::decode(static_cast<uint8_t>(c)));
    std::vector<Acc> v(q.codes.size());
    for (size_t e = 0; e < v.size(); ++e) v[e] = table[q.codes[e]];
    return v;
  };
  const std::vector<Acc> av = decoded(a), bv = decoded(b);
  std::vector<Real> d(static_cast<size_t>(a.rows * b.rows), Real(0));
  for (int64_t i = 0; i < a.rows; ++i)
    for (int64_t j = 0; j < b.rows; ++j) {
      const Acc *ar = av.data() + i * a.cols, *br = bv.data() + j * b.cols;
      Real sum = 0;
      for (int64_t k0 = 0; k0 < a.cols; k0 += k_block) {
        Acc part = 0;
        for (int64_t k = k0; k < std::min(a.cols, k0 + k_block); ++k) part += ar[k] * br[k];
        sum += static_cast<Real>(part) * static_cast<Real>(a.scale_at(i, k0)) *
               static_cast<Real>(b.scale_at(j, k0));
      }
      d[i * b.rows + j] = sum;
    }
  return d;
}

}  // namespace coda::reference
