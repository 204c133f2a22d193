#pragma once
// Weight-layout converters between the layouts checkpoints use and the ones that keep the
// epilogue's pairwise maps thread-local (docs/math.md §2). All weights are row-major (out, in);
// converters permute rows only, so they apply unchanged to gradients.
//   - SwiGLU: split [W_gate; W_up] (each (I, H))  <->  interleaved W_gu (2I, H), rows [g0, u0, g1,
//   ...]
//   - RoPE:   HF "rotate_half" rows (i, i + d/2) of each Q/K head  <->  adjacent rows (2i, 2i+1)
//   - QKV:    separate Wq, Wk, Wv  <->  packed [Q heads | K heads | V heads]

#include <cstdint>
#include <vector>

#include "coda/common/check.hpp"

namespace coda::programs {

namespace detail {
template <class T>
void copy_row(const std::vector<T>& src, int64_t src_row, std::vector<T>& dst, int64_t dst_row,
              int64_t cols) {
  for (int64_t c = 0; c < cols; ++c) dst[dst_row * cols + c] = src[src_row * cols + c];
}
inline void check_rows(const char* fn, const char* name, size_t size, int64_t rows, int64_t cols) {
  CODA_CHECK(rows > 0 && cols > 0, fn, ": ", name, " needs positive rows and cols, got (", rows,
             ", ", cols, ")");
  CODA_CHECK(size == static_cast<size_t>(rows * cols), fn, ": ", name, " has ", size,
             " elements, expected (", rows, ", ", cols, ") = ", rows * cols);
}
}  // namespace detail

template <class T>
std::vector<T> interleave_gate_up(const std::vector<T>& w_gate, const std::vector<T>& w_up,
                                  int64_t intermediate, int64_t hidden) {
  detail::check_rows("interleave_gate_up", "w_gate", w_gate.size(), intermediate, hidden);
  detail::check_rows("interleave_gate_up", "w_up", w_up.size(), intermediate, hidden);
  std::vector<T> out(2 * intermediate * hidden);
  for (int64_t i = 0; i < intermediate; ++i) {
    detail::copy_row(w_gate, i, out, 2 * i, hidden);
    detail::copy_row(w_up, i, out, 2 * i + 1, hidden);
  }
  return out;
}

template <class T>
void split_gate_up(const std::vector<T>& w_gu, int64_t intermediate, int64_t hidden,
                   std::vector<T>& w_gate, std::vector<T>& w_up) {
  detail::check_rows("split_gate_up", "w_gu", w_gu.size(), 2 * intermediate, hidden);
  w_gate.assign(intermediate * hidden, T(0));
  w_up.assign(intermediate * hidden, T(0));
  for (int64_t i = 0; i < intermediate; ++i) {
    detail::copy_row(w_gu, 2 * i, w_gate, i, hidden);
    detail::copy_row(w_gu, 2 * i + 1, w_up, i, hidden);
  }
}

namespace detail {
// The RoPE row permutation of one projection with `heads` heads of `head_dim` rows each: within a
// head, half-split row i is adjacent-pair row 2i and half-split row i + head_dim / 2 is row 2i + 1.
template <class T>
std::vector<T> permute_rope_rows(const char* who, const std::vector<T>& w, int64_t heads,
                                 int64_t head_dim, int64_t cols, bool half_to_interleaved) {
  CODA_CHECK(head_dim > 0 && head_dim % 2 == 0, who,
             ": head_dim must be positive and even, got ", head_dim);
  check_rows(who, "w", w.size(), heads * head_dim, cols);
  std::vector<T> out(w.size());
  for (int64_t h = 0; h < heads; ++h)
    for (int64_t i = 0; i < head_dim; ++i) {
      const int64_t half = h * head_dim + i;
      const int64_t pair = h * head_dim + (i < head_dim / 2 ? 2 * i : 2 * (i - head_dim / 2) + 1);
      if (half_to_interleaved)
        copy_row(w, half, out, pair, cols);
      else
        copy_row(w, pair, out, half, cols);
    }
  return out;
}
}  // namespace detail

// Rows of one projection: HF half-split -> adjacent pairs, and back.
template <class T>
std::vector<T> rope_rows_half_to_interleaved(const std::vector<T>& w, int64_t heads,
                                             int64_t head_dim, int64_t cols) {
  return detail::permute_rope_rows("rope_rows_half_to_interleaved", w, heads, head_dim, cols,
                                   true);
}
template <class T>
std::vector<T> rope_rows_interleaved_to_half(const std::vector<T>& w, int64_t heads,
                                             int64_t head_dim, int64_t cols) {
  return detail::permute_rope_rows("rope_rows_interleaved_to_half", w, heads, head_dim, cols,
                                   false);
}

// Stacks row blocks: [a; b; c].
template <class T>
std::vector<T> pack_qkv(const std::vector<T>& wq, const std::vector<T>& wk,
                        const std::vector<T>& wv, int64_t cols) {
  CODA_CHECK(cols > 0, "pack_qkv: cols must be positive, got ", cols);
  for (const auto* w : {&wq, &wk, &wv})
    CODA_CHECK(w->size() % cols == 0, "pack_qkv: a block of ", w->size(),
               " elements is not a whole number of rows of ", cols);
  CODA_CHECK(wk.size() == wv.size(), "pack_qkv: wk has ", wk.size(), " elements but wv has ",
             wv.size());
  std::vector<T> out;
  out.reserve(wq.size() + wk.size() + wv.size());
  out.insert(out.end(), wq.begin(), wq.end());
  out.insert(out.end(), wk.begin(), wk.end());
  out.insert(out.end(), wv.begin(), wv.end());
  return out;
}

template <class T>
void unpack_qkv(const std::vector<T>& w_qkv, int64_t q_rows, int64_t kv_rows, int64_t cols,
                std::vector<T>& wq, std::vector<T>& wk, std::vector<T>& wv) {
  detail::check_rows("unpack_qkv", "w_qkv", w_qkv.size(), q_rows + 2 * kv_rows, cols);
  const auto q_end = w_qkv.begin() + q_rows * cols, k_end = q_end + kv_rows * cols;
  wq.assign(w_qkv.begin(), q_end);
  wk.assign(q_end, k_end);
  wv.assign(k_end, w_qkv.end());
}

// The whole QKV conversion from a Hugging Face checkpoint's layout to the fused layout, and back.
template <class T>
std::vector<T> qkv_from_hf(const std::vector<T>& wq, const std::vector<T>& wk,
                           const std::vector<T>& wv, int64_t n_heads, int64_t n_kv_heads,
                           int64_t head_dim, int64_t hidden) {
  return pack_qkv(rope_rows_half_to_interleaved(wq, n_heads, head_dim, hidden),
                  rope_rows_half_to_interleaved(wk, n_kv_heads, head_dim, hidden), wv, hidden);
}

template <class T>
void qkv_to_hf(const std::vector<T>& w_qkv, int64_t n_heads, int64_t n_kv_heads, int64_t head_dim,
               int64_t hidden, std::vector<T>& wq, std::vector<T>& wk, std::vector<T>& wv) {
  std::vector<T> q, k;
  unpack_qkv(w_qkv, n_heads * head_dim, n_kv_heads * head_dim, hidden, q, k, wv);
  wq = rope_rows_interleaved_to_half(q, n_heads, head_dim, hidden);
  wk = rope_rows_interleaved_to_half(k, n_kv_heads, head_dim, hidden);
}

}  // namespace coda::programs
