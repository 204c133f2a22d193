// Names of the table's programs, configurations and operand layouts (host only).
#include "coda/kernel/args.hpp"

namespace coda::kernel {

const char* config_name(Config c) {
  switch (c) {
#define CODA_CONFIG(name, str, tile_m, tile_n, tile_k, cluster_m, cluster_n, cooperative) \
  case Config::k##name:                                                               \
    return str;
#include "coda/kernel/table.def"
    case Config::kCount:
      break;
  }
  return "?";
}

const char* program_name(Program p) {
  switch (p) {
#define CODA_PROGRAM(name, str, args, header) \
  case Program::k##name:                      \
    return str;
#include "coda/kernel/table.def"
    case Program::kCount:
      break;
  }
  return "?";
}

const char* operands_name(Operands o) {
  switch (o) {
    case Operands::kXWt:
      return "X*W^T";
    case Operands::kXW:
      return "X*W";
    case Operands::kXtY:
      return "X^T*Y";
  }
  return "?";
}

}  // namespace coda::kernel
