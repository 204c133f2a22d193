// The backward-pass kernels against the CPU reference executor: the plain GEMM in the transposed
// operand layouts (D = dz · W and D = Xᵀ · Y) and B1, the RMSNorm backward in the epilogue of
// g = dz · W (tile load of x, accumulate-into store of dx, aux store of h_out, per-column dγ
// partials). Same rules as gemm_programs_test: poisoned outputs, ragged shapes, docs/math.md §5.

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <iterator>
#include <vector>

#include "coda/kernel/aux_kernels.hpp"
#include "coda/ops.hpp"
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
      run<Program::kPlain>(c,
          {s.m, s.n, s.k, dx.get(), s.k, dw.get(), s.n, nullptr, 0, d.get(), s.n}, args,
          Operands::kXW);
      const V ref = reference::gemm<double>(MatrixRef<double>::row_major(x.data(), s.m, s.k),
                                            MatrixRef<double>::transposed(w.data(), s.n, s.k));
      expect_rule("X*W " + label(c, s), download_bf16(d), ref, round_all(ref));
    }
}

// The plain GEMM in each operand layout at odd M, N and K (an odd vocabulary's logits GEMM, its
// dgrad over K = V and its wgrad with M = V): operands and D at row strides padded to 8, NaN in
// the padding: never read; D's written only as the ops' contract allows (zeros up to the next
// multiple of 8 columns; the row stride is N rounded up to 8, plus 8 to see that nothing lands
// beyond).
TEST_F(GpuKernelTest, PlainGemmsTakeOddExtentsAtPaddedRowStrides) {
  testing::Rng rng(26);
  const Shape shapes[] = {{77, 1001, 131}, {1001, 136, 77}, {5, 9, 3}};
  for (Operands o : {Operands::kXWt, Operands::kXW, Operands::kXtY})
    for (Config c : compiled_configs(Program::kPlain, o))
      for (const Shape& s : shapes) {
        // A and B as stored: X·Wᵀ: A (M, K), B (N, K); X·W: A (M, K), B (K, N); Xᵀ·Y: A (K, M),
        // B (K, N).
        const int a_rows = o == Operands::kXtY ? s.k : s.m,
                  a_cols = o == Operands::kXtY ? s.m : s.k;
        const int b_rows = o == Operands::kXWt ? s.n : s.k,
                  b_cols = o == Operands::kXWt ? s.k : s.n;
        const V a = testing::bf16_uniform(size_t(a_rows) * a_cols, -1, 1, rng);
        const V b = testing::bf16_uniform(size_t(b_rows) * b_cols, -1, 1, rng);
        const int lda = padded_ld(a_cols), ldb = padded_ld(b_cols), ldd = padded_ld(s.n) + 8;
        auto da = upload_bf16_rows(a, a_rows, a_cols, lda);
        auto db = upload_bf16_rows(b, b_rows, b_cols, ldb);
        DeviceBuffer<bf16> d(size_t(s.m) * ldd);
        d.poison();
        PlainArgs args;
        run<Program::kPlain>(
            c, {s.m, s.n, s.k, da.get(), lda, db.get(), ldb, nullptr, 0, d.get(), ldd}, args, o);
        const auto ma = o == Operands::kXtY ? MatrixRef<double>::transposed(a.data(), s.m, s.k)
                                            : MatrixRef<double>::row_major(a.data(), s.m, s.k);
        const auto mb = o == Operands::kXWt ? MatrixRef<double>::row_major(b.data(), s.n, s.k)
                                            : MatrixRef<double>::transposed(b.data(), s.n, s.k);
        const V ref = reference::gemm<double>(ma, mb);
        const std::string l = std::string(operands_name(o)) + " " + label(c, s);
        const PaddedRows got = download_bf16_rows(d, s.m, s.n, ldd);
        expect_rule("odd extents " + l, got.values, ref, round_all(ref));
        EXPECT_TRUE(got.padding_ok) << l << ": " << got.describe();
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
      run<Program::kPlain>(c,
          {s.m, s.n, s.k, dx.get(), s.m, dy.get(), s.n, nullptr, 0, d.get(), s.n}, args,
          Operands::kXtY);
      const V ref = reference::gemm<double>(MatrixRef<double>::transposed(x.data(), s.m, s.k),
                                            MatrixRef<double>::transposed(y.data(), s.n, s.k));
      expect_rule("X^T*Y " + label(c, s), download_bf16(d), ref, round_all(ref));
    }
}

// dx into its own buffer, in place into dres, or without dres: dx poisoned and passed as C
// (args.dres false), so a read of C would turn dx into NaN.
enum class Dres { kSeparate, kInPlace, kAbsent };

void check_rmsnorm_backward(Dres mode) {
  const auto configs = compiled_configs(Program::kRmsnormBackward, Operands::kXW);
  ASSERT_FALSE(configs.empty());
  const bool in_place = mode == Dres::kInPlace, absent = mode == Dres::kAbsent;
  testing::Rng rng(23 + int(mode));
  for (Config c : configs)
    for (const Shape& s : kShapes) {
      if (skip_large(s)) continue;
      // g (M, H) = dz (M, Nout) · W (Nout, H): GEMM N = H, K = Nout.
      const int M = s.m, H = s.n, Nout = s.k;
      const size_t mh = size_t(M) * H;
      const V dz = testing::bf16_uniform(size_t(M) * Nout, -1, 1, rng);
      const V w = testing::bf16_uniform(size_t(Nout) * H, -0.3, 0.3, rng);
      const V x = testing::bf16_uniform(mh, -2, 2, rng);
      const V dres = absent ? V(mh, 0.0) : testing::bf16_uniform(mh, -1, 1, rng);
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
      // The in-place variant also gives h rows padded by 8 elements (the TMA store's row stride
      // on pingpong differs from N): the padding must stay as poisoned.
      const int ldh = in_place ? H + 8 : H;
      DeviceBuffer<bf16> ddx(in_place ? 0 : mh), dh(size_t(M) * ldh);
      if (!in_place) ddx.poison();
      dh.poison();
      dpart.poison();
      bf16* out = in_place ? ddres.get() : ddx.get();
      RmsnormBackwardArgs args{dxs.get(), H,   dr.get(),    dg.get(), dzdz.get(),
                               dh.get(),  ldh, dpart.get(), !absent};
      run<Program::kRmsnormBackward>(
          c, {M, H, Nout, ddz.get(), Nout, dw.get(), H, absent ? out : ddres.get(), H, out, H},
          args, Operands::kXW);

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
      const std::string l = std::string(in_place ? "in-place "
                                        : absent ? "without dres "
                                                 : "") +
                            label(c, s);
      expect_rule("B1 dx " + l, download_bf16(in_place ? ddres : ddx), dx, dx_pt);
      // The poison reads back as NaN; h itself is finite.
      const V h_rows = download_bf16(dh);
      V h_gpu(mh);
      int64_t padding_written = 0;
      for (int i = 0; i < M; ++i)
        for (int j = 0; j < ldh; ++j) {
          const double v = h_rows[size_t(i) * ldh + j];
          if (j < H)
            h_gpu[size_t(i) * H + j] = v;
          else
            padding_written += !std::isnan(v);
        }
      EXPECT_EQ(padding_written, 0) << "B1 h_out padding (ldh " << ldh << ") " << l;
      expect_rule("B1 h_out " + l, h_gpu, h, h_pt);
      expect_rule("B1 dgamma partials " + l, part_gpu, part_ref, part_pt);
    }
}

TEST_F(GpuKernelTest, CrossEntropyBackwardMatchesReferenceWithIgnoredTokensAndZLoss) {
  const auto configs = compiled_configs(Program::kRmsnormCrossEntropyBackward);
  ASSERT_FALSE(configs.empty());
  testing::Rng rng(25);
  // V = 200 and 1000: the last N-tile is ragged; V = 1001 with K = 131: odd extents at row
  // strides padded to 8 (NaN there; dℓ's padding as the ops' contract allows). ℓ is recomputed from
  // h and W_vocab.
  const Shape shapes[] = {
      {1, 200, 136}, {19, 1000, 136}, {111, 1000, 136}, {4097, 200, 136}, {77, 1001, 131}};
  const float z_loss = 1e-2f;
  for (Config c : configs)
    for (const Shape& s : shapes) {
      if (skip_large(s)) continue;
      const int M = s.m, Nv = s.n, H = s.k;  // Nv: vocabulary
      const V h = testing::bf16_uniform(size_t(M) * H, -1, 1, rng);
      const V w = testing::bf16_uniform(size_t(Nv) * H, -1, 1, rng);
      std::vector<float> r(M), scale(M);
      std::vector<int64_t> tgt(M);
      for (int i = 0; i < M; ++i) {
        r[i] = static_cast<float>(rng.uniform(0.5, 3));
        tgt[i] = i % 7 == 3 ? -100 : rng.integer(0, Nv - 1);
        scale[i] = tgt[i] < 0 ? 0.0f : static_cast<float>(rng.uniform(0.001, 0.01));
      }
      // lse from the fp64 logits (an input of B4, as the forward pass would have produced it).
      const V y = gemm_ref(h, w, {M, Nv, H});
      std::vector<float> lse(M);
      for (int i = 0; i < M; ++i) {
        double mx = -INFINITY, se = 0;
        for (int j = 0; j < Nv; ++j) mx = std::max(mx, y[size_t(i) * Nv + j] * r[i]);
        for (int j = 0; j < Nv; ++j) se += std::exp(y[size_t(i) * Nv + j] * r[i] - mx);
        lse[i] = static_cast<float>(mx + std::log(se));
      }
      const auto tiles = reference_tiles(c);
      const auto layout = epilogue::PartialLayout::per_row(M, Nv, tiles.tile_m, tiles.tile_n);
      const int ldk = padded_ld(H), ldl = padded_ld(Nv);
      auto dh = upload_bf16_rows(h, M, H, ldk), dw = upload_bf16_rows(w, Nv, H, ldk);
      DeviceBuffer<float> dr(r), dlse(lse), dscale(scale), dpart(layout.elements());
      DeviceBuffer<int64_t> dt(tgt);
      DeviceBuffer<bf16> dl(size_t(M) * ldl);
      dl.poison();
      dpart.poison();
      RmsnormCrossEntropyBackwardArgs args{dr.get(), dlse.get(),  dscale.get(),
                                           dt.get(), dpart.get(), z_loss};
      run<Program::kRmsnormCrossEntropyBackward>(
          c, {M, Nv, H, dh.get(), ldk, dw.get(), ldk, nullptr, 0, dl.get(), ldl}, args);

      const V rd(r.begin(), r.end()), lsed(lse.begin(), lse.end()), sd(scale.begin(), scale.end());
      programs::RmsnormCrossEntropyBackward<double> p;
      V dlog(size_t(M) * Nv), part(layout.elements(), 0.0);
      p.r = {rd.data(), M};
      p.lse = {lsed.data(), M};
      p.scale = {sd.data(), M};
      p.targets = {tgt.data(), M};
      p.vocab = Nv;
      p.z_loss = z_loss;
      p.dlogits = {dlog.data(), M, Nv, Nv};
      p.partials = part.data();
      p.layout = layout;
      reference::execute<double>(MatrixRef<double>::row_major(h.data(), M, H),
                                 MatrixRef<double>::row_major(w.data(), Nv, H), p, tiles);
      // PyTorch: logits = bf16(bf16(h wᵀ) r); dℓ in fp32 from them (softmax · (1 + 2λ lse) −
      // onehot) · scale, rounded to bf16; ZdZ = Σ ℓ·dℓ over the bf16 tensors.
      V dl_pt(size_t(M) * Nv), part_pt(layout.elements(), 0.0);
      for (int i = 0; i < M; ++i)
        for (int j = 0; j < Nv; ++j) {
          const size_t e = size_t(i) * Nv + j;
          const double l = round_bf16(round_bf16(y[e]) * rd[i]);
          dl_pt[e] = round_bf16(
              (std::exp(l - lsed[i]) * (1 + 2 * z_loss * lsed[i]) - (tgt[i] == j ? 1.0 : 0.0)) *
              sd[i]);
          part_pt[layout.index(i, j / tiles.tile_n)] += l * dl_pt[e];
        }
      V part_gpu(layout.elements());
      const auto raw = dpart.download();
      for (size_t i = 0; i < raw.size(); ++i) part_gpu[i] = raw[i];
      for (int64_t t = 0; t < layout.tiles; ++t)
        for (int64_t i = M; i < layout.extent; ++i)
          part_gpu[layout.index(i, t)] = part[layout.index(i, t)] = part_pt[layout.index(i, t)] = 0;
      const std::string l = label(c, s);
      const PaddedRows got = download_bf16_rows(dl, M, Nv, ldl);
      expect_rule("B4 dlogits " + l, got.values, dlog, dl_pt);
      EXPECT_TRUE(got.padding_ok) << l << ": " << got.describe();
      expect_rule("B4 ZdZ partials " + l, part_gpu, part, part_pt);
    }
}

TEST_F(GpuKernelTest, SwigluBackwardMatchesReference) {
  const auto configs = compiled_configs(Program::kSwigluBackward, Operands::kXW);
  ASSERT_FALSE(configs.empty());
  testing::Rng rng(26);
  // Beyond kShapes, one whose tile grid (65 x 9 tiles of 128x128) gives every CTA of a 132-SM
  // H200 four or five tiles: z's shared-memory ring, which dz reuses, then wraps across
  // tiles and both pingpong warpgroups start later tiles from advanced pipeline states.
  std::vector<Shape> shapes(std::begin(kShapes), std::end(kShapes));
  shapes.push_back({8193, 1032, 72});
  for (Config c : configs)
    for (const Shape& s : shapes) {
      if (skip_large(s)) continue;
      // da (M, I) = dx_out (M, H) · W_down (H, I): GEMM N = I, K = H. z, dz: (M, 2I) interleaved.
      const int M = s.m, I = s.n, H = s.k;
      const V dxo = testing::bf16_uniform(size_t(M) * H, -1, 1, rng);
      const V wd = testing::bf16_uniform(size_t(H) * I, -0.3, 0.3, rng);
      const V z = testing::bf16_uniform(size_t(M) * 2 * I, -4, 4, rng);
      const auto tiles = reference_tiles(c);
      const auto layout = epilogue::PartialLayout::per_row(M, I, tiles.tile_m, tiles.tile_n);
      auto ddxo = upload_bf16(dxo), dwd = upload_bf16(wd), dzin = upload_bf16(z);
      DeviceBuffer<bf16> da_out(size_t(M) * I), ddz(size_t(M) * 2 * I);
      DeviceBuffer<float> dpart(layout.elements());
      da_out.poison();
      ddz.poison();
      dpart.poison();
      // (g, u) bf16 pairs are read and written as one 32-bit element each.
      SwigluBackwardArgs args{reinterpret_cast<const uint32_t*>(dzin.get()), I,
                              reinterpret_cast<uint32_t*>(ddz.get()), I, dpart.get()};
      run<Program::kSwigluBackward>(c,
          {M, I, H, ddxo.get(), H, dwd.get(), I, nullptr, 0, da_out.get(), I}, args,
          Operands::kXW);

      programs::SwigluBackward<double> p;
      V dz(size_t(M) * 2 * I), a(size_t(M) * I), part(layout.elements(), 0.0);
      p.z = {z.data(), M, 2 * I, 2 * I};
      p.dz = {dz.data(), M, 2 * I, 2 * I};
      p.a = {a.data(), M, I, I};
      p.partials = part.data();
      p.layout = layout;
      reference::execute<double>(MatrixRef<double>::row_major(dxo.data(), M, H),
                                 MatrixRef<double>::transposed(wd.data(), I, H), p, tiles);
      // PyTorch autograd of silu(g)·u in bf16: da = bf16(dx W); du = bf16(da · bf16(silu g));
      // dg = bf16(bf16(da · u) · σ(g)(1 + g(1 − σ(g)))); a = bf16(bf16(silu g) · u).
      const V da = reference::gemm<double>(MatrixRef<double>::row_major(dxo.data(), M, H),
                                           MatrixRef<double>::transposed(wd.data(), I, H));
      V dz_pt(dz.size()), a_pt(a.size()), part_pt(layout.elements(), 0.0);
      for (int i = 0; i < M; ++i)
        for (int j = 0; j < I; ++j) {
          const double g = z[size_t(i) * 2 * I + 2 * j], u = z[size_t(i) * 2 * I + 2 * j + 1];
          const double sg = 1 / (1 + std::exp(-g)), silu = round_bf16(g * sg);
          const double dab = round_bf16(da[size_t(i) * I + j]);
          const double du = round_bf16(dab * silu);
          const double dg = round_bf16(round_bf16(dab * u) * sg * (1 + g * (1 - sg)));
          dz_pt[size_t(i) * 2 * I + 2 * j] = dg;
          dz_pt[size_t(i) * 2 * I + 2 * j + 1] = du;
          a_pt[size_t(i) * I + j] = round_bf16(silu * u);
          part_pt[layout.index(i, j / tiles.tile_n)] += g * dg + u * du;
        }
      V part_gpu(layout.elements());
      const auto raw = dpart.download();
      for (size_t i = 0; i < raw.size(); ++i) part_gpu[i] = raw[i];
      for (int64_t t = 0; t < layout.tiles; ++t)
        for (int64_t i = M; i < layout.extent; ++i)
          part_gpu[layout.index(i, t)] = part[layout.index(i, t)] = part_pt[layout.index(i, t)] = 0;
      const std::string l = label(c, s);
      expect_rule("B2 dz " + l, download_bf16(ddz), dz, dz_pt);
      expect_rule("B2 a " + l, download_bf16(da_out), a, a_pt);
      expect_rule("B2 ZdZ partials " + l, part_gpu, part, part_pt);
    }
}

TEST_F(GpuKernelTest, RopeBackwardAndZdZMatchReference) {
  testing::Rng rng(27);
  // Also a dy that starts 8 bytes past a 16-byte boundary and a width (18) that is not a
  // multiple of 8 (a 16-byte-access variant of the kernel needed both; it was slower).
  // With a bias (F3's q/k/v bias: ZdZ subtracts b·dz).
  struct Case {
    programs::QkvLayout ql;
    int dy_offset;  // elements
    bool bias;
  };
  const Case cases[] = {{{4, 2, 64}, 0, false}, {{3, 1, 128}, 0, false}, {{4, 2, 64}, 4, false},
                        {{1, 1, 6}, 0, false},  {{4, 2, 64}, 0, true},   {{3, 1, 128}, 4, true}};
  for (const auto& [ql, dy_offset, with_bias] : cases)
    for (int M : {1, 19, 111, 4097}) {
      const int W = ql.width(), H = 256;
      const V y = testing::bf16_uniform(size_t(M) * W, -2, 2, rng);
      const V dy = testing::bf16_uniform(size_t(M) * W, -1, 1, rng);
      const V b = with_bias ? testing::bf16_uniform(W, -4, 4, rng) : V{};
      std::vector<int32_t> pos(M);
      for (auto& p : pos) p = static_cast<int32_t>(rng.integer(0, 1 << 17));
      const auto inv = programs::rope_inv_freq(ql.head_dim, 500000.0, {.enabled = true});
      const auto table = programs::rope_column_table(ql, inv);
      std::vector<uint32_t> hi, lo;
      ops::split_rope_table(table, hi, lo);
      V dy_shifted(dy_offset, 0.0);
      dy_shifted.insert(dy_shifted.end(), dy.begin(), dy.end());
      auto dyv = upload_bf16(y), ddy = upload_bf16(dy_shifted);
      auto db = upload_bf16(with_bias ? b : V(2, 0.0));
      DeviceBuffer<int32_t> dpos(pos);
      DeviceBuffer<uint32_t> dhi(hi), dlo(lo);
      DeviceBuffer<bf16> ddz(size_t(M) * W);
      DeviceBuffer<float> dzdz(M);
      ddz.poison();
      dzdz.poison();
      rope_backward(dyv.get(), ddy.get() + dy_offset, with_bias ? db.get() : nullptr, dpos.get(),
                    dhi.get(), dlo.get(), M, W, H, ddz.get(), dzdz.get(), nullptr);
      CODA_CUDA_CHECK(cudaDeviceSynchronize());
      V dz(size_t(M) * W), zsum(M);
      programs::rope_backward<double>({y.data(), M, W, W}, {dy.data(), M, W, W},
                                      {b.data(), int64_t(b.size())}, {pos.data(), M},
                                      {table.data(), W}, {dz.data(), M, W, W}, zsum.data());
      for (auto& v : zsum) v /= H;
      // PyTorch (HF rotate_half autograd, bf16): cos/sin in bf16, each product and sum rounded;
      // ZdZ as an fp32 sum over bf16 products.
      V dz_pt(dz.size()), z_pt(M);
      for (int i = 0; i < M; ++i) {
        float acc = 0.f;
        for (int j = 0; j < W; j += 2) {
          const size_t e = size_t(i) * W + j;
          const bool rot = j < ql.q_width() + ql.kv_width();
          const double th = rot ? double(pos[i]) * inv[(j % ql.head_dim) / 2] : 0.0;
          const double c = round_bf16(std::cos(th)), sn = round_bf16(std::sin(th));
          dz_pt[e] = round_bf16(round_bf16(dy[e] * c) + round_bf16(dy[e + 1] * sn));
          dz_pt[e + 1] = round_bf16(round_bf16(dy[e + 1] * c) - round_bf16(dy[e] * sn));
          acc += float(y[e] * dy[e]) + float(y[e + 1] * dy[e + 1]);
          if (with_bias) acc -= float(b[j] * dz_pt[e]) + float(b[j + 1] * dz_pt[e + 1]);
        }
        z_pt[i] = double(acc) / H;
      }
      const auto zg = dzdz.download();
      const std::string l = "d=" + std::to_string(ql.head_dim) + " M=" + std::to_string(M) +
                            " dy offset " + std::to_string(dy_offset) + (with_bias ? " bias" : "");
      expect_rule("B3 dz " + l, download_bf16(ddz), dz, dz_pt);
      expect_rule("B3 ZdZ " + l, V(zg.begin(), zg.end()), zsum, z_pt);
    }
}

// B3q (Qwen3's QK-norm backward) through the op API (the row kernel and the dγ folds): dz, ZdZ
// and dγ_q, dγ_k against the CPU reference; head_dim 128, 64 and 8; M up to 4097 (more rows than
// the kernel's blocks hold warps: each warp takes several rows).
TEST_F(GpuKernelTest, QkNormRopeBackwardMatchesReference) {
  testing::Rng rng(29);
  const programs::QkvLayout layouts[] = {{4, 2, 128}, {3, 1, 64}, {6, 3, 8}};
  for (const auto& ql : layouts)
    for (int M : {1, 19, 111, 4097, 9000}) {
      const programs::QkNorm qk{ql, 1e-6};
      const int W = ql.width(), d = ql.head_dim, P = int(qk.normed_width()), H = 256;
      const V pre = testing::bf16_uniform(size_t(M) * P, -2, 2, rng);
      const V y = testing::bf16_uniform(size_t(M) * W, -2, 2, rng);
      const V dy = testing::bf16_uniform(size_t(M) * W, -1, 1, rng);
      const V qg = testing::bf16_uniform(d, 0.5, 1.5, rng),
              kg = testing::bf16_uniform(d, 0.5, 1.5, rng);
      std::vector<int32_t> pos(M);
      for (auto& p : pos) p = static_cast<int32_t>(rng.integer(0, 1 << 17));
      const auto inv = programs::rope_inv_freq(d, 1000000.0, {});
      const auto table = programs::rope_column_table(ql, inv);
      std::vector<uint32_t> hi, lo;
      ops::split_rope_table(table, hi, lo);
      std::vector<uint32_t> words(hi);
      words.insert(words.end(), lo.begin(), lo.end());
      auto dpre = upload_bf16(pre), dyv = upload_bf16(y), ddy = upload_bf16(dy),
           dqg = upload_bf16(qg), dkg = upload_bf16(kg);
      DeviceBuffer<int32_t> dpos(pos);
      DeviceBuffer<uint32_t> dtable(words);
      DeviceBuffer<bf16> ddz(size_t(M) * W);
      const int64_t rows = ops::qk_norm_backward_partials_rows(M);
      DeviceBuffer<float> dzdz(M), dpart(size_t(rows) * 2 * d), ddq(d), ddk(d);
      ddz.poison();
      dzdz.poison();
      dpart.poison();
      ddq.poison();
      ddk.poison();
      using TV = TensorView;
      ops::qk_norm_rope_backward(TV::matrix(dpre.get(), DType::kBF16, M, P, P, 0),
                                 TV::matrix(dyv.get(), DType::kBF16, M, W, W, 0),
                                 TV::matrix(ddy.get(), DType::kBF16, M, W, W, 0),
                                 TV::vector(dqg.get(), DType::kBF16, d, 0),
                                 TV::vector(dkg.get(), DType::kBF16, d, 0), qk,
                                 TV::vector(dpos.get(), DType::kI32, M, 0),
                                 TV::matrix(dtable.get(), DType::kI32, 2, W, W, 0), H,
                                 TV::matrix(ddz.get(), DType::kBF16, M, W, W, 0),
                                 TV::vector(dzdz.get(), DType::kF32, M, 0),
                                 TV::matrix(dpart.get(), DType::kF32, rows, 2 * d, 2 * d, 0),
                                 TV::vector(ddq.get(), DType::kF32, d, 0),
                                 TV::vector(ddk.get(), DType::kF32, d, 0), nullptr);
      CODA_CUDA_CHECK(cudaDeviceSynchronize());
      V dz(size_t(M) * W), zsum(M), dq(d), dk(d);
      programs::qk_norm_rope_backward<double>(
          {pre.data(), M, P, P}, {y.data(), M, W, W}, {dy.data(), M, W, W}, {qg.data(), d},
          {kg.data(), d}, qk, {pos.data(), M}, {table.data(), W}, {dz.data(), M, W, W}, zsum.data(),
          dq.data(), dk.data());
      for (auto& v : zsum) v /= H;
      // PyTorch (HF eager autograd, bf16): RoPE's transpose with bf16 cos / sin and rounded
      // products; the head norm's backward in fp32 from dn = bf16(γ · dy'); dγ an fp32 sum of
      // dy' · bf16(n) rounded to bf16; ZdZ an fp32 sum.
      V dz_pt(dz.size()), z_pt(M), dq_pt(d, 0.0), dk_pt(d, 0.0);
      std::vector<float> dqf(d, 0.f), dkf(d, 0.f);
      for (int i = 0; i < M; ++i) {
        float acc = 0.f;
        for (int h0 = 0; h0 < W; h0 += d) {
          const int kind = qk.kind(h0);
          const size_t e0 = size_t(i) * W + h0;
          if (kind == 2) {
            for (int j = 0; j < d; ++j) {
              dz_pt[e0 + j] = dy[e0 + j];
              acc += float(y[e0 + j] * dy[e0 + j]);
            }
            continue;
          }
          const double* u = &pre[size_t(i) * P + h0];
          float ss = 0.f;
          for (int j = 0; j < d; ++j) ss += float(u[j] * u[j]);
          const float s = 1.f / std::sqrt(ss / float(d) + 1e-6f);
          const V& g = kind == 0 ? qg : kg;
          std::vector<float>& dg = kind == 0 ? dqf : dkf;
          V dyr(d);
          float dn_n = 0.f;
          for (int j = 0; j < d; j += 2) {
            const double th = double(pos[i]) * inv[j / 2];
            const double c = round_bf16(std::cos(th)), sn = round_bf16(std::sin(th));
            dyr[j] = round_bf16(round_bf16(dy[e0 + j] * c) + round_bf16(dy[e0 + j + 1] * sn));
            dyr[j + 1] = round_bf16(round_bf16(dy[e0 + j + 1] * c) - round_bf16(dy[e0 + j] * sn));
          }
          for (int j = 0; j < d; ++j) {
            const float n = float(u[j]) * s;
            dg[j] += float(dyr[j]) * float(round_bf16(n));
            dn_n += float(round_bf16(g[j] * dyr[j])) * n;
          }
          for (int j = 0; j < d; ++j) {
            const float dn = float(round_bf16(g[j] * dyr[j]));
            const float du = s * (dn - float(u[j]) * s * dn_n / float(d));
            dz_pt[e0 + j] = round_bf16(du);
            acc += float(u[j] * dz_pt[e0 + j]);
          }
        }
        z_pt[i] = double(acc) / H;
      }
      for (int j = 0; j < d; ++j) dq_pt[j] = round_bf16(dqf[j]), dk_pt[j] = round_bf16(dkf[j]);
      const auto zg = dzdz.download(), qgot = ddq.download(), kgot = ddk.download();
      const std::string l = "d=" + std::to_string(d) + " M=" + std::to_string(M);
      expect_rule("B3q dz " + l, download_bf16(ddz), dz, dz_pt);
      expect_rule("B3q ZdZ " + l, V(zg.begin(), zg.end()), zsum, z_pt);
      expect_rule("B3q dq_gamma " + l, V(qgot.begin(), qgot.end()), dq, dq_pt);
      expect_rule("B3q dk_gamma " + l, V(kgot.begin(), kgot.end()), dk, dk_pt);
    }
}

TEST_F(GpuKernelTest, PartialFoldsMatchSums) {
  testing::Rng rng(28);
  for (int n : {1, 19, 4097}) {
    const int64_t padded = (n + 127) / 128 * 128, tiles = 7;
    std::vector<float> part(padded * tiles);
    for (auto& v : part) v = static_cast<float>(rng.uniform(-1, 1));
    DeviceBuffer<float> dpart(part), drow(n), dcol(n);
    drow.poison();
    dcol.poison();
    fold_row_sums(dpart.get(), n, padded, tiles, 0.25f, drow.get(), nullptr);
    fold_column_sums(dpart.get(), n, padded, tiles, dcol.get(), nullptr);
    CODA_CUDA_CHECK(cudaDeviceSynchronize());
    V ref(n), pt(n);
    for (int i = 0; i < n; ++i) {
      float f = 0.f;
      for (int64_t t = 0; t < tiles; ++t) ref[i] += part[i + padded * t], f += part[i + padded * t];
      pt[i] = f;
    }
    const auto rg = drow.download(), cg = dcol.download();
    V rowv(n), rref(n), rpt(n);
    for (int i = 0; i < n; ++i) rowv[i] = rg[i], rref[i] = 0.25 * ref[i], rpt[i] = 0.25 * pt[i];
    expect_rule("fold_row_sums n=" + std::to_string(n), rowv, rref, rpt);
    expect_rule("fold_column_sums n=" + std::to_string(n), V(cg.begin(), cg.end()), ref, pt);
  }
}

TEST_F(GpuKernelTest, RmsnormBackwardMatchesReference) { check_rmsnorm_backward(Dres::kSeparate); }
TEST_F(GpuKernelTest, RmsnormBackwardAccumulatesInPlaceIntoResidualGradient) {
  check_rmsnorm_backward(Dres::kInPlace);
}
TEST_F(GpuKernelTest, RmsnormBackwardWithoutResidualGradientReadsNoSource) {
  check_rmsnorm_backward(Dres::kAbsent);
}

}  // namespace
}  // namespace coda::kernel
