// Reference fp64 LLaMA forward + hand-written backward. See standard_llama.hpp.
//
// Layout conventions used throughout this file:
//   * activations are (rows, cols) row-major; a "row" is one token m = b*T + t;
//   * a weight W is (out, in) and a linear layer is Y = X * W^T;
//   * backward helpers ACCUMULATE (+=) into their gradient outputs, so callers zero-initialize
//     them once and residual branches simply add up.
#include "support/standard_llama.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>
#include <string>

namespace coda::testing {
namespace {

using Vec = std::vector<double>;

Vec zeros(size_t n) { return Vec(n, 0.0); }

// ----------------------------------------------------------------------------------------------
// Linear layer: Y (rows, out) = X (rows, in) * W (out, in)^T.
// ----------------------------------------------------------------------------------------------

Vec linear(const Vec& x, const Vec& w, size_t rows, size_t in, size_t out) {
  Vec y = zeros(rows * out);
  for (size_t m = 0; m < rows; ++m) {
    for (size_t o = 0; o < out; ++o) {
      double acc = 0.0;
      for (size_t i = 0; i < in; ++i) acc += x[m * in + i] * w[o * in + i];
      y[m * out + o] = acc;
    }
  }
  return y;
}

// dX += dY * W and dW += dY^T * X.
void linear_backward(const Vec& dy, const Vec& x, const Vec& w, size_t rows, size_t in, size_t out,
                     Vec& dx, Vec& dw) {
  for (size_t m = 0; m < rows; ++m) {
    for (size_t o = 0; o < out; ++o) {
      const double g = dy[m * out + o];
      for (size_t i = 0; i < in; ++i) {
        dx[m * in + i] += g * w[o * in + i];
        dw[o * in + i] += g * x[m * in + i];
      }
    }
  }
}

// ----------------------------------------------------------------------------------------------
// RMSNorm: y = x * r * gamma with r = 1 / sqrt(mean(x^2) + eps), per row.
// ----------------------------------------------------------------------------------------------

struct NormOut {
  Vec y;
  Vec rstd;  // r per row, kept for the backward
};

NormOut rmsnorm(const Vec& x, const Vec& gamma, size_t rows, size_t n, double eps) {
  NormOut out{zeros(rows * n), zeros(rows)};
  for (size_t m = 0; m < rows; ++m) {
    double sum_sq = 0.0;
    for (size_t i = 0; i < n; ++i) sum_sq += x[m * n + i] * x[m * n + i];
    const double r = 1.0 / std::sqrt(sum_sq / static_cast<double>(n) + eps);
    out.rstd[m] = r;
    for (size_t i = 0; i < n; ++i) out.y[m * n + i] = x[m * n + i] * r * gamma[i];
  }
  return out;
}

// With u_i = gamma_i * dy_i:  dx_i = r * u_i - x_i * r^3 / n * sum_j(u_j * x_j)
// (the second term is the path through r, since dr/dx_i = -r^3 * x_i / n).
void rmsnorm_backward(const Vec& dy, const Vec& x, const Vec& gamma, const Vec& rstd, size_t rows,
                      size_t n, Vec& dx, Vec& dgamma) {
  for (size_t m = 0; m < rows; ++m) {
    const double r = rstd[m];
    double dot = 0.0;
    for (size_t i = 0; i < n; ++i) dot += gamma[i] * dy[m * n + i] * x[m * n + i];
    const double coef = r * r * r * dot / static_cast<double>(n);
    for (size_t i = 0; i < n; ++i) {
      dx[m * n + i] += r * gamma[i] * dy[m * n + i] - coef * x[m * n + i];
      dgamma[i] += dy[m * n + i] * x[m * n + i] * r;
    }
  }
}

// ----------------------------------------------------------------------------------------------
// RoPE, Hugging Face "rotate_half" convention: dim i is paired with dim i + d/2.
// ----------------------------------------------------------------------------------------------

// Rotates every head of x (M, heads*d) in place by angle sign * t * inv_freq[i].
// sign = +1 is the forward. The rotation is orthogonal, so its backward (the transpose) is the
// same rotation with sign = -1.
void rope(Vec& x, int heads, const LlamaConfig& c, const Vec& inv_freq, double sign) {
  const size_t d = c.head_dim, half = d / 2, width = heads * d;
  for (int b = 0; b < c.batch; ++b) {
    for (int t = 0; t < c.seq; ++t) {
      const size_t m = static_cast<size_t>(b) * c.seq + t;  // position is t, not m
      for (int h = 0; h < heads; ++h) {
        double* v = &x[m * width + h * d];
        for (size_t i = 0; i < half; ++i) {
          const double a = sign * t * inv_freq[i];
          const double cs = std::cos(a), sn = std::sin(a);
          const double lo = v[i], hi = v[i + half];
          v[i] = lo * cs - hi * sn;
          v[i + half] = hi * cs + lo * sn;
        }
      }
    }
  }
}

// ----------------------------------------------------------------------------------------------
// Causal grouped-query attention, per sequence.
// ----------------------------------------------------------------------------------------------

struct AttnOut {
  Vec y;      // (M, Hq*d)
  Vec probs;  // (B, Hq, T, T) softmax weights; entries above the diagonal stay 0
};

// Index helpers shared by forward and backward so they cannot disagree.
struct AttnIndex {
  size_t d, hq, hkv, group, seq;
  explicit AttnIndex(const LlamaConfig& c)
      : d(c.head_dim),
        hq(c.n_heads),
        hkv(c.n_kv_heads),
        group(c.n_heads / c.n_kv_heads),
        seq(c.seq) {}
  size_t q(size_t m, size_t h) const { return m * hq * d + h * d; }              // also y
  size_t kv(size_t m, size_t h) const { return m * hkv * d + (h / group) * d; }  // query head h
  size_t p(size_t b, size_t h, size_t t, size_t s) const {
    return ((b * hq + h) * seq + t) * seq + s;
  }
};

AttnOut attention(const Vec& q, const Vec& k, const Vec& v, const LlamaConfig& c) {
  const AttnIndex ix(c);
  const size_t M = c.tokens(), T = c.seq, d = ix.d;
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  AttnOut out{zeros(M * ix.hq * d), zeros(static_cast<size_t>(c.batch) * ix.hq * T * T)};
  Vec scores(T);
  for (size_t b = 0; b < static_cast<size_t>(c.batch); ++b) {
    for (size_t h = 0; h < ix.hq; ++h) {
      for (size_t t = 0; t < T; ++t) {
        const size_t mq = b * T + t;
        // Scores against keys s <= t of the same sequence; subtract the max for stability.
        double mx = -std::numeric_limits<double>::infinity();
        for (size_t s = 0; s <= t; ++s) {
          double dot = 0.0;
          for (size_t i = 0; i < d; ++i) dot += q[ix.q(mq, h) + i] * k[ix.kv(b * T + s, h) + i];
          scores[s] = dot * scale;
          mx = std::max(mx, scores[s]);
        }
        double denom = 0.0;
        for (size_t s = 0; s <= t; ++s) denom += std::exp(scores[s] - mx);
        for (size_t s = 0; s <= t; ++s) {
          const double p = std::exp(scores[s] - mx) / denom;
          out.probs[ix.p(b, h, t, s)] = p;
          for (size_t i = 0; i < d; ++i) out.y[ix.q(mq, h) + i] += p * v[ix.kv(b * T + s, h) + i];
        }
      }
    }
  }
  return out;
}

// y_t = sum_s p_ts v_s  =>  dv_s += p_ts dy_t,  dp_ts = dy_t . v_s.
// Softmax backward: dscore_ts = p_ts * (dp_ts - sum_s' p_ts' dp_ts').
// score_ts = q_t . k_s * scale  =>  dq_t += dscore * scale * k_s,  dk_s += dscore * scale * q_t.
// Several query heads share one kv head under GQA, so dk / dv accumulate over the group.
void attention_backward(const Vec& dy, const Vec& q, const Vec& k, const Vec& v, const Vec& probs,
                        const LlamaConfig& c, Vec& dq, Vec& dk, Vec& dv) {
  const AttnIndex ix(c);
  const size_t T = c.seq, d = ix.d;
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  Vec dp(T);
  for (size_t b = 0; b < static_cast<size_t>(c.batch); ++b) {
    for (size_t h = 0; h < ix.hq; ++h) {
      for (size_t t = 0; t < T; ++t) {
        const size_t mq = b * T + t;
        double p_dot_dp = 0.0;
        for (size_t s = 0; s <= t; ++s) {
          const double p = probs[ix.p(b, h, t, s)];
          double dot = 0.0;
          for (size_t i = 0; i < d; ++i) {
            dot += dy[ix.q(mq, h) + i] * v[ix.kv(b * T + s, h) + i];
            dv[ix.kv(b * T + s, h) + i] += p * dy[ix.q(mq, h) + i];
          }
          dp[s] = dot;
          p_dot_dp += p * dot;
        }
        for (size_t s = 0; s <= t; ++s) {
          const double ds = probs[ix.p(b, h, t, s)] * (dp[s] - p_dot_dp) * scale;
          for (size_t i = 0; i < d; ++i) {
            dq[ix.q(mq, h) + i] += ds * k[ix.kv(b * T + s, h) + i];
            dk[ix.kv(b * T + s, h) + i] += ds * q[ix.q(mq, h) + i];
          }
        }
      }
    }
  }
}

// ----------------------------------------------------------------------------------------------
// SwiGLU: act = silu(gate) * up, silu(g) = g * sigmoid(g).
// ----------------------------------------------------------------------------------------------

double sigmoid(double g) { return 1.0 / (1.0 + std::exp(-g)); }

Vec swiglu(const Vec& gate, const Vec& up) {
  Vec act(gate.size());
  for (size_t i = 0; i < gate.size(); ++i) act[i] = gate[i] * sigmoid(gate[i]) * up[i];
  return act;
}

// d silu(g)/dg = sig(g) * (1 + g * (1 - sig(g))).
void swiglu_backward(const Vec& dact, const Vec& gate, const Vec& up, Vec& dgate, Vec& dup) {
  for (size_t i = 0; i < gate.size(); ++i) {
    const double sg = sigmoid(gate[i]);
    dup[i] += dact[i] * gate[i] * sg;
    dgate[i] += dact[i] * up[i] * sg * (1.0 + gate[i] * (1.0 - sg));
  }
}

// ----------------------------------------------------------------------------------------------
// One decoder layer.
// ----------------------------------------------------------------------------------------------

// Everything the backward of one layer needs from its forward.
struct LayerCache {
  Vec x_in;  // residual stream entering the layer
  NormOut attn_norm;
  Vec q, k, v;  // q and k after RoPE
  AttnOut attn;
  Vec x_mid;  // residual stream after the attention block
  NormOut ffn_norm;
  Vec gate, up, act;
};

// Runs one layer on x (M, H) in place and returns the cache for the backward.
LayerCache layer_forward(const LlamaConfig& c, const LayerWeights& w, const Vec& inv_freq, Vec& x) {
  const size_t M = c.tokens(), H = c.hidden, I = c.intermediate;
  const size_t qw = static_cast<size_t>(c.n_heads) * c.head_dim;
  const size_t kvw = static_cast<size_t>(c.n_kv_heads) * c.head_dim;
  LayerCache cache;
  cache.x_in = x;

  cache.attn_norm = rmsnorm(x, w.gamma_attn, M, H, c.eps);
  cache.q = linear(cache.attn_norm.y, w.wq, M, H, qw);
  cache.k = linear(cache.attn_norm.y, w.wk, M, H, kvw);
  cache.v = linear(cache.attn_norm.y, w.wv, M, H, kvw);
  rope(cache.q, c.n_heads, c, inv_freq, +1.0);
  rope(cache.k, c.n_kv_heads, c, inv_freq, +1.0);
  cache.attn = attention(cache.q, cache.k, cache.v, c);
  const Vec attn_out = linear(cache.attn.y, w.wo, M, qw, H);
  for (size_t i = 0; i < x.size(); ++i) x[i] += attn_out[i];
  cache.x_mid = x;

  cache.ffn_norm = rmsnorm(x, w.gamma_ffn, M, H, c.eps);
  cache.gate = linear(cache.ffn_norm.y, w.w_gate, M, H, I);
  cache.up = linear(cache.ffn_norm.y, w.w_up, M, H, I);
  cache.act = swiglu(cache.gate, cache.up);
  const Vec ffn_out = linear(cache.act, w.w_down, M, I, H);
  for (size_t i = 0; i < x.size(); ++i) x[i] += ffn_out[i];
  return cache;
}

// On entry dx = dL/d(layer output); on exit dx = dL/d(layer input). Weight grads accumulate in g.
void layer_backward(const LlamaConfig& c, const LayerWeights& w, const Vec& inv_freq,
                    const LayerCache& cache, Vec& dx, LayerWeights& g) {
  const size_t M = c.tokens(), H = c.hidden, I = c.intermediate;
  const size_t qw = static_cast<size_t>(c.n_heads) * c.head_dim;
  const size_t kvw = static_cast<size_t>(c.n_kv_heads) * c.head_dim;

  // FFN block: x_out = x_mid + swiglu(norm(x_mid)) * w_down^T. The residual passes dx through.
  Vec dact = zeros(M * I), dgate = zeros(M * I), dup = zeros(M * I), dh = zeros(M * H);
  linear_backward(dx, cache.act, w.w_down, M, I, H, dact, g.w_down);
  swiglu_backward(dact, cache.gate, cache.up, dgate, dup);
  linear_backward(dgate, cache.ffn_norm.y, w.w_gate, M, H, I, dh, g.w_gate);
  linear_backward(dup, cache.ffn_norm.y, w.w_up, M, H, I, dh, g.w_up);
  rmsnorm_backward(dh, cache.x_mid, w.gamma_ffn, cache.ffn_norm.rstd, M, H, dx, g.gamma_ffn);

  // Attention block: x_mid = x_in + attn(norm(x_in)) * wo^T.
  Vec dy = zeros(M * qw), dq = zeros(M * qw), dk = zeros(M * kvw), dv = zeros(M * kvw);
  linear_backward(dx, cache.attn.y, w.wo, M, qw, H, dy, g.wo);
  attention_backward(dy, cache.q, cache.k, cache.v, cache.attn.probs, c, dq, dk, dv);
  rope(dq, c.n_heads, c, inv_freq, -1.0);  // back from rotated to pre-RoPE coordinates
  rope(dk, c.n_kv_heads, c, inv_freq, -1.0);
  Vec dh_attn = zeros(M * H);
  linear_backward(dq, cache.attn_norm.y, w.wq, M, H, qw, dh_attn, g.wq);
  linear_backward(dk, cache.attn_norm.y, w.wk, M, H, kvw, dh_attn, g.wk);
  linear_backward(dv, cache.attn_norm.y, w.wv, M, H, kvw, dh_attn, g.wv);
  rmsnorm_backward(dh_attn, cache.x_in, w.gamma_attn, cache.attn_norm.rstd, M, H, dx, g.gamma_attn);
}

// ----------------------------------------------------------------------------------------------
// Loss head: cross entropy (+ optional z-loss) on logits (M, V).
// ----------------------------------------------------------------------------------------------

// Per token: loss = lse - z[target] + zl * lse^2, so
// dloss/dz_j = softmax_j * (1 + 2 * zl * lse) - [j == target]. Ignored tokens contribute
// nothing. If dlogits != nullptr it receives dL/dlogits (already scaled by the reduction).
double cross_entropy(const Vec& logits, const std::vector<int64_t>& targets, size_t V,
                     const LossOptions& opt, Vec* dlogits) {
  const size_t M = targets.size();
  size_t count = 0;
  for (int64_t tgt : targets) count += (tgt != opt.ignore_index);
  if (dlogits) *dlogits = zeros(M * V);
  // PyTorch's mean over zero elements is NaN; there is then nothing to differentiate.
  if (opt.mean && count == 0) return std::numeric_limits<double>::quiet_NaN();
  const double scale = opt.mean ? 1.0 / static_cast<double>(count) : 1.0;

  double total = 0.0;
  for (size_t m = 0; m < M; ++m) {
    if (targets[m] == opt.ignore_index) continue;
    const double* z = &logits[m * V];
    const double mx = *std::max_element(z, z + V);
    double sum_exp = 0.0;
    for (size_t j = 0; j < V; ++j) sum_exp += std::exp(z[j] - mx);
    const double lse = mx + std::log(sum_exp);
    const size_t tgt = static_cast<size_t>(targets[m]);
    total += lse - z[tgt] + opt.z_loss * lse * lse;
    if (!dlogits) continue;
    const double softmax_coef = 1.0 + 2.0 * opt.z_loss * lse;
    for (size_t j = 0; j < V; ++j) {
      (*dlogits)[m * V + j] = scale * std::exp(z[j] - lse) * softmax_coef;
    }
    (*dlogits)[m * V + tgt] -= scale;
  }
  return total * scale;
}

// ----------------------------------------------------------------------------------------------
// Shape checks and gradient allocation.
// ----------------------------------------------------------------------------------------------

void require(bool ok, const std::string& what) {
  if (!ok) throw std::invalid_argument("standard_llama: " + what);
}

void require_size(const Vec& v, size_t n, const std::string& name) {
  require(v.size() == n,
          name + " has " + std::to_string(v.size()) + " elements, expected " + std::to_string(n));
}

LayerWeights zero_layer(const LlamaConfig& c) {
  const size_t H = c.hidden, I = c.intermediate;
  const size_t qw = static_cast<size_t>(c.n_heads) * c.head_dim;
  const size_t kvw = static_cast<size_t>(c.n_kv_heads) * c.head_dim;
  return LayerWeights{zeros(H), zeros(qw * H), zeros(kvw * H), zeros(kvw * H), zeros(H * qw),
                      zeros(H), zeros(I * H),  zeros(I * H),   zeros(H * I)};
}

void validate(const LlamaConfig& c, const ModelWeights& w, const Vec& x0,
              const std::vector<int64_t>& targets, const LossOptions& opt) {
  require(c.hidden > 0 && c.n_heads > 0 && c.n_kv_heads > 0 && c.intermediate > 0 && c.vocab > 0 &&
              c.n_layers >= 0 && c.batch > 0 && c.seq > 0,
          "config dimensions must be positive");
  require(c.n_heads % c.n_kv_heads == 0, "n_heads must be a multiple of n_kv_heads");
  require(c.head_dim > 0 && c.head_dim % 2 == 0, "head_dim must be positive and even");
  require(static_cast<int>(w.layers.size()) == c.n_layers, "layer count != n_layers");
  const LayerWeights shape = zero_layer(c);
  for (const LayerWeights& l : w.layers) {
    require_size(l.gamma_attn, shape.gamma_attn.size(), "gamma_attn");
    require_size(l.wq, shape.wq.size(), "wq");
    require_size(l.wk, shape.wk.size(), "wk");
    require_size(l.wv, shape.wv.size(), "wv");
    require_size(l.wo, shape.wo.size(), "wo");
    require_size(l.gamma_ffn, shape.gamma_ffn.size(), "gamma_ffn");
    require_size(l.w_gate, shape.w_gate.size(), "w_gate");
    require_size(l.w_up, shape.w_up.size(), "w_up");
    require_size(l.w_down, shape.w_down.size(), "w_down");
  }
  const size_t M = c.tokens(), H = c.hidden, V = c.vocab;
  require_size(w.gamma_final, H, "gamma_final");
  require_size(w.w_vocab, V * H, "w_vocab");
  require_size(w.inv_freq, static_cast<size_t>(c.head_dim / 2), "inv_freq");
  require_size(x0, M * H, "x0");
  require(targets.size() == M, "targets must have batch*seq elements");
  for (int64_t tgt : targets) {
    require(tgt == opt.ignore_index || (tgt >= 0 && tgt < c.vocab), "target out of range");
  }
}

// splitmix64 (Steele, Lea, Flood 2014): tiny, well-mixed, and fully deterministic.
uint64_t splitmix64(uint64_t& state) {
  uint64_t z = (state += 0x9E3779B97F4A7C15ULL);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}

}  // namespace

double llama_loss(const LlamaConfig& c, const ModelWeights& w, const std::vector<double>& x0,
                  const std::vector<int64_t>& targets, const LossOptions& opt, ModelGrads* grads) {
  validate(c, w, x0, targets, opt);
  const size_t M = c.tokens(), H = c.hidden, V = c.vocab;

  // Forward, keeping every layer's cache for the backward.
  std::vector<LayerCache> caches;
  caches.reserve(c.n_layers);
  Vec x = x0;
  for (const LayerWeights& lw : w.layers) caches.push_back(layer_forward(c, lw, w.inv_freq, x));
  const NormOut final_norm = rmsnorm(x, w.gamma_final, M, H, c.eps);
  const Vec logits = linear(final_norm.y, w.w_vocab, M, H, V);
  if (grads == nullptr) return cross_entropy(logits, targets, V, opt, nullptr);

  // Backward, in reverse order.
  Vec dlogits;
  const double loss = cross_entropy(logits, targets, V, opt, &dlogits);
  *grads =
      ModelGrads{std::vector<LayerWeights>(c.n_layers, zero_layer(c)), zeros(H), zeros(V * H), {}};
  Vec dhf = zeros(M * H), dx = zeros(M * H);
  linear_backward(dlogits, final_norm.y, w.w_vocab, M, H, V, dhf, grads->w_vocab);
  rmsnorm_backward(dhf, x, w.gamma_final, final_norm.rstd, M, H, dx, grads->gamma_final);
  for (int l = c.n_layers - 1; l >= 0; --l) {
    layer_backward(c, w.layers[l], w.inv_freq, caches[l], dx, grads->layers[l]);
  }
  grads->dx0 = std::move(dx);
  return loss;
}

std::vector<double> random_vector(size_t n, double scale, uint64_t seed) {
  uint64_t state = seed;
  Vec out(n);
  for (double& v : out) {
    const double unit = static_cast<double>(splitmix64(state) >> 11) * 0x1.0p-53;  // [0, 1)
    v = scale * (2.0 * unit - 1.0);
  }
  return out;
}

ModelWeights random_weights(const LlamaConfig& c, uint64_t seed) {
  // Each tensor gets its own seed drawn from a master stream, so tensors are uncorrelated.
  uint64_t master = seed;
  auto linear_w = [&](size_t out, size_t in) {
    return random_vector(out * in, 1.0 / std::sqrt(static_cast<double>(in)), splitmix64(master));
  };
  auto gamma = [&](size_t n) {
    Vec g = random_vector(n, 0.2, splitmix64(master));
    for (double& v : g) v += 1.0;
    return g;
  };
  const size_t H = c.hidden, I = c.intermediate;
  const size_t qw = static_cast<size_t>(c.n_heads) * c.head_dim;
  const size_t kvw = static_cast<size_t>(c.n_kv_heads) * c.head_dim;
  ModelWeights w;
  for (int l = 0; l < c.n_layers; ++l) {
    LayerWeights lw;
    lw.gamma_attn = gamma(H);
    lw.wq = linear_w(qw, H);
    lw.wk = linear_w(kvw, H);
    lw.wv = linear_w(kvw, H);
    lw.wo = linear_w(H, qw);
    lw.gamma_ffn = gamma(H);
    lw.w_gate = linear_w(I, H);
    lw.w_up = linear_w(I, H);
    lw.w_down = linear_w(H, I);
    w.layers.push_back(std::move(lw));
  }
  w.gamma_final = gamma(H);
  w.w_vocab = linear_w(c.vocab, H);
  w.inv_freq.resize(c.head_dim / 2);
  for (size_t i = 0; i < w.inv_freq.size(); ++i) {
    w.inv_freq[i] = std::pow(10000.0, -2.0 * static_cast<double>(i) / c.head_dim);
  }
  return w;
}

}  // namespace coda::testing
