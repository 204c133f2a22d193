// Kernel configuration heuristic (include/coda/kernel/heuristic.hpp): pure, no device queries.
//
// Measurements behind the rules (bench/results at commit a6c7cb7; docs/experiments.md):
//   plain X·Wᵀ      2026-11-29-run2-gemm-sweep.json (31 shapes, 5 configs x 8 scheduler options)
//   plain X·W       2026-11-29-run27-xw-sweep.txt
//   plain Xᵀ·Y      2026-11-30-run125-xty-sustained.txt (sustained), 2026-11-30-run39-suite.json
//   fused programs  2026-11-29-run{4,5,16}-programs.json, 2026-11-30-run37-programs-sweep.json,
//                   2026-11-30-run75-b1-gate-up-configs.txt
//   pingpong order  2026-11-30-run88-92-swizzle.txt
#include "coda/kernel/heuristic.hpp"

#include <algorithm>
#include <cstdint>

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
// and the plain GEMM ran 3-13% faster at swizzle 4 or 8 than at 1, except where swizzle 8 padded
// the grid (1B QKV: 24 tile columns, 12 clusters, rounded up to 16: 38-47% slower). Token counts
// that are not a multiple of 8 tiles pad along M as well (600 tokens: 5 tile rows, 8 at swizzle 4).
// `largest` caps the swizzle (the FP8 GEMMs at very long K, below).
SchedulerOptions ping_order(const GemmShape& s, int largest = 8) {
  const int64_t unswizzled = scheduled_tiles(s.m, s.n, 128, 128, 1, 2, 1);
  for (int sw : {8, 4, 2})
    if (sw <= largest && scheduled_tiles(s.m, s.n, 128, 128, 1, 2, sw) * 50 <= unswizzled * 51)
      return {sw, Raster::kAlongM};
  return {1, Raster::kAlongM};
}

KernelChoice ping(const GemmShape& s) { return {Config::kPing128x128x64_1x2, ping_order(s)}; }

// Plain GEMM D = X · Wᵀ: one choice per regime, picked for the regime's geometric mean with a
// penalty below 0.95 (sweep estimate: geomean 1.008 x cuBLAS, worst 0.92 at 1B gate/up).
KernelChoice plain_xwt(const GemmShape& s) {
  if (s.n >= 100000) return {Config::kPing128x192x64_2x1, {4, Raster::kAlongN}};  // LM head
  if (s.n <= 6144 || s.k <= 2048) return ping(s);
  if (s.n >= 16384) return {Config::kPing128x192x64_2x1, {8, Raster::kAlongN}};  // gate/up
  return {Config::kCoop256x128x64_1x2, {8, Raster::kAlongN}};
}

// The share of the launched waves' tile slots that hold a tile.
double wave_fill(const GemmShape& s, int tile_m, int tile_n, int sms) {
  const int64_t tiles = int64_t((s.m + tile_m - 1) / tile_m) * ((s.n + tile_n - 1) / tile_n);
  return double(tiles) / double((tiles + sms - 1) / sms * sms);
}

// The weight-gradient GEMM D = Xᵀ·Y (M, N = the weight's shape, K = tokens). Cooperative 128x256
// at swizzle 8 along N runs at 0.99-1.00x cuBLAS's time under sustained load at every LLaMA-3
// weight gradient of 8192 tokens (swizzle 1 along M: 2-8% slower sustained). The LM head's dW
// (vocabulary-many rows) and gradients over at most 2048 tokens keep swizzle 1 along M, the sweep's
// choice, not re-timed sustained. Where cooperative's grid fills less than 93% of its last wave
// (1B dW QKV 3072 x 2048: 192 tiles = 1.45 waves of 132 SMs, 0.77x cuBLAS; pingpong 0.98-1.00x),
// pingpong 128x128 with twice the tiles fills it better.
KernelChoice plain_xty(const GemmShape& s, const DeviceProps& props) {
  const bool sweep_rule = s.k <= 2048 || (s.m >= 100000 && s.n <= 6144);
  const SchedulerOptions sched = s.n >= 100000 ? SchedulerOptions{4, Raster::kAlongN}
                                 : sweep_rule  ? SchedulerOptions{1, Raster::kAlongM}
                                               : SchedulerOptions{8, Raster::kAlongN};
  const double coop = wave_fill(s, 128, 256, props.multiprocessors);
  const double pp = wave_fill(s, 128, 128, props.multiprocessors);
  if (coop < 0.93 && pp > coop + 0.03)
    return {Config::kPing128x128x64_1x2, sweep_rule ? sched : ping_order(s)};
  return {Config::kCoop128x256x64_2x1, sched};
}

// The data-gradient GEMM D = X·W (dz · W). Where both N and K reach 4096 or K is 16384+ (8B and
// 70B everywhere, 1B gate/up) cooperative 256x128 was up to 13% faster and at worst level;
// pingpong was as fast or faster on 1B's narrow, short-K shapes.
KernelChoice plain_xw(const GemmShape& s) {
  if ((s.n >= 4096 && s.k >= 4096) || s.k >= 16384)
    return {Config::kCoop256x128x64_1x2, {8, Raster::kAlongN}};
  return ping(s);
}

// Blockwise FP8 (the plain GEMM and the fp32-accumulating weight gradient): cooperative 128x128
// (two 64-row warpgroups, each with its accumulator and the mainloop's per-block partial sum) in
// the pingpong programs' tile order. At every LLaMA-3 projection
// (bench/results/2026-12-01-fp8.json) it ran 0.97-1.03x cuBLASLt's time forward and for the data
// gradient; pingpong 64x128 ran 0.50-0.76x and is not built; swizzle 8 on 1B's 24-column QKV grid
// ran 0.74x (ping_order's 4: 0.99x). At K >= 32768 (70B gate/up data gradient and its B1,
// K = 57344) a tile's operand panels are 7 MB each, and swizzle 8 leaves the plain GEMM at the
// mercy of how closely the CTAs sharing a panel keep pace: on an H100 it ran 6.6-8.7 ms at
// M = 8192 and 13.8-19.3 ms at 16384 over seven measurements in two processes, against
// cuBLASLt's 6.5-6.8 and 13.5-14.4; swizzle 2 (a wave's four B panels, 29 MB, fit the 50 MB
// L2) ran 6.5-7.3 and 14.2-14.7, and B1 level with swizzle 8
// (bench/results/2026-12-06-run3-fp8-long-k-order.txt). Swizzle 2 there, under the padding rule.
//
// The mainloop (table.def): with each k-tile's promotion under the next one's MMAs
// (kCoop128x128x128_1x2_Overlap) the plain forward / data-gradient GEMM ran 1.03-1.09x cuBLASLt
// at the 1B and 8B shapes with K <= 16384 and 0.94-1.09x at 70B with K <= 10240, against
// 0.99-1.02x on CUTLASS's loop, but 0.91-0.99x at K = 28672 and 0.74-0.82x at K = 57344
// (bench/results/2026-12-06-run7-promotion-ab.txt, call 3; one H100): the overlapped loop to
// K = 16384, CUTLASS's above. Every other program is compiled on one of the two (F2, F2z, B2 and
// B2z, whose K is the hidden size, on the overlapped loop), and that one is its choice.
constexpr int kOverlapMaxK = 16384;
KernelChoice fp8_config(Program p, Operands o, const GemmShape& s) {
  const SchedulerOptions order = ping_order(s, s.k >= 32768 ? 2 : 8);
  const Config overlap = Config::kCoop128x128x128_1x2_Overlap, stock = Config::kCoop128x128x128_1x2;
  if (!in_table(p, overlap, o)) return {stock, order};
  if (!in_table(p, stock, o)) return {overlap, order};
  return {s.k <= kOverlapMaxK ? overlap : stock, order};
}

KernelChoice program_config(Program p, const GemmShape& s) {
  const SchedulerOptions deep{s.k <= 2048 ? 1 : 8, Raster::kAlongM};
  switch (p) {
    case Program::kResidualRmsnormPartial:
      // F1 at N > 6144, K > 2048 (70B out- and down-proj): cooperative 128x256 ran 1.635 /
      // 3.307 ms (out-proj, M = 8192 / 16384) and 5.447 / 11.639 (down-proj) against 1.676 /
      // 3.493 and 5.950 / 11.493 on cooperative 256x128; pingpong level at 8192, slower at 16384.
      if (s.n > 6144 && s.k > 2048) return {Config::kCoop128x256x64_2x1, plain_xwt(s).scheduler};
      return ping(s);
    case Program::kRmsnormSwiglu:
      // Pingpong 128x128 fastest at 1B and 8B (1B / 16384 tokens: 1.82 ms against 1.96 on
      // pingpong 128x192); at 70B cooperative 128x256 (11.59 / 23.40 ms at 8192 / 16384 tokens,
      // pingpong 128x192 11.65 / 23.55, pingpong 128x128 11.89 / 24.01).
      if (s.n < 32768) return ping(s);
      return {Config::kCoop128x256x64_2x1, deep};
    case Program::kRmsnormRope:
      // The plain GEMM's regimes on the QKV widths (N <= 10240): pingpong 128x128, cooperative
      // 256x128 at N > 6144 and K > 2048.
      if (s.n > 6144 && s.k > 2048) return {Config::kCoop256x128x64_1x2, {8, Raster::kAlongN}};
      return ping(s);
    case Program::kRmsnormQkNormRope:
      // Its node stages the whole 128x128 tile and needs the cooperative epilogue's 256 threads:
      // the one configuration it is compiled for, in the pingpong programs' tile order.
      return {Config::kCoop128x128x64_1x2, ping_order(s)};
    case Program::kRmsnormLse:
      return {Config::kPing128x192x64_2x1, deep};
    case Program::kRmsnormLseLogits:
      // Per 2048-token chunk of the LM head: pingpong 128x192 hides the epilogue at K >= 4096
      // (1.01 / 1.005x its GEMM at 8B / 70B; cooperative 128x256 1.27 / 1.14x); at K = 2048
      // nothing hides it (1.46-1.58x) and the LM head uses the plain GEMM there.
      if (s.k > 2048) return {Config::kPing128x192x64_2x1, deep};
      return {Config::kCoop128x256x64_2x1, deep};
    case Program::kRmsnormCrossEntropyBackward:
      // 128x192 spilled 128 bytes (its fp32 DAG holds ten fragments); 128x128 does not.
      return {Config::kPing128x128x64_1x2, deep};
    case Program::kRmsnormBackward:
      // B1 (g = dz·W, N = hidden, K = the projection's width). QKV (K <= 10240): pingpong 2-21%
      // faster. Gate/up (K >= 16384): pingpong 5-7% faster at 1B and 3-4% at 8B / 8192 tokens;
      // cooperative 256x128 (its node merges dγ over 8 warps) 3% faster at 8B / 16384 tokens and
      // 15-25% at 70B.
      if (s.k >= 16384 && (s.n >= 8192 || (s.n >= 4096 && s.m > 8192)))
        return {Config::kCoop256x128x64_1x2, {8, Raster::kAlongN}};
      return ping(s);
    case Program::kSwigluBackward:
      // Swizzle 8 along M was the fastest B2 at every LLaMA shape (1B 7% faster than swizzle 1:
      // its epilogue streams z and dz, and a swizzled order keeps the operand tiles in L2);
      // cooperative 256x128 was 3-10% slower (its epilogue does not overlap the other
      // warpgroup's MMA).
    case Program::kPairLayoutProbe:
    case Program::kAccumulateF32:
    case Program::kResidualRmsnormFp8:
    case Program::kRmsnormSwigluFp8:
    case Program::kRmsnormBackwardFp8:
    case Program::kSwigluBackwardFp8:
    case Program::kRmsnormSwigluFp8Z:
    case Program::kSwigluBackwardFp8Z:
    case Program::kPlain:
    case Program::kCount:
      break;
  }
  return ping(s);
}

}  // namespace

KernelChoice choose_config(Program p, Operands o, const GemmShape& s, const DeviceProps& props) {
  CODA_CHECK(s.m > 0 && s.n > 0 && s.k > 0, "choose_config: sizes must be positive, got M=", s.m,
             " N=", s.n, " K=", s.k);
  CODA_CHECK(props.multiprocessors > 0,
             "choose_config: the device's multiprocessor count must be positive, got ",
             props.multiprocessors);
  if (is_fp8(o)) return fp8_config(p, o, s);
  if (p != Program::kPlain) return program_config(p, s);
  switch (o) {
    case Operands::kXWt:
      return plain_xwt(s);
    case Operands::kXW:
      return plain_xw(s);
    case Operands::kXtY:
      return plain_xty(s, props);
    case Operands::kFp8XWt:
    case Operands::kFp8XYt:
      break;
  }
  return plain_xwt(s);
}

}  // namespace coda::kernel
