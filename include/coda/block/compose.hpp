#pragma once
// The composition of every block op, forward and backward (docs/math.md, "The block"): which
// programs run, which partial buffers they write, which folds finish them. Written once, over a
// backend B that runs the programs:
//   - reference::HostBackend (include/coda/reference/host_backend.hpp): the CPU reference
//     executor on host tensors (the reference decoder, reference/llama.hpp);
//   - torch_ext::CpuBackend (torch/backends.hpp), CudaBackend (torch/backend_cuda.hpp): the
//     PyTorch op kernels, on the reference executor or on the Hopper kernels of
//     include/coda/ops.hpp.
//
// A backend provides
//   using Tensor;  rows(t), cols(t);  act(rows, cols), stat(n), zeros_stat;
//   rows_of(t, first, count);  leading(t, rows, cols): a contiguous (rows, cols) matrix over the
//   start of t's storage;  zeros_stat(rows, cols): an fp32 (stat dtype) matrix;
//   partials(PartialsOf, m, n, k) (a (tiles, extent) buffer);
//   one method per program and fold of ops.hpp, with the same names and argument order;
//   weight_grad(dz, h, dw, accumulate): dW (+)= dzᵀ·h;
//   add_(acc, v), copy_(dst, src);  param_like(fp32 vector, like): in `like`'s dtype;
//   act_bytes(): bytes per activation element (the LM head's scratch budget);
//   token_scale, reduce_loss, targets_minus (the loss's per-token bookkeeping, on the device).
// Integer tensors (positions, targets) and the RoPE table pass through as the backend's types.

#include <algorithm>
#include <cstdint>

#include "coda/common/check.hpp"
#include "coda/programs/forward.hpp"

namespace coda::block {

// The partial buffer of a program: its layout follows the tile the program's kernel runs on.
enum class PartialsOf {
  kResidualRmsnorm,       // F1 Σx², per row
  kRmsnormBackward,       // B1 dγ, per column
  kSwigluBackward,        // B2 ZdZ, per row
  kLmHead,                // F4 (max, Σexp), per row
  kLmHeadLogits,          // F4 storing logits, per row
  kCrossEntropyBackward,  // B4 Σ ℓ·dℓ, per row
};

struct LossOptions {
  programs::CrossEntropyOptions ce;            // ignore_index, reduction, z_loss
  int64_t max_chunk_bytes = int64_t(1) << 30;  // the LM head's scratch budget
  // lm_head_loss_grad forms lse and dℓ with one row kernel over the plain GEMM's logits up to
  // this hidden size, and with F4 storing logits above it.
  int64_t row_kernel_max_hidden = 2048;
};

template <class B>
using T = typename B::Tensor;

template <class B>
struct Norm {  // a residual stream value and its norm's caches
  T<B> x, h, r;
};

// ---- forward --------------------------------------------------------------------------------

// F0: h = x ⊙ γ, r = rsqrt(mean x² + eps) (the first layer: no GEMM before it).
template <class B>
Norm<B> rmsnorm_stats(B& b, const T<B>& x, const T<B>& gamma, double eps) {
  Norm<B> o{x, b.act(b.rows(x), b.cols(x)), b.stat(b.rows(x))};
  b.first_layer_rmsnorm(x, gamma, eps, o.h, o.r);
  return o;
}

// F1 + A1: x = a · Wᵀ + residual;  h = x ⊙ γ;  r = rsqrt(mean x² + eps).
template <class B>
Norm<B> residual_rmsnorm(B& b, const T<B>& a, const T<B>& w, const T<B>& residual,
                         const T<B>& gamma, double eps) {
  const int64_t m = b.rows(a), n = b.rows(w), k = b.cols(a);
  const T<B> s = b.partials(PartialsOf::kResidualRmsnorm, m, n, k);
  Norm<B> o{b.act(m, n), b.act(m, n), b.stat(m)};
  b.gemm_residual_rmsnorm_partial(a, w, residual, gamma, o.x, o.h, s);
  b.rmsnorm_fold(s, n, eps, o.r);
  return o;
}

// F3: qkv = rope(r ⊙ (h · W_qkvᵀ) + b_qkv); b_qkv (the q/k/v bias) may be absent.
template <class B>
T<B> norm_qkv(B& b, const T<B>& h, const T<B>& r, const T<B>& w_qkv, const T<B>& b_qkv,
              const auto& pos, const auto& rope_table) {
  T<B> qkv = b.act(b.rows(h), b.rows(w_qkv));
  b.gemm_rmsnorm_rope(h, w_qkv, r, b_qkv, pos, rope_table, qkv);
  return qkv;
}

template <class B>
struct QkNormQkv {  // F3 with QK-norm: the attention's input and the saved pre-norm Q, K
  T<B> qkv, qk_pre;
};

// F3 with QK-norm (Qwen3): qkv = rope(qk_norm(r ⊙ (h · W_qkvᵀ))) on the Q and K heads; qk_pre, the
// Q and K columns before their norm, is what the backward reads.
template <class B>
QkNormQkv<B> norm_qkv_qk_norm(B& b, const T<B>& h, const T<B>& r, const T<B>& w_qkv,
                              const T<B>& q_gamma, const T<B>& k_gamma, const programs::QkNorm& qk,
                              const auto& pos, const auto& rope_table) {
  const int64_t m = b.rows(h);
  QkNormQkv<B> o{b.act(m, b.rows(w_qkv)), b.act(m, qk.normed_width())};
  b.gemm_rmsnorm_qk_norm_rope(h, w_qkv, r, q_gamma, k_gamma, qk, pos, rope_table, o.qkv, o.qk_pre);
  return o;
}

template <class B>
struct Swiglu {  // F2's outputs
  T<B> z, a;
};

// F2: z = r ⊙ (h · W_guᵀ) (interleaved gate/up), a = silu(z_g) · z_u.
template <class B>
Swiglu<B> rmsnorm_swiglu(B& b, const T<B>& h, const T<B>& r, const T<B>& w_gu) {
  const int64_t m = b.rows(h), two_i = b.rows(w_gu);
  Swiglu<B> o{b.act(m, two_i), b.act(m, two_i / 2)};
  b.gemm_rmsnorm_swiglu(h, w_gu, r, o.z, o.a);
  return o;
}

template <class B>
struct Mlp {
  Norm<B> out;  // x_out = x + swiglu(...)·W_downᵀ and the next norm's caches
  T<B> z;       // F2's pre-activation, saved for the backward
};

// F2 then F1 + A1: the MLP with its residual add and the next norm (gamma_next).
template <class B>
Mlp<B> mlp(B& b, const T<B>& x, const T<B>& h, const T<B>& r, const T<B>& w_gu, const T<B>& w_down,
           const T<B>& gamma_next, double eps) {
  Swiglu<B> f2 = rmsnorm_swiglu(b, h, r, w_gu);
  return {residual_rmsnorm(b, f2.a, w_down, x, gamma_next, eps), f2.z};
}

template <class B>
struct MlpPartial {
  T<B> y, z;
};

// F2 then the plain GEMM: the MLP branch alone, y = swiglu(...) · W_downᵀ (tensor parallelism).
template <class B>
MlpPartial<B> mlp_partial(B& b, const T<B>& h, const T<B>& r, const T<B>& w_gu,
                          const T<B>& w_down) {
  Swiglu<B> f2 = rmsnorm_swiglu(b, h, r, w_gu);
  T<B> y = b.act(b.rows(h), b.rows(w_down));
  b.gemm(f2.a, w_down, y);
  return {y, f2.z};
}

template <class B>
struct Loss {
  T<B> loss, lse;
};

// F4 + A2: the loss without materializing logits.
template <class B>
Loss<B> lm_head_loss(B& b, const T<B>& h, const T<B>& r, const T<B>& w_vocab, const auto& targets,
                     const LossOptions& o) {
  const int64_t m = b.rows(h), vocab = b.rows(w_vocab), hidden = b.cols(h);
  const T<B> pmax = b.partials(PartialsOf::kLmHead, m, vocab, hidden);
  const T<B> psum = b.partials(PartialsOf::kLmHead, m, vocab, hidden);
  T<B> target_logit = b.zeros_stat(m), lse = b.stat(m), token_loss = b.stat(m);
  b.gemm_rmsnorm_lse(h, w_vocab, r, targets, pmax, psum, target_logit);
  b.lse_loss_fold(pmax, psum, target_logit, targets, vocab, o.ce.ignore_index, o.ce.z_loss, lse,
                  token_loss);
  return {b.reduce_loss(token_loss, targets, o), lse};
}

// ---- backward -------------------------------------------------------------------------------

template <class B>
struct NormGrad {  // B1's results
  T<B> h_out;      // the normalized input x·r·γ, for the weight gradient
  T<B> dgamma;     // fp32 (stat dtype)
};

// B1 + dγ fold: dx = dres + r·(g·γ − x·r·ZdZ) with g = dz · W (dx may alias dres; an absent
// dres, T<B>{}, adds nothing and is not read: where no residual gradient enters).
template <class B>
NormGrad<B> rmsnorm_backward(B& b, const T<B>& dz, const T<B>& w, const T<B>& x, const T<B>& r,
                             const T<B>& gamma, const T<B>& zdz, const T<B>& dres, T<B>& dx) {
  const int64_t m = b.rows(x), hidden = b.cols(x), n_out = b.cols(dz);
  const T<B> p = b.partials(PartialsOf::kRmsnormBackward, m, hidden, n_out);
  NormGrad<B> o{b.act(m, hidden), b.stat(hidden)};
  b.gemm_rmsnorm_backward(dz, w, x, r, gamma, zdz, dres, dx, o.h_out, p);
  b.dgamma_fold(p, o.dgamma);
  return o;
}

template <class B>
T<B> weight_grad(B& b, const T<B>& dz, const T<B>& h) {
  T<B> dw = b.act(b.cols(dz), b.cols(h));
  b.weight_grad(dz, h, dw, false);
  return dw;
}

template <class B>
struct InputGrads {  // gradients of a norm consumer: its input, the norm weight, its weights
  T<B> dx{}, dgamma{}, dw{}, dw2{};
  T<B> dbias{};                 // norm_qkv_backward with a q/k/v bias
  T<B> dq_gamma{}, dk_gamma{};  // norm_qkv_qk_norm_backward
};

template <class B>
struct RopeGrad {  // B3's pre-RoPE gradient and its ZdZ; the bias gradient, their column sum
  T<B> dpre{}, zdz{}, dbias{};
  T<B> dq_gamma{}, dk_gamma{};  // B3q's: the QK-norm weights' gradients
};

// B3, and db_qkv = Σ_tokens of its output when there is a bias: the first half of norm_qkv's
// backward in either precision.
template <class B>
RopeGrad<B> qkv_rope_backward(B& b, const T<B>& dqkv, const T<B>& qkv, const T<B>& b_qkv,
                              int64_t hidden, const auto& pos, const auto& rope_table) {
  const int64_t m = b.rows(qkv), width = b.cols(qkv);
  RopeGrad<B> o{b.act(m, width), b.stat(m), {}};
  b.rope_backward(qkv, dqkv, b_qkv, pos, rope_table, hidden, o.dpre, o.zdz);
  if (b.present(b_qkv)) {
    T<B> sum = b.stat(width);
    b.column_sum(o.dpre, sum);
    o.dbias = b.param_like(sum, b_qkv);
  }
  return o;
}

// B3 → B1 (+ dW_qkv, and db_qkv): the backward of norm_qkv. dx excludes the residual stream's
// own gradient.
template <class B>
InputGrads<B> norm_qkv_backward(B& b, const T<B>& dqkv, const T<B>& qkv, const T<B>& x,
                                const T<B>& gamma, const T<B>& w_qkv, const T<B>& b_qkv,
                                const T<B>& r, const auto& pos, const auto& rope_table) {
  const int64_t m = b.rows(x), hidden = b.cols(x);
  const RopeGrad<B> d = qkv_rope_backward(b, dqkv, qkv, b_qkv, hidden, pos, rope_table);
  T<B> dx = b.act(m, hidden);  // B1 writes it: no dres (autograd adds the residual's gradient)
  NormGrad<B> g = rmsnorm_backward(b, d.dpre, w_qkv, x, r, gamma, d.zdz, T<B>{}, dx);
  return {dx, b.param_like(g.dgamma, gamma), weight_grad(b, d.dpre, g.h_out), {}, d.dbias};
}

// B3q (RoPE and QK-norm backward), its ZdZ and the QK-norm weights' gradients: the first half of
// norm_qkv_qk_norm's backward in either precision.
template <class B>
RopeGrad<B> qkv_qk_norm_rope_backward(B& b, const T<B>& dqkv, const T<B>& qkv, const T<B>& qk_pre,
                                      const T<B>& q_gamma, const T<B>& k_gamma,
                                      const programs::QkNorm& qk, int64_t hidden, const auto& pos,
                                      const auto& rope_table) {
  const int64_t m = b.rows(qkv), d = qk.layout.head_dim;
  RopeGrad<B> o{b.act(m, b.cols(qkv)), b.stat(m)};
  T<B> dqg = b.stat(d), dkg = b.stat(d);
  b.qk_norm_rope_backward(qk_pre, qkv, dqkv, q_gamma, k_gamma, qk, pos, rope_table, hidden, o.dpre,
                          o.zdz, dqg, dkg);
  o.dq_gamma = b.param_like(dqg, q_gamma);
  o.dk_gamma = b.param_like(dkg, k_gamma);
  return o;
}

// B3 with QK-norm → B1 (+ dW_qkv, dγ_q, dγ_k): the backward of norm_qkv_qk_norm. dx excludes the
// residual stream's own gradient.
template <class B>
InputGrads<B> norm_qkv_qk_norm_backward(B& b, const T<B>& dqkv, const T<B>& qkv, const T<B>& qk_pre,
                                        const T<B>& x, const T<B>& gamma, const T<B>& w_qkv,
                                        const T<B>& q_gamma, const T<B>& k_gamma,
                                        const programs::QkNorm& qk, const T<B>& r, const auto& pos,
                                        const auto& rope_table) {
  const int64_t m = b.rows(x), hidden = b.cols(x);
  const RopeGrad<B> d = qkv_qk_norm_rope_backward(b, dqkv, qkv, qk_pre, q_gamma, k_gamma, qk,
                                                  hidden, pos, rope_table);
  T<B> dx = b.act(m, hidden);  // B1 writes it: no dres (autograd adds the residual's gradient)
  NormGrad<B> g = rmsnorm_backward(b, d.dpre, w_qkv, x, r, gamma, d.zdz, T<B>{}, dx);
  InputGrads<B> o{dx, b.param_like(g.dgamma, gamma), weight_grad(b, d.dpre, g.h_out), {}, {}};
  o.dq_gamma = d.dq_gamma;
  o.dk_gamma = d.dk_gamma;
  return o;
}

// dy = dout · W, dW = doutᵀ · input: a plain linear layer's backward (the out-projection).
template <class B>
InputGrads<B> linear_backward(B& b, const T<B>& dout, const T<B>& input, const T<B>& weight) {
  T<B> dinput = b.act(b.rows(dout), b.cols(weight));
  b.gemm_xw(dout, weight, dinput);
  return {dinput, {}, weight_grad(b, dout, input), {}};
}

// B2 (+ dW_down) → B1 (+ dW_gu): the backward of mlp (residual: dx_out also reaches x through
// the residual add) or of mlp_partial (it does not). dw = dW_gu, dw2 = dW_down.
template <class B>
InputGrads<B> mlp_backward(B& b, const T<B>& dx_out, const T<B>& x, const T<B>& gamma,
                           const T<B>& w_gu, const T<B>& w_down, const T<B>& r, const T<B>& z,
                           bool residual) {
  const int64_t m = b.rows(x), hidden = b.cols(x), inter = b.cols(w_down);
  T<B> dz = b.act(m, 2 * inter), a = b.act(m, inter), zdz = b.stat(m);
  const T<B> p = b.partials(PartialsOf::kSwigluBackward, m, inter, hidden);
  b.gemm_swiglu_backward(dx_out, w_down, z, dz, a, p);
  b.zdz_fold(p, hidden, zdz);
  T<B> dw_down = weight_grad(b, dx_out, a);
  T<B> dx = b.act(m, hidden);
  NormGrad<B> g = rmsnorm_backward(b, dz, w_gu, x, r, gamma, zdz, residual ? dx_out : T<B>{}, dx);
  return {dx, b.param_like(g.dgamma, gamma), weight_grad(b, dz, g.h_out), dw_down};
}

template <class B>
struct LossGrad {
  T<B> loss, lse, dx, dgamma, dw;
};

// The LM head's loss and its gradients for d loss = 1 (mean or sum), with no logits recomputed:
// per chunk of tokens (the chunk's logits are the scratch max_chunk_bytes bounds)
//   F4  the chunk's logits stored, with the (max, Σexp) partials and target logits; A2 lse and
//       the token losses; B4 dℓ formed in place from the stored logits, ZdZ per token. At
//       hidden <= row_kernel_max_hidden instead: the plain GEMM's logits, then one row kernel for
//       all three (F4's epilogue cost 1.46x its GEMM at hidden 2048: a 2048-deep mainloop cannot
//       hide it);
//   B1  dx of the chunk's rows (the final norm's backward) and the chunk's dγ;
//   dW += dℓᵀ · h_out (one rounding of dW per chunk, no fp32 V × H accumulator).
template <class B>
LossGrad<B> lm_head_loss_grad(B& b, const T<B>& x, const T<B>& gamma, const T<B>& w_vocab,
                              const T<B>& h, const T<B>& r, const auto& targets,
                              const LossOptions& o) {
  const int64_t m = b.rows(x), vocab = b.rows(w_vocab), hidden = b.cols(x);
  CODA_CHECK(o.ce.reduction != programs::Reduction::kNone,
             "lm_head_loss_grad: reduction must be mean or sum (with none the gradient depends "
             "on the incoming per-token gradient: use lm_head_loss and its backward)");
  const T<B> scale = b.token_scale(nullptr, targets, o, m);  // d loss = 1
  // Rows per chunk: the chunk's logits and B1's h_out within max_chunk_bytes; the tokens spread
  // evenly over the fewest chunks, each a multiple of 2048 rows where that fits (8 tiles of 256:
  // a partial group of 8 tile rows pads the swizzled tile order with idle tiles; 2816-row chunks
  // ran 34% slower at H 4096, M 8192), else of 128 or 8 rows (the per-token vectors the kernels
  // read start 16-byte aligned at every chunk), at least 8.
  int64_t rows = o.max_chunk_bytes / ((vocab + hidden) * b.act_bytes());
  const int64_t q = rows >= 2048 ? 2048 : rows >= 128 ? 128 : 8;
  rows = std::max<int64_t>(8, rows / q * q);
  const int64_t chunks = (m + rows - 1) / rows;
  const int64_t chunk = std::min((((m + chunks - 1) / chunks + q - 1) / q) * q, m);
  const bool row_kernel_lse = hidden <= o.row_kernel_max_hidden;
  T<B> logits = b.act(chunk, vocab);
  T<B> lse = b.stat(m), token_loss = b.stat(m), zdz = b.stat(chunk);
  T<B> target_logit = b.zeros_stat(row_kernel_lse ? 0 : m);
  T<B> dx = b.act(m, hidden);  // B1's output, per chunk (no dres: the LM head has no residual)
  T<B> dgamma = b.stat(hidden), dw = b.act(vocab, hidden);
  for (int64_t m0 = 0; m0 < m; m0 += chunk) {
    const int64_t mc = std::min(chunk, m - m0);
    const T<B> hc = b.rows_of(h, m0, mc), rc = b.rows_of(r, m0, mc);
    const auto tc = b.rows_of(targets, m0, mc);
    T<B> lc = b.rows_of(logits, 0, mc), zc = b.rows_of(zdz, 0, mc);
    T<B> lse_c = b.rows_of(lse, m0, mc), loss_c = b.rows_of(token_loss, m0, mc);
    const T<B> sc = b.rows_of(scale, m0, mc);
    if (row_kernel_lse) {
      b.gemm(hc, w_vocab, lc);
      b.cross_entropy_from_unscaled_logits(lc, hc, w_vocab, rc, tc, o.ce.ignore_index, o.ce.z_loss,
                                           sc, lse_c, loss_c, zc);
    } else {
      const T<B> pmax = b.partials(PartialsOf::kLmHeadLogits, mc, vocab, hidden);
      const T<B> psum = b.partials(PartialsOf::kLmHeadLogits, mc, vocab, hidden);
      T<B> tl = b.rows_of(target_logit, m0, mc);
      b.gemm_rmsnorm_lse_logits(hc, w_vocab, rc, tc, pmax, psum, tl, lc);
      b.lse_loss_fold(pmax, psum, tl, tc, vocab, o.ce.ignore_index, o.ce.z_loss, lse_c, loss_c);
      b.cross_entropy_backward_from_logits(lc, lse_c, sc, tc, tl, o.ce.z_loss, hidden, zc);
    }
    T<B> dx_c = b.rows_of(dx, m0, mc);
    NormGrad<B> g =
        rmsnorm_backward(b, lc, w_vocab, b.rows_of(x, m0, mc), rc, gamma, zc, T<B>{}, dx_c);
    if (m0 == 0)
      b.copy_(dgamma, g.dgamma);
    else
      b.add_(dgamma, g.dgamma);
    b.weight_grad(lc, g.h_out, dw, m0 > 0);
  }
  return {b.reduce_loss(token_loss, targets, o), lse, dx, b.param_like(dgamma, gamma), dw};
}

// The LM head's backward for an incoming d loss (any reduction), recomputing the logits: the
// vocabulary is processed in slices so that the scratch stays within max_chunk_bytes (dℓ for
// every token and one slice of columns, plus, when sliced, an fp32 dx accumulator and B1's h_out:
// M × H × (4 + act_bytes) bytes; dx itself is the output). Per slice:
//   B4  dℓ[:, slice] recomputed from h, with the slice's share of ZdZ;
//   B1  the final norm's backward of g_s = dℓ[:, slice] · W[slice]: linear in (g, ZdZ), so the
//       slices' dx and dγ add up (fp32), each slice rounded once by B1;
//   dW[slice] = dℓ[:, slice]ᵀ · h_out: one GEMM over all tokens, written in place.
template <class B>
InputGrads<B> lm_head_loss_backward(B& b, const T<B>& dloss, const T<B>& x, const T<B>& gamma,
                                    const T<B>& w_vocab, const T<B>& h, const T<B>& r,
                                    const auto& targets, const T<B>& lse, const LossOptions& o) {
  const int64_t m = b.rows(x), vocab = b.rows(w_vocab), hidden = b.cols(x);
  const T<B> scale = b.token_scale(&dloss, targets, o, m);
  const int64_t bytes = b.act_bytes(), sliced_scratch = m * hidden * (4 + bytes);
  int64_t slice = vocab;
  if (m * vocab * bytes > o.max_chunk_bytes) {
    slice = std::max<int64_t>(0, o.max_chunk_bytes - sliced_scratch) / (m * bytes) / 8 * 8;
    slice = std::clamp<int64_t>(slice, 8, vocab);
  }
  const bool sliced = slice < vocab;
  T<B> dl_buf = b.act(m, slice), dw = b.act(vocab, hidden);
  T<B> dx = b.act(m, hidden), dgamma = b.zeros_stat(hidden);
  T<B> dx32 = b.zeros_stat(sliced ? m : 0, hidden);
  for (int64_t v0 = 0; v0 < vocab; v0 += slice) {
    const int64_t vs = std::min(slice, vocab - v0);
    T<B> dl = b.leading(dl_buf, m, vs);  // contiguous (m, vs) at the buffer's start
    const T<B> w_s = b.rows_of(w_vocab, v0, vs);
    // B4 matches targets against the slice's own column indices.
    const auto t_s = b.targets_minus(targets, v0);
    const T<B> p = b.partials(PartialsOf::kCrossEntropyBackward, m, vs, hidden);
    T<B> zdz = b.stat(m);
    b.gemm_rmsnorm_cross_entropy_backward(h, w_s, r, lse, scale, t_s, o.ce.z_loss, dl, p);
    b.zdz_fold(p, hidden, zdz);
    // dx: the slice's B1 output (no dres); the slices' sum is dx32
    NormGrad<B> g = rmsnorm_backward(b, dl, w_s, x, r, gamma, zdz, T<B>{}, dx);
    T<B> dw_s = b.rows_of(dw, v0, vs);
    b.weight_grad(dl, g.h_out, dw_s, false);
    b.add_(dgamma, g.dgamma);
    if (sliced) b.add_(dx32, dx);
  }
  if (sliced) b.copy_(dx, dx32);
  return {dx, b.param_like(dgamma, gamma), dw, {}};
}

}  // namespace coda::block
