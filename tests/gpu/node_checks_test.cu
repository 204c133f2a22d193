// The epilogue nodes' host-side checks (can_implement) against the problem the launch checks:
// kernel/gemm.cuh asks CUTLASS with M, N and K rounded up to 8 (its alignment rule), so a node
// must accept a ragged problem's real arguments at the rounded extents. Host only (label cpu).

#include <gtest/gtest.h>

#include <cute/tensor.hpp>
#include <vector>

#include "coda/kernel/nodes/fp8_pair_decode.cuh"

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

}  // namespace
}  // namespace coda::kernel
