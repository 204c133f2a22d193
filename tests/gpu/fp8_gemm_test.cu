// The blockwise FP8 kernels against the host recipe (reference/fp8.hpp) on fresh random inputs,
// ragged shapes included (M = 1, 19, 111, 300, 4097; N, K multiples of 8 / 16 but not of 128):
//   - E4m3::encode on the device (one cvt instruction) against its host bit path;
//   - the cast kernels, code for code and scale for scale;
//   - every compiled FP8 GEMM against the blockwise GEMM in fp64 on the same codes, outputs
//     poisoned (NaN) first. The GPU sums each 128-wide K block in the tensor cores' fp32 and
//     rounds D to bf16: |out − ref| <= 2^-8·|ref| + 2^-10·max|ref| per element.
// Skipped with a message when no Hopper GPU is present.

#include <cuda_bf16.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "coda/epilogue/fp8.hpp"
#include "coda/kernel/quantize.hpp"
#include "coda/ops.hpp"
#include "coda/reference/fp8.hpp"
#include "support/bf16.hpp"
#include "support/device.hpp"
#include "support/fp8_check.hpp"
#include "support/gpu_check.hpp"
#include "support/numeric.hpp"

namespace coda::kernel {
namespace {

using epilogue::E4m3;
using reference::BlockQuantized;

// encode of every value, and encode2 of each value with its neighbour (the pair instruction).
__global__ void encode_kernel(const float* v, uint8_t* out, uint16_t* out2, size_t n) {
  const size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) {
    out[i] = E4m3::encode(v[i]);
    out2[i] = E4m3::encode2(v[i], v[(i + 1) % n]);
  }
}

TEST_F(GpuKernelTest, E4m3EncodeOnTheDeviceMatchesTheHostBitPath) {
  std::vector<float> v;
  for (uint64_t bits = 0; bits < (uint64_t(1) << 32); bits += 997) {  // every class, both signs
    float f;
    const uint32_t b = uint32_t(bits);
    std::memcpy(&f, &b, 4);
    v.push_back(f);
  }
  for (float f : {0.0f, -0.0f, 448.0f, -448.0f, 464.0f, 480.0f, INFINITY, -INFINITY, NAN, 0x1p-9f,
                  0x1p-10f, 0x1.8p-10f, 0x1p-6f, 0x1.ep-7f})
    v.push_back(f);
  DeviceBuffer<float> dv(v);
  DeviceBuffer<uint8_t> out(v.size());
  DeviceBuffer<uint16_t> out2(v.size());
  encode_kernel<<<unsigned((v.size() + 255) / 256), 256>>>(dv.get(), out.get(), out2.get(),
                                                           v.size());
  CODA_CUDA_CHECK(cudaDeviceSynchronize());
  const std::vector<uint8_t> got = out.download();
  const std::vector<uint16_t> got2 = out2.download();
  size_t bad = 0;
  for (size_t i = 0; i < v.size(); ++i) {
    // The bit path, as the host compiles it (no cvt instruction there).
    if (got[i] != E4m3::encode(v[i]) && bad++ < 5)
      ADD_FAILURE() << std::hexfloat << v[i] << ": device " << int(got[i]) << ", host "
                    << int(E4m3::encode(v[i]));
    const float next = v[(i + 1) % v.size()];
    const uint16_t want2 = uint16_t(E4m3::encode(v[i]) | E4m3::encode(next) << 8);
    if (got2[i] != want2 && bad++ < 5)
      ADD_FAILURE() << std::hexfloat << "encode2(" << v[i] << ", " << next << "): device "
                    << got2[i] << ", host " << want2;
  }
  EXPECT_EQ(bad, 0u) << " of " << v.size();
}

TEST_F(GpuKernelTest, RowCastMatchesTheRecipeCodeForCode) {
  testing::Rng rng(11);
  const std::pair<int64_t, int64_t> shapes[] = {
      {1, 16}, {19, 272}, {300, 272}, {130, 4096}, {4097, 144}};
  for (const auto& [m, k] : shapes) {
    const std::string what = "M=" + std::to_string(m) + " K=" + std::to_string(k);
    std::vector<double> x = wide_values(m, k, rng);
    if (m > 100) x[size_t(77 * k + 5)] = NAN;  // its row block and column block become NaN
    const auto q =
        reference::quantize_blockwise(MatrixRef<double>::row_major(x.data(), m, k), 1, 128);
    const auto qt =
        reference::quantize_blockwise(MatrixRef<double>::transposed(x.data(), k, m), 1, 128);
    auto dx = upload_bf16(x);
    const int64_t lds = pad(m, 4), ldt = pad(m, 16);
    DeviceBuffer<uint8_t> codes(size_t(m * k)), codes_t(size_t(k * ldt));
    DeviceBuffer<float> scales(size_t(q.grid_cols() * lds)), scales_t(size_t(qt.grid_cols() * k));
    codes.poison();
    codes_t.poison();
    scales.poison();
    scales_t.poison();
    ops::quantize_fp8_rows(dev(dx.get(), DType::kBF16, m, k, k),
                           dev(codes.get(), DType::kE4M3, m, k, k),
                           dev(scales.get(), DType::kF32, q.grid_cols(), m, lds),
                           dev(codes_t.get(), DType::kE4M3, k, ldt, ldt),
                           dev(scales_t.get(), DType::kF32, qt.grid_cols(), k, k), nullptr);
    CODA_CUDA_CHECK(cudaDeviceSynchronize());
    expect_same_bytes(what + " codes", codes.download(), q.codes);
    expect_same_floats(what + " scales", scales.download(), row_scales(q, lds));
    expect_same_bytes(what + " codes_t", codes_t.download(), padded_codes(qt, ldt));
    expect_same_floats(what + " scales_t", scales_t.download(), row_scales(qt, k));
  }
}

// a = silu(g)·u of z's interleaved pairs cast into its transposed copy (fp8_mlp's backward with
// recompute_a): each code dequantized against a in fp64 within e4m3's half step, a's bf16
// rounding and the device's approximate exp (2^-4 + 2^-7 relative, 2^-9 of the block's scale);
// the tokens past M (up to 16) hold code 0. Outputs poisoned first.
TEST_F(GpuKernelTest, SwigluCastQuantizesAsTheRecipe) {
  testing::Rng rng(13);
  const std::pair<int64_t, int64_t> shapes[] = {{1, 16}, {130, 272}, {4097, 144}};
  for (const auto& [m, inter] : shapes) {
    const std::string what = "M=" + std::to_string(m) + " I=" + std::to_string(inter);
    const std::vector<double> z = testing::bf16_uniform(size_t(m * 2 * inter), -4, 4, rng);
    std::vector<double> a(size_t(m * inter));
    for (size_t i = 0; i < a.size(); ++i)
      a[i] = z[2 * i] / (1 + std::exp(-z[2 * i])) * z[2 * i + 1];
    auto dz = upload_bf16(z);
    const int64_t ldt = pad(m, 16), blocks = (m + 127) / 128;
    DeviceBuffer<uint8_t> codes_t(size_t(inter * ldt));
    DeviceBuffer<float> scales_t(size_t(blocks * inter));
    codes_t.poison();
    scales_t.poison();
    ops::quantize_fp8_swiglu_t(dev(dz.get(), DType::kBF16, m, 2 * inter, 2 * inter),
                               dev(codes_t.get(), DType::kE4M3, inter, ldt, ldt),
                               dev(scales_t.get(), DType::kF32, blocks, inter, inter), nullptr);
    CODA_CUDA_CHECK(cudaDeviceSynchronize());
    const std::vector<uint8_t> codes = codes_t.download();
    const std::vector<float> scales = scales_t.download();
    size_t bad = 0;
    for (int64_t c = 0; c < inter; ++c)
      for (int64_t t = 0; t < ldt; ++t) {
        const uint8_t code = codes[size_t(c * ldt + t)];
        if (t >= m) {
          bad += code != 0;
          continue;
        }
        const double s = scales[size_t((t / 128) * inter + c)];
        const double got = E4m3::decode(code) * s, want = a[size_t(t * inter + c)];
        if (!(std::abs(got - want) <= (0x1p-4 + 0x1p-7) * std::abs(want) + 0x1p-9 * s) && bad++ < 5)
          ADD_FAILURE() << what << " a[" << t << ", " << c << "] = " << want << ", code "
                        << int(code) << " x scale " << s << " = " << got;
      }
    EXPECT_EQ(bad, 0u) << what;
  }
}

TEST_F(GpuKernelTest, BlockCastMatchesTheRecipeCodeForCode) {
  testing::Rng rng(12);
  const std::pair<int64_t, int64_t> shapes[] = {{16, 16}, {272, 400}, {128, 128}, {1040, 4096}};
  for (const auto& [n, k] : shapes) {
    const std::string what = "N=" + std::to_string(n) + " K=" + std::to_string(k);
    const std::vector<double> w = wide_values(n, k, rng);
    const auto q =
        reference::quantize_blockwise(MatrixRef<double>::row_major(w.data(), n, k), 128, 128);
    const auto qt =
        reference::quantize_blockwise(MatrixRef<double>::transposed(w.data(), k, n), 128, 128);
    auto dw = upload_bf16(w);
    DeviceBuffer<uint8_t> codes(size_t(n * k)), codes_t(size_t(k * n));
    DeviceBuffer<float> scales(q.scales.size()), scales_t(qt.scales.size());
    codes.poison();
    codes_t.poison();
    scales.poison();
    scales_t.poison();
    ops::quantize_fp8_blocks(
        dev(dw.get(), DType::kBF16, n, k, k), dev(codes.get(), DType::kE4M3, n, k, k),
        dev(scales.get(), DType::kF32, q.grid_rows(), q.grid_cols(), q.grid_cols()),
        dev(codes_t.get(), DType::kE4M3, k, n, n),
        dev(scales_t.get(), DType::kF32, qt.grid_rows(), qt.grid_cols(), qt.grid_cols()), nullptr);
    CODA_CUDA_CHECK(cudaDeviceSynchronize());
    expect_same_bytes(what + " codes", codes.download(), q.codes);
    expect_same_floats(what + " scales", scales.download(), q.scales);
    expect_same_bytes(what + " codes_t", codes_t.download(), qt.codes);
    expect_same_floats(what + " scales_t", scales_t.download(), qt.scales);
  }
}

// A weight's transposed operand made from its codes (the FP8 backward's data-gradient operand):
// code for code the recipe's cast of wᵀ, on 64x64 tiles that straddle the 128x128 blocks, and
// (one shape) with every operand at a row stride wider than its width.
TEST_F(GpuKernelTest, BlockTransposeMatchesTheRecipeOfTheTranspose) {
  testing::Rng rng(14);
  const std::pair<int64_t, int64_t> shapes[] = {{16, 16}, {272, 400}, {80, 1040}, {1040, 4096}};
  for (const auto& [n, k] : shapes) {
    const std::string what = "N=" + std::to_string(n) + " K=" + std::to_string(k);
    const std::vector<double> w = wide_values(n, k, rng);
    const auto qt =
        reference::quantize_blockwise(MatrixRef<double>::transposed(w.data(), k, n), 128, 128);
    const bool wide = n == 272;
    const int64_t grid_n = ScaleLayout::blocks(n), grid_k = ScaleLayout::blocks(k);
    const int64_t ld = wide ? k + 48 : k, ld_scales = wide ? grid_k + 3 : grid_k;
    const int64_t ld_t = wide ? n + 32 : n, ld_scales_t = wide ? grid_n + 1 : grid_n;
    auto dw = upload_bf16(w);
    DeviceBuffer<uint8_t> codes(size_t(n * ld)), codes_t(size_t(k * ld_t));
    DeviceBuffer<float> scales(size_t(grid_n * ld_scales)), scales_t(size_t(grid_k * ld_scales_t));
    codes_t.poison();
    scales_t.poison();
    ops::quantize_fp8_blocks(
        dev(dw.get(), DType::kBF16, n, k, k), dev(codes.get(), DType::kE4M3, n, k, ld),
        dev(scales.get(), DType::kF32, grid_n, grid_k, ld_scales), {}, {}, nullptr);
    ops::transpose_fp8_blocks(dev(codes.get(), DType::kE4M3, n, k, ld),
                              dev(scales.get(), DType::kF32, grid_n, grid_k, ld_scales),
                              dev(codes_t.get(), DType::kE4M3, k, n, ld_t),
                              dev(scales_t.get(), DType::kF32, grid_k, grid_n, ld_scales_t),
                              nullptr);
    CODA_CUDA_CHECK(cudaDeviceSynchronize());
    // The rows of each output at its own stride, packed as the recipe's.
    const std::vector<uint8_t> got_t = codes_t.download();
    const std::vector<float> got_st = scales_t.download();
    std::vector<uint8_t> rows_t;
    std::vector<float> rows_st;
    for (int64_t r = 0; r < k; ++r)
      rows_t.insert(rows_t.end(), got_t.begin() + r * ld_t, got_t.begin() + r * ld_t + n);
    for (int64_t r = 0; r < grid_k; ++r)
      rows_st.insert(rows_st.end(), got_st.begin() + r * ld_scales_t,
                     got_st.begin() + r * ld_scales_t + grid_n);
    expect_same_bytes(what + " codes_t", rows_t, qt.codes);
    expect_same_floats(what + " scales_t", rows_st, qt.scales);
  }
}

const Shape kShapes[] = {{1, 200, 144},    {19, 8, 16},      {111, 200, 400},
                         {300, 264, 1040}, {4097, 264, 272}, {256, 1024, 2048}};

// One GEMM of shape s on the recipe's operands from fresh wide values: x (M, K) in 1x128 blocks
// and the second operand (N, K) in b_block_rows x 128 blocks (128: a weight; 1: the tokens of a
// weight gradient), on the device, and their product by the host recipe in fp64.
struct RecipeGemm {
  Fp8Operand a, b;
  std::vector<double> ref;
};
RecipeGemm recipe_gemm(const Shape& s, testing::Rng& rng, int b_block_rows) {
  const std::vector<double> x = wide_values(s.m, s.k, rng), y = wide_values(s.n, s.k, rng);
  const auto qx = quantized(x, s.m, s.k, 1), qy = quantized(y, s.n, s.k, b_block_rows);
  return {upload_rows(qx), b_block_rows == 1 ? upload_rows(qy) : upload_blocks(qy),
          reference::gemm_fp8_blockwise<double>(qx, qy)};
}

TEST_F(GpuKernelTest, Fp8GemmMatchesTheBlockwiseRecipe) {
  const auto configs = compiled_configs(Program::kPlain, Operands::kFp8XWt);
  ASSERT_FALSE(configs.empty());
  testing::Rng rng(13);
  for (const Shape& s : kShapes) {
    if (skip_large(s)) continue;
    const RecipeGemm g = recipe_gemm(s, rng, 128);  // the reference once, for every config
    for (Config c : configs) {
      DeviceBuffer<bf16> d(size_t(s.m) * s.n);
      d.poison();
      GemmProblem p = fp8_problem(s, g.a, g.b);
      p.d = d.get();
      p.ldd = s.n;
      run<Program::kPlain>(c, p, {}, Operands::kFp8XWt);
      expect_close("fp8 " + label(c, s), download_bf16(d), g.ref);
    }
  }
}

TEST_F(GpuKernelTest, Fp8WeightGradientMatchesTheBlockwiseRecipe) {
  testing::Rng rng(14);
  for (const Shape& s : kShapes) {
    if (skip_large(s)) continue;
    const RecipeGemm g = recipe_gemm(s, rng, 1);
    const std::vector<double>& ref = g.ref;
    const GemmProblem p = fp8_problem(s, g.a, g.b);
    for (Config c : compiled_configs(Program::kPlain, Operands::kFp8XYt)) {
      DeviceBuffer<bf16> d(size_t(s.m) * s.n);
      d.poison();
      GemmProblem pb = p;
      pb.d = d.get();
      pb.ldd = s.n;
      run<Program::kPlain>(c, pb, {}, Operands::kFp8XYt);
      expect_close("fp8 x·yᵀ " + label(c, s), download_bf16(d), ref);
    }
    for (Config c : compiled_configs(Program::kAccumulateF32, Operands::kFp8XYt)) {
      // d += x·yᵀ over a random fp32 start: the result minus the start is the product.
      std::vector<float> start(size_t(s.m) * s.n);
      for (float& v : start) v = float(rng.uniform(-1, 1));
      DeviceBuffer<float> d(start);
      run<Program::kAccumulateF32>(c, p, {d.get(), s.n}, Operands::kFp8XYt);
      const std::vector<float> got = d.download();
      std::vector<double> product(got.size());
      for (size_t i = 0; i < got.size(); ++i) product[i] = double(got[i]) - double(start[i]);
      expect_close("fp8 d += x·yᵀ " + label(c, s), product, ref);
    }
  }
}

// The recipe end to end through the op API: cast x, w and dy on the device, then the forward,
// data-gradient and weight-gradient GEMMs (the latter over the transposed copies, K = tokens
// padded to 16), each against the recipe on the host's own quantization.
TEST_F(GpuKernelTest, CastThenGemmThroughTheOps) {
  testing::Rng rng(15);
  const int64_t m = 300, n = 272, k = 1040, m16 = pad(m, 16);
  const std::vector<double> x = wide_values(m, k, rng), w = wide_values(n, k, rng),
                            dy = wide_values(m, n, rng);
  auto dx = upload_bf16(x), dw = upload_bf16(w), ddy = upload_bf16(dy);
  DeviceBuffer<uint8_t> xc(size_t(m * k)), xtc(size_t(k * m16)), wc(size_t(n * k)),
      wtc(size_t(k * n)), dyc(size_t(m * n)), dytc(size_t(n * m16));
  const int64_t kb = pad(k, 128) / 128, nb = pad(n, 128) / 128, mb = pad(m, 128) / 128;
  DeviceBuffer<float> xs(size_t(kb * pad(m, 4))), xts(size_t(mb * k)), ws(size_t(nb * kb)),
      wts(size_t(kb * nb)), dys(size_t(nb * pad(m, 4))), dyts(size_t(mb * n));
  const auto e4 = DType::kE4M3, f = DType::kF32;
  ops::quantize_fp8_rows(dev(dx.get(), DType::kBF16, m, k, k), dev(xc.get(), e4, m, k, k),
                         dev(xs.get(), f, kb, m, pad(m, 4)), dev(xtc.get(), e4, k, m16, m16),
                         dev(xts.get(), f, mb, k, k), nullptr);
  ops::quantize_fp8_blocks(dev(dw.get(), DType::kBF16, n, k, k), dev(wc.get(), e4, n, k, k),
                           dev(ws.get(), f, nb, kb, kb), dev(wtc.get(), e4, k, n, n),
                           dev(wts.get(), f, kb, nb, nb), nullptr);
  ops::quantize_fp8_rows(dev(ddy.get(), DType::kBF16, m, n, n), dev(dyc.get(), e4, m, n, n),
                         dev(dys.get(), f, nb, m, pad(m, 4)), dev(dytc.get(), e4, n, m16, m16),
                         dev(dyts.get(), f, mb, n, n), nullptr);
  DeviceBuffer<bf16> y(size_t(m * n)), dxo(size_t(m * k));
  DeviceBuffer<float> dwo(size_t(n * k));
  y.poison();
  dxo.poison();
  CODA_CUDA_CHECK(cudaMemset(dwo.get(), 0, dwo.size() * 4));
  ops::gemm_fp8(dev(xc.get(), e4, m, k, k), dev(xs.get(), f, kb, m, pad(m, 4)),
                dev(wc.get(), e4, n, k, k), dev(ws.get(), f, nb, kb, kb),
                dev(y.get(), DType::kBF16, m, n, n), nullptr);
  ops::gemm_fp8(dev(dyc.get(), e4, m, n, n), dev(dys.get(), f, nb, m, pad(m, 4)),
                dev(wtc.get(), e4, k, n, n), dev(wts.get(), f, kb, nb, nb),
                dev(dxo.get(), DType::kBF16, m, k, k), nullptr);
  ops::gemm_fp8_xyt(dev(dytc.get(), e4, n, m16, m16), dev(dyts.get(), f, mb, n, n),
                    dev(xtc.get(), e4, k, m16, m16), dev(xts.get(), f, mb, k, k),
                    dev(dwo.get(), f, n, k, k), true, nullptr);
  CODA_CUDA_CHECK(cudaDeviceSynchronize());

  using Ref = MatrixRef<double>;
  const auto qx = reference::quantize_blockwise(Ref::row_major(x.data(), m, k), 1, 128);
  const auto qw = reference::quantize_blockwise(Ref::row_major(w.data(), n, k), 128, 128);
  const auto qwt = reference::quantize_blockwise(Ref::transposed(w.data(), k, n), 128, 128);
  const auto qdy = reference::quantize_blockwise(Ref::row_major(dy.data(), m, n), 1, 128);
  const auto qdyt = reference::quantize_blockwise(Ref::transposed(dy.data(), n, m), 1, 128);
  const auto qxt = reference::quantize_blockwise(Ref::transposed(x.data(), k, m), 1, 128);
  expect_close("y = x·wᵀ", download_bf16(y), reference::gemm_fp8_blockwise<double>(qx, qw));
  expect_close("dx = dy·w", download_bf16(dxo), reference::gemm_fp8_blockwise<double>(qdy, qwt));
  const std::vector<float> got = dwo.download();
  expect_close("dw = dyᵀ·x", std::vector<double>(got.begin(), got.end()),
               reference::gemm_fp8_blockwise<double>(qdyt, qxt));
}

// The weight gradient through the op API on each backend (ops::set_fp8_wgrad_backend): the
// transposed copies of dy and x as the cast writes them (scales with a row stride of exactly the
// operand's rows, what cuBLASLt reads), tokens ragged (1, 300, 4097: padded to 16 with code 0)
// and not (1024). Every result against the recipe on the host's own quantization: ours; cuBLASLt
// with the fallback to ours (any token count); cuBLASLt only, which must take the bf16 D when the
// tokens are whole 128-blocks; and the fp32 D += on cuBLASLt only, which either runs and matches
// or is refused with the reason (no fp32-D kernel), reported either way.
TEST_F(GpuKernelTest, WeightGradientOnEachBackendMatchesTheRecipe) {
  struct Restore {  // the process-wide backend back to what it was, whatever happens
    ops::Fp8WgradBackend before = ops::fp8_wgrad_backend();
    ~Restore() { ops::set_fp8_wgrad_backend(before); }
  } restore;
  testing::Rng rng(16);
  struct Case {
    int64_t tokens, n, k;
  };
  const auto e4 = DType::kE4M3, f = DType::kF32;
  for (const Case& cs : {Case{1, 128, 144}, Case{300, 272, 1040}, Case{1024, 384, 256},
                         Case{4097, 256, 272}}) {
    const int64_t m = cs.tokens, n = cs.n, k = cs.k, m16 = pad(m, 16), mb = pad(m, 128) / 128;
    const std::vector<double> x = wide_values(m, k, rng), dy = wide_values(m, n, rng);
    auto dx = upload_bf16(x), ddy = upload_bf16(dy);
    // Only the transposed copies are wanted: the rows' outputs are left out (null views).
    DeviceBuffer<uint8_t> xtc(size_t(k * m16)), dytc(size_t(n * m16));
    DeviceBuffer<float> xts(size_t(mb * k)), dyts(size_t(mb * n));
    ops::quantize_fp8_rows(dev(dx.get(), DType::kBF16, m, k, k), {}, {},
                           dev(xtc.get(), e4, k, m16, m16), dev(xts.get(), f, mb, k, k), nullptr);
    ops::quantize_fp8_rows(dev(ddy.get(), DType::kBF16, m, n, n), {}, {},
                           dev(dytc.get(), e4, n, m16, m16), dev(dyts.get(), f, mb, n, n), nullptr);
    using Ref = MatrixRef<double>;
    const auto qdyt = reference::quantize_blockwise(Ref::transposed(dy.data(), n, m), 1, 128);
    const auto qxt = reference::quantize_blockwise(Ref::transposed(x.data(), k, m), 1, 128);
    const std::vector<double> ref = reference::gemm_fp8_blockwise<double>(qdyt, qxt);
    const std::string shape = " tokens=" + std::to_string(m) + " n=" + std::to_string(n) +
                              " k=" + std::to_string(k);
    auto wgrad = [&](const TensorView& d, bool accumulate) {
      ops::gemm_fp8_xyt(dev(dytc.get(), e4, n, m16, m16), dev(dyts.get(), f, mb, n, n),
                        dev(xtc.get(), e4, k, m16, m16), dev(xts.get(), f, mb, k, k), d,
                        accumulate, nullptr);
      CODA_CUDA_CHECK(cudaDeviceSynchronize());
    };
    std::vector<std::pair<ops::Fp8WgradBackend, const char*>> backends = {
        {ops::Fp8WgradBackend::kCutlass, "cutlass"}, {ops::Fp8WgradBackend::kCublasLt, "cublaslt"}};
    if (m % 128 == 0) backends.push_back({ops::Fp8WgradBackend::kCublasLtOnly, "cublaslt-only"});
    for (auto [backend, name] : backends) {
      ops::set_fp8_wgrad_backend(backend);
      DeviceBuffer<bf16> dw(size_t(n * k));
      dw.poison();
      wgrad(dev(dw.get(), DType::kBF16, n, k, k), false);
      expect_close(std::string("dw = dyᵀ·x on ") + name + shape, download_bf16(dw), ref);
    }
    for (auto [backend, name] : {std::pair{ops::Fp8WgradBackend::kCublasLt, "cublaslt"},
                                 std::pair{ops::Fp8WgradBackend::kCublasLtOnly, "cublaslt-only"}}) {
      ops::set_fp8_wgrad_backend(backend);
      std::vector<float> start(size_t(n * k));
      for (float& v : start) v = float(rng.uniform(-1, 1));
      DeviceBuffer<float> acc(start);
      try {
        wgrad(dev(acc.get(), f, n, k, k), true);
      } catch (const std::exception& e) {  // only cuBLASLt-only may refuse, and only for fp32 D
        ASSERT_EQ(backend, ops::Fp8WgradBackend::kCublasLtOnly) << e.what();
        EXPECT_TRUE(m % 128 != 0 || std::string(e.what()).find("fp32 D") != std::string::npos)
            << e.what();
        std::printf("  dw += dyᵀ·x%s: cuBLASLt refuses it: %s\n", shape.c_str(), e.what());
        continue;
      }
      const std::vector<float> got = acc.download();
      std::vector<double> product(got.size());
      for (size_t i = 0; i < got.size(); ++i) product[i] = double(got[i]) - double(start[i]);
      expect_close(std::string("dw += dyᵀ·x on ") + name + shape, product, ref);
    }
  }
}

// F1 over FP8 operands with h quantized in its epilogue (Program::kResidualRmsnormFp8) against
// the same F1 with bf16 h on the same mainloop, whose h then goes through the cast kernel: x and
// the Σx² partials byte for byte, h's codes and scales (both copies, and the rows alone, which
// leave from the registers with no staged tile) byte for byte. The bf16-h
// F1 itself against the recipe: x = the blockwise GEMM + residual, h = x ⊙ γ, S = Σ x² per tile.
// Every output is exactly the size the kernels write, poisoned differently for the fused and the
// cast outputs, so a byte written by only one of them differs.
TEST_F(GpuKernelTest, Fp8ResidualRmsnormQuantizesHAsTheCastKernelDoes) {
  const Config c = Config::kCoop128x128x128_1x2;
  ASSERT_TRUE(compiled(Program::kResidualRmsnormFp8, c, Operands::kFp8XWt));
  ASSERT_TRUE(compiled(Program::kResidualRmsnormPartial, c, Operands::kFp8XWt));
  testing::Rng rng(16);
  const Shape shapes[] = {
      {1, 272, 144}, {130, 128, 16}, {300, 400, 1040}, {4097, 272, 272}, {256, 1024, 2048}};
  for (const Shape& s : shapes) {
    if (skip_large(s)) continue;
    const int64_t m = s.m, n = s.n, m4 = pad(m, 4), m16 = pad(m, 16);
    const int64_t nb = pad(n, 128) / 128, mb = pad(m, 128) / 128;
    const std::vector<double> a = wide_values(m, s.k, rng), w = wide_values(n, s.k, rng);
    std::vector<double> residual(static_cast<size_t>(m * n)), gam(static_cast<size_t>(n));
    for (double& v : residual) v = testing::round_bf16(rng.uniform(-2, 2));
    for (double& v : gam) v = testing::round_bf16(rng.uniform(0.5, 1.5));
    const auto qa = quantized(a, s.m, s.k, 1), qw = quantized(w, s.n, s.k, 128);
    const Fp8Operand da = upload_rows(qa), dw = upload_blocks(qw);
    auto dres = upload_bf16(residual), dgamma = upload_bf16(gam);
    const size_t partials = size_t(nb * mb * 128);

    // F1 with bf16 h, then the cast of h.
    DeviceBuffer<bf16> x_ref(size_t(m * n)), h_ref(size_t(m * n));
    DeviceBuffer<float> s_ref(partials);
    x_ref.poison();
    h_ref.poison();
    s_ref.poison();
    GemmProblem p = fp8_problem(s, da, dw);
    p.c = dres.get();
    p.ldc = n;
    p.d = x_ref.get();
    p.ldd = n;
    run<Program::kResidualRmsnormPartial>(c, p, {dgamma.get(), h_ref.get(), n, s_ref.get()},
                                          Operands::kFp8XWt);
    DeviceBuffer<uint8_t> cast(size_t(m * n)), cast_t(size_t(n * m16));
    DeviceBuffer<float> cast_s(size_t(nb * m4)), cast_ts(size_t(mb * n));
    for (auto* b : {&cast, &cast_t}) b->poison(0xfe);
    cast_s.poison(0xfe);
    cast_ts.poison(0xfe);
    quantize_fp8_rows(h_ref.get(), m, n, n, {cast.get(), n, cast_s.get(), m4},
                      {cast_t.get(), m16, cast_ts.get(), n}, nullptr);

    // F1 with h quantized in the epilogue.
    DeviceBuffer<bf16> x(size_t(m * n));
    DeviceBuffer<float> sums(partials);
    DeviceBuffer<uint8_t> h(size_t(m * n)), h_t(size_t(n * m16));
    DeviceBuffer<float> hs(size_t(nb * m4)), h_ts(size_t(mb * n));
    x.poison();
    sums.poison();
    for (auto* b : {&h, &h_t}) b->poison();
    hs.poison();
    h_ts.poison();
    p.d = x.get();
    run<Program::kResidualRmsnormFp8>(
        c, p,
        {dgamma.get(), {h.get(), n, hs.get(), m4}, {h_t.get(), m16, h_ts.get(), n}, sums.get()},
        Operands::kFp8XWt);
    CODA_CUDA_CHECK(cudaDeviceSynchronize());

    const std::string at = label(c, s);
    const std::vector<double> xr = download_bf16(x_ref);
    expect_same_floats("Σx² partials " + at, sums.download(), s_ref.download());
    const auto bytes = [](const DeviceBuffer<bf16>& b) {
      const std::vector<bf16> v = b.download();
      std::vector<uint8_t> out(v.size() * sizeof(bf16));
      std::memcpy(out.data(), v.data(), out.size());
      return out;
    };
    expect_same_bytes("x " + at, bytes(x), bytes(x_ref));
    expect_same_bytes("h codes " + at, h.download(), cast.download());
    expect_same_floats("h scales " + at, hs.download(), cast_s.download());
    expect_same_bytes("hᵀ codes " + at, h_t.download(), cast_t.download());
    expect_same_floats("hᵀ scales " + at, h_ts.download(), cast_ts.download());

    // h's rows alone (the FP8 block's F1): no tile staged, the same codes and scales.
    DeviceBuffer<bf16> x_rows(size_t(m * n));
    DeviceBuffer<float> sums_rows(partials), hs_rows(size_t(nb * m4));
    DeviceBuffer<uint8_t> h_rows(size_t(m * n));
    x_rows.poison();
    sums_rows.poison();
    h_rows.poison();
    hs_rows.poison();
    p.d = x_rows.get();
    run<Program::kResidualRmsnormFp8>(
        c, p, {dgamma.get(), {h_rows.get(), n, hs_rows.get(), m4}, {}, sums_rows.get()},
        Operands::kFp8XWt);
    CODA_CUDA_CHECK(cudaDeviceSynchronize());
    expect_same_bytes("x (h's rows alone) " + at, bytes(x_rows), bytes(x_ref));
    expect_same_floats("Σx² partials (h's rows alone) " + at, sums_rows.download(),
                       s_ref.download());
    expect_same_bytes("h codes (rows alone) " + at, h_rows.download(), cast.download());
    expect_same_floats("h scales (rows alone) " + at, hs_rows.download(), cast_s.download());

    // The bf16-h program against the recipe.
    std::vector<double> x_want = reference::gemm_fp8_blockwise<double>(qa, qw);
    for (size_t i = 0; i < x_want.size(); ++i) x_want[i] += residual[i];
    expect_close("x = a·wᵀ + residual " + at, xr, x_want);
    std::vector<double> h_want(xr.size());  // from the unrounded x, as the epilogue has it
    for (int64_t i = 0; i < m; ++i)
      for (int64_t j = 0; j < n; ++j) h_want[i * n + j] = x_want[i * n + j] * gam[j];
    expect_close("h = x ⊙ γ " + at, download_bf16(h_ref), h_want);
    const std::vector<float> sr = s_ref.download();
    for (int64_t t = 0; t < nb; ++t)
      for (int64_t i = 0; i < m; ++i) {
        double want = 0.0;
        for (int64_t j = t * 128; j < std::min(n, (t + 1) * 128); ++j)
          want += x_want[i * n + j] * x_want[i * n + j];
        ASSERT_NEAR(sr[t * mb * 128 + i], want, 0x1p-10 * want + 1e-30)
            << "Σx² row " << i << " tile " << t << " " << at;
      }
  }
}

}  // namespace
}  // namespace coda::kernel
