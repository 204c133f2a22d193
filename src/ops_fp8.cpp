// The C++ op API's FP8 part (include/coda/ops.hpp): the casts, the FP8 GEMMs and the programs on
// FP8 operands, each with its argument checks, kernel choice and launch (src/ops_internal.hpp).
#include <cuda_runtime.h>

#include <cstdlib>
#include <cstring>

#include "coda/common/check.hpp"
#include "coda/kernel/args.hpp"
#include "coda/kernel/quantize.hpp"
#include "coda/kernel/runtime.hpp"
#include "coda/ops.hpp"
#include "ops_internal.hpp"

namespace coda::ops {
using namespace detail;

namespace {
int64_t blocks(int64_t extent) { return kernel::ScaleLayout::blocks(extent); }
kernel::Fp8Output fp8_output(const TensorView& codes, const TensorView& scales) {
  return {codes.as<uint8_t>(), codes.ld, scales.as<float>(), scales.ld};
}
// An FP8 GEMM operand (rows, k) of e4m3 codes, K a multiple of 16 (16-byte TMA rows).
void fp8_operand(Args& c, const char* name, const TensorView& t, int64_t rows, int64_t k) {
  c.matrix(name, t, DType::kE4M3, rows, k);
}
// A cast's bf16 input (rows, cols), cols a multiple of 16.
struct CastSizes {
  int64_t rows, cols;
};
CastSizes cast_input(Args& c, const char* name, const TensorView& x) {
  CODA_CHECK(x.dims == 2, c.op(), ": ", name, " must be a matrix");
  const int64_t rows = x.rows, cols = x.cols;
  CODA_CHECK(rows > 0 && cols > 0 && cols % 16 == 0 && rows < (int64_t(1) << 31) &&
                 cols < (int64_t(1) << 31),
             c.op(), ": ", name, " must be (rows, cols) with cols a multiple of 16, both ",
             "positive and below 2^31, got (", rows, ", ", cols, ")");
  c.matrix(name, x, kBf, rows, cols);
  return {rows, cols};
}
// The transposed 128x1 copy of a (rows, cols) tensor: codes (cols, padded_tokens(rows)) with
// scales (ceil(rows/128), cols), checked.
kernel::Fp8Output copy_output(Args& c, const char* name, const TensorView& codes_t,
                              const char* scales_name, const TensorView& scales_t, int64_t rows,
                              int64_t cols) {
  c.matrix(name, codes_t, DType::kE4M3, cols, kernel::ScaleLayout::padded_tokens(rows));
  c.scales(scales_name, scales_t, blocks(rows), cols, true);
  return fp8_output(codes_t, scales_t);
}
// The outputs of a (rows, cols) tensor quantized in 1x128 blocks, each checked where wanted (null
// codes: not wanted), at least one wanted: codes (rows, cols) with scales (ceil(cols/128), rows),
// and the transposed copy (copy_output). The quantize_fp8_rows cast and the programs whose
// epilogue quantizes their output write these.
struct RowOutputs {
  kernel::Fp8Output rows, cols;
};
RowOutputs row_outputs(Args& c, const char* codes_name, const TensorView& codes,
                       const char* scales_name, const TensorView& scales, const char* t_name,
                       const TensorView& codes_t, const char* ts_name, const TensorView& scales_t,
                       int64_t rows, int64_t cols) {
  CODA_CHECK(codes.data || codes_t.data, c.op(), ": neither ", codes_name, " nor ", t_name,
             " is wanted");
  RowOutputs o;
  if (codes.data) {
    c.matrix(codes_name, codes, DType::kE4M3, rows, cols);
    c.scales(scales_name, scales, blocks(cols), rows, true);
    o.rows = fp8_output(codes, scales);
  }
  if (codes_t.data) o.cols = copy_output(c, t_name, codes_t, ts_name, scales_t, rows, cols);
  return o;
}
// z saved in FP8 (M, 2I), 2I a multiple of 32, with its 1x128 scales.
CastSizes fp8_z_input(Args& c, const TensorView& z, const TensorView& z_scales) {
  CODA_CHECK(z.dims == 2, c.op(), ": z must be a matrix");
  const int64_t m = z.rows, two_i = z.cols;
  CODA_CHECK(
      m > 0 && two_i > 0 && two_i % 32 == 0 && m < (int64_t(1) << 31) && two_i < (int64_t(1) << 31),
      c.op(), ": z must be (M, 2I) with 2I a multiple of 32, both positive and below ",
      "2^31, got (", m, ", ", two_i, ")");
  c.matrix("z", z, DType::kE4M3, m, two_i);
  c.scales("z_scales", z_scales, blocks(two_i), m, true);
  return {m, two_i};
}
}  // namespace

void quantize_fp8_rows(View x, View codes, View scales, View codes_t, View scales_t,
                       cudaStream_t stream) {
  Args c("coda::ops::quantize_fp8_rows");
  const auto [m, k] = cast_input(c, "x", x);
  const RowOutputs out = row_outputs(c, "codes", codes, "scales", scales, "codes_t", codes_t,
                                     "scales_t", scales_t, m, k);
  c.on_device();
  kernel::quantize_fp8_rows(bf(x), m, k, x.ld, out.rows, out.cols, stream);
}

void quantize_fp8_swiglu_t(View z, View codes_t, View scales_t, cudaStream_t stream) {
  Args c("coda::ops::quantize_fp8_swiglu_t");
  const auto [m, two_i] = cast_input(c, "z", z);
  CODA_CHECK(two_i % 32 == 0, c.op(), ": z's columns (2I) must be a multiple of 32 (a's I a ",
             "multiple of 16), got ", two_i);
  const kernel::Fp8Output out =
      copy_output(c, "codes_t", codes_t, "scales_t", scales_t, m, two_i / 2);
  c.on_device();
  kernel::quantize_fp8_swiglu_t(bf(z), m, two_i / 2, z.ld, out, stream);
}

void quantize_fp8_swiglu_t_fp8_z(View z, View z_scales, View codes_t, View scales_t,
                                 cudaStream_t stream) {
  Args c("coda::ops::quantize_fp8_swiglu_t_fp8_z");
  const auto [m, two_i] = fp8_z_input(c, z, z_scales);
  const kernel::Fp8Output out =
      copy_output(c, "codes_t", codes_t, "scales_t", scales_t, m, two_i / 2);
  c.on_device();
  kernel::quantize_fp8_swiglu_t_fp8_z(z.as<const uint8_t>(), m, two_i / 2, z.ld, f32(z_scales),
                                      z_scales.ld, out, stream);
}

void quantize_fp8_blocks(View w, View codes, View scales, View codes_t, View scales_t,
                         cudaStream_t stream) {
  Args c("coda::ops::quantize_fp8_blocks");
  const auto [n, k] = cast_input(c, "w", w);
  CODA_CHECK(codes.data || codes_t.data, c.op(), ": neither codes nor codes_t is wanted");
  if (codes.data) {
    c.matrix("codes", codes, DType::kE4M3, n, k);
    c.scales("scales", scales, blocks(n), blocks(k), false);
  }
  if (codes_t.data) {
    CODA_CHECK(n % 16 == 0, c.op(), ": codes_t needs N a multiple of 16 (its rows), got ", n);
    c.matrix("codes_t", codes_t, DType::kE4M3, k, n);
    c.scales("scales_t", scales_t, blocks(k), blocks(n), false);
  }
  c.on_device();
  kernel::quantize_fp8_blocks(
      bf(w), n, k, w.ld, codes.data ? fp8_output(codes, scales) : kernel::Fp8Output{},
      codes_t.data ? fp8_output(codes_t, scales_t) : kernel::Fp8Output{}, stream);
}

void transpose_fp8_blocks(View codes, View scales, View codes_t, View scales_t,
                          cudaStream_t stream) {
  Args c("coda::ops::transpose_fp8_blocks");
  CODA_CHECK(codes.dims == 2, c.op(), ": codes must be a matrix");
  const int64_t n = codes.rows, k = codes.cols;
  CODA_CHECK(n > 0 && k > 0 && n % 16 == 0 && k % 16 == 0, c.op(),
             ": codes must be (N, K) with both multiples of 16, got (", n, ", ", k, ")");
  c.matrix("codes", codes, DType::kE4M3, n, k);
  c.scales("scales", scales, blocks(n), blocks(k), false);
  c.matrix("codes_t", codes_t, DType::kE4M3, k, n);
  c.scales("scales_t", scales_t, blocks(k), blocks(n), false);
  c.distinct("codes", codes, "codes_t", codes_t);
  c.distinct("scales", scales, "scales_t", scales_t);
  c.on_device();
  kernel::transpose_fp8_blocks(codes.as<uint8_t>(), n, k, codes.ld, scales.as<float>(), scales.ld,
                               fp8_output(codes_t, scales_t), stream);
}

namespace {
// An FP8 GEMM's operands, checked: a (M, K) in 1x128 blocks and b (N, K) in 128x128 blocks
// (`b_blocks`) or 1x128 blocks, K a multiple of 16; the problem without C and D.
struct Fp8Operand {
  const char* name;
  View codes;
  const char* scales_name;
  View scales;
};
kernel::GemmProblem fp8_problem(Args& c, const Fp8Operand& a, const Fp8Operand& b, bool b_blocks) {
  const View x = a.codes, x_scales = a.scales, w = b.codes, w_scales = b.scales;
  const GemmSizes s{x.rows, w.rows, x.cols};
  CODA_CHECK(x.dims == 2 && w.dims == 2, c.op(), ": ", a.name, " and ", b.name,
             " must be matrices");
  c.gemm_sizes(s);
  CODA_CHECK(s.k % 16 == 0, c.op(), ": K must be a multiple of 16 (16-byte rows of e4m3), got ",
             s.k);
  fp8_operand(c, a.name, x, s.m, s.k);
  fp8_operand(c, b.name, w, s.n, s.k);
  c.scales(a.scales_name, x_scales, blocks(s.k), s.m, true);
  if (b_blocks)
    c.scales(b.scales_name, w_scales, blocks(s.n), blocks(s.k), false);
  else
    c.scales(b.scales_name, w_scales, blocks(s.k), s.n, false);
  // The mainloop's scale layouts hold 32-bit strides (their batch stride is ld · blocks).
  const int64_t limit = int64_t(1) << 31;
  CODA_CHECK(x_scales.ld * blocks(s.k) < limit &&
                 w_scales.ld * (b_blocks ? blocks(s.n) : blocks(s.k)) < limit,
             c.op(), ": the scales must span fewer than 2^31 entries, got row strides ",
             x_scales.ld, " and ", w_scales.ld);
  kernel::GemmProblem p{int(s.m), int(s.n), int(s.k), x.data, x.ld, w.data, w.ld};
  p.scale_a = f32(x_scales);
  p.ld_scale_a = x_scales.ld;
  p.scale_b = f32(w_scales);
  p.ld_scale_b = w_scales.ld;
  return p;
}
}  // namespace

void gemm_fp8(View x, View x_scales, View w, View w_scales, View d, cudaStream_t stream) {
  Args c("coda::ops::gemm_fp8");
  kernel::GemmProblem p =
      fp8_problem(c, {"x", x, "x_scales", x_scales}, {"w", w, "w_scales", w_scales}, true);
  c.matrix("d", d, kBf, p.m, p.n);
  c.on_device();
  p.d = bf_out(d);
  p.ldd = d.ld;
  launch<Program::kPlain>(c, Operands::kFp8XWt, p, {}, stream);
}

PartialLayout fp8_residual_rmsnorm_partials_layout(int64_t m, int64_t n, int64_t k) {
  return checked_layout("coda::ops::fp8_residual_rmsnorm_partials_layout",
                        Program::kResidualRmsnormFp8, Operands::kFp8XWt, {m, n, k});
}

void gemm_fp8_residual_rmsnorm(View a, View a_scales, View w, View w_scales, View residual,
                               View gamma, View x, View h, View h_scales, View h_t, View h_t_scales,
                               View sumsq_partials, cudaStream_t stream) {
  Args c("coda::ops::gemm_fp8_residual_rmsnorm");
  kernel::GemmProblem p =
      fp8_problem(c, {"a", a, "a_scales", a_scales}, {"w", w, "w_scales", w_scales}, true);
  const int64_t m = p.m, n = p.n;
  CODA_CHECK(n % 16 == 0, c.op(), ": N (w's rows) must be a multiple of 16 (16-byte rows of h's ",
             "codes), got ", n);
  c.matrix("residual", residual, kBf, m, n);
  c.vector("gamma", gamma, kBf, n);
  c.matrix("x", x, kBf, m, n);
  const RowOutputs out =
      row_outputs(c, "h", h, "h_scales", h_scales, "h_t", h_t, "h_t_scales", h_t_scales, m, n);
  const auto kc = choose_with_partials(c, Program::kResidualRmsnormFp8, Operands::kFp8XWt,
                                       {m, n, p.k}, "sumsq_partials", sumsq_partials);
  c.on_device();
  p.c = bf(residual);
  p.ldc = residual.ld;
  p.d = bf_out(x);
  p.ldd = x.ld;
  const kernel::ResidualRmsnormFp8Args args{bf(gamma), out.rows, out.cols, f32_out(sumsq_partials)};
  launch<Program::kResidualRmsnormFp8>(c, Operands::kFp8XWt, kc, p, args, stream);
}

PartialLayout fp8_residual_rmsnorm_bf16_partials_layout(int64_t m, int64_t n, int64_t k) {
  return checked_layout("coda::ops::fp8_residual_rmsnorm_bf16_partials_layout",
                        Program::kResidualRmsnormPartial, Operands::kFp8XWt, {m, n, k});
}

void gemm_fp8_residual_rmsnorm_bf16(View a, View a_scales, View w, View w_scales, View residual,
                                    View gamma, View x, View h, View sumsq_partials,
                                    cudaStream_t stream) {
  Args c("coda::ops::gemm_fp8_residual_rmsnorm_bf16");
  const kernel::GemmProblem p =
      fp8_problem(c, {"a", a, "a_scales", a_scales}, {"w", w, "w_scales", w_scales}, true);
  residual_rmsnorm_partial(c, Operands::kFp8XWt, p, residual, gamma, x, h, sumsq_partials, stream);
}

void gemm_fp8_rmsnorm_swiglu(View h, View h_scales, View w_gu, View w_gu_scales, View r, View z,
                             View a, View a_scales, View a_t, View a_t_scales,
                             cudaStream_t stream) {
  Args c("coda::ops::gemm_fp8_rmsnorm_swiglu");
  kernel::GemmProblem p = fp8_problem(c, {"h", h, "h_scales", h_scales},
                                      {"w_gu", w_gu, "w_gu_scales", w_gu_scales}, true);
  const int64_t m = p.m, two_i = p.n;
  CODA_CHECK(two_i % 32 == 0, c.op(), ": 2I (w_gu's rows) must be a multiple of 32 (16-byte ",
             "rows of a's codes), got ", two_i);
  c.vector("r", r, kF, m);
  c.matrix("z", z, kBf, m, two_i);
  const RowOutputs out = row_outputs(c, "a", a, "a_scales", a_scales, "a_t", a_t, "a_t_scales",
                                     a_t_scales, m, two_i / 2);
  c.on_device();
  p.d = bf_out(z);
  p.ldd = z.ld;
  launch<Program::kRmsnormSwigluFp8>(c, Operands::kFp8XWt, p, {f32(r), out.rows, out.cols}, stream);
}

void gemm_fp8_rmsnorm_swiglu_fp8_z(View h, View h_scales, View w_gu, View w_gu_scales, View r,
                                   View z, View z_scales, View a, View a_scales, View a_t,
                                   View a_t_scales, cudaStream_t stream) {
  Args c("coda::ops::gemm_fp8_rmsnorm_swiglu_fp8_z");
  const kernel::GemmProblem p = fp8_problem(c, {"h", h, "h_scales", h_scales},
                                            {"w_gu", w_gu, "w_gu_scales", w_gu_scales}, true);
  const int64_t m = p.m, two_i = p.n;
  CODA_CHECK(two_i % 32 == 0, c.op(), ": 2I (w_gu's rows) must be a multiple of 32 (16-byte ",
             "rows of a's codes), got ", two_i);
  c.vector("r", r, kF, m);
  CODA_CHECK(z.data, c.op(), ": z is null (its codes are this program's point)");
  const RowOutputs zq =
      row_outputs(c, "z", z, "z_scales", z_scales, "z_t", {}, "z_t_scales", {}, m, two_i);
  const RowOutputs out = row_outputs(c, "a", a, "a_scales", a_scales, "a_t", a_t, "a_t_scales",
                                     a_t_scales, m, two_i / 2);
  c.on_device();
  kernel::RmsnormSwigluFp8ZArgs args;
  args.f2 = {f32(r), out.rows, out.cols};
  args.z = zq.rows;
  launch<Program::kRmsnormSwigluFp8Z>(c, Operands::kFp8XWt, p, args, stream);
}

void gemm_fp8_rmsnorm_rope(View h, View h_scales, View w_qkv, View w_qkv_scales, View r, View bias,
                           View pos, View rope_table, View qkv, cudaStream_t stream) {
  Args c("coda::ops::gemm_fp8_rmsnorm_rope");
  const kernel::GemmProblem p = fp8_problem(c, {"h", h, "h_scales", h_scales},
                                            {"w_qkv", w_qkv, "w_qkv_scales", w_qkv_scales}, true);
  rmsnorm_rope(c, Operands::kFp8XWt, p, r, bias, pos, rope_table, qkv, stream);
}

void gemm_fp8_rmsnorm_qk_norm_rope(View h, View h_scales, View w_qkv, View w_qkv_scales, View r,
                                   View q_gamma, View k_gamma, const programs::QkNorm& qk, View pos,
                                   View rope_table, View qkv, View qk_pre, cudaStream_t stream) {
  Args c("coda::ops::gemm_fp8_rmsnorm_qk_norm_rope");
  const kernel::GemmProblem p = fp8_problem(c, {"h", h, "h_scales", h_scales},
                                            {"w_qkv", w_qkv, "w_qkv_scales", w_qkv_scales}, true);
  rmsnorm_qk_norm_rope(c, Operands::kFp8XWt, p, r, q_gamma, k_gamma, qk, pos, rope_table, qkv,
                       qk_pre, stream);
}

PartialLayout fp8_rmsnorm_backward_partials_layout(int64_t m, int64_t hidden, int64_t n_out) {
  return checked_layout("coda::ops::fp8_rmsnorm_backward_partials_layout",
                        Program::kRmsnormBackwardFp8, Operands::kFp8XWt, {m, hidden, n_out});
}

void gemm_fp8_rmsnorm_backward(View dz, View dz_scales, View w_t, View w_t_scales, View x, View r,
                               View gamma, View zdz, View dres, View dx, View h_t, View h_t_scales,
                               View dgamma_partials, cudaStream_t stream) {
  Args c("coda::ops::gemm_fp8_rmsnorm_backward");
  kernel::GemmProblem p = fp8_problem(c, {"dz", dz, "dz_scales", dz_scales},
                                      {"w_t", w_t, "w_t_scales", w_t_scales}, true);
  const int64_t m = p.m, hidden = p.n;
  CODA_CHECK(hidden % 16 == 0, c.op(), ": H (w_t's rows) must be a multiple of 16 (16-byte rows ",
             "of h_t's codes), got ", hidden);
  rmsnorm_backward_inputs(c, x, r, gamma, zdz, dres, dx, m, hidden);
  CODA_CHECK(h_t.data, c.op(), ": h_t is null (the weight gradient's operand is the point)");
  const kernel::Fp8Output h_out = copy_output(c, "h_t", h_t, "h_t_scales", h_t_scales, m, hidden);
  const auto kc = choose_with_partials(c, Program::kRmsnormBackwardFp8, Operands::kFp8XWt,
                                       {m, hidden, p.k}, "dgamma_partials", dgamma_partials);
  c.on_device();
  const bool with_dres = dres.data != nullptr;
  const View src = with_dres ? dres : dx;  // without dres: dx, never read (C's load skipped)
  p.c = bf(src);
  p.ldc = src.ld;
  p.d = bf_out(dx);
  p.ldd = dx.ld;
  const kernel::RmsnormBackwardArgs b1{
      bf(x), x.ld, f32(r), bf(gamma), f32(zdz), nullptr, 0, f32_out(dgamma_partials), with_dres};
  launch<Program::kRmsnormBackwardFp8>(c, Operands::kFp8XWt, kc, p, {b1, h_out}, stream);
}

PartialLayout fp8_swiglu_backward_partials_layout(int64_t m, int64_t intermediate, int64_t hidden) {
  return checked_layout("coda::ops::fp8_swiglu_backward_partials_layout",
                        Program::kSwigluBackwardFp8, Operands::kFp8XWt, {m, intermediate, hidden});
}

namespace {
// B2 over FP8 operands, its checks and kernel choice: z bf16 pairs, or with z_scales (not null)
// e4m3 code pairs with their 1x128 scales.
struct B2Setup {
  kernel::GemmProblem p;
  RowOutputs out;
  kernel::KernelChoice kc;
};
B2Setup b2_setup(Args& c, Program program, View dx_out, View dx_out_scales, View w_down_t,
                 View w_down_t_scales, View z, const TensorView* z_scales, View dz, View dz_scales,
                 View dz_t, View dz_t_scales, View zdz_partials) {
  B2Setup s;
  s.p = fp8_problem(c, {"dx_out", dx_out, "dx_out_scales", dx_out_scales},
                    {"w_down_t", w_down_t, "w_down_t_scales", w_down_t_scales}, true);
  const int64_t m = s.p.m, inter = s.p.n;
  c.matrix("z", z, z_scales ? DType::kE4M3 : kBf, m, 2 * inter);
  if (z_scales) c.scales("z_scales", *z_scales, blocks(2 * inter), m, true);
  s.out = row_outputs(c, "dz", dz, "dz_scales", dz_scales, "dz_t", dz_t, "dz_t_scales", dz_t_scales,
                      m, 2 * inter);
  s.kc = choose_with_partials(c, program, Operands::kFp8XWt, {m, inter, s.p.k}, "zdz_partials",
                              zdz_partials);
  c.on_device();
  return s;
}
}  // namespace

void gemm_fp8_swiglu_backward(View dx_out, View dx_out_scales, View w_down_t, View w_down_t_scales,
                              View z, View dz, View dz_scales, View dz_t, View dz_t_scales,
                              View zdz_partials, cudaStream_t stream) {
  Args c("coda::ops::gemm_fp8_swiglu_backward");
  const B2Setup s =
      b2_setup(c, Program::kSwigluBackwardFp8, dx_out, dx_out_scales, w_down_t, w_down_t_scales, z,
               nullptr, dz, dz_scales, dz_t, dz_t_scales, zdz_partials);
  // (g, u) bf16 pairs travel as one 32-bit element each: row strides in pairs.
  kernel::SwigluBackwardFp8Args args;
  args.z = z.as<const uint32_t>();
  args.ldz = z.ld / 2;
  args.zdz_partials = f32_out(zdz_partials);
  args.dz = s.out.rows;
  args.dz_t = s.out.cols;
  launch<Program::kSwigluBackwardFp8>(c, Operands::kFp8XWt, s.kc, s.p, args, stream);
}

PartialLayout fp8_swiglu_backward_fp8_z_partials_layout(int64_t m, int64_t intermediate,
                                                        int64_t hidden) {
  return checked_layout("coda::ops::fp8_swiglu_backward_fp8_z_partials_layout",
                        Program::kSwigluBackwardFp8Z, Operands::kFp8XWt, {m, intermediate, hidden});
}

void gemm_fp8_swiglu_backward_fp8_z(View dx_out, View dx_out_scales, View w_down_t,
                                    View w_down_t_scales, View z, View z_scales, View dz,
                                    View dz_scales, View dz_t, View dz_t_scales, View zdz_partials,
                                    cudaStream_t stream) {
  Args c("coda::ops::gemm_fp8_swiglu_backward_fp8_z");
  const B2Setup s =
      b2_setup(c, Program::kSwigluBackwardFp8Z, dx_out, dx_out_scales, w_down_t, w_down_t_scales, z,
               &z_scales, dz, dz_scales, dz_t, dz_t_scales, zdz_partials);
  // (g, u) code pairs travel as one 16-bit element each: row strides in pairs.
  kernel::SwigluBackwardFp8ZArgs args;
  args.z = z.as<const uint16_t>();
  args.ldz = z.ld / 2;
  args.z_scales = f32(z_scales);
  args.ld_z_scales = z_scales.ld;
  args.zdz_partials = f32_out(zdz_partials);
  args.dz = s.out.rows;
  args.dz_t = s.out.cols;
  launch<Program::kSwigluBackwardFp8Z>(c, Operands::kFp8XWt, s.kc, s.p, args, stream);
}

PartialLayout fp8_swiglu_backward_split_partials_layout(int64_t m, int64_t intermediate) {
  CODA_CHECK(m > 0 && intermediate > 0, "coda::ops::fp8_swiglu_backward_split_partials_layout: M ",
             "and I must be positive, got ", m, " and ", intermediate);
  constexpr int64_t kTile = kernel::ScaleLayout::kBlock;  // dz's: 64 columns of da
  return PartialLayout::per_row(m, intermediate, kTile, kTile / 2);
}

void fp8_swiglu_backward_quantize(View da, View z, View z_scales, View dz, View dz_scales,
                                  View dz_t, View dz_t_scales, View zdz_partials,
                                  cudaStream_t stream) {
  Args c("coda::ops::fp8_swiglu_backward_quantize");
  CODA_CHECK(da.dims == 2, c.op(), ": da must be a matrix");
  const int64_t m = da.rows, inter = da.cols;
  CODA_CHECK(m > 0 && inter > 0 && inter % 8 == 0 && m < (int64_t(1) << 31) &&
                 inter < (int64_t(1) << 30),
             c.op(), ": da must be (M, I) with I a multiple of 8, both positive and below 2^30, ",
             "got (", m, ", ", inter, ")");
  c.matrix("da", da, kBf, m, inter);
  const bool fp8_z = z_scales.data != nullptr;
  c.matrix("z", z, fp8_z ? DType::kE4M3 : kBf, m, 2 * inter);
  if (fp8_z) c.scales("z_scales", z_scales, blocks(2 * inter), m, true);
  const RowOutputs out = row_outputs(c, "dz", dz, "dz_scales", dz_scales, "dz_t", dz_t,
                                     "dz_t_scales", dz_t_scales, m, 2 * inter);
  c.partials("zdz_partials", zdz_partials, fp8_swiglu_backward_split_partials_layout(m, inter));
  c.on_device();
  kernel::swiglu_backward_quantize_fp8(bf(da), da.ld, z.data, z.ld,
                                       fp8_z ? f32(z_scales) : nullptr, z_scales.ld, m, inter,
                                       out.rows, out.cols, f32_out(zdz_partials), zdz_partials.ld,
                                       stream);
}

void fp8_rmsnorm_swiglu_quantize(View y, View r, View z, View z_scales, View a, View a_scales,
                                  View a_t, View a_t_scales, cudaStream_t stream) {
  Args c("coda::ops::fp8_rmsnorm_swiglu_quantize");
  CODA_CHECK(y.dims == 2, c.op(), ": y must be a matrix");
  const int64_t m = y.rows, two_i = y.cols;
  CODA_CHECK(m > 0 && two_i > 0 && two_i % 32 == 0 && m < (int64_t(1) << 31) &&
                 two_i < (int64_t(1) << 31),
             c.op(), ": y must be (M, 2I) with 2I a multiple of 32, both positive and below ",
             "2^31, got (", m, ", ", two_i, ")");
  c.matrix("y", y, kBf, m, two_i);
  c.vector("r", r, kF, m);
  CODA_CHECK(z.data, c.op(), ": z is null (its codes are the point of z saved in FP8)");
  c.matrix("z", z, DType::kE4M3, m, two_i);
  c.scales("z_scales", z_scales, blocks(two_i), m, true);
  const RowOutputs out = row_outputs(c, "a", a, "a_scales", a_scales, "a_t", a_t, "a_t_scales",
                                     a_t_scales, m, two_i / 2);
  c.on_device();
  kernel::rmsnorm_swiglu_quantize_fp8(bf(y), y.ld, f32(r), m, two_i / 2, fp8_output(z, z_scales),
                                      out.rows, out.cols, stream);
}

PartialLayout fp8_rope_backward_partials_layout(int64_t m, int64_t width) {
  CODA_CHECK(m > 0 && width > 0, "coda::ops::fp8_rope_backward_partials_layout: M and the width ",
             "must be positive, got ", m, " and ", width);
  constexpr int64_t kTile = kernel::ScaleLayout::kBlock;
  return PartialLayout::per_row(m, width, kTile, kTile);
}

void fp8_rope_backward_quantize(View qkv, View dqkv, View pos, View rope_table, View dpre,
                                View dpre_scales, View dpre_t, View dpre_t_scales,
                                View zdz_partials, cudaStream_t stream) {
  Args c("coda::ops::fp8_rope_backward_quantize");
  CODA_CHECK(qkv.dims == 2, c.op(), ": qkv must be a matrix");
  const int64_t m = qkv.rows, width = qkv.cols;
  CODA_CHECK(
      m > 0 && width > 0 && width % 16 == 0 && m < (int64_t(1) << 31) && width < (int64_t(1) << 31),
      c.op(), ": qkv must be (M, N) with N a multiple of 16, both positive and below 2^31, ",
      "got (", m, ", ", width, ")");
  c.matrix("qkv", qkv, kBf, m, width);
  c.matrix("dqkv", dqkv, kBf, m, width);
  c.vector("pos", pos, DType::kI32, m);
  c.matrix("rope_table", rope_table, DType::kI32, 2, width);
  const RowOutputs out = row_outputs(c, "dpre", dpre, "dpre_scales", dpre_scales, "dpre_t", dpre_t,
                                     "dpre_t_scales", dpre_t_scales, m, width);
  c.partials("zdz_partials", zdz_partials, fp8_rope_backward_partials_layout(m, width));
  c.on_device();
  kernel::rope_backward_quantize_fp8(bf(qkv), qkv.ld, bf(dqkv), dqkv.ld, pos.as<const int32_t>(),
                                     words(rope_table, 0), words(rope_table, 1), m, width, out.rows,
                                     out.cols, f32_out(zdz_partials), zdz_partials.ld, stream);
}

PartialLayout fp8_rmsnorm_backward_split_partials_layout(int64_t m, int64_t hidden) {
  CODA_CHECK(m > 0 && hidden > 0, "coda::ops::fp8_rmsnorm_backward_split_partials_layout: M and ",
             "H must be positive, got ", m, " and ", hidden);
  constexpr int64_t kTile = kernel::ScaleLayout::kBlock;
  return PartialLayout::per_column(m, hidden, kTile, kTile);
}

void fp8_rmsnorm_backward_quantize(View g, View x, View r, View gamma, View zdz, View dres,
                                   View dx, View h_t, View h_t_scales, View dgamma_partials,
                                   cudaStream_t stream) {
  Args c("coda::ops::fp8_rmsnorm_backward_quantize");
  CODA_CHECK(g.dims == 2, c.op(), ": g must be a matrix");
  const int64_t m = g.rows, hidden = g.cols;
  CODA_CHECK(m > 0 && hidden > 0 && hidden % 16 == 0 && m < (int64_t(1) << 31) &&
                 hidden < (int64_t(1) << 31),
             c.op(), ": g must be (M, H) with H a multiple of 16, both positive and below 2^31, ",
             "got (", m, ", ", hidden, ")");
  c.matrix("g", g, kBf, m, hidden);
  rmsnorm_backward_inputs(c, x, r, gamma, zdz, dres, dx, m, hidden);
  CODA_CHECK(h_t.data, c.op(), ": h_t is null (the weight gradient's operand is the point)");
  const kernel::Fp8Output h_out = copy_output(c, "h_t", h_t, "h_t_scales", h_t_scales, m, hidden);
  c.partials("dgamma_partials", dgamma_partials,
             fp8_rmsnorm_backward_split_partials_layout(m, hidden));
  c.on_device();
  const bool with_dres = dres.data != nullptr;
  kernel::rmsnorm_backward_quantize_fp8(bf(g), g.ld, bf(x), x.ld, with_dres ? bf(dres) : nullptr,
                                        dres.ld, f32(r), bf(gamma), f32(zdz), m, hidden,
                                        bf_out(dx), dx.ld, h_out, f32_out(dgamma_partials),
                                        dgamma_partials.ld, stream);
}

namespace {
int placement_from_environment() {
  const char* v = std::getenv("CODA_FP8_EPILOGUE");
  if (v == nullptr || *v == '\0' || std::strcmp(v, "auto") == 0)
    return int(Fp8EpiloguePlacement::kAuto);
  if (std::strcmp(v, "fused") == 0) return int(Fp8EpiloguePlacement::kFused);
  CODA_CHECK(std::strcmp(v, "split") == 0,
             "CODA_FP8_EPILOGUE must be 'auto', 'fused' or 'split', got '", v, "'");
  return int(Fp8EpiloguePlacement::kSplit);
}
ProcessSetting g_placement(placement_from_environment);
}  // namespace

Fp8EpiloguePlacement fp8_epilogue_placement() {
  return Fp8EpiloguePlacement(g_placement.get());
}
void set_fp8_epilogue_placement(Fp8EpiloguePlacement placement) {
  g_placement.set(int(placement));
}

bool fp8_epilogue_split(Fp8SplitProgram program, int64_t k) {
  switch (fp8_epilogue_placement()) {
    case Fp8EpiloguePlacement::kFused:
      return false;
    case Fp8EpiloguePlacement::kSplit:
      return true;
    case Fp8EpiloguePlacement::kAuto:
      break;
  }
  // Auto: split where the plain GEMM and the pass measure faster than the fused epilogue (the
  // suite's fp8-fused `split` rows, bench/results; docs/design.md). The epilogue's cost is per
  // output element while the GEMM's grows with K, so each program splits up to a K: B2 at every
  // LLaMA shape; B1 up to 32768 (at 70B's gate/up, K = 57344, the fused kernel runs within
  // 1.06x of its plain GEMM and the split measures level); F2z up to 4096 (at 70B, K = 8192, its
  // pass costs more than the fused epilogue's 1.09-1.11x).
  switch (program) {
    case Fp8SplitProgram::kB2:
      return true;
    case Fp8SplitProgram::kB1:
      return k <= kFp8B1SplitMaxK;
    case Fp8SplitProgram::kF2z:
      return k <= kFp8F2zSplitMaxK;
  }
  return false;
}

void gemm_fp8_xyt(View x, View x_scales, View y, View y_scales, View d, bool accumulate,
                  cudaStream_t stream) {
  Args c(accumulate ? "coda::ops::gemm_fp8_xyt (accumulate)" : "coda::ops::gemm_fp8_xyt");
  kernel::GemmProblem p =
      fp8_problem(c, {"x", x, "x_scales", x_scales}, {"y", y, "y_scales", y_scales}, false);
  c.matrix("d", d, accumulate ? kF : kBf, p.m, p.n);
  c.on_device();
  const Fp8WgradBackend backend = fp8_wgrad_backend();
  if (backend != Fp8WgradBackend::kCutlass) {
    void* out = accumulate ? static_cast<void*>(f32_out(d)) : static_cast<void*>(bf_out(d));
    const char* why_not = gemm_fp8_xyt_cublaslt(p, out, d.ld, accumulate, stream);
    if (why_not == nullptr) return;
    CODA_CHECK(backend != Fp8WgradBackend::kCublasLtOnly, c.op(),
               ": the backend is cuBLASLt only (CODA_FP8_WGRAD=cublaslt-only), and cuBLASLt "
               "cannot take this problem: ", why_not);
  }
  if (accumulate) {
    launch<Program::kAccumulateF32>(c, Operands::kFp8XYt, p, {f32_out(d), d.ld}, stream);
  } else {
    p.d = bf_out(d);
    p.ldd = d.ld;
    launch<Program::kPlain>(c, Operands::kFp8XYt, p, {}, stream);
  }
}

}  // namespace coda::ops
