// Plain, unfused fp64 reference implementation of a LLaMA-style decoder stack plus
// cross-entropy head, with a hand-written backward pass.
//
// This is test support code: it exists to be obviously correct, not fast. Fused / GPU
// implementations are checked against it. Everything is row-major std::vector<double>, and
// weights are stored PyTorch-style as (out, in), so a linear layer computes Y = X * W^T.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace coda::testing {

struct LlamaConfig {
  int hidden;        // H
  int n_heads;       // Hq
  int n_kv_heads;    // Hkv (GQA: Hq % Hkv == 0; query head h uses kv head h / (Hq / Hkv))
  int head_dim;      // d (even)
  int intermediate;  // I
  int vocab;         // V
  int n_layers;
  int batch;   // B independent sequences
  int seq;     // T tokens each; M = B*T tokens, token m = b*T + t, RoPE position t
  double eps;  // RMSNorm eps: RMSNorm(x) = x * rsqrt(mean(x^2) + eps) * gamma
  int tokens() const { return batch * seq; }
};

struct LayerWeights {
  std::vector<double> gamma_attn;  // (H)
  std::vector<double> wq;          // (Hq*d, H)
  std::vector<double> wk;          // (Hkv*d, H)
  std::vector<double> wv;          // (Hkv*d, H)
  std::vector<double> wo;          // (H, Hq*d)
  std::vector<double> gamma_ffn;   // (H)
  std::vector<double> w_gate;      // (I, H)
  std::vector<double> w_up;        // (I, H)
  std::vector<double> w_down;      // (H, I)
};

struct ModelWeights {
  std::vector<LayerWeights> layers;
  std::vector<double> gamma_final;  // (H)
  std::vector<double> w_vocab;      // (V, H)
  std::vector<double> inv_freq;     // (d/2) RoPE frequencies (rad per position)
};

struct LossOptions {
  int64_t ignore_index = -100;
  // true: mean over non-ignored tokens (NaN if every token is ignored, like PyTorch's mean of
  // nothing); false: sum over non-ignored tokens.
  bool mean = true;
  // Adds z_loss * lse^2 per non-ignored token, reduced the same way as the CE term.
  double z_loss = 0.0;
};

// Same shapes as ModelWeights (inv_freq is a constant, so it has no gradient), plus the input.
struct ModelGrads {
  std::vector<LayerWeights> layers;
  std::vector<double> gamma_final, w_vocab;
  std::vector<double> dx0;  // (M, H)
};

// x0: (M, H) embeddings entering layer 0. targets: (M). Returns the reduced loss.
// If grads != nullptr, it is overwritten with the gradient of the loss w.r.t. x0 and every
// weight. Throws std::invalid_argument on inconsistent shapes or out-of-range targets.
double llama_loss(const LlamaConfig& config, const ModelWeights& weights,
                  const std::vector<double>& x0, const std::vector<int64_t>& targets,
                  const LossOptions& options, ModelGrads* grads);

// Deterministic uniform(-scale, scale) values from a splitmix64 stream seeded with `seed`.
std::vector<double> random_vector(size_t n, double scale, uint64_t seed);

// Random weights of sensible scale: gammas 1 + U(-0.2, 0.2), linear weights U(-1, 1)/sqrt(in),
// inv_freq[i] = 10000^(-2i/d).
ModelWeights random_weights(const LlamaConfig& config, uint64_t seed);

}  // namespace coda::testing
