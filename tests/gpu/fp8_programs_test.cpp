// The FP8 programs (F2's a, B1's h_out, B2's dz quantized in the epilogue; F2 / B2 with z in FP8
// against the same programs with z in bf16, byte for byte; F3 on FP8 operands;
// F1's h is in fp8_gemm_test.cu) against the host recipe, on fresh random inputs over ragged shapes
// (M = 1, 130, 300, 4097; N not a multiple of 128; a unit of F2's tile pairs half past N):
//   - the bf16 outputs (z, dx, and a, h_out and dz as the staged bf16 copy the kernel can write)
//     and the partials against the program's functors on the GEMM of the dequantized operands in
//     fp64 (reference/fp8_programs.hpp), by the FP8 GEMM tolerance of fp8_check.hpp;
//   - the codes and scales, rows and the transposed copy, byte for byte against the host recipe's
//     quantization of the kernel's own bf16 values (what the cast kernel writes for them, which
//     fp8_gemm_test.cu checks byte for byte against the same recipe).
// Every output is poisoned first. Skipped with a message when no Hopper GPU is present.

#include "coda/reference/fp8_programs.hpp"

#include <gtest/gtest.h>

#include <stdexcept>
#include <string>
#include <vector>

#include "coda/kernel/aux_kernels.hpp"
#include "coda/kernel/cuda_check.hpp"
#include "coda/kernel/quantize.hpp"
#include "coda/ops.hpp"
#include "coda/programs/formulas.hpp"
#include "coda/programs/rope.hpp"
#include "support/fp8_check.hpp"
#include "support/gpu_check.hpp"

namespace coda::kernel {
namespace {

// The one configuration table.def compiles each FP8 program for (F2, F2z, B2 and B2z on the
// overlapped promotion, the others on CUTLASS's loop; the tiles are all 128x128).
Config config_of(Program p) {
  const std::vector<Config> configs = compiled_configs(p, Operands::kFp8XWt);
  if (configs.size() != 1)
    throw std::logic_error(std::string("expected one compiled configuration of ") +
                           program_name(p) + ", found " + std::to_string(configs.size()));
  return configs.front();
}

// A quantized output on the device: codes (rows, cols) with 1x128 scales and the transposed copy
// (cols, rows padded to 16) with its scales, all poisoned.
struct QuantizedOut {
  int64_t rows, cols;
  DeviceBuffer<uint8_t> codes, codes_t;
  DeviceBuffer<float> scales, scales_t;
  QuantizedOut(int64_t r, int64_t c)
      : rows(r),
        cols(c),
        codes(size_t(r * c)),
        codes_t(size_t(c * pad(r, 16))),
        scales(size_t(pad(c, 128) / 128 * pad(r, 4))),
        scales_t(size_t(pad(r, 128) / 128 * c)) {
    codes.poison();
    codes_t.poison();
    scales.poison();
    scales_t.poison();
  }
  Fp8Output rows_out() { return {codes.get(), cols, scales.get(), pad(rows, 4)}; }
  Fp8Output cols_out() { return {codes_t.get(), pad(rows, 16), scales_t.get(), cols}; }

  // The transposed copy alone against the recipe.
  void expect_quantizes_copy(const std::string& what, const std::vector<double>& v) const {
    const auto qt =
        reference::quantize_blockwise(MatrixRef<double>::transposed(v.data(), cols, rows), 1, 128);
    expect_same_bytes(what + "ᵀ codes", codes_t.download(), padded_codes(qt, pad(rows, 16)));
    expect_same_floats(what + "ᵀ scales", scales_t.download(), row_scales(qt, cols));
  }
  // The rows alone (1x128 blocks) against the recipe.
  void expect_quantizes_rows(const std::string& what, const std::vector<double>& v) const {
    const auto q =
        reference::quantize_blockwise(MatrixRef<double>::row_major(v.data(), rows, cols), 1, 128);
    expect_same_bytes(what + " codes", codes.download(), q.codes);
    expect_same_floats(what + " scales", scales.download(), row_scales(q, pad(rows, 4)));
  }
  // Everything the same bytes as `o`'s (another run's outputs).
  void expect_same_as(const std::string& what, const QuantizedOut& o) const {
    expect_same_bytes(what + " codes", codes.download(), o.codes.download());
    expect_same_floats(what + " scales", scales.download(), o.scales.download());
    expect_same_bytes(what + "ᵀ codes", codes_t.download(), o.codes_t.download());
    expect_same_floats(what + "ᵀ scales", scales_t.download(), o.scales_t.download());
  }
  // Both copies against the recipe's quantization of v (rows, cols), the kernel's bf16 values.
  void expect_quantizes(const std::string& what, const std::vector<double>& v) const {
    const auto q =
        reference::quantize_blockwise(MatrixRef<double>::row_major(v.data(), rows, cols), 1, 128);
    const auto qt =
        reference::quantize_blockwise(MatrixRef<double>::transposed(v.data(), cols, rows), 1, 128);
    expect_same_bytes(what + " codes", codes.download(), q.codes);
    expect_same_floats(what + " scales", scales.download(), row_scales(q, pad(rows, 4)));
    expect_same_bytes(what + "ᵀ codes", codes_t.download(), padded_codes(qt, pad(rows, 16)));
    expect_same_floats(what + "ᵀ scales", scales_t.download(), row_scales(qt, cols));
  }
};

// The partials a kernel defines, and the reference's: entries past `valid` rows (per_row) or
// columns (per_column) of the padded extent are not outputs, and are zeroed in both.
std::vector<double> defined_partials(const std::vector<float>& got, std::vector<double>& ref,
                                     const epilogue::PartialLayout& l, int64_t valid) {
  std::vector<double> out(got.begin(), got.end());
  for (int64_t t = 0; t < l.tiles; ++t)
    for (int64_t i = valid; i < l.extent; ++i) out[l.index(i, t)] = ref[l.index(i, t)] = 0.0;
  return out;
}

std::string at(const Shape& s) {
  return "M=" + std::to_string(s.m) + " N=" + std::to_string(s.n) + " K=" + std::to_string(s.k);
}

// F2 with FP8 a: {M, 2I, K}. 2I = 384 leaves the second tile of a unit past N; 2752 ends in a
// partial tile (a's last block 96 columns wide).
TEST_F(GpuKernelTest, Fp8RmsnormSwigluQuantizesAAsTheRecipe) {
  testing::Rng rng(21);
  const Shape shapes[] = {{1, 256, 144},    {130, 384, 272},   {300, 2752, 1040},
                          {4097, 512, 272}, {256, 1024, 2048}, {19, 4096, 128}};
  for (const Shape& s : shapes) {
    if (skip_large(s)) continue;
    const int64_t m = s.m, two_i = s.n, inter = two_i / 2;
    const auto qh = quantized(wide_values(m, s.k, rng), s.m, s.k, 1);
    const auto qw = quantized(wide_values(two_i, s.k, rng), s.n, s.k, 128);
    const std::vector<double> r = testing::bf16_uniform(size_t(m), 0.5, 1.5, rng);
    const Fp8Operand dh = upload_rows(qh), dw = upload_blocks(qw);
    DeviceBuffer<float> dr(std::vector<float>(r.begin(), r.end()));
    DeviceBuffer<bf16> z(size_t(m * two_i)), a_copy(size_t(m * inter));
    z.poison();
    a_copy.poison();
    QuantizedOut a(m, inter);
    GemmProblem p = fp8_problem(s, dh, dw);
    p.d = z.get();
    p.ldd = two_i;
    run<Program::kRmsnormSwigluFp8>(config_of(Program::kRmsnormSwigluFp8), p,
                                    {dr.get(), a.rows_out(), a.cols_out(), a_copy.get(), inter},
                                    Operands::kFp8XWt);

    const auto ref = reference::fp8_rmsnorm_swiglu<double>(qh, qw, r);
    const std::vector<double> a_got = download_bf16(a_copy);
    expect_close("z " + at(s), download_bf16(z), ref.z);
    expect_close("a " + at(s), a_got, ref.a);
    a.expect_quantizes("a " + at(s), a_got);
  }
}

// F3 on FP8 operands: GQA layouts, long positions, with and without the q/k/v bias; head_dim 48
// leaves the last tile ragged.
TEST_F(GpuKernelTest, Fp8RmsnormRopeMatchesTheRecipe) {
  testing::Rng rng(24);
  const programs::QkvLayout layouts[] = {{3, 1, 64}, {4, 2, 128}, {2, 1, 48}};
  for (const auto& ql : layouts)
    for (int m : {1, 130, 4097})
      for (bool with_bias : {false, true}) {
        const Shape s{m, ql.width(), 272};
        if (skip_large(s)) continue;
        const auto qh = quantized(wide_values(s.m, s.k, rng), s.m, s.k, 1);
        const auto qw = quantized(wide_values(s.n, s.k, rng), s.n, s.k, 128);
        const std::vector<double> r = testing::bf16_uniform(size_t(s.m), 0.3, 3, rng);
        const std::vector<double> b =
            with_bias ? testing::bf16_uniform(size_t(s.n), -4, 4, rng) : std::vector<double>{};
        std::vector<int32_t> pos(size_t(s.m));
        for (int32_t& p : pos) p = int32_t(rng.integer(0, 1 << 17));
        const auto table = programs::rope_column_table(
            ql, programs::rope_inv_freq(ql.head_dim, 500000.0, {.enabled = true}));
        std::vector<uint32_t> hi, lo;
        ops::split_rope_table(table, hi, lo);
        const Fp8Operand dh = upload_rows(qh), dw = upload_blocks(qw);
        DeviceBuffer<float> dr(std::vector<float>(r.begin(), r.end()));
        auto db = upload_bf16(with_bias ? b : std::vector<double>(8, 0.0));
        DeviceBuffer<int32_t> dpos(pos);
        DeviceBuffer<uint32_t> dhi(hi), dlo(lo);
        DeviceBuffer<bf16> qkv(size_t(s.m) * s.n);
        qkv.poison();
        GemmProblem p = fp8_problem(s, dh, dw);
        p.d = qkv.get();
        p.ldd = s.n;
        run<Program::kRmsnormRope>(
            config_of(Program::kRmsnormRope), p,
            {dr.get(), with_bias ? db.get() : nullptr, dpos.get(), dhi.get(), dlo.get()},
            Operands::kFp8XWt);
        expect_close("qkv " + at(s) + (with_bias ? " bias" : ""), download_bf16(qkv),
                     reference::fp8_rmsnorm_rope<double>(qh, qw, r, b, pos, table));
      }
}

// F3q (QK-norm, Qwen3) on FP8 operands: head_dim 128, 64, 32 and 8, GQA, N = 320 leaves a
// 64-column last tile; qkv and qk_pre against the program on the dequantized operands.
TEST_F(GpuKernelTest, Fp8RmsnormQkNormRopeMatchesTheRecipe) {
  testing::Rng rng(25);
  const programs::QkvLayout layouts[] = {{4, 2, 128}, {3, 1, 64}, {2, 2, 32}, {6, 3, 8}};
  for (const auto& ql : layouts)
    for (int m : {1, 130, 4097}) {
      const Shape s{m, ql.width(), 272};
      if (skip_large(s)) continue;
      const programs::QkNorm qk{ql, 1e-6};
      const int d = ql.head_dim, normed = int(qk.normed_width());
      const auto qh = quantized(wide_values(s.m, s.k, rng), s.m, s.k, 1);
      const auto qw = quantized(wide_values(s.n, s.k, rng), s.n, s.k, 128);
      const std::vector<double> r = testing::bf16_uniform(size_t(s.m), 0.3, 3, rng),
                                qg = testing::bf16_uniform(size_t(d), 0.5, 1.5, rng),
                                kg = testing::bf16_uniform(size_t(d), 0.5, 1.5, rng);
      std::vector<int32_t> pos(size_t(s.m));
      for (int32_t& p : pos) p = int32_t(rng.integer(0, 1 << 17));
      const auto table = programs::rope_column_table(ql, programs::rope_inv_freq(d, 1000000.0, {}));
      std::vector<uint32_t> hi, lo;
      ops::split_rope_table(table, hi, lo);
      const Fp8Operand dh = upload_rows(qh), dw = upload_blocks(qw);
      DeviceBuffer<float> dr(std::vector<float>(r.begin(), r.end()));
      auto dqg = upload_bf16(qg), dkg = upload_bf16(kg);
      DeviceBuffer<int32_t> dpos(pos);
      DeviceBuffer<uint32_t> dhi(hi), dlo(lo);
      DeviceBuffer<bf16> qkv(size_t(s.m) * s.n), pre(size_t(s.m) * normed);
      qkv.poison();
      pre.poison();
      const RmsnormQkNormRopeArgs args =
          qk_norm_rope_args(qk, dr.get(), dqg.get(), dkg.get(), dpos.get(), dhi.get(), dlo.get(),
                            qkv.get(), pre.get());
      GemmProblem p = fp8_problem(s, dh, dw);  // no D: the node stores qkv and qk_pre
      p.ldd = s.n;
      run<Program::kRmsnormQkNormRope>(config_of(Program::kRmsnormQkNormRope), p, args,
                                       Operands::kFp8XWt);
      const auto want =
          reference::fp8_rmsnorm_qk_norm_rope<double>(qh, qw, r, qg, kg, qk, pos, table);
      expect_close("qkv " + at(s) + " d=" + std::to_string(d), download_bf16(qkv), want.qkv);
      expect_close("qk_pre " + at(s) + " d=" + std::to_string(d), download_bf16(pre), want.qk_pre);
    }
}

// B1 on FP8 operands with h_out's transposed copy quantized: {M, H, K}, K the consumer's width
// (dz's columns). One shape accumulates in place (dx aliases dres); one runs without dres (C is
// the poisoned dx and must not be read).
TEST_F(GpuKernelTest, Fp8RmsnormBackwardQuantizesHOutAsTheRecipe) {
  testing::Rng rng(22);
  const Shape shapes[] = {
      {1, 272, 144}, {130, 128, 400}, {300, 400, 1040}, {4097, 272, 272}, {256, 1024, 2048}};
  for (const Shape& s : shapes) {
    if (skip_large(s)) continue;
    const int64_t m = s.m, hid = s.n;
    const bool in_place = s.m == 300, absent = s.m == 130;
    const auto qdz = quantized(wide_values(m, s.k, rng), s.m, s.k, 1);
    const auto qwt = quantized(wide_values(hid, s.k, rng), s.n, s.k, 128);  // Wᵀ (H, K)
    const std::vector<double> x = testing::bf16_uniform(size_t(m * hid), -2, 2, rng),
                              dres = testing::bf16_uniform(size_t(m * hid), -1, 1, rng),
                              gam = testing::bf16_uniform(size_t(hid), 0.5, 1.5, rng),
                              r = testing::bf16_uniform(size_t(m), 0.5, 1.5, rng),
                              zdz = testing::bf16_uniform(size_t(m), -0.1, 0.1, rng);
    const Fp8Operand ddz = upload_rows(qdz), dwt = upload_blocks(qwt);
    auto dx_in = upload_bf16(x), dres_in = upload_bf16(dres), dgam = upload_bf16(gam);
    DeviceBuffer<float> dr(std::vector<float>(r.begin(), r.end())),
        dzdz(std::vector<float>(zdz.begin(), zdz.end()));
    DeviceBuffer<bf16> dx(size_t(m * hid)), h_copy(size_t(m * hid));
    dx.poison();
    h_copy.poison();
    const auto layout = epilogue::PartialLayout::per_column(m, hid, 128, 128);
    DeviceBuffer<float> dgamma(size_t(layout.tiles * layout.extent));
    dgamma.poison();
    QuantizedOut q(m, hid);
    GemmProblem p = fp8_problem(s, ddz, dwt);
    p.c = absent ? dx.get() : dres_in.get();
    p.ldc = hid;
    p.d = in_place ? dres_in.get() : dx.get();
    p.ldd = hid;
    const RmsnormBackwardArgs b1{dx_in.get(), hid, dr.get(),     dgam.get(), dzdz.get(),
                                 nullptr,     0,   dgamma.get(), !absent};
    run<Program::kRmsnormBackwardFp8>(config_of(Program::kRmsnormBackwardFp8), p,
                                      {b1, q.cols_out(), h_copy.get(), hid}, Operands::kFp8XWt);

    auto ref = reference::fp8_rmsnorm_backward<double>(qdz, qwt, x, r, gam, zdz,
                                                       absent ? std::vector<double>{} : dres);
    const std::string what = at(s) + (in_place ? " in place" : absent ? " without dres" : "");
    expect_close("dx " + what, download_bf16(in_place ? dres_in : dx), ref.dx);
    expect_close("dγ partials " + what,
                 defined_partials(dgamma.download(), ref.dgamma_partials, layout, hid),
                 ref.dgamma_partials);
    const std::vector<double> h_got = download_bf16(h_copy);
    expect_close("h_out " + what, h_got, ref.h);
    q.expect_quantizes_copy("h_out " + what, h_got);
  }
}

// F2 with z in FP8 as well: z's codes and scales are the recipe's of the bf16 z that
// kRmsnormSwigluFp8 writes on the same operands (the same mainloop, so the same accumulators),
// byte for byte, and a's outputs are that program's.
TEST_F(GpuKernelTest, Fp8RmsnormSwigluWithFp8ZQuantizesZAsTheRecipe) {
  testing::Rng rng(25);
  const Shape shapes[] = {{1, 256, 144}, {130, 384, 272}, {300, 2752, 1040}, {4097, 512, 272}};
  for (const Shape& s : shapes) {
    if (skip_large(s)) continue;
    const int64_t m = s.m, two_i = s.n, inter = two_i / 2;
    const auto qh = quantized(wide_values(m, s.k, rng), s.m, s.k, 1);
    const auto qw = quantized(wide_values(two_i, s.k, rng), s.n, s.k, 128);
    const std::vector<double> r = testing::bf16_uniform(size_t(m), 0.5, 1.5, rng);
    const Fp8Operand dh = upload_rows(qh), dw = upload_blocks(qw);
    DeviceBuffer<float> dr(std::vector<float>(r.begin(), r.end()));
    DeviceBuffer<bf16> z(size_t(m * two_i));
    z.poison();
    QuantizedOut a(m, inter), a_z(m, inter), zq(m, two_i);
    GemmProblem p = fp8_problem(s, dh, dw);
    p.d = z.get();
    p.ldd = two_i;
    run<Program::kRmsnormSwigluFp8>(config_of(Program::kRmsnormSwigluFp8), p,
                                    {dr.get(), a.rows_out(), a.cols_out()}, Operands::kFp8XWt);
    RmsnormSwigluFp8ZArgs args;
    args.f2 = {dr.get(), a_z.rows_out(), a_z.cols_out()};
    args.z = zq.rows_out();
    run<Program::kRmsnormSwigluFp8Z>(config_of(Program::kRmsnormSwigluFp8Z), fp8_problem(s, dh, dw),
                                     args, Operands::kFp8XWt);
    zq.expect_quantizes_rows("z " + at(s), download_bf16(z));
    a_z.expect_same_as("a " + at(s), a);
  }
}

// B2 from an FP8 z: every output byte for byte kSwigluBackwardFp8's on the decoded z in bf16
// (exact there), the ZdZ partials bit for bit.
TEST_F(GpuKernelTest, Fp8SwigluBackwardWithFp8ZIsB2OfTheDecodedZ) {
  testing::Rng rng(27);
  const Shape shapes[] = {{1, 128, 144}, {130, 200, 272}, {300, 456, 1040}, {4097, 128, 272}};
  for (const Shape& s : shapes) {
    if (skip_large(s)) continue;
    const int64_t m = s.m, inter = s.n;
    const auto qdx = quantized(wide_values(m, s.k, rng), s.m, s.k, 1);
    const auto qwdt = quantized(wide_values(inter, s.k, rng), s.n, s.k, 128);
    // z over many binades: its blocks' scales differ, so a wrong block or row of scale shows.
    const auto qz = quantized(wide_values(m, 2 * inter, rng), m, 2 * inter, 1);
    const Fp8Operand ddx = upload_rows(qdx), dwdt = upload_blocks(qwdt), dzq = upload_rows(qz);
    auto z_dec = upload_bf16(qz.dequantized());
    const auto layout = epilogue::PartialLayout::per_row(m, inter, 128, 128);
    DeviceBuffer<float> zdz(size_t(layout.tiles * layout.extent)),
        zdz_z(size_t(layout.tiles * layout.extent));
    zdz.poison();
    zdz_z.poison();
    QuantizedOut q(m, 2 * inter), q_z(m, 2 * inter);
    SwigluBackwardFp8Args args;
    args.z = reinterpret_cast<const uint32_t*>(z_dec.get());
    args.ldz = inter;
    args.zdz_partials = zdz.get();
    args.dz = q.rows_out();
    args.dz_t = q.cols_out();
    run<Program::kSwigluBackwardFp8>(config_of(Program::kSwigluBackwardFp8),
                                     fp8_problem(s, ddx, dwdt), args, Operands::kFp8XWt);
    SwigluBackwardFp8ZArgs zargs;
    zargs.z = reinterpret_cast<const uint16_t*>(dzq.codes.get());
    zargs.ldz = inter;
    zargs.z_scales = dzq.scales.get();
    zargs.ld_z_scales = dzq.ld_scales;
    zargs.zdz_partials = zdz_z.get();
    zargs.dz = q_z.rows_out();
    zargs.dz_t = q_z.cols_out();
    run<Program::kSwigluBackwardFp8Z>(config_of(Program::kSwigluBackwardFp8Z),
                                      fp8_problem(s, ddx, dwdt), zargs, Operands::kFp8XWt);
    q_z.expect_same_as("dz " + at(s), q);
    const std::vector<float> plain = zdz.download();
    std::vector<double> want(plain.begin(), plain.end());  // kSwigluBackwardFp8's
    const std::vector<double> got = defined_partials(zdz_z.download(), want, layout, m);
    expect_same_floats("ZdZ partials " + at(s), std::vector<float>(got.begin(), got.end()),
                       std::vector<float>(want.begin(), want.end()));
  }
}

// a's transposed copy recomputed from an FP8 z: byte for byte the cast kernel's from the decoded
// z in bf16.
TEST_F(GpuKernelTest, SwigluCopyFromFp8ZIsThatOfTheDecodedZ) {
  testing::Rng rng(29);
  const int64_t sizes[][2] = {{1, 16}, {130, 272}, {4097, 128}, {300, 1040}};
  for (const auto& mi : sizes) {
    const int64_t m = mi[0], inter = mi[1];
    const auto qz = quantized(wide_values(m, 2 * inter, rng), m, 2 * inter, 1);  // many scales
    const Fp8Operand dzq = upload_rows(qz);
    auto z_dec = upload_bf16(qz.dequantized());
    QuantizedOut a(m, inter), a_z(m, inter);
    quantize_fp8_swiglu_t(z_dec.get(), m, inter, 2 * inter, a.cols_out(), nullptr);
    quantize_fp8_swiglu_t_fp8_z(dzq.codes.get(), m, inter, 2 * inter, dzq.scales.get(),
                                dzq.ld_scales, a_z.cols_out(), nullptr);
    CODA_CUDA_CHECK(cudaDeviceSynchronize());
    const std::string what = "a from z (" + std::to_string(m) + ", " + std::to_string(inter) + ")";
    expect_same_bytes(what + "ᵀ codes", a_z.codes_t.download(), a.codes_t.download());
    expect_same_floats(what + "ᵀ scales", a_z.scales_t.download(), a.scales_t.download());
  }
}

// B2 with FP8 dz: {M, I, H}. I = 200: the last tile's second part is 16 columns of dz wide.
TEST_F(GpuKernelTest, Fp8SwigluBackwardQuantizesDzAsTheRecipe) {
  testing::Rng rng(23);
  const Shape shapes[] = {
      {1, 128, 144}, {130, 200, 272}, {300, 456, 1040}, {4097, 128, 272}, {256, 512, 2048}};
  for (const Shape& s : shapes) {
    if (skip_large(s)) continue;
    const int64_t m = s.m, inter = s.n;
    const auto qdx = quantized(wide_values(m, s.k, rng), s.m, s.k, 1);
    const auto qwdt = quantized(wide_values(inter, s.k, rng), s.n, s.k, 128);  // W_downᵀ (I, H)
    const std::vector<double> z = testing::bf16_uniform(size_t(m * 2 * inter), -3, 3, rng);
    const Fp8Operand ddx = upload_rows(qdx), dwdt = upload_blocks(qwdt);
    auto dz_in = upload_bf16(z);
    DeviceBuffer<bf16> dz_copy(size_t(m * 2 * inter));
    dz_copy.poison();
    const auto layout = epilogue::PartialLayout::per_row(m, inter, 128, 128);
    DeviceBuffer<float> zdz(size_t(layout.tiles * layout.extent));
    zdz.poison();
    QuantizedOut q(m, 2 * inter);
    const GemmProblem p = fp8_problem(s, ddx, dwdt);
    SwigluBackwardFp8Args args;
    args.z = reinterpret_cast<const uint32_t*>(dz_in.get());
    args.ldz = inter;
    args.zdz_partials = zdz.get();
    args.dz = q.rows_out();
    args.dz_t = q.cols_out();
    args.dz_copy = dz_copy.get();
    args.ld_dz_copy = 2 * inter;
    run<Program::kSwigluBackwardFp8>(config_of(Program::kSwigluBackwardFp8), p, args,
                                     Operands::kFp8XWt);

    auto ref = reference::fp8_swiglu_backward<double>(qdx, qwdt, z);
    const std::vector<double> dz_got = download_bf16(dz_copy);
    expect_close("dz " + at(s), dz_got, ref.dz);
    expect_close("ZdZ partials " + at(s),
                 defined_partials(zdz.download(), ref.zdz_partials, layout, m), ref.zdz_partials);
    q.expect_quantizes("dz " + at(s), dz_got);
  }
}

// F2 split with z in FP8: the pass over a plain GEMM's bf16 y (rmsnorm_swiglu_quantize_fp8), from
// fresh random y and r: z's codes byte for byte the recipe's quantization of bf16(r·y) (one fp32
// product: exact to reproduce on the host), a's bf16 copy against silu(z_g)·z_u in fp64 and its
// codes (both copies) byte for byte the recipe's quantization of that copy. {M, I}: I = 144 ends
// in a 16-column tile of a (z's last block 32 columns wide); M = 130 and 4097 in partial tiles.
TEST_F(GpuKernelTest, Fp8RmsnormSwigluSplitPassMatchesTheRecipe) {
  testing::Rng rng(41);
  const int64_t sizes[][2] = {{1, 128}, {130, 144}, {300, 528}, {4097, 128}};
  for (const auto& mi : sizes) {
    const int64_t m = mi[0], inter = mi[1];
    const std::string what = "split F2 (" + std::to_string(m) + ", " + std::to_string(inter) + ")";
    const auto y = testing::bf16_uniform(size_t(m * 2 * inter), -3, 3, rng);
    std::vector<float> r(static_cast<size_t>(m));
    for (auto& v : r) v = float(0.5 + rng.uniform());
    auto d_y = upload_bf16(y);
    DeviceBuffer<float> d_r(r);
    DeviceBuffer<bf16> copy(size_t(m * inter));
    copy.poison();
    QuantizedOut z(m, 2 * inter), a(m, inter);
    rmsnorm_swiglu_quantize_fp8(d_y.get(), 2 * inter, d_r.get(), m, inter, z.rows_out(),
                                a.rows_out(), a.cols_out(), nullptr, copy.get(), inter);
    CODA_CUDA_CHECK(cudaDeviceSynchronize());
    std::vector<double> z_pass(size_t(m * 2 * inter)), a_ref(size_t(m * inter));
    for (int64_t i = 0; i < m; ++i)
      for (int64_t n = 0; n < inter; ++n) {
        const size_t e = size_t(i * 2 * inter + 2 * n);
        z_pass[e] = testing::round_bf16(r[size_t(i)] * float(y[e]));
        z_pass[e + 1] = testing::round_bf16(r[size_t(i)] * float(y[e + 1]));
        const double ri = r[size_t(i)];
        a_ref[size_t(i * inter + n)] = epilogue::SwiGlu{}(ri * y[e], ri * y[e + 1]);
      }
    z.expect_quantizes_rows(what + " z", z_pass);
    const std::vector<double> a_got = download_bf16(copy);
    expect_close(what + " a", a_got, a_ref);
    a.expect_quantizes(what + " a", a_got);
  }
}

// B1 split: the pass over a plain GEMM's bf16 g (rmsnorm_backward_quantize_fp8), from fresh random
// inputs with and without dres: dx and the dγ partials against the program's functors in fp64, and
// h_out's transposed copy byte for byte the recipe's quantization of bf16(x·r·γ) computed in fp32
// as the pass computes it (products only: exact to reproduce on the host). {M, H}: H = 144 ends in
// a 16-column tile, M = 130 and 4097 in partial row tiles.
TEST_F(GpuKernelTest, Fp8RmsnormBackwardSplitPassMatchesTheRecipe) {
  testing::Rng rng(37);
  const int64_t sizes[][2] = {{1, 128}, {130, 144}, {300, 1040}, {4097, 272}};
  for (const auto& mh : sizes) {
    const int64_t m = mh[0], hidden = mh[1];
    for (const bool with_dres : {true, false}) {
      const std::string what = "split B1 (" + std::to_string(m) + ", " + std::to_string(hidden) +
                               (with_dres ? ", dres)" : ")");
      const auto g = testing::bf16_uniform(size_t(m * hidden), -2, 2, rng);
      const auto x = testing::bf16_uniform(size_t(m * hidden), -3, 3, rng);
      const auto dres = testing::bf16_uniform(size_t(m * hidden), -1, 1, rng);
      const auto gamma = testing::bf16_uniform(size_t(hidden), 0.5, 1.5, rng);
      std::vector<float> r(static_cast<size_t>(m)), zdz(static_cast<size_t>(m));
      for (auto& v : r) v = float(0.5 + rng.uniform());
      for (auto& v : zdz) v = float(0.2 * rng.uniform() - 0.1);
      auto d_g = upload_bf16(g), d_x = upload_bf16(x), d_dres = upload_bf16(dres),
           d_gamma = upload_bf16(gamma);
      DeviceBuffer<float> d_r(r), d_zdz(zdz);
      DeviceBuffer<bf16> dx(size_t(m * hidden));
      dx.poison();
      const auto layout = epilogue::PartialLayout::per_column(m, hidden, 128, 128);
      DeviceBuffer<float> parts(size_t(layout.elements()));
      parts.poison();
      QuantizedOut h(m, hidden);
      rmsnorm_backward_quantize_fp8(d_g.get(), hidden, d_x.get(), hidden,
                                    with_dres ? d_dres.get() : nullptr, hidden, d_r.get(),
                                    d_gamma.get(), d_zdz.get(), m, hidden, dx.get(), hidden,
                                    h.cols_out(), parts.get(), layout.extent, nullptr);
      CODA_CUDA_CHECK(cudaDeviceSynchronize());
      std::vector<double> dx_ref(size_t(m * hidden)), h_pass(size_t(m * hidden)),
          parts_ref(size_t(layout.elements()), 0.0);
      for (int64_t i = 0; i < m; ++i)
        for (int64_t n = 0; n < hidden; ++n) {
          const size_t e = size_t(i * hidden + n);
          dx_ref[e] = programs::RmsnormBackwardDx{}(g[e], with_dres ? dres[e] : 0.0, x[e],
                                                    double(r[size_t(i)]), gamma[size_t(n)],
                                                    double(zdz[size_t(i)]));
          h_pass[e] = testing::round_bf16(
              programs::NormalizedScaled{}(float(x[e]), r[size_t(i)], float(gamma[size_t(n)])));
          parts_ref[size_t(layout.index(n, i / 128))] +=
              programs::GradTimesNormalized{}(g[e], x[e], double(r[size_t(i)]));
        }
      expect_close(what + " dx", download_bf16(dx), dx_ref);
      std::vector<float> got = parts.download();
      std::vector<double> got_d(got.begin(), got.end());
      for (int64_t t = 0; t < layout.tiles; ++t)  // columns past H are padding, not outputs
        for (int64_t n = hidden; n < layout.extent; ++n)
          got_d[size_t(layout.index(n, t))] = parts_ref[size_t(layout.index(n, t))] = 0.0;
      expect_close(what + " dγ partials", got_d, parts_ref);
      h.expect_quantizes_copy(what + " h_out", h_pass);
    }
  }
}

// B2 split: the pass over a plain GEMM's bf16 da (swiglu_backward_quantize_fp8), from fresh
// random da and z: the staged bf16 dz and the ZdZ partials against the program's functors in fp64
// (programs::SwigluBackward's math on the same da), the codes and scales of both copies byte for
// byte the recipe's quantization of the staged values, and from an FP8 z every output byte for
// byte the pass's on the decoded z in bf16. {M, I}: I = 200 ends in a dz tile 16 columns wide;
// I = 64 is one dz tile.
TEST_F(GpuKernelTest, Fp8SwigluBackwardSplitPassMatchesTheRecipe) {
  testing::Rng rng(31);
  const int64_t sizes[][2] = {{1, 128}, {130, 200}, {300, 456}, {4097, 128}, {256, 64}};
  for (const auto& mi : sizes) {
    const int64_t m = mi[0], inter = mi[1];
    const std::string what =
        "split B2 (" + std::to_string(m) + ", " + std::to_string(inter) + ")";
    const std::vector<double> da = testing::bf16_uniform(size_t(m * inter), -2, 2, rng);
    const std::vector<double> z = testing::bf16_uniform(size_t(m * 2 * inter), -3, 3, rng);
    auto d_da = upload_bf16(da), d_z = upload_bf16(z);
    const auto layout = epilogue::PartialLayout::per_row(m, inter, 128, 64);  // per dz tile
    DeviceBuffer<float> zdz(size_t(layout.elements()));
    zdz.poison();
    DeviceBuffer<bf16> copy(size_t(m * 2 * inter));
    copy.poison();
    QuantizedOut q(m, 2 * inter);
    swiglu_backward_quantize_fp8(d_da.get(), inter, d_z.get(), 2 * inter, nullptr, 0, m, inter,
                                 q.rows_out(), q.cols_out(), zdz.get(), layout.extent, nullptr,
                                 copy.get(), 2 * inter);
    CODA_CUDA_CHECK(cudaDeviceSynchronize());
    std::vector<double> dz_ref(size_t(m * 2 * inter)), zdz_ref(size_t(layout.elements()), 0.0);
    for (int64_t r = 0; r < m; ++r)
      for (int64_t n = 0; n < inter; ++n) {
        const double g = z[size_t(r * 2 * inter + 2 * n)], u = z[size_t(r * 2 * inter + 2 * n + 1)];
        double dg, du, a;
        epilogue::SwiGluBackward{}(g, u, da[size_t(r * inter + n)], dg, du, a);
        dz_ref[size_t(r * 2 * inter + 2 * n)] = dg;
        dz_ref[size_t(r * 2 * inter + 2 * n + 1)] = du;
        zdz_ref[size_t(layout.index(r, n / 64))] += programs::PairDot{}(g, u, dg, du);
      }
    const std::vector<double> dz_got = download_bf16(copy);
    expect_close(what + " dz", dz_got, dz_ref);
    expect_close(what + " ZdZ partials", defined_partials(zdz.download(), zdz_ref, layout, m),
                 zdz_ref);
    q.expect_quantizes(what + " dz", dz_got);

    // From z in FP8: the pass on the decoded z, byte for byte.
    const auto qz = quantized(wide_values(m, 2 * inter, rng), m, 2 * inter, 1);
    const Fp8Operand dzq = upload_rows(qz);
    auto z_dec = upload_bf16(qz.dequantized());
    QuantizedOut q_dec(m, 2 * inter), q_fp8(m, 2 * inter);
    DeviceBuffer<float> zdz_dec(size_t(layout.elements())), zdz_fp8(size_t(layout.elements()));
    zdz_dec.poison();
    zdz_fp8.poison();
    swiglu_backward_quantize_fp8(d_da.get(), inter, z_dec.get(), 2 * inter, nullptr, 0, m, inter,
                                 q_dec.rows_out(), q_dec.cols_out(), zdz_dec.get(), layout.extent,
                                 nullptr);
    swiglu_backward_quantize_fp8(d_da.get(), inter, dzq.codes.get(), 2 * inter, dzq.scales.get(),
                                 dzq.ld_scales, m, inter, q_fp8.rows_out(), q_fp8.cols_out(),
                                 zdz_fp8.get(), layout.extent, nullptr);
    CODA_CUDA_CHECK(cudaDeviceSynchronize());
    q_fp8.expect_same_as(what + " dz from an FP8 z", q_dec);
    const std::vector<float> plain = zdz_dec.download();
    std::vector<double> want(plain.begin(), plain.end());
    const std::vector<double> got = defined_partials(zdz_fp8.download(), want, layout, m);
    expect_same_floats(what + " ZdZ partials from an FP8 z",
                       std::vector<float>(got.begin(), got.end()),
                       std::vector<float>(want.begin(), want.end()));
  }
}

// B3 and its cast in one pass (the FP8 norm+QKV backward without a bias) against the two kernels
// it replaces, on random qkv, dqkv and positions with a LLaMA RoPE table (V heads at frequency
// 0): dpre's staged bf16 values byte for byte rope_backward's dqkv_pre, its codes and scales
// (rows and transposed copy) the recipe's quantization of them, the ZdZ partials against fp64
// sums per row and 128-column tile, and their fold over the tiles rope_backward's zdz to fp32
// rounding. Widths 512, 640 and 112 (not a multiple of 128: a last tile 112 columns wide).
TEST_F(GpuKernelTest, Fp8RopeBackwardPassIsTheCastOfRopeBackward) {
  testing::Rng rng(41);
  const programs::QkvLayout layouts[] = {{4, 2, 64}, {3, 1, 128}, {5, 1, 16}};
  for (const programs::QkvLayout& ql : layouts)
    for (const int64_t m : {int64_t(1), int64_t(130), int64_t(300), int64_t(4097)}) {
      const int64_t w = ql.width(), hidden = 256;
      const std::string what =
          "B3 + cast (M=" + std::to_string(m) + ", width " + std::to_string(w) + ")";
      const std::vector<double> y = testing::bf16_uniform(size_t(m * w), -2, 2, rng);
      const std::vector<double> dy = testing::bf16_uniform(size_t(m * w), -1, 1, rng);
      std::vector<int32_t> pos(static_cast<size_t>(m));
      for (auto& p : pos) p = static_cast<int32_t>(rng.integer(0, 1 << 17));
      const auto inv = programs::rope_inv_freq(ql.head_dim, 500000.0, {.enabled = true});
      const auto table = programs::rope_column_table(ql, inv);
      std::vector<uint32_t> hi, lo;
      ops::split_rope_table(table, hi, lo);
      auto d_y = upload_bf16(y), d_dy = upload_bf16(dy);
      DeviceBuffer<int32_t> d_pos(pos);
      DeviceBuffer<uint32_t> d_hi(hi), d_lo(lo);
      const auto layout = epilogue::PartialLayout::per_row(m, w, 128, 128);
      DeviceBuffer<float> partials(size_t(layout.elements())), zdz(static_cast<size_t>(m));
      DeviceBuffer<bf16> copy(size_t(m * w)), dpre(size_t(m * w));
      partials.poison();
      zdz.poison();
      copy.poison();
      dpre.poison();
      QuantizedOut q(m, w);
      rope_backward_quantize_fp8(d_y.get(), w, d_dy.get(), w, d_pos.get(), d_hi.get(), d_lo.get(),
                                 m, w, q.rows_out(), q.cols_out(), partials.get(), layout.extent,
                                 nullptr, copy.get(), w);
      rope_backward(d_y.get(), d_dy.get(), nullptr, d_pos.get(), d_hi.get(), d_lo.get(), m, w,
                    hidden, dpre.get(), zdz.get(), nullptr);
      CODA_CUDA_CHECK(cudaDeviceSynchronize());

      const std::vector<double> got = download_bf16(copy), unfused = download_bf16(dpre);
      size_t differ = 0, first = 0;
      for (size_t i = got.size(); i-- > 0;)
        if (got[i] != unfused[i]) ++differ, first = i;
      EXPECT_EQ(differ, 0u) << what << ": dpre differs from rope_backward's in " << differ
                            << " elements, first at " << first << " (" << got[first] << " vs "
                            << unfused[first] << ")";
      q.expect_quantizes(what + " dpre", got);

      std::vector<double> part_ref(size_t(layout.elements()), 0.0);
      for (int64_t r = 0; r < m; ++r)
        for (int64_t n = 0; n < w; ++n)
          part_ref[size_t(layout.index(r, n / 128))] +=
              y[size_t(r * w + n)] * dy[size_t(r * w + n)];
      const std::vector<float> part_got = partials.download();
      expect_close(what + " ZdZ partials", defined_partials(part_got, part_ref, layout, m),
                   part_ref);
      std::vector<double> folded(static_cast<size_t>(m), 0.0);
      for (int64_t r = 0; r < m; ++r) {
        for (int64_t t = 0; t < layout.tiles; ++t)
          folded[size_t(r)] += part_got[size_t(layout.index(r, t))];
        folded[size_t(r)] /= double(hidden);
      }
      const std::vector<float> zdz_unfused = zdz.download();
      expect_close(what + " ZdZ folded vs rope_backward's", folded,
                   std::vector<double>(zdz_unfused.begin(), zdz_unfused.end()));
    }
}

}  // namespace
}  // namespace coda::kernel
