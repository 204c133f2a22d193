// The e4m3 functor (epilogue/fp8.hpp) against NVIDIA's own conversion (cuda_fp8.h, host side:
// __nv_cvt_float_to_fp8 with saturation to the largest finite value, and back through half):
// every pattern and 200k random values over every binade. Host-only (label cpu).

#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "coda/epilogue/fp8.hpp"

namespace coda::epilogue {
namespace {

float cuda_decode(uint8_t b) {
  const __half_raw h = __nv_cvt_fp8_to_halfraw(__nv_fp8_storage_t(b), __NV_E4M3);
  return __half2float(__half(h));
}
uint8_t cuda_encode(float v) { return __nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3); }

TEST(E4m3Cuda, DecodeAndEncodeMatchCudaFp8) {
  for (int b = 0; b < 256; ++b) {
    const float mine = E4m3::decode(uint8_t(b)), cuda = cuda_decode(uint8_t(b));
    if (std::isnan(cuda)) {
      EXPECT_TRUE(std::isnan(mine)) << b;
      continue;
    }
    EXPECT_EQ(mine, cuda) << b;
    EXPECT_EQ(E4m3::encode(mine), cuda_encode(mine)) << b;
  }
  std::mt19937 rng(3);
  std::uniform_real_distribution<float> mant(1.0f, 2.0f);
  std::uniform_int_distribution<int> exp(-14, 12), coin(0, 1);
  for (int i = 0; i < 200000; ++i) {
    const float v = std::ldexp(mant(rng), exp(rng)) * (coin(rng) ? 1.0f : -1.0f);
    ASSERT_EQ(int(E4m3::encode(v)), int(cuda_encode(v))) << v;
  }
}

}  // namespace
}  // namespace coda::epilogue
