// The C++ op API (include/coda/ops.hpp): argument checks, the config heuristic, the launch.
#include "coda/ops.hpp"

#include <cuda_runtime.h>

#include <initializer_list>
#include <string>
#include <utility>

#include "coda/common/check.hpp"
#include "coda/kernel/aux_kernels.hpp"
#include "coda/kernel/cuda_check.hpp"
#include "coda/kernel/heuristic.hpp"

namespace coda::ops {
namespace {

using kernel::Operands;
using kernel::Program;

// Device pointer arguments: non-null, 16-byte aligned, on the current device. The host-side
// checks run for every argument before any device query, so a null or misaligned argument is
// reported as such (and is reported on a machine without a GPU too).
void check_device_pointers(const char* op,
                           std::initializer_list<std::pair<const char*, const void*>> pointers) {
  for (const auto& [name, p] : pointers) {
    CODA_CHECK(p != nullptr, op, ": ", name, " is null");
    CODA_CHECK(reinterpret_cast<uintptr_t>(p) % 16 == 0, op, ": ", name,
               " must be 16-byte aligned, got address ", p);
  }
  int device = 0;
  CODA_CUDA_CHECK(cudaGetDevice(&device));
  for (const auto& [name, p] : pointers) {
    cudaPointerAttributes attr{};
    const cudaError_t e = cudaPointerGetAttributes(&attr, p);
    CODA_CHECK(e == cudaSuccess, op, ": cannot query ", name, ": ", cudaGetErrorString(e));
    CODA_CHECK(attr.type == cudaMemoryTypeDevice || attr.type == cudaMemoryTypeManaged, op, ": ",
               name, " is not device memory (pointer type ", int(attr.type), ")");
    CODA_CHECK(attr.device == device, op, ": ", name, " is on device ", attr.device,
               " but the current device is ", device);
  }
}

void check_gemm_sizes(const char* op, int m, int n, int k) {
  CODA_CHECK(m > 0 && n > 0 && k > 0, op, ": sizes must be positive, got M=", m, " N=", n,
             " K=", k);
  CODA_CHECK(n % 8 == 0, op, ": N must be a multiple of 8 (16-byte rows for TMA), got ", n);
  CODA_CHECK(k % 8 == 0, op, ": K must be a multiple of 8 (16-byte rows for TMA), got ", k);
}

// Stored logits (M rows of V bf16 at row stride ld_logits): rows at least V long and 4-byte
// aligned for the row kernels' bf16-pair accesses (V % 8 == 0 comes with check_gemm_sizes).
void check_logits_stride(const char* op, int vocab, int ld_logits) {
  CODA_CHECK(ld_logits >= vocab && ld_logits % 2 == 0, op,
             ": ld_logits must be even and >= vocab, got vocab ", vocab, ", ld_logits ",
             ld_logits);
}

void launch(const char* op, Program p, int m, int n, int k, const kernel::GemmProblem& prob,
            const void* args, cudaStream_t stream, Operands o = Operands::kXWt) {
  const kernel::KernelChoice c = kernel::choose_config(p, o, m, n, k);
  const kernel::LaunchFn fn = kernel::find_kernel(p, c.config, o);
  CODA_CHECK(fn != nullptr, op,
             ": no compiled kernel for this program (build with CODA_KERNELS=all)");
  const cudaError_t e = fn(prob, args, c.scheduler, stream);
  CODA_CHECK(e == cudaSuccess, op, ": launch failed (", kernel::config_name(c.config), ", M=", m,
             " N=", n, " K=", k, "): ", cudaGetErrorString(e));
}

epilogue::PartialLayout partial_layout(Program p, int m, int n, int k,
                                       Operands o = Operands::kXWt) {
  const auto c = kernel::choose_config(p, o, m, n, k);
  const auto t = kernel::tile_shape(c.config);
  return p == Program::kRmsnormBackward ? epilogue::PartialLayout::per_column(m, n, t.m, t.n)
                                        : epilogue::PartialLayout::per_row(m, n, t.m, t.n);
}

}  // namespace

void gemm(const bf16* x, const bf16* w, bf16* d, int m, int n, int k, cudaStream_t stream) {
  const char* op = "coda::ops::gemm";
  check_gemm_sizes(op, m, n, k);
  check_device_pointers(op, {{"x", x}, {"w", w}, {"d", d}});
  kernel::PlainArgs args;
  launch(op, Program::kPlain, m, n, k, {m, n, k, x, k, w, k, nullptr, 0, d, n}, &args, stream);
}

epilogue::PartialLayout residual_rmsnorm_partials_layout(int m, int n, int k) {
  check_gemm_sizes("coda::ops::residual_rmsnorm_partials_layout", m, n, k);
  return partial_layout(Program::kResidualRmsnormPartial, m, n, k);
}

void gemm_residual_rmsnorm_partial(const bf16* a, const bf16* w, const bf16* residual,
                                   const bf16* gamma, bf16* x, bf16* h, float* sumsq_partials,
                                   int m, int n, int k, cudaStream_t stream) {
  const char* op = "coda::ops::gemm_residual_rmsnorm_partial";
  check_gemm_sizes(op, m, n, k);
  check_device_pointers(op, {{"a", a},
                             {"w", w},
                             {"residual", residual},
                             {"gamma", gamma},
                             {"x", x},
                             {"h", h},
                             {"sumsq_partials", sumsq_partials}});
  CODA_CHECK(static_cast<const void*>(h) != x && static_cast<const void*>(h) != residual, op,
             ": h must not alias x or residual");
  kernel::ResidualRmsnormPartialArgs args{gamma, h, n, sumsq_partials};
  launch(op, Program::kResidualRmsnormPartial, m, n, k, {m, n, k, a, k, w, k, residual, n, x, n},
         &args, stream);
}

void rmsnorm_fold(const float* sumsq_partials, const epilogue::PartialLayout& layout, int hidden,
                  float eps, float* r, cudaStream_t stream) {
  const char* op = "coda::ops::rmsnorm_fold";
  check_device_pointers(op, {{"sumsq_partials", sumsq_partials}, {"r", r}});
  CODA_CHECK(hidden > 0, op, ": hidden must be positive, got ", hidden);
  CODA_CHECK(eps >= 0.f, op, ": eps must be >= 0, got ", eps);
  kernel::fold_rstd(sumsq_partials, layout.logical, layout.extent, layout.tiles, hidden, eps, r,
                    stream);
}

void first_layer_rmsnorm(const bf16* x, const bf16* gamma, int m, int hidden, float eps, bf16* h,
                         float* r, cudaStream_t stream) {
  const char* op = "coda::ops::first_layer_rmsnorm";
  CODA_CHECK(m > 0 && hidden > 0 && hidden % 8 == 0, op,
             ": need M > 0 and hidden a positive multiple of 8, got M=", m, " hidden=", hidden);
  check_device_pointers(op, {{"x", x}, {"gamma", gamma}, {"h", h}, {"r", r}});
  kernel::first_layer_rmsnorm(x, gamma, m, hidden, eps, h, r, stream);
}

void gemm_rmsnorm_swiglu(const bf16* h, const bf16* w_gu, const float* r, bf16* z, bf16* a, int m,
                         int two_i, int k, cudaStream_t stream) {
  const char* op = "coda::ops::gemm_rmsnorm_swiglu";
  check_gemm_sizes(op, m, two_i, k);
  CODA_CHECK(two_i % 16 == 0, op,
             ": 2I must be a multiple of 16 (a's rows of I are 16-byte "
             "aligned), got ",
             two_i);
  check_device_pointers(op, {{"h", h}, {"w_gu", w_gu}, {"r", r}, {"z", z}, {"a", a}});
  kernel::RmsnormSwigluArgs args{r, a, two_i / 2};
  launch(op, Program::kRmsnormSwiglu, m, two_i, k,
         {m, two_i, k, h, k, w_gu, k, nullptr, 0, z, two_i}, &args, stream);
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

void gemm_rmsnorm_rope(const bf16* h, const bf16* w_qkv, const float* r, const int32_t* pos,
                       const RopeTableDevice& freq, bf16* qkv, int m, int n, int k,
                       cudaStream_t stream) {
  const char* op = "coda::ops::gemm_rmsnorm_rope";
  check_gemm_sizes(op, m, n, k);
  check_device_pointers(op, {{"h", h},
                             {"w_qkv", w_qkv},
                             {"r", r},
                             {"pos", pos},
                             {"freq.hi", freq.hi},
                             {"freq.lo", freq.lo},
                             {"qkv", qkv}});
  CODA_CHECK(freq.columns == n, op, ": freq table has ", freq.columns, " columns, expected N=", n);
  kernel::RmsnormRopeArgs args{r, pos, freq.hi, freq.lo};
  launch(op, Program::kRmsnormRope, m, n, k, {m, n, k, h, k, w_qkv, k, nullptr, 0, qkv, n}, &args,
         stream);
}

epilogue::PartialLayout rmsnorm_backward_partials_layout(int m, int hidden, int n_out) {
  check_gemm_sizes("coda::ops::rmsnorm_backward_partials_layout", m, hidden, n_out);
  return partial_layout(Program::kRmsnormBackward, m, hidden, n_out, Operands::kXW);
}

void gemm_rmsnorm_backward(const bf16* dz, const bf16* w, const bf16* x, const float* r,
                           const bf16* gamma, const float* zdz, const bf16* dres, bf16* dx,
                           bf16* h_out, float* dgamma_partials, int m, int hidden, int n_out,
                           cudaStream_t stream) {
  const char* op = "coda::ops::gemm_rmsnorm_backward";
  check_gemm_sizes(op, m, hidden, n_out);
  check_device_pointers(op, {{"dz", dz},
                             {"w", w},
                             {"x", x},
                             {"r", r},
                             {"gamma", gamma},
                             {"zdz", zdz},
                             {"dres", dres},
                             {"dx", dx},
                             {"h_out", h_out},
                             {"dgamma_partials", dgamma_partials}});
  CODA_CHECK(static_cast<const void*>(h_out) != dx && static_cast<const void*>(h_out) != dres &&
                 static_cast<const void*>(h_out) != x,
             op, ": h_out must not alias dx, dres or x");
  kernel::RmsnormBackwardArgs args{x, hidden, r, gamma, zdz, h_out, hidden, dgamma_partials};
  launch(op, Program::kRmsnormBackward, m, hidden, n_out,
         {m, hidden, n_out, dz, n_out, w, hidden, dres, hidden, dx, hidden}, &args, stream,
         Operands::kXW);
}

void gemm_xw(const bf16* x, const bf16* w, bf16* d, int m, int n, int k, cudaStream_t stream) {
  const char* op = "coda::ops::gemm_xw";
  check_gemm_sizes(op, m, n, k);
  check_device_pointers(op, {{"x", x}, {"w", w}, {"d", d}});
  kernel::PlainArgs args;
  launch(op, Program::kPlain, m, n, k, {m, n, k, x, k, w, n, nullptr, 0, d, n}, &args, stream,
         Operands::kXW);
}

void gemm_xty(const bf16* x, const bf16* y, bf16* d, int m, int n, int k, cudaStream_t stream) {
  const char* op = "coda::ops::gemm_xty";
  CODA_CHECK(m > 0 && n > 0 && k > 0, op, ": sizes must be positive, got M=", m, " N=", n,
             " K=", k);
  CODA_CHECK(m % 8 == 0 && n % 8 == 0, op,
             ": M and N must be multiples of 8 (16-byte rows of X and Y), got M=", m, " N=", n);
  check_device_pointers(op, {{"x", x}, {"y", y}, {"d", d}});
  kernel::PlainArgs args;
  launch(op, Program::kPlain, m, n, k, {m, n, k, x, m, y, n, nullptr, 0, d, n}, &args, stream,
         Operands::kXtY);
}

epilogue::PartialLayout swiglu_backward_partials_layout(int m, int intermediate, int hidden) {
  check_gemm_sizes("coda::ops::swiglu_backward_partials_layout", m, intermediate, hidden);
  return partial_layout(Program::kSwigluBackward, m, intermediate, hidden, Operands::kXW);
}

void gemm_swiglu_backward(const bf16* dx_out, const bf16* w_down, const bf16* z, bf16* dz, bf16* a,
                          float* zdz_partials, int m, int intermediate, int hidden,
                          cudaStream_t stream) {
  const char* op = "coda::ops::gemm_swiglu_backward";
  check_gemm_sizes(op, m, intermediate, hidden);
  check_device_pointers(op, {{"dx_out", dx_out},
                             {"w_down", w_down},
                             {"z", z},
                             {"dz", dz},
                             {"a", a},
                             {"zdz_partials", zdz_partials}});
  // (g, u) bf16 pairs travel as one 32-bit element each.
  kernel::SwigluBackwardArgs args{reinterpret_cast<const uint32_t*>(z), intermediate,
                                  reinterpret_cast<uint32_t*>(dz), intermediate, zdz_partials};
  launch(
      op, Program::kSwigluBackward, m, intermediate, hidden,
      {m, intermediate, hidden, dx_out, hidden, w_down, intermediate, nullptr, 0, a, intermediate},
      &args, stream, Operands::kXW);
}

void rope_backward(const bf16* qkv, const bf16* dqkv, const int32_t* pos,
                   const RopeTableDevice& freq, int m, int width, int hidden, bf16* dqkv_pre,
                   float* zdz, cudaStream_t stream) {
  const char* op = "coda::ops::rope_backward";
  CODA_CHECK(m > 0 && width > 0 && width % 8 == 0 && hidden > 0, op,
             ": need M > 0, width a positive multiple of 8 and hidden > 0, got M=", m,
             " width=", width, " hidden=", hidden);
  CODA_CHECK(freq.columns == width, op, ": freq table has ", freq.columns,
             " columns, expected width=", width);
  check_device_pointers(op, {{"qkv", qkv},
                             {"dqkv", dqkv},
                             {"pos", pos},
                             {"freq.hi", freq.hi},
                             {"freq.lo", freq.lo},
                             {"dqkv_pre", dqkv_pre},
                             {"zdz", zdz}});
  kernel::rope_backward(qkv, dqkv, pos, freq.hi, freq.lo, m, width, hidden, dqkv_pre, zdz, stream);
}

void zdz_fold(const float* partials, const epilogue::PartialLayout& layout, int hidden, float* zdz,
              cudaStream_t stream) {
  const char* op = "coda::ops::zdz_fold";
  check_device_pointers(op, {{"partials", partials}, {"zdz", zdz}});
  CODA_CHECK(hidden > 0, op, ": hidden must be positive, got ", hidden);
  kernel::fold_row_sums(partials, layout.logical, layout.extent, layout.tiles, 1.0f / float(hidden),
                        zdz, stream);
}

void dgamma_fold(const float* partials, const epilogue::PartialLayout& layout, float* dgamma,
                 cudaStream_t stream) {
  const char* op = "coda::ops::dgamma_fold";
  check_device_pointers(op, {{"partials", partials}, {"dgamma", dgamma}});
  kernel::fold_column_sums(partials, layout.logical, layout.extent, layout.tiles, dgamma, stream);
}

epilogue::PartialLayout lm_head_partials_layout(int m, int vocab, int hidden) {
  check_gemm_sizes("coda::ops::lm_head_partials_layout", m, vocab, hidden);
  return partial_layout(Program::kRmsnormLse, m, vocab, hidden);
}

namespace {
// F4, with (kRmsnormLseLogits) or without (kRmsnormLse) the logits stored.
void rmsnorm_lse_program(const char* op, Program p, const bf16* h, const bf16* w_vocab,
                         const float* r, const int64_t* targets, float* max_partials,
                         float* sum_partials, float* target_logit, bf16* logits, int ld_logits,
                         int m, int vocab, int hidden, cudaStream_t stream) {
  check_gemm_sizes(op, m, vocab, hidden);
  check_device_pointers(op, {{"h", h},
                             {"w_vocab", w_vocab},
                             {"r", r},
                             {"targets", targets},
                             {"max_partials", max_partials},
                             {"sum_partials", sum_partials},
                             {"target_logit", target_logit}});
  if (p == Program::kRmsnormLseLogits) {
    check_device_pointers(op, {{"logits", logits}});
    check_logits_stride(op, vocab, ld_logits);
  }
  kernel::RmsnormLseArgs args{r, targets, max_partials, sum_partials, target_logit};
  launch(op, p, m, vocab, hidden,
         {m, vocab, hidden, h, hidden, w_vocab, hidden, nullptr, 0, logits, ld_logits}, &args,
         stream);
}
}  // namespace

void gemm_rmsnorm_lse(const bf16* h, const bf16* w_vocab, const float* r, const int64_t* targets,
                      float* max_partials, float* sum_partials, float* target_logit, int m,
                      int vocab, int hidden, cudaStream_t stream) {
  rmsnorm_lse_program("coda::ops::gemm_rmsnorm_lse", Program::kRmsnormLse, h, w_vocab, r, targets,
                      max_partials, sum_partials, target_logit, nullptr, vocab, m, vocab, hidden,
                      stream);
}

epilogue::PartialLayout lm_head_logits_partials_layout(int m, int vocab, int hidden) {
  check_gemm_sizes("coda::ops::lm_head_logits_partials_layout", m, vocab, hidden);
  return partial_layout(Program::kRmsnormLseLogits, m, vocab, hidden);
}

void gemm_rmsnorm_lse_logits(const bf16* h, const bf16* w_vocab, const float* r,
                             const int64_t* targets, float* max_partials, float* sum_partials,
                             float* target_logit, bf16* logits, int ld_logits, int m, int vocab,
                             int hidden, cudaStream_t stream) {
  rmsnorm_lse_program("coda::ops::gemm_rmsnorm_lse_logits", Program::kRmsnormLseLogits, h,
                      w_vocab, r, targets, max_partials, sum_partials, target_logit, logits,
                      ld_logits, m, vocab, hidden, stream);
}

void cross_entropy_backward_from_logits(bf16* logits, int ld_logits, const float* lse,
                                        const float* scale, const int64_t* targets,
                                        const float* target_logit, float z_loss, float* zdz,
                                        int m, int vocab, int hidden, cudaStream_t stream) {
  const char* op = "coda::ops::cross_entropy_backward_from_logits";
  check_gemm_sizes(op, m, vocab, hidden);
  check_device_pointers(op, {{"logits", logits},
                             {"lse", lse},
                             {"scale", scale},
                             {"targets", targets},
                             {"target_logit", target_logit},
                             {"zdz", zdz}});
  check_logits_stride(op, vocab, ld_logits);
  kernel::cross_entropy_grad_from_logits(logits, ld_logits, m, vocab, lse, scale, targets,
                                         target_logit, z_loss, hidden, zdz, stream);
}

void cross_entropy_from_unscaled_logits(bf16* logits, int ld_logits, const bf16* h,
                                        const bf16* w_vocab, const float* r,
                                        const int64_t* targets, int64_t ignore_index,
                                        float z_loss, const float* scale, float* lse,
                                        float* token_loss, float* zdz, int m, int vocab,
                                        int hidden, cudaStream_t stream) {
  const char* op = "coda::ops::cross_entropy_from_unscaled_logits";
  check_gemm_sizes(op, m, vocab, hidden);
  check_device_pointers(op, {{"logits", logits},
                             {"h", h},
                             {"w_vocab", w_vocab},
                             {"r", r},
                             {"targets", targets},
                             {"scale", scale},
                             {"lse", lse},
                             {"token_loss", token_loss},
                             {"zdz", zdz}});
  check_logits_stride(op, vocab, ld_logits);
  kernel::cross_entropy_from_unscaled_logits(logits, ld_logits, m, vocab, h, w_vocab, hidden, r,
                                             targets, ignore_index, z_loss, scale, lse, token_loss,
                                             zdz, stream);
}

void lse_loss_fold(const float* max_partials, const float* sum_partials,
                   const epilogue::PartialLayout& layout, const float* target_logit,
                   const int64_t* targets, int vocab, int64_t ignore_index, float z_loss,
                   float* lse, float* token_loss, cudaStream_t stream) {
  const char* op = "coda::ops::lse_loss_fold";
  check_device_pointers(op, {{"max_partials", max_partials},
                             {"sum_partials", sum_partials},
                             {"target_logit", target_logit},
                             {"targets", targets},
                             {"lse", lse},
                             {"token_loss", token_loss}});
  CODA_CHECK(vocab > 0, op, ": vocab must be positive, got ", vocab);
  kernel::fold_lse_loss(max_partials, sum_partials, layout.logical, layout.extent, layout.tiles,
                        target_logit, targets, vocab, ignore_index, z_loss, lse, token_loss,
                        stream);
}

epilogue::PartialLayout cross_entropy_backward_partials_layout(int m, int vocab, int hidden) {
  check_gemm_sizes("coda::ops::cross_entropy_backward_partials_layout", m, vocab, hidden);
  return partial_layout(Program::kRmsnormCrossEntropyBackward, m, vocab, hidden);
}

void gemm_rmsnorm_cross_entropy_backward(const bf16* h, const bf16* w_vocab, const float* r,
                                         const float* lse, const float* scale,
                                         const int64_t* targets, float z_loss, bf16* dlogits,
                                         float* zdz_partials, int m, int vocab, int hidden,
                                         cudaStream_t stream) {
  const char* op = "coda::ops::gemm_rmsnorm_cross_entropy_backward";
  check_gemm_sizes(op, m, vocab, hidden);
  check_device_pointers(op, {{"h", h},
                             {"w_vocab", w_vocab},
                             {"r", r},
                             {"lse", lse},
                             {"scale", scale},
                             {"targets", targets},
                             {"dlogits", dlogits},
                             {"zdz_partials", zdz_partials}});
  kernel::RmsnormCrossEntropyBackwardArgs args{r, lse, scale, targets, zdz_partials, z_loss};
  launch(op, Program::kRmsnormCrossEntropyBackward, m, vocab, hidden,
         {m, vocab, hidden, h, hidden, w_vocab, hidden, nullptr, 0, dlogits, vocab}, &args,
         stream);
}

}  // namespace coda::ops
