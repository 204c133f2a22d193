#pragma once
// The LLaMA-3 shapes of docs/math.md §7, shared by the benchmarks.

namespace coda::bench {

struct LlamaModel {
  const char* name;
  int hidden, q_heads, kv_heads, head_dim, ffn;
  int qkv_width() const { return (q_heads + 2 * kv_heads) * head_dim; }
};

inline constexpr LlamaModel kLlama3Models[] = {{"llama3-1B", 2048, 32, 8, 64, 8192},
                                               {"llama3-8B", 4096, 32, 8, 128, 14336},
                                               {"llama3-70B", 8192, 64, 8, 128, 28672}};
// Qwen3's QKV projections (QK-norm, head_dim 128): 1.7B and 8B.
inline constexpr LlamaModel kQwen3Models[] = {{"qwen3-1.7B", 2048, 16, 8, 128, 6144},
                                              {"qwen3-8B", 4096, 32, 8, 128, 12288}};
inline constexpr int kLlama3Vocab = 128256;
inline constexpr int kTokenCounts[] = {8192, 16384};

}  // namespace coda::bench
