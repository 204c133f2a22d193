#pragma once
// RoPE angles from (position, frequency) computed in the epilogue, accurate at long context.
//
// fp32 `pos * freq` loses ~5e-3 rad at 128k positions, so frequencies are kept as fixed-point TURNS
// per position: T = round(freq / 2pi * 2^64) (uint64, split hi/lo 32 bits). The angle in turns is
// frac(pos * T / 2^64), computed exactly modulo 2^64 by integer multiplication, then mapped to
// [-pi, pi). On the GPU only the top 32 bits are formed:
//     turns32 = pos * hi + umulhi(pos, lo)    (mod 2^32; error < 2^-32 turn = 1.5e-9 rad)
// and converted to fp32 (error <= pi * 2^-24 = 1.9e-7 rad), so the angle stays within ~2e-7 rad of
// fp64 up to 2^20 positions and beyond. The double-precision host path uses the full 64-bit
// product. Columns with T = 0 (V heads) rotate by exactly 0: cos = 1, sin = 0.

#include <cmath>
#include <cstdint>
#include <vector>

#include "coda/common/check.hpp"
#include "coda/common/host_device.hpp"

namespace coda::programs {

struct RopeFrequency {
  uint32_t hi = 0, lo = 0;  // T = hi * 2^32 + lo, turns per position in units of 2^-64
};

// Host: radians per position -> fixed-point turns. long double keeps 64 mantissa bits on x86.
inline RopeFrequency rope_frequency_from_radians(double radians_per_position) {
  CODA_CHECK(radians_per_position >= 0.0 && std::isfinite(radians_per_position),
             "rope frequency: expected a finite, non-negative radians/position, got ",
             radians_per_position);
  const long double two_pi = 6.283185307179586476925286766559L;
  long double turns = static_cast<long double>(radians_per_position) / two_pi;
  turns -= std::floor(turns);  // whole turns per position do not change any angle
  const long double scaled = std::ldexp(turns, 64);
  // scaled < 2^64; split without overflowing uint64 near the top.
  const long double hi = std::floor(std::ldexp(scaled, -32));
  const long double lo = std::floor(scaled - std::ldexp(hi, 32) + 0.5L);
  RopeFrequency f;
  f.hi = static_cast<uint32_t>(hi);
  f.lo = lo >= 4294967296.0L ? 0xffffffffu : static_cast<uint32_t>(lo);
  return f;
}

// Angle in radians, in [-pi, pi), of position `pos` (>= 0) for fixed-point frequency `f`.
template <class Real>
CODA_HD Real rope_angle(int32_t pos, RopeFrequency f) {
  const uint32_t p = static_cast<uint32_t>(pos);
  if constexpr (sizeof(Real) >= 8) {
    const uint64_t t = (static_cast<uint64_t>(f.hi) << 32) | f.lo;
    const int64_t turns = static_cast<int64_t>(static_cast<uint64_t>(p) * t);  // mod 2^64
    return static_cast<Real>(turns) * static_cast<Real>(1.4629180792671596e-9 / 4294967296.0);
  } else {
#if defined(__CUDA_ARCH__)
    const uint32_t carry = __umulhi(p, f.lo);
#else
    const uint32_t carry = static_cast<uint32_t>((static_cast<uint64_t>(p) * f.lo) >> 32);
#endif
    const int32_t turns = static_cast<int32_t>(p * f.hi + carry);    // mod 2^32
    return static_cast<Real>(turns) * Real(1.4629180792671596e-9f);  // 2pi / 2^32
  }
}

template <class Real>
CODA_HD void rope_cos_sin(int32_t pos, RopeFrequency f, Real& cos_a, Real& sin_a) {
  const Real angle = rope_angle<Real>(pos, f);
#if defined(__CUDA_ARCH__)
  if constexpr (sizeof(Real) == 4) {
    __sincosf(angle, &sin_a, &cos_a);  // |angle| <= pi: abs error ~2^-21.4
    return;
  }
#endif
  using std::cos;
  using std::sin;
  cos_a = cos(angle);
  sin_a = sin(angle);
}

// Geometry of a packed QKV row: [Q heads | K heads | V heads], each head `head_dim` wide, RoPE
// pairs adjacent (2i, 2i+1) inside a head.
struct QkvLayout {
  int n_heads = 0, n_kv_heads = 0, head_dim = 0;

  int q_width() const { return n_heads * head_dim; }
  int kv_width() const { return n_kv_heads * head_dim; }
  int width() const { return q_width() + 2 * kv_width(); }
  void validate() const {
    CODA_CHECK(n_heads > 0 && n_kv_heads > 0 && head_dim > 0,
               "qkv layout: heads and head_dim must be positive, got n_heads=", n_heads,
               " n_kv_heads=", n_kv_heads, " head_dim=", head_dim);
    CODA_CHECK(n_heads % n_kv_heads == 0, "qkv layout: n_heads (", n_heads,
               ") must be a multiple of n_kv_heads (", n_kv_heads, ")");
    CODA_CHECK(head_dim % 2 == 0, "qkv layout: head_dim must be even, got ", head_dim);
  }
};

// QK-norm (Qwen3): an RMSNorm over each Q and K head of F3's output, before RoPE, with one
// head_dim-wide weight for all Q heads and one for all K heads.
struct QkNorm {
  QkvLayout layout;
  double eps = 1e-6;

  void validate(const char* who) const {
    layout.validate();
    CODA_CHECK(eps >= 0 && std::isfinite(eps), who,
               ": the QK-norm eps must be finite and >= 0, got ", eps);
  }
  // Which norm weight column n of the packed QKV row uses: 0 (Q), 1 (K) or 2 (V: none).
  int kind(int64_t n) const {
    const int64_t head = n / layout.head_dim;
    return head < layout.n_heads ? 0 : head < layout.n_heads + layout.n_kv_heads ? 1 : 2;
  }
  int64_t normed_width() const { return layout.q_width() + layout.kv_width(); }
};

// Per-column fixed-point frequencies for a packed QKV output of width layout.width():
// column n of a Q or K head with in-head index j gets inv_freq[j / 2]; V columns get 0.
inline std::vector<RopeFrequency> rope_column_table(const QkvLayout& layout,
                                                    const std::vector<double>& inv_freq) {
  layout.validate();
  CODA_CHECK(static_cast<int>(inv_freq.size()) == layout.head_dim / 2,
             "rope table: inv_freq must have head_dim/2 = ", layout.head_dim / 2, " entries, got ",
             inv_freq.size());
  std::vector<RopeFrequency> per_pair(inv_freq.size());
  for (size_t i = 0; i < inv_freq.size(); ++i)
    per_pair[i] = rope_frequency_from_radians(inv_freq[i]);
  std::vector<RopeFrequency> table(layout.width());
  const int rotated = layout.q_width() + layout.kv_width();
  for (int n = 0; n < rotated; ++n) table[n] = per_pair[(n % layout.head_dim) / 2];
  return table;
}

// LLaMA-style inverse frequencies theta^(-2i/d), optionally with LLaMA-3.1 scaling.
struct RopeScaling {
  bool enabled = false;
  double factor = 8.0, low_freq_factor = 1.0, high_freq_factor = 4.0;
  int original_max_position = 8192;
};

inline std::vector<double> rope_inv_freq(int head_dim, double theta, const RopeScaling& s = {}) {
  CODA_CHECK(head_dim > 0 && head_dim % 2 == 0,
             "rope_inv_freq: head_dim must be positive and even, got ", head_dim);
  CODA_CHECK(theta > 1.0, "rope_inv_freq: theta must be > 1, got ", theta);
  std::vector<double> f(head_dim / 2);
  const double pi = 3.14159265358979323846;
  for (int i = 0; i < head_dim / 2; ++i) {
    double v = std::pow(theta, -2.0 * i / head_dim);
    if (s.enabled) {
      const double low_wavelen = s.original_max_position / s.low_freq_factor;
      const double high_wavelen = s.original_max_position / s.high_freq_factor;
      const double wavelen = 2 * pi / v;
      if (wavelen > low_wavelen) {
        v = v / s.factor;
      } else if (wavelen >= high_wavelen) {
        const double smooth = (s.original_max_position / wavelen - s.low_freq_factor) /
                              (s.high_freq_factor - s.low_freq_factor);
        v = (1 - smooth) * v / s.factor + smooth * v;
      }
    }
    f[i] = v;
  }
  return f;
}

}  // namespace coda::programs
