// The FP8 programs' elementwise halves as passes of their own after a plain FP8 GEMM (kernel/
// quantize.hpp: B2's swiglu_backward_quantize_fp8, F2's rmsnorm_swiglu_quantize_fp8 with z in FP8,
// B1's rmsnorm_backward_quantize_fp8) and B3 with the cast of its output
// (rope_backward_quantize_fp8): one CTA per 128x128 tile, inputs brought into shared memory, the
// outputs' codes quantized by the cast's tile passes (fp8_tile.cuh) so that they are the cast
// kernel's of the bf16 values staged.
#include <cuda_bf16.h>

#include <cstdint>

#include "coda/common/check.hpp"
#include "coda/epilogue/elementwise.hpp"
#include "coda/epilogue/fp8.hpp"
#include "coda/kernel/cuda_check.hpp"
#include "coda/kernel/fp8_tile.cuh"
#include "coda/kernel/quantize.hpp"
#include "coda/programs/formulas.hpp"
#include "coda/programs/rope.hpp"
#include "quantize_tiles.cuh"

namespace coda::kernel {
namespace {

using epilogue::E4m3;
using fp8_tile::Blocks;
using fp8_tile::kThreads;
using fp8_tile::kTile;
using tiles::check_output;
using tiles::check_outputs;
using tiles::check_rows16;
using tiles::commit_and_wait;
using tiles::commit_async_copies;
using tiles::copy16_async;
using tiles::copy4_async;
using tiles::InputScales;
using tiles::launch_tile_kernel;
using tiles::store_row_partial;
using tiles::wait_async_copies;

// B2's pass: shared memory past the staged dz tile. da's 128x64 tile (the 64 columns of da whose
// (dg, du) pairs are the tile's 128 columns of dz), rows kDaPitch elements apart; from an FP8 z,
// its 128x128 codes, rows kCodePitch bytes apart, and the 128 rows' block scales. A bf16 z is
// brought into the staging itself, which dz then overwrites in place.
constexpr int kDaPitch = kTile / 2 + 8;  // 144 bytes: 8 lanes' 16-byte reads on distinct banks
constexpr int kCodePitch = kTile + 16;
constexpr int kSwigluBackwardSmem = fp8_tile::kSmemBytes + kTile * kDaPitch * 2;
constexpr int kSwigluBackwardFp8ZSmem =
    kSwigluBackwardSmem + kTile * kCodePitch + kTile * int(sizeof(float));

// B2's epilogue as a pass of its own (kernel/quantize.hpp swiglu_backward_quantize_fp8): one CTA
// per 128x128 tile of dz, i.e. 128 rows of 64 columns of da and 128 of z. The inputs come into
// shared memory by cp.async with no registers held in flight (64 registers a thread: 4 CTAs an
// SM from a bf16 z, 3 from an FP8 one, whose loads overlap the others' math and stores). A chunk
// is 8 columns of dz: 4 of da, 8 of z; 16 lanes (a half-warp) cover a row. dz is rounded to bf16
// in the staging and quantized from there by the cast's passes, so its codes are the cast
// kernel's of those bf16 values; ZdZ sums g·dg + u·du over the tile's 128 columns of dz in fp32
// from the unrounded dg, du, as the fused epilogue does.
template <bool kFp8Z>
__global__ void __launch_bounds__(kThreads)
    swiglu_backward_tile_kernel(const bf16* __restrict__ da, int64_t ldda,
                                const void* __restrict__ z, int64_t ldz, InputScales zs,
                                int64_t rows, int64_t cols, Fp8Output out, Fp8Output out_t,
                                float* __restrict__ partials, int64_t ld_partials, bf16* copy,
                                int64_t ld_copy) {
  using fp8_tile::kPitch;
  extern __shared__ __align__(16) unsigned char smem[];
  const fp8_tile::Staged staged = fp8_tile::staged(smem);
  bf16* const da_tile = reinterpret_cast<bf16*>(smem + fp8_tile::kSmemBytes);
  uint8_t* const codes = smem + kSwigluBackwardSmem;
  float* const row_scale = reinterpret_cast<float*>(codes + kTile * kCodePitch);
  const fp8_tile::TilePlace t = fp8_tile::place(blockIdx.y, blockIdx.x, rows, cols);
  constexpr int kChunks = kTile * kTile / 8 / kThreads;  // 8: rows threadIdx.x / 16 + 16 j

  // da: 8 16-byte pieces a row, 4 a thread. cols_here is a multiple of 16, so a piece (8 columns
  // of da, 16 of dz) is wholly in or out; pieces outside are zeros.
#pragma unroll
  for (int j = 0; j < kChunks / 2; ++j) {
    const int i = threadIdx.x + j * kThreads, r = i / 8, c = i % 8 * 8;
    const bool in = r < t.rows_here && 2 * c < t.cols_here;
    copy16_async(da_tile + r * kDaPitch + c, in ? da + (t.row0 + r) * ldda + t.col0 / 2 + c : da,
                 in ? 16 : 0);
  }
  if constexpr (kFp8Z) {
    const uint8_t* zc = static_cast<const uint8_t*>(z);
#pragma unroll
    for (int j = 0; j < kChunks / 2; ++j) {
      const int i = threadIdx.x + j * kThreads, r = i / 8, c = i % 8 * 16;
      const bool in = r < t.rows_here && c < t.cols_here;
      copy16_async(codes + r * kCodePitch + c, in ? zc + (t.row0 + r) * ldz + t.col0 + c : zc,
                   in ? 16 : 0);
    }
    if (threadIdx.x < kTile) {
      const bool in = int(threadIdx.x) < t.rows_here;
      copy4_async(row_scale + threadIdx.x,
                  in ? zs.scales + t.tile_col * zs.ld + t.row0 + threadIdx.x : zs.scales,
                  in ? 4 : 0);
    }
  } else {
    const bf16* zb = static_cast<const bf16*>(z);
#pragma unroll
    for (int j = 0; j < kChunks; ++j) {
      const int i = threadIdx.x + j * kThreads, r = i / 16, c = i % 16 * 8;
      const bool in = r < t.rows_here && c < t.cols_here;
      copy16_async(staged.tile + r * kPitch + c, in ? zb + (t.row0 + r) * ldz + t.col0 + c : zb,
                   in ? 16 : 0);
    }
  }
  wait_async_copies();
  __syncthreads();

#pragma unroll 2
  for (int j = 0; j < kChunks; ++j) {
    const int i = threadIdx.x + j * kThreads, r = i / 16, c = i % 16 * 8;
    const uint2 dv = *reinterpret_cast<const uint2*>(da_tile + r * kDaPitch + c / 2);
    uint32_t zwords[4];
    if constexpr (kFp8Z) {
      const uint2 cv = *reinterpret_cast<const uint2*>(codes + r * kCodePitch + c);
      zwords[0] = cv.x;
      zwords[1] = cv.y;
    } else {
      const uint4 zv = *reinterpret_cast<const uint4*>(staged.tile + r * kPitch + c);
      zwords[0] = zv.x;
      zwords[1] = zv.y;
      zwords[2] = zv.z;
      zwords[3] = zv.w;
    }
    const uint32_t dwords[2] = {dv.x, dv.y};
    uint4 d;
    uint32_t* dz = reinterpret_cast<uint32_t*>(&d);
    float part = 0.0f;
#pragma unroll
    for (int q = 0; q < 4; ++q) {  // pair q: da value q, z's (g, u) pair q
      float2 gu;
      if constexpr (kFp8Z) {
        // Decoded, then rounded to bf16 (exact but below 2^-133), as fp8_pair_decode does.
        const float s = row_scale[r];
        const float2 p = fp8_tile::decode2(uint16_t(zwords[q / 2] >> (16 * (q % 2))));
        gu = __bfloat1622float2(__floats2bfloat162_rn(p.x * s, p.y * s));
      } else {
        gu = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&zwords[q]));
      }
      const float dav =
          q % 2 ? fp8_tile::high_value(dwords[q / 2]) : fp8_tile::low_value(dwords[q / 2]);
      float dg, du, a;
      epilogue::SwiGluBackward{}(gu.x, gu.y, dav, dg, du, a);
      part += programs::PairDot{}(gu.x, gu.y, dg, du);
      const __nv_bfloat162 pair = __floats2bfloat162_rn(dg, du);
      dz[q] = *reinterpret_cast<const uint32_t*>(&pair);
    }
    // The half-warp holds row r's 128 columns of the tile: its sum is the row's partial.
    store_row_partial(part, partials + t.tile_col * ld_partials + t.row0 + r, r < t.rows_here);
    *reinterpret_cast<uint4*>(staged.tile + r * kPitch + c) = d;  // z's chunk, read above
    if (copy != nullptr && r < t.rows_here && c < t.cols_here)
      *reinterpret_cast<uint4*>(copy + (t.row0 + r) * ld_copy + t.col0 + c) = d;
  }
  __syncthreads();
  if (out.codes) fp8_tile::quantize_rows<Blocks::kRows>(staged, t, out, threadIdx.x);
  if (out_t.codes) fp8_tile::quantize_columns<Blocks::kRows>(staged, t, out_t, threadIdx.x);
}

// F2's pass: shared memory past the staged a tile. y's 128x256 tile (the 256 columns of y whose
// interleaved (g, u) pairs are the tile's 128 columns of a), rows kYPitch elements apart, then the
// rows' r.
constexpr int kYPitch = 2 * kTile + 8;  // 528 bytes: a warp's 16-byte reads of a row conflict-free
constexpr int kRmsnormSwigluSmem =
    fp8_tile::kSmemBytes + kTile * kYPitch * 2 + kTile * int(sizeof(float));

// F2's epilogue with z saved in FP8, as a pass of its own (kernel/quantize.hpp
// rmsnorm_swiglu_quantize_fp8): one CTA per 128 rows of one 128-column tile of a, i.e. 256
// columns of the plain GEMM's output y = h·w_guᵀ. y's tile comes into shared memory by cp.async
// in two groups of 64 rows, the second in flight while the first is computed, with no registers
// held in flight (two CTAs an SM by shared memory, one's loads under the other's math and
// stores). A chunk is 8 columns of y (16 bytes); a warp covers a row's 256, each half-warp one
// 128-column block of z, whose amax its shuffles find: z = r·y is rounded to bf16 and its codes
// written from registers. a = silu(z_g)·z_u from the unrounded z is rounded to bf16 and staged;
// its rows and transposed copy are quantized by the cast's passes.
__global__ void __launch_bounds__(kThreads)
    rmsnorm_swiglu_tile_kernel(const bf16* __restrict__ y, int64_t ldy, const float* __restrict__ r,
                               int64_t rows, int64_t inter, Fp8Output z_out, Fp8Output out,
                               Fp8Output out_t, bf16* copy, int64_t ld_copy) {
  using fp8_tile::kPitch;
  extern __shared__ __align__(16) unsigned char smem[];
  const fp8_tile::Staged staged = fp8_tile::staged(smem);
  bf16* const y_tile = reinterpret_cast<bf16*>(smem + fp8_tile::kSmemBytes);
  float* const row_r = reinterpret_cast<float*>(smem + fp8_tile::kSmemBytes + kTile * kYPitch * 2);
  constexpr int kRowChunks = 2 * kTile / 8;               // 32 chunks of y per row
  constexpr int kChunks = kTile * kRowChunks / kThreads;  // 16: rows threadIdx.x / 32 + 8 j
  const fp8_tile::TilePlace t = fp8_tile::place(blockIdx.y, blockIdx.x, rows, inter);  // a's tile
  const int lane = threadIdx.x % 32, c = lane * 8;  // the thread's 8 columns of y (4 of a)
  const bool cols_in = c / 2 < t.cols_here;         // cols_here: a multiple of 16
  const int64_t y_col = 2 * t.col0 + c;

  // Group j / 8: rows 64 (j / 8) .. 64 (j / 8) + 63; r's 128 values with the first.
  auto load = [&](int j) {
    const int row = threadIdx.x / 32 + (kThreads / 32) * j;
    const bool in = row < t.rows_here && cols_in;
    copy16_async(y_tile + row * kYPitch + c, in ? y + (t.row0 + row) * ldy + y_col : y,
                 in ? 16 : 0);
  };
#pragma unroll
  for (int j = 0; j < kChunks / 2; ++j) load(j);
  if (threadIdx.x < kTile) {
    const bool in = int(threadIdx.x) < t.rows_here;
    copy4_async(row_r + threadIdx.x, in ? r + t.row0 + threadIdx.x : r, in ? 4 : 0);
  }
  commit_async_copies();
#pragma unroll
  for (int j = kChunks / 2; j < kChunks; ++j) load(j);

  auto compute = [&](int j) {
    const int row = threadIdx.x / 32 + (kThreads / 32) * j;
    const uint4 v = *reinterpret_cast<const uint4*>(y_tile + row * kYPitch + c);
    const float rr = row_r[row];
    const uint32_t w[4] = {v.x, v.y, v.z, v.w};
    float zf[8];
    fp8_tile::Eight e;  // z in bf16, pairs
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      zf[2 * q] = rr * fp8_tile::low_value(w[q]);
      zf[2 * q + 1] = rr * fp8_tile::high_value(w[q]);
      const __nv_bfloat162 p = __floats2bfloat162_rn(zf[2 * q], zf[2 * q + 1]);
      e.p[q] = *reinterpret_cast<const uint32_t*>(&p);
    }
    // z's 1x128 block: this half-warp's 16 lanes (amax8: per-half maxima of the pairs).
    const uint32_t amax = fp8_tile::group_amax<16>(fp8_tile::amax8(e));
    const float sc = E4m3::scale(fp8_tile::as_amax(amax)), inv = E4m3::inverse(sc);
    const int64_t zrow = t.row0 + row;
    if (zrow < ScaleLayout::row_scales_ld(rows) && lane % 16 == 0 && cols_in)
      z_out.scales[y_col / kTile * z_out.ld_scales + zrow] = sc;
    if (row < t.rows_here && cols_in)
      *reinterpret_cast<uint2*>(z_out.codes + zrow * z_out.ld + y_col) = fp8_tile::encode8(e, inv);
    // a from the unrounded z, rounded to bf16 and staged (4 values, 8 bytes).
    uint2 a;
    uint32_t* aw = reinterpret_cast<uint32_t*>(&a);
#pragma unroll
    for (int q = 0; q < 2; ++q) {
      const __nv_bfloat162 p =
          __floats2bfloat162_rn(epilogue::SwiGlu{}(zf[4 * q], zf[4 * q + 1]),
                                epilogue::SwiGlu{}(zf[4 * q + 2], zf[4 * q + 3]));
      aw[q] = *reinterpret_cast<const uint32_t*>(&p);
    }
    *reinterpret_cast<uint2*>(staged.tile + row * kPitch + c / 2) = a;
    if (copy != nullptr && row < t.rows_here && cols_in)
      *reinterpret_cast<uint2*>(copy + (t.row0 + row) * ld_copy + t.col0 + c / 2) = a;
  };
  commit_and_wait<1>();  // the first group has landed; the second may still be in flight
  __syncthreads();
#pragma unroll 2
  for (int j = 0; j < kChunks / 2; ++j) compute(j);
  commit_and_wait<0>();
  __syncthreads();
#pragma unroll 2
  for (int j = kChunks / 2; j < kChunks; ++j) compute(j);
  __syncthreads();
  if (out.codes) fp8_tile::quantize_rows<Blocks::kRows>(staged, t, out, threadIdx.x);
  if (out_t.codes) fp8_tile::quantize_columns<Blocks::kRows>(staged, t, out_t, threadIdx.x);
}

// B1's pass: shared memory. g's, x's and (with dres) dres's 128x128 tiles, rows kPitch apart,
// then the rows' r and ZdZ. x's tile is the staging: h_out overwrites it in place.
constexpr int kTileBytes = fp8_tile::kSmemBytes;
constexpr int rmsnorm_backward_smem(bool dres) {
  return (dres ? 3 : 2) * kTileBytes + 2 * kTile * int(sizeof(float));
}

// B1's epilogue as a pass of its own (kernel/quantize.hpp rmsnorm_backward_quantize_fp8): one CTA
// per 128x128 tile of g. The inputs come into shared memory by cp.async with no registers held
// in flight (3 CTAs an SM without dres, 2 with it). A chunk is 8 columns of a row; the thread's
// 8 columns are the same in every chunk (256 threads, 16 chunks a row), so γ is loaded once and
// the dγ column sums stay in registers until the CTA's 16 row groups meet in shared memory (in
// g's tile, read by then). dx goes straight to global memory; h_out = x·r·γ is staged over x's
// tile and its transposed copy quantized by the cast's column pass.
template <bool kDres>
__global__ void __launch_bounds__(kThreads)
    rmsnorm_backward_tile_kernel(const bf16* __restrict__ g, int64_t ldg,
                                 const bf16* __restrict__ x, int64_t ldx, const bf16* dres,
                                 int64_t ld_dres, const float* __restrict__ r,
                                 const bf16* __restrict__ gamma, const float* __restrict__ zdz,
                                 int64_t rows, int64_t cols, bf16* dx, int64_t lddx,
                                 Fp8Output out_t, float* __restrict__ partials,
                                 int64_t ld_partials) {
  using fp8_tile::kPitch;
  extern __shared__ __align__(16) unsigned char smem[];
  bf16* const g_tile = reinterpret_cast<bf16*>(smem);
  const fp8_tile::Staged staged = fp8_tile::staged(smem + kTileBytes);  // x's tile, then h_out's
  bf16* const d_tile = reinterpret_cast<bf16*>(smem + 2 * kTileBytes);
  float* const r_row = reinterpret_cast<float*>(smem + (kDres ? 3 : 2) * kTileBytes);
  float* const zdz_row = r_row + kTile;
  constexpr int kChunks = kTile * kTile / 8 / kThreads;  // 8: rows threadIdx.x / 16 + 16 j
  constexpr int kRowGroups = kThreads / (kTile / 8);     // 16 threads share a thread's columns
  const fp8_tile::TilePlace t = fp8_tile::place(blockIdx.y, blockIdx.x, rows, cols);
  const int c = threadIdx.x % (kTile / 8) * 8, group = threadIdx.x / (kTile / 8);
  const bool cols_in = c < t.cols_here;  // cols_here is a multiple of 16: 8 columns in or out

  // Zeros outside the tensor (x and r 0 there: h_out 0, which the column pass needs).
#pragma unroll
  for (int j = 0; j < kChunks; ++j) {
    const int row = group + kRowGroups * j;
    const bool in = row < t.rows_here && cols_in;
    const int64_t m = t.row0 + row, n = t.col0 + c;
    copy16_async(g_tile + row * kPitch + c, in ? g + m * ldg + n : g, in ? 16 : 0);
    copy16_async(staged.tile + row * kPitch + c, in ? x + m * ldx + n : x, in ? 16 : 0);
    if constexpr (kDres)
      copy16_async(d_tile + row * kPitch + c, in ? dres + m * ld_dres + n : dres, in ? 16 : 0);
  }
  if (threadIdx.x < kTile) {
    const bool in = int(threadIdx.x) < t.rows_here;
    const int64_t m = t.row0 + threadIdx.x;
    copy4_async(r_row + threadIdx.x, in ? r + m : r, in ? 4 : 0);
    copy4_async(zdz_row + threadIdx.x, in ? zdz + m : zdz, in ? 4 : 0);
  }
  float gam[8], col_acc[8];
  {
    uint4 gv = make_uint4(0, 0, 0, 0);
    if (cols_in) gv = *reinterpret_cast<const uint4*>(gamma + t.col0 + c);
    const uint32_t w[4] = {gv.x, gv.y, gv.z, gv.w};
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      gam[e] = e % 2 ? fp8_tile::high_value(w[e / 2]) : fp8_tile::low_value(w[e / 2]);
      col_acc[e] = 0.0f;
    }
  }
  wait_async_copies();
  __syncthreads();

#pragma unroll 2
  for (int j = 0; j < kChunks; ++j) {
    const int row = group + kRowGroups * j;
    const fp8_tile::Eight gv = fp8_tile::load8(g_tile + row * kPitch + c);
    const fp8_tile::Eight xv = fp8_tile::load8(staged.tile + row * kPitch + c);
    fp8_tile::Eight dv = {{0, 0, 0, 0}};
    if constexpr (kDres) dv = fp8_tile::load8(d_tile + row * kPitch + c);
    const float rr = r_row[row], zz = zdz_row[row];
    uint4 dxv, hv;
    uint32_t* dxw = reinterpret_cast<uint32_t*>(&dxv);
    uint32_t* hw = reinterpret_cast<uint32_t*>(&hv);
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      float d2[2], h2[2];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int e = 2 * q + h;
        const float gf = h ? fp8_tile::high_value(gv.p[q]) : fp8_tile::low_value(gv.p[q]);
        const float xf = h ? fp8_tile::high_value(xv.p[q]) : fp8_tile::low_value(xv.p[q]);
        const float df = h ? fp8_tile::high_value(dv.p[q]) : fp8_tile::low_value(dv.p[q]);
        d2[h] = programs::RmsnormBackwardDx{}(gf, df, xf, rr, gam[e], zz);
        h2[h] = programs::NormalizedScaled{}(xf, rr, gam[e]);
        col_acc[e] += programs::GradTimesNormalized{}(gf, xf, rr);
      }
      const __nv_bfloat162 dp = __floats2bfloat162_rn(d2[0], d2[1]);
      const __nv_bfloat162 hp = __floats2bfloat162_rn(h2[0], h2[1]);
      dxw[q] = *reinterpret_cast<const uint32_t*>(&dp);
      hw[q] = *reinterpret_cast<const uint32_t*>(&hp);
    }
    *reinterpret_cast<uint4*>(staged.tile + row * kPitch + c) = hv;  // x's chunk, read above
    if (row < t.rows_here && cols_in)
      *reinterpret_cast<uint4*>(dx + (t.row0 + row) * lddx + t.col0 + c) = dxv;
  }
  __syncthreads();  // g's tile is read: the column sums go there
  float(*col_part)[kTile] = reinterpret_cast<float(*)[kTile]>(g_tile);
#pragma unroll
  for (int e = 0; e < 8; ++e) col_part[group][c + e] = col_acc[e];
  __syncthreads();
  if (threadIdx.x < kTile && threadIdx.x < t.cols_here) {
    float sum = 0.0f;
#pragma unroll
    for (int k = 0; k < kRowGroups; ++k) sum += col_part[k][threadIdx.x];
    partials[blockIdx.y * ld_partials + t.col0 + threadIdx.x] = sum;
  }
  fp8_tile::quantize_columns<Blocks::kRows>(staged, t, out_t, threadIdx.x);
}

// B3's RoPE backward with its output quantized, for the FP8 norm+QKV backward (kernel/quantize.hpp
// rope_backward_quantize_fp8): one CTA per 128x128 tile of qkv. A chunk is 8 columns (4 rotation
// pairs) of a row: 16 bytes of qkv and of dqkv; a thread's 8 columns are the same in every chunk
// (256 threads, 16 chunks a row), so its 4 pairs' frequencies are loaded once. dpre = Rᵀ·dqkv is
// computed as rope_backward's kernel computes it (aux_kernels.cu), rounded to bf16 and staged;
// its rows and transposed copy are quantized by the cast's passes, so the codes are the cast
// kernel's of rope_backward's output. ZdZ's partial Σ qkv·dqkv over the tile's columns of a row:
// the half-warp holding the row reduces it and its first lane writes it (one writer a row).
__global__ void __launch_bounds__(kThreads, 2)
    rope_backward_tile_kernel(const bf16* __restrict__ y, int64_t ldy, const bf16* __restrict__ dy,
                              int64_t lddy, const int32_t* __restrict__ pos,
                              const uint32_t* __restrict__ freq_hi,
                              const uint32_t* __restrict__ freq_lo, int64_t rows, int64_t cols,
                              Fp8Output out, Fp8Output out_t, float* __restrict__ partials,
                              int64_t ld_partials, bf16* copy, int64_t ld_copy) {
  using fp8_tile::kPitch;
  extern __shared__ __align__(16) unsigned char smem[];
  const fp8_tile::Staged staged = fp8_tile::staged(smem);
  constexpr int kChunks = kTile * kTile / 8 / kThreads;  // 8: rows threadIdx.x / 16 + 16 j
  constexpr int kGroup = 4;
  constexpr int kRowGroups = kThreads / (kTile / 8);  // 16 threads share a thread's columns
  const fp8_tile::TilePlace t = fp8_tile::place(blockIdx.y, blockIdx.x, rows, cols);
  const int c = threadIdx.x % (kTile / 8) * 8, group = threadIdx.x / (kTile / 8);
  const bool cols_in = c < t.cols_here;  // cols_here is a multiple of 16: 8 columns in or out
  programs::RopeFrequency freq[4];
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    const int64_t n = t.col0 + c + 2 * q;  // pair q's first column; its frequency's entry
    freq[q] = cols_in ? programs::RopeFrequency{freq_hi[n], freq_lo[n]} : programs::RopeFrequency{};
  }
#pragma unroll
  for (int j0 = 0; j0 < kChunks; j0 += kGroup) {
    uint4 yv[kGroup], gv[kGroup];
    int32_t p[kGroup];
#pragma unroll
    for (int k = 0; k < kGroup; ++k) {
      const int row = group + kRowGroups * (j0 + k);
      yv[k] = gv[k] = make_uint4(0, 0, 0, 0);
      p[k] = 0;
      if (row < t.rows_here && cols_in) {
        const int64_t m = t.row0 + row, n = t.col0 + c;
        yv[k] = *reinterpret_cast<const uint4*>(y + m * ldy + n);
        gv[k] = *reinterpret_cast<const uint4*>(dy + m * lddy + n);
        p[k] = pos[m];
      }
    }
#pragma unroll
    for (int k = 0; k < kGroup; ++k) {
      const int row = group + kRowGroups * (j0 + k);
      const uint32_t yw[4] = {yv[k].x, yv[k].y, yv[k].z, yv[k].w};
      const uint32_t gw[4] = {gv[k].x, gv[k].y, gv[k].z, gv[k].w};
      uint4 d;
      uint32_t* dw = reinterpret_cast<uint32_t*>(&d);
      float part = 0.0f;
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const float y0 = fp8_tile::low_value(yw[q]), y1 = fp8_tile::high_value(yw[q]);
        const float g0 = fp8_tile::low_value(gw[q]), g1 = fp8_tile::high_value(gw[q]);
        float cs, sn, d0, d1;
        programs::rope_cos_sin<float>(p[k], freq[q], cs, sn);
        epilogue::RopeRotateTranspose{}(g0, g1, cs, sn, d0, d1);
        part += programs::PairDot{}(y0, y1, g0, g1);
        const __nv_bfloat162 pair = __floats2bfloat162_rn(d0, d1);
        dw[q] = *reinterpret_cast<const uint32_t*>(&pair);
      }
      store_row_partial(part, partials + blockIdx.x * ld_partials + t.row0 + row,
                        row < t.rows_here);
      // Zeros outside the tensor, which the passes' amaxes need.
      *reinterpret_cast<uint4*>(staged.tile + row * kPitch + c) = d;
      if (copy != nullptr && row < t.rows_here && cols_in)
        *reinterpret_cast<uint4*>(copy + (t.row0 + row) * ld_copy + t.col0 + c) = d;
    }
  }
  __syncthreads();
  if (out.codes) fp8_tile::quantize_rows<Blocks::kRows>(staged, t, out, threadIdx.x);
  if (out_t.codes) fp8_tile::quantize_columns<Blocks::kRows>(staged, t, out_t, threadIdx.x);
}

}  // namespace

void swiglu_backward_quantize_fp8(const bf16* da, int64_t ldda, const void* z, int64_t ldz,
                                  const float* z_scales, int64_t ld_z_scales, int64_t rows,
                                  int64_t inter, Fp8Output out, Fp8Output out_t, float* partials,
                                  int64_t ld_partials, cudaStream_t stream, bf16* copy,
                                  int64_t ld_copy) {
  const char* op = "coda::kernel::swiglu_backward_quantize_fp8";
  const bool fp8_z = z_scales != nullptr;
  CODA_CHECK(rows > 0 && inter > 0 && inter % 8 == 0, op,
             ": da must be (rows, I) with I a multiple of 8, got (", rows, ", ", inter, ")");
  check_rows16(op, "da", da, ldda, inter);
  // z's row stride in elements (bf16) or bytes (codes); its loads are 16 bytes.
  CODA_CHECK(z != nullptr && ldz >= 2 * inter && (ldz * (fp8_z ? 1 : 2)) % 16 == 0 &&
                 reinterpret_cast<uintptr_t>(z) % 16 == 0,
             op, ": z must be (rows, 2·I) with its start and row stride 16-byte aligned, got row ",
             "stride ", ldz, " at address ", z);
  CODA_CHECK(!fp8_z || ld_z_scales >= rows, op, ": z's scale row stride must be >= ", rows,
             ", got ", ld_z_scales);
  CODA_CHECK(partials != nullptr && ld_partials >= rows, op,
             ": the ZdZ partials need a row stride >= ", rows, ", got ", ld_partials);
  if (copy != nullptr) check_rows16(op, "the bf16 copy of dz", copy, ld_copy, 2 * inter);
  check_outputs(op, out, out_t, rows, 2 * inter);
  auto launch = [&](auto kernel, int smem) {  // one CTA per 128x128 tile of dz
    launch_tile_kernel(op, kernel, rows, ScaleLayout::blocks(2 * inter), smem, stream, da, ldda, z,
                       ldz, InputScales{z_scales, ld_z_scales}, rows, 2 * inter, out, out_t,
                       partials, ld_partials, copy, ld_copy);
  };
  if (fp8_z)
    launch(swiglu_backward_tile_kernel<true>, kSwigluBackwardFp8ZSmem);
  else
    launch(swiglu_backward_tile_kernel<false>, kSwigluBackwardSmem);
}

void rmsnorm_swiglu_quantize_fp8(const bf16* y, int64_t ldy, const float* r, int64_t rows,
                                 int64_t inter, Fp8Output z_out, Fp8Output out, Fp8Output out_t,
                                 cudaStream_t stream, bf16* copy, int64_t ld_copy) {
  const char* op = "coda::kernel::rmsnorm_swiglu_quantize_fp8";
  CODA_CHECK(rows > 0 && inter > 0 && inter % 16 == 0, op,
             ": y must be (rows, 2·I) with I a multiple of 16, got rows ", rows, ", I ", inter);
  check_rows16(op, "y", y, ldy, 2 * inter);
  CODA_CHECK(r != nullptr, op, ": r is null");
  CODA_CHECK(z_out.codes != nullptr, op, ": z's codes are the point (z saved in FP8)");
  CODA_CHECK(copy == nullptr || (ld_copy >= inter && ld_copy % 4 == 0 &&
                                 reinterpret_cast<uintptr_t>(copy) % 8 == 0),
             op, ": the bf16 copy of a needs an 8-byte aligned start and row stride >= ", inter,
             ", got ", ld_copy);
  CODA_CHECK(out.codes || out_t.codes, op, ": neither a's rows nor its copy is wanted");
  check_output(op, "z", z_out, 2 * inter, ScaleLayout::row_scales_ld(rows));
  check_outputs(op, out, out_t, rows, inter);
  launch_tile_kernel(op, rmsnorm_swiglu_tile_kernel, rows, ScaleLayout::blocks(inter),
                     kRmsnormSwigluSmem, stream, y, ldy, r, rows, inter, z_out, out, out_t, copy,
                     ld_copy);
}

void rmsnorm_backward_quantize_fp8(const bf16* g, int64_t ldg, const bf16* x, int64_t ldx,
                                   const bf16* dres, int64_t ld_dres, const float* r,
                                   const bf16* gamma, const float* zdz, int64_t rows, int64_t cols,
                                   bf16* dx, int64_t lddx, Fp8Output out_t, float* partials,
                                   int64_t ld_partials, cudaStream_t stream) {
  const char* op = "coda::kernel::rmsnorm_backward_quantize_fp8";
  CODA_CHECK(rows > 0 && cols > 0 && cols % 16 == 0, op,
             ": g must be (rows, H) with H a multiple of 16, got (", rows, ", ", cols, ")");
  check_rows16(op, "g", g, ldg, cols);
  check_rows16(op, "x", x, ldx, cols);
  check_rows16(op, "dx", dx, lddx, cols);
  if (dres != nullptr) check_rows16(op, "dres", dres, ld_dres, cols);
  CODA_CHECK(r != nullptr && zdz != nullptr && gamma != nullptr &&
                 reinterpret_cast<uintptr_t>(gamma) % 16 == 0,
             op, ": r, zdz and a 16-byte aligned gamma are all needed");
  CODA_CHECK(partials != nullptr && ld_partials >= cols, op,
             ": the dγ partials need a row stride >= ", cols, ", got ", ld_partials);
  CODA_CHECK(out_t.codes != nullptr, op, ": no output");
  check_output(op, "out_t", out_t, ScaleLayout::padded_tokens(rows), cols);
  auto launch = [&](auto kernel, int smem) {
    launch_tile_kernel(op, kernel, rows, ScaleLayout::blocks(cols), smem, stream, g, ldg, x, ldx,
                       dres, ld_dres, r, gamma, zdz, rows, cols, dx, lddx, out_t, partials,
                       ld_partials);
  };
  if (dres != nullptr)
    launch(rmsnorm_backward_tile_kernel<true>, rmsnorm_backward_smem(true));
  else
    launch(rmsnorm_backward_tile_kernel<false>, rmsnorm_backward_smem(false));
}

void rope_backward_quantize_fp8(const bf16* y, int64_t ldy, const bf16* dy, int64_t lddy,
                                const int32_t* pos, const uint32_t* freq_hi,
                                const uint32_t* freq_lo, int64_t rows, int64_t cols, Fp8Output out,
                                Fp8Output out_t, float* partials, int64_t ld_partials,
                                cudaStream_t stream, bf16* copy, int64_t ld_copy) {
  const char* op = "coda::kernel::rope_backward_quantize_fp8";
  CODA_CHECK(rows > 0 && cols > 0 && cols % 16 == 0, op,
             ": qkv must be (rows, cols) with cols a multiple of 16, got (", rows, ", ", cols, ")");
  check_rows16(op, "qkv", y, ldy, cols);
  check_rows16(op, "dqkv", dy, lddy, cols);
  CODA_CHECK(pos != nullptr && freq_hi != nullptr && freq_lo != nullptr, op,
             ": null positions or frequency table");
  CODA_CHECK(partials != nullptr && ld_partials >= rows, op,
             ": the ZdZ partials need a row stride >= ", rows, ", got ", ld_partials);
  if (copy != nullptr) check_rows16(op, "the bf16 copy of dpre", copy, ld_copy, cols);
  check_outputs(op, out, out_t, rows, cols);
  launch_tile_kernel(op, rope_backward_tile_kernel, rows, ScaleLayout::blocks(cols),
                     fp8_tile::kSmemBytes, stream, y, ldy, dy, lddy, pos, freq_hi, freq_lo, rows,
                     cols, out, out_t, partials, ld_partials, copy, ld_copy);
}

}  // namespace coda::kernel
