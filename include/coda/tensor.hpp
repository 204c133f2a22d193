#pragma once
// TensorView: what the C++ op API (include/coda/ops.hpp) takes for every tensor argument. A
// non-owning, row-major 1-D or 2-D view that carries its element type and the CUDA device its
// memory is on, so the op layer checks shape, dtype, stride, alignment and device on the host,
// without asking the driver about pointers.

#include <cstdint>

namespace coda {

// kE4M3: FP8 e4m3 codes, one byte each (torch.float8_e4m3fn).
enum class DType : uint8_t { kBF16, kF32, kI32, kI64, kE4M3 };

constexpr int dtype_bytes(DType t) {
  return t == DType::kBF16 ? 2 : t == DType::kI64 ? 8 : t == DType::kE4M3 ? 1 : 4;
}
constexpr const char* dtype_name(DType t) {
  return t == DType::kBF16   ? "bfloat16"
         : t == DType::kF32  ? "float32"
         : t == DType::kI32  ? "int32"
         : t == DType::kE4M3 ? "float8_e4m3fn"
                             : "int64";
}

struct TensorView {
  void* data = nullptr;
  DType dtype = DType::kBF16;
  int dims = 2;  // 1: a vector of `rows` elements (cols = 1)
  int64_t rows = 0, cols = 1;
  int64_t ld = 1;   // elements from one row to the next (>= cols)
  int device = -1;  // CUDA device ordinal; -1: host memory

  static TensorView matrix(const void* p, DType t, int64_t rows, int64_t cols, int64_t ld,
                           int device) {
    return {const_cast<void*>(p), t, 2, rows, cols, ld, device};
  }
  static TensorView vector(const void* p, DType t, int64_t n, int device) {
    return {const_cast<void*>(p), t, 1, n, 1, 1, device};
  }
  template <class T>
  T* as() const {
    return static_cast<T*>(data);
  }
};

}  // namespace coda
