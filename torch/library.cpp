// The coda op schemas (docs/torch-ops.md), the rope_table constant builder and the Meta kernels
// (shape and dtype only, symbolic sizes, so torch.compile's fake tensors trace through the ops).
#include <torch/library.h>

#include <vector>

#include "checks.hpp"
#include "coda/programs/rope.hpp"
#include "meta_kernel.hpp"

namespace coda::torch_ext {
namespace {

at::Tensor rope_table(const at::Tensor& inv_freq, int64_t n_heads, int64_t n_kv_heads,
                      int64_t head_dim) {
  const char* op = "coda::rope_table";
  TORCH_CHECK(inv_freq.device().is_cpu(), op,
              ": inv_freq must be a CPU tensor (the table is built once on the host, then moved "
              "with the module), got ",
              inv_freq.device());
  TORCH_CHECK(inv_freq.scalar_type() == at::kDouble, op, ": inv_freq must be float64, got ",
              inv_freq.scalar_type());
  TORCH_CHECK(inv_freq.dim() == 1 && inv_freq.size(0) == head_dim / 2, op,
              ": inv_freq must have shape (head_dim / 2,) = (", head_dim / 2, ",), got ",
              shape_string(inv_freq.sizes()));
  const programs::QkvLayout layout{static_cast<int>(n_heads), static_cast<int>(n_kv_heads),
                                   static_cast<int>(head_dim)};
  layout.validate();
  const at::Tensor f = inv_freq.contiguous();
  const std::vector<double> freq(f.data_ptr<double>(), f.data_ptr<double>() + f.numel());
  const auto columns = programs::rope_column_table(layout, freq);
  const int64_t w = static_cast<int64_t>(columns.size());
  at::Tensor table = at::empty({2, w}, at::TensorOptions().dtype(at::kInt));
  auto* p = table.data_ptr<int32_t>();
  for (int64_t n = 0; n < w; ++n) {
    p[n] = static_cast<int32_t>(columns[n].hi);
    p[w + n] = static_cast<int32_t>(columns[n].lo);
  }
  return table;
}

constexpr char k_rope_table[] = "coda::rope_table";

// The host's frequencies (programs::rope_inv_freq) as a float64 CPU tensor, so Python does not
// restate the LLaMA-3.1 scaling.
at::Tensor rope_inv_freq(int64_t head_dim, double theta, bool llama3_scaling, double factor,
                         double low_freq_factor, double high_freq_factor,
                         int64_t original_max_position) {
  const programs::RopeScaling s{llama3_scaling, factor, low_freq_factor, high_freq_factor,
                                static_cast<int>(original_max_position)};
  const auto f = programs::rope_inv_freq(static_cast<int>(head_dim), theta, s);
  return at::tensor(c10::ArrayRef<double>(f), at::TensorOptions().dtype(at::kDouble));
}
constexpr char k_rope_inv_freq[] = "coda::rope_inv_freq";

// ---- Meta kernels ------------------------------------------------------------------------------

at::Tensor rope_table_meta(const at::Tensor& inv_freq, int64_t n_heads, int64_t n_kv_heads,
                           int64_t head_dim) {
  return at::empty({2, (n_heads + 2 * n_kv_heads) * head_dim},
                   inv_freq.options().dtype(at::kInt));
}

at::ScalarType stat_dtype(const at::Tensor& t) {
  return t.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}
at::Tensor stat_vector(const at::Tensor& like_rows) {
  return at::empty_symint({like_rows.sym_size(0)}, like_rows.options().dtype(stat_dtype(like_rows)));
}
void expect_2d(const char* op, const char* name, const at::Tensor& t) {
  TORCH_CHECK(t.dim() == 2, op, ": ", name, " must be 2-D, got ", t.dim(), " dimensions");
}

std::tuple<at::Tensor, at::Tensor> rmsnorm_stats_meta(const at::Tensor& x, const at::Tensor&,
                                                      double) {
  expect_2d("coda::rmsnorm_stats", "x", x);
  return {at::empty_symint(x.sym_sizes(), x.options()), stat_vector(x)};
}
at::Tensor norm_qkv_meta(const at::Tensor& x, const at::Tensor&, const at::Tensor& w_qkv,
                         const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                         const std::optional<at::Tensor>&) {
  expect_2d("coda::norm_qkv", "x", x);
  expect_2d("coda::norm_qkv", "w_qkv", w_qkv);
  return at::empty_symint({x.sym_size(0), w_qkv.sym_size(0)}, x.options());
}
std::tuple<at::Tensor, at::Tensor, at::Tensor> out_proj_residual_norm_meta(
    const at::Tensor& y, const at::Tensor& w_o, const at::Tensor&, const at::Tensor&, double) {
  expect_2d("coda::out_proj_residual_norm", "y", y);
  expect_2d("coda::out_proj_residual_norm", "w_o", w_o);
  at::Tensor x = at::empty_symint({y.sym_size(0), w_o.sym_size(0)}, y.options());
  return {x, at::empty_like(x), stat_vector(y)};
}
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> mlp_meta(
    const at::Tensor& x, const at::Tensor&, const at::Tensor& w_gu, const at::Tensor&,
    const at::Tensor&, const at::Tensor&, const at::Tensor&, double) {
  expect_2d("coda::mlp", "x", x);
  expect_2d("coda::mlp", "w_gu", w_gu);
  return {at::empty_symint(x.sym_sizes(), x.options()),
          at::empty_symint(x.sym_sizes(), x.options()), stat_vector(x),
          at::empty_symint({x.sym_size(0), w_gu.sym_size(0)}, x.options())};
}
std::tuple<at::Tensor, at::Tensor> mlp_partial_meta(const at::Tensor& x, const at::Tensor&,
                                                    const at::Tensor& w_gu, const at::Tensor& w_down,
                                                    const at::Tensor&, const at::Tensor&) {
  expect_2d("coda::mlp_partial", "x", x);
  expect_2d("coda::mlp_partial", "w_gu", w_gu);
  expect_2d("coda::mlp_partial", "w_down", w_down);
  return {at::empty_symint({x.sym_size(0), w_down.sym_size(0)}, x.options()),
          at::empty_symint({x.sym_size(0), w_gu.sym_size(0)}, x.options())};
}
std::tuple<at::Tensor, at::Tensor> lm_head_loss_meta(const at::Tensor& x, const at::Tensor&,
                                                     const at::Tensor&, const at::Tensor&,
                                                     const at::Tensor&, const at::Tensor&,
                                                     int64_t, c10::string_view reduction, double,
                                                     int64_t) {
  expect_2d("coda::lm_head_loss", "x", x);
  const auto red = parse_reduction("coda::lm_head_loss", reduction);
  at::Tensor loss = red == LossReduction::kNone
                        ? stat_vector(x)
                        : at::empty({}, x.options().dtype(stat_dtype(x)));
  return {loss, stat_vector(x)};
}
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> lm_head_loss_grad_meta(
    const at::Tensor& x, const at::Tensor& gamma, const at::Tensor& w_vocab, const at::Tensor&,
    const at::Tensor&, const at::Tensor&, int64_t, c10::string_view reduction, double, int64_t) {
  expect_2d("coda::lm_head_loss_grad", "x", x);
  TORCH_CHECK(parse_reduction("coda::lm_head_loss_grad", reduction) != LossReduction::kNone,
              "coda::lm_head_loss_grad: reduction must be 'mean' or 'sum', got 'none'");
  return {at::empty({}, x.options().dtype(stat_dtype(x))), stat_vector(x), at::empty_like(x),
          at::empty_like(gamma), at::empty_like(w_vocab)};
}
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> norm_qkv_backward_meta(
    const at::Tensor&, const at::Tensor&, const at::Tensor& x, const at::Tensor& gamma,
    const at::Tensor& w_qkv, const at::Tensor&, const at::Tensor&, const at::Tensor&,
    const std::optional<at::Tensor>& b_qkv) {
  return {at::empty_like(x), at::empty_like(gamma), at::empty_like(w_qkv),
          b_qkv ? at::empty_like(*b_qkv) : at::empty({0}, x.options())};
}
std::tuple<at::Tensor, at::Tensor> norm_qkv_qk_norm_meta(
    const at::Tensor& x, const at::Tensor&, const at::Tensor& w_qkv, const at::Tensor&,
    const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor& q_gamma,
    const at::Tensor&, int64_t n_heads, int64_t n_kv_heads, double) {
  expect_2d("coda::norm_qkv_qk_norm", "x", x);
  expect_2d("coda::norm_qkv_qk_norm", "w_qkv", w_qkv);
  const auto normed = (n_heads + n_kv_heads) * q_gamma.sym_size(0);
  return {at::empty_symint({x.sym_size(0), w_qkv.sym_size(0)}, x.options()),
          at::empty_symint({x.sym_size(0), normed}, x.options())};
}
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>
norm_qkv_qk_norm_backward_meta(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                               const at::Tensor& x, const at::Tensor& gamma,
                               const at::Tensor& w_qkv, const at::Tensor&, const at::Tensor&,
                               const at::Tensor&, const at::Tensor& q_gamma,
                               const at::Tensor& k_gamma, int64_t, int64_t, double) {
  return {at::empty_like(x), at::empty_like(gamma), at::empty_like(w_qkv), at::empty_like(q_gamma),
          at::empty_like(k_gamma)};
}
std::tuple<at::Tensor, at::Tensor> linear_backward_meta(const at::Tensor&, const at::Tensor& input,
                                                        const at::Tensor& weight) {
  return {at::empty_like(input), at::empty_like(weight)};
}
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> mlp_backward_meta(
    const at::Tensor&, const at::Tensor& x, const at::Tensor& gamma, const at::Tensor& w_gu,
    const at::Tensor& w_down, const at::Tensor&, const at::Tensor&, bool) {
  return {at::empty_like(x), at::empty_like(gamma), at::empty_like(w_gu), at::empty_like(w_down)};
}
std::tuple<at::Tensor, at::Tensor, at::Tensor> lm_head_loss_backward_meta(
    const at::Tensor&, const at::Tensor& x, const at::Tensor& gamma, const at::Tensor& w_vocab,
    const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t,
    c10::string_view, double, int64_t) {
  return {at::empty_like(x), at::empty_like(gamma), at::empty_like(w_vocab)};
}

}  // namespace

TORCH_LIBRARY(coda, m) {
  m.def("rope_table(Tensor inv_freq, int n_heads, int n_kv_heads, int head_dim) -> Tensor");
  m.def(
      "rope_inv_freq(int head_dim, float theta, bool llama3_scaling=False, float factor=8.0, "
      "float low_freq_factor=1.0, float high_freq_factor=4.0, int original_max_position=8192) "
      "-> Tensor",
      CODA_GUARDED(k_rope_inv_freq, rope_inv_freq));
  m.def("rmsnorm_stats(Tensor x, Tensor gamma, float eps) -> (Tensor h, Tensor r)");
  m.def(
      "norm_qkv(Tensor x, Tensor gamma, Tensor w_qkv, Tensor h, Tensor r, Tensor pos, "
      "Tensor rope_table, Tensor? b_qkv=None) -> Tensor");
  // norm_qkv with QK-norm (Qwen3): an RMSNorm (weights q_gamma, k_gamma: head_dim each) over
  // every Q and K head before RoPE; qk_pre (the Q and K columns before it) is for the backward.
  m.def(
      "norm_qkv_qk_norm(Tensor x, Tensor gamma, Tensor w_qkv, Tensor h, Tensor r, Tensor pos, "
      "Tensor rope_table, Tensor q_gamma, Tensor k_gamma, int n_heads, int n_kv_heads, "
      "float eps) -> (Tensor qkv, Tensor qk_pre)");
  m.def(
      "out_proj_residual_norm(Tensor y, Tensor w_o, Tensor residual, Tensor gamma, float eps) "
      "-> (Tensor x, Tensor h, Tensor r)");
  m.def(
      "mlp(Tensor x, Tensor gamma, Tensor w_gu, Tensor w_down, Tensor h, Tensor r, "
      "Tensor gamma_next, float eps) -> (Tensor x_out, Tensor h_out, Tensor r_out, Tensor z)");
  m.def(
      "mlp_partial(Tensor x, Tensor gamma, Tensor w_gu, Tensor w_down, Tensor h, Tensor r) "
      "-> (Tensor y, Tensor z)");
  m.def(
      "lm_head_loss(Tensor x, Tensor gamma, Tensor w_vocab, Tensor h, Tensor r, Tensor targets, "
      "int ignore_index=-100, str reduction='mean', float z_loss=0.0, "
      "int max_chunk_bytes=1073741824) -> (Tensor loss, Tensor lse)");
  // The loss and, computed with it, its gradients for d loss = 1 (mean or sum only): the LM
  // head's three-GEMM path; lm_head_loss's autograd uses it when a gradient is needed.
  m.def(
      "lm_head_loss_grad(Tensor x, Tensor gamma, Tensor w_vocab, Tensor h, Tensor r, "
      "Tensor targets, int ignore_index=-100, str reduction='mean', float z_loss=0.0, "
      "int max_chunk_bytes=1073741824) -> (Tensor loss, Tensor lse, Tensor dx, Tensor dgamma, "
      "Tensor dw_vocab)");
  // t *= g (g a one-element fp32 tensor) for gradients formed before their scale was known; on
  // CUDA no pass over t when g == 1 (checked on the device, no host sync).
  m.def("scale_grad_(Tensor(a!) t, Tensor g) -> ()");
  m.def(
      "norm_qkv_backward(Tensor dqkv, Tensor qkv, Tensor x, Tensor gamma, Tensor w_qkv, "
      "Tensor r, Tensor pos, Tensor rope_table, Tensor? b_qkv=None) -> (Tensor dx, "
      "Tensor dgamma, Tensor dw_qkv, Tensor db_qkv)");
  m.def(
      "norm_qkv_qk_norm_backward(Tensor dqkv, Tensor qkv, Tensor qk_pre, Tensor x, Tensor gamma, "
      "Tensor w_qkv, Tensor r, Tensor pos, Tensor rope_table, Tensor q_gamma, Tensor k_gamma, "
      "int n_heads, int n_kv_heads, float eps) -> (Tensor dx, Tensor dgamma, Tensor dw_qkv, "
      "Tensor dq_gamma, Tensor dk_gamma)");
  m.def(
      "linear_backward(Tensor dout, Tensor input, Tensor weight) -> (Tensor dinput, "
      "Tensor dweight)");
  m.def(
      "mlp_backward(Tensor dx_out, Tensor x, Tensor gamma, Tensor w_gu, Tensor w_down, Tensor r, "
      "Tensor z, bool residual=True) -> (Tensor dx, Tensor dgamma, Tensor dw_gu, Tensor dw_down)");
  m.def(
      "lm_head_loss_backward(Tensor dloss, Tensor x, Tensor gamma, Tensor w_vocab, Tensor h, "
      "Tensor r, Tensor targets, Tensor lse, int ignore_index, str reduction, float z_loss, "
      "int max_chunk_bytes) -> (Tensor dx, Tensor dgamma, Tensor dw_vocab)");
}

TORCH_LIBRARY_IMPL(coda, CPU, m) {
  m.impl("rope_table", CODA_GUARDED(k_rope_table, rope_table));
}

TORCH_LIBRARY_IMPL(coda, Meta, m) {
  impl_meta(m, "rope_table", &rope_table_meta);
  impl_meta(
      m, "scale_grad_", +[](const at::Tensor&, const at::Tensor&) {});
  impl_meta(m, "rmsnorm_stats", &rmsnorm_stats_meta);
  impl_meta(m, "norm_qkv", &norm_qkv_meta);
  impl_meta(m, "out_proj_residual_norm", &out_proj_residual_norm_meta);
  impl_meta(m, "mlp", &mlp_meta);
  impl_meta(m, "mlp_partial", &mlp_partial_meta);
  impl_meta(m, "lm_head_loss", &lm_head_loss_meta);
  impl_meta(m, "lm_head_loss_grad", &lm_head_loss_grad_meta);
  impl_meta(m, "norm_qkv_backward", &norm_qkv_backward_meta);
  impl_meta(m, "norm_qkv_qk_norm", &norm_qkv_qk_norm_meta);
  impl_meta(m, "norm_qkv_qk_norm_backward", &norm_qkv_qk_norm_backward_meta);
  impl_meta(m, "linear_backward", &linear_backward_meta);
  impl_meta(m, "mlp_backward", &mlp_backward_meta);
  impl_meta(m, "lm_head_loss_backward", &lm_head_loss_backward_meta);
}

}  // namespace coda::torch_ext
