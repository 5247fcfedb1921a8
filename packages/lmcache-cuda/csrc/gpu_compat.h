// One source tree for CUDA (nvcc) and ROCm (hipcc): the few runtime names the
// kernels use are mapped here, so lmcache-rocm builds the same files.
#pragma once

#if defined(__HIPCC__) || defined(USE_ROCM)
#include <hip/hip_runtime.h>
#define LMC_GPU_NAME(suffix) hip##suffix
#else
#include <cuda_runtime.h>
#define LMC_GPU_NAME(suffix) cuda##suffix
#endif

// Both runtimes spell these names alike but for the cuda/hip prefix.
using gpuStream_t = LMC_GPU_NAME(Stream_t);
using gpuError_t = LMC_GPU_NAME(Error_t);
#define gpuSuccess LMC_GPU_NAME(Success)
#define gpuGetErrorString LMC_GPU_NAME(GetErrorString)
#define gpuGetLastError LMC_GPU_NAME(GetLastError)
#define gpuMemcpyAsync LMC_GPU_NAME(MemcpyAsync)
#define gpuMemcpyDefault LMC_GPU_NAME(MemcpyDefault)
