#pragma once
// The one place that maps a problem to a kernel configuration (tile, cluster, schedule, scheduler
// options), per program family. Tables come from measured sweeps on the H200
// (bench/results/*gemm*.json, docs/performance.md).

#include <string>
#include <vector>

#include "coda/kernel/args.hpp"

namespace coda::kernel {

struct KernelChoice {
  Config config;
  SchedulerOptions scheduler;
};

// Plain GEMM D = X · Wᵀ.
KernelChoice plain_gemm_config(int m, int n, int k);

// Any program; falls back to a compiled configuration of that program. The environment variable
// CODA_KERNEL_OVERRIDE, read once, replaces the choice for whole program / operand pairs (for
// tuning and benchmarks only; see parse_kernel_overrides).
KernelChoice choose_config(Program p, Operands o, int m, int n, int k);

// One CODA_KERNEL_OVERRIDE entry: every launch of `program` with `operands` takes `choice`.
struct KernelOverride {
  Program program;
  Operands operands;
  KernelChoice choice;
};

// Parses "PROGRAM/OPERANDS=CONFIG:SWIZZLE:RASTER" entries separated by ';', with the names of
// program_name (e.g. gemm_rmsnorm_backward), XWt / XW / XtY and config_name (e.g.
// coop_256x128x64_c1x2), SWIZZLE 1/2/4/8 and RASTER M or N, e.g.
//   gemm_rmsnorm_backward/XW=ping_128x128x64_c1x2:8:M;gemm/XtY=coop_128x256x64_c2x1:4:N
// Blanks around entries are ignored. Throws coda::Error naming the bad entry and the accepted
// values; a program / operand pair named twice is an error too.
std::vector<KernelOverride> parse_kernel_overrides(const std::string& spec);

}  // namespace coda::kernel
