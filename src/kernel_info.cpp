// Names and tile shapes of the kernel configurations (host only).
#include "coda/kernel/args.hpp"

namespace coda::kernel {

TileShapeMN tile_shape(Config c) {
  switch (c) {
    case Config::kCoop128x256x64_2x1:
      return {128, 256};
    case Config::kCoop256x128x64_1x2:
      return {256, 128};
    case Config::kPing128x128x64_1x2:
      return {128, 128};
    case Config::kPing128x128x64_2x1:
      return {128, 128};
    case Config::kPing128x192x64_2x1:
      return {128, 192};
    case Config::kCoop128x128x64_1x1:
      return {128, 128};
    case Config::kCount:
      break;
  }
  return {0, 0};
}

const char* config_name(Config c) {
  switch (c) {
    case Config::kCoop128x256x64_2x1:
      return "coop_128x256x64_c2x1";
    case Config::kCoop256x128x64_1x2:
      return "coop_256x128x64_c1x2";
    case Config::kPing128x128x64_1x2:
      return "ping_128x128x64_c1x2";
    case Config::kPing128x128x64_2x1:
      return "ping_128x128x64_c2x1";
    case Config::kPing128x192x64_2x1:
      return "ping_128x192x64_c2x1";
    case Config::kCoop128x128x64_1x1:
      return "coop_128x128x64_c1x1";
    case Config::kCount:
      break;
  }
  return "?";
}

const char* program_name(Program p) {
  switch (p) {
    case Program::kPlain:
      return "gemm";
    case Program::kResidualRmsnormPartial:
      return "gemm_residual_rmsnorm_partial";
    case Program::kRmsnormSwiglu:
      return "gemm_rmsnorm_swiglu";
    case Program::kRmsnormRope:
      return "gemm_rmsnorm_rope";
    case Program::kRmsnormLse:
      return "gemm_rmsnorm_lse";
    case Program::kRmsnormLseLogits:
      return "gemm_rmsnorm_lse_logits";
    case Program::kPairLayoutProbe:
      return "pair_layout_probe";
    case Program::kRmsnormBackward:
      return "gemm_rmsnorm_backward";
    case Program::kRmsnormCrossEntropyBackward:
      return "gemm_rmsnorm_cross_entropy_backward";
    case Program::kSwigluBackward:
      return "gemm_swiglu_backward";
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
