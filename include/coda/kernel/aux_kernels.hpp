#pragma once
// Small memory-bound kernels around the GEMMs (src/aux_kernels.cu): random fills for tests and
// benchmarks, and comparison reductions for on-device checks.

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "coda/kernel/args.hpp"

namespace coda::kernel {

// p[i] = bf16(uniform(lo, hi)) from a counter-based hash of (seed, i): reproducible, no state.
void fill_uniform_bf16(bf16* p, size_t n, uint64_t seed, float lo, float hi, cudaStream_t stream);

// out[0] = max_i |a[i] - b[i]|, out[1] = max_i |b[i]| (fp32, device pointer, 2 floats); NaN in a
// or b makes out[0] NaN.
void max_abs_diff_bf16(const bf16* a, const bf16* b, size_t n, float* out, cudaStream_t stream);

// A1: r[m] = rsqrt(Σ_t partials[m + rows_padded · t] / hidden + eps), for m < M.
void fold_rstd(const float* partials, int64_t m, int64_t rows_padded, int64_t tiles, int64_t hidden,
               float eps, float* r, cudaStream_t stream);

// F0 (first layer): h = x ⊙ γ (bf16), r[m] = rsqrt(mean_n x² + eps). x, h (M, H) row-major.
void first_layer_rmsnorm(const bf16* x, const bf16* gamma, int64_t m, int64_t hidden, float eps,
                         bf16* h, float* r, cudaStream_t stream);

// A3 (ZdZ): out[m] = scale · Σ_t partials[m + rows_padded · t], for m < M (scale = 1 / H).
void fold_row_sums(const float* partials, int64_t m, int64_t rows_padded, int64_t tiles,
                   float scale, float* out, cudaStream_t stream);

// A3 (dγ): out[n] = Σ_t partials[n + cols_padded · t], for n < N.
void fold_column_sums(const float* partials, int64_t n, int64_t cols_padded, int64_t tiles,
                      float* out, cudaStream_t stream);

// B3 (RoPE backward): dz = Rᵀ·dy on adjacent pairs (V columns, whose frequency is 0, pass
// through); zdz[m] = Σ_n (y·dy − b·dz) / hidden. y, dy, dz (M, width) bf16; bias (width) bf16,
// F3's bias, or null; pos (M); freq_hi/lo (width).
void rope_backward(const bf16* y, const bf16* dy, const bf16* bias, const int32_t* pos,
                   const uint32_t* freq_hi, const uint32_t* freq_lo, int64_t m, int64_t width,
                   int64_t hidden, bf16* dz, float* zdz, cudaStream_t stream);

// B3 with QK-norm (docs/math.md B3q), one warp per row: on each Q and K head (u = qk_pre,
// s = rsqrt(mean u² + eps), n = u·s, dy' = Rᵀ·dy) dz = s·(γ ⊙ dy' − n·mean(γ ⊙ dy' ⊙ n)); on V
// heads dz = dy; zdz[m] = Σ_n z·dz · inv_hidden (z = u on Q and K, qkv on V). Block b writes
// its Σ over its rows and heads of dy' ⊙ n to dgamma_partials[b · 2d ..]: the Q heads' d sums,
// then the K heads'. head_dim even, <= 128; every pointer and row stride 4-byte aligned.
struct QkNormBackwardArgs {
  const bf16* qk_pre = nullptr;  // (M, normed_width)
  int64_t ld_qk_pre = 0;
  const bf16* qkv = nullptr;  // (M, width): read on the V columns
  int64_t ld_qkv = 0;
  const bf16* dy = nullptr;  // (M, width)
  int64_t ld_dy = 0;
  const bf16* q_gamma = nullptr;  // (head_dim)
  const bf16* k_gamma = nullptr;  // (head_dim)
  const int32_t* pos = nullptr;   // (M)
  const uint32_t* freq_hi = nullptr;
  const uint32_t* freq_lo = nullptr;  // (width)
  bf16* dz = nullptr;                 // (M, width)
  int64_t ld_dz = 0;
  float* zdz = nullptr;              // (M)
  float* dgamma_partials = nullptr;  // (qk_norm_backward_blocks(M), 2 · head_dim)
  int64_t m = 0, width = 0;
  int head_dim = 0, q_width = 0, normed_width = 0;
  float eps = 0.f, inv_hidden = 0.f;
};
// The blocks (partial rows) qk_norm_rope_backward runs for M rows.
int64_t qk_norm_backward_blocks(int64_t m);
void qk_norm_rope_backward(const QkNormBackwardArgs& a, cudaStream_t stream);

// A2 (per token): lse[m] = logsumexp over the tiles' (max, sumexp) partials (per_row layout);
// token_loss[m] = lse − target_logit + z_loss·lse², 0 where targets[m] == ignore_index, NaN where
// the target is neither ignored nor in [0, vocab) (no host check: the loss shows it).
void fold_lse_loss(const float* max_partials, const float* sum_partials, int64_t m,
                   int64_t rows_padded, int64_t tiles, const float* target_logit,
                   const int64_t* targets, int64_t vocab, int64_t ignore_index, float z_loss,
                   float* lse, float* token_loss, cudaStream_t stream);

// B4 from stored logits (the LM head's three-GEMM path): in place on each row m of logits (bf16,
// M rows of `vocab` columns at stride ld), dℓ = (p·(1 + 2·z_loss·lse) − [n == target])·scale[m]
// with p = exp(ℓ − lse[m]), ℓ of the target column = target_logit[m] (fp32, F4's); zdz[m] =
// Σ_n ℓ·dℓ / hidden (fp32 values, before rounding). A target outside [0, vocab) (ignored, another
// rank's, invalid) matches no column.
void cross_entropy_grad_from_logits(bf16* logits, int64_t ld, int64_t m, int64_t vocab,
                                    const float* lse, const float* scale, const int64_t* targets,
                                    const float* target_logit, float z_loss, int64_t hidden,
                                    float* zdz, cudaStream_t stream);

// A2 and B4 in one pass pair over the plain GEMM's unscaled logits (the LM head's three-GEMM path
// at short K, where the F4 epilogue costs more than a separate pass): per row m of s (bf16, M rows
// of `vocab` columns at stride ld; s = h·wᵀ with h (M, hidden), w (vocab, hidden) contiguous),
// ℓ = r[m]·s except the target column's r[m]·(h[m]·w[target]) in fp32; lse[m] and token_loss[m] as
// fold_lse_loss; then in place dℓ and zdz[m] as cross_entropy_grad_from_logits.
void cross_entropy_from_unscaled_logits(bf16* s, int64_t ld, int64_t m, int64_t vocab,
                                        const bf16* h, const bf16* w, int64_t hidden,
                                        const float* r, const int64_t* targets,
                                        int64_t ignore_index, float z_loss, const float* scale,
                                        float* lse, float* token_loss, float* zdz,
                                        cudaStream_t stream);

// p[i] = bf16(p[i] · g[0]) for i < n, unless g[0] == 1 (read on the device: then no pass over p).
// For gradients formed before their scale is known (the LM head's, for d loss = 1).
void scale_bf16_unless_one(bf16* p, int64_t n, const float* g, cudaStream_t stream);

}  // namespace coda::kernel
