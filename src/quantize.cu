// The FP8 cast kernels of kernel/quantize.hpp. Rows alone (1x128 blocks): straight from global
// memory, a half-warp per block with a shuffle amax. With the transposed copy, and for 128x128
// blocks: one CTA per 128x128 tile of x, which goes through shared memory once; rows and columns
// are quantized from it by one warp per row or column.
#include <cuda_bf16.h>

#include <cstdint>

#include "coda/common/check.hpp"
#include "coda/epilogue/fp8.hpp"
#include "coda/kernel/cuda_check.hpp"
#include "coda/kernel/quantize.hpp"

namespace coda::kernel {
namespace {

using epilogue::E4m3;

constexpr int kTile = ScaleLayout::kBlock;  // 128
constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
// A tile row in shared memory: 128 bf16 plus 2, so that a row is 65 words and a warp reading one
// column (a row per lane) touches 32 distinct banks.
constexpr int kPitch = kTile + 2;

// The largest magnitude, NaN winning (fmaxf would drop it).
__device__ __forceinline__ float amax_of(float m, float a) { return (a > m || a != a) ? a : m; }
// Over the `width` lanes of each aligned group (width a power of two <= 32).
template <int kWidth = 32>
__device__ __forceinline__ float group_amax(float m) {
#pragma unroll
  for (int o = kWidth / 2; o > 0; o /= 2) m = amax_of(m, __shfl_xor_sync(0xffffffffu, m, o));
  return m;
}

__device__ __forceinline__ uint32_t pack4(float a, float b, float c, float d, float inv) {
  return uint32_t(E4m3::quantize_by_inverse(a, inv)) |
         uint32_t(E4m3::quantize_by_inverse(b, inv)) << 8 |
         uint32_t(E4m3::quantize_by_inverse(c, inv)) << 16 |
         uint32_t(E4m3::quantize_by_inverse(d, inv)) << 24;
}

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
    float m = 0.0f;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float2 p = __bfloat1622float2(h[j]);
      f[2 * j] = p.x;
      f[2 * j + 1] = p.y;
      m = amax_of(m, amax_of(fabsf(p.x), fabsf(p.y)));
    }
    const float s = E4m3::scale(group_amax<16>(m)), inv = E4m3::inverse(s);
    const int64_t block = col / 128;
    if (lane % 16 == 0 && block * 128 < cols && r < rows_scaled)
      out.scales[block * out.ld_scales + r] = s;
    if (r < rows && col < cols)
      *reinterpret_cast<uint2*>(out.codes + r * out.ld + col) =
          make_uint2(pack4(f[0], f[1], f[2], f[3], inv), pack4(f[4], f[5], f[6], f[7], inv));
  }
}

enum class Blocks { kRows, kTiles };

// One CTA per 128x128 tile through shared memory (dynamic: tile + the transposed codes).
// Blocks::kRows: `out` per 1x128 row block, `out_t` per 128x1 column block. Blocks::kTiles: one
// scale for the whole 128x128 tile, for both. The transposed codes are staged in shared memory
// and leave in 16-byte rows.
constexpr int kTileBytes = kTile * kPitch * 2;
constexpr int kTransposedBytes = kTile * kTile;
constexpr int kTileSmem = kTileBytes + kTransposedBytes;
template <Blocks kBlocks>
__global__ void __launch_bounds__(kThreads)
    quantize_tile_kernel(const bf16* __restrict__ x, int64_t rows, int64_t cols, int64_t ldx,
                         Fp8Output out, Fp8Output out_t) {
  extern __shared__ __align__(16) unsigned char smem[];
  __nv_bfloat162* tile = reinterpret_cast<__nv_bfloat162*>(smem);
  uint8_t* tcodes = smem + kTileBytes;  // (128 columns of x, 128 rows of x): xᵀ's codes
  __shared__ float warp_max[kWarps];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t row0 = int64_t(blockIdx.y) * kTile, col0 = int64_t(blockIdx.x) * kTile;
  const int64_t rows_here = rows - row0 < kTile ? rows - row0 : kTile;
  const int64_t cols_here = cols - col0 < kTile ? cols - col0 : kTile;

  // Load: 16-byte chunks (8 bf16), zeros outside x (they add nothing to an amax), all in flight
  // before the first shared-memory store.
  constexpr int kChunks = kTile * kTile / 8 / kThreads;
  uint4 v[kChunks];
#pragma unroll
  for (int j = 0; j < kChunks; ++j) {
    const int i = threadIdx.x + j * kThreads, r = i / (kTile / 8), c = i % (kTile / 8) * 8;
    v[j] = make_uint4(0, 0, 0, 0);
    if (r < rows_here && c < cols_here)
      v[j] = *reinterpret_cast<const uint4*>(x + (row0 + r) * ldx + col0 + c);
  }
#pragma unroll
  for (int j = 0; j < kChunks; ++j) {
    const int i = threadIdx.x + j * kThreads, r = i / (kTile / 8), c = i % (kTile / 8) * 8;
    uint32_t* dst = reinterpret_cast<uint32_t*>(tile) + (r * kPitch + c) / 2;
    dst[0] = v[j].x;
    dst[1] = v[j].y;
    dst[2] = v[j].z;
    dst[3] = v[j].w;
  }
  __syncthreads();

  float tile_inv = 0.0f;
  if constexpr (kBlocks == Blocks::kTiles) {
    // Over the tile's 128 real columns (the pad words are never written).
    float m = 0.0f;
    for (int r = warp; r < kTile; r += kWarps) {
      const float2 a = __bfloat1622float2(tile[(r * kPitch) / 2 + 2 * lane]);
      const float2 b = __bfloat1622float2(tile[(r * kPitch) / 2 + 2 * lane + 1]);
      m = amax_of(m, amax_of(amax_of(fabsf(a.x), fabsf(a.y)), amax_of(fabsf(b.x), fabsf(b.y))));
    }
    m = group_amax(m);
    if (lane == 0) warp_max[warp] = m;
    __syncthreads();
    m = warp_max[0];
#pragma unroll
    for (int w = 1; w < kWarps; ++w) m = amax_of(m, warp_max[w]);
    const float s = E4m3::scale(m);
    tile_inv = E4m3::inverse(s);
    if (threadIdx.x == 0) {
      if (out.codes) out.scales[blockIdx.y * out.ld_scales + blockIdx.x] = s;
      if (out_t.codes) out_t.scales[blockIdx.x * out_t.ld_scales + blockIdx.y] = s;
    }
  }

  // Rows: lane holds columns 4·lane .. 4·lane + 3 of row r. Under 1x128 blocks the rows past x
  // up to a multiple of 4 get scale 1 (their amax is 0): the GEMM's TMA reads whole 16 bytes.
  if (out.codes) {
    const int64_t rows_scaled =
        kBlocks == Blocks::kRows ? ScaleLayout::row_scales_ld(rows) - row0 : rows_here;
    const int row_end = rows_scaled < kTile ? int(rows_scaled) : kTile;
    for (int r = warp; r < row_end; r += kWarps) {
      const float2 a = __bfloat1622float2(tile[(r * kPitch) / 2 + 2 * lane]);
      const float2 b = __bfloat1622float2(tile[(r * kPitch) / 2 + 2 * lane + 1]);
      float inv = tile_inv;
      if constexpr (kBlocks == Blocks::kRows) {
        const float m =
            group_amax(amax_of(amax_of(fabsf(a.x), fabsf(a.y)), amax_of(fabsf(b.x), fabsf(b.y))));
        const float s = E4m3::scale(m);
        inv = E4m3::inverse(s);
        if (lane == 0) out.scales[blockIdx.x * out.ld_scales + row0 + r] = s;
      }
      if (r < rows_here && 4 * lane < cols_here)
        *reinterpret_cast<uint32_t*>(out.codes + (row0 + r) * out.ld + col0 + 4 * lane) =
            pack4(a.x, a.y, b.x, b.y, inv);
    }
  }

  // Columns (the transposed copy): lane holds rows lane + 32·i of column c, quantized into the
  // staged codes; then 16-byte stores of xᵀ's rows. Rows past x up to the next multiple of 16
  // hold code 0 (their values are 0).
  if (out_t.codes) {
    const __nv_bfloat16* t = reinterpret_cast<const __nv_bfloat16*>(tile);
    for (int c = warp; c < cols_here; c += kWarps) {
      float v4[4];
      float m = 0.0f;
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        v4[i] = __bfloat162float(t[(lane + 32 * i) * kPitch + c]);
        m = amax_of(m, fabsf(v4[i]));
      }
      float inv = tile_inv;
      if constexpr (kBlocks == Blocks::kRows) {
        const float s = E4m3::scale(group_amax(m));
        inv = E4m3::inverse(s);
        if (lane == 0) out_t.scales[blockIdx.y * out_t.ld_scales + col0 + c] = s;
      }
#pragma unroll
      for (int i = 0; i < 4; ++i)
        tcodes[c * kTile + lane + 32 * i] =  // 0 past x, even in a block whose scale is NaN
            row0 + lane + 32 * i < rows ? E4m3::quantize_by_inverse(v4[i], inv) : uint8_t(0);
    }
    __syncthreads();
    const int64_t rows_padded = ScaleLayout::padded_tokens(rows) - row0;
    const int rows_written = rows_padded < kTile ? int(rows_padded) : kTile;
    for (int i = threadIdx.x; i < kTile * kTile / 16; i += kThreads) {
      const int c = i / (kTile / 16), r = i % (kTile / 16) * 16;
      if (c < cols_here && r < rows_written)
        *reinterpret_cast<uint4*>(out_t.codes + (col0 + c) * out_t.ld + row0 + r) =
            *reinterpret_cast<const uint4*>(tcodes + c * kTile + r);
    }
  }
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

template <Blocks kBlocks>
void launch_tiles(const char* op, const bf16* x, int64_t rows, int64_t cols, int64_t ldx,
                  const Fp8Output& out, const Fp8Output& out_t, cudaStream_t stream) {
  const int64_t row_blocks = ScaleLayout::blocks(rows), col_blocks = ScaleLayout::blocks(cols);
  CODA_CHECK(row_blocks < 65536, op, ": ", rows, " rows is too many (at most 65535 tiles)");
  // Per launch (the current device's function attribute; no synchronization).
  CODA_CUDA_CHECK(cudaFuncSetAttribute(quantize_tile_kernel<kBlocks>,
                                       cudaFuncAttributeMaxDynamicSharedMemorySize, kTileSmem));
  const dim3 grid{unsigned(col_blocks), unsigned(row_blocks)};
  quantize_tile_kernel<kBlocks>
      <<<grid, kThreads, kTileSmem, stream>>>(x, rows, cols, ldx, out, out_t);
  CODA_CUDA_CHECK(cudaGetLastError());
}

}  // namespace

void quantize_fp8_rows(const bf16* x, int64_t rows, int64_t cols, int64_t ldx, Fp8Output out,
                       Fp8Output out_t, cudaStream_t stream) {
  const char* op = "coda::kernel::quantize_fp8_rows";
  check_input(op, x, rows, cols, ldx, out, out_t);
  check_output(op, "out", out, cols, ScaleLayout::row_scales_ld(rows));
  check_output(op, "out_t", out_t, ScaleLayout::padded_tokens(rows), cols);
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

}  // namespace coda::kernel
