#pragma once
// CUDA status checks for the launch layer. Errors become coda::Error with the call and the code.

#include <cuda_runtime.h>

#include "coda/common/check.hpp"

#define CODA_CUDA_CHECK(expr)                                                                   \
  do {                                                                                          \
    const cudaError_t coda_status_ = (expr);                                                    \
    CODA_CHECK(coda_status_ == cudaSuccess, #expr, " failed: ", cudaGetErrorName(coda_status_), \
               " (", cudaGetErrorString(coda_status_), ")");                                    \
  } while (0)
