#pragma once
// What src/quantize.cu's cast kernels and src/fp8_passes.cu's epilogue passes share: the 128x128
// tile kernels' launch and argument checks, cp.async copies into shared memory and a half-warp's
// row sum. Internal to the kernels' library (not installed).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "coda/common/check.hpp"
#include "coda/kernel/args.hpp"
#include "coda/kernel/cuda_check.hpp"
#include "coda/kernel/fp8_tile.cuh"

namespace coda::kernel::tiles {

using fp8_tile::kThreads;

// An FP8 input's scales: block b of row r at b · ld + r.
struct InputScales {
  const float* scales = nullptr;
  int64_t ld = 0;
};

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
// Commits the copies issued so far as one group; commit_and_wait then waits until at most
// `kPending` groups are still in flight, wait_async_copies until none is.
__device__ __forceinline__ void commit_async_copies() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}
template <int kPending>
__device__ __forceinline__ void commit_and_wait() {
  asm volatile("cp.async.commit_group;\ncp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
}
__device__ __forceinline__ void wait_async_copies() { commit_and_wait<0>(); }

// A row's partial sum over 128 columns held 8 a lane by a half-warp: the half-warp's sum, stored
// at `at` by its first lane (one writer a row) where `store`.
__device__ __forceinline__ void store_row_partial(float part, float* at, bool store) {
#pragma unroll
  for (int o = 8; o > 0; o /= 2) part += __shfl_xor_sync(0xffffffffu, part, o);
  if (threadIdx.x % 16 == 0 && store) *at = part;
}

// An output of `cols`-wide code rows whose scale rows hold `scale_cols` entries.
inline void check_output(const char* op, const char* name, const Fp8Output& o, int64_t cols,
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
inline void check_rows16(const char* op, const char* name, const void* p, int64_t ld,
                         int64_t cols) {
  CODA_CHECK(p != nullptr && ld >= cols && ld % 8 == 0 && reinterpret_cast<uintptr_t>(p) % 16 == 0,
             op, ": ", name,
             "'s start and row stride must be 16-byte aligned with the stride >= ", cols,
             ", got row stride ", ld, " at address ", p);
}

// The quantized outputs of a (rows, cols) tensor, rows and transposed copy, at least one wanted.
inline void check_outputs(const char* op, const Fp8Output& out, const Fp8Output& out_t,
                          int64_t rows, int64_t cols) {
  CODA_CHECK(out.codes || out_t.codes, op, ": no output");
  check_output(op, "out", out, cols, ScaleLayout::row_scales_ld(rows));
  check_output(op, "out_t", out_t, ScaleLayout::padded_tokens(rows), cols);
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

}  // namespace coda::kernel::tiles
