// The FP8 block ops' Meta kernels (torch/fp8_block_ops.cpp has their schemas and the CPU, CUDA
// and autograd kernels): each output's shape and dtype from the inputs' (symbolic) sizes, as the
// CPU and CUDA kernels make them, for fake tensors (torch.compile, opcheck). Each is registered
// behind impl_meta's check that every tensor argument is a meta tensor.
#include <torch/library.h>

#include <optional>
#include <tuple>
#include <utility>

#include "fp8_ops.hpp"
#include "meta_kernel.hpp"

namespace coda::torch_ext {
namespace {

using at::Tensor;
using OutProj = std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor>;
using MlpOut = std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor>;
using MlpPartialOut = std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor>;

at::ScalarType stat_of(const Tensor& act) {
  return act.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

OutProj fp8_out_proj_residual_norm_meta(const Tensor& y, const Tensor& w_o, const Tensor&,
                                        const Tensor&, const std::optional<Tensor>&,
                                        const std::optional<Tensor>&, const Tensor&, const Tensor&,
                                        double, bool copies, bool recompute_y, bool) {
  const c10::SymInt m = y.sym_size(0), k = y.sym_size(1), hidden = w_o.sym_size(0);
  const fp8::Quantized h = fp8::empty_quantized(y, m, hidden, true, false);
  const fp8::Quantized y_copy = fp8::empty_quantized(y, m, k, false, copies && !recompute_y);
  return {at::empty_symint({m, hidden}, y.options()),
          std::get<0>(h),
          std::get<1>(h),
          at::empty_symint({m}, y.options().dtype(stat_of(y))),
          std::get<2>(y_copy),
          std::get<3>(y_copy)};
}
std::tuple<Tensor, Tensor, Tensor> fp8_linear_meta(const Tensor& y, const Tensor& w, const Tensor&,
                                                   const Tensor&, const std::optional<Tensor>&,
                                                   const std::optional<Tensor>&, bool copies,
                                                   bool) {
  const c10::SymInt m = y.sym_size(0), k = y.sym_size(1);
  const fp8::Quantized copy = fp8::empty_quantized(y, m, k, false, copies);
  return {at::empty_symint({m, w.sym_size(0)}, y.options()), std::get<2>(copy), std::get<3>(copy)};
}
// The MLP's saved z (M, 2I): in the activation dtype with empty z_scales, or (fp8_z) its 1x128
// codes and their scales.
std::pair<Tensor, Tensor> saved_z(const Tensor& x, const c10::SymInt& m, const c10::SymInt& two_i,
                                  bool fp8_z) {
  if (!fp8_z)
    return {at::empty_symint({m, two_i}, x.options()),
            at::empty({0}, x.options().dtype(at::kFloat))};
  const fp8::Quantized zq = fp8::empty_quantized(x, m, two_i, true, false);
  return {std::get<0>(zq), std::get<1>(zq)};
}
MlpOut fp8_mlp_meta(const Tensor& x, const Tensor&, const Tensor& w_gu, const Tensor&,
                    const Tensor&, const std::optional<Tensor>&, const std::optional<Tensor>&,
                    const Tensor&, const Tensor&, const Tensor&, const std::optional<Tensor>&,
                    const std::optional<Tensor>&, const Tensor&, const Tensor&, const Tensor&,
                    const Tensor&, double, bool act_h_out, bool copies, bool recompute_a, bool,
                    bool fp8_z) {
  const c10::SymInt m = x.sym_size(0), hidden = x.sym_size(1), two_i = w_gu.sym_size(0);
  const fp8::Quantized a_copy =
      fp8::empty_quantized(x, m, two_i / 2, false, copies && !recompute_a);
  const Tensor r = at::empty_symint({m}, x.options().dtype(stat_of(x)));
  const auto [z, z_scales] = saved_z(x, m, two_i, fp8_z);
  const Tensor &a_t = std::get<2>(a_copy), &a_t_scales = std::get<3>(a_copy);
  if (act_h_out)
    return {at::empty_like(x),
            at::empty_like(x),
            at::empty({0}, x.options().dtype(at::kFloat)),
            r,
            z,
            a_t,
            a_t_scales,
            z_scales};
  const fp8::Quantized h = fp8::empty_quantized(x, m, hidden, true, false);
  return {at::empty_like(x), std::get<0>(h), std::get<1>(h), r, z, a_t, a_t_scales, z_scales};
}
MlpPartialOut fp8_mlp_partial_meta(const Tensor& x, const Tensor&, const Tensor& w_gu,
                                   const Tensor&, const Tensor&, const std::optional<Tensor>&,
                                   const std::optional<Tensor>&, const Tensor&, const Tensor&,
                                   const Tensor&, const std::optional<Tensor>&,
                                   const std::optional<Tensor>&, const Tensor&, const Tensor&,
                                   const Tensor&, bool copies, bool recompute_a, bool, bool fp8_z) {
  const c10::SymInt m = x.sym_size(0), two_i = w_gu.sym_size(0);
  const fp8::Quantized a_copy =
      fp8::empty_quantized(x, m, two_i / 2, false, copies && !recompute_a);
  const auto [z, z_scales] = saved_z(x, m, two_i, fp8_z);
  return {at::empty_like(x), z, std::get<2>(a_copy), std::get<3>(a_copy), z_scales};
}
Tensor fp8_norm_qkv_meta(const Tensor& x, const Tensor&, const Tensor& w_qkv, const Tensor&,
                         const Tensor&, const std::optional<Tensor>&, const std::optional<Tensor>&,
                         const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                         const std::optional<Tensor>&, bool) {
  return at::empty_symint({x.sym_size(0), w_qkv.sym_size(0)}, x.options());
}
std::tuple<Tensor, Tensor> fp8_norm_qkv_qk_norm_meta(
    const Tensor& x, const Tensor&, const Tensor& w_qkv, const Tensor&, const Tensor&,
    const std::optional<Tensor>&, const std::optional<Tensor>&, const Tensor&, const Tensor&,
    const Tensor&, const Tensor&, const Tensor&, const Tensor& q_gamma, const Tensor&,
    int64_t n_heads, int64_t n_kv_heads, double, bool) {
  const c10::SymInt m = x.sym_size(0), normed = (n_heads + n_kv_heads) * q_gamma.sym_size(0);
  return {at::empty_symint({m, w_qkv.sym_size(0)}, x.options()),
          at::empty_symint({m, normed}, x.options())};
}
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> fp8_norm_qkv_qk_norm_backward_meta(
    const Tensor&, const Tensor&, const Tensor&, const Tensor& x, const Tensor& gamma,
    const Tensor& w_qkv, const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
    const Tensor& q_gamma, const Tensor& k_gamma, int64_t, int64_t, double) {
  return {at::empty_like(x), at::empty_like(gamma), at::empty_like(w_qkv), at::empty_like(q_gamma),
          at::empty_like(k_gamma)};
}
std::tuple<Tensor, Tensor> fp8_linear_backward_meta(const Tensor& dout,
                                                    const std::optional<Tensor>&,
                                                    const std::optional<Tensor>&,
                                                    const Tensor& weight, const Tensor&,
                                                    const Tensor&, const std::optional<Tensor>&) {
  return {at::empty_symint({dout.sym_size(0), weight.sym_size(1)}, dout.options()),
          at::empty_like(weight)};
}
std::tuple<Tensor, Tensor, Tensor, Tensor> fp8_mlp_backward_meta(
    const Tensor&, const Tensor& x, const Tensor& gamma, const Tensor& w_gu, const Tensor&,
    const Tensor&, const Tensor& w_down, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
    const std::optional<Tensor>&, const std::optional<Tensor>&, const std::optional<Tensor>&,
    bool) {
  return {at::empty_like(x), at::empty_like(gamma), at::empty_like(w_gu), at::empty_like(w_down)};
}
std::tuple<Tensor, Tensor, Tensor, Tensor> fp8_norm_qkv_backward_meta(
    const Tensor&, const Tensor&, const Tensor& x, const Tensor& gamma, const Tensor& w_qkv,
    const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
    const std::optional<Tensor>& b_qkv) {
  return {at::empty_like(x), at::empty_like(gamma), at::empty_like(w_qkv),
          b_qkv ? at::empty_like(*b_qkv) : at::empty({0}, x.options())};
}

}  // namespace

TORCH_LIBRARY_IMPL(coda, Meta, m) {
  impl_meta(m, "fp8_out_proj_residual_norm", &fp8_out_proj_residual_norm_meta);
  impl_meta(m, "fp8_mlp", &fp8_mlp_meta);
  impl_meta(m, "fp8_mlp_partial", &fp8_mlp_partial_meta);
  impl_meta(m, "fp8_linear", &fp8_linear_meta);
  impl_meta(m, "fp8_norm_qkv", &fp8_norm_qkv_meta);
  impl_meta(m, "fp8_linear_backward", &fp8_linear_backward_meta);
  impl_meta(m, "fp8_mlp_backward", &fp8_mlp_backward_meta);
  impl_meta(m, "fp8_norm_qkv_backward", &fp8_norm_qkv_backward_meta);
  impl_meta(m, "fp8_norm_qkv_qk_norm", &fp8_norm_qkv_qk_norm_meta);
  impl_meta(m, "fp8_norm_qkv_qk_norm_backward", &fp8_norm_qkv_qk_norm_backward_meta);
}

}  // namespace coda::torch_ext
