#pragma once
// on_backend(like, fn): fn(backend) on the backend of `like`'s device, and on the CPU its dtype
// (torch/backends.hpp, backend_cuda.hpp). A generic fn serves both dispatch keys.

#include "backends.hpp"
#if CODA_TORCH_CUDA
#include "backend_cuda.hpp"
#endif

namespace coda::torch_ext {

template <class Fn>
auto on_backend(const at::Tensor& like, Fn&& fn) {
#if CODA_TORCH_CUDA
  if (like.is_cuda()) {
    CudaBackend b(like.device());
    return fn(b);
  }
#endif
  TORCH_CHECK(like.is_cpu(), "coda: no kernel for tensors on ", like.device());
  if (like.scalar_type() == at::kDouble) {
    CpuBackend<double> b(like.device());
    return fn(b);
  }
  CpuBackend<float> b(like.device());
  return fn(b);
}

}  // namespace coda::torch_ext
