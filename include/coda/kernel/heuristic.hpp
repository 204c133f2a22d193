#pragma once
// The one place that maps a problem to a kernel configuration (tile, cluster, schedule, scheduler
// options), per program family. Tables come from measured sweeps on the H200
// (bench/results/*gemm*.json, docs/performance.md).

#include "coda/kernel/args.hpp"

namespace coda::kernel {

struct KernelChoice {
  Config config;
  SchedulerOptions scheduler;
};

// Plain GEMM D = X · Wᵀ.
KernelChoice plain_gemm_config(int m, int n, int k);

// Any program; falls back to a compiled configuration of that program.
KernelChoice choose_config(Program p, Operands o, int m, int n, int k);

}  // namespace coda::kernel
