#pragma once
// The plain C++ op API: device pointers, shapes and a stream. Every entry validates its arguments
// (null, sizes, 16-byte alignment, N and K multiples of 8, pointers on the current device) and
// throws coda::Error naming the argument; then it launches without synchronizing the host.
// Tensors are contiguous row-major bf16 unless stated; r, partials and other reductions are fp32.

#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

#include "coda/epilogue/reduction.hpp"
#include "coda/kernel/args.hpp"
#include "coda/programs/rope.hpp"

namespace coda::ops {

using kernel::bf16;

// D (M, N) = X (M, K) · W (N, K)ᵀ
void gemm(const bf16* x, const bf16* w, bf16* d, int m, int n, int k, cudaStream_t stream);

// Layout of the per-row partial buffer the fused forward op for (M, N) writes (it depends on the
// tile the heuristic picks); allocate layout.elements() floats.
epilogue::PartialLayout residual_rmsnorm_partials_layout(int m, int n, int k);

// F1: x = A · Wᵀ + residual;  h = x ⊙ γ;  per-tile Σx² partials. A (M, K), W (N, K), residual,
// x, h (M, N), gamma (N). x may alias residual (in-place residual stream).
void gemm_residual_rmsnorm_partial(const bf16* a, const bf16* w, const bf16* residual,
                                   const bf16* gamma, bf16* x, bf16* h, float* sumsq_partials,
                                   int m, int n, int k, cudaStream_t stream);

// A1: r = rsqrt(Σ partials / hidden + eps), r (M) fp32.
void rmsnorm_fold(const float* sumsq_partials, const epilogue::PartialLayout& layout, int hidden,
                  float eps, float* r, cudaStream_t stream);

// F0 (first layer): h = x ⊙ γ, r = rsqrt(mean x² + eps).
void first_layer_rmsnorm(const bf16* x, const bf16* gamma, int m, int hidden, float eps, bf16* h,
                         float* r, cudaStream_t stream);

// F2: z = r ⊙ (h · W_guᵀ) (M, 2I) with gate/up interleaved;  a = silu(z_g) · z_u (M, I).
void gemm_rmsnorm_swiglu(const bf16* h, const bf16* w_gu, const float* r, bf16* z, bf16* a, int m,
                         int two_i, int k, cudaStream_t stream);

// Device copy of a RoPE column table (programs::rope_column_table): hi and lo words, N each.
struct RopeTableDevice {
  const uint32_t* hi = nullptr;
  const uint32_t* lo = nullptr;
  int columns = 0;
};
// Splits a host table into the two word arrays (host vectors, for upload by the caller).
void split_rope_table(const std::vector<programs::RopeFrequency>& table, std::vector<uint32_t>& hi,
                      std::vector<uint32_t>& lo);

// F3: qkv = rope(r ⊙ (h · W_qkvᵀ), pos, freq) on Q and K heads, V unrotated. qkv (M, N).
void gemm_rmsnorm_rope(const bf16* h, const bf16* w_qkv, const float* r, const int32_t* pos,
                       const RopeTableDevice& freq, bf16* qkv, int m, int n, int k,
                       cudaStream_t stream);

// B1: g = dz · W (dz (M, Nout), W (Nout, H)); dx = dres + r·(g·γ − x·r·ZdZ) written to dx (which
// may alias dres: an in-place accumulate); h_out = x·r·γ; per-tile dγ partials (per_column layout).
epilogue::PartialLayout rmsnorm_backward_partials_layout(int m, int hidden, int n_out);
void gemm_rmsnorm_backward(const bf16* dz, const bf16* w, const bf16* x, const float* r,
                           const bf16* gamma, const float* zdz, const bf16* dres, bf16* dx,
                           bf16* h_out, float* dgamma_partials, int m, int hidden, int n_out,
                           cudaStream_t stream);

// D (M, N) = X (M, K) · W (K, N): the data gradient dz · W of a layer whose weight is W (K = out).
void gemm_xw(const bf16* x, const bf16* w, bf16* d, int m, int n, int k, cudaStream_t stream);

// D (M, N) = Xᵀ · Y with X (K, M) and Y (K, N): the weight gradient dW = dzᵀ · h (K = tokens).
void gemm_xty(const bf16* x, const bf16* y, bf16* d, int m, int n, int k, cudaStream_t stream);

// B2: da = dx_out · W_down (dx_out (M, H), W_down (H, I)); with z the saved interleaved (g, u)
// pairs (M, 2I): dz (M, 2I) interleaved, a = silu(g)·u (M, I) recomputed, Σ g·dg + u·du partials.
epilogue::PartialLayout swiglu_backward_partials_layout(int m, int intermediate, int hidden);
void gemm_swiglu_backward(const bf16* dx_out, const bf16* w_down, const bf16* z, bf16* dz, bf16* a,
                          float* zdz_partials, int m, int intermediate, int hidden,
                          cudaStream_t stream);

// B3: dqkv_pre = Rᵀ · dqkv on Q/K pairs (V unchanged), zdz[m] = Σ_n qkv·dqkv / hidden.
void rope_backward(const bf16* qkv, const bf16* dqkv, const int32_t* pos,
                   const RopeTableDevice& freq, int m, int width, int hidden, bf16* dqkv_pre,
                   float* zdz, cudaStream_t stream);

// A3: zdz[m] = Σ partials / hidden (per-row layout); dgamma[n] = Σ partials (per-column layout).
void zdz_fold(const float* partials, const epilogue::PartialLayout& layout, int hidden, float* zdz,
              cudaStream_t stream);
void dgamma_fold(const float* partials, const epilogue::PartialLayout& layout, float* dgamma,
                 cudaStream_t stream);

// F4: logits ℓ = r ⊙ (h · W_vocabᵀ) (M, V), never stored: per-tile online (max, Σexp) partials
// (layout from lm_head_partials_layout) and target_logit[m] = ℓ[m, targets[m]] (left untouched
// for targets outside [0, V), e.g. ignore_index). h (M, H), w_vocab (V, H), r (M), targets (M).
epilogue::PartialLayout lm_head_partials_layout(int m, int vocab, int hidden);
void gemm_rmsnorm_lse(const bf16* h, const bf16* w_vocab, const float* r, const int64_t* targets,
                      float* max_partials, float* sum_partials, float* target_logit, int m,
                      int vocab, int hidden, cudaStream_t stream);

// F4 that also stores the logits, bf16 (M, V) at row stride ld_logits (the LM head's three-GEMM
// path: dℓ is then formed in place from them instead of recomputing the GEMM). Its partials use
// their own layout (another tile than gemm_rmsnorm_lse's).
epilogue::PartialLayout lm_head_logits_partials_layout(int m, int vocab, int hidden);
void gemm_rmsnorm_lse_logits(const bf16* h, const bf16* w_vocab, const float* r,
                             const int64_t* targets, float* max_partials, float* sum_partials,
                             float* target_logit, bf16* logits, int ld_logits, int m, int vocab,
                             int hidden, cudaStream_t stream);
// B4 from those logits, in place: dℓ = (p − onehot(target) + 2·z_loss·lse·p) · scale[m] with
// p = exp(ℓ − lse[m]), the target column's ℓ taken from target_logit (F4's fp32 value); zdz[m] =
// Σ ℓ·dℓ / hidden (already folded: B1's input).
void cross_entropy_backward_from_logits(bf16* logits, int ld_logits, const float* lse,
                                        const float* scale, const int64_t* targets,
                                        const float* target_logit, float z_loss, float* zdz,
                                        int m, int vocab, int hidden, cudaStream_t stream);

// A2 + B4 on the plain GEMM's logits s = h·W_vocabᵀ (bf16 (M, V) at row stride ld_logits, not yet
// scaled by r): ℓ = r·s; lse, token_loss as lse_loss_fold (the target logit r·(h·w_target) in
// fp32 from h (M, hidden) and w_vocab (V, hidden)); then s is overwritten in place by dℓ as
// cross_entropy_backward_from_logits, with zdz. The LM head's three-GEMM path at hidden <= 2048.
void cross_entropy_from_unscaled_logits(bf16* logits, int ld_logits, const bf16* h,
                                        const bf16* w_vocab, const float* r,
                                        const int64_t* targets, int64_t ignore_index,
                                        float z_loss, const float* scale, float* lse,
                                        float* token_loss, float* zdz, int m, int vocab,
                                        int hidden, cudaStream_t stream);

// A2: lse (M) and per-token loss (M): lse − ℓ_target + z_loss·lse², 0 for ignore_index, NaN for a
// target outside [0, V) that is not ignore_index (checked on the device; the host never syncs).
void lse_loss_fold(const float* max_partials, const float* sum_partials,
                   const epilogue::PartialLayout& layout, const float* target_logit,
                   const int64_t* targets, int vocab, int64_t ignore_index, float z_loss,
                   float* lse, float* token_loss, cudaStream_t stream);

// B4's Σ ℓ·dℓ partials: its own layout (B4 may run on another tile than F4).
epilogue::PartialLayout cross_entropy_backward_partials_layout(int m, int vocab, int hidden);
// B4: dℓ = (softmax(ℓ) − onehot(target) + 2·z_loss·lse·softmax(ℓ)) · scale[m] recomputed from h,
// written as bf16 (M, V); Σ ℓ·dℓ per-tile partials (cross_entropy_backward_partials_layout).
void gemm_rmsnorm_cross_entropy_backward(const bf16* h, const bf16* w_vocab, const float* r,
                                         const float* lse, const float* scale,
                                         const int64_t* targets, float z_loss, bf16* dlogits,
                                         float* zdz_partials, int m, int vocab, int hidden,
                                         cudaStream_t stream);

}  // namespace coda::ops
