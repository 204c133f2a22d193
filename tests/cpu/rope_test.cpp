// RoPE angles and frequency tables.

#include "coda/programs/rope.hpp"

#include <gtest/gtest.h>

#include <cmath>

#include "support/numeric.hpp"

namespace coda::programs {
namespace {

// Distance between two angles on the circle, in radians.
double angle_distance(long double a, long double b) {
  const long double two_pi = 6.283185307179586476925286766559L;
  long double d = std::fmod(a - b, two_pi);
  if (d < 0) d += two_pi;
  return static_cast<double>(std::min(d, two_pi - d));
}

TEST(RopeAngle, Fp32PathStaysWithin1e6RadOfExactUpTo2To20Positions) {
  const auto freqs = rope_inv_freq(128, 500000.0, {.enabled = true});
  auto more = rope_inv_freq(64, 10000.0);
  std::vector<double> all(freqs);
  all.insert(all.end(), more.begin(), more.end());
  all.push_back(1.0);
  testing::Rng rng(11);
  double worst32 = 0, worst64 = 0;
  for (double f : all) {
    const RopeFrequency q = rope_frequency_from_radians(f);
    for (int i = 0; i < 64; ++i) {
      const int32_t pos = i < 4 ? (1 << 20) - i : static_cast<int32_t>(rng.integer(0, 1 << 20));
      const long double exact = static_cast<long double>(pos) * static_cast<long double>(f);
      worst32 = std::max(worst32, angle_distance(rope_angle<float>(pos, q), exact));
      worst64 = std::max(worst64, angle_distance(rope_angle<double>(pos, q), exact));
      const float a32 = rope_angle<float>(pos, q);
      EXPECT_LE(std::abs(a32), 3.1415930f);
    }
  }
  EXPECT_LT(worst32, 1e-6);
  EXPECT_LT(worst64, 1e-12);
  // The naive fp32 product really is inaccurate there, which is why the fixed-point path exists.
  const float naive = static_cast<float>(1 << 20) * 0.9f;
  EXPECT_GT(angle_distance(naive, (1 << 20) * 0.9L), 1e-3);
}

TEST(RopeAngle, ZeroFrequencyIsAnExactIdentityRotation) {
  float c, s;
  rope_cos_sin<float>(123456, RopeFrequency{}, c, s);
  EXPECT_EQ(c, 1.0f);
  EXPECT_EQ(s, 0.0f);
}

TEST(RopeTable, QAndKColumnsGetPairFrequenciesAndVColumnsZero) {
  const QkvLayout l{4, 2, 8};
  const auto inv = rope_inv_freq(8, 10000.0);
  const auto t = rope_column_table(l, inv);
  ASSERT_EQ(static_cast<int>(t.size()), l.width());
  for (int n = 0; n < l.width(); ++n) {
    const bool rotated = n < l.q_width() + l.kv_width();
    const RopeFrequency expect =
        rotated ? rope_frequency_from_radians(inv[(n % 8) / 2]) : RopeFrequency{};
    EXPECT_EQ(t[n].hi, expect.hi) << n;
    EXPECT_EQ(t[n].lo, expect.lo) << n;
  }
  EXPECT_THROW(rope_column_table(l, std::vector<double>(3, 1.0)), Error);
  EXPECT_THROW(rope_column_table(QkvLayout{3, 2, 8}, inv), Error);
}

TEST(RopeInvFreq, Llama31ScalingKeepsHighDividesLowAndBlendsTheMiddle) {
  const int d = 128;
  const auto plain = rope_inv_freq(d, 500000.0);
  const RopeScaling s{.enabled = true, .factor = 8.0};
  const auto scaled = rope_inv_freq(d, 500000.0, s);
  const double pi = 3.14159265358979323846;
  int high = 0, low = 0, mid = 0;
  for (int i = 0; i < d / 2; ++i) {
    const double wavelen = 2 * pi / plain[i];
    EXPECT_NEAR(plain[i], std::pow(500000.0, -2.0 * i / d), 1e-15);
    if (wavelen < s.original_max_position / s.high_freq_factor) {
      EXPECT_EQ(scaled[i], plain[i]);
      ++high;
    } else if (wavelen > s.original_max_position / s.low_freq_factor) {
      EXPECT_DOUBLE_EQ(scaled[i], plain[i] / s.factor);
      ++low;
    } else {
      EXPECT_LT(scaled[i], plain[i]);
      EXPECT_GT(scaled[i], plain[i] / s.factor);
      ++mid;
    }
  }
  EXPECT_GT(high, 0);
  EXPECT_GT(low, 0);
  EXPECT_GT(mid, 0);
}

}  // namespace
}  // namespace coda::programs
