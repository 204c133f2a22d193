// Names of the table's programs, configurations and operand layouts (host only).
#include <cstddef>

#include "coda/kernel/args.hpp"

namespace coda::kernel {
namespace {

constexpr const char* kConfigNames[] = {
#define CODA_CONFIG(name, str, ...) str,
#include "coda/kernel/table.def"
};
constexpr const char* kProgramNames[] = {
#define CODA_PROGRAM(name, str, ...) str,
#include "coda/kernel/table.def"
};

template <size_t N>
const char* name_at(const char* const (&names)[N], int i) {
  return i >= 0 && size_t(i) < N ? names[i] : "?";
}

}  // namespace

const char* config_name(Config c) { return name_at(kConfigNames, int(c)); }
const char* program_name(Program p) { return name_at(kProgramNames, int(p)); }

const char* operands_name(Operands o) {
  return o == Operands::kXWt      ? "X*W^T"
         : o == Operands::kXW     ? "X*W"
         : o == Operands::kXtY    ? "X^T*Y"
         : o == Operands::kFp8XWt ? "fp8 X*W^T"
         : o == Operands::kFp8XYt ? "fp8 X*Y^T"
                                  : "?";
}

}  // namespace coda::kernel
