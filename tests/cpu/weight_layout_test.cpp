// Weight-layout converters: round trips, and that the converted layouts compute the same function.

#include "coda/programs/weight_layout.hpp"

#include <gtest/gtest.h>

#include <cmath>

#include "coda/programs/rope.hpp"
#include "support/numeric.hpp"

namespace coda::programs {
namespace {

using testing::uniform_vector;

TEST(WeightLayout, GateUpInterleaveRoundTripsAndPairsRows) {
  const int64_t I = 7, H = 5;
  const auto g = uniform_vector(I * H, -1, 1, 1), u = uniform_vector(I * H, -1, 1, 2);
  const auto gu = interleave_gate_up(g, u, I, H);
  for (int64_t i = 0; i < I; ++i)
    for (int64_t c = 0; c < H; ++c) {
      EXPECT_EQ(gu[(2 * i) * H + c], g[i * H + c]);
      EXPECT_EQ(gu[(2 * i + 1) * H + c], u[i * H + c]);
    }
  std::vector<double> g2, u2;
  split_gate_up(gu, I, H, g2, u2);
  EXPECT_EQ(g2, g);
  EXPECT_EQ(u2, u);
  EXPECT_THROW(interleave_gate_up(g, u, I + 1, H), Error);
}

TEST(WeightLayout, HfQkvToFusedRoundTrips) {
  const int64_t Hq = 4, Hkv = 2, d = 8, H = 6;
  const auto wq = uniform_vector(Hq * d * H, -1, 1, 3), wk = uniform_vector(Hkv * d * H, -1, 1, 4);
  const auto wv = uniform_vector(Hkv * d * H, -1, 1, 5);
  const auto packed = qkv_from_hf(wq, wk, wv, Hq, Hkv, d, H);
  ASSERT_EQ(packed.size(), wq.size() + wk.size() + wv.size());
  std::vector<double> q2, k2, v2;
  qkv_to_hf(packed, Hq, Hkv, d, H, q2, k2, v2);
  EXPECT_EQ(q2, wq);
  EXPECT_EQ(k2, wk);
  EXPECT_EQ(v2, wv);
  EXPECT_THROW(rope_rows_half_to_interleaved(wq, Hq, 7, H), Error);
  EXPECT_THROW(unpack_qkv(packed, Hq * d, Hkv * d + 1, H, q2, k2, v2), Error);
}

// HF rotate_half on q = W_hf h equals adjacent-pair RoPE on q' = W_fused h, up to the same row
// permutation; and scores q·k are unchanged by it.
TEST(WeightLayout, ConvertedRopeComputesTheSameScores) {
  const int64_t d = 16, H = 9;
  const auto wq = uniform_vector(d * H, -1, 1, 6), wk = uniform_vector(d * H, -1, 1, 7);
  const auto hq = uniform_vector(H, -1, 1, 8), hk = uniform_vector(H, -1, 1, 9);
  const auto inv = rope_inv_freq(d, 10000.0);
  const int pos_q = 37, pos_k = 11;
  auto project = [&](const std::vector<double>& w, const std::vector<double>& x) {
    std::vector<double> y(d, 0.0);
    for (int64_t r = 0; r < d; ++r)
      for (int64_t c = 0; c < H; ++c) y[r] += w[r * H + c] * x[c];
    return y;
  };
  auto rope_hf = [&](std::vector<double> v, int pos) {
    std::vector<double> o(d);
    for (int64_t i = 0; i < d / 2; ++i) {
      const double c = std::cos(pos * inv[i]), s = std::sin(pos * inv[i]);
      o[i] = v[i] * c - v[i + d / 2] * s;
      o[i + d / 2] = v[i + d / 2] * c + v[i] * s;
    }
    return o;
  };
  auto rope_pairs = [&](std::vector<double> v, int pos) {
    for (int64_t i = 0; i < d / 2; ++i) {
      const double c = std::cos(pos * inv[i]), s = std::sin(pos * inv[i]);
      const double x0 = v[2 * i], x1 = v[2 * i + 1];
      v[2 * i] = x0 * c - x1 * s;
      v[2 * i + 1] = x0 * s + x1 * c;
    }
    return v;
  };
  const auto q_hf = rope_hf(project(wq, hq), pos_q), k_hf = rope_hf(project(wk, hk), pos_k);
  const auto q_f = rope_pairs(project(rope_rows_half_to_interleaved(wq, 1, d, H), hq), pos_q);
  const auto k_f = rope_pairs(project(rope_rows_half_to_interleaved(wk, 1, d, H), hk), pos_k);
  double s_hf = 0, s_f = 0;
  for (int64_t i = 0; i < d; ++i) {
    s_hf += q_hf[i] * k_hf[i];
    s_f += q_f[i] * k_f[i];
  }
  EXPECT_NEAR(s_hf, s_f, 1e-13);
  for (int64_t i = 0; i < d / 2; ++i) {
    EXPECT_NEAR(q_f[2 * i], q_hf[i], 1e-14);
    EXPECT_NEAR(q_f[2 * i + 1], q_hf[i + d / 2], 1e-14);
  }
}

}  // namespace
}  // namespace coda::programs
