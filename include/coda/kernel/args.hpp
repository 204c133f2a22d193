#pragma once
// Host-visible description of one Hopper GEMM launch: the problem, the kernel configuration
// identifiers, and each program's epilogue operands. No CUTLASS here, so the dispatch layer and the
// tests include it from plain C++.

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace coda::kernel {

using bf16 = __nv_bfloat16;

// D (M, N) = op(A) · op(B), fp32 accumulate. Names say how each operand is stored; the bf16
// layouts first, then the blockwise FP8 ones (e4m3 codes, one fp32 power-of-two scale per block,
// docs/math.md §6), both operands K-major as FP8 wgmma needs.
enum class Operands : int {
  kXWt = 0,  // A (M, K) row-major, B = W (N, K) row-major: D = X · Wᵀ       (forward)
  kXW = 1,   // A (M, K) row-major, B = W (K, N) row-major: D = dz · W       (data gradient)
  kXtY = 2,  // A = Xᵀ with X (K, M) row-major, B (K, N) row-major: D = Xᵀ · Y (weight gradient)
  // FP8 A (M, K) in 1x128 blocks, B = W (N, K) in 128x128 blocks: D = X · Wᵀ (forward; the data
  // gradient with Wᵀ's codes and the same blocks transposed).
  kFp8XWt = 3,
  // FP8 A (M, K) and B (N, K), both in 1x128 blocks: D = X · Yᵀ (the weight gradient, from the
  // transposed 128x1 copies of dy and x, whose rows run along the tokens).
  kFp8XYt = 4,
};
constexpr bool is_fp8(Operands o) { return o == Operands::kFp8XWt || o == Operands::kFp8XYt; }
constexpr Operands kAllOperands[] = {Operands::kXWt, Operands::kXW, Operands::kXtY,
                                     Operands::kFp8XWt, Operands::kFp8XYt};

struct GemmProblem {
  int m = 0, n = 0, k = 0;
  const void* a = nullptr;  // bf16, or e4m3 codes for the FP8 operands
  int64_t lda = 0;
  const void* b = nullptr;
  int64_t ldb = 0;
  const bf16* c = nullptr;  // source tile (residual); only programs that load C read it
  int64_t ldc = 0;
  bf16* d = nullptr;  // may be null for programs without a D output
  int64_t ldd = 0;
  // The FP8 operands' block scales (ScaleLayout below); unused by the bf16 ones.
  const float* scale_a = nullptr;
  int64_t ld_scale_a = 0;
  const float* scale_b = nullptr;
  int64_t ld_scale_b = 0;
};

// Where the FP8 operands' scales live, as the blockwise mainloop reads them (kb = K block):
//   A, 1x128:         scale of (m, kb) at m + ld · kb, ld >= M and a multiple of 4 (its TMA rows);
//   B, 128x128:       scale of (nb, kb) at nb · ld + kb, ld >= ceil(K / 128);
//   B, 1x128 (XYt):   scale of (n, kb) at n + ld · kb, ld >= N.
// So a 1x128 operand's scales are a (ceil(K / 128), ld) row-major matrix: one row per K block.
struct ScaleLayout {
  static constexpr int kBlock = 128;
  static constexpr int64_t blocks(int64_t extent) { return (extent + kBlock - 1) / kBlock; }
  // The rows of a 1x128 operand's scales the mainloop reads: `rows` rounded up to 4 (16-byte TMA
  // rows; the casts write scale 1 past the tensor), the least leading dimension of its scales.
  static constexpr int64_t row_scales_ld(int64_t rows) { return (rows + 3) / 4 * 4; }
  // The width of a transposed (128x1) copy of `tokens` rows: rounded up to 16 (16-byte rows of
  // e4m3), code 0 in the padding, so a weight gradient contracts over the padded extent.
  static constexpr int64_t padded_tokens(int64_t tokens) { return (tokens + 15) / 16 * 16; }
};

// An FP8 output: e4m3 codes (row-major, row stride ld) and its scales (row stride ld_scales), in
// a ScaleLayout.
struct Fp8Output {
  uint8_t* codes = nullptr;
  int64_t ld = 0;
  float* scales = nullptr;
  int64_t ld_scales = 0;
};

// The tensors the GEMM kernel itself reads as C and writes as D: the problem's c and d, unless a
// fusion puts its own operands there (FusionOf<P>::operands; B2's z and dz, 32-bit pairs).
struct KernelOperands {
  const void* c = nullptr;
  int64_t ldc = 0;
  void* d = nullptr;
  int64_t ldd = 0;
};

// Persistent tile scheduler options (runtime, no recompilation).
enum class Raster : int { kHeuristic = 0, kAlongM = 1, kAlongN = 2 };
struct SchedulerOptions {
  int swizzle = 1;  // 1, 2, 4 or 8
  Raster raster = Raster::kHeuristic;
};

// ---- per-program epilogue operands ----------------------------------------------------------
struct PlainArgs {};

// D (M, N) fp32 += acc: the kernel's C and D are both `d` (a weight gradient accumulated over
// micro-batches in fp32).
struct AccumulateF32Args {
  float* d = nullptr;
  int64_t ldd = 0;
};

struct ResidualRmsnormPartialArgs {  // F1: C = residual, D = x
  const bf16* gamma = nullptr;       // (N)
  bf16* h = nullptr;                 // (M, N) x ⊙ γ
  int64_t ldh = 0;
  float* sumsq_partials = nullptr;  // PartialLayout::per_row(M, N, tile_m, tile_n)
};

// F1 with h in FP8 (tile 128x128): h = x ⊙ γ rounded to bf16, then quantized as the cast
// kernels do: h_fp8 in 1x128 blocks (the next GEMMs' A), h_t its transposed 128x1 copy (their
// weight gradients' B); either may be left out (null codes).
struct ResidualRmsnormFp8Args {     // C = residual, D = x
  const bf16* gamma = nullptr;      // (N)
  Fp8Output h;                      // codes (M, N), scales (ceil(N / 128), row_scales_ld(M))
  Fp8Output h_t;                    // codes (N, padded_tokens(M)), scales (ceil(M / 128), N)
  float* sumsq_partials = nullptr;  // PartialLayout::per_row(M, N, 128, 128)
};

// F2 with a in FP8 (tile 128x128, its tiles scheduled in pairs along N: a 1x128 block of a is
// two tiles of z): D = z (M, 2I) as F2; a = silu(z_g)·z_u rounded to bf16, then quantized as the
// cast kernels do: a in 1x128 blocks (the down-projection's A) and aᵀ, its transposed 128x1 copy
// (the down-projection weight gradient's B); either may be left out (null codes). a_copy, when
// set, gets the bf16 a itself (tests).
struct RmsnormSwigluFp8Args {
  const float* r = nullptr;  // (M)
  Fp8Output a;               // codes (M, I), scales (ceil(I / 128), row_scales_ld(M))
  Fp8Output a_t;             // codes (I, padded_tokens(M)), scales (ceil(M / 128), I)
  bf16* a_copy = nullptr;    // (M, I), leading dimension ld_a_copy
  int64_t ld_a_copy = 0;
};

// F2 with a and z in FP8 (Program::kRmsnormSwigluFp8Z): a as RmsnormSwigluFp8Args; z, rounded to
// bf16, quantized in 1x128 blocks along its 2I columns instead of written in bf16 (no D): the
// pre-activation B2 and the recomputed aᵀ read back, in 2I bytes a token instead of 4I. A
// 128-column tile of z is one block of each of its rows.
struct RmsnormSwigluFp8ZArgs {
  RmsnormSwigluFp8Args f2;
  Fp8Output z;  // codes (M, 2I), scales (ceil(2I / 128), row_scales_ld(M))
};

struct RmsnormSwigluArgs {   // F2: D = z (M, 2I)
  const float* r = nullptr;  // (M)
  bf16* a = nullptr;         // (M, I)
  int64_t lda = 0;
};

struct RmsnormRopeArgs {              // F3: D = qkv
  const float* r = nullptr;           // (M)
  const bf16* bias = nullptr;         // (N), null: no bias
  const int32_t* pos = nullptr;       // (M)
  const uint32_t* freq_hi = nullptr;  // (N) programs::RopeFrequency split in two vectors
  const uint32_t* freq_lo = nullptr;  // (N)
};

// F3 with QK-norm (Qwen3; tile 128x128, cooperative): no D. u = r[m] · acc is staged over the
// whole tile; each Q and K head of a row is RMS-normalized, scaled by its head-norm weight and
// rotated into qkv, V heads stored as u; qk_pre gets the Q and K columns of u. head_dim divides
// the tile's 128 columns, so every head lies in one tile.
struct RmsnormQkNormRopeArgs {
  const float* r = nullptr;           // (M)
  const bf16* q_gamma = nullptr;      // (head_dim)
  const bf16* k_gamma = nullptr;      // (head_dim)
  const int32_t* pos = nullptr;       // (M)
  const uint32_t* freq_hi = nullptr;  // (N)
  const uint32_t* freq_lo = nullptr;  // (N)
  bf16* qkv = nullptr;                // (M, N)
  int64_t ld_qkv = 0;
  bf16* qk_pre = nullptr;  // (M, normed_width)
  int64_t ld_qk_pre = 0;
  int head_dim = 0, q_width = 0, normed_width = 0;  // normed_width: the Q and K columns
  float eps = 0.f;
};

struct RmsnormLseArgs {              // F4: D = logits (bf16) only for kRmsnormLseLogits
  const float* r = nullptr;          // (M)
  const int64_t* targets = nullptr;  // (M)
  float* max_partials = nullptr;     // PartialLayout::per_row(M, N, tile_m, tile_n)
  float* sum_partials = nullptr;
  float* target_logit = nullptr;  // (M), untouched for rows whose target is not in [0, N)
};

struct RmsnormBackwardArgs {  // B1: A = dz, B = W (K = N_out, N = H); C = dres, D = dx
  const bf16* x = nullptr;    // (M, H) saved residual stream
  int64_t ldx = 0;
  const float* r = nullptr;     // (M)
  const bf16* gamma = nullptr;  // (H)
  const float* zdz = nullptr;   // (M), folded: Σ dz·z / H
  bf16* h_out = nullptr;        // (M, H)
  int64_t ldh = 0;
  float* dgamma_partials = nullptr;  // PartialLayout::per_column(M, H, tile_m, tile_n)
  bool dres = true;  // false: dx is the norm's gradient alone, C is not read (it may be D)
};

// B1 over FP8 operands (tile 128x128): A = dz in 1x128 blocks, B = Wᵀ's codes in 128x128 blocks;
// C = dres, D = dx and dγ as B1. h_out = x·r·γ, rounded to bf16, is quantized as the cast kernels
// do into its transposed 128x1 copy h_t (the weight gradient's B: dW = dzᵀ · h_out); b1.h_out
// must be null. h_copy, when set, gets the bf16 h_out itself (tests).
struct RmsnormBackwardFp8Args {
  RmsnormBackwardArgs b1;
  Fp8Output h_t;           // codes (H, padded_tokens(M)), scales (ceil(M / 128), H)
  bf16* h_copy = nullptr;  // (M, H), leading dimension ld_h_copy
  int64_t ld_h_copy = 0;
};

struct RmsnormCrossEntropyBackwardArgs {  // B4: A = h, B = W_vocab; D = dℓ (M, V)
  const float* r = nullptr;               // (M)
  const float* lse = nullptr;             // (M)
  const float* scale = nullptr;           // (M): d loss / d token loss (0 for ignored tokens)
  const int64_t* targets = nullptr;       // (M)
  float* zdz_partials = nullptr;  // PartialLayout::per_row(M, V, tile_m, tile_n): Σ ℓ·dℓ
  float z_loss = 0.0f;
};

// B2: A = dx_out (M, H), B = W_down (H, I); the problem's D (p.d) = a (M, I). The kernel writes a
// through a node and dz as the collective's own D (fusions/swiglu_backward.cuh).
struct SwigluBackwardArgs {
  const uint32_t* z = nullptr;  // (M, I) interleaved (g, u) bf16 pairs, one 32-bit element each
  int64_t ldz = 0;              // in pairs
  uint32_t* dz = nullptr;       // (M, I) (dg, du) pairs
  int64_t lddz = 0;
  float* zdz_partials = nullptr;  // PartialLayout::per_row(M, I, tile_m, tile_n): Σ g·dg + u·du
};

// B2 over FP8 operands (tile 128x128): A = dx_out in 1x128 blocks, B = W_downᵀ's codes (I, H) in
// 128x128 blocks, so the GEMM's N is I. z comes in as B2's (the kernel's C, 32-bit pairs); dz,
// rounded to bf16 pairs, is quantized in 1x128 blocks along its 2I columns (the gate/up data
// gradient's A) and as dzᵀ (its weight gradient's A); ZdZ partials as B2. No D and no a (the FP8
// forward keeps F2's aᵀ). dz_copy, when set, gets the bf16 dz itself (tests).
struct SwigluBackwardFp8Args {
  const uint32_t* z = nullptr;    // (M, I) interleaved (g, u) bf16 pairs
  int64_t ldz = 0;                // in pairs
  float* zdz_partials = nullptr;  // PartialLayout::per_row(M, I, 128, 128): Σ g·dg + u·du
  Fp8Output dz;                   // codes (M, 2I), scales (ceil(2I / 128), row_scales_ld(M))
  Fp8Output dz_t;                 // codes (2I, padded_tokens(M)), scales (ceil(M / 128), 2I)
  bf16* dz_copy = nullptr;        // (M, 2I), leading dimension ld_dz_copy
  int64_t ld_dz_copy = 0;
};

// B2 over FP8 operands with z in FP8 (Program::kSwigluBackwardFp8Z): as SwigluBackwardFp8Args,
// but z comes as F2's e4m3 codes, read as 16-bit (g, u) code pairs (the kernel's C), with its
// 1x128 block scales; each pair is decoded (code · scale, exact) before B2's math.
struct SwigluBackwardFp8ZArgs {
  const uint16_t* z = nullptr;      // (M, I) interleaved (g, u) e4m3 code pairs
  int64_t ldz = 0;                  // in pairs
  const float* z_scales = nullptr;  // (ceil(2I / 128), row_scales_ld(M)): block b of row m at
  int64_t ld_z_scales = 0;          // b · ld_z_scales + m
  float* zdz_partials = nullptr;    // PartialLayout::per_row(M, I, 128, 128): Σ g·dg + u·du
  Fp8Output dz;                     // as SwigluBackwardFp8Args
  Fp8Output dz_t;
};

// ---- the program / configuration table (kernel/table.def) ----------------------------------
enum class Program : int {
#define CODA_PROGRAM(name, str, args, header) k##name,
#include "coda/kernel/table.def"
  kCount
};

enum class Config : int {
#define CODA_CONFIG(name, str, ...) k##name,
#include "coda/kernel/table.def"
  kCount
};

// The operand struct of each program: launch<P> takes exactly ArgsOf<P>.
template <Program P>
struct ArgsOfProgram;
#define CODA_PROGRAM(name, str, args, header) \
  template <>                                 \
  struct ArgsOfProgram<Program::k##name> {    \
    using type = args;                        \
  };
#include "coda/kernel/table.def"
template <Program P>
using ArgsOf = typename ArgsOfProgram<P>::type;

struct TileShapeMN {
  int m, n;
};
// Tile shape of a configuration (partial buffers depend on it).
constexpr TileShapeMN tile_shape(Config c) {
  switch (c) {
#define CODA_CONFIG(name, str, tile_m, tile_n, ...) \
  case Config::k##name:                             \
    return {tile_m, tile_n};
#include "coda/kernel/table.def"
    case Config::kCount:
      break;
  }
  return {0, 0};
}
// Whether the table lists the kernel (program, config, operands): what a full build compiles.
constexpr bool in_table(Program p, Config c, Operands o) {
#define CODA_KERNEL(program, config, operands) \
  if (p == Program::k##program && c == Config::k##config && o == Operands::k##operands) return true;
#include "coda/kernel/table.def"
  return false;
}
const char* config_name(Config c);
const char* program_name(Program p);
const char* operands_name(Operands o);

// Type-erased entry of one compiled kernel; `args` points to the program's ArgsOf<P>. Only the
// registry (src/kernels/registry.cpp.in) and launch<P> below handle it.
using LaunchFn = cudaError_t (*)(const GemmProblem&, const void* args, const SchedulerOptions&,
                                 cudaStream_t);

// The compiled kernel for (program, config, operands), or nullptr where this build does not
// have it (a CODA_KERNELS subset).
LaunchFn find_kernel(Program p, Config c, Operands o);
inline bool compiled(Program p, Config c, Operands o) { return find_kernel(p, c, o) != nullptr; }

// Launches program P's kernel for (config, operands): cudaErrorInvalidDeviceFunction where the
// build lacks it. A wrong operand struct for P does not compile.
template <Program P>
cudaError_t launch(Config c, Operands o, const GemmProblem& problem, const ArgsOf<P>& args,
                   const SchedulerOptions& schedule, cudaStream_t stream) {
  const LaunchFn fn = find_kernel(P, c, o);
  if (!fn) return cudaErrorInvalidDeviceFunction;
  return fn(problem, &args, schedule, stream);
}

}  // namespace coda::kernel
