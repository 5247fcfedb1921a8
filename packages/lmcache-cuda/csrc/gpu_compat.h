// One source tree for CUDA (nvcc) and ROCm (hipcc): the few runtime names the
// kernels use are mapped here, so lmcache-rocm builds the same files.
#pragma once

#if defined(__HIPCC__) || defined(USE_ROCM)
#include <hip/hip_runtime.h>
using gpuStream_t = hipStream_t;
using gpuError_t = hipError_t;
#define gpuSuccess hipSuccess
#define gpuGetErrorString hipGetErrorString
#define gpuGetLastError hipGetLastError
#define gpuMemcpyAsync hipMemcpyAsync
#define gpuMemcpyDefault hipMemcpyDefault
#else
#include <cuda_runtime.h>
using gpuStream_t = cudaStream_t;
using gpuError_t = cudaError_t;
#define gpuSuccess cudaSuccess
#define gpuGetErrorString cudaGetErrorString
#define gpuGetLastError cudaGetLastError
#define gpuMemcpyAsync cudaMemcpyAsync
#define gpuMemcpyDefault cudaMemcpyDefault
#endif
