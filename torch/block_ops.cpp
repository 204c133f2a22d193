// CPU and CUDA kernels of the coda block ops: each op validates its arguments (validate.hpp), then
// runs its composition (block/compose.hpp) on the backend of the tensors' device: the reference
// executor in float32 / float64 on the CPU, the Hopper programs in bf16 on CUDA
// (torch/backends.hpp). One definition per op serves both dispatch keys.
#include <torch/library.h>

#include <tuple>

#include "on_backend.hpp"
#include "validate.hpp"

namespace coda::torch_ext {
namespace {

using at::Tensor;

block::LossOptions loss_options(LossReduction reduction, int64_t ignore_index, double z_loss,
                                int64_t max_chunk_bytes) {
  block::LossOptions o;
  o.ce = {.ignore_index = ignore_index, .reduction = reduction, .z_loss = z_loss};
  o.max_chunk_bytes = max_chunk_bytes;
  return o;
}

// ---- forward ops --------------------------------------------------------------------------------

std::tuple<Tensor, Tensor> rmsnorm_stats(const Tensor& x, const Tensor& gamma, double eps) {
  const auto c = OpContext::from(op_names::rmsnorm_stats, "x", x);
  validate_rmsnorm_stats(c, x, gamma, eps);
  return on_backend(x, [&](auto& b) {
    const auto n = block::rmsnorm_stats(b, x, gamma, eps);
    return std::make_tuple(n.h, n.r);
  });
}

Tensor norm_qkv(const Tensor& x, const Tensor& gamma, const Tensor& w_qkv, const Tensor& h,
                const Tensor& r, const Tensor& pos, const Tensor& rope_table,
                const std::optional<Tensor>& b_qkv_in) {
  const auto c = OpContext::from(op_names::norm_qkv, "x", x);
  const Tensor b_qkv = b_qkv_in.value_or(Tensor());
  validate_norm_qkv(c, x, gamma, w_qkv, &h, r, pos, rope_table, b_qkv);
  check_positions(c, pos);
  return on_backend(
      x, [&](auto& b) { return block::norm_qkv(b, h, r, w_qkv, b_qkv, pos, rope_table); });
}

// norm_qkv with QK-norm (Qwen3); qk_pre, the Q and K columns before their norm, is for the
// backward.
std::tuple<Tensor, Tensor> norm_qkv_qk_norm(const Tensor& x, const Tensor& gamma,
                                            const Tensor& w_qkv, const Tensor& h, const Tensor& r,
                                            const Tensor& pos, const Tensor& rope_table,
                                            const Tensor& q_gamma, const Tensor& k_gamma,
                                            int64_t n_heads, int64_t n_kv_heads, double eps) {
  const auto c = OpContext::from(op_names::norm_qkv_qk_norm, "x", x);
  const auto s = validate_norm_qkv_qk_norm(c, x, gamma, w_qkv, &h, r, pos, rope_table, q_gamma,
                                           k_gamma, n_heads, n_kv_heads, eps);
  check_positions(c, pos);
  return on_backend(x, [&](auto& b) {
    const auto o = block::norm_qkv_qk_norm(b, h, r, w_qkv, q_gamma, k_gamma, s.qk, pos, rope_table);
    return std::make_tuple(o.qkv, o.qk_pre);
  });
}

std::tuple<Tensor, Tensor, Tensor> out_proj_residual_norm(const Tensor& y, const Tensor& w_o,
                                                          const Tensor& residual,
                                                          const Tensor& gamma, double eps) {
  const auto c = OpContext::from(op_names::out_proj_residual_norm, "y", y);
  validate_out_proj_residual_norm(c, y, w_o, residual, gamma, eps);
  return on_backend(y, [&](auto& b) {
    const auto n = block::residual_rmsnorm(b, y, w_o, residual, gamma, eps);
    return std::make_tuple(n.x, n.h, n.r);
  });
}

std::tuple<Tensor, Tensor, Tensor, Tensor> mlp(const Tensor& x, const Tensor& gamma,
                                               const Tensor& w_gu, const Tensor& w_down,
                                               const Tensor& h, const Tensor& r,
                                               const Tensor& gamma_next, double eps) {
  const auto c = OpContext::from(op_names::mlp, "x", x);
  validate_mlp(c, x, gamma, w_gu, w_down, h, r, gamma_next, eps);
  return on_backend(x, [&](auto& b) {
    const auto o = block::mlp(b, x, h, r, w_gu, w_down, gamma_next, eps);
    return std::make_tuple(o.out.x, o.out.h, o.out.r, o.z);
  });
}

// The MLP branch without its residual and without the next norm: y = SwiGLU(F2) · W_downᵀ.
// Under tensor parallelism (docs/tensor-parallel.md) each rank's y is its share of the sum.
std::tuple<Tensor, Tensor> mlp_partial(const Tensor& x, const Tensor& gamma, const Tensor& w_gu,
                                       const Tensor& w_down, const Tensor& h, const Tensor& r) {
  const auto c = OpContext::from(op_names::mlp_partial, "x", x);
  validate_mlp_partial(c, x, gamma, w_gu, w_down, h, r);
  return on_backend(x, [&](auto& b) {
    const auto o = block::mlp_partial(b, h, r, w_gu, w_down);
    return std::make_tuple(o.y, o.z);
  });
}

std::tuple<Tensor, Tensor> lm_head_loss(const Tensor& x, const Tensor& gamma, const Tensor& w_vocab,
                                        const Tensor& h, const Tensor& r, const Tensor& targets,
                                        int64_t ignore_index, c10::string_view reduction,
                                        double z_loss, int64_t max_chunk_bytes) {
  const auto c = OpContext::from(op_names::lm_head_loss, "x", x);
  // max_chunk_bytes is checked here too, before any work: the forward holds no logits.
  const auto s =
      validate_lm_head_loss(c, x, gamma, w_vocab, h, r, targets, reduction, max_chunk_bytes);
  const auto o = loss_options(s.reduction, ignore_index, z_loss, max_chunk_bytes);
  return on_backend(x, [&](auto& b) {
    const auto l = block::lm_head_loss(b, h, r, w_vocab, targets, o);
    return std::make_tuple(l.loss, l.lse);
  });
}

// The loss and, formed with it, its gradients for d loss = 1 (the LM head's three-GEMM path).
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> lm_head_loss_grad(
    const Tensor& x, const Tensor& gamma, const Tensor& w_vocab, const Tensor& h, const Tensor& r,
    const Tensor& targets, int64_t ignore_index, c10::string_view reduction, double z_loss,
    int64_t max_chunk_bytes) {
  const auto c = OpContext::from(op_names::lm_head_loss_grad, "x", x);
  const auto s =
      validate_lm_head_loss_grad(c, x, gamma, w_vocab, h, r, targets, reduction, max_chunk_bytes);
  const auto o = loss_options(s.reduction, ignore_index, z_loss, max_chunk_bytes);
  return on_backend(x, [&](auto& b) {
    const auto g = block::lm_head_loss_grad(b, x, gamma, w_vocab, h, r, targets, o);
    return std::make_tuple(g.loss, g.lse, g.dx, g.dgamma, g.dw);
  });
}

// ---- backward ops -------------------------------------------------------------------------------

// db_qkv: the bias's gradient, or an empty (0,) tensor without a bias.
std::tuple<Tensor, Tensor, Tensor, Tensor> norm_qkv_backward(
    const Tensor& dqkv, const Tensor& qkv, const Tensor& x, const Tensor& gamma,
    const Tensor& w_qkv, const Tensor& r, const Tensor& pos, const Tensor& rope_table,
    const std::optional<Tensor>& b_qkv_in) {
  const auto c = OpContext::from(op_names::norm_qkv_backward, "x", x);
  const Tensor b_qkv = b_qkv_in.value_or(Tensor());
  validate_norm_qkv_backward(c, dqkv, qkv, x, gamma, w_qkv, r, pos, rope_table, b_qkv);
  check_positions(c, pos);
  return on_backend(x, [&](auto& b) {
    const auto g =
        block::norm_qkv_backward(b, dqkv, qkv, x, gamma, w_qkv, b_qkv, r, pos, rope_table);
    const Tensor db = g.dbias.defined() ? g.dbias : at::empty({0}, x.options());
    return std::make_tuple(g.dx, g.dgamma, g.dw, db);
  });
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> norm_qkv_qk_norm_backward(
    const Tensor& dqkv, const Tensor& qkv, const Tensor& qk_pre, const Tensor& x,
    const Tensor& gamma, const Tensor& w_qkv, const Tensor& r, const Tensor& pos,
    const Tensor& rope_table, const Tensor& q_gamma, const Tensor& k_gamma, int64_t n_heads,
    int64_t n_kv_heads, double eps) {
  const auto c = OpContext::from(op_names::norm_qkv_qk_norm_backward, "x", x);
  const auto s =
      validate_norm_qkv_qk_norm_backward(c, dqkv, qkv, qk_pre, x, gamma, w_qkv, r, pos, rope_table,
                                         q_gamma, k_gamma, n_heads, n_kv_heads, eps);
  check_positions(c, pos);
  return on_backend(x, [&](auto& b) {
    const auto g = block::norm_qkv_qk_norm_backward(b, dqkv, qkv, qk_pre, x, gamma, w_qkv, q_gamma,
                                                    k_gamma, s.qk, r, pos, rope_table);
    return std::make_tuple(g.dx, g.dgamma, g.dw, g.dq_gamma, g.dk_gamma);
  });
}

std::tuple<Tensor, Tensor> linear_backward(const Tensor& dout, const Tensor& input,
                                           const Tensor& weight) {
  const auto c = OpContext::from(op_names::linear_backward, "dout", dout);
  validate_linear_backward(c, dout, input, weight);
  return on_backend(dout, [&](auto& b) {
    const auto g = block::linear_backward(b, dout, input, weight);
    return std::make_tuple(g.dx, g.dw);
  });
}

std::tuple<Tensor, Tensor, Tensor, Tensor> mlp_backward(const Tensor& dx_out, const Tensor& x,
                                                        const Tensor& gamma, const Tensor& w_gu,
                                                        const Tensor& w_down, const Tensor& r,
                                                        const Tensor& z, bool residual) {
  const auto c = OpContext::from(op_names::mlp_backward, "x", x);
  validate_mlp_backward(c, dx_out, x, gamma, w_gu, w_down, r, z);
  return on_backend(x, [&](auto& b) {
    const auto g = block::mlp_backward(b, dx_out, x, gamma, w_gu, w_down, r, z, residual);
    return std::make_tuple(g.dx, g.dgamma, g.dw, g.dw2);
  });
}

std::tuple<Tensor, Tensor, Tensor> lm_head_loss_backward(
    const Tensor& dloss, const Tensor& x, const Tensor& gamma, const Tensor& w_vocab,
    const Tensor& h, const Tensor& r, const Tensor& targets, const Tensor& lse,
    int64_t ignore_index, c10::string_view reduction, double z_loss, int64_t max_chunk_bytes) {
  const auto c = OpContext::from(op_names::lm_head_loss_backward, "x", x);
  const auto s = validate_lm_head_loss_backward(c, dloss, x, gamma, w_vocab, h, r, targets, lse,
                                                reduction, max_chunk_bytes);
  const auto o = loss_options(s.reduction, ignore_index, z_loss, max_chunk_bytes);
  return on_backend(x, [&](auto& b) {
    const auto g = block::lm_head_loss_backward(b, dloss, x, gamma, w_vocab, h, r, targets, lse, o);
    return std::make_tuple(g.dx, g.dgamma, g.dw);
  });
}

// t *= g (g one element) for gradients formed before their scale was known; on CUDA no pass
// over t when g == 1 (read on the device, no host sync).
void scale_grad_(const Tensor& t, const Tensor& g) {
  TORCH_CHECK(g.numel() == 1, "coda::scale_grad_: g must have one element, got ", g.numel());
  TORCH_CHECK(g.device() == t.device(), "coda::scale_grad_: g must be on ", t.device(), ", got ",
              g.device());
#if CODA_TORCH_CUDA
  if (t.is_cuda() && t.scalar_type() == at::kBFloat16 && t.is_contiguous()) {
    CudaBackend b(t.device());
    // A fresh float copy: a view of a larger tensor need not start 16-byte aligned.
    const Tensor g32 = g.reshape({1}).to(at::kFloat, /*non_blocking=*/false, /*copy=*/true);
    ops::scale_unless_one(
        TensorView::vector(t.data_ptr(), DType::kBF16, t.numel(), t.device().index()),
        CudaBackend::view(g32), b.stream());
    return;
  }
#endif
  const_cast<Tensor&>(t).mul_(g.reshape({}));
}

}  // namespace

TORCH_LIBRARY_IMPL(coda, CPU, m) {
  CODA_REGISTER_KERNELS(m)
  m.impl("scale_grad_", &scale_grad_);
}
#if CODA_TORCH_CUDA
TORCH_LIBRARY_IMPL(coda, CUDA, m) {
  CODA_REGISTER_KERNELS(m)
  m.impl("scale_grad_", &scale_grad_);
}
#endif

}  // namespace coda::torch_ext
