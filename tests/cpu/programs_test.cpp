// Every program of docs/math.md on the reference executor against the unfused math computed
// separately in fp64, over several tile sizes and ragged shapes. The rewritten algebra must hold to
// 1e-12.

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <tuple>
#include <vector>

#include "coda/programs/backward.hpp"
#include "coda/programs/forward.hpp"
#include "coda/reference/executor.hpp"
#include "support/numeric.hpp"

namespace coda::programs {
namespace {

using reference::MatrixRef;
using reference::TileConfig;
using testing::max_rel_error;
using testing::uniform_vector;
using V = std::vector<double>;

constexpr double kTol = 1e-12;

struct Shape {
  int64_t m, n, k;
};

// (shape, tiles): M, K in {1, 19, 111}; N even and never a multiple of the larger tiles.
std::vector<std::tuple<Shape, TileConfig>> cases() {
  std::vector<std::tuple<Shape, TileConfig>> out;
  const TileConfig tiles[] = {{128, 128, 64, 32}, {64, 64, 32, 16}, {16, 24, 8, 8}};
  for (int64_t m : {1, 19, 111})
    for (int64_t n : {8, 40, 232})
      for (int64_t k : {1, 19, 111})
        for (const auto& t : tiles) out.push_back({{m, n, k}, t});
  return out;
}

class ProgramTest : public ::testing::TestWithParam<std::tuple<Shape, TileConfig>> {
 protected:
  Shape s() const { return std::get<0>(GetParam()); }
  TileConfig t() const { return std::get<1>(GetParam()); }
  uint64_t seed() const { return 1000 * s().m + 10 * s().n + s().k + t().tile_n; }
  // Plain D = A Bᵀ in fp64, written out separately from the executor.
  V plain_gemm(const V& a, const V& b, int64_t m, int64_t n, int64_t k) const {
    V d(m * n, 0.0);
    for (int64_t i = 0; i < m; ++i)
      for (int64_t j = 0; j < n; ++j)
        for (int64_t p = 0; p < k; ++p) d[i * n + j] += a[i * k + p] * b[j * k + p];
    return d;
  }
};

TEST_P(ProgramTest, F1ResidualRmsnormPartialAndA1Fold) {
  const auto [M, N, K] = s();
  const V a = uniform_vector(M * K, -1, 1, seed()), w = uniform_vector(N * K, -1, 1, seed() + 1);
  const V res = uniform_vector(M * N, -1, 1, seed() + 2),
          gamma = uniform_vector(N, 0.5, 1.5, seed() + 3);
  const double eps = 1e-5;
  ResidualRmsnormPartial<double> p;
  V x(M * N), h(M * N);
  p.layout = epilogue::PartialLayout::per_row(M, N, t().tile_m, t().tile_n);
  V part(p.layout.elements());
  p.residual = {res.data(), M, N, N};
  p.gamma = {gamma.data(), N};
  p.x = {x.data(), M, N, N};
  p.h = {h.data(), M, N, N};
  p.partials = part.data();
  reference::execute<double>(MatrixRef<double>::row_major(a.data(), M, K),
                             MatrixRef<double>::row_major(w.data(), N, K), p, t());
  const V r = fold_rstd<double>(part.data(), p.layout, N, eps);

  V x_ref = plain_gemm(a, w, M, N, K), h_ref(M * N), r_ref(M);
  for (int64_t i = 0; i < M; ++i) {
    double ss = 0;
    for (int64_t j = 0; j < N; ++j) {
      double& xv = x_ref[i * N + j];
      xv += res[i * N + j];
      h_ref[i * N + j] = xv * gamma[j];
      ss += xv * xv;
    }
    r_ref[i] = 1 / std::sqrt(ss / N + eps);
  }
  EXPECT_LT(max_rel_error(x, x_ref), kTol);
  EXPECT_LT(max_rel_error(h, h_ref), kTol);
  EXPECT_LT(max_rel_error(r, r_ref), kTol);
  // Delayed normalization: r ⊙ (h Wᵀ) equals RMSNorm(x) Wᵀ for any next weight.
  const int64_t n2 = 6;
  const V w2 = uniform_vector(n2 * N, -1, 1, seed() + 4);
  const V delayed = plain_gemm(h, w2, M, n2, N);
  V normalized(M * N), direct;
  for (int64_t i = 0; i < M; ++i)
    for (int64_t j = 0; j < N; ++j) normalized[i * N + j] = x_ref[i * N + j] * r_ref[i] * gamma[j];
  direct = plain_gemm(normalized, w2, M, n2, N);
  V scaled(M * n2);
  for (int64_t i = 0; i < M; ++i)
    for (int64_t j = 0; j < n2; ++j) scaled[i * n2 + j] = r[i] * delayed[i * n2 + j];
  EXPECT_LT(max_rel_error(scaled, direct), kTol);
}

TEST_P(ProgramTest, F0FirstLayerRmsnorm) {
  const auto [M, N, K] = s();
  (void)K;
  const V x = uniform_vector(M * N, -2, 2, seed()), gamma = uniform_vector(N, 0.5, 1.5, seed() + 1);
  V h(M * N), r(M);
  first_layer_rmsnorm<double>({x.data(), M, N, N}, {gamma.data(), N}, 1e-6, {h.data(), M, N, N},
                              r.data());
  for (int64_t i = 0; i < M; ++i) {
    double ss = 0;
    for (int64_t j = 0; j < N; ++j) ss += x[i * N + j] * x[i * N + j];
    EXPECT_NEAR(r[i], 1 / std::sqrt(ss / N + 1e-6), kTol * r[i]);
    for (int64_t j = 0; j < N; ++j) EXPECT_NEAR(h[i * N + j], x[i * N + j] * gamma[j], 1e-15);
  }
}

TEST_P(ProgramTest, F2RmsnormSwiglu) {
  const auto [M, N, K] = s();
  const V h = uniform_vector(M * K, -1, 1, seed()), w = uniform_vector(N * K, -1, 1, seed() + 1);
  const V r = uniform_vector(M, 0.2, 3, seed() + 2);
  V z(M * N), a(M * N / 2);
  RmsnormSwiglu<double> p;
  p.r = {r.data(), M};
  p.z = {z.data(), M, N, N};
  p.a = {a.data(), M, N / 2, N / 2};
  reference::execute<double>(MatrixRef<double>::row_major(h.data(), M, K),
                             MatrixRef<double>::row_major(w.data(), N, K), p, t());
  V z_ref = plain_gemm(h, w, M, N, K), a_ref(M * N / 2);
  for (int64_t i = 0; i < M; ++i) {
    for (int64_t j = 0; j < N; ++j) z_ref[i * N + j] *= r[i];
    for (int64_t j = 0; j < N / 2; ++j) {
      const double g = z_ref[i * N + 2 * j], u = z_ref[i * N + 2 * j + 1];
      a_ref[i * N / 2 + j] = g / (1 + std::exp(-g)) * u;
    }
  }
  EXPECT_LT(max_rel_error(z, z_ref), kTol);
  EXPECT_LT(max_rel_error(a, a_ref), kTol);
}

TEST_P(ProgramTest, F3RmsnormRopeWithGqaWithAndWithoutBias) {
  const auto [M, Nraw, K] = s();
  (void)Nraw;
  for (int d : {64, 128})
    for (bool with_bias : {false, true}) {
      const QkvLayout l{4, 2, d};  // GQA: 4 query heads share 2 kv heads
      const int64_t N = l.width();
      const V h = uniform_vector(M * K, -1, 1, seed()),
              w = uniform_vector(N * K, -1, 1, seed() + 1);
      const V r = uniform_vector(M, 0.2, 3, seed() + 2), b = uniform_vector(N, -4, 4, seed() + 3);
      std::vector<int32_t> pos(M);
      for (int64_t i = 0; i < M; ++i) pos[i] = static_cast<int32_t>((i * 7919) % 5000);
      const auto inv = rope_inv_freq(d, 500000.0, {.enabled = true});
      const auto freq = rope_column_table(l, inv);
      V out(M * N);
      RmsnormRope<double> p;
      p.r = {r.data(), M};
      if (with_bias) p.bias = {b.data(), N};
      p.pos = {pos.data(), M};
      p.freq = {freq.data(), N};
      p.qkv = {out.data(), M, N, N};
      reference::execute<double>(MatrixRef<double>::row_major(h.data(), M, K),
                                 MatrixRef<double>::row_major(w.data(), N, K), p, t());
      V ref = plain_gemm(h, w, M, N, K);
      for (int64_t i = 0; i < M; ++i) {
        for (int64_t j = 0; j < N; ++j)
          ref[i * N + j] = ref[i * N + j] * r[i] + (with_bias ? b[j] : 0);
        for (int64_t j = 0; j < l.q_width() + l.kv_width(); j += 2) {
          const double th = pos[i] * inv[(j % d) / 2];
          const double x0 = ref[i * N + j], x1 = ref[i * N + j + 1];
          ref[i * N + j] = x0 * std::cos(th) - x1 * std::sin(th);
          ref[i * N + j + 1] = x0 * std::sin(th) + x1 * std::cos(th);
        }
      }
      EXPECT_LT(max_rel_error(out, ref), kTol) << "d=" << d << " bias=" << with_bias;
    }
}

TEST_P(ProgramTest, F4RmsnormLseAndA2LossWithIgnoredTokensAndZLoss) {
  const auto [M, N_even, K] = s();
  // N plays the vocabulary: never a multiple of the tile, and also odd (the executor's last pair
  // then holds one column).
  for (const int64_t N : {N_even, N_even + 1}) {
    const V h = uniform_vector(M * K, -1, 1, seed()), w = uniform_vector(N * K, -3, 3, seed() + 1);
    const V r = uniform_vector(M, 0.2, 3, seed() + 2);
    std::vector<int64_t> tgt(M);
    testing::Rng rng(seed() + 3);
    for (auto& v : tgt) v = rng.uniform() < 0.2 ? -100 : rng.integer(0, N - 1);
    for (auto red : {Reduction::kMean, Reduction::kSum}) {
      const CrossEntropyOptions opt{.reduction = red,
                                    .z_loss = red == Reduction::kSum ? 1e-3 : 0.0};
      RmsnormLse<double> p;
      p.layout = epilogue::PartialLayout::per_row(M, N, t().tile_m, t().tile_n);
      V pmax(p.layout.elements()), psum(p.layout.elements()), tl(M, 0.0), logits(M * N);
      p.r = {r.data(), M};
      p.targets = {tgt.data(), M};
      p.vocab = N;
      p.max_partials = pmax.data();
      p.sumexp_partials = psum.data();
      p.target_logit = {tl.data(), M};
      p.logits = {logits.data(), M, N, N};
      reference::execute<double>(MatrixRef<double>::row_major(h.data(), M, K),
                                 MatrixRef<double>::row_major(w.data(), N, K), p, t());
      const auto res =
          fold_lse_loss<double>(pmax.data(), psum.data(), p.layout, tl.data(), tgt.data(), N, opt);
      V l_ref = plain_gemm(h, w, M, N, K), lse_ref(M);
      double total = 0;
      int64_t count = 0;
      for (int64_t i = 0; i < M; ++i) {
        double mx = -INFINITY, se = 0;
        for (int64_t j = 0; j < N; ++j) mx = std::max(mx, l_ref[i * N + j] *= r[i]);
        for (int64_t j = 0; j < N; ++j) se += std::exp(l_ref[i * N + j] - mx);
        lse_ref[i] = mx + std::log(se);
        if (tgt[i] == -100) continue;
        total += lse_ref[i] - l_ref[i * N + tgt[i]] + opt.z_loss * lse_ref[i] * lse_ref[i];
        ++count;
      }
      const double loss_ref = red == Reduction::kMean ? (count ? total / count : NAN) : total;
      EXPECT_LT(max_rel_error(logits, l_ref), kTol);
      EXPECT_LT(max_rel_error(res.lse, lse_ref), kTol);
      if (std::isnan(loss_ref)) {
        EXPECT_TRUE(std::isnan(res.loss));
      } else {
        EXPECT_NEAR(res.loss, loss_ref, kTol * std::max(1.0, std::abs(loss_ref)));
      }
      EXPECT_EQ(res.counted, count);
    }
  }
}

TEST_P(ProgramTest, B1RmsnormBackwardAccumulatesIntoResidualGradient) {
  const auto [M, H, Nout] = s();  // g = dz · W with dz (M, Nout), W (Nout, H)
  const V dz = uniform_vector(M * Nout, -1, 1, seed()),
          w = uniform_vector(Nout * H, -1, 1, seed() + 1);
  const V x = uniform_vector(M * H, -2, 2, seed() + 2),
          gamma = uniform_vector(H, 0.5, 1.5, seed() + 3);
  const V r = uniform_vector(M, 0.3, 2, seed() + 4), zdz = uniform_vector(M, -1, 1, seed() + 5);
  const V dres = uniform_vector(M * H, -1, 1, seed() + 6);
  V dx = dres, h_out(M * H);
  RmsnormBackward<double> p;
  p.layout = epilogue::PartialLayout::per_column(M, H, t().tile_m, t().tile_n);
  V part(p.layout.elements());
  p.x = {x.data(), M, H, H};
  p.r = {r.data(), M};
  p.gamma = {gamma.data(), H};
  p.zdz = {zdz.data(), M};
  p.dx = {dx.data(), M, H, H, epilogue::StoreMode::kAccumulate};
  p.h_out = {h_out.data(), M, H, H};
  p.dgamma_partials = part.data();
  reference::execute<double>(MatrixRef<double>::row_major(dz.data(), M, Nout),
                             MatrixRef<double>::transposed(w.data(), H, Nout), p, t());
  const V dgamma = fold_dgamma<double>(part.data(), p.layout);
  // Unfused: g = dz W; n = x r; dx = dres + r (g γ − n zdz); h = n γ; dγ = Σ_m g n.
  V g(M * H, 0.0), dx_ref(M * H), h_ref(M * H), dg_ref(H, 0.0);
  for (int64_t i = 0; i < M; ++i)
    for (int64_t j = 0; j < Nout; ++j)
      for (int64_t c = 0; c < H; ++c) g[i * H + c] += dz[i * Nout + j] * w[j * H + c];
  for (int64_t i = 0; i < M; ++i)
    for (int64_t c = 0; c < H; ++c) {
      const double nv = x[i * H + c] * r[i];
      dx_ref[i * H + c] = dres[i * H + c] + r[i] * (g[i * H + c] * gamma[c] - nv * zdz[i]);
      h_ref[i * H + c] = nv * gamma[c];
      dg_ref[c] += g[i * H + c] * nv;
    }
  EXPECT_LT(max_rel_error(dx, dx_ref), kTol);
  EXPECT_LT(max_rel_error(h_out, h_ref), kTol);
  EXPECT_LT(max_rel_error(dgamma, dg_ref), kTol);
}

TEST_P(ProgramTest, B2SwigluBackwardOnInterleavedPairs) {
  const auto [M, I, K] = s();  // da = dx · W_down with dx (M, K), W_down (K, I)
  const V dx = uniform_vector(M * K, -1, 1, seed()), wd = uniform_vector(K * I, -1, 1, seed() + 1);
  const V z = uniform_vector(M * 2 * I, -5, 5, seed() + 2);
  V dz(M * 2 * I), a(M * I);
  SwigluBackward<double> p;
  p.layout = epilogue::PartialLayout::per_row(M, I, t().tile_m, t().tile_n);
  V part(p.layout.elements());
  p.z = {z.data(), M, 2 * I, 2 * I};
  p.dz = {dz.data(), M, 2 * I, 2 * I};
  p.a = {a.data(), M, I, I};
  p.partials = part.data();
  reference::execute<double>(MatrixRef<double>::row_major(dx.data(), M, K),
                             MatrixRef<double>::transposed(wd.data(), I, K), p, t());
  const V zdz = fold_zdz<double>(part.data(), p.layout, 3);
  V da(M * I, 0.0), dz_ref(M * 2 * I), a_ref(M * I), zdz_ref(M, 0.0);
  for (int64_t i = 0; i < M; ++i)
    for (int64_t p2 = 0; p2 < K; ++p2)
      for (int64_t j = 0; j < I; ++j) da[i * I + j] += dx[i * K + p2] * wd[p2 * I + j];
  for (int64_t i = 0; i < M; ++i)
    for (int64_t j = 0; j < I; ++j) {
      const double g = z[i * 2 * I + 2 * j], u = z[i * 2 * I + 2 * j + 1],
                   s = 1 / (1 + std::exp(-g));
      const double du = da[i * I + j] * g * s;
      const double dg = da[i * I + j] * u * (s + g * s * (1 - s));  // d/dg (g s) = s + g s (1 - s)
      dz_ref[i * 2 * I + 2 * j] = dg;
      dz_ref[i * 2 * I + 2 * j + 1] = du;
      a_ref[i * I + j] = g * s * u;
      zdz_ref[i] += (g * dg + u * du) / 3;
    }
  EXPECT_LT(max_rel_error(dz, dz_ref), kTol);
  EXPECT_LT(max_rel_error(a, a_ref), kTol);
  EXPECT_LT(max_rel_error(zdz, zdz_ref), kTol);
}

TEST_P(ProgramTest, B4CrossEntropyBackwardMatchesSoftmaxMinusOnehot) {
  const auto [M, N_even, K] = s();
  for (const int64_t N : {N_even, N_even + 1}) {  // an odd vocabulary too
    const V h = uniform_vector(M * K, -1, 1, seed()), w = uniform_vector(N * K, -3, 3, seed() + 1);
    const V r = uniform_vector(M, 0.2, 3, seed() + 2), scale = uniform_vector(M, 0, 1, seed() + 3);
    std::vector<int32_t> tgt(M);
    testing::Rng rng(seed() + 4);
    for (auto& v : tgt) v = static_cast<int32_t>(rng.integer(0, N - 1));
    V l = plain_gemm(h, w, M, N, K), lse(M);
    for (int64_t i = 0; i < M; ++i) {
      double mx = -INFINITY, se = 0;
      for (int64_t j = 0; j < N; ++j) mx = std::max(mx, l[i * N + j] *= r[i]);
      for (int64_t j = 0; j < N; ++j) se += std::exp(l[i * N + j] - mx);
      lse[i] = mx + std::log(se);
    }
    const double z = 2e-3;
    RmsnormCrossEntropyBackward<double, int32_t> p;
    p.layout = epilogue::PartialLayout::per_row(M, N, t().tile_m, t().tile_n);
    V dl(M * N), part(p.layout.elements());
    p.r = {r.data(), M};
    p.lse = {lse.data(), M};
    p.scale = {scale.data(), M};
    p.targets = {tgt.data(), M};
    p.vocab = N;
    p.z_loss = z;
    p.dlogits = {dl.data(), M, N, N};
    p.partials = part.data();
    reference::execute<double>(MatrixRef<double>::row_major(h.data(), M, K),
                               MatrixRef<double>::row_major(w.data(), N, K), p, t());
    const V zdz = fold_zdz<double>(part.data(), p.layout, 5);
    V dl_ref(M * N), zdz_ref(M, 0.0);
    for (int64_t i = 0; i < M; ++i)
      for (int64_t j = 0; j < N; ++j) {
        const double sm = std::exp(l[i * N + j] - lse[i]);
        // d/dl of (lse − l_t + z lse²) = softmax (1 + 2 z lse) − onehot
        dl_ref[i * N + j] = (sm * (1 + 2 * z * lse[i]) - (j == tgt[i])) * scale[i];
        zdz_ref[i] += l[i * N + j] * dl_ref[i * N + j] / 5;
      }
    EXPECT_LT(max_rel_error(dl, dl_ref), kTol);
    EXPECT_LT(max_rel_error(zdz, zdz_ref), kTol);
  }
}

TEST_P(ProgramTest, B3RopeBackwardIsTheTransposeAndZdZUsesTheRotatedPair) {
  const auto [M, Nraw, K] = s();
  (void)Nraw;
  (void)K;
  const QkvLayout l{2, 1, 64};
  const int64_t N = l.width();
  const V y = uniform_vector(M * N, -1, 1, seed()), dy = uniform_vector(M * N, -1, 1, seed() + 1);
  std::vector<int32_t> pos(M);
  for (int64_t i = 0; i < M; ++i) pos[i] = static_cast<int32_t>(i * 31);
  const auto inv = rope_inv_freq(64, 10000.0);
  const auto freq = rope_column_table(l, inv);
  V dz(M * N), zsum(M);
  rope_backward<double>({y.data(), M, N, N}, {dy.data(), M, N, N}, {}, {pos.data(), M},
                        {freq.data(), N}, {dz.data(), M, N, N}, zsum.data());
  // With F3's bias b: ZdZ is ⟨z, dz⟩ for z = Rᵀ y − b.
  const V b = uniform_vector(N, -4, 4, seed() + 2);
  V dz_b(M * N), zsum_b(M);
  rope_backward<double>({y.data(), M, N, N}, {dy.data(), M, N, N}, {b.data(), N}, {pos.data(), M},
                        {freq.data(), N}, {dz_b.data(), M, N, N}, zsum_b.data());
  EXPECT_EQ(dz_b, dz);
  for (int64_t i = 0; i < M; ++i) {
    double zs = 0, zs_pre = 0, zs_bias = 0;
    for (int64_t j = 0; j < N; j += 2) {
      const bool rot = j < l.q_width() + l.kv_width();
      const double th = rot ? pos[i] * inv[(j % 64) / 2] : 0.0, c = std::cos(th), sn = std::sin(th);
      const double d0 = dy[i * N + j], d1 = dy[i * N + j + 1];
      EXPECT_NEAR(dz[i * N + j], d0 * c + d1 * sn, kTol);
      EXPECT_NEAR(dz[i * N + j + 1], -d0 * sn + d1 * c, kTol);
      zs += y[i * N + j] * d0 + y[i * N + j + 1] * d1;
      // the pre-rotation pair z = Rᵀ y gives the same ⟨z, dz⟩
      const double z0 = y[i * N + j] * c + y[i * N + j + 1] * sn;
      const double z1 = -y[i * N + j] * sn + y[i * N + j + 1] * c;
      zs_pre += z0 * dz[i * N + j] + z1 * dz[i * N + j + 1];
      zs_bias += (z0 - b[j]) * dz[i * N + j] + (z1 - b[j + 1]) * dz[i * N + j + 1];
    }
    EXPECT_NEAR(zsum[i], zs, 1e-12 * std::max(1.0, std::abs(zs)));
    EXPECT_NEAR(zsum[i], zs_pre, 1e-12 * std::max(1.0, std::abs(zs)));
    EXPECT_NEAR(zsum_b[i], zs_bias, 1e-12 * std::max(1.0, std::abs(zs_bias)));
  }
}

// The unfused QK-norm + RoPE of one row in fp64, from u = r·acc: the tests' independent model
// of F3 with QK-norm (Qwen3).
V qk_norm_rope_row(const V& u, const QkvLayout& l, const V& qg, const V& kg, double eps,
                   int32_t pos, const std::vector<double>& inv) {
  const int64_t d = l.head_dim;
  V y = u;
  for (int64_t h0 = 0; h0 < l.q_width() + l.kv_width(); h0 += d) {
    const V& g = h0 < l.q_width() ? qg : kg;
    double ss = 0;
    for (int64_t j = 0; j < d; ++j) ss += u[h0 + j] * u[h0 + j];
    const double s = 1.0 / std::sqrt(ss / d + eps);
    for (int64_t j = 0; j < d; j += 2) {
      const double th = pos * inv[j / 2];
      const double x0 = g[j] * u[h0 + j] * s, x1 = g[j + 1] * u[h0 + j + 1] * s;
      y[h0 + j] = x0 * std::cos(th) - x1 * std::sin(th);
      y[h0 + j + 1] = x0 * std::sin(th) + x1 * std::cos(th);
    }
  }
  return y;
}

TEST_P(ProgramTest, F3QkNormRopeNormalizesEachQAndKHeadBeforeRope) {
  const auto [M, Nraw, K] = s();
  (void)Nraw;
  for (int d : {8, 32})
    for (int heads_per_subtile : {1, 2}) {
      const QkvLayout l{4, 2, d};
      const QkNorm qk{l, 1e-6};
      const int64_t N = l.width(), W = qk.normed_width();
      const V h = uniform_vector(M * K, -1, 1, seed()),
              w = uniform_vector(N * K, -1, 1, seed() + 1);
      const V r = uniform_vector(M, 0.2, 3, seed() + 2);
      const V qg = uniform_vector(d, -2, 2, seed() + 3), kg = uniform_vector(d, -2, 2, seed() + 4);
      std::vector<int32_t> pos(M);
      for (int64_t i = 0; i < M; ++i) pos[i] = static_cast<int32_t>((i * 7919) % 5000);
      const auto inv = rope_inv_freq(d, 1000000.0);
      const auto freq = rope_column_table(l, inv);
      TileConfig cfg = t();
      cfg.subtile_n = d * heads_per_subtile;
      cfg.tile_n = cfg.subtile_n * std::max(1, t().tile_n / cfg.subtile_n);
      V out(M * N), pre(M * W);
      RmsnormQkNormRope<double> p;
      p.r = {r.data(), M};
      p.q_gamma = {qg.data(), d};
      p.k_gamma = {kg.data(), d};
      p.qk = qk;
      p.pos = {pos.data(), M};
      p.freq = {freq.data(), N};
      p.qkv = {out.data(), M, N, N};
      p.qk_pre = {pre.data(), M, W, W};
      reference::execute<double>(MatrixRef<double>::row_major(h.data(), M, K),
                                 MatrixRef<double>::row_major(w.data(), N, K), p, cfg);
      const V acc = plain_gemm(h, w, M, N, K);
      V ref(M * N), ref_pre(M * W);
      for (int64_t i = 0; i < M; ++i) {
        V u(N);
        for (int64_t j = 0; j < N; ++j) u[j] = acc[i * N + j] * r[i];
        const V y = qk_norm_rope_row(u, l, qg, kg, qk.eps, pos[i], inv);
        std::copy(y.begin(), y.end(), ref.begin() + i * N);
        std::copy(u.begin(), u.begin() + W, ref_pre.begin() + i * W);
      }
      EXPECT_LT(max_rel_error(out, ref), kTol)
          << "d=" << d << " heads/subtile " << heads_per_subtile;
      EXPECT_LT(max_rel_error(pre, ref_pre), kTol) << "d=" << d;
    }
}

class QkNormBackwardTest : public ::testing::TestWithParam<int64_t> {};

TEST_P(QkNormBackwardTest, B3QkNormRopeBackwardMatchesFiniteDifferences) {
  const int64_t M = GetParam();
  const uint64_t seed_ = 77 + M;
  const auto seed = [&] { return seed_; };
  const int d = 8;
  const QkvLayout l{2, 1, d};
  const QkNorm qk{l, 1e-5};
  const int64_t N = l.width(), W = qk.normed_width();
  const V u = uniform_vector(M * N, -1, 1, seed()), dy = uniform_vector(M * N, -1, 1, seed() + 1);
  V qg = uniform_vector(d, -2, 2, seed() + 3), kg = uniform_vector(d, -2, 2, seed() + 4);
  std::vector<int32_t> pos(M);
  for (int64_t i = 0; i < M; ++i) pos[i] = static_cast<int32_t>(i * 31 + 3);
  const auto inv = rope_inv_freq(d, 10000.0);
  const auto freq = rope_column_table(l, inv);
  V pre(M * W), qkv(M * N);
  for (int64_t i = 0; i < M; ++i) {
    const V row(u.begin() + i * N, u.begin() + (i + 1) * N);
    const V y = qk_norm_rope_row(row, l, qg, kg, qk.eps, pos[i], inv);
    std::copy(row.begin(), row.begin() + W, pre.begin() + i * W);
    std::copy(y.begin(), y.end(), qkv.begin() + i * N);
  }
  V dz(M * N), zsum(M), dqg(d), dkg(d);
  qk_norm_rope_backward<double>({pre.data(), M, W, W}, {qkv.data(), M, N, N}, {dy.data(), M, N, N},
                                {qg.data(), d}, {kg.data(), d}, qk, {pos.data(), M},
                                {freq.data(), N}, {dz.data(), M, N, N}, zsum.data(), dqg.data(),
                                dkg.data());
  // L = Σ dy ⊙ y(u, γ): central differences over every input of one row, and over γ.
  const auto loss = [&](int64_t i, const V& row, const V& q, const V& k) {
    const V y = qk_norm_rope_row(row, l, q, k, qk.eps, pos[i], inv);
    double s = 0;
    for (int64_t j = 0; j < N; ++j) s += dy[i * N + j] * y[j];
    return s;
  };
  const double step = 1e-6, tol = 1e-7;
  V fd_qg(d, 0.0), fd_kg(d, 0.0);
  for (int64_t i = 0; i < M; ++i) {
    V row(u.begin() + i * N, u.begin() + (i + 1) * N);
    double zs = 0;
    for (int64_t j = 0; j < N; ++j) {
      const double keep = row[j];
      row[j] = keep + step;
      const double up = loss(i, row, qg, kg);
      row[j] = keep - step;
      const double down = loss(i, row, qg, kg);
      row[j] = keep;
      EXPECT_NEAR(dz[i * N + j], (up - down) / (2 * step), tol) << "row " << i << " col " << j;
      zs += keep * dz[i * N + j];
    }
    EXPECT_NEAR(zsum[i], zs, 1e-12 * std::max(1.0, std::abs(zs)));
    for (V* g : {&qg, &kg})
      for (int64_t j = 0; j < d; ++j) {
        const double keep = (*g)[j];
        (*g)[j] = keep + step;
        const double up = loss(i, row, qg, kg);
        (*g)[j] = keep - step;
        const double down = loss(i, row, qg, kg);
        (*g)[j] = keep;
        (g == &qg ? fd_qg : fd_kg)[j] += (up - down) / (2 * step);
      }
  }
  for (int64_t j = 0; j < d; ++j) {
    EXPECT_NEAR(dqg[j], fd_qg[j], tol * M) << "dq_gamma " << j;
    EXPECT_NEAR(dkg[j], fd_kg[j], tol * M) << "dk_gamma " << j;
  }
}

INSTANTIATE_TEST_SUITE_P(RaggedRows, QkNormBackwardTest, ::testing::Values(1, 19, 111));

TEST(QkNormProgram, RejectsASubtileNarrowerThanAHead) {
  const QkvLayout l{2, 1, 16};
  RmsnormQkNormRope<double> p;
  p.qk = {l, 1e-6};
  try {
    p.validate(4, l.width(), TileConfig{128, 128, 64, 8});
    FAIL() << "expected coda::Error";
  } catch (const coda::Error& e) {
    EXPECT_NE(std::string(e.what()).find("multiple of head_dim (16)"), std::string::npos)
        << e.what();
  }
}

std::string case_name(const ::testing::TestParamInfo<std::tuple<Shape, TileConfig>>& info) {
  const Shape sh = std::get<0>(info.param);
  const TileConfig t = std::get<1>(info.param);
  return "M" + std::to_string(sh.m) + "_N" + std::to_string(sh.n) + "_K" + std::to_string(sh.k) +
         "_tile" + std::to_string(t.tile_m) + "x" + std::to_string(t.tile_n) + "_sub" +
         std::to_string(t.subtile_m) + "x" + std::to_string(t.subtile_n);
}

INSTANTIATE_TEST_SUITE_P(RaggedShapesAndTiles, ProgramTest, ::testing::ValuesIn(cases()),
                         case_name);

}  // namespace
}  // namespace coda::programs
