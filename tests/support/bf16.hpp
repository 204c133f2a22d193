#pragma once
// Host bfloat16 rounding (round to nearest even), bit-compatible with __nv_bfloat16, so tests build
// inputs that are exactly representable and emulate PyTorch's bf16 rounding without CUDA headers.

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace coda::testing {

inline uint16_t bf16_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if (std::isnan(f)) return 0x7fc0;
  u += 0x7fff + ((u >> 16) & 1);  // round to nearest even
  return static_cast<uint16_t>(u >> 16);
}

inline float bf16_value(uint16_t bits) {
  const uint32_t u = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline double round_bf16(double x) { return bf16_value(bf16_bits(static_cast<float>(x))); }

inline std::vector<uint16_t> to_bf16_bits(const std::vector<double>& v) {
  std::vector<uint16_t> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = bf16_bits(static_cast<float>(v[i]));
  return out;
}

inline std::vector<double> from_bf16_bits(const std::vector<uint16_t>& v) {
  std::vector<double> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = bf16_value(v[i]);
  return out;
}

// Values drawn uniformly and rounded to bf16, as doubles (so the fp64 reference sees exactly what
// the GPU sees).
template <class Rng>
std::vector<double> bf16_uniform(size_t n, double lo, double hi, Rng& rng) {
  std::vector<double> v(n);
  for (auto& e : v) e = round_bf16(rng.uniform(lo, hi));
  return v;
}

}  // namespace coda::testing
