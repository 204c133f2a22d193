#pragma once
// The one family of argument checks. Every public entry validates its arguments with CODA_CHECK and
// reports what was expected and what it got; CUDA status codes go through CODA_CUDA_CHECK.

#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>

namespace coda {

// Thrown for invalid arguments and failed CUDA calls. what() names the argument and the values.
class Error : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

namespace detail {

template <class... Parts>
[[noreturn]] void fail(const char* file, int line, const char* condition, Parts&&... parts) {
  std::ostringstream message;
  (message << ... << std::forward<Parts>(parts));
  message << " [check `" << condition << "` failed at " << file << ":" << line << "]";
  throw Error(message.str());
}

}  // namespace detail
}  // namespace coda

// CODA_CHECK(cond, "A: expected ", m, " rows, got ", a_rows);
#define CODA_CHECK(cond, ...)                                                  \
  do {                                                                         \
    if (!(cond)) ::coda::detail::fail(__FILE__, __LINE__, #cond, __VA_ARGS__); \
  } while (0)
