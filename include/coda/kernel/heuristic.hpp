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

// The multiprocessor count of CUDA device `device` in *count, read once per device: the GEMM
// launcher's persistent grid and the weight-gradient rule's wave fill both take it from here.
cudaError_t device_multiprocessors(int device, int* count);

// Programmatic dependent launch (PDL) of the GEMM kernels; on unless turned off. A GEMM launched
// so may start its CTAs (barrier set-up, descriptor prefetch) while the kernel before it in the
// stream drains. Every CUDA translation unit is compiled with CUTLASS_ENABLE_GDC_FOR_SM90, so
// CUTLASS's producer warps wait for that kernel (griddepcontrol.wait) before their first global
// access, and its consumer warps let the next kernel launch after their last tile's mainloop.
// The environment variable CODA_PROGRAMMATIC_LAUNCH (0 or 1), read at the first launch, or
// set_programmatic_launch sets it; any other value throws coda::Error naming it. Benchmarks turn
// it off to time both ways in one process.
bool programmatic_launch();
void set_programmatic_launch(bool on);
// CODA_PROGRAMMATIC_LAUNCH's value as on / off: unset (null), "" and "1" are on, "0" off.
bool parse_programmatic_launch(const char* value);

// Any program; falls back to a compiled configuration of that program. The environment variable
// CODA_KERNEL_OVERRIDE, read at the first launch, or set_kernel_overrides replaces the choice for
// program / operand pairs (for tuning and benchmarks only; see parse_kernel_overrides). sms is the
// device's multiprocessor count, which the weight-gradient rule weighs (how full the last wave of
// tiles is; an H100 / H200 SXM has 132, an H100 PCIe 114); 0, the default, means the current
// device's, queried once per device and only by that rule, so every other choice (and the
// partial-buffer layouts that follow it) stays a host-only computation.
KernelChoice choose_config(Program p, Operands o, int m, int n, int k, int sms = 0);

// One CODA_KERNEL_OVERRIDE entry: every launch of `program` with `operands` (and, where k > 0,
// that inner dimension K) takes `choice`.
struct KernelOverride {
  Program program;
  Operands operands;
  KernelChoice choice;
  int k = 0;
};

// Parses "PROGRAM/OPERANDS[@K]=CONFIG:SWIZZLE:RASTER" entries separated by ';', with the names of
// program_name (e.g. gemm_rmsnorm_backward), XWt / XW / XtY and config_name (e.g.
// coop_256x128x64_c1x2), SWIZZLE 1/2/4/8 and RASTER M or N; "@K" limits an entry to launches
// with that K (one projection of a layer), e.g.
//   gemm_rmsnorm_backward/XW@28672=coop_256x128x64_c1x2:8:M;gemm/XtY=coop_128x256x64_c2x1:4:N
// An entry for the launch's K wins over one without "@K". Blanks around entries are ignored.
// Throws coda::Error naming the bad entry and the accepted values; an entry named twice is an
// error too.
std::vector<KernelOverride> parse_kernel_overrides(const std::string& spec);

// Replaces the active overrides (CODA_KERNEL_OVERRIDE's, or an earlier call's) from now on, so a
// benchmark can time two configuration sets in one process; "" clears them. A bad spec throws and
// leaves the active ones. Partial-buffer layouts follow the configuration: size buffers and fold
// with the overrides that run the launch. Tuning only.
void set_kernel_overrides(const std::string& spec);

}  // namespace coda::kernel
