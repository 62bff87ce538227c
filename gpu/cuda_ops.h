// shmgrad's CUDA path: the few device operations an engine with devices= needs, in one
// shared library (libshmgrad_cuda.so) built by nvcc with the CUDA runtime linked in
// statically. Nothing else links it: a process loads it with dlopen only when an engine
// is given devices, so the CPU engine needs no CUDA library at run time, and a machine
// without a driver or a device gets an error code here, never a failed load.
//
// A C interface (no C++ types cross the library's edge), every call returning 0 or a
// CUDA error code; shmgrad_cuda_error_string() names a code. Memory is allocated with
// cudaMalloc (outside any caching allocator) so that an IPC handle stays valid for the
// allocation's life; handles are kShmgradIpcHandleBytes opaque bytes.
#pragma once

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define SHMGRAD_CUDA_API_VERSION 4
#define SHMGRAD_IPC_HANDLE_BYTES 64
#define SHMGRAD_DEVICE_UUID_BYTES 16
#define SHMGRAD_MAX_REDUCE_INPUTS 64  // ipc::kMaxWorkers

// The library's interface version (SHMGRAD_CUDA_API_VERSION): a loader refuses another.
int shmgrad_cuda_api_version(void);
// The CUDA runtime version it was built with (e.g. 13000), and the driver's (0: none).
int shmgrad_cuda_runtime_version(void);
int shmgrad_cuda_driver_version(void);
// A code's name and description, as the CUDA runtime gives them.
const char* shmgrad_cuda_error_name(int code);
const char* shmgrad_cuda_error_string(int code);

// The number of visible devices, in *count.
int shmgrad_cuda_device_count(int* count);
// The device's name (NUL-terminated, at most `len` bytes with the NUL) and capability.
int shmgrad_cuda_device_info(int device, char* name, size_t len, int* major, int* minor);

// The device's UUID (cudaDeviceProp::uuid): what names a GPU the same way in every process,
// whatever its CUDA_VISIBLE_DEVICES or CUDA_DEVICE_ORDER make its ordinal there.
int shmgrad_cuda_device_uuid(int device, uint8_t uuid[SHMGRAD_DEVICE_UUID_BYTES]);
// 1 when `code` is a sticky error (a kernel fault: an illegal address, a launch failure, an
// assert...): the process's CUDA context is unusable from then on, and every later call
// fails with it; 0 otherwise.
int shmgrad_cuda_error_is_sticky(int code);

// Every function below that takes a `device` runs on it and leaves the calling thread's
// current device as it found it (cudaGetDevice before, cudaSetDevice back after): a
// caller whose current device is another one is not switched.

// cudaMalloc on `device`, zero-filled; the pointer as an integer.
int shmgrad_cuda_alloc(int device, uint64_t bytes, uint64_t* ptr);
int shmgrad_cuda_free(int device, uint64_t ptr);
// The IPC handle of an allocation's base pointer (made on the allocation's `device`).
int shmgrad_cuda_ipc_handle(int device, uint64_t ptr, uint8_t handle[SHMGRAD_IPC_HANDLE_BYTES]);
// Opens a handle made in another process (a process cannot open its own) in `device`'s
// context: the device whose kernels will use the memory, which may be another device than
// the allocation's (cudaIpcMemLazyEnablePeerAccess enables peer access to it, as NCCL opens
// its peers' buffers; an error where the devices have no peer access). A handle opens once
// per process; close it with the same `device`.
int shmgrad_cuda_ipc_open(int device, const uint8_t handle[SHMGRAD_IPC_HANDLE_BYTES],
                          uint64_t* ptr);
int shmgrad_cuda_ipc_close(int device, uint64_t ptr);
// *can = 1 when kernels on `device` can address `peer`'s memory (cudaDeviceCanAccessPeer;
// 1 for a device and itself), else 0.
int shmgrad_cuda_can_access_peer(int device, int peer, int* can);
// Synchronous copies between host and device memory (set-up and tests; not the step).
int shmgrad_cuda_copy_to_device(int device, uint64_t dst, const void* src, uint64_t bytes);
int shmgrad_cuda_copy_to_host(int device, void* dst, uint64_t src, uint64_t bytes);

// Page-locks host memory (cudaHostRegister, portable: for every device), in `device`'s
// context, so that copies from it to a device are asynchronous DMA; unregister it before
// it is unmapped.
int shmgrad_cuda_host_register(int device, void* ptr, uint64_t bytes);
int shmgrad_cuda_host_unregister(int device, void* ptr);

// Where this library's allocations live: 0, device memory (a tensor over one is a CUDA
// tensor on its device); 1, host memory the process can address (a test double's, for
// machines without a device: tensors over it are CPU tensors).
int shmgrad_cuda_memory_kind(void);

// The step's operations. Each is issued on the legacy default stream, which orders it
// after the work torch issued on its default stream, and each returns when it is done.
//
// Zeroes bytes at ptr.
int shmgrad_cuda_zero(int device, uint64_t ptr, uint64_t bytes);
// Waits for every piece of work this process issued on `device` (cudaDeviceSynchronize):
// a worker's backward is in its slot before it arrives at the compute barrier.
int shmgrad_cuda_synchronize(int device);
// Copies bytes from src to dst, issued on `device`, from whose context both addresses
// are mapped: its own memory or another device's opened there (a peer copy).
int shmgrad_cuda_copy(int device, uint64_t dst, uint64_t src, uint64_t bytes);
// The reduction of one slice, on `device`: for i in [begin, end),
//   out[i] = a * prev[i] + b * (ins[0][i] + ins[1][i] + ... + ins[nins-1][i])
// summed in list order in float32, so the result is deterministic for a given list.
// out, prev and ins (nins <= SHMGRAD_MAX_REDUCE_INPUTS, a host array of device addresses)
// must be mapped in `device`'s context: its own memory, or another device's opened there
// through IPC (peer access). prev may be 0 when a == 0; out may equal prev or an input (each
// element is read before it is written).
int shmgrad_cuda_reduce(int device, uint64_t out, uint64_t prev, const uint64_t* ins, uint32_t nins,
                        uint64_t begin, uint64_t end, float a, float b);
// *found = 1 when a float in ptr[begin, end) is NaN or infinite, else 0.
int shmgrad_cuda_any_nonfinite(int device, uint64_t ptr, uint64_t begin, uint64_t end, int* found);

#ifdef __cplusplus
}
#endif
