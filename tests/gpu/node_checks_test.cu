// The epilogue nodes' host-side checks (can_implement) against the problem the launch checks:
// kernel/gemm.cuh asks CUTLASS with M, N and K rounded up to 8 (its alignment rule), so a node
// must accept a ragged problem's real arguments at the rounded extents. Host only (label cpu).

#include <gtest/gtest.h>

#include <cute/tensor.hpp>
#include <vector>

#include "coda/kernel/nodes/fp8_pair_decode.cuh"
#include "coda/kernel/nodes/fp8_row_store.cuh"

namespace coda::kernel {
namespace {

using Tile = cute::Shape<cute::_128, cute::_128, cute::_128>;
using PairDecode = Fp8PairDecode<Tile>;

int up8(int e) { return (e + 7) / 8 * 8; }

TEST(NodeChecks, Fp8PairDecodeAcceptsARaggedMAtTheExtentsTheLaunchChecks) {
  std::vector<float> scales(4 * 304);
  for (int m : {1, 130, 300, 4097}) {
    const Fp8PairDecodeArguments a{scales.data(), m};  // z_scales (blocks, M): ld = M
    EXPECT_TRUE(PairDecode::can_implement(cute::make_shape(up8(m), 1040, 2048, 1), a))
        << "M = " << m << " checked as " << up8(m);
  }
}

TEST(NodeChecks, Fp8PairDecodeRefusesMissingScales) {
  EXPECT_FALSE(PairDecode::can_implement(cute::make_shape(304, 1040, 2048, 1),
                                         Fp8PairDecodeArguments{nullptr, 300}));
  std::vector<float> scales(8);
  EXPECT_FALSE(PairDecode::can_implement(cute::make_shape(304, 1040, 2048, 1),
                                         Fp8PairDecodeArguments{scales.data(), 0}));
}

TEST(NodeChecks, Fp8RowStoreAcceptsARaggedMAtTheExtentsTheLaunchChecks) {
  alignas(16) uint8_t codes[32] = {};
  std::vector<float> scales(8);
  for (int m : {1, 130, 300, 4097}) {
    const Fp8Output z{codes, 2752, scales.data(), (m + 3) / 4 * 4};
    EXPECT_TRUE(Fp8RowStore<Tile>::can_implement(cute::make_shape(up8(m), 2752, 1040, 1), z))
        << "M = " << m << " checked as " << up8(m);
  }
}

TEST(NodeChecks, Fp8RowStoreRefusesMissingOutputsAndRowsNotIn16Bytes) {
  alignas(16) uint8_t codes[32] = {};
  std::vector<float> scales(8);
  const auto shape = cute::make_shape(304, 2752, 1040, 1);
  EXPECT_FALSE(Fp8RowStore<Tile>::can_implement(shape, Fp8Output{nullptr, 2752, scales.data(), 300}));
  EXPECT_FALSE(Fp8RowStore<Tile>::can_implement(shape, Fp8Output{codes, 2752, nullptr, 300}));
  // Codes leave 16 columns (bytes) at a time: the row stride, N and the base must all allow it.
  EXPECT_FALSE(Fp8RowStore<Tile>::can_implement(shape, Fp8Output{codes, 2753, scales.data(), 300}));
  EXPECT_FALSE(Fp8RowStore<Tile>::can_implement(shape, Fp8Output{codes, 2760, scales.data(), 300}));
  EXPECT_FALSE(Fp8RowStore<Tile>::can_implement(cute::make_shape(304, 2744, 1040, 1),
                                                Fp8Output{codes, 2752, scales.data(), 300}));
  EXPECT_FALSE(
      Fp8RowStore<Tile>::can_implement(shape, Fp8Output{codes + 8, 2752, scales.data(), 300}));
  EXPECT_TRUE(Fp8RowStore<Tile>::can_implement(shape, Fp8Output{codes, 2752, scales.data(), 300}));
}

}  // namespace
}  // namespace coda::kernel
