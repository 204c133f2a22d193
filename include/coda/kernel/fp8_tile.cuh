#pragma once
// One 128x128 bf16 tile in shared memory quantized to blockwise e4m3 (docs/math.md §6) by 256
// threads: its rows in 1x128 blocks and its columns in 128x1 blocks (the transposed copy), in the
// layouts the FP8 GEMMs read (args.hpp ScaleLayout). The standalone cast kernels (src/quantize.cu)
// load the tile from global memory; the quantizing epilogue node (nodes/fp8_tile_store.cuh)
// stages it from the accumulator tile. Both then run the passes below, so an epilogue's codes
// are the cast kernel's codes of the same bf16 values, bit for bit.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>

#include "coda/epilogue/fp8.hpp"
#include "coda/kernel/args.hpp"

namespace coda::kernel::fp8_tile {

constexpr int kTile = ScaleLayout::kBlock;  // 128
constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
// A tile row in shared memory: 128 bf16 plus 8, so that rows start 16-byte aligned (16-byte loads
// and stores) and a row is 68 words: 8 lanes reading 16 bytes from 8 consecutive rows, or a
// warp writing the accumulator's column pairs, touch 32 distinct banks.
constexpr int kPitch = kTile + 8;
constexpr int kSmemBytes = kTile * kPitch * 2;

// Magnitudes as the bits of |v|: for non-negative floats the unsigned order of the bits is the
// order of the values, with NaN above infinity, so an integer max is an amax in which NaN wins
// (fmaxf would drop it) in one instruction.
__device__ __forceinline__ uint32_t magnitude(float v) { return __float_as_uint(v) & 0x7fffffffu; }
__device__ __forceinline__ uint32_t amax_of(uint32_t m, float v) { return max(m, magnitude(v)); }
__device__ __forceinline__ float as_amax(uint32_t m) { return __uint_as_float(m); }
// Over the `width` lanes of each aligned group (width a power of two <= 32).
template <int kWidth = 32>
__device__ __forceinline__ uint32_t group_amax(uint32_t m) {
#pragma unroll
  for (int o = kWidth / 2; o > 0; o /= 2) m = max(m, __shfl_xor_sync(0xffffffffu, m, o));
  return m;
}

__device__ __forceinline__ uint32_t pack4(float a, float b, float c, float d, float inv) {
  using epilogue::E4m3;  // quantize_by_inverse, two at a time
  const uint32_t lo = E4m3::encode2(a * inv, b * inv), hi = E4m3::encode2(c * inv, d * inv);
  return lo | hi << 16;
}

// Two e4m3 codes (byte 0 the low value) as floats, exactly E4m3::decode's values (e4m3 lies
// inside fp16, fp16 inside fp32; NaN stays NaN), in two conversions. The readers of an FP8 z.
__device__ __forceinline__ float2 decode2(uint16_t codes) {
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(__nv_fp8x2_storage_t(codes), __NV_E4M3);
  return __half22float2(__half2(h));
}

// The cooperative schedule's 64xN warpgroup MMA (GMMA) accumulator: each thread holds two rows of
// every 16, r and r + 8 with r % 16 < 8 (its row slots 0 and 1), and column pairs 8j + 2q, + 1,
// q its lane's place in a quad (the four lanes sharing those rows). The nodes that keep values
// per row in registers (nodes/fp8_row_store.cuh, nodes/fp8_pair_decode.cuh) index them so.
__device__ __forceinline__ int row_slot(int row) { return (row & 8) != 0 ? 1 : 0; }
__device__ __forceinline__ int slot_row0(int row) { return row & ~8; }  // the slot-0 row
__device__ __forceinline__ int quad_lane(int col) { return (col % 8) / 2; }

// Where a tile sits in its (rows, cols) tensor, and how much of it is real.
struct TilePlace {
  int64_t row0, col0;  // its first element
  int64_t rows, cols;  // the tensor's extent
  int rows_here, cols_here;
  int64_t tile_row, tile_col;  // its block indices (row0 / 128, col0 / 128)
};
__device__ __forceinline__ TilePlace place(int64_t tile_row, int64_t tile_col, int64_t rows,
                                           int64_t cols) {
  const int64_t row0 = tile_row * kTile, col0 = tile_col * kTile;
  const int64_t rh = rows - row0 < kTile ? rows - row0 : kTile;
  const int64_t ch = cols - col0 < kTile ? cols - col0 : kTile;
  return {row0, col0, rows, cols, int(rh), int(ch), tile_row, tile_col};
}

// The staged tile: element (r, c) at tile[r * kPitch + c]; elements outside the tensor are 0
// (they add nothing to an amax).
struct Staged {
  __nv_bfloat16* tile;
};
__device__ __forceinline__ Staged staged(unsigned char* smem) {
  return {reinterpret_cast<__nv_bfloat16*>(smem)};
}

// How a tile is blocked: kRows, 1x128 along its rows and 128x1 along its columns (activations
// and gradients); kTiles, one 128x128 block (weights), whose scale's inverse the caller passes.
enum class Blocks { kRows, kTiles };

// The amax of a bf16 pair's two values as |bits| of fp32 (bf16 is fp32's high half): lo and hi.
__device__ __forceinline__ uint32_t pair_magnitudes(uint32_t pair) { return pair & 0x7fff7fffu; }
__device__ __forceinline__ uint32_t low_amax(uint32_t mags) { return mags << 16; }
__device__ __forceinline__ uint32_t high_amax(uint32_t mags) { return mags & 0xffff0000u; }
__device__ __forceinline__ float low_value(uint32_t pair) { return __uint_as_float(pair << 16); }
__device__ __forceinline__ float high_value(uint32_t pair) {
  return __uint_as_float(pair & 0xffff0000u);
}

// Eight bf16 (one 16-byte read) as four pairs.
struct Eight {
  uint32_t p[4];
};
__device__ __forceinline__ Eight load8(const __nv_bfloat16* at) {
  const uint4 u = *reinterpret_cast<const uint4*>(at);
  return {{u.x, u.y, u.z, u.w}};
}
// The e4m3 codes of v[0..7] · inv, v[i] from pairs (i even: low half), byte i = value i.
__device__ __forceinline__ uint2 encode8(const Eight& e, float inv) {
  return make_uint2(
      pack4(low_value(e.p[0]), high_value(e.p[0]), low_value(e.p[1]), high_value(e.p[1]), inv),
      pack4(low_value(e.p[2]), high_value(e.p[2]), low_value(e.p[3]), high_value(e.p[3]), inv));
}
__device__ __forceinline__ uint32_t amax8(const Eight& e) {  // as |bits|
  const uint32_t m2 = __vmaxu2(__vmaxu2(pair_magnitudes(e.p[0]), pair_magnitudes(e.p[1])),
                               __vmaxu2(pair_magnitudes(e.p[2]), pair_magnitudes(e.p[3])));
  return max(low_amax(m2), high_amax(m2));
}

// Rows: warp w takes rows 16w .. 16w + 15; lane (g, s) = (lane / 8, lane % 8) holds rows
// 16w + g + 4u (u < 4), columns 8s .. 8s + 7 and 64 + 8s .. 64 + 8s + 7 (16-byte reads, 8 lanes
// reading 128 contiguous bytes of a row), so a row's amax takes 3 shuffle rounds and its codes go
// out 8 bytes at a time. Under 1x128 blocks the rows past the tensor up to a multiple of 4 get
// scale 1 (their staged values are 0): the GEMM's TMA reads whole 16 bytes of scales.
template <Blocks kBlocks>
__device__ __forceinline__ void quantize_rows(const Staged& s, const TilePlace& t, Fp8Output out,
                                              int thread, float tile_inv = 0.0f) {
  constexpr int kRowsPerLane = kTile / kWarps / 4;  // 4
  const int warp = thread / 32, lane = thread % 32, g = lane / 8, seg = lane % 8;
  constexpr bool per_row = kBlocks == Blocks::kRows;
  const int64_t rows_scaled = per_row ? ScaleLayout::row_scales_ld(t.rows) - t.row0 : t.rows_here;
  const int row_end = rows_scaled < kTile ? int(rows_scaled) : kTile;
  Eight a[kRowsPerLane], b[kRowsPerLane];
  float inv[kRowsPerLane];
#pragma unroll
  for (int u = 0; u < kRowsPerLane; ++u) {
    const __nv_bfloat16* row = s.tile + (16 * warp + g + 4 * u) * kPitch + 8 * seg;
    a[u] = load8(row);
    b[u] = load8(row + 64);
    inv[u] = tile_inv;
  }
  if constexpr (per_row) {
    uint32_t m[kRowsPerLane];
#pragma unroll
    for (int u = 0; u < kRowsPerLane; ++u) m[u] = max(amax8(a[u]), amax8(b[u]));
#pragma unroll
    for (int o = 4; o > 0; o /= 2)
#pragma unroll
      for (int u = 0; u < kRowsPerLane; ++u)
        m[u] = max(m[u], __shfl_xor_sync(0xffffffffu, m[u], o));
#pragma unroll
    for (int u = 0; u < kRowsPerLane; ++u) {
      const float sc = epilogue::E4m3::scale(as_amax(m[u]));
      inv[u] = epilogue::E4m3::inverse(sc);
      const int r = 16 * warp + g + 4 * u;
      if (seg == 0 && r < row_end) out.scales[t.tile_col * out.ld_scales + t.row0 + r] = sc;
    }
  }
#pragma unroll
  for (int u = 0; u < kRowsPerLane; ++u) {
    const int r = 16 * warp + g + 4 * u;
    if (r >= t.rows_here) continue;
    uint8_t* row = out.codes + (t.row0 + r) * out.ld + t.col0;
    // cols_here is a multiple of 16: an 8-column chunk is wholly in or out.
    if (8 * seg < t.cols_here) *reinterpret_cast<uint2*>(row + 8 * seg) = encode8(a[u], inv[u]);
    if (64 + 8 * seg < t.cols_here)
      *reinterpret_cast<uint2*>(row + 64 + 8 * seg) = encode8(b[u], inv[u]);
  }
}

// Columns (the transposed copy, codes (cols, padded_tokens(rows))): warp w takes columns
// 16w .. 16w + 15, each half-warp 8 of them; lane i of a half holds rows 8i .. 8i + 7 of its 8
// columns, so a column's amax takes 4 shuffle rounds and its codes go out 8 bytes at a time. The
// lane reads its rows rotated by i (row 8i + (j + i) mod 8 at step j): the 8 lanes of a 16-byte
// phase then hit 8 distinct bank groups; the codes are rotated back before the store. Rows past
// the tensor up to the next multiple of 16 hold code 0, even in a block whose scale is NaN.
template <Blocks kBlocks>
__device__ __forceinline__ void quantize_columns(const Staged& s, const TilePlace& t,
                                                 Fp8Output out_t, int thread,
                                                 float tile_inv = 0.0f) {
  using epilogue::E4m3;
  const int warp = thread / 32, lane = thread % 32, i = lane % 16, turn = i % 8;
  const int c0 = 16 * warp + 8 * (lane / 16);
  // cols_here is a multiple of 16 (the casts and the epilogue take N a multiple of 16).
  if (c0 >= t.cols_here) return;
  const int64_t rows_padded = ScaleLayout::padded_tokens(t.rows) - t.row0;
  const int rows_written = rows_padded < kTile ? int(rows_padded) : kTile;
  Eight w[8];  // w[j]: row 8i + (j + turn) % 8, columns c0 .. c0 + 7
#pragma unroll
  for (int j = 0; j < 8; ++j) w[j] = load8(s.tile + (8 * i + (j + turn) % 8) * kPitch + c0);
  float inv[8];
#pragma unroll
  for (int k = 0; k < 8; ++k) inv[k] = tile_inv;
  if constexpr (kBlocks == Blocks::kRows) {
    uint32_t m[8];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      uint32_t m2 = pair_magnitudes(w[0].p[k]);
#pragma unroll
      for (int j = 1; j < 8; ++j) m2 = __vmaxu2(m2, pair_magnitudes(w[j].p[k]));
      m[2 * k] = low_amax(m2);
      m[2 * k + 1] = high_amax(m2);
    }
#pragma unroll
    for (int o = 8; o > 0; o /= 2)
#pragma unroll
      for (int k = 0; k < 8; ++k) m[k] = max(m[k], __shfl_xor_sync(0xffffffffu, m[k], o));
    float mine = 0.0f;
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      const float sc = E4m3::scale(as_amax(m[k]));
      inv[k] = E4m3::inverse(sc);
      mine = i == k ? sc : mine;
    }
    if (i < 8) out_t.scales[t.tile_row * out_t.ld_scales + t.col0 + c0 + i] = mine;
  }
  if (8 * i >= rows_written) return;
  const bool whole = t.row0 + kTile <= t.rows;  // else rows past the tensor encode as 0
#pragma unroll
  for (int k = 0; k < 8; ++k) {
    uint32_t half[2];
#pragma unroll
    for (int j = 0; j < 8; j += 4) {
      float v[4];
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const uint32_t pair = w[j + q].p[k / 2];
        v[q] = (k % 2 ? high_value(pair) : low_value(pair)) * inv[k];
        if (!whole && t.row0 + 8 * i + (j + q + turn) % 8 >= t.rows) v[q] = 0.0f;
      }
      half[j / 4] = uint32_t(E4m3::encode2(v[0], v[1])) | uint32_t(E4m3::encode2(v[2], v[3])) << 16;
    }
    // Byte j holds row 8i + (j + turn) % 8: rotate left by `turn` bytes into row order.
    const bool swap = turn >= 4;
    const uint32_t lo = swap ? half[1] : half[0], hi = swap ? half[0] : half[1];
    const int sh = 8 * (turn % 4);
    const uint2 codes = make_uint2(__funnelshift_l(hi, lo, sh), __funnelshift_l(lo, hi, sh));
    *reinterpret_cast<uint2*>(out_t.codes + (t.col0 + c0 + k) * out_t.ld + t.row0 + 8 * i) = codes;
  }
}

}  // namespace coda::kernel::fp8_tile
