// Runtime state of the Hopper executor (include/coda/kernel/runtime.hpp).
#include "coda/kernel/runtime.hpp"

#include <atomic>
#include <cstdlib>
#include <iterator>
#include <memory>
#include <mutex>
#include <sstream>
#include <string>
#include <unordered_map>

#include "coda/common/check.hpp"

namespace coda::kernel {

cudaError_t device_props(int device, DeviceProps* props) {
  static std::mutex mutex;
  static std::unordered_map<int, DeviceProps> cached;
  std::lock_guard<std::mutex> lock(mutex);
  auto it = cached.find(device);
  if (it == cached.end()) {
    DeviceProps p;
    const cudaError_t e =
        cudaDeviceGetAttribute(&p.multiprocessors, cudaDevAttrMultiProcessorCount, device);
    if (e != cudaSuccess) return e;
    it = cached.emplace(device, p).first;
  }
  *props = it->second;
  return cudaSuccess;
}

std::vector<KernelOverride> parse_kernel_overrides(const std::string& spec) {
  auto names = [](int count, auto name_of) {  // "a, b, c" for an error message
    std::string all;
    for (int i = 0; i < count; ++i) all += std::string(i ? ", " : "") + name_of(i);
    return all;
  };
  auto trim = [](std::string t) {
    const auto b = t.find_first_not_of(" \t\r\n"), l = t.find_last_not_of(" \t\r\n");
    return b == std::string::npos ? std::string() : t.substr(b, l - b + 1);
  };
  std::vector<KernelOverride> out;
  std::stringstream entries(spec);
  std::string e;
  while (std::getline(entries, e, ';')) {
    e = trim(e);
    if (e.empty()) continue;
    const auto slash = e.find('/'), eq = e.find('=');
    CODA_CHECK(slash != std::string::npos && eq != std::string::npos && slash < eq,
               "CODA_KERNEL_OVERRIDE: expected PROGRAM/OPERANDS[@K]=CONFIG:SWIZZLE:RASTER, got '",
               e, "'");
    const std::string prog = e.substr(0, slash);
    std::string ops = e.substr(slash + 1, eq - slash - 1);
    int only_k = 0;
    if (const auto at = ops.find('@'); at != std::string::npos) {
      const std::string ks = ops.substr(at + 1);
      ops = ops.substr(0, at);
      CODA_CHECK(!ks.empty() && ks.size() <= 9 &&
                     ks.find_first_not_of("0123456789") == std::string::npos && std::stoi(ks) > 0,
                 "CODA_KERNEL_OVERRIDE: K '", ks, "' in '", e, "': expected a positive integer");
      only_k = std::stoi(ks);
    }
    std::stringstream rhs(e.substr(eq + 1));
    std::string cfg, sw, ra, rest;
    std::getline(rhs, cfg, ':');
    std::getline(rhs, sw, ':');
    std::getline(rhs, ra, ':');
    std::getline(rhs, rest);
    CODA_CHECK(rest.empty(), "CODA_KERNEL_OVERRIDE: unexpected '", rest, "' after the raster in '",
               e, "'");
    KernelOverride v{Program::kCount, Operands::kXWt, {Config::kCount, {}}, only_k};
    for (int i = 0; i < int(Program::kCount); ++i)
      if (prog == program_name(Program(i))) v.program = Program(i);
    CODA_CHECK(v.program != Program::kCount, "CODA_KERNEL_OVERRIDE: unknown program '", prog,
               "' in '", e, "'; expected one of ",
               names(int(Program::kCount), [](int i) { return program_name(Program(i)); }));
    const char* const kOperandNames[] = {"XWt", "XW", "XtY", "Fp8XWt", "Fp8XYt"};
    int operands = -1;
    static_assert(std::size(kOperandNames) == std::size(kAllOperands));
    for (int i = 0; i < int(std::size(kOperandNames)); ++i)
      if (ops == kOperandNames[i]) operands = i;
    CODA_CHECK(operands >= 0, "CODA_KERNEL_OVERRIDE: operands '", ops, "' in '", e,
               "': expected XWt, XW, XtY, Fp8XWt or Fp8XYt");
    v.operands = Operands(operands);
    for (int i = 0; i < int(Config::kCount); ++i)
      if (cfg == config_name(Config(i))) v.choice.config = Config(i);
    CODA_CHECK(v.choice.config != Config::kCount, "CODA_KERNEL_OVERRIDE: unknown configuration '",
               cfg, "' in '", e, "'; expected one of ",
               names(int(Config::kCount), [](int i) { return config_name(Config(i)); }));
    CODA_CHECK(in_table(v.program, v.choice.config, v.operands), "CODA_KERNEL_OVERRIDE: '", e,
               "': ", prog, " with ", ops, " on ", cfg,
               " is not a kernel of include/coda/kernel/table.def");
    CODA_CHECK(sw == "1" || sw == "2" || sw == "4" || sw == "8", "CODA_KERNEL_OVERRIDE: swizzle '",
               sw, "' in '", e, "': expected 1, 2, 4 or 8");
    CODA_CHECK(ra == "M" || ra == "N", "CODA_KERNEL_OVERRIDE: raster '", ra, "' in '", e,
               "': expected M or N");
    v.choice.scheduler = {std::stoi(sw), ra == "M" ? Raster::kAlongM : Raster::kAlongN};
    for (const KernelOverride& w : out)
      CODA_CHECK(w.program != v.program || w.operands != v.operands || w.k != v.k,
                 "CODA_KERNEL_OVERRIDE: ", prog, "/", ops,
                 v.k ? "@" + std::to_string(v.k) : std::string(), " is named twice");
    out.push_back(v);
  }
  return out;
}

namespace {
// The active overrides: CODA_KERNEL_OVERRIDE's at the first launch, until set_kernel_overrides
// replaces them. Readers take a reference-counted snapshot, so a replacement never frees a list
// a launch on another thread is still reading.
struct ActiveOverrides {
  std::mutex mutex;
  std::shared_ptr<const std::vector<KernelOverride>> list;
};
ActiveOverrides& active_overrides() {
  static ActiveOverrides a;
  return a;
}
std::shared_ptr<const std::vector<KernelOverride>> overrides_snapshot() {
  ActiveOverrides& a = active_overrides();
  std::lock_guard<std::mutex> lock(a.mutex);
  if (!a.list) {
    const char* s = std::getenv("CODA_KERNEL_OVERRIDE");
    a.list = std::make_shared<const std::vector<KernelOverride>>(s ? parse_kernel_overrides(s)
                                                                   : std::vector<KernelOverride>{});
  }
  return a.list;
}

// Whether GEMMs launch with PDL: 1 / 0, or -1 until the environment is read at the first launch.
// Read on every launch, so an atomic rather than a lock.
std::atomic<int> g_programmatic_launch{-1};
}  // namespace

void set_kernel_overrides(const std::string& spec) {
  auto parsed = std::make_shared<const std::vector<KernelOverride>>(parse_kernel_overrides(spec));
  ActiveOverrides& a = active_overrides();
  std::lock_guard<std::mutex> lock(a.mutex);
  a.list = std::move(parsed);
}

bool parse_programmatic_launch(const char* value) {
  const std::string v = value ? value : "";
  CODA_CHECK(v.empty() || v == "0" || v == "1",
             "CODA_PROGRAMMATIC_LAUNCH: expected 0 (off) or 1 (on, the default), got '", v, "'");
  return v != "0";
}

bool programmatic_launch() {
  int v = g_programmatic_launch.load(std::memory_order_relaxed);
  if (v < 0) {
    // Parsed first (it may throw); a setting made meanwhile by set_programmatic_launch wins.
    const int env = parse_programmatic_launch(std::getenv("CODA_PROGRAMMATIC_LAUNCH")) ? 1 : 0;
    if (g_programmatic_launch.compare_exchange_strong(v, env, std::memory_order_relaxed)) v = env;
  }
  return v == 1;
}

void set_programmatic_launch(bool on) {
  g_programmatic_launch.store(on ? 1 : 0, std::memory_order_relaxed);
}

KernelChoice select_kernel(Program p, Operands o, const GemmShape& s, const DeviceProps* given) {
  const auto overrides = overrides_snapshot();
  // An entry for this K wins over one for every K, wherever either stands in the list.
  const KernelOverride* match = nullptr;
  for (const KernelOverride& v : *overrides)
    if (v.program == p && v.operands == o && (v.k == s.k || (v.k == 0 && !match))) match = &v;
  KernelChoice c;
  if (match) {
    c = match->choice;
  } else if (given) {
    c = choose_config(p, o, s, *given);
  } else {
    int device = 0;
    DeviceProps props;
    cudaError_t e = cudaGetDevice(&device);
    if (e == cudaSuccess) e = device_props(device, &props);
    CODA_CHECK(e == cudaSuccess, program_name(p),
               ": cannot read the current device's properties: ", cudaGetErrorString(e));
    c = choose_config(p, o, s, props);
  }
  CODA_CHECK(compiled(p, c.config, o), program_name(p), " with ", operands_name(o), " on ",
             config_name(c.config), match ? " (CODA_KERNEL_OVERRIDE)" : "",
             " is not compiled in this build (CODA_KERNELS; include/coda/kernel/table.def)");
  return c;
}

}  // namespace coda::kernel
