#pragma once
// Per-element formulas of programs that are more than one primitive functor, kept free of host-only
// includes so the Hopper fusions (include/coda/kernel/fusions) and the CPU programs share them.

#include "coda/common/host_device.hpp"
#include "coda/epilogue/elementwise.hpp"

namespace coda::programs {

// r = 1 / sqrt(Σx² / H + eps): the reciprocal RMS from a row's sum of squares (A1, F0).
struct Rstd {
  template <class T>
  CODA_HD T operator()(T sum_squares, T inv_hidden, T eps) const {
    return epilogue::rsqrt_approx(sum_squares * inv_hidden + eps);
  }
};

// a0·b0 + a1·b1 for an adjacent pair: the ZdZ terms Σ dz·z of B2 (g·dg + u·du) and B3 (y·dy)
// and the cross-entropy's Σ ℓ·dℓ over a pair of logits.
struct PairDot {
  template <class T>
  CODA_HD T operator()(T a0, T a1, T b0, T b1) const {
    return a0 * b0 + a1 * b1;
  }
};

// A2's per-token loss lse − ℓ_target + z_loss·lse² (the caller masks ignored tokens).
struct TokenLoss {
  template <class T>
  CODA_HD T operator()(T lse, T target_logit, T z_loss) const {
    return lse - target_logit + z_loss * lse * lse;
  }
};

// B1's per-element formulas (both executors call these).
// dx = dres + r·(g·γ − n·ZdZ) with n = x·r: the RMSNorm input gradient added to the residual's.
struct RmsnormBackwardDx {
  template <class T>
  CODA_HD T operator()(T g, T dres, T x, T r, T gamma, T zdz) const {
    return dres + r * (g * gamma - x * r * zdz);
  }
};
// h_out = n ⊙ γ = x·r·γ (the normalized input, recomputed for the weight gradient).
struct NormalizedScaled {
  template <class T>
  CODA_HD T operator()(T x, T r, T gamma) const {
    return x * r * gamma;
  }
};
// dγ contribution g·n = g·(x·r), grouped as x·r so that the GPU epilogue computes x·r once for
// dx, h and dγ (without fast math the compiler may not regroup g·x·r itself).
struct GradTimesNormalized {
  template <class T>
  CODA_HD T operator()(T g, T x, T r) const {
    return g * (x * r);
  }
};

// B4: dℓ = (exp(ℓ − lse)·(1 + 2λ·lse) − [column == target]) · scale: the gradient of
// lse − ℓ_target + λ·lse² for one logit, times the per-token loss scale (0 for ignored tokens).
struct CrossEntropyGrad {
  template <class T>
  CODA_HD T operator()(T logit, T lse, T scale, bool is_target, T z_loss) const {
    const T p = epilogue::exp_approx(logit - lse) * (T(1) + T(2) * z_loss * lse);
    return (p - (is_target ? T(1) : T(0))) * scale;
  }
};

}  // namespace coda::programs
