// Random fills and on-device comparisons (see include/coda/kernel/aux_kernels.hpp).
#include <cuda_bf16.h>

#include <cmath>
#include <cstdint>
#include <tuple>
#include <utility>

#include "coda/epilogue/elementwise.hpp"
#include "coda/epilogue/online_softmax.hpp"
#include "coda/kernel/aux_kernels.hpp"
#include "coda/kernel/cuda_check.hpp"
#include "coda/programs/formulas.hpp"
#include "coda/programs/rope.hpp"

namespace coda::kernel {
namespace {

__device__ __forceinline__ uint64_t mix(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

__global__ void fill_uniform_kernel(bf16* p, size_t n, uint64_t seed, float lo, float hi) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n;
       i += size_t(gridDim.x) * blockDim.x) {
    const uint64_t r = mix(seed * 0x9e3779b97f4a7c15ull + i);
    const float u = static_cast<float>(r >> 40) * 0x1.0p-24f;
    p[i] = __float2bfloat16(lo + (hi - lo) * u);
  }
}

// Max of non-negative floats via integer atomics (the bit patterns order like the values);
// NaN (0x7fc00000 and up) wins, so a poisoned or NaN output is never reported as small.
__device__ __forceinline__ void atomic_max_nonneg(float* addr, float v) {
  atomicMax(reinterpret_cast<unsigned int*>(addr), __float_as_uint(v));
}

__global__ void max_abs_diff_kernel(const bf16* a, const bf16* b, size_t n, float* out) {
  float d = 0.f, m = 0.f;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n;
       i += size_t(gridDim.x) * blockDim.x) {
    const float x = __bfloat162float(a[i]), y = __bfloat162float(b[i]);
    const float e = fabsf(x - y);
    d = (isnan(e) || e > d) ? e : d;
    m = fmaxf(m, fabsf(y));
  }
  for (int o = 16; o > 0; o /= 2) {
    const float od = __shfl_xor_sync(0xffffffff, d, o);
    d = (isnan(od) || od > d) ? od : d;
    m = fmaxf(m, __shfl_xor_sync(0xffffffff, m, o));
  }
  if ((threadIdx.x & 31) == 0) {
    atomic_max_nonneg(out, isnan(d) ? __uint_as_float(0x7fc00000u) : d);
    atomic_max_nonneg(out + 1, m);
  }
}

// One thread per row; consecutive threads read consecutive rows of each tile column (coalesced).
__global__ void fold_rstd_kernel(const float* partials, int64_t m, int64_t rows_padded,
                                 int64_t tiles, float inv_hidden, float eps, float* r) {
  const int64_t row = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (row >= m) return;
  float s = 0.f;
  for (int64_t t = 0; t < tiles; ++t) s += partials[row + rows_padded * t];
  r[row] = programs::Rstd{}(s, inv_hidden, eps);
}

// One warp per row, 8 bf16 (16 bytes) per lane per step; H % 8 == 0 is checked by the caller.
__global__ void first_layer_rmsnorm_kernel(const bf16* x, const bf16* gamma, int64_t m,
                                           int64_t hidden, float eps, bf16* h, float* r) {
  const int64_t row = blockIdx.x * int64_t(blockDim.x / 32) + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= m) return;
  const uint4* xv = reinterpret_cast<const uint4*>(x + row * hidden);
  const uint4* gv = reinterpret_cast<const uint4*>(gamma);
  uint4* hv = reinterpret_cast<uint4*>(h + row * hidden);
  float s = 0.f;
  for (int64_t i = lane; i < hidden / 8; i += 32) {
    uint4 xr = xv[i], gr = gv[i], hr;
    const __nv_bfloat162* xp = reinterpret_cast<const __nv_bfloat162*>(&xr);
    const __nv_bfloat162* gp = reinterpret_cast<const __nv_bfloat162*>(&gr);
    __nv_bfloat162* hp = reinterpret_cast<__nv_bfloat162*>(&hr);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float2 xf = __bfloat1622float2(xp[j]), gf = __bfloat1622float2(gp[j]);
      s += programs::PairDot{}(xf.x, xf.y, xf.x, xf.y);
      hp[j] = __floats2bfloat162_rn(xf.x * gf.x, xf.y * gf.y);
    }
    hv[i] = hr;
  }
  for (int o = 16; o > 0; o /= 2) s += __shfl_xor_sync(0xffffffff, s, o);
  if (lane == 0) r[row] = programs::Rstd{}(s, 1.0f / float(hidden), eps);
}

__global__ void fold_row_sums_kernel(const float* partials, int64_t m, int64_t rows_padded,
                                     int64_t tiles, float scale, float* out) {
  const int64_t row = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (row >= m) return;
  float s = 0.f;
  for (int64_t t = 0; t < tiles; ++t) s += partials[row + rows_padded * t];
  out[row] = s * scale;
}

// One warp per row; each lane handles pairs (2j, 2j+1) as one 32-bit load of two bf16.
// With F3's bias b (null: none) ZdZ is Σ (y·dy − b·dz): Rᵀ·y is z + b.
__global__ void rope_backward_kernel(const bf16* y, const bf16* dy, const bf16* bias,
                                     const int32_t* pos, const uint32_t* freq_hi,
                                     const uint32_t* freq_lo, int64_t m, int64_t width,
                                     float inv_hidden, bf16* dz, float* zdz) {
  const int64_t row = blockIdx.x * int64_t(blockDim.x / 32) + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= m) return;
  const __nv_bfloat162* y2 = reinterpret_cast<const __nv_bfloat162*>(y + row * width);
  const __nv_bfloat162* dy2 = reinterpret_cast<const __nv_bfloat162*>(dy + row * width);
  __nv_bfloat162* dz2 = reinterpret_cast<__nv_bfloat162*>(dz + row * width);
  const int32_t p = pos[row];
  float s = 0.f;
  for (int64_t j = lane; j < width / 2; j += 32) {
    const float2 yv = __bfloat1622float2(y2[j]), g = __bfloat1622float2(dy2[j]);
    float c, sn, d0, d1;
    programs::rope_cos_sin<float>(p, programs::RopeFrequency{freq_hi[2 * j], freq_lo[2 * j]}, c, sn);
    epilogue::RopeRotateTranspose{}(g.x, g.y, c, sn, d0, d1);
    dz2[j] = __floats2bfloat162_rn(d0, d1);
    s += programs::PairDot{}(yv.x, yv.y, g.x, g.y);
    if (bias) {
      const float2 b = __bfloat1622float2(reinterpret_cast<const __nv_bfloat162*>(bias)[j]);
      s -= programs::PairDot{}(b.x, b.y, d0, d1);
    }
  }
  for (int o = 16; o > 0; o /= 2) s += __shfl_xor_sync(0xffffffff, s, o);
  if (lane == 0) zdz[row] = s * inv_hidden;
}

__device__ __forceinline__ float warp_sum(float v) {
  for (int o = 16; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffff, v, o);
  return v;
}

// B3q: a warp per row (rows strided over the grid), its lanes over each head's pairs (pair j of a
// head: lane j % 32, slot j / 32; head_dim <= 128 gives at most two slots). Each lane keeps its
// pairs' dγ sums in registers over all its rows and heads; the block adds its warps' in a fixed
// order and writes one partial row.
constexpr int kQkWarps = 8;
constexpr int kQkSlots = 2;
constexpr int kQkMaxBlocks = 1024;

__global__ void __launch_bounds__(kQkWarps * 32)
    qk_norm_rope_backward_kernel(QkNormBackwardArgs a) {
  __shared__ float sums[kQkWarps][4 * 32 * kQkSlots];  // per warp: 2 · head_dim sums
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, d = a.head_dim, pairs = d / 2;
  const float inv_d = 1.0f / float(d);
  using bf2 = __nv_bfloat162;
  float2 gamma[2][kQkSlots], dg[2][kQkSlots];
  for (int t = 0; t < kQkSlots; ++t) {
    const int j = lane + 32 * t;
    const bool in = j < pairs;
    gamma[0][t] = in ? __bfloat1622float2(reinterpret_cast<const bf2*>(a.q_gamma)[j]) : float2{};
    gamma[1][t] = in ? __bfloat1622float2(reinterpret_cast<const bf2*>(a.k_gamma)[j]) : float2{};
    dg[0][t] = dg[1][t] = float2{0.f, 0.f};
  }
  for (int64_t row = blockIdx.x * int64_t(kQkWarps) + warp; row < a.m;
       row += int64_t(gridDim.x) * kQkWarps) {
    const bf2* u2 = reinterpret_cast<const bf2*>(a.qk_pre + row * a.ld_qk_pre);
    const bf2* dy2 = reinterpret_cast<const bf2*>(a.dy + row * a.ld_dy);
    const bf2* y2 = reinterpret_cast<const bf2*>(a.qkv + row * a.ld_qkv);
    bf2* dz2 = reinterpret_cast<bf2*>(a.dz + row * a.ld_dz);
    const int32_t p = a.pos[row];
    float zdz = 0.f;
    for (int h0 = 0; h0 < a.normed_width; h0 += d) {
      const int kind = h0 < a.q_width ? 0 : 1;
      float2 u[kQkSlots], dyr[kQkSlots];
      float ss = 0.f;
      for (int t = 0; t < kQkSlots; ++t) {
        const int j = lane + 32 * t, pair = h0 / 2 + j;
        u[t] = dyr[t] = float2{0.f, 0.f};
        if (j >= pairs) continue;
        u[t] = __bfloat1622float2(u2[pair]);
        const float2 g = __bfloat1622float2(dy2[pair]);
        float c, sn;
        const int col = 2 * pair;
        programs::rope_cos_sin<float>(p, programs::RopeFrequency{a.freq_hi[col], a.freq_lo[col]}, c,
                                      sn);
        epilogue::RopeRotateTranspose{}(g.x, g.y, c, sn, dyr[t].x, dyr[t].y);
        ss += epilogue::Square{}(u[t].x) + epilogue::Square{}(u[t].y);
      }
      const float s = programs::Rstd{}(warp_sum(ss), inv_d, a.eps);
      // The registers of this head's kind, chosen by value (an index by the run-time kind would
      // put the arrays on the stack).
      float2 g[kQkSlots];
      float dn_n = 0.f;  // Σ γ ⊙ dy' ⊙ n over the head
      for (int t = 0; t < kQkSlots; ++t) {
        g[t] = kind == 0 ? gamma[0][t] : gamma[1][t];
        const float n0 = u[t].x * s, n1 = u[t].y * s;
        const float2 add{dyr[t].x * n0, dyr[t].y * n1};
        if (kind == 0) {
          dg[0][t].x += add.x;
          dg[0][t].y += add.y;
        } else {
          dg[1][t].x += add.x;
          dg[1][t].y += add.y;
        }
        dn_n += g[t].x * dyr[t].x * n0 + g[t].y * dyr[t].y * n1;
      }
      const float mean_dn_n = warp_sum(dn_n) * inv_d;
      for (int t = 0; t < kQkSlots; ++t) {
        const int j = lane + 32 * t;
        if (j >= pairs) continue;
        const float du0 = s * (g[t].x * dyr[t].x - u[t].x * s * mean_dn_n);
        const float du1 = s * (g[t].y * dyr[t].y - u[t].y * s * mean_dn_n);
        dz2[h0 / 2 + j] = __floats2bfloat162_rn(du0, du1);
        zdz += programs::PairDot{}(u[t].x, u[t].y, du0, du1);
      }
    }
    for (int64_t j = a.normed_width / 2 + lane; j < a.width / 2; j += 32) {  // V: dz = dy
      const bf2 g = dy2[j];
      const float2 y = __bfloat1622float2(y2[j]), gf = __bfloat1622float2(g);
      dz2[j] = g;
      zdz += programs::PairDot{}(y.x, y.y, gf.x, gf.y);
    }
    zdz = warp_sum(zdz);
    if (lane == 0) a.zdz[row] = zdz * a.inv_hidden;
  }
#pragma unroll
  for (int kind = 0; kind < 2; ++kind)
#pragma unroll
    for (int t = 0; t < kQkSlots; ++t) {
      const int j = lane + 32 * t;
      if (j >= pairs) continue;
      sums[warp][kind * d + 2 * j] = dg[kind][t].x;
      sums[warp][kind * d + 2 * j + 1] = dg[kind][t].y;
    }
  __syncthreads();
  for (int i = threadIdx.x; i < 2 * d; i += blockDim.x) {
    float total = 0.f;
    for (int w = 0; w < kQkWarps; ++w) total += sums[w][i];
    a.dgamma_partials[blockIdx.x * int64_t(2 * d) + i] = total;
  }
}

// A token's loss from its lse: 0 when ignored, NaN for a target that is neither ignored nor in
// [0, vocab) (an invalid target must not pass silently), else lse − ℓ_target + z_loss·lse².
__device__ float target_loss(float l, int64_t target, int64_t ignore_index, int64_t vocab,
                             float target_logit, float z_loss) {
  if (target == ignore_index) return 0.f;
  if (target < 0 || target >= vocab) return __int_as_float(0x7fc00000);
  return programs::TokenLoss{}(l, target_logit, z_loss);
}

// Σ v over the block, returned to every thread (warp shuffles, then the warps' sums in a fixed
// order, so every thread gets the same bits). Every thread of the block must call it.
__device__ float block_sum(float v) {
  __shared__ float warp_sums[32];
  for (int o = 16; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffff, v, o);
  __syncthreads();  // warp_sums may still be read by a previous call
  if (threadIdx.x % 32 == 0) warp_sums[threadIdx.x / 32] = v;
  __syncthreads();
  float t = 0.f;
  for (unsigned w = 0; w < blockDim.x / 32; ++w) t += warp_sums[w];
  return t;
}

__global__ void fold_lse_loss_kernel(const float* max_partials, const float* sum_partials,
                                     int64_t m, int64_t rows_padded, int64_t tiles,
                                     const float* target_logit, const int64_t* targets,
                                     int64_t vocab, int64_t ignore_index, float z_loss, float* lse,
                                     float* token_loss) {
  const int64_t row = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (row >= m) return;
  epilogue::OnlineMaxSumExp<float> s;
  for (int64_t t = 0; t < tiles; ++t) {
    const int64_t i = row + rows_padded * t;
    s = epilogue::OnlineMaxSumExp<float>::merge(s, {max_partials[i], sum_partials[i]});
  }
  const float l = s.logsumexp();
  lse[row] = l;
  const int64_t target = targets[row];
  token_loss[row] = target_loss(l, target, ignore_index, vocab,
                                target >= 0 && target < vocab ? target_logit[row] : 0.f, z_loss);
}

// Columns (2j, 2j + 1) of a row as one 32-bit load, or column 2j alone (y = 0) where it is an
// odd vocabulary's last.
__device__ float2 load_pair(const __nv_bfloat162* p, bool pair) {
  if (pair) return __bfloat1622float2(*p);
  return make_float2(__bfloat162float(*reinterpret_cast<const bf16*>(p)), 0.f);
}

// One row of B4 in place, by the whole block (rows are long: a vocabulary; pairs of columns as
// one 32-bit access): ℓ = row_scale·v for the row's bf16 values v (1 when
// they are the logits themselves), except the target column's ℓ = target_logit (fp32: at
// |ℓ| ≈ 20-30 the bf16 step moves p_target by up to ~6%, and p_target − 1 far more, relatively);
// dℓ = (exp(ℓ − lse)·(1 + 2·z_loss·lse) − [n == target])·sc written over v, *zdz = Σ ℓ·dℓ ·
// inv_hidden.
__device__ void cross_entropy_grad_row(__nv_bfloat162* v2, int64_t vocab, float row_scale,
                                       float l, float sc, int64_t target, float target_logit,
                                       float z_loss, float inv_hidden, float* zdz) {
  const programs::CrossEntropyGrad grad;
  float s = 0.f;
  for (int64_t j = threadIdx.x; j < (vocab + 1) / 2; j += blockDim.x) {
    const bool pair = 2 * j + 1 < vocab;  // an odd vocabulary's last column stands alone
    const float2 v = load_pair(v2 + j, pair);
    const bool t0 = 2 * j == target, t1 = 2 * j + 1 == target;
    const float l0 = t0 ? target_logit : row_scale * v.x;
    const float l1 = !pair ? 0.f : t1 ? target_logit : row_scale * v.y;
    const float d0 = grad(l0, l, sc, t0, z_loss), d1 = pair ? grad(l1, l, sc, t1, z_loss) : 0.f;
    s += programs::PairDot{}(l0, l1, d0, d1);
    if (pair)
      v2[j] = __floats2bfloat162_rn(d0, d1);
    else
      reinterpret_cast<bf16*>(v2 + j)[0] = __float2bfloat16_rn(d0);
  }
  s = block_sum(s);
  if (threadIdx.x == 0) *zdz = s * inv_hidden;
}

__global__ void cross_entropy_grad_from_logits_kernel(bf16* logits, int64_t ld, int64_t vocab,
                                                      const float* lse, const float* scale,
                                                      const int64_t* targets,
                                                      const float* target_logit, float z_loss,
                                                      float inv_hidden, float* zdz) {
  const int64_t row = blockIdx.x;
  cross_entropy_grad_row(reinterpret_cast<__nv_bfloat162*>(logits + row * ld), vocab, 1.f,
                         lse[row], scale[row], targets[row], target_logit[row], z_loss,
                         inv_hidden, zdz + row);
}

// One block per row. First the target logit, r·(h·w_target) in fp32 (as F4 takes it from its
// accumulator: H multiply-adds per token), known to every thread; then per-thread online (max, Σexp)
// of ℓ = r·s with that value in the target column (so lse >= ℓ_target, as with exact logits),
// merged across lanes and warps; thread 0 forms lse and the token loss; then dℓ in place over the
// row (read again, mostly from HBM) with the same target column.
__global__ void cross_entropy_from_unscaled_logits_kernel(
    bf16* logits, int64_t ld, int64_t vocab, const bf16* h, const bf16* w, int64_t hidden,
    const float* r, const int64_t* targets, int64_t ignore_index, float z_loss, const float* scale,
    float* lse_out, float* token_loss, float* zdz) {
  using State = epilogue::OnlineMaxSumExp<float>;
  const int64_t row = blockIdx.x;
  const float rr = r[row];
  const int64_t target = targets[row];
  const bool valid = target >= 0 && target < vocab;
  float dot = 0.f;
  if (valid) {
    const __nv_bfloat162* h2 = reinterpret_cast<const __nv_bfloat162*>(h + row * hidden);
    const __nv_bfloat162* w2 = reinterpret_cast<const __nv_bfloat162*>(w + target * hidden);
    for (int64_t k = threadIdx.x; k < hidden / 2; k += blockDim.x) {
      const float2 a = __bfloat1622float2(h2[k]), b = __bfloat1622float2(w2[k]);
      dot += a.x * b.x + a.y * b.y;
    }
  }
  const float target_logit = rr * block_sum(dot);

  __nv_bfloat162* v2 = reinterpret_cast<__nv_bfloat162*>(logits + row * ld);
  State st;
  for (int64_t j = threadIdx.x; j < (vocab + 1) / 2; j += blockDim.x) {
    const bool pair = 2 * j + 1 < vocab;
    const float2 v = load_pair(v2 + j, pair);
    st.add(2 * j == target ? target_logit : rr * v.x);
    if (pair) st.add(2 * j + 1 == target ? target_logit : rr * v.y);
  }
  for (int o = 16; o > 0; o /= 2)
    st = State::merge(st, State{__shfl_xor_sync(0xffffffff, st.max, o),
                                __shfl_xor_sync(0xffffffff, st.sum, o)});
  __shared__ float warp_max[32], warp_sum[32], row_lse;
  if (threadIdx.x % 32 == 0) warp_max[threadIdx.x / 32] = st.max, warp_sum[threadIdx.x / 32] = st.sum;
  __syncthreads();
  if (threadIdx.x == 0) {
    State all;
    for (unsigned i = 0; i < blockDim.x / 32; ++i)
      all = State::merge(all, State{warp_max[i], warp_sum[i]});
    const float l = all.logsumexp();
    lse_out[row] = l;
    row_lse = l;
    token_loss[row] = target_loss(l, target, ignore_index, vocab, target_logit, z_loss);
  }
  __syncthreads();
  cross_entropy_grad_row(v2, vocab, rr, row_lse, scale[row], target, target_logit, z_loss,
                         1.0f / float(hidden), zdz + row);
}

// Eight bf16 per 16-byte access where the pointer allows; the rest one by one.
__global__ void scale_bf16_unless_one_kernel(bf16* p, int64_t n, const float* g) {
  const float s = *g;
  if (s == 1.f) return;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  const int64_t first = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const bool vec = reinterpret_cast<uintptr_t>(p) % 16 == 0;
  const int64_t n8 = vec ? n / 8 : 0;
  uint4* p8 = reinterpret_cast<uint4*>(p);
  for (int64_t i = first; i < n8; i += stride) {
    uint4 v = p8[i];
    __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&v);
    for (int j = 0; j < 4; ++j) {
      const float2 f = __bfloat1622float2(h[j]);
      h[j] = __floats2bfloat162_rn(f.x * s, f.y * s);
    }
    p8[i] = v;
  }
  for (int64_t i = n8 * 8 + first; i < n; i += stride)
    p[i] = __float2bfloat16_rn(__bfloat162float(p[i]) * s);
}

}  // namespace

void scale_bf16_unless_one(bf16* p, int64_t n, const float* g, cudaStream_t stream) {
  CODA_CHECK(p && g, "scale_bf16_unless_one: null pointer");
  if (n <= 0) return;
  const int64_t blocks = std::min<int64_t>((n / 8 + 255) / 256 + 1, 132 * 16);
  scale_bf16_unless_one_kernel<<<unsigned(blocks), 256, 0, stream>>>(p, n, g);
  CODA_CUDA_CHECK(cudaGetLastError());
}

void cross_entropy_grad_from_logits(bf16* logits, int64_t ld, int64_t m, int64_t vocab,
                                    const float* lse, const float* scale, const int64_t* targets,
                                    const float* target_logit, float z_loss, int64_t hidden,
                                    float* zdz, cudaStream_t stream) {
  CODA_CHECK(logits && lse && scale && targets && target_logit && zdz,
             "cross_entropy_grad_from_logits: null pointer");
  CODA_CHECK(
      m > 0 && m < (int64_t(1) << 31) && vocab > 0 && ld >= vocab && ld % 2 == 0 && hidden > 0,
      "cross_entropy_grad_from_logits: bad sizes (m ", m, ", vocab ", vocab, ", ld ", ld,
      ", hidden ", hidden, ")");
  cross_entropy_grad_from_logits_kernel<<<unsigned(m), 256, 0, stream>>>(
      logits, ld, vocab, lse, scale, targets, target_logit, z_loss, 1.0f / float(hidden), zdz);
  CODA_CUDA_CHECK(cudaGetLastError());
}

void cross_entropy_from_unscaled_logits(bf16* logits, int64_t ld, int64_t m, int64_t vocab,
                                        const bf16* h, const bf16* w, int64_t hidden,
                                        const float* r, const int64_t* targets,
                                        int64_t ignore_index, float z_loss, const float* scale,
                                        float* lse, float* token_loss, float* zdz,
                                        cudaStream_t stream) {
  CODA_CHECK(logits && h && w && r && targets && scale && lse && token_loss && zdz,
             "cross_entropy_from_unscaled_logits: null pointer");
  CODA_CHECK(m > 0 && m < (int64_t(1) << 31) && vocab > 0 && ld >= vocab && ld % 2 == 0 &&
                 hidden > 0 && hidden % 2 == 0,
             "cross_entropy_from_unscaled_logits: bad sizes (m ", m, ", vocab ", vocab, ", ld ", ld,
             ", hidden ", hidden, ")");
  cross_entropy_from_unscaled_logits_kernel<<<unsigned(m), 256, 0, stream>>>(
      logits, ld, vocab, h, w, hidden, r, targets, ignore_index, z_loss, scale, lse, token_loss,
      zdz);
  CODA_CUDA_CHECK(cudaGetLastError());
}

void fold_row_sums(const float* partials, int64_t m, int64_t rows_padded, int64_t tiles,
                   float scale, float* out, cudaStream_t stream) {
  CODA_CHECK(partials && out, "fold_row_sums: null pointer (partials or out)");
  CODA_CHECK(m > 0 && tiles > 0 && rows_padded >= m, "fold_row_sums: bad sizes (m ", m,
             ", rows_padded ", rows_padded, ", tiles ", tiles, ")");
  fold_row_sums_kernel<<<unsigned((m + 255) / 256), 256, 0, stream>>>(partials, m, rows_padded,
                                                                      tiles, scale, out);
  CODA_CUDA_CHECK(cudaGetLastError());
}

void fold_column_sums(const float* partials, int64_t n, int64_t cols_padded, int64_t tiles,
                      float* out, cudaStream_t stream) {
  // The same fold with columns in place of rows (partials are column-fastest).
  CODA_CHECK(partials && out, "fold_column_sums: null pointer (partials or out)");
  CODA_CHECK(n > 0 && tiles > 0 && cols_padded >= n, "fold_column_sums: bad sizes (n ", n,
             ", cols_padded ", cols_padded, ", tiles ", tiles, ")");
  fold_row_sums_kernel<<<unsigned((n + 255) / 256), 256, 0, stream>>>(partials, n, cols_padded,
                                                                      tiles, 1.0f, out);
  CODA_CUDA_CHECK(cudaGetLastError());
}

void rope_backward(const bf16* y, const bf16* dy, const bf16* bias, const int32_t* pos,
                   const uint32_t* freq_hi, const uint32_t* freq_lo, int64_t m, int64_t width,
                   int64_t hidden, bf16* dz, float* zdz, cudaStream_t stream) {
  CODA_CHECK(y && dy && pos && freq_hi && freq_lo && dz && zdz,
             "rope_backward: null pointer argument");
  CODA_CHECK(m > 0 && width > 0 && width % 2 == 0 && hidden > 0,
             "rope_backward: need m > 0, an even width and hidden > 0, got m ", m, ", width ",
             width, ", hidden ", hidden);
  // Pairs move as 32-bit words: with an even width every row then starts 4-byte aligned.
  for (const auto& [name, p] :
       {std::pair<const char*, const void*>{"y", y}, {"dy", dy}, {"dz", dz}, {"bias", bias}})
    CODA_CHECK(reinterpret_cast<uintptr_t>(p) % 4 == 0, "rope_backward: ", name,
               " must be 4-byte aligned (bf16 pairs move as 32-bit words), got address ", p);
  const int warps = 8;
  rope_backward_kernel<<<unsigned((m + warps - 1) / warps), warps * 32, 0, stream>>>(
      y, dy, bias, pos, freq_hi, freq_lo, m, width, 1.0f / float(hidden), dz, zdz);
  CODA_CUDA_CHECK(cudaGetLastError());
}

int64_t qk_norm_backward_blocks(int64_t m) {
  const int64_t blocks = (m + kQkWarps - 1) / kQkWarps;
  return blocks < kQkMaxBlocks ? blocks : kQkMaxBlocks;
}

void qk_norm_rope_backward(const QkNormBackwardArgs& a, cudaStream_t stream) {
  CODA_CHECK(a.qk_pre && a.qkv && a.dy && a.q_gamma && a.k_gamma && a.pos && a.freq_hi &&
                 a.freq_lo && a.dz && a.zdz && a.dgamma_partials,
             "qk_norm_rope_backward: null pointer argument");
  const int d = a.head_dim;
  CODA_CHECK(a.m > 0 && d > 0 && d % 2 == 0 && d <= 64 * kQkSlots && a.q_width % d == 0 &&
                 a.normed_width % d == 0 && a.normed_width > a.q_width &&
                 a.width > a.normed_width && a.width % 2 == 0,
             "qk_norm_rope_backward: bad geometry (M ", a.m, ", head_dim ", d, ", q_width ",
             a.q_width, ", normed_width ", a.normed_width, ", width ", a.width, ")");
  // Pairs move as 32-bit words.
  for (const auto& [name, p, ld] :
       {std::tuple<const char*, const void*, int64_t>{"qk_pre", a.qk_pre, a.ld_qk_pre},
        {"qkv", a.qkv, a.ld_qkv},
        {"dy", a.dy, a.ld_dy},
        {"dz", a.dz, a.ld_dz},
        {"q_gamma", a.q_gamma, 0},
        {"k_gamma", a.k_gamma, 0}})
    CODA_CHECK(reinterpret_cast<uintptr_t>(p) % 4 == 0 && ld % 2 == 0,
               "qk_norm_rope_backward: ", name,
               " must be 4-byte aligned with an even row stride, got address ", p, " stride ", ld);
  const unsigned blocks = unsigned(qk_norm_backward_blocks(a.m));
  qk_norm_rope_backward_kernel<<<blocks, kQkWarps * 32, 0, stream>>>(a);
  CODA_CUDA_CHECK(cudaGetLastError());
}

void fold_rstd(const float* partials, int64_t m, int64_t rows_padded, int64_t tiles, int64_t hidden,
               float eps, float* r, cudaStream_t stream) {
  CODA_CHECK(partials && r, "fold_rstd: null pointer (partials or r)");
  CODA_CHECK(m > 0 && tiles > 0 && hidden > 0 && rows_padded >= m, "fold_rstd: bad sizes (m ", m,
             ", rows_padded ", rows_padded, ", tiles ", tiles, ", hidden ", hidden, ")");
  const int threads = 256;
  fold_rstd_kernel<<<unsigned((m + threads - 1) / threads), threads, 0, stream>>>(
      partials, m, rows_padded, tiles, 1.0f / float(hidden), eps, r);
  CODA_CUDA_CHECK(cudaGetLastError());
}

void first_layer_rmsnorm(const bf16* x, const bf16* gamma, int64_t m, int64_t hidden, float eps,
                         bf16* h, float* r, cudaStream_t stream) {
  CODA_CHECK(x && gamma && h && r, "first_layer_rmsnorm: null pointer (x, gamma, h or r)");
  CODA_CHECK(m > 0 && hidden > 0 && hidden % 8 == 0,
             "first_layer_rmsnorm: need m > 0 and hidden a positive multiple of 8, got m ", m,
             ", hidden ", hidden);
  const int warps = 8;
  first_layer_rmsnorm_kernel<<<unsigned((m + warps - 1) / warps), warps * 32, 0, stream>>>(
      x, gamma, m, hidden, eps, h, r);
  CODA_CUDA_CHECK(cudaGetLastError());
}

void fill_uniform_bf16(bf16* p, size_t n, uint64_t seed, float lo, float hi, cudaStream_t stream) {
  CODA_CHECK(p != nullptr || n == 0, "fill_uniform_bf16: p is null");
  if (n == 0) return;
  fill_uniform_kernel<<<1024, 256, 0, stream>>>(p, n, seed, lo, hi);
  CODA_CUDA_CHECK(cudaGetLastError());
}

void max_abs_diff_bf16(const bf16* a, const bf16* b, size_t n, float* out, cudaStream_t stream) {
  CODA_CHECK(a && b && out, "max_abs_diff_bf16: null pointer argument");
  CODA_CUDA_CHECK(cudaMemsetAsync(out, 0, 2 * sizeof(float), stream));
  if (n == 0) return;
  max_abs_diff_kernel<<<1024, 256, 0, stream>>>(a, b, n, out);
  CODA_CUDA_CHECK(cudaGetLastError());
}

void fold_lse_loss(const float* max_partials, const float* sum_partials, int64_t m,
                   int64_t rows_padded, int64_t tiles, const float* target_logit,
                   const int64_t* targets, int64_t vocab, int64_t ignore_index, float z_loss,
                   float* lse, float* token_loss, cudaStream_t stream) {
  CODA_CHECK(max_partials && sum_partials && target_logit && targets && lse && token_loss,
             "fold_lse_loss: null pointer argument");
  CODA_CHECK(m > 0 && tiles > 0 && rows_padded >= m && vocab > 0, "fold_lse_loss: bad sizes (m ",
             m, ", rows_padded ", rows_padded, ", tiles ", tiles, ", vocab ", vocab, ")");
  fold_lse_loss_kernel<<<unsigned((m + 255) / 256), 256, 0, stream>>>(
      max_partials, sum_partials, m, rows_padded, tiles, target_logit, targets, vocab,
      ignore_index, z_loss, lse, token_loss);
  CODA_CUDA_CHECK(cudaGetLastError());
}

}  // namespace coda::kernel
