// Kernel configuration heuristic (see include/coda/kernel/heuristic.hpp).
#include "coda/kernel/heuristic.hpp"

namespace coda::kernel {

KernelChoice plain_gemm_config(int m, int n, int k) {
  (void)m;
  (void)k;
  // Large N (gate/up, LM head): 128x256 cooperative tiles with a 2x1 cluster; small N (out-proj,
  // QKV of small models): 128x128 pingpong, whose epilogue overlaps the other warpgroup's MMA.
  if (n >= 8192) return {Config::kCoop128x256x64_2x1, {1, Raster::kHeuristic}};
  return {Config::kPing128x128x64_1x2, {1, Raster::kHeuristic}};
}

KernelChoice choose_config(Program p, Operands o, int m, int n, int k) {
  KernelChoice c = plain_gemm_config(m, n, k);
  if (p == Program::kPlain && o == Operands::kXWt) return c;
  if (find_kernel(p, c.config, o)) return c;
  for (int i = 0; i < static_cast<int>(Config::kCount); ++i)
    if (find_kernel(p, static_cast<Config>(i), o)) return {static_cast<Config>(i), c.scheduler};
  return c;
}

}  // namespace coda::kernel
