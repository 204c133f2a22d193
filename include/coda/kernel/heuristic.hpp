#pragma once
// The one place that maps a problem to a kernel configuration (tile, cluster, schedule, scheduler
// options), per program family: a pure function of the problem and the device's properties, so
// it runs and is tested on any machine. Runtime state (the device-property cache, overrides,
// the launch switch) lives in kernel/runtime.hpp. The rules come from sweeps on the H200; the
// measurements behind each are cited next to it in src/heuristic.cpp.

#include "coda/kernel/args.hpp"

namespace coda::kernel {

struct KernelChoice {
  Config config;
  SchedulerOptions scheduler;
};

struct GemmShape {
  int m = 0, n = 0, k = 0;
};

// What the rules read off the device.
struct DeviceProps {
  int multiprocessors = 0;  // an H100 / H200 SXM has 132, an H100 PCIe 114
};

// The configuration for `program` with `operands` at `shape` on a device with `props`; for every
// (program, operands) pair of the table a kernel the table lists (in_table). Throws coda::Error
// for non-positive sizes or multiprocessors.
KernelChoice choose_config(Program program, Operands operands, const GemmShape& shape,
                           const DeviceProps& props);

}  // namespace coda::kernel
