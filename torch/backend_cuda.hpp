#pragma once
// The CUDA backend of the block compositions: the Hopper programs of include/coda/ops.hpp on
// PyTorch's current stream, buffers from PyTorch's caching allocator. Nothing here waits on the
// device (no .item(), no host copies), so the ops capture into CUDA graphs.

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "backends.hpp"
#include "coda/ops.hpp"

namespace coda::torch_ext {

class CudaBackend : public TorchTensors {
 public:
  explicit CudaBackend(c10::Device device)
      : TorchTensors(device, at::kBFloat16, at::kFloat),
        guard_(device),
        stream_(c10::cuda::getCurrentCUDAStream(device.index()).stream()) {}

  // The op layer's view of a CUDA tensor (2-D, or 1-D as a vector).
  static TensorView view(const at::Tensor& t) {
    if (!t.defined()) return {};  // an optional argument left out: a null view
    const auto st = t.scalar_type();
    const DType d = st == at::kBFloat16          ? DType::kBF16
                    : st == at::kFloat           ? DType::kF32
                    : st == at::kInt             ? DType::kI32
                    : st == at::kFloat8_e4m3fn   ? DType::kE4M3
                                                 : DType::kI64;
    TORCH_CHECK(st == at::kBFloat16 || st == at::kFloat || st == at::kInt || st == at::kLong ||
                    st == at::kFloat8_e4m3fn,
                "coda: no kernel takes ", st, " tensors");
    const int device = t.device().index();
    if (t.dim() == 1) {
      TORCH_CHECK(t.size(0) <= 1 || t.stride(0) == 1, "coda: expected a dense vector, got size ",
                  t.size(0), " stride ", t.stride(0));
      return TensorView::vector(t.data_ptr(), d, t.size(0), device);
    }
    TORCH_CHECK(t.dim() == 2 && (t.size(1) <= 1 || t.stride(1) == 1),
                "coda: expected a row-major matrix, got sizes ", t.sizes(), " strides ",
                t.strides());
    // A single row's stride is arbitrary in PyTorch: the kernels read it as a dense row, unless
    // its stride is one they can take (a row of a padded buffer, act below).
    const bool usable = t.stride(0) >= t.size(1) && (t.stride(0) * t.element_size()) % 16 == 0;
    const int64_t ld = t.size(0) == 1 && !usable ? t.size(1) : t.stride(0);
    return TensorView::matrix(t.data_ptr(), d, t.size(0), t.size(1), ld, device);
  }

  // Activations whose rows are not 16 bytes (the logits' scratch of a vocabulary of any size):
  // rows padded to a multiple of 8 elements, the TMA's row stride; the view is (rows, cols).
  static int64_t padded_ld(int64_t cols) { return (cols + 7) / 8 * 8; }
  Tensor act(int64_t rows, int64_t cols) const {
    return TorchTensors::act(rows, padded_ld(cols)).narrow(1, 0, cols);
  }
  // (rows, cols) at the start of `t`'s memory, rows padded as act's.
  static Tensor leading(const Tensor& t, int64_t rows, int64_t cols) {
    const int64_t ld = padded_ld(cols);
    TORCH_CHECK(rows * ld <= t.size(0) * t.stride(0), "coda: leading (", rows, ", ", cols,
                ") exceeds a buffer of ", t.size(0), " rows of ", t.stride(0));
    return t.as_strided({rows, cols}, {ld, 1}, t.storage_offset());
  }

  Tensor partials(block::PartialsOf of, int64_t m, int64_t n, int64_t k) const {
    using block::PartialsOf;
    const epilogue::PartialLayout l =
        of == PartialsOf::kResidualRmsnorm   ? ops::residual_rmsnorm_partials_layout(m, n, k)
        : of == PartialsOf::kRmsnormBackward ? ops::rmsnorm_backward_partials_layout(m, n, k)
        : of == PartialsOf::kSwigluBackward  ? ops::swiglu_backward_partials_layout(m, n, k)
        : of == PartialsOf::kLmHead          ? ops::lm_head_partials_layout(m, n, k)
        : of == PartialsOf::kLmHeadLogits    ? ops::lm_head_logits_partials_layout(m, n, k)
                                             : ops::cross_entropy_backward_partials_layout(m, n, k);
    return stat(l.tiles * l.extent).view({l.tiles, l.extent});
  }

  // The programs and folds the compositions call: each method forwards its arguments to the
  // ops.hpp function of the same name, each tensor as its view, on the current stream.
#define CODA_CUDA_PROGRAMS(X)                                                                    \
  X(gemm) X(gemm_xw) X(first_layer_rmsnorm) X(gemm_residual_rmsnorm_partial) X(rmsnorm_fold)    \
      X(gemm_rmsnorm_swiglu) X(gemm_rmsnorm_rope) X(gemm_rmsnorm_lse) X(gemm_rmsnorm_lse_logits) \
          X(lse_loss_fold) X(cross_entropy_backward_from_logits)                               \
              X(cross_entropy_from_unscaled_logits) X(gemm_rmsnorm_backward) X(dgamma_fold)    \
                  X(gemm_swiglu_backward) X(zdz_fold) X(rope_backward)                         \
                      X(gemm_rmsnorm_cross_entropy_backward)
#define CODA_FORWARD_TO_OPS(name) \
  void name(const auto&... a) const { run(ops::name, a...); }
  CODA_CUDA_PROGRAMS(CODA_FORWARD_TO_OPS)
#undef CODA_FORWARD_TO_OPS
#undef CODA_CUDA_PROGRAMS
  // dW (+)= dzᵀ · h: our Xᵀ·Y mainloop, or cuBLAS with β = 1 to accumulate (bf16 dW, fp32
  // accumulation inside one call).
  void weight_grad(const Tensor& dz, const Tensor& h, Tensor& dw, bool accumulate) const {
    if (accumulate)
      dw.addmm_(dz.t(), h);
    else
      ops::gemm_xty(view(dz), view(h), view(dw), stream_);
  }
  void gemm_rmsnorm_qk_norm_rope(const Tensor& h, const Tensor& w_qkv, const Tensor& r,
                                 const Tensor& q_gamma, const Tensor& k_gamma,
                                 const programs::QkNorm& qk, const Tensor& pos,
                                 const Tensor& rope_table, Tensor& qkv, Tensor& qk_pre) const {
    ops::gemm_rmsnorm_qk_norm_rope(view(h), view(w_qkv), view(r), view(q_gamma), view(k_gamma), qk,
                                   view(pos), view(rope_table), view(qkv), view(qk_pre), stream_);
  }
  // B3q, its dγ partials from the caching allocator.
  void qk_norm_rope_backward(const Tensor& qk_pre, const Tensor& qkv, const Tensor& dqkv,
                             const Tensor& q_gamma, const Tensor& k_gamma,
                             const programs::QkNorm& qk, const Tensor& pos,
                             const Tensor& rope_table, int64_t hidden, Tensor& dpre, Tensor& zdz,
                             Tensor& dq_gamma, Tensor& dk_gamma) const {
    const int64_t d = qk.layout.head_dim, rows = ops::qk_norm_backward_partials_rows(dqkv.size(0));
    const Tensor partials = stat(rows * 2 * d).view({rows, 2 * d});
    ops::qk_norm_rope_backward(view(qk_pre), view(qkv), view(dqkv), view(q_gamma), view(k_gamma),
                               qk, view(pos), view(rope_table), hidden, view(dpre), view(zdz),
                               view(partials), view(dq_gamma), view(dk_gamma), stream_);
  }
  // B3 and the cast of its output in one pass (block/compose_fp8.hpp fp8_norm_qkv_backward,
  // without a bias): dpre's rows and transposed copy, and the ZdZ partials for zdz_fold.
  std::tuple<Fp8, Tensor> fp8_rope_backward(const Tensor& qkv, const Tensor& dqkv,
                                            const Tensor& pos, const Tensor& rope_table) const {
    const int64_t m = qkv.size(0), width = qkv.size(1);
    const auto [c, s, ct, st] = fp8::empty_quantized(qkv, m, width, true, true);
    const epilogue::PartialLayout l = ops::fp8_rope_backward_partials_layout(m, width);
    const Tensor p = stat(l.tiles * l.extent).view({l.tiles, l.extent});
    ops::fp8_rope_backward_quantize(view(qkv), view(dqkv), view(pos), view(rope_table), view(c),
                                    view(s), view(ct), view(st), view(p), stream_);
    return {Fp8{c, s, ct, st}, p};
  }
  // out[n] = Σ_m t[m, n] in fp32 (a bias gradient).
  void column_sum(const Tensor& t, Tensor& out) const {
    at::sum_out(out, t, {0}, false, at::kFloat);
  }
  cudaStream_t stream() const { return stream_; }

 private:
  static TensorView arg(const at::Tensor& t) { return view(t); }
  template <class Scalar>
  static Scalar arg(Scalar s) {
    return s;
  }
  template <class Fn, class... A>
  void run(Fn fn, const A&... a) const {
    fn(arg(a)..., stream_);
  }

  c10::cuda::CUDAGuard guard_;
  cudaStream_t stream_;
};

}  // namespace coda::torch_ext
