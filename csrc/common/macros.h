// Portability macros shared by the CPU and CUDA kernels.
#pragma once

#if defined(__CUDACC__) || defined(__HIPCC__)
#define DETOPS_HOST_DEVICE __host__ __device__
#else
#define DETOPS_HOST_DEVICE
#endif

#define DETOPS_HOST_DEVICE_INLINE DETOPS_HOST_DEVICE inline
