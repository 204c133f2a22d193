#pragma once
// Test helpers: deterministic random inputs and error measures.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace coda::testing {

// splitmix64: small, fast, and the same sequence on every platform.
class Rng {
 public:
  explicit Rng(uint64_t seed) : state_(seed) {}
  uint64_t next() {
    uint64_t z = (state_ += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  double uniform() { return static_cast<double>(next() >> 11) * 0x1.0p-53; }  // [0, 1)
  double uniform(double lo, double hi) { return lo + (hi - lo) * uniform(); }
  int64_t integer(int64_t lo, int64_t hi) {  // [lo, hi]
    return lo + static_cast<int64_t>(next() % static_cast<uint64_t>(hi - lo + 1));
  }

 private:
  uint64_t state_;
};

template <class T = double>
std::vector<T> uniform_vector(size_t n, double lo, double hi, uint64_t seed) {
  Rng rng(seed);
  std::vector<T> v(n);
  for (auto& e : v) e = static_cast<T>(rng.uniform(lo, hi));
  return v;
}

// max |a - b| / max(max |b|, tiny): one number per output, scale-free.
template <class A, class B>
double max_rel_error(const std::vector<A>& a, const std::vector<B>& b) {
  if (a.size() != b.size()) return INFINITY;
  double diff = 0, scale = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    const double d = std::abs(static_cast<double>(a[i]) - static_cast<double>(b[i]));
    if (std::isnan(d)) return INFINITY;
    diff = std::max(diff, d);
    scale = std::max(scale, std::abs(static_cast<double>(b[i])));
  }
  return diff / std::max(scale, 1e-300);
}

template <class A, class B>
double max_abs_error(const std::vector<A>& a, const std::vector<B>& b) {
  if (a.size() != b.size()) return INFINITY;
  double diff = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    const double d = std::abs(static_cast<double>(a[i]) - static_cast<double>(b[i]));
    if (std::isnan(d)) return INFINITY;
    diff = std::max(diff, d);
  }
  return diff;
}

}  // namespace coda::testing
