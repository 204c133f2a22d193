// The block ops in blockwise FP8 (docs/torch-ops.md, "FP8 block ops"; docs/math.md §6): schemas,
// the CPU and CUDA kernels (one definition each: block/compose_fp8.hpp on the tensors' backend,
// the FP8 programs of torch/fp8_ops.hpp) and C++ autograd; their Meta kernels are in
// torch/fp8_block_meta.cpp. They mirror out_proj_residual_norm, mlp and norm_qkv, with every
// projection GEMM on FP8 operands: each weight comes with its FP8 operands, made once per
// optimizer step by the caller (the 128x128 codes and scales of w, and of wᵀ or None: the
// backward transposes w's codes then, so wᵀ's exist only while it runs), and the norms' h travels
// quantized (its 1x128 rows, the next GEMM's A; the weight gradients' copy of the normalized
// input comes from B1 in the backward). The residual stream, r, z and the gradients autograd
// hands between ops stay in the activation dtype.
#include <torch/autograd.h>
#include <torch/csrc/autograd/autograd_not_implemented_fallback.h>
#include <torch/library.h>

#include <optional>
#include <string>
#include <tuple>

#include "coda/kernel/args.hpp"
#include "on_backend.hpp"
#include "typed_op.hpp"
#include "validate.hpp"

namespace coda::torch_ext {
namespace {

using at::Tensor;
using kernel::ScaleLayout;
using Fp8 = block::Fp8Tensors<Tensor>;

int64_t blocks(int64_t n) { return ScaleLayout::blocks(n); }

// ---- argument checks ------------------------------------------------------------------------

void check_codes(const OpContext& c, const char* name, const Tensor& t, int64_t rows,
                 int64_t cols) {
  c.same_device(name, t);
  c.dtype(name, t, at::kFloat8_e4m3fn);
  c.shape(name, t, {rows, cols});
  c.contiguous(name, t);
}
// fp32 scales (rows, cols): row-major with a row stride >= cols; `tma_rows` (1x128 scales, read
// 16 bytes at a time) a multiple of 4 and >= cols rounded up to 4.
void check_scales(const OpContext& c, const char* name, const Tensor& t, int64_t rows, int64_t cols,
                  bool tma_rows) {
  c.same_device(name, t);
  c.dtype(name, t, at::kFloat);
  c.shape(name, t, {rows, cols});
  const int64_t least = tma_rows ? ScaleLayout::row_scales_ld(cols) : cols;
  TORCH_CHECK(t.stride(1) == 1 && t.stride(0) >= least && (!tma_rows || t.stride(0) % 4 == 0), c.op,
              ": ", name, " must be row-major with a row stride >= ", least,
              tma_rows ? " and a multiple of 4" : "", ", got strides ", shape_string(t.strides()));
}
// FP8 widths: 16-byte rows of codes. Each op checks every width its forward or backward
// quantizes (a weight's N in check_fp8_weight, the other in the op), on every device, so that the
// forward refuses what its backward could not run and an error names this op's arguments rather
// than an inner cast's.
void fp8_width(const OpContext& c, const char* what, int64_t width) {
  TORCH_CHECK(width % 16 == 0, c.op, ": ", what, " = ", width,
              " must be a multiple of 16 (16-byte rows of e4m3 codes)");
}
// An FP8 weight cache of w (N, K), its arguments named `prefix`_codes, ..: codes (N, K), scales
// (ceil(N/128), ceil(K/128)) where `forward`, and wᵀ's codes (K, N), scales (ceil(K/128),
// ceil(N/128)), which a forward may leave out (its backward transposes the codes then, or with
// `recast` casts wᵀ from w); `width` names N, a multiple of 16 on every device (wᵀ's codes have N
// columns, and the data gradient's operand, quantized along N, 16-byte rows of codes).
void check_fp8_weight(const OpContext& c, const std::string& prefix, const char* width,
                      const Tensor& w, const Fp8& q, bool forward, bool recast = false) {
  const int64_t n = w.size(0), k = w.size(1);
  const std::string codes = prefix + "_codes", scales = prefix + "_scales",
                    codes_t = prefix + "_codes_t", scales_t = prefix + "_scales_t";
  if (forward) {
    check_codes(c, codes.c_str(), q.codes, n, k);
    check_scales(c, scales.c_str(), q.scales, blocks(n), blocks(k), false);
    TORCH_CHECK(q.codes_t.defined() == q.scales_t.defined(), c.op, ": pass both ", codes_t, " and ",
                scales_t, " (wᵀ's operand, kept), or neither (the backward makes it)");
    TORCH_CHECK(!(recast && q.codes_t.defined()), c.op,
                ": recast_w_t casts wᵀ's operand in the backward: pass ", codes_t, " and ",
                scales_t, " as None with it");
  }
  if (!forward || q.codes_t.defined()) {
    check_codes(c, codes_t.c_str(), q.codes_t, k, n);
    check_scales(c, scales_t.c_str(), q.scales_t, blocks(k), blocks(n), false);
  }
  fp8_width(c, width, n);
}
// A forward's weight operands; wᵀ's may be absent (None).
Fp8 fp8_weight(const Tensor& codes, const Tensor& scales, const std::optional<Tensor>& codes_t,
               const std::optional<Tensor>& scales_t) {
  return {codes, scales, codes_t.value_or(Tensor()), scales_t.value_or(Tensor())};
}
// An FP8 activation `name` (M, N): its 1x128 rows (codes `name` (M, N), scales `name`_scales
// (ceil(N/128), M)) where `rows`, its 128x1 copy (`name`_t (N, M16), `name`_t_scales
// (ceil(M/128), N)) where `copy`.
void check_fp8_act(const OpContext& c, const std::string& name, const Fp8& q, int64_t m, int64_t n,
                   bool rows, bool copy) {
  const std::string s = name + "_scales", t = name + "_t", ts = name + "_t_scales";
  if (rows) {
    check_codes(c, name.c_str(), q.codes, m, n);
    check_scales(c, s.c_str(), q.scales, blocks(n), m, true);
  }
  if (copy) {
    check_codes(c, t.c_str(), q.codes_t, n, ScaleLayout::padded_tokens(m));
    check_scales(c, ts.c_str(), q.scales_t, blocks(m), n, false);
  }
}

Tensor empty_like_stat(const Tensor& like) {
  return at::empty({0}, like.options().dtype(at::kFloat));
}

// ---- forward ops ----------------------------------------------------------------------------

using OutProj = std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor>;
OutProj fp8_out_proj_residual_norm(const Tensor& y, const Tensor& w_o, const Tensor& w_codes,
                                   const Tensor& w_scales, const std::optional<Tensor>& w_codes_t,
                                   const std::optional<Tensor>& w_scales_t, const Tensor& residual,
                                   const Tensor& gamma, double eps, bool copies, bool recompute_y,
                                   bool recast_w_t) {
  const auto c = OpContext::from("coda::fp8_out_proj_residual_norm", "y", y);
  const auto s = validate_out_proj_residual_norm(c, y, w_o, residual, gamma, eps);
  const Fp8 w = fp8_weight(w_codes, w_scales, w_codes_t, w_scales_t);
  check_fp8_weight(c, "w", "H (w_o.size(0))", w_o, w, true, recast_w_t);
  fp8_width(c, "K (y.size(1))", s.k);
  return on_backend(y, [&](auto& b) {
    const auto o =
        block::fp8_out_proj_residual_norm(b, y, w, residual, gamma, eps, copies && !recompute_y);
    const auto& n = o.out;
    return std::make_tuple(n.x, n.h.codes, n.h.scales, n.r, o.y.codes_t, o.y.scales_t);
  });
}

// y · wᵀ alone (tensor parallelism's row-parallel out-projection): y cast, the FP8 GEMM; y's
// transposed copy for the backward (fp8_linear_backward), empty without `copies`.
std::tuple<Tensor, Tensor, Tensor> fp8_linear(const Tensor& y, const Tensor& w,
                                              const Tensor& w_codes, const Tensor& w_scales,
                                              const std::optional<Tensor>& w_codes_t,
                                              const std::optional<Tensor>& w_scales_t, bool copies,
                                              bool recast_w_t) {
  const auto c = OpContext::from("coda::fp8_linear", "y", y);
  c.matrix("y", y);
  c.matrix("w", w);
  const int64_t k = y.size(1);
  TORCH_CHECK(w.size(1) == k, c.op, ": w must have shape (N, ", k, ") for y of shape ",
              shape_string(y.sizes()), ", got ", shape_string(w.sizes()));
  const Fp8 wq = fp8_weight(w_codes, w_scales, w_codes_t, w_scales_t);
  check_fp8_weight(c, "w", "N (w.size(0))", w, wq, true, recast_w_t);
  fp8_width(c, "K (y.size(1))", k);
  return on_backend(y, [&](auto& b) {
    const auto o = block::fp8_linear(b, y, wq, copies);
    return std::make_tuple(o.out, o.input.codes_t, o.input.scales_t);
  });
}

// The MLP forwards' FP8 operands (fp8_mlp, fp8_mlp_partial): both weights' and h's rows.
void check_fp8_mlp_operands(const OpContext& c, const MlpSizes& s, const Tensor& w_gu,
                            const Fp8& gu, const Tensor& w_down, const Fp8& dn, const Fp8& h,
                            bool recast_w_t) {
  check_fp8_weight(c, "gu", "2I (w_gu.size(0))", w_gu, gu, true, recast_w_t);
  check_fp8_weight(c, "dn", "H (w_down.size(0))", w_down, dn, true, recast_w_t);
  check_fp8_act(c, "h", h, s.m, s.hidden, true, false);
  fp8_width(c, "I (w_gu.size(0) / 2)", s.intermediate);
}

using MlpOut = std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor>;
MlpOut fp8_mlp(const Tensor& x, const Tensor& gamma, const Tensor& w_gu, const Tensor& gu_codes,
               const Tensor& gu_scales, const std::optional<Tensor>& gu_codes_t,
               const std::optional<Tensor>& gu_scales_t, const Tensor& w_down,
               const Tensor& dn_codes, const Tensor& dn_scales,
               const std::optional<Tensor>& dn_codes_t, const std::optional<Tensor>& dn_scales_t,
               const Tensor& h, const Tensor& h_scales, const Tensor& r, const Tensor& gamma_next,
               double eps, bool act_h_out, bool copies, bool recompute_a, bool recast_w_t,
               bool fp8_z) {
  const auto c = OpContext::from("coda::fp8_mlp", "x", x);
  const auto s = validate_mlp(c, x, gamma, w_gu, w_down, nullptr, r);
  c.activation("gamma_next", gamma_next, {s.hidden});
  check_eps(c.op, eps);
  const Fp8 gu = fp8_weight(gu_codes, gu_scales, gu_codes_t, gu_scales_t);
  const Fp8 dn = fp8_weight(dn_codes, dn_scales, dn_codes_t, dn_scales_t);
  const Fp8 hq{h, h_scales, {}, {}};
  check_fp8_mlp_operands(c, s, w_gu, gu, w_down, dn, hq, recast_w_t);
  return on_backend(x, [&](auto& b) {
    const auto o =
        block::fp8_mlp(b, x, hq, r, gu, dn, gamma_next, eps, act_h_out, copies, recompute_a, fp8_z);
    const auto& n = o.out;
    const Tensor z_scales = fp8_z ? o.z_scales : empty_like_stat(x);
    if (act_h_out) {
      return std::make_tuple(n.x, o.h_act, empty_like_stat(x), n.r, o.z, o.a.codes_t, o.a.scales_t,
                             z_scales);
    }
    return std::make_tuple(n.x, n.h.codes, n.h.scales, n.r, o.z, o.a.codes_t, o.a.scales_t,
                           z_scales);
  });
}

// The MLP branch alone (tensor parallelism; mlp_partial's FP8 counterpart): y = a · W_downᵀ
// after F2, no residual add and no next norm; z and a's copy for the backward, with copies,
// recompute_a and fp8_z as fp8_mlp's.
using MlpPartialOut = std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor>;
MlpPartialOut fp8_mlp_partial(const Tensor& x, const Tensor& gamma, const Tensor& w_gu,
                              const Tensor& gu_codes, const Tensor& gu_scales,
                              const std::optional<Tensor>& gu_codes_t,
                              const std::optional<Tensor>& gu_scales_t, const Tensor& w_down,
                              const Tensor& dn_codes, const Tensor& dn_scales,
                              const std::optional<Tensor>& dn_codes_t,
                              const std::optional<Tensor>& dn_scales_t, const Tensor& h,
                              const Tensor& h_scales, const Tensor& r, bool copies,
                              bool recompute_a, bool recast_w_t, bool fp8_z) {
  const auto c = OpContext::from("coda::fp8_mlp_partial", "x", x);
  const auto s = validate_mlp(c, x, gamma, w_gu, w_down, nullptr, r);
  const Fp8 gu = fp8_weight(gu_codes, gu_scales, gu_codes_t, gu_scales_t);
  const Fp8 dn = fp8_weight(dn_codes, dn_scales, dn_codes_t, dn_scales_t);
  const Fp8 hq{h, h_scales, {}, {}};
  check_fp8_mlp_operands(c, s, w_gu, gu, w_down, dn, hq, recast_w_t);
  return on_backend(x, [&](auto& b) {
    const auto o = block::fp8_mlp_partial(b, hq, r, gu, dn, copies, recompute_a, fp8_z);
    return std::make_tuple(o.y, o.z, o.a.codes_t, o.a.scales_t,
                           fp8_z ? o.z_scales : empty_like_stat(x));
  });
}

Tensor fp8_norm_qkv(const Tensor& x, const Tensor& gamma, const Tensor& w_qkv,
                    const Tensor& w_codes, const Tensor& w_scales,
                    const std::optional<Tensor>& w_codes_t, const std::optional<Tensor>& w_scales_t,
                    const Tensor& h, const Tensor& h_scales, const Tensor& r, const Tensor& pos,
                    const Tensor& rope_table, const std::optional<Tensor>& b_qkv_in,
                    bool recast_w_t) {
  const auto c = OpContext::from("coda::fp8_norm_qkv", "x", x);
  const Tensor b_qkv = b_qkv_in.value_or(Tensor());
  const auto s = validate_norm_qkv(c, x, gamma, w_qkv, nullptr, r, pos, rope_table, b_qkv);
  check_positions(c, pos);
  const Fp8 w = fp8_weight(w_codes, w_scales, w_codes_t, w_scales_t);
  check_fp8_weight(c, "w", "the QKV width (w_qkv.size(0))", w_qkv, w, true, recast_w_t);
  const Fp8 hq{h, h_scales, {}, {}};
  check_fp8_act(c, "h", hq, s.m, s.hidden, true, false);
  fp8_width(c, "H (x.size(1))", s.hidden);
  return on_backend(
      x, [&](auto& b) { return block::fp8_norm_qkv(b, hq, r, w, b_qkv, pos, rope_table); });
}

// norm_qkv_qk_norm's FP8 counterpart (Qwen3): F3q on FP8 operands; qk_pre for the backward.
std::tuple<Tensor, Tensor> fp8_norm_qkv_qk_norm(
    const Tensor& x, const Tensor& gamma, const Tensor& w_qkv, const Tensor& w_codes,
    const Tensor& w_scales, const std::optional<Tensor>& w_codes_t,
    const std::optional<Tensor>& w_scales_t, const Tensor& h, const Tensor& h_scales,
    const Tensor& r, const Tensor& pos, const Tensor& rope_table, const Tensor& q_gamma,
    const Tensor& k_gamma, int64_t n_heads, int64_t n_kv_heads, double eps, bool recast_w_t) {
  const auto c = OpContext::from("coda::fp8_norm_qkv_qk_norm", "x", x);
  const auto s = validate_norm_qkv_qk_norm(c, x, gamma, w_qkv, nullptr, r, pos, rope_table, q_gamma,
                                           k_gamma, n_heads, n_kv_heads, eps);
  check_positions(c, pos);
  const Fp8 w = fp8_weight(w_codes, w_scales, w_codes_t, w_scales_t);
  check_fp8_weight(c, "w", "the QKV width (w_qkv.size(0))", w_qkv, w, true, recast_w_t);
  const Fp8 hq{h, h_scales, {}, {}};
  check_fp8_act(c, "h", hq, s.proj.m, s.proj.hidden, true, false);
  fp8_width(c, "H (x.size(1))", s.proj.hidden);
  return on_backend(x, [&](auto& b) {
    const auto o =
        block::fp8_norm_qkv_qk_norm(b, hq, r, w, q_gamma, k_gamma, s.qk, pos, rope_table);
    return std::make_tuple(o.qkv, o.qk_pre);
  });
}

// ---- backward ops ---------------------------------------------------------------------------

std::tuple<Tensor, Tensor> fp8_linear_backward(const Tensor& dout,
                                               const std::optional<Tensor>& input_t,
                                               const std::optional<Tensor>& input_t_scales,
                                               const Tensor& weight, const Tensor& w_codes_t,
                                               const Tensor& w_scales_t,
                                               const std::optional<Tensor>& input) {
  const auto c = OpContext::from("coda::fp8_linear_backward", "dout", dout);
  c.matrix("dout", dout);
  const int64_t m = dout.size(0), n = dout.size(1);
  c.same_device("weight", weight);
  c.dtype("weight", weight, c.act);
  TORCH_CHECK(weight.dim() == 2 && weight.size(0) == n, c.op, ": weight must have shape (", n,
              ", K) for dout of shape ", shape_string(dout.sizes()), ", got ",
              shape_string(weight.sizes()));
  const int64_t k = weight.size(1);
  const Fp8 w{{}, {}, w_codes_t, w_scales_t};
  check_fp8_weight(c, "w", "N (dout.size(1))", weight, w, false);
  TORCH_CHECK(input_t.has_value() == input_t_scales.has_value() &&
                  input_t.has_value() != input.has_value(),
              c.op, ": pass input_t and input_t_scales (the input's transposed copy), or input "
              "alone (the copy made from it)");
  Fp8 in;
  if (input_t) {
    in = Fp8{{}, {}, *input_t, *input_t_scales};
    check_fp8_act(c, "input", in, m, k, false, true);
  } else {
    c.activation("input", *input, {m, k});
  }
  fp8_width(c, "K (weight.size(1))", k);
  return on_backend(dout, [&](auto& b) {
    const auto g = block::fp8_linear_backward(b, dout, in, w, input.value_or(Tensor()));
    return std::make_tuple(g.dx, g.dw);
  });
}

std::tuple<Tensor, Tensor, Tensor, Tensor> fp8_mlp_backward(
    const Tensor& dx_out, const Tensor& x, const Tensor& gamma, const Tensor& w_gu,
    const Tensor& gu_codes_t, const Tensor& gu_scales_t, const Tensor& w_down,
    const Tensor& dn_codes_t, const Tensor& dn_scales_t, const Tensor& r, const Tensor& z,
    const std::optional<Tensor>& a_t, const std::optional<Tensor>& a_t_scales,
    const std::optional<Tensor>& z_scales, bool residual) {
  const auto c = OpContext::from("coda::fp8_mlp_backward", "x", x);
  // z as fp8_mlp saved it: in the activation dtype, or (fp8_z) its codes with z_scales.
  const auto s = z_scales ? validate_mlp(c, x, gamma, w_gu, w_down, nullptr, r)
                          : validate_mlp_backward(c, dx_out, x, gamma, w_gu, w_down, r, z);
  if (z_scales) {
    c.activation("dx_out", dx_out, {s.m, s.hidden});
    const Fp8 zq{z, *z_scales, {}, {}};
    check_fp8_act(c, "z", zq, s.m, 2 * s.intermediate, true, false);
  }
  const Fp8 gu{{}, {}, gu_codes_t, gu_scales_t}, dn{{}, {}, dn_codes_t, dn_scales_t};
  check_fp8_weight(c, "gu", "2I (w_gu.size(0))", w_gu, gu, false);
  check_fp8_weight(c, "dn", "H (w_down.size(0))", w_down, dn, false);
  TORCH_CHECK(a_t.has_value() == a_t_scales.has_value(), c.op,
              ": pass both a_t and a_t_scales (F2's copy of a), or neither (made from z)");
  Fp8 a;  // none: the backward makes a's copy from z
  if (a_t) {
    a = Fp8{{}, {}, *a_t, *a_t_scales};
    check_fp8_act(c, "a", a, s.m, s.intermediate, false, true);
  }
  fp8_width(c, "I (w_gu.size(0) / 2)", s.intermediate);
  return on_backend(x, [&](auto& b) {
    const auto g = block::fp8_mlp_backward(b, dx_out, x, gamma, gu, dn, r, z,
                                           z_scales.value_or(Tensor()), a, residual);
    return std::make_tuple(g.dx, g.dgamma, g.dw, g.dw2);
  });
}

std::tuple<Tensor, Tensor, Tensor, Tensor> fp8_norm_qkv_backward(
    const Tensor& dqkv, const Tensor& qkv, const Tensor& x, const Tensor& gamma,
    const Tensor& w_qkv, const Tensor& w_codes_t, const Tensor& w_scales_t, const Tensor& r,
    const Tensor& pos, const Tensor& rope_table, const std::optional<Tensor>& b_qkv_in) {
  const auto c = OpContext::from("coda::fp8_norm_qkv_backward", "x", x);
  const Tensor b_qkv = b_qkv_in.value_or(Tensor());
  const auto s =
      validate_norm_qkv_backward(c, dqkv, qkv, x, gamma, w_qkv, r, pos, rope_table, b_qkv);
  check_positions(c, pos);
  const Fp8 w{{}, {}, w_codes_t, w_scales_t};
  check_fp8_weight(c, "w", "the QKV width (w_qkv.size(0))", w_qkv, w, false);
  fp8_width(c, "H (x.size(1))", s.hidden);
  return on_backend(x, [&](auto& b) {
    const auto g =
        block::fp8_norm_qkv_backward(b, dqkv, qkv, x, gamma, w, b_qkv, r, pos, rope_table);
    const Tensor db = g.dbias.defined() ? g.dbias : at::empty({0}, x.options());
    return std::make_tuple(g.dx, g.dgamma, g.dw, db);
  });
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> fp8_norm_qkv_qk_norm_backward(
    const Tensor& dqkv, const Tensor& qkv, const Tensor& qk_pre, const Tensor& x,
    const Tensor& gamma, const Tensor& w_qkv, const Tensor& w_codes_t, const Tensor& w_scales_t,
    const Tensor& r, const Tensor& pos, const Tensor& rope_table, const Tensor& q_gamma,
    const Tensor& k_gamma, int64_t n_heads, int64_t n_kv_heads, double eps) {
  const auto c = OpContext::from("coda::fp8_norm_qkv_qk_norm_backward", "x", x);
  const auto s =
      validate_norm_qkv_qk_norm_backward(c, dqkv, qkv, qk_pre, x, gamma, w_qkv, r, pos, rope_table,
                                         q_gamma, k_gamma, n_heads, n_kv_heads, eps);
  check_positions(c, pos);
  const Fp8 w{{}, {}, w_codes_t, w_scales_t};
  check_fp8_weight(c, "w", "the QKV width (w_qkv.size(0))", w_qkv, w, false);
  fp8_width(c, "H (x.size(1))", s.proj.hidden);
  return on_backend(x, [&](auto& b) {
    const auto g = block::fp8_norm_qkv_qk_norm_backward(b, dqkv, qkv, qk_pre, x, gamma, w, q_gamma,
                                                        k_gamma, s.qk, r, pos, rope_table);
    return std::make_tuple(g.dx, g.dgamma, g.dw, g.dq_gamma, g.dk_gamma);
  });
}

// ---- autograd -------------------------------------------------------------------------------

// The forward ops with copies, typed by their kernels' own signatures: what the autograd
// functions and the no-copies path call below autograd.
const c10::TypedOperatorHandle<decltype(fp8_out_proj_residual_norm)>& out_proj_op() {
  static const auto f =
      op<decltype(fp8_out_proj_residual_norm)>("coda::fp8_out_proj_residual_norm");
  return f;
}
const c10::TypedOperatorHandle<decltype(fp8_mlp)>& mlp_op() {
  static const auto f = op<decltype(fp8_mlp)>("coda::fp8_mlp");
  return f;
}
const c10::TypedOperatorHandle<decltype(fp8_linear)>& linear_op() {
  static const auto f = op<decltype(fp8_linear)>("coda::fp8_linear");
  return f;
}
const c10::TypedOperatorHandle<decltype(fp8_mlp_partial)>& mlp_partial_op() {
  static const auto f = op<decltype(fp8_mlp_partial)>("coda::fp8_mlp_partial");
  return f;
}

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// How a backward gets a weight's data-gradient operand (wᵀ's codes and scales).
enum class WeightT : int64_t {
  kKept = 0,       // the caller passed it: saved
  kTranspose = 1,  // w's codes saved, transposed in the backward (fp8_transpose_blocks)
  kRecast = 2,     // nothing FP8 saved: cast from the bf16 w (saved anyway) in the backward
};
// What a forward saves of a weight for wᵀ's operand, `key` recording how (WeightT): without
// the caller's, wᵀ's codes live only while the layer's backward runs; with `recast` w's codes
// do not outlive the forward either (a caller that casts w every forward: nothing of it kept).
std::pair<Tensor, Tensor> weight_t_to_save(AutogradContext* ctx, const char* key, const Tensor& wc,
                                           const Tensor& ws, const std::optional<Tensor>& wct,
                                           const std::optional<Tensor>& wst, bool recast) {
  const WeightT how = wct ? WeightT::kKept : recast ? WeightT::kRecast : WeightT::kTranspose;
  ctx->saved_data[key] = static_cast<int64_t>(how);
  if (how == WeightT::kKept) return {*wct, *wst};
  if (how == WeightT::kTranspose) return {wc, ws};
  return {Tensor(), Tensor()};
}
// wᵀ's operand in the backward, from what weight_t_to_save saved (a, b) or from w.
std::tuple<Tensor, Tensor> weight_t(AutogradContext* ctx, const char* key, const Tensor& a,
                                    const Tensor& b, const Tensor& w) {
  const auto how = static_cast<WeightT>(ctx->saved_data[key].toInt());
  if (how == WeightT::kKept) return {a, b};
  if (how == WeightT::kTranspose) {
    static const auto t =
        op<std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&)>("coda::fp8_transpose_blocks");
    return t.call(a, b);
  }
  static const auto cast =
      op<std::tuple<Tensor, Tensor, Tensor, Tensor>(const Tensor&, bool, bool)>(
          "coda::fp8_quantize_blocks");
  auto [codes, scales, codes_t, scales_t] = cast.call(w, false, true);
  return {codes_t, scales_t};
}

// copies=False leaves out what the backward reads: only where no gradient is recorded.
void no_copies_without_grad(const char* op, std::initializer_list<const Tensor*> inputs) {
  if (!at::GradMode::is_enabled()) return;
  for (const Tensor* t : inputs)
    TORCH_CHECK(!(t->defined() && t->requires_grad()), op,
                ": copies=False leaves out the weight gradients' operands, but an input requires "
                "a gradient; call it under torch.no_grad() or with copies=True");
}

class Fp8OutProjResidualNorm : public torch::autograd::Function<Fp8OutProjResidualNorm> {
 public:
  static variable_list forward(AutogradContext* ctx, const Tensor& y, const Tensor& w_o,
                               const Tensor& wc, const Tensor& ws, const std::optional<Tensor>& wct,
                               const std::optional<Tensor>& wst, const Tensor& residual,
                               const Tensor& gamma, double eps, bool recompute_y, bool recast_w_t) {
    ctx->set_materialize_grads(false);
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [x, h, hs, r, yt, yts] = out_proj_op().call(y, w_o, wc, ws, wct, wst, residual, gamma, eps,
                                                     true, recompute_y, recast_w_t);
    ctx->mark_non_differentiable({h, hs, r, yt, yts});  // caches for the consumer, its operands
    // recompute_y: y itself (the attention's output, which attention's backward keeps anyway)
    // instead of its transposed copy; the backward makes the copy.
    const auto [wt, wts] = weight_t_to_save(ctx, "w_t", wc, ws, wct, wst, recast_w_t);
    ctx->save_for_backward({recompute_y ? y : yt, yts, w_o, wt, wts});
    ctx->saved_data["recompute_y"] = recompute_y;
    return {x, h, hs, r, yt, yts};
  }
  static variable_list backward(AutogradContext* ctx, variable_list g) {
    variable_list out(11);
    if (!g[0].defined()) return out;
    const auto s = ctx->get_saved_variables();
    static const auto b = op<decltype(fp8_linear_backward)>("coda::fp8_linear_backward");
    const Tensor dx = g[0].contiguous();
    // y's copy as the forward made it, or y (recompute_y): the backward op makes the copy.
    const bool kept = !ctx->saved_data["recompute_y"].toBool();
    const auto [wt, wts] = weight_t(ctx, "w_t", s[3], s[4], s[2]);
    auto [dy, dw] = kept ? b.call(dx, s[0], s[1], s[2], wt, wts, std::nullopt)
                         : b.call(dx, std::nullopt, std::nullopt, s[2], wt, wts, s[0]);
    out[0] = dy;
    out[1] = dw;
    out[6] = dx;  // the residual add
    return out;
  }
};

// The MLP forwards' inputs (fp8_mlp's and fp8_mlp_partial's first twelve: x, gamma, both weights
// with their four FP8 tensors each) and F2's outputs for the backward (z, a's copy, z_scales):
// what mlp_backward_from_saved reads, each weight's wᵀ operand as weight_t_to_save decides.
struct MlpInputs {
  const Tensor &x, &gamma, &w_gu, &guc, &gus;
  const std::optional<Tensor>&guct, &gust;
  const Tensor &w_down, &dnc, &dns;
  const std::optional<Tensor>&dnct, &dnst;
};
struct MlpSaved {
  const Tensor &z, &a_t, &a_t_scales, &z_scales;
};
void save_mlp_for_backward(AutogradContext* ctx, const MlpInputs& in, const Tensor& r,
                           const MlpSaved& f2, bool recompute_a, bool recast_w_t, bool fp8_z) {
  const auto [gut, guts] =
      weight_t_to_save(ctx, "gu_t", in.guc, in.gus, in.guct, in.gust, recast_w_t);
  const auto [dnt, dnts] =
      weight_t_to_save(ctx, "dn_t", in.dnc, in.dns, in.dnct, in.dnst, recast_w_t);
  ctx->save_for_backward({in.x, in.gamma, in.w_gu, gut, guts, in.w_down, dnt, dnts, r, f2.z, f2.a_t,
                          f2.a_t_scales, f2.z_scales});
  ctx->saved_data["recompute_a"] = recompute_a;
  ctx->saved_data["fp8_z"] = fp8_z;
}

// fp8_mlp_backward from what Fp8Mlp and Fp8MlpPartial save (the same list: x, gamma, w_gu, wᵀ's
// two, w_down, wᵀ's two, r, z, a's copy, its scales, z_scales) into the gradients of the op's
// `inputs` inputs (x, gamma, w_gu at 0-2, w_down at 7); `residual` as the op's.
variable_list mlp_backward_from_saved(AutogradContext* ctx, const Tensor& dout, size_t inputs,
                                      bool residual) {
  variable_list out(inputs);
  if (!dout.defined()) return out;
  const auto s = ctx->get_saved_variables();
  static auto b = op<decltype(fp8_mlp_backward)>("coda::fp8_mlp_backward");
  // a's copy, or none (recompute_a: F2 wrote no copy, an empty tensor): made from z.
  const bool kept = !ctx->saved_data["recompute_a"].toBool();
  const auto [gut, guts] = weight_t(ctx, "gu_t", s[3], s[4], s[2]);
  const auto [dnt, dnts] = weight_t(ctx, "dn_t", s[6], s[7], s[5]);
  auto [dx, dgamma, dw_gu, dw_down] = b.call(
      dout.contiguous(), s[0], s[1], s[2], gut, guts, s[5], dnt, dnts, s[8], s[9],
      kept ? std::optional<Tensor>(s[10]) : std::nullopt,
      kept ? std::optional<Tensor>(s[11]) : std::nullopt,
      ctx->saved_data["fp8_z"].toBool() ? std::optional<Tensor>(s[12]) : std::nullopt, residual);
  out[0] = dx;
  out[1] = dgamma;
  out[2] = dw_gu;
  out[7] = dw_down;
  return out;
}

class Fp8Mlp : public torch::autograd::Function<Fp8Mlp> {
 public:
  static variable_list forward(AutogradContext* ctx, const Tensor& x, const Tensor& gamma,
                               const Tensor& w_gu, const Tensor& guc, const Tensor& gus,
                               const std::optional<Tensor>& guct, const std::optional<Tensor>& gust,
                               const Tensor& w_down, const Tensor& dnc, const Tensor& dns,
                               const std::optional<Tensor>& dnct, const std::optional<Tensor>& dnst,
                               const Tensor& h, const Tensor& hs, const Tensor& r,
                               const Tensor& gamma_next, double eps, bool act_h_out,
                               bool recompute_a, bool recast_w_t, bool fp8_z) {
    ctx->set_materialize_grads(false);
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [x_out, h_out, h_outs, r_out, z, at, ats, zs] =
        mlp_op().call(x, gamma, w_gu, guc, gus, guct, gust, w_down, dnc, dns, dnct, dnst, h, hs, r,
                      gamma_next, eps, act_h_out, true, recompute_a, recast_w_t, fp8_z);
    ctx->mark_non_differentiable({h_out, h_outs, r_out, z, at, ats, zs});
    save_mlp_for_backward(ctx, {x, gamma, w_gu, guc, gus, guct, gust, w_down, dnc, dns, dnct, dnst},
                          r, {z, at, ats, zs}, recompute_a, recast_w_t, fp8_z);
    return {x_out, h_out, h_outs, r_out, z, at, ats, zs};
  }
  static variable_list backward(AutogradContext* ctx, variable_list g) {
    return mlp_backward_from_saved(ctx, g[0], 21, true);
  }
};

class Fp8Linear : public torch::autograd::Function<Fp8Linear> {
 public:
  static variable_list forward(AutogradContext* ctx, const Tensor& y, const Tensor& w,
                               const Tensor& wc, const Tensor& ws, const std::optional<Tensor>& wct,
                               const std::optional<Tensor>& wst, bool recast_w_t) {
    ctx->set_materialize_grads(false);
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [out, yt, yts] = linear_op().call(y, w, wc, ws, wct, wst, true, recast_w_t);
    ctx->mark_non_differentiable({yt, yts});
    const auto [wt, wts] = weight_t_to_save(ctx, "w_t", wc, ws, wct, wst, recast_w_t);
    ctx->save_for_backward({yt, yts, w, wt, wts});
    return {out, yt, yts};
  }
  static variable_list backward(AutogradContext* ctx, variable_list g) {
    variable_list out(7);
    if (!g[0].defined()) return out;
    const auto s = ctx->get_saved_variables();
    static const auto b = op<decltype(fp8_linear_backward)>("coda::fp8_linear_backward");
    const auto [wt, wts] = weight_t(ctx, "w_t", s[3], s[4], s[2]);
    auto [dy, dw] = b.call(g[0].contiguous(), s[0], s[1], s[2], wt, wts, std::nullopt);
    out[0] = dy;
    out[1] = dw;
    return out;
  }
};

// fp8_mlp_partial: its backward is fp8_mlp_backward without the residual's dx_out, so under
// tensor parallelism each rank's dx is its share of the sum.
class Fp8MlpPartial : public torch::autograd::Function<Fp8MlpPartial> {
 public:
  static variable_list forward(AutogradContext* ctx, const Tensor& x, const Tensor& gamma,
                               const Tensor& w_gu, const Tensor& guc, const Tensor& gus,
                               const std::optional<Tensor>& guct, const std::optional<Tensor>& gust,
                               const Tensor& w_down, const Tensor& dnc, const Tensor& dns,
                               const std::optional<Tensor>& dnct, const std::optional<Tensor>& dnst,
                               const Tensor& h, const Tensor& hs, const Tensor& r, bool recompute_a,
                               bool recast_w_t, bool fp8_z) {
    ctx->set_materialize_grads(false);
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [y, z, at, ats, zs] =
        mlp_partial_op().call(x, gamma, w_gu, guc, gus, guct, gust, w_down, dnc, dns, dnct, dnst, h,
                              hs, r, true, recompute_a, recast_w_t, fp8_z);
    ctx->mark_non_differentiable({z, at, ats, zs});
    save_mlp_for_backward(ctx, {x, gamma, w_gu, guc, gus, guct, gust, w_down, dnc, dns, dnct, dnst},
                          r, {z, at, ats, zs}, recompute_a, recast_w_t, fp8_z);
    return {y, z, at, ats, zs};
  }
  static variable_list backward(AutogradContext* ctx, variable_list g) {
    return mlp_backward_from_saved(ctx, g[0], 18, false);
  }
};

class Fp8NormQkv : public torch::autograd::Function<Fp8NormQkv> {
 public:
  static Tensor forward(AutogradContext* ctx, const Tensor& x, const Tensor& gamma,
                        const Tensor& w_qkv, const Tensor& wc, const Tensor& ws,
                        const std::optional<Tensor>& wct, const std::optional<Tensor>& wst,
                        const Tensor& h, const Tensor& hs, const Tensor& r, const Tensor& pos,
                        const Tensor& table, const std::optional<Tensor>& b_qkv, bool recast_w_t) {
    ctx->set_materialize_grads(false);
    at::AutoDispatchBelowADInplaceOrView guard;
    static auto f = op<decltype(fp8_norm_qkv)>("coda::fp8_norm_qkv");
    Tensor qkv = f.call(x, gamma, w_qkv, wc, ws, wct, wst, h, hs, r, pos, table, b_qkv, recast_w_t);
    const auto [wt, wts] = weight_t_to_save(ctx, "w_t", wc, ws, wct, wst, recast_w_t);
    ctx->save_for_backward(
        {qkv, x, gamma, w_qkv, wt, wts, r, pos, table, b_qkv.value_or(Tensor())});
    return qkv;
  }
  static variable_list backward(AutogradContext* ctx, variable_list g) {
    variable_list out(14);
    if (!g[0].defined()) return out;
    const auto s = ctx->get_saved_variables();
    static auto b = op<std::tuple<Tensor, Tensor, Tensor, Tensor>(
        const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
        const Tensor&, const Tensor&, const Tensor&, const Tensor&, const std::optional<Tensor>&)>(
        "coda::fp8_norm_qkv_backward");
    const std::optional<Tensor> bias = s[9].defined() ? std::optional<Tensor>(s[9]) : std::nullopt;
    const auto [wt, wts] = weight_t(ctx, "w_t", s[4], s[5], s[3]);
    auto [dx, dgamma, dw, db] =
        b.call(g[0].contiguous(), s[0], s[1], s[2], s[3], wt, wts, s[6], s[7], s[8], bias);
    out[0] = dx;
    out[1] = dgamma;
    out[2] = dw;
    if (bias) out[12] = db;
    return out;
  }
};

class Fp8NormQkvQkNorm : public torch::autograd::Function<Fp8NormQkvQkNorm> {
 public:
  static variable_list forward(AutogradContext* ctx, const Tensor& x, const Tensor& gamma,
                               const Tensor& w_qkv, const Tensor& wc, const Tensor& ws,
                               const std::optional<Tensor>& wct, const std::optional<Tensor>& wst,
                               const Tensor& h, const Tensor& hs, const Tensor& r,
                               const Tensor& pos, const Tensor& table, const Tensor& q_gamma,
                               const Tensor& k_gamma, int64_t n_heads, int64_t n_kv_heads,
                               double eps, bool recast_w_t) {
    ctx->set_materialize_grads(false);
    at::AutoDispatchBelowADInplaceOrView guard;
    static const auto f = op<decltype(fp8_norm_qkv_qk_norm)>("coda::fp8_norm_qkv_qk_norm");
    auto [qkv, qk_pre] = f.call(x, gamma, w_qkv, wc, ws, wct, wst, h, hs, r, pos, table, q_gamma,
                                k_gamma, n_heads, n_kv_heads, eps, recast_w_t);
    ctx->mark_non_differentiable({qk_pre});
    const auto [wt, wts] = weight_t_to_save(ctx, "w_t", wc, ws, wct, wst, recast_w_t);
    ctx->save_for_backward(
        {qkv, qk_pre, x, gamma, w_qkv, wt, wts, r, pos, table, q_gamma, k_gamma});
    ctx->saved_data["n_heads"] = n_heads;
    ctx->saved_data["n_kv_heads"] = n_kv_heads;
    ctx->saved_data["eps"] = eps;
    return {qkv, qk_pre};
  }
  static variable_list backward(AutogradContext* ctx, variable_list g) {
    variable_list out(18);
    if (!g[0].defined()) return out;
    const auto s = ctx->get_saved_variables();
    static const auto b =
        op<decltype(fp8_norm_qkv_qk_norm_backward)>("coda::fp8_norm_qkv_qk_norm_backward");
    const auto [wt, wts] = weight_t(ctx, "w_t", s[5], s[6], s[4]);
    auto [dx, dgamma, dw, dqg, dkg] =
        b.call(g[0].contiguous(), s[0], s[1], s[2], s[3], s[4], wt, wts, s[7], s[8], s[9], s[10],
               s[11], ctx->saved_data["n_heads"].toInt(), ctx->saved_data["n_kv_heads"].toInt(),
               ctx->saved_data["eps"].toDouble());
    out[0] = dx;
    out[1] = dgamma;
    out[2] = dw;
    out[12] = dqg;
    out[13] = dkg;
    return out;
  }
};

namespace names {
inline constexpr char out_proj[] = "coda::fp8_out_proj_residual_norm";
inline constexpr char mlp[] = "coda::fp8_mlp";
inline constexpr char mlp_partial[] = "coda::fp8_mlp_partial";
inline constexpr char linear[] = "coda::fp8_linear";
inline constexpr char norm_qkv[] = "coda::fp8_norm_qkv";
inline constexpr char linear_backward[] = "coda::fp8_linear_backward";
inline constexpr char mlp_backward[] = "coda::fp8_mlp_backward";
inline constexpr char norm_qkv_backward[] = "coda::fp8_norm_qkv_backward";
inline constexpr char norm_qkv_qk_norm[] = "coda::fp8_norm_qkv_qk_norm";
inline constexpr char norm_qkv_qk_norm_backward[] = "coda::fp8_norm_qkv_qk_norm_backward";
}  // namespace names

void register_kernels(torch::Library& m) {
  m.impl("fp8_out_proj_residual_norm", CODA_GUARDED(names::out_proj, fp8_out_proj_residual_norm));
  m.impl("fp8_mlp", CODA_GUARDED(names::mlp, fp8_mlp));
  m.impl("fp8_mlp_partial", CODA_GUARDED(names::mlp_partial, fp8_mlp_partial));
  m.impl("fp8_linear", CODA_GUARDED(names::linear, fp8_linear));
  m.impl("fp8_norm_qkv", CODA_GUARDED(names::norm_qkv, fp8_norm_qkv));
  m.impl("fp8_linear_backward", CODA_GUARDED(names::linear_backward, fp8_linear_backward));
  m.impl("fp8_mlp_backward", CODA_GUARDED(names::mlp_backward, fp8_mlp_backward));
  m.impl("fp8_norm_qkv_backward", CODA_GUARDED(names::norm_qkv_backward, fp8_norm_qkv_backward));
  m.impl("fp8_norm_qkv_qk_norm", CODA_GUARDED(names::norm_qkv_qk_norm, fp8_norm_qkv_qk_norm));
  m.impl("fp8_norm_qkv_qk_norm_backward",
         CODA_GUARDED(names::norm_qkv_qk_norm_backward, fp8_norm_qkv_qk_norm_backward));
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(coda, m) {
  // Forward: as out_proj_residual_norm, mlp and norm_qkv, each weight with its FP8 operands (wᵀ's
  // optional: None, and the backward transposes w's codes, or with recast_w_t casts wᵀ from w,
  // keeping nothing FP8 of the weight) and h in its 1x128 blocks. out-proj also
  // returns y's transposed copy (its backward's dW_o operand; with recompute_y none, empty: the
  // backward makes it from y, which it keeps instead); mlp returns z and a's copy (its backward's
  // operands; with recompute_a no copy, empty: the backward makes it from z; with fp8_z z is its
  // e4m3 codes in 1x128 blocks with z_scales, else z_scales is empty); with act_h_out mlp's
  // h_out is the activation-dtype h (the LM head's input) and h_out_scales is empty.
  m.def(
      "fp8_out_proj_residual_norm(Tensor y, Tensor w_o, Tensor w_codes, Tensor w_scales, "
      "Tensor? w_codes_t, Tensor? w_scales_t, Tensor residual, Tensor gamma, float eps, "
      "bool copies=True, bool recompute_y=False, bool recast_w_t=False) -> (Tensor x, "
      "Tensor h, Tensor h_scales, Tensor r, Tensor y_t, Tensor y_t_scales)");
  m.def(
      "fp8_mlp(Tensor x, Tensor gamma, Tensor w_gu, Tensor gu_codes, Tensor gu_scales, "
      "Tensor? gu_codes_t, Tensor? gu_scales_t, Tensor w_down, Tensor dn_codes, "
      "Tensor dn_scales, Tensor? dn_codes_t, Tensor? dn_scales_t, Tensor h, Tensor h_scales, "
      "Tensor r, Tensor gamma_next, float eps, bool act_h_out=False, bool copies=True, "
      "bool recompute_a=False, bool recast_w_t=False, bool fp8_z=False) -> (Tensor x_out, "
      "Tensor h_out, Tensor h_out_scales, Tensor r_out, Tensor z, Tensor a_t, Tensor a_t_scales, "
      "Tensor z_scales)");
  // The MLP branch alone (mlp_partial's FP8 counterpart, for tensor parallelism): y = a · W_downᵀ,
  // no residual add, no next norm; z and a's copy for its backward (fp8_mlp_backward with
  // residual=False); copies, recompute_a, recast_w_t and fp8_z as fp8_mlp's.
  m.def(
      "fp8_mlp_partial(Tensor x, Tensor gamma, Tensor w_gu, Tensor gu_codes, Tensor gu_scales, "
      "Tensor? gu_codes_t, Tensor? gu_scales_t, Tensor w_down, Tensor dn_codes, "
      "Tensor dn_scales, Tensor? dn_codes_t, Tensor? dn_scales_t, Tensor h, Tensor h_scales, "
      "Tensor r, bool copies=True, bool recompute_a=False, bool recast_w_t=False, "
      "bool fp8_z=False) -> (Tensor y, Tensor z, Tensor a_t, Tensor a_t_scales, "
      "Tensor z_scales)");
  // y · wᵀ alone (tensor parallelism's row-parallel out-projection, whose residual add follows
  // the reduce-scatter): y cast once, its transposed copy returned for the backward
  // (fp8_linear_backward; empty without copies).
  m.def(
      "fp8_linear(Tensor y, Tensor w, Tensor w_codes, Tensor w_scales, Tensor? w_codes_t, "
      "Tensor? w_scales_t, bool copies=True, bool recast_w_t=False) -> (Tensor out, "
      "Tensor y_t, Tensor y_t_scales)");
  m.def(
      "fp8_norm_qkv(Tensor x, Tensor gamma, Tensor w_qkv, Tensor w_codes, Tensor w_scales, "
      "Tensor? w_codes_t, Tensor? w_scales_t, Tensor h, Tensor h_scales, Tensor r, Tensor pos, "
      "Tensor rope_table, Tensor? b_qkv=None, bool recast_w_t=False) -> Tensor");
  // With QK-norm (Qwen3), as norm_qkv_qk_norm: qk_pre (the Q and K columns before their norm)
  // is for the backward.
  m.def(
      "fp8_norm_qkv_qk_norm(Tensor x, Tensor gamma, Tensor w_qkv, Tensor w_codes, "
      "Tensor w_scales, Tensor? w_codes_t, Tensor? w_scales_t, Tensor h, Tensor h_scales, "
      "Tensor r, Tensor pos, Tensor rope_table, Tensor q_gamma, Tensor k_gamma, int n_heads, "
      "int n_kv_heads, float eps, bool recast_w_t=False) -> (Tensor qkv, Tensor qk_pre)");
  // Backward: the incoming gradient cast once; the weights' transposed codes; the copies kept
  // (fp8_mlp_backward without a's: made from z).
  m.def(
      "fp8_linear_backward(Tensor dout, Tensor? input_t, Tensor? input_t_scales, Tensor weight, "
      "Tensor w_codes_t, Tensor w_scales_t, Tensor? input=None) -> (Tensor dinput, "
      "Tensor dweight)");
  m.def(
      "fp8_mlp_backward(Tensor dx_out, Tensor x, Tensor gamma, Tensor w_gu, Tensor gu_codes_t, "
      "Tensor gu_scales_t, Tensor w_down, Tensor dn_codes_t, Tensor dn_scales_t, Tensor r, "
      "Tensor z, Tensor? a_t, Tensor? a_t_scales, Tensor? z_scales=None, bool residual=True) "
      "-> (Tensor dx, Tensor dgamma, Tensor dw_gu, Tensor dw_down)");
  m.def(
      "fp8_norm_qkv_qk_norm_backward(Tensor dqkv, Tensor qkv, Tensor qk_pre, Tensor x, "
      "Tensor gamma, Tensor w_qkv, Tensor w_codes_t, Tensor w_scales_t, Tensor r, Tensor pos, "
      "Tensor rope_table, Tensor q_gamma, Tensor k_gamma, int n_heads, int n_kv_heads, "
      "float eps) -> (Tensor dx, Tensor dgamma, Tensor dw_qkv, Tensor dq_gamma, "
      "Tensor dk_gamma)");
  m.def(
      "fp8_norm_qkv_backward(Tensor dqkv, Tensor qkv, Tensor x, Tensor gamma, Tensor w_qkv, "
      "Tensor w_codes_t, Tensor w_scales_t, Tensor r, Tensor pos, Tensor rope_table, "
      "Tensor? b_qkv=None) -> (Tensor dx, Tensor dgamma, Tensor dw_qkv, Tensor db_qkv)");
}

TORCH_LIBRARY_IMPL(coda, CPU, m) { register_kernels(m); }
#if CODA_TORCH_CUDA
TORCH_LIBRARY_IMPL(coda, CUDA, m) { register_kernels(m); }
#endif

TORCH_LIBRARY_IMPL(coda, Autograd, m) {
  for (const char* name : {"fp8_linear_backward", "fp8_mlp_backward", "fp8_norm_qkv_backward",
                           "fp8_norm_qkv_qk_norm_backward"})
    m.impl(name, torch::autograd::autogradNotImplementedFallback());
  m.impl("fp8_norm_qkv_qk_norm",
         [](const Tensor& x, const Tensor& gamma, const Tensor& w_qkv, const Tensor& wc,
            const Tensor& ws, const std::optional<Tensor>& wct, const std::optional<Tensor>& wst,
            const Tensor& h, const Tensor& hs, const Tensor& r, const Tensor& pos,
            const Tensor& table, const Tensor& q_gamma, const Tensor& k_gamma, int64_t n_heads,
            int64_t n_kv_heads, double eps, bool recast_w_t) {
           auto o = Fp8NormQkvQkNorm::apply(x, gamma, w_qkv, wc, ws, wct, wst, h, hs, r, pos, table,
                                            q_gamma, k_gamma, n_heads, n_kv_heads, eps, recast_w_t);
           return std::make_tuple(o[0], o[1]);
         });
  // copies=False (the caller computes no gradient: coda.nn passes torch.is_grad_enabled()):
  // below autograd without the transposed copies, the weight gradients' operands only; refused
  // where a gradient would be recorded.
  m.impl(
      "fp8_out_proj_residual_norm",
      [](const Tensor& y, const Tensor& w_o, const Tensor& wc, const Tensor& ws,
         const std::optional<Tensor>& wct, const std::optional<Tensor>& wst, const Tensor& residual,
         const Tensor& gamma, double eps, bool copies, bool recompute_y, bool recast_w_t) {
        if (!copies) {
          no_copies_without_grad("coda::fp8_out_proj_residual_norm", {&y, &w_o, &residual, &gamma});
          at::AutoDispatchBelowADInplaceOrView guard;
          return out_proj_op().call(y, w_o, wc, ws, wct, wst, residual, gamma, eps, false,
                                    recompute_y, recast_w_t);
        }
        auto o = Fp8OutProjResidualNorm::apply(y, w_o, wc, ws, wct, wst, residual, gamma, eps,
                                               recompute_y, recast_w_t);
        return std::make_tuple(o[0], o[1], o[2], o[3], o[4], o[5]);
      });
  m.impl("fp8_mlp", [](const Tensor& x, const Tensor& gamma, const Tensor& w_gu, const Tensor& guc,
                       const Tensor& gus, const std::optional<Tensor>& guct,
                       const std::optional<Tensor>& gust, const Tensor& w_down, const Tensor& dnc,
                       const Tensor& dns, const std::optional<Tensor>& dnct,
                       const std::optional<Tensor>& dnst, const Tensor& h, const Tensor& hs,
                       const Tensor& r, const Tensor& gamma_next, double eps, bool act_h_out,
                       bool copies, bool recompute_a, bool recast_w_t, bool fp8_z) {
    if (!copies) {
      no_copies_without_grad("coda::fp8_mlp", {&x, &gamma, &w_gu, &w_down, &r, &gamma_next});
      at::AutoDispatchBelowADInplaceOrView guard;
      return mlp_op().call(x, gamma, w_gu, guc, gus, guct, gust, w_down, dnc, dns, dnct, dnst, h,
                           hs, r, gamma_next, eps, act_h_out, false, recompute_a, recast_w_t,
                           fp8_z);
    }
    auto o = Fp8Mlp::apply(x, gamma, w_gu, guc, gus, guct, gust, w_down, dnc, dns, dnct, dnst, h,
                           hs, r, gamma_next, eps, act_h_out, recompute_a, recast_w_t, fp8_z);
    return std::make_tuple(o[0], o[1], o[2], o[3], o[4], o[5], o[6], o[7]);
  });
  m.impl("fp8_linear", [](const Tensor& y, const Tensor& w, const Tensor& wc, const Tensor& ws,
                          const std::optional<Tensor>& wct, const std::optional<Tensor>& wst,
                          bool copies, bool recast_w_t) {
    if (!copies) {
      no_copies_without_grad("coda::fp8_linear", {&y, &w});
      at::AutoDispatchBelowADInplaceOrView guard;
      return linear_op().call(y, w, wc, ws, wct, wst, false, recast_w_t);
    }
    auto o = Fp8Linear::apply(y, w, wc, ws, wct, wst, recast_w_t);
    return std::make_tuple(o[0], o[1], o[2]);
  });
  m.impl("fp8_mlp_partial",
         [](const Tensor& x, const Tensor& gamma, const Tensor& w_gu, const Tensor& guc,
            const Tensor& gus, const std::optional<Tensor>& guct, const std::optional<Tensor>& gust,
            const Tensor& w_down, const Tensor& dnc, const Tensor& dns,
            const std::optional<Tensor>& dnct, const std::optional<Tensor>& dnst, const Tensor& h,
            const Tensor& hs, const Tensor& r, bool copies, bool recompute_a, bool recast_w_t,
            bool fp8_z) {
           if (!copies) {
             no_copies_without_grad("coda::fp8_mlp_partial", {&x, &gamma, &w_gu, &w_down, &r});
             at::AutoDispatchBelowADInplaceOrView guard;
             return mlp_partial_op().call(x, gamma, w_gu, guc, gus, guct, gust, w_down, dnc, dns,
                                          dnct, dnst, h, hs, r, false, recompute_a, recast_w_t,
                                          fp8_z);
           }
           auto o = Fp8MlpPartial::apply(x, gamma, w_gu, guc, gus, guct, gust, w_down, dnc, dns,
                                         dnct, dnst, h, hs, r, recompute_a, recast_w_t, fp8_z);
           return std::make_tuple(o[0], o[1], o[2], o[3], o[4]);
         });
  m.impl("fp8_norm_qkv",
         [](const Tensor& x, const Tensor& gamma, const Tensor& w_qkv, const Tensor& wc,
            const Tensor& ws, const std::optional<Tensor>& wct, const std::optional<Tensor>& wst,
            const Tensor& h, const Tensor& hs, const Tensor& r, const Tensor& pos,
            const Tensor& table, const std::optional<Tensor>& b_qkv, bool recast_w_t) {
           return Fp8NormQkv::apply(x, gamma, w_qkv, wc, ws, wct, wst, h, hs, r, pos, table, b_qkv,
                                    recast_w_t);
         });
}

}  // namespace coda::torch_ext
