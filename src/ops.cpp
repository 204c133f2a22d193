// The C++ op API (include/coda/ops.hpp): argument checks, the kernel choice, the launch.
#include "coda/ops.hpp"

#include <cuda_runtime.h>

#include <string>

#include "coda/common/check.hpp"
#include "coda/kernel/args.hpp"
#include "coda/kernel/aux_kernels.hpp"
#include "coda/kernel/cuda_check.hpp"
#include "coda/kernel/quantize.hpp"
#include "coda/kernel/runtime.hpp"

namespace coda::ops {
namespace {

using kernel::bf16;
using kernel::GemmShape;
using kernel::Operands;
using kernel::Program;

struct GemmSizes {
  int64_t m, n, k;
};

// The checks of one op call. Each argument is checked on the host as it is named; on_device()
// then compares every view's device with the current one (a cudaGetDevice, no pointer query).
class Args {
 public:
  explicit Args(const char* op) : op_(op) {}

  // A row-major matrix: non-null, `dtype`, (rows, cols), row stride >= cols, start and row stride
  // 16-byte aligned (TMA rows; the row kernels' vector accesses).
  const TensorView& matrix(const char* name, const TensorView& t, DType dtype, int64_t rows,
                           int64_t cols) {
    common(name, t, dtype);
    CODA_CHECK(t.dims == 2, op_, ": ", name, " must be a matrix, got a vector of ", t.rows);
    CODA_CHECK(t.rows == rows && t.cols == cols, op_, ": ", name, " must have shape (", rows, ", ",
               cols, "), got (", t.rows, ", ", t.cols, ")");
    CODA_CHECK(t.ld >= t.cols && (t.ld * dtype_bytes(dtype)) % 16 == 0, op_, ": ", name,
               " needs a row stride >= ", t.cols, " of a multiple of 16 bytes, got ", t.ld,
               " elements");
    return t;
  }
  // A vector of n elements (start 16-byte aligned: per-column vectors load 16 bytes at a time).
  const TensorView& vector(const char* name, const TensorView& t, DType dtype, int64_t n) {
    common(name, t, dtype);
    CODA_CHECK(t.dims == 1, op_, ": ", name, " must be a vector of ", n, " elements, got (", t.rows,
               ", ", t.cols, ")");
    CODA_CHECK(t.rows == n, op_, ": ", name, " must have ", n, " elements, got ", t.rows);
    return t;
  }
  // A partial buffer: an fp32 matrix of exactly `layout`'s (tiles, extent).
  // The programs write it densely: its row stride is its extent.
  const TensorView& partials(const char* name, const TensorView& t, const PartialLayout& layout) {
    matrix(name, t, DType::kF32, layout.tiles, layout.extent);
    CODA_CHECK(t.ld == t.cols, op_, ": ", name, " must be contiguous (row stride ", t.cols,
               "), got a row stride of ", t.ld);
    return t;
  }
  // A fold's input and output: an fp32 vector `out` of the logical entries, and a (tiles,
  // extent) fp32 partial buffer whose extent covers them.
  void fold(const char* name, const TensorView& partials, const char* out_name,
            const TensorView& out) {
    vector(out_name, out, DType::kF32, out.rows);
    matrix(name, partials, DType::kF32, partials.rows, partials.cols);
    CODA_CHECK(partials.cols >= out.rows && partials.rows > 0, op_, ": ", name, " (", partials.rows,
               ", ", partials.cols, ") must be (tiles, extent) with extent >= ", out_name, "'s ",
               out.rows, " entries");
  }
  // GEMM sizes: positive and below 2^31. The TMA asks 16-byte row strides and starts of the
  // operands (matrix()), not whole extents: the mainloop zero-fills past M, N and K, so K and M
  // may be anything. N must be a multiple of 8 unless the program's epilogue takes any N
  // (`any_n`; D's store then writes zeros up to N rounded up to 8, the contract in ops.hpp).
  void gemm_sizes(GemmSizes s, bool any_n = false) const {
    CODA_CHECK(s.m > 0 && s.n > 0 && s.k > 0, op_, ": sizes must be positive, got M=", s.m,
               " N=", s.n, " K=", s.k);
    CODA_CHECK(s.m < (int64_t(1) << 31) && s.n < (int64_t(1) << 31) && s.k < (int64_t(1) << 31),
               op_, ": sizes must be below 2^31, got M=", s.m, " N=", s.n, " K=", s.k);
    CODA_CHECK(any_n || s.n % 8 == 0, op_,
               ": N must be a multiple of 8 (the epilogue maps column pairs 16 bytes at a time), "
               "got ",
               s.n);
  }
  // A GEMM's operands A and B in layout `o`, checked with their sizes; returns (M, N, K).
  //   X·Wᵀ: A (M, K), B (N, K);  X·W: A (M, K), B (K, N);  Xᵀ·Y: A (K, M), B (K, N).
  GemmSizes gemm_operands(const char* a_name, const TensorView& a, const char* b_name,
                          const TensorView& b, kernel::Operands o, bool any_n = false) {
    const bool xty = o == kernel::Operands::kXtY;
    const GemmSizes s{xty ? a.cols : a.rows, o == kernel::Operands::kXWt ? b.rows : b.cols,
                      xty ? a.rows : a.cols};
    gemm_sizes(s, any_n);
    matrix(a_name, a, DType::kBF16, xty ? s.k : s.m, xty ? s.m : s.k);
    matrix(b_name, b, DType::kBF16, o == kernel::Operands::kXWt ? s.n : s.k,
           o == kernel::Operands::kXWt ? s.k : s.n);
    return s;
  }
  // Block scales: an fp32 (rows, cols) matrix with row stride >= cols; where `tma_rows` (1x128
  // scales, which the mainloop loads 16 bytes at a time) a multiple of 4 and >= cols rounded up
  // to 4, entries the quantizer fills with 1.
  const TensorView& scales(const char* name, const TensorView& t, int64_t rows, int64_t cols,
                           bool tma_rows) {
    common(name, t, DType::kF32);
    CODA_CHECK(t.dims == 2 && t.rows == rows && t.cols == cols, op_, ": ", name,
               " must be fp32 scales of shape (", rows, ", ", cols, "), got (", t.rows, ", ",
               t.dims == 2 ? t.cols : 1, ")");
    const int64_t least = tma_rows ? kernel::ScaleLayout::row_scales_ld(cols) : cols;
    CODA_CHECK(t.ld >= least && (!tma_rows || t.ld % 4 == 0), op_, ": ", name,
               " needs a row stride >= ", least, tma_rows ? " and a multiple of 4" : "", ", got ",
               t.ld);
    return t;
  }
  void distinct(const char* a, const TensorView& ta, const char* b, const TensorView& tb) const {
    CODA_CHECK(ta.data != tb.data, op_, ": ", a, " must not alias ", b);
  }
  // Every view named so far is on the current CUDA device.
  void on_device() const {
    int current = -1;
    const cudaError_t e = cudaGetDevice(&current);
    CODA_CHECK(e == cudaSuccess, op_, ": no current CUDA device: ", cudaGetErrorString(e));
    for (int i = 0; i < count_; ++i)
      CODA_CHECK(devices_[i] == current, op_, ": ", names_[i], " is on CUDA device ", devices_[i],
                 ", but the current device is ", current);
  }
  const char* op() const { return op_; }

 private:
  void common(const char* name, const TensorView& t, DType dtype) {
    CODA_CHECK(t.data != nullptr, op_, ": ", name, " is null");
    CODA_CHECK(t.device >= 0, op_, ": ", name, " is host memory (device ", t.device,
               "); the op runs on a CUDA device");
    CODA_CHECK(t.dtype == dtype, op_, ": ", name, " must be ", dtype_name(dtype), ", got ",
               dtype_name(t.dtype));
    CODA_CHECK(reinterpret_cast<uintptr_t>(t.data) % 16 == 0, op_, ": ", name,
               " must be 16-byte aligned, got address ", t.data);
    CODA_CHECK(count_ < kMax, op_, ": too many arguments");
    names_[count_] = name;
    devices_[count_++] = t.device;
  }
  static constexpr int kMax = 16;
  const char* op_;
  const char* names_[kMax] = {};
  int devices_[kMax] = {};
  int count_ = 0;
};

constexpr DType kBf = DType::kBF16, kF = DType::kF32;

// The kernel of one call, chosen once: its tile shape fixes the partial buffers' layout, and the
// launch runs it.
kernel::KernelChoice choose(Program p, Operands o, int64_t m, int64_t n, int64_t k) {
  return kernel::select_kernel(p, o, {int(m), int(n), int(k)});
}

template <Program P>
void launch(const Args& c, Operands o, const kernel::KernelChoice& k,
            const kernel::GemmProblem& prob, const kernel::ArgsOf<P>& a, cudaStream_t stream) {
  const cudaError_t e = kernel::launch<P>(k.config, o, prob, a, k.scheduler, stream);
  CODA_CHECK(e == cudaSuccess, c.op(), ": launch failed (", kernel::config_name(k.config),
             ", M=", prob.m, " N=", prob.n, " K=", prob.k, "): ", cudaGetErrorString(e));
}
// A program that writes no partials: chosen at its launch.
template <Program P>
void launch(const Args& c, Operands o, const kernel::GemmProblem& prob, const kernel::ArgsOf<P>& a,
            cudaStream_t stream) {
  launch<P>(c, o, choose(P, o, prob.m, prob.n, prob.k), prob, a, stream);
}

PartialLayout layout_of(Program p, const kernel::KernelChoice& k, int64_t m, int64_t n) {
  const auto t = kernel::tile_shape(k.config);
  return p == Program::kRmsnormBackward || p == Program::kRmsnormBackwardFp8
             ? PartialLayout::per_column(m, n, t.m, t.n)
             : PartialLayout::per_row(m, n, t.m, t.n);
}
// The programs whose epilogue takes any N: D through the TMA store (16-byte granules, zeros past
// N) and nodes that mask each column against N (the LM head's, over a vocabulary of any size).
bool any_n(Program p) {
  return p == Program::kPlain || p == Program::kRmsnormLse || p == Program::kRmsnormLseLogits ||
         p == Program::kRmsnormCrossEntropyBackward;
}
// layout_of after the GEMM size checks of `op`, for the public *_partials_layout functions.
PartialLayout checked_layout(const char* op, Program p, Operands o, GemmSizes s) {
  Args(op).gemm_sizes(s, any_n(p));
  return layout_of(p, choose(p, o, s.m, s.n, s.k), s.m, s.n);
}
// The kernel of a program that writes a partial buffer, chosen once, with the buffer `name`
// checked against that kernel's layout.
kernel::KernelChoice choose_with_partials(Args& c, Program p, Operands o, GemmSizes s,
                                          const char* name, const TensorView& partials) {
  const kernel::KernelChoice k = choose(p, o, s.m, s.n, s.k);
  c.partials(name, partials, layout_of(p, k, s.m, s.n));
  return k;
}

const bf16* bf(const TensorView& t) { return t.as<const bf16>(); }
bf16* bf_out(const TensorView& t) { return t.as<bf16>(); }
const float* f32(const TensorView& t) { return t.as<const float>(); }
float* f32_out(const TensorView& t) { return t.as<float>(); }
const uint32_t* words(const TensorView& table, int row) {  // a rope_table row, as uint32
  return table.as<const uint32_t>() + row * table.ld;
}

}  // namespace

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
  c.matrix("residual", residual, kBf, m, n);
  c.vector("gamma", gamma, kBf, n);
  c.matrix("x", x, kBf, m, n);
  c.matrix("h", h, kBf, m, n);
  c.distinct("h", h, "x", x);
  c.distinct("h", h, "residual", residual);
  const auto kc = choose_with_partials(c, Program::kResidualRmsnormPartial, Operands::kXWt,
                                       {m, n, k}, "sumsq_partials", sumsq_partials);
  c.on_device();
  const kernel::ResidualRmsnormPartialArgs args{bf(gamma), bf_out(h), h.ld,
                                                f32_out(sumsq_partials)};
  launch<Program::kResidualRmsnormPartial>(c, Operands::kXWt, kc,
                                           {int(m), int(n), int(k), bf(a), a.ld, bf(w), w.ld,
                                            bf(residual), residual.ld, bf_out(x), x.ld},
                                           args, stream);
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
  c.vector("r", r, kF, m);
  if (bias.data) c.vector("bias", bias, kBf, n);
  c.vector("pos", pos, DType::kI32, m);
  c.matrix("rope_table", rope_table, DType::kI32, 2, n);
  c.matrix("qkv", qkv, kBf, m, n);
  c.on_device();
  const kernel::RmsnormRopeArgs args{f32(r), bf(bias), pos.as<const int32_t>(),
                                     words(rope_table, 0), words(rope_table, 1)};
  launch<Program::kRmsnormRope>(
      c, Operands::kXWt,
      {int(m), int(n), int(k), bf(h), h.ld, bf(w_qkv), w_qkv.ld, nullptr, 0, bf_out(qkv), qkv.ld},
      args, stream);
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

void gemm_rmsnorm_qk_norm_rope(View h, View w_qkv, View r, View q_gamma, View k_gamma,
                               const programs::QkNorm& qk, View pos, View rope_table, View qkv,
                               View qk_pre, cudaStream_t stream) {
  Args c("coda::ops::gemm_rmsnorm_qk_norm_rope");
  const auto [m, n, k] = c.gemm_operands("h", h, "w_qkv", w_qkv, Operands::kXWt);
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
  launch<Program::kRmsnormQkNormRope>(
      c, Operands::kXWt,
      {int(m), int(n), int(k), bf(h), h.ld, bf(w_qkv), w_qkv.ld, nullptr, 0, nullptr, n}, args,
      stream);
}

PartialLayout rmsnorm_backward_partials_layout(int64_t m, int64_t hidden, int64_t n_out) {
  return checked_layout("coda::ops::rmsnorm_backward_partials_layout", Program::kRmsnormBackward,
                        Operands::kXW, {m, hidden, n_out});
}

void gemm_rmsnorm_backward(View dz, View w, View x, View r, View gamma, View zdz, View dres,
                           View dx, View h_out, View dgamma_partials, cudaStream_t stream) {
  Args c("coda::ops::gemm_rmsnorm_backward");
  const auto [m, hidden, n_out] = c.gemm_operands("dz", dz, "w", w, Operands::kXW);
  c.matrix("x", x, kBf, m, hidden);
  c.vector("r", r, kF, m);
  c.vector("gamma", gamma, kBf, hidden);
  c.vector("zdz", zdz, kF, m);
  c.matrix("dres", dres, kBf, m, hidden);
  c.matrix("dx", dx, kBf, m, hidden);
  c.matrix("h_out", h_out, kBf, m, hidden);
  c.distinct("h_out", h_out, "dx", dx);
  c.distinct("h_out", h_out, "dres", dres);
  c.distinct("h_out", h_out, "x", x);
  const auto kc = choose_with_partials(c, Program::kRmsnormBackward, Operands::kXW,
                                       {m, hidden, n_out}, "dgamma_partials", dgamma_partials);
  c.on_device();
  const kernel::RmsnormBackwardArgs args{
      bf(x), x.ld, f32(r), bf(gamma), f32(zdz), bf_out(h_out), h_out.ld, f32_out(dgamma_partials)};
  launch<Program::kRmsnormBackward>(c, Operands::kXW, kc,
                                    {int(m), int(hidden), int(n_out), bf(dz), dz.ld, bf(w), w.ld,
                                     bf(dres), dres.ld, bf_out(dx), dx.ld},
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

namespace {
int64_t blocks(int64_t extent) { return kernel::ScaleLayout::blocks(extent); }
kernel::Fp8Output fp8_output(const TensorView& codes, const TensorView& scales) {
  return {codes.as<uint8_t>(), codes.ld, scales.as<float>(), scales.ld};
}
// An FP8 GEMM operand (rows, k) of e4m3 codes, K a multiple of 16 (16-byte TMA rows).
void fp8_operand(Args& c, const char* name, const TensorView& t, int64_t rows, int64_t k) {
  c.matrix(name, t, DType::kE4M3, rows, k);
}
// A cast's bf16 input (rows, cols), cols a multiple of 16, and at least one of its outputs.
struct CastSizes {
  int64_t rows, cols;
};
CastSizes cast_input(Args& c, const char* name, const TensorView& x, const TensorView& codes,
                     const TensorView& codes_t) {
  CODA_CHECK(x.dims == 2, c.op(), ": ", name, " must be a matrix");
  const int64_t rows = x.rows, cols = x.cols;
  CODA_CHECK(rows > 0 && cols > 0 && cols % 16 == 0 && rows < (int64_t(1) << 31) &&
                 cols < (int64_t(1) << 31),
             c.op(), ": ", name, " must be (rows, cols) with cols a multiple of 16, both ",
             "positive and below 2^31, got (", rows, ", ", cols, ")");
  c.matrix(name, x, kBf, rows, cols);
  CODA_CHECK(codes.data || codes_t.data, c.op(), ": neither codes nor codes_t is wanted");
  return {rows, cols};
}
// The outputs of a (rows, cols) tensor quantized in 1x128 blocks, each checked where wanted (null
// codes: not wanted): codes (rows, cols) with scales (ceil(cols/128), rows), and the transposed
// copy's codes (cols, padded_tokens(rows)) with scales (ceil(rows/128), cols). The
// quantize_fp8_rows cast and F1 with FP8 h write these.
struct RowOutputs {
  kernel::Fp8Output rows, cols;
};
RowOutputs row_outputs(Args& c, const char* codes_name, const TensorView& codes,
                       const char* scales_name, const TensorView& scales, const char* t_name,
                       const TensorView& codes_t, const char* ts_name, const TensorView& scales_t,
                       int64_t rows, int64_t cols) {
  RowOutputs o;
  if (codes.data) {
    c.matrix(codes_name, codes, DType::kE4M3, rows, cols);
    c.scales(scales_name, scales, blocks(cols), rows, true);
    o.rows = fp8_output(codes, scales);
  }
  if (codes_t.data) {
    c.matrix(t_name, codes_t, DType::kE4M3, cols, kernel::ScaleLayout::padded_tokens(rows));
    c.scales(ts_name, scales_t, blocks(rows), cols, true);
    o.cols = fp8_output(codes_t, scales_t);
  }
  return o;
}
}  // namespace

void quantize_fp8_rows(View x, View codes, View scales, View codes_t, View scales_t,
                       cudaStream_t stream) {
  Args c("coda::ops::quantize_fp8_rows");
  const auto [m, k] = cast_input(c, "x", x, codes, codes_t);
  const RowOutputs out = row_outputs(c, "codes", codes, "scales", scales, "codes_t", codes_t,
                                     "scales_t", scales_t, m, k);
  c.on_device();
  kernel::quantize_fp8_rows(bf(x), m, k, x.ld, out.rows, out.cols, stream);
}

void quantize_fp8_blocks(View w, View codes, View scales, View codes_t, View scales_t,
                         cudaStream_t stream) {
  Args c("coda::ops::quantize_fp8_blocks");
  const auto [n, k] = cast_input(c, "w", w, codes, codes_t);
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
  CODA_CHECK(h.data || h_t.data, c.op(), ": neither h nor h_t is wanted");
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
  kernel::GemmProblem p =
      fp8_problem(c, {"a", a, "a_scales", a_scales}, {"w", w, "w_scales", w_scales}, true);
  const int64_t m = p.m, n = p.n;
  c.matrix("residual", residual, kBf, m, n);
  c.vector("gamma", gamma, kBf, n);
  c.matrix("x", x, kBf, m, n);
  c.matrix("h", h, kBf, m, n);
  c.distinct("h", h, "x", x);
  const auto kc = choose_with_partials(c, Program::kResidualRmsnormPartial, Operands::kFp8XWt,
                                       {m, n, p.k}, "sumsq_partials", sumsq_partials);
  c.on_device();
  p.c = bf(residual);
  p.ldc = residual.ld;
  p.d = bf_out(x);
  p.ldd = x.ld;
  launch<Program::kResidualRmsnormPartial>(
      c, Operands::kFp8XWt, kc, p, {bf(gamma), bf_out(h), h.ld, f32_out(sumsq_partials)}, stream);
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
  CODA_CHECK(a.data || a_t.data, c.op(), ": neither a nor a_t is wanted");
  const RowOutputs out = row_outputs(c, "a", a, "a_scales", a_scales, "a_t", a_t, "a_t_scales",
                                     a_t_scales, m, two_i / 2);
  c.on_device();
  p.d = bf_out(z);
  p.ldd = z.ld;
  launch<Program::kRmsnormSwigluFp8>(c, Operands::kFp8XWt, p, {f32(r), out.rows, out.cols}, stream);
}

void gemm_fp8_rmsnorm_rope(View h, View h_scales, View w_qkv, View w_qkv_scales, View r, View bias,
                           View pos, View rope_table, View qkv, cudaStream_t stream) {
  Args c("coda::ops::gemm_fp8_rmsnorm_rope");
  kernel::GemmProblem p = fp8_problem(c, {"h", h, "h_scales", h_scales},
                                      {"w_qkv", w_qkv, "w_qkv_scales", w_qkv_scales}, true);
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
  launch<Program::kRmsnormRope>(c, Operands::kFp8XWt, p, args, stream);
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
  c.matrix("x", x, kBf, m, hidden);
  c.vector("r", r, kF, m);
  c.vector("gamma", gamma, kBf, hidden);
  c.vector("zdz", zdz, kF, m);
  c.matrix("dres", dres, kBf, m, hidden);
  c.matrix("dx", dx, kBf, m, hidden);
  CODA_CHECK(h_t.data, c.op(), ": h_t is null (the weight gradient's operand is the point)");
  const RowOutputs out = row_outputs(c, "h", TensorView{}, "h_scales", TensorView{}, "h_t", h_t,
                                     "h_t_scales", h_t_scales, m, hidden);
  const auto kc = choose_with_partials(c, Program::kRmsnormBackwardFp8, Operands::kFp8XWt,
                                       {m, hidden, p.k}, "dgamma_partials", dgamma_partials);
  c.on_device();
  p.c = bf(dres);
  p.ldc = dres.ld;
  p.d = bf_out(dx);
  p.ldd = dx.ld;
  const kernel::RmsnormBackwardArgs b1{bf(x),    x.ld,    f32(r), bf(gamma),
                                       f32(zdz), nullptr, 0,      f32_out(dgamma_partials)};
  launch<Program::kRmsnormBackwardFp8>(c, Operands::kFp8XWt, kc, p, {b1, out.cols}, stream);
}

PartialLayout fp8_swiglu_backward_partials_layout(int64_t m, int64_t intermediate, int64_t hidden) {
  return checked_layout("coda::ops::fp8_swiglu_backward_partials_layout",
                        Program::kSwigluBackwardFp8, Operands::kFp8XWt, {m, intermediate, hidden});
}

void gemm_fp8_swiglu_backward(View dx_out, View dx_out_scales, View w_down_t, View w_down_t_scales,
                              View z, View dz, View dz_scales, View dz_t, View dz_t_scales,
                              View zdz_partials, cudaStream_t stream) {
  Args c("coda::ops::gemm_fp8_swiglu_backward");
  kernel::GemmProblem p =
      fp8_problem(c, {"dx_out", dx_out, "dx_out_scales", dx_out_scales},
                  {"w_down_t", w_down_t, "w_down_t_scales", w_down_t_scales}, true);
  const int64_t m = p.m, inter = p.n;
  c.matrix("z", z, kBf, m, 2 * inter);
  CODA_CHECK(dz.data || dz_t.data, c.op(), ": neither dz nor dz_t is wanted");
  const RowOutputs out = row_outputs(c, "dz", dz, "dz_scales", dz_scales, "dz_t", dz_t,
                                     "dz_t_scales", dz_t_scales, m, 2 * inter);
  const auto kc = choose_with_partials(c, Program::kSwigluBackwardFp8, Operands::kFp8XWt,
                                       {m, inter, p.k}, "zdz_partials", zdz_partials);
  c.on_device();
  // (g, u) bf16 pairs travel as one 32-bit element each: row strides in pairs.
  kernel::SwigluBackwardFp8Args args;
  args.z = z.as<const uint32_t>();
  args.ldz = z.ld / 2;
  args.zdz_partials = f32_out(zdz_partials);
  args.dz = out.rows;
  args.dz_t = out.cols;
  launch<Program::kSwigluBackwardFp8>(c, Operands::kFp8XWt, kc, p, args, stream);
}

void gemm_fp8_xyt(View x, View x_scales, View y, View y_scales, View d, bool accumulate,
                  cudaStream_t stream) {
  Args c(accumulate ? "coda::ops::gemm_fp8_xyt (accumulate)" : "coda::ops::gemm_fp8_xyt");
  kernel::GemmProblem p =
      fp8_problem(c, {"x", x, "x_scales", x_scales}, {"y", y, "y_scales", y_scales}, false);
  c.matrix("d", d, accumulate ? kF : kBf, p.m, p.n);
  c.on_device();
  if (accumulate) {
    launch<Program::kAccumulateF32>(c, Operands::kFp8XYt, p, {f32_out(d), d.ld}, stream);
  } else {
    p.d = bf_out(d);
    p.ldd = d.ld;
    launch<Program::kPlain>(c, Operands::kFp8XYt, p, {}, stream);
  }
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
