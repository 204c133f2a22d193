#pragma once
// Shared pieces of the GPU tests: the skip-without-GPU fixture, kernel lookup and launch, bf16
// upload/download, and the docs/math.md §5 tolerance rule.

#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "coda/kernel/args.hpp"
#include "coda/programs/rope.hpp"
#include "coda/reference/executor.hpp"
#include "support/bf16.hpp"
#include "support/device.hpp"
#include "support/numeric.hpp"

namespace coda::kernel {

using reference::MatrixRef;
using testing::DeviceBuffer;
using testing::round_bf16;
using V = std::vector<double>;

struct Shape {
  int m, n, k;
};

// CODA_GPU_TEST_SMALL=1 skips the shapes above ~1000 rows or K = 2048 (compute-sanitizer runs,
// where every kernel is instrumented and the large ones dominate the time). K up to 2048 stays:
// 16 k-tiles, so the sanitizers see the mainloops (4-5 stages) refill stages they have used.
inline bool skip_large(const Shape& s) {
  const char* v = std::getenv("CODA_GPU_TEST_SMALL");
  return v && v[0] == '1' && (s.m > 1000 || s.k > 2048);
}

class GpuKernelTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const std::string why = testing::gpu_unavailable_reason();
    if (!why.empty()) GTEST_SKIP() << "GPU test skipped: " << why;
  }
};

inline std::vector<Config> compiled_configs(Program p, Operands o = Operands::kXWt) {
  std::vector<Config> out;
  for (int c = 0; c < static_cast<int>(Config::kCount); ++c)
    if (find_kernel(p, static_cast<Config>(c), o)) out.push_back(static_cast<Config>(c));
  return out;
}

// F3q's launch arguments over device buffers: qkv (M, N) and qk_pre (M, qk.normed_width()),
// rows packed (the bf16 and FP8 F3q tests).
inline RmsnormQkNormRopeArgs qk_norm_rope_args(const programs::QkNorm& qk, const float* r,
                                               const bf16* q_gamma, const bf16* k_gamma,
                                               const int32_t* pos, const uint32_t* freq_hi,
                                               const uint32_t* freq_lo, bf16* qkv, bf16* qk_pre) {
  RmsnormQkNormRopeArgs a;
  a.r = r;
  a.q_gamma = q_gamma;
  a.k_gamma = k_gamma;
  a.pos = pos;
  a.freq_hi = freq_hi;
  a.freq_lo = freq_lo;
  a.qkv = qkv;
  a.ld_qkv = qk.layout.width();
  a.qk_pre = qk_pre;
  a.normed_width = int(qk.normed_width());
  a.ld_qk_pre = a.normed_width;
  a.head_dim = qk.layout.head_dim;
  a.q_width = qk.layout.q_width();
  a.eps = float(qk.eps);
  return a;
}

inline reference::TileConfig reference_tiles(Config c) {
  const TileShapeMN t = tile_shape(c);
  // Epilogue subtile: 128x32 (cooperative) or 64x32 (pingpong); only the tile affects outputs.
  return {t.m, t.n, std::string(config_name(c)).rfind("coop", 0) == 0 ? 128 : 64, 32};
}

// The scheduler options of every test launch: swizzle 1 (what the heuristic gives these tests'
// small K) unless CODA_TEST_SWIZZLE (1/2/4/8) and CODA_TEST_RASTER (M/N) say otherwise.
// scripts/gpu-check runs the GPU tests again with swizzle 8 along M and along N, what the op layer
// picks at K > 2048: swizzling pads the tile grid with tiles wholly outside the problem, which
// every epilogue node must leave alone.
inline SchedulerOptions test_schedule() {
  SchedulerOptions so;
  if (const char* s = std::getenv("CODA_TEST_SWIZZLE")) so.swizzle = std::atoi(s);
  if (const char* r = std::getenv("CODA_TEST_RASTER"))
    so.raster = r[0] == 'N' ? Raster::kAlongN : r[0] == 'M' ? Raster::kAlongM : Raster::kHeuristic;
  return so;
}

template <Program P>
void run(Config c, const GemmProblem& prob, const ArgsOf<P>& args, Operands o = Operands::kXWt) {
  ASSERT_TRUE(compiled(P, c, o)) << program_name(P) << " on " << config_name(c);
  CODA_CUDA_CHECK(launch<P>(c, o, prob, args, test_schedule(), nullptr));
  CODA_CUDA_CHECK(cudaDeviceSynchronize());
}

inline std::vector<double> download_bf16(const DeviceBuffer<bf16>& b) {
  std::vector<bf16> raw = b.download();
  std::vector<uint16_t> bits(raw.size());
  std::memcpy(bits.data(), raw.data(), raw.size() * 2);
  return testing::from_bf16_bits(bits);
}

// Rows of `cols` values at a row stride of `ld` >= cols: what a TMA operand or output of an odd
// extent looks like (its row stride a multiple of 8). The padding is NaN (0xffff), so a kernel
// that read it would show it. download_bf16_rows returns the rows and checks the padding against
// the ops' contract (include/coda/ops.hpp): a store of D may write zeros into the columns up to
// the next multiple of 8 (the TMA store's 16-byte granule, as the H200 does) and nothing beyond.
inline int padded_ld(int cols) { return (cols + 7) / 8 * 8; }
inline DeviceBuffer<bf16> upload_bf16_rows(const V& v, int rows, int cols, int ld) {
  const auto bits = testing::to_bf16_bits(v);
  std::vector<uint16_t> padded(size_t(rows) * ld, 0xffff);
  for (int i = 0; i < rows; ++i)
    std::memcpy(&padded[size_t(i) * ld], &bits[size_t(i) * cols], size_t(cols) * 2);
  std::vector<bf16> raw(padded.size());
  std::memcpy(static_cast<void*>(raw.data()), padded.data(), padded.size() * 2);
  return DeviceBuffer<bf16>(raw);
}
inline DeviceBuffer<bf16> upload_bf16(const V& v) {
  return upload_bf16_rows(v, 1, int(v.size()), int(v.size()));
}
struct PaddedRows {
  V values;
  bool padding_ok = true;  // the contract above holds
  int granule_zeros = 0, beyond_granule = 0, granule_other = 0;
  std::string describe() const {
    return std::to_string(granule_zeros) + " zeros in the 16-byte granule past N, " +
           std::to_string(granule_other) + " other values there, " +
           std::to_string(beyond_granule) + " writes beyond it";
  }
};
inline PaddedRows download_bf16_rows(const DeviceBuffer<bf16>& b, int rows, int cols, int ld) {
  std::vector<bf16> raw = b.download();
  std::vector<uint16_t> bits(raw.size());
  std::memcpy(bits.data(), raw.data(), raw.size() * 2);
  PaddedRows out;
  std::vector<uint16_t> dense(size_t(rows) * cols);
  for (int i = 0; i < rows; ++i)
    for (int j = 0; j < ld; ++j) {
      const uint16_t e = bits[size_t(i) * ld + j];
      if (j < cols) {
        dense[size_t(i) * cols + j] = e;
      } else if (e != 0xffff) {
        if (j >= padded_ld(cols))
          ++out.beyond_granule;
        else if (e == 0)
          ++out.granule_zeros;
        else
          ++out.granule_other;
      }
    }
  out.padding_ok = out.beyond_granule == 0 && out.granule_other == 0;
  out.values = testing::from_bf16_bits(dense);
  return out;
}

template <class T>
std::vector<double> as_double(const std::vector<T>& v) {
  return std::vector<double>(v.begin(), v.end());
}

// The tolerance rule, plus: every element written (finite) and the sizes agree.
inline void expect_rule(const std::string& what, const V& out, const V& ref, const V& pt) {
  ASSERT_EQ(out.size(), ref.size()) << what;
  for (size_t i = 0; i < out.size(); ++i)
    ASSERT_TRUE(std::isfinite(out[i]))
        << what << ": element " << i << " not written (" << out[i] << ")";
  const double e = testing::max_abs_error(out, ref), e_pt = testing::max_abs_error(pt, ref);
  EXPECT_LE(e, 2 * e_pt + 1e-6) << what << ": ours " << e << " vs PyTorch-bf16 " << e_pt;
}

inline V gemm_ref(const V& a, const V& w, const Shape& s) {
  return reference::gemm<double>(MatrixRef<double>::row_major(a.data(), s.m, s.k),
                                 MatrixRef<double>::row_major(w.data(), s.n, s.k));
}

inline std::string label(Config c, const Shape& s) {
  return std::string(config_name(c)) + " M=" + std::to_string(s.m) + " N=" + std::to_string(s.n) +
         " K=" + std::to_string(s.k);
}

}  // namespace coda::kernel
