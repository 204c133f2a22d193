#pragma once
// Argument checks shared by the CPU and CUDA kernels of the coda ops. Every failure names the op,
// the argument and the expected vs actual value (shape, dtype, device, layout).

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <initializer_list>
#include <stdexcept>
#include <sstream>
#include <string>

#include "coda/programs/forward.hpp"

namespace coda::torch_ext {

inline std::string shape_string(c10::IntArrayRef s) {
  std::ostringstream o;
  o << '(';
  for (size_t i = 0; i < s.size(); ++i) o << (i ? ", " : "") << s[i];
  o << (s.size() == 1 ? ",)" : ")");
  return o.str();
}

// What every tensor argument of one op call is checked against.
struct OpContext {
  const char* op;
  c10::Device device;
  at::ScalarType act;  // activation / weight dtype
  at::ScalarType stat;  // r, lse, loss: float64 when act is float64, else float32

  // The device and activation dtype come from the op's first activation argument.
  static OpContext from(const char* op, const char* name, const at::Tensor& t) {
    TORCH_CHECK(t.defined(), op, ": ", name, " is undefined");
    const auto act = t.scalar_type();
    if (t.is_cuda()) {
      TORCH_CHECK(act == at::kBFloat16, op, ": ", name,
                  " must be bfloat16 on CUDA (the Hopper programs are instantiated for bf16), got ",
                  act);
    } else if (t.is_cpu()) {
      TORCH_CHECK(act == at::kFloat || act == at::kDouble, op, ": ", name,
                  " must be float32 or float64 on the CPU (reference executor), got ", act);
    } else {
      TORCH_CHECK(t.is_meta(), op, ": ", name, " is on ", t.device(),
                  "; coda ops run on CPU or CUDA");
    }
    return {op, t.device(), act, act == at::kDouble ? at::kDouble : at::kFloat};
  }

  void same_device(const char* name, const at::Tensor& t) const {
    TORCH_CHECK(t.defined(), op, ": ", name, " is undefined");
    TORCH_CHECK(t.device() == device, op, ": ", name, " is on ", t.device(),
                " but the op runs on ", device);
  }
  void dtype(const char* name, const at::Tensor& t, at::ScalarType want) const {
    TORCH_CHECK(t.scalar_type() == want, op, ": ", name, " must be ", want, ", got ",
                t.scalar_type());
  }
  void shape(const char* name, const at::Tensor& t, std::initializer_list<int64_t> want) const {
    TORCH_CHECK(t.sizes() == c10::IntArrayRef(want), op, ": ", name, " must have shape ",
                shape_string(want), ", got ", shape_string(t.sizes()));
  }
  void contiguous(const char* name, const at::Tensor& t) const {
    TORCH_CHECK(t.is_contiguous(), op, ": ", name,
                " must be contiguous (row-major), got strides ", shape_string(t.strides()),
                " for shape ", shape_string(t.sizes()));
    if (t.is_cuda())
      TORCH_CHECK(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0, op, ": ", name,
                  " must be 16-byte aligned (TMA), got address ", t.data_ptr());
  }
  // Device, dtype, contiguity and exact shape in one call.
  void tensor(const char* name, const at::Tensor& t, at::ScalarType want,
              std::initializer_list<int64_t> want_shape) const {
    same_device(name, t);
    dtype(name, t, want);
    shape(name, t, want_shape);
    contiguous(name, t);
  }
  void activation(const char* name, const at::Tensor& t,
                  std::initializer_list<int64_t> want_shape) const {
    tensor(name, t, act, want_shape);
  }
  void statistic(const char* name, const at::Tensor& t,
                 std::initializer_list<int64_t> want_shape) const {
    tensor(name, t, stat, want_shape);
  }
  // An incoming gradient that only feeds PyTorch ops: any strides, any alignment.
  void upstream(const char* name, const at::Tensor& t,
                std::initializer_list<int64_t> want_shape) const {
    same_device(name, t);
    dtype(name, t, stat);
    shape(name, t, want_shape);
  }
  // A 2-D activation whose sizes are read from it (the op's "M" and width).
  void matrix(const char* name, const at::Tensor& t) const {
    same_device(name, t);
    dtype(name, t, act);
    TORCH_CHECK(t.dim() == 2, op, ": ", name, " must be 2-D (tokens, features), got shape ",
                shape_string(t.sizes()));
    TORCH_CHECK(t.size(0) > 0 && t.size(1) > 0, op, ": ", name, " must be non-empty, got shape ",
                shape_string(t.sizes()));
    contiguous(name, t);
  }
  // CUDA programs need 16-byte rows: widths that are multiples of 8 bf16 elements.
  void cuda_width(const char* what, int64_t width, int64_t multiple = 8) const {
    if (device.is_cuda())
      TORCH_CHECK(width % multiple == 0, op, ": ", what, " = ", width,
                  " must be a multiple of ", multiple, " on CUDA (16-byte rows for TMA)");
  }
};

inline at::TensorOptions stat_options(const OpContext& c) {
  return at::TensorOptions().dtype(c.stat).device(c.device);
}

// Positions are read on the host on the CPU (the CUDA kernels cannot check them without a sync).
inline void check_positions(const OpContext& c, const at::Tensor& pos) {
  if (!pos.is_cpu() || pos.numel() == 0) return;
  const int32_t lowest = pos.min().item<int32_t>();
  TORCH_CHECK(lowest >= 0, c.op, ": pos must be >= 0, got min ", lowest);
}

inline void check_eps(const char* op, double eps) {
  TORCH_CHECK(eps >= 0.0, op, ": eps must be >= 0, got ", eps);
}

// Errors from the framework-free layers (coda::Error, a std::invalid_argument) become the same
// RuntimeError as every other argument check, prefixed with the op's name.
template <class Fn>
struct Guarded;
template <class R, class... A>
struct Guarded<R (*)(A...)> {
  template <R (*F)(A...), const char* Name>
  static R call(A... a) {
    try {
      return F(a...);
    } catch (const std::invalid_argument& e) {
      TORCH_CHECK(false, Name, ": ", e.what());
    }
  }
};
#define CODA_GUARDED(name, fn) (&::coda::torch_ext::Guarded<decltype(&fn)>::template call<&fn, name>)

// The ops with CPU and CUDA kernels, in one list: each kernel file defines a function per op with
// the op's name, and registers them all with CODA_REGISTER_KERNELS(m) (guarded: see above).
#define CODA_KERNEL_OPS(X)                                                                         \
  X(rmsnorm_stats)                                                                                 \
  X(norm_qkv) X(out_proj_residual_norm) X(mlp) X(mlp_partial) X(lm_head_loss) X(lm_head_loss_grad) \
      X(norm_qkv_backward) X(linear_backward) X(mlp_backward) X(lm_head_loss_backward)             \
          X(norm_qkv_qk_norm) X(norm_qkv_qk_norm_backward)
namespace op_names {
#define CODA_OP_NAME(op) inline constexpr char op[] = "coda::" #op;
CODA_KERNEL_OPS(CODA_OP_NAME)
#undef CODA_OP_NAME
}  // namespace op_names
#define CODA_REGISTER_KERNEL(op) m.impl(#op, CODA_GUARDED(::coda::torch_ext::op_names::op, op));
#define CODA_REGISTER_KERNELS(m) CODA_KERNEL_OPS(CODA_REGISTER_KERNEL)

using LossReduction = programs::Reduction;

inline LossReduction parse_reduction(const char* op, c10::string_view s) {
  if (s == "mean") return LossReduction::kMean;
  if (s == "sum") return LossReduction::kSum;
  if (s == "none") return LossReduction::kNone;
  TORCH_CHECK(false, op, ": reduction must be 'mean', 'sum' or 'none', got '", std::string(s),
              "'");
}

}  // namespace coda::torch_ext
