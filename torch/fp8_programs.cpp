// The blockwise FP8 programs (docs/torch-ops.md, "FP8"): a GEMM whose epilogue quantizes its output
// (F1's h, F2's a, B1's h_out copy, B2's dz), F1 with h in the activation dtype, F3 / F3q on FP8
// operands and the SwiGLU cast of a recomputed copy. On CUDA they run the Hopper kernels through
// include/coda/ops.hpp; on the CPU the host oracles of reference/fp8_programs.hpp in fp64, rounded
// to the activation dtype and cast by the recipe, in the layouts the kernels write
// (fp8_common.hpp), so CPU and CUDA results compare code for code.
#include "coda/reference/fp8_programs.hpp"

#include <torch/library.h>

#include <optional>
#include <tuple>
#include <vector>

#include "checks.hpp"
#include "coda/epilogue/elementwise.hpp"
#include "fp8_common.hpp"
#include "fp8_ops.hpp"
#include "meta_kernel.hpp"
#if CODA_TORCH_CUDA
#include <c10/cuda/CUDAGuard.h>
#endif

namespace coda::torch_ext {
namespace {

using namespace fp8_detail;  // NOLINT(google-build-using-namespace): the shared FP8 helpers

// ---- the FP8 programs: a GEMM whose epilogue quantizes its output ----------------------------
// Each writes one (rows, cols) tensor in 1x128 blocks (`rows`) and / or as its transposed 128x1
// copy (`transposed`), in the layouts fp8_quantize_rows writes; the copies not asked for are
// empty. On the CPU the oracle of reference/fp8_programs.hpp runs in fp64, its output is rounded
// to the activation dtype (as the epilogue rounds it to bf16) and cast by quantize_blockwise.
struct RowCast {
  Tensor codes, scales, codes_t, scales_t;
};
RowCast row_cast_outputs(const Tensor& like, int64_t rows, int64_t cols, bool want_rows,
                         bool want_t) {
  auto [codes, scales, codes_t, scales_t] =
      empty_quantized_outputs(like, rows, cols, want_rows, want_t);
  return {codes, scales, codes_t, scales_t};
}

std::vector<double> to_doubles(const Tensor& t) {
  const Tensor d = t.to(at::kDouble).contiguous();
  return std::vector<double>(d.data_ptr<double>(), d.data_ptr<double>() + d.numel());
}
Tensor from_doubles(const std::vector<double>& v, int64_t rows, int64_t cols) {
  return at::from_blob(const_cast<double*>(v.data()), {rows, cols}, at::kDouble).clone();
}
// The statistic dtype of an activation dtype: float64 for float64 (CPU), else float32.
at::ScalarType stat_of(at::ScalarType act) { return act == at::kDouble ? at::kDouble : at::kFloat; }

// v (rows, cols), the oracle's fp64 values: rounded to `act`, then cast into o's outputs.
void cast_on_cpu(const std::vector<double>& v, int64_t rows, int64_t cols, at::ScalarType act,
                 RowCast& o) {
  const Tensor rounded = from_doubles(v, rows, cols).to(act).to(at::kDouble).contiguous();
  const double* p = rounded.data_ptr<double>();
  if (o.codes.numel() > 0) {
    const auto q = reference::quantize_blockwise(
        reference::MatrixRef<double>::row_major(p, rows, cols), 1, 128);
    put_codes(q, o.codes);
    put_row_scales(q, o.scales);
  }
  if (o.codes_t.numel() > 0) {
    const auto q = reference::quantize_blockwise(
        reference::MatrixRef<double>::transposed(p, cols, rows), 1, 128);
    o.codes_t.zero_();
    put_codes(q, o.codes_t);
    put_row_scales(q, o.scales_t);
  }
}

// An activation argument of an FP8 program: a contiguous (rows, cols) matrix on `first`'s device,
// bf16 (or float32 / float64 on the CPU).
void check_activation(const char* op, const char* name, const Tensor& t, int64_t rows, int64_t cols,
                      const Tensor& first) {
  TORCH_CHECK(t.defined(), op, ": ", name, " is undefined");
  TORCH_CHECK(t.device() == first.device(), op, ": ", name, " must be on ", first.device(),
              ", got ", t.device());
  TORCH_CHECK(t.sizes() == c10::IntArrayRef({rows, cols}), op, ": ", name, " must be (", rows, ", ",
              cols, "), got ", shape_string(t.sizes()));
  check_input(op, name, t);
}
// A per-row (or per-column) statistic: a contiguous (n) vector, float32 (or float64 on the CPU).
void check_statistic(const char* op, const char* name, const Tensor& t, int64_t n,
                     const Tensor& first) {
  TORCH_CHECK(t.defined(), op, ": ", name, " is undefined");
  TORCH_CHECK(t.device() == first.device(), op, ": ", name, " must be on ", first.device(),
              ", got ", t.device());
  const auto s = t.scalar_type();
  TORCH_CHECK(s == at::kFloat || (t.is_cpu() && s == at::kDouble), op, ": ", name,
              " must be float32", t.is_cpu() ? " (or float64 on the CPU)" : "", ", got ", s);
  TORCH_CHECK(t.dim() == 1 && t.size(0) == n && t.is_contiguous(), op, ": ", name,
              " must be a contiguous (", n, ") vector, got ", shape_string(t.sizes()), " strides ",
              shape_string(t.strides()));
}
// A per-column weight (γ): a contiguous (n) vector of `like`'s dtype.
void check_weight_vector(const char* op, const char* name, const Tensor& t, int64_t n,
                         const char* like_name, const Tensor& like) {
  TORCH_CHECK(t.defined(), op, ": ", name, " is undefined");
  TORCH_CHECK(t.device() == like.device(), op, ": ", name, " must be on ", like.device(), ", got ",
              t.device());
  TORCH_CHECK(
      t.dim() == 1 && t.size(0) == n && t.is_contiguous() && t.scalar_type() == like.scalar_type(),
      op, ": ", name, " must be a contiguous (", n, ") vector of ", like_name, "'s dtype ",
      like.scalar_type(), ", got ", shape_string(t.sizes()), " ", t.scalar_type());
}

#if CODA_TORCH_CUDA
TensorView vector_view(const Tensor& t, DType d) {
  return TensorView::vector(t.data_ptr(), d, t.numel(), t.device().index());
}
// A RowCast's four views; the outputs not asked for are absent (null).
struct RowCastViews {
  TensorView codes, scales, codes_t, scales_t;
};
RowCastViews views_of(const RowCast& o) {
  RowCastViews v;
  if (o.codes.numel() > 0) {
    v.codes = codes_view(o.codes);
    v.scales = scales_view(o.scales);
  }
  if (o.codes_t.numel() > 0) {
    v.codes_t = codes_view(o.codes_t);
    v.scales_t = scales_view(o.scales_t);
  }
  return v;
}
#endif

// F1 over FP8 operands (ops::gemm_fp8_residual_rmsnorm): x = a · wᵀ + residual, h = x ⊙ γ in
// residual's dtype quantized in 1x128 blocks (`rows`) and as its transposed 128x1 copy
// (`transposed`), Σx² partials per 128x128 tile for rmsnorm_fold. On the CPU residual and gamma
// may be float32 or float64 too (x, h and the partials then stay in that precision).
using Fp8F1 = std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor>;
Fp8F1 fp8_gemm_residual_rmsnorm(const Tensor& a, const Tensor& a_scales, const Tensor& w,
                                const Tensor& w_scales, const Tensor& residual, const Tensor& gamma,
                                bool rows, bool transposed) {
  const char* op = "coda::fp8_gemm_residual_rmsnorm";
  const auto [m, n, k] = check_pair(op, "a", a, "a_scales", a_scales, w, w_scales, true);
  check_input(op, "residual", residual);
  TORCH_CHECK(residual.device() == a.device() && gamma.device() == a.device(), op,
              ": residual and gamma must be on ", a.device(), ", got ", residual.device(), " and ",
              gamma.device());
  TORCH_CHECK(residual.sizes() == c10::IntArrayRef({m, n}), op, ": residual must be (", m, ", ", n,
              "), got ", shape_string(residual.sizes()));
  TORCH_CHECK(gamma.dim() == 1 && gamma.size(0) == n && gamma.is_contiguous() &&
                  gamma.scalar_type() == residual.scalar_type(),
              op, ": gamma must be a contiguous (", n, ") vector of residual's dtype ",
              residual.scalar_type(), ", got ", shape_string(gamma.sizes()), " ",
              gamma.scalar_type());
  TORCH_CHECK(rows || transposed, op, ": neither rows nor transposed is asked for");
  const at::ScalarType act = residual.scalar_type();
  RowCast h = row_cast_outputs(a, m, n, rows, transposed);
  if (a.is_cpu()) {
    const auto f = reference::fp8_residual_rmsnorm<double>(read_operand(a, a_scales, false),
                                                           read_operand(w, w_scales, true),
                                                           to_doubles(residual), to_doubles(gamma));
    cast_on_cpu(f.h, m, n, act, h);
    const Tensor s = from_doubles(f.partials, f.layout.tiles, f.layout.extent).to(stat_of(act));
    return {from_doubles(f.x, m, n).to(act), h.codes, h.scales, h.codes_t, h.scales_t, s};
  }
#if CODA_TORCH_CUDA
  const c10::cuda::CUDAGuard guard(a.device());
  TORCH_CHECK(act == at::kBFloat16, op, ": residual must be bfloat16 on CUDA, got ", act);
  const Tensor x = at::empty({m, n}, residual.options());
  const auto l = ops::fp8_residual_rmsnorm_partials_layout(m, n, k);
  const Tensor s = at::empty({l.tiles, l.extent}, scale_options(a));
  const RowCastViews v = views_of(h);
  ops::gemm_fp8_residual_rmsnorm(
      codes_view(a), scales_view(a_scales), codes_view(w), scales_view(w_scales),
      view(residual, DType::kBF16), vector_view(gamma, DType::kBF16), view(x, DType::kBF16),
      v.codes, v.scales, v.codes_t, v.scales_t, view(s, DType::kF32), stream_of(a));
  return {x, h.codes, h.scales, h.codes_t, h.scales_t, s};
#else
  TORCH_CHECK(false, op, ": this build has no CUDA kernels");
#endif
}

// F2 over FP8 operands (ops::gemm_fp8_rmsnorm_swiglu): z = r ⊙ (h · w_guᵀ) (M, 2I), gate / up
// interleaved, and a = silu(z_g) · z_u (M, I) from the unrounded z, rounded to the activation
// dtype and quantized (`rows`, `transposed`). No input carries the activation dtype: `dtype`
// names it, bfloat16 by default and on CUDA; on the CPU float32 or float64 keep z and a (before
// the cast) in that precision. r (M): float32 (or float64 on the CPU).
using Fp8F2 = std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor>;
struct F2Sizes {
  int64_t m, two_i;
  at::ScalarType act;
};
F2Sizes check_f2(const char* op, const Tensor& h, const Tensor& h_scales, const Tensor& w_gu,
                 const Tensor& w_gu_scales, const Tensor& r, bool rows, bool transposed,
                 std::optional<at::ScalarType> dtype) {
  const auto [m, two_i, k] =
      check_pair(op, "h", h, "h_scales", h_scales, w_gu, w_gu_scales, true, "w_gu", "w_gu_scales");
  TORCH_CHECK(two_i % 32 == 0, op, ": w_gu's rows (2I) must be a multiple of 32 (a's codes are ",
              "rows of I e4m3 bytes, 16-byte aligned), got ", two_i);
  check_statistic(op, "r", r, m, h);
  const at::ScalarType act = dtype.value_or(at::kBFloat16);
  TORCH_CHECK(act == at::kBFloat16 || (h.is_cpu() && (act == at::kFloat || act == at::kDouble)), op,
              ": dtype must be bfloat16", h.is_cpu() ? " (or float32 / float64 on the CPU)" : "",
              ", got ", act);
  TORCH_CHECK(rows || transposed, op, ": neither rows nor transposed is asked for");
  return {m, two_i, act};
}
// F2's oracle in fp64 (reference::fp8_rmsnorm_swiglu): a rounded to `act` and cast into a's
// outputs; returns z.
std::vector<double> f2_on_cpu(const Tensor& h, const Tensor& h_scales, const Tensor& w_gu,
                              const Tensor& w_gu_scales, const Tensor& r, at::ScalarType act,
                              RowCast& a) {
  auto f = reference::fp8_rmsnorm_swiglu<double>(
      read_operand(h, h_scales, false), read_operand(w_gu, w_gu_scales, true), to_doubles(r));
  cast_on_cpu(f.a, h.size(0), w_gu.size(0) / 2, act, a);
  return std::move(f.z);
}
Fp8F2 fp8_gemm_rmsnorm_swiglu(const Tensor& h, const Tensor& h_scales, const Tensor& w_gu,
                              const Tensor& w_gu_scales, const Tensor& r, bool rows,
                              bool transposed, std::optional<at::ScalarType> dtype) {
  const char* op = "coda::fp8_gemm_rmsnorm_swiglu";
  const auto [m, two_i, act] =
      check_f2(op, h, h_scales, w_gu, w_gu_scales, r, rows, transposed, dtype);
  const int64_t inter = two_i / 2;
  RowCast a = row_cast_outputs(h, m, inter, rows, transposed);
  if (h.is_cpu()) {
    const std::vector<double> z = f2_on_cpu(h, h_scales, w_gu, w_gu_scales, r, act, a);
    return {from_doubles(z, m, two_i).to(act), a.codes, a.scales, a.codes_t, a.scales_t};
  }
#if CODA_TORCH_CUDA
  const c10::cuda::CUDAGuard guard(h.device());
  const Tensor z = at::empty({m, two_i}, h.options().dtype(at::kBFloat16));
  const RowCastViews v = views_of(a);
  ops::gemm_fp8_rmsnorm_swiglu(codes_view(h), scales_view(h_scales), codes_view(w_gu),
                               scales_view(w_gu_scales), vector_view(r, DType::kF32),
                               view(z, DType::kBF16), v.codes, v.scales, v.codes_t, v.scales_t,
                               stream_of(h));
  return {z, a.codes, a.scales, a.codes_t, a.scales_t};
#else
  TORCH_CHECK(false, op, ": this build has no CUDA kernels");
#endif
}

// F2 with z saved in FP8 (ops::gemm_fp8_rmsnorm_swiglu_fp8_z): as fp8_gemm_rmsnorm_swiglu, but z
// is rounded to the activation dtype and quantized in 1x128 blocks (codes (M, 2I), scales
// (ceil(2I/128), M)) instead of returned: z's codes are the cast of fp8_gemm_rmsnorm_swiglu's z.
// Returns (z, z_scales, a, a_scales, a_t, a_t_scales).
using Fp8F2Z = std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor>;
Fp8F2Z fp8_gemm_rmsnorm_swiglu_fp8_z(const Tensor& h, const Tensor& h_scales, const Tensor& w_gu,
                                     const Tensor& w_gu_scales, const Tensor& r, bool rows,
                                     bool transposed, std::optional<at::ScalarType> dtype) {
  const char* op = "coda::fp8_gemm_rmsnorm_swiglu_fp8_z";
  const auto [m, two_i, act] =
      check_f2(op, h, h_scales, w_gu, w_gu_scales, r, rows, transposed, dtype);
  const int64_t inter = two_i / 2;
  RowCast a = row_cast_outputs(h, m, inter, rows, transposed);
  RowCast z = row_cast_outputs(h, m, two_i, true, false);
  if (h.is_cpu()) {
    cast_on_cpu(f2_on_cpu(h, h_scales, w_gu, w_gu_scales, r, act, a), m, two_i, act, z);
    return {z.codes, z.scales, a.codes, a.scales, a.codes_t, a.scales_t};
  }
#if CODA_TORCH_CUDA
  const c10::cuda::CUDAGuard guard(h.device());
  const RowCastViews v = views_of(a);
  if (ops::fp8_epilogue_split(ops::Fp8SplitProgram::kF2z, h.size(1))) {
    // Split (ops::fp8_epilogue_placement): the plain GEMM's y in bf16, then F2's pass over it.
    const Tensor y = at::empty({m, two_i}, h_scales.options().dtype(at::kBFloat16));
    ops::gemm_fp8(codes_view(h), scales_view(h_scales), codes_view(w_gu), scales_view(w_gu_scales),
                  view(y, DType::kBF16), stream_of(h));
    ops::fp8_rmsnorm_swiglu_quantize(view(y, DType::kBF16), vector_view(r, DType::kF32),
                                     codes_view(z.codes), scales_view(z.scales), v.codes, v.scales,
                                     v.codes_t, v.scales_t, stream_of(h));
    return {z.codes, z.scales, a.codes, a.scales, a.codes_t, a.scales_t};
  }
  ops::gemm_fp8_rmsnorm_swiglu_fp8_z(codes_view(h), scales_view(h_scales), codes_view(w_gu),
                                     scales_view(w_gu_scales), vector_view(r, DType::kF32),
                                     codes_view(z.codes), scales_view(z.scales), v.codes, v.scales,
                                     v.codes_t, v.scales_t, stream_of(h));
  return {z.codes, z.scales, a.codes, a.scales, a.codes_t, a.scales_t};
#else
  TORCH_CHECK(false, op, ": this build has no CUDA kernels");
#endif
}

// z as B2 and the recomputed aᵀ read it: in the activation dtype, or saved in FP8 (float8_e4m3fn
// codes (M, 2I) with z_scales (ceil(2I/128), M), fp8_gemm_rmsnorm_swiglu_fp8_z's). Returns the
// dtype the outputs round to: z's, or with FP8 z `dtype` (bfloat16 by default; float32 / float64
// on the CPU).
at::ScalarType check_z(const char* op, const Tensor& z, const std::optional<Tensor>& z_scales,
                       std::optional<at::ScalarType> dtype, int64_t m, int64_t two_i,
                       const Tensor& first) {
  TORCH_CHECK(z.defined(), op, ": z is undefined");
  const bool fp8 = z.scalar_type() == at::kFloat8_e4m3fn;
  TORCH_CHECK(fp8 == z_scales.has_value(), op,
              ": pass z_scales exactly when z is float8_e4m3fn (z saved in FP8); got z of dtype ",
              z.scalar_type(), z_scales ? " with z_scales" : " without z_scales");
  if (!fp8) {
    check_activation(op, "z", z, m, two_i, first);
    TORCH_CHECK(!dtype || *dtype == z.scalar_type(), op, ": dtype (", *dtype,
                ") applies to an FP8 z; the outputs round to z's dtype ", z.scalar_type());
    return z.scalar_type();
  }
  check_operand(op, "z", z, "z_scales", *z_scales, first);
  TORCH_CHECK(z.size(0) == m && z.size(1) == two_i, op, ": z must be (", m, ", ", two_i, "), got ",
              shape_string(z.sizes()));
  check_scale_shape(op, "z_scales", *z_scales, blocks(two_i), m);
  const at::ScalarType act = dtype.value_or(at::kBFloat16);
  TORCH_CHECK(act == at::kBFloat16 || (z.is_cpu() && (act == at::kFloat || act == at::kDouble)), op,
              ": dtype must be bfloat16", z.is_cpu() ? " (or float32 / float64 on the CPU)" : "",
              ", got ", act);
  return act;
}
// z's values in fp64 (an FP8 z decoded: exact).
std::vector<double> z_values(const Tensor& z, const std::optional<Tensor>& z_scales) {
  if (z_scales) return read_operand(z, *z_scales, false).dequantized();
  return to_doubles(z);
}

// B1 over FP8 operands (ops::gemm_fp8_rmsnorm_backward): g = dz · W from dz (M, K) in 1x128
// blocks and w_t = Wᵀ's codes (H, K) in 128x128 blocks (fp8_quantize_blocks(W, transposed=True)'s
// codes_t); dx = dres + r·(g·γ − x·r·ZdZ) (M, H) in x's dtype; h_out = x·r·γ (the GEMM's
// normalized input) rounded to x's dtype, its transposed 128x1 copy quantized (the weight
// gradient dW = dzᵀ · h_out's operand); the dγ partials PartialLayout::per_column(M, H, 128, 128)
// for dgamma_fold. zdz is the folded ZdZ (already / H). On the CPU x, dres and γ may be float32
// or float64 too.
using Fp8B1 = std::tuple<Tensor, Tensor, Tensor, Tensor>;
Fp8B1 fp8_gemm_rmsnorm_backward(const Tensor& dz, const Tensor& dz_scales, const Tensor& w_t,
                                const Tensor& w_t_scales, const Tensor& x, const Tensor& r,
                                const Tensor& gamma, const Tensor& zdz,
                                const std::optional<Tensor>& dres_in) {
  const char* op = "coda::fp8_gemm_rmsnorm_backward";
  const auto [m, hidden, k] =
      check_pair(op, "dz", dz, "dz_scales", dz_scales, w_t, w_t_scales, true, "w_t", "w_t_scales");
  TORCH_CHECK(hidden % 16 == 0, op, ": w_t's rows (H) must be a multiple of 16 (16-byte rows of ",
              "h_t's codes), got ", hidden);
  check_activation(op, "x", x, m, hidden, dz);
  const Tensor dres = dres_in.value_or(Tensor());  // None: no residual gradient
  if (dres.defined()) {
    check_activation(op, "dres", dres, m, hidden, dz);
    TORCH_CHECK(dres.scalar_type() == x.scalar_type(), op, ": dres must have x's dtype ",
                x.scalar_type(), ", got ", dres.scalar_type());
  }
  check_weight_vector(op, "gamma", gamma, hidden, "x", x);
  check_statistic(op, "r", r, m, dz);
  check_statistic(op, "zdz", zdz, m, dz);
  const at::ScalarType act = x.scalar_type();
  RowCast q = row_cast_outputs(dz, m, hidden, false, true);
  if (dz.is_cpu()) {
    const auto f = reference::fp8_rmsnorm_backward<double>(
        read_operand(dz, dz_scales, false), read_operand(w_t, w_t_scales, true), to_doubles(x),
        to_doubles(r), to_doubles(gamma), to_doubles(zdz),
        dres.defined() ? to_doubles(dres) : std::vector<double>{});
    cast_on_cpu(f.h, m, hidden, act, q);
    const Tensor s =
        from_doubles(f.dgamma_partials, f.layout.tiles, f.layout.extent).to(stat_of(act));
    return {from_doubles(f.dx, m, hidden).to(act), q.codes_t, q.scales_t, s};
  }
#if CODA_TORCH_CUDA
  const c10::cuda::CUDAGuard guard(dz.device());
  const Tensor dx = at::empty({m, hidden}, x.options());
  if (ops::fp8_epilogue_split(ops::Fp8SplitProgram::kB1, k)) {
    // Split (ops::fp8_epilogue_placement): the plain GEMM's g in bf16, then B1's pass over it.
    const Tensor g = at::empty({m, hidden}, x.options());
    ops::gemm_fp8(codes_view(dz), scales_view(dz_scales), codes_view(w_t), scales_view(w_t_scales),
                  view(g, DType::kBF16), stream_of(dz));
    const auto l = ops::fp8_rmsnorm_backward_split_partials_layout(m, hidden);
    const Tensor s = at::empty({l.tiles, l.extent}, scale_options(dz));
    ops::fp8_rmsnorm_backward_quantize(
        view(g, DType::kBF16), view(x, DType::kBF16), vector_view(r, DType::kF32),
        vector_view(gamma, DType::kBF16), vector_view(zdz, DType::kF32),
        dres.defined() ? view(dres, DType::kBF16) : TensorView{}, view(dx, DType::kBF16),
        codes_view(q.codes_t), scales_view(q.scales_t), view(s, DType::kF32), stream_of(dz));
    return {dx, q.codes_t, q.scales_t, s};
  }
  const auto l = ops::fp8_rmsnorm_backward_partials_layout(m, hidden, k);
  const Tensor s = at::empty({l.tiles, l.extent}, scale_options(dz));
  ops::gemm_fp8_rmsnorm_backward(
      codes_view(dz), scales_view(dz_scales), codes_view(w_t), scales_view(w_t_scales),
      view(x, DType::kBF16), vector_view(r, DType::kF32), vector_view(gamma, DType::kBF16),
      vector_view(zdz, DType::kF32), dres.defined() ? view(dres, DType::kBF16) : TensorView{},
      view(dx, DType::kBF16), codes_view(q.codes_t), scales_view(q.scales_t), view(s, DType::kF32),
      stream_of(dz));
  return {dx, q.codes_t, q.scales_t, s};
#else
  TORCH_CHECK(false, op, ": this build has no CUDA kernels");
#endif
}

// B2 over FP8 operands (ops::gemm_fp8_swiglu_backward): da = dx_out · W_down from dx_out (M, H)
// in 1x128 blocks and w_down_t = W_downᵀ's codes (I, H) in 128x128 blocks; with z (M, 2I) the
// saved interleaved pre-activation, dz (M, 2I) = dSwiGLU (docs/math.md B2) rounded to z's dtype
// and quantized (`rows`, `transposed`), and the ZdZ partials Σ g·dg + u·du (not yet / H),
// PartialLayout::per_row(M, I, 128, 128) (split: ops::fp8_swiglu_backward_split_partials_layout's
// 64-column tiles), for zdz_fold. On the CPU z may be float32 or float64.
// On CUDA the fused kernel, or split (ops::fp8_epilogue_split): the plain GEMM's da in
// bf16 (M·I·2 bytes, freed on return) and ops::fp8_swiglu_backward_quantize.
using Fp8B2 = std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor>;
Fp8B2 fp8_gemm_swiglu_backward(const Tensor& dx_out, const Tensor& dx_out_scales,
                               const Tensor& w_down_t, const Tensor& w_down_t_scales,
                               const Tensor& z, bool rows, bool transposed,
                               const std::optional<Tensor>& z_scales,
                               std::optional<at::ScalarType> dtype) {
  const char* op = "coda::fp8_gemm_swiglu_backward";
  const auto [m, inter, k] =
      check_pair(op, "dx_out", dx_out, "dx_out_scales", dx_out_scales, w_down_t, w_down_t_scales,
                 true, "w_down_t", "w_down_t_scales");
  TORCH_CHECK(inter % 8 == 0, op, ": w_down_t's rows (I) must be a multiple of 8 (dz's codes are ",
              "rows of 2I e4m3 bytes, 16-byte aligned), got ", inter);
  const at::ScalarType act = check_z(op, z, z_scales, dtype, m, 2 * inter, dx_out);
  TORCH_CHECK(rows || transposed, op, ": neither rows nor transposed is asked for");
  RowCast q = row_cast_outputs(dx_out, m, 2 * inter, rows, transposed);
  if (dx_out.is_cpu()) {
    const auto f = reference::fp8_swiglu_backward<double>(
        read_operand(dx_out, dx_out_scales, false), read_operand(w_down_t, w_down_t_scales, true),
        z_values(z, z_scales));
    cast_on_cpu(f.dz, m, 2 * inter, act, q);
    const Tensor s = from_doubles(f.zdz_partials, f.layout.tiles, f.layout.extent).to(stat_of(act));
    return {q.codes, q.scales, q.codes_t, q.scales_t, s};
  }
#if CODA_TORCH_CUDA
  const c10::cuda::CUDAGuard guard(dx_out.device());
  const RowCastViews v = views_of(q);
  if (ops::fp8_epilogue_split(ops::Fp8SplitProgram::kB2, k)) {
    // Split (ops::fp8_epilogue_placement): the plain GEMM's da in bf16, then B2's pass over it.
    const Tensor da = at::empty({m, inter}, dx_out.options().dtype(at::kBFloat16));
    ops::gemm_fp8(codes_view(dx_out), scales_view(dx_out_scales), codes_view(w_down_t),
                  scales_view(w_down_t_scales), view(da, DType::kBF16), stream_of(dx_out));
    const auto l = ops::fp8_swiglu_backward_split_partials_layout(m, inter);
    const Tensor s = at::empty({l.tiles, l.extent}, scale_options(dx_out));
    ops::fp8_swiglu_backward_quantize(
        view(da, DType::kBF16), z_scales ? codes_view(z) : view(z, DType::kBF16),
        z_scales ? scales_view(*z_scales) : TensorView{}, v.codes, v.scales, v.codes_t,
        v.scales_t, view(s, DType::kF32), stream_of(dx_out));
    return {q.codes, q.scales, q.codes_t, q.scales_t, s};
  }
  if (z_scales) {
    const auto l = ops::fp8_swiglu_backward_fp8_z_partials_layout(m, inter, k);
    const Tensor s = at::empty({l.tiles, l.extent}, scale_options(dx_out));
    ops::gemm_fp8_swiglu_backward_fp8_z(
        codes_view(dx_out), scales_view(dx_out_scales), codes_view(w_down_t),
        scales_view(w_down_t_scales), codes_view(z), scales_view(*z_scales), v.codes, v.scales,
        v.codes_t, v.scales_t, view(s, DType::kF32), stream_of(dx_out));
    return {q.codes, q.scales, q.codes_t, q.scales_t, s};
  }
  const auto l = ops::fp8_swiglu_backward_partials_layout(m, inter, k);
  const Tensor s = at::empty({l.tiles, l.extent}, scale_options(dx_out));
  ops::gemm_fp8_swiglu_backward(codes_view(dx_out), scales_view(dx_out_scales),
                                codes_view(w_down_t), scales_view(w_down_t_scales),
                                view(z, DType::kBF16), v.codes, v.scales, v.codes_t, v.scales_t,
                                view(s, DType::kF32), stream_of(dx_out));
  return {q.codes, q.scales, q.codes_t, q.scales_t, s};
#else
  TORCH_CHECK(false, op, ": this build has no CUDA kernels");
#endif
}

// a = silu(g)·u of z (M, 2I) (F2's interleaved pre-activation, in the activation dtype or in FP8
// with z_scales), rounded to z's dtype (an FP8 z's: `dtype`), as its transposed 128x1 copy (codes
// (I, M16), scales (ceil(M/128), I)): the down-projection's weight gradient operand recomputed in
// the backward instead of kept from the forward (ops::quantize_fp8_swiglu_t[_fp8_z] on CUDA; on
// the CPU a in fp64, rounded, then the recipe's cast).
std::tuple<Tensor, Tensor> fp8_swiglu_quantize_t(const Tensor& z,
                                                 const std::optional<Tensor>& z_scales,
                                                 std::optional<at::ScalarType> dtype) {
  const char* op = "coda::fp8_swiglu_quantize_t";
  TORCH_CHECK(z.defined() && z.dim() == 2, op, ": z must be a matrix, got ",
              z.defined() ? std::to_string(z.dim()) + " dimensions" : "undefined");
  const at::ScalarType act = check_z(op, z, z_scales, dtype, z.size(0), z.size(1), z);
  TORCH_CHECK(z.size(1) % 32 == 0, op, ": z's columns (2I) must be a multiple of 32 (I a ",
              "multiple of 16), got ", z.size(1));
  const int64_t m = z.size(0), inter = z.size(1) / 2;
  RowCast q = row_cast_outputs(z, m, inter, false, true);
  if (z.is_cpu()) {
    const std::vector<double> zv = z_values(z, z_scales);
    std::vector<double> a(size_t(m * inter));
    for (size_t i = 0; i < a.size(); ++i) a[i] = epilogue::SwiGlu{}(zv[2 * i], zv[2 * i + 1]);
    cast_on_cpu(a, m, inter, act, q);
    return {q.codes_t, q.scales_t};
  }
#if CODA_TORCH_CUDA
  const c10::cuda::CUDAGuard guard(z.device());
  if (z_scales) {
    ops::quantize_fp8_swiglu_t_fp8_z(codes_view(z), scales_view(*z_scales), codes_view(q.codes_t),
                                     scales_view(q.scales_t), stream_of(z));
  } else {
    ops::quantize_fp8_swiglu_t(view(z, DType::kBF16), codes_view(q.codes_t),
                               scales_view(q.scales_t), stream_of(z));
  }
  return {q.codes_t, q.scales_t};
#else
  TORCH_CHECK(false, op, ": this build has no CUDA kernels");
#endif
}

// F1 over FP8 operands with h in the activation dtype (the last layer's, for the LM head): x, h
// (M, N) and the Σx² partials as out_proj_residual_norm's, from fp8_gemm's operands.
std::tuple<Tensor, Tensor, Tensor> fp8_gemm_residual_rmsnorm_act_h(
    const Tensor& a, const Tensor& a_scales, const Tensor& w, const Tensor& w_scales,
    const Tensor& residual, const Tensor& gamma) {
  const char* op = "coda::fp8_gemm_residual_rmsnorm (bf16 h)";
  const auto [m, n, k] = check_pair(op, "a", a, "a_scales", a_scales, w, w_scales, true);
  check_activation(op, "residual", residual, m, n, a);
  check_weight_vector(op, "gamma", gamma, n, "residual", residual);
  const at::ScalarType act = residual.scalar_type();
  if (a.is_cpu()) {
    const auto f = reference::fp8_residual_rmsnorm<double>(read_operand(a, a_scales, false),
                                                           read_operand(w, w_scales, true),
                                                           to_doubles(residual), to_doubles(gamma));
    return {from_doubles(f.x, m, n).to(act), from_doubles(f.h, m, n).to(act),
            from_doubles(f.partials, f.layout.tiles, f.layout.extent).to(stat_of(act))};
  }
#if CODA_TORCH_CUDA
  const c10::cuda::CUDAGuard guard(a.device());
  const Tensor x = at::empty({m, n}, residual.options()), h = at::empty({m, n}, residual.options());
  const auto l = ops::fp8_residual_rmsnorm_bf16_partials_layout(m, n, k);
  const Tensor s = at::empty({l.tiles, l.extent}, scale_options(a));
  ops::gemm_fp8_residual_rmsnorm_bf16(codes_view(a), scales_view(a_scales), codes_view(w),
                                      scales_view(w_scales), view(residual, DType::kBF16),
                                      vector_view(gamma, DType::kBF16), view(x, DType::kBF16),
                                      view(h, DType::kBF16), view(s, DType::kF32), stream_of(a));
  return {x, h, s};
#else
  TORCH_CHECK(false, op, ": this build has no CUDA kernels");
#endif
}

// The host oracle's RoPE inputs: positions (M) and the column table (N) from a (2, N) int32
// rope_table of (hi, lo) words.
std::tuple<std::vector<int32_t>, std::vector<programs::RopeFrequency>> host_rope(
    const Tensor& pos, const Tensor& rope_table) {
  const Tensor pc = pos.to(at::kInt).contiguous(), tc = rope_table.contiguous();
  std::vector<int32_t> p(pc.data_ptr<int32_t>(), pc.data_ptr<int32_t>() + pc.numel());
  const int64_t n = tc.size(1);
  std::vector<programs::RopeFrequency> freq(static_cast<size_t>(n));
  const auto* words = reinterpret_cast<const uint32_t*>(tc.data_ptr<int32_t>());
  for (int64_t j = 0; j < n; ++j) freq[j] = {words[j], words[n + j]};
  return {p, freq};
}

// F3 over FP8 operands: qkv (M, N) = rope(r ⊙ (h · w_qkvᵀ) + b_qkv) in `act`, from h's 1x128 and
// w_qkv's 128x128 codes; b_qkv undefined for none; pos int32 (M), rope_table (2, N) int32.
Tensor fp8_gemm_rmsnorm_rope(const Tensor& h, const Tensor& h_scales, const Tensor& w,
                             const Tensor& w_scales, const Tensor& r, const Tensor& b_qkv,
                             const Tensor& pos, const Tensor& rope_table, at::ScalarType act) {
  const char* op = "coda::fp8_gemm_rmsnorm_rope";
  const auto [m, n, k] =
      check_pair(op, "h", h, "h_scales", h_scales, w, w_scales, true, "w_qkv", "w_qkv_scales");
  check_statistic(op, "r", r, m, h);
  if (h.is_cpu()) {
    const auto [p, freq] = host_rope(pos, rope_table);
    const std::vector<double> bias = b_qkv.defined() ? to_doubles(b_qkv) : std::vector<double>{};
    const auto q = reference::fp8_rmsnorm_rope<double>(read_operand(h, h_scales, false),
                                                       read_operand(w, w_scales, true),
                                                       to_doubles(r), bias, p, freq);
    return from_doubles(q, m, n).to(act);
  }
#if CODA_TORCH_CUDA
  const c10::cuda::CUDAGuard guard(h.device());
  const Tensor qkv = at::empty({m, n}, h.options().dtype(at::kBFloat16));
  ops::gemm_fp8_rmsnorm_rope(codes_view(h), scales_view(h_scales), codes_view(w),
                             scales_view(w_scales), vector_view(r, DType::kF32),
                             b_qkv.defined() ? vector_view(b_qkv, DType::kBF16) : TensorView{},
                             vector_view(pos, DType::kI32), view(rope_table, DType::kI32),
                             view(qkv, DType::kBF16), stream_of(h));
  return qkv;
#else
  TORCH_CHECK(false, op, ": this build has no CUDA kernels");
#endif
}

// F3q over FP8 operands: (qkv (M, N), qk_pre (M, qk.normed_width())) in `act`, as
// gemm_rmsnorm_qk_norm_rope's (the QK-norm per Q and K head before RoPE; qk_pre their columns
// before it), from h's 1x128 and w_qkv's 128x128 codes.
std::tuple<Tensor, Tensor> fp8_gemm_rmsnorm_qk_norm_rope(
    const Tensor& h, const Tensor& h_scales, const Tensor& w, const Tensor& w_scales,
    const Tensor& r, const Tensor& q_gamma, const Tensor& k_gamma, const programs::QkNorm& qk,
    const Tensor& pos, const Tensor& rope_table, at::ScalarType act) {
  const char* op = "coda::fp8_gemm_rmsnorm_qk_norm_rope";
  const auto [m, n, k] =
      check_pair(op, "h", h, "h_scales", h_scales, w, w_scales, true, "w_qkv", "w_qkv_scales");
  check_statistic(op, "r", r, m, h);
  const int64_t normed = qk.normed_width();
  if (h.is_cpu()) {
    const auto [p, freq] = host_rope(pos, rope_table);
    const auto f = reference::fp8_rmsnorm_qk_norm_rope<double>(
        read_operand(h, h_scales, false), read_operand(w, w_scales, true), to_doubles(r),
        to_doubles(q_gamma), to_doubles(k_gamma), qk, p, freq);
    return {from_doubles(f.qkv, m, n).to(act), from_doubles(f.qk_pre, m, normed).to(act)};
  }
#if CODA_TORCH_CUDA
  const c10::cuda::CUDAGuard guard(h.device());
  const Tensor qkv = at::empty({m, n}, h.options().dtype(at::kBFloat16));
  const Tensor qk_pre = at::empty({m, normed}, h.options().dtype(at::kBFloat16));
  ops::gemm_fp8_rmsnorm_qk_norm_rope(
      codes_view(h), scales_view(h_scales), codes_view(w), scales_view(w_scales),
      vector_view(r, DType::kF32), vector_view(q_gamma, DType::kBF16),
      vector_view(k_gamma, DType::kBF16), qk, vector_view(pos, DType::kI32),
      view(rope_table, DType::kI32), view(qkv, DType::kBF16), view(qk_pre, DType::kBF16),
      stream_of(h));
  return {qkv, qk_pre};
#else
  TORCH_CHECK(false, op, ": this build has no CUDA kernels");
#endif
}

namespace names {
inline constexpr char residual_rmsnorm[] = "coda::fp8_gemm_residual_rmsnorm";
inline constexpr char rmsnorm_swiglu[] = "coda::fp8_gemm_rmsnorm_swiglu";
inline constexpr char rmsnorm_swiglu_fp8_z[] = "coda::fp8_gemm_rmsnorm_swiglu_fp8_z";
inline constexpr char rmsnorm_backward[] = "coda::fp8_gemm_rmsnorm_backward";
inline constexpr char swiglu_backward[] = "coda::fp8_gemm_swiglu_backward";
inline constexpr char swiglu_quantize_t[] = "coda::fp8_swiglu_quantize_t";
}  // namespace names

void register_programs(torch::Library& m) {
  m.impl("fp8_gemm_residual_rmsnorm",
         CODA_GUARDED(names::residual_rmsnorm, fp8_gemm_residual_rmsnorm));
  m.impl("fp8_gemm_rmsnorm_swiglu", CODA_GUARDED(names::rmsnorm_swiglu, fp8_gemm_rmsnorm_swiglu));
  m.impl("fp8_gemm_rmsnorm_swiglu_fp8_z",
         CODA_GUARDED(names::rmsnorm_swiglu_fp8_z, fp8_gemm_rmsnorm_swiglu_fp8_z));
  m.impl("fp8_gemm_rmsnorm_backward",
         CODA_GUARDED(names::rmsnorm_backward, fp8_gemm_rmsnorm_backward));
  m.impl("fp8_gemm_swiglu_backward",
         CODA_GUARDED(names::swiglu_backward, fp8_gemm_swiglu_backward));
  m.impl("fp8_swiglu_quantize_t", CODA_GUARDED(names::swiglu_quantize_t, fp8_swiglu_quantize_t));
}

}  // namespace

// The FP8 programs for the block compositions' backends (torch/fp8_ops.hpp).
namespace fp8 {
Quantized empty_quantized(const Tensor& like, const c10::SymInt& rows, const c10::SymInt& cols,
                          bool want_rows, bool transposed) {
  return empty_quantized_outputs(like, rows, cols, want_rows, transposed);
}
Fp8F1 residual_rmsnorm(const Tensor& a, const Tensor& a_scales, const Tensor& w,
                       const Tensor& w_scales, const Tensor& residual, const Tensor& gamma,
                       bool rows, bool transposed) {
  return fp8_gemm_residual_rmsnorm(a, a_scales, w, w_scales, residual, gamma, rows, transposed);
}
std::tuple<Tensor, Tensor, Tensor> residual_rmsnorm_act_h(const Tensor& a, const Tensor& a_scales,
                                                          const Tensor& w, const Tensor& w_scales,
                                                          const Tensor& residual,
                                                          const Tensor& gamma) {
  return fp8_gemm_residual_rmsnorm_act_h(a, a_scales, w, w_scales, residual, gamma);
}
Fp8F2 rmsnorm_swiglu(const Tensor& h, const Tensor& h_scales, const Tensor& w_gu,
                     const Tensor& w_gu_scales, const Tensor& r, bool rows, bool transposed,
                     at::ScalarType act) {
  return fp8_gemm_rmsnorm_swiglu(h, h_scales, w_gu, w_gu_scales, r, rows, transposed, act);
}
Tensor rmsnorm_rope(const Tensor& h, const Tensor& h_scales, const Tensor& w_qkv,
                    const Tensor& w_qkv_scales, const Tensor& r, const Tensor& b_qkv,
                    const Tensor& pos, const Tensor& rope_table, at::ScalarType act) {
  return fp8_gemm_rmsnorm_rope(h, h_scales, w_qkv, w_qkv_scales, r, b_qkv, pos, rope_table, act);
}
std::tuple<Tensor, Tensor> rmsnorm_qk_norm_rope(const Tensor& h, const Tensor& h_scales,
                                                const Tensor& w_qkv, const Tensor& w_qkv_scales,
                                                const Tensor& r, const Tensor& q_gamma,
                                                const Tensor& k_gamma, const programs::QkNorm& qk,
                                                const Tensor& pos, const Tensor& rope_table,
                                                at::ScalarType act) {
  return fp8_gemm_rmsnorm_qk_norm_rope(h, h_scales, w_qkv, w_qkv_scales, r, q_gamma, k_gamma, qk,
                                       pos, rope_table, act);
}
Fp8B1 rmsnorm_backward(const Tensor& dz, const Tensor& dz_scales, const Tensor& w_t,
                       const Tensor& w_t_scales, const Tensor& x, const Tensor& r,
                       const Tensor& gamma, const Tensor& zdz, const Tensor& dres) {
  return fp8_gemm_rmsnorm_backward(dz, dz_scales, w_t, w_t_scales, x, r, gamma, zdz,
                                   dres.defined() ? std::optional<Tensor>(dres) : std::nullopt);
}
Fp8F2Z rmsnorm_swiglu_fp8_z(const Tensor& h, const Tensor& h_scales, const Tensor& w_gu,
                            const Tensor& w_gu_scales, const Tensor& r, bool rows, bool transposed,
                            at::ScalarType act) {
  return fp8_gemm_rmsnorm_swiglu_fp8_z(h, h_scales, w_gu, w_gu_scales, r, rows, transposed, act);
}
namespace {
std::optional<Tensor> scales_or_none(const Tensor& z_scales) {
  return z_scales.defined() ? std::optional<Tensor>(z_scales) : std::nullopt;
}
std::optional<at::ScalarType> dtype_of_fp8_z(const Tensor& z_scales, at::ScalarType act) {
  return z_scales.defined() ? std::optional<at::ScalarType>(act) : std::nullopt;
}
}  // namespace
std::tuple<Tensor, Tensor> swiglu_quantize_t(const Tensor& z, const Tensor& z_scales,
                                             at::ScalarType act) {
  return fp8_swiglu_quantize_t(z, scales_or_none(z_scales), dtype_of_fp8_z(z_scales, act));
}
Fp8B2 swiglu_backward(const Tensor& dx_out, const Tensor& dx_out_scales, const Tensor& w_down_t,
                      const Tensor& w_down_t_scales, const Tensor& z, const Tensor& z_scales,
                      bool rows, bool transposed, at::ScalarType act) {
  return fp8_gemm_swiglu_backward(dx_out, dx_out_scales, w_down_t, w_down_t_scales, z, rows,
                                  transposed, scales_or_none(z_scales),
                                  dtype_of_fp8_z(z_scales, act));
}
}  // namespace fp8

namespace {
// a's recomputed copy inside fp8_mlp's backward, under torch.compile: the outputs at z's sizes,
// symbolic ones too; at concrete sizes the CPU and CUDA kernels' checks.
std::tuple<Tensor, Tensor> fp8_swiglu_quantize_t_meta(const Tensor& z,
                                                      const std::optional<Tensor>& z_scales,
                                                      std::optional<at::ScalarType> dtype) {
  const char* op = "coda::fp8_swiglu_quantize_t";
  TORCH_CHECK(z.defined() && z.dim() == 2, op, ": z must be a matrix, got ",
              z.defined() ? std::to_string(z.dim()) + " dimensions" : "undefined");
  TORCH_CHECK((z.scalar_type() == at::kFloat8_e4m3fn) == z_scales.has_value(), op,
              ": pass z_scales exactly when z is float8_e4m3fn (z saved in FP8); got z of dtype ",
              z.scalar_type(), z_scales ? " with z_scales" : " without z_scales");
  if (!z.unsafeGetTensorImpl()->has_symbolic_sizes_strides()) {
    if (!z_scales) check_input(op, "z", z);
    TORCH_CHECK(z.size(1) % 32 == 0, op, ": z's columns (2I) must be a multiple of 32 (I a ",
                "multiple of 16), got ", z.size(1));
  }
  (void)dtype;
  const auto q = empty_quantized_outputs(z, z.sym_size(0), z.sym_size(1) / 2, false, true);
  return {std::get<2>(q), std::get<3>(q)};
}
}  // namespace

TORCH_LIBRARY_IMPL(coda, Meta, m) {
  impl_meta(m, "fp8_swiglu_quantize_t", &fp8_swiglu_quantize_t_meta);
}

TORCH_LIBRARY_FRAGMENT(coda, m) {
  m.def(
      "fp8_gemm_residual_rmsnorm(Tensor a, Tensor a_scales, Tensor w, Tensor w_scales, "
      "Tensor residual, Tensor gamma, bool rows=True, bool transposed=False) -> (Tensor x, "
      "Tensor h, Tensor h_scales, Tensor h_t, Tensor h_t_scales, Tensor sumsq_partials)");
  m.def(
      "fp8_gemm_rmsnorm_swiglu(Tensor h, Tensor h_scales, Tensor w_gu, Tensor w_gu_scales, "
      "Tensor r, bool rows=True, bool transposed=False, ScalarType? dtype=None) -> (Tensor z, "
      "Tensor a, Tensor a_scales, Tensor a_t, Tensor a_t_scales)");
  m.def(
      "fp8_gemm_rmsnorm_backward(Tensor dz, Tensor dz_scales, Tensor w_t, Tensor w_t_scales, "
      "Tensor x, Tensor r, Tensor gamma, Tensor zdz, Tensor? dres) -> (Tensor dx, Tensor h_t, "
      "Tensor h_t_scales, Tensor dgamma_partials)");
  m.def(
      "fp8_gemm_rmsnorm_swiglu_fp8_z(Tensor h, Tensor h_scales, Tensor w_gu, Tensor w_gu_scales, "
      "Tensor r, bool rows=True, bool transposed=False, ScalarType? dtype=None) -> (Tensor z, "
      "Tensor z_scales, Tensor a, Tensor a_scales, Tensor a_t, Tensor a_t_scales)");
  m.def(
      "fp8_swiglu_quantize_t(Tensor z, Tensor? z_scales=None, ScalarType? dtype=None) -> "
      "(Tensor a_t, Tensor a_t_scales)");
  m.def(
      "fp8_gemm_swiglu_backward(Tensor dx_out, Tensor dx_out_scales, Tensor w_down_t, "
      "Tensor w_down_t_scales, Tensor z, bool rows=True, bool transposed=False, "
      "Tensor? z_scales=None, ScalarType? dtype=None) -> (Tensor dz, "
      "Tensor dz_scales, Tensor dz_t, Tensor dz_t_scales, Tensor zdz_partials)");
}

TORCH_LIBRARY_IMPL(coda, CPU, m) { register_programs(m); }
#if CODA_TORCH_CUDA
TORCH_LIBRARY_IMPL(coda, CUDA, m) { register_programs(m); }
#endif

}  // namespace coda::torch_ext
