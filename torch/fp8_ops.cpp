// The blockwise FP8 ops (docs/torch-ops.md, "FP8"): the cast passes and the FP8 GEMMs. On CUDA
// they run the Hopper kernels through include/coda/ops.hpp; on the CPU the reference recipe
// (reference/fp8.hpp), which emulates e4m3 exactly and writes the same layouts, so CPU and CUDA
// results compare code for code. Codes are torch.float8_e4m3fn tensors; scales fp32 as in
// ops.hpp: a 1x128-blocked (rows, cols) tensor has (ceil(cols / 128), rows) scales whose row
// stride is rows rounded up to 4 (a view of that storage), a 128x128-blocked one
// (ceil(rows / 128), ceil(cols / 128)).
#include <torch/library.h>

#include <tuple>
#include <vector>

#include "checks.hpp"
#include "coda/kernel/args.hpp"
#include "coda/reference/fp8.hpp"
#include "coda/reference/fp8_programs.hpp"
#if CODA_TORCH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "coda/kernel/runtime.hpp"
#include "coda/ops.hpp"
#endif

namespace coda::torch_ext {
namespace {

using at::Tensor;
using kernel::ScaleLayout;
using Quantized = std::tuple<Tensor, Tensor, Tensor, Tensor>;

int64_t blocks(int64_t n) { return ScaleLayout::blocks(n); }

// The high-precision input of a cast: bf16 on CUDA; float32, float64 or bf16 on the CPU.
void check_input(const char* op, const char* name, const Tensor& x) {
  TORCH_CHECK(x.defined(), op, ": ", name, " is undefined");
  TORCH_CHECK(x.is_cpu() || x.is_cuda(), op, ": ", name, " is on ", x.device(),
              "; coda ops run on CPU or CUDA");
  const auto t = x.scalar_type();
  TORCH_CHECK(t == at::kBFloat16 || (x.is_cpu() && (t == at::kFloat || t == at::kDouble)), op, ": ",
              name, " must be bfloat16", x.is_cpu() ? " (or float32 / float64 on the CPU)" : "",
              ", got ", t);
  TORCH_CHECK(x.dim() == 2 && x.numel() > 0, op, ": ", name, " must be a non-empty matrix, got ",
              shape_string(x.sizes()));
  TORCH_CHECK(x.size(1) % 16 == 0, op, ": ", name,
              "'s columns must be a multiple of 16 (16-byte rows of e4m3), got ", x.size(1));
  TORCH_CHECK(x.is_contiguous(), op, ": ", name, " must be contiguous, got strides ",
              shape_string(x.strides()));
}

at::TensorOptions codes_options(const Tensor& like) {
  return at::TensorOptions().dtype(at::kFloat8_e4m3fn).device(like.device());
}
at::TensorOptions scale_options(const Tensor& like) {
  return at::TensorOptions().dtype(at::kFloat).device(like.device());
}
// (rows, cols) scales whose storage rows are `ld` wide.
Tensor scales_with_ld(const Tensor& like, int64_t rows, int64_t cols, int64_t ld) {
  return at::empty({rows, ld}, scale_options(like)).narrow(1, 0, cols);
}
Tensor none(const Tensor& like) { return at::empty({0}, scale_options(like)); }

// ---- the CPU reference: from BlockQuantized to the kernels' layouts and back ----------------
std::vector<float> as_floats(const Tensor& x) {
  const Tensor f = x.to(at::kFloat).contiguous();
  return std::vector<float>(f.data_ptr<float>(), f.data_ptr<float>() + f.numel());
}
void put_codes(const reference::BlockQuantized& q, Tensor& codes) {
  auto* dst = reinterpret_cast<uint8_t*>(codes.data_ptr());
  for (int64_t i = 0; i < q.rows; ++i)
    for (int64_t j = 0; j < q.cols; ++j) dst[i * codes.stride(0) + j] = q.code_at(i, j);
}
// 1x128 scales of q (rows, cols) into (KB, rows): entry (kb, r) at kb · ld + r; rows past q up to
// the storage's width get 1, as the CUDA kernel writes them.
void put_row_scales(const reference::BlockQuantized& q, Tensor& scales) {
  auto* dst = scales.data_ptr<float>();
  const int64_t ld = scales.stride(0), width = ld;
  for (int64_t kb = 0; kb < q.grid_cols(); ++kb)
    for (int64_t r = 0; r < width; ++r)
      dst[kb * ld + r] = r < q.rows ? q.scale_at(r, kb * q.block_cols) : 1.0f;
}
void put_block_scales(const reference::BlockQuantized& q, Tensor& scales) {
  auto* dst = scales.data_ptr<float>();
  for (int64_t i = 0; i < q.grid_rows(); ++i)
    for (int64_t j = 0; j < q.grid_cols(); ++j)
      dst[i * scales.stride(0) + j] = q.scales[i * q.grid_cols() + j];
}
reference::BlockQuantized read_operand(const Tensor& codes, const Tensor& scales,
                                       bool block_scales) {
  reference::BlockQuantized q{codes.size(0), codes.size(1), block_scales ? 128 : 1, 128, {}, {}};
  q.codes.resize(size_t(q.rows * q.cols));
  const auto* src = reinterpret_cast<const uint8_t*>(codes.data_ptr());
  for (int64_t i = 0; i < q.rows; ++i)
    for (int64_t j = 0; j < q.cols; ++j) q.codes[i * q.cols + j] = src[i * codes.stride(0) + j];
  q.scales.resize(size_t(q.grid_rows() * q.grid_cols()));
  const float* sp = scales.data_ptr<float>();
  const int64_t ld = scales.stride(0);
  for (int64_t i = 0; i < q.grid_rows(); ++i)
    for (int64_t kb = 0; kb < q.grid_cols(); ++kb)
      q.scales[i * q.grid_cols() + kb] = block_scales ? sp[i * ld + kb] : sp[kb * ld + i];
  return q;
}

#if CODA_TORCH_CUDA
TensorView view(const Tensor& t, DType d) {
  TORCH_CHECK(t.dim() == 2 && (t.size(1) <= 1 || t.stride(1) == 1),
              "coda: expected a row-major matrix, got sizes ", t.sizes(), " strides ", t.strides());
  return TensorView::matrix(t.data_ptr(), d, t.size(0), t.size(1), t.stride(0), t.device().index());
}
TensorView codes_view(const Tensor& t) { return view(t, DType::kE4M3); }
TensorView scales_view(const Tensor& t) { return view(t, DType::kF32); }
cudaStream_t stream_of(const Tensor& t) {
  return c10::cuda::getCurrentCUDAStream(t.device().index()).stream();
}
#endif

// The four outputs of a cast; the ones not asked for are empty.
Quantized quantize(const char* op, const Tensor& x, bool rows, bool transposed, bool tiles) {
  check_input(op, "x", x);
  TORCH_CHECK(rows || transposed, op, ": neither rows nor transposed is asked for");
  const int64_t m = x.size(0), k = x.size(1);
  TORCH_CHECK(!(tiles && transposed) || m % 16 == 0, op,
              ": the transposed copy of a 128x128-blocked tensor needs rows a multiple of 16, got ",
              m);
  Tensor codes = none(x), scales = none(x), codes_t = none(x), scales_t = none(x);
  if (rows) {
    codes = at::empty({m, k}, codes_options(x));
    scales = tiles ? at::empty({blocks(m), blocks(k)}, scale_options(x))
                   : scales_with_ld(x, blocks(k), m, ScaleLayout::row_scales_ld(m));
  }
  if (transposed) {
    codes_t = tiles ? at::empty({k, m}, codes_options(x))
                    : at::empty({k, ScaleLayout::padded_tokens(m)}, codes_options(x));
    scales_t = tiles ? at::empty({blocks(k), blocks(m)}, scale_options(x))
                     : at::empty({blocks(m), k}, scale_options(x));
  }
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

// An operand: e4m3 codes (rows, k) with rows-major storage and its fp32 scales, on one device.
void check_operand(const char* op, const char* name, const Tensor& codes, const char* sname,
                   const Tensor& scales, const Tensor& first) {
  TORCH_CHECK(codes.defined() && scales.defined(), op, ": ", name, " or ", sname, " is undefined");
  TORCH_CHECK(codes.device() == first.device() && scales.device() == first.device(), op, ": ", name,
              " and ", sname, " must be on ", first.device(), ", got ", codes.device(), " and ",
              scales.device());
  TORCH_CHECK(codes.scalar_type() == at::kFloat8_e4m3fn, op, ": ", name,
              " must be float8_e4m3fn, got ", codes.scalar_type());
  TORCH_CHECK(scales.scalar_type() == at::kFloat, op, ": ", sname, " must be float32, got ",
              scales.scalar_type());
  TORCH_CHECK(codes.dim() == 2 && codes.numel() > 0 && codes.stride(1) == 1, op, ": ", name,
              " must be a non-empty row-major matrix, got sizes ", shape_string(codes.sizes()),
              " strides ", shape_string(codes.strides()));
  TORCH_CHECK(scales.dim() == 2 && scales.stride(1) == 1, op, ": ", sname,
              " must be a row-major matrix, got sizes ", shape_string(scales.sizes()), " strides ",
              shape_string(scales.strides()));
  TORCH_CHECK(codes.is_cpu() || codes.is_cuda(), op, ": ", name, " is on ", codes.device());
}
void check_scale_shape(const char* op, const char* name, const Tensor& s, int64_t rows,
                       int64_t cols) {
  TORCH_CHECK(s.size(0) == rows && s.size(1) == cols, op, ": ", name, " must have shape (", rows,
              ", ", cols, "), got ", shape_string(s.sizes()));
  if (s.is_cpu())  // the reference reads the storage the CUDA kernels would
    TORCH_CHECK(s.stride(0) >= cols, op, ": ", name, "'s row stride must be >= ", cols);
}

// x (M, K) 1x128 · w (N, K) (128x128 blocks when `w_blocks`, else 1x128) -> (M, N).
// An FP8 GEMM's operand pair, checked: `x_name` (M, K) in 1x128 blocks, w (N, K) in 128x128 blocks
// when `w_blocks`, else 1x128, with their scales; returns (M, N, K).
std::tuple<int64_t, int64_t, int64_t> check_pair(const char* op, const char* x_name,
                                                 const Tensor& x, const char* xs_name,
                                                 const Tensor& xs, const Tensor& w,
                                                 const Tensor& ws, bool w_blocks) {
  check_operand(op, x_name, x, xs_name, xs, x);
  check_operand(op, "w", w, "w_scales", ws, x);
  TORCH_CHECK(x.size(1) == w.size(1), op, ": ", x_name, " is ", shape_string(x.sizes()),
              " and w is ", shape_string(w.sizes()), ": their K differ");
  const int64_t m = x.size(0), n = w.size(0), k = x.size(1);
  check_scale_shape(op, xs_name, xs, blocks(k), m);
  if (w_blocks)
    check_scale_shape(op, "w_scales", ws, blocks(n), blocks(k));
  else
    check_scale_shape(op, "w_scales", ws, blocks(k), n);
  return {m, n, k};
}

Tensor gemm(const char* op, const Tensor& x, const Tensor& xs, const Tensor& w, const Tensor& ws,
            bool w_blocks, const Tensor* accumulate) {
  const auto [m, n, k] = check_pair(op, "x", x, "x_scales", xs, w, ws, w_blocks);
  if (accumulate) {
    const Tensor& d = *accumulate;
    TORCH_CHECK(d.defined() && d.device() == x.device() && d.scalar_type() == at::kFloat &&
                    d.sizes() == c10::IntArrayRef({m, n}) && d.is_contiguous(),
                op, ": d must be a contiguous float32 (", m, ", ", n, ") tensor on ", x.device(),
                ", got ", d.defined() ? shape_string(d.sizes()) : "undefined");
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

// F1 over FP8 operands (ops::gemm_fp8_residual_rmsnorm): x = a · wᵀ + residual, h = x ⊙ γ in
// residual's dtype quantized in 1x128 blocks (`rows`) and as its transposed 128x1 copy
// (`transposed`), Σx² partials per 128x128 tile for rmsnorm_fold. On the CPU residual and gamma
// may be float32 or float64 too (x, h and the partials then stay in that precision).
using Fp8F1 = std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor>;
Fp8F1 fp8_gemm_residual_rmsnorm(const Tensor& a, const Tensor& a_scales, const Tensor& w,
                                const Tensor& w_scales, const Tensor& residual, const Tensor& gamma,
                                bool rows, bool transposed) {
  const char* op = "coda::fp8_gemm_residual_rmsnorm";
  const auto [m, n, k] = check_pair(op, "a", a, "a_scales", a_scales, w, w_scales, true);
  check_input(op, "residual", residual);
  TORCH_CHECK(residual.device() == a.device() && gamma.device() == a.device(), op,
              ": residual and gamma must be on ", a.device(), ", got ", residual.device(), " and ",
              gamma.device());
  TORCH_CHECK(residual.sizes() == c10::IntArrayRef({m, n}), op, ": residual must be (", m, ", ", n,
              "), got ", shape_string(residual.sizes()));
  TORCH_CHECK(gamma.dim() == 1 && gamma.size(0) == n && gamma.is_contiguous() &&
                  gamma.scalar_type() == residual.scalar_type(),
              op, ": gamma must be a contiguous (", n, ") vector of residual's dtype ",
              residual.scalar_type(), ", got ", shape_string(gamma.sizes()), " ",
              gamma.scalar_type());
  TORCH_CHECK(rows || transposed, op, ": neither rows nor transposed is asked for");
  const at::ScalarType act = residual.scalar_type();
  Tensor h = none(a), hs = none(a), h_t = none(a), h_ts = none(a);
  if (rows) {
    h = at::empty({m, n}, codes_options(a));
    hs = scales_with_ld(a, blocks(n), m, ScaleLayout::row_scales_ld(m));
  }
  if (transposed) {
    h_t = at::empty({n, ScaleLayout::padded_tokens(m)}, codes_options(a));
    h_ts = at::empty({blocks(m), n}, scale_options(a));
  }
  if (a.is_cpu()) {
    const auto to_doubles = [](const Tensor& t) {
      const Tensor d = t.to(at::kDouble).contiguous();
      return std::vector<double>(d.data_ptr<double>(), d.data_ptr<double>() + d.numel());
    };
    const auto f = reference::fp8_residual_rmsnorm<double>(read_operand(a, a_scales, false),
                                                           read_operand(w, w_scales, true),
                                                           to_doubles(residual), to_doubles(gamma));
    const auto tensor = [](const std::vector<double>& v, int64_t r, int64_t c) {
      return at::from_blob(const_cast<double*>(v.data()), {r, c}, at::kDouble).clone();
    };
    const Tensor x = tensor(f.x, m, n).to(act);
    const Tensor hv = tensor(f.h, m, n).to(act).to(at::kDouble).contiguous();
    const double* hp = hv.data_ptr<double>();
    if (rows) {
      const auto q =
          reference::quantize_blockwise(reference::MatrixRef<double>::row_major(hp, m, n), 1, 128);
      put_codes(q, h);
      put_row_scales(q, hs);
    }
    if (transposed) {
      const auto q =
          reference::quantize_blockwise(reference::MatrixRef<double>::transposed(hp, n, m), 1, 128);
      h_t.zero_();
      put_codes(q, h_t);
      put_row_scales(q, h_ts);
    }
    const Tensor s = tensor(f.partials, f.layout.tiles, f.layout.extent)
                         .to(act == at::kDouble ? at::kDouble : at::kFloat);
    return {x, h, hs, h_t, h_ts, s};
  }
#if CODA_TORCH_CUDA
  const c10::cuda::CUDAGuard guard(a.device());
  TORCH_CHECK(act == at::kBFloat16, op, ": residual must be bfloat16 on CUDA, got ", act);
  const Tensor x = at::empty({m, n}, residual.options());
  const auto l = ops::fp8_residual_rmsnorm_partials_layout(m, n, k);
  const Tensor s = at::empty({l.tiles, l.extent}, scale_options(a));
  const TensorView absent{};
  ops::gemm_fp8_residual_rmsnorm(
      codes_view(a), scales_view(a_scales), codes_view(w), scales_view(w_scales),
      view(residual, DType::kBF16),
      TensorView::vector(gamma.data_ptr(), DType::kBF16, n, gamma.device().index()),
      view(x, DType::kBF16), rows ? codes_view(h) : absent, rows ? scales_view(hs) : absent,
      transposed ? codes_view(h_t) : absent, transposed ? scales_view(h_ts) : absent,
      view(s, DType::kF32), stream_of(a));
  return {x, h, hs, h_t, h_ts, s};
#else
  TORCH_CHECK(false, op, ": this build has no CUDA kernels");
#endif
}

// Benchmarks' kernel sweeps: kernel::set_kernel_overrides (CODA_KERNEL_OVERRIDE's syntax).
void set_kernel_overrides(c10::string_view spec) {
#if CODA_TORCH_CUDA
  kernel::set_kernel_overrides(std::string(spec));
#else
  TORCH_CHECK(false, "coda::set_kernel_overrides: this build has no CUDA kernels");
#endif
}

namespace names {
inline constexpr char overrides[] = "coda::set_kernel_overrides";
inline constexpr char quantize_rows[] = "coda::fp8_quantize_rows";
inline constexpr char quantize_blocks[] = "coda::fp8_quantize_blocks";
inline constexpr char gemm_blocks[] = "coda::fp8_gemm";
inline constexpr char gemm_xyt[] = "coda::fp8_gemm_xyt";
inline constexpr char gemm_xyt_acc[] = "coda::fp8_gemm_xyt_accumulate_";
inline constexpr char residual_rmsnorm[] = "coda::fp8_gemm_residual_rmsnorm";
}  // namespace names

void register_fp8(torch::Library& m) {
  m.impl("fp8_quantize_rows", CODA_GUARDED(names::quantize_rows, fp8_quantize_rows));
  m.impl("fp8_quantize_blocks", CODA_GUARDED(names::quantize_blocks, fp8_quantize_blocks));
  m.impl("fp8_gemm", CODA_GUARDED(names::gemm_blocks, fp8_gemm));
  m.impl("fp8_gemm_xyt", CODA_GUARDED(names::gemm_xyt, fp8_gemm_xyt));
  m.impl("fp8_gemm_xyt_accumulate_", CODA_GUARDED(names::gemm_xyt_acc, fp8_gemm_xyt_accumulate_));
  m.impl("fp8_gemm_residual_rmsnorm",
         CODA_GUARDED(names::residual_rmsnorm, fp8_gemm_residual_rmsnorm));
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(coda, m) {
  m.def(
      "fp8_quantize_rows(Tensor x, bool rows=True, bool transposed=False) "
      "-> (Tensor codes, Tensor scales, Tensor codes_t, Tensor scales_t)");
  m.def(
      "fp8_quantize_blocks(Tensor w, bool rows=True, bool transposed=False) "
      "-> (Tensor codes, Tensor scales, Tensor codes_t, Tensor scales_t)");
  m.def("fp8_gemm(Tensor x, Tensor x_scales, Tensor w, Tensor w_scales) -> Tensor");
  m.def("fp8_gemm_xyt(Tensor x, Tensor x_scales, Tensor y, Tensor y_scales) -> Tensor");
  m.def(
      "fp8_gemm_xyt_accumulate_(Tensor(a!) d, Tensor x, Tensor x_scales, Tensor y, "
      "Tensor y_scales) -> ()");
  m.def(
      "fp8_gemm_residual_rmsnorm(Tensor a, Tensor a_scales, Tensor w, Tensor w_scales, "
      "Tensor residual, Tensor gamma, bool rows=True, bool transposed=False) -> (Tensor x, "
      "Tensor h, Tensor h_scales, Tensor h_t, Tensor h_t_scales, Tensor sumsq_partials)");
  m.def("set_kernel_overrides(str spec) -> ()",
        CODA_GUARDED(names::overrides, set_kernel_overrides));
}

TORCH_LIBRARY_IMPL(coda, CPU, m) { register_fp8(m); }
#if CODA_TORCH_CUDA
TORCH_LIBRARY_IMPL(coda, CUDA, m) { register_fp8(m); }
#endif

}  // namespace coda::torch_ext
