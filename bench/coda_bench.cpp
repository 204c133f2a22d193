// coda-bench, the main job. Without a GPU: the CPU reference of a small LLaMA decoder (GQA), the
// fused GEMM-epilogue programs against the standard unfused model in fp64, max error per output.
// With a Hopper GPU, scripts/run also runs the GPU benchmarks (bench/README.md).

#include <cmath>
#include <cstdio>
#include <string>

#include "support/llama_convert.hpp"
#include "support/numeric.hpp"

int main() {
  using namespace coda;
  using testing::max_rel_error;
  // H=256, 4 query heads / 2 kv heads (GQA), d=64, I=688, V=1000, M=77 tokens, 2 layers.
  const testing::LlamaConfig cfg{256, 4, 2, 64, 688, 1000, 2, 1, 77, 1e-5};
  const auto weights = testing::random_weights(cfg, 2026);
  const auto x0 = testing::random_vector(size_t(cfg.tokens()) * cfg.hidden, 1.0, 7);
  std::vector<int64_t> targets(cfg.tokens());
  testing::Rng rng(8);
  for (auto& t : targets) t = rng.uniform() < 0.1 ? -100 : rng.integer(0, cfg.vocab - 1);

  std::printf(
      "coda-bench (CPU reference): LLaMA block H=%d heads=%d/%d d=%d I=%d V=%d M=%d "
      "layers=%d\n",
      cfg.hidden, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.intermediate, cfg.vocab,
      cfg.tokens(), cfg.n_layers);
  testing::ModelGrads g_std;
  const double loss_std = testing::llama_loss(cfg, weights, x0, targets, {}, &g_std);
  reference::FusedGrads<double> g_raw;
  const double loss_fused = reference::fused_llama_loss(
      testing::fused_shape(cfg), testing::to_fused(cfg, weights), x0, targets,
      block::LossOptions{}, reference::TileConfig{128, 128, 64, 32}, &g_raw);
  const auto g = testing::from_fused(cfg, g_raw);

  std::printf("%-28s %14s\n", "output", "max rel error");
  std::printf("%-28s %14.3e   (fused %.12f, standard %.12f)\n", "loss",
              std::abs(loss_fused - loss_std) / std::abs(loss_std), loss_fused, loss_std);
  double worst = std::abs(loss_fused - loss_std) / std::abs(loss_std);
  auto row = [&](const std::string& name, const std::vector<double>& a,
                 const std::vector<double>& b) {
    const double e = max_rel_error(a, b);
    worst = std::max(worst, e);
    std::printf("%-28s %14.3e\n", name.c_str(), e);
  };
  row("d x0", g.dx0, g_std.dx0);
  row("d gamma_final", g.gamma_final, g_std.gamma_final);
  row("d w_vocab", g.w_vocab, g_std.w_vocab);
  for (size_t l = 0; l < g.layers.size(); ++l) {
    const auto &a = g.layers[l], &b = g_std.layers[l];
    const std::string p = "layer " + std::to_string(l) + " d ";
    row(p + "gamma_attn", a.gamma_attn, b.gamma_attn);
    row(p + "wq", a.wq, b.wq);
    row(p + "wk", a.wk, b.wk);
    row(p + "wv", a.wv, b.wv);
    row(p + "wo", a.wo, b.wo);
    row(p + "gamma_ffn", a.gamma_ffn, b.gamma_ffn);
    row(p + "w_gate", a.w_gate, b.w_gate);
    row(p + "w_up", a.w_up, b.w_up);
    row(p + "w_down", a.w_down, b.w_down);
  }
  std::printf("worst: %.3e (%s 1e-10)\n", worst, worst < 1e-10 ? "within" : "NOT within");
  return worst < 1e-10 ? 0 : 1;
}
