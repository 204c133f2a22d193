#pragma once
// The reparameterized LLaMA decoder on the CPU: every memory-bound op runs as an epilogue program
// on the reference executor (OPS.md §4), forward and backward. This is the composition the GPU path
// follows; tests check it against an independent, unfused fp64 model (tests/support).
//
// Fused weight layouts: w_qkv packed [Q | K | V] with RoPE pairs adjacent; w_gu interleaved
// [g0, u0, g1, ...] (see programs/weight_layout.hpp for the converters).

#include <cstdint>
#include <vector>

#include "coda/programs/backward.hpp"
#include "coda/programs/forward.hpp"
#include "coda/reference/attention.hpp"
#include "coda/reference/executor.hpp"

namespace coda::reference {

struct LlamaShape {
  int hidden = 0, n_heads = 0, n_kv_heads = 0, head_dim = 0, intermediate = 0, vocab = 0;
  int n_layers = 0;
  int64_t batch = 0, seq = 0;
  double eps = 1e-5;

  int64_t tokens() const { return batch * seq; }
  programs::QkvLayout qkv() const { return {n_heads, n_kv_heads, head_dim}; }
  void validate() const {
    qkv().validate();
    CODA_CHECK(hidden > 0 && intermediate > 0 && vocab > 0 && n_layers > 0 && tokens() > 0,
               "llama shape: sizes must be positive (hidden ", hidden, ", intermediate ",
               intermediate, ", vocab ", vocab, ", layers ", n_layers, ", tokens ", tokens(), ")");
    CODA_CHECK(hidden % 2 == 0 && vocab % 2 == 0,
               "llama shape: hidden and vocab must be even (pairwise epilogues), got ", hidden,
               " and ", vocab);
  }
};

template <class Real>
struct FusedLayer {
  std::vector<Real> gamma_attn;  // (H)
  std::vector<Real> w_qkv;       // ((Hq + 2 Hkv) d, H)
  std::vector<Real> w_o;         // (H, Hq d)
  std::vector<Real> gamma_ffn;   // (H)
  std::vector<Real> w_gu;        // (2I, H) interleaved
  std::vector<Real> w_down;      // (H, I)
};

template <class Real>
struct FusedModel {
  std::vector<FusedLayer<Real>> layers;
  std::vector<Real> gamma_final;  // (H)
  std::vector<Real> w_vocab;      // (V, H)
  std::vector<double> inv_freq;   // (d/2) radians per position
};

template <class Real>
struct FusedGrads {
  std::vector<FusedLayer<Real>> layers;
  std::vector<Real> gamma_final, w_vocab;
  std::vector<Real> dx0;  // (M, H)
};

namespace detail {

template <class Real>
MatrixRef<Real> rows(const std::vector<Real>& v, int64_t r, int64_t c) {
  return MatrixRef<Real>::row_major(v.data(), r, c);
}
template <class Real>
epilogue::TileIn<Real> tile_in(const std::vector<Real>& v, int64_t r, int64_t c) {
  return {v.data(), r, c, c};
}
template <class Real>
epilogue::TileOut<Real> tile_out(std::vector<Real>& v, int64_t r, int64_t c,
                                 epilogue::StoreMode mode = epilogue::StoreMode::kOverwrite) {
  return {v.data(), r, c, c, mode};
}
template <class Real>
epilogue::VectorIn<Real> vec(const std::vector<Real>& v) {
  return {v.data(), static_cast<int64_t>(v.size())};
}

// dW (n_out, k_in) = dzᵀ · h with dz (M, n_out) and h (M, k_in).
template <class Real>
std::vector<Real> weight_grad(const std::vector<Real>& dz, const std::vector<Real>& h, int64_t m,
                              int64_t n_out, int64_t k_in) {
  return gemm<Real>(MatrixRef<Real>::transposed(dz.data(), n_out, m),
                    MatrixRef<Real>::transposed(h.data(), k_in, m));
}

// F1 + A1: x = a · wᵀ + residual, h = x ⊙ γ, r.
template <class Real>
void residual_rmsnorm(const std::vector<Real>& a, const std::vector<Real>& w, int64_t m, int64_t n,
                      int64_t k, const std::vector<Real>& residual, const std::vector<Real>& gamma,
                      double eps, const TileConfig& tiles, std::vector<Real>& x,
                      std::vector<Real>& h, std::vector<Real>& r) {
  programs::ResidualRmsnormPartial<Real> p;
  x.assign(m * n, Real(0));
  h.assign(m * n, Real(0));
  p.layout = epilogue::PartialLayout::per_row(m, n, tiles.tile_m, tiles.tile_n);
  std::vector<Real> partials(p.layout.elements(), Real(0));
  p.residual = tile_in(residual, m, n);
  p.gamma = vec(gamma);
  p.x = tile_out(x, m, n);
  p.h = tile_out(h, m, n);
  p.sumsq_partials = partials.data();
  execute<Real>(rows(a, m, k), rows(w, n, k), p, tiles);
  r = programs::fold_rstd<Real>(partials.data(), p.layout, n, eps);
}

// B1: g = dz · w (w is (n_out, H)); dx (+)= r (g γ − n ZdZ); returns h_out; accumulates dγ.
template <class Real>
std::vector<Real> rmsnorm_backward(const std::vector<Real>& dz, const std::vector<Real>& w,
                                   int64_t m, int64_t n_out, int64_t hidden,
                                   const std::vector<Real>& x, const std::vector<Real>& r,
                                   const std::vector<Real>& gamma, const std::vector<Real>& zdz,
                                   const TileConfig& tiles, std::vector<Real>& dx,
                                   epilogue::StoreMode mode, std::vector<Real>& dgamma) {
  programs::RmsnormBackward<Real> p;
  std::vector<Real> h_out(m * hidden, Real(0));
  if (mode == epilogue::StoreMode::kOverwrite) dx.assign(m * hidden, Real(0));
  p.layout = epilogue::PartialLayout::per_column(m, hidden, tiles.tile_m, tiles.tile_n);
  std::vector<Real> partials(p.layout.elements(), Real(0));
  p.x = tile_in(x, m, hidden);
  p.r = vec(r);
  p.gamma = vec(gamma);
  p.zdz = vec(zdz);
  p.dx = tile_out(dx, m, hidden, mode);
  p.h_out = tile_out(h_out, m, hidden);
  p.dgamma_partials = partials.data();
  execute<Real>(rows(dz, m, n_out), MatrixRef<Real>::transposed(w.data(), hidden, n_out), p, tiles);
  dgamma = programs::fold_dgamma<Real>(partials.data(), p.layout);
  return h_out;
}

}  // namespace detail

// Forward (and, with grads != nullptr, backward) of the whole decoder from x0 (M, H) to the loss.
template <class Real, class Target>
Real fused_llama_loss(const LlamaShape& s, const FusedModel<Real>& model,
                      const std::vector<Real>& x0, const std::vector<Target>& targets,
                      const programs::CrossEntropyOptions& ce, const TileConfig& tiles,
                      FusedGrads<Real>* grads) {
  using namespace detail;
  s.validate();
  tiles.validate();
  const int64_t M = s.tokens(), H = s.hidden, I = s.intermediate, V = s.vocab;
  const programs::QkvLayout ql = s.qkv();
  const int64_t W = ql.width(), Q = ql.q_width();
  CODA_CHECK(static_cast<int>(model.layers.size()) == s.n_layers, "fused_llama_loss: model has ",
             model.layers.size(), " layers, shape says ", s.n_layers);
  CODA_CHECK(x0.size() == static_cast<size_t>(M * H), "fused_llama_loss: x0 has ", x0.size(),
             " elements, expected (", M, ", ", H, ")");
  CODA_CHECK(targets.size() == static_cast<size_t>(M), "fused_llama_loss: targets has ",
             targets.size(), " entries, expected M = ", M);

  const auto freq = programs::rope_column_table(ql, model.inv_freq);
  std::vector<int32_t> pos(M);
  for (int64_t m = 0; m < M; ++m) pos[m] = static_cast<int32_t>(m % s.seq);
  const Attention<Real> attn{ql, s.batch, s.seq};

  struct Saved {  // per layer: what the backward programs consume
    std::vector<Real> x_in, r_in, qkv, y_attn, x1, r1, z;
  };
  std::vector<Saved> saved(s.n_layers);

  // F0: the first layer's input norm.
  std::vector<Real> x = x0, h(M * H), r(M);
  programs::first_layer_rmsnorm<Real>(tile_in(x0, M, H), vec(model.layers[0].gamma_attn), s.eps,
                                      tile_out(h, M, H), r.data());
  for (int l = 0; l < s.n_layers; ++l) {
    const auto& L = model.layers[l];
    Saved& sv = saved[l];
    sv.x_in = x;
    sv.r_in = r;
    // F3: qkv = rope(r ⊙ (h · W_qkvᵀ))
    sv.qkv.assign(M * W, Real(0));
    programs::RmsnormRope<Real> f3;
    f3.r = vec(r);
    f3.pos = {pos.data(), M};
    f3.freq = {freq.data(), W};
    f3.qkv = tile_out(sv.qkv, M, W);
    execute<Real>(rows(h, M, H), rows(L.w_qkv, W, H), f3, tiles);
    sv.y_attn = attn.forward(sv.qkv);
    // F1: x1 = y · W_oᵀ + x;  h1 = x1 ⊙ γ_ffn
    std::vector<Real> h1;
    residual_rmsnorm(sv.y_attn, L.w_o, M, H, Q, x, L.gamma_ffn, s.eps, tiles, sv.x1, h1, sv.r1);
    // F2: z = r1 ⊙ (h1 · W_guᵀ);  a = swiglu(z)
    sv.z.assign(M * 2 * I, Real(0));
    std::vector<Real> a(M * I, Real(0));
    programs::RmsnormSwiglu<Real> f2;
    f2.r = vec(sv.r1);
    f2.z = tile_out(sv.z, M, 2 * I);
    f2.a = tile_out(a, M, I);
    execute<Real>(rows(h1, M, H), rows(L.w_gu, 2 * I, H), f2, tiles);
    // F1: x2 = a · W_downᵀ + x1;  h2 = x2 ⊙ γ_next (next layer's attention norm, or the final norm)
    const auto& gamma_next =
        l + 1 < s.n_layers ? model.layers[l + 1].gamma_attn : model.gamma_final;
    residual_rmsnorm(a, L.w_down, M, H, I, sv.x1, gamma_next, s.eps, tiles, x, h, r);
  }

  // F4 + A2: LM head and cross-entropy, never materializing logits.
  programs::RmsnormLse<Real, Target> f4;
  f4.layout = epilogue::PartialLayout::per_row(M, V, tiles.tile_m, tiles.tile_n);
  std::vector<Real> pmax(f4.layout.elements()), psum(f4.layout.elements()),
      target_logit(M, Real(0));
  f4.r = vec(r);
  f4.targets = {targets.data(), M};
  f4.vocab = V;
  f4.max_partials = pmax.data();
  f4.sumexp_partials = psum.data();
  f4.target_logit = {target_logit.data(), M};
  execute<Real>(rows(h, M, H), rows(model.w_vocab, V, H), f4, tiles);
  const auto loss = programs::fold_lse_loss<Real>(pmax.data(), psum.data(), f4.layout,
                                                  target_logit.data(), targets.data(), V, ce);
  if (!grads) return loss.loss;

  // ---- backward ----
  grads->layers.assign(s.n_layers, {});
  // B4: dℓ recomputed from h in the LM head's epilogue, ZdZ of the final norm.
  const auto scale =
      programs::cross_entropy_scale<Real>(targets.data(), M, ce, Real(1), loss.counted);
  programs::RmsnormCrossEntropyBackward<Real, Target> b4;
  b4.layout = epilogue::PartialLayout::per_row(M, V, tiles.tile_m, tiles.tile_n);
  std::vector<Real> dlogits(M * V, Real(0)), zdz_partials(b4.layout.elements());
  b4.r = vec(r);
  b4.lse = vec(loss.lse);
  b4.scale = vec(scale);
  b4.targets = {targets.data(), M};
  b4.vocab = V;
  b4.z_loss = ce.z_loss;
  b4.dlogits = tile_out(dlogits, M, V);
  b4.zdz_partials = zdz_partials.data();
  execute<Real>(rows(h, M, H), rows(model.w_vocab, V, H), b4, tiles);
  auto zdz = programs::fold_zdz<Real>(zdz_partials.data(), b4.layout, H);
  // B1 (final norm): dx = r (g γ − n ZdZ), dW_vocab = dℓᵀ · h_out.
  std::vector<Real> dx;
  auto h_out = rmsnorm_backward(dlogits, model.w_vocab, M, V, H, x, r, model.gamma_final, zdz,
                                tiles, dx, epilogue::StoreMode::kOverwrite, grads->gamma_final);
  grads->w_vocab = weight_grad(dlogits, h_out, M, V, H);

  for (int l = s.n_layers - 1; l >= 0; --l) {
    const auto& L = model.layers[l];
    const Saved& sv = saved[l];
    auto& G = grads->layers[l];
    // B2: da = dx2 · W_down → dz, a; dW_down = dx2ᵀ · a.
    programs::SwigluBackward<Real> b2;
    b2.layout = epilogue::PartialLayout::per_row(M, I, tiles.tile_m, tiles.tile_n);
    std::vector<Real> dz(M * 2 * I, Real(0)), a(M * I, Real(0)), p2(b2.layout.elements());
    b2.z = tile_in(sv.z, M, 2 * I);
    b2.dz = tile_out(dz, M, 2 * I);
    b2.a = tile_out(a, M, I);
    b2.zdz_partials = p2.data();
    execute<Real>(rows(dx, M, H), MatrixRef<Real>::transposed(L.w_down.data(), I, H), b2, tiles);
    G.w_down = weight_grad(dx, a, M, H, I);
    zdz = programs::fold_zdz<Real>(p2.data(), b2.layout, H);
    // B1 (FFN norm): dx1 = dx2 + r1 (g γ − n ZdZ) with g = dz · W_gu; dW_gu = dzᵀ · h_out.
    h_out = rmsnorm_backward(dz, L.w_gu, M, 2 * I, H, sv.x1, sv.r1, L.gamma_ffn, zdz, tiles, dx,
                             epilogue::StoreMode::kAccumulate, G.gamma_ffn);
    G.w_gu = weight_grad(dz, h_out, M, 2 * I, H);
    // Out-projection: dW_o = dx1ᵀ · y;  dy = dx1 · W_o.
    G.w_o = weight_grad(dx, sv.y_attn, M, H, Q);
    const auto dy = gemm<Real>(rows(dx, M, H), MatrixRef<Real>::transposed(L.w_o.data(), Q, H));
    // Attention, then B3: dz = Rᵀ dqkv, ZdZ = Σ y·dy / H.
    const auto dqkv = attn.backward(sv.qkv, dy);
    std::vector<Real> dqkv_pre(M * W, Real(0)), zsum(M);
    programs::rope_backward<Real>(tile_in(sv.qkv, M, W), tile_in(dqkv, M, W), {pos.data(), M},
                                  {freq.data(), W}, tile_out(dqkv_pre, M, W), zsum.data());
    for (auto& v : zsum) v /= static_cast<Real>(H);
    // B1 (attention norm): dx_in = dx1 + r (g γ − n ZdZ) with g = dqkv_pre · W_qkv.
    h_out = rmsnorm_backward(dqkv_pre, L.w_qkv, M, W, H, sv.x_in, sv.r_in, L.gamma_attn, zsum,
                             tiles, dx, epilogue::StoreMode::kAccumulate, G.gamma_attn);
    G.w_qkv = weight_grad(dqkv_pre, h_out, M, W, H);
  }
  grads->dx0 = dx;
  return loss.loss;
}

}  // namespace coda::reference
