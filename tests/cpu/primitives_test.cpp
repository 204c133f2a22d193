// Each epilogue primitive's host twin against a plain loop, on random inputs.

#include <gtest/gtest.h>

#include <array>
#include <cmath>
#include <limits>
#include <vector>

#include "coda/epilogue/elementwise.hpp"
#include "coda/epilogue/online_softmax.hpp"
#include "coda/epilogue/reduction.hpp"
#include "coda/epilogue/tile.hpp"
#include "coda/epilogue/vector.hpp"
#include "support/numeric.hpp"

namespace coda::epilogue {
namespace {

using testing::Rng;

TEST(Elementwise, PairwiseSwiGluMatchesPlainLoop) {
  Rng rng(1);
  std::array<double, 16> frag;
  for (auto& v : frag) v = rng.uniform(-6, 6);
  const auto input = frag;
  std::array<double, 8> out{};
  for_each_pair<16>(frag.data(), [&](int j, double g, double u) { out[j] = SwiGlu{}(g, u); });
  for (int j = 0; j < 8; ++j) {
    const double g = input[2 * j], u = input[2 * j + 1];
    EXPECT_NEAR(out[j], g / (1 + std::exp(-g)) * u, 1e-15 * (1 + std::abs(out[j])));
  }
}

TEST(Elementwise, SwiGluBackwardIsTheDerivative) {
  Rng rng(2);
  for (int i = 0; i < 200; ++i) {
    const double g = rng.uniform(-8, 8), u = rng.uniform(-3, 3), da = rng.uniform(-2, 2);
    double dg, du, a;
    SwiGluBackward{}(g, u, da, dg, du, a);
    const double h = 1e-6;
    const double fd_g = (SwiGlu{}(g + h, u) - SwiGlu{}(g - h, u)) / (2 * h) * da;
    const double fd_u = (SwiGlu{}(g, u + h) - SwiGlu{}(g, u - h)) / (2 * h) * da;
    EXPECT_NEAR(dg, fd_g, 1e-8 * (1 + std::abs(fd_g)));
    EXPECT_NEAR(du, fd_u, 1e-8 * (1 + std::abs(fd_u)));
    EXPECT_NEAR(a, SwiGlu{}(g, u), 1e-15);
  }
}

TEST(Elementwise, RopeRotationIsOrthogonalAndMatchesComplexProduct) {
  Rng rng(3);
  for (int i = 0; i < 200; ++i) {
    const double x0 = rng.uniform(-2, 2), x1 = rng.uniform(-2, 2), th = rng.uniform(-4, 4);
    double y0, y1, z0, z1;
    RopeRotate{}(x0, x1, std::cos(th), std::sin(th), y0, y1);
    // (x0 + i x1) e^{i th}
    EXPECT_NEAR(y0, x0 * std::cos(th) - x1 * std::sin(th), 1e-15);
    EXPECT_NEAR(y1, x0 * std::sin(th) + x1 * std::cos(th), 1e-15);
    RopeRotateTranspose{}(y0, y1, std::cos(th), std::sin(th), z0, z1);
    EXPECT_NEAR(z0, x0, 1e-14);
    EXPECT_NEAR(z1, x1, 1e-14);
  }
}

TEST(Vector, LoadsReturnIdentityPastTheEndAndStoresDropThem) {
  const auto v = testing::uniform_vector(37, -1, 1, 4);
  VectorIn<double> in{v.data(), 37};
  for (int i = 0; i < 37; ++i) EXPECT_EQ(in.load(i), v[i]);
  EXPECT_EQ(in.load(37, -5.0), -5.0);
  EXPECT_EQ(in.load(-1), 0.0);
  std::vector<double> out(38, 7.0);
  VectorOut<double> o{out.data(), 37};
  for (int i = -2; i < 40; ++i) o.store(i, 1.0 * i);
  for (int i = 0; i < 37; ++i) EXPECT_EQ(out[i], 1.0 * i);
  EXPECT_EQ(out[37], 7.0);
}

TEST(Tile, StridedLoadsStoresHalfWidthAndAccumulateMatchPlainLoops) {
  const int64_t rows = 19, cols = 22, ld = 25;
  const auto src = testing::uniform_vector(rows * ld, -1, 1, 5);
  TileIn<double> in{src.data(), rows, cols, ld};
  for (int64_t m = 0; m < rows; ++m)
    for (int64_t n = 0; n < cols; ++n) EXPECT_EQ(in.load(m, n), src[m * ld + n]);
  EXPECT_EQ(in.load(rows, 0), 0.0);
  EXPECT_EQ(in.load(0, cols), 0.0);

  auto dst = testing::uniform_vector(rows * ld, -1, 1, 6);
  const auto before = dst;
  TileOut<double> acc{dst.data(), rows, cols, ld, StoreMode::kAccumulate};
  for (int64_t m = 0; m < rows + 2; ++m)
    for (int64_t n = 0; n < cols + 2; ++n) acc.store(m, n, 0.5);
  for (int64_t m = 0; m < rows; ++m)
    for (int64_t n = 0; n < ld; ++n)
      EXPECT_EQ(dst[m * ld + n], before[m * ld + n] + (n < cols ? 0.5 : 0.0));

  std::vector<double> half(rows * (cols / 2), -1.0);
  TileOut<double> h{half.data(), rows, cols / 2, cols / 2};
  for (int64_t m = 0; m < rows; ++m)
    for (int64_t n = 0; n < cols; n += 2) h.store_half(m, n, 100.0 * m + n);
  for (int64_t m = 0; m < rows; ++m)
    for (int64_t j = 0; j < cols / 2; ++j) EXPECT_EQ(half[m * (cols / 2) + j], 100.0 * m + 2 * j);
}

TEST(Reduction, TilePartialsAndFoldMatchPlainRowAndColumnSums) {
  const int64_t M = 37, N = 50, tm = 16, tn = 24;
  const auto x = testing::uniform_vector(M * N, -1, 1, 7);
  const auto rows = PartialLayout::per_row(M, N, tm, tn);
  const auto cols = PartialLayout::per_column(M, N, tm, tn);
  EXPECT_EQ(rows.extent, 48);
  EXPECT_EQ(rows.tiles, 3);
  EXPECT_EQ(cols.extent, 72);
  EXPECT_EQ(cols.tiles, 3);
  std::vector<double> prow(rows.elements(), 0.0), pcol(cols.elements(), 0.0);
  for (int64_t bm = 0; bm * tm < M; ++bm)
    for (int64_t bn = 0; bn * tn < N; ++bn) {
      TilePartialReducer<double, Plus> r(tm, 0.0), c(tn, 0.0);
      for (int64_t i = 0; i < tm && bm * tm + i < M; ++i)
        for (int64_t j = 0; j < tn && bn * tn + j < N; ++j) {
          r.add(i, x[(bm * tm + i) * N + bn * tn + j]);
          c.add(j, x[(bm * tm + i) * N + bn * tn + j]);
        }
      r.write(prow.data(), rows, bm * tm, bn);
      c.write(pcol.data(), cols, bn * tn, bm);
    }
  const auto row_sum = fold_partials<double>(prow.data(), rows, 0.0, Plus{});
  const auto col_sum = fold_partials<double>(pcol.data(), cols, 0.0, Plus{});
  for (int64_t m = 0; m < M; ++m) {
    double s = 0;
    for (int64_t n = 0; n < N; ++n) s += x[m * N + n];
    EXPECT_NEAR(row_sum[m], s, 1e-13);
  }
  for (int64_t n = 0; n < N; ++n) {
    double s = 0;
    for (int64_t m = 0; m < M; ++m) s += x[m * N + n];
    EXPECT_NEAR(col_sum[n], s, 1e-13);
  }
  EXPECT_THROW(fold_partials<double>(static_cast<double*>(nullptr), rows, 0.0, Plus{}), Error);
}

double direct_logsumexp(const std::vector<double>& v) {
  double mx = -INFINITY;
  for (double x : v) mx = std::max(mx, x);
  double s = 0;
  for (double x : v) s += std::exp(x - mx);
  return mx + std::log(s);
}

TEST(OnlineSoftmax, SplitAndMergeInAnyOrderMatchesDirectLogSumExp) {
  Rng rng(8);
  for (int trial = 0; trial < 50; ++trial) {
    const int n = static_cast<int>(rng.integer(1, 300));
    const double spread = trial % 5 == 0 ? 1e4 : 20.0;  // extreme logits must not overflow
    const auto v = testing::uniform_vector(n, -spread, spread, 100 + trial);
    // Random chunks, each accumulated online, merged right-to-left with identities mixed in.
    std::vector<OnlineMaxSumExp<double>> parts;
    for (int i = 0; i < n;) {
      const int len = static_cast<int>(rng.integer(1, 40));
      OnlineMaxSumExp<double> s;
      for (int j = i; j < std::min(n, i + len); ++j) s.add(v[j]);
      parts.push_back(s);
      parts.push_back(OnlineMaxSumExp<double>::identity());
      i += len;
    }
    auto total = OnlineMaxSumExp<double>::identity();
    for (auto it = parts.rbegin(); it != parts.rend(); ++it)
      total = OnlineMaxSumExp<double>::merge(*it, total);
    const double expect = direct_logsumexp(v);
    EXPECT_NEAR(total.logsumexp(), expect, 1e-13 * std::max(1.0, std::abs(expect)));
    EXPECT_TRUE(std::isfinite(total.sum));
  }
}

TEST(OnlineSoftmax, EmptyStatesNeverProduceNaN) {
  const auto e = OnlineMaxSumExp<double>::identity();
  const auto both = OnlineMaxSumExp<double>::merge(e, e);
  EXPECT_EQ(both.sum, 0.0);
  EXPECT_EQ(both.logsumexp(), -std::numeric_limits<double>::infinity());
  OnlineMaxSumExp<float> f;
  f.add(-1e30f);
  EXPECT_FALSE(std::isnan(OnlineMaxSumExp<float>::merge(f, OnlineMaxSumExp<float>{}).sum));
}

}  // namespace
}  // namespace coda::epilogue
