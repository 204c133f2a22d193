// The e4m3 quantize functor (epilogue/fp8.hpp) against an independent host implementation: the
// value of each of the 256 bit patterns from the format's definition, and rounding by brute force
// (the nearest of the 127 finite non-negative values, ties to the even pattern). Covers every
// pattern, every tie between neighbours, saturation, zeros, subnormals, NaN and infinities, and
// the block scale's power-of-two rule.

#include "coda/epilogue/fp8.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>

namespace coda::epilogue {
namespace {

// The format's definition, in double: sign, 4 exponent bits (bias 7), 3 mantissa bits.
double definition(int bits) {
  const int s = (bits >> 7) & 1, e = (bits >> 3) & 15, m = bits & 7;
  if (e == 15 && m == 7) return std::numeric_limits<double>::quiet_NaN();
  const double mag = e == 0 ? (m / 8.0) * std::pow(2.0, -6) : (1 + m / 8.0) * std::pow(2.0, e - 7);
  return s ? -mag : mag;
}

// Round to nearest (ties to the even pattern) by search, saturating at 448.
int reference_encode(double v) {
  if (std::isnan(v)) return -1;  // any NaN pattern
  const int sign = std::signbit(v) ? 0x80 : 0;
  const double a = std::min(std::fabs(v), 448.0);
  int best = 0;
  for (int b = 1; b <= 0x7e; ++b) {
    const double d = std::fabs(definition(b) - a), db = std::fabs(definition(best) - a);
    if (d < db || (d == db && (b & 1) == 0)) best = b;
  }
  return sign | best;
}

void expect_encodes(float v) {
  const int want = reference_encode(v);
  const uint8_t got = E4m3::encode(v);
  if (want < 0) {
    EXPECT_TRUE(std::isnan(E4m3::decode(got))) << v << " -> " << int(got);
  } else {
    EXPECT_EQ(int(got), want) << "v = " << v;
  }
}

TEST(E4m3, DecodeMatchesTheDefinitionForEveryPattern) {
  for (int b = 0; b < 256; ++b) {
    const double want = definition(b);
    const float got = E4m3::decode(uint8_t(b));
    if (std::isnan(want)) {
      EXPECT_TRUE(std::isnan(got)) << b;
    } else {
      EXPECT_EQ(double(got), want) << b;
    }
  }
  EXPECT_EQ(E4m3::decode(0x7e), 448.0f);
  EXPECT_EQ(E4m3::decode(0x01), std::ldexp(1.0f, -9));  // the smallest subnormal
  EXPECT_EQ(E4m3::decode(0x08), std::ldexp(1.0f, -6));  // the smallest normal
}

TEST(E4m3, EveryValueRoundTripsAndEveryTieGoesToTheEvenPattern) {
  for (int b = 0; b < 256; ++b) {
    const float v = E4m3::decode(uint8_t(b));
    if (std::isnan(v)) continue;
    EXPECT_EQ(int(E4m3::encode(v)), b) << b;
  }
  // Midpoints between neighbours (exact in fp32) and values just either side of them.
  for (int b = 0; b < 0x7e; ++b) {
    const float lo = E4m3::decode(uint8_t(b)), hi = E4m3::decode(uint8_t(b + 1));
    const float mid = (lo + hi) / 2;
    for (float v : {mid, std::nextafter(mid, 0.0f), std::nextafter(mid, 1e9f)}) {
      expect_encodes(v);
      expect_encodes(-v);
    }
  }
}

TEST(E4m3, SaturatesZerosSubnormalsNanAndInfinity) {
  EXPECT_EQ(E4m3::encode(0.0f), 0x00);
  EXPECT_EQ(E4m3::encode(-0.0f), 0x80);
  EXPECT_EQ(E4m3::encode(448.0f), 0x7e);
  EXPECT_EQ(E4m3::encode(464.0f), 0x7e);  // the tie with 480, which e4m3fn lacks: saturate
  EXPECT_EQ(E4m3::encode(1e30f), 0x7e);
  EXPECT_EQ(E4m3::encode(-1e30f), 0xfe);
  EXPECT_EQ(E4m3::encode(std::numeric_limits<float>::infinity()), 0x7e);
  EXPECT_EQ(E4m3::encode(-std::numeric_limits<float>::infinity()), 0xfe);
  EXPECT_TRUE(std::isnan(E4m3::decode(E4m3::encode(std::nanf("")))));
  EXPECT_EQ(E4m3::encode(std::ldexp(1.0f, -10)), 0x00);  // half the smallest subnormal: tie to 0
  EXPECT_EQ(E4m3::encode(std::ldexp(1.5f, -10)), 0x01);
  EXPECT_EQ(E4m3::encode(std::ldexp(1.0f, -20)), 0x00);
  EXPECT_EQ(E4m3::encode(std::numeric_limits<float>::denorm_min()), 0x00);
  // The largest subnormal rounds up into the smallest normal at 7.5 · 2^-9.
  EXPECT_EQ(E4m3::encode(7.5f * std::ldexp(1.0f, -9)), 0x08);
}

TEST(E4m3, RandomValuesOverEveryBinadeMatchTheSearch) {
  std::mt19937 rng(5);
  std::uniform_real_distribution<float> mant(1.0f, 2.0f);
  std::uniform_int_distribution<int> exp(-14, 10), coin(0, 1);
  for (int i = 0; i < 200000; ++i) {
    const float v = std::ldexp(mant(rng), exp(rng)) * (coin(rng) ? 1.0f : -1.0f);
    expect_encodes(v);
  }
}

TEST(E4m3, BlockScaleIsTheSmallestPowerOfTwoThatFitsTheBlock) {
  EXPECT_EQ(E4m3::scale(0.0f), 1.0f);
  EXPECT_EQ(E4m3::scale(448.0f), 1.0f);
  EXPECT_EQ(E4m3::scale(std::nextafter(448.0f, 1e9f)), 2.0f);
  EXPECT_EQ(E4m3::scale(224.0f), 0.5f);
  EXPECT_EQ(E4m3::scale(1.0f), std::ldexp(1.0f, -8));  // 448 · 2^-8 = 1.75 >= 1
  EXPECT_TRUE(std::isnan(E4m3::scale(std::nanf(""))));
  EXPECT_TRUE(std::isnan(E4m3::scale(std::numeric_limits<float>::infinity())));
  std::mt19937 rng(9);
  std::uniform_real_distribution<float> mant(1.0f, 2.0f);
  std::uniform_int_distribution<int> exp(-100, 100);
  for (int i = 0; i < 100000; ++i) {
    const float amax = std::ldexp(mant(rng), exp(rng));
    const float s = E4m3::scale(amax);
    int e;
    ASSERT_EQ(std::frexp(s, &e), 0.5f) << amax << ": " << s << " is not a power of two";
    // amax / s fits e4m3 and amax / (s / 2) does not (checked in double: exact).
    EXPECT_LE(double(amax) / s, 448.0) << amax;
    EXPECT_GT(double(amax) / (s / 2), 448.0) << amax;
    // The block's largest value quantizes without saturating and dequantizes within half a step.
    const float q = E4m3::decode(E4m3::quantize(amax, s)) * s;
    EXPECT_LE(std::fabs(q - amax), amax / 16) << amax;
  }
}

TEST(E4m3, InverseOfEveryScaleIsExact) {
  // Every power of two a scale can be (2^-126 .. 2^120): inverse(s) · s == 1 exactly, and
  // quantizing by the inverse equals quantizing by the quotient.
  for (int p = -126; p <= 120; ++p) {
    const float s = std::ldexp(1.0f, p), inv = E4m3::inverse(s);
    EXPECT_EQ(double(inv) * double(s), 1.0) << p;
    for (float v : {1.0f, -3.0f, 0.3f, 448.0f, 1e-30f, 7e30f})
      EXPECT_EQ(E4m3::quantize_by_inverse(v, inv), E4m3::quantize(v, s)) << p << " " << v;
  }
  EXPECT_TRUE(std::isnan(E4m3::inverse(std::nanf(""))));
}

TEST(E4m3, BlockScaleOfATinyBlockStaysANormalFloat) {
  // Below amax = 448 · 2^-126 the scale stops at 2^-126 rather than underflowing to 0 (which
  // would turn the block into NaN or infinity); amax / s still fits.
  const float floor_scale = std::ldexp(1.0f, -126);
  for (const float amax :
       {std::ldexp(1.0f, -120), std::ldexp(1.0f, -140), std::numeric_limits<float>::denorm_min(),
        std::numeric_limits<float>::min()}) {
    const float s = E4m3::scale(amax);
    EXPECT_GE(s, floor_scale) << amax;
    EXPECT_TRUE(std::isfinite(1.0f / s)) << amax;
    EXPECT_LE(double(amax) / s, 448.0) << amax;
    const float q = E4m3::decode(E4m3::quantize(amax, s)) * s;
    EXPECT_TRUE(std::isfinite(q)) << amax;
    EXPECT_LE(std::fabs(double(q) - amax), double(amax) / 16 + double(s) * std::ldexp(1.0, -10))
        << amax;
  }
  EXPECT_EQ(E4m3::scale(std::ldexp(1.0f, -120)), std::ldexp(1.0f, -126));  // 2^-120 / 2^-126 = 64
  EXPECT_EQ(E4m3::scale(std::ldexp(1.5f, -110)), std::ldexp(1.0f, -118));
}

}  // namespace
}  // namespace coda::epilogue
