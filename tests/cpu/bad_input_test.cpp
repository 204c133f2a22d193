// Bad input gives a clear coda::Error naming the argument and the expected vs actual value.

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <functional>
#include <string>

#include "coda/programs/backward.hpp"
#include "coda/programs/forward.hpp"
#include "coda/programs/weight_layout.hpp"
#include "coda/reference/executor.hpp"
#include "coda/reference/llama.hpp"

namespace coda {
namespace {

using reference::MatrixRef;
using reference::TileConfig;
using ::testing::AllOf;
using ::testing::HasSubstr;
using V = std::vector<double>;

// Runs `fn`, expects coda::Error, and returns its message for matching.
std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e.what();
  }
  ADD_FAILURE() << "expected coda::Error";
  return {};
}

struct F1Fixture {
  int64_t M = 5, N = 8, K = 4;
  V a = V(M * K, 1.0), w = V(N * K, 1.0), res = V(M * N, 0.0), gamma = V(N, 1.0);
  V x = V(M * N), h = V(M * N);
  TileConfig tiles{4, 4, 2, 2};
  programs::ResidualRmsnormPartial<double> p;
  V part;
  F1Fixture() {
    p.layout = epilogue::PartialLayout::per_row(M, N, tiles.tile_m, tiles.tile_n);
    part.resize(p.layout.elements());
    p.residual = {res.data(), M, N, N};
    p.gamma = {gamma.data(), N};
    p.x = {x.data(), M, N, N};
    p.h = {h.data(), M, N, N};
    p.partials = part.data();
  }
  void run() {
    reference::execute<double>(MatrixRef<double>::row_major(a.data(), M, K),
                               MatrixRef<double>::row_major(w.data(), N, K), p, tiles);
  }
};

TEST(BadInput, MismatchedShapes) {
  F1Fixture f;
  f.run();  // the fixture itself is valid
  EXPECT_THAT(error_of([&] {
                reference::execute<double>(MatrixRef<double>::row_major(f.a.data(), f.M, f.K),
                                           MatrixRef<double>::row_major(f.w.data(), f.N, f.K - 1),
                                           f.p, f.tiles);
              }),
              AllOf(HasSubstr("K extents differ"), HasSubstr("(5, 4)"), HasSubstr("(8, 3)")));
  f.p.gamma.size = 7;
  EXPECT_THAT(error_of([&] { f.run(); }),
              AllOf(HasSubstr("gamma"), HasSubstr("has 7 entries, expected 8")));
  F1Fixture g;
  g.p.residual.rows = 4;
  EXPECT_THAT(error_of([&] { g.run(); }),
              AllOf(HasSubstr("residual"), HasSubstr("(4, 8), expected (5, 8)")));
  EXPECT_THAT(error_of([] { programs::interleave_gate_up(V(6), V(8), 2, 3); }),
              AllOf(HasSubstr("w_up"), HasSubstr("8 elements, expected (2, 3)")));
}

TEST(BadInput, PartialBufferForAnotherTileSize) {
  F1Fixture f;
  f.p.layout = epilogue::PartialLayout::per_row(f.M, f.N, 8, 8);
  EXPECT_THAT(error_of([&] { f.run(); }),
              AllOf(HasSubstr("sumsq_partials"), HasSubstr("tiles 1"), HasSubstr("tiles 2")));
}

TEST(BadInput, TileDivisibility) {
  F1Fixture f;
  f.tiles = {4, 6, 4, 4};
  EXPECT_THAT(error_of([&] { f.run(); }), HasSubstr("subtile 4x4 must divide the tile 4x6"));
  f.tiles = {4, 6, 2, 3};
  EXPECT_THAT(error_of([&] { f.run(); }), HasSubstr("subtile_n must be even"));
  EXPECT_THAT(error_of([] {
                programs::QkvLayout{6, 4, 8}.validate();
              }),
              HasSubstr("n_heads (6) must be a multiple of n_kv_heads (4)"));
  EXPECT_THAT(error_of([] { programs::rope_inv_freq(7, 10000.0); }), HasSubstr("head_dim"));
}

TEST(BadInput, NullPointers) {
  F1Fixture f;
  f.p.h.data = nullptr;
  EXPECT_THAT(error_of([&] { f.run(); }), HasSubstr("h is null"));
  F1Fixture g;
  g.p.partials = nullptr;
  EXPECT_THAT(error_of([&] { g.run(); }), HasSubstr("sumsq_partials is null"));
  EXPECT_THAT(error_of([&] {
                reference::execute<double>(MatrixRef<double>{nullptr, 5, 4, 4, 1},
                                           MatrixRef<double>::row_major(g.w.data(), 8, 4), g.p,
                                           g.tiles);
              }),
              HasSubstr("A is null"));
  EXPECT_THAT(error_of([] {
                programs::fold_lse_loss<double>(static_cast<double*>(nullptr),
                                                static_cast<double*>(nullptr), {}, nullptr,
                                                static_cast<int64_t*>(nullptr), 2, {});
              }),
              HasSubstr("null pointer"));
}

TEST(BadInput, NonPositiveSizes) {
  F1Fixture f;
  f.tiles = {0, 4, 2, 2};
  EXPECT_THAT(error_of([&] { f.run(); }), HasSubstr("sizes must be positive"));
  EXPECT_THAT(
      error_of([] { programs::fold_rstd<double>(static_cast<double*>(nullptr), {}, 0, 1e-5); }),
      HasSubstr("hidden must be positive, got 0"));
  reference::LlamaShape s{.hidden = 0,
                          .n_heads = 2,
                          .n_kv_heads = 1,
                          .head_dim = 4,
                          .intermediate = 8,
                          .vocab = 10,
                          .n_layers = 1,
                          .batch = 1,
                          .seq = 2};
  EXPECT_THAT(error_of([&] { s.validate(); }), HasSubstr("hidden 0"));
}

TEST(BadInput, OutOfRangeTargetIsNamed) {
  const epilogue::PartialLayout l{1, 1, 1};
  const double pmax = 0, psum = 1, tl = 0;
  const int64_t target = 7;
  EXPECT_THAT(
      error_of([&] { programs::fold_lse_loss<double>(&pmax, &psum, l, &tl, &target, 5, {}); }),
      AllOf(HasSubstr("targets[0] = 7"), HasSubstr("[0, 5)")));
}

}  // namespace
}  // namespace coda
