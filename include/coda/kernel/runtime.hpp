#pragma once
// Process-wide state of the Hopper executor, apart from the pure heuristic: the devices'
// properties (read once per device), kernel overrides for tuning, and the programmatic-launch
// switch. select_kernel is what the op layer calls for each launch.

#include <cuda_runtime.h>

#include <string>
#include <vector>

#include "coda/kernel/heuristic.hpp"

namespace coda::kernel {

// The properties of CUDA device `device`, read once per device; a failed query is returned, not
// cached.
cudaError_t device_props(int device, DeviceProps* props);

// The kernel a launch on the current device takes: an override for the program (below), or
// choose_config with the current device's properties (or `props`, where given). Throws
// coda::Error when the choice is not compiled in this build (a CODA_KERNELS subset) or the device
// cannot be queried.
KernelChoice select_kernel(Program program, Operands operands, const GemmShape& shape,
                           const DeviceProps* props = nullptr);

// Programmatic dependent launch (PDL) of the GEMM kernels; on unless turned off. A GEMM launched
// so may start its CTAs (barrier set-up, descriptor prefetch) while the kernel before it in the
// stream drains. Every CUDA translation unit is compiled with CUTLASS_ENABLE_GDC_FOR_SM90, so
// CUTLASS's producer warps wait for that kernel (griddepcontrol.wait) before their first global
// access, and its consumer warps let the next kernel launch after their last tile's mainloop.
// The environment variable CODA_PROGRAMMATIC_LAUNCH (0 or 1), read at the first launch, or
// set_programmatic_launch sets it; any other value throws coda::Error naming it.
bool programmatic_launch();
void set_programmatic_launch(bool on);
// CODA_PROGRAMMATIC_LAUNCH's value as on / off: unset (null), "" and "1" are on, "0" off.
bool parse_programmatic_launch(const char* value);

// One CODA_KERNEL_OVERRIDE entry: every launch of `program` with `operands` (and, where k > 0,
// that inner dimension K) takes `choice`.
struct KernelOverride {
  Program program;
  Operands operands;
  KernelChoice choice;
  int k = 0;
};

// Parses "PROGRAM/OPERANDS[@K]=CONFIG:SWIZZLE:RASTER" entries separated by ';', with the names of
// program_name (e.g. gemm_rmsnorm_backward), XWt / XW / XtY / Fp8XWt / Fp8XYt and config_name (e.g.
// coop_256x128x64_c1x2), SWIZZLE 1/2/4/8 and RASTER M or N; "@K" limits an entry to launches
// with that K (one projection of a layer), e.g.
//   gemm_rmsnorm_backward/XW@28672=coop_256x128x64_c1x2:8:M;gemm/XtY=coop_128x256x64_c2x1:4:N
// An entry for the launch's K wins over one without "@K". Blanks around entries are ignored.
// Throws coda::Error naming the bad entry and the accepted values; an entry named twice, or one
// for a kernel the table does not list, is an error too.
std::vector<KernelOverride> parse_kernel_overrides(const std::string& spec);

// Replaces the active overrides (CODA_KERNEL_OVERRIDE's, read at the first launch, or an earlier
// call's) from now on; "" clears them. A bad spec throws and leaves the active ones. Partial-buffer
// layouts follow the configuration: size buffers and fold with the overrides that run the launch.
// For tuning and benchmarks only.
void set_kernel_overrides(const std::string& spec);

}  // namespace coda::kernel
