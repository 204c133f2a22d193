// Kernel configuration heuristic (see include/coda/kernel/heuristic.hpp).
//
// Plain GEMM, from the H200 sweep bench/results/2026-11-29-run2-gemm-sweep.json (31 LLaMA-3 /
// square shapes, 5 configs x 8 scheduler options, ratio to cuBLAS; 7-run medians, so single
// entries carry ~5-20% run-to-run noise): one choice per regime, picked for the regime's geometric
// mean with a penalty below 0.95 (sweep estimate: geomean 1.008, worst 0.92, 1B gate/up):
//   N >= 100000 (LM head)            pingpong 128x192, cluster 2x1, swizzle 4, raster N
//   N <= 6144 or K <= 2048           pingpong 128x128, cluster 1x2, raster M, the largest swizzle
//                                    that pads the tile grid by at most 2% (run 92)
//   N >= 16384 (gate/up)             pingpong 128x192, cluster 2x1, swizzle 8, raster N
//   otherwise                        cooperative 256x128, cluster 1x2, swizzle 8, raster N
#include "coda/kernel/heuristic.hpp"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <sstream>
#include <string>
#include <unordered_map>

#include <cuda_runtime.h>

#include "coda/common/check.hpp"

namespace coda::kernel {

namespace {

// The tiles CUTLASS's persistent scheduler runs for an (M, N) problem: the tile counts rounded up
// to whole clusters, then both up to swizzle x cluster tiles, where the swizzle is first capped by
// the smaller count (8 needs 6 tiles, 4 needs 3, 2 needs 2; PersistentTileSchedulerSm90Params::
// initialize). The padded tiles take their turns like real ones.
int64_t scheduled_tiles(int m, int n, int tile_m, int tile_n, int cluster_m, int cluster_n,
                        int swizzle) {
  auto round_up = [](int64_t x, int64_t q) { return (x + q - 1) / q * q; };
  const int64_t tm = round_up((m + tile_m - 1) / tile_m, cluster_m);
  const int64_t tn = round_up((n + tile_n - 1) / tile_n, cluster_n);
  const int64_t fewer = std::min(tm, tn);
  const int s = swizzle >= 8 && fewer >= 6   ? 8
                : swizzle >= 4 && fewer >= 3 ? 4
                : swizzle >= 2 && fewer >= 2 ? 2
                                             : 1;
  return round_up(tm, s * cluster_m) * round_up(tn, s * cluster_n);
}

// Pingpong 128x128 with cluster 1x2, tiles walked along M, at the largest swizzle up to 8 whose
// padding adds at most 2% to the tiles of swizzle 1. At every 1B / 8B shape the pingpong programs
// and the plain GEMM ran 3-13% faster at swizzle 4 or 8 than at 1 (run 92, bench/results/
// 2026-11-30-run88-92-swizzle.txt), except where swizzle 8 padded the grid (1B QKV: 24 tile
// columns, 12 clusters, rounded up to 16: 38-47% slower). Token counts that are not a multiple
// of 8 tiles pad along M as well (600 tokens: 5 tile rows, 8 at swizzle 4).
SchedulerOptions ping_128x128_1x2_order(int m, int n) {
  const int64_t unswizzled = scheduled_tiles(m, n, 128, 128, 1, 2, 1);
  for (int s : {8, 4, 2})
    if (scheduled_tiles(m, n, 128, 128, 1, 2, s) * 50 <= unswizzled * 51)
      return {s, Raster::kAlongM};
  return {1, Raster::kAlongM};
}

}  // namespace

cudaError_t device_multiprocessors(int device, int* count) {
  static std::mutex mutex;
  static std::unordered_map<int, int> cached;
  std::lock_guard<std::mutex> lock(mutex);
  int& sms = cached[device];
  if (sms == 0) {
    const cudaError_t e = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
    if (e != cudaSuccess) {
      sms = 0;
      return e;
    }
  }
  *count = sms;
  return cudaSuccess;
}

KernelChoice plain_gemm_config(int m, int n, int k) {
  if (n >= 100000) return {Config::kPing128x192x64_2x1, {4, Raster::kAlongN}};
  if (n <= 6144 || k <= 2048) return {Config::kPing128x128x64_1x2, ping_128x128_1x2_order(m, n)};
  if (n >= 16384) return {Config::kPing128x192x64_2x1, {8, Raster::kAlongN}};
  return {Config::kCoop256x128x64_1x2, {8, Raster::kAlongN}};
}

namespace {

// The current device's multiprocessor count (device_multiprocessors).
int current_device_sms() {
  int device = 0, sms = 0;
  const cudaError_t e = cudaGetDevice(&device);
  CODA_CHECK(e == cudaSuccess, "choose_config: no current CUDA device to count multiprocessors on (",
             cudaGetErrorString(e), "); pass the count");
  const cudaError_t a = device_multiprocessors(device, &sms);
  CODA_CHECK(a == cudaSuccess, "choose_config: cannot read device ", device,
             "'s multiprocessor count: ", cudaGetErrorString(a));
  return sms;
}

// The weight-gradient GEMM D = Xᵀ·Y (M, N = the weight's shape, K = tokens). Cooperative 128x256
// is at cuBLAS parity (0.99-1.03, run 29) wherever its tile grid fills the last wave. Where it
// fills less than 93% of it (1B dW QKV 3072 x 2048: 192 tiles = 1.45 waves of 132 SMs, 0.77-0.79x
// cuBLAS in run 29, 0.98-1.00 on pingpong in run 39; the paper's H = 2048 dW gate/up), pingpong
// 128x128 with 2x the tiles fills it better. The wave fill is the share of the launched waves'
// tile slots that hold a tile. (The paper's H = 4096 dW down, 0.88x cuBLAS in run 39, fills 95%:
// its gap is something else.)
double wave_fill(int m, int n, int tile_m, int tile_n, int sms) {
  const int64_t tiles = int64_t((m + tile_m - 1) / tile_m) * ((n + tile_n - 1) / tile_n);
  return double(tiles) / double((tiles + sms - 1) / sms * sms);
}

KernelChoice plain_xty_config(int m, int n, int k, int sms) {
  // Cooperative 128x256 at swizzle 8 along N. Until run 125 the shapes with N <= 6144 took
  // swizzle 1 along M (the run-2 sweep's choice, within 1.2% of the fastest in single runs, run
  // 97). Under sustained load (steps back to back at the 700 W limit, bench/results/
  // 2026-11-30-run125-xty-sustained.txt) swizzle 1 ran 2-8% slower than 8 along N (8B dW
  // gate/up 3.107 against 2.872 ms: 1.073 against 0.992x cuBLAS's time) and was level or up to
  // 1.8% slower in single runs; 8 along N ran at 0.99-1.00x cuBLAS's time sustained at every
  // LLaMA-3 weight-gradient shape of 8192 tokens it serves.
  // The earlier rule stays where run 125 did not time the change: the LM head's dW
  // (vocabulary-many rows) and weight gradients over at most 2048 tokens.
  const bool earlier_rule = k <= 2048 || (m >= 100000 && n <= 6144);
  const SchedulerOptions sched = n >= 100000    ? SchedulerOptions{4, Raster::kAlongN}
                                 : earlier_rule ? SchedulerOptions{1, Raster::kAlongM}
                                                : SchedulerOptions{8, Raster::kAlongN};
  if (sms == 0) sms = current_device_sms();
  const double coop = wave_fill(m, n, 128, 256, sms), ping = wave_fill(m, n, 128, 128, sms);
  // Pingpong takes the padding rule of the other pingpong kernels (1B dW qkv: swizzle 8 along M,
  // 1.004x cuBLAS sustained and 0.965x in single runs, against 1.009 / 1.012 at swizzle 1).
  if (coop < 0.93 && ping > coop + 0.03)
    return {Config::kPing128x128x64_1x2, earlier_rule ? sched : ping_128x128_1x2_order(m, n)};
  return {Config::kCoop128x256x64_2x1, sched};
}

// The data-gradient GEMM D = X·W (W not transposed: the backward's dz·W), from the run-27 sweep
// (bench/results/2026-11-29-run27-xw-sweep.txt: pingpong 128x128 c1x2 vs cooperative 256x128
// c1x2, swizzle 1/8 x raster M/N, every LLaMA-3 backward shape). Where both N and K reach 4096
// or K is 16384+ (8B and 70B everywhere, 1B gate/up) cooperative 256x128 was up to 13% faster
// (2-7% at 70B) and at worst level (gate/up with 16384 tokens at 1B / 8B); pingpong was as fast
// or faster on 1B's narrow, short-K shapes. Swizzle 8 won for both; pingpong now takes the
// padding rule (ping_128x128_1x2_order), which gives 8 at those shapes. Run 97 re-timed these
// round-robin: within 1.2% of the fastest option except 8B's down (2.8%, 8192 tokens) and QKV
// (1.6-1.8%) shapes, where pingpong 128x128 was ahead; the chain runs those through B2 / B1.
KernelChoice plain_xw_config(int m, int n, int k) {
  if ((n >= 4096 && k >= 4096) || k >= 16384)
    return {Config::kCoop256x128x64_1x2, {8, Raster::kAlongN}};
  return {Config::kPing128x128x64_1x2, ping_128x128_1x2_order(m, n)};
}

// Fused programs are compiled for fewer configurations (src/kernels/kernels.cmake). Choices from
// the fused times per configuration in bench/results/2026-11-29-run{4,5}-programs.json.
KernelChoice program_config(Program p, int m, int n, int k) {
  // Other tiles: swizzle 8 along M, 1 at K <= 2048 (runs 4, 5). Pingpong 128x128 1x2: run 92.
  const SchedulerOptions deep{k <= 2048 ? 1 : 8, Raster::kAlongM};
  const SchedulerOptions ping = ping_128x128_1x2_order(m, n);
  switch (p) {
    case Program::kRmsnormSwiglu:
      // Fused F2 times of runs 5, 16 and 47 (coda_program_bench, every compiled configuration),
      // averaged: at 1B and 8B pingpong 128x128 was the fastest (1B / 16384 tokens: 1.82 ms
      // against 1.96 on pingpong 128x192, the choice below 2I = 32768 until run 47); at 70B
      // cooperative 128x256 (11.59 / 23.40 ms at 8192 / 16384 tokens, pingpong 128x192 11.65 /
      // 23.55, pingpong 128x128 11.89 / 24.01); it won in runs 16 and 47, while run 48 had
      // pingpong 128x128 1.2% faster at 8192 tokens (cooperative 0.9% faster at 16384): within
      // the run-to-run spread.
      if (n < 32768) return {Config::kPing128x128x64_1x2, ping};
      return {Config::kCoop128x256x64_2x1, deep};
    // Swizzle 8 at K > 2048 pads the tile grid with tiles wholly past N; the LSE node used to
    // write their partials past the end of its buffers (NaN losses at H >= 4096, run 14), fixed
    // in nodes/row_partials.cuh. The GPU tests run every program under swizzle 8 too.
    case Program::kRmsnormLse:
      return {Config::kPing128x192x64_2x1, deep};
    case Program::kRmsnormCrossEntropyBackward:
      // 128x192 spilled (128 bytes, its fp32 DAG holds ten fragments): 128x128 does not.
      // (Not re-timed in run 92: it keeps swizzle 8 at K > 2048.)
      return {Config::kPing128x128x64_1x2, deep};
    case Program::kRmsnormLseLogits:
      // Per 2048-token chunk of the LM head (run 37, bench/results/2026-11-30-run37-programs-
      // sweep.json): pingpong 128x192 hides the epilogue at K >= 4096 (1.01 / 1.005x its GEMM at
      // 8B / 70B, where cooperative 128x256 took 1.27 / 1.14x); at K = 2048 nothing hides it
      // (1.46-1.58x) and the op layer uses the plain GEMM there (torch/ops_cuda.cpp).
      if (k > 2048) return {Config::kPing128x192x64_2x1, deep};
      return {Config::kCoop128x256x64_2x1, deep};
    case Program::kRmsnormBackward:
      // B1 (g = dz·W, N = hidden, K = the projection's width). QKV (K <= 10240): pingpong was
      // 2-21% faster in the run-27 sweep (most at 1B). Gate/up (K >= 16384), fused B1 under ncu
      // after pingpong B1 took x and h by TMA (run 75, bench/results/2026-11-30-run75-b1-gate-up-
      // configs.txt): pingpong 5-7% faster at 1B (8192 and 16384 tokens) and 3-4% at 8B / 8192;
      // cooperative 256x128 (its node merges dγ over 8 warps) 3% faster at 8B / 16384 and
      // 15-25% at 70B. (Run 27, before the TMA operands, had cooperative ahead at 8192 tokens.)
      if (k >= 16384 && (n >= 8192 || (n >= 4096 && m > 8192)))
        return {Config::kCoop256x128x64_1x2, {8, Raster::kAlongN}};
      return {Config::kPing128x128x64_1x2, ping};
    case Program::kSwigluBackward:
      // Swizzle 8 along M was the fastest B2 at every LLaMA shape of a sweep of swizzle 1/2/4/8 x
      // raster M/N (run 24: 1B 7% faster than swizzle 1; its epilogue streams z and dz, and a
      // swizzled order keeps the operand tiles in L2). Cooperative 256x128 was slower at every
      // shape (run 27: 3-10%; its epilogue does not overlap the other warpgroup's MMA).
      // (run 92's rule gives swizzle 8 at every LLaMA-3 shape)
      return {Config::kPing128x128x64_1x2, ping};
    case Program::kResidualRmsnormPartial:
      // F1 where the plain GEMM takes cooperative 256x128 (N > 6144 at K > 2048: 70B out- and
      // down-proj): F1 on cooperative 128x256 ran 1.635 / 3.307 ms (out-proj, M = 8192 / 16384)
      // and 5.447 / 11.639 (down-proj) against 1.676 / 3.493 and 5.950 / 11.493 on 256x128
      // (run 37); pingpong 128x128 / 128x192 were level at M = 8192 and slower at 16384.
      if (n > 6144 && k > 2048)
        return {Config::kCoop128x256x64_2x1, plain_gemm_config(m, n, k).scheduler};
      return plain_gemm_config(m, n, k);
    case Program::kRmsnormRope:
      // The plain GEMM's choice (F1: out/down-proj, F3: QKV have N <= 10240): pingpong 128x128
      // below 6144 columns, cooperative 256x128 above, both compiled for these programs.
      return plain_gemm_config(m, n, k);
    default:
      return plain_gemm_config(m, n, k);
  }
}

}  // namespace

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
               "CODA_KERNEL_OVERRIDE: expected PROGRAM/OPERANDS[@K]=CONFIG:SWIZZLE:RASTER, got '", e,
               "'");
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
    CODA_CHECK(ops == "XWt" || ops == "XW" || ops == "XtY", "CODA_KERNEL_OVERRIDE: operands '", ops,
               "' in '", e, "': expected XWt, XW or XtY");
    v.operands = ops == "XWt" ? Operands::kXWt : ops == "XW" ? Operands::kXW : Operands::kXtY;
    for (int i = 0; i < int(Config::kCount); ++i)
      if (cfg == config_name(Config(i))) v.choice.config = Config(i);
    CODA_CHECK(v.choice.config != Config::kCount, "CODA_KERNEL_OVERRIDE: unknown configuration '",
               cfg, "' in '", e, "'; expected one of ",
               names(int(Config::kCount), [](int i) { return config_name(Config(i)); }));
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
    a.list = std::make_shared<const std::vector<KernelOverride>>(
        s ? parse_kernel_overrides(s) : std::vector<KernelOverride>{});
  }
  return a.list;
}
}  // namespace

namespace {
// Whether GEMMs launch with PDL: 1 / 0, or -1 until the environment is read at the first launch.
// Read on every launch, so an atomic rather than a lock.
std::atomic<int> g_programmatic_launch{-1};
}  // namespace

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

void set_kernel_overrides(const std::string& spec) {
  auto parsed = std::make_shared<const std::vector<KernelOverride>>(parse_kernel_overrides(spec));
  ActiveOverrides& a = active_overrides();
  std::lock_guard<std::mutex> lock(a.mutex);
  a.list = std::move(parsed);
}

KernelChoice choose_config(Program p, Operands o, int m, int n, int k, int sms) {
  CODA_CHECK(sms >= 0, "choose_config: the multiprocessor count must be >= 0 (0: the current "
             "device's), got ", sms);
  const auto overrides = overrides_snapshot();
  // An entry for this K wins over one for every K, wherever either stands in the list.
  const KernelOverride* match = nullptr;
  for (const KernelOverride& v : *overrides)
    if (v.program == p && v.operands == o && (v.k == k || (v.k == 0 && !match))) match = &v;
  if (match) {
    CODA_CHECK(find_kernel(p, match->choice.config, o), "CODA_KERNEL_OVERRIDE: ", program_name(p),
               " with ", operands_name(o), " is not compiled for ",
               config_name(match->choice.config), " in this build (src/kernels/kernels.cmake)");
    return match->choice;
  }
  const KernelChoice c = p != Program::kPlain  ? program_config(p, m, n, k)
                         : o == Operands::kXWt ? plain_gemm_config(m, n, k)
                         : o == Operands::kXW  ? plain_xw_config(m, n, k)
                                               : plain_xty_config(m, n, k, sms);
  if (find_kernel(p, c.config, o)) return c;
  for (int i = 0; i < static_cast<int>(Config::kCount); ++i)
    if (find_kernel(p, static_cast<Config>(i), o)) return {static_cast<Config>(i), c.scheduler};
  return c;
}

}  // namespace coda::kernel
