// The heuristic's tile order for pingpong 128x128 (cluster 1x2) against CUTLASS's own persistent
// tile scheduler, on the host (no GPU needed): the swizzle it picks pads the scheduled tile grid
// by at most 2% over swizzle 1, and no larger swizzle up to 8 would stay within that.

#include <cutlass/gemm/kernel/tile_scheduler_params.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <cstdlib>
#include <string>
#include <type_traits>
#include <utility>

#include "coda/common/check.hpp"
#include "coda/kernel/args.hpp"
#include "coda/kernel/heuristic.hpp"
#include "coda/kernel/runtime.hpp"

namespace coda::kernel {
namespace {

using SchedulerParams = cutlass::gemm::kernel::detail::PersistentTileSchedulerSm90Params;

// The tiles CUTLASS's scheduler hands out (padding included) for pingpong 128x128, cluster 1x2.
uint64_t scheduled_tiles(int m, int n, int swizzle) {
  SchedulerParams p;
  cutlass::KernelHardwareInfo hw;
  hw.sm_count = 132;
  p.initialize(cutlass::gemm::BatchedGemmCoord(m, n, 64, 1), cutlass::gemm::GemmCoord(128, 128, 64),
               cutlass::gemm::GemmCoord(1, 2, 1), hw, swizzle,
               SchedulerParams::RasterOrderOptions::AlongM);
  return p.blocks_per_problem_;
}

// An H100 / H200 SXM: the weight-gradient rule's multiprocessor count, given so that no device is
// queried (these tests run on hosts without a GPU).
constexpr int kH200Sms = 132;
constexpr DeviceProps kH200{kH200Sms};

struct Case {
  Program program;
  Operands operands;
  int k;
};

TEST(Heuristic, PingpongSwizzlePadsTheTileGridByAtMostTwoPercent) {
  const int ms[] = {1, 19, 128, 600, 1100, 4097, 8000, 8192, 16384, 16500};
  const int ns[] = {8,    200,  1032,  2048,  3072,  4096,  5632,
                    6144, 8200, 11008, 14336, 16384, 22016, 28672};
  const Case cases[] = {{Program::kPlain, Operands::kXWt, 2048},
                        {Program::kPlain, Operands::kXW, 2048},
                        {Program::kResidualRmsnormPartial, Operands::kXWt, 4096},
                        {Program::kRmsnormRope, Operands::kXWt, 2048},
                        {Program::kRmsnormSwiglu, Operands::kXWt, 2048},
                        {Program::kSwigluBackward, Operands::kXW, 2048},
                        {Program::kRmsnormBackward, Operands::kXW, 3072}};
  int checked = 0;
  for (const Case& c : cases)
    for (int m : ms)
      for (int n : ns) {
        const KernelChoice choice = choose_config(c.program, c.operands, {m, n, c.k}, kH200);
        if (choice.config != Config::kPing128x128x64_1x2) continue;
        const std::string at = std::string(program_name(c.program)) + " M=" + std::to_string(m) +
                               " N=" + std::to_string(n) + " K=" + std::to_string(c.k);
        ASSERT_EQ(choice.scheduler.raster, Raster::kAlongM) << at;
        const int s = choice.scheduler.swizzle;
        const uint64_t unswizzled = scheduled_tiles(m, n, 1);
        EXPECT_LE(scheduled_tiles(m, n, s) * 50, unswizzled * 51) << at << " swizzle " << s;
        for (int larger = 2 * s; larger <= 8; larger *= 2)
          EXPECT_GT(scheduled_tiles(m, n, larger) * 50, unswizzled * 51)
              << at << ": swizzle " << larger << " pads no more than 2% but " << s << " was chosen";
        ++checked;
      }
  EXPECT_GT(checked, 500);
  // 1B QKV: 24 tile columns; swizzle 8 rounds them up to 32 (measured 38-47% slower than 1, and
  // swizzle 4 3-8% faster than 1).
  EXPECT_EQ(
      choose_config(Program::kRmsnormRope, Operands::kXWt, {8192, 3072, 2048}, kH200).scheduler.swizzle, 4);
}

// Blockwise FP8 (cooperative 128x128, cluster 1x2: the pingpong tile grid): the padding rule's
// swizzle, capped at 2 from K = 32768 (src/heuristic.cpp: the 70B gate/up data gradient and its
// B1, K = 57344, ran erratically at swizzle 8).
TEST(Heuristic, Fp8GemmsCapTheSwizzleAt2FromK32768) {
  for (Program p : {Program::kPlain, Program::kRmsnormBackwardFp8})
    for (int m : {8192, 16384}) {
      const KernelChoice long_k = choose_config(p, Operands::kFp8XWt, {m, 8192, 57344}, kH200);
      EXPECT_EQ(long_k.config, Config::kCoop128x128x128_1x2) << program_name(p) << " M=" << m;
      EXPECT_EQ(long_k.scheduler.swizzle, 2) << program_name(p) << " M=" << m;
      EXPECT_EQ(long_k.scheduler.raster, Raster::kAlongM) << program_name(p) << " M=" << m;
      // 8B gate/up (K = 28672) keeps the padding rule's 8.
      EXPECT_EQ(choose_config(p, Operands::kFp8XWt, {m, 4096, 28672}, kH200).scheduler.swizzle, 8)
          << program_name(p) << " M=" << m;
    }
  const int ms[] = {1, 19, 128, 600, 4097, 8192, 16384};
  const int ns[] = {8, 200, 1032, 4096, 8200, 8192, 16384};
  for (int m : ms)
    for (int n : ns) {
      const KernelChoice c =
          choose_config(Program::kPlain, Operands::kFp8XWt, {m, n, 57344}, kH200);
      const int s = c.scheduler.swizzle;
      const uint64_t unswizzled = scheduled_tiles(m, n, 1);
      const std::string at = "M=" + std::to_string(m) + " N=" + std::to_string(n);
      ASSERT_TRUE(s == 1 || s == 2) << at << " swizzle " << s;
      EXPECT_LE(scheduled_tiles(m, n, s) * 50, unswizzled * 51) << at << " swizzle " << s;
      if (s == 1) EXPECT_GT(scheduled_tiles(m, n, 2) * 50, unswizzled * 51) << at;
    }
}

// The blockwise FP8 mainloop: the plain forward / data-gradient GEMM promotes under the next
// k-tile's MMAs up to K = 16384 and runs CUTLASS's loop above (the overlapped loop ran 0.74-0.99x
// cuBLASLt from K = 28672); F2, F2z, B2 and B2z always overlap, F1, B1, F3, F3q and the weight
// gradient never (src/heuristic.cpp).
TEST(Heuristic, Fp8PromotionUnderTheMmasUpToK16384) {
  const Config overlap = Config::kCoop128x128x128_1x2_Overlap, stock = Config::kCoop128x128x128_1x2;
  for (int m : {1, 300, 8192, 16384})
    for (int n : {8, 2048, 8192, 28672}) {
      const std::string at = "M=" + std::to_string(m) + " N=" + std::to_string(n);
      for (int k : {16, 2048, 8192, 16384})
        EXPECT_EQ(choose_config(Program::kPlain, Operands::kFp8XWt, {m, n, k}, kH200).config,
                  overlap)
            << at << " K=" << k;
      for (int k : {16400, 28672, 57344})
        EXPECT_EQ(choose_config(Program::kPlain, Operands::kFp8XWt, {m, n, k}, kH200).config, stock)
            << at << " K=" << k;
      for (int k : {2048, 57344}) {
        EXPECT_EQ(choose_config(Program::kPlain, Operands::kFp8XYt, {m, n, k}, kH200).config, stock)
            << at << " K=" << k;
        EXPECT_EQ(
            choose_config(Program::kAccumulateF32, Operands::kFp8XYt, {m, n, k}, kH200).config,
            stock)
            << at << " K=" << k;
        for (Program p : {Program::kRmsnormSwigluFp8, Program::kRmsnormSwigluFp8Z,
                          Program::kSwigluBackwardFp8, Program::kSwigluBackwardFp8Z})
          EXPECT_EQ(choose_config(p, Operands::kFp8XWt, {m, n, k}, kH200).config, overlap)
              << program_name(p) << " " << at << " K=" << k;
        for (Program p :
             {Program::kResidualRmsnormFp8, Program::kResidualRmsnormPartial,
              Program::kRmsnormBackwardFp8, Program::kRmsnormRope, Program::kRmsnormQkNormRope})
          EXPECT_EQ(choose_config(p, Operands::kFp8XWt, {m, n, k}, kH200).config, stock)
              << program_name(p) << " " << at << " K=" << k;
      }
    }
}

// The weight-gradient GEMM's choice (D = Xᵀ·Y, the weight's M x N, K = tokens) against `want`.

void expect_xty_choice(int m, int n, int k, Config config, int swizzle, Raster raster) {
  const KernelChoice c = choose_config(Program::kPlain, Operands::kXtY, {m, n, k}, kH200);
  EXPECT_EQ(c.config, config) << m << "x" << n << "x" << k;
  EXPECT_EQ(c.scheduler.swizzle, swizzle) << m << "x" << n << "x" << k;
  EXPECT_EQ(c.scheduler.raster, raster) << m << "x" << n << "x" << k;
}

TEST(Heuristic, WeightGradientsTakeSwizzle8AlongNOrThePingpongPaddingRule) {
  const Config coop = Config::kCoop128x256x64_2x1, ping = Config::kPing128x128x64_1x2;
  // Run 125 (sustained load, 8192 tokens): swizzle 1 along M, the earlier choice at N <= 6144,
  // ran 2-8% slower than 8 along N. 8B dW gate/up (2I x H), 8B dW out-proj, 1B dW out-proj:
  expect_xty_choice(28672, 4096, 8192, coop, 8, Raster::kAlongN);
  expect_xty_choice(4096, 4096, 8192, coop, 8, Raster::kAlongN);
  expect_xty_choice(2048, 2048, 8192, coop, 8, Raster::kAlongN);
  // 1B dW qkv (3072 x 2048): 128x256 tiles fill 1.45 waves badly, pingpong 128x128 with its order.
  expect_xty_choice(3072, 2048, 8192, ping, 8, Raster::kAlongM);
  // Not timed under sustained load, so the earlier rule (swizzle 1 along M): at most 2048 tokens, and the
  // LM head's dW (vocabulary rows x H, H <= 6144).
  expect_xty_choice(28672, 4096, 2048, coop, 1, Raster::kAlongM);
  expect_xty_choice(3072, 2048, 2048, ping, 1, Raster::kAlongM);
  expect_xty_choice(128256, 2048, 2048, coop, 1, Raster::kAlongM);
  expect_xty_choice(128256, 2048, 8192, coop, 1, Raster::kAlongM);
}

TEST(Heuristic, WeightGradientWaveFillCountsTheDevicesMultiprocessors) {
  const auto xty = [](int sms) {
    return choose_config(Program::kPlain, Operands::kXtY, {3072, 2048, 8192}, {sms}).config;
  };
  // 1B dW qkv: 192 tiles of 128x256. On 132 SMs they fill 73% of the two waves they take, the 384
  // pingpong tiles 97% of three: pingpong. On 96 SMs the 128x256 tiles fill two waves exactly; on
  // 114 (an H100 PCIe) both fill 84% of theirs: the 128x256 tile stays.
  EXPECT_EQ(xty(kH200Sms), Config::kPing128x128x64_1x2);
  EXPECT_EQ(xty(96), Config::kCoop128x256x64_2x1);
  EXPECT_EQ(xty(114), Config::kCoop128x256x64_2x1);
  // The other programs' choices do not depend on it; a count that is not positive is an error.
  EXPECT_EQ(choose_config(Program::kSwigluBackward, Operands::kXW, {8192, 8192, 2048}, {78}).config,
            choose_config(Program::kSwigluBackward, Operands::kXW, {8192, 8192, 2048}, kH200).config);
  EXPECT_THROW(choose_config(Program::kPlain, Operands::kXtY, {3072, 2048, 8192}, {0}), coda::Error);
}

TEST(Heuristic, AFailedDevicePropertyQueryIsReportedNotCached) {
  // No such device (on a host without a GPU, no device at all): an error, the properties
  // untouched, and nothing cached, so the next query asks again and fails again.
  for (int attempt = 0; attempt < 2; ++attempt) {
    DeviceProps props{-7};
    EXPECT_NE(device_props(1 << 20, &props), cudaSuccess) << attempt;
    EXPECT_EQ(props.multiprocessors, -7) << attempt;
  }
}

// The table (kernel/table.def) and the heuristic agree: for every (program, operands) pair the
// table compiles, at every shape of a sweep (LLaMA-3 widths, ragged sizes, the LM head) and on
// devices of 78, 114 and 132 multiprocessors, the choice is a kernel of the table; and every
// configuration is compiled for some program.
TEST(Heuristic, EveryChoiceIsAKernelOfTheTable) {
  const int ms[] = {1, 19, 600, 4097, 8192, 16384};
  const int ns[] = {8, 1032, 2048, 3072, 4096, 6144, 8192, 10240, 14336, 16384, 28672, 57344,
                    128256};
  const int ks[] = {8, 1024, 2048, 4096, 8192, 14336, 28672, 57344};
  int checked = 0;
  for (int p = 0; p < int(Program::kCount); ++p)
    for (Operands o : kAllOperands) {
      bool listed = false;
      for (int c = 0; c < int(Config::kCount); ++c) listed |= in_table(Program(p), Config(c), o);
      if (!listed) continue;
      for (int sms : {78, 114, 132})
        for (int m : ms)
          for (int n : ns)
            for (int k : ks) {
              const KernelChoice c = choose_config(Program(p), o, {m, n, k}, {sms});
              ASSERT_TRUE(in_table(Program(p), c.config, o))
                  << program_name(Program(p)) << " " << operands_name(o) << " M=" << m << " N=" << n
                  << " K=" << k << ": " << config_name(c.config) << " is not in the table";
              ++checked;
            }
    }
  EXPECT_GT(checked, 10000);
  for (int c = 0; c < int(Config::kCount); ++c) {
    bool used = false;
    for (int p = 0; p < int(Program::kCount); ++p)
      for (Operands o : kAllOperands)
        used |= in_table(Program(p), Config(c), o);
    EXPECT_TRUE(used) << config_name(Config(c)) << " is compiled for no program";
  }
}

TEST(KernelTable, ArgsOfNamesEachProgramsOperandStruct) {
  static_assert(std::is_same_v<ArgsOf<Program::kRmsnormBackward>, RmsnormBackwardArgs>);
  static_assert(std::is_same_v<ArgsOf<Program::kRmsnormLseLogits>, RmsnormLseArgs>);
  static_assert(std::is_same_v<ArgsOf<Program::kPairLayoutProbe>, PlainArgs>);
  EXPECT_EQ(tile_shape(Config::kCoop256x128x64_1x2).m, 256);
  EXPECT_EQ(tile_shape(Config::kPing128x192x64_2x1).n, 192);
  EXPECT_STREQ(config_name(Config::kPing128x128x64_1x2), "ping_128x128x64_c1x2");
}

TEST(ProgrammaticLaunch, TheSwitchAndItsEnvironmentValue) {
  const bool was = programmatic_launch();
  set_programmatic_launch(false);
  EXPECT_FALSE(programmatic_launch());
  set_programmatic_launch(true);
  EXPECT_TRUE(programmatic_launch());
  set_programmatic_launch(was);
  EXPECT_TRUE(parse_programmatic_launch(nullptr));
  EXPECT_TRUE(parse_programmatic_launch(""));
  EXPECT_TRUE(parse_programmatic_launch("1"));
  EXPECT_FALSE(parse_programmatic_launch("0"));
  for (const char* bad : {"yes", "01", " 1", "off"}) {
    try {
      parse_programmatic_launch(bad);
      ADD_FAILURE() << "'" << bad << "' accepted";
    } catch (const Error& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find("CODA_PROGRAMMATIC_LAUNCH"), std::string::npos) << what;
      EXPECT_NE(what.find(std::string("'") + bad + "'"), std::string::npos) << what;
    }
  }
}

TEST(KernelOverride, ParsesEntriesByTheNamesTheLibraryPrints) {
  const auto v = parse_kernel_overrides(
      "gemm_rmsnorm_backward/XW=ping_128x128x64_c1x2:8:M;;gemm/XtY=coop_128x256x64_c2x1:4:N");
  ASSERT_EQ(v.size(), 2u);
  EXPECT_EQ(v[0].program, Program::kRmsnormBackward);
  EXPECT_EQ(v[0].operands, Operands::kXW);
  EXPECT_EQ(v[0].choice.config, Config::kPing128x128x64_1x2);
  EXPECT_EQ(v[0].choice.scheduler.swizzle, 8);
  EXPECT_EQ(v[0].choice.scheduler.raster, Raster::kAlongM);
  EXPECT_EQ(v[1].program, Program::kPlain);
  EXPECT_EQ(v[1].operands, Operands::kXtY);
  EXPECT_EQ(v[1].choice.config, Config::kCoop128x256x64_2x1);
  EXPECT_EQ(v[1].choice.scheduler.swizzle, 4);
  EXPECT_EQ(v[1].choice.scheduler.raster, Raster::kAlongN);
  EXPECT_TRUE(parse_kernel_overrides("").empty());
  EXPECT_TRUE(parse_kernel_overrides(" ; \n").empty());
  const auto spaced = parse_kernel_overrides(" gemm/XW=ping_128x128x64_c1x2:2:N ;\n");
  ASSERT_EQ(spaced.size(), 1u);
  EXPECT_EQ(spaced[0].choice.scheduler.swizzle, 2);
  // Every program has a name an override can use.
  for (int i = 0; i < int(Program::kCount); ++i)
    EXPECT_NE(std::string(program_name(Program(i))), "?") << i;
}

TEST(KernelOverride, AnEntryCanBeLimitedToOneK) {
  const auto v = parse_kernel_overrides(
      "gemm_rmsnorm_backward/XW@28672=coop_256x128x64_c1x2:8:M;"
      "gemm_rmsnorm_backward/XW=ping_128x128x64_c1x2:4:M");
  ASSERT_EQ(v.size(), 2u);
  EXPECT_EQ(v[0].k, 28672);
  EXPECT_EQ(v[0].operands, Operands::kXW);
  EXPECT_EQ(v[0].choice.config, Config::kCoop256x128x64_1x2);
  EXPECT_EQ(v[1].k, 0);
}

// Clears the process-wide overrides when a test ends however it ends, so that an exception
// thrown mid-test cannot leave them set for the tests after it in this binary.
struct ClearOverridesAtExit {
  ~ClearOverridesAtExit() { set_kernel_overrides(""); }
};

// select_kernel refuses kernels a subset build (CODA_KERNELS) lacks: the override tests need B1's
// two configurations.
bool b1_kernels_compiled() {
  return compiled(Program::kRmsnormBackward, Config::kPing128x128x64_1x2, Operands::kXW) &&
         compiled(Program::kRmsnormBackward, Config::kCoop256x128x64_1x2, Operands::kXW);
}

TEST(KernelOverride, AnEntryForTheKWinsOverOneForEveryK) {
  if (!b1_kernels_compiled()) GTEST_SKIP() << "B1's kernels are not in this build (CODA_KERNELS)";
  // Listed after the general entry, the @K one still applies at its K.
  const ClearOverridesAtExit clear;
  set_kernel_overrides(
      "gemm_rmsnorm_backward/XW=ping_128x128x64_c1x2:4:M;"
      "gemm_rmsnorm_backward/XW@28672=coop_256x128x64_c1x2:2:N");
  const KernelChoice at_k =
      select_kernel(Program::kRmsnormBackward, Operands::kXW, {8192, 4096, 28672}, &kH200);
  const KernelChoice other =
      select_kernel(Program::kRmsnormBackward, Operands::kXW, {8192, 4096, 6144}, &kH200);
  set_kernel_overrides("");
  EXPECT_EQ(at_k.config, Config::kCoop256x128x64_1x2);
  EXPECT_EQ(at_k.scheduler.swizzle, 2);
  EXPECT_EQ(other.config, Config::kPing128x128x64_1x2);
  EXPECT_EQ(other.scheduler.swizzle, 4);
}

TEST(KernelOverride, SetReplacesTheActiveOverridesAndKeepsThemOnABadSpec) {
  if (!b1_kernels_compiled()) GTEST_SKIP() << "B1's kernels are not in this build (CODA_KERNELS)";
  // 8B B1: gate/up (K = 28672) and QKV (K = 6144) share the program; the entry for one K leaves
  // the other to the heuristic.
  const ClearOverridesAtExit clear;
  const KernelChoice qkv = select_kernel(Program::kRmsnormBackward, Operands::kXW, {8192, 4096, 6144}, &kH200);
  set_kernel_overrides("gemm_rmsnorm_backward/XW@28672=coop_256x128x64_c1x2:2:N");
  const KernelChoice gu = select_kernel(Program::kRmsnormBackward, Operands::kXW, {8192, 4096, 28672}, &kH200);
  EXPECT_EQ(gu.config, Config::kCoop256x128x64_1x2);
  EXPECT_EQ(gu.scheduler.swizzle, 2);
  EXPECT_EQ(gu.scheduler.raster, Raster::kAlongN);
  const KernelChoice qkv2 = select_kernel(Program::kRmsnormBackward, Operands::kXW, {8192, 4096, 6144}, &kH200);
  EXPECT_EQ(qkv2.config, qkv.config);
  EXPECT_EQ(qkv2.scheduler.swizzle, qkv.scheduler.swizzle);
  EXPECT_THROW(set_kernel_overrides("gemm_rmsnorm_backward/XW@x=ping_128x128x64_c1x2:8:M"), Error);
  EXPECT_EQ(select_kernel(Program::kRmsnormBackward, Operands::kXW, {8192, 4096, 28672}, &kH200).scheduler.swizzle,
            2);
  set_kernel_overrides("");
  const KernelChoice back = select_kernel(Program::kRmsnormBackward, Operands::kXW, {8192, 4096, 28672}, &kH200);
  EXPECT_EQ(back.scheduler.swizzle, 8);  // the heuristic's swizzle for either configuration
}

TEST(KernelOverride, BadEntriesNameThePartAndTheAcceptedValues) {
  auto message = [](const std::string& spec) -> std::string {
    try {
      parse_kernel_overrides(spec);
    } catch (const Error& e) {
      return e.what();
    }
    return "no error";
  };
  const std::pair<std::string, std::string> bad[] = {
      {"gemm=ping_128x128x64_c1x2:8:M", "expected PROGRAM/OPERANDS[@K]=CONFIG:SWIZZLE:RASTER"},
      {"gemm/XW@=ping_128x128x64_c1x2:8:M", "K '' in"},
      {"gemm/XW@-4=ping_128x128x64_c1x2:8:M", "K '-4' in"},
      {"gemm/XW@0=ping_128x128x64_c1x2:8:M", "K '0' in"},
      {"gemm/XW@8=ping_128x128x64_c1x2:8:M;gemm/XW@8=coop_256x128x64_c1x2:8:N",
       "gemm/XW@8 is named twice"},
      {"gemm_b1/XW=ping_128x128x64_c1x2:8:M", "unknown program 'gemm_b1'"},
      {"gemm/XY=ping_128x128x64_c1x2:8:M", "operands 'XY'"},
      {"gemm/XW=ping_128x999x64_c1x2:8:M", "unknown configuration 'ping_128x999x64_c1x2'"},
      {"gemm_swiglu_backward/XW=coop_256x128x64_c1x2:8:M",
       "is not a kernel of include/coda/kernel/table.def"},
      {"gemm/XW=ping_128x128x64_c1x2:3:M", "swizzle '3'"},
      {"gemm/XW=ping_128x128x64_c1x2:8", "raster ''"},
      {"gemm/XW=ping_128x128x64_c1x2:8:M:junk", "unexpected 'junk' after the raster"},
      {"gemm/XW=ping_128x128x64_c1x2:8:M;gemm/XW=coop_256x128x64_c1x2:8:N",
       "gemm/XW is named twice"},
  };
  for (const auto& [spec, want] : bad) {
    const std::string got = message(spec);
    EXPECT_NE(got.find("CODA_KERNEL_OVERRIDE"), std::string::npos) << spec << ": " << got;
    EXPECT_NE(got.find(want), std::string::npos) << spec << ": " << got;
  }
  EXPECT_NE(message("gemm_b1/XW=a:1:M").find("gemm_rmsnorm_backward"), std::string::npos);
}

}  // namespace
}  // namespace coda::kernel
