#pragma once
// The CPU backend of the block compositions (block/compose.hpp): every program and fold of
// ops.hpp run on the reference executor in Real (float or double), over the same per-tile
// partial buffers the GPU writes (for the tile configuration `tiles`).
//   HostPrograms<Derived, Real>  the programs, for any tensor type whose memory Derived::view
//                                exposes as a View (torch/backends.hpp reuses it for at::Tensor);
//   HostBackend<Real>            HostPrograms over HostTensor, the reference decoder's backend.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <vector>

#include "coda/block/compose.hpp"
#include "coda/common/check.hpp"
#include "coda/programs/backward.hpp"
#include "coda/programs/forward.hpp"
#include "coda/programs/rope.hpp"
#include "coda/reference/executor.hpp"

namespace coda::reference {

// Row-major memory of a 1-D (cols = 1) or 2-D tensor.
template <class E>
struct View {
  E* data = nullptr;
  int64_t rows = 0, cols = 1, ld = 1;

  epilogue::TileIn<E> in() const { return {data, rows, cols, ld}; }
  epilogue::TileOut<E> out(epilogue::StoreMode mode = epilogue::StoreMode::kOverwrite) const {
    return {data, rows, cols, ld, mode};
  }
  epilogue::VectorIn<E> vec() const { return {data, rows * cols}; }
  MatrixRef<E> matrix() const { return {data, rows, cols, ld, 1}; }
  // The transpose, without a copy.
  MatrixRef<E> transposed() const { return {data, cols, rows, 1, ld}; }
  E& at(int64_t i, int64_t j) const { return data[i * ld + j]; }
};

template <class Derived, class Real>
class HostPrograms {
 public:
  TileConfig tiles;  // the CTA tile the programs and their partial buffers use

  // ---- partial buffers: (tiles, extent) --------------------------------------------------------
  auto partials(block::PartialsOf of, int64_t m, int64_t n, int64_t) {
    const auto l = of == block::PartialsOf::kRmsnormBackward
                       ? epilogue::PartialLayout::per_column(m, n, tiles.tile_m, tiles.tile_n)
                       : epilogue::PartialLayout::per_row(m, n, tiles.tile_m, tiles.tile_n);
    return self().zeros_stat(l.tiles, l.extent);
  }

  // ---- plain GEMMs -----------------------------------------------------------------------------
  void gemm(const auto& x, const auto& w, auto& d) {  // d = x · wᵀ
    store(reference::gemm<Real>(v(x).matrix(), v(w).matrix()), v(d));
  }
  void gemm_xw(const auto& x, const auto& w, auto& d) {  // d = x · w
    store(reference::gemm<Real>(v(x).matrix(), v(w).transposed()), v(d));
  }
  void weight_grad(const auto& dz, const auto& h, auto& dw, bool accumulate) {  // dw (+)= dzᵀ·h
    const auto g = reference::gemm<Real>(v(dz).transposed(), v(h).transposed());
    const View<Real> o = v(dw);
    for (int64_t i = 0; i < o.rows; ++i)
      for (int64_t j = 0; j < o.cols; ++j)
        o.at(i, j) = (accumulate ? o.at(i, j) : Real(0)) + g[i * o.cols + j];
  }

  // ---- forward ---------------------------------------------------------------------------------
  void first_layer_rmsnorm(const auto& x, const auto& gamma, double eps, auto& h, auto& r) {
    programs::first_layer_rmsnorm<Real>(v(x).in(), v(gamma).vec(), eps, v(h).out(), v(r).data);
  }
  void gemm_residual_rmsnorm_partial(const auto& a, const auto& w, const auto& residual,
                                     const auto& gamma, auto& x, auto& h, const auto& s) {
    programs::ResidualRmsnormPartial<Real> p;
    p.residual = v(residual).in();
    p.gamma = v(gamma).vec();
    p.x = v(x).out();
    p.h = v(h).out();
    use_partials(p, s, v(x).rows);
    execute<Real>(v(a).matrix(), v(w).matrix(), p, tiles);
  }
  void rmsnorm_fold(const auto& s, int64_t hidden, double eps, auto& r) {
    const View<Real> out = v(r);
    copy(programs::fold_rstd<Real>(v(s).data, layout(s, out.rows), hidden, eps), out);
  }
  void gemm_rmsnorm_swiglu(const auto& h, const auto& w_gu, const auto& r, auto& z, auto& a) {
    programs::RmsnormSwiglu<Real> p;
    p.r = v(r).vec();
    p.z = v(z).out();
    p.a = v(a).out();
    execute<Real>(v(h).matrix(), v(w_gu).matrix(), p, tiles);
  }
  void gemm_rmsnorm_rope(const auto& h, const auto& w_qkv, const auto& r, const auto& bias,
                         const auto& pos, const auto& table, auto& qkv) {
    const auto freq = rope_columns(table);
    programs::RmsnormRope<Real> p;
    p.r = v(r).vec();
    p.bias = v(bias).vec();  // empty (size 0) without a bias
    p.pos = vi32(pos).vec();
    p.freq = {freq.data(), int64_t(freq.size())};
    p.qkv = v(qkv).out();
    execute<Real>(v(h).matrix(), v(w_qkv).matrix(), p, tiles);
  }
  // F3 with QK-norm, on this backend's tiles with one head-wide epilogue subtile per head group:
  // tile (tile_m, a multiple of head_dim), subtile (subtile_m, head_dim).
  void gemm_rmsnorm_qk_norm_rope(const auto& h, const auto& w_qkv, const auto& r,
                                 const auto& q_gamma, const auto& k_gamma,
                                 const programs::QkNorm& qk, const auto& pos, const auto& table,
                                 auto& qkv, auto& qk_pre) {
    const auto freq = rope_columns(table);
    programs::RmsnormQkNormRope<Real> p;
    p.r = v(r).vec();
    p.q_gamma = v(q_gamma).vec();
    p.k_gamma = v(k_gamma).vec();
    p.qk = qk;
    p.pos = vi32(pos).vec();
    p.freq = {freq.data(), int64_t(freq.size())};
    p.qkv = v(qkv).out();
    p.qk_pre = v(qk_pre).out();
    const int d = qk.layout.head_dim;
    TileConfig cfg = tiles;
    cfg.tile_n = d * std::max(1, tiles.tile_n / d);
    cfg.subtile_n = d;
    execute<Real>(v(h).matrix(), v(w_qkv).matrix(), p, cfg);
  }
  void gemm_rmsnorm_lse(const auto& h, const auto& w, const auto& r, const auto& targets,
                        const auto& pmax, const auto& psum, auto& target_logit) {
    lse_program(h, w, r, targets, pmax, psum, target_logit, nullptr);
  }
  void gemm_rmsnorm_lse_logits(const auto& h, const auto& w, const auto& r, const auto& targets,
                               const auto& pmax, const auto& psum, auto& target_logit,
                               auto& logits) {
    const View<Real> l = v(logits);
    lse_program(h, w, r, targets, pmax, psum, target_logit, &l);
  }
  // A2 (throws for a target that is neither ignored nor in [0, vocab): the host can check).
  void lse_loss_fold(const auto& pmax, const auto& psum, const auto& target_logit,
                     const auto& targets, int64_t vocab, int64_t ignore_index, double z_loss,
                     auto& lse, auto& token_loss) {
    programs::CrossEntropyOptions o;
    o.ignore_index = ignore_index;
    o.z_loss = z_loss;
    const View<Real> out = v(lse);
    const auto res =
        programs::fold_lse_loss<Real>(v(pmax).data, v(psum).data, layout(pmax, out.rows),
                                      v(target_logit).data, vi64(targets).data, vocab, o);
    copy(res.lse, out);
    copy(res.token_loss, v(token_loss));
  }
  // B4 in place on stored logits (the row kernel of the three-GEMM path).
  void cross_entropy_backward_from_logits(auto& logits, const auto& lse, const auto& scale,
                                          const auto& targets, const auto& target_logit,
                                          double z_loss, int64_t hidden, auto& zdz) {
    const View<Real> l = v(logits), e = v(lse), s = v(scale), tl = v(target_logit), zd = v(zdz);
    const View<int64_t> t = vi64(targets);
    for (int64_t m = 0; m < l.rows; ++m)
      zd.data[m] =
          grad_row(l, m, Real(1), e.data[m], s.data[m], t.data[m], tl.data[m], z_loss, hidden);
  }
  // A2 + B4 from the plain GEMM's logits s = h·Wᵀ (the three-GEMM path at hidden <= 2048).
  void cross_entropy_from_unscaled_logits(auto& logits, const auto& h, const auto& w, const auto& r,
                                          const auto& targets, int64_t ignore_index, double z_loss,
                                          const auto& scale, auto& lse, auto& token_loss,
                                          auto& zdz) {
    const View<Real> l = v(logits), hv = v(h), wv = v(w), rv = v(r), s = v(scale), e = v(lse),
                     tk = v(token_loss), zd = v(zdz);
    const View<int64_t> t = vi64(targets);
    for (int64_t m = 0; m < l.rows; ++m) {
      const int64_t target = t.data[m];
      const bool valid = target >= 0 && target < l.cols;
      Real dot = 0;
      for (int64_t k = 0; valid && k < hv.cols; ++k) dot += hv.at(m, k) * wv.at(target, k);
      const Real rm = rv.data[m], target_logit = rm * dot;
      epilogue::OnlineMaxSumExp<Real> st;
      for (int64_t n = 0; n < l.cols; ++n) st.add(n == target ? target_logit : rm * l.at(m, n));
      e.data[m] = st.logsumexp();
      CODA_CHECK(valid || target == ignore_index, "cross_entropy_from_unscaled_logits: targets[", m,
                 "] = ", target, " is outside [0, ", l.cols, ") and is not ignore_index (",
                 ignore_index, ")");
      tk.data[m] = valid && target != ignore_index
                       ? programs::TokenLoss{}(e.data[m], target_logit, Real(z_loss))
                       : Real(0);
      zd.data[m] = grad_row(l, m, rm, e.data[m], s.data[m], target, target_logit, z_loss, hv.cols);
    }
  }

  // ---- backward --------------------------------------------------------------------------------
  // B1: dx = dres + r·(g·γ − x·r·ZdZ) (dx may alias dres; an absent dres: no residual term).
  void gemm_rmsnorm_backward(const auto& dz, const auto& w, const auto& x, const auto& r,
                             const auto& gamma, const auto& zdz, const auto& dres, auto& dx,
                             auto& h_out, const auto& p) {
    const View<Real> out = v(dx), in = v(dres);
    const bool accumulate = in.data != nullptr;
    if (accumulate && out.data != in.data)
      for (int64_t i = 0; i < out.rows; ++i)
        for (int64_t j = 0; j < out.cols; ++j) out.at(i, j) = in.at(i, j);
    programs::RmsnormBackward<Real> b1;
    b1.x = v(x).in();
    b1.r = v(r).vec();
    b1.gamma = v(gamma).vec();
    b1.zdz = v(zdz).vec();
    b1.dx =
        out.out(accumulate ? epilogue::StoreMode::kAccumulate : epilogue::StoreMode::kOverwrite);
    b1.h_out = v(h_out).out();
    b1.dgamma_partials = v(p).data;
    b1.layout = layout(p, out.cols);
    execute<Real>(v(dz).matrix(), v(w).transposed(), b1, tiles);
  }
  void dgamma_fold(const auto& p, auto& dgamma) {
    const View<Real> out = v(dgamma);
    copy(programs::fold_dgamma<Real>(v(p).data, layout(p, out.rows)), out);
  }
  void gemm_swiglu_backward(const auto& dx_out, const auto& w_down, const auto& z, auto& dz,
                            auto& a, const auto& p) {
    programs::SwigluBackward<Real> b2;
    b2.z = v(z).in();
    b2.dz = v(dz).out();
    b2.a = v(a).out();
    use_partials(b2, p, v(a).rows);
    execute<Real>(v(dx_out).matrix(), v(w_down).transposed(), b2, tiles);
  }
  void zdz_fold(const auto& p, int64_t hidden, auto& zdz) {
    const View<Real> out = v(zdz);
    copy(programs::fold_zdz<Real>(v(p).data, layout(p, out.rows), hidden), out);
  }
  void rope_backward(const auto& qkv, const auto& dqkv, const auto& bias, const auto& pos,
                     const auto& table, int64_t hidden, auto& dpre, auto& zdz) {
    const auto freq = rope_columns(table);
    const View<Real> out = v(zdz);
    programs::rope_backward<Real>(v(qkv).in(), v(dqkv).in(), v(bias).vec(), vi32(pos).vec(),
                                  {freq.data(), int64_t(freq.size())}, v(dpre).out(), out.data);
    for (int64_t m = 0; m < out.rows; ++m) out.data[m] /= static_cast<Real>(hidden);
  }
  void qk_norm_rope_backward(const auto& qk_pre, const auto& qkv, const auto& dqkv,
                             const auto& q_gamma, const auto& k_gamma, const programs::QkNorm& qk,
                             const auto& pos, const auto& table, int64_t hidden, auto& dpre,
                             auto& zdz, auto& dq_gamma, auto& dk_gamma) {
    const auto freq = rope_columns(table);
    const View<Real> out = v(zdz);
    programs::qk_norm_rope_backward<Real>(v(qk_pre).in(), v(qkv).in(), v(dqkv).in(),
                                          v(q_gamma).vec(), v(k_gamma).vec(), qk, vi32(pos).vec(),
                                          {freq.data(), int64_t(freq.size())}, v(dpre).out(),
                                          out.data, v(dq_gamma).data, v(dk_gamma).data);
    for (int64_t m = 0; m < out.rows; ++m) out.data[m] /= static_cast<Real>(hidden);
  }
  // out[n] = Σ_m t[m, n] (a bias gradient), in Real.
  void column_sum(const auto& t, auto& out) {
    const View<Real> in = v(t), o = v(out);
    for (int64_t n = 0; n < in.cols; ++n) {
      Real s = 0;
      for (int64_t m = 0; m < in.rows; ++m) s += in.at(m, n);
      o.data[n] = s;
    }
  }
  void gemm_rmsnorm_cross_entropy_backward(const auto& h, const auto& w, const auto& r,
                                           const auto& lse, const auto& scale, const auto& targets,
                                           double z_loss, auto& dlogits, const auto& p) {
    programs::RmsnormCrossEntropyBackward<Real, int64_t> b4;
    b4.r = v(r).vec();
    b4.lse = v(lse).vec();
    b4.scale = v(scale).vec();
    b4.targets = vi64(targets).vec();
    b4.vocab = v(w).rows;
    b4.z_loss = z_loss;
    b4.dlogits = v(dlogits).out();
    use_partials(b4, p, v(h).rows);
    execute<Real>(v(h).matrix(), v(w).matrix(), b4, tiles);
  }

 private:
  Derived& self() { return static_cast<Derived&>(*this); }
  View<Real> v(const auto& t) { return self().template view<Real>(t); }
  View<int32_t> vi32(const auto& t) { return self().template view<int32_t>(t); }
  View<int64_t> vi64(const auto& t) { return self().template view<int64_t>(t); }

  // A row-sum program's partial buffer: `buf`, (tiles, extent), for `logical` rows.
  void use_partials(programs::RowSums<Real>& program, const auto& buf, int64_t logical) {
    program.partials = v(buf).data;
    program.layout = layout(buf, logical);
  }
  // A (tiles, extent) buffer's layout for `logical` rows (or columns).
  epilogue::PartialLayout layout(const auto& p, int64_t logical) {
    const View<Real> b = v(p);
    return {b.cols, b.rows, logical};
  }
  static void store(const std::vector<Real>& values, const View<Real>& out) {
    for (int64_t i = 0; i < out.rows; ++i)
      for (int64_t j = 0; j < out.cols; ++j) out.at(i, j) = values[i * out.cols + j];
  }
  static void copy(const std::vector<Real>& values, const View<Real>& out) {
    std::copy(values.begin(), values.end(), out.data);
  }
  // The (2, W) int32 table's columns: high words in row 0, low words in row 1.
  std::vector<programs::RopeFrequency> rope_columns(const auto& table) {
    const View<int32_t> t = vi32(table);
    std::vector<programs::RopeFrequency> f(t.cols);
    for (int64_t n = 0; n < t.cols; ++n)
      f[n] = {static_cast<uint32_t>(t.at(0, n)), static_cast<uint32_t>(t.at(1, n))};
    return f;
  }
  void lse_program(const auto& h, const auto& w, const auto& r, const auto& targets,
                   const auto& pmax, const auto& psum, auto& target_logit,
                   const View<Real>* logits) {
    programs::RmsnormLse<Real, int64_t> f4;
    f4.r = v(r).vec();
    f4.targets = vi64(targets).vec();
    f4.vocab = v(w).rows;
    f4.max_partials = v(pmax).data;
    f4.sumexp_partials = v(psum).data;
    f4.layout = layout(pmax, v(h).rows);
    const View<Real> tl = v(target_logit);
    f4.target_logit = {tl.data, tl.rows};
    if (logits) f4.logits = logits->out();
    execute<Real>(v(h).matrix(), v(w).matrix(), f4, tiles);
  }
  // One row of B4 in place: ℓ = row_scale·v (the target column: target_logit), dℓ over v;
  // returns Σ ℓ·dℓ / hidden.
  static Real grad_row(const View<Real>& l, int64_t m, Real row_scale, Real lse, Real scale,
                       int64_t target, Real target_logit, double z_loss, int64_t hidden) {
    Real s = 0;
    for (int64_t n = 0; n < l.cols; n += 2) {  // an odd vocabulary's last pair: (V − 1, 0)
      const bool pair = n + 1 < l.cols;
      const bool t0 = n == target, t1 = n + 1 == target;
      const Real l0 = t0 ? target_logit : row_scale * l.at(m, n);
      const Real l1 = !pair ? Real(0) : t1 ? target_logit : row_scale * l.at(m, n + 1);
      const programs::CrossEntropyGrad grad;
      const Real d0 = grad(l0, lse, scale, t0, Real(z_loss)),
                 d1 = pair ? grad(l1, lse, scale, t1, Real(z_loss)) : Real(0);
      s += programs::PairDot{}(l0, l1, d0, d1);
      l.at(m, n) = d0;
      if (pair) l.at(m, n + 1) = d1;
    }
    return s / static_cast<Real>(hidden);
  }
};

// A host tensor: shared storage and a row-major window on it (rows_of and leading share it).
template <class E>
struct HostTensor {
  std::shared_ptr<std::vector<E>> storage;
  int64_t offset = 0, rows = 0, cols = 1, ld = 1;

  static HostTensor zeros(int64_t rows, int64_t cols) {
    return {std::make_shared<std::vector<E>>(size_t(rows * cols), E(0)), 0, rows, cols, cols};
  }
  static HostTensor of(std::vector<E> values, int64_t rows, int64_t cols) {
    CODA_CHECK(int64_t(values.size()) == rows * cols, "HostTensor: ", values.size(),
               " values for (", rows, ", ", cols, ")");
    return {std::make_shared<std::vector<E>>(std::move(values)), 0, rows, cols, cols};
  }
  E* data() const { return storage ? storage->data() + offset : nullptr; }
  // The values, row by row (a copy).
  std::vector<E> values() const {
    std::vector<E> out(size_t(rows * cols));
    for (int64_t i = 0; i < rows; ++i)
      std::copy(data() + i * ld, data() + i * ld + cols, out.begin() + i * cols);
    return out;
  }
};

// The reference decoder's backend: HostPrograms over HostTensor<Real>.
template <class Real>
class HostBackend : public HostPrograms<HostBackend<Real>, Real> {
 public:
  using Tensor = HostTensor<Real>;
  explicit HostBackend(const TileConfig& t = {}) { this->tiles = t; }

  template <class E>
  static View<E> view(const HostTensor<E>& t) {
    return {t.data(), t.rows, t.cols, t.ld};
  }
  static int64_t rows(const auto& t) { return t.rows; }
  static int64_t cols(const auto& t) { return t.cols; }
  static bool present(const auto& t) { return t.storage != nullptr; }  // an optional argument
  static Tensor act(int64_t rows, int64_t cols) { return Tensor::zeros(rows, cols); }
  static Tensor stat(int64_t n) { return Tensor::zeros(n, 1); }
  static Tensor zeros_stat(int64_t n) { return Tensor::zeros(n, 1); }
  static Tensor zeros_stat(int64_t rows, int64_t cols) { return Tensor::zeros(rows, cols); }
  static int64_t act_bytes() { return sizeof(Real); }
  template <class E>
  static HostTensor<E> rows_of(const HostTensor<E>& t, int64_t first, int64_t count) {
    HostTensor<E> s = t;
    s.offset += first * t.ld;
    s.rows = count;
    return s;
  }
  static Tensor leading(const Tensor& t, int64_t rows, int64_t cols) {
    CODA_CHECK(rows * cols <= t.rows * t.ld, "leading: (", rows, ", ", cols,
               ") does not fit in the buffer");
    return {t.storage, t.offset, rows, cols, cols};
  }
  static void add_(Tensor& acc, const Tensor& v) {
    each(acc, v, [](Real& a, Real b) { a += b; });
  }
  static void copy_(Tensor& dst, const Tensor& src) {
    each(dst, src, [](Real& a, Real b) { a = b; });
  }
  static Tensor param_like(const Tensor& t, const Tensor&) { return t; }
  static HostTensor<int64_t> targets_minus(const HostTensor<int64_t>& t, int64_t v0) {
    std::vector<int64_t> s = t.values();
    for (auto& e : s) e -= v0;
    return HostTensor<int64_t>::of(std::move(s), t.rows, t.cols);
  }
  // d loss / d token loss per token: dloss (null: 1; one value, or one per token for 'none'),
  // divided by the counted tokens for 'mean', 0 for ignored tokens.
  static Tensor token_scale(const Tensor* dloss, const HostTensor<int64_t>& targets,
                            const block::LossOptions& o, int64_t m) {
    const bool per_token = o.ce.reduction == programs::Reduction::kNone;
    CODA_CHECK(targets.rows * targets.cols == m, "token_scale: targets has ",
               targets.rows * targets.cols, " entries, expected ", m);
    CODA_CHECK(!dloss || dloss->rows * dloss->cols == (per_token ? m : 1),
               "token_scale: dloss has ", dloss ? dloss->rows * dloss->cols : 0,
               " entries, expected ", per_token ? m : 1, " (reduction ",
               per_token ? "none: one per token" : "mean or sum: one", ")");
    const int64_t* t = targets.data();
    const int64_t counted =
        std::count_if(t, t + m, [&](int64_t v) { return v != o.ce.ignore_index; });
    Tensor s = stat(m);
    for (int64_t i = 0; i < m; ++i) {
      if (t[i] == o.ce.ignore_index) continue;
      const Real g = !dloss                                         ? Real(1)
                     : per_token ? dloss->data()[i]
                                 : dloss->data()[0];
      s.data()[i] = o.ce.reduction == programs::Reduction::kMean ? g / Real(counted) : g;
    }
    return s;
  }
  // The loss from per-token losses (0 where ignored): as is, summed, or the mean over counted
  // tokens (NaN when every token is ignored, as PyTorch).
  static Tensor reduce_loss(const Tensor& token_loss, const HostTensor<int64_t>& targets,
                            const block::LossOptions& o) {
    if (o.ce.reduction == programs::Reduction::kNone) return token_loss;
    const int64_t* t = targets.data();
    Real total = 0;
    int64_t counted = 0;
    for (int64_t i = 0; i < token_loss.rows; ++i) {
      total += token_loss.data()[i];
      counted += t[i] != o.ce.ignore_index;
    }
    Tensor l = stat(1);
    l.data()[0] = o.ce.reduction == programs::Reduction::kSum ? total
                  : counted                                   ? total / Real(counted)
                            : std::numeric_limits<Real>::quiet_NaN();
    return l;
  }

 private:
  template <class Fn>
  static void each(Tensor& a, const Tensor& b, Fn fn) {
    CODA_CHECK(a.rows == b.rows && a.cols == b.cols, "HostBackend: (", a.rows, ", ", a.cols,
               ") and (", b.rows, ", ", b.cols, ") differ");
    for (int64_t i = 0; i < a.rows; ++i)
      for (int64_t j = 0; j < a.cols; ++j) fn(a.data()[i * a.ld + j], b.data()[i * b.ld + j]);
  }
};

}  // namespace coda::reference
