// The backward-pass kernels against the CPU reference executor: the plain GEMM in the transposed
// operand layouts (D = dz · W and D = Xᵀ · Y) and B1, the RMSNorm backward in the epilogue of
// g = dz · W (tile load of x, accumulate-into store of dx, aux store of h_out, per-column dγ
// partials). Same rules as gemm_programs_test: poisoned outputs, ragged shapes, OPS.md §5.

#include <gtest/gtest.h>

#include "coda/programs/backward.hpp"
#include "support/gpu_check.hpp"

namespace coda::kernel {
namespace {

const Shape kShapes[] = {
    {1, 200, 136}, {19, 8, 8}, {111, 200, 136}, {4097, 200, 136}, {111, 1032, 520}};

V round_all(const V& v) {
  V o(v.size());
  for (size_t i = 0; i < v.size(); ++i) o[i] = round_bf16(v[i]);
  return o;
}

TEST_F(GpuKernelTest, PlainGemmWithUntransposedWeightMatchesReference) {  // D = X · W
  const auto configs = compiled_configs(Program::kPlain, Operands::kXW);
  ASSERT_FALSE(configs.empty());
  testing::Rng rng(21);
  for (Config c : configs)
    for (const Shape& s : kShapes) {
      if (skip_large(s)) continue;
      const V x = testing::bf16_uniform(size_t(s.m) * s.k, -1, 1, rng);
      const V w = testing::bf16_uniform(size_t(s.k) * s.n, -1, 1, rng);  // (K, N) row-major
      auto dx = upload_bf16(x), dw = upload_bf16(w);
      DeviceBuffer<bf16> d(size_t(s.m) * s.n);
      d.poison();
      PlainArgs args;
      run(Program::kPlain, c,
          {s.m, s.n, s.k, dx.get(), s.k, dw.get(), s.n, nullptr, 0, d.get(), s.n}, &args,
          Operands::kXW);
      const V ref = reference::gemm<double>(MatrixRef<double>::row_major(x.data(), s.m, s.k),
                                            MatrixRef<double>::transposed(w.data(), s.n, s.k));
      expect_rule("X*W " + label(c, s), download_bf16(d), ref, round_all(ref));
    }
}

TEST_F(GpuKernelTest, PlainGemmTransposedActivationMatchesReference) {  // D = Xᵀ · Y
  const auto configs = compiled_configs(Program::kPlain, Operands::kXtY);
  ASSERT_FALSE(configs.empty());
  testing::Rng rng(22);
  // Weight-gradient shapes: D (M, N) = Xᵀ (M, K) · Y (K, N), X (K, M) and Y (K, N) row-major; K
  // plays the tokens and is ragged; M and N (feature sizes) are multiples of 8 as TMA requires.
  const Shape shapes[] = {
      {200, 136, 1}, {8, 8, 19}, {200, 136, 111}, {136, 200, 4097}, {1032, 520, 111}};
  for (Config c : configs)
    for (const Shape& s : shapes) {
      if (skip_large(s)) continue;
      const V x = testing::bf16_uniform(size_t(s.k) * s.m, -1, 1, rng);
      const V y = testing::bf16_uniform(size_t(s.k) * s.n, -1, 1, rng);
      auto dx = upload_bf16(x), dy = upload_bf16(y);
      DeviceBuffer<bf16> d(size_t(s.m) * s.n);
      d.poison();
      PlainArgs args;
      run(Program::kPlain, c,
          {s.m, s.n, s.k, dx.get(), s.m, dy.get(), s.n, nullptr, 0, d.get(), s.n}, &args,
          Operands::kXtY);
      const V ref = reference::gemm<double>(MatrixRef<double>::transposed(x.data(), s.m, s.k),
                                            MatrixRef<double>::transposed(y.data(), s.n, s.k));
      expect_rule("X^T*Y " + label(c, s), download_bf16(d), ref, round_all(ref));
    }
}

void check_rmsnorm_backward(bool in_place) {
  const auto configs = compiled_configs(Program::kRmsnormBackward, Operands::kXW);
  ASSERT_FALSE(configs.empty());
  testing::Rng rng(in_place ? 24 : 23);
  for (Config c : configs)
    for (const Shape& s : kShapes) {
      if (skip_large(s)) continue;
      // g (M, H) = dz (M, Nout) · W (Nout, H): GEMM N = H, K = Nout.
      const int M = s.m, H = s.n, Nout = s.k;
      const size_t mh = size_t(M) * H;
      const V dz = testing::bf16_uniform(size_t(M) * Nout, -1, 1, rng);
      const V w = testing::bf16_uniform(size_t(Nout) * H, -0.3, 0.3, rng);
      const V x = testing::bf16_uniform(mh, -2, 2, rng);
      const V dres = testing::bf16_uniform(mh, -1, 1, rng);
      const V gamma = testing::bf16_uniform(H, 0.5, 1.5, rng);
      std::vector<float> r(M), zdz(M);
      for (int i = 0; i < M; ++i) {
        r[i] = static_cast<float>(rng.uniform(0.3, 2));
        zdz[i] = static_cast<float>(rng.uniform(-0.5, 0.5));
      }
      const auto tiles = reference_tiles(c);
      const auto layout = epilogue::PartialLayout::per_column(M, H, tiles.tile_m, tiles.tile_n);
      auto ddz = upload_bf16(dz), dw = upload_bf16(w), dxs = upload_bf16(x),
           dg = upload_bf16(gamma);
      auto ddres = upload_bf16(dres);
      DeviceBuffer<float> dr(r), dzdz(zdz), dpart(layout.elements());
      DeviceBuffer<bf16> ddx(in_place ? 0 : mh), dh(mh);
      if (!in_place) ddx.poison();
      dh.poison();
      dpart.poison();
      bf16* out = in_place ? ddres.get() : ddx.get();
      RmsnormBackwardArgs args{dxs.get(),  H,        dr.get(), dg.get(),
                               dzdz.get(), dh.get(), H,        dpart.get()};
      run(Program::kRmsnormBackward, c,
          {M, H, Nout, ddz.get(), Nout, dw.get(), H, ddres.get(), H, out, H}, &args, Operands::kXW);

      const V rd(r.begin(), r.end()), zd(zdz.begin(), zdz.end());
      programs::RmsnormBackward<double> p;
      V dx = dres, h(mh), part(layout.elements(), 0.0);
      p.x = {x.data(), M, H, H};
      p.r = {rd.data(), M};
      p.gamma = {gamma.data(), H};
      p.zdz = {zd.data(), M};
      p.dx = {dx.data(), M, H, H, epilogue::StoreMode::kAccumulate};
      p.h_out = {h.data(), M, H, H};
      p.dgamma_partials = part.data();
      p.layout = layout;
      reference::execute<double>(MatrixRef<double>::row_major(dz.data(), M, Nout),
                                 MatrixRef<double>::transposed(w.data(), H, Nout), p, tiles);
      // PyTorch: g = bf16(dz W); the RMSNorm backward in fp32 from bf16 tensors, rounded once, then
      // the residual add rounded; h = bf16(bf16(x r) γ); dγ = Σ g · bf16(x r) in fp32.
      const V g = reference::gemm<double>(MatrixRef<double>::row_major(dz.data(), M, Nout),
                                          MatrixRef<double>::transposed(w.data(), H, Nout));
      V dx_pt(mh), h_pt(mh), part_pt(layout.elements(), 0.0);
      for (int i = 0; i < M; ++i)
        for (int j = 0; j < H; ++j) {
          const size_t e = size_t(i) * H + j;
          const double gb = round_bf16(g[e]), nb = round_bf16(x[e] * rd[i]);
          dx_pt[e] =
              round_bf16(dres[e] + round_bf16(rd[i] * (gb * gamma[j] - x[e] * rd[i] * zd[i])));
          h_pt[e] = round_bf16(nb * gamma[j]);
          part_pt[layout.index(j, i / tiles.tile_m)] += gb * nb;
        }
      // Only columns < H of the padded partial buffer are defined outputs.
      V part_gpu(layout.elements()), part_ref = part;
      const auto raw = dpart.download();
      for (size_t i = 0; i < raw.size(); ++i) part_gpu[i] = raw[i];
      for (int64_t t = 0; t < layout.tiles; ++t)
        for (int64_t j = H; j < layout.extent; ++j)
          part_gpu[layout.index(j, t)] = part_ref[layout.index(j, t)] =
              part_pt[layout.index(j, t)] = 0;
      const std::string l = std::string(in_place ? "in-place " : "") + label(c, s);
      expect_rule("B1 dx " + l, download_bf16(in_place ? ddres : ddx), dx, dx_pt);
      expect_rule("B1 h_out " + l, download_bf16(dh), h, h_pt);
      expect_rule("B1 dgamma partials " + l, part_gpu, part_ref, part_pt);
    }
}

TEST_F(GpuKernelTest, RmsnormBackwardMatchesReference) { check_rmsnorm_backward(false); }
TEST_F(GpuKernelTest, RmsnormBackwardAccumulatesInPlaceIntoResidualGradient) {
  check_rmsnorm_backward(true);
}

}  // namespace
}  // namespace coda::kernel
