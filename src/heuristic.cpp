// Kernel configuration heuristic (see include/coda/kernel/heuristic.hpp).
//
// Measured on the H200 (bench/results/2026-11-29-run2-gemm-sweep.json: 31 LLaMA-3 / square shapes,
// 5 configs x 8 scheduler options, ours vs cuBLAS). Per-shape best configs are noisy (7-run
// medians); the rule below maximized the geometric mean over the sweep (1.013) with no shape below
// 0.91 (1B gate_up at M = 16384 is the weakest):
//   N <= 6144 and K <= 8192 -> pingpong 128x128, cluster 1x2, swizzle 1, raster N
//   otherwise, K <= 2048    -> cooperative 128x256, cluster 2x1, swizzle 1, raster M
//   otherwise               -> cooperative 256x128, cluster 1x2, swizzle 8, raster M
#include "coda/kernel/heuristic.hpp"

namespace coda::kernel {

KernelChoice plain_gemm_config(int m, int n, int k) {
  (void)m;
  if (n <= 6144 && k <= 8192) return {Config::kPing128x128x64_1x2, {1, Raster::kAlongN}};
  if (k <= 2048) return {Config::kCoop128x256x64_2x1, {1, Raster::kAlongM}};
  return {Config::kCoop256x128x64_1x2, {8, Raster::kAlongM}};
}

namespace {

// Fused programs are compiled for fewer configurations (src/kernels/kernels.cmake); the order of
// preference per program, from bench/results/2026-11-29-run2-programs.json (fused time per config).
KernelChoice program_config(Program p, int m, int n, int k) {
  const KernelChoice plain = plain_gemm_config(m, n, k);
  switch (p) {
    case Program::kRmsnormSwiglu:
      // Pingpong overlaps the SwiGLU epilogue with the other warpgroup's MMA: faster than
      // cooperative 128x256 in 5 of 6 LLaMA gate/up shapes.
      return {Config::kPing128x128x64_1x2, {1, Raster::kAlongN}};
    case Program::kRmsnormLse:
    case Program::kRmsnormLseLogits:
      return {Config::kCoop128x256x64_2x1, {8, Raster::kAlongN}};
    case Program::kResidualRmsnormPartial:
    case Program::kRmsnormRope:
      // Same split as the plain GEMM, between the two compiled configurations.
      if (plain.config == Config::kPing128x128x64_1x2) return plain;
      return {Config::kCoop128x256x64_2x1, plain.scheduler};
    default:
      return plain;
  }
}

}  // namespace

KernelChoice choose_config(Program p, Operands o, int m, int n, int k) {
  const KernelChoice c = p == Program::kPlain ? plain_gemm_config(m, n, k) : program_config(p, m, n, k);
  if (find_kernel(p, c.config, o)) return c;
  for (int i = 0; i < static_cast<int>(Config::kCount); ++i)
    if (find_kernel(p, static_cast<Config>(i), o)) return {static_cast<Config>(i), c.scheduler};
  return c;
}

}  // namespace coda::kernel
