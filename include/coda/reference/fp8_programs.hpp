#pragma once
// The FP8 programs on the host: the epilogue programs of programs/ over the blockwise GEMM of
// reference/fp8.hpp, the oracle of the quantizing GPU programs (kernel/fusions/*_fp8.cuh). Kept
// apart from fp8.hpp, whose recipe CUDA translation units include too.

#include <algorithm>
#include <cstdint>
#include <vector>

#include "coda/common/check.hpp"
#include "coda/programs/backward.hpp"
#include "coda/programs/forward.hpp"
#include "coda/reference/executor.hpp"
#include "coda/reference/fp8.hpp"

namespace coda::reference {

// The 128x128 tiles of the FP8 programs' cooperative kernels (their partial buffers' layout).
inline TileConfig fp8_tiles() { return {128, 128, 64, 32}; }

// Runs `program` on the GEMM of the dequantized operands a (M, K) and b (N, K), in Real, over
// fp8_tiles().
template <class Real, class Program>
void execute_fp8(const BlockQuantized& a, const BlockQuantized& b, Program& program) {
  const std::vector<double> da = a.dequantized(), db = b.dequantized();
  execute<Real>(MatrixRef<double>::row_major(da.data(), a.rows, a.cols),
                MatrixRef<double>::row_major(db.data(), b.rows, b.cols), program, fp8_tiles());
}

// F1 over FP8 operands (Program::kResidualRmsnormFp8), in Real: the bf16 program's functors
// (programs::ResidualRmsnormPartial) over 128x128 tiles on the GEMM of the dequantized operands
// (the blockwise GEMM up to the rounding of Real's sums, see above).
// x = a · wᵀ + residual, h = x ⊙ γ, partials = Σx² per (row, 128-column tile) in
// PartialLayout::per_row(M, N, 128, 128), padding rows 0. The caller rounds h to the activation
// type and quantizes it (quantize_blockwise), as the epilogue does. residual (M, N) and gamma (N)
// row-major.
template <class Real>
struct Fp8ResidualRmsnorm {
  std::vector<Real> x, h, partials;
  epilogue::PartialLayout layout;
};
template <class Real>
Fp8ResidualRmsnorm<Real> fp8_residual_rmsnorm(const BlockQuantized& a, const BlockQuantized& w,
                                              const std::vector<Real>& residual,
                                              const std::vector<Real>& gamma) {
  const int64_t m = a.rows, n = w.rows;
  CODA_CHECK(int64_t(residual.size()) == m * n && int64_t(gamma.size()) == n,
             "fp8_residual_rmsnorm: residual must be (", m, ", ", n, ") and gamma (", n, "), got ",
             residual.size(), " and ", gamma.size(), " elements");
  Fp8ResidualRmsnorm<Real> out;
  out.x.resize(size_t(m * n));
  out.h.resize(size_t(m * n));
  out.layout = epilogue::PartialLayout::per_row(m, n, fp8_tiles().tile_m, fp8_tiles().tile_n);
  out.partials.assign(size_t(out.layout.tiles * out.layout.extent), Real(0));
  programs::ResidualRmsnormPartial<Real> p;
  p.residual = {residual.data(), m, n, n};
  p.gamma = {gamma.data(), n};
  p.x = {out.x.data(), m, n, n, epilogue::StoreMode::kOverwrite};
  p.h = {out.h.data(), m, n, n, epilogue::StoreMode::kOverwrite};
  p.partials = out.partials.data();
  p.layout = out.layout;
  execute_fp8<Real>(a, w, p);
  return out;
}

// F2 over FP8 operands (Program::kRmsnormSwigluFp8), in Real: z = r ⊙ (h · w_guᵀ) (M, 2I),
// a = silu(z_g) · z_u (M, I) from the unrounded z (programs::RmsnormSwiglu). The caller rounds
// a to the activation type and quantizes it (quantize_blockwise), as the epilogue does.
template <class Real>
struct Fp8RmsnormSwiglu {
  std::vector<Real> z, a;
};
template <class Real>
Fp8RmsnormSwiglu<Real> fp8_rmsnorm_swiglu(const BlockQuantized& h, const BlockQuantized& w_gu,
                                          const std::vector<Real>& r) {
  const int64_t m = h.rows, two_i = w_gu.rows;
  CODA_CHECK(int64_t(r.size()) == m, "fp8_rmsnorm_swiglu: r must have ", m, " entries, got ",
             r.size());
  Fp8RmsnormSwiglu<Real> out;
  out.z.resize(size_t(m * two_i));
  out.a.resize(size_t(m * two_i / 2));
  programs::RmsnormSwiglu<Real> p;
  p.r = {r.data(), m};
  p.z = {out.z.data(), m, two_i, two_i};
  p.a = {out.a.data(), m, two_i / 2, two_i / 2};
  execute_fp8<Real>(h, w_gu, p);
  return out;
}

// F3 over FP8 operands (Program::kRmsnormRope on Operands::kFp8XWt), in Real: qkv = rope(r ⊙
// (h · w_qkvᵀ) + bias) (programs::RmsnormRope; bias empty for none, freq the column table).
template <class Real>
std::vector<Real> fp8_rmsnorm_rope(const BlockQuantized& h, const BlockQuantized& w_qkv,
                                   const std::vector<Real>& r, const std::vector<Real>& bias,
                                   const std::vector<int32_t>& pos,
                                   const std::vector<programs::RopeFrequency>& freq) {
  const int64_t m = h.rows, n = w_qkv.rows;
  CODA_CHECK(int64_t(r.size()) == m && int64_t(pos.size()) == m && int64_t(freq.size()) == n &&
                 (bias.empty() || int64_t(bias.size()) == n),
             "fp8_rmsnorm_rope: r and pos must have ", m, " entries, freq (and bias, if any) ", n);
  std::vector<Real> qkv(size_t(m * n));
  programs::RmsnormRope<Real> p;
  p.r = {r.data(), m};
  p.bias = {bias.empty() ? nullptr : bias.data(), int64_t(bias.size())};
  p.pos = {pos.data(), m};
  p.freq = {freq.data(), n};
  p.qkv = {qkv.data(), m, n, n};
  execute_fp8<Real>(h, w_qkv, p);
  return qkv;
}

// F3q over FP8 operands (Program::kRmsnormQkNormRope on Operands::kFp8XWt), in Real: qkv =
// rope(qk_norm(r ⊙ (h · w_qkvᵀ))) on the Q and K heads and qk_pre, their columns before the norm
// (programs::RmsnormQkNormRope, each head inside one epilogue subtile, as on the device).
template <class Real>
struct Fp8RmsnormQkNormRope {
  std::vector<Real> qkv, qk_pre;
};
template <class Real>
Fp8RmsnormQkNormRope<Real> fp8_rmsnorm_qk_norm_rope(
    const BlockQuantized& h, const BlockQuantized& w_qkv, const std::vector<Real>& r,
    const std::vector<Real>& q_gamma, const std::vector<Real>& k_gamma, const programs::QkNorm& qk,
    const std::vector<int32_t>& pos, const std::vector<programs::RopeFrequency>& freq) {
  const int64_t m = h.rows, n = w_qkv.rows, normed = qk.normed_width();
  const int d = qk.layout.head_dim;
  Fp8RmsnormQkNormRope<Real> out{std::vector<Real>(size_t(m * n)),
                                 std::vector<Real>(size_t(m * normed))};
  programs::RmsnormQkNormRope<Real> p;
  p.r = {r.data(), int64_t(r.size())};
  p.q_gamma = {q_gamma.data(), int64_t(q_gamma.size())};
  p.k_gamma = {k_gamma.data(), int64_t(k_gamma.size())};
  p.qk = qk;
  p.pos = {pos.data(), int64_t(pos.size())};
  p.freq = {freq.data(), int64_t(freq.size())};
  p.qkv = {out.qkv.data(), m, n, n};
  p.qk_pre = {out.qk_pre.data(), m, normed, normed};
  TileConfig cfg = fp8_tiles();
  cfg.tile_n = d * std::max(1, cfg.tile_n / d);
  cfg.subtile_n = d;
  const std::vector<double> dh = h.dequantized(), dw = w_qkv.dequantized();
  execute<Real>(MatrixRef<double>::row_major(dh.data(), h.rows, h.cols),
                MatrixRef<double>::row_major(dw.data(), w_qkv.rows, w_qkv.cols), p, cfg);
  return out;
}

// B1 over FP8 operands (Program::kRmsnormBackwardFp8), in Real: g = dz · W from dz (M, K) and
// w_t = Wᵀ (H, K); dx = dres + r·(g·γ − x·r·ZdZ) (M, H) (dres empty: none), h = x·r·γ (M, H)
// and the dγ partials,
// PartialLayout::per_column(M, H, 128, 128) (programs::RmsnormBackward). The caller rounds h and
// quantizes its transposed copy, as the epilogue does.
template <class Real>
struct Fp8RmsnormBackward {
  std::vector<Real> dx, h, dgamma_partials;
  epilogue::PartialLayout layout;
};
template <class Real>
Fp8RmsnormBackward<Real> fp8_rmsnorm_backward(const BlockQuantized& dz, const BlockQuantized& w_t,
                                              const std::vector<Real>& x,
                                              const std::vector<Real>& r,
                                              const std::vector<Real>& gamma,
                                              const std::vector<Real>& zdz,
                                              const std::vector<Real>& dres) {
  const int64_t m = dz.rows, hid = w_t.rows;
  const bool accumulate = !dres.empty();  // empty: no residual gradient
  CODA_CHECK(int64_t(x.size()) == m * hid && (!accumulate || int64_t(dres.size()) == m * hid) &&
                 int64_t(r.size()) == m && int64_t(zdz.size()) == m && int64_t(gamma.size()) == hid,
             "fp8_rmsnorm_backward: x and dres must be (", m, ", ", hid, "), r and zdz (", m,
             "), gamma (", hid, ")");
  Fp8RmsnormBackward<Real> out;
  out.dx = accumulate ? dres : std::vector<Real>(size_t(m * hid));  // accumulated into
  out.h.resize(size_t(m * hid));
  out.layout = epilogue::PartialLayout::per_column(m, hid, fp8_tiles().tile_m, fp8_tiles().tile_n);
  out.dgamma_partials.assign(size_t(out.layout.tiles * out.layout.extent), Real(0));
  programs::RmsnormBackward<Real> p;
  p.x = {x.data(), m, hid, hid};
  p.r = {r.data(), m};
  p.gamma = {gamma.data(), hid};
  p.zdz = {zdz.data(), m};
  p.dx = {out.dx.data(), m, hid, hid,
          accumulate ? epilogue::StoreMode::kAccumulate : epilogue::StoreMode::kOverwrite};
  p.h_out = {out.h.data(), m, hid, hid, epilogue::StoreMode::kOverwrite};
  p.dgamma_partials = out.dgamma_partials.data();
  p.layout = out.layout;
  execute_fp8<Real>(dz, w_t, p);
  return out;
}

// B2 over FP8 operands (Program::kSwigluBackwardFp8), in Real: da = dx_out · W_down from dx_out
// (M, H) and w_down_t = W_downᵀ (I, H); with z (M, 2I) interleaved, dz (M, 2I) and the ZdZ
// partials Σ g·dg + u·du, PartialLayout::per_row(M, I, 128, 128) (programs::SwigluBackward; its
// a is dropped). The caller rounds dz and quantizes it, as the epilogue does.
template <class Real>
struct Fp8SwigluBackward {
  std::vector<Real> dz, zdz_partials;
  epilogue::PartialLayout layout;
};
template <class Real>
Fp8SwigluBackward<Real> fp8_swiglu_backward(const BlockQuantized& dx_out,
                                            const BlockQuantized& w_down_t,
                                            const std::vector<Real>& z) {
  const int64_t m = dx_out.rows, inter = w_down_t.rows;
  CODA_CHECK(int64_t(z.size()) == m * 2 * inter, "fp8_swiglu_backward: z must be (", m, ", ",
             2 * inter, "), got ", z.size(), " elements");
  Fp8SwigluBackward<Real> out;
  out.dz.resize(size_t(m * 2 * inter));
  out.layout = epilogue::PartialLayout::per_row(m, inter, fp8_tiles().tile_m, fp8_tiles().tile_n);
  out.zdz_partials.assign(size_t(out.layout.tiles * out.layout.extent), Real(0));
  std::vector<Real> a(size_t(m * inter));
  programs::SwigluBackward<Real> p;
  p.z = {z.data(), m, 2 * inter, 2 * inter};
  p.dz = {out.dz.data(), m, 2 * inter, 2 * inter};
  p.a = {a.data(), m, inter, inter};
  p.partials = out.zdz_partials.data();
  p.layout = out.layout;
  execute_fp8<Real>(dx_out, w_down_t, p);
  return out;
}

}  // namespace coda::reference
