#pragma once
// The FP8 programs of torch/fp8_ops.cpp as functions, for the backends the FP8 block
// compositions run on (torch/backends.hpp). Each runs on its tensors' device: the host oracle
// in fp64 on the CPU, rounded to the activation dtype and cast by the recipe; the Hopper kernels
// on CUDA. Quantized outputs come as (codes, scales, codes_t, scales_t) in the layouts of
// fp8_quantize_rows (docs/torch-ops.md), the ones not asked for empty.

#include <ATen/ATen.h>

#include <tuple>

#include "coda/programs/forward.hpp"

namespace coda::torch_ext::fp8 {

using at::Tensor;
using Quantized = std::tuple<Tensor, Tensor, Tensor, Tensor>;
using Fp8F1 = std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor>;
using Fp8F2 = std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor>;
using Fp8B1 = std::tuple<Tensor, Tensor, Tensor, Tensor>;
using Fp8B2 = std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor>;

// The uninitialized outputs of a (rows, cols) tensor quantized as quantize_rows writes it, on
// like's device (Meta included; sizes may be symbolic); the ones not wanted empty.
Quantized empty_quantized(const Tensor& like, const c10::SymInt& rows, const c10::SymInt& cols,
                          bool want_rows, bool transposed);
// x (rows, cols) in 1x128 blocks (`rows`) and as its transposed 128x1 copy (`transposed`).
Quantized quantize_rows(const Tensor& x, bool rows, bool transposed);
// x (M, K) 1x128 · w (N, K) 128x128 -> (M, N) (bf16 on CUDA, fp64 on the CPU).
Tensor gemm(const Tensor& x, const Tensor& x_scales, const Tensor& w, const Tensor& w_scales);
// x (M, K) 1x128 · y (N, K) 1x128 -> (M, N): the weight gradient from the transposed copies.
Tensor gemm_xyt(const Tensor& x, const Tensor& x_scales, const Tensor& y, const Tensor& y_scales);
// F1: (x, h codes, h scales, h_t codes, h_t scales, Σx² partials).
Fp8F1 residual_rmsnorm(const Tensor& a, const Tensor& a_scales, const Tensor& w,
                       const Tensor& w_scales, const Tensor& residual, const Tensor& gamma,
                       bool rows, bool transposed);
// F1 with h in residual's dtype: (x, h, Σx² partials).
std::tuple<Tensor, Tensor, Tensor> residual_rmsnorm_act_h(const Tensor& a, const Tensor& a_scales,
                                                          const Tensor& w, const Tensor& w_scales,
                                                          const Tensor& residual,
                                                          const Tensor& gamma);
// F2: (z, a codes, a scales, a_t codes, a_t scales), z and a (before the cast) in `act`.
Fp8F2 rmsnorm_swiglu(const Tensor& h, const Tensor& h_scales, const Tensor& w_gu,
                     const Tensor& w_gu_scales, const Tensor& r, bool rows, bool transposed,
                     at::ScalarType act);
// F3: qkv in `act`; b_qkv undefined for none.
Tensor rmsnorm_rope(const Tensor& h, const Tensor& h_scales, const Tensor& w_qkv,
                    const Tensor& w_qkv_scales, const Tensor& r, const Tensor& b_qkv,
                    const Tensor& pos, const Tensor& rope_table, at::ScalarType act);
// F3q: (qkv, qk_pre) in `act`.
std::tuple<Tensor, Tensor> rmsnorm_qk_norm_rope(const Tensor& h, const Tensor& h_scales,
                                                const Tensor& w_qkv, const Tensor& w_qkv_scales,
                                                const Tensor& r, const Tensor& q_gamma,
                                                const Tensor& k_gamma, const programs::QkNorm& qk,
                                                const Tensor& pos, const Tensor& rope_table,
                                                at::ScalarType act);
// B1: (dx, h_out's transposed copy: codes, scales; dγ partials), h_out = x·r·γ.
Fp8B1 rmsnorm_backward(const Tensor& dz, const Tensor& dz_scales, const Tensor& w_t,
                       const Tensor& w_t_scales, const Tensor& x, const Tensor& r,
                       const Tensor& gamma, const Tensor& zdz, const Tensor& dres);
// F2 with z saved in FP8: (z codes, z scales, a codes, a scales, a_t codes, a_t scales), z and a
// rounded to `act` before their casts.
using Fp8F2Z = std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor>;
Fp8F2Z rmsnorm_swiglu_fp8_z(const Tensor& h, const Tensor& h_scales, const Tensor& w_gu,
                            const Tensor& w_gu_scales, const Tensor& r, bool rows, bool transposed,
                            at::ScalarType act);
// a = silu(g)·u of z (M, 2I), rounded to z's dtype (z saved in FP8, z_scales defined: to
// `act`), as its transposed 128x1 copy (codes, scales).
std::tuple<Tensor, Tensor> swiglu_quantize_t(const Tensor& z, const Tensor& z_scales,
                                             at::ScalarType act);
// B2: (dz codes, dz scales, dz_t codes, dz_t scales, ZdZ partials); z as swiglu_quantize_t's.
Fp8B2 swiglu_backward(const Tensor& dx_out, const Tensor& dx_out_scales, const Tensor& w_down_t,
                      const Tensor& w_down_t_scales, const Tensor& z, const Tensor& z_scales,
                      bool rows, bool transposed, at::ScalarType act);

}  // namespace coda::torch_ext::fp8
