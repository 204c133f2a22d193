#pragma once
// One 128x128 bf16 tile in shared memory quantized to blockwise e4m3 (docs/math.md §6) by 256
// threads: its rows in 1x128 blocks and its columns in 128x1 blocks (the transposed copy), in the
// layouts the FP8 GEMMs read (args.hpp ScaleLayout). The standalone cast kernels (src/quantize.cu)
// load the tile from global memory; the quantizing epilogue node (nodes/fp8_tile_store.cuh)
// stages it from the accumulator tile. Both then run the passes below, so an epilogue's codes
// are the cast kernel's codes of the same bf16 values, bit for bit.

#include <cuda_bf16.h>

#include <cstdint>

#include "coda/epilogue/fp8.hpp"
#include "coda/kernel/args.hpp"

namespace coda::kernel::fp8_tile {

constexpr int kTile = ScaleLayout::kBlock;  // 128
constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
// A tile row in shared memory: 128 bf16 plus 2, so that a row is 65 words and a warp reading one
// column (a row per lane) touches 32 distinct banks.
constexpr int kPitch = kTile + 2;
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

// A warp's rows (or columns) go kBatch at a time: their loads, shuffle rounds and stores
// interleave, where one at a time each waited on the last one's shuffles.
constexpr int kBatch = 8;

// The block scales of a batch of 32-lane blocks (rows or columns), from each lane's amax (as
// |bits|): merged over the warp, every lane gets each block's scale and its exact inverse.
__device__ __forceinline__ void warp_block_scales(uint32_t (&m)[kBatch], float (&sc)[kBatch],
                                                  float (&inv)[kBatch]) {
  using epilogue::E4m3;
#pragma unroll
  for (int o = 16; o > 0; o /= 2)
#pragma unroll
    for (int i = 0; i < kBatch; ++i) m[i] = max(m[i], __shfl_xor_sync(0xffffffffu, m[i], o));
#pragma unroll
  for (int i = 0; i < kBatch; ++i) {
    sc[i] = E4m3::scale(as_amax(m[i]));
    inv[i] = E4m3::inverse(sc[i]);
  }
}

// Rows: lane holds columns 4·lane .. 4·lane + 3 of row r. Under 1x128 blocks the rows past the
// tensor up to a multiple of 4 get scale 1 (their amax is 0): the GEMM's TMA reads whole 16 bytes
// of scales.
template <Blocks kBlocks>
__device__ __forceinline__ void quantize_rows(const Staged& s, const TilePlace& t, Fp8Output out,
                                              int thread, float tile_inv = 0.0f) {
  using epilogue::E4m3;
  const int warp = thread / 32, lane = thread % 32;
  constexpr bool per_row = kBlocks == Blocks::kRows;
  const int64_t rows_scaled = per_row ? ScaleLayout::row_scales_ld(t.rows) - t.row0 : t.rows_here;
  const int row_end = rows_scaled < kTile ? int(rows_scaled) : kTile;
  const __nv_bfloat162* tile = reinterpret_cast<const __nv_bfloat162*>(s.tile);
  for (int r0 = warp; r0 < row_end; r0 += kBatch * kWarps) {
    float2 a[kBatch], b[kBatch];
    float inv[kBatch];
#pragma unroll
    for (int i = 0; i < kBatch; ++i) {  // rows r0 + i·kWarps < 128: inside the staged tile
      const int r = r0 + i * kWarps;
      a[i] = __bfloat1622float2(tile[(r * kPitch) / 2 + 2 * lane]);
      b[i] = __bfloat1622float2(tile[(r * kPitch) / 2 + 2 * lane + 1]);
      inv[i] = tile_inv;
    }
    if constexpr (per_row) {
      uint32_t m[kBatch];
#pragma unroll
      for (int i = 0; i < kBatch; ++i)
        m[i] = amax_of(amax_of(amax_of(magnitude(a[i].x), a[i].y), b[i].x), b[i].y);
      float sc[kBatch];
      warp_block_scales(m, sc, inv);
#pragma unroll
      for (int i = 0; i < kBatch; ++i) {
        const int r = r0 + i * kWarps;
        if (lane == 0 && r < row_end) out.scales[t.tile_col * out.ld_scales + t.row0 + r] = sc[i];
      }
    }
#pragma unroll
    for (int i = 0; i < kBatch; ++i) {
      const int r = r0 + i * kWarps;
      if (r < t.rows_here && 4 * lane < t.cols_here)
        *reinterpret_cast<uint32_t*>(out.codes + (t.row0 + r) * out.ld + t.col0 + 4 * lane) =
            pack4(a[i].x, a[i].y, b[i].x, b[i].y, inv[i]);
    }
  }
}

// Columns (the transposed copy, codes (cols, padded_tokens(rows))): lane holds rows lane + 32·j
// of column c and stores their codes, a warp's 32 bytes contiguous. Rows past the tensor up to
// the next multiple of 16 hold code 0, even in a block whose scale is NaN.
template <Blocks kBlocks>
__device__ __forceinline__ void quantize_columns(const Staged& s, const TilePlace& t,
                                                 Fp8Output out_t, int thread,
                                                 float tile_inv = 0.0f) {
  using epilogue::E4m3;
  const int warp = thread / 32, lane = thread % 32;
  const int64_t rows_padded = ScaleLayout::padded_tokens(t.rows) - t.row0;
  const int rows_written = rows_padded < kTile ? int(rows_padded) : kTile;
  for (int c0 = warp; c0 < t.cols_here; c0 += kBatch * kWarps) {
    float v[kBatch][4], inv[kBatch];
    uint32_t m[kBatch];
#pragma unroll
    for (int i = 0; i < kBatch; ++i) {  // columns c0 + i·kWarps < 128: inside the staged tile
      const int c = c0 + i * kWarps;
      m[i] = 0;
      inv[i] = tile_inv;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        v[i][j] = __bfloat162float(s.tile[(lane + 32 * j) * kPitch + c]);
        m[i] = amax_of(m[i], v[i][j]);
      }
    }
    if constexpr (kBlocks == Blocks::kRows) {
      float sc[kBatch];
      warp_block_scales(m, sc, inv);
#pragma unroll
      for (int i = 0; i < kBatch; ++i) {
        const int c = c0 + i * kWarps;
        if (lane == 0 && c < t.cols_here)
          out_t.scales[t.tile_row * out_t.ld_scales + t.col0 + c] = sc[i];
      }
    }
#pragma unroll
    for (int i = 0; i < kBatch; ++i) {
      const int c = c0 + i * kWarps;
      if (c >= t.cols_here) continue;
      uint8_t* row = out_t.codes + (t.col0 + c) * out_t.ld + t.row0;
#pragma unroll
      for (int j = 0; j < 4; j += 2) {  // rows lane + 32·j and lane + 32·(j + 1)
        const int r = lane + 32 * j;
        const float lo = t.row0 + r < t.rows ? v[i][j] * inv[i] : 0.0f;
        const float hi = t.row0 + r + 32 < t.rows ? v[i][j + 1] * inv[i] : 0.0f;
        const uint16_t q = E4m3::encode2(lo, hi);  // code 0 past the tensor, whatever the scale
        if (r < rows_written) row[r] = uint8_t(q);
        if (r + 32 < rows_written) row[r + 32] = uint8_t(q >> 8);
      }
    }
  }
}

}  // namespace coda::kernel::fp8_tile
