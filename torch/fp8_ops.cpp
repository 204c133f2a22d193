// The blockwise FP8 casts and GEMMs (docs/torch-ops.md, "FP8"): the cast passes (1x128 rows and
// their transposed copy; 128x128 weight blocks) and the FP8 GEMMs (forward / data gradient, and
// the weight gradient from the transposed copies). On CUDA they run the Hopper kernels through
// include/coda/ops.hpp; on the CPU the reference recipe (reference/fp8.hpp), which emulates e4m3
// exactly and writes the same layouts (fp8_common.hpp), so CPU and CUDA results compare code for
// code. The FP8 programs are fp8_programs.cpp's.
#include "fp8_ops.hpp"

#include <torch/library.h>

#include <string>
#include <tuple>
#include <vector>

#include "checks.hpp"
#include "coda/reference/fp8.hpp"
#include "fp8_common.hpp"
#include "meta_kernel.hpp"
#if CODA_TORCH_CUDA
#include <c10/cuda/CUDAGuard.h>

#include "coda/kernel/runtime.hpp"
#include "coda/ops.hpp"
#endif

namespace coda::torch_ext {
namespace {

using namespace fp8_detail;  // NOLINT(google-build-using-namespace): the shared FP8 helpers

// The four outputs of a cast; the ones not asked for are empty.
Quantized quantize(const char* op, const Tensor& x, bool rows, bool transposed, bool tiles) {
  check_input(op, tiles ? "w" : "x", x);
  TORCH_CHECK(rows || transposed, op, ": neither rows nor transposed is asked for");
  const int64_t m = x.size(0), k = x.size(1);
  TORCH_CHECK(!(tiles && transposed) || m % 16 == 0, op,
              ": the transposed copy of a 128x128-blocked tensor needs rows a multiple of 16, got ",
              m);
  auto [codes, scales, codes_t, scales_t] =
      empty_quantized_outputs(x, m, k, rows, transposed, tiles);
  if (x.is_cpu()) {
    const std::vector<float> v = as_floats(x);
    if (rows) {
      const auto q = reference::quantize_blockwise(
          reference::MatrixRef<float>::row_major(v.data(), m, k), tiles ? 128 : 1, 128);
      put_codes(q, codes);
      if (tiles)
        put_block_scales(q, scales);
      else
        put_row_scales(q, scales);
    }
    if (transposed) {
      const auto q = reference::quantize_blockwise(
          reference::MatrixRef<float>::transposed(v.data(), k, m), tiles ? 128 : 1, 128);
      codes_t.zero_();
      put_codes(q, codes_t);
      if (tiles)
        put_block_scales(q, scales_t);
      else
        put_row_scales(q, scales_t);
    }
    return {codes, scales, codes_t, scales_t};
  }
#if CODA_TORCH_CUDA
  const c10::cuda::CUDAGuard guard(x.device());
  const TensorView xv = view(x, DType::kBF16);
  const TensorView absent{};
  const TensorView c = rows ? codes_view(codes) : absent, s = rows ? scales_view(scales) : absent;
  const TensorView ct = transposed ? codes_view(codes_t) : absent,
                   st = transposed ? scales_view(scales_t) : absent;
  if (tiles)
    ops::quantize_fp8_blocks(xv, c, s, ct, st, stream_of(x));
  else
    ops::quantize_fp8_rows(xv, c, s, ct, st, stream_of(x));
  return {codes, scales, codes_t, scales_t};
#else
  TORCH_CHECK(false, op, ": this build has no CUDA kernels");
#endif
}

Quantized fp8_quantize_rows(const Tensor& x, bool rows, bool transposed) {
  return quantize("coda::fp8_quantize_rows", x, rows, transposed, false);
}
Quantized fp8_quantize_blocks(const Tensor& w, bool rows, bool transposed) {
  return quantize("coda::fp8_quantize_blocks", w, rows, transposed, true);
}

// The transpose's arguments: a weight's codes (N, K) e4m3, contiguous, N and K multiples of 16,
// and scales (ceil(N/128), ceil(K/128)) fp32 row-major, on one device. Sizes may be symbolic
// (Meta), their checks then left to the real kernels.
void check_blocks_operand(const char* op, const Tensor& codes, const Tensor& scales) {
  TORCH_CHECK(codes.defined() && scales.defined(), op, ": codes and scales must be defined");
  TORCH_CHECK(codes.scalar_type() == at::kFloat8_e4m3fn, op, ": codes must be float8_e4m3fn, got ",
              codes.scalar_type());
  TORCH_CHECK(scales.scalar_type() == at::kFloat, op, ": scales must be float32, got ",
              scales.scalar_type());
  TORCH_CHECK(codes.dim() == 2 && scales.dim() == 2, op,
              ": codes and scales must be matrices, got ", codes.dim(), " and ", scales.dim(),
              " dimensions");
  TORCH_CHECK(scales.device() == codes.device(), op, ": scales is on ", scales.device(),
              ", codes on ", codes.device());
  if (codes.unsafeGetTensorImpl()->has_symbolic_sizes_strides() ||
      scales.unsafeGetTensorImpl()->has_symbolic_sizes_strides())
    return;
  const int64_t n = codes.size(0), k = codes.size(1);
  TORCH_CHECK(n > 0 && k > 0 && n % 16 == 0 && k % 16 == 0, op,
              ": codes must be (N, K) with N and K positive multiples of 16, got ",
              shape_string(codes.sizes()));
  TORCH_CHECK(codes.is_contiguous(), op, ": codes must be contiguous, got strides ",
              shape_string(codes.strides()));
  const int64_t nb = ScaleLayout::blocks(n), kb = ScaleLayout::blocks(k);
  TORCH_CHECK(scales.size(0) == nb && scales.size(1) == kb, op, ": scales must have shape (", nb,
              ", ", kb, ") for codes of shape ", shape_string(codes.sizes()), ", got ",
              shape_string(scales.sizes()));
  TORCH_CHECK(scales.stride(1) == 1 && scales.stride(0) >= kb, op,
              ": scales must be row-major with a row stride >= ", kb, ", got strides ",
              shape_string(scales.strides()));
}

// codes_t (K, N), scales_t (ceil(K/128), ceil(N/128)) of a weight from its codes and scales, bit
// for bit fp8_quantize_blocks(w, False, True) of the w they came from: its data-gradient operand,
// made in a backward instead of kept from the weight cast.
std::tuple<Tensor, Tensor> fp8_transpose_blocks(const Tensor& codes, const Tensor& scales) {
  const char* op = "coda::fp8_transpose_blocks";
  check_blocks_operand(op, codes, scales);
  TORCH_CHECK(codes.is_cpu() || codes.is_cuda(), op, ": codes is on ", codes.device(),
              "; coda ops run on CPU or CUDA");
  auto [c, s, codes_t, scales_t] =
      empty_quantized_outputs(codes, codes.size(0), codes.size(1), false, true, true);
  if (codes.is_cpu()) {
    codes_t.copy_(codes.t());
    scales_t.copy_(scales.t());
    return {codes_t, scales_t};
  }
#if CODA_TORCH_CUDA
  const c10::cuda::CUDAGuard guard(codes.device());
  ops::transpose_fp8_blocks(codes_view(codes), scales_view(scales), codes_view(codes_t),
                            scales_view(scales_t), stream_of(codes));
  return {codes_t, scales_t};
#else
  TORCH_CHECK(false, op, ": this build has no CUDA kernels");
#endif
}

// x · wᵀ (w in 128x128 blocks: fp8_gemm) or x · yᵀ (y in 1x128 blocks: the fp8_gemm_xyt ops),
// into `accumulate` when given.
Tensor gemm(const char* op, const Tensor& x, const Tensor& xs, const Tensor& w, const Tensor& ws,
            bool w_blocks, const Tensor* accumulate) {
  const auto [m, n, k] = check_pair(op, "x", x, "x_scales", xs, w, ws, w_blocks,
                                    w_blocks ? "w" : "y", w_blocks ? "w_scales" : "y_scales");
  if (accumulate) {
    const Tensor& d = *accumulate;
    TORCH_CHECK(d.defined(), op, ": d is undefined");
    TORCH_CHECK(d.device() == x.device() && d.scalar_type() == at::kFloat &&
                    d.sizes() == c10::IntArrayRef({m, n}) && d.is_contiguous(),
                op, ": d must be a contiguous float32 (", m, ", ", n, ") tensor on ", x.device(),
                ", got ", d.scalar_type(), " ", shape_string(d.sizes()), " with strides ",
                shape_string(d.strides()), " on ", d.device());
  }
  if (x.is_cpu()) {
    const auto a = read_operand(x, xs, false), b = read_operand(w, ws, w_blocks);
    const std::vector<double> d = reference::gemm_fp8_blockwise<double>(a, b);
    const Tensor out = at::from_blob(const_cast<double*>(d.data()), {m, n}, at::kDouble).clone();
    if (accumulate) {
      const_cast<Tensor&>(*accumulate).add_(out.to(at::kFloat));
      return *accumulate;
    }
    return out;
  }
#if CODA_TORCH_CUDA
  const c10::cuda::CUDAGuard guard(x.device());
  const Tensor d = accumulate ? *accumulate : at::empty({m, n}, x.options().dtype(at::kBFloat16));
  if (w_blocks)
    ops::gemm_fp8(codes_view(x), scales_view(xs), codes_view(w), scales_view(ws),
                  view(d, DType::kBF16), stream_of(x));
  else
    ops::gemm_fp8_xyt(codes_view(x), scales_view(xs), codes_view(w), scales_view(ws),
                      view(d, accumulate ? DType::kF32 : DType::kBF16), accumulate != nullptr,
                      stream_of(x));
  return d;
#else
  TORCH_CHECK(false, op, ": this build has no CUDA kernels");
#endif
}

Tensor fp8_gemm(const Tensor& x, const Tensor& x_scales, const Tensor& w, const Tensor& w_scales) {
  return gemm("coda::fp8_gemm", x, x_scales, w, w_scales, true, nullptr);
}
Tensor fp8_gemm_xyt(const Tensor& x, const Tensor& x_scales, const Tensor& y,
                    const Tensor& y_scales) {
  return gemm("coda::fp8_gemm_xyt", x, x_scales, y, y_scales, false, nullptr);
}
void fp8_gemm_xyt_accumulate_(const Tensor& d, const Tensor& x, const Tensor& x_scales,
                              const Tensor& y, const Tensor& y_scales) {
  gemm("coda::fp8_gemm_xyt_accumulate_", x, x_scales, y, y_scales, false, &d);
}

// Benchmarks' kernel sweeps: kernel::set_kernel_overrides (CODA_KERNEL_OVERRIDE's syntax).
void set_kernel_overrides(c10::string_view spec) {
#if CODA_TORCH_CUDA
  kernel::set_kernel_overrides(std::string(spec));
#else
  TORCH_CHECK(false, "coda::set_kernel_overrides: this build has no CUDA kernels");
#endif
}

// The FP8 weight gradient's backend (ops::set_fp8_wgrad_backend), process-wide: "cutlass",
// "cublaslt" or "cublaslt-only"; returns the one it replaced. The CPU build has ours only.
std::string set_fp8_wgrad_backend(c10::string_view backend) {
  const std::string b(backend);
  TORCH_CHECK(b == "cutlass" || b == "cublaslt" || b == "cublaslt-only",
              "coda::set_fp8_wgrad_backend: backend must be 'cutlass', 'cublaslt' or "
              "'cublaslt-only', got '", b, "'");
#if CODA_TORCH_CUDA
  using ops::Fp8WgradBackend;
  const Fp8WgradBackend old = ops::fp8_wgrad_backend();
  ops::set_fp8_wgrad_backend(b == "cutlass"    ? Fp8WgradBackend::kCutlass
                             : b == "cublaslt" ? Fp8WgradBackend::kCublasLt
                                               : Fp8WgradBackend::kCublasLtOnly);
  return old == Fp8WgradBackend::kCutlass    ? "cutlass"
         : old == Fp8WgradBackend::kCublasLt ? "cublaslt"
                                             : "cublaslt-only";
#else
  TORCH_CHECK(b == "cutlass", "coda::set_fp8_wgrad_backend: this build has no CUDA kernels, so "
              "no cuBLASLt backend");
  return "cutlass";
#endif
}

// Where the FP8 programs' elementwise work runs (ops::set_fp8_epilogue_placement), process-wide:
// "auto", "fused" (in the GEMM's epilogue) or "split" (a pass of its own after the plain FP8
// GEMM); returns the one it replaced. The CPU runs each program's oracle either way: the CPU
// build accepts the names and returns "auto".
std::string set_fp8_epilogue(c10::string_view placement) {
  const std::string p(placement);
  TORCH_CHECK(p == "auto" || p == "fused" || p == "split",
              "coda::set_fp8_epilogue: placement must be 'auto', 'fused' or 'split', got '", p, "'");
#if CODA_TORCH_CUDA
  using ops::Fp8EpiloguePlacement;
  const Fp8EpiloguePlacement old = ops::fp8_epilogue_placement();
  ops::set_fp8_epilogue_placement(p == "auto"    ? Fp8EpiloguePlacement::kAuto
                                  : p == "fused" ? Fp8EpiloguePlacement::kFused
                                                 : Fp8EpiloguePlacement::kSplit);
  return old == Fp8EpiloguePlacement::kAuto    ? "auto"
         : old == Fp8EpiloguePlacement::kFused ? "fused"
                                               : "split";
#else
  return "auto";
#endif
}

namespace names {
inline constexpr char overrides[] = "coda::set_kernel_overrides";
inline constexpr char epilogue_placement[] = "coda::set_fp8_epilogue";
inline constexpr char wgrad_backend[] = "coda::set_fp8_wgrad_backend";
inline constexpr char quantize_rows[] = "coda::fp8_quantize_rows";
inline constexpr char quantize_blocks[] = "coda::fp8_quantize_blocks";
inline constexpr char transpose_blocks[] = "coda::fp8_transpose_blocks";
inline constexpr char gemm_blocks[] = "coda::fp8_gemm";
inline constexpr char gemm_xyt[] = "coda::fp8_gemm_xyt";
inline constexpr char gemm_xyt_acc[] = "coda::fp8_gemm_xyt_accumulate_";
}  // namespace names

void register_fp8(torch::Library& m) {
  m.impl("fp8_quantize_rows", CODA_GUARDED(names::quantize_rows, fp8_quantize_rows));
  m.impl("fp8_quantize_blocks", CODA_GUARDED(names::quantize_blocks, fp8_quantize_blocks));
  m.impl("fp8_transpose_blocks", CODA_GUARDED(names::transpose_blocks, fp8_transpose_blocks));
  m.impl("fp8_gemm", CODA_GUARDED(names::gemm_blocks, fp8_gemm));
  m.impl("fp8_gemm_xyt", CODA_GUARDED(names::gemm_xyt, fp8_gemm_xyt));
  m.impl("fp8_gemm_xyt_accumulate_", CODA_GUARDED(names::gemm_xyt_acc, fp8_gemm_xyt_accumulate_));
}

}  // namespace

// The casts and GEMMs for the block compositions' backends (torch/fp8_ops.hpp).
namespace fp8 {
Quantized quantize_rows(const Tensor& x, bool rows, bool transposed) {
  return fp8_quantize_rows(x, rows, transposed);
}
Tensor gemm(const Tensor& x, const Tensor& x_scales, const Tensor& w, const Tensor& w_scales) {
  return fp8_gemm(x, x_scales, w, w_scales);
}
Tensor gemm_xyt(const Tensor& x, const Tensor& x_scales, const Tensor& y, const Tensor& y_scales) {
  return fp8_gemm_xyt(x, x_scales, y, y_scales);
}
}  // namespace fp8

namespace {
// The casts' Meta kernels (the model's first cast and its weight caches, under torch.compile):
// the outputs at the input's sizes, symbolic ones too (dynamic shapes); at concrete sizes the
// CPU and CUDA kernels' checks, at symbolic ones those that need no size's value.
Quantized quantize_meta(const char* op, const Tensor& x, bool rows, bool transposed, bool tiles) {
  const char* name = tiles ? "w" : "x";
  TORCH_CHECK(x.defined() && x.dim() == 2, op, ": ", name, " must be a matrix, got ",
              x.defined() ? std::to_string(x.dim()) + " dimensions" : "undefined");
  if (!x.unsafeGetTensorImpl()->has_symbolic_sizes_strides()) {
    check_input(op, name, x);
    TORCH_CHECK(!(tiles && transposed) || x.size(0) % 16 == 0, op,
                ": the transposed copy of a 128x128-blocked tensor needs rows a multiple of 16, "
                "got ",
                x.size(0));
  }
  const auto t = x.scalar_type();
  TORCH_CHECK(t == at::kBFloat16 || t == at::kFloat || t == at::kDouble, op, ": ", name,
              " must be bfloat16 (or float32 / float64 on the CPU), got ", t);
  TORCH_CHECK(rows || transposed, op, ": neither rows nor transposed is asked for");
  return empty_quantized_outputs(x, x.sym_size(0), x.sym_size(1), rows, transposed, tiles);
}
Quantized fp8_quantize_rows_meta(const Tensor& x, bool rows, bool transposed) {
  return quantize_meta("coda::fp8_quantize_rows", x, rows, transposed, false);
}
Quantized fp8_quantize_blocks_meta(const Tensor& w, bool rows, bool transposed) {
  return quantize_meta("coda::fp8_quantize_blocks", w, rows, transposed, true);
}
std::tuple<Tensor, Tensor> fp8_transpose_blocks_meta(const Tensor& codes, const Tensor& scales) {
  check_blocks_operand("coda::fp8_transpose_blocks", codes, scales);
  auto [c, s, codes_t, scales_t] =
      empty_quantized_outputs(codes, codes.sym_size(0), codes.sym_size(1), false, true, true);
  return {codes_t, scales_t};
}
}  // namespace

TORCH_LIBRARY_IMPL(coda, Meta, m) {
  impl_meta(m, "fp8_quantize_rows", &fp8_quantize_rows_meta);
  impl_meta(m, "fp8_quantize_blocks", &fp8_quantize_blocks_meta);
  impl_meta(m, "fp8_transpose_blocks", &fp8_transpose_blocks_meta);
}

TORCH_LIBRARY_FRAGMENT(coda, m) {
  m.def(
      "fp8_quantize_rows(Tensor x, bool rows=True, bool transposed=False) "
      "-> (Tensor codes, Tensor scales, Tensor codes_t, Tensor scales_t)");
  m.def(
      "fp8_quantize_blocks(Tensor w, bool rows=True, bool transposed=False) "
      "-> (Tensor codes, Tensor scales, Tensor codes_t, Tensor scales_t)");
  // A weight's transposed operand from its codes and scales (fp8_quantize_blocks(w)'s), as
  // fp8_quantize_blocks(w, False, True) makes it from w.
  m.def("fp8_transpose_blocks(Tensor codes, Tensor scales) -> (Tensor codes_t, Tensor scales_t)");
  m.def("fp8_gemm(Tensor x, Tensor x_scales, Tensor w, Tensor w_scales) -> Tensor");
  m.def("fp8_gemm_xyt(Tensor x, Tensor x_scales, Tensor y, Tensor y_scales) -> Tensor");
  m.def(
      "fp8_gemm_xyt_accumulate_(Tensor(a!) d, Tensor x, Tensor x_scales, Tensor y, "
      "Tensor y_scales) -> ()");
  m.def("set_kernel_overrides(str spec) -> ()",
        CODA_GUARDED(names::overrides, set_kernel_overrides));
  m.def("set_fp8_wgrad_backend(str backend) -> str",
        CODA_GUARDED(names::wgrad_backend, set_fp8_wgrad_backend));
  m.def("set_fp8_epilogue(str placement) -> str",
        CODA_GUARDED(names::epilogue_placement, set_fp8_epilogue));
}

TORCH_LIBRARY_IMPL(coda, CPU, m) { register_fp8(m); }
#if CODA_TORCH_CUDA
TORCH_LIBRARY_IMPL(coda, CUDA, m) { register_fp8(m); }
#endif

}  // namespace coda::torch_ext
