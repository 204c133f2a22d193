#pragma once
// The plain C++ op API of the Hopper executor: one function per program of docs/math.md (and the
// folds and row kernels around them), on TensorViews and a stream. Every entry checks each
// argument on the host before anything reaches the device (shape, dtype, row stride, 16-byte
// alignment, the view's device against the current one) and throws coda::Error naming the
// argument, the expected and the actual value; then it launches without synchronizing the host.
// Activations are bf16 matrices; r, partials and every reduction are fp32.
//
// Extents: every matrix needs a row stride of a multiple of 16 bytes (the TMA's), not extents of
// a multiple of 8: K, and M of Xᵀ·Y, may be any size, and so may N for the plain GEMMs and the
// LM-head programs (F4, F4 with logits, B4; the others need N % 8). Where N is not a multiple of
// 8, D's store may write zeros into its columns up to N rounded up to 8 (the TMA store moves
// 16-byte granules; the H200 does): D's rows must own that padding, not share it with a neighbour
// (a column slice of a wider tensor). The PyTorch ops pass their own padded scratch.
//
// Partial buffers are fp32 matrices of (layout.tiles, layout.extent): the layout depends on the
// kernel configuration the launch takes, so callers ask the *_partials_layout function of the op.

#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

#include "coda/epilogue/reduction.hpp"
#include "coda/programs/rope.hpp"
#include "coda/tensor.hpp"

namespace coda::ops {

using View = const TensorView&;
using epilogue::PartialLayout;

// D (M, N) = X (M, K) · W (N, K)ᵀ
void gemm(View x, View w, View d, cudaStream_t stream);
// D (M, N) = X (M, K) · W (K, N): the data gradient dz · W of a layer whose weight is W.
void gemm_xw(View x, View w, View d, cudaStream_t stream);
// D (M, N) = Xᵀ · Y with X (K, M) and Y (K, N): the weight gradient dW = dzᵀ · h (K = tokens).
void gemm_xty(View x, View y, View d, cudaStream_t stream);

// F1: x = a · Wᵀ + residual;  h = x ⊙ γ;  per-tile Σx² partials. a (M, K), w (N, K), residual,
// x, h (M, N), gamma (N). x may alias residual (in-place residual stream).
PartialLayout residual_rmsnorm_partials_layout(int64_t m, int64_t n, int64_t k);
void gemm_residual_rmsnorm_partial(View a, View w, View residual, View gamma, View x, View h,
                                   View sumsq_partials, cudaStream_t stream);
// A1: r = rsqrt(Σ partials / hidden + eps), r (M).
void rmsnorm_fold(View sumsq_partials, int64_t hidden, float eps, View r, cudaStream_t stream);
// F0 (first layer): h = x ⊙ γ, r = rsqrt(mean x² + eps).
void first_layer_rmsnorm(View x, View gamma, float eps, View h, View r, cudaStream_t stream);

// F2: z = r ⊙ (h · W_guᵀ) (M, 2I) with gate/up interleaved;  a = silu(z_g) · z_u (M, I).
void gemm_rmsnorm_swiglu(View h, View w_gu, View r, View z, View a, cudaStream_t stream);

// F3: qkv = rope(r ⊙ (h · W_qkvᵀ) + bias, pos, freq) on Q and K heads, V unrotated. qkv (M, N);
// bias (N) bf16, or a null view (View{}) for none; pos (M) int32; rope_table (2, N) int32: the
// high and low words of each column's programs::RopeFrequency (rows 0 and 1).
void gemm_rmsnorm_rope(View h, View w_qkv, View r, View bias, View pos, View rope_table, View qkv,
                       cudaStream_t stream);
// F3 with QK-norm (Qwen3): u = r ⊙ (h · W_qkvᵀ); on each Q and K head of a row,
// qkv = rope(γ ⊙ u · rsqrt(mean u² + eps), pos, freq) with γ = q_gamma or k_gamma (head_dim,
// bf16); V heads qkv = u; qk_pre (M, qk.normed_width()) = u on the Q and K columns. head_dim must
// divide 128 and be >= 8 (a head lies in one 128-column tile).
void gemm_rmsnorm_qk_norm_rope(View h, View w_qkv, View r, View q_gamma, View k_gamma,
                               const programs::QkNorm& qk, View pos, View rope_table, View qkv,
                               View qk_pre, cudaStream_t stream);
// The two rows of a rope_table from the host table (for upload by the caller).
void split_rope_table(const std::vector<programs::RopeFrequency>& table, std::vector<uint32_t>& hi,
                      std::vector<uint32_t>& lo);

// B1: g = dz · W (dz (M, Nout), W (Nout, H)); dx = dres + r·(g·γ − x·r·ZdZ) written to dx (which
// may alias dres: an in-place accumulate; dres a null view: no residual gradient, nothing read);
// h_out = x·r·γ; per-tile dγ partials (per-column).
PartialLayout rmsnorm_backward_partials_layout(int64_t m, int64_t hidden, int64_t n_out);
void gemm_rmsnorm_backward(View dz, View w, View x, View r, View gamma, View zdz, View dres,
                           View dx, View h_out, View dgamma_partials, cudaStream_t stream);

// B2: da = dx_out · W_down (dx_out (M, H), W_down (H, I)); with z the saved interleaved (g, u)
// pairs (M, 2I): dz (M, 2I) interleaved, a = silu(g)·u (M, I) recomputed, Σ g·dg + u·du partials.
PartialLayout swiglu_backward_partials_layout(int64_t m, int64_t intermediate, int64_t hidden);
void gemm_swiglu_backward(View dx_out, View w_down, View z, View dz, View a, View zdz_partials,
                          cudaStream_t stream);

// B3: dqkv_pre = Rᵀ · dqkv on Q/K pairs (V unchanged), zdz[m] = Σ_n (qkv·dqkv − bias·dqkv_pre)
// / hidden (bias: F3's, or a null view).
void rope_backward(View qkv, View dqkv, View bias, View pos, View rope_table, int64_t hidden,
                   View dqkv_pre, View zdz, cudaStream_t stream);

// B3 with QK-norm (the backward of gemm_rmsnorm_qk_norm_rope, docs/math.md B3q): on Q and K
// heads dqkv_pre = s · (γ ⊙ dy' − n · mean(γ ⊙ dy' ⊙ n)) with dy' = Rᵀ · dqkv, n = u · s, u =
// qk_pre; on V heads dqkv_pre = dqkv; zdz[m] = Σ_n z · dqkv_pre / hidden (z = u on Q and K, qkv
// on V); dq_gamma, dk_gamma (fp32, head_dim) = Σ over rows and heads of dy' ⊙ n, through
// dgamma_partials (fp32, (qk_norm_backward_partials_rows(M), 2 · head_dim)).
int64_t qk_norm_backward_partials_rows(int64_t m);
void qk_norm_rope_backward(View qk_pre, View qkv, View dqkv, View q_gamma, View k_gamma,
                           const programs::QkNorm& qk, View pos, View rope_table, int64_t hidden,
                           View dqkv_pre, View zdz, View dgamma_partials, View dq_gamma,
                           View dk_gamma, cudaStream_t stream);

// A3: zdz[m] = Σ partials / hidden (per-row); dgamma[n] = Σ partials (per-column).
void zdz_fold(View partials, int64_t hidden, View zdz, cudaStream_t stream);
void dgamma_fold(View partials, View dgamma, cudaStream_t stream);

// F4: logits ℓ = r ⊙ (h · W_vocabᵀ) (M, V), never stored: per-tile online (max, Σexp) partials and
// target_logit[m] = ℓ[m, targets[m]] (left untouched for targets outside [0, V), e.g.
// ignore_index). h (M, H), w_vocab (V, H), r (M), targets (M) int64.
PartialLayout lm_head_partials_layout(int64_t m, int64_t vocab, int64_t hidden);
void gemm_rmsnorm_lse(View h, View w_vocab, View r, View targets, View max_partials,
                      View sum_partials, View target_logit, cudaStream_t stream);
// F4 that also stores the logits, bf16 (M, V) (the LM head's three-GEMM path: dℓ is then formed in
// place from them). Its partials use their own layout (another tile than gemm_rmsnorm_lse's).
PartialLayout lm_head_logits_partials_layout(int64_t m, int64_t vocab, int64_t hidden);
void gemm_rmsnorm_lse_logits(View h, View w_vocab, View r, View targets, View max_partials,
                             View sum_partials, View target_logit, View logits,
                             cudaStream_t stream);
// B4 from those logits, in place: dℓ = (p − onehot(target) + 2·z_loss·lse·p) · scale[m] with
// p = exp(ℓ − lse[m]), the target column's ℓ taken from target_logit (F4's fp32 value); zdz[m] =
// Σ ℓ·dℓ / hidden (already folded: B1's input).
void cross_entropy_backward_from_logits(View logits, View lse, View scale, View targets,
                                        View target_logit, float z_loss, int64_t hidden, View zdz,
                                        cudaStream_t stream);
// A2 + B4 on the plain GEMM's logits s = h·W_vocabᵀ (bf16 (M, V), not yet scaled by r): ℓ = r·s;
// lse, token_loss as lse_loss_fold (the target logit r·(h·w_target) in fp32 from h and w_vocab);
// then s is overwritten in place by dℓ as cross_entropy_backward_from_logits, with zdz. The LM
// head's three-GEMM path at hidden <= 2048.
void cross_entropy_from_unscaled_logits(View logits, View h, View w_vocab, View r, View targets,
                                        int64_t ignore_index, float z_loss, View scale, View lse,
                                        View token_loss, View zdz, cudaStream_t stream);
// A2: lse (M) and per-token loss (M): lse − ℓ_target + z_loss·lse², 0 for ignore_index, NaN for a
// target outside [0, V) that is not ignore_index (checked on the device; the host never syncs).
void lse_loss_fold(View max_partials, View sum_partials, View target_logit, View targets,
                   int64_t vocab, int64_t ignore_index, float z_loss, View lse, View token_loss,
                   cudaStream_t stream);
// B4: dℓ = (softmax(ℓ) − onehot(target) + 2·z_loss·lse·softmax(ℓ)) · scale[m] recomputed from h,
// written as bf16 (M, V); Σ ℓ·dℓ per-tile partials (its own layout).
PartialLayout cross_entropy_backward_partials_layout(int64_t m, int64_t vocab, int64_t hidden);
void gemm_rmsnorm_cross_entropy_backward(View h, View w_vocab, View r, View lse, View scale,
                                         View targets, float z_loss, View dlogits,
                                         View zdz_partials, cudaStream_t stream);

// p = bf16(p · g[0]) unless g[0] == 1 (read on the device: then no pass over p); p a bf16 vector
// (any alignment), g one fp32. For gradients formed before their scale is known.
void scale_unless_one(View p, View g, cudaStream_t stream);

// ---- Blockwise FP8 (docs/math.md §6) --------------------------------------------------------
// e4m3 codes are kE4M3 matrices; each 1x128 block and each 128x128 block has one fp32 power-of-
// two scale. A view passed with a null data pointer is an output not wanted.
//
// Scales of a 1x128-blocked (rows, cols) operand: an fp32 (ceil(cols / 128), rows) matrix, one
// row per column block, with a row stride that is a multiple of 4 (its TMA rows); scales of a
// 128x128-blocked one: (ceil(rows / 128), ceil(cols / 128)), any row stride >= its width.

// x (M, K) bf16, K a multiple of 16, into 1x128 blocks: codes (M, K), scales (ceil(K/128), M);
// and its transposed 128x1 copy: codes_t (K, M16) with M16 = M rounded up to 16 (columns M..
// M16-1 are code 0, so a weight gradient contracts over M16 tokens), scales_t (ceil(M/128), K).
void quantize_fp8_rows(View x, View codes, View scales, View codes_t, View scales_t,
                       cudaStream_t stream);
// a = silu(g)·u of z (M, 2I) bf16 interleaved (g, u) pairs (F2's pre-activation), I a multiple
// of 16, each a rounded to bf16: a's transposed 128x1 copy codes_t (I, M16), scales_t
// (ceil(M/128), I), as quantize_fp8_rows writes it for that a.
void quantize_fp8_swiglu_t(View z, View codes_t, View scales_t, cudaStream_t stream);
// The same from z saved in FP8 (gemm_fp8_rmsnorm_swiglu_fp8_z's z codes (M, 2I) and z_scales
// (ceil(2I/128), M rounded up to 4)): each pair decoded, a = silu(g)·u rounded to bf16; bit for
// bit quantize_fp8_swiglu_t of the decoded z in bf16.
void quantize_fp8_swiglu_t_fp8_z(View z, View z_scales, View codes_t, View scales_t,
                                 cudaStream_t stream);
// w (N, K) bf16, K a multiple of 16, into 128x128 blocks: codes (N, K), scales (ceil(N/128),
// ceil(K/128)); codes_t (K, N) = wᵀ's codes with scales_t (ceil(K/128), ceil(N/128)) the same
// blocks transposed (N a multiple of 16 then): the data gradient's operand.
void quantize_fp8_blocks(View w, View codes, View scales, View codes_t, View scales_t,
                         cudaStream_t stream);
// The transpose of quantize_fp8_blocks' codes (N, K) and scales (ceil(N/128), ceil(K/128)), N and
// K multiples of 16: codes_t (K, N) and scales_t (ceil(K/128), ceil(N/128)), bit for bit its
// codes_t and scales_t of the same w (a weight's data-gradient operand made from the forward's).
void transpose_fp8_blocks(View codes, View scales, View codes_t, View scales_t,
                          cudaStream_t stream);
// d (M, N) bf16 = x · wᵀ: x (M, K) in 1x128 blocks, w (N, K) in 128x128 blocks, K a multiple of
// 16, N of 8; partial sums promoted to fp32 and scaled once per 128 of K.
void gemm_fp8(View x, View x_scales, View w, View w_scales, View d, cudaStream_t stream);
// F1 over FP8 operands (a in 1x128 blocks, w in 128x128 blocks, as gemm_fp8): x (M, N) =
// a · wᵀ + residual in bf16; h = bf16(x ⊙ γ) quantized in the epilogue, bit for bit as
// quantize_fp8_rows would quantize it: h (M, N) codes with h_scales (ceil(N/128), M rounded up to
// 4), and its transposed copy h_t (N, M16) with h_t_scales (ceil(M/128), N), either of which may
// be left out; per-tile Σx² partials for rmsnorm_fold. N a multiple of 16. x may alias residual.
PartialLayout fp8_residual_rmsnorm_partials_layout(int64_t m, int64_t n, int64_t k);
void gemm_fp8_residual_rmsnorm(View a, View a_scales, View w, View w_scales, View residual,
                               View gamma, View x, View h, View h_scales, View h_t, View h_t_scales,
                               View sumsq_partials, cudaStream_t stream);
// F1 over FP8 operands with h in bf16 (the last layer's: the LM head reads bf16 h): x, h (M, N)
// and the Σx² partials as gemm_residual_rmsnorm_partial's, from gemm_fp8's operands.
PartialLayout fp8_residual_rmsnorm_bf16_partials_layout(int64_t m, int64_t n, int64_t k);
void gemm_fp8_residual_rmsnorm_bf16(View a, View a_scales, View w, View w_scales, View residual,
                                    View gamma, View x, View h, View sumsq_partials,
                                    cudaStream_t stream);
// F2 over FP8 operands (h in 1x128 blocks, w_gu (2I, K) in 128x128 blocks): z (M, 2I) = r ⊙
// (h · w_guᵀ) in bf16 (interleaved gate/up, saved for the backward); a = bf16(silu(z_g) · z_u)
// quantized in the epilogue as quantize_fp8_rows would quantize it: a (M, I) with a_scales
// (ceil(I/128), M rounded up to 4) and its transposed copy a_t (I, M16) with a_t_scales
// (ceil(M/128), I), either of which may be left out. 2I a multiple of 32.
void gemm_fp8_rmsnorm_swiglu(View h, View h_scales, View w_gu, View w_gu_scales, View r, View z,
                             View a, View a_scales, View a_t, View a_t_scales, cudaStream_t stream);
// The same with z saved in FP8: z (M, 2I) rounded to bf16 and quantized in 1x128 blocks instead of
// written in bf16, codes z (M, 2I) and z_scales (ceil(2I/128), M rounded up to 4), bit for bit
// quantize_fp8_rows of gemm_fp8_rmsnorm_swiglu's z; a and its outputs as there.
void gemm_fp8_rmsnorm_swiglu_fp8_z(View h, View h_scales, View w_gu, View w_gu_scales, View r,
                                   View z, View z_scales, View a, View a_scales, View a_t,
                                   View a_t_scales, cudaStream_t stream);
// F3 over FP8 operands (h in 1x128 blocks, w_qkv (N, K) in 128x128 blocks): qkv (M, N) bf16 =
// rope(r ⊙ (h · w_qkvᵀ) + bias, pos, freq), the arguments as gemm_rmsnorm_rope's.
void gemm_fp8_rmsnorm_rope(View h, View h_scales, View w_qkv, View w_qkv_scales, View r, View bias,
                           View pos, View rope_table, View qkv, cudaStream_t stream);
// F3q over FP8 operands (as gemm_fp8_rmsnorm_rope's): qkv and qk_pre as gemm_rmsnorm_qk_norm_rope
// writes them.
void gemm_fp8_rmsnorm_qk_norm_rope(View h, View h_scales, View w_qkv, View w_qkv_scales, View r,
                                   View q_gamma, View k_gamma, const programs::QkNorm& qk, View pos,
                                   View rope_table, View qkv, View qk_pre, cudaStream_t stream);
// B1 over FP8 operands: g = dz · W from dz (M, K) in 1x128 blocks and w_t = Wᵀ's codes (H, K) in
// 128x128 blocks (quantize_fp8_blocks' codes_t of W (K, H)); dx = dres + r·(g·γ − x·r·ZdZ) in
// bf16 (may alias dres; dres null: no residual gradient); h_out = x·r·γ, the GEMM's normalized
// input, rounded to bf16 and quantized in the epilogue as quantize_fp8_rows would quantize its
// transposed copy: h_t (H, M16) with h_t_scales (ceil(M/128), H) (the weight gradient
// dW = dzᵀ · h_out's B); dγ partials. H a multiple of 16.
PartialLayout fp8_rmsnorm_backward_partials_layout(int64_t m, int64_t hidden, int64_t n_out);
void gemm_fp8_rmsnorm_backward(View dz, View dz_scales, View w_t, View w_t_scales, View x, View r,
                               View gamma, View zdz, View dres, View dx, View h_t, View h_t_scales,
                               View dgamma_partials, cudaStream_t stream);
// B2 over FP8 operands: da = dx_out · W_down from dx_out (M, H) in 1x128 blocks and w_down_t =
// W_downᵀ's codes (I, H) in 128x128 blocks; with z (M, 2I) the saved interleaved pre-activation,
// dz (M, 2I) = dSwiGLU rounded to bf16, quantized in the epilogue as quantize_fp8_rows would
// quantize it: dz (M, 2I) codes with dz_scales (ceil(2I/128), M rounded up to 4), dz_t (2I, M16)
// with dz_t_scales (ceil(M/128), 2I), either may be left out; ZdZ partials (Σ g·dg + u·du). a is
// not recomputed (the FP8 forward keeps F2's a_t). I a multiple of 8.
PartialLayout fp8_swiglu_backward_partials_layout(int64_t m, int64_t intermediate, int64_t hidden);
void gemm_fp8_swiglu_backward(View dx_out, View dx_out_scales, View w_down_t, View w_down_t_scales,
                              View z, View dz, View dz_scales, View dz_t, View dz_t_scales,
                              View zdz_partials, cudaStream_t stream);
// The same from z saved in FP8 (codes z (M, 2I), z_scales (ceil(2I/128), M rounded up to 4), as
// gemm_fp8_rmsnorm_swiglu_fp8_z writes them), each (g, u) decoded first: bit for bit
// gemm_fp8_swiglu_backward of the decoded z in bf16. Partials in
// fp8_swiglu_backward_fp8_z_partials_layout.
PartialLayout fp8_swiglu_backward_fp8_z_partials_layout(int64_t m, int64_t intermediate,
                                                        int64_t hidden);
void gemm_fp8_swiglu_backward_fp8_z(View dx_out, View dx_out_scales, View w_down_t,
                                    View w_down_t_scales, View z, View z_scales, View dz,
                                    View dz_scales, View dz_t, View dz_t_scales, View zdz_partials,
                                    cudaStream_t stream);
// B2 split (the placement below): gemm_fp8 writes da = dx_out · W_down (M, I) in bf16, then
// this pass makes what B2's epilogue makes from it: dz = dSwiGLU(z, da) rounded to bf16 and
// quantized as quantize_fp8_rows would quantize it (dz, dz_t as gemm_fp8_swiglu_backward's, either
// may be left out) and the ZdZ partials in fp8_swiglu_backward_split_partials_layout (per row and
// 64-column tile of da, i.e. 128 columns of dz). z (M, 2I) bf16, or e4m3 codes with z_scales
// (z_scales' data null: bf16), as gemm_fp8_swiglu_backward[_fp8_z] take it. I a multiple of 8.
// The outputs differ from the fused B2's by da's rounding to bf16 before the pass.
PartialLayout fp8_swiglu_backward_split_partials_layout(int64_t m, int64_t intermediate);
void fp8_swiglu_backward_quantize(View da, View z, View z_scales, View dz, View dz_scales,
                                  View dz_t, View dz_t_scales, View zdz_partials,
                                  cudaStream_t stream);
// F2 split with z saved in FP8: gemm_fp8 writes y = h · w_guᵀ (M, 2I) in bf16, then this pass
// makes what F2's epilogue with an FP8 z makes from it (gemm_fp8_rmsnorm_swiglu_fp8_z's r, z,
// z_scales, a, a_scales, a_t, a_t_scales): z = r ⊙ y rounded to bf16 and quantized, and a =
// silu(z_g)·z_u from the unrounded z, rounded and quantized. 2I a multiple of 32. The outputs
// differ from the fused F2's by y's rounding to bf16 before r scales it.
void fp8_rmsnorm_swiglu_quantize(View y, View r, View z, View z_scales, View a, View a_scales,
                                 View a_t, View a_t_scales, cudaStream_t stream);
// B1 split: gemm_fp8 writes g = dz · W (M, H) in bf16, then this pass makes what B1's epilogue
// makes from it (gemm_fp8_rmsnorm_backward's x, r, gamma, zdz, dres, dx, h_t and h_t_scales):
// dx, h_out's transposed copy quantized, and the dγ partials in
// fp8_rmsnorm_backward_split_partials_layout (per column and 128-row tile, as the fused
// kernel's). H a multiple of 16. The outputs differ from the fused B1's by g's rounding to bf16.
PartialLayout fp8_rmsnorm_backward_split_partials_layout(int64_t m, int64_t hidden);
void fp8_rmsnorm_backward_quantize(View g, View x, View r, View gamma, View zdz, View dres,
                                   View dx, View h_t, View h_t_scales, View dgamma_partials,
                                   cudaStream_t stream);
// B3 and the cast of its output in one pass (the FP8 norm+QKV backward without a bias): dqkv_pre
// = Rᵀ·dqkv as rope_backward computes it, rounded to bf16 and quantized as quantize_fp8_rows
// would quantize it (dpre rows, dpre_t its transposed copy; either may be left out), and the ZdZ
// partials Σ qkv·dqkv per row and 128-column tile in fp8_rope_backward_partials_layout, which
// zdz_fold(partials, hidden) turns into rope_backward's zdz (up to fp32 summation order). qkv,
// dqkv (M, N) bf16, N a multiple of 16; pos (M) int32; rope_table (2, N) int32 as
// rope_backward's. Saves the bf16 dqkv_pre's write and the cast's read of it.
PartialLayout fp8_rope_backward_partials_layout(int64_t m, int64_t width);
void fp8_rope_backward_quantize(View qkv, View dqkv, View pos, View rope_table, View dpre,
                                View dpre_scales, View dpre_t, View dpre_t_scales,
                                View zdz_partials, cudaStream_t stream);
// Where an FP8 program's elementwise work runs: in the GEMM's epilogue (kFused) or in a pass of
// its own after a plain FP8 GEMM (kSplit), process-wide. The blockwise FP8 kernels' epilogue does
// not overlap the tensor cores (docs/design.md), and a pass at HBM bandwidth could cost less than
// the exposed epilogue. kAuto, the default, splits where the pass is measured faster than the
// fused epilogue (docs/experiments.md): B2, B1 whose GEMM's K is at most kFp8B1SplitMaxK and F2z
// whose K is at most kFp8F2zSplitMaxK. Starts from the environment variable CODA_FP8_EPILOGUE
// ("auto", "fused", "split"), read on first use. Callers that own an allocator (the torch ops)
// apply it: fp8_epilogue_split(program, k) says whether B1, B2 or F2 with z in FP8 over a GEMM of
// reduction extent k runs split.
enum class Fp8EpiloguePlacement { kAuto, kFused, kSplit };
enum class Fp8SplitProgram { kF2z, kB1, kB2 };
inline constexpr int64_t kFp8B1SplitMaxK = 32768, kFp8F2zSplitMaxK = 4096;
Fp8EpiloguePlacement fp8_epilogue_placement();
void set_fp8_epilogue_placement(Fp8EpiloguePlacement placement);
bool fp8_epilogue_split(Fp8SplitProgram program, int64_t k);
// d (M, N) = x · yᵀ with x (M, K) and y (N, K) both in 1x128 blocks (the weight gradient from
// the transposed copies, K = tokens): d bf16, or with `accumulate` fp32 d += x · yᵀ. Runs on
// the backend fp8_wgrad_backend() names.
void gemm_fp8_xyt(View x, View x_scales, View y, View y_scales, View d, bool accumulate,
                  cudaStream_t stream);
// gemm_fp8_xyt's backend, process-wide: our CUTLASS kernel (kCutlass), or cuBLASLt's
// blockwise-scaled GEMM where it takes the problem (scales whose row stride is exactly the
// operand's rows, as the casts and epilogues write the transposed copies' scales; a D type this
// cuBLASLt has a kernel for) and ours elsewhere (kCublasLt), or cuBLASLt or an error naming why
// not (kCublasLtOnly). Starts from the environment variable CODA_FP8_WGRAD ("cublaslt", the
// default; "cutlass"; "cublaslt-only"), read on first use.
enum class Fp8WgradBackend { kCutlass, kCublasLt, kCublasLtOnly };
Fp8WgradBackend fp8_wgrad_backend();
void set_fp8_wgrad_backend(Fp8WgradBackend backend);

}  // namespace coda::ops
