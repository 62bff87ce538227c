// libshmgrad_cuda.so: see cuda_ops.h.
#include "gpu/cuda_ops.h"

#include <cuda_runtime.h>

#include <cstring>

#define SHMGRAD_API extern "C" __attribute__((visibility("default")))

namespace {

// Every entry point first makes `device` current on the calling thread.
cudaError_t use(int device) {
  int count = 0;
  cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess) return e;
  if (device < 0 || device >= count) return cudaErrorInvalidDevice;
  return cudaSetDevice(device);
}

template <typename T>
T* at(uint64_t p) {
  return reinterpret_cast<T*>(static_cast<uintptr_t>(p));
}

// One thread per element (grid-stride); slots summed in slot order, so every element's
// result depends only on the slots' values, not on the launch shape.
__global__ void sumSlotsKernel(float* __restrict__ out, const float* prev,
                               const float* __restrict__ slots, uint32_t nslots, uint64_t stride,
                               uint64_t begin, uint64_t end, float a, float b) {
  const uint64_t step = static_cast<uint64_t>(gridDim.x) * blockDim.x;
  for (uint64_t i = begin + blockIdx.x * static_cast<uint64_t>(blockDim.x) + threadIdx.x; i < end;
       i += step) {
    float s = 0.0f;
    for (uint32_t k = 0; k < nslots; ++k) s += slots[k * stride + i];
    out[i] = a == 0.0f ? b * s : a * prev[i] + b * s;
  }
}

}  // namespace

SHMGRAD_API int shmgrad_cuda_api_version(void) { return SHMGRAD_CUDA_API_VERSION; }

SHMGRAD_API int shmgrad_cuda_runtime_version(void) {
  int v = 0;
  cudaRuntimeGetVersion(&v);
  return v;
}

SHMGRAD_API int shmgrad_cuda_driver_version(void) {
  int v = 0;
  if (cudaDriverGetVersion(&v) != cudaSuccess) return 0;
  return v;
}

SHMGRAD_API const char* shmgrad_cuda_error_name(int code) {
  return cudaGetErrorName(static_cast<cudaError_t>(code));
}

SHMGRAD_API const char* shmgrad_cuda_error_string(int code) {
  return cudaGetErrorString(static_cast<cudaError_t>(code));
}

SHMGRAD_API int shmgrad_cuda_device_count(int* count) {
  *count = 0;
  return cudaGetDeviceCount(count);
}

SHMGRAD_API int shmgrad_cuda_device_info(int device, char* name, size_t len, int* major,
                                         int* minor) {
  cudaError_t e = use(device);
  if (e != cudaSuccess) return e;
  cudaDeviceProp prop;
  e = cudaGetDeviceProperties(&prop, device);
  if (e != cudaSuccess) return e;
  if (len > 0) {
    std::strncpy(name, prop.name, len - 1);
    name[len - 1] = '\0';
  }
  *major = prop.major;
  *minor = prop.minor;
  return cudaSuccess;
}

SHMGRAD_API int shmgrad_cuda_alloc(int device, uint64_t bytes, uint64_t* ptr) {
  *ptr = 0;
  cudaError_t e = use(device);
  if (e != cudaSuccess) return e;
  void* p = nullptr;
  e = cudaMalloc(&p, bytes);
  if (e != cudaSuccess) return e;
  e = cudaMemset(p, 0, bytes);
  if (e == cudaSuccess) e = cudaDeviceSynchronize();
  if (e != cudaSuccess) {
    cudaFree(p);
    return e;
  }
  *ptr = reinterpret_cast<uintptr_t>(p);
  return cudaSuccess;
}

SHMGRAD_API int shmgrad_cuda_free(int device, uint64_t ptr) {
  cudaError_t e = use(device);
  if (e != cudaSuccess) return e;
  return cudaFree(at<void>(ptr));
}

SHMGRAD_API int shmgrad_cuda_ipc_handle(int device, uint64_t ptr,
                                        uint8_t handle[SHMGRAD_IPC_HANDLE_BYTES]) {
  static_assert(sizeof(cudaIpcMemHandle_t) == SHMGRAD_IPC_HANDLE_BYTES, "IPC handle size");
  cudaError_t e = use(device);
  if (e != cudaSuccess) return e;
  cudaIpcMemHandle_t h;
  e = cudaIpcGetMemHandle(&h, at<void>(ptr));
  if (e != cudaSuccess) return e;
  std::memcpy(handle, &h, sizeof h);
  return cudaSuccess;
}

SHMGRAD_API int shmgrad_cuda_ipc_open(int device, const uint8_t handle[SHMGRAD_IPC_HANDLE_BYTES],
                                      uint64_t* ptr) {
  *ptr = 0;
  cudaError_t e = use(device);
  if (e != cudaSuccess) return e;
  cudaIpcMemHandle_t h;
  std::memcpy(&h, handle, sizeof h);
  void* p = nullptr;
  e = cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess);
  if (e != cudaSuccess) return e;
  *ptr = reinterpret_cast<uintptr_t>(p);
  return cudaSuccess;
}

SHMGRAD_API int shmgrad_cuda_ipc_close(int device, uint64_t ptr) {
  cudaError_t e = use(device);
  if (e != cudaSuccess) return e;
  return cudaIpcCloseMemHandle(at<void>(ptr));
}

SHMGRAD_API int shmgrad_cuda_copy_to_device(int device, uint64_t dst, const void* src,
                                            uint64_t bytes) {
  cudaError_t e = use(device);
  if (e != cudaSuccess) return e;
  return cudaMemcpy(at<void>(dst), src, bytes, cudaMemcpyHostToDevice);
}

SHMGRAD_API int shmgrad_cuda_copy_to_host(int device, void* dst, uint64_t src, uint64_t bytes) {
  cudaError_t e = use(device);
  if (e != cudaSuccess) return e;
  return cudaMemcpy(dst, at<void>(src), bytes, cudaMemcpyDeviceToHost);
}

SHMGRAD_API int shmgrad_cuda_sum_slots(int device, uint64_t out, uint64_t prev, uint64_t slots,
                                       uint32_t nslots, uint64_t stride, uint64_t begin,
                                       uint64_t end, float a, float b, uint64_t stream, int wait) {
  if (end < begin || (a != 0.0f && prev == 0) || out == 0 || (nslots > 0 && slots == 0)) {
    return cudaErrorInvalidValue;
  }
  if (end == begin) return cudaSuccess;
  cudaError_t e = use(device);
  if (e != cudaSuccess) return e;
  constexpr int kThreads = 256;
  const uint64_t n = end - begin;
  const uint64_t blocks64 = (n + kThreads - 1) / kThreads;
  const unsigned blocks = static_cast<unsigned>(blocks64 < 65535 ? blocks64 : 65535);
  cudaStream_t s = at<CUstream_st>(stream);
  sumSlotsKernel<<<blocks, kThreads, 0, s>>>(at<float>(out), at<const float>(prev),
                                             at<const float>(slots), nslots, stride, begin, end, a,
                                             b);
  e = cudaGetLastError();
  if (e != cudaSuccess || !wait) return e;
  return cudaStreamSynchronize(s);
}
