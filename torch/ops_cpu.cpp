// CPU kernels of the coda ops: the programs of OPS.md run on the reference executor
// (include/coda/reference), in float32 or float64, so the whole op surface and its autograd run
// and are tested on a machine without a GPU.
#include <torch/library.h>

#include <algorithm>
#include <tuple>
#include <vector>

#include "coda/programs/backward.hpp"
#include "coda/programs/forward.hpp"
#include "coda/programs/rope.hpp"
#include "coda/reference/executor.hpp"
#include "validate.hpp"

namespace coda::torch_ext {
namespace {

using epilogue::PartialLayout;
using epilogue::StoreMode;
using reference::MatrixRef;
using reference::TileConfig;

constexpr TileConfig kTiles{};

template <class R>
const R* in(const at::Tensor& t) {
  return t.data_ptr<R>();
}
template <class R>
R* out(at::Tensor& t) {
  return t.data_ptr<R>();
}
template <class R>
epilogue::TileIn<R> tile_in(const at::Tensor& t) {
  return {t.data_ptr<R>(), t.size(0), t.size(1), t.size(1)};
}
template <class R>
epilogue::TileOut<R> tile_out(at::Tensor& t, StoreMode mode = StoreMode::kOverwrite) {
  return {t.data_ptr<R>(), t.size(0), t.size(1), t.size(1), mode};
}
template <class R>
epilogue::VectorIn<R> vec(const at::Tensor& t) {
  return {t.data_ptr<R>(), t.numel()};
}
template <class R>
MatrixRef<R> rows(const at::Tensor& t) {  // row-major (rows, cols)
  return MatrixRef<R>::row_major(t.data_ptr<R>(), t.size(0), t.size(1));
}
template <class R>
MatrixRef<R> transposed(const at::Tensor& t) {  // the transpose of row-major t, no copy
  return MatrixRef<R>::transposed(t.data_ptr<R>(), t.size(1), t.size(0));
}
template <class R>
void copy_to(const std::vector<R>& v, at::Tensor& t) {
  std::copy(v.begin(), v.end(), t.data_ptr<R>());
}
template <class R>
at::Tensor matrix_tensor(const std::vector<R>& v, int64_t r, int64_t c, const at::Tensor& like) {
  at::Tensor t = at::empty({r, c}, like.options());
  copy_to(v, t);
  return t;
}

// Positions are read on the host here (the CUDA kernels cannot check them without a sync).
void check_positions(const OpContext& c, const at::Tensor& pos) {
  const int32_t lowest = pos.min().item<int32_t>();
  TORCH_CHECK(lowest >= 0, c.op, ": pos must be >= 0, got min ", lowest);
}

std::vector<programs::RopeFrequency> rope_columns(const at::Tensor& table) {
  const int64_t w = table.size(1);
  const auto* p = table.data_ptr<int32_t>();
  std::vector<programs::RopeFrequency> f(w);
  for (int64_t n = 0; n < w; ++n)
    f[n] = {static_cast<uint32_t>(p[n]), static_cast<uint32_t>(p[w + n])};
  return f;
}

// dW (N, K) = dzᵀ · h with dz (M, N), h (M, K).
template <class R>
at::Tensor weight_grad(const at::Tensor& dz, const at::Tensor& h) {
  return matrix_tensor(reference::gemm<R>(transposed<R>(dz), transposed<R>(h)), dz.size(1),
                       h.size(1), dz);
}

// B1: g = dz · W (W (N, H)); dx (mode) r·(gγ − n·ZdZ); returns h_out; dgamma (H) overwritten.
template <class R>
at::Tensor rmsnorm_backward(const at::Tensor& dz, const at::Tensor& w, const at::Tensor& x,
                            const at::Tensor& r, const at::Tensor& gamma,
                            const std::vector<R>& zdz, at::Tensor& dx, StoreMode mode,
                            at::Tensor& dgamma) {
  const int64_t m = x.size(0), hidden = x.size(1);
  programs::RmsnormBackward<R> p;
  at::Tensor h_out = at::zeros_like(x);
  p.layout = PartialLayout::per_column(m, hidden, kTiles.tile_m, kTiles.tile_n);
  std::vector<R> partials(p.layout.elements(), R(0));
  p.x = tile_in<R>(x);
  p.r = vec<R>(r);
  p.gamma = vec<R>(gamma);
  p.zdz = {zdz.data(), m};
  p.dx = tile_out<R>(dx, mode);
  p.h_out = tile_out<R>(h_out);
  p.dgamma_partials = partials.data();
  reference::execute<R>(rows<R>(dz), transposed<R>(w), p, kTiles);
  copy_to(programs::fold_dgamma<R>(partials.data(), p.layout), dgamma);
  return h_out;
}

// ---- forward ops --------------------------------------------------------------------------------

std::tuple<at::Tensor, at::Tensor> rmsnorm_stats(const at::Tensor& x, const at::Tensor& gamma,
                                                 double eps) {
  const auto c = OpContext::from(op_names::rmsnorm_stats, "x", x);
  const auto s = validate_rmsnorm_stats(c, x, gamma, eps);
  at::Tensor h = at::empty_like(x), r = at::empty({s.m}, stat_options(c));
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "coda::rmsnorm_stats", [&] {
    programs::first_layer_rmsnorm<scalar_t>(tile_in<scalar_t>(x), vec<scalar_t>(gamma), eps,
                                            tile_out<scalar_t>(h), out<scalar_t>(r));
  });
  return {h, r};
}

at::Tensor norm_qkv(const at::Tensor& x, const at::Tensor& gamma, const at::Tensor& w_qkv,
                    const at::Tensor& h, const at::Tensor& r, const at::Tensor& pos,
                    const at::Tensor& rope_table) {
  const auto c = OpContext::from(op_names::norm_qkv, "x", x);
  const auto s = validate_norm_qkv(c, x, gamma, w_qkv, &h, r, pos, rope_table);
  check_positions(c, pos);
  at::Tensor qkv = at::empty({s.m, s.n}, x.options());
  const auto freq = rope_columns(rope_table);
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "coda::norm_qkv", [&] {
    programs::RmsnormRope<scalar_t> p;
    p.r = vec<scalar_t>(r);
    p.pos = {pos.data_ptr<int32_t>(), s.m};
    p.freq = {freq.data(), s.n};
    p.qkv = tile_out<scalar_t>(qkv);
    reference::execute<scalar_t>(rows<scalar_t>(h), rows<scalar_t>(w_qkv), p, kTiles);
  });
  return qkv;
}

template <class R>
void residual_rmsnorm(const at::Tensor& a, const at::Tensor& w, const at::Tensor& residual,
                      const at::Tensor& gamma, double eps, at::Tensor& x, at::Tensor& h,
                      at::Tensor& r) {
  const int64_t m = a.size(0), n = w.size(0);
  programs::ResidualRmsnormPartial<R> p;
  p.layout = PartialLayout::per_row(m, n, kTiles.tile_m, kTiles.tile_n);
  std::vector<R> partials(p.layout.elements(), R(0));
  p.residual = tile_in<R>(residual);
  p.gamma = vec<R>(gamma);
  p.x = tile_out<R>(x);
  p.h = tile_out<R>(h);
  p.sumsq_partials = partials.data();
  reference::execute<R>(rows<R>(a), rows<R>(w), p, kTiles);
  copy_to(programs::fold_rstd<R>(partials.data(), p.layout, n, eps), r);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> out_proj_residual_norm(const at::Tensor& y,
                                                                      const at::Tensor& w_o,
                                                                      const at::Tensor& residual,
                                                                      const at::Tensor& gamma,
                                                                      double eps) {
  const auto c = OpContext::from(op_names::out_proj_residual_norm, "y", y);
  const auto s = validate_out_proj_residual_norm(c, y, w_o, residual, gamma, eps);
  at::Tensor x = at::empty({s.m, s.hidden}, y.options()), h = at::empty_like(x),
             r = at::empty({s.m}, stat_options(c));
  AT_DISPATCH_FLOATING_TYPES(y.scalar_type(), "coda::out_proj_residual_norm", [&] {
    residual_rmsnorm<scalar_t>(y, w_o, residual, gamma, eps, x, h, r);
  });
  return {x, h, r};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> mlp(
    const at::Tensor& x, const at::Tensor& gamma, const at::Tensor& w_gu, const at::Tensor& w_down,
    const at::Tensor& h, const at::Tensor& r, const at::Tensor& gamma_next, double eps) {
  const auto c = OpContext::from(op_names::mlp, "x", x);
  const auto s = validate_mlp(c, x, gamma, w_gu, w_down, h, r, gamma_next, eps);
  at::Tensor z = at::empty({s.m, 2 * s.intermediate}, x.options()),
             a = at::empty({s.m, s.intermediate}, x.options()), x_out = at::empty_like(x),
             h_out = at::empty_like(x), r_out = at::empty({s.m}, stat_options(c));
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "coda::mlp", [&] {
    programs::RmsnormSwiglu<scalar_t> f2;
    f2.r = vec<scalar_t>(r);
    f2.z = tile_out<scalar_t>(z);
    f2.a = tile_out<scalar_t>(a);
    reference::execute<scalar_t>(rows<scalar_t>(h), rows<scalar_t>(w_gu), f2, kTiles);
    residual_rmsnorm<scalar_t>(a, w_down, x, gamma_next, eps, x_out, h_out, r_out);
  });
  return {x_out, h_out, r_out, z};
}

// The MLP branch without its residual and without the next norm: y = SwiGLU(F2) · W_downᵀ.
// Under tensor parallelism (docs/tensor-parallel.md) each rank's y is its share of the sum.
std::tuple<at::Tensor, at::Tensor> mlp_partial(const at::Tensor& x, const at::Tensor& gamma,
                                               const at::Tensor& w_gu, const at::Tensor& w_down,
                                               const at::Tensor& h, const at::Tensor& r) {
  const auto c = OpContext::from(op_names::mlp_partial, "x", x);
  const auto s = validate_mlp_partial(c, x, gamma, w_gu, w_down, h, r);
  at::Tensor z = at::empty({s.m, 2 * s.intermediate}, x.options()),
             a = at::empty({s.m, s.intermediate}, x.options()), y;
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "coda::mlp_partial", [&] {
    using R = scalar_t;
    programs::RmsnormSwiglu<R> f2;
    f2.r = vec<R>(r);
    f2.z = tile_out<R>(z);
    f2.a = tile_out<R>(a);
    reference::execute<R>(rows<R>(h), rows<R>(w_gu), f2, kTiles);
    y = matrix_tensor(reference::gemm<R>(rows<R>(a), rows<R>(w_down)), s.m, s.hidden, x);
  });
  return {y, z};
}

std::tuple<at::Tensor, at::Tensor> lm_head_loss(const at::Tensor& x, const at::Tensor& gamma,
                                                const at::Tensor& w_vocab, const at::Tensor& h,
                                                const at::Tensor& r, const at::Tensor& targets,
                                                int64_t ignore_index, c10::string_view reduction,
                                                double z_loss, int64_t max_chunk_bytes) {
  const auto c = OpContext::from(op_names::lm_head_loss, "x", x);
  const auto s =
      validate_lm_head_loss(c, x, gamma, w_vocab, h, r, targets, reduction, max_chunk_bytes);
  const auto red = s.reduction;
  at::Tensor lse = at::empty({s.m}, stat_options(c));
  at::Tensor loss = red == LossReduction::kNone ? at::empty({s.m}, stat_options(c))
                                                : at::empty({}, stat_options(c));
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "coda::lm_head_loss", [&] {
    using R = scalar_t;
    programs::RmsnormLse<R, int64_t> f4;
    f4.layout = PartialLayout::per_row(s.m, s.vocab, kTiles.tile_m, kTiles.tile_n);
    std::vector<R> pmax(f4.layout.elements()), psum(f4.layout.elements()), tl(s.m, R(0));
    f4.r = vec<R>(r);
    f4.targets = {targets.data_ptr<int64_t>(), s.m};
    f4.vocab = s.vocab;
    f4.max_partials = pmax.data();
    f4.sumexp_partials = psum.data();
    f4.target_logit = {tl.data(), s.m};
    reference::execute<R>(rows<R>(h), rows<R>(w_vocab), f4, kTiles);
    programs::CrossEntropyOptions o;
    o.ignore_index = ignore_index;
    o.reduction = static_cast<programs::Reduction>(red);
    o.z_loss = z_loss;
    const auto res = programs::fold_lse_loss<R>(pmax.data(), psum.data(), f4.layout, tl.data(),
                                                targets.data_ptr<int64_t>(), s.vocab, o);
    copy_to(res.lse, lse);
    if (red == LossReduction::kNone)
      copy_to(res.token_loss, loss);
    else
      *out<R>(loss) = res.loss;
  });
  return {loss, lse};
}

// ---- backward ops -------------------------------------------------------------------------------

std::tuple<at::Tensor, at::Tensor, at::Tensor> lm_head_loss_backward(
    const at::Tensor& dloss, const at::Tensor& x, const at::Tensor& gamma,
    const at::Tensor& w_vocab, const at::Tensor& h, const at::Tensor& r, const at::Tensor& targets,
    const at::Tensor& lse, int64_t ignore_index, c10::string_view reduction, double z_loss,
    int64_t max_chunk_bytes);

// The reference of the fused path: the loss, then its backward for d loss = 1.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> lm_head_loss_grad(
    const at::Tensor& x, const at::Tensor& gamma, const at::Tensor& w_vocab, const at::Tensor& h,
    const at::Tensor& r, const at::Tensor& targets, int64_t ignore_index,
    c10::string_view reduction, double z_loss, int64_t max_chunk_bytes) {
  const auto c = OpContext::from(op_names::lm_head_loss_grad, "x", x);
  validate_lm_head_loss_grad(c, x, gamma, w_vocab, h, r, targets, reduction, max_chunk_bytes);
  auto [loss, lse] = lm_head_loss(x, gamma, w_vocab, h, r, targets, ignore_index, reduction,
                                  z_loss, max_chunk_bytes);
  auto [dx, dgamma, dw] = lm_head_loss_backward(at::ones_like(loss), x, gamma, w_vocab, h, r,
                                                targets, lse, ignore_index, reduction, z_loss,
                                                max_chunk_bytes);
  return {loss, lse, dx, dgamma, dw};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> norm_qkv_backward(
    const at::Tensor& dqkv, const at::Tensor& qkv, const at::Tensor& x, const at::Tensor& gamma,
    const at::Tensor& w_qkv, const at::Tensor& r, const at::Tensor& pos,
    const at::Tensor& rope_table) {
  const auto c = OpContext::from(op_names::norm_qkv_backward, "x", x);
  const auto s =
      validate_norm_qkv_backward(c, dqkv, qkv, x, gamma, w_qkv, r, pos, rope_table);
  check_positions(c, pos);
  const auto freq = rope_columns(rope_table);
  at::Tensor dx = at::empty_like(x), dgamma = at::empty_like(gamma), dw;
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "coda::norm_qkv_backward", [&] {
    using R = scalar_t;
    // B3: dqkv_pre = Rᵀ dqkv, ZdZ = Σ qkv·dqkv / H.
    at::Tensor dpre = at::empty_like(dqkv);
    std::vector<R> zdz(s.m);
    programs::rope_backward<R>(tile_in<R>(qkv), tile_in<R>(dqkv), {pos.data_ptr<int32_t>(), s.m},
                               {freq.data(), s.n}, tile_out<R>(dpre), zdz.data());
    for (auto& v : zdz) v /= static_cast<R>(s.hidden);
    // B1 with the QKV weight, then dW_qkv = dpreᵀ · h_out.
    const at::Tensor h_out =
        rmsnorm_backward<R>(dpre, w_qkv, x, r, gamma, zdz, dx, StoreMode::kOverwrite, dgamma);
    dw = weight_grad<R>(dpre, h_out);
  });
  return {dx, dgamma, dw};
}

std::tuple<at::Tensor, at::Tensor> linear_backward(const at::Tensor& dout, const at::Tensor& input,
                                                   const at::Tensor& weight) {
  const auto c = OpContext::from(op_names::linear_backward, "dout", dout);
  const auto s = validate_linear_backward(c, dout, input, weight);
  at::Tensor dinput, dweight;
  AT_DISPATCH_FLOATING_TYPES(dout.scalar_type(), "coda::linear_backward", [&] {
    using R = scalar_t;
    dinput = matrix_tensor(reference::gemm<R>(rows<R>(dout), transposed<R>(weight)), s.m, s.k, dout);
    dweight = weight_grad<R>(dout, input);
  });
  return {dinput, dweight};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> mlp_backward(
    const at::Tensor& dx_out, const at::Tensor& x, const at::Tensor& gamma, const at::Tensor& w_gu,
    const at::Tensor& w_down, const at::Tensor& r, const at::Tensor& z, bool residual) {
  const auto c = OpContext::from(op_names::mlp_backward, "x", x);
  const auto s = validate_mlp_backward(c, dx_out, x, gamma, w_gu, w_down, r, z);
  // residual: dx_out also reaches x through the residual add (mlp); not for mlp_partial.
  at::Tensor dx = residual ? dx_out.clone() : at::zeros_like(x), dgamma = at::empty_like(gamma), dw_gu, dw_down;
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "coda::mlp_backward", [&] {
    using R = scalar_t;
    // B2: da = dx_out · W_down → dz (interleaved), a recomputed, ZdZ partials.
    programs::SwigluBackward<R> b2;
    b2.layout = PartialLayout::per_row(s.m, s.intermediate, kTiles.tile_m, kTiles.tile_n);
    at::Tensor dz = at::zeros_like(z), a = at::zeros({s.m, s.intermediate}, x.options());
    std::vector<R> partials(b2.layout.elements(), R(0));
    b2.z = tile_in<R>(z);
    b2.dz = tile_out<R>(dz);
    b2.a = tile_out<R>(a);
    b2.zdz_partials = partials.data();
    reference::execute<R>(rows<R>(dx_out), transposed<R>(w_down), b2, kTiles);
    dw_down = weight_grad<R>(dx_out, a);
    const auto zdz = programs::fold_zdz<R>(partials.data(), b2.layout, s.hidden);
    // B1 with W_gu, accumulating into the residual gradient; dW_gu = dzᵀ · h_out.
    const at::Tensor h_out =
        rmsnorm_backward<R>(dz, w_gu, x, r, gamma, zdz, dx, StoreMode::kAccumulate, dgamma);
    dw_gu = weight_grad<R>(dz, h_out);
  });
  return {dx, dgamma, dw_gu, dw_down};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> lm_head_loss_backward(
    const at::Tensor& dloss, const at::Tensor& x, const at::Tensor& gamma,
    const at::Tensor& w_vocab, const at::Tensor& h, const at::Tensor& r, const at::Tensor& targets,
    const at::Tensor& lse, int64_t ignore_index, c10::string_view reduction, double z_loss,
    int64_t max_chunk_bytes) {
  const auto c = OpContext::from(op_names::lm_head_loss_backward, "x", x);
  const auto s = validate_lm_head_loss_backward(c, dloss, x, gamma, w_vocab, h, r, targets, lse,
                                                reduction, max_chunk_bytes);
  const auto red = s.reduction;
  at::Tensor dx = at::empty_like(x), dgamma = at::empty_like(gamma), dw;
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "coda::lm_head_loss_backward", [&] {
    using R = scalar_t;
    const int64_t* t = targets.data_ptr<int64_t>();
    const at::Tensor dloss_c = dloss.contiguous();
    // d loss / d token loss: the incoming gradient, / counted tokens for 'mean', 0 if ignored.
    std::vector<R> scale(s.m, R(0));
    int64_t counted = 0;
    for (int64_t i = 0; i < s.m; ++i) counted += t[i] != ignore_index;
    for (int64_t i = 0; i < s.m; ++i) {
      if (t[i] == ignore_index) continue;
      const R g = red == LossReduction::kNone ? dloss_c.data_ptr<R>()[i] : *dloss_c.data_ptr<R>();
      scale[i] = red == LossReduction::kMean ? g / static_cast<R>(counted) : g;
    }
    // B4: dℓ recomputed from h, ZdZ of the final norm; then B1 and dW_vocab = dℓᵀ · h_out.
    programs::RmsnormCrossEntropyBackward<R, int64_t> b4;
    b4.layout = PartialLayout::per_row(s.m, s.vocab, kTiles.tile_m, kTiles.tile_n);
    at::Tensor dlogits = at::zeros({s.m, s.vocab}, x.options());
    std::vector<R> partials(b4.layout.elements(), R(0));
    b4.r = vec<R>(r);
    b4.lse = vec<R>(lse);
    b4.scale = {scale.data(), s.m};
    b4.targets = {t, s.m};
    b4.vocab = s.vocab;
    b4.z_loss = z_loss;
    b4.dlogits = tile_out<R>(dlogits);
    b4.zdz_partials = partials.data();
    reference::execute<R>(rows<R>(h), rows<R>(w_vocab), b4, kTiles);
    const auto zdz = programs::fold_zdz<R>(partials.data(), b4.layout, s.hidden);
    const at::Tensor h_out = rmsnorm_backward<R>(dlogits, w_vocab, x, r, gamma, zdz, dx,
                                                 StoreMode::kOverwrite, dgamma);
    dw = weight_grad<R>(dlogits, h_out);
  });
  return {dx, dgamma, dw};
}

}  // namespace

TORCH_LIBRARY_IMPL(coda, CPU, m) {
  CODA_REGISTER_KERNELS(m)
  m.impl("scale_grad_", [](const at::Tensor& t, const at::Tensor& g) {
    TORCH_CHECK(g.numel() == 1, "coda::scale_grad_: g must have one element, got ", g.numel());
    const_cast<at::Tensor&>(t).mul_(g.reshape({}));
  });
}

}  // namespace coda::torch_ext
