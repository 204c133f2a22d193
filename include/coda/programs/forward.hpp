#pragma once
// Forward programs F0-F4 and aux A1-A2 of docs/math.md, as compositions of the five primitives.
//
// Each program below is the host composition the CPU reference executor runs; the Hopper executor
// builds the same composition from the same functors (include/coda/kernel/programs.hpp). Per-row
// partial buffers use PartialLayout::per_row with the tile size of the run.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "coda/common/check.hpp"
#include "coda/epilogue/elementwise.hpp"
#include "coda/epilogue/online_softmax.hpp"
#include "coda/epilogue/reduction.hpp"
#include "coda/epilogue/tile.hpp"
#include "coda/epilogue/vector.hpp"
#include "coda/programs/formulas.hpp"
#include "coda/programs/rope.hpp"
#include "coda/reference/executor.hpp"

namespace coda::programs {

using epilogue::OnlineMaxSumExp;
using epilogue::PartialLayout;
using epilogue::TileIn;
using epilogue::TileOut;
using epilogue::VectorIn;
using epilogue::VectorOut;
using reference::TileConfig;
using reference::TileInfo;

// Programs that keep no per-subtile state inherit these no-op hooks.
struct NoSubtileHooks {
  void end_subtile(const TileInfo&, int64_t, int64_t) {}
};

// The host twin of the device's per-row partial reduction: one sum per row over a tile's columns
// (in registers on the GPU), written at the tile's end into `partials`, PartialLayout::per_row.
template <class Real>
struct RowSums : NoSubtileHooks {
  Real* partials = nullptr;
  PartialLayout layout;  // per_row(M, N, tile_m, tile_n)
  std::vector<Real> row_acc;

  void require_partials(const char* who, const char* name, int64_t M, int64_t N,
                        const TileConfig& cfg) const {
    layout.require(who, name, partials, PartialLayout::per_row(M, N, cfg.tile_m, cfg.tile_n));
  }
  void begin_tile(const TileInfo& t) { row_acc.assign(t.rows, Real(0)); }
  void add(const TileInfo& t, int64_t m, Real v) { row_acc[m - t.m0] += v; }
  void end_tile(const TileInfo& t) {
    for (int64_t i = 0; i < t.rows; ++i)
      partials[layout.index(t.m0 + i, t.tile_n_index)] = row_acc[i];
  }
};

// F1 (out-proj, down-proj): x = acc + residual;  h = x ⊙ γ;  S[m, t] = Σ_{n in tile t} x²
template <class Real>
struct ResidualRmsnormPartial : RowSums<Real> {  // partials: Σx²
  TileIn<Real> residual;  // (M, N), may be empty (data == nullptr) for "no residual"
  VectorIn<Real> gamma;   // (N)
  TileOut<Real> x;        // (M, N) new residual stream
  TileOut<Real> h;        // (M, N) x ⊙ γ, the next GEMM's input

  void validate(int64_t M, int64_t N, const TileConfig& cfg) const {
    const char* who = "gemm_residual_rmsnorm_partial";
    if (residual.data) residual.require(who, "residual", M, N);
    gamma.require(who, "gamma", N);
    x.require(who, "x", M, N);
    h.require(who, "h", M, N);
    this->require_partials(who, "sumsq_partials", M, N, cfg);
  }
  void visit(const TileInfo& t, int64_t m, int64_t n, Real acc0, Real acc1) {
    const Real acc[2] = {acc0, acc1};
    for (int c = 0; c < 2; ++c) {
      const Real xv = residual.data ? epilogue::Plus{}(acc[c], residual.load(m, n + c)) : acc[c];
      x.store(m, n + c, xv);
      h.store(m, n + c, epilogue::Multiplies{}(xv, gamma.load(n + c)));
      this->add(t, m, epilogue::Square{}(xv));
    }
  }
};

// A1: r[m] = rsqrt(Σ_t S[m, t] / H + eps)
template <class Real, class In>
std::vector<Real> fold_rstd(const In* sumsq_partials, const PartialLayout& layout, int64_t hidden,
                            double eps) {
  CODA_CHECK(hidden > 0, "fold_rstd: hidden must be positive, got ", hidden);
  CODA_CHECK(eps >= 0, "fold_rstd: eps must be >= 0, got ", eps);
  std::vector<Real> r =
      epilogue::fold_partials<Real>(sumsq_partials, layout, Real(0), epilogue::Plus{});
  for (auto& v : r) v = Rstd{}(v, Real(1) / static_cast<Real>(hidden), static_cast<Real>(eps));
  return r;
}

// F0 (first layer, no GEMM before it): h = x ⊙ γ;  r[m] = rsqrt(mean_n x² + eps)
template <class Real>
void first_layer_rmsnorm(const TileIn<Real>& x, const VectorIn<Real>& gamma, double eps,
                         const TileOut<Real>& h, Real* r) {
  CODA_CHECK(x.data && h.data && r, "first_layer_rmsnorm: null pointer (x, h or r)");
  CODA_CHECK(gamma.size == x.cols, "first_layer_rmsnorm: gamma has ", gamma.size,
             " entries, expected H = ", x.cols);
  for (int64_t m = 0; m < x.rows; ++m) {
    Real s = 0;
    for (int64_t n = 0; n < x.cols; ++n) {
      const Real v = x.load(m, n);
      s += epilogue::Square{}(v);
      h.store(m, n, epilogue::Multiplies{}(v, gamma.load(n)));
    }
    r[m] = Rstd{}(s, Real(1) / static_cast<Real>(x.cols), static_cast<Real>(eps));
  }
}

// F2 (gate/up): z = r[m] · acc (interleaved g,u);  a = silu(z_g) · z_u  (half width)
template <class Real>
struct RmsnormSwiglu : NoSubtileHooks {
  VectorIn<Real> r;  // (M)
  TileOut<Real> z;   // (M, 2I) saved for backward
  TileOut<Real> a;   // (M, I)

  void validate(int64_t M, int64_t N, const TileConfig&) const {
    const char* who = "gemm_rmsnorm_swiglu";
    r.require(who, "r", M);
    z.require(who, "z", M, N);
    a.require(who, "a", M, N / 2);
  }
  void begin_tile(const TileInfo&) {}
  void visit(const TileInfo&, int64_t m, int64_t n, Real acc0, Real acc1) {
    const Real rm = r.load(m);
    const Real g = acc0 * rm, u = acc1 * rm;
    z.store(m, n, g);
    z.store(m, n + 1, u);
    a.store_half(m, n, epilogue::SwiGlu{}(g, u));
  }
  void end_tile(const TileInfo&) {}
};

// F3 (QKV): z = r[m] · acc + b[n];  q, k = rope(z, pos[m], freq[n]);  v = z  (freq = 0 on V
// columns; b the optional q/k/v bias of Qwen2-style attention, b = 0 without it)
template <class Real>
struct RmsnormRope : NoSubtileHooks {
  VectorIn<Real> r;              // (M)
  VectorIn<Real> bias;           // (N), may be empty (data == nullptr) for "no bias"
  VectorIn<int32_t> pos;         // (M)
  VectorIn<RopeFrequency> freq;  // (N), rope_column_table
  TileOut<Real> qkv;             // (M, N)

  void validate(int64_t M, int64_t N, const TileConfig&) const {
    const char* who = "gemm_rmsnorm_rope";
    r.require(who, "r", M);
    if (bias.data) bias.require(who, "bias", N);
    pos.require(who, "pos", M);
    freq.require(who, "freq", N);
    qkv.require(who, "qkv", M, N);
  }
  void begin_tile(const TileInfo&) {}
  void visit(const TileInfo&, int64_t m, int64_t n, Real acc0, Real acc1) {
    const Real rm = r.load(m);
    const Real b0 = bias.load(n), b1 = bias.load(n + 1);  // 0 without a bias (size 0)
    Real c, s, y0, y1;
    rope_cos_sin<Real>(pos.load(m), freq.load(n), c, s);
    epilogue::RopeRotate{}(acc0 * rm + b0, acc1 * rm + b1, c, s, y0, y1);
    qkv.store(m, n, y0);
    qkv.store(m, n + 1, y1);
  }
  void end_tile(const TileInfo&) {}
};

// F3 with QK-norm (Qwen3): u = r[m] · acc;  on each Q and K head
//   q = rope(γ_head ⊙ u · rsqrt(mean_head u² + eps), pos[m], freq[n]);  v = u.
// qk_pre = u over the Q and K columns, saved for the backward. A head's statistic needs the whole
// head inside one epilogue subtile, so subtile_n must be a multiple of head_dim (subtiles start
// at multiples of subtile_n: no head straddles two); each subtile's u is held until its end,
// as the device holds it in registers, and stored normalized.
template <class Real>
struct RmsnormQkNormRope {
  VectorIn<Real> r;                 // (M)
  VectorIn<Real> q_gamma, k_gamma;  // (head_dim) each
  QkNorm qk;
  VectorIn<int32_t> pos;         // (M)
  VectorIn<RopeFrequency> freq;  // (N), rope_column_table
  TileOut<Real> qkv;             // (M, N)
  TileOut<Real> qk_pre;          // (M, qk.normed_width())

  struct Pair {
    int64_t m, n;
    Real u0, u1;
  };
  std::vector<Pair> subtile;  // the current subtile's u
  std::vector<Real> sumsq;    // per (row of the subtile, head), keyed by row_key

  void validate(int64_t M, int64_t N, const TileConfig& cfg) const {
    const char* who = "gemm_rmsnorm_qk_norm_rope";
    qk.validate(who);
    CODA_CHECK(N == qk.layout.width(), who, ": N = ", N, " but the heads give a QKV width of ",
               qk.layout.width());
    CODA_CHECK(cfg.subtile_n % qk.layout.head_dim == 0, who, ": the epilogue subtile's width (",
               cfg.subtile_n, ") must be a multiple of head_dim (", qk.layout.head_dim,
               ") so that every head lies in one subtile");
    r.require(who, "r", M);
    q_gamma.require(who, "q_gamma", qk.layout.head_dim);
    k_gamma.require(who, "k_gamma", qk.layout.head_dim);
    pos.require(who, "pos", M);
    freq.require(who, "freq", N);
    qkv.require(who, "qkv", M, N);
    qk_pre.require(who, "qk_pre", M, qk.normed_width());
  }
  void begin_tile(const TileInfo&) { subtile.clear(); }
  void visit(const TileInfo&, int64_t m, int64_t n, Real acc0, Real acc1) {
    const Real rm = r.load(m);
    subtile.push_back({m, n, acc0 * rm, acc1 * rm});
  }
  void end_subtile(const TileInfo&, int64_t, int64_t) {
    if (subtile.empty()) return;
    const int64_t d = qk.layout.head_dim, m0 = subtile.front().m, n0 = subtile.front().n / d * d;
    int64_t rows = 0, heads = 0;
    for (const Pair& p : subtile) {
      rows = std::max(rows, p.m - m0 + 1);
      heads = std::max(heads, (p.n - n0) / d + 1);
    }
    sumsq.assign(rows * heads, Real(0));
    const auto key = [&](const Pair& p) { return (p.m - m0) * heads + (p.n - n0) / d; };
    for (const Pair& p : subtile)
      sumsq[key(p)] += epilogue::Square{}(p.u0) + epilogue::Square{}(p.u1);
    for (const Pair& p : subtile) {
      const int kind = qk.kind(p.n);
      if (kind == 2) {  // V: no norm, no rotation
        qkv.store(p.m, p.n, p.u0);
        qkv.store(p.m, p.n + 1, p.u1);
        continue;
      }
      const Real s =
          Rstd{}(sumsq[key(p)], Real(1) / static_cast<Real>(d), static_cast<Real>(qk.eps));
      const VectorIn<Real>& g = kind == 0 ? q_gamma : k_gamma;
      const int64_t j = p.n % d;
      Real c, sn, y0, y1;
      rope_cos_sin<Real>(pos.load(p.m), freq.load(p.n), c, sn);
      epilogue::RopeRotate{}(g.load(j) * (p.u0 * s), g.load(j + 1) * (p.u1 * s), c, sn, y0, y1);
      qkv.store(p.m, p.n, y0);
      qkv.store(p.m, p.n + 1, y1);
      qk_pre.store(p.m, p.n, p.u0);
      qk_pre.store(p.m, p.n + 1, p.u1);
    }
    subtile.clear();
  }
  void end_tile(const TileInfo&) {}
};

// The arguments the LM head's programs (F4, B4) share: the vocabulary (columns >= V never count),
// the per-row r and targets.
template <class Real, class Target>
void require_lm_head(const char* who, int64_t vocab, int64_t M, int64_t N, const VectorIn<Real>& r,
                     const VectorIn<Target>& targets) {
  CODA_CHECK(vocab > 0 && vocab <= N, who, ": vocab must be in [1, N = ", N, "], got ", vocab);
  r.require(who, "r", M);
  targets.require(who, "targets", M);
}

// F4 (LM head): ℓ = r[m] · acc;  per-tile online (max, sumexp) over n < V;  pick ℓ[m, target[m]]
template <class Real, class Target = int64_t>
struct RmsnormLse {
  static constexpr bool kOddN = true;  // columns >= vocab (<= N) are skipped: any vocabulary
  VectorIn<Real> r;                 // (M)
  VectorIn<Target> targets;         // (M)
  int64_t vocab = 0;                // V: columns >= V never enter max or sum
  Real* max_partials = nullptr;     // per_row layout
  Real* sumexp_partials = nullptr;  // per_row layout
  PartialLayout layout;
  VectorOut<Real> target_logit;  // (M), written by the tile holding the target
  TileOut<Real> logits;          // optional (M, V)

  std::vector<OnlineMaxSumExp<Real>> state;

  void validate(int64_t M, int64_t N, const TileConfig& cfg) const {
    const char* who = "gemm_rmsnorm_lse";
    require_lm_head(who, vocab, M, N, r, targets);
    target_logit.require(who, "target_logit", M);
    const auto expect = PartialLayout::per_row(M, N, cfg.tile_m, cfg.tile_n);
    layout.require(who, "max_partials", max_partials, expect);
    layout.require(who, "sumexp_partials", sumexp_partials, expect);
    if (logits.data) logits.require(who, "logits", M, vocab);
  }
  void begin_tile(const TileInfo& t) { state.assign(t.rows, OnlineMaxSumExp<Real>::identity()); }
  void visit(const TileInfo& t, int64_t m, int64_t n, Real acc0, Real acc1) {
    const Real rm = r.load(m);
    const Real l[2] = {acc0 * rm, acc1 * rm};
    for (int c = 0; c < 2; ++c) {
      if (n + c >= vocab) continue;
      state[m - t.m0].add(l[c]);
      if (static_cast<int64_t>(targets.load(m)) == n + c) target_logit.store(m, l[c]);
      if (logits.data) logits.store(m, n + c, l[c]);
    }
  }
  void end_subtile(const TileInfo&, int64_t, int64_t) {}
  void end_tile(const TileInfo& t) {
    for (int64_t i = 0; i < t.rows; ++i) {
      max_partials[layout.index(t.m0 + i, t.tile_n_index)] = state[i].max;
      sumexp_partials[layout.index(t.m0 + i, t.tile_n_index)] = state[i].sum;
    }
  }
};

enum class Reduction : int { kMean = 0, kSum = 1, kNone = 2 };

struct CrossEntropyOptions {
  int64_t ignore_index = -100;
  Reduction reduction = Reduction::kMean;
  double z_loss = 0.0;  // adds z_loss * lse² per counted token
};

template <class Real>
struct LossResult {
  std::vector<Real> lse;         // (M)
  std::vector<Real> token_loss;  // (M), 0 for ignored tokens
  Real loss = 0;                 // reduced (mean: NaN if every token is ignored, like PyTorch)
  int64_t counted = 0;           // non-ignored tokens
};

// A2: lse = logsumexp over tiles of the partials;  loss = lse − ℓ_target (+ z·lse²), 0 if ignored
template <class Real, class In, class Target>
LossResult<Real> fold_lse_loss(const In* max_partials, const In* sumexp_partials,
                               const PartialLayout& layout, const Real* target_logit,
                               const Target* targets, int64_t vocab,
                               const CrossEntropyOptions& opt) {
  CODA_CHECK(max_partials && sumexp_partials && target_logit && targets,
             "fold_lse_loss: null pointer argument");
  LossResult<Real> out;
  out.lse.resize(layout.logical);
  out.token_loss.assign(layout.logical, Real(0));
  Real total = 0;
  for (int64_t m = 0; m < layout.logical; ++m) {
    OnlineMaxSumExp<Real> s;
    for (int64_t t = 0; t < layout.tiles; ++t)
      s = OnlineMaxSumExp<Real>::merge(s, {static_cast<Real>(max_partials[layout.index(m, t)]),
                                           static_cast<Real>(sumexp_partials[layout.index(m, t)])});
    out.lse[m] = s.logsumexp();
    const int64_t target = static_cast<int64_t>(targets[m]);
    if (target == opt.ignore_index) continue;
    CODA_CHECK(target >= 0 && target < vocab, "fold_lse_loss: targets[", m, "] = ", target,
               " is outside [0, ", vocab, ") and is not ignore_index (", opt.ignore_index, ")");
    const Real lse = out.lse[m];
    out.token_loss[m] = TokenLoss{}(lse, target_logit[m], static_cast<Real>(opt.z_loss));
    total += out.token_loss[m];
    ++out.counted;
  }
  out.loss = opt.reduction == Reduction::kMean
                 ? (out.counted ? total / static_cast<Real>(out.counted)
                                : std::numeric_limits<Real>::quiet_NaN())
                 : total;
  return out;
}

}  // namespace coda::programs
