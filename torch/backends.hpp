#pragma once
// The backends the PyTorch op kernels run the block compositions on (block/compose.hpp):
//   TorchTensors    allocation, views and the loss's per-token bookkeeping on at::Tensor, for
//                   both devices (torch ops on the tensors' device; no host sync);
//   CpuBackend<R>   + the reference executor's programs (reference/host_backend.hpp) in R;
//   CudaBackend     + the Hopper programs of include/coda/ops.hpp (torch/backend_cuda.hpp).

#include <ATen/ATen.h>

#include "coda/block/compose.hpp"
#include "coda/reference/host_backend.hpp"

namespace coda::torch_ext {

class TorchTensors {
 public:
  using Tensor = at::Tensor;

  // act: the activations' dtype; stat: fp32 reductions (float64 with float64 activations).
  TorchTensors(c10::Device device, at::ScalarType act, at::ScalarType stat)
      : act_(at::TensorOptions().device(device).dtype(act)),
        stat_(at::TensorOptions().device(device).dtype(stat)) {}

  static int64_t rows(const Tensor& t) { return t.size(0); }
  static int64_t cols(const Tensor& t) { return t.dim() == 2 ? t.size(1) : 1; }
  static bool present(const Tensor& t) { return t.defined(); }  // an optional argument
  Tensor act(int64_t rows, int64_t cols) const { return at::empty({rows, cols}, act_); }
  Tensor zeros_act(int64_t rows, int64_t cols) const { return at::zeros({rows, cols}, act_); }
  Tensor stat(int64_t n) const { return at::empty({n}, stat_); }
  Tensor zeros_stat(int64_t n) const { return at::zeros({n}, stat_); }
  Tensor zeros_stat(int64_t rows, int64_t cols) const { return at::zeros({rows, cols}, stat_); }
  int64_t act_bytes() const { return c10::elementSize(c10::typeMetaToScalarType(act_.dtype())); }
  static Tensor rows_of(const Tensor& t, int64_t first, int64_t count) {
    return t.narrow(0, first, count);
  }
  static Tensor leading(const Tensor& t, int64_t rows, int64_t cols) {
    return t.view({-1}).narrow(0, 0, rows * cols).view({rows, cols});
  }
  static void add_(Tensor& acc, const Tensor& v) { acc.add_(v); }
  static void copy_(Tensor& dst, const Tensor& src) { dst.copy_(src); }
  static void zero_(Tensor& t) { t.zero_(); }
  static Tensor param_like(const Tensor& t, const Tensor& like) { return t.to(like.scalar_type()); }
  static Tensor targets_minus(const Tensor& targets, int64_t v0) {
    return v0 == 0 ? targets : targets - v0;
  }
  // d loss / d token loss per token: dloss (null: 1; one value, or one per token for 'none'),
  // divided by the counted tokens for 'mean', 0 for ignored tokens.
  Tensor token_scale(const Tensor* dloss, const Tensor& targets, const block::LossOptions& o,
                     int64_t m) const {
    const Tensor counted = targets.ne(o.ce.ignore_index);
    const Tensor g = dloss ? dloss->to(stat_.dtype()) : at::ones({}, stat_);
    Tensor scale = o.ce.reduction == programs::Reduction::kNone ? g.contiguous() : g.expand({m});
    if (o.ce.reduction == programs::Reduction::kMean)
      scale = scale / counted.sum().to(stat_.dtype());
    return at::where(counted, scale, at::zeros({}, stat_)).contiguous();
  }
  // The loss from per-token losses (0 where ignored): as is ('none'), summed, or the mean over
  // counted tokens: 0 / 0 = NaN when every token is ignored (as PyTorch).
  Tensor reduce_loss(const Tensor& token_loss, const Tensor& targets,
                     const block::LossOptions& o) const {
    if (o.ce.reduction == programs::Reduction::kNone) return token_loss;
    const Tensor total = token_loss.sum();
    if (o.ce.reduction == programs::Reduction::kSum) return total;
    return total / targets.ne(o.ce.ignore_index).sum().to(stat_.dtype());
  }

 private:
  at::TensorOptions act_, stat_;
};

// The reference executor's programs in R (float or double) on CPU tensors.
template <class R>
class CpuBackend : public TorchTensors, public reference::HostPrograms<CpuBackend<R>, R> {
 public:
  explicit CpuBackend(c10::Device device)
      : TorchTensors(device, c10::CppTypeToScalarType<R>::value,
                     c10::CppTypeToScalarType<R>::value) {}
  template <class E>
  static reference::View<E> view(const at::Tensor& t) {
    if (!t.defined()) return {nullptr, 0, 1, 1};  // an optional argument left out
    return {t.data_ptr<E>(), t.size(0), t.dim() == 2 ? t.size(1) : 1,
            t.dim() == 2 ? t.stride(0) : 1};
  }
};

}  // namespace coda::torch_ext
