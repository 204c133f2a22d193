// The op API refuses bad arguments with a coda::Error naming the argument, before it touches the
// device: these checks run (and are tested) on machines without a GPU.

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <functional>
#include <string>

#include "coda/kernel/aux_kernels.hpp"
#include "coda/ops.hpp"

namespace coda::ops {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e.what();
  }
  ADD_FAILURE() << "expected coda::Error";
  return {};
}

// Addresses that are never dereferenced: the checks reject them first.
const bf16* fake(uintptr_t address) { return reinterpret_cast<const bf16*>(address); }
bf16* fake_mut(uintptr_t address) { return reinterpret_cast<bf16*>(address); }

TEST(OpArguments, SizesAreCheckedWithTheirValues) {
  EXPECT_THAT(error_of([] { gemm(fake(256), fake(512), fake_mut(768), 0, 16, 16, nullptr); }),
              AllOf(HasSubstr("coda::ops::gemm"), HasSubstr("M=0")));
  EXPECT_THAT(error_of([] { gemm(fake(256), fake(512), fake_mut(768), 4, 12, 16, nullptr); }),
              AllOf(HasSubstr("N must be a multiple of 8"), HasSubstr("got 12")));
  EXPECT_THAT(error_of([] { gemm_xty(fake(256), fake(512), fake_mut(768), 12, 16, 5, nullptr); }),
              HasSubstr("M and N must be multiples of 8"));
  EXPECT_THAT(error_of([] {
                gemm_rmsnorm_swiglu(fake(256), fake(512), nullptr, fake_mut(768), fake_mut(1024), 4,
                                    24, 16, nullptr);
              }),
              AllOf(HasSubstr("2I must be a multiple of 16"), HasSubstr("got 24")));
}

TEST(OpArguments, NullAndMisalignedPointersAreNamed) {
  EXPECT_THAT(error_of([] { gemm(fake(256), nullptr, fake_mut(768), 4, 16, 16, nullptr); }),
              HasSubstr("w is null"));
  EXPECT_THAT(error_of([] { gemm(fake(256 + 2), fake(512), fake_mut(768), 4, 16, 16, nullptr); }),
              AllOf(HasSubstr("x must be 16-byte aligned"), HasSubstr("0x102")));
  EXPECT_THAT(error_of([] {
                rope_backward(fake(256), fake(512), nullptr, {nullptr, nullptr, 16}, 4, 16, 64,
                              fake_mut(768), nullptr, nullptr);
              }),
              HasSubstr("pos is null"));
}

TEST(OpArguments, TheRopeBackwardKernelRefusesRowsItCannotReadAsWords) {
  // The kernel layer under ops::rope_backward (which asks for 16-byte alignment) reads bf16 pairs
  // as 32-bit words: an odd-element pointer is an error, not a misaligned-address fault.
  const uint32_t* words = reinterpret_cast<const uint32_t*>(uintptr_t(1024));
  EXPECT_THAT(error_of([&] {
                kernel::rope_backward(fake(256), fake(512 + 2), reinterpret_cast<const int32_t*>(1024),
                                      words, words, 4, 16, 64, fake_mut(768),
                                      reinterpret_cast<float*>(1024), nullptr);
              }),
              AllOf(HasSubstr("dy must be 4-byte aligned"), HasSubstr("0x202")));
}

TEST(OpArguments, TableAndWidthMismatchesAreNamed) {
  EXPECT_THAT(error_of([] {
                rope_backward(fake(256), fake(512), nullptr, {nullptr, nullptr, 8}, 4, 16, 64,
                              fake_mut(768), nullptr, nullptr);
              }),
              AllOf(HasSubstr("freq table has 8 columns"), HasSubstr("width=16")));
  EXPECT_THAT(error_of([] {
                rmsnorm_fold(nullptr, {128, 1, 4}, 64, 1e-5f, nullptr, nullptr);
              }),
              HasSubstr("sumsq_partials is null"));
}

TEST(OpArguments, SplitRopeTableKeepsBothWords) {
  const std::vector<programs::RopeFrequency> t{{1, 2}, {3, 4}, {0xffffffffu, 0}};
  std::vector<uint32_t> hi, lo;
  split_rope_table(t, hi, lo);
  EXPECT_EQ(hi, (std::vector<uint32_t>{1, 3, 0xffffffffu}));
  EXPECT_EQ(lo, (std::vector<uint32_t>{2, 4, 0}));
}

}  // namespace
}  // namespace coda::ops
