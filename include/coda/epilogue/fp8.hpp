#pragma once
// The FP8 (e4m3) quantization of docs/math.md §6, one definition for every executor: the CPU
// reference (exact emulation), the GPU epilogue nodes and the standalone cast kernels.
//
// e4m3 ("fn" variant, as NVIDIA's __nv_fp8_e4m3 and torch.float8_e4m3fn): 1 sign, 4 exponent
// (bias 7), 3 mantissa bits; no infinities; S.1111.111 is NaN; the largest finite value is 448;
// subnormals have exponent field 0 and step 2^-9.
//
// A block of values (1x128 along the GEMM's K, 128x128 for weights) shares one fp32 scale
// s = 2^ceil(log2(amax / 448)) (s = 1 when amax = 0): the stored value is e4m3(v / s), saturating,
// rounded to nearest even, and it dequantizes as q · s. Powers of two make v / s exact.

#include <cmath>
#include <cstdint>
#include <cstring>

#include "coda/common/host_device.hpp"

#if defined(__CUDACC__)
#include <cuda_fp8.h>
#endif

namespace coda::epilogue {

struct E4m3 {
  static constexpr float kMax = 448.0f;
  static constexpr uint8_t kNan = 0x7f;

  // The value of an e4m3 bit pattern (NaN for S.1111.111).
  CODA_HD static float decode(uint8_t bits) {
    const int sign = bits >> 7, exp = (bits >> 3) & 0xf, man = bits & 0x7;
    if (exp == 0xf && man == 0x7) return NAN;
    const float mag = exp == 0 ? ldexpf(float(man), -9)  // subnormal: man · 2^-3 · 2^(1-7)
                               : ldexpf(float(8 + man), exp - 10);  // (1 + man/8) · 2^(exp-7)
    return sign ? -mag : mag;
  }

  // The e4m3 pattern nearest to v (ties to even mantissa), |v| > 448 saturating to ±448, NaN to
  // NaN. Exact: the rounding works on v's fp32 bits.
  CODA_HD static uint8_t encode(float v) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
    // The same rounding in one instruction (cvt.rn.satfinite.e4m3x2.f32); tests/gpu/
    // fp8_convert_test.cpp checks it against the bit path below over every fp32 class.
    return uint8_t(__nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3));
#endif
    uint32_t u;
    memcpy(&u, &v, 4);
    const uint8_t sign = uint8_t((u >> 24) & 0x80);
    const uint32_t a = u & 0x7fffffffu;        // |v|'s bits
    if (a > 0x7f800000u) return kNan;          // NaN
    if (a >= 0x43e00000u) return sign | 0x7e;  // |v| >= 448 (inf included): saturate
    // |v| < 2^-6: the subnormal range, a multiple of 2^-9 after rounding; else keep 3 mantissa
    // bits of the normal fp32 value.
    if (a < 0x3c800000u) {
      // |v| = m · 2^-9 with m = |v| · 512 rounded to nearest even (exact in fp32: a power of two
      // scale); m = 8 carries into the smallest normal (exponent field 1, mantissa 0).
      float s;
      const uint32_t abits = a;
      memcpy(&s, &abits, 4);
      const float m = rintf(s * 512.0f);  // round half to even (default rounding mode)
      return sign | uint8_t(m);
    }
    const uint32_t exp = (a >> 23) - 127 + 7;  // the e4m3 exponent field, 1..15
    const uint32_t man = a & 0x7fffffu;
    // Round the 23-bit mantissa to 3 bits, ties to even; a carry may bump the exponent.
    const uint32_t keep = man >> 20, rest = man & 0xfffffu, half = 0x80000u;
    uint32_t q = (exp << 3) | keep;
    if (rest > half || (rest == half && (keep & 1))) ++q;
    return sign | uint8_t(q);  // q <= 0x7e: |v| < 448 rounds to at most 448
  }

  // encode(lo) | encode(hi) << 8: on sm_89 and later one instruction for both
  // (cvt.rn.satfinite.e4m3x2.f32), the vector kernels' form.
  CODA_HD static uint16_t encode2(float lo, float hi) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
    return uint16_t(__nv_cvt_float2_to_fp8x2(make_float2(lo, hi), __NV_SATFINITE, __NV_E4M3));
#endif
    return uint16_t(encode(lo) | uint16_t(encode(hi)) << 8);
  }

  // The block scale for a block whose largest magnitude is amax: 2^ceil(log2(amax / 448)), the
  // smallest power of two s with amax <= 448·s, computed exactly (no rounded quotient), and no
  // smaller than 2^-126; 1 for amax = 0. A NaN or infinite amax gives a NaN scale (the block's
  // values are NaN then).
  CODA_HD static float scale(float amax) {
    if (amax == 0.0f) return 1.0f;
    if (!(amax > 0.0f && amax <= 3.4028235e38f)) return NAN;
    // On the bits (no frexp / ldexp: one integer path for host and device). For a normal amax =
    // 1.f · 2^e, amax / 448 = (1.f / 1.75) · 2^(e-8), so p = e - 8 when 1.f <= 1.75 (mantissa
    // bits <= 0x600000) and e - 7 above. A subnormal amax is below 448 · 2^-126 anyway. p is at
    // least -126 (the smallest normal float, with a finite reciprocal: a tinier power of two would
    // underflow to 0 for amax below 2^-140).
    uint32_t bits;
    memcpy(&bits, &amax, 4);
    const int e = int(bits >> 23) - 127;
    int p = (bits >> 23) == 0 ? -126 : (bits & 0x7fffffu) <= 0x600000u ? e - 8 : e - 7;
    p = p < -126 ? -126 : p;
    const uint32_t sbits = uint32_t(p + 127) << 23;
    float out;
    memcpy(&out, &sbits, 4);
    return out;
  }

  // 1 / s for a block scale s (a power of two in [2^-126, 2^120]), exactly, on the bits: the
  // exponent field goes from f to 254 - f. A NaN scale gives NaN.
  CODA_HD static float inverse(float s) {
    uint32_t bits;
    memcpy(&bits, &s, 4);
    if ((bits & 0x7f800000u) == 0x7f800000u) return NAN;
    const uint32_t inv = (254u - (bits >> 23)) << 23;
    float out;
    memcpy(&out, &inv, 4);
    return out;
  }

  // e4m3(v / s): the quantized value of v in a block of scale s.
  CODA_HD static uint8_t quantize(float v, float s) { return encode(v / s); }
  // The same from inverse(s): a power of two whose product with v rounds exactly as the quotient
  // v / s does (both are v scaled by a power of two, correctly rounded).
  CODA_HD static uint8_t quantize_by_inverse(float v, float inv_s) { return encode(v * inv_s); }
};

}  // namespace coda::epilogue
