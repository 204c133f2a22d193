// The program-level ops: one GEMM-epilogue program or fold each, on either backend
// (torch/backends.hpp), for benchmarks and tests that time or check a program on its own. The
// block ops (block_ops.cpp) compose the same backend calls; these have no autograd and no Meta
// kernels (eager only). Partial buffers travel as fp32 (tiles, extent) tensors: their layout
// follows the kernel configuration of the launch that wrote them.
#include <torch/library.h>

#include <tuple>

#include "checks.hpp"
#include "on_backend.hpp"

namespace coda::torch_ext {
namespace {

using at::Tensor;
using block::PartialsOf;

// Every tensor argument on the op's device, activations in its activation dtype, statistics in
// its statistic dtype, integer operands as int32; all contiguous.
struct ProgramArgs {
  OpContext c;
  // The op's device and dtypes from its first activation argument.
  ProgramArgs(const char* op, const Tensor& first)
      : c(OpContext::from(op, "first argument", first)) {}
  // A fold's: from its partial buffer, a statistic (fp32 on CUDA, the CPU's float dtype).
  static ProgramArgs of_statistic(const char* op, const Tensor& partials) {
    TORCH_CHECK(partials.defined(), op, ": partials is undefined");
    const at::ScalarType want = partials.is_cuda() ? at::kFloat : partials.scalar_type();
    TORCH_CHECK(partials.scalar_type() == want && (want == at::kFloat || want == at::kDouble), op,
                ": partials must be float32 (float64 on the CPU), got ", partials.scalar_type());
    return ProgramArgs(
        OpContext{op, partials.device(), partials.is_cuda() ? at::kBFloat16 : want, want});
  }
  explicit ProgramArgs(OpContext context) : c(context) {}
  const ProgramArgs& act(const char* name, const Tensor& t) const {
    c.same_device(name, t);
    c.dtype(name, t, c.act);
    c.contiguous(name, t);
    return *this;
  }
  const ProgramArgs& stat(const char* name, const Tensor& t) const {
    c.same_device(name, t);
    c.dtype(name, t, c.stat);
    c.contiguous(name, t);
    return *this;
  }
  const ProgramArgs& int32(const char* name, const Tensor& t) const {
    c.same_device(name, t);
    c.dtype(name, t, at::kInt);
    c.contiguous(name, t);
    return *this;
  }
  // An argument whose shape follows from the operands'.
  const ProgramArgs& shape(const char* name, const Tensor& t,
                           std::initializer_list<int64_t> want) const {
    c.shape(name, t, want);
    return *this;
  }
  // 2-D operands whose sizes the programs read: non-empty, and K of `a` equal to `b`'s.
  void operand_pair(const char* a, const Tensor& ta, int da, const char* b, const Tensor& tb,
                    int db) const {
    TORCH_CHECK(ta.dim() == 2 && tb.dim() == 2, c.op, ": ", a, " and ", b, " must be 2-D, got ",
                shape_string(ta.sizes()), " and ", shape_string(tb.sizes()));
    TORCH_CHECK(ta.numel() > 0 && tb.numel() > 0, c.op, ": ", a, " and ", b,
                " must be non-empty, got ", shape_string(ta.sizes()), " and ",
                shape_string(tb.sizes()));
    TORCH_CHECK(ta.size(da) == tb.size(db), c.op, ": ", a, ".size(", da, ") = ", ta.size(da),
                " must equal ", b, ".size(", db, ") = ", tb.size(db));
  }
};

// D = x · wᵀ (transposed: D = x · w), our plain GEMM in the forward or data-gradient layout.
Tensor plain_gemm(const char* op, const Tensor& x, const Tensor& w, bool transposed) {
  ProgramArgs p(op, x);
  p.act("x", x).act("w", w).operand_pair("x", x, 1, "w", w, transposed ? 0 : 1);
  return on_backend(x, [&](auto& b) {
    Tensor d = b.act(x.size(0), w.size(transposed ? 1 : 0));
    if (transposed)
      b.gemm_xw(x, w, d);
    else
      b.gemm(x, w, d);
    return d.contiguous();  // CUDA pads rows of an N not a multiple of 8 (CudaBackend::act)
  });
}
Tensor gemm(const Tensor& x, const Tensor& w) { return plain_gemm("coda::gemm", x, w, false); }
Tensor gemm_xw(const Tensor& x, const Tensor& w) { return plain_gemm("coda::gemm_xw", x, w, true); }

Tensor gemm_xty(const Tensor& x, const Tensor& y) {
  ProgramArgs p("coda::gemm_xty", x);
  p.act("x", x).act("y", y).operand_pair("x", x, 0, "y", y, 0);
  return on_backend(x, [&](auto& b) { return block::weight_grad(b, x, y).contiguous(); });
}

std::tuple<Tensor, Tensor, Tensor> gemm_residual_rmsnorm_partial(const Tensor& a, const Tensor& w,
                                                                 const Tensor& residual,
                                                                 const Tensor& gamma) {
  ProgramArgs p("coda::gemm_residual_rmsnorm_partial", a);
  p.act("a", a).act("w", w).act("residual", residual).act("gamma", gamma);
  p.operand_pair("a", a, 1, "w", w, 1);
  p.shape("residual", residual, {a.size(0), w.size(0)}).shape("gamma", gamma, {w.size(0)});
  return on_backend(a, [&](auto& b) {
    const int64_t m = a.size(0), n = w.size(0);
    Tensor x = b.act(m, n), h = b.act(m, n);
    const Tensor s = b.partials(PartialsOf::kResidualRmsnorm, m, n, a.size(1));
    b.gemm_residual_rmsnorm_partial(a, w, residual, gamma, x, h, s);
    return std::make_tuple(x, h, s);
  });
}

// A fold: the (tiles, extent) partial buffer to an fp32 vector of its n logical entries.
template <class Fold>
Tensor fold_op(const char* op, const Tensor& partials, int64_t n, Fold&& fold) {
  const auto p = ProgramArgs::of_statistic(op, partials);
  p.stat("partials", partials);
  TORCH_CHECK(partials.dim() == 2 && n > 0 && n <= partials.size(1), op,
              ": partials must be (tiles, extent) with extent >= ", n, ", got ",
              shape_string(partials.sizes()));
  return on_backend(partials, [&](auto& b) {
    Tensor out = b.stat(n);
    fold(b, out);
    return out;
  });
}

Tensor rmsnorm_fold(const Tensor& partials, int64_t m, int64_t hidden, double eps) {
  TORCH_CHECK(hidden > 0, "coda::rmsnorm_fold: hidden must be positive, got ", hidden);
  check_eps("coda::rmsnorm_fold", eps);
  return fold_op("coda::rmsnorm_fold", partials, m,
                 [&](auto& b, Tensor& r) { b.rmsnorm_fold(partials, hidden, eps, r); });
}

std::tuple<Tensor, Tensor> gemm_rmsnorm_swiglu(const Tensor& h, const Tensor& w_gu,
                                               const Tensor& r) {
  ProgramArgs p("coda::gemm_rmsnorm_swiglu", h);
  p.act("h", h).act("w_gu", w_gu).stat("r", r).operand_pair("h", h, 1, "w_gu", w_gu, 1);
  p.shape("r", r, {h.size(0)});
  return on_backend(h, [&](auto& b) {
    const auto o = block::rmsnorm_swiglu(b, h, r, w_gu);
    return std::make_tuple(o.z, o.a);
  });
}

Tensor gemm_rmsnorm_rope(const Tensor& h, const Tensor& w_qkv, const Tensor& r, const Tensor& pos,
                         const Tensor& rope_table, const std::optional<Tensor>& bias_in) {
  ProgramArgs p("coda::gemm_rmsnorm_rope", h);
  p.act("h", h).act("w_qkv", w_qkv).stat("r", r).int32("pos", pos).int32("rope_table", rope_table);
  p.operand_pair("h", h, 1, "w_qkv", w_qkv, 1);
  p.shape("r", r, {h.size(0)}).shape("pos", pos, {h.size(0)});
  p.shape("rope_table", rope_table, {2, w_qkv.size(0)});
  const Tensor bias = bias_in.value_or(Tensor());
  if (bias.defined()) p.act("bias", bias).shape("bias", bias, {w_qkv.size(0)});
  check_positions(p.c, pos);
  return on_backend(
      h, [&](auto& b) { return block::norm_qkv(b, h, r, w_qkv, bias, pos, rope_table); });
}

std::tuple<Tensor, Tensor, Tensor> gemm_rmsnorm_backward(const Tensor& dz, const Tensor& w,
                                                         const Tensor& x, const Tensor& r,
                                                         const Tensor& gamma, const Tensor& zdz,
                                                         const std::optional<Tensor>& dres_in) {
  ProgramArgs p("coda::gemm_rmsnorm_backward", dz);
  p.act("dz", dz).act("w", w).act("x", x).stat("r", r).act("gamma", gamma).stat("zdz", zdz);
  p.operand_pair("dz", dz, 1, "w", w, 0);
  const int64_t m = dz.size(0), hidden = w.size(1);
  const Tensor dres = dres_in.value_or(Tensor());  // None: no residual gradient
  if (dres.defined()) p.act("dres", dres).shape("dres", dres, {m, hidden});
  p.shape("x", x, {m, hidden}).shape("gamma", gamma, {hidden});
  p.shape("r", r, {m}).shape("zdz", zdz, {m});
  return on_backend(x, [&](auto& b) {
    Tensor dx = b.act(m, hidden), h_out = b.act(m, hidden);
    const Tensor s = b.partials(PartialsOf::kRmsnormBackward, m, hidden, dz.size(1));
    b.gemm_rmsnorm_backward(dz, w, x, r, gamma, zdz, dres, dx, h_out, s);
    return std::make_tuple(dx, h_out, s);
  });
}

Tensor dgamma_fold(const Tensor& partials, int64_t hidden) {
  return fold_op("coda::dgamma_fold", partials, hidden,
                 [&](auto& b, Tensor& dgamma) { b.dgamma_fold(partials, dgamma); });
}

std::tuple<Tensor, Tensor, Tensor> gemm_swiglu_backward(const Tensor& dx_out, const Tensor& w_down,
                                                        const Tensor& z) {
  ProgramArgs p("coda::gemm_swiglu_backward", dx_out);
  p.act("dx_out", dx_out).act("w_down", w_down).act("z", z);
  p.operand_pair("dx_out", dx_out, 1, "w_down", w_down, 0);
  p.shape("z", z, {dx_out.size(0), 2 * w_down.size(1)});
  return on_backend(dx_out, [&](auto& b) {
    const int64_t m = dx_out.size(0), inter = w_down.size(1);
    Tensor dz = b.act(m, 2 * inter), a = b.act(m, inter);
    const Tensor s = b.partials(PartialsOf::kSwigluBackward, m, inter, dx_out.size(1));
    b.gemm_swiglu_backward(dx_out, w_down, z, dz, a, s);
    return std::make_tuple(dz, a, s);
  });
}

Tensor zdz_fold(const Tensor& partials, int64_t m, int64_t hidden) {
  TORCH_CHECK(hidden > 0, "coda::zdz_fold: hidden must be positive, got ", hidden);
  return fold_op("coda::zdz_fold", partials, m,
                 [&](auto& b, Tensor& zdz) { b.zdz_fold(partials, hidden, zdz); });
}

std::tuple<Tensor, Tensor> rope_backward(const Tensor& qkv, const Tensor& dqkv, const Tensor& pos,
                                         const Tensor& rope_table, int64_t hidden,
                                         const std::optional<Tensor>& bias_in) {
  ProgramArgs p("coda::rope_backward", qkv);
  p.act("qkv", qkv).act("dqkv", dqkv).int32("pos", pos).int32("rope_table", rope_table);
  TORCH_CHECK(qkv.dim() == 2 && qkv.numel() > 0, p.c.op,
              ": qkv must be non-empty 2-D (tokens, QKV width), got ",
              shape_string(qkv.sizes()));
  TORCH_CHECK(hidden > 0, p.c.op, ": hidden must be positive, got ", hidden);
  p.shape("dqkv", dqkv, {qkv.size(0), qkv.size(1)}).shape("pos", pos, {qkv.size(0)});
  p.shape("rope_table", rope_table, {2, qkv.size(1)});
  const Tensor bias = bias_in.value_or(Tensor());
  if (bias.defined()) p.act("bias", bias).shape("bias", bias, {qkv.size(1)});
  check_positions(p.c, pos);
  return on_backend(qkv, [&](auto& b) {
    Tensor dpre = b.act(qkv.size(0), qkv.size(1)), zdz = b.stat(qkv.size(0));
    b.rope_backward(qkv, dqkv, bias, pos, rope_table, hidden, dpre, zdz);
    return std::make_tuple(dpre, zdz);
  });
}

// The program-level ops, in one list: each has a function of the op's name above.
#define CODA_PROGRAM_OPS(X)                                                                 \
  X(gemm) X(gemm_xw) X(gemm_xty) X(gemm_residual_rmsnorm_partial) X(rmsnorm_fold)           \
      X(gemm_rmsnorm_swiglu) X(gemm_rmsnorm_rope) X(gemm_rmsnorm_backward) X(dgamma_fold)   \
          X(gemm_swiglu_backward) X(zdz_fold) X(rope_backward)
namespace program_names {
#define CODA_OP_NAME(op) inline constexpr char op[] = "coda::" #op;
CODA_PROGRAM_OPS(CODA_OP_NAME)
#undef CODA_OP_NAME
}  // namespace program_names

void register_programs(torch::Library& m) {
#define CODA_REGISTER_PROGRAM(op) m.impl(#op, CODA_GUARDED(program_names::op, op));
  CODA_PROGRAM_OPS(CODA_REGISTER_PROGRAM)
#undef CODA_REGISTER_PROGRAM
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(coda, m) {
  m.def("gemm(Tensor x, Tensor w) -> Tensor");
  m.def("gemm_xw(Tensor x, Tensor w) -> Tensor");
  m.def("gemm_xty(Tensor x, Tensor y) -> Tensor");
  m.def(
      "gemm_residual_rmsnorm_partial(Tensor a, Tensor w, Tensor residual, Tensor gamma) "
      "-> (Tensor x, Tensor h, Tensor partials)");
  m.def("rmsnorm_fold(Tensor partials, int m, int hidden, float eps) -> Tensor");
  m.def("gemm_rmsnorm_swiglu(Tensor h, Tensor w_gu, Tensor r) -> (Tensor z, Tensor a)");
  m.def(
      "gemm_rmsnorm_rope(Tensor h, Tensor w_qkv, Tensor r, Tensor pos, Tensor rope_table, "
      "Tensor? bias=None) -> Tensor");
  m.def(
      "gemm_rmsnorm_backward(Tensor dz, Tensor w, Tensor x, Tensor r, Tensor gamma, Tensor zdz, "
      "Tensor? dres) -> (Tensor dx, Tensor h_out, Tensor partials)");
  m.def("dgamma_fold(Tensor partials, int hidden) -> Tensor");
  m.def(
      "gemm_swiglu_backward(Tensor dx_out, Tensor w_down, Tensor z) "
      "-> (Tensor dz, Tensor a, Tensor partials)");
  m.def("zdz_fold(Tensor partials, int m, int hidden) -> Tensor");
  m.def(
      "rope_backward(Tensor qkv, Tensor dqkv, Tensor pos, Tensor rope_table, int hidden, "
      "Tensor? bias=None) -> (Tensor dqkv_pre, Tensor zdz)");
}

TORCH_LIBRARY_IMPL(coda, CPU, m) { register_programs(m); }
#if CODA_TORCH_CUDA
TORCH_LIBRARY_IMPL(coda, CUDA, m) { register_programs(m); }
#endif

}  // namespace coda::torch_ext
