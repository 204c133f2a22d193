#pragma once
// Shape/dtype/device validation of each coda op, shared by its CPU and CUDA kernels (the Meta
// kernels only derive output shapes). Each returns the sizes the kernel needs.

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

inline ProjSizes validate_norm_qkv(const OpContext& c, const at::Tensor& x,
                                   const at::Tensor& gamma, const at::Tensor& w_qkv,
                                   const at::Tensor* h, const at::Tensor& r, const at::Tensor& pos,
                                   const at::Tensor& rope_table) {
  const auto s = validate_norm_consumer(c, x, gamma, "w_qkv", w_qkv, h, r);
  TORCH_CHECK(s.n % 2 == 0, c.op, ": w_qkv.size(0) (the QKV width) must be even, got ", s.n);
  c.cuda_width("the QKV width (w_qkv.size(0))", s.n);
  c.tensor("pos", pos, at::kInt, {s.m});
  c.tensor("rope_table", rope_table, at::kInt, {2, s.n});
  return s;
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
  TORCH_CHECK(s.n % 2 == 0, c.op,
              ": the vocabulary (w_vocab.size(0)) must be even (the epilogue maps column pairs), "
              "got ",
              s.n);
  c.cuda_width("the vocabulary (w_vocab.size(0))", s.n);
  // The CUDA epilogues compare targets with column indices in fp32: exact below 2^24.
  TORCH_CHECK(!c.device.is_cuda() || s.n <= (int64_t(1) << 24), c.op,
              ": the vocabulary (w_vocab.size(0)) must be <= 2^24 on CUDA, got ", s.n);
  c.tensor("targets", targets, at::kLong, {s.m});
  return s;
}

}  // namespace coda::torch_ext
