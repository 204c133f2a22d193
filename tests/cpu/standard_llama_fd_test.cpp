// Checks the hand-written backward of the fp64 reference LLaMA (support/standard_llama.hpp)
// against central finite differences on every element of every tensor, plus a few structural
// properties of the forward (ignore handling, causality, per-sequence positions, GQA mapping).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "support/standard_llama.hpp"

namespace coda::testing {
namespace {

using Vec = std::vector<double>;

constexpr int64_t kIgnore = -100;
// Central differences in fp64 with h = 1e-6 reach ~1e-9 here (truncation ~h^2, rounding
// ~1e-16 * |loss| / h). The tolerance leaves two orders of magnitude of margin while still
// being far below the size of any real gradient bug.
constexpr double kStep = 1e-6;
constexpr double kTol = 1e-7;

LlamaConfig TinyConfig() {
  LlamaConfig c;
  c.hidden = 8;
  c.n_heads = 4;
  c.n_kv_heads = 2;
  c.head_dim = 4;
  c.intermediate = 12;
  c.vocab = 11;
  c.n_layers = 2;
  c.batch = 2;
  c.seq = 3;
  c.eps = 1e-5;
  return c;
}

// Targets in [0, V) with a couple of tokens ignored (one in each sequence).
std::vector<int64_t> SomeTargets(const LlamaConfig& c) {
  std::vector<int64_t> t(c.tokens());
  for (int m = 0; m < c.tokens(); ++m) t[m] = (3 * m + 1) % c.vocab;
  t[1] = kIgnore;
  t[c.seq] = kIgnore;
  return t;
}

// Named views of all differentiable tensors, in a fixed order. Works for both (weights, x0) and
// ModelGrads (with dx0), so a parameter and its gradient line up index by index.
using Named = std::vector<std::pair<std::string, Vec*>>;

Named ListTensors(std::vector<LayerWeights>& layers, Vec& gamma_final, Vec& w_vocab, Vec& x) {
  Named out;
  for (size_t l = 0; l < layers.size(); ++l) {
    const std::string p = "layer" + std::to_string(l) + ".";
    LayerWeights& w = layers[l];
    out.insert(out.end(), {{p + "gamma_attn", &w.gamma_attn},
                           {p + "wq", &w.wq},
                           {p + "wk", &w.wk},
                           {p + "wv", &w.wv},
                           {p + "wo", &w.wo},
                           {p + "gamma_ffn", &w.gamma_ffn},
                           {p + "w_gate", &w.w_gate},
                           {p + "w_up", &w.w_up},
                           {p + "w_down", &w.w_down}});
  }
  out.push_back({"gamma_final", &gamma_final});
  out.push_back({"w_vocab", &w_vocab});
  out.push_back({"x0", &x});
  return out;
}

Named ListTensors(ModelGrads& g) { return ListTensors(g.layers, g.gamma_final, g.w_vocab, g.dx0); }

// Central-difference gradient of the loss w.r.t. every element, laid out like ModelGrads.
ModelGrads FiniteDifferenceGrads(const LlamaConfig& c, ModelWeights w, Vec x0,
                                 const std::vector<int64_t>& targets, const LossOptions& opt,
                                 const ModelGrads& shape) {
  ModelGrads fd = shape;  // only for the shapes; every value is overwritten
  Named params = ListTensors(w.layers, w.gamma_final, w.w_vocab, x0);
  Named out = ListTensors(fd);
  for (size_t t = 0; t < params.size(); ++t) {
    Vec& p = *params[t].second;
    for (size_t i = 0; i < p.size(); ++i) {
      const double saved = p[i];
      p[i] = saved + kStep;
      const double plus = llama_loss(c, w, x0, targets, opt, nullptr);
      p[i] = saved - kStep;
      const double minus = llama_loss(c, w, x0, targets, opt, nullptr);
      p[i] = saved;
      (*out[t].second)[i] = (plus - minus) / (2.0 * kStep);
    }
  }
  return fd;
}

struct Comparison {
  bool ok = true;
  double max_abs_err = 0.0;
  std::string worst;  // where the largest error relative to the tolerance occurred
};

// The acceptance criterion: |fd - an| <= kTol * max(1, |an|) for every element.
Comparison Compare(ModelGrads fd, ModelGrads an) {
  Comparison r;
  double worst_ratio = -1.0;
  Named f = ListTensors(fd), a = ListTensors(an);
  for (size_t t = 0; t < f.size(); ++t) {
    const Vec &fv = *f[t].second, &av = *a[t].second;
    if (fv.size() != av.size()) return {false, INFINITY, a[t].first + " has the wrong size"};
    for (size_t i = 0; i < fv.size(); ++i) {
      const double err = std::abs(fv[i] - av[i]);
      const double ratio = err / (kTol * std::max(1.0, std::abs(av[i])));
      r.max_abs_err = std::max(r.max_abs_err, err);
      if (ratio > worst_ratio) {
        worst_ratio = ratio;
        r.worst = a[t].first + "[" + std::to_string(i) + "] fd=" + std::to_string(fv[i]) +
                  " an=" + std::to_string(av[i]);
      }
      if (!(ratio <= 1.0)) r.ok = false;  // also rejects NaN
    }
  }
  return r;
}

// Every tensor must actually receive gradient, otherwise "fd == an == 0" would hide a tensor
// that the forward silently ignores.
void ExpectAllTensorsHaveGradient(ModelGrads an) {
  for (auto& [name, v] : ListTensors(an)) {
    double mx = 0.0;
    for (double x : *v) mx = std::max(mx, std::abs(x));
    EXPECT_GT(mx, 1e-4) << name << " gets no gradient";
  }
}

void CheckGradients(const LossOptions& opt, uint64_t seed) {
  const LlamaConfig c = TinyConfig();
  const ModelWeights w = random_weights(c, seed);
  const Vec x0 = random_vector(static_cast<size_t>(c.tokens()) * c.hidden, 1.0, seed + 1);
  const std::vector<int64_t> targets = SomeTargets(c);
  ModelGrads an;
  const double loss = llama_loss(c, w, x0, targets, opt, &an);
  ASSERT_TRUE(std::isfinite(loss));
  EXPECT_EQ(loss, llama_loss(c, w, x0, targets, opt, nullptr));  // grads don't change the loss
  ExpectAllTensorsHaveGradient(an);
  const Comparison r = Compare(FiniteDifferenceGrads(c, w, x0, targets, opt, an), an);
  std::printf("  loss=%.6f  max |fd - an| = %.3e  (worst vs tol: %s)\n", loss, r.max_abs_err,
              r.worst.c_str());
  EXPECT_TRUE(r.ok) << "worst: " << r.worst;
}

TEST(StandardLlamaFd, MeanReduction) { CheckGradients(LossOptions{kIgnore, true, 0.0}, 11); }

TEST(StandardLlamaFd, SumReduction) { CheckGradients(LossOptions{kIgnore, false, 0.0}, 22); }

TEST(StandardLlamaFd, MeanWithZLoss) { CheckGradients(LossOptions{kIgnore, true, 0.1}, 33); }

TEST(StandardLlamaFd, SumWithZLoss) { CheckGradients(LossOptions{kIgnore, false, 0.05}, 44); }

// The comparison must be able to fail: a slightly wrong analytic gradient is rejected.
TEST(StandardLlamaFd, PerturbedGradientIsRejected) {
  const LlamaConfig c = TinyConfig();
  const LossOptions opt{kIgnore, true, 0.0};
  const ModelWeights w = random_weights(c, 5);
  const Vec x0 = random_vector(static_cast<size_t>(c.tokens()) * c.hidden, 1.0, 6);
  const std::vector<int64_t> targets = SomeTargets(c);
  ModelGrads an;
  llama_loss(c, w, x0, targets, opt, &an);
  const ModelGrads fd = FiniteDifferenceGrads(c, w, x0, targets, opt, an);
  ASSERT_TRUE(Compare(fd, an).ok);
  for (const char* which : {"wk", "x0", "w_vocab"}) {
    ModelGrads bad = an;
    Vec& v = std::string(which) == "wk"   ? bad.layers[0].wk
             : std::string(which) == "x0" ? bad.dx0
                                          : bad.w_vocab;
    v[v.size() / 2] += 20.0 * kTol * std::max(1.0, std::abs(v[v.size() / 2]));
    EXPECT_FALSE(Compare(fd, bad).ok) << "perturbation of " << which << " not detected";
  }
  ModelGrads wrong_sign = an;  // a classic bug: a sign flip in one tensor
  for (double& g : wrong_sign.gamma_final) g = -g;
  EXPECT_FALSE(Compare(fd, wrong_sign).ok);
}

void ExpectAllZero(ModelGrads g) {
  for (auto& [name, v] : ListTensors(g)) {
    EXPECT_FALSE(v->empty()) << name;
    for (double x : *v) ASSERT_EQ(x, 0.0) << name;
  }
}

TEST(StandardLlama, AllIgnoredGivesNanMeanAndZeroSum) {
  const LlamaConfig c = TinyConfig();
  const ModelWeights w = random_weights(c, 7);
  const Vec x0 = random_vector(static_cast<size_t>(c.tokens()) * c.hidden, 1.0, 8);
  const std::vector<int64_t> targets(c.tokens(), kIgnore);
  ModelGrads g;
  EXPECT_TRUE(std::isnan(llama_loss(c, w, x0, targets, LossOptions{kIgnore, true, 0.1}, &g)));
  ExpectAllZero(g);
  EXPECT_EQ(llama_loss(c, w, x0, targets, LossOptions{kIgnore, false, 0.1}, &g), 0.0);
  ExpectAllZero(g);
}

// With zero vocab weights every logit is 0, so lse = log(V) and each token costs log(V).
TEST(StandardLlama, UniformLogitsGiveLogVocab) {
  const LlamaConfig c = TinyConfig();
  ModelWeights w = random_weights(c, 9);
  std::fill(w.w_vocab.begin(), w.w_vocab.end(), 0.0);
  const Vec x0 = random_vector(static_cast<size_t>(c.tokens()) * c.hidden, 1.0, 10);
  const std::vector<int64_t> targets = SomeTargets(c);  // 2 of 6 ignored
  const double lv = std::log(static_cast<double>(c.vocab));
  EXPECT_NEAR(llama_loss(c, w, x0, targets, LossOptions{kIgnore, true, 0.0}, nullptr), lv, 1e-14);
  EXPECT_NEAR(llama_loss(c, w, x0, targets, LossOptions{kIgnore, false, 0.5}, nullptr),
              4.0 * (lv + 0.5 * lv * lv), 1e-13);
}

// A token only sees its own sequence, causally, and identical sequences are treated identically.
// (RoPE scores depend only on t - t', so a per-sequence position offset is invisible in the loss.)
TEST(StandardLlama, SequencesAreIndependentAndCausal) {
  const LlamaConfig c = TinyConfig();
  const size_t H = c.hidden, T = c.seq;
  const ModelWeights w = random_weights(c, 12);
  const LossOptions sum{kIgnore, false, 0.0};
  Vec x0 = random_vector(static_cast<size_t>(c.tokens()) * H, 1.0, 13);
  std::copy(x0.begin(), x0.begin() + T * H, x0.begin() + T * H);  // sequence 1 := sequence 0

  // Only sequence 0 / only sequence 1 carries targets: identical inputs, identical loss.
  std::vector<int64_t> seq0(c.tokens(), kIgnore), seq1(c.tokens(), kIgnore);
  for (size_t t = 0; t < T; ++t) seq0[t] = seq1[T + t] = static_cast<int64_t>(2 * t + 1);
  const double loss0 = llama_loss(c, w, x0, seq0, sum, nullptr);
  EXPECT_EQ(loss0, llama_loss(c, w, x0, seq1, sum, nullptr));

  // Changing sequence 1 leaves sequence 0's loss bit-identical and gets no gradient.
  Vec x0_changed = x0;
  const Vec noise = random_vector(T * H, 1.0, 14);
  std::copy(noise.begin(), noise.end(), x0_changed.begin() + T * H);
  ModelGrads g;
  EXPECT_EQ(loss0, llama_loss(c, w, x0_changed, seq0, sum, &g));
  for (size_t i = T * H; i < g.dx0.size(); ++i) ASSERT_EQ(g.dx0[i], 0.0) << i;

  // Causality: with no target on the last position, that position's input is irrelevant.
  std::vector<int64_t> early = seq0;
  early[T - 1] = kIgnore;
  const double loss_early = llama_loss(c, w, x0, early, sum, nullptr);
  Vec x0_last = x0;
  for (size_t i = 0; i < H; ++i) x0_last[(T - 1) * H + i] += 0.5;
  EXPECT_EQ(loss_early, llama_loss(c, w, x0_last, early, sum, &g));
  for (size_t i = 0; i < H; ++i) ASSERT_EQ(g.dx0[(T - 1) * H + i], 0.0);
}

// GQA: query head h reads kv head h / (Hq / Hkv). Duplicating each kv head into a plain MHA model
// (Hkv = Hq) must reproduce the loss, and the MHA kv gradients must sum back to the GQA ones.
TEST(StandardLlama, GqaMatchesDuplicatedKvHeads) {
  const LlamaConfig gqa = TinyConfig();
  LlamaConfig mha = gqa;
  mha.n_kv_heads = gqa.n_heads;
  const size_t group = gqa.n_heads / gqa.n_kv_heads, d = gqa.head_dim, H = gqa.hidden;
  const ModelWeights wg = random_weights(gqa, 15);
  ModelWeights wm = wg;
  for (size_t l = 0; l < wg.layers.size(); ++l) {
    for (Vec LayerWeights::*field : {&LayerWeights::wk, &LayerWeights::wv}) {
      const Vec& src = wg.layers[l].*field;
      Vec& dst = wm.layers[l].*field;
      dst.assign(mha.n_kv_heads * d * H, 0.0);
      for (size_t h = 0; h < static_cast<size_t>(mha.n_kv_heads); ++h) {
        std::copy_n(src.begin() + (h / group) * d * H, d * H, dst.begin() + h * d * H);
      }
    }
  }
  const Vec x0 = random_vector(static_cast<size_t>(gqa.tokens()) * H, 1.0, 16);
  const std::vector<int64_t> targets = SomeTargets(gqa);
  const LossOptions opt{kIgnore, true, 0.0};
  ModelGrads gg, gm;
  EXPECT_NEAR(llama_loss(gqa, wg, x0, targets, opt, &gg),
              llama_loss(mha, wm, x0, targets, opt, &gm), 1e-13);
  for (size_t l = 0; l < wg.layers.size(); ++l) {
    for (Vec LayerWeights::*field : {&LayerWeights::wk, &LayerWeights::wv}) {
      const Vec& g_gqa = gg.layers[l].*field;
      const Vec& g_mha = gm.layers[l].*field;
      for (size_t i = 0; i < g_gqa.size(); ++i) {
        const size_t kv = i / (d * H), rest = i % (d * H);
        double summed = 0.0;
        for (size_t j = 0; j < group; ++j) summed += g_mha[(kv * group + j) * d * H + rest];
        ASSERT_NEAR(g_gqa[i], summed, 1e-13) << "layer " << l << " element " << i;
      }
    }
  }
}

// Pins the "rotate_half" pairing (dim i with dim i + d/2, frequency i) against the interleaved
// one (dims 2i, 2i+1). With d = 4 and inv_freq = {0, 1}, only the pair at frequency index 1
// rotates: dims (1, 3) under rotate_half, dims (2, 3) if interleaved.
TEST(StandardLlama, RopeUsesRotateHalfPairing) {
  const LlamaConfig c = TinyConfig();
  ASSERT_EQ(c.head_dim, 4);
  ModelWeights w = random_weights(c, 19);
  const Vec x0 = random_vector(static_cast<size_t>(c.tokens()) * c.hidden, 1.0, 20);
  const std::vector<int64_t> targets = SomeTargets(c);
  // Loss with q/k restricted to head dims `keep`, with and without rotation.
  auto losses = [&](std::vector<int> keep) {
    ModelWeights wr = w;
    for (LayerWeights& l : wr.layers) {
      for (Vec* m : {&l.wq, &l.wk}) {
        for (size_t row = 0; row < m->size() / c.hidden; ++row) {
          const int dim = static_cast<int>(row % c.head_dim);
          if (std::find(keep.begin(), keep.end(), dim) != keep.end()) continue;
          std::fill_n(m->begin() + row * c.hidden, c.hidden, 0.0);
        }
      }
    }
    wr.inv_freq = {0.0, 1.0};
    const double rotated = llama_loss(c, wr, x0, targets, LossOptions{}, nullptr);
    wr.inv_freq = {0.0, 0.0};
    return std::pair{rotated, llama_loss(c, wr, x0, targets, LossOptions{}, nullptr)};
  };
  const auto [rot02, plain02] = losses({0, 2});  // the frequency-0 pair only: no rotation
  EXPECT_EQ(rot02, plain02);
  const auto [rot01, plain01] = losses({0, 1});  // dim 1 is in the rotating pair
  EXPECT_GT(std::abs(rot01 - plain01), 1e-6);
}

TEST(StandardLlama, RejectsBadShapesAndTargets) {
  const LlamaConfig c = TinyConfig();
  const ModelWeights w = random_weights(c, 17);
  const Vec x0 = random_vector(static_cast<size_t>(c.tokens()) * c.hidden, 1.0, 18);
  std::vector<int64_t> targets = SomeTargets(c);
  EXPECT_THROW(llama_loss(c, w, Vec(3), targets, LossOptions{}, nullptr), std::invalid_argument);
  targets[0] = c.vocab;
  EXPECT_THROW(llama_loss(c, w, x0, targets, LossOptions{}, nullptr), std::invalid_argument);
}

TEST(StandardLlama, RandomIsDeterministicAndInRange) {
  const Vec a = random_vector(1000, 0.3, 42), b = random_vector(1000, 0.3, 42);
  EXPECT_EQ(a, b);
  EXPECT_NE(a, random_vector(1000, 0.3, 43));
  for (double v : a) ASSERT_LT(std::abs(v), 0.3);
}

}  // namespace
}  // namespace coda::testing
