#pragma once
// Primitive 4 of 5: block reductions into per-tile partial buffers, and the folds that finish them.
//
// Per-row partials (a row's sum over one tile's columns, e.g. sum x^2 for RMSNorm, ZdZ) live in a
// (rows_padded, tiles) buffer, row index fastest:   partial[m + rows_padded * tile_n]
// with rows_padded = round_up(M, tile_m). Per-column partials (a column's sum over one tile's rows,
// e.g. dgamma) live in a (cols_padded, tiles) buffer:   partial[n + cols_padded * tile_m].
// These are the layouts CUTLASS's Sm90ColReduction / Sm90RowReduction write with
// FinalReduction=false, so both executors produce the same buffers and share the folds below.
// Partials are always fp32 on the device (docs/math.md: every reduction is fp32).

#include <cstdint>
#include <vector>

#include "coda/common/check.hpp"
#include "coda/common/host_device.hpp"

namespace coda::epilogue {

CODA_HD int64_t round_up(int64_t x, int64_t multiple) {
  return (x + multiple - 1) / multiple * multiple;
}
CODA_HD int64_t ceil_div(int64_t x, int64_t d) { return (x + d - 1) / d; }

// Shape of a partial buffer: `extent` padded entries per tile, `tiles` tiles.
struct PartialLayout {
  int64_t extent = 0;   // rows_padded (per-row partials) or cols_padded (per-column partials)
  int64_t tiles = 0;    // number of tiles reduced over
  int64_t logical = 0;  // M (per-row) or N (per-column): entries past it are padding

  static PartialLayout per_row(int64_t m, int64_t n, int64_t tile_m, int64_t tile_n) {
    return {round_up(m, tile_m), ceil_div(n, tile_n), m};
  }
  static PartialLayout per_column(int64_t m, int64_t n, int64_t tile_m, int64_t tile_n) {
    return {round_up(n, tile_n), ceil_div(m, tile_m), n};
  }
  int64_t elements() const { return extent * tiles; }
  bool operator==(const PartialLayout& o) const {
    return extent == o.extent && tiles == o.tiles && logical == o.logical;
  }
  // Argument check: a partial buffer `name` for this run must have exactly `expected`'s layout.
  void require(const char* who, const char* name, const void* data,
               const PartialLayout& expected) const {
    CODA_CHECK(data != nullptr, who, ": ", name, " is null");
    CODA_CHECK(*this == expected, who, ": ", name, " layout is (extent ", extent, ", tiles ", tiles,
               ", logical ", logical, "), expected (extent ", expected.extent, ", tiles ",
               expected.tiles, ", logical ", expected.logical, ") for this problem and tile");
  }
  CODA_HD int64_t index(int64_t i, int64_t tile) const { return i + extent * tile; }
};

// Host twin of the device block reduction: accumulates values of one tile per row (or column) in
// registers, then writes the tile's partials. `Op` is a binary functor, `identity` its neutral
// value.
template <class Real, class Op>
class TilePartialReducer {
 public:
  TilePartialReducer(int64_t extent_in_tile, Real identity, Op op = Op{})
      : acc_(extent_in_tile, identity), identity_(identity), op_(op) {}

  void reset() { acc_.assign(acc_.size(), identity_); }
  void add(int64_t local_index, Real v) { acc_[local_index] = op_(acc_[local_index], v); }

  // Writes entries [first, first + extent_in_tile) of tile `tile` into `partials`.
  template <class Out>
  void write(Out* partials, const PartialLayout& layout, int64_t first, int64_t tile) const {
    for (int64_t i = 0; i < static_cast<int64_t>(acc_.size()); ++i) {
      if (first + i < layout.extent)
        partials[layout.index(first + i, tile)] = static_cast<Out>(acc_[i]);
    }
  }

 private:
  std::vector<Real> acc_;
  Real identity_;
  Op op_;
};

// Fold: out[i] = op over tiles of partial[i, tile], for i < layout.logical.
template <class Real, class In, class Op>
std::vector<Real> fold_partials(const In* partials, const PartialLayout& layout, Real identity,
                                Op op) {
  CODA_CHECK(partials != nullptr, "fold_partials: partials is null");
  CODA_CHECK(layout.tiles > 0 && layout.extent >= layout.logical,
             "fold_partials: bad layout (extent ", layout.extent, ", tiles ", layout.tiles,
             ", logical ", layout.logical, ")");
  std::vector<Real> out(layout.logical, identity);
  for (int64_t t = 0; t < layout.tiles; ++t)
    for (int64_t i = 0; i < layout.logical; ++i)
      out[i] = op(out[i], static_cast<Real>(partials[layout.index(i, t)]));
  return out;
}

}  // namespace coda::epilogue
