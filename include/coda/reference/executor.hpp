#pragma once
// The CPU reference executor: D = A * B^T accumulated in Real (fp32 or fp64), then an epilogue
// program run over the same tile / subtile decomposition the Hopper executor uses, producing the
// same outputs and the same per-tile partial buffers. It is the oracle of every GPU test and runs
// in CI.
//
// Subtile order matches CUTLASS's sm90 TMA epilogue collective: for each CTA tile, subtiles are
// visited N-outer, M-inner; per-row state (partial sums, online max/sum-exp) therefore lives for
// the whole tile and is written in end_tile, exactly like the device's register accumulators.

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "coda/common/check.hpp"

namespace coda::reference {

// A strided read-only matrix view: element (i, j) at data[i * row_stride + j * col_stride].
// Covers every operand the library multiplies: X (M, K) row-major, W (N, K) row-major as B of
// D = X W^T, W used untransposed as B of dz * W (B(n, k) = W[k, n]), and dz^T for weight gradients.
template <class T>
struct MatrixRef {
  const T* data = nullptr;
  int64_t rows = 0, cols = 0;
  int64_t row_stride = 0, col_stride = 1;

  static MatrixRef row_major(const T* p, int64_t rows, int64_t cols) {
    return {p, rows, cols, cols, 1};
  }
  // The transpose of a row-major (cols, rows) matrix, without copying.
  static MatrixRef transposed(const T* p, int64_t rows, int64_t cols) {
    return {p, rows, cols, 1, rows};
  }
  T at(int64_t i, int64_t j) const { return data[i * row_stride + j * col_stride]; }
};

struct TileConfig {
  int tile_m = 128, tile_n = 128;      // CTA tile
  int subtile_m = 64, subtile_n = 32;  // epilogue subtile

  void validate() const {
    CODA_CHECK(tile_m > 0 && tile_n > 0 && subtile_m > 0 && subtile_n > 0,
               "tile config: sizes must be positive, got tile ", tile_m, "x", tile_n, ", subtile ",
               subtile_m, "x", subtile_n);
    CODA_CHECK(tile_m % subtile_m == 0 && tile_n % subtile_n == 0, "tile config: subtile ",
               subtile_m, "x", subtile_n, " must divide the tile ", tile_m, "x", tile_n);
    CODA_CHECK(subtile_n % 2 == 0, "tile config: subtile_n must be even (pairwise maps), got ",
               subtile_n);
  }
};

// Where one CTA tile sits, clipped to the problem.
struct TileInfo {
  int64_t tile_m_index = 0, tile_n_index = 0;
  int64_t m0 = 0, n0 = 0;      // first row / column
  int64_t rows = 0, cols = 0;  // valid extent (<= tile size on the ragged edge)
};

// The program protocol (the host side of the primitive lifecycle, docs/design.md):
//   void begin_tile(const TileInfo&);
//   void visit(const TileInfo&, int64_t m, int64_t n, Real acc_n, Real acc_n_plus_1);  // pair
//   void end_subtile(const TileInfo&, int64_t epi_m, int64_t epi_n);
//   void end_tile(const TileInfo&);
//   void validate(int64_t M, int64_t N, const TileConfig&) const;  // throws coda::Error
// `visit` receives global coordinates of the pair (n, n+1), n even, both inside the problem,
// except for a program that declares `static constexpr bool kOddN = true` (it skips columns
// >= N itself, like the LM-head programs over a vocabulary of any size): with N odd its last
// pair is (N − 1, N), the second value 0.
template <class Program, class = void>
struct TakesOddN : std::false_type {};
template <class Program>
struct TakesOddN<Program, std::void_t<decltype(Program::kOddN)>>
    : std::bool_constant<Program::kOddN> {};

template <class Real, class A, class B, class Program>
void execute(const MatrixRef<A>& a, const MatrixRef<B>& b, Program& program,
             const TileConfig& cfg) {
  cfg.validate();
  CODA_CHECK(a.data != nullptr, "execute: A is null");
  CODA_CHECK(b.data != nullptr, "execute: B is null");
  CODA_CHECK(a.rows > 0 && b.rows > 0 && a.cols > 0,
             "execute: sizes must be positive, got M=", a.rows, " N=", b.rows, " K=", a.cols);
  CODA_CHECK(a.cols == b.cols, "execute: A is (", a.rows, ", ", a.cols, ") and B is (", b.rows,
             ", ", b.cols, "): the K extents differ");
  CODA_CHECK(b.rows % 2 == 0 || TakesOddN<Program>::value,
             "execute: N must be even for pairwise epilogues, got ", b.rows);
  const int64_t m_total = a.rows, n_total = b.rows, k_total = a.cols;
  program.validate(m_total, n_total, cfg);

  std::vector<Real> acc(static_cast<size_t>(cfg.tile_m) * cfg.tile_n);
  for (int64_t tm = 0; tm * cfg.tile_m < m_total; ++tm) {
    for (int64_t tn = 0; tn * cfg.tile_n < n_total; ++tn) {
      TileInfo t;
      t.tile_m_index = tm;
      t.tile_n_index = tn;
      t.m0 = tm * cfg.tile_m;
      t.n0 = tn * cfg.tile_n;
      t.rows = std::min<int64_t>(cfg.tile_m, m_total - t.m0);
      t.cols = std::min<int64_t>(cfg.tile_n, n_total - t.n0);
      for (int64_t i = 0; i < t.rows; ++i) {
        for (int64_t j = 0; j < t.cols; ++j) {
          Real s = 0;
          for (int64_t k = 0; k < k_total; ++k)
            s += static_cast<Real>(a.at(t.m0 + i, k)) * static_cast<Real>(b.at(t.n0 + j, k));
          acc[i * cfg.tile_n + j] = s;
        }
      }
      program.begin_tile(t);
      for (int64_t en = 0; en * cfg.subtile_n < t.cols; ++en) {
        for (int64_t em = 0; em * cfg.subtile_m < t.rows; ++em) {
          const int64_t i_end = std::min<int64_t>((em + 1) * cfg.subtile_m, t.rows);
          const int64_t j_end = std::min<int64_t>((en + 1) * cfg.subtile_n, t.cols);
          for (int64_t i = em * cfg.subtile_m; i < i_end; ++i)
            for (int64_t j = en * cfg.subtile_n; j < j_end; j += 2)
              program.visit(t, t.m0 + i, t.n0 + j, acc[i * cfg.tile_n + j],
                            j + 1 < t.cols ? acc[i * cfg.tile_n + j + 1] : Real(0));
          program.end_subtile(t, em, en);
        }
      }
      program.end_tile(t);
    }
  }
}

// The plain GEMM, D = A * B^T in Real, for tests and for weight gradients of the reference block.
template <class Real, class A, class B>
std::vector<Real> gemm(const MatrixRef<A>& a, const MatrixRef<B>& b) {
  CODA_CHECK(a.cols == b.cols, "gemm: K extents differ (", a.cols, " vs ", b.cols, ")");
  std::vector<Real> d(static_cast<size_t>(a.rows * b.rows), Real(0));
  for (int64_t i = 0; i < a.rows; ++i)
    for (int64_t j = 0; j < b.rows; ++j) {
      Real s = 0;
      for (int64_t k = 0; k < a.cols; ++k)
        s += static_cast<Real>(a.at(i, k)) * static_cast<Real>(b.at(j, k));
      d[i * b.rows + j] = s;
    }
  return d;
}

}  // namespace coda::reference
