#pragma once
// Naive causal attention on a packed QKV tensor, fp64/fp32, forward and backward. Attention is not
// an epilogue program (it sits between fused blocks); the reference block needs it to run a whole
// layer. Sequences are contiguous: token m = b * seq + t attends to tokens of sequence b at t' <=
// t. GQA: query head j reads kv head j / (n_heads / n_kv_heads).

#include <cmath>
#include <cstdint>
#include <vector>

#include "coda/common/check.hpp"
#include "coda/programs/rope.hpp"

namespace coda::reference {

template <class Real>
struct Attention {
  programs::QkvLayout layout;
  int64_t batch = 0, seq = 0;

  int64_t tokens() const { return batch * seq; }
  Real scale() const { return Real(1) / std::sqrt(static_cast<Real>(layout.head_dim)); }

  void validate(const std::vector<Real>& qkv) const {
    layout.validate();
    CODA_CHECK(batch > 0 && seq > 0, "attention: batch and seq must be positive, got ", batch, ", ",
               seq);
    CODA_CHECK(qkv.size() == static_cast<size_t>(tokens() * layout.width()), "attention: qkv has ",
               qkv.size(), " elements, expected (", tokens(), ", ", layout.width(), ")");
  }
  const Real* q(const std::vector<Real>& qkv, int64_t m, int j) const {
    return qkv.data() + m * layout.width() + j * layout.head_dim;
  }
  int64_t k_offset(int64_t m, int j) const {
    const int kv = j / (layout.n_heads / layout.n_kv_heads);
    return m * layout.width() + layout.q_width() + kv * layout.head_dim;
  }
  int64_t v_offset(int64_t m, int j) const { return k_offset(m, j) + layout.kv_width(); }

  // Softmax row of query (b, t) for head j over t' <= t.
  std::vector<Real> probs(const std::vector<Real>& qkv, int64_t b, int64_t t, int j) const {
    const int d = layout.head_dim;
    const Real* qv = q(qkv, b * seq + t, j);
    std::vector<Real> p(t + 1);
    Real mx = -INFINITY;
    for (int64_t s = 0; s <= t; ++s) {
      const Real* kv = qkv.data() + k_offset(b * seq + s, j);
      Real dot = 0;
      for (int i = 0; i < d; ++i) dot += qv[i] * kv[i];
      p[s] = dot * scale();
      mx = std::max(mx, p[s]);
    }
    Real sum = 0;
    for (auto& v : p) sum += (v = std::exp(v - mx));
    for (auto& v : p) v /= sum;
    return p;
  }

  // y (M, n_heads * head_dim)
  std::vector<Real> forward(const std::vector<Real>& qkv) const {
    validate(qkv);
    const int d = layout.head_dim;
    std::vector<Real> y(tokens() * layout.q_width(), Real(0));
    for (int64_t b = 0; b < batch; ++b)
      for (int64_t t = 0; t < seq; ++t)
        for (int j = 0; j < layout.n_heads; ++j) {
          const auto p = probs(qkv, b, t, j);
          Real* out = y.data() + (b * seq + t) * layout.q_width() + j * d;
          for (int64_t s = 0; s <= t; ++s) {
            const Real* vv = qkv.data() + v_offset(b * seq + s, j);
            for (int i = 0; i < d; ++i) out[i] += p[s] * vv[i];
          }
        }
    return y;
  }

  // dqkv (M, width) from dy (M, n_heads * head_dim).
  std::vector<Real> backward(const std::vector<Real>& qkv, const std::vector<Real>& dy) const {
    validate(qkv);
    CODA_CHECK(dy.size() == static_cast<size_t>(tokens() * layout.q_width()), "attention: dy has ",
               dy.size(), " elements, expected (", tokens(), ", ", layout.q_width(), ")");
    const int d = layout.head_dim;
    std::vector<Real> dqkv(qkv.size(), Real(0));
    for (int64_t b = 0; b < batch; ++b)
      for (int64_t t = 0; t < seq; ++t)
        for (int j = 0; j < layout.n_heads; ++j) {
          const int64_t m = b * seq + t;
          const auto p = probs(qkv, b, t, j);
          const Real* g = dy.data() + m * layout.q_width() + j * d;
          std::vector<Real> dp(t + 1);
          Real pdp = 0;
          for (int64_t s = 0; s <= t; ++s) {
            const Real* vv = qkv.data() + v_offset(b * seq + s, j);
            Real* dv = dqkv.data() + v_offset(b * seq + s, j);
            Real dot = 0;
            for (int i = 0; i < d; ++i) {
              dot += g[i] * vv[i];
              dv[i] += p[s] * g[i];
            }
            dp[s] = dot;
            pdp += p[s] * dot;
          }
          const Real* qv = q(qkv, m, j);
          Real* dq = dqkv.data() + m * layout.width() + j * d;
          for (int64_t s = 0; s <= t; ++s) {
            const Real ds = p[s] * (dp[s] - pdp) * scale();
            const Real* kv = qkv.data() + k_offset(b * seq + s, j);
            Real* dk = dqkv.data() + k_offset(b * seq + s, j);
            for (int i = 0; i < d; ++i) {
              dq[i] += ds * kv[i];
              dk[i] += ds * qv[i];
            }
          }
        }
    return dqkv;
  }
};

}  // namespace coda::reference
