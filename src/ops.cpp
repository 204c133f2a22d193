// The C++ op API (include/coda/ops.hpp): argument checks, the kernel choice, the launch.
#include "coda/ops.hpp"

#include <cuda_runtime.h>

#include <string>

#include "coda/common/check.hpp"
#include "coda/kernel/args.hpp"
#include "coda/kernel/aux_kernels.hpp"
#include "coda/kernel/cuda_check.hpp"
#include "coda/kernel/runtime.hpp"
#include "ops_internal.hpp"

namespace coda::ops {
using namespace detail;

namespace detail {

void residual_rmsnorm_partial(Args& c, Operands o, kernel::GemmProblem p, View residual, View gamma,
                              View x, View h, View sumsq_partials, cudaStream_t stream) {
  const int64_t m = p.m, n = p.n;
  c.matrix("residual", residual, kBf, m, n);
  c.vector("gamma", gamma, kBf, n);
  c.matrix("x", x, kBf, m, n);
  c.matrix("h", h, kBf, m, n);
  c.distinct("h", h, "x", x);
  c.distinct("h", h, "residual", residual);
  const auto kc = choose_with_partials(c, Program::kResidualRmsnormPartial, o, {m, n, p.k},
                                       "sumsq_partials", sumsq_partials);
  c.on_device();
  p.c = bf(residual);
  p.ldc = residual.ld;
  p.d = bf_out(x);
  p.ldd = x.ld;
  const kernel::ResidualRmsnormPartialArgs args{bf(gamma), bf_out(h), h.ld,
                                                f32_out(sumsq_partials)};
  launch<Program::kResidualRmsnormPartial>(c, o, kc, p, args, stream);
}

void rmsnorm_rope(Args& c, Operands o, kernel::GemmProblem p, View r, View bias, View pos,
                  View rope_table, View qkv, cudaStream_t stream) {
  const int64_t m = p.m, n = p.n;
  c.vector("r", r, kF, m);
  if (bias.data) c.vector("bias", bias, kBf, n);
  c.vector("pos", pos, DType::kI32, m);
  c.matrix("rope_table", rope_table, DType::kI32, 2, n);
  c.matrix("qkv", qkv, kBf, m, n);
  c.on_device();
  p.d = bf_out(qkv);
  p.ldd = qkv.ld;
  const kernel::RmsnormRopeArgs args{f32(r), bf(bias), pos.as<const int32_t>(),
                                     words(rope_table, 0), words(rope_table, 1)};
  launch<Program::kRmsnormRope>(c, o, p, args, stream);
}

void rmsnorm_backward_inputs(Args& c, View x, View r, View gamma, View zdz, View dres, View dx,
                             int64_t m, int64_t hidden) {
  c.matrix("x", x, kBf, m, hidden);
  c.vector("r", r, kF, m);
  c.vector("gamma", gamma, kBf, hidden);
  c.vector("zdz", zdz, kF, m);
  if (dres.data) c.matrix("dres", dres, kBf, m, hidden);  // null: no residual gradient
  c.matrix("dx", dx, kBf, m, hidden);
}

}  // namespace detail

namespace {
// The plain GEMM D (M, N) = op(x) · op(y) in layout `o`.
void plain_gemm(const char* op, Operands o, View x, const char* y_name, View y, View d,
                cudaStream_t stream) {
  Args c(op);
  const auto [m, n, k] = c.gemm_operands("x", x, y_name, y, o, any_n(Program::kPlain));
  c.matrix("d", d, kBf, m, n);
  c.on_device();
  launch<Program::kPlain>(
      c, o, {int(m), int(n), int(k), bf(x), x.ld, bf(y), y.ld, nullptr, 0, bf_out(d), d.ld}, {},
      stream);
}
}  // namespace

void gemm(View x, View w, View d, cudaStream_t stream) {
  plain_gemm("coda::ops::gemm", Operands::kXWt, x, "w", w, d, stream);
}
void gemm_xw(View x, View w, View d, cudaStream_t stream) {
  plain_gemm("coda::ops::gemm_xw", Operands::kXW, x, "w", w, d, stream);
}
void gemm_xty(View x, View y, View d, cudaStream_t stream) {
  plain_gemm("coda::ops::gemm_xty", Operands::kXtY, x, "y", y, d, stream);
}

PartialLayout residual_rmsnorm_partials_layout(int64_t m, int64_t n, int64_t k) {
  return checked_layout("coda::ops::residual_rmsnorm_partials_layout",
                        Program::kResidualRmsnormPartial, Operands::kXWt, {m, n, k});
}

void gemm_residual_rmsnorm_partial(View a, View w, View residual, View gamma, View x, View h,
                                   View sumsq_partials, cudaStream_t stream) {
  Args c("coda::ops::gemm_residual_rmsnorm_partial");
  const auto [m, n, k] = c.gemm_operands("a", a, "w", w, Operands::kXWt);
  residual_rmsnorm_partial(c, Operands::kXWt, {int(m), int(n), int(k), bf(a), a.ld, bf(w), w.ld},
                           residual, gamma, x, h, sumsq_partials, stream);
}

void rmsnorm_fold(View sumsq_partials, int64_t hidden, float eps, View r, cudaStream_t stream) {
  Args c("coda::ops::rmsnorm_fold");
  CODA_CHECK(hidden > 0, c.op(), ": hidden must be positive, got ", hidden);
  CODA_CHECK(eps >= 0.f, c.op(), ": eps must be >= 0, got ", eps);
  c.fold("sumsq_partials", sumsq_partials, "r", r);
  c.on_device();
  kernel::fold_rstd(f32(sumsq_partials), r.rows, sumsq_partials.ld, sumsq_partials.rows, hidden,
                    eps, f32_out(r), stream);
}

void first_layer_rmsnorm(View x, View gamma, float eps, View h, View r, cudaStream_t stream) {
  Args c("coda::ops::first_layer_rmsnorm");
  const int64_t m = x.rows, hidden = x.cols;
  CODA_CHECK(m > 0 && hidden > 0 && hidden % 8 == 0, c.op(),
             ": need M > 0 and H a positive multiple of 8, got M=", m, " H=", hidden);
  CODA_CHECK(eps >= 0.f, c.op(), ": eps must be >= 0, got ", eps);
  c.matrix("x", x, kBf, m, hidden);
  c.vector("gamma", gamma, kBf, hidden);
  c.matrix("h", h, kBf, m, hidden);
  c.vector("r", r, kF, m);
  CODA_CHECK(x.ld == hidden && h.ld == hidden, c.op(), ": x and h must be contiguous (row stride ",
             hidden, "), got ", x.ld, " and ", h.ld);
  c.on_device();
  kernel::first_layer_rmsnorm(bf(x), bf(gamma), m, hidden, eps, bf_out(h), f32_out(r), stream);
}

void gemm_rmsnorm_swiglu(View h, View w_gu, View r, View z, View a, cudaStream_t stream) {
  Args c("coda::ops::gemm_rmsnorm_swiglu");
  const auto [m, two_i, k] = c.gemm_operands("h", h, "w_gu", w_gu, Operands::kXWt);
  CODA_CHECK(two_i % 16 == 0, c.op(),
             ": 2I (w_gu's rows) must be a multiple of 16 (a's rows of I are 16-byte aligned), "
             "got ",
             two_i);
  c.vector("r", r, kF, m);
  c.matrix("z", z, kBf, m, two_i);
  c.matrix("a", a, kBf, m, two_i / 2);
  c.on_device();
  launch<Program::kRmsnormSwiglu>(
      c, Operands::kXWt,
      {int(m), int(two_i), int(k), bf(h), h.ld, bf(w_gu), w_gu.ld, nullptr, 0, bf_out(z), z.ld},
      {f32(r), bf_out(a), a.ld}, stream);
}

void split_rope_table(const std::vector<programs::RopeFrequency>& table, std::vector<uint32_t>& hi,
                      std::vector<uint32_t>& lo) {
  hi.resize(table.size());
  lo.resize(table.size());
  for (size_t i = 0; i < table.size(); ++i) {
    hi[i] = table[i].hi;
    lo[i] = table[i].lo;
  }
}

void gemm_rmsnorm_rope(View h, View w_qkv, View r, View bias, View pos, View rope_table, View qkv,
                       cudaStream_t stream) {
  Args c("coda::ops::gemm_rmsnorm_rope");
  const auto [m, n, k] = c.gemm_operands("h", h, "w_qkv", w_qkv, Operands::kXWt);
  rmsnorm_rope(c, Operands::kXWt, {int(m), int(n), int(k), bf(h), h.ld, bf(w_qkv), w_qkv.ld}, r,
               bias, pos, rope_table, qkv, stream);
}

namespace {
// The head geometry both QK-norm programs take: the QKV width and a head_dim that divides the
// forward's 128-column tile (so a head never spans two tiles), from 8 (the narrowest head the GPU
// tests cover) to 128.
void check_qk_norm(const Args& c, const programs::QkNorm& qk, int64_t width) {
  qk.validate(c.op());
  const int d = qk.layout.head_dim;
  CODA_CHECK(d >= 8 && 128 % d == 0, c.op(),
             ": head_dim must divide 128 and be >= 8 (8, 16, 32, 64 or 128: a head lies in one "
             "128-column tile), got ",
             d);
  CODA_CHECK(width == qk.layout.width(), c.op(), ": the QKV width is ", width, " but the heads (",
             qk.layout.n_heads, " + 2 x ", qk.layout.n_kv_heads, ") x ", d, " give ",
             qk.layout.width());
}
}  // namespace

namespace detail {
void rmsnorm_qk_norm_rope(Args& c, Operands o, kernel::GemmProblem p, View r, View q_gamma,
                          View k_gamma, const programs::QkNorm& qk, View pos, View rope_table,
                          View qkv, View qk_pre, cudaStream_t stream) {
  const int64_t m = p.m, n = p.n;
  check_qk_norm(c, qk, n);
  const int64_t d = qk.layout.head_dim, normed = qk.normed_width();
  c.vector("r", r, kF, m);
  c.vector("q_gamma", q_gamma, kBf, d);
  c.vector("k_gamma", k_gamma, kBf, d);
  c.vector("pos", pos, DType::kI32, m);
  c.matrix("rope_table", rope_table, DType::kI32, 2, n);
  c.matrix("qkv", qkv, kBf, m, n);
  c.matrix("qk_pre", qk_pre, kBf, m, normed);
  c.distinct("qk_pre", qk_pre, "qkv", qkv);
  c.on_device();
  kernel::RmsnormQkNormRopeArgs args;
  args.r = f32(r);
  args.q_gamma = bf(q_gamma);
  args.k_gamma = bf(k_gamma);
  args.pos = pos.as<const int32_t>();
  args.freq_hi = words(rope_table, 0);
  args.freq_lo = words(rope_table, 1);
  args.qkv = bf_out(qkv);
  args.ld_qkv = qkv.ld;
  args.qk_pre = bf_out(qk_pre);
  args.ld_qk_pre = qk_pre.ld;
  args.head_dim = int(d);
  args.q_width = qk.layout.q_width();
  args.normed_width = int(normed);
  args.eps = float(qk.eps);
  // No D: the program's node stores qkv and qk_pre.
  p.d = nullptr;
  p.ldd = n;
  launch<Program::kRmsnormQkNormRope>(c, o, p, args, stream);
}
}  // namespace detail

void gemm_rmsnorm_qk_norm_rope(View h, View w_qkv, View r, View q_gamma, View k_gamma,
                               const programs::QkNorm& qk, View pos, View rope_table, View qkv,
                               View qk_pre, cudaStream_t stream) {
  Args c("coda::ops::gemm_rmsnorm_qk_norm_rope");
  const auto [m, n, k] = c.gemm_operands("h", h, "w_qkv", w_qkv, Operands::kXWt);
  rmsnorm_qk_norm_rope(
      c, Operands::kXWt,
      {int(m), int(n), int(k), bf(h), h.ld, bf(w_qkv), w_qkv.ld, nullptr, 0, nullptr, n}, r,
      q_gamma, k_gamma, qk, pos, rope_table, qkv, qk_pre, stream);
}

PartialLayout rmsnorm_backward_partials_layout(int64_t m, int64_t hidden, int64_t n_out) {
  return checked_layout("coda::ops::rmsnorm_backward_partials_layout", Program::kRmsnormBackward,
                        Operands::kXW, {m, hidden, n_out});
}

void gemm_rmsnorm_backward(View dz, View w, View x, View r, View gamma, View zdz, View dres,
                           View dx, View h_out, View dgamma_partials, cudaStream_t stream) {
  Args c("coda::ops::gemm_rmsnorm_backward");
  const auto [m, hidden, n_out] = c.gemm_operands("dz", dz, "w", w, Operands::kXW);
  rmsnorm_backward_inputs(c, x, r, gamma, zdz, dres, dx, m, hidden);
  c.matrix("h_out", h_out, kBf, m, hidden);
  c.distinct("h_out", h_out, "dx", dx);
  if (dres.data) c.distinct("h_out", h_out, "dres", dres);
  c.distinct("h_out", h_out, "x", x);
  const auto kc = choose_with_partials(c, Program::kRmsnormBackward, Operands::kXW,
                                       {m, hidden, n_out}, "dgamma_partials", dgamma_partials);
  c.on_device();
  const bool with_dres = dres.data != nullptr;
  const kernel::RmsnormBackwardArgs args{
      bf(x),    x.ld,          f32(r),   bf(gamma),
      f32(zdz), bf_out(h_out), h_out.ld, f32_out(dgamma_partials),
      with_dres};
  // Without dres the source is dx itself, never read (the kernel skips C's load).
  const View src = with_dres ? dres : dx;
  launch<Program::kRmsnormBackward>(c, Operands::kXW, kc,
                                    {int(m), int(hidden), int(n_out), bf(dz), dz.ld, bf(w), w.ld,
                                     bf(src), src.ld, bf_out(dx), dx.ld},
                                    args, stream);
}

PartialLayout swiglu_backward_partials_layout(int64_t m, int64_t intermediate, int64_t hidden) {
  return checked_layout("coda::ops::swiglu_backward_partials_layout", Program::kSwigluBackward,
                        Operands::kXW, {m, intermediate, hidden});
}

void gemm_swiglu_backward(View dx_out, View w_down, View z, View dz, View a, View zdz_partials,
                          cudaStream_t stream) {
  Args c("coda::ops::gemm_swiglu_backward");
  const auto [m, inter, hidden] =
      c.gemm_operands("dx_out", dx_out, "w_down", w_down, Operands::kXW);
  c.matrix("z", z, kBf, m, 2 * inter);
  c.matrix("dz", dz, kBf, m, 2 * inter);
  c.matrix("a", a, kBf, m, inter);
  const auto kc = choose_with_partials(c, Program::kSwigluBackward, Operands::kXW,
                                       {m, inter, hidden}, "zdz_partials", zdz_partials);
  c.on_device();
  // (g, u) bf16 pairs travel as one 32-bit element each: row strides in pairs.
  const kernel::SwigluBackwardArgs args{z.as<const uint32_t>(), z.ld / 2, dz.as<uint32_t>(),
                                        dz.ld / 2, f32_out(zdz_partials)};
  launch<Program::kSwigluBackward>(c, Operands::kXW, kc,
                                   {int(m), int(inter), int(hidden), bf(dx_out), dx_out.ld,
                                    bf(w_down), w_down.ld, nullptr, 0, bf_out(a), a.ld},
                                   args, stream);
}

void rope_backward(View qkv, View dqkv, View bias, View pos, View rope_table, int64_t hidden,
                   View dqkv_pre, View zdz, cudaStream_t stream) {
  Args c("coda::ops::rope_backward");
  const int64_t m = qkv.rows, width = qkv.cols;
  CODA_CHECK(m > 0 && width > 0 && width % 8 == 0 && hidden > 0, c.op(),
             ": need M > 0, width a positive multiple of 8 and hidden > 0, got M=", m,
             " width=", width, " hidden=", hidden);
  c.matrix("qkv", qkv, kBf, m, width);
  c.matrix("dqkv", dqkv, kBf, m, width);
  if (bias.data) c.vector("bias", bias, kBf, width);
  c.vector("pos", pos, DType::kI32, m);
  c.matrix("rope_table", rope_table, DType::kI32, 2, width);
  c.matrix("dqkv_pre", dqkv_pre, kBf, m, width);
  c.vector("zdz", zdz, kF, m);
  CODA_CHECK(qkv.ld == width && dqkv.ld == width && dqkv_pre.ld == width, c.op(),
             ": qkv, dqkv and dqkv_pre must be contiguous (row stride ", width, "), got ", qkv.ld,
             ", ", dqkv.ld, ", ", dqkv_pre.ld);
  c.on_device();
  kernel::rope_backward(bf(qkv), bf(dqkv), bf(bias), pos.as<const int32_t>(), words(rope_table, 0),
                        words(rope_table, 1), m, width, hidden, bf_out(dqkv_pre), f32_out(zdz),
                        stream);
}

int64_t qk_norm_backward_partials_rows(int64_t m) {
  CODA_CHECK(m > 0, "coda::ops::qk_norm_backward_partials_rows: M must be positive, got ", m);
  return kernel::qk_norm_backward_blocks(m);
}

void qk_norm_rope_backward(View qk_pre, View qkv, View dqkv, View q_gamma, View k_gamma,
                           const programs::QkNorm& qk, View pos, View rope_table, int64_t hidden,
                           View dqkv_pre, View zdz, View dgamma_partials, View dq_gamma,
                           View dk_gamma, cudaStream_t stream) {
  Args c("coda::ops::qk_norm_rope_backward");
  const int64_t m = dqkv.rows, width = dqkv.cols;
  CODA_CHECK(m > 0 && hidden > 0, c.op(), ": need M > 0 and hidden > 0, got M=", m,
             " hidden=", hidden);
  c.matrix("dqkv", dqkv, kBf, m, width);  // first: the width below comes from it
  check_qk_norm(c, qk, width);
  const int64_t d = qk.layout.head_dim, normed = qk.normed_width();
  c.matrix("qkv", qkv, kBf, m, width);
  c.matrix("qk_pre", qk_pre, kBf, m, normed);
  c.vector("q_gamma", q_gamma, kBf, d);
  c.vector("k_gamma", k_gamma, kBf, d);
  c.vector("pos", pos, DType::kI32, m);
  c.matrix("rope_table", rope_table, DType::kI32, 2, width);
  c.matrix("dqkv_pre", dqkv_pre, kBf, m, width);
  c.vector("zdz", zdz, kF, m);
  c.partials("dgamma_partials", dgamma_partials,
             PartialLayout{2 * d, qk_norm_backward_partials_rows(m), 2 * d});
  c.vector("dq_gamma", dq_gamma, kF, d);
  c.vector("dk_gamma", dk_gamma, kF, d);
  c.distinct("dqkv_pre", dqkv_pre, "dqkv", dqkv);
  c.distinct("dqkv_pre", dqkv_pre, "qkv", qkv);
  c.distinct("dqkv_pre", dqkv_pre, "qk_pre", qk_pre);
  c.on_device();
  kernel::QkNormBackwardArgs a;
  a.qk_pre = bf(qk_pre);
  a.ld_qk_pre = qk_pre.ld;
  a.qkv = bf(qkv);
  a.ld_qkv = qkv.ld;
  a.dy = bf(dqkv);
  a.ld_dy = dqkv.ld;
  a.q_gamma = bf(q_gamma);
  a.k_gamma = bf(k_gamma);
  a.pos = pos.as<const int32_t>();
  a.freq_hi = words(rope_table, 0);
  a.freq_lo = words(rope_table, 1);
  a.dz = bf_out(dqkv_pre);
  a.ld_dz = dqkv_pre.ld;
  a.zdz = f32_out(zdz);
  a.dgamma_partials = f32_out(dgamma_partials);
  a.m = m;
  a.width = width;
  a.head_dim = int(d);
  a.q_width = qk.layout.q_width();
  a.normed_width = int(normed);
  a.eps = float(qk.eps);
  a.inv_hidden = 1.0f / float(hidden);
  kernel::qk_norm_rope_backward(a, stream);
  const int64_t rows = dgamma_partials.rows;
  kernel::fold_column_sums(f32(dgamma_partials), d, 2 * d, rows, f32_out(dq_gamma), stream);
  kernel::fold_column_sums(f32(dgamma_partials) + d, d, 2 * d, rows, f32_out(dk_gamma), stream);
}

void zdz_fold(View partials, int64_t hidden, View zdz, cudaStream_t stream) {
  Args c("coda::ops::zdz_fold");
  CODA_CHECK(hidden > 0, c.op(), ": hidden must be positive, got ", hidden);
  c.fold("partials", partials, "zdz", zdz);
  c.on_device();
  kernel::fold_row_sums(f32(partials), zdz.rows, partials.ld, partials.rows, 1.0f / float(hidden),
                        f32_out(zdz), stream);
}

void dgamma_fold(View partials, View dgamma, cudaStream_t stream) {
  Args c("coda::ops::dgamma_fold");
  c.fold("partials", partials, "dgamma", dgamma);
  c.on_device();
  kernel::fold_column_sums(f32(partials), dgamma.rows, partials.ld, partials.rows, f32_out(dgamma),
                           stream);
}

PartialLayout lm_head_partials_layout(int64_t m, int64_t vocab, int64_t hidden) {
  return checked_layout("coda::ops::lm_head_partials_layout", Program::kRmsnormLse, Operands::kXWt,
                        {m, vocab, hidden});
}

PartialLayout lm_head_logits_partials_layout(int64_t m, int64_t vocab, int64_t hidden) {
  return checked_layout("coda::ops::lm_head_logits_partials_layout", Program::kRmsnormLseLogits,
                        Operands::kXWt, {m, vocab, hidden});
}

namespace {
// F4, with (logits non-null) or without the logits stored.
template <Program P>
void rmsnorm_lse_program(Args& c, View h, View w_vocab, View r, View targets, View max_partials,
                         View sum_partials, View target_logit, const TensorView* logits,
                         cudaStream_t stream) {
  const auto [m, vocab, hidden] =
      c.gemm_operands("h", h, "w_vocab", w_vocab, Operands::kXWt, any_n(P));
  c.vector("r", r, kF, m);
  c.vector("targets", targets, DType::kI64, m);
  const auto kc =
      choose_with_partials(c, P, Operands::kXWt, {m, vocab, hidden}, "max_partials", max_partials);
  c.partials("sum_partials", sum_partials, layout_of(P, kc, m, vocab));
  c.vector("target_logit", target_logit, kF, m);
  if (logits) c.matrix("logits", *logits, kBf, m, vocab);
  c.on_device();
  const kernel::RmsnormLseArgs args{f32(r), targets.as<const int64_t>(), f32_out(max_partials),
                                    f32_out(sum_partials), f32_out(target_logit)};
  launch<P>(c, Operands::kXWt, kc,
            {int(m), int(vocab), int(hidden), bf(h), h.ld, bf(w_vocab), w_vocab.ld, nullptr, 0,
             logits ? bf_out(*logits) : nullptr, logits ? logits->ld : vocab},
            args, stream);
}
}  // namespace

void gemm_rmsnorm_lse(View h, View w_vocab, View r, View targets, View max_partials,
                      View sum_partials, View target_logit, cudaStream_t stream) {
  Args c("coda::ops::gemm_rmsnorm_lse");
  rmsnorm_lse_program<Program::kRmsnormLse>(c, h, w_vocab, r, targets, max_partials, sum_partials,
                                            target_logit, nullptr, stream);
}

void gemm_rmsnorm_lse_logits(View h, View w_vocab, View r, View targets, View max_partials,
                             View sum_partials, View target_logit, View logits,
                             cudaStream_t stream) {
  Args c("coda::ops::gemm_rmsnorm_lse_logits");
  rmsnorm_lse_program<Program::kRmsnormLseLogits>(c, h, w_vocab, r, targets, max_partials,
                                                  sum_partials, target_logit, &logits, stream);
}

void cross_entropy_backward_from_logits(View logits, View lse, View scale, View targets,
                                        View target_logit, float z_loss, int64_t hidden, View zdz,
                                        cudaStream_t stream) {
  Args c("coda::ops::cross_entropy_backward_from_logits");
  const int64_t m = logits.rows, vocab = logits.cols;
  c.gemm_sizes({m, vocab, hidden}, /*any_n=*/true);
  c.matrix("logits", logits, kBf, m, vocab);
  c.vector("lse", lse, kF, m);
  c.vector("scale", scale, kF, m);
  c.vector("targets", targets, DType::kI64, m);
  c.vector("target_logit", target_logit, kF, m);
  c.vector("zdz", zdz, kF, m);
  c.on_device();
  kernel::cross_entropy_grad_from_logits(bf_out(logits), logits.ld, m, vocab, f32(lse), f32(scale),
                                         targets.as<const int64_t>(), f32(target_logit), z_loss,
                                         hidden, f32_out(zdz), stream);
}

void cross_entropy_from_unscaled_logits(View logits, View h, View w_vocab, View r, View targets,
                                        int64_t ignore_index, float z_loss, View scale, View lse,
                                        View token_loss, View zdz, cudaStream_t stream) {
  Args c("coda::ops::cross_entropy_from_unscaled_logits");
  const int64_t m = logits.rows, vocab = logits.cols, hidden = h.cols;
  c.gemm_sizes({m, vocab, hidden}, /*any_n=*/true);
  c.matrix("logits", logits, kBf, m, vocab);
  c.matrix("h", h, kBf, m, hidden);
  c.matrix("w_vocab", w_vocab, kBf, vocab, hidden);
  CODA_CHECK(h.ld == hidden && w_vocab.ld == hidden, c.op(),
             ": h and w_vocab must be contiguous (row stride ", hidden, "), got ", h.ld, " and ",
             w_vocab.ld);
  c.vector("r", r, kF, m);
  c.vector("targets", targets, DType::kI64, m);
  c.vector("scale", scale, kF, m);
  c.vector("lse", lse, kF, m);
  c.vector("token_loss", token_loss, kF, m);
  c.vector("zdz", zdz, kF, m);
  c.on_device();
  kernel::cross_entropy_from_unscaled_logits(
      bf_out(logits), logits.ld, m, vocab, bf(h), bf(w_vocab), hidden, f32(r),
      targets.as<const int64_t>(), ignore_index, z_loss, f32(scale), f32_out(lse),
      f32_out(token_loss), f32_out(zdz), stream);
}

void lse_loss_fold(View max_partials, View sum_partials, View target_logit, View targets,
                   int64_t vocab, int64_t ignore_index, float z_loss, View lse, View token_loss,
                   cudaStream_t stream) {
  Args c("coda::ops::lse_loss_fold");
  CODA_CHECK(vocab > 0, c.op(), ": vocab must be positive, got ", vocab);
  const int64_t m = lse.rows;
  c.fold("max_partials", max_partials, "lse", lse);
  c.matrix("sum_partials", sum_partials, kF, max_partials.rows, max_partials.cols);
  CODA_CHECK(max_partials.ld == sum_partials.ld, c.op(),
             ": max_partials and sum_partials must have one row stride, got ", max_partials.ld,
             " and ", sum_partials.ld);
  c.vector("target_logit", target_logit, kF, m);
  c.vector("targets", targets, DType::kI64, m);
  c.vector("token_loss", token_loss, kF, m);
  c.on_device();
  kernel::fold_lse_loss(f32(max_partials), f32(sum_partials), m, max_partials.ld, max_partials.rows,
                        f32(target_logit), targets.as<const int64_t>(), vocab, ignore_index, z_loss,
                        f32_out(lse), f32_out(token_loss), stream);
}

PartialLayout cross_entropy_backward_partials_layout(int64_t m, int64_t vocab, int64_t hidden) {
  return checked_layout("coda::ops::cross_entropy_backward_partials_layout",
                        Program::kRmsnormCrossEntropyBackward, Operands::kXWt, {m, vocab, hidden});
}

void gemm_rmsnorm_cross_entropy_backward(View h, View w_vocab, View r, View lse, View scale,
                                         View targets, float z_loss, View dlogits,
                                         View zdz_partials, cudaStream_t stream) {
  Args c("coda::ops::gemm_rmsnorm_cross_entropy_backward");
  const auto [m, vocab, hidden] = c.gemm_operands("h", h, "w_vocab", w_vocab, Operands::kXWt,
                                                  any_n(Program::kRmsnormCrossEntropyBackward));
  c.vector("r", r, kF, m);
  c.vector("lse", lse, kF, m);
  c.vector("scale", scale, kF, m);
  c.vector("targets", targets, DType::kI64, m);
  c.matrix("dlogits", dlogits, kBf, m, vocab);
  const auto kc = choose_with_partials(c, Program::kRmsnormCrossEntropyBackward, Operands::kXWt,
                                       {m, vocab, hidden}, "zdz_partials", zdz_partials);
  c.on_device();
  const kernel::RmsnormCrossEntropyBackwardArgs args{
      f32(r), f32(lse), f32(scale), targets.as<const int64_t>(), f32_out(zdz_partials), z_loss};
  launch<Program::kRmsnormCrossEntropyBackward>(
      c, Operands::kXWt, kc,
      {int(m), int(vocab), int(hidden), bf(h), h.ld, bf(w_vocab), w_vocab.ld, nullptr, 0,
       bf_out(dlogits), dlogits.ld},
      args, stream);
}

void scale_unless_one(View p, View g, cudaStream_t stream) {
  Args c("coda::ops::scale_unless_one");
  // p needs no alignment: the kernel takes 16-byte steps only where the address allows.
  CODA_CHECK(p.data != nullptr && p.dtype == kBf && p.dims == 1, c.op(),
             ": p must be a non-null bfloat16 vector, got dtype ", dtype_name(p.dtype), ", ",
             p.dims, " dimensions");
  c.vector("g", g, kF, 1);
  c.on_device();
  CODA_CHECK(p.device == g.device, c.op(), ": p is on device ", p.device, ", g on ", g.device);
  kernel::scale_bf16_unless_one(bf_out(p), p.rows, f32(g), stream);
}

}  // namespace coda::ops
