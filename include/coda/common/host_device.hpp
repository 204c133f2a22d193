#pragma once
// One spelling for code that both executors run: the CPU reference (g++ or nvcc host pass) and
// the Hopper epilogue (nvcc device pass).

#if defined(__CUDACC__)
#define CODA_HD __host__ __device__ __forceinline__
#define CODA_DEVICE __device__ __forceinline__
#else
#define CODA_HD inline
#define CODA_DEVICE inline
#endif
