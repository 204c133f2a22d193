#pragma once
// Primitive 2 of 5: vector loads and stores.
//
// Per-row vectors are indexed by the output row m (r[m], ZdZ[m], targets[m], pos[m]); per-column
// vectors by the output column n (gamma[n], rope frequencies). Loads past the end return the given
// identity, as the device broadcast nodes do for out-of-bounds lanes, so callers never branch on
// the ragged edge of a tile. On the GPU these are CUTLASS's Sm90ColBroadcast (per row) and
// Sm90RowBroadcast (per column), staged through shared memory once per tile; the host twin is
// below.

#include <cstdint>

#include "coda/common/check.hpp"
#include "coda/common/host_device.hpp"

namespace coda::epilogue {

// A read-only vector of `size` elements.
template <class T>
struct VectorIn {
  const T* data = nullptr;
  int64_t size = 0;

  CODA_HD T load(int64_t i, T out_of_bounds = T(0)) const {
    return (i >= 0 && i < size) ? data[i] : out_of_bounds;
  }
  // Argument check for program `who`: non-null and exactly `expected` entries.
  void require(const char* who, const char* name, int64_t expected) const {
    CODA_CHECK(data != nullptr, who, ": ", name, " is null");
    CODA_CHECK(size == expected, who, ": ", name, " has ", size, " entries, expected ", expected);
  }
};

// A per-row output vector (e.g. the picked target logit): element i written by the one tile that
// owns it; writes past the end are dropped.
template <class T>
struct VectorOut {
  T* data = nullptr;
  int64_t size = 0;

  CODA_HD void store(int64_t i, T value) const {
    if (i >= 0 && i < size) data[i] = value;
  }
  void require(const char* who, const char* name, int64_t expected) const {
    CODA_CHECK(data != nullptr, who, ": ", name, " is null");
    CODA_CHECK(size == expected, who, ": ", name, " has ", size, " entries, expected ", expected);
  }
};

}  // namespace coda::epilogue
