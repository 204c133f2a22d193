#pragma once
// The standalone FP8 cast kernels (src/quantize.cu): one pass over a bf16 matrix that writes its
// blockwise e4m3 codes and scales (docs/math.md §6) in the layouts the FP8 GEMMs read
// (args.hpp ScaleLayout), for the tensors no GEMM epilogue produces (the attention output, the
// embedding output, the weights once per optimizer step). Every value goes through
// epilogue::E4m3, as on the host.

#include <cuda_runtime.h>

#include <cstdint>

#include "coda/kernel/args.hpp"

namespace coda::kernel {

// x (rows, cols) bf16 row-major (row stride ldx), cols a multiple of 16.
//   out (if codes is set): codes (rows, cols), 1x128 blocks along cols; the scale of row r's
//     block cb at cb · ld_scales + r, for r < rows rounded up to 4 (scale 1 past x), so
//     ld_scales >= that.
//   out_t (if codes is set): codes (cols, rows) = the 128x1 blocks of xᵀ, i.e. 1x128 blocks along
//     rows of xᵀ; the scale of xᵀ's row c, block rb at rb · ld_scales + c. Columns rows ..
//     round_up(rows, 16) - 1 of the codes are written 0, so a GEMM may contract over the padded
//     extent (16-byte TMA rows).
void quantize_fp8_rows(const bf16* x, int64_t rows, int64_t cols, int64_t ldx, Fp8Output out,
                       Fp8Output out_t, cudaStream_t stream);

// a = silu(g)·u of z (rows, 2·cols) bf16 interleaved (g, u) pairs, row stride ldz (F2's saved
// pre-activation), each a rounded to bf16 (as the bf16 B2 recomputes a), cols a multiple of 16:
// a's transposed copy out_t exactly as quantize_fp8_rows writes it for that a (the
// down-projection's weight-gradient operand, when the forward did not keep it).
void quantize_fp8_swiglu_t(const bf16* z, int64_t rows, int64_t cols, int64_t ldz, Fp8Output out_t,
                           cudaStream_t stream);
// The same from z saved in FP8: codes (rows, 2·cols), row stride ldz bytes, and their 1x128
// scales (block b of row r at b · ld_z_scales + r); each value decoded and rounded to bf16, so
// out_t is quantize_fp8_swiglu_t's of the decoded z in bf16, bit for bit.
void quantize_fp8_swiglu_t_fp8_z(const uint8_t* z, int64_t rows, int64_t cols, int64_t ldz,
                                 const float* z_scales, int64_t ld_z_scales, Fp8Output out_t,
                                 cudaStream_t stream);

// The FP8 programs' elementwise halves as passes of their own (src/fp8_passes.cu).
// B2's elementwise half, for a B2 split into a plain FP8 GEMM (da = dx_out · W_down in bf16) and
// this pass: dz = dSwiGLU(z, da) (rows, 2·inter) from da (rows, inter) bf16 (start and row stride
// 16-byte aligned) and z's interleaved (g, u) pairs, bf16 (z_scales null; row stride ldz
// elements, 16-byte aligned) or e4m3 codes (row stride ldz bytes, a multiple of 16) with their
// 1x128 scales (block b of row r at b · ld_z_scales + r; each value decoded and rounded to bf16
// first), inter a multiple of 8: dz rounded to bf16 and quantized as quantize_fp8_rows would
// quantize it (out: 1x128 blocks, out_t: the transposed copy; either may be left out), and the ZdZ
// partials Σ g·dg + u·du per row and 128x128 tile of dz, i.e. 64 columns of da
// (PartialLayout::per_row(rows, inter, 128, 64): tile t of row r at t · ld_partials + r; rows past
// `rows` not written). copy (optional, tests): dz's bf16 values as staged, row stride ld_copy.
void swiglu_backward_quantize_fp8(const bf16* da, int64_t ldda, const void* z, int64_t ldz,
                                  const float* z_scales, int64_t ld_z_scales, int64_t rows,
                                  int64_t inter, Fp8Output out, Fp8Output out_t, float* partials,
                                  int64_t ld_partials, cudaStream_t stream, bf16* copy = nullptr,
                                  int64_t ld_copy = 0);

// F2's elementwise half with z saved in FP8, for an F2 split into a plain FP8 GEMM (y = h ·
// w_guᵀ (rows, 2·inter) in bf16, interleaved (g, u) columns, 16-byte aligned start and row
// stride) and this pass, inter a multiple of 16: z = r ⊙ y (r (rows) fp32) rounded to bf16 and
// quantized in 1x128 blocks (z_out, required: the codes gemm_fp8_rmsnorm_swiglu_fp8_z writes);
// a = silu(z_g)·z_u (rows, inter) from the unrounded z, rounded to bf16 and quantized as
// quantize_fp8_rows would quantize it (out, out_t; either may be left out). copy (optional,
// tests): a's bf16 values, row stride ld_copy.
void rmsnorm_swiglu_quantize_fp8(const bf16* y, int64_t ldy, const float* r, int64_t rows,
                                 int64_t inter, Fp8Output z_out, Fp8Output out, Fp8Output out_t,
                                 cudaStream_t stream, bf16* copy = nullptr, int64_t ld_copy = 0);

// B1's elementwise half, for a B1 split into a plain FP8 GEMM (g = dz · W in bf16) and this
// pass, all (rows, cols) bf16 matrices with 16-byte aligned starts and row strides, cols a
// multiple of 16: dx = dres + r·(g·γ − x·r·ZdZ) (dres null: none; dx may alias dres), h_out =
// x·r·γ rounded to bf16 and quantized as quantize_fp8_rows would quantize its transposed copy
// (out_t), and the dγ partials Σ g·x·r per column and 128-row tile
// (PartialLayout::per_column(rows, cols, 128, 128): tile t of column n at t · ld_partials + n;
// columns past `cols` not written). r, zdz (rows) fp32, gamma (cols) bf16.
void rmsnorm_backward_quantize_fp8(const bf16* g, int64_t ldg, const bf16* x, int64_t ldx,
                                   const bf16* dres, int64_t ld_dres, const float* r,
                                   const bf16* gamma, const float* zdz, int64_t rows, int64_t cols,
                                   bf16* dx, int64_t lddx, Fp8Output out_t, float* partials,
                                   int64_t ld_partials, cudaStream_t stream);

// B3's RoPE backward and the cast of its output in one pass, for the FP8 norm+QKV backward
// without a bias: dpre = Rᵀ·dqkv (rows, cols) from y = qkv and dy = dqkv (bf16, 16-byte aligned
// starts and row strides), pos (rows) int32 and each column's fixed-point frequency (freq_hi,
// freq_lo: cols entries; a pair's at its first column), cols a multiple of 16: dpre rounded to
// bf16 and quantized as quantize_fp8_rows would quantize it (out, out_t; either may be left
// out), i.e. rope_backward's dqkv_pre cast; and the ZdZ partials Σ qkv·dqkv per row and
// 128-column tile (PartialLayout::per_row(rows, cols, 128, 128): tile t of row r at
// t · ld_partials + r; rows past `rows` not written), whose fold over the tiles / hidden is
// rope_backward's zdz up to fp32 summation order. copy (optional, tests): dpre's bf16 values.
void rope_backward_quantize_fp8(const bf16* y, int64_t ldy, const bf16* dy, int64_t lddy,
                                const int32_t* pos, const uint32_t* freq_hi,
                                const uint32_t* freq_lo, int64_t rows, int64_t cols, Fp8Output out,
                                Fp8Output out_t, float* partials, int64_t ld_partials,
                                cudaStream_t stream, bf16* copy = nullptr, int64_t ld_copy = 0);

// x (rows, cols) bf16 in 128x128 blocks (weights), cols a multiple of 16; one scale per block.
//   out (if codes is set): codes (rows, cols); the scale of block (rb, cb) at rb · ld_scales + cb.
//   out_t (if codes is set): codes (cols, rows) = xᵀ with the same blocks transposed; block
//     (cb, rb)'s scale at cb · ld_scales + rb. Rows must be a multiple of 16 when out_t is set.
void quantize_fp8_blocks(const bf16* x, int64_t rows, int64_t cols, int64_t ldx, Fp8Output out,
                         Fp8Output out_t, cudaStream_t stream);

// The transpose of a 128x128-blocked matrix as quantize_fp8_blocks writes it (codes (rows, cols),
// row stride ld; block (rb, cb)'s scale at rb · ld_scales + cb), rows and cols multiples of 16:
// out_t = codesᵀ (cols, rows) with block (cb, rb)'s scale at cb · out_t.ld_scales + rb, bit for
// bit quantize_fp8_blocks' out_t of the matrix the codes came from (the blocks are the same, so
// are their amaxes). A pass over bytes, through shared memory in 64x64 tiles.
void transpose_fp8_blocks(const uint8_t* codes, int64_t rows, int64_t cols, int64_t ld,
                          const float* scales, int64_t ld_scales, Fp8Output out_t,
                          cudaStream_t stream);

}  // namespace coda::kernel
