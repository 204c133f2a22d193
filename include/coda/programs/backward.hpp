#pragma once
// Backward programs B1-B4 and aux A3 of docs/math.md.
//
// The identity that keeps RMSNorm backward tile-local: with n = x·r, y = n ⊙ γ the normalized input
// of a consumer z = r ⊙ (h · Wᵀ), and g = dz · W,
//     dx = r · (g ⊙ γ − n · ZdZ),   ZdZ[m] = ⟨g ⊙ γ, n⟩ / H = Σ_j dz[m,j] · z[m,j] / H,
// so ZdZ is reduced by whichever epilogue produced dz (B2, B3, B4) and folded by A3.

#include <cmath>
#include <cstdint>
#include <vector>

#include "coda/programs/formulas.hpp"
#include "coda/programs/forward.hpp"

namespace coda::programs {

// B1 (RMSNorm backward, in the epilogue of g = dz · W):
//   n = x·r;  dx += r·(g·γ − n·ZdZ);  h_out = n ⊙ γ;  dγ[n, t] = Σ_{m in tile t} g·n
template <class Real>
struct RmsnormBackward : NoSubtileHooks {
  TileIn<Real> x;        // (M, H) saved residual stream
  VectorIn<Real> r;      // (M)
  VectorIn<Real> gamma;  // (H)
  VectorIn<Real> zdz;    // (M) folded ZdZ (already divided by H)
  TileOut<Real> dx;      // (M, H), usually StoreMode::kAccumulate into the residual grad
  TileOut<Real> h_out;   // (M, H) recomputed normalized input, for the weight gradient
  Real* dgamma_partials = nullptr;
  PartialLayout layout;  // per_column(M, H, tile_m, tile_n)

  std::vector<Real> col_acc;

  void validate(int64_t M, int64_t N, const TileConfig& cfg) const {
    const char* who = "gemm_rmsnorm_backward";
    x.require(who, "x", M, N);
    r.require(who, "r", M);
    gamma.require(who, "gamma", N);
    zdz.require(who, "zdz", M);
    dx.require(who, "dx", M, N);
    h_out.require(who, "h_out", M, N);
    layout.require(who, "dgamma_partials", dgamma_partials,
                   PartialLayout::per_column(M, N, cfg.tile_m, cfg.tile_n));
  }
  void begin_tile(const TileInfo& t) { col_acc.assign(t.cols, Real(0)); }
  void visit(const TileInfo& t, int64_t m, int64_t n, Real g0, Real g1) {
    const Real g[2] = {g0, g1};
    const Real rm = r.load(m), zm = zdz.load(m);
    for (int c = 0; c < 2; ++c) {
      const Real xv = x.load(m, n + c), gam = gamma.load(n + c);
      // dres enters through the store (StoreMode::kAccumulate into it), or not at all.
      dx.store(m, n + c, RmsnormBackwardDx{}(g[c], Real(0), xv, rm, gam, zm));
      h_out.store(m, n + c, NormalizedScaled{}(xv, rm, gam));
      col_acc[n + c - t.n0] += GradTimesNormalized{}(g[c], xv, rm);
    }
  }
  void end_tile(const TileInfo& t) {
    for (int64_t j = 0; j < t.cols; ++j)
      dgamma_partials[layout.index(t.n0 + j, t.tile_m_index)] = col_acc[j];
  }
};

// B2 (SwiGLU backward, in the epilogue of da = dx_out · W_down), (g, u) the saved pair of z:
//   du = da·silu(g);  dg = da·u·σ(g)·(1 + g·(1 − σ(g)));  a = silu(g)·u;  ZdZ_t += g·dg + u·du
// Output column n of da owns the interleaved pair (2n, 2n+1) of z and dz.
template <class Real>
struct SwigluBackward : RowSums<Real> {  // partials: Σ (g·dg + u·du), not yet / H
  TileIn<Real> z;    // (M, 2I) saved pre-activation, interleaved
  TileOut<Real> dz;  // (M, 2I) interleaved
  TileOut<Real> a;   // (M, I) recomputed activation, for dW_down

  void validate(int64_t M, int64_t N, const TileConfig& cfg) const {
    const char* who = "gemm_swiglu_backward";
    z.require(who, "z", M, 2 * N);
    dz.require(who, "dz", M, 2 * N);
    a.require(who, "a", M, N);
    this->require_partials(who, "zdz_partials", M, N, cfg);
  }
  void visit(const TileInfo& t, int64_t m, int64_t n, Real da0, Real da1) {
    const Real da[2] = {da0, da1};
    for (int c = 0; c < 2; ++c) {
      const int64_t col = n + c;
      const Real g = z.load(m, 2 * col), u = z.load(m, 2 * col + 1);
      Real dg, du, av;
      epilogue::SwiGluBackward{}(g, u, da[c], dg, du, av);
      dz.store(m, 2 * col, dg);
      dz.store(m, 2 * col + 1, du);
      a.store(m, col, av);
      this->add(t, m, PairDot{}(g, u, dg, du));
    }
  }
};

// B3 (RoPE backward, elementwise over the packed QKV gradient):
//   dz = Rᵀ·dy (rotate by −θ; V columns pass through);
//   ZdZ[m] += Σ_n (z + b)·dz − b·dz = Σ_n y·dy − b·dz  (R orthogonal; z + b = Rᵀ·y, b the
//   optional bias F3 added to z, empty for none)
// Returns the per-row sums (not yet / H) in `zdz_sum`.
template <class Real>
void rope_backward(const TileIn<Real>& y, const TileIn<Real>& dy, const VectorIn<Real>& bias,
                   const VectorIn<int32_t>& pos, const VectorIn<RopeFrequency>& freq,
                   const TileOut<Real>& dz, Real* zdz_sum) {
  CODA_CHECK(y.data && dy.data && dz.data && zdz_sum, "rope_backward: null pointer argument");
  if (bias.data) bias.require("rope_backward", "bias", y.cols);
  CODA_CHECK(y.rows == dy.rows && y.cols == dy.cols, "rope_backward: y is (", y.rows, ", ", y.cols,
             ") but dy is (", dy.rows, ", ", dy.cols, ")");
  CODA_CHECK(freq.size == y.cols, "rope_backward: freq has ", freq.size, " entries, expected ",
             y.cols);
  CODA_CHECK(y.cols % 2 == 0, "rope_backward: width must be even, got ", y.cols);
  for (int64_t m = 0; m < y.rows; ++m) {
    Real s = 0;
    for (int64_t n = 0; n < y.cols; n += 2) {
      Real c, sn, d0, d1;
      rope_cos_sin<Real>(pos.load(m), freq.load(n), c, sn);
      const Real dy0 = dy.load(m, n), dy1 = dy.load(m, n + 1);
      epilogue::RopeRotateTranspose{}(dy0, dy1, c, sn, d0, d1);
      dz.store(m, n, d0);
      dz.store(m, n + 1, d1);
      s += PairDot{}(y.load(m, n), y.load(m, n + 1), dy0, dy1);
      if (bias.data) s -= PairDot{}(bias.load(n), bias.load(n + 1), d0, d1);
    }
    zdz_sum[m] = s;
  }
}

// B3 with QK-norm (Qwen3), per row, from u = qk_pre (r·acc on the Q and K columns, F3's saved
// pre-norm values) and dy = dqkv; on each Q and K head
//   s = rsqrt(mean u² + eps),  n = u·s,  dy' = Rᵀ·dy,  dγ_head += dy' ⊙ n,
//   dn = γ_head ⊙ dy',  dz = du = s·(dn − n·mean(dn ⊙ n));
// on V columns dz = dy. ZdZ[m] = Σ_n z·dz with z = u (Q, K) and z = qkv (V), not yet / H, in
// `zdz_sum`; dq_gamma, dk_gamma (head_dim each) are overwritten with the sums over rows and heads.
template <class Real>
void qk_norm_rope_backward(const TileIn<Real>& qk_pre, const TileIn<Real>& qkv,
                           const TileIn<Real>& dy, const VectorIn<Real>& q_gamma,
                           const VectorIn<Real>& k_gamma, const QkNorm& qk,
                           const VectorIn<int32_t>& pos, const VectorIn<RopeFrequency>& freq,
                           const TileOut<Real>& dz, Real* zdz_sum, Real* dq_gamma, Real* dk_gamma) {
  const char* who = "qk_norm_rope_backward";
  qk.validate(who);
  CODA_CHECK(qk_pre.data && qkv.data && dy.data && dz.data && zdz_sum && dq_gamma && dk_gamma, who,
             ": null pointer argument");
  const int64_t M = dy.rows, N = dy.cols, d = qk.layout.head_dim, normed = qk.normed_width();
  CODA_CHECK(N == qk.layout.width(), who, ": dqkv has ", N, " columns, the heads give ",
             qk.layout.width());
  CODA_CHECK(qk_pre.rows == M && qk_pre.cols == normed, who, ": qk_pre is (", qk_pre.rows, ", ",
             qk_pre.cols, "), expected (", M, ", ", normed, ")");
  CODA_CHECK(qkv.rows == M && qkv.cols == N, who, ": qkv is (", qkv.rows, ", ", qkv.cols,
             "), expected (", M, ", ", N, ")");
  q_gamma.require(who, "q_gamma", d);
  k_gamma.require(who, "k_gamma", d);
  pos.require(who, "pos", M);
  freq.require(who, "freq", N);
  for (int64_t j = 0; j < d; ++j) dq_gamma[j] = dk_gamma[j] = Real(0);
  std::vector<Real> dyr(d);  // one head's Rᵀ·dy
  for (int64_t m = 0; m < M; ++m) {
    Real zdz = 0;
    for (int64_t h0 = 0; h0 < N; h0 += d) {
      const int kind = qk.kind(h0);
      if (kind == 2) {
        for (int64_t n = h0; n < h0 + d; ++n) {
          dz.store(m, n, dy.load(m, n));
          zdz += qkv.load(m, n) * dy.load(m, n);
        }
        continue;
      }
      const VectorIn<Real>& g = kind == 0 ? q_gamma : k_gamma;
      Real* dg = kind == 0 ? dq_gamma : dk_gamma;
      Real sumsq = 0;
      for (int64_t j = 0; j < d; ++j) sumsq += epilogue::Square{}(qk_pre.load(m, h0 + j));
      const Real s = Rstd{}(sumsq, Real(1) / static_cast<Real>(d), static_cast<Real>(qk.eps));
      Real dn_n = 0;  // Σ dn ⊙ n over the head
      for (int64_t j = 0; j < d; j += 2) {
        Real c, sn;
        rope_cos_sin<Real>(pos.load(m), freq.load(h0 + j), c, sn);
        epilogue::RopeRotateTranspose{}(dy.load(m, h0 + j), dy.load(m, h0 + j + 1), c, sn, dyr[j],
                                        dyr[j + 1]);
        for (int64_t i = j; i < j + 2; ++i) {
          const Real n = qk_pre.load(m, h0 + i) * s;
          dg[i] += dyr[i] * n;
          dn_n += g.load(i) * dyr[i] * n;
        }
      }
      const Real mean_dn_n = dn_n / static_cast<Real>(d);
      for (int64_t j = 0; j < d; ++j) {
        const Real u = qk_pre.load(m, h0 + j);
        const Real du = s * (g.load(j) * dyr[j] - u * s * mean_dn_n);
        dz.store(m, h0 + j, du);
        zdz += u * du;
      }
    }
    zdz_sum[m] = zdz;
  }
}

// B4 (cross-entropy backward, in the epilogue of a recomputed ℓ = r·(h · W_vocabᵀ)):
//   p = exp(ℓ − lse);  dℓ = (p·(1 + 2λ·lse) − onehot(target)) · scale[m];  ZdZ_t += ℓ·dℓ
// scale[m] is the incoming loss gradient over the token count (mean) or 1 (sum); 0 for ignored
// tokens. Columns >= V get no gradient.
template <class Real, class Target = int64_t>
struct RmsnormCrossEntropyBackward : RowSums<Real> {  // partials: Σ ℓ·dℓ, not yet / H
  static constexpr bool kOddN = true;  // columns >= vocab (<= N) are skipped: any vocabulary
  VectorIn<Real> r, lse, scale;  // (M)
  VectorIn<Target> targets;      // (M)
  int64_t vocab = 0;
  double z_loss = 0.0;
  TileOut<Real> dlogits;  // (M, V)

  void validate(int64_t M, int64_t N, const TileConfig& cfg) const {
    const char* who = "gemm_rmsnorm_cross_entropy_backward";
    require_lm_head(who, vocab, M, N, r, targets);
    lse.require(who, "lse", M);
    scale.require(who, "scale", M);
    dlogits.require(who, "dlogits", M, vocab);
    this->require_partials(who, "zdz_partials", M, N, cfg);
  }
  void visit(const TileInfo& t, int64_t m, int64_t n, Real acc0, Real acc1) {
    const Real acc[2] = {acc0, acc1};
    const Real rm = r.load(m), lm = lse.load(m), sm = scale.load(m);
    const int64_t target = static_cast<int64_t>(targets.load(m));
    for (int c = 0; c < 2; ++c) {
      if (n + c >= vocab) continue;
      const Real l = acc[c] * rm;
      const Real d = CrossEntropyGrad{}(l, lm, sm, target == n + c, static_cast<Real>(z_loss));
      dlogits.store(m, n + c, d);
      this->add(t, m, l * d);
    }
  }
};

// A3: ZdZ[m] = Σ_t partial[m, t] / H;  dγ[n] = Σ_t partial[n, t]
template <class Real, class In>
std::vector<Real> fold_zdz(const In* partials, const PartialLayout& layout, int64_t hidden) {
  CODA_CHECK(hidden > 0, "fold_zdz: hidden must be positive, got ", hidden);
  auto v = epilogue::fold_partials<Real>(partials, layout, Real(0), epilogue::Plus{});
  for (auto& e : v) e /= static_cast<Real>(hidden);
  return v;
}

template <class Real, class In>
std::vector<Real> fold_dgamma(const In* partials, const PartialLayout& layout) {
  return epilogue::fold_partials<Real>(partials, layout, Real(0), epilogue::Plus{});
}

}  // namespace coda::programs
