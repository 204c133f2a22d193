#pragma once
// The reparameterized LLaMA decoder on the CPU: the block compositions of block/compose.hpp (the
// ones the PyTorch ops run on either device) on the reference executor, with reference attention
// between the blocks, forward and backward. Tests check it against an independent, unfused fp64
// model (tests/support).
//
// Fused weight layouts: w_qkv packed [Q | K | V] with RoPE pairs adjacent; w_gu interleaved
// [g0, u0, g1, ...] (see programs/weight_layout.hpp for the converters).

#include <cstdint>
#include <vector>

#include "coda/block/compose.hpp"
#include "coda/reference/attention.hpp"
#include "coda/reference/host_backend.hpp"

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
    CODA_CHECK(hidden % 2 == 0, "llama shape: hidden must be even (pairwise epilogues), got ",
               hidden);
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

// Which LM head composition the decoder runs: the loss with its gradient formed in the forward
// (lm_head_loss_grad, what training uses), or the loss, then its backward recomputing the logits
// (lm_head_loss + lm_head_loss_backward).
enum class LmHeadPath { kLossGrad, kRecompute };

// Forward (and, with grads != nullptr, backward) of the whole decoder from x0 (M, H) to the loss.
template <class Real, class Target>
Real fused_llama_loss(const LlamaShape& s, const FusedModel<Real>& model,
                      const std::vector<Real>& x0, const std::vector<Target>& targets,
                      const block::LossOptions& loss, const TileConfig& tiles,
                      FusedGrads<Real>* grads, LmHeadPath lm_head = LmHeadPath::kLossGrad) {
  using Tn = HostTensor<Real>;
  s.validate();
  tiles.validate();
  const int64_t M = s.tokens(), H = s.hidden, I = s.intermediate, V = s.vocab;
  const programs::QkvLayout ql = s.qkv();
  const int64_t W = ql.width(), Q = ql.q_width();
  CODA_CHECK(static_cast<int>(model.layers.size()) == s.n_layers, "fused_llama_loss: model has ",
             model.layers.size(), " layers, shape says ", s.n_layers);
  CODA_CHECK(x0.size() == static_cast<size_t>(M * H), "fused_llama_loss: x0 has ", x0.size(),
             " elements, expected (", M, ", ", H, ")");
  CODA_CHECK(loss.ce.reduction != programs::Reduction::kNone,
             "fused_llama_loss: reduction must be mean or sum (it returns one loss), got none");
  CODA_CHECK(targets.size() == static_cast<size_t>(M), "fused_llama_loss: targets has ",
             targets.size(), " entries, expected M = ", M);

  HostBackend<Real> b(tiles);
  auto mat = [](const std::vector<Real>& v, int64_t r, int64_t c) { return Tn::of(v, r, c); };
  auto vec = [](const std::vector<Real>& v) { return Tn::of(v, int64_t(v.size()), 1); };
  // Positions, targets and the RoPE table as the PyTorch ops take them: int32 (M), int64 (M),
  // int32 (2, W) of high / low words.
  std::vector<int32_t> pos(M), words(2 * W);
  for (int64_t m = 0; m < M; ++m) pos[m] = static_cast<int32_t>(m % s.seq);
  const auto freq = programs::rope_column_table(ql, model.inv_freq);
  for (int64_t n = 0; n < W; ++n) {
    words[n] = static_cast<int32_t>(freq[n].hi);
    words[W + n] = static_cast<int32_t>(freq[n].lo);
  }
  const auto pos_t = HostTensor<int32_t>::of(pos, M, 1);
  const auto table = HostTensor<int32_t>::of(words, 2, W);
  const auto tgt =
      HostTensor<int64_t>::of(std::vector<int64_t>(targets.begin(), targets.end()), M, 1);
  const Attention<Real> attn{ql, s.batch, s.seq};

  struct Layer {  // the fused layer's weights as tensors
    Tn gamma_attn, w_qkv, w_o, gamma_ffn, w_gu, w_down;
  };
  std::vector<Layer> L;
  for (const auto& l : model.layers)
    L.push_back({vec(l.gamma_attn), mat(l.w_qkv, W, H), mat(l.w_o, H, Q), vec(l.gamma_ffn),
                 mat(l.w_gu, 2 * I, H), mat(l.w_down, H, I)});
  const Tn gamma_final = vec(model.gamma_final), w_vocab = mat(model.w_vocab, V, H);

  struct Saved {  // per layer: what the backward compositions consume
    Tn x_in, r_in, qkv, y_attn, x1, r1, z;
  };
  std::vector<Saved> saved(s.n_layers);
  block::Norm<HostBackend<Real>> n = block::rmsnorm_stats(b, mat(x0, M, H), L[0].gamma_attn, s.eps);
  for (int l = 0; l < s.n_layers; ++l) {
    Saved& sv = saved[l];
    sv.x_in = n.x;
    sv.r_in = n.r;
    sv.qkv = block::norm_qkv(b, n.h, n.r, L[l].w_qkv, Tn{}, pos_t, table);  // no q/k/v bias
    sv.y_attn = mat(attn.forward(sv.qkv.values()), M, Q);
    const auto n1 = block::residual_rmsnorm(b, sv.y_attn, L[l].w_o, n.x, L[l].gamma_ffn, s.eps);
    sv.x1 = n1.x;
    sv.r1 = n1.r;
    const Tn& gamma_next = l + 1 < s.n_layers ? L[l + 1].gamma_attn : gamma_final;
    auto f = block::mlp(b, n1.x, n1.h, n1.r, L[l].w_gu, L[l].w_down, gamma_next, s.eps);
    sv.z = f.z;
    n = f.out;
  }
  if (!grads) return block::lm_head_loss(b, n.h, n.r, w_vocab, tgt, loss).loss.data()[0];

  Real value = 0;
  Tn dx;
  if (lm_head == LmHeadPath::kLossGrad) {
    auto g = block::lm_head_loss_grad(b, n.x, gamma_final, w_vocab, n.h, n.r, tgt, loss);
    value = g.loss.data()[0];
    dx = g.dx;
    grads->gamma_final = g.dgamma.values();
    grads->w_vocab = g.dw.values();
  } else {
    const auto f = block::lm_head_loss(b, n.h, n.r, w_vocab, tgt, loss);
    value = f.loss.data()[0];
    const Tn one = Tn::of({Real(1)}, 1, 1);
    auto g =
        block::lm_head_loss_backward(b, one, n.x, gamma_final, w_vocab, n.h, n.r, tgt, f.lse, loss);
    dx = g.dx;
    grads->gamma_final = g.dgamma.values();
    grads->w_vocab = g.dw.values();
  }
  grads->layers.assign(s.n_layers, {});
  for (int l = s.n_layers - 1; l >= 0; --l) {
    const Saved& sv = saved[l];
    auto& G = grads->layers[l];
    // The MLP (with its residual), the out-projection, attention, then the QKV norm consumer.
    const auto m = block::mlp_backward(b, dx, sv.x1, L[l].gamma_ffn, L[l].w_gu, L[l].w_down, sv.r1,
                                       sv.z, true);
    G.gamma_ffn = m.dgamma.values();
    G.w_gu = m.dw.values();
    G.w_down = m.dw2.values();
    const auto o = block::linear_backward(b, m.dx, sv.y_attn, L[l].w_o);
    G.w_o = o.dw.values();
    const Tn dqkv = mat(attn.backward(sv.qkv.values(), o.dx.values()), M, W);
    const auto q = block::norm_qkv_backward(b, dqkv, sv.qkv, sv.x_in, L[l].gamma_attn, L[l].w_qkv,
                                            Tn{}, sv.r_in, pos_t, table);
    G.gamma_attn = q.dgamma.values();
    G.w_qkv = q.dw.values();
    dx = m.dx;  // the residual stream's gradient reaching x_in: dx1 + the QKV norm's
    b.add_(dx, q.dx);
  }
  grads->dx0 = dx.values();
  return value;
}

}  // namespace coda::reference
