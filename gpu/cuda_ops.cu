// libshmgrad_cuda.so: see cuda_ops.h.
#include "gpu/cuda_ops.h"

#include <cuda_runtime.h>

#include <cstring>
#include <mutex>

#define SHMGRAD_API extern "C" __attribute__((visibility("default")))

namespace {

// Makes `device` current on the calling thread for one entry point, and the caller's
// current device current again when the entry point returns: a trainer whose torch
// computes on another device than the engine's is not switched (torch keeps its own idea
// of the current device, and would launch its next kernels on ours). Nothing is set, nor
// restored, when `device` is current already.
class OnDevice {
 public:
  OnDevice() = default;
  OnDevice(const OnDevice&) = delete;
  OnDevice& operator=(const OnDevice&) = delete;
  ~OnDevice() {
    if (restore_ >= 0) cudaSetDevice(restore_);
  }

  cudaError_t use(int device, int* visible = nullptr) {
    int count = 0;
    cudaError_t e = cudaGetDeviceCount(&count);
    if (e != cudaSuccess) return e;
    if (device < 0 || device >= count) return cudaErrorInvalidDevice;
    if (visible != nullptr) *visible = count;
    int current = 0;
    e = cudaGetDevice(&current);
    if (e != cudaSuccess || current == device) return e;
    e = cudaSetDevice(device);
    if (e == cudaSuccess) restore_ = current;
    return e;
  }

 private:
  int restore_ = -1;  // the caller's device, when it was another one
};

template <typename T>
T* at(uint64_t p) {
  return reinterpret_cast<T*>(static_cast<uintptr_t>(p));
}

// The inputs of one reduction, passed to the kernel by value (kernel parameter space):
// no device allocation, and nothing to copy before the launch.
struct ReduceInputs {
  uint64_t ptr[SHMGRAD_MAX_REDUCE_INPUTS];
};

constexpr int kThreads = 256;
constexpr uint64_t kMaxBlocks = 65535;

unsigned blocksFor(uint64_t n) {
  const uint64_t blocks = (n + kThreads - 1) / kThreads;
  return static_cast<unsigned>(blocks < kMaxBlocks ? blocks : kMaxBlocks);
}

// One thread per element (grid-stride); inputs summed in list order, so every element's
// result depends only on the inputs' values, not on the launch shape. No __restrict__:
// out may alias prev or an input, which is safe because a thread reads everything of
// element i before it writes out[i], and no other thread touches element i.
__global__ void reduceKernel(float* out, const float* prev, ReduceInputs ins, uint32_t nins,
                             uint64_t begin, uint64_t end, float a, float b) {
  const uint64_t step = static_cast<uint64_t>(gridDim.x) * blockDim.x;
  for (uint64_t i = begin + blockIdx.x * static_cast<uint64_t>(blockDim.x) + threadIdx.x; i < end;
       i += step) {
    float s = 0.0f;
    if (nins > 0) s = reinterpret_cast<const float*>(ins.ptr[0])[i];
    for (uint32_t k = 1; k < nins; ++k) s += reinterpret_cast<const float*>(ins.ptr[k])[i];
    out[i] = a == 0.0f ? b * s : a * prev[i] + b * s;
  }
}

// Sets *flag when an element of p[begin, end) is NaN or infinite (every writer writes 1).
__global__ void nonfiniteKernel(const float* p, uint64_t begin, uint64_t end, int* flag) {
  const uint64_t step = static_cast<uint64_t>(gridDim.x) * blockDim.x;
  for (uint64_t i = begin + blockIdx.x * static_cast<uint64_t>(blockDim.x) + threadIdx.x; i < end;
       i += step) {
    if (!isfinite(p[i])) {
      *flag = 1;
      return;
    }
  }
}

// any_nonfinite's device-side flag, one per device: allocated on the device's first call
// and kept for the process's life, so the step's hot path allocates nothing. The mutex
// serialises the calls on one device, which share the flag.
struct NonfiniteFlag {
  std::mutex mu;
  int* flag = nullptr;
};

// The flag of `device`, a valid ordinal (on.use() checked it against `count`, which a process
// never sees change). Never freed: the process's exit tears the context down with it.
NonfiniteFlag& nonfiniteFlag(int device, int count) {
  static NonfiniteFlag* const flags = new NonfiniteFlag[count];
  return flags[device];
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
  OnDevice on;
  cudaError_t e = on.use(device);
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

SHMGRAD_API int shmgrad_cuda_device_uuid(int device, uint8_t uuid[SHMGRAD_DEVICE_UUID_BYTES]) {
  static_assert(sizeof(cudaUUID_t) == SHMGRAD_DEVICE_UUID_BYTES, "device UUID size");
  if (uuid == nullptr) return cudaErrorInvalidValue;
  int count = 0;
  cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess) return e;
  if (device < 0 || device >= count) return cudaErrorInvalidDevice;
  cudaDeviceProp prop;  // no context needed: properties are the driver's
  e = cudaGetDeviceProperties(&prop, device);
  if (e != cudaSuccess) return e;
  std::memcpy(uuid, &prop.uuid, SHMGRAD_DEVICE_UUID_BYTES);
  return cudaSuccess;
}

SHMGRAD_API int shmgrad_cuda_error_is_sticky(int code) {
  // The errors after which CUDA documents the context as unusable (every later call
  // returns the same error until the process exits).
  switch (static_cast<cudaError_t>(code)) {
    case cudaErrorIllegalAddress:
    case cudaErrorLaunchTimeout:
    case cudaErrorHardwareStackError:
    case cudaErrorIllegalInstruction:
    case cudaErrorMisalignedAddress:
    case cudaErrorInvalidAddressSpace:
    case cudaErrorInvalidPc:
    case cudaErrorLaunchFailure:
    case cudaErrorAssert:
    case cudaErrorECCUncorrectable:
    case cudaErrorContextIsDestroyed:
      return 1;
    default:
      return 0;
  }
}

SHMGRAD_API int shmgrad_cuda_host_register(int device, void* ptr, uint64_t bytes) {
  if (ptr == nullptr || bytes == 0) return cudaErrorInvalidValue;
  OnDevice on;  // a context on this device, not on device 0 by default
  cudaError_t e = on.use(device);
  if (e != cudaSuccess) return e;
  return cudaHostRegister(ptr, bytes, cudaHostRegisterPortable);
}

SHMGRAD_API int shmgrad_cuda_host_unregister(int device, void* ptr) {
  if (ptr == nullptr) return cudaErrorInvalidValue;
  OnDevice on;
  cudaError_t e = on.use(device);
  if (e != cudaSuccess) return e;
  return cudaHostUnregister(ptr);
}

SHMGRAD_API int shmgrad_cuda_alloc(int device, uint64_t bytes, uint64_t* ptr) {
  *ptr = 0;
  OnDevice on;
  cudaError_t e = on.use(device);
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
  OnDevice on;
  cudaError_t e = on.use(device);
  if (e != cudaSuccess) return e;
  return cudaFree(at<void>(ptr));
}

SHMGRAD_API int shmgrad_cuda_ipc_handle(int device, uint64_t ptr,
                                        uint8_t handle[SHMGRAD_IPC_HANDLE_BYTES]) {
  static_assert(sizeof(cudaIpcMemHandle_t) == SHMGRAD_IPC_HANDLE_BYTES, "IPC handle size");
  OnDevice on;
  cudaError_t e = on.use(device);
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
  OnDevice on;
  cudaError_t e = on.use(device);
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
  OnDevice on;
  cudaError_t e = on.use(device);
  if (e != cudaSuccess) return e;
  return cudaIpcCloseMemHandle(at<void>(ptr));
}

SHMGRAD_API int shmgrad_cuda_can_access_peer(int device, int peer, int* can) {
  if (can == nullptr) return cudaErrorInvalidValue;
  *can = 0;
  int count = 0;
  OnDevice on;
  cudaError_t e = on.use(device, &count);
  if (e != cudaSuccess) return e;
  if (peer < 0 || peer >= count) return cudaErrorInvalidDevice;
  if (peer == device) {
    *can = 1;
    return cudaSuccess;
  }
  return cudaDeviceCanAccessPeer(can, device, peer);
}

SHMGRAD_API int shmgrad_cuda_copy_to_device(int device, uint64_t dst, const void* src,
                                            uint64_t bytes) {
  OnDevice on;
  cudaError_t e = on.use(device);
  if (e != cudaSuccess) return e;
  return cudaMemcpy(at<void>(dst), src, bytes, cudaMemcpyHostToDevice);
}

SHMGRAD_API int shmgrad_cuda_copy_to_host(int device, void* dst, uint64_t src, uint64_t bytes) {
  OnDevice on;
  cudaError_t e = on.use(device);
  if (e != cudaSuccess) return e;
  return cudaMemcpy(dst, at<void>(src), bytes, cudaMemcpyDeviceToHost);
}

SHMGRAD_API int shmgrad_cuda_memory_kind(void) { return 0; }

SHMGRAD_API int shmgrad_cuda_zero(int device, uint64_t ptr, uint64_t bytes) {
  if (ptr == 0) return cudaErrorInvalidValue;
  OnDevice on;
  cudaError_t e = on.use(device);
  if (e != cudaSuccess) return e;
  e = cudaMemsetAsync(at<void>(ptr), 0, bytes, 0);
  if (e != cudaSuccess) return e;
  return cudaStreamSynchronize(0);
}

SHMGRAD_API int shmgrad_cuda_synchronize(int device) {
  OnDevice on;
  cudaError_t e = on.use(device);
  if (e != cudaSuccess) return e;
  return cudaDeviceSynchronize();
}

SHMGRAD_API int shmgrad_cuda_copy(int device, uint64_t dst, uint64_t src, uint64_t bytes) {
  if (dst == 0 || src == 0) return cudaErrorInvalidValue;
  OnDevice on;
  cudaError_t e = on.use(device);
  if (e != cudaSuccess) return e;
  // Unified addressing: the driver finds each address's device (a peer copy over NVLink or
  // PCIe when they differ); on the legacy stream, after the work issued before it.
  e = cudaMemcpyAsync(at<void>(dst), at<const void>(src), bytes, cudaMemcpyDefault, 0);
  if (e != cudaSuccess) return e;
  return cudaStreamSynchronize(0);
}

SHMGRAD_API int shmgrad_cuda_reduce(int device, uint64_t out, uint64_t prev, const uint64_t* ins,
                                    uint32_t nins, uint64_t begin, uint64_t end, float a, float b) {
  if (end < begin || out == 0 || (a != 0.0f && prev == 0) || nins > SHMGRAD_MAX_REDUCE_INPUTS ||
      (nins > 0 && ins == nullptr)) {
    return cudaErrorInvalidValue;
  }
  ReduceInputs inputs{};
  for (uint32_t k = 0; k < nins; ++k) {
    if (ins[k] == 0) return cudaErrorInvalidValue;
    inputs.ptr[k] = ins[k];
  }
  OnDevice on;
  cudaError_t e = on.use(device);
  if (e != cudaSuccess || end == begin) return e;
  reduceKernel<<<blocksFor(end - begin), kThreads>>>(at<float>(out), at<const float>(prev), inputs,
                                                     nins, begin, end, a, b);
  e = cudaGetLastError();
  if (e != cudaSuccess) return e;
  return cudaStreamSynchronize(0);
}

SHMGRAD_API int shmgrad_cuda_any_nonfinite(int device, uint64_t ptr, uint64_t begin, uint64_t end,
                                           int* found) {
  if (found == nullptr) return cudaErrorInvalidValue;
  *found = 0;
  if (end < begin || ptr == 0) return cudaErrorInvalidValue;
  int count = 0;
  OnDevice on;
  cudaError_t e = on.use(device, &count);
  if (e != cudaSuccess || end == begin) return e;
  NonfiniteFlag& f = nonfiniteFlag(device, count);
  std::lock_guard<std::mutex> lock(f.mu);
  if (f.flag == nullptr) {
    e = cudaMalloc(&f.flag, sizeof(int));
    if (e != cudaSuccess) {
      f.flag = nullptr;  // retried on the next call
      return e;
    }
  }
  e = cudaMemsetAsync(f.flag, 0, sizeof(int), 0);
  if (e != cudaSuccess) return e;
  nonfiniteKernel<<<blocksFor(end - begin), kThreads>>>(at<const float>(ptr), begin, end, f.flag);
  e = cudaGetLastError();
  if (e != cudaSuccess) return e;
  int host = 0;
  e = cudaMemcpyAsync(&host, f.flag, sizeof host, cudaMemcpyDeviceToHost, 0);
  if (e == cudaSuccess) e = cudaStreamSynchronize(0);
  if (e != cudaSuccess) return e;
  *found = host != 0 ? 1 : 0;
  return cudaSuccess;
}
