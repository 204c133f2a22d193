// CUDA kernels of the coda ops: the Hopper programs through the C++ op API (include/coda/ops.hpp)
// on PyTorch's current stream. Buffers come from PyTorch's caching allocator; nothing here waits
// on the device (no .item(), no host copies), so the ops capture into CUDA graphs.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>
#include <climits>
#include <tuple>

#include "coda/kernel/aux_kernels.hpp"
#include "coda/ops.hpp"
#include "validate.hpp"

namespace coda::torch_ext {
namespace {

using at::Tensor;
using kernel::bf16;
namespace ops = coda::ops;

const bf16* bf(const Tensor& t) { return reinterpret_cast<const bf16*>(t.data_ptr()); }
bf16* bf_out(Tensor& t) { return reinterpret_cast<bf16*>(t.data_ptr()); }
const float* f32(const Tensor& t) { return t.data_ptr<float>(); }
float* f32_out(Tensor& t) { return t.data_ptr<float>(); }

int as_int(const char* op, const char* what, int64_t v) {
  TORCH_CHECK(v <= INT_MAX, op, ": ", what, " = ", v, " exceeds the kernels' int range");
  return static_cast<int>(v);
}

cudaStream_t stream_of(const Tensor& t) {
  return c10::cuda::getCurrentCUDAStream(t.device().index()).stream();
}

ops::RopeTableDevice rope_device(const Tensor& table) {
  const auto* words = reinterpret_cast<const uint32_t*>(table.data_ptr<int32_t>());
  const int w = static_cast<int>(table.size(1));
  return {words, words + w, w};
}

Tensor partial_buffer(const epilogue::PartialLayout& layout, const Tensor& like) {
  return at::empty({layout.elements()}, like.options().dtype(at::kFloat));
}

// dW (N, K) = dzᵀ · h on our mainloop (Xᵀ·Y operands); dz (M, N), h (M, K), bf16.
Tensor weight_grad(const Tensor& dz, const Tensor& h) {
  Tensor dw = at::empty({dz.size(1), h.size(1)}, dz.options());
  ops::gemm_xty(bf(dz), bf(h), bf_out(dw), int(dz.size(1)), int(h.size(1)), int(dz.size(0)),
                stream_of(dz));
  return dw;
}

// B1 + dγ fold: dx = dres + r·(g·γ − n·ZdZ) with g = dz · W; returns h_out; dgamma (fp32, H).
Tensor rmsnorm_backward(const Tensor& dz, const Tensor& w, const Tensor& x, const Tensor& r,
                        const Tensor& gamma, const Tensor& zdz, const Tensor& dres, Tensor& dx,
                        Tensor& dgamma32) {
  const int m = int(x.size(0)), hidden = int(x.size(1)), n_out = int(dz.size(1));
  const auto s = stream_of(x);
  Tensor h_out = at::empty_like(x);
  const auto layout = ops::rmsnorm_backward_partials_layout(m, hidden, n_out);
  Tensor partials = partial_buffer(layout, x);
  ops::gemm_rmsnorm_backward(bf(dz), bf(w), bf(x), f32(r), bf(gamma), f32(zdz), bf(dres),
                             bf_out(dx), bf_out(h_out), f32_out(partials), m, hidden, n_out, s);
  ops::dgamma_fold(f32(partials), layout, f32_out(dgamma32), s);
  return h_out;
}

// ---- forward ops -------------------------------------------------------------------------------

std::tuple<Tensor, Tensor> rmsnorm_stats(const Tensor& x, const Tensor& gamma, double eps) {
  const auto c = OpContext::from(op_names::rmsnorm_stats, "x", x);
  const auto sz = validate_rmsnorm_stats(c, x, gamma, eps);
  const c10::cuda::CUDAGuard guard(x.device());
  Tensor h = at::empty_like(x), r = at::empty({sz.m}, stat_options(c));
  ops::first_layer_rmsnorm(bf(x), bf(gamma), as_int(c.op, "M", sz.m), int(sz.hidden), float(eps),
                           bf_out(h), f32_out(r), stream_of(x));
  return {h, r};
}

Tensor norm_qkv(const Tensor& x, const Tensor& gamma, const Tensor& w_qkv, const Tensor& h,
                const Tensor& r, const Tensor& pos, const Tensor& rope_table) {
  const auto c = OpContext::from(op_names::norm_qkv, "x", x);
  const auto sz = validate_norm_qkv(c, x, gamma, w_qkv, &h, r, pos, rope_table);
  const c10::cuda::CUDAGuard guard(x.device());
  Tensor qkv = at::empty({sz.m, sz.n}, x.options());
  ops::gemm_rmsnorm_rope(bf(h), bf(w_qkv), f32(r), pos.data_ptr<int32_t>(),
                         rope_device(rope_table), bf_out(qkv), as_int(c.op, "M", sz.m),
                         int(sz.n), int(sz.hidden), stream_of(x));
  return qkv;
}

// F1 + A1 shared by out_proj_residual_norm and mlp.
void residual_rmsnorm(const Tensor& a, const Tensor& w, const Tensor& residual,
                      const Tensor& gamma, double eps, Tensor& x, Tensor& h, Tensor& r) {
  const int m = int(a.size(0)), n = int(w.size(0)), k = int(a.size(1));
  const auto s = stream_of(a);
  const auto layout = ops::residual_rmsnorm_partials_layout(m, n, k);
  Tensor partials = partial_buffer(layout, a);
  ops::gemm_residual_rmsnorm_partial(bf(a), bf(w), bf(residual), bf(gamma), bf_out(x), bf_out(h),
                                     f32_out(partials), m, n, k, s);
  ops::rmsnorm_fold(f32(partials), layout, n, float(eps), f32_out(r), s);
}

std::tuple<Tensor, Tensor, Tensor> out_proj_residual_norm(const Tensor& y, const Tensor& w_o,
                                                          const Tensor& residual,
                                                          const Tensor& gamma, double eps) {
  const auto c = OpContext::from(op_names::out_proj_residual_norm, "y", y);
  const auto sz = validate_out_proj_residual_norm(c, y, w_o, residual, gamma, eps);
  as_int(c.op, "M", sz.m);
  const c10::cuda::CUDAGuard guard(y.device());
  Tensor x = at::empty({sz.m, sz.hidden}, y.options()), h = at::empty_like(x),
         r = at::empty({sz.m}, stat_options(c));
  residual_rmsnorm(y, w_o, residual, gamma, eps, x, h, r);
  return {x, h, r};
}

std::tuple<Tensor, Tensor, Tensor, Tensor> mlp(const Tensor& x, const Tensor& gamma,
                                               const Tensor& w_gu, const Tensor& w_down,
                                               const Tensor& h, const Tensor& r,
                                               const Tensor& gamma_next, double eps) {
  const auto c = OpContext::from(op_names::mlp, "x", x);
  const auto sz = validate_mlp(c, x, gamma, w_gu, w_down, h, r, gamma_next, eps);
  const int m = as_int(c.op, "M", sz.m);
  const c10::cuda::CUDAGuard guard(x.device());
  Tensor z = at::empty({sz.m, 2 * sz.intermediate}, x.options()),
         a = at::empty({sz.m, sz.intermediate}, x.options()), x_out = at::empty_like(x),
         h_out = at::empty_like(x), r_out = at::empty({sz.m}, stat_options(c));
  ops::gemm_rmsnorm_swiglu(bf(h), bf(w_gu), f32(r), bf_out(z), bf_out(a), m,
                           int(2 * sz.intermediate), int(sz.hidden), stream_of(x));
  residual_rmsnorm(a, w_down, x, gamma_next, eps, x_out, h_out, r_out);
  return {x_out, h_out, r_out, z};
}

// The MLP branch without its residual and the next norm (see ops_cpu.cpp): F2, then X·Wᵀ.
std::tuple<Tensor, Tensor> mlp_partial(const Tensor& x, const Tensor& gamma, const Tensor& w_gu,
                                       const Tensor& w_down, const Tensor& h, const Tensor& r) {
  const auto c = OpContext::from(op_names::mlp_partial, "x", x);
  const auto sz = validate_mlp_partial(c, x, gamma, w_gu, w_down, h, r);
  const int m = as_int(c.op, "M", sz.m), inter = int(sz.intermediate), hidden = int(sz.hidden);
  const c10::cuda::CUDAGuard guard(x.device());
  Tensor z = at::empty({sz.m, 2 * sz.intermediate}, x.options()),
         a = at::empty({sz.m, sz.intermediate}, x.options()),
         y = at::empty({sz.m, sz.hidden}, x.options());
  ops::gemm_rmsnorm_swiglu(bf(h), bf(w_gu), f32(r), bf_out(z), bf_out(a), m, 2 * inter, hidden,
                           stream_of(x));
  ops::gemm(bf(a), bf(w_down), bf_out(y), m, hidden, inter, stream_of(x));
  return {y, z};
}

// The loss from per-token losses (0 where ignored): as is ('none'), summed, or the mean over
// counted tokens, on the device: 0 / 0 = NaN when every token is ignored (as PyTorch).
Tensor reduce_loss(const Tensor& token_loss, const Tensor& counted, LossReduction red) {
  if (red == LossReduction::kNone) return token_loss;
  const Tensor total = token_loss.sum();
  return red == LossReduction::kSum ? total : total / counted.sum().to(at::kFloat);
}

std::tuple<Tensor, Tensor> lm_head_loss(const Tensor& x, const Tensor& gamma,
                                        const Tensor& w_vocab, const Tensor& h, const Tensor& r,
                                        const Tensor& targets, int64_t ignore_index,
                                        c10::string_view reduction, double z_loss,
                                        int64_t max_chunk_bytes) {
  const auto c = OpContext::from(op_names::lm_head_loss, "x", x);
  // max_chunk_bytes is checked here too, before any work: the forward holds no logits.
  const auto sz =
      validate_lm_head_loss(c, x, gamma, w_vocab, h, r, targets, reduction, max_chunk_bytes);
  const auto red = sz.reduction;
  const int m = as_int(c.op, "M", sz.m), vocab = int(sz.vocab), hidden = int(sz.hidden);
  const c10::cuda::CUDAGuard guard(x.device());
  const auto s = stream_of(x);
  const auto layout = ops::lm_head_partials_layout(m, vocab, hidden);
  Tensor pmax = partial_buffer(layout, x), psum = partial_buffer(layout, x);
  Tensor target_logit = at::zeros({sz.m}, stat_options(c));
  ops::gemm_rmsnorm_lse(bf(h), bf(w_vocab), f32(r), targets.data_ptr<int64_t>(), f32_out(pmax),
                        f32_out(psum), f32_out(target_logit), m, vocab, hidden, s);
  Tensor lse = at::empty({sz.m}, stat_options(c)), token_loss = at::empty_like(lse);
  ops::lse_loss_fold(f32(pmax), f32(psum), layout, f32(target_logit),
                     targets.data_ptr<int64_t>(), vocab, ignore_index, float(z_loss),
                     f32_out(lse), f32_out(token_loss), s);
  return {reduce_loss(token_loss, targets.ne(ignore_index), red), lse};
}

// d loss / d token loss per token (M, fp32), on the device (no host sync): the incoming gradient
// (per token for 'none'), divided by the counted tokens for 'mean', 0 for ignored tokens.
Tensor token_scale(const Tensor& dloss, const Tensor& counted, LossReduction red, int64_t m) {
  Tensor scale = red == LossReduction::kNone ? dloss.contiguous() : dloss.expand({m});
  if (red == LossReduction::kMean) scale = scale / counted.sum().to(at::kFloat);
  return at::where(counted, scale, at::zeros({}, scale.options())).contiguous();
}

// The LM head's three-GEMM path: the loss and its gradients for d loss = 1, with no logits
// recomputed. Per chunk of tokens (the chunk's bf16 logits are the scratch max_chunk_bytes
// bounds):
//   F4  the chunk's logits stored, with the (max, Σexp) partials and target logits; A2 lse and
//       the token losses; B4 dℓ formed in place from the stored logits, ZdZ per token. At
//       hidden <= 2048 instead: the plain GEMM's logits, then one row kernel for all three;
//   B1  dx of the chunk's rows (the final norm's backward) and the chunk's dγ;
//   dW += dℓᵀ · h_out (the first chunk on our mainloop, then cuBLAS with β = 1: bf16 dW, fp32
//        accumulation within a chunk, one rounding per chunk; no fp32 V × H accumulator).
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> lm_head_loss_grad(
    const Tensor& x, const Tensor& gamma, const Tensor& w_vocab, const Tensor& h, const Tensor& r,
    const Tensor& targets, int64_t ignore_index, c10::string_view reduction, double z_loss,
    int64_t max_chunk_bytes) {
  const auto c = OpContext::from(op_names::lm_head_loss_grad, "x", x);
  // (validate_lm_head requires V % 8 == 0 on CUDA: the stored logits' rows are 16-byte aligned.)
  const auto sz =
      validate_lm_head_loss_grad(c, x, gamma, w_vocab, h, r, targets, reduction, max_chunk_bytes);
  const int64_t m = sz.m, vocab = sz.vocab, hidden = sz.hidden;
  as_int(c.op, "M", m);
  const c10::cuda::CUDAGuard guard(x.device());
  const auto s = stream_of(x);
  const auto st = stat_options(c);
  const int64_t* t = targets.data_ptr<int64_t>();
  const Tensor counted = targets.ne(ignore_index);
  const Tensor scale = token_scale(at::ones({}, st), counted, sz.reduction, m);  // d loss = 1
  // Rows per chunk: the chunk's logits and B1's h_out within max_chunk_bytes; the tokens spread
  // evenly over the fewest chunks, each a multiple of 2048 rows where that fits (8 tiles of 256:
  // the swizzled tile order pads a partial group of 8 tile rows with idle tiles that still cost
  // time, run 35: 2816-row chunks were 34% slower at H 4096, M 8192), else of 128 or 8 rows (the
  // per-token vectors the kernels read start 16-byte aligned at every chunk), at least 8.
  int64_t rows = max_chunk_bytes / ((vocab + hidden) * 2);
  const int64_t q = rows >= 2048 ? 2048 : rows >= 128 ? 128 : 8;
  rows = std::max<int64_t>(8, rows / q * q);
  const int64_t chunks = (m + rows - 1) / rows;
  const int64_t chunk = std::min((((m + chunks - 1) / chunks + q - 1) / q) * q, m);
  // At hidden <= 2048 the F4 epilogue (LSE partials and logits) cost 1.46x its GEMM on every
  // compiled tile (run 37: a 2048-deep mainloop cannot hide it); the row kernel's two reads and
  // one write of the chunk's logits cost less. Above, F4 runs 1.00-1.01x its GEMM.
  const bool unfused_lse = hidden <= 2048;
  Tensor logits = at::empty({chunk, vocab}, x.options());
  Tensor lse = at::empty({m}, st), token_loss = at::empty({m}, st);
  Tensor target_logit = at::zeros({unfused_lse ? 0 : m}, st), zdz = at::empty({chunk}, st);
  Tensor dx = at::zeros_like(x);  // B1's dres (none: the LM head has no residual) and output
  Tensor dgamma32 = at::empty({hidden}, st), dgamma_c = at::empty({hidden}, st);
  Tensor dw = at::empty_like(w_vocab, at::MemoryFormat::Contiguous);
  for (int64_t m0 = 0; m0 < m; m0 += chunk) {
    const int mc = int(std::min(chunk, m - m0));
    if (unfused_lse) {
      ops::gemm(bf(h) + m0 * hidden, bf(w_vocab), bf_out(logits), mc, int(vocab), int(hidden), s);
      ops::cross_entropy_from_unscaled_logits(
          bf_out(logits), int(vocab), bf(h) + m0 * hidden, bf(w_vocab), f32(r) + m0, t + m0,
          ignore_index, float(z_loss), f32(scale) + m0, f32_out(lse) + m0,
          f32_out(token_loss) + m0, f32_out(zdz), mc, int(vocab), int(hidden), s);
    } else {
      const auto layout = ops::lm_head_logits_partials_layout(mc, int(vocab), int(hidden));
      Tensor pmax = partial_buffer(layout, x), psum = partial_buffer(layout, x);
      ops::gemm_rmsnorm_lse_logits(bf(h) + m0 * hidden, bf(w_vocab), f32(r) + m0, t + m0,
                                   f32_out(pmax), f32_out(psum), f32_out(target_logit) + m0,
                                   bf_out(logits), int(vocab), mc, int(vocab), int(hidden), s);
      ops::lse_loss_fold(f32(pmax), f32(psum), layout, f32(target_logit) + m0, t + m0,
                         int(vocab), ignore_index, float(z_loss), f32_out(lse) + m0,
                         f32_out(token_loss) + m0, s);
      ops::cross_entropy_backward_from_logits(bf_out(logits), int(vocab), f32(lse) + m0,
                                              f32(scale) + m0, t + m0, f32(target_logit) + m0,
                                              float(z_loss), f32_out(zdz), mc, int(vocab),
                                              int(hidden), s);
    }
    const Tensor dl = logits.narrow(0, 0, mc);
    Tensor dx_c = dx.narrow(0, m0, mc);
    // The first chunk's dγ fold writes dgamma32; later chunks' are added to it.
    const Tensor h_out = rmsnorm_backward(dl, w_vocab, x.narrow(0, m0, mc), r.narrow(0, m0, mc),
                                          gamma, zdz.narrow(0, 0, mc), dx_c, dx_c,
                                          m0 == 0 ? dgamma32 : dgamma_c);
    if (m0 == 0) {
      ops::gemm_xty(bf(dl), bf(h_out), bf_out(dw), int(vocab), int(hidden), mc, s);
    } else {
      dgamma32.add_(dgamma_c);
      dw.addmm_(dl.t(), h_out);
    }
  }
  return {reduce_loss(token_loss, counted, sz.reduction), lse, dx,
          dgamma32.to(gamma.scalar_type()), dw};
}

// ---- backward ops ------------------------------------------------------------------------------

std::tuple<Tensor, Tensor, Tensor> norm_qkv_backward(const Tensor& dqkv, const Tensor& qkv,
                                                     const Tensor& x, const Tensor& gamma,
                                                     const Tensor& w_qkv, const Tensor& r,
                                                     const Tensor& pos,
                                                     const Tensor& rope_table) {
  const auto c = OpContext::from(op_names::norm_qkv_backward, "x", x);
  const auto sz =
      validate_norm_qkv_backward(c, dqkv, qkv, x, gamma, w_qkv, r, pos, rope_table);
  const int m = as_int(c.op, "M", sz.m);
  const c10::cuda::CUDAGuard guard(x.device());
  const auto s = stream_of(x);
  // B3: dqkv_pre = Rᵀ dqkv, ZdZ = Σ qkv·dqkv / H.
  Tensor dpre = at::empty_like(dqkv), zdz = at::empty({sz.m}, stat_options(c));
  ops::rope_backward(bf(qkv), bf(dqkv), pos.data_ptr<int32_t>(), rope_device(rope_table), m,
                     int(sz.n), int(sz.hidden), bf_out(dpre), f32_out(zdz), s);
  // B1 into a zeroed dx (the residual part of dx is the producer op's, summed by autograd).
  Tensor dx = at::zeros_like(x), dgamma32 = at::empty({sz.hidden}, stat_options(c));
  const Tensor h_out = rmsnorm_backward(dpre, w_qkv, x, r, gamma, zdz, dx, dx, dgamma32);
  return {dx, dgamma32.to(gamma.scalar_type()), weight_grad(dpre, h_out)};
}

std::tuple<Tensor, Tensor> linear_backward(const Tensor& dout, const Tensor& input,
                                           const Tensor& weight) {
  const auto c = OpContext::from(op_names::linear_backward, "dout", dout);
  const auto sz = validate_linear_backward(c, dout, input, weight);
  const int64_t m = sz.m, n = sz.n, k = sz.k;
  const c10::cuda::CUDAGuard guard(dout.device());
  Tensor dinput = at::empty({m, k}, dout.options());
  ops::gemm_xw(bf(dout), bf(weight), bf_out(dinput), as_int(c.op, "M", m), int(k), int(n),
               stream_of(dout));
  return {dinput, weight_grad(dout, input)};
}

std::tuple<Tensor, Tensor, Tensor, Tensor> mlp_backward(const Tensor& dx_out, const Tensor& x,
                                                        const Tensor& gamma, const Tensor& w_gu,
                                                        const Tensor& w_down, const Tensor& r,
                                                        const Tensor& z, bool residual) {
  const auto c = OpContext::from(op_names::mlp_backward, "x", x);
  const auto sz = validate_mlp_backward(c, dx_out, x, gamma, w_gu, w_down, r, z);
  const int m = as_int(c.op, "M", sz.m), inter = int(sz.intermediate), hidden = int(sz.hidden);
  const c10::cuda::CUDAGuard guard(x.device());
  const auto s = stream_of(x);
  // B2: da = dx_out · W_down → dz (interleaved), a recomputed, ZdZ partials.
  Tensor dz = at::empty_like(z), a = at::empty({sz.m, sz.intermediate}, x.options());
  const auto layout = ops::swiglu_backward_partials_layout(m, inter, hidden);
  Tensor partials = partial_buffer(layout, x), zdz = at::empty({sz.m}, stat_options(c));
  ops::gemm_swiglu_backward(bf(dx_out), bf(w_down), bf(z), bf_out(dz), bf_out(a),
                            f32_out(partials), m, inter, hidden, s);
  ops::zdz_fold(f32(partials), layout, hidden, f32_out(zdz), s);
  Tensor dw_down = weight_grad(dx_out, a);
  // B1 with W_gu: dx = dx_out (the residual, unless mlp_partial) + norm backward; dW_gu = dzᵀ · h_out.
  Tensor dgamma32 = at::empty({sz.hidden}, stat_options(c));
  Tensor dx = residual ? at::empty_like(x) : at::zeros_like(x);
  const Tensor h_out =
      rmsnorm_backward(dz, w_gu, x, r, gamma, zdz, residual ? dx_out : dx, dx, dgamma32);
  return {dx, dgamma32.to(gamma.scalar_type()), weight_grad(dz, h_out), dw_down};
}

std::tuple<Tensor, Tensor, Tensor> lm_head_loss_backward(
    const Tensor& dloss, const Tensor& x, const Tensor& gamma, const Tensor& w_vocab,
    const Tensor& h, const Tensor& r, const Tensor& targets, const Tensor& lse,
    int64_t ignore_index, c10::string_view reduction, double z_loss, int64_t max_chunk_bytes) {
  const auto c = OpContext::from(op_names::lm_head_loss_backward, "x", x);
  const auto sz = validate_lm_head_loss_backward(c, dloss, x, gamma, w_vocab, h, r, targets, lse,
                                                 reduction, max_chunk_bytes);
  const auto red = sz.reduction;
  const int64_t m = sz.m, vocab = sz.vocab, hidden = sz.hidden;
  as_int(c.op, "M", m);
  const c10::cuda::CUDAGuard guard(x.device());
  const auto s = stream_of(x);

  const Tensor scale = token_scale(dloss, targets.ne(ignore_index), red, m);

  // The vocabulary is processed in slices so that the backward's scratch stays within
  // max_chunk_bytes: dℓ for every token and one slice of columns (M × slice, bf16), plus, when
  // sliced, an fp32 dx accumulator and B1's h_out (M × H × 6 bytes; dx itself is the output).
  // Per slice:
  //   B4  dℓ[:, slice] recomputed from h, with the slice's share of ZdZ;
  //   B1  the final norm's backward of g_s = dℓ[:, slice] · W[slice] — linear in (g, ZdZ), so
  //       the slices' dx and dγ add up (fp32), each slice rounded once to bf16 by B1;
  //   dW[slice] = dℓ[:, slice]ᵀ · h_out: exact, one GEMM over all tokens, written in place
  //       (no fp32 V × H accumulator).
  const auto st = stat_options(c);
  const int64_t sliced_scratch = m * hidden * 6;
  int64_t slice = vocab;
  if (m * vocab * 2 > max_chunk_bytes) {
    slice = std::max<int64_t>(0, max_chunk_bytes - sliced_scratch) / (m * 2) / 8 * 8;
    slice = std::clamp<int64_t>(slice, 8, vocab);
  }
  const bool sliced = slice < vocab;
  Tensor dl_buf = at::empty({m * slice}, x.options());
  Tensor dw = at::empty_like(w_vocab, at::MemoryFormat::Contiguous);
  Tensor dx = at::zeros_like(x), dgamma32 = at::zeros({hidden}, st);
  Tensor dx32 = sliced ? at::zeros(x.sizes(), st) : Tensor();
  Tensor dgamma_s = sliced ? at::empty({hidden}, st) : dgamma32;
  for (int64_t v0 = 0; v0 < vocab; v0 += slice) {
    const int64_t vs = std::min(slice, vocab - v0);
    Tensor dl = dl_buf.narrow(0, 0, m * vs).view({m, vs});
    Tensor w_s = w_vocab.narrow(0, v0, vs);
    // B4 matches targets against the slice's own column indices.
    Tensor t_s = v0 == 0 ? targets : (targets - v0);
    const auto layout = ops::cross_entropy_backward_partials_layout(int(m), int(vs), int(hidden));
    Tensor partials = partial_buffer(layout, x), zdz = at::empty({m}, st);
    ops::gemm_rmsnorm_cross_entropy_backward(
        bf(h), bf(w_s), f32(r), f32(lse), f32(scale), t_s.data_ptr<int64_t>(), float(z_loss),
        bf_out(dl), f32_out(partials), int(m), int(vs), int(hidden), s);
    ops::zdz_fold(f32(partials), layout, int(hidden), f32_out(zdz), s);
    if (sliced && v0 > 0) dx.zero_();  // dx: the slice's dres and output; the sum is dx32
    const Tensor h_out = rmsnorm_backward(dl, w_s, x, r, gamma, zdz, dx, dx, dgamma_s);
    ops::gemm_xty(bf(dl), bf(h_out), bf_out(dw) + v0 * hidden, int(vs), int(hidden), int(m), s);
    if (sliced) {
      dx32.add_(dx);
      dgamma32.add_(dgamma_s);
    }
  }
  if (sliced) {
    dl_buf = Tensor();
    dx.copy_(dx32);
  }
  return {dx, dgamma32.to(gamma.scalar_type()), dw};
}

}  // namespace

void scale_grad_(const Tensor& t, const Tensor& g) {
  TORCH_CHECK(g.numel() == 1, "coda::scale_grad_: g must have one element, got ", g.numel());
  TORCH_CHECK(g.device() == t.device(), "coda::scale_grad_: g must be on ", t.device(), ", got ",
              g.device());
  const c10::cuda::CUDAGuard guard(t.device());
  if (t.scalar_type() != at::kBFloat16 || !t.is_contiguous()) {
    const_cast<Tensor&>(t).mul_(g.reshape({}));
    return;
  }
  const Tensor g32 = g.reshape({}).to(at::kFloat).contiguous();
  kernel::scale_bf16_unless_one(reinterpret_cast<bf16*>(t.data_ptr()), t.numel(), f32(g32),
                                stream_of(t));
}

TORCH_LIBRARY_IMPL(coda, CUDA, m) {
  CODA_REGISTER_KERNELS(m)
  m.impl("scale_grad_", &scale_grad_);
}

}  // namespace coda::torch_ext
