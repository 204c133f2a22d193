// What the op API's translation units share (src/ops.cpp, src/ops_fp8.cpp): the argument checks
// of one call (Args), the kernel choice and launch, the partial layouts, typed views. Private to
// src/.
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>

#include "coda/common/check.hpp"
#include "coda/kernel/args.hpp"
#include "coda/kernel/runtime.hpp"
#include "coda/ops.hpp"

namespace coda::ops::detail {

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

inline constexpr DType kBf = DType::kBF16, kF = DType::kF32;

// The kernel of one call, chosen once: its tile shape fixes the partial buffers' layout, and the
// launch runs it.
inline kernel::KernelChoice choose(Program p, Operands o, int64_t m, int64_t n, int64_t k) {
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

inline PartialLayout layout_of(Program p, const kernel::KernelChoice& k, int64_t m, int64_t n) {
  const auto t = kernel::tile_shape(k.config);
  return p == Program::kRmsnormBackward || p == Program::kRmsnormBackwardFp8
             ? PartialLayout::per_column(m, n, t.m, t.n)
             : PartialLayout::per_row(m, n, t.m, t.n);
}
// The programs whose epilogue takes any N: D through the TMA store (16-byte granules, zeros past
// N) and nodes that mask each column against N (the LM head's, over a vocabulary of any size).
inline bool any_n(Program p) {
  return p == Program::kPlain || p == Program::kRmsnormLse || p == Program::kRmsnormLseLogits ||
         p == Program::kRmsnormCrossEntropyBackward;
}
// layout_of after the GEMM size checks of `op`, for the public *_partials_layout functions.
inline PartialLayout checked_layout(const char* op, Program p, Operands o, GemmSizes s) {
  Args(op).gemm_sizes(s, any_n(p));
  return layout_of(p, choose(p, o, s.m, s.n, s.k), s.m, s.n);
}
// The kernel of a program that writes a partial buffer, chosen once, with the buffer `name`
// checked against that kernel's layout.
inline kernel::KernelChoice choose_with_partials(Args& c, Program p, Operands o, GemmSizes s,
                                                 const char* name, const TensorView& partials) {
  const kernel::KernelChoice k = choose(p, o, s.m, s.n, s.k);
  c.partials(name, partials, layout_of(p, k, s.m, s.n));
  return k;
}

inline const bf16* bf(const TensorView& t) { return t.as<const bf16>(); }
inline bf16* bf_out(const TensorView& t) { return t.as<bf16>(); }
inline const float* f32(const TensorView& t) { return t.as<const float>(); }
inline float* f32_out(const TensorView& t) { return t.as<float>(); }
inline const uint32_t* words(const TensorView& table, int row) {  // a rope_table row, as uint32
  return table.as<const uint32_t>() + row * table.ld;
}

// The epilogues that run on bf16 and on FP8 operands alike, from the call's GEMM problem `p` (A
// and B, checked by the caller) in layout `o`: the checks of the remaining arguments, the kernel
// choice and the launch (src/ops.cpp).
//   F1 with a bf16 h: x = A·B + residual, h = x ⊙ γ, the Σx² partials.
void residual_rmsnorm_partial(Args& c, Operands o, kernel::GemmProblem p, View residual, View gamma,
                              View x, View h, View sumsq_partials, cudaStream_t stream);
//   F3: qkv = rope(r ⊙ (A·B) + bias).
void rmsnorm_rope(Args& c, Operands o, kernel::GemmProblem p, View r, View bias, View pos,
                  View rope_table, View qkv, cudaStream_t stream);
//   F3q: qkv = rope(qk_norm(r ⊙ (A·B))) on the Q and K heads, qk_pre their columns before it.
void rmsnorm_qk_norm_rope(Args& c, Operands o, kernel::GemmProblem p, View r, View q_gamma,
                          View k_gamma, const programs::QkNorm& qk, View pos, View rope_table,
                          View qkv, View qk_pre, cudaStream_t stream);
// B1's epilogue operands and output, (M, H): x, r, γ, ZdZ, dres, dx.
void rmsnorm_backward_inputs(Args& c, View x, View r, View gamma, View zdz, View dres, View dx,
                             int64_t m, int64_t hidden);

// D (bf16, or fp32 += with `accumulate`) = X·Yᵀ of a checked 1x128 x 1x128 FP8 problem on
// cuBLASLt (src/fp8_wgrad_cublaslt.cpp); nullptr when launched, else why cuBLASLt cannot take
// it (nothing launched): scales whose row stride is not the operand's rows, or no algorithm.
const char* gemm_fp8_xyt_cublaslt(const kernel::GemmProblem& p, void* d, int64_t ldd,
                                  bool accumulate, cudaStream_t stream);

// A process-wide choice (an enum's value) that starts from the environment, read on the first
// get(), and that set() replaces: the FP8 weight gradient's backend, the FP8 epilogue placement.
class ProcessSetting {
 public:
  explicit ProcessSetting(int (*from_environment)()) : from_environment_(from_environment) {}
  int get() {
    int v = value_.load(std::memory_order_relaxed);
    if (v < 0) {
      int unset = -1;
      value_.compare_exchange_strong(unset, from_environment_());
      v = value_.load(std::memory_order_relaxed);
    }
    return v;
  }
  void set(int v) { value_.store(v, std::memory_order_relaxed); }

 private:
  std::atomic<int> value_{-1};  // -1: not yet read from the environment
  int (*from_environment_)();
};

}  // namespace coda::ops::detail
