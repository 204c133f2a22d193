#pragma once
// The block ops in blockwise FP8 (docs/math.md §6), forward and backward, written once over a
// backend B (block/compose.hpp's, plus the FP8 programs below). Every projection GEMM runs on FP8
// operands; each FP8 operand comes from the epilogue that produced it (F1's h, F2's a, B2's dz)
// or from one cast pass (the attention output, and at these op boundaries the gradients that
// autograd hands over in bf16: the residual stream's and the attention's); the weights come
// quantized (once per optimizer step, by the caller). Weight gradients contract the transposed
// 128x1 copies over the tokens: of the GEMM's input as the GEMM saw it, i.e. of a (F2 keeps it
// from the forward pass) and y (the out-projection's cast keeps it), and of the normalized input
// h_out = r·(x ⊙ γ) of a norm's consumer, which B1 recomputes and quantizes (F1's h is x ⊙ γ: its
// r comes after the fold), as the bf16 B1 recomputes h_out.
//
// Beyond block/compose.hpp's backend, B provides (each returning its outputs; `Fp8` holds codes,
// scales, codes_t, scales_t, the ones not asked for empty):
//   fp8_cast(x, rows, transposed) -> Fp8                         the cast pass
//   fp8_gemm(a, w_codes, w_scales) -> T                          a (1x128) · w (128x128)ᵀ
//   fp8_wgrad(dz, h) -> T                                        dzᵀ · h over their 128x1 copies
//   fp8_residual_rmsnorm(a, w, residual, gamma) -> (x, h, partials)         F1, h's rows
//   fp8_residual_rmsnorm_act_h(a, w, residual, gamma) -> (x, h, partials)   F1, h unquantized
//   fp8_rmsnorm_swiglu(h, w, r, copy, fp8_z) -> (z, z_scales, a)            F2, a's rows and
//                                                                           (copy) its copy; z
//                                                                           in FP8 (fp8_z: its
//                                                                           codes, and scales)
//   fp8_rmsnorm_rope(h, w, r, bias, pos, rope_table) -> qkv                 F3
//   fp8_rmsnorm_qk_norm_rope(h, w, r, q_gamma, k_gamma, qk, pos, rope_table) -> (qkv, qk_pre)
//                                                                           F3q
//   fp8_rmsnorm_backward(dz, w, x, r, gamma, zdz, dres) -> (dx, h_out, partials)   B1 (Wᵀ's
//                                                                      codes), h_out's copy
//   fp8_swiglu_copy(z, z_scales) -> Fp8       a = silu(g)·u of z, rounded, as its copy (only
//                                             codes_t, scales_t): a not kept by the forward
//   fp8_swiglu_backward(dx_out, w_down, z, z_scales) -> (dz, partials)      B2 (W_downᵀ's), dz
//                                                                           both copies
// and may provide
//   fp8_rope_backward(qkv, dqkv, pos, rope_table) -> (dpre, partials)       B3 and the cast of
//                                                                           its output in one
//                                                                           pass (no bias; ZdZ
//                                                                           partials for zdz_fold)
// (z_scales empty: z in the activation dtype; else z's codes and their 1x128 scales)

#include <cstdint>

#include "coda/block/compose.hpp"

namespace coda::block {

// A tensor in blockwise FP8: an activation's 1x128 codes and scales with its transposed 128x1
// copy, or a weight's 128x128 codes and scales with its transpose's (the same blocks).
template <class Tensor>
struct Fp8Tensors {
  Tensor codes, scales, codes_t, scales_t;
};
template <class B>
using Fp8 = Fp8Tensors<T<B>>;

template <class B>
struct Fp8Norm {  // a residual stream value and its norm's caches, h quantized
  T<B> x;
  Fp8<B> h;
  T<B> r;
};

// F1 + A1 on FP8 operands: x = a · Wᵀ + residual;  h = x ⊙ γ quantized;  r.
template <class B>
Fp8Norm<B> fp8_residual_rmsnorm(B& b, const Fp8<B>& a, const Fp8<B>& w, const T<B>& residual,
                                const T<B>& gamma, double eps) {
  auto [x, h, s] = b.fp8_residual_rmsnorm(a, w, residual, gamma);
  Fp8Norm<B> o{x, h, b.stat(b.rows(x))};
  b.rmsnorm_fold(s, b.cols(x), eps, o.r);
  return o;
}

template <class B>
struct Fp8OutProj {
  Fp8Norm<B> out;
  Fp8<B> y;  // the input's transposed copy (codes_t, scales_t), for dW_o
};

// The out-projection: y cast (its rows for the GEMM; with `copies` its copy for the weight
// gradient, which no backward needs without it), then F1.
template <class B>
Fp8OutProj<B> fp8_out_proj_residual_norm(B& b, const T<B>& y, const Fp8<B>& w_o,
                                         const T<B>& residual, const T<B>& gamma, double eps,
                                         bool copies = true) {
  const Fp8<B> yq = b.fp8_cast(y, true, copies);
  return {fp8_residual_rmsnorm(b, yq, w_o, residual, gamma, eps), yq};
}

template <class B>
struct Fp8Linear {
  T<B> out;      // y · Wᵀ in the activation dtype
  Fp8<B> input;  // y's transposed copy (codes_t, scales_t), for dW
};

// y · Wᵀ on FP8 operands, no epilogue: y cast once (its rows for the GEMM, its copy for the
// weight gradient; without `copies` its rows only: no backward). Tensor parallelism's
// row-parallel out-projection, whose residual add and norm follow the reduce-scatter of `out`;
// its backward is fp8_linear_backward.
template <class B>
Fp8Linear<B> fp8_linear(B& b, const T<B>& y, const Fp8<B>& w, bool copies = true) {
  const Fp8<B> yq = b.fp8_cast(y, true, copies);
  return {b.fp8_gemm(yq, w.codes, w.scales), yq};
}

template <class B>
struct Fp8Mlp {
  Fp8Norm<B> out;  // x_out, h_out quantized (empty with act_h_out), r_out
  T<B> h_act;      // with act_h_out: h_out unquantized (the LM head's input); else empty
  T<B> z;          // F2's pre-activation, saved for the backward: in the activation dtype, or
  T<B> z_scales;   // (fp8_z) its 1x128 codes with these scales; else empty
  Fp8<B> a;        // F2's a; its copy (codes_t, scales_t) is the down-projection's dW operand
};

// F2 then F1 + A1 on FP8 operands. With act_h_out the next norm's h stays in the activation dtype
// (the last layer's, for the LM head, which stays in bf16); without `copies` F2 writes a's rows
// only (no backward); with `recompute_a` too, and the backward makes a's copy from z
// (fp8_mlp_backward): I + I/32 bytes fewer kept per token for one more pass over z. With `fp8_z`
// F2 quantizes z as well (1x128 blocks of the bf16 z) instead of writing it in bf16: 2I + 2I/32
// bytes kept per token instead of 4I; the backward decodes it (B2, and a's copy).
template <class B>
Fp8Mlp<B> fp8_mlp(B& b, const T<B>& x, const Fp8<B>& h, const T<B>& r, const Fp8<B>& w_gu,
                  const Fp8<B>& w_down, const T<B>& gamma_next, double eps, bool act_h_out,
                  bool copies = true, bool recompute_a = false, bool fp8_z = false) {
  auto [z, z_scales, a] = b.fp8_rmsnorm_swiglu(h, w_gu, r, copies && !recompute_a, fp8_z);
  Fp8Mlp<B> o{{}, {}, z, z_scales, a};
  if (act_h_out) {
    auto [x2, h2, s] = b.fp8_residual_rmsnorm_act_h(a, w_down, x, gamma_next);
    o.out = {x2, {}, b.stat(b.rows(x2))};
    o.h_act = h2;
    b.rmsnorm_fold(s, b.cols(x2), eps, o.out.r);
  } else {
    o.out = fp8_residual_rmsnorm(b, a, w_down, x, gamma_next, eps);
  }
  return o;
}

template <class B>
struct Fp8MlpPartial {
  T<B> y;         // this rank's share of the MLP branch, a · W_downᵀ, in the activation dtype
  T<B> z;         // F2's pre-activation, saved for the backward: in the activation dtype, or
  T<B> z_scales;  // (fp8_z) its 1x128 codes with these scales; else empty
  Fp8<B> a;       // F2's a; its copy (codes_t, scales_t) is the down-projection's dW operand
};

// F2 then the plain FP8 GEMM: the MLP branch alone, y = a · W_downᵀ, no residual add and no
// next norm (tensor parallelism: each rank's y is its share of the sum, reduced before the add;
// docs/tensor-parallel.md). Its backward is fp8_mlp_backward without the residual.
// `copies`, `recompute_a`, `fp8_z`: as fp8_mlp's.
template <class B>
Fp8MlpPartial<B> fp8_mlp_partial(B& b, const Fp8<B>& h, const T<B>& r, const Fp8<B>& w_gu,
                                 const Fp8<B>& w_down, bool copies = true, bool recompute_a = false,
                                 bool fp8_z = false) {
  auto [z, z_scales, a] = b.fp8_rmsnorm_swiglu(h, w_gu, r, copies && !recompute_a, fp8_z);
  return {b.fp8_gemm(a, w_down.codes, w_down.scales), z, z_scales, a};
}

// F3 on FP8 operands: qkv = rope(r ⊙ (h · W_qkvᵀ) + b_qkv).
template <class B>
T<B> fp8_norm_qkv(B& b, const Fp8<B>& h, const T<B>& r, const Fp8<B>& w_qkv, const T<B>& b_qkv,
                  const auto& pos, const auto& rope_table) {
  return b.fp8_rmsnorm_rope(h, w_qkv, r, b_qkv, pos, rope_table);
}

// F3q on FP8 operands: qkv = rope(qk_norm(r ⊙ (h · W_qkvᵀ))) on the Q and K heads, and qk_pre
// (norm_qkv_qk_norm's, from h's rows and W_qkv's codes).
template <class B>
QkNormQkv<B> fp8_norm_qkv_qk_norm(B& b, const Fp8<B>& h, const T<B>& r, const Fp8<B>& w_qkv,
                                  const T<B>& q_gamma, const T<B>& k_gamma,
                                  const programs::QkNorm& qk, const auto& pos,
                                  const auto& rope_table) {
  auto [qkv, qk_pre] =
      b.fp8_rmsnorm_qk_norm_rope(h, w_qkv, r, q_gamma, k_gamma, qk, pos, rope_table);
  return {qkv, qk_pre};
}

// ---- backward -------------------------------------------------------------------------------

// B1 + dγ fold on FP8 operands: dx = dres + r·(g·γ − x·r·ZdZ), g = dz · W from dz's rows and
// Wᵀ's codes; dW = dzᵀ · h_out from dz's copy and B1's copy of h_out. dx stays in the activation
// dtype.
template <class B>
InputGrads<B> fp8_rmsnorm_backward(B& b, const Fp8<B>& dz, const Fp8<B>& w, const T<B>& x,
                                   const T<B>& r, const T<B>& gamma, const T<B>& zdz,
                                   const T<B>& dres) {
  auto [dx, h_out, p] = b.fp8_rmsnorm_backward(dz, w, x, r, gamma, zdz, dres);
  T<B> dgamma = b.stat(b.cols(x));
  b.dgamma_fold(p, dgamma);
  return {dx, b.param_like(dgamma, gamma), b.fp8_wgrad(dz, h_out), {}};
}

// dy = dout · W, dW = doutᵀ · input: the out-projection's backward, dout cast once for both.
template <class B>
InputGrads<B> fp8_linear_backward(B& b, const T<B>& dout, const Fp8<B>& input, const Fp8<B>& w,
                                  const T<B>& input_act = {}) {
  const Fp8<B> d = b.fp8_cast(dout, true, true);
  const Fp8<B> in = b.present(input.codes_t) ? input : b.fp8_cast(input_act, false, true);
  return {b.fp8_gemm(d, w.codes_t, w.scales_t), {}, b.fp8_wgrad(d, in), {}};
}

// B2 (+ dW_down) → B1 (+ dW_gu): fp8_mlp's backward, dx_out cast once (B2's A, dW_down's B);
// the residual add's gradient enters B1 as dres (`residual`; fp8_mlp_partial's backward has no
// residual add: dx is then the branch's alone). dw = dW_gu, dw2 = dW_down. `a` holds a's copy
// as F2 wrote it, or nothing (recompute_a): then it is made from z here, as the bf16 B2
// recomputes a. z as fp8_mlp saved it (z_scales empty: in the activation dtype).
template <class B>
InputGrads<B> fp8_mlp_backward(B& b, const T<B>& dx_out, const T<B>& x, const T<B>& gamma,
                               const Fp8<B>& w_gu, const Fp8<B>& w_down, const T<B>& r,
                               const T<B>& z, const T<B>& z_scales, const Fp8<B>& a,
                               bool residual = true) {
  const int64_t m = b.rows(x), hidden = b.cols(x);
  const Fp8<B> dxo = b.fp8_cast(dx_out, true, true);
  auto [dz, p] = b.fp8_swiglu_backward(dxo, w_down, z, z_scales);
  T<B> zdz = b.stat(m);
  b.zdz_fold(p, hidden, zdz);
  T<B> dw_down = b.fp8_wgrad(dxo, b.present(a.codes_t) ? a : b.fp8_swiglu_copy(z, z_scales));
  InputGrads<B> g = fp8_rmsnorm_backward(b, dz, w_gu, x, r, gamma, zdz, residual ? dx_out : T<B>{});
  g.dw2 = dw_down;
  return g;
}

// B3 → cast → B1 (+ dW_qkv; db_qkv = Σ_tokens of B3's output with a bias): fp8_norm_qkv's
// backward; B3 and the cast in one pass where the backend has it and there is no bias. dx
// excludes the residual stream's own gradient.
template <class B>
InputGrads<B> fp8_norm_qkv_backward(B& b, const T<B>& dqkv, const T<B>& qkv, const T<B>& x,
                                    const T<B>& gamma, const Fp8<B>& w_qkv, const T<B>& b_qkv,
                                    const T<B>& r, const auto& pos, const auto& rope_table) {
  const int64_t hidden = b.cols(x);
  // No dres: autograd adds the residual stream's own gradient.
  if constexpr (requires { b.fp8_rope_backward(qkv, dqkv, pos, rope_table); }) {
    if (!b.present(b_qkv)) {  // B3 and its cast in one pass: dpre never stored in bf16
      auto [dp, p] = b.fp8_rope_backward(qkv, dqkv, pos, rope_table);
      T<B> zdz = b.stat(b.rows(qkv));
      b.zdz_fold(p, hidden, zdz);
      return fp8_rmsnorm_backward(b, dp, w_qkv, x, r, gamma, zdz, T<B>{});
    }
  }
  const RopeGrad<B> d = qkv_rope_backward(b, dqkv, qkv, b_qkv, hidden, pos, rope_table);
  const Fp8<B> dp = b.fp8_cast(d.dpre, true, true);
  InputGrads<B> g = fp8_rmsnorm_backward(b, dp, w_qkv, x, r, gamma, d.zdz, T<B>{});
  g.dbias = d.dbias;
  return g;
}

// B3q → cast → B1 (+ dW_qkv, dγ_q, dγ_k): fp8_norm_qkv_qk_norm's backward (B3q in the activation
// dtype, as in bf16). dx excludes the residual stream's own gradient.
template <class B>
InputGrads<B> fp8_norm_qkv_qk_norm_backward(B& b, const T<B>& dqkv, const T<B>& qkv,
                                            const T<B>& qk_pre, const T<B>& x, const T<B>& gamma,
                                            const Fp8<B>& w_qkv, const T<B>& q_gamma,
                                            const T<B>& k_gamma, const programs::QkNorm& qk,
                                            const T<B>& r, const auto& pos,
                                            const auto& rope_table) {
  const RopeGrad<B> d = qkv_qk_norm_rope_backward(b, dqkv, qkv, qk_pre, q_gamma, k_gamma, qk,
                                                  b.cols(x), pos, rope_table);
  const Fp8<B> dp = b.fp8_cast(d.dpre, true, true);
  // No dres: autograd adds the residual stream's own gradient.
  InputGrads<B> g = fp8_rmsnorm_backward(b, dp, w_qkv, x, r, gamma, d.zdz, T<B>{});
  g.dq_gamma = d.dq_gamma;
  g.dk_gamma = d.dk_gamma;
  return g;
}

}  // namespace coda::block
