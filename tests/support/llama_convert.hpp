#pragma once
// Maps the standard model's weights (HF layouts: split Wq/Wk/Wv with half-split RoPE rows, split
// gate/up) to the fused layouts, and the fused gradients back, with the library's converters.

#include "coda/programs/weight_layout.hpp"
#include "coda/reference/llama.hpp"
#include "support/standard_llama.hpp"

namespace coda::testing {

inline reference::LlamaShape fused_shape(const LlamaConfig& c) {
  return {.hidden = c.hidden,
          .n_heads = c.n_heads,
          .n_kv_heads = c.n_kv_heads,
          .head_dim = c.head_dim,
          .intermediate = c.intermediate,
          .vocab = c.vocab,
          .n_layers = c.n_layers,
          .batch = c.batch,
          .seq = c.seq,
          .eps = c.eps};
}

inline reference::FusedModel<double> to_fused(const LlamaConfig& c, const ModelWeights& w) {
  reference::FusedModel<double> f;
  for (const auto& l : w.layers) {
    f.layers.push_back(
        {.gamma_attn = l.gamma_attn,
         .w_qkv =
             programs::qkv_from_hf(l.wq, l.wk, l.wv, c.n_heads, c.n_kv_heads, c.head_dim, c.hidden),
         .w_o = l.wo,
         .gamma_ffn = l.gamma_ffn,
         .w_gu = programs::interleave_gate_up(l.w_gate, l.w_up, c.intermediate, c.hidden),
         .w_down = l.w_down});
  }
  f.gamma_final = w.gamma_final;
  f.w_vocab = w.w_vocab;
  f.inv_freq = w.inv_freq;
  return f;
}

inline ModelGrads from_fused(const LlamaConfig& c, const reference::FusedGrads<double>& g) {
  ModelGrads out;
  for (const auto& l : g.layers) {
    LayerWeights s;
    s.gamma_attn = l.gamma_attn;
    programs::qkv_to_hf(l.w_qkv, c.n_heads, c.n_kv_heads, c.head_dim, c.hidden, s.wq, s.wk, s.wv);
    s.wo = l.w_o;
    s.gamma_ffn = l.gamma_ffn;
    programs::split_gate_up(l.w_gu, c.intermediate, c.hidden, s.w_gate, s.w_up);
    s.w_down = l.w_down;
    out.layers.push_back(std::move(s));
  }
  out.gamma_final = g.gamma_final;
  out.w_vocab = g.w_vocab;
  out.dx0 = g.dx0;
  return out;
}

}  // namespace coda::testing
