// The FP8 cast kernels of kernel/quantize.hpp. One CTA per 128x128 tile of x: the tile goes
// through shared memory once, then rows (1x128 blocks) and columns (128x1 blocks, the transposed
// copy) are quantized from it, each by one warp per row or column with a shuffle amax.
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
__device__ __forceinline__ float warp_amax(float m) {
#pragma unroll
  for (int o = 16; o > 0; o /= 2) m = amax_of(m, __shfl_xor_sync(0xffffffffu, m, o));
  return m;
}

enum class Blocks { kRows, kTiles };

// Blocks::kRows: `out` per 1x128 row block, `out_t` per 128x1 column block. Blocks::kTiles: one
// scale for the whole 128x128 tile, for both.
template <Blocks kBlocks>
__global__ void __launch_bounds__(kThreads)
    quantize_kernel(const bf16* __restrict__ x, int64_t rows, int64_t cols, int64_t ldx,
                    Fp8Output out, Fp8Output out_t) {
  __shared__ __nv_bfloat162 tile[kTile * kPitch / 2];
  __shared__ float warp_max[kWarps];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t row0 = int64_t(blockIdx.y) * kTile, col0 = int64_t(blockIdx.x) * kTile;
  const int64_t rows_here = rows - row0 < kTile ? rows - row0 : kTile;
  const int64_t cols_here = cols - col0 < kTile ? cols - col0 : kTile;

  // Load: 16-byte chunks (8 bf16), zeros outside x (they add nothing to an amax).
  for (int i = threadIdx.x; i < kTile * kTile / 8; i += kThreads) {
    const int r = i / (kTile / 8), c = i % (kTile / 8) * 8;
    uint4 v = make_uint4(0, 0, 0, 0);
    if (r < rows_here && c < cols_here)
      v = *reinterpret_cast<const uint4*>(x + (row0 + r) * ldx + col0 + c);
    uint32_t* dst = reinterpret_cast<uint32_t*>(tile) + (r * kPitch + c) / 2;
    dst[0] = v.x;
    dst[1] = v.y;
    dst[2] = v.z;
    dst[3] = v.w;
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
    m = warp_amax(m);
    if (lane == 0) warp_max[warp] = m;
    __syncthreads();
    m = warp_max[0];
#pragma unroll
    for (int w = 1; w < kWarps; ++w) m = amax_of(m, warp_max[w]);
    const float s = E4m3::scale(m);
    tile_inv = 1.0f / s;
    if (threadIdx.x == 0) {
      if (out.codes) out.scales[blockIdx.y * out.ld_scales + blockIdx.x] = s;
      if (out_t.codes) out_t.scales[blockIdx.x * out_t.ld_scales + blockIdx.y] = s;
    }
  }

  // Rows: lane holds columns 4·lane .. 4·lane + 3 of row r. Under 1x128 blocks the rows past x
  // up to a multiple of 4 get scale 1 (their amax is 0): the GEMM's TMA reads whole 16 bytes.
  if (out.codes) {
    const int64_t rows_scaled = kBlocks == Blocks::kRows ? (rows + 3) / 4 * 4 - row0 : rows_here;
    const int row_end = rows_scaled < kTile ? int(rows_scaled) : kTile;
    for (int r = warp; r < row_end; r += kWarps) {
      const float2 a = __bfloat1622float2(tile[(r * kPitch) / 2 + 2 * lane]);
      const float2 b = __bfloat1622float2(tile[(r * kPitch) / 2 + 2 * lane + 1]);
      float inv = tile_inv;
      if constexpr (kBlocks == Blocks::kRows) {
        const float m =
            warp_amax(amax_of(amax_of(fabsf(a.x), fabsf(a.y)), amax_of(fabsf(b.x), fabsf(b.y))));
        const float s = E4m3::scale(m);
        inv = 1.0f / s;
        if (lane == 0) out.scales[blockIdx.x * out.ld_scales + row0 + r] = s;
      }
      if (r < rows_here && 4 * lane < cols_here) {
        const uint32_t q = uint32_t(E4m3::quantize_by_inverse(a.x, inv)) |
                           uint32_t(E4m3::quantize_by_inverse(a.y, inv)) << 8 |
                           uint32_t(E4m3::quantize_by_inverse(b.x, inv)) << 16 |
                           uint32_t(E4m3::quantize_by_inverse(b.y, inv)) << 24;
        *reinterpret_cast<uint32_t*>(out.codes + (row0 + r) * out.ld + col0 + 4 * lane) = q;
      }
    }
  }

  // Columns (the transposed copy): lane holds rows lane + 32·i of column c; the codes of xᵀ's
  // row c are 32 consecutive bytes per i. Rows past x up to the next multiple of 16 get code 0.
  if (out_t.codes) {
    const int64_t rows_padded = (rows + 15) / 16 * 16 - row0;
    const int rows_written = rows_padded < kTile ? int(rows_padded) : kTile;
    const __nv_bfloat16* t = reinterpret_cast<const __nv_bfloat16*>(tile);
    for (int c = warp; c < cols_here; c += kWarps) {
      float v[4];
      float m = 0.0f;
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        v[i] = __bfloat162float(t[(lane + 32 * i) * kPitch + c]);
        m = amax_of(m, fabsf(v[i]));
      }
      float inv = tile_inv;
      if constexpr (kBlocks == Blocks::kRows) {
        const float s = E4m3::scale(warp_amax(m));
        inv = 1.0f / s;
        if (lane == 0) out_t.scales[blockIdx.y * out_t.ld_scales + col0 + c] = s;
      }
      uint8_t* dst = out_t.codes + (col0 + c) * out_t.ld + row0;
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int r = lane + 32 * i;
        if (r < rows_written) dst[r] = E4m3::quantize_by_inverse(v[i], inv);  // 0 past x
      }
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
  CODA_CHECK(o.ld_scales >= scale_cols, op, ": ", name,
             "'s scale row stride must be >= ", scale_cols, ", got ", o.ld_scales);
}

template <Blocks kBlocks>
void launch(const char* op, const bf16* x, int64_t rows, int64_t cols, int64_t ldx,
            const Fp8Output& out, const Fp8Output& out_t, cudaStream_t stream) {
  CODA_CHECK(x != nullptr && rows > 0 && cols > 0 && cols % 16 == 0 && ldx >= cols, op,
             ": x must be a (rows, cols) matrix with cols a multiple of 16, got (", rows, ", ",
             cols, ") with row stride ", ldx);
  CODA_CHECK(out.codes || out_t.codes, op, ": no output");
  const int64_t row_blocks = ScaleLayout::blocks(rows), col_blocks = ScaleLayout::blocks(cols);
  CODA_CHECK(row_blocks < 65536, op, ": ", rows, " rows is too many (at most 65535 tiles)");
  const dim3 grid{unsigned(col_blocks), unsigned(row_blocks)};
  quantize_kernel<kBlocks><<<grid, kThreads, 0, stream>>>(x, rows, cols, ldx, out, out_t);
  CODA_CUDA_CHECK(cudaGetLastError());
}

}  // namespace

void quantize_fp8_rows(const bf16* x, int64_t rows, int64_t cols, int64_t ldx, Fp8Output out,
                       Fp8Output out_t, cudaStream_t stream) {
  const char* op = "coda::kernel::quantize_fp8_rows";
  check_output(op, "out", out, cols, rows);
  check_output(op, "out_t", out_t, (rows + 15) / 16 * 16, cols);
  launch<Blocks::kRows>(op, x, rows, cols, ldx, out, out_t, stream);
}

void quantize_fp8_blocks(const bf16* x, int64_t rows, int64_t cols, int64_t ldx, Fp8Output out,
                         Fp8Output out_t, cudaStream_t stream) {
  const char* op = "coda::kernel::quantize_fp8_blocks";
  CODA_CHECK(!out_t.codes || rows % 16 == 0, op,
             ": the transposed copy needs rows a multiple of 16, got ", rows);
  check_output(op, "out", out, cols, ScaleLayout::blocks(cols));
  check_output(op, "out_t", out_t, rows, ScaleLayout::blocks(rows));
  launch<Blocks::kTiles>(op, x, rows, cols, ldx, out, out_t, stream);
}

}  // namespace coda::kernel
