// A C ABI over coda::ops for foreign callers (the Python benchmark loads it with ctypes until the
// PyTorch extension exists). Each function returns 0 on success, or -1 with the message available
// from coda_last_error(); pointers are raw device pointers, `stream` a cudaStream_t.
#include <algorithm>
#include <cstring>
#include <string>

#include "coda/common/check.hpp"
#include "coda/kernel/heuristic.hpp"
#include "coda/ops.hpp"

namespace {
thread_local std::string g_last_error;

template <class Fn>
int guarded(Fn&& fn) {
  try {
    fn();
    return 0;
  } catch (const std::exception& e) {
    g_last_error = e.what();
    return -1;
  }
}

using coda::ops::bf16;
auto B(const void* p) { return static_cast<const bf16*>(p); }
auto Bm(void* p) { return static_cast<bf16*>(p); }
auto S(void* s) { return static_cast<cudaStream_t>(s); }
}  // namespace

extern "C" {

const char* coda_last_error() { return g_last_error.c_str(); }

// Tuning only: replaces the kernel configuration overrides (coda::kernel::set_kernel_overrides).
int coda_set_kernel_overrides(const char* spec) {
  return guarded([&] { coda::kernel::set_kernel_overrides(spec ? spec : ""); });
}

// Benchmarks only: GEMMs with (1) or without (0) programmatic dependent launch
// (coda::kernel::set_programmatic_launch); *on receives the current setting.
int coda_set_programmatic_launch(int on) {
  return guarded([&] { coda::kernel::set_programmatic_launch(on != 0); });
}
int coda_programmatic_launch(int* on) {
  return guarded([&] {
    CODA_CHECK(on != nullptr, "coda_programmatic_launch: on must point to an int");
    *on = coda::kernel::programmatic_launch() ? 1 : 0;
  });
}

int coda_gemm(const void* x, const void* w, void* d, int m, int n, int k, void* stream) {
  return guarded([&] { coda::ops::gemm(B(x), B(w), Bm(d), m, n, k, S(stream)); });
}

// Writes {extent, tiles} of the F1 partial buffer for (m, n, k).
int coda_residual_rmsnorm_partials_layout(int m, int n, int k, long long* extent_tiles) {
  return guarded([&] {
    const auto l = coda::ops::residual_rmsnorm_partials_layout(m, n, k);
    extent_tiles[0] = l.extent;
    extent_tiles[1] = l.tiles;
  });
}

int coda_gemm_residual_rmsnorm_partial(const void* a, const void* w, const void* residual,
                                       const void* gamma, void* x, void* h, float* partials, int m,
                                       int n, int k, void* stream) {
  return guarded([&] {
    coda::ops::gemm_residual_rmsnorm_partial(B(a), B(w), B(residual), B(gamma), Bm(x), Bm(h),
                                             partials, m, n, k, S(stream));
  });
}

int coda_rmsnorm_fold(const float* partials, int m, long long extent, long long tiles, int hidden,
                      float eps, float* r, void* stream) {
  return guarded([&] {
    coda::ops::rmsnorm_fold(partials, {extent, tiles, m}, hidden, eps, r, S(stream));
  });
}

int coda_first_layer_rmsnorm(const void* x, const void* gamma, int m, int hidden, float eps,
                             void* h, float* r, void* stream) {
  return guarded(
      [&] { coda::ops::first_layer_rmsnorm(B(x), B(gamma), m, hidden, eps, Bm(h), r, S(stream)); });
}

int coda_gemm_rmsnorm_swiglu(const void* h, const void* w_gu, const float* r, void* z, void* a,
                             int m, int two_i, int k, void* stream) {
  return guarded([&] {
    coda::ops::gemm_rmsnorm_swiglu(B(h), B(w_gu), r, Bm(z), Bm(a), m, two_i, k, S(stream));
  });
}

// Fills hi/lo (host arrays of width entries) with the fixed-point RoPE column table.
int coda_rope_column_table(int n_heads, int n_kv_heads, int head_dim, const double* inv_freq,
                           unsigned* hi, unsigned* lo) {
  return guarded([&] {
    const coda::programs::QkvLayout l{n_heads, n_kv_heads, head_dim};
    const auto t = coda::programs::rope_column_table(
        l, std::vector<double>(inv_freq, inv_freq + head_dim / 2));
    std::vector<uint32_t> words_hi, words_lo;
    coda::ops::split_rope_table(t, words_hi, words_lo);
    std::copy(words_hi.begin(), words_hi.end(), hi);
    std::copy(words_lo.begin(), words_lo.end(), lo);
  });
}

int coda_gemm_rmsnorm_rope(const void* h, const void* w_qkv, const float* r, const int* pos,
                           const unsigned* freq_hi, const unsigned* freq_lo, void* qkv, int m,
                           int n, int k, void* stream) {
  return guarded([&] {
    coda::ops::gemm_rmsnorm_rope(B(h), B(w_qkv), r, pos, {freq_hi, freq_lo, n}, Bm(qkv), m, n, k,
                                 S(stream));
  });
}

int coda_gemm_xw(const void* x, const void* w, void* d, int m, int n, int k, void* stream) {
  return guarded([&] { coda::ops::gemm_xw(B(x), B(w), Bm(d), m, n, k, S(stream)); });
}

int coda_gemm_xty(const void* x, const void* y, void* d, int m, int n, int k, void* stream) {
  return guarded([&] { coda::ops::gemm_xty(B(x), B(y), Bm(d), m, n, k, S(stream)); });
}

// Writes {extent, tiles} of the partial buffers of B1 (per column) and B2 (per row).
int coda_rmsnorm_backward_partials_layout(int m, int hidden, int n_out, long long* extent_tiles) {
  return guarded([&] {
    const auto l = coda::ops::rmsnorm_backward_partials_layout(m, hidden, n_out);
    extent_tiles[0] = l.extent;
    extent_tiles[1] = l.tiles;
  });
}
int coda_swiglu_backward_partials_layout(int m, int intermediate, int hidden,
                                         long long* extent_tiles) {
  return guarded([&] {
    const auto l = coda::ops::swiglu_backward_partials_layout(m, intermediate, hidden);
    extent_tiles[0] = l.extent;
    extent_tiles[1] = l.tiles;
  });
}

int coda_gemm_rmsnorm_backward(const void* dz, const void* w, const void* x, const float* r,
                               const void* gamma, const float* zdz, const void* dres, void* dx,
                               void* h_out, float* dgamma_partials, int m, int hidden, int n_out,
                               void* stream) {
  return guarded([&] {
    coda::ops::gemm_rmsnorm_backward(B(dz), B(w), B(x), r, B(gamma), zdz, B(dres), Bm(dx),
                                     Bm(h_out), dgamma_partials, m, hidden, n_out, S(stream));
  });
}

int coda_gemm_swiglu_backward(const void* dx_out, const void* w_down, const void* z, void* dz,
                              void* a, float* zdz_partials, int m, int intermediate, int hidden,
                              void* stream) {
  return guarded([&] {
    coda::ops::gemm_swiglu_backward(B(dx_out), B(w_down), B(z), Bm(dz), Bm(a), zdz_partials, m,
                                    intermediate, hidden, S(stream));
  });
}

int coda_rope_backward(const void* qkv, const void* dqkv, const int* pos, const unsigned* freq_hi,
                       const unsigned* freq_lo, int m, int width, int hidden, void* dqkv_pre,
                       float* zdz, void* stream) {
  return guarded([&] {
    coda::ops::rope_backward(B(qkv), B(dqkv), pos, {freq_hi, freq_lo, width}, m, width, hidden,
                             Bm(dqkv_pre), zdz, S(stream));
  });
}

int coda_zdz_fold(const float* partials, int m, long long extent, long long tiles, int hidden,
                  float* zdz, void* stream) {
  return guarded([&] {
    coda::ops::zdz_fold(partials, {extent, tiles, m}, hidden, zdz, S(stream));
  });
}

int coda_dgamma_fold(const float* partials, int n, long long extent, long long tiles, float* dgamma,
                     void* stream) {
  return guarded([&] { coda::ops::dgamma_fold(partials, {extent, tiles, n}, dgamma, S(stream)); });
}

}  // extern "C"
