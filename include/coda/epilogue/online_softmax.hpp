#pragma once
// Primitive 5 of 5: the stateful online (max, sum-exp) transform and its merge rule.
//
// State (m, s) represents sum_i exp(x_i) = s * exp(m). Identity: (-inf, 0). Merge:
//   m' = max(m1, m2),  s' = s1 * exp(m1 - m') + s2 * exp(m2 - m'),
// guarding exp(-inf - -inf) (both empty) so that an empty state never produces NaN. Columns past
// the vocabulary (ragged last tile) must not be added: callers skip them (they are not -inf, the
// accumulator holds 0 there).

#include <cmath>
#include <limits>

#include "coda/common/host_device.hpp"
#include "coda/epilogue/elementwise.hpp"

namespace coda::epilogue {

template <class T>
struct OnlineMaxSumExp {
  T max = -std::numeric_limits<T>::infinity();
  T sum = T(0);

  CODA_HD static OnlineMaxSumExp identity() { return {}; }

  // exp(a - b) with exp(-inf - -inf) := 0 (an empty state contributes nothing).
  CODA_HD static T scaled(T a, T b) {
    return (a == -std::numeric_limits<T>::infinity()) ? T(0) : exp_approx(a - b);
  }

  CODA_HD void add(T x) { add(max, sum, x); }
  // The same on a state held as two separate values (the device keeps them in register arrays).
  // One exp per element: the running sum is rescaled only when the max moves.
  CODA_HD static void add(T& max, T& sum, T x) {
    if (x > max) {
      sum = sum * scaled(max, x) + T(1);
      max = x;
    } else {
      sum += scaled(x, max);
    }
  }

  CODA_HD static OnlineMaxSumExp merge(const OnlineMaxSumExp& a, const OnlineMaxSumExp& b) {
    const T m = a.max > b.max ? a.max : b.max;
    return {m, a.sum * scaled(a.max, m) + b.sum * scaled(b.max, m)};
  }

  // log(sum exp): -inf for an empty state.
  CODA_HD T logsumexp() const {
    using std::log;
    return (sum == T(0)) ? -std::numeric_limits<T>::infinity() : max + log(sum);
  }
};

}  // namespace coda::epilogue
