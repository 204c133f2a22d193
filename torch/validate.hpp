#pragma once
// Shape/dtype/device validation of each coda op, shared by its CPU and CUDA kernels (the Meta
// kernels only derive output shapes). validate_<op> checks every argument of the op and returns
// the sizes the kernel needs; the smaller helpers above them are their common parts.

#include "checks.hpp"

namespace coda::torch_ext {

struct NormSizes {  // x (M, H)
  int64_t m, hidden;
};
struct ProjSizes {  // x (M, H) feeding a weight (N, H)
  int64_t m, hidden, n;
};

inline NormSizes validate_rmsnorm_stats(const OpContext& c, const at::Tensor& x,
                                        const at::Tensor& gamma) {
  c.matrix("x", x);
  const int64_t m = x.size(0), hidden = x.size(1);
  c.activation("gamma", gamma, {hidden});
  c.cuda_width("hidden (x.size(1))", hidden);
  return {m, hidden};
}

// The common part of the norm consumers: x, h (M, H), γ (H), r (M), weight (N, H).
inline ProjSizes validate_norm_consumer(const OpContext& c, const at::Tensor& x,
                                        const at::Tensor& gamma, const char* wname,
                                        const at::Tensor& w, const at::Tensor* h,
                                        const at::Tensor& r) {
  const auto s = validate_rmsnorm_stats(c, x, gamma);
  // The consumer's backward runs B1 with N = H: its epilogue maps column pairs.
  TORCH_CHECK(c.device.is_cuda() || s.hidden % 2 == 0, c.op,
              ": H (x.size(1)) must be even on the CPU (pairwise epilogues), got ", s.hidden);
  c.matrix(wname, w);
  TORCH_CHECK(w.size(1) == s.hidden, c.op, ": ", wname, " must have shape (N, ", s.hidden,
              ") to consume x of shape ", shape_string(x.sizes()), ", got ",
              shape_string(w.sizes()));
  if (h) c.activation("h", *h, {s.m, s.hidden});
  c.statistic("r", r, {s.m});
  return {s.m, s.hidden, w.size(0)};
}

inline ProjSizes validate_norm_qkv(const OpContext& c, const at::Tensor& x, const at::Tensor& gamma,
                                   const at::Tensor& w_qkv, const at::Tensor* h,
                                   const at::Tensor& r, const at::Tensor& pos,
                                   const at::Tensor& rope_table, const at::Tensor& b_qkv) {
  const auto s = validate_norm_consumer(c, x, gamma, "w_qkv", w_qkv, h, r);
  TORCH_CHECK(s.n % 2 == 0, c.op, ": w_qkv.size(0) (the QKV width) must be even, got ", s.n);
  c.cuda_width("the QKV width (w_qkv.size(0))", s.n);
  c.tensor("pos", pos, at::kInt, {s.m});
  c.tensor("rope_table", rope_table, at::kInt, {2, s.n});
  if (b_qkv.defined()) c.activation("b_qkv", b_qkv, {s.n});
  return s;
}

// norm_qkv with QK-norm (Qwen3): the heads give the packed width N = (n_heads + 2·n_kv_heads)·d.
struct QkNormSizes {
  ProjSizes proj;
  programs::QkNorm qk;
};
inline QkNormSizes validate_norm_qkv_qk_norm(const OpContext& c, const at::Tensor& x,
                                             const at::Tensor& gamma, const at::Tensor& w_qkv,
                                             const at::Tensor* h, const at::Tensor& r,
                                             const at::Tensor& pos, const at::Tensor& rope_table,
                                             const at::Tensor& q_gamma, const at::Tensor& k_gamma,
                                             int64_t n_heads, int64_t n_kv_heads, double eps) {
  const auto s = validate_norm_qkv(c, x, gamma, w_qkv, h, r, pos, rope_table, at::Tensor());
  TORCH_CHECK(n_heads > 0 && n_kv_heads > 0 && n_heads % n_kv_heads == 0, c.op,
              ": n_heads and n_kv_heads must be positive with n_heads a multiple of n_kv_heads, "
              "got n_heads=",
              n_heads, " n_kv_heads=", n_kv_heads);
  const int64_t heads = n_heads + 2 * n_kv_heads;
  TORCH_CHECK(s.n % heads == 0 && (s.n / heads) % 2 == 0, c.op,
              ": the QKV width (w_qkv.size(0) = ", s.n,
              ") must be (n_heads + 2*n_kv_heads) = ", heads, " times an even head_dim");
  const int64_t d = s.n / heads;
  // The CUDA epilogue normalizes a 128-column tile whose heads lie wholly in it.
  TORCH_CHECK(!c.device.is_cuda() || (d >= 8 && 128 % d == 0), c.op,
              ": on CUDA head_dim must divide 128 and be >= 8 (8, 16, 32, 64 or 128), got ", d);
  c.activation("q_gamma", q_gamma, {d});
  c.activation("k_gamma", k_gamma, {d});
  check_eps(c.op, eps);
  programs::QkNorm qk;
  qk.layout = {static_cast<int>(n_heads), static_cast<int>(n_kv_heads), static_cast<int>(d)};
  qk.eps = eps;
  return {s, qk};
}

struct MlpSizes {
  int64_t m, hidden, intermediate;
};
inline MlpSizes validate_mlp(const OpContext& c, const at::Tensor& x, const at::Tensor& gamma,
                             const at::Tensor& w_gu, const at::Tensor& w_down,
                             const at::Tensor* h, const at::Tensor& r) {
  const auto s = validate_norm_consumer(c, x, gamma, "w_gu", w_gu, h, r);
  TORCH_CHECK(s.n % 2 == 0, c.op, ": w_gu.size(0) (2I, gate/up interleaved) must be even, got ",
              s.n);
  c.cuda_width("2I (w_gu.size(0))", s.n, 16);
  const int64_t inter = s.n / 2;
  TORCH_CHECK(c.device.is_cuda() || inter % 2 == 0, c.op,
              ": I (w_gu.size(0) / 2) must be even on the CPU (the SwiGLU backward maps column "
              "pairs), got ",
              inter);
  c.activation("w_down", w_down, {s.hidden, inter});
  return {s.m, s.hidden, inter};
}

inline ProjSizes validate_lm_head(const OpContext& c, const at::Tensor& x, const at::Tensor& gamma,
                                  const at::Tensor& w_vocab, const at::Tensor& h,
                                  const at::Tensor& r, const at::Tensor& targets) {
  const auto s = validate_norm_consumer(c, x, gamma, "w_vocab", w_vocab, &h, r);
  // Any vocabulary size: the LM-head programs skip the columns past it, and on CUDA the logits'
  // scratch rows are padded to 16 bytes (CudaBackend::act).
  // The CUDA epilogues compare targets with column indices in fp32: exact below 2^24.
  TORCH_CHECK(!c.device.is_cuda() || s.n <= (int64_t(1) << 24), c.op,
              ": the vocabulary (w_vocab.size(0)) must be <= 2^24 on CUDA, got ", s.n);
  c.tensor("targets", targets, at::kLong, {s.m});
  return s;
}

// ---- one validator per op -------------------------------------------------------------------

inline NormSizes validate_rmsnorm_stats(const OpContext& c, const at::Tensor& x,
                                        const at::Tensor& gamma, double eps) {
  const auto s = validate_rmsnorm_stats(c, x, gamma);
  check_eps(c.op, eps);
  return s;
}

inline ProjSizes validate_norm_qkv_backward(const OpContext& c, const at::Tensor& dqkv,
                                            const at::Tensor& qkv, const at::Tensor& x,
                                            const at::Tensor& gamma, const at::Tensor& w_qkv,
                                            const at::Tensor& r, const at::Tensor& pos,
                                            const at::Tensor& rope_table, const at::Tensor& b_qkv) {
  const auto s = validate_norm_qkv(c, x, gamma, w_qkv, nullptr, r, pos, rope_table, b_qkv);
  c.activation("dqkv", dqkv, {s.m, s.n});
  c.activation("qkv", qkv, {s.m, s.n});
  return s;
}

inline QkNormSizes validate_norm_qkv_qk_norm_backward(
    const OpContext& c, const at::Tensor& dqkv, const at::Tensor& qkv, const at::Tensor& qk_pre,
    const at::Tensor& x, const at::Tensor& gamma, const at::Tensor& w_qkv, const at::Tensor& r,
    const at::Tensor& pos, const at::Tensor& rope_table, const at::Tensor& q_gamma,
    const at::Tensor& k_gamma, int64_t n_heads, int64_t n_kv_heads, double eps) {
  const auto s = validate_norm_qkv_qk_norm(c, x, gamma, w_qkv, nullptr, r, pos, rope_table, q_gamma,
                                           k_gamma, n_heads, n_kv_heads, eps);
  c.activation("dqkv", dqkv, {s.proj.m, s.proj.n});
  c.activation("qkv", qkv, {s.proj.m, s.proj.n});
  c.activation("qk_pre", qk_pre, {s.proj.m, s.qk.normed_width()});
  return s;
}

struct OutProjSizes {  // y (M, K) · w_o (H, K)ᵀ
  int64_t m, k, hidden;
};
inline OutProjSizes validate_out_proj_residual_norm(const OpContext& c, const at::Tensor& y,
                                                    const at::Tensor& w_o,
                                                    const at::Tensor& residual,
                                                    const at::Tensor& gamma, double eps) {
  c.matrix("y", y);
  c.matrix("w_o", w_o);
  const int64_t m = y.size(0), k = y.size(1), hidden = w_o.size(0);
  TORCH_CHECK(w_o.size(1) == k, c.op, ": w_o must have shape (H, ", k, ") for y of shape ",
              shape_string(y.sizes()), ", got ", shape_string(w_o.sizes()));
  TORCH_CHECK(c.device.is_cuda() || hidden % 2 == 0, c.op,
              ": H (w_o.size(0)) must be even on the CPU (pairwise epilogues), got ", hidden);
  c.cuda_width("K (y.size(1))", k);
  c.cuda_width("H (w_o.size(0))", hidden);
  c.activation("residual", residual, {m, hidden});
  c.activation("gamma", gamma, {hidden});
  check_eps(c.op, eps);
  return {m, k, hidden};
}

struct LinearSizes {  // dout (M, N), input (M, K), weight (N, K)
  int64_t m, n, k;
};
inline LinearSizes validate_linear_backward(const OpContext& c, const at::Tensor& dout,
                                            const at::Tensor& input, const at::Tensor& weight) {
  c.matrix("dout", dout);
  c.matrix("input", input);
  const int64_t m = dout.size(0), n = dout.size(1), k = input.size(1);
  TORCH_CHECK(input.size(0) == m, c.op, ": input must have ", m, " rows like dout, got shape ",
              shape_string(input.sizes()));
  c.activation("weight", weight, {n, k});
  c.cuda_width("N (dout.size(1))", n);
  c.cuda_width("K (input.size(1))", k);
  return {m, n, k};
}

inline MlpSizes validate_mlp(const OpContext& c, const at::Tensor& x, const at::Tensor& gamma,
                             const at::Tensor& w_gu, const at::Tensor& w_down, const at::Tensor& h,
                             const at::Tensor& r, const at::Tensor& gamma_next, double eps) {
  const auto s = validate_mlp(c, x, gamma, w_gu, w_down, &h, r);
  c.activation("gamma_next", gamma_next, {s.hidden});
  check_eps(c.op, eps);
  return s;
}

inline MlpSizes validate_mlp_partial(const OpContext& c, const at::Tensor& x,
                                     const at::Tensor& gamma, const at::Tensor& w_gu,
                                     const at::Tensor& w_down, const at::Tensor& h,
                                     const at::Tensor& r) {
  return validate_mlp(c, x, gamma, w_gu, w_down, &h, r);
}

inline MlpSizes validate_mlp_backward(const OpContext& c, const at::Tensor& dx_out,
                                      const at::Tensor& x, const at::Tensor& gamma,
                                      const at::Tensor& w_gu, const at::Tensor& w_down,
                                      const at::Tensor& r, const at::Tensor& z) {
  const auto s = validate_mlp(c, x, gamma, w_gu, w_down, nullptr, r);
  c.activation("dx_out", dx_out, {s.m, s.hidden});
  c.activation("z", z, {s.m, 2 * s.intermediate});
  return s;
}

struct LmHeadSizes {
  int64_t m, hidden, vocab;
  LossReduction reduction;
};
inline LmHeadSizes validate_lm_head_loss(const OpContext& c, const at::Tensor& x,
                                         const at::Tensor& gamma, const at::Tensor& w_vocab,
                                         const at::Tensor& h, const at::Tensor& r,
                                         const at::Tensor& targets, c10::string_view reduction,
                                         int64_t max_chunk_bytes) {
  const auto s = validate_lm_head(c, x, gamma, w_vocab, h, r, targets);
  const auto red = parse_reduction(c.op, reduction);
  TORCH_CHECK(max_chunk_bytes > 0, c.op, ": max_chunk_bytes must be positive, got ",
              max_chunk_bytes);
  return {s.m, s.hidden, s.n, red};
}

inline LmHeadSizes validate_lm_head_loss_grad(const OpContext& c, const at::Tensor& x,
                                              const at::Tensor& gamma, const at::Tensor& w_vocab,
                                              const at::Tensor& h, const at::Tensor& r,
                                              const at::Tensor& targets,
                                              c10::string_view reduction,
                                              int64_t max_chunk_bytes) {
  const auto s =
      validate_lm_head_loss(c, x, gamma, w_vocab, h, r, targets, reduction, max_chunk_bytes);
  TORCH_CHECK(s.reduction != LossReduction::kNone, c.op,
              ": reduction must be 'mean' or 'sum' (with 'none' the gradient depends on the "
              "incoming per-token gradient: use lm_head_loss and its backward), got 'none'");
  return s;
}

inline LmHeadSizes validate_lm_head_loss_backward(
    const OpContext& c, const at::Tensor& dloss, const at::Tensor& x, const at::Tensor& gamma,
    const at::Tensor& w_vocab, const at::Tensor& h, const at::Tensor& r, const at::Tensor& targets,
    const at::Tensor& lse, c10::string_view reduction, int64_t max_chunk_bytes) {
  const auto s =
      validate_lm_head_loss(c, x, gamma, w_vocab, h, r, targets, reduction, max_chunk_bytes);
  c.statistic("lse", lse, {s.m});
  if (s.reduction == LossReduction::kNone)
    c.upstream("dloss", dloss, {s.m});
  else
    c.upstream("dloss", dloss, {});
  return s;
}

}  // namespace coda::torch_ext
