// The FP8 cast kernels of kernel/quantize.hpp. Rows alone (1x128 blocks): straight from global
// memory, a half-warp per block with a shuffle amax. With the transposed copy, and for 128x128
// blocks: one CTA per 128x128 tile of x, which goes through shared memory once; its rows and
// columns are quantized from there by fp8_tile.cuh's passes (8 lanes per row block, a half-warp
// per 8 column blocks).
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

namespace coda::kernel {
namespace {

using epilogue::E4m3;
using fp8_tile::amax_of;
using fp8_tile::Blocks;
using fp8_tile::group_amax;
using fp8_tile::kThreads;
using fp8_tile::kTile;
using fp8_tile::kWarps;
using fp8_tile::pack4;

// 1x128 blocks along the rows, no transposed copy: no shared memory. A warp takes 4 rows of one
// 256-column chunk; each half-warp one 128-column block of a row, a lane 8 columns (one 16-byte
// load, one 8-byte store). The 4 rows' loads are in flight together.
constexpr int kRowsPerWarp = 4;
__global__ void __launch_bounds__(kThreads)
    quantize_rows_kernel(const bf16* __restrict__ x, int64_t rows, int64_t cols, int64_t ldx,
                         Fp8Output out) {
  const int lane = threadIdx.x % 32;
  const int64_t chunks = (cols + 255) / 256;
  const int64_t item = int64_t(blockIdx.x) * kWarps + threadIdx.x / 32;
  const int64_t row0 = item / chunks * kRowsPerWarp, col = item % chunks * 256 + 8 * lane;
  // Rows past x up to a multiple of 4 load zeros: their amax is 0, so their scale is 1, which the
  // GEMM's 16-byte TMA rows of scales read.
  const int64_t rows_scaled = ScaleLayout::row_scales_ld(rows);
  if (row0 >= rows_scaled) return;
  uint4 v[kRowsPerWarp];
#pragma unroll
  for (int i = 0; i < kRowsPerWarp; ++i) {
    v[i] = make_uint4(0, 0, 0, 0);
    if (row0 + i < rows && col < cols)
      v[i] = *reinterpret_cast<const uint4*>(x + (row0 + i) * ldx + col);
  }
#pragma unroll
  for (int i = 0; i < kRowsPerWarp; ++i) {
    const int64_t r = row0 + i;
    float f[8];
    const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&v[i]);
    uint32_t m = 0;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float2 p = __bfloat1622float2(h[j]);
      f[2 * j] = p.x;
      f[2 * j + 1] = p.y;
      m = amax_of(amax_of(m, p.x), p.y);
    }
    const float s = E4m3::scale(fp8_tile::as_amax(group_amax<16>(m))), inv = E4m3::inverse(s);
    const int64_t block = col / 128;
    if (lane % 16 == 0 && block * 128 < cols && r < rows_scaled)
      out.scales[block * out.ld_scales + r] = s;
    if (r < rows && col < cols)
      *reinterpret_cast<uint2*>(out.codes + r * out.ld + col) =
          make_uint2(pack4(f[0], f[1], f[2], f[3], inv), pack4(f[4], f[5], f[6], f[7], inv));
  }
}

// What a tile kernel quantizes: x itself, or a = silu(g)·u of the interleaved (g, u) pairs of
// x = z (rows, 2·cols), F2's saved pre-activation, each a rounded to bf16 as the bf16 B2 rounds
// the a it recomputes for dW_down.
// kSwiGluFp8: the same from z saved in FP8 (e4m3 codes, `ldx` bytes a row, and its 1x128 block
// scales), each value decoded and rounded to bf16 (exact but below 2^-133) first, so that a is
// kSwiGlu's of the decoded z, bit for bit.
enum class TileInput { kX, kSwiGlu, kSwiGluFp8 };
// An FP8 input's scales: block b of row r at b · ld + r.
struct InputScales {
  const float* scales = nullptr;
  int64_t ld = 0;
};

// Eight consecutive a values from z's 16 values at `z` (two 16-byte loads), as 8 bf16.
__device__ uint4 swiglu8(const uint4 (&z)[2]) {
  uint4 a;
  __nv_bfloat162* out = reinterpret_cast<__nv_bfloat162*>(&a);
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const __nv_bfloat162* pair = reinterpret_cast<const __nv_bfloat162*>(&z[h]);
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const float2 p = __bfloat1622float2(pair[2 * j]), q = __bfloat1622float2(pair[2 * j + 1]);
      out[2 * h + j] =
          __floats2bfloat162_rn(epilogue::SwiGlu{}(p.x, p.y), epilogue::SwiGlu{}(q.x, q.y));
    }
  }
  return a;
}

// Eight consecutive a values from 16 of z's e4m3 codes (one 16-byte load) in a block of scale s.
__device__ uint4 swiglu8_fp8(const uint4& z, float s) {
  uint4 a;
  __nv_bfloat162* out = reinterpret_cast<__nv_bfloat162*>(&a);
  const uint32_t words[4] = {z.x, z.y, z.z, z.w};
#pragma unroll
  for (int q = 0; q < 4; ++q) {  // a word: (g, u) pairs of codes, two of them
    const float2 p = fp8_tile::decode2(uint16_t(words[q] & 0xffffu));
    const float2 r = fp8_tile::decode2(uint16_t(words[q] >> 16));
    const float2 pz = __bfloat1622float2(__floats2bfloat162_rn(p.x * s, p.y * s));
    const float2 rz = __bfloat1622float2(__floats2bfloat162_rn(r.x * s, r.y * s));
    out[q] = __floats2bfloat162_rn(epilogue::SwiGlu{}(pz.x, pz.y), epilogue::SwiGlu{}(rz.x, rz.y));
  }
  return a;
}

// One CTA per 128x128 tile through shared memory (fp8_tile.cuh): loaded once, then its rows and
// its columns quantized from there. Blocks::kRows: `out` per 1x128 row block, `out_t` per 128x1
// column block. Blocks::kTiles: one scale for the whole 128x128 tile, for both. With
// TileInput::kSwiGlu the tile is a's (rows, cols) from z at x (row stride ldx, 2·cols wide);
// with kSwiGluFp8 from z's codes at x (ldx bytes a row) and their scales xs.
template <Blocks kBlocks, TileInput kInput = TileInput::kX>
__global__ void __launch_bounds__(kThreads)
    quantize_tile_kernel(const void* __restrict__ x, int64_t rows, int64_t cols, int64_t ldx,
                         Fp8Output out, Fp8Output out_t, InputScales xs) {
  using fp8_tile::kPitch;
  extern __shared__ __align__(16) unsigned char smem[];
  const fp8_tile::Staged staged = fp8_tile::staged(smem);
  __shared__ uint32_t warp_max[kWarps];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const fp8_tile::TilePlace t = fp8_tile::place(blockIdx.y, blockIdx.x, rows, cols);

  // Load: 16-byte chunks (8 bf16; 16 of z's for kSwiGlu), zeros outside x (they add nothing to
  // an amax, and silu(0)·0 = 0), all in flight before the first shared-memory store.
  constexpr int kChunks = kTile * kTile / 8 / kThreads;
  constexpr int kLoads = kInput == TileInput::kSwiGlu ? 2 : 1;  // 16-byte loads per chunk
  uint4 v[kChunks][kLoads];
  float scale[kChunks];  // kSwiGluFp8: the chunk's block scale (0 outside z)
#pragma unroll
  for (int j = 0; j < kChunks; ++j) {
    const int i = threadIdx.x + j * kThreads, r = i / (kTile / 8), c = i % (kTile / 8) * 8;
    const bool in = r < t.rows_here && c < t.cols_here;
    scale[j] = 0.0f;
    if constexpr (kInput == TileInput::kSwiGluFp8) {
      // 16 codes (8 pairs) from z's column 2(col0 + c), all in one 128-column block.
      v[j][0] = make_uint4(0, 0, 0, 0);
      if (in) {
        const int64_t zc = 2 * (t.col0 + c);
        v[j][0] = *reinterpret_cast<const uint4*>(static_cast<const uint8_t*>(x) +
                                                  (t.row0 + r) * ldx + zc);
        scale[j] = xs.scales[zc / kTile * xs.ld + t.row0 + r];
      }
    } else {
      const bf16* xb = static_cast<const bf16*>(x);
#pragma unroll
      for (int l = 0; l < kLoads; ++l) {
        v[j][l] = make_uint4(0, 0, 0, 0);
        if (in)
          v[j][l] = *reinterpret_cast<const uint4*>(xb + (t.row0 + r) * ldx +
                                                    kLoads * (t.col0 + c) + 8 * l);
      }
    }
  }
#pragma unroll
  for (int j = 0; j < kChunks; ++j) {
    const int i = threadIdx.x + j * kThreads, r = i / (kTile / 8), c = i % (kTile / 8) * 8;
    uint4 a;
    if constexpr (kInput == TileInput::kSwiGlu) {
      a = swiglu8(v[j]);
    } else if constexpr (kInput == TileInput::kSwiGluFp8) {
      a = swiglu8_fp8(v[j][0], scale[j]);
    } else {
      a = v[j][0];
    }
    *reinterpret_cast<uint4*>(staged.tile + r * kPitch + c) = a;
  }
  __syncthreads();

  float tile_inv = 0.0f;
  if constexpr (kBlocks == Blocks::kTiles) {
    // Over the tile's 128 real columns (the pad words are never written).
    const __nv_bfloat162* tile = reinterpret_cast<const __nv_bfloat162*>(staged.tile);
    uint32_t m = 0;
    for (int r = warp; r < kTile; r += kWarps) {
      const float2 a = __bfloat1622float2(tile[(r * kPitch) / 2 + 2 * lane]);
      const float2 b = __bfloat1622float2(tile[(r * kPitch) / 2 + 2 * lane + 1]);
      m = amax_of(amax_of(amax_of(amax_of(m, a.x), a.y), b.x), b.y);
    }
    m = group_amax(m);
    if (lane == 0) warp_max[warp] = m;
    __syncthreads();
    m = warp_max[0];
#pragma unroll
    for (int w = 1; w < kWarps; ++w) m = max(m, warp_max[w]);
    const float s = E4m3::scale(fp8_tile::as_amax(m));
    tile_inv = E4m3::inverse(s);
    if (threadIdx.x == 0) {
      if (out.codes) out.scales[blockIdx.y * out.ld_scales + blockIdx.x] = s;
      if (out_t.codes) out_t.scales[blockIdx.x * out_t.ld_scales + blockIdx.y] = s;
    }
  }
  if (out.codes) fp8_tile::quantize_rows<kBlocks>(staged, t, out, threadIdx.x, tile_inv);
  if (out_t.codes) fp8_tile::quantize_columns<kBlocks>(staged, t, out_t, threadIdx.x, tile_inv);
}

// 16 bytes from global to shared memory without passing through registers (cp.async, cached in
// L2 only); `bytes` 0 fills the 16 bytes with zeros and reads nothing.
__device__ __forceinline__ void copy16_async(void* dst, const void* src, int bytes) {
  const uint32_t d = uint32_t(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(d), "l"(src), "r"(bytes));
}
__device__ __forceinline__ void copy4_async(void* dst, const void* src, int bytes) {
  const uint32_t d = uint32_t(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(d), "l"(src), "r"(bytes));
}
__device__ __forceinline__ void wait_async_copies() {
  asm volatile("cp.async.commit_group;\ncp.async.wait_group 0;\n" ::: "memory");
}

// A row's partial sum over 128 columns held 8 a lane by a half-warp: the half-warp's sum, stored
// at `at` by its first lane (one writer a row) where `store`.
__device__ __forceinline__ void store_row_partial(float part, float* at, bool store) {
#pragma unroll
  for (int o = 8; o > 0; o /= 2) part += __shfl_xor_sync(0xffffffffu, part, o);
  if (threadIdx.x % 16 == 0 && store) *at = part;
}

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

// F2's epilogue with z saved in FP8, as a pass of its own (kernel/quantize.hpp
// rmsnorm_swiglu_quantize_fp8): one CTA per 128 rows of one 128-column tile of a, i.e. 256
// columns of the plain GEMM's output y = h·w_guᵀ (its interleaved (g, u) pairs). A chunk is 8
// columns of y (16 bytes); a warp covers a row's 256, each half-warp one 128-column block of z,
// whose amax its shuffles find: z = r·y is rounded to bf16 and its codes written from registers.
// a = silu(z_g)·z_u from the unrounded z is rounded to bf16 and staged; its rows and transposed
// copy are quantized by the cast's passes.
__global__ void __launch_bounds__(kThreads, 2)
    rmsnorm_swiglu_tile_kernel(const bf16* __restrict__ y, int64_t ldy,
                               const float* __restrict__ r, int64_t rows, int64_t inter,
                               Fp8Output z_out, Fp8Output out, Fp8Output out_t, bf16* copy,
                               int64_t ld_copy) {
  using epilogue::E4m3;
  using fp8_tile::kPitch;
  extern __shared__ __align__(16) unsigned char smem[];
  const fp8_tile::Staged staged = fp8_tile::staged(smem);
  constexpr int kRowChunks = 2 * kTile / 8;                    // 32 chunks of y per row
  constexpr int kChunks = kTile * kRowChunks / kThreads;       // 16: rows threadIdx.x / 32 + 8 j
  constexpr int kGroup = 4;
  const fp8_tile::TilePlace t = fp8_tile::place(blockIdx.y, blockIdx.x, rows, inter);  // a's tile
  const int lane = threadIdx.x % 32, c = lane * 8;  // the thread's 8 columns of y (4 of a)
  const bool cols_in = c / 2 < t.cols_here;         // cols_here: a multiple of 16
  const int64_t y_col = 2 * t.col0 + c;
#pragma unroll
  for (int j0 = 0; j0 < kChunks; j0 += kGroup) {
    uint4 v[kGroup];
    float rr[kGroup];
#pragma unroll
    for (int k = 0; k < kGroup; ++k) {
      const int row = threadIdx.x / 32 + (kThreads / 32) * (j0 + k);
      v[k] = make_uint4(0, 0, 0, 0);
      rr[k] = 0.0f;
      if (row < t.rows_here && cols_in) {
        v[k] = *reinterpret_cast<const uint4*>(y + (t.row0 + row) * ldy + y_col);
        rr[k] = r[t.row0 + row];
      }
    }
#pragma unroll
    for (int k = 0; k < kGroup; ++k) {
      const int row = threadIdx.x / 32 + (kThreads / 32) * (j0 + k);
      const uint32_t w[4] = {v[k].x, v[k].y, v[k].z, v[k].w};
      float zf[8];
      fp8_tile::Eight e;  // z in bf16, pairs
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        zf[2 * q] = rr[k] * fp8_tile::low_value(w[q]);
        zf[2 * q + 1] = rr[k] * fp8_tile::high_value(w[q]);
        const __nv_bfloat162 p = __floats2bfloat162_rn(zf[2 * q], zf[2 * q + 1]);
        e.p[q] = *reinterpret_cast<const uint32_t*>(&p);
      }
      // z's 1x128 block: this half-warp's 16 lanes (amax8: per-half maxima of the pairs).
      uint32_t amax = fp8_tile::amax8(e);
#pragma unroll
      for (int o = 8; o > 0; o /= 2) amax = max(amax, __shfl_xor_sync(0xffffffffu, amax, o));
      const float sc = E4m3::scale(fp8_tile::as_amax(amax)), inv = E4m3::inverse(sc);
      const int64_t zrow = t.row0 + row;
      if (zrow < ScaleLayout::row_scales_ld(rows) && lane % 16 == 0 && cols_in)
        z_out.scales[y_col / kTile * z_out.ld_scales + zrow] = sc;
      if (row < t.rows_here && cols_in) {
        *reinterpret_cast<uint2*>(z_out.codes + zrow * z_out.ld + y_col) =
            fp8_tile::encode8(e, inv);
      }
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
    }
  }
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

// One 64x64 tile of codes per CTA: each thread loads 16 bytes of a row into shared memory (row
// pitch 68 bytes, 4-byte stores: a warp's byte reads down the columns hit each bank at most
// twice) and stores 16 bytes of a column, i.e. of out_t's row. rows and cols are multiples of 16,
// so a thread's 16 bytes are all inside the matrix or all outside. The CTA at the origin of a
// 128x128 block (every other tile in each direction) also moves that block's scale.
constexpr int kTransposeTile = 64, kTransposePitch = kTransposeTile + 4;
__global__ void __launch_bounds__(256)
    transpose_blocks_kernel(const uint8_t* __restrict__ codes, int64_t rows, int64_t cols,
                            int64_t ld, const float* __restrict__ scales, int64_t ld_scales,
                            Fp8Output out) {
  __shared__ uint32_t tile[kTransposeTile * kTransposePitch / 4];
  auto* bytes = reinterpret_cast<uint8_t*>(tile);
  const int64_t r0 = int64_t(blockIdx.y) * kTransposeTile,
                c0 = int64_t(blockIdx.x) * kTransposeTile;
  const int t = static_cast<int>(threadIdx.x), line = t / 4, part = t % 4 * 16;
  if (r0 + line < rows && c0 + part < cols) {
    const uint4 v = *reinterpret_cast<const uint4*>(codes + (r0 + line) * ld + c0 + part);
    uint32_t* dst = tile + (line * kTransposePitch + part) / 4;
    dst[0] = v.x;
    dst[1] = v.y;
    dst[2] = v.z;
    dst[3] = v.w;
  }
  __syncthreads();
  // Thread t writes out_t's row c0 + line (the input's column), columns r0 + part .. + 15.
  if (c0 + line < cols && r0 + part < rows) {
    uint32_t w[4];
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      w[q] = 0;
#pragma unroll
      for (int j = 0; j < 4; ++j)
        w[q] |= uint32_t(bytes[(part + 4 * q + j) * kTransposePitch + line]) << (8 * j);
    }
    *reinterpret_cast<uint4*>(out.codes + (c0 + line) * out.ld + r0 + part) =
        make_uint4(w[0], w[1], w[2], w[3]);
  }
  constexpr int64_t kBlock = ScaleLayout::kBlock;
  if (t == 0 && r0 % kBlock == 0 && c0 % kBlock == 0)
    out.scales[c0 / kBlock * out.ld_scales + r0 / kBlock] =
        scales[r0 / kBlock * ld_scales + c0 / kBlock];
}

// An output of `cols`-wide code rows whose scale rows hold `scale_cols` entries.
void check_output(const char* op, const char* name, const Fp8Output& o, int64_t cols,
                  int64_t scale_cols) {
  if (!o.codes) return;
  CODA_CHECK(o.scales != nullptr, op, ": ", name, " has codes but no scales");
  CODA_CHECK(o.ld >= cols && o.ld % 16 == 0, op, ": ", name, "'s row stride must be >= ", cols,
             " and a multiple of 16, got ", o.ld);
  CODA_CHECK(reinterpret_cast<uintptr_t>(o.codes) % 16 == 0, op, ": ", name,
             "'s codes must be 16-byte aligned, got address ", static_cast<void*>(o.codes));
  CODA_CHECK(o.ld_scales >= scale_cols, op, ": ", name,
             "'s scale row stride must be >= ", scale_cols, ", got ", o.ld_scales);
}

// A bf16 matrix read or written 16 bytes at a time: start and row stride 16-byte aligned, the
// stride at least `cols`.
void check_rows16(const char* op, const char* name, const void* p, int64_t ld, int64_t cols) {
  CODA_CHECK(p != nullptr && ld >= cols && ld % 8 == 0 && reinterpret_cast<uintptr_t>(p) % 16 == 0,
             op, ": ", name,
             "'s start and row stride must be 16-byte aligned with the stride >= ", cols,
             ", got row stride ", ld, " at address ", p);
}

void check_input(const char* op, const bf16* x, int64_t rows, int64_t cols, int64_t ldx,
                 const Fp8Output& out, const Fp8Output& out_t) {
  CODA_CHECK(x != nullptr && rows > 0 && cols > 0 && cols % 16 == 0 && ldx >= cols, op,
             ": x must be a (rows, cols) matrix with cols a multiple of 16, got (", rows, ", ",
             cols, ") with row stride ", ldx);
  CODA_CHECK(ldx % 8 == 0 && reinterpret_cast<uintptr_t>(x) % 16 == 0, op,
             ": x's start and row stride must be 16-byte aligned (16-byte loads), got row stride ",
             ldx, " at address ", static_cast<const void*>(x));
  CODA_CHECK(out.codes || out_t.codes, op, ": no output");
}

// A tile kernel's launch: one CTA of kThreads per 128 rows and `col_units` column units, each with
// the staged tile's shared memory.
template <class... Params, class... A>
void launch_tile_kernel(const char* op, void (*kernel)(Params...), int64_t rows, int64_t col_units,
                        int smem, cudaStream_t stream, A... args) {
  const int64_t row_blocks = ScaleLayout::blocks(rows);
  CODA_CHECK(row_blocks < 65536, op, ": ", rows, " rows is too many (at most 65535 tiles)");
  // Per launch (the current device's function attribute; no synchronization).
  CODA_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  const dim3 grid{unsigned(col_units), unsigned(row_blocks)};
  kernel<<<grid, kThreads, smem, stream>>>(args...);
  CODA_CUDA_CHECK(cudaGetLastError());
}

// The quantized outputs of a (rows, cols) tensor, rows and transposed copy, at least one wanted.
void check_outputs(const char* op, const Fp8Output& out, const Fp8Output& out_t, int64_t rows,
                   int64_t cols) {
  CODA_CHECK(out.codes || out_t.codes, op, ": no output");
  check_output(op, "out", out, cols, ScaleLayout::row_scales_ld(rows));
  check_output(op, "out_t", out_t, ScaleLayout::padded_tokens(rows), cols);
}

template <Blocks kBlocks, TileInput kInput = TileInput::kX>
void launch_tiles(const char* op, const void* x, int64_t rows, int64_t cols, int64_t ldx,
                  const Fp8Output& out, const Fp8Output& out_t, cudaStream_t stream,
                  InputScales xs = {}) {
  launch_tile_kernel(op, quantize_tile_kernel<kBlocks, kInput>, rows, ScaleLayout::blocks(cols),
                     fp8_tile::kSmemBytes, stream, x, rows, cols, ldx, out, out_t, xs);
}

}  // namespace

void quantize_fp8_rows(const bf16* x, int64_t rows, int64_t cols, int64_t ldx, Fp8Output out,
                       Fp8Output out_t, cudaStream_t stream) {
  const char* op = "coda::kernel::quantize_fp8_rows";
  check_input(op, x, rows, cols, ldx, out, out_t);
  check_outputs(op, out, out_t, rows, cols);
  if (out_t.codes) {
    launch_tiles<Blocks::kRows>(op, x, rows, cols, ldx, out, out_t, stream);
    return;
  }
  const int64_t items = (rows + kRowsPerWarp - 1) / kRowsPerWarp * ((cols + 255) / 256);
  const int64_t ctas = (items + kWarps - 1) / kWarps;
  CODA_CHECK(ctas < (int64_t(1) << 31), op, ": (", rows, ", ", cols, ") is too large");
  quantize_rows_kernel<<<unsigned(ctas), kThreads, 0, stream>>>(x, rows, cols, ldx, out);
  CODA_CUDA_CHECK(cudaGetLastError());
}

void quantize_fp8_swiglu_t(const bf16* z, int64_t rows, int64_t cols, int64_t ldz, Fp8Output out_t,
                           cudaStream_t stream) {
  const char* op = "coda::kernel::quantize_fp8_swiglu_t";
  CODA_CHECK(z != nullptr && rows > 0 && cols > 0 && cols % 16 == 0 && ldz >= 2 * cols, op,
             ": z must be a (rows, 2·cols) matrix with cols a multiple of 16, got rows ", rows,
             ", cols ", cols, ", row stride ", ldz);
  CODA_CHECK(ldz % 8 == 0 && reinterpret_cast<uintptr_t>(z) % 16 == 0, op,
             ": z's start and row stride must be 16-byte aligned (16-byte loads), got row stride ",
             ldz, " at address ", static_cast<const void*>(z));
  CODA_CHECK(out_t.codes != nullptr, op, ": no output");
  check_output(op, "out_t", out_t, ScaleLayout::padded_tokens(rows), cols);
  launch_tiles<Blocks::kRows, TileInput::kSwiGlu>(op, z, rows, cols, ldz, Fp8Output{}, out_t,
                                                  stream);
}

void quantize_fp8_swiglu_t_fp8_z(const uint8_t* z, int64_t rows, int64_t cols, int64_t ldz,
                                 const float* z_scales, int64_t ld_z_scales, Fp8Output out_t,
                                 cudaStream_t stream) {
  const char* op = "coda::kernel::quantize_fp8_swiglu_t_fp8_z";
  CODA_CHECK(z != nullptr && z_scales != nullptr && rows > 0 && cols > 0 && cols % 16 == 0 &&
                 ldz >= 2 * cols,
             op, ": z must be (rows, 2·cols) codes with scales, cols a multiple of 16, got rows ",
             rows, ", cols ", cols, ", row stride ", ldz);
  CODA_CHECK(ldz % 16 == 0 && reinterpret_cast<uintptr_t>(z) % 16 == 0, op,
             ": z's start and row stride must be 16-byte aligned (16-byte loads), got row stride ",
             ldz, " at address ", static_cast<const void*>(z));
  CODA_CHECK(ld_z_scales >= rows, op, ": z's scale row stride must be >= ", rows, ", got ",
             ld_z_scales);
  CODA_CHECK(out_t.codes != nullptr, op, ": no output");
  check_output(op, "out_t", out_t, ScaleLayout::padded_tokens(rows), cols);
  launch_tiles<Blocks::kRows, TileInput::kSwiGluFp8>(op, z, rows, cols, ldz, Fp8Output{}, out_t,
                                                     stream, {z_scales, ld_z_scales});
}

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
                     fp8_tile::kSmemBytes, stream, y, ldy, r, rows, inter, z_out, out, out_t, copy,
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

void quantize_fp8_blocks(const bf16* x, int64_t rows, int64_t cols, int64_t ldx, Fp8Output out,
                         Fp8Output out_t, cudaStream_t stream) {
  const char* op = "coda::kernel::quantize_fp8_blocks";
  CODA_CHECK(!out_t.codes || rows % 16 == 0, op,
             ": the transposed copy needs rows a multiple of 16, got ", rows);
  check_input(op, x, rows, cols, ldx, out, out_t);
  check_output(op, "out", out, cols, ScaleLayout::blocks(cols));
  check_output(op, "out_t", out_t, rows, ScaleLayout::blocks(rows));
  launch_tiles<Blocks::kTiles>(op, x, rows, cols, ldx, out, out_t, stream);
}

void transpose_fp8_blocks(const uint8_t* codes, int64_t rows, int64_t cols, int64_t ld,
                          const float* scales, int64_t ld_scales, Fp8Output out_t,
                          cudaStream_t stream) {
  const char* op = "coda::kernel::transpose_fp8_blocks";
  CODA_CHECK(codes != nullptr && scales != nullptr && out_t.codes != nullptr, op,
             ": codes, scales and out_t are all needed");
  CODA_CHECK(rows > 0 && cols > 0 && rows % 16 == 0 && cols % 16 == 0, op,
             ": the codes must be (rows, cols) with both multiples of 16, got (", rows, ", ", cols,
             ")");
  CODA_CHECK(ld >= cols && ld % 16 == 0 && reinterpret_cast<uintptr_t>(codes) % 16 == 0, op,
             ": the codes' start and row stride must be 16-byte aligned with the stride >= ", cols,
             ", got row stride ", ld, " at address ", static_cast<const void*>(codes));
  CODA_CHECK(ld_scales >= ScaleLayout::blocks(cols), op,
             ": the scales' row stride must be >= ", ScaleLayout::blocks(cols), ", got ",
             ld_scales);
  check_output(op, "out_t", out_t, rows, ScaleLayout::blocks(rows));
  const int64_t tiles_r = (rows + kTransposeTile - 1) / kTransposeTile,
                tiles_c = (cols + kTransposeTile - 1) / kTransposeTile;
  CODA_CHECK(tiles_r < 65536 && tiles_c < (int64_t(1) << 31), op, ": (", rows, ", ", cols,
             ") is too large");
  const dim3 grid{unsigned(tiles_c), unsigned(tiles_r)};
  transpose_blocks_kernel<<<grid, 256, 0, stream>>>(codes, rows, cols, ld, scales, ld_scales,
                                                    out_t);
  CODA_CUDA_CHECK(cudaGetLastError());
}

}  // namespace coda::kernel
