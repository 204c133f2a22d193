#pragma once
// A registered coda op by name, typed, for the C++ autograd functions that call the ops below
// autograd (torch/autograd.cpp, torch/fp8_block_ops.cpp).

#include <ATen/core/dispatch/Dispatcher.h>

namespace coda::torch_ext {

template <class Signature>
c10::TypedOperatorHandle<Signature> op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
}

}  // namespace coda::torch_ext
