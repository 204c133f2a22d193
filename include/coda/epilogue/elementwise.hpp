#pragma once
// Primitive 1 of 5: elementwise and pairwise maps on accumulator values.
//
// The functors here are the one definition of every per-element formula; the CPU reference executor
// and the Hopper epilogue nodes both call them. Pairwise maps act on adjacent columns (2j, 2j+1):
// the sm90 wgmma accumulator gives each thread both columns of a pair (tests/gpu checks this on the
// device), so SwiGLU and RoPE never leave the thread.

#include <cmath>
#include <cstdint>

#include "coda/common/host_device.hpp"

namespace coda::epilogue {

// exp with the GPU's fast path for fp32 (a multiply and one MUFU.EX2, denormal results flushed to
// zero: the epilogue rounds to bf16 or sums into fp32 partials, where they do not matter); exact
// libm on the host.
template <class T>
CODA_HD T exp_approx(T x) {
#if defined(__CUDA_ARCH__)
  if constexpr (sizeof(T) == 4) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x * 1.4426950408889634f));
    return y;
  }
#endif
  using std::exp;
  return exp(x);
}

// 1 / x with the GPU's approximate reciprocal for fp32 (one MUFU.RCP, within 1 ulp): the correctly
// rounded forms (IEEE division, __frcp_rn) add a Newton step and a slow-path branch per element.
template <class T>
CODA_HD T reciprocal(T x) {
#if defined(__CUDA_ARCH__)
  if constexpr (sizeof(T) == 4) {
    float y;
    asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
  }
#endif
  return T(1) / x;
}

// 1 / sqrt(x): the GPU's rsqrt for fp32 (MUFU.RSQ, within 2 ulp), exact on the host.
template <class T>
CODA_HD T rsqrt_approx(T x) {
#if defined(__CUDA_ARCH__)
  if constexpr (sizeof(T) == 4) return rsqrtf(x);
#endif
  using std::sqrt;
  return T(1) / sqrt(x);
}

template <class T>
CODA_HD T sigmoid(T x) {
  return reciprocal(T(1) + exp_approx(-x));
}

template <class T>
CODA_HD T silu(T x) {
  return x * sigmoid(x);
}

// --- 1 -> 1 maps -------------------------------------------------------------------------------

struct Plus {
  template <class T>
  CODA_HD T operator()(T a, T b) const {
    return a + b;
  }
};

struct Multiplies {
  template <class T>
  CODA_HD T operator()(T a, T b) const {
    return a * b;
  }
};

struct Square {
  template <class T>
  CODA_HD T operator()(T a) const {
    return a * a;
  }
};

// --- 2 -> 1: SwiGLU on an interleaved (gate, up) pair: a = silu(g) * u -------------------------
struct SwiGlu {
  template <class T>
  CODA_HD T operator()(T g, T u) const {
    return silu(g) * u;
  }
};

// --- 1 -> 2: SwiGLU backward. With s = sigmoid(g): du = da * silu(g),
//     dg = da * u * silu'(g), silu'(g) = s * (1 + g * (1 - s)) = s + silu(g) * (1 - s) (the second
//     form reuses silu(g): one multiply fewer per pair). Also returns a = silu(g) * u (recomputed,
//     for dW_down).
struct SwiGluBackward {
  template <class T>
  CODA_HD void operator()(T g, T u, T da, T& dg, T& du, T& a) const {
    const T s = sigmoid(g);
    const T silu_g = g * s;
    du = da * silu_g;
    dg = da * u * (s + silu_g * (T(1) - s));
    a = silu_g * u;
  }
};

// --- 2 -> 2: RoPE on an adjacent pair (complex multiply by e^{+i angle}) ------------------------
struct RopeRotate {
  template <class T>
  CODA_HD void operator()(T x0, T x1, T cos_a, T sin_a, T& y0, T& y1) const {
    y0 = x0 * cos_a - x1 * sin_a;
    y1 = x0 * sin_a + x1 * cos_a;
  }
};

// The transpose (rotation by -angle), for the backward pass: R is orthogonal, so dx = R^T dy.
struct RopeRotateTranspose {
  template <class T>
  CODA_HD void operator()(T dy0, T dy1, T cos_a, T sin_a, T& dx0, T& dx1) const {
    dx0 = dy0 * cos_a + dy1 * sin_a;
    dx1 = -dy0 * sin_a + dy1 * cos_a;
  }
};

// Applies `f(x[2j], x[2j+1])` to every adjacent pair of a register fragment of N elements, in
// place. N is a compile-time constant so the loop unrolls and the fragment stays in registers.
template <int N, class T, class F>
CODA_HD void for_each_pair(T* fragment, F&& f) {
  static_assert(N % 2 == 0, "pairwise maps need an even fragment");
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
  for (int j = 0; j < N / 2; ++j) f(j, fragment[2 * j], fragment[2 * j + 1]);
}

}  // namespace coda::epilogue
