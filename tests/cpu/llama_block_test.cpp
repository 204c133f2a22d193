// The whole reparameterized decoder (first layer, middle blocks, last layer + LM head + CE) forward
// and backward, through the block compositions (block/compose.hpp) on the reference executor,
// against the independent, unfused fp64 model: loss and the gradient of every input and weight,
// both RMSNorm gammas included, within 1e-10 relative. Each case runs every LM head path: the
// loss with its gradient in token chunks (row kernel or F4 storing logits), and the loss, then
// its backward recomputing the logits in vocabulary slices.

#include <gtest/gtest.h>

#include <cmath>
#include <string>

#include "support/llama_convert.hpp"
#include "support/numeric.hpp"

namespace coda::testing {
namespace {

constexpr double kTol = 1e-10;

struct Case {
  std::string name;
  LlamaConfig cfg;
  reference::TileConfig tiles;
  LossOptions loss;
};

std::vector<Case> cases() {
  // GQA everywhere; V = 38 and H = 32 are not multiples of the 24-wide tiles.
  const LlamaConfig one{32, 4, 2, 8, 24, 38, 1, 2, 5, 1e-5};
  const LlamaConfig three{32, 4, 2, 8, 24, 38, 3, 2, 5, 1e-5};
  const LlamaConfig d64{128, 4, 1, 64, 40, 50, 2, 1, 7, 1e-6};
  return {
      {"OneLayerMean", one, {16, 24, 8, 8}, {.mean = true}},
      {"ThreeLayersMean", three, {16, 24, 8, 8}, {.mean = true}},
      {"ThreeLayersSumZLoss", three, {128, 128, 64, 32}, {.mean = false, .z_loss = 1e-2}},
      {"HeadDim64", d64, {64, 64, 32, 16}, {.mean = true, .z_loss = 1e-3}},
      // An ignore_index inside the vocabulary: the ignored rows' targets are valid columns.
      {"IgnoreIndexInVocabulary", three, {16, 24, 8, 8}, {.ignore_index = 3, .mean = true}},
  };
}

class LlamaBlockTest : public ::testing::TestWithParam<Case> {};

void expect_all(double loss_fused, double loss_std, const ModelGrads& g, const ModelGrads& g_std);

void expect_close(const std::vector<double>& fused, const std::vector<double>& standard,
                  const std::string& what) {
  const double e = max_rel_error(fused, standard);
  EXPECT_LT(e, kTol) << what << ": max rel error " << e;
}

TEST_P(LlamaBlockTest, FusedMatchesStandardForwardAndBackward) {
  const Case& c = GetParam();
  const ModelWeights w = random_weights(c.cfg, 42);
  const int64_t M = c.cfg.tokens();
  const auto x0 = random_vector(M * c.cfg.hidden, 1.0, 43);
  std::vector<int64_t> targets(M);
  Rng rng(44);
  for (int64_t m = 0; m < M; ++m)
    targets[m] = (m % 4 == 3) ? c.loss.ignore_index : rng.integer(0, c.cfg.vocab - 1);

  ModelGrads g_std;
  const double loss_std = llama_loss(c.cfg, w, x0, targets, c.loss, &g_std);

  const programs::CrossEntropyOptions ce{
      .ignore_index = c.loss.ignore_index,
      .reduction = c.loss.mean ? programs::Reduction::kMean : programs::Reduction::kSum,
      .z_loss = c.loss.z_loss};
  // Budgets that split the LM head: chunks of 8 tokens (the logits and h_out of 8 rows, (V + H)
  // values each in fp64), and vocabulary slices (a budget below M x V fp64 logits; one below the
  // sliced path's own scratch gives the smallest slice, 8 columns).
  const int64_t V = c.cfg.vocab, H = c.cfg.hidden;
  struct Path {
    const char* name;
    reference::LmHeadPath path;
    block::LossOptions loss;
  };
  const Path paths[] = {
      {"loss+grad, row kernel, chunks", reference::LmHeadPath::kLossGrad,
       {.ce = ce, .max_chunk_bytes = 8 * (V + H) * 8}},
      {"loss+grad, F4 logits", reference::LmHeadPath::kLossGrad,
       {.ce = ce, .row_kernel_max_hidden = 0}},
      {"loss, then backward in slices", reference::LmHeadPath::kRecompute,
       {.ce = ce, .max_chunk_bytes = M * V * 8 - 1}},
  };
  for (const Path& path : paths) {
    SCOPED_TRACE(path.name);
    reference::FusedGrads<double> g_fused_raw;
    const double loss_fused =
        reference::fused_llama_loss(fused_shape(c.cfg), to_fused(c.cfg, w), x0, targets,
                                    path.loss, c.tiles, &g_fused_raw, path.path);
    const ModelGrads g = from_fused(c.cfg, g_fused_raw);
    expect_all(loss_fused, loss_std, g, g_std);
  }
}

void expect_all(double loss_fused, double loss_std, const ModelGrads& g, const ModelGrads& g_std) {
  EXPECT_NEAR(loss_fused, loss_std, kTol * std::abs(loss_std));
  expect_close(g.dx0, g_std.dx0, "dx0");
  expect_close(g.gamma_final, g_std.gamma_final, "gamma_final");
  expect_close(g.w_vocab, g_std.w_vocab, "w_vocab");
  ASSERT_EQ(g.layers.size(), g_std.layers.size());
  for (size_t l = 0; l < g.layers.size(); ++l) {
    const auto &a = g.layers[l], &b = g_std.layers[l];
    const std::string p = "layer " + std::to_string(l) + " ";
    expect_close(a.gamma_attn, b.gamma_attn, p + "gamma_attn");
    expect_close(a.wq, b.wq, p + "wq");
    expect_close(a.wk, b.wk, p + "wk");
    expect_close(a.wv, b.wv, p + "wv");
    expect_close(a.wo, b.wo, p + "wo");
    expect_close(a.gamma_ffn, b.gamma_ffn, p + "gamma_ffn");
    expect_close(a.w_gate, b.w_gate, p + "w_gate");
    expect_close(a.w_up, b.w_up, p + "w_up");
    expect_close(a.w_down, b.w_down, p + "w_down");
  }
}

INSTANTIATE_TEST_SUITE_P(Configs, LlamaBlockTest, ::testing::ValuesIn(cases()),
                         [](const auto& info) { return info.param.name; });

// The comparison above can fail: a fused model with one weight perturbed is rejected.
TEST(LlamaBlockSanity, PerturbedWeightIsDetected) {
  const LlamaConfig cfg{32, 4, 2, 8, 24, 38, 1, 1, 4, 1e-5};
  const ModelWeights w = random_weights(cfg, 7);
  const auto x0 = random_vector(cfg.tokens() * cfg.hidden, 1.0, 8);
  const std::vector<int64_t> targets{1, 2, 3, 4};
  const double loss_std = llama_loss(cfg, w, x0, targets, {}, nullptr);
  auto fused = to_fused(cfg, w);
  fused.layers[0].gamma_ffn[3] *= 1.0 + 1e-7;
  const double loss_fused = reference::fused_llama_loss(
      fused_shape(cfg), fused, x0, targets, block::LossOptions{},
      reference::TileConfig{}, static_cast<reference::FusedGrads<double>*>(nullptr));
  EXPECT_GT(std::abs(loss_fused - loss_std), kTol * std::abs(loss_std));
}

// The decoder returns one loss: reduction 'none' is refused, not answered with token 0's loss.
TEST(LlamaBlockSanity, PerTokenReductionIsRefused) {
  const LlamaConfig cfg{32, 4, 2, 8, 24, 38, 1, 1, 4, 1e-5};
  const ModelWeights w = random_weights(cfg, 7);
  const auto x0 = random_vector(cfg.tokens() * cfg.hidden, 1.0, 8);
  const std::vector<int64_t> targets{1, 2, 3, 4};
  block::LossOptions none;
  none.ce.reduction = programs::Reduction::kNone;
  reference::FusedGrads<double> grads;
  EXPECT_THROW(reference::fused_llama_loss(fused_shape(cfg), to_fused(cfg, w), x0, targets, none,
                                           reference::TileConfig{}, &grads),
               Error);
}

}  // namespace
}  // namespace coda::testing
