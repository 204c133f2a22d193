// Autograd kernels of the differentiable coda ops (torch::autograd::Function). Each forward runs
// the op below autograd and saves only what its backward program reads (docs/math.md §3); each backward
// calls the matching *_backward op, so torch.compile traces both as ordinary op calls.
#include <torch/autograd.h>
#include <torch/csrc/autograd/autograd_not_implemented_fallback.h>
#include <torch/library.h>

#include <string>
#include <tuple>

#include "typed_op.hpp"

namespace coda::torch_ext {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;
using at::Tensor;

// A gradient the caller did not produce (output unused) is a zero contribution.
Tensor grad_or_zeros(const Tensor& g, const Tensor& like) {
  return g.defined() ? g.contiguous() : at::zeros_like(like);
}

class NormQkv : public torch::autograd::Function<NormQkv> {
 public:
  static Tensor forward(AutogradContext* ctx, const Tensor& x, const Tensor& gamma,
                        const Tensor& w_qkv, const Tensor& h, const Tensor& r, const Tensor& pos,
                        const Tensor& table, const std::optional<Tensor>& b_qkv) {
    ctx->set_materialize_grads(false);  // unused outputs' gradients stay undefined, no zero-fill
    at::AutoDispatchBelowADInplaceOrView guard;
    static auto f =
        op<Tensor(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                  const Tensor&, const Tensor&, const std::optional<Tensor>&)>("coda::norm_qkv");
    Tensor qkv = f.call(x, gamma, w_qkv, h, r, pos, table, b_qkv);
    ctx->save_for_backward({qkv, x, gamma, w_qkv, r, pos, table, b_qkv.value_or(Tensor())});
    return qkv;
  }
  static variable_list backward(AutogradContext* ctx, variable_list g) {
    const auto s = ctx->get_saved_variables();
    static auto b = op<std::tuple<Tensor, Tensor, Tensor, Tensor>(
        const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
        const Tensor&, const Tensor&, const std::optional<Tensor>&)>("coda::norm_qkv_backward");
    const std::optional<Tensor> bias = s[7].defined() ? std::optional<Tensor>(s[7]) : std::nullopt;
    auto [dx, dgamma, dw, db] =
        b.call(grad_or_zeros(g[0], s[0]), s[0], s[1], s[2], s[3], s[4], s[5], s[6], bias);
    return {dx, dgamma, dw, Tensor(), Tensor(), Tensor(), Tensor(), bias ? db : Tensor()};
  }
};

class NormQkvQkNorm : public torch::autograd::Function<NormQkvQkNorm> {
 public:
  static variable_list forward(AutogradContext* ctx, const Tensor& x, const Tensor& gamma,
                               const Tensor& w_qkv, const Tensor& h, const Tensor& r,
                               const Tensor& pos, const Tensor& table, const Tensor& q_gamma,
                               const Tensor& k_gamma, int64_t n_heads, int64_t n_kv_heads,
                               double eps) {
    ctx->set_materialize_grads(false);
    at::AutoDispatchBelowADInplaceOrView guard;
    static auto f = op<std::tuple<Tensor, Tensor>(
        const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
        const Tensor&, const Tensor&, const Tensor&, int64_t, int64_t, double)>(
        "coda::norm_qkv_qk_norm");
    auto [qkv, qk_pre] =
        f.call(x, gamma, w_qkv, h, r, pos, table, q_gamma, k_gamma, n_heads, n_kv_heads, eps);
    ctx->mark_non_differentiable({qk_pre});
    ctx->save_for_backward({qkv, qk_pre, x, gamma, w_qkv, r, pos, table, q_gamma, k_gamma});
    ctx->saved_data["n_heads"] = n_heads;
    ctx->saved_data["n_kv_heads"] = n_kv_heads;
    ctx->saved_data["eps"] = eps;
    return {qkv, qk_pre};
  }
  static variable_list backward(AutogradContext* ctx, variable_list g) {
    const auto s = ctx->get_saved_variables();
    static auto b = op<std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor>(
        const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
        const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, int64_t, int64_t,
        double)>("coda::norm_qkv_qk_norm_backward");
    if (!g[0].defined()) return variable_list(12);
    auto [dx, dgamma, dw, dqg, dkg] =
        b.call(g[0].contiguous(), s[0], s[1], s[2], s[3], s[4], s[5], s[6], s[7], s[8], s[9],
               ctx->saved_data["n_heads"].toInt(), ctx->saved_data["n_kv_heads"].toInt(),
               ctx->saved_data["eps"].toDouble());
    return {dx,       dgamma, dw,  Tensor(), Tensor(), Tensor(),
            Tensor(), dqg,    dkg, Tensor(), Tensor(), Tensor()};
  }
};

class OutProjResidualNorm : public torch::autograd::Function<OutProjResidualNorm> {
 public:
  static variable_list forward(AutogradContext* ctx, const Tensor& y, const Tensor& w_o,
                               const Tensor& residual, const Tensor& gamma, double eps) {
    ctx->set_materialize_grads(false);  // unused outputs' gradients stay undefined, no zero-fill
    at::AutoDispatchBelowADInplaceOrView guard;
    static auto f = op<std::tuple<Tensor, Tensor, Tensor>(const Tensor&, const Tensor&,
                                                          const Tensor&, const Tensor&, double)>(
        "coda::out_proj_residual_norm");
    auto [x, h, r] = f.call(y, w_o, residual, gamma, eps);
    ctx->mark_non_differentiable({h, r});  // caches for the consumer, which differentiates x, γ
    ctx->save_for_backward({y, w_o});
    return {x, h, r};
  }
  static variable_list backward(AutogradContext* ctx, variable_list g) {
    const auto s = ctx->get_saved_variables();
    if (!g[0].defined()) return {Tensor(), Tensor(), Tensor(), Tensor(), Tensor()};
    static auto b = op<std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&)>(
        "coda::linear_backward");
    const Tensor dx = g[0].contiguous();
    auto [dy, dw] = b.call(dx, s[0], s[1]);
    return {dy, dw, dx, Tensor(), Tensor()};
  }
};

// coda::mlp_backward, shared by Mlp (residual: dx_out reaches x) and MlpPartial (it does not).
auto& mlp_backward_op() {
  static auto b = op<std::tuple<Tensor, Tensor, Tensor, Tensor>(
      const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
      const Tensor&, bool)>("coda::mlp_backward");
  return b;
}

class Mlp : public torch::autograd::Function<Mlp> {
 public:
  static variable_list forward(AutogradContext* ctx, const Tensor& x, const Tensor& gamma,
                               const Tensor& w_gu, const Tensor& w_down, const Tensor& h,
                               const Tensor& r, const Tensor& gamma_next, double eps) {
    ctx->set_materialize_grads(false);  // unused outputs' gradients stay undefined, no zero-fill
    at::AutoDispatchBelowADInplaceOrView guard;
    static auto f =
        op<std::tuple<Tensor, Tensor, Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&,
                                                      const Tensor&, const Tensor&, const Tensor&,
                                                      const Tensor&, double)>("coda::mlp");
    auto [x_out, h_out, r_out, z] = f.call(x, gamma, w_gu, w_down, h, r, gamma_next, eps);
    ctx->mark_non_differentiable({h_out, r_out, z});
    ctx->save_for_backward({x, gamma, w_gu, w_down, r, z});
    return {x_out, h_out, r_out, z};
  }
  static variable_list backward(AutogradContext* ctx, variable_list g) {
    const auto s = ctx->get_saved_variables();
    if (!g[0].defined()) return variable_list(8);
    auto [dx, dgamma, dw_gu, dw_down] = mlp_backward_op().call(g[0].contiguous(), s[0], s[1],
                                                               s[2], s[3], s[4], s[5], true);
    return {dx, dgamma, dw_gu, dw_down, Tensor(), Tensor(), Tensor(), Tensor()};
  }
};

// The MLP branch without residual (y = a · W_downᵀ): its backward is mlp_backward without the
// residual's dx_out, so under tensor parallelism each rank's dx is its share of the sum.
class MlpPartial : public torch::autograd::Function<MlpPartial> {
 public:
  static variable_list forward(AutogradContext* ctx, const Tensor& x, const Tensor& gamma,
                               const Tensor& w_gu, const Tensor& w_down, const Tensor& h,
                               const Tensor& r) {
    ctx->set_materialize_grads(false);
    at::AutoDispatchBelowADInplaceOrView guard;
    static auto f = op<std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&,
                                                  const Tensor&, const Tensor&, const Tensor&)>(
        "coda::mlp_partial");
    auto [y, z] = f.call(x, gamma, w_gu, w_down, h, r);
    ctx->mark_non_differentiable({z});
    ctx->save_for_backward({x, gamma, w_gu, w_down, r, z});
    return {y, z};
  }
  static variable_list backward(AutogradContext* ctx, variable_list g) {
    const auto s = ctx->get_saved_variables();
    if (!g[0].defined()) return variable_list(6);
    auto [dx, dgamma, dw_gu, dw_down] = mlp_backward_op().call(
        g[0].contiguous(), s[0], s[1], s[2], s[3], s[4], s[5], false);
    return {dx, dgamma, dw_gu, dw_down, Tensor(), Tensor()};
  }
};

class LmHeadLoss : public torch::autograd::Function<LmHeadLoss> {
 public:
  static variable_list forward(AutogradContext* ctx, const Tensor& x, const Tensor& gamma,
                               const Tensor& w_vocab, const Tensor& h, const Tensor& r,
                               const Tensor& targets, int64_t ignore_index,
                               c10::string_view reduction, double z_loss,
                               int64_t max_chunk_bytes, bool grad_mode) {
    ctx->set_materialize_grads(false);  // unused outputs' gradients stay undefined, no zero-fill
    at::AutoDispatchBelowADInplaceOrView guard;
    // The loss is the model's last op: when a gradient will be needed (mean or sum, grad mode on
    // at the call: not under torch.no_grad, where parameters still say requires_grad), form it
    // now for d loss = 1 on the three-GEMM path (lm_head_loss_grad: no logits recomputed) and
    // only scale it in backward.
    const bool grad_now =
        grad_mode && reduction != "none" &&
        (x.requires_grad() || gamma.requires_grad() || w_vocab.requires_grad());
    Tensor loss, lse;
    if (grad_now) {
      static auto fg = op<std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor>(
          const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
          int64_t, c10::string_view, double, int64_t)>("coda::lm_head_loss_grad");
      auto [l, e, dx, dgamma, dw] = fg.call(x, gamma, w_vocab, h, r, targets, ignore_index,
                                            reduction, z_loss, max_chunk_bytes);
      loss = l;
      lse = e;
      ctx->saved_data["dx"] = dx;
      ctx->saved_data["dgamma"] = dgamma;
      ctx->saved_data["dw"] = dw;
    } else {
      static auto f = op<std::tuple<Tensor, Tensor>(
          const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
          int64_t, c10::string_view, double, int64_t)>("coda::lm_head_loss");
      std::tie(loss, lse) =
          f.call(x, gamma, w_vocab, h, r, targets, ignore_index, reduction, z_loss, max_chunk_bytes);
    }
    ctx->mark_non_differentiable({lse});
    ctx->save_for_backward({x, gamma, w_vocab, h, r, targets, lse});
    ctx->saved_data["ignore_index"] = ignore_index;
    ctx->saved_data["reduction"] = std::string(reduction);
    ctx->saved_data["z_loss"] = z_loss;
    ctx->saved_data["max_chunk_bytes"] = max_chunk_bytes;
    return {loss, lse};
  }
  static variable_list backward(AutogradContext* ctx, variable_list g) {
    if (!g[0].defined()) return variable_list(11);
    // With create_graph (grad mode on here) the recompute path runs, so that differentiating the
    // gradient raises (lm_head_loss_backward has no derivative) instead of silently giving none.
    if (ctx->saved_data.count("dw") && !at::GradMode::is_enabled()) {
      // Formed in forward for d loss = 1: scaled in place by the incoming (scalar) gradient and
      // handed over once; a second backward through the graph (retain_graph) recomputes below.
      // (coda::scale_grad_ makes no pass over them when d loss == 1, the usual case.)
      static auto scale = op<void(const Tensor&, const Tensor&)>("coda::scale_grad_");
      at::AutoDispatchBelowADInplaceOrView guard;
      variable_list out(11);
      int i = 0;
      for (const char* k : {"dx", "dgamma", "dw"}) {
        out[i] = ctx->saved_data[k].toTensor();
        scale.call(out[i++], g[0]);
        ctx->saved_data.erase(k);
      }
      return out;
    }
    for (const char* k : {"dx", "dgamma", "dw"}) ctx->saved_data.erase(k);  // not used from here
    const auto s = ctx->get_saved_variables();
    static auto b = op<std::tuple<Tensor, Tensor, Tensor>(
        const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
        const Tensor&, const Tensor&, int64_t, c10::string_view, double, int64_t)>(
        "coda::lm_head_loss_backward");
    const std::string reduction = ctx->saved_data["reduction"].toStringRef();
    auto [dx, dgamma, dw] =
        b.call(g[0].contiguous(), s[0], s[1], s[2], s[3], s[4], s[5], s[6],
               ctx->saved_data["ignore_index"].toInt(), reduction,
               ctx->saved_data["z_loss"].toDouble(), ctx->saved_data["max_chunk_bytes"].toInt());
    variable_list out(11);
    out[0] = dx;
    out[1] = dgamma;
    out[2] = dw;
    return out;
  }
};

// The norm statistics are caches (see docs/torch-ops.md): computed below autograd, no graph.
std::tuple<Tensor, Tensor> rmsnorm_stats_autograd(const Tensor& x, const Tensor& gamma,
                                                  double eps) {
  at::AutoDispatchBelowADInplaceOrView guard;
  static auto f = op<std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, double)>(
      "coda::rmsnorm_stats");
  return f.call(x, gamma, eps);
}

}  // namespace

TORCH_LIBRARY_IMPL(coda, Autograd, m) {
  // The backward ops are not differentiable themselves: double backward raises instead of
  // returning no gradient.
  for (const char* name : {"norm_qkv_backward", "norm_qkv_qk_norm_backward", "linear_backward",
                           "mlp_backward", "lm_head_loss_backward", "lm_head_loss_grad"})
    m.impl(name, torch::autograd::autogradNotImplementedFallback());
  m.impl("rmsnorm_stats", &rmsnorm_stats_autograd);
  m.impl("norm_qkv", [](const Tensor& x, const Tensor& gamma, const Tensor& w_qkv, const Tensor& h,
                        const Tensor& r, const Tensor& pos, const Tensor& table,
                        const std::optional<Tensor>& b_qkv) {
    return NormQkv::apply(x, gamma, w_qkv, h, r, pos, table, b_qkv);
  });
  m.impl("norm_qkv_qk_norm",
         [](const Tensor& x, const Tensor& gamma, const Tensor& w_qkv, const Tensor& h,
            const Tensor& r, const Tensor& pos, const Tensor& table, const Tensor& q_gamma,
            const Tensor& k_gamma, int64_t n_heads, int64_t n_kv_heads, double eps) {
           auto o = NormQkvQkNorm::apply(x, gamma, w_qkv, h, r, pos, table, q_gamma, k_gamma,
                                         n_heads, n_kv_heads, eps);
           return std::make_tuple(o[0], o[1]);
         });
  m.impl("out_proj_residual_norm", [](const Tensor& y, const Tensor& w_o, const Tensor& residual,
                                      const Tensor& gamma, double eps) {
    auto o = OutProjResidualNorm::apply(y, w_o, residual, gamma, eps);
    return std::make_tuple(o[0], o[1], o[2]);
  });
  m.impl("mlp", [](const Tensor& x, const Tensor& gamma, const Tensor& w_gu, const Tensor& w_down,
                   const Tensor& h, const Tensor& r, const Tensor& gamma_next, double eps) {
    auto o = Mlp::apply(x, gamma, w_gu, w_down, h, r, gamma_next, eps);
    return std::make_tuple(o[0], o[1], o[2], o[3]);
  });
  m.impl("mlp_partial", [](const Tensor& x, const Tensor& gamma, const Tensor& w_gu,
                           const Tensor& w_down, const Tensor& h, const Tensor& r) {
    auto o = MlpPartial::apply(x, gamma, w_gu, w_down, h, r);
    return std::make_tuple(o[0], o[1]);
  });
  m.impl("lm_head_loss", [](const Tensor& x, const Tensor& gamma, const Tensor& w_vocab,
                            const Tensor& h, const Tensor& r, const Tensor& targets,
                            int64_t ignore_index, c10::string_view reduction, double z_loss,
                            int64_t max_chunk_bytes) {
    auto o = LmHeadLoss::apply(x, gamma, w_vocab, h, r, targets, ignore_index, reduction, z_loss,
                               max_chunk_bytes, at::GradMode::is_enabled());
    return std::make_tuple(o[0], o[1]);
  });
}

}  // namespace coda::torch_ext
