#pragma once
// What the FP8 casts and GEMMs (fp8_ops.cpp) and the FP8 programs (fp8_programs.cpp) share: the
// input and operand checks, the tensors of the scale layouts, the CPU reference's readers and
// writers of those layouts, and the CUDA views. Codes are torch.float8_e4m3fn tensors; scales
// fp32 as in ops.hpp: a 1x128-blocked (rows, cols) tensor has (ceil(cols / 128), rows) scales
// whose row stride is rows rounded up to 4 (a view of that storage), a 128x128-blocked one
// (ceil(rows / 128), ceil(cols / 128)).
#include <ATen/ATen.h>

#include <cstdint>
#include <tuple>
#include <vector>

#include "checks.hpp"
#include "coda/kernel/args.hpp"
#include "coda/reference/fp8.hpp"
#if CODA_TORCH_CUDA
#include <c10/cuda/CUDAStream.h>

#include "coda/ops.hpp"
#endif

namespace coda::torch_ext::fp8_detail {

using at::Tensor;
using kernel::ScaleLayout;
using Quantized = std::tuple<Tensor, Tensor, Tensor, Tensor>;

inline int64_t blocks(int64_t n) { return ScaleLayout::blocks(n); }

// The high-precision input of a cast: bf16 on CUDA; float32, float64 or bf16 on the CPU (and on
// the Meta device, which stands for either).
inline void check_input(const char* op, const char* name, const Tensor& x) {
  TORCH_CHECK(x.defined(), op, ": ", name, " is undefined");
  TORCH_CHECK(x.is_cpu() || x.is_cuda() || x.is_meta(), op, ": ", name, " is on ", x.device(),
              "; coda ops run on CPU or CUDA");
  const auto t = x.scalar_type();
  const bool wide_ok = x.is_cpu() || x.is_meta();
  TORCH_CHECK(t == at::kBFloat16 || (wide_ok && (t == at::kFloat || t == at::kDouble)), op, ": ",
              name, " must be bfloat16", wide_ok ? " (or float32 / float64 on the CPU)" : "",
              ", got ", t);
  TORCH_CHECK(x.dim() == 2 && x.numel() > 0, op, ": ", name, " must be a non-empty matrix, got ",
              shape_string(x.sizes()));
  TORCH_CHECK(x.size(1) % 16 == 0, op, ": ", name,
              "'s columns must be a multiple of 16 (16-byte rows of e4m3), got ", x.size(1));
  TORCH_CHECK(x.is_contiguous(), op, ": ", name, " must be contiguous, got strides ",
              shape_string(x.strides()));
}

inline at::TensorOptions codes_options(const Tensor& like) {
  return at::TensorOptions().dtype(at::kFloat8_e4m3fn).device(like.device());
}
inline at::TensorOptions scale_options(const Tensor& like) {
  return at::TensorOptions().dtype(at::kFloat).device(like.device());
}
inline Tensor none(const Tensor& like) { return at::empty({0}, scale_options(like)); }

// The outputs of a cast of a (rows, cols) tensor, uninitialized, in the layouts above (1x128
// blocks, or 128x128 with `tiles`; the ones not asked for empty): what the casts and the FP8
// programs write into, and what the Meta kernels return. Sizes may be symbolic, so
// torch.compile's fake tensors trace through the FP8 ops at dynamic shapes.
inline Quantized empty_quantized_outputs(const Tensor& like, const c10::SymInt& rows,
                                         const c10::SymInt& cols, bool want_rows, bool transposed,
                                         bool tiles = false) {
  constexpr int64_t b = ScaleLayout::kBlock;
  const auto blocks_of = [](const c10::SymInt& n) { return (n + (b - 1)) / b; };
  Tensor codes = none(like), scales = none(like), codes_t = none(like), scales_t = none(like);
  if (want_rows) {
    codes = at::empty_symint({rows, cols}, codes_options(like));
    scales = tiles ? at::empty_symint({blocks_of(rows), blocks_of(cols)}, scale_options(like))
                   : at::empty_symint({blocks_of(cols), (rows + 3) / 4 * 4}, scale_options(like))
                         .narrow_symint(1, 0, rows);  // row_scales_ld(rows) wide storage
  }
  if (transposed) {
    codes_t = tiles ? at::empty_symint({cols, rows}, codes_options(like))
                    : at::empty_symint({cols, (rows + 15) / 16 * 16},  // padded_tokens(rows)
                                       codes_options(like));
    scales_t = tiles ? at::empty_symint({blocks_of(cols), blocks_of(rows)}, scale_options(like))
                     : at::empty_symint({blocks_of(rows), cols}, scale_options(like));
  }
  return {codes, scales, codes_t, scales_t};
}

// ---- the CPU reference: from BlockQuantized to the kernels' layouts and back ----------------
inline std::vector<float> as_floats(const Tensor& x) {
  const Tensor f = x.to(at::kFloat).contiguous();
  return std::vector<float>(f.data_ptr<float>(), f.data_ptr<float>() + f.numel());
}
inline void put_codes(const reference::BlockQuantized& q, Tensor& codes) {
  auto* dst = reinterpret_cast<uint8_t*>(codes.data_ptr());
  for (int64_t i = 0; i < q.rows; ++i)
    for (int64_t j = 0; j < q.cols; ++j) dst[i * codes.stride(0) + j] = q.code_at(i, j);
}
// 1x128 scales of q (rows, cols) into (KB, rows): entry (kb, r) at kb · ld + r; rows past q up to
// the storage's width get 1, as the CUDA kernel writes them.
inline void put_row_scales(const reference::BlockQuantized& q, Tensor& scales) {
  auto* dst = scales.data_ptr<float>();
  const int64_t ld = scales.stride(0), width = ld;
  for (int64_t kb = 0; kb < q.grid_cols(); ++kb)
    for (int64_t r = 0; r < width; ++r)
      dst[kb * ld + r] = r < q.rows ? q.scale_at(r, kb * q.block_cols) : 1.0f;
}
inline void put_block_scales(const reference::BlockQuantized& q, Tensor& scales) {
  auto* dst = scales.data_ptr<float>();
  for (int64_t i = 0; i < q.grid_rows(); ++i)
    for (int64_t j = 0; j < q.grid_cols(); ++j)
      dst[i * scales.stride(0) + j] = q.scales[i * q.grid_cols() + j];
}
inline reference::BlockQuantized read_operand(const Tensor& codes, const Tensor& scales,
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
inline TensorView view(const Tensor& t, DType d) {
  TORCH_CHECK(t.dim() == 2 && (t.size(1) <= 1 || t.stride(1) == 1),
              "coda: expected a row-major matrix, got sizes ", t.sizes(), " strides ", t.strides());
  return TensorView::matrix(t.data_ptr(), d, t.size(0), t.size(1), t.stride(0), t.device().index());
}
inline TensorView codes_view(const Tensor& t) { return view(t, DType::kE4M3); }
inline TensorView scales_view(const Tensor& t) { return view(t, DType::kF32); }
inline cudaStream_t stream_of(const Tensor& t) {
  return c10::cuda::getCurrentCUDAStream(t.device().index()).stream();
}
#endif

// An operand: e4m3 codes (rows, k) with rows-major storage and its fp32 scales, on one device.
inline void check_operand(const char* op, const char* name, const Tensor& codes, const char* sname,
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
inline void check_scale_shape(const char* op, const char* name, const Tensor& s, int64_t rows,
                              int64_t cols) {
  TORCH_CHECK(s.size(0) == rows && s.size(1) == cols, op, ": ", name, " must have shape (", rows,
              ", ", cols, "), got ", shape_string(s.sizes()));
  if (s.is_cpu())  // the reference reads the storage the CUDA kernels would
    TORCH_CHECK(s.stride(0) >= cols, op, ": ", name, "'s row stride must be >= ", cols);
}

// An FP8 GEMM's operand pair, checked: `x_name` (M, K) in 1x128 blocks, `w_name` (N, K) in
// 128x128 blocks when `w_blocks`, else 1x128, with their scales; returns (M, N, K).
inline std::tuple<int64_t, int64_t, int64_t> check_pair(const char* op, const char* x_name,
                                                        const Tensor& x, const char* xs_name,
                                                        const Tensor& xs, const Tensor& w,
                                                        const Tensor& ws, bool w_blocks,
                                                        const char* w_name = "w",
                                                        const char* ws_name = "w_scales") {
  check_operand(op, x_name, x, xs_name, xs, x);
  check_operand(op, w_name, w, ws_name, ws, x);
  TORCH_CHECK(x.size(1) == w.size(1), op, ": ", x_name, " is ", shape_string(x.sizes()), " and ",
              w_name, " is ", shape_string(w.sizes()), ": their K differ");
  const int64_t m = x.size(0), n = w.size(0), k = x.size(1);
  check_scale_shape(op, xs_name, xs, blocks(k), m);
  if (w_blocks)
    check_scale_shape(op, ws_name, ws, blocks(n), blocks(k));
  else
    check_scale_shape(op, ws_name, ws, blocks(k), n);
  return {m, n, k};
}

}  // namespace coda::torch_ext::fp8_detail
