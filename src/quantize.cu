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
#include "quantize_tiles.cuh"

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
using tiles::check_output;
using tiles::check_outputs;
using tiles::InputScales;
using tiles::launch_tile_kernel;

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
