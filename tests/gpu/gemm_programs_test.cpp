// Every compiled Hopper kernel against the CPU reference executor on fresh random inputs, ragged
// shapes included (M = 1, 19, 111, 4097; N, K multiples of 8 but not of the tile). Outputs are
// poisoned (NaN) before each run, so an unwritten element fails. Tolerance (docs/math.md §5):
//   max|out − ref| <= 2 · max|out_pt − ref| + 1e-6,
// with ref the fp64 reference and out_pt PyTorch's unfused bf16 path, emulated on the host (each
// eager op rounds its output to bf16). Skipped with a message when no Hopper GPU is present.

#include <gtest/gtest.h>

#include <cmath>
#include <iterator>
#include <string>
#include <vector>

#include "coda/kernel/args.hpp"
#include "coda/kernel/aux_kernels.hpp"
#include "coda/kernel/runtime.hpp"
#include "coda/ops.hpp"
#include "coda/programs/forward.hpp"
#include "coda/reference/executor.hpp"
#include "support/bf16.hpp"
#include "support/device.hpp"
#include "support/gpu_check.hpp"
#include "support/numeric.hpp"

namespace coda::kernel {
namespace {

// N = 200 and K = 136 are multiples of 8 but of no tile; M covers 1, a prime, and > a tile.
const Shape kShapes[] = {
    {1, 200, 136}, {19, 8, 8}, {111, 200, 136}, {4097, 200, 136}, {111, 1032, 520}};

TEST_F(GpuKernelTest, AccumulatorPairsAreAdjacentColumnsOfOneThread) {
  const auto configs = compiled_configs(Program::kPairLayoutProbe);
  ASSERT_FALSE(configs.empty());
  testing::Rng rng(1);
  for (Config c : configs)
    for (const Shape& s : kShapes) {
      if (skip_large(s)) continue;
      auto a = upload_bf16(testing::bf16_uniform(size_t(s.m) * s.k, -1, 1, rng));
      auto w = upload_bf16(testing::bf16_uniform(size_t(s.n) * s.k, -1, 1, rng));
      DeviceBuffer<bf16> d(size_t(s.m) * s.n);
      d.poison();
      PlainArgs args;
      run<Program::kPairLayoutProbe>(c,
          {s.m, s.n, s.k, a.get(), s.k, w.get(), s.k, nullptr, 0, d.get(), s.n}, args);
      for (double v : download_bf16(d)) ASSERT_EQ(v, 1.0) << label(c, s);
    }
}

TEST_F(GpuKernelTest, PlainGemmMatchesReference) {
  const auto configs = compiled_configs(Program::kPlain);
  ASSERT_FALSE(configs.empty());
  testing::Rng rng(2);
  for (Config c : configs)
    for (const Shape& s : kShapes) {
      if (skip_large(s)) continue;
      const V a = testing::bf16_uniform(size_t(s.m) * s.k, -1, 1, rng);
      const V w = testing::bf16_uniform(size_t(s.n) * s.k, -1, 1, rng);
      auto da = upload_bf16(a), dw = upload_bf16(w);
      DeviceBuffer<bf16> d(size_t(s.m) * s.n);
      d.poison();
      PlainArgs args;
      run<Program::kPlain>(c,
          {s.m, s.n, s.k, da.get(), s.k, dw.get(), s.k, nullptr, 0, d.get(), s.n}, args);
      const V ref = gemm_ref(a, w, s);
      V pt(ref.size());
      for (size_t i = 0; i < ref.size(); ++i) pt[i] = round_bf16(ref[i]);
      expect_rule("gemm " + label(c, s), download_bf16(d), ref, pt);
    }
}

// Programmatic dependent launch (kernel::programmatic_launch, on by default): a GEMM may start
// while the one before it in the stream drains, and must neither read what that one has not
// written yet nor overwrite what it is still reading. Each round launches three dependent kernels
// on one stream with no synchronization between them, on two (M, N) buffers P and Q that swap
// roles every round:
//   P  = A·W1ᵀ       (K = 960; 24 tiles, so most SMs are free once it lets its dependents launch,
//                     after its last tile's mainloop, before its epilogue has stored P)
//   Q  = P·W2ᵀ       reads P in its mainloop
//   x  = A3·W3ᵀ + Q  (F1) reads Q as its residual, in its epilogue
// The next round's first launch writes Q (then P = Q·W2ᵀ, x = … + P), the buffer the launch
// before it is reading. A read that ran ahead of its producer would see the previous round's
// values (or the poison of the first); a write that ran ahead would change the residual under
// F1. A changes every round, and every round's x is checked.
// What this shows is that results stay right under PDL, not that the waits are needed: kernels
// built with CUTLASS's wait compiled out (the early release kept) passed it 10 times of 10 on the
// H200. The dependent grid starts later than the last epilogue it could race with.
TEST_F(GpuKernelTest, DependentLaunchesReadWhatTheLaunchBeforeThemWrote) {
  const Config c = Config::kPing128x128x64_1x2;
  if (!find_kernel(Program::kPlain, c, Operands::kXWt) ||
      !find_kernel(Program::kResidualRmsnormPartial, c, Operands::kXWt))
    GTEST_SKIP() << "needs plain and F1 on " << config_name(c) << " (subset build)";
  struct RestoreLaunchMode {
    bool was = programmatic_launch();
    ~RestoreLaunchMode() { set_programmatic_launch(was); }
  } restore;
  set_programmatic_launch(true);
  testing::Rng rng(11);
  const int m = 960, k1 = 960, n = 264, k3 = 136, rounds = 4;
  const Shape s1{m, n, k1}, s2{m, n, n}, s3{m, n, k3};
  const V w1 = testing::bf16_uniform(size_t(n) * k1, -0.1, 0.1, rng);
  const V w2 = testing::bf16_uniform(size_t(n) * n, -0.15, 0.15, rng);
  const V a3 = testing::bf16_uniform(size_t(m) * k3, -1, 1, rng);
  const V w3 = testing::bf16_uniform(size_t(n) * k3, -0.2, 0.2, rng);
  const V ones(n, 1.0);
  auto dw1 = upload_bf16(w1), dw2 = upload_bf16(w2), da3 = upload_bf16(a3),
       dw3 = upload_bf16(w3), dgamma = upload_bf16(ones);
  std::vector<V> a(rounds);
  std::vector<DeviceBuffer<bf16>> da, dx;
  for (int r = 0; r < rounds; ++r) {
    a[r] = testing::bf16_uniform(size_t(m) * k1, -1, 1, rng);
    da.push_back(upload_bf16(a[r]));
    dx.emplace_back(size_t(m) * n);
    dx.back().poison();
  }
  DeviceBuffer<bf16> pq[2] = {DeviceBuffer<bf16>(size_t(m) * n), DeviceBuffer<bf16>(size_t(m) * n)};
  DeviceBuffer<bf16> h(size_t(m) * n);
  pq[0].poison();
  pq[1].poison();
  const auto tiles = reference_tiles(c);
  const auto layout = epilogue::PartialLayout::per_row(m, n, tiles.tile_m, tiles.tile_n);
  DeviceBuffer<float> part(layout.elements());
  // The uploads and poisons above ran on the legacy default stream, which the non-blocking
  // stream below does not wait for.
  CODA_CUDA_CHECK(cudaDeviceSynchronize());
  cudaStream_t stream;
  CODA_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  const SchedulerOptions so = test_schedule();
  const LaunchFn plain = find_kernel(Program::kPlain, c, Operands::kXWt);
  const LaunchFn f1 = find_kernel(Program::kResidualRmsnormPartial, c, Operands::kXWt);
  PlainArgs none;
  ResidualRmsnormPartialArgs f1_args{dgamma.get(), h.get(), n, part.get()};
  cudaError_t err = cudaSuccess;
  for (int r = 0; r < rounds && err == cudaSuccess; ++r) {
    bf16* first = pq[r % 2].get();  // P this round: Q of the round before
    bf16* second = pq[(r + 1) % 2].get();
    err = plain({m, n, k1, da[r].get(), k1, dw1.get(), k1, nullptr, 0, first, n}, &none, so, stream);
    if (err == cudaSuccess)
      err = plain({m, n, n, first, n, dw2.get(), n, nullptr, 0, second, n}, &none, so, stream);
    if (err == cudaSuccess)
      err = f1({m, n, k3, da3.get(), k3, dw3.get(), k3, second, n, dx[r].get(), n}, &f1_args, so,
               stream);
  }
  const cudaError_t sync = cudaStreamSynchronize(stream);
  CODA_CUDA_CHECK(cudaStreamDestroy(stream));
  CODA_CUDA_CHECK(err);
  CODA_CUDA_CHECK(sync);
  // fp64 reference, and PyTorch's bf16 path (each GEMM's output rounded to bf16).
  const V y3 = gemm_ref(a3, w3, s3);
  for (int r = 0; r < rounds; ++r) {
    const V y1 = gemm_ref(a[r], w1, s1);
    V y1_pt(y1.size());
    for (size_t i = 0; i < y1.size(); ++i) y1_pt[i] = round_bf16(y1[i]);
    const V y2 = gemm_ref(y1, w2, s2), y2_pt = gemm_ref(y1_pt, w2, s2);
    V x(y2.size()), x_pt(y2.size());
    for (size_t i = 0; i < y2.size(); ++i) {
      x[i] = y3[i] + y2[i];
      x_pt[i] = round_bf16(round_bf16(y3[i]) + round_bf16(y2_pt[i]));
    }
    expect_rule("round " + std::to_string(r) + " x = A3·W3ᵀ + (A·W1ᵀ)·W2ᵀ",
                download_bf16(dx[r]), x, x_pt);
  }
}

TEST_F(GpuKernelTest, ResidualRmsnormPartialMatchesReference) {
  const auto configs = compiled_configs(Program::kResidualRmsnormPartial);
  ASSERT_FALSE(configs.empty());
  testing::Rng rng(3);
  // The last shape gives every CTA several tiles (520 of 128x128 on at most 132 CTAs), so both
  // pingpong warpgroups and the residual's TMA ring run over more than one tile, and it stays
  // under CODA_GPU_TEST_SMALL's limit, so the sanitizers run it too.
  std::vector<Shape> shapes(std::begin(kShapes), std::end(kShapes));
  shapes.push_back({999, 8200, 72});
  for (Config c : configs)
    for (const Shape& s : shapes) {
      if (skip_large(s)) continue;
      const size_t mn = size_t(s.m) * s.n;
      const V a = testing::bf16_uniform(size_t(s.m) * s.k, -1, 1, rng);
      const V w = testing::bf16_uniform(size_t(s.n) * s.k, -0.2, 0.2, rng);
      const V res = testing::bf16_uniform(mn, -2, 2, rng);
      const V gamma = testing::bf16_uniform(s.n, 0.5, 1.5, rng);
      const auto tiles = reference_tiles(c);
      const auto layout = epilogue::PartialLayout::per_row(s.m, s.n, tiles.tile_m, tiles.tile_n);
      auto da = upload_bf16(a), dw = upload_bf16(w), dres = upload_bf16(res),
           dg = upload_bf16(gamma);
      DeviceBuffer<bf16> dx(mn), dh(mn);
      DeviceBuffer<float> dpart(layout.elements());
      dx.poison();
      dh.poison();
      dpart.poison();
      ResidualRmsnormPartialArgs args{dg.get(), dh.get(), s.n, dpart.get()};
      run<Program::kResidualRmsnormPartial>(c,
          {s.m, s.n, s.k, da.get(), s.k, dw.get(), s.k, dres.get(), s.n, dx.get(), s.n}, args);

      programs::ResidualRmsnormPartial<double> p;
      V x(mn), h(mn), part(layout.elements(), 0.0);
      p.residual = {res.data(), s.m, s.n, s.n};
      p.gamma = {gamma.data(), s.n};
      p.x = {x.data(), s.m, s.n, s.n};
      p.h = {h.data(), s.m, s.n, s.n};
      p.partials = part.data();
      p.layout = layout;
      reference::execute<double>(MatrixRef<double>::row_major(a.data(), s.m, s.k),
                                 MatrixRef<double>::row_major(w.data(), s.n, s.k), p, tiles);
      // PyTorch: y = bf16(a wᵀ); x = bf16(y + res); h = bf16(x γ); Σ x² over bf16 x.
      const V y = gemm_ref(a, w, s);
      V x_pt(mn), h_pt(mn), part_pt(layout.elements(), 0.0);
      for (int i = 0; i < s.m; ++i)
        for (int j = 0; j < s.n; ++j) {
          const size_t e = size_t(i) * s.n + j;
          x_pt[e] = round_bf16(round_bf16(y[e]) + res[e]);
          h_pt[e] = round_bf16(x_pt[e] * gamma[j]);
          part_pt[layout.index(i, j / tiles.tile_n)] += x_pt[e] * x_pt[e];
        }
      // Only rows < M of the padded partial buffer are defined outputs.
      V part_gpu = as_double(dpart.download()), part_ref = part, part_py = part_pt;
      for (int64_t t = 0; t < layout.tiles; ++t)
        for (int64_t i = s.m; i < layout.extent; ++i)
          part_gpu[layout.index(i, t)] = part_ref[layout.index(i, t)] =
              part_py[layout.index(i, t)] = 0;
      const std::string l = label(c, s);
      expect_rule("F1 x " + l, download_bf16(dx), x, x_pt);
      expect_rule("F1 h " + l, download_bf16(dh), h, h_pt);
      expect_rule("F1 sumsq partials " + l, part_gpu, part_ref, part_py);
    }
}

TEST_F(GpuKernelTest, RmsnormSwigluMatchesReference) {
  const auto configs = compiled_configs(Program::kRmsnormSwiglu);
  ASSERT_FALSE(configs.empty());
  testing::Rng rng(4);
  // 2I must be a multiple of 16 (the (M, I) output's rows are 16-byte aligned for TMA).
  const Shape shapes[] = {
      {1, 208, 136}, {19, 16, 8}, {111, 208, 136}, {4097, 208, 136}, {111, 1040, 520}};
  for (Config c : configs)
    for (const Shape& s : shapes) {
      if (skip_large(s)) continue;
      const size_t mn = size_t(s.m) * s.n;
      const V h = testing::bf16_uniform(size_t(s.m) * s.k, -1, 1, rng);
      const V w = testing::bf16_uniform(size_t(s.n) * s.k, -0.3, 0.3, rng);
      std::vector<float> r(s.m);
      for (auto& v : r) v = static_cast<float>(rng.uniform(0.3, 3));
      auto dh = upload_bf16(h), dw = upload_bf16(w);
      DeviceBuffer<float> dr(r);
      DeviceBuffer<bf16> dz(mn), dact(mn / 2);
      dz.poison();
      dact.poison();
      RmsnormSwigluArgs args{dr.get(), dact.get(), s.n / 2};
      run<Program::kRmsnormSwiglu>(c,
          {s.m, s.n, s.k, dh.get(), s.k, dw.get(), s.k, nullptr, 0, dz.get(), s.n}, args);

      const V rd = as_double(r);
      programs::RmsnormSwiglu<double> p;
      V z(mn), act(mn / 2);
      p.r = {rd.data(), s.m};
      p.z = {z.data(), s.m, s.n, s.n};
      p.a = {act.data(), s.m, s.n / 2, s.n / 2};
      reference::execute<double>(MatrixRef<double>::row_major(h.data(), s.m, s.k),
                                 MatrixRef<double>::row_major(w.data(), s.n, s.k), p,
                                 reference_tiles(c));
      // PyTorch: y = bf16(h wᵀ); z = bf16(y r); a = bf16(bf16(silu(g)) u).
      const V y = gemm_ref(h, w, s);
      V z_pt(mn), a_pt(mn / 2);
      for (int i = 0; i < s.m; ++i)
        for (int j = 0; j < s.n; j += 2) {
          const size_t e = size_t(i) * s.n + j;
          z_pt[e] = round_bf16(round_bf16(y[e]) * rd[i]);
          z_pt[e + 1] = round_bf16(round_bf16(y[e + 1]) * rd[i]);
          a_pt[e / 2] = round_bf16(round_bf16(epilogue::silu(z_pt[e])) * z_pt[e + 1]);
        }
      const std::string l = label(c, s);
      expect_rule("F2 z " + l, download_bf16(dz), z, z_pt);
      expect_rule("F2 a " + l, download_bf16(dact), act, a_pt);
    }
}

TEST_F(GpuKernelTest, RmsnormRopeMatchesReferenceWithGqaLongPositionsAndBias) {
  const auto configs = compiled_configs(Program::kRmsnormRope);
  ASSERT_FALSE(configs.empty());
  testing::Rng rng(5);
  // N = 320, 1024 and 192 (head_dim 48: not a power of two; the last N tile is ragged).
  const programs::QkvLayout layouts[] = {{3, 1, 64}, {4, 2, 128}, {2, 1, 48}};
  for (Config c : configs)
    for (const auto& ql : layouts)
      for (int m : {1, 111, 4097})
        for (bool with_bias : {false, true}) {
          const Shape s{m, ql.width(), 136};
          if (skip_large(s)) continue;
          const size_t mn = size_t(s.m) * s.n;
          const V h = testing::bf16_uniform(size_t(s.m) * s.k, -1, 1, rng);
          const V w = testing::bf16_uniform(size_t(s.n) * s.k, -0.3, 0.3, rng);
          // Qwen2's q/k/v bias (large next to the projection, as trained biases often are).
          const V b = with_bias ? testing::bf16_uniform(s.n, -4, 4, rng) : V{};
          std::vector<float> r(s.m);
          std::vector<int32_t> pos(s.m);
          for (int i = 0; i < s.m; ++i) {
            r[i] = static_cast<float>(rng.uniform(0.3, 3));
            pos[i] = static_cast<int32_t>(rng.integer(0, 1 << 17));
          }
          const auto inv = programs::rope_inv_freq(ql.head_dim, 500000.0, {.enabled = true});
          const auto table = programs::rope_column_table(ql, inv);
          std::vector<uint32_t> hi, lo;
          ops::split_rope_table(table, hi, lo);
          auto dh = upload_bf16(h), dw = upload_bf16(w),
               db = upload_bf16(with_bias ? b : V(8, 0.0));
          DeviceBuffer<float> dr(r);
          DeviceBuffer<int32_t> dpos(pos);
          DeviceBuffer<uint32_t> dhi(hi), dlo(lo);
          DeviceBuffer<bf16> dq(mn);
          dq.poison();
          RmsnormRopeArgs args{dr.get(), with_bias ? db.get() : nullptr, dpos.get(), dhi.get(),
                               dlo.get()};
          run<Program::kRmsnormRope>(
              c, {s.m, s.n, s.k, dh.get(), s.k, dw.get(), s.k, nullptr, 0, dq.get(), s.n}, args);

          const V rd = as_double(r);
          programs::RmsnormRope<double> p;
          V q(mn);
          p.r = {rd.data(), s.m};
          p.bias = {b.data(), int64_t(b.size())};
          p.pos = {pos.data(), s.m};
          p.freq = {table.data(), s.n};
          p.qkv = {q.data(), s.m, s.n, s.n};
          reference::execute<double>(MatrixRef<double>::row_major(h.data(), s.m, s.k),
                                     MatrixRef<double>::row_major(w.data(), s.n, s.k), p,
                                     reference_tiles(c));
          // PyTorch (HF eager): q = bf16(bf16(y) r); cos, sin cast to bf16; q·cos and rot(q)·sin
          // each rounded, then their sum.
          const V y = gemm_ref(h, w, s);
          V q_pt(mn);
          for (int i = 0; i < s.m; ++i)
            for (int j = 0; j < s.n; j += 2) {
              const size_t e = size_t(i) * s.n + j;
              double x0 = round_bf16(round_bf16(y[e]) * rd[i]);
              double x1 = round_bf16(round_bf16(y[e + 1]) * rd[i]);
              if (with_bias) {  // the bias added to the rounded projection, rounded again
                x0 = round_bf16(x0 + b[j]);
                x1 = round_bf16(x1 + b[j + 1]);
              }
              const bool rotated = j < ql.q_width() + ql.kv_width();
              const double th = rotated ? double(pos[i]) * inv[(j % ql.head_dim) / 2] : 0.0;
              const double cs = round_bf16(std::cos(th)), sn = round_bf16(std::sin(th));
              q_pt[e] = round_bf16(round_bf16(x0 * cs) - round_bf16(x1 * sn));
              q_pt[e + 1] = round_bf16(round_bf16(x1 * cs) + round_bf16(x0 * sn));
            }
          expect_rule("F3 qkv " + label(c, s) + (with_bias ? " bias" : ""), download_bf16(dq), q,
                      q_pt);
        }
}

// F3 with QK-norm (Qwen3): the tile normalizes whole heads (head_dim 128, 64, 32 and 8; N = 320
// leaves a 64-column last tile) against the CPU reference with one head-wide subtile.
TEST_F(GpuKernelTest, RmsnormQkNormRopeMatchesReference) {
  const auto configs = compiled_configs(Program::kRmsnormQkNormRope);
  ASSERT_FALSE(configs.empty());
  testing::Rng rng(13);
  const programs::QkvLayout layouts[] = {{4, 2, 128}, {3, 1, 64}, {2, 2, 32}, {6, 3, 8}};
  for (Config c : configs)
    for (const auto& ql : layouts)
      for (int m : {1, 111, 4097}) {
        const Shape s{m, ql.width(), 136};
        if (skip_large(s)) continue;
        const programs::QkNorm qk{ql, 1e-6};
        const int d = ql.head_dim, normed = int(qk.normed_width());
        const size_t mn = size_t(s.m) * s.n, mp = size_t(s.m) * normed;
        const V h = testing::bf16_uniform(size_t(s.m) * s.k, -1, 1, rng);
        const V w = testing::bf16_uniform(size_t(s.n) * s.k, -0.3, 0.3, rng);
        const V qg = testing::bf16_uniform(d, 0.5, 1.5, rng),
                kg = testing::bf16_uniform(d, 0.5, 1.5, rng);
        std::vector<float> r(s.m);
        std::vector<int32_t> pos(s.m);
        for (int i = 0; i < s.m; ++i) {
          r[i] = static_cast<float>(rng.uniform(0.3, 3));
          pos[i] = static_cast<int32_t>(rng.integer(0, 1 << 17));
        }
        const auto inv = programs::rope_inv_freq(d, 1000000.0, {});
        const auto table = programs::rope_column_table(ql, inv);
        std::vector<uint32_t> hi, lo;
        ops::split_rope_table(table, hi, lo);
        auto dh = upload_bf16(h), dw = upload_bf16(w), dqg = upload_bf16(qg), dkg = upload_bf16(kg);
        DeviceBuffer<float> dr(r);
        DeviceBuffer<int32_t> dpos(pos);
        DeviceBuffer<uint32_t> dhi(hi), dlo(lo);
        DeviceBuffer<bf16> dq(mn), dpre(mp);
        dq.poison();
        dpre.poison();
        const RmsnormQkNormRopeArgs args =
            qk_norm_rope_args(qk, dr.get(), dqg.get(), dkg.get(), dpos.get(), dhi.get(), dlo.get(),
                              dq.get(), dpre.get());
        run<Program::kRmsnormQkNormRope>(
            c, {s.m, s.n, s.k, dh.get(), s.k, dw.get(), s.k, nullptr, 0, nullptr, s.n}, args);

        const V rd = as_double(r);
        programs::RmsnormQkNormRope<double> p;
        V q(mn), pre(mp);
        p.r = {rd.data(), s.m};
        p.q_gamma = {qg.data(), d};
        p.k_gamma = {kg.data(), d};
        p.qk = qk;
        p.pos = {pos.data(), s.m};
        p.freq = {table.data(), s.n};
        p.qkv = {q.data(), s.m, s.n, s.n};
        p.qk_pre = {pre.data(), s.m, normed, normed};
        reference::TileConfig tiles = reference_tiles(c);
        tiles.subtile_n = d;
        reference::execute<double>(MatrixRef<double>::row_major(h.data(), s.m, s.k),
                                   MatrixRef<double>::row_major(w.data(), s.n, s.k), p, tiles);
        // PyTorch (HF eager Qwen3): u = bf16(bf16(y) r); the head norm in fp32 rounded to bf16,
        // times γ rounded; cos, sin in bf16 and each product of the rotation rounded.
        const V y = gemm_ref(h, w, s);
        V q_pt(mn), pre_pt(mp);
        for (int i = 0; i < s.m; ++i)
          for (int h0 = 0; h0 < s.n; h0 += d) {
            const int kind = qk.kind(h0);
            const size_t e0 = size_t(i) * s.n + h0;
            V u(d);
            double ss = 0;
            for (int j = 0; j < d; ++j) {
              u[j] = round_bf16(round_bf16(y[e0 + j]) * rd[i]);
              ss += u[j] * u[j];
            }
            if (kind == 2) {
              for (int j = 0; j < d; ++j) q_pt[e0 + j] = u[j];
              continue;
            }
            const double sc = 1.0 / std::sqrt(float(ss / d) + 1e-6);
            const V& g = kind == 0 ? qg : kg;
            for (int j = 0; j < d; j += 2) {
              pre_pt[size_t(i) * normed + h0 + j] = u[j];
              pre_pt[size_t(i) * normed + h0 + j + 1] = u[j + 1];
              const double x0 = round_bf16(g[j] * round_bf16(u[j] * sc));
              const double x1 = round_bf16(g[j + 1] * round_bf16(u[j + 1] * sc));
              const double th = double(pos[i]) * inv[j / 2];
              const double cs = round_bf16(std::cos(th)), sn = round_bf16(std::sin(th));
              q_pt[e0 + j] = round_bf16(round_bf16(x0 * cs) - round_bf16(x1 * sn));
              q_pt[e0 + j + 1] = round_bf16(round_bf16(x1 * cs) + round_bf16(x0 * sn));
            }
          }
        const std::string l = label(c, s) + " d" + std::to_string(d);
        expect_rule("F3q qkv " + l, download_bf16(dq), q, q_pt);
        expect_rule("F3q qk_pre " + l, download_bf16(dpre), pre, pre_pt);
      }
}

template <Program prog>
void check_lse() {
  const auto configs = compiled_configs(prog);
  ASSERT_FALSE(configs.empty());
  testing::Rng rng(6);
  // V = 1000 and 200 are not multiples of any tile; the last N-tile is ragged. V = 1001 and 333
  // are odd (a GPT-2 or padded-LLaMA vocabulary), with K = 131 odd too: h, W and the logits at
  // row strides padded to 8 (NaN there), the logits' padding as the ops' contract allows.
  const Shape shapes[] = {{1, 200, 8},      {3, 200, 136},   {111, 1000, 136},
                          {4097, 200, 136}, {77, 1001, 131}, {3, 333, 8}};
  for (Config c : configs)
    for (const Shape& s : shapes) {
      if (skip_large(s)) continue;
      const V h = testing::bf16_uniform(size_t(s.m) * s.k, -1, 1, rng);
      const V w = testing::bf16_uniform(size_t(s.n) * s.k, -1, 1, rng);
      std::vector<float> r(s.m);
      std::vector<int64_t> tgt(s.m);
      for (int i = 0; i < s.m; ++i) {
        r[i] = static_cast<float>(rng.uniform(0.5, 4));
        tgt[i] = i % 5 == 4 ? -100 : rng.integer(0, s.n - 1);
      }
      const auto tiles = reference_tiles(c);
      const auto layout = epilogue::PartialLayout::per_row(s.m, s.n, tiles.tile_m, tiles.tile_n);
      const int ldk = padded_ld(s.k), ldl = padded_ld(s.n);
      auto dh = upload_bf16_rows(h, s.m, s.k, ldk), dw = upload_bf16_rows(w, s.n, s.k, ldk);
      DeviceBuffer<float> dr(r), dmax(layout.elements()), dsum(layout.elements()), dtl(s.m);
      DeviceBuffer<int64_t> dt(tgt);
      DeviceBuffer<bf16> dlog(prog == Program::kRmsnormLseLogits ? size_t(s.m) * ldl : 0);
      dmax.poison();
      dsum.poison();
      dtl.poison();
      dlog.poison();
      RmsnormLseArgs args{dr.get(), dt.get(), dmax.get(), dsum.get(), dtl.get()};
      run<prog>(c, {s.m, s.n, s.k, dh.get(), ldk, dw.get(), ldk, nullptr, 0, dlog.get(), ldl},
                args);

      const V rd = as_double(r);
      programs::RmsnormLse<double> p;
      V pmax(layout.elements()), psum(layout.elements()), tl(s.m, 0.0), logits(size_t(s.m) * s.n);
      p.r = {rd.data(), s.m};
      p.targets = {tgt.data(), s.m};
      p.vocab = s.n;
      p.max_partials = pmax.data();
      p.sumexp_partials = psum.data();
      p.layout = layout;
      p.target_logit = {tl.data(), s.m};
      p.logits = {logits.data(), s.m, s.n, s.n};
      reference::execute<double>(MatrixRef<double>::row_major(h.data(), s.m, s.k),
                                 MatrixRef<double>::row_major(w.data(), s.n, s.k), p, tiles);
      const programs::CrossEntropyOptions opt{};
      const auto ref = programs::fold_lse_loss<double>(pmax.data(), psum.data(), layout, tl.data(),
                                                       tgt.data(), s.n, opt);
      const V gmax = as_double(dmax.download()), gsum = as_double(dsum.download());
      const V gtl = as_double(dtl.download());
      const auto ours = programs::fold_lse_loss<double>(gmax.data(), gsum.data(), layout,
                                                        gtl.data(), tgt.data(), s.n, opt);
      // PyTorch: logits = bf16(bf16(y) r); lse and the target logit from those.
      const V y = gemm_ref(h, w, s);
      V lse_pt(s.m), tl_pt(s.m), logit_pt(size_t(s.m) * s.n);
      for (int i = 0; i < s.m; ++i) {
        double mx = -INFINITY, se = 0;
        for (int j = 0; j < s.n; ++j) {
          const size_t e = size_t(i) * s.n + j;
          logit_pt[e] = round_bf16(round_bf16(y[e]) * rd[i]);
          mx = std::max(mx, logit_pt[e]);
        }
        for (int j = 0; j < s.n; ++j) se += std::exp(logit_pt[size_t(i) * s.n + j] - mx);
        lse_pt[i] = mx + std::log(se);
        tl_pt[i] = tgt[i] >= 0 ? logit_pt[size_t(i) * s.n + tgt[i]] : 0.0;
      }
      V tl_gpu(s.m), tl_ref(s.m);
      for (int i = 0; i < s.m; ++i) {
        tl_gpu[i] = tgt[i] >= 0 ? gtl[i] : 0.0;  // ignored rows: never written, by design
        tl_ref[i] = tgt[i] >= 0 ? tl[i] : 0.0;
      }
      const std::string l = std::string(program_name(prog)) + " " + label(c, s);
      for (int i = 0; i < s.m; ++i) {
        if (tgt[i] < 0 ||
            std::abs(tl_gpu[i] - tl_ref[i]) <= 2 * std::abs(tl_pt[i] - tl_ref[i]) + 1e-6)
          continue;
        // Diagnose the first wrong row: which reference logit equals what the GPU wrote?
        int match = -1;
        for (int j = 0; j < s.n; ++j)
          if (std::abs(logits[size_t(i) * s.n + j] - tl_gpu[i]) < 1e-2 * (1 + std::abs(tl_gpu[i])))
            match = j;
        ADD_FAILURE() << l << ": row " << i << " target " << tgt[i] << " gpu " << tl_gpu[i]
                      << " ref " << tl_ref[i] << " (gpu value is the ref logit of column " << match
                      << "); gpu max/sum tile0 " << gmax[layout.index(i, 0)] << "/"
                      << gsum[layout.index(i, 0)] << " ref " << pmax[layout.index(i, 0)] << "/"
                      << psum[layout.index(i, 0)];
        break;
      }
      expect_rule("lse " + l, ours.lse, ref.lse, lse_pt);
      expect_rule("target logit " + l, tl_gpu, tl_ref, tl_pt);
      EXPECT_NEAR(ours.loss, ref.loss,
                  2 * std::abs(ref.loss -
                               [&] {
                                 double t = 0;
                                 int64_t n = 0;
                                 for (int i = 0; i < s.m; ++i)
                                   if (tgt[i] >= 0) t += lse_pt[i] - tl_pt[i], ++n;
                                 return t / n;
                               }()) +
                      1e-6)
          << l;
      if (prog == Program::kRmsnormLseLogits) {
        const PaddedRows got = download_bf16_rows(dlog, s.m, s.n, ldl);
        expect_rule("logits " + l, got.values, logits, logit_pt);
        EXPECT_TRUE(got.padding_ok) << l << ": " << got.describe();
      }
    }
}

// F0 (first layer) and A1 (the Σx² fold to r) against the CPU reference.
TEST_F(GpuKernelTest, FirstLayerRmsnormAndRstdFoldMatchReference) {
  testing::Rng rng(7);
  for (const Shape& s : kShapes) {
    if (skip_large(s)) continue;
    const int M = s.m, H = s.n;
    const double eps = 1e-5;
    const V x = testing::bf16_uniform(size_t(M) * H, -3, 3, rng);
    const V gamma = testing::bf16_uniform(H, 0.5, 1.5, rng);
    auto dx = upload_bf16(x), dg = upload_bf16(gamma);
    DeviceBuffer<bf16> dh(size_t(M) * H);
    DeviceBuffer<float> dr(M), dr2(M);
    dh.poison();
    dr.poison();
    dr2.poison();
    first_layer_rmsnorm(dx.get(), dg.get(), M, H, static_cast<float>(eps), dh.get(), dr.get(),
                        nullptr);
    // A1 on partials of the same rows: three tiles that split each row's Σx².
    const auto layout = epilogue::PartialLayout::per_row(M, H, 128, (H + 2) / 3);
    std::vector<float> part(layout.elements(), 0.f);
    for (int i = 0; i < M; ++i)
      for (int j = 0; j < H; ++j)
        part[layout.index(i, j / ((H + 2) / 3))] +=
            float(x[size_t(i) * H + j] * x[size_t(i) * H + j]);
    DeviceBuffer<float> dpart(part);
    fold_rstd(dpart.get(), M, layout.extent, layout.tiles, H, static_cast<float>(eps), dr2.get(),
              nullptr);
    CODA_CUDA_CHECK(cudaDeviceSynchronize());

    V h(size_t(M) * H), r(M);
    programs::first_layer_rmsnorm<double>({x.data(), M, H, H}, {gamma.data(), H}, eps,
                                          {h.data(), M, H, H}, r.data());
    // PyTorch: h = bf16(x γ); r from an fp32 mean of bf16 squares.
    V h_pt(h.size()), r_pt(M);
    for (int i = 0; i < M; ++i) {
      float ss = 0.f;
      for (int j = 0; j < H; ++j) {
        const double v = x[size_t(i) * H + j];
        h_pt[size_t(i) * H + j] = round_bf16(v * gamma[j]);
        ss += float(v * v);
      }
      r_pt[i] = 1.0 / std::sqrt(double(ss / float(H)) + eps);
    }
    const auto rg = dr.download(), rg2 = dr2.download();
    const std::string l = "M=" + std::to_string(M) + " H=" + std::to_string(H);
    expect_rule("F0 h " + l, download_bf16(dh), h, h_pt);
    expect_rule("F0 r " + l, V(rg.begin(), rg.end()), r, r_pt);
    expect_rule("A1 r " + l, V(rg2.begin(), rg2.end()), r, r_pt);
  }
}

TEST_F(GpuKernelTest, RmsnormLseMatchesReferenceWithRaggedVocab) {
  check_lse<Program::kRmsnormLse>();
}
TEST_F(GpuKernelTest, RmsnormLseLogitsMatchesReference) { check_lse<Program::kRmsnormLseLogits>(); }

}  // namespace
}  // namespace coda::kernel
