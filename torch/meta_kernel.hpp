#pragma once
// Meta kernels registered behind a device check. The dispatcher runs an op's Meta kernel when any
// tensor argument is on the meta device, so a call that mixes meta tensors with CPU or CUDA ones
// (a model built on meta and only partly materialized) lands in the Meta kernel, which would hand
// back empty tensors on the other device as if it had computed them. impl_meta registers a Meta
// kernel that first checks every tensor argument is a meta tensor, naming one that is not and one
// that is where they mix.

#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <optional>
#include <string>

namespace coda::torch_ext {
namespace meta_detail {

// The schema's name of argument `index` of `op` (only asked for on the error path).
inline std::string argument_name(const std::string& op, size_t index) {
  const auto handle = c10::Dispatcher::singleton().findSchema({op, ""});
  if (handle && index < handle->schema().arguments().size())
    return handle->schema().arguments()[index].name();
  return "argument " + std::to_string(index);
}

// Where the tensor arguments are: the first one on meta and the first one elsewhere.
struct Devices {
  std::optional<size_t> meta, other;
  std::optional<c10::Device> other_device;
  void see(size_t index, const at::Tensor& t) {
    if (!t.defined()) return;
    if (t.is_meta()) {
      if (!meta) meta = index;
    } else if (!other) {
      other = index;
      other_device = t.device();
    }
  }
  void see(size_t index, const std::optional<at::Tensor>& t) {
    if (t) see(index, *t);
  }
  template <class T>
  void see(size_t, const T&) {}
};

}  // namespace meta_detail

// m.impl(name, fn) for the Meta key, fn run only when every tensor argument is on meta.
template <class R, class... Args>
void impl_meta(torch::Library& m, const char* name, R (*fn)(Args...)) {
  m.impl(name, [op = "coda::" + std::string(name), fn](Args... args) -> R {
    meta_detail::Devices d;
    size_t index = 0;
    (d.see(index++, args), ...);
    TORCH_CHECK(!d.other, op, ": ", meta_detail::argument_name(op, *d.other), " is on ",
                *d.other_device, " but ", meta_detail::argument_name(op, d.meta.value_or(0)),
                " is on meta: every tensor argument of a call must be on one device");
    return fn(args...);
  });
}

}  // namespace coda::torch_ext
