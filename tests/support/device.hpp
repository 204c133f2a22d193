#pragma once
// Device-memory helpers for GPU tests and benchmarks (host C++ against the CUDA runtime).

#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "coda/kernel/cuda_check.hpp"

namespace coda::testing {

// Why there is no GPU, or "" if there is one.
inline std::string gpu_unavailable_reason() {
  int n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) return std::string("no CUDA device (") + cudaGetErrorString(e) + ")";
  if (n == 0) return "no CUDA device";
  cudaDeviceProp p{};
  if (cudaGetDeviceProperties(&p, 0) != cudaSuccess) return "cannot read device properties";
  if (p.major != 9) return std::string("device ") + p.name + " is not sm_90 (Hopper)";
  return "";
}

template <class T>
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  explicit DeviceBuffer(size_t n) : n_(n) {
    if (n) CODA_CUDA_CHECK(cudaMalloc(&p_, n * sizeof(T)));
  }
  explicit DeviceBuffer(const std::vector<T>& host) : DeviceBuffer(host.size()) { upload(host); }
  ~DeviceBuffer() {
    if (p_) cudaFree(p_);
  }
  DeviceBuffer(DeviceBuffer&& o) noexcept : p_(o.p_), n_(o.n_) {
    o.p_ = nullptr;
    o.n_ = 0;
  }
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept {
    std::swap(p_, o.p_);
    std::swap(n_, o.n_);
    return *this;
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  T* get() const { return p_; }
  size_t size() const { return n_; }
  void upload(const std::vector<T>& host) {
    CODA_CHECK(host.size() == n_, "upload: ", host.size(), " elements into a buffer of ", n_);
    if (n_) CODA_CUDA_CHECK(cudaMemcpy(p_, host.data(), n_ * sizeof(T), cudaMemcpyHostToDevice));
  }
  std::vector<T> download() const {
    std::vector<T> host(n_);
    if (n_) CODA_CUDA_CHECK(cudaMemcpy(host.data(), p_, n_ * sizeof(T), cudaMemcpyDeviceToHost));
    return host;
  }
  // Fills every byte with `byte` (0xff makes bf16 and fp32 NaN): unwritten outputs then fail.
  void poison(unsigned char byte = 0xff) {
    if (n_) CODA_CUDA_CHECK(cudaMemset(p_, byte, n_ * sizeof(T)));
  }

 private:
  T* p_ = nullptr;
  size_t n_ = 0;
};

}  // namespace coda::testing
