#pragma once
// The backends the PyTorch op kernels run the block compositions on (block/compose.hpp):
//   TorchTensors    allocation, views and the loss's per-token bookkeeping on at::Tensor, and
//                   the FP8 programs of block/compose_fp8.hpp (torch/fp8_ops.hpp), for both
//                   devices (on the tensors' device; no host sync);
//   CpuBackend<R>   + the reference executor's programs (reference/host_backend.hpp) in R;
//   CudaBackend     + the Hopper programs of include/coda/ops.hpp (torch/backend_cuda.hpp).

#include <ATen/ATen.h>

#include "coda/block/compose.hpp"
#include "coda/block/compose_fp8.hpp"
#include "coda/reference/host_backend.hpp"
#include "fp8_ops.hpp"

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
  // ---- the FP8 programs (block/compose_fp8.hpp), through torch/fp8_ops.hpp ----------------
  using Fp8 = block::Fp8Tensors<Tensor>;
  static Fp8 fp8_of(const fp8::Quantized& q) {
    return {std::get<0>(q), std::get<1>(q), std::get<2>(q), std::get<3>(q)};
  }
  static Fp8 fp8_cast(const Tensor& x, bool rows, bool transposed) {
    return fp8_of(fp8::quantize_rows(x.contiguous(), rows, transposed));
  }
  Tensor fp8_gemm(const Fp8& a, const Tensor& w_codes, const Tensor& w_scales) const {
    return fp8::gemm(a.codes, a.scales, w_codes, w_scales).to(act_dtype());
  }
  Tensor fp8_wgrad(const Fp8& dz, const Fp8& h) const {
    return fp8::gemm_xyt(dz.codes_t, dz.scales_t, h.codes_t, h.scales_t).to(act_dtype());
  }
  std::tuple<Tensor, Fp8, Tensor> fp8_residual_rmsnorm(const Fp8& a, const Fp8& w,
                                                       const Tensor& residual,
                                                       const Tensor& gamma) const {
    auto [x, c, s, ct, st, p] =
        fp8::residual_rmsnorm(a.codes, a.scales, w.codes, w.scales, residual, gamma, true, false);
    return {x, Fp8{c, s, ct, st}, p};
  }
  std::tuple<Tensor, Tensor, Tensor> fp8_residual_rmsnorm_act_h(const Fp8& a, const Fp8& w,
                                                                const Tensor& residual,
                                                                const Tensor& gamma) const {
    return fp8::residual_rmsnorm_act_h(a.codes, a.scales, w.codes, w.scales, residual, gamma);
  }
  // z, its scales (z in FP8, with fp8_z; else undefined) and a.
  std::tuple<Tensor, Tensor, Fp8> fp8_rmsnorm_swiglu(const Fp8& h, const Fp8& w, const Tensor& r,
                                                     bool copy, bool fp8_z) const {
    if (fp8_z) {
      auto [z, zs, c, s, ct, st] = fp8::rmsnorm_swiglu_fp8_z(h.codes, h.scales, w.codes, w.scales,
                                                             r, true, copy, act_dtype());
      return {z, zs, Fp8{c, s, ct, st}};
    }
    auto [z, c, s, ct, st] =
        fp8::rmsnorm_swiglu(h.codes, h.scales, w.codes, w.scales, r, true, copy, act_dtype());
    return {z, Tensor(), Fp8{c, s, ct, st}};
  }
  Tensor fp8_rmsnorm_rope(const Fp8& h, const Fp8& w, const Tensor& r, const Tensor& bias,
                          const Tensor& pos, const Tensor& rope_table) const {
    return fp8::rmsnorm_rope(h.codes, h.scales, w.codes, w.scales, r, bias, pos, rope_table,
                             act_dtype());
  }
  std::tuple<Tensor, Tensor> fp8_rmsnorm_qk_norm_rope(const Fp8& h, const Fp8& w, const Tensor& r,
                                                      const Tensor& q_gamma, const Tensor& k_gamma,
                                                      const programs::QkNorm& qk, const Tensor& pos,
                                                      const Tensor& rope_table) const {
    return fp8::rmsnorm_qk_norm_rope(h.codes, h.scales, w.codes, w.scales, r, q_gamma, k_gamma, qk,
                                     pos, rope_table, act_dtype());
  }
  // B1 from dz's rows and Wᵀ's codes (w.codes_t): dx, h_out's copy (codes_t, scales_t), the dγ
  // partials.
  static std::tuple<Tensor, Fp8, Tensor> fp8_rmsnorm_backward(const Fp8& dz, const Fp8& w,
                                                              const Tensor& x, const Tensor& r,
                                                              const Tensor& gamma,
                                                              const Tensor& zdz,
                                                              const Tensor& dres) {
    auto [dx, ht, hts, p] =
        fp8::rmsnorm_backward(dz.codes, dz.scales, w.codes_t, w.scales_t, x, r, gamma, zdz, dres);
    return {dx, Fp8{{}, {}, ht, hts}, p};
  }
  // a = silu(g)·u of z (z_scales defined: z in FP8), rounded, as its transposed copy (a not kept
  // by the forward).
  Fp8 fp8_swiglu_copy(const Tensor& z, const Tensor& z_scales) const {
    auto [ct, st] = fp8::swiglu_quantize_t(z, z_scales, act_dtype());
    return Fp8{{}, {}, ct, st};
  }
  // B2 from dx_out's rows and W_downᵀ's codes (w_down.codes_t): dz (both copies), ZdZ partials.
  std::tuple<Fp8, Tensor> fp8_swiglu_backward(const Fp8& dx_out, const Fp8& w_down, const Tensor& z,
                                              const Tensor& z_scales) const {
    auto [c, s, ct, st, p] =
        fp8::swiglu_backward(dx_out.codes, dx_out.scales, w_down.codes_t, w_down.scales_t, z,
                             z_scales, true, true, act_dtype());
    return {Fp8{c, s, ct, st}, p};
  }
  at::ScalarType act_dtype() const { return c10::typeMetaToScalarType(act_.dtype()); }

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
