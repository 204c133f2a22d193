#pragma once
// Primitive 3 of 5: tile loads and stores.
//
// A tile operand is a row-major (rows, cols) matrix with a leading dimension, read or written at
// the accumulator's (m, n). Variants:
//   - TileIn:          residual / saved activation in (device: pipelined TMA load, Sm90AuxLoad or
//   C);
//   - TileOut:         saved activation out (device: TMA store through smem, Sm90AuxStore or D);
//   - TileOut, half:   the 2->1 pairwise maps write column n/2 of a (rows, cols/2) output (SwiGLU
//   a);
//   - accumulate-into: out[m, n] = out[m, n] + v (the residual gradient; device: C = D aliasing).
// Out-of-bounds loads return 0 (TMA zero-fills) and out-of-bounds stores are dropped (TMA clips).

#include <cstdint>

#include "coda/common/check.hpp"
#include "coda/common/host_device.hpp"

namespace coda::epilogue {

template <class T>
struct TileIn {
  const T* data = nullptr;
  int64_t rows = 0, cols = 0, ld = 0;

  CODA_HD bool contains(int64_t m, int64_t n) const {
    return m >= 0 && m < rows && n >= 0 && n < cols;
  }
  CODA_HD T load(int64_t m, int64_t n) const { return contains(m, n) ? data[m * ld + n] : T(0); }

  // Argument check for program `who`: non-null, shape (rows, cols), row stride >= cols.
  void require(const char* who, const char* name, int64_t expect_rows, int64_t expect_cols) const {
    CODA_CHECK(data != nullptr, who, ": ", name, " is null");
    CODA_CHECK(rows == expect_rows && cols == expect_cols, who, ": ", name, " is (", rows, ", ",
               cols, "), expected (", expect_rows, ", ", expect_cols, ")");
    CODA_CHECK(ld >= cols, who, ": ", name, " has row stride ", ld, " < cols ", cols);
  }
};

enum class StoreMode : int {
  kOverwrite,   // out = v
  kAccumulate,  // out = out + v
};

template <class T>
struct TileOut {
  T* data = nullptr;
  int64_t rows = 0, cols = 0, ld = 0;
  StoreMode mode = StoreMode::kOverwrite;

  CODA_HD bool contains(int64_t m, int64_t n) const {
    return m >= 0 && m < rows && n >= 0 && n < cols;
  }

  CODA_HD void store(int64_t m, int64_t n, T value) const {
    if (!contains(m, n)) return;
    T& slot = data[m * ld + n];
    slot = (mode == StoreMode::kAccumulate) ? T(slot + value) : value;
  }

  // The 2->1 store: the pair (n, n+1) of the accumulator lands in column n/2 of this (half-width)
  // output.
  CODA_HD void store_half(int64_t m, int64_t pair_first_col, T value) const {
    store(m, pair_first_col / 2, value);
  }

  // Argument check for program `who`: non-null, shape (rows, cols), row stride >= cols.
  void require(const char* who, const char* name, int64_t expect_rows, int64_t expect_cols) const {
    CODA_CHECK(data != nullptr, who, ": ", name, " is null");
    CODA_CHECK(rows == expect_rows && cols == expect_cols, who, ": ", name, " is (", rows, ", ",
               cols, "), expected (", expect_rows, ", ", expect_cols, ")");
    CODA_CHECK(ld >= cols, who, ": ", name, " has row stride ", ld, " < cols ", cols);
  }
};

}  // namespace coda::epilogue
