#pragma once
// The FP8 programs on the host: the epilogue programs of programs/ over the blockwise GEMM of
// reference/fp8.hpp, the oracle of the quantizing GPU programs (kernel/fusions/*_fp8.cuh). Kept
// apart from fp8.hpp, whose recipe CUDA translation units include too.

#include <cstdint>
#include <vector>

#include "coda/common/check.hpp"
#include "coda/programs/forward.hpp"
#include "coda/reference/executor.hpp"
#include "coda/reference/fp8.hpp"

namespace coda::reference {

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
  const TileConfig tiles{128, 128, 64, 32};
  Fp8ResidualRmsnorm<Real> out;
  out.x.resize(size_t(m * n));
  out.h.resize(size_t(m * n));
  out.layout = epilogue::PartialLayout::per_row(m, n, tiles.tile_m, tiles.tile_n);
  out.partials.assign(size_t(out.layout.tiles * out.layout.extent), Real(0));
  const std::vector<double> da = a.dequantized(), dw = w.dequantized();
  programs::ResidualRmsnormPartial<Real> p;
  p.residual = {residual.data(), m, n, n};
  p.gamma = {gamma.data(), n};
  p.x = {out.x.data(), m, n, n, epilogue::StoreMode::kOverwrite};
  p.h = {out.h.data(), m, n, n, epilogue::StoreMode::kOverwrite};
  p.partials = out.partials.data();
  p.layout = out.layout;
  execute<Real>(MatrixRef<double>::row_major(da.data(), m, a.cols),
                MatrixRef<double>::row_major(dw.data(), n, w.cols), p, tiles);
  return out;
}

}  // namespace coda::reference
