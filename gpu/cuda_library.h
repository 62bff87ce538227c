// libshmgrad_cuda.so (gpu/cuda_ops.h) loaded with dlopen, for C++ processes: every call
// checked, every CUDA error code turned into a shmgrad::Error that names it. Nothing
// links the library, so a CPU engine never needs it; a process that serves devices loads
// it once (the coordinator at start-up).
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <memory>
#include <string>

#include "gpu/cuda_ops.h"
#include "ipc/device_table.h"
#include "ipc/segment.h"

namespace shmgrad::gpu {

using IpcHandle = std::array<uint8_t, SHMGRAD_IPC_HANDLE_BYTES>;
using DeviceUuid = std::array<uint8_t, SHMGRAD_DEVICE_UUID_BYTES>;

// "GPU-3b2f6c1a-..." as nvidia-smi and CUDA_VISIBLE_DEVICES write a UUID.
std::string uuidText(const DeviceUuid& uuid);

class CudaLibrary {
 public:
  // Loads `path`: kNotFound when it is not there (the CUDA path was not built),
  // kInvalidArgument when it is not shmgrad's CUDA library or has another interface.
  static std::shared_ptr<CudaLibrary> load(const std::string& path);
  // Where this installation keeps it: $SHMGRAD_CUDA_LIBRARY, else libshmgrad_cuda.so in
  // the folder above the running program's (shmgrad/bin/shmgrad -> shmgrad/).
  static std::string defaultPath();

  ~CudaLibrary();
  CudaLibrary(const CudaLibrary&) = delete;
  CudaLibrary& operator=(const CudaLibrary&) = delete;

  const std::string& path() const { return path_; }
  // Visible devices; kInvalidArgument naming a missing driver or device when there are none.
  int deviceCount() const;
  // The GPU's UUID, the same in every process.
  DeviceUuid deviceUuid(int device) const;
  // This process's ordinal of the device table entry's GPU (found by its UUID: the
  // coordinator's ordinal may differ); kInvalidArgument naming it, the coordinator's
  // ordinal and the fix, when this process does not see it (another CUDA_VISIBLE_DEVICES
  // than the engine's).
  int localOrdinal(const ipc::DeviceEntry& entry) const;
  // cudaMalloc'd, zero-filled; kNoSpace when the device is full.
  uint64_t alloc(int device, uint64_t bytes) const;
  // Frees; returns the CUDA error code rather than throwing (used while stopping).
  int free(int device, uint64_t ptr) const noexcept;
  IpcHandle ipcHandle(int device, uint64_t ptr) const;
  uint64_t ipcOpen(int device, const IpcHandle& handle) const;
  int ipcClose(int device, uint64_t ptr) const noexcept;
  void copyToDevice(int device, uint64_t dst, const void* src, uint64_t bytes) const;
  void copyToHost(int device, void* dst, uint64_t src, uint64_t bytes) const;
  // True when allocations are host memory (a test double on a machine without a device):
  // tensors over them are CPU tensors.
  bool hostMemory() const { return host_memory_; }
  // The step's operations (gpu/cuda_ops.h), each done when it returns; errors named.
  void zero(int device, uint64_t ptr, uint64_t bytes) const;
  void synchronize(int device) const;
  // Whether kernels on `device` can address `peer`'s memory (true for a device and itself).
  bool canAccessPeer(int device, int peer) const;
  // A device-to-device copy issued on `device`, in whose context both addresses are mapped.
  void copy(int device, uint64_t dst, uint64_t src, uint64_t bytes) const;
  void reduce(int device, uint64_t out, uint64_t prev, const uint64_t* ins, uint32_t nins,
              uint64_t begin, uint64_t end, float a, float b) const;
  bool anyNonFinite(int device, uint64_t ptr, uint64_t begin, uint64_t end) const;
  // Page-locks host memory, in `device`'s context (copies from it to a device become
  // asynchronous DMA).
  void hostRegister(int device, void* ptr, uint64_t bytes) const;
  int hostUnregister(int device, void* ptr) const noexcept;
  // Whether a call of this process's has failed with a sticky error (a kernel fault): its
  // CUDA context is unusable, and a worker must exit to be replaced.
  bool faulted() const { return faulted_.load(std::memory_order_relaxed); }
  // Whether `device`'s context has a sticky error, this library's or torch's (they share
  // the device's primary context): waits for the device, and looks at what that returns.
  bool deviceFaulted(int device) const;
  // "cudaErrorNoDevice: no CUDA-capable device is detected"
  std::string describe(int code) const;

 private:
  CudaLibrary() = default;
  void check(int code, const char* what, int device) const;

  std::string path_;
  void* handle_ = nullptr;
  decltype(&shmgrad_cuda_api_version) api_version_ = nullptr;
  decltype(&shmgrad_cuda_error_name) error_name_ = nullptr;
  decltype(&shmgrad_cuda_error_string) error_string_ = nullptr;
  decltype(&shmgrad_cuda_device_count) device_count_ = nullptr;
  decltype(&shmgrad_cuda_alloc) alloc_ = nullptr;
  decltype(&shmgrad_cuda_free) free_ = nullptr;
  decltype(&shmgrad_cuda_ipc_handle) ipc_handle_ = nullptr;
  decltype(&shmgrad_cuda_ipc_open) ipc_open_ = nullptr;
  decltype(&shmgrad_cuda_ipc_close) ipc_close_ = nullptr;
  decltype(&shmgrad_cuda_copy_to_device) copy_to_device_ = nullptr;
  decltype(&shmgrad_cuda_copy_to_host) copy_to_host_ = nullptr;
  decltype(&shmgrad_cuda_zero) zero_ = nullptr;
  decltype(&shmgrad_cuda_synchronize) synchronize_ = nullptr;
  decltype(&shmgrad_cuda_can_access_peer) can_access_peer_ = nullptr;
  decltype(&shmgrad_cuda_copy) copy_ = nullptr;
  decltype(&shmgrad_cuda_reduce) reduce_ = nullptr;
  decltype(&shmgrad_cuda_any_nonfinite) any_nonfinite_ = nullptr;
  decltype(&shmgrad_cuda_device_uuid) device_uuid_ = nullptr;
  decltype(&shmgrad_cuda_error_is_sticky) error_is_sticky_ = nullptr;
  decltype(&shmgrad_cuda_host_register) host_register_ = nullptr;
  decltype(&shmgrad_cuda_host_unregister) host_unregister_ = nullptr;
  bool host_memory_ = false;
  mutable std::atomic<bool> faulted_{false};
};

// One device's buffers as a worker or trainer sees them: the published table entry's IPC
// handle opened in this process (once per process however many mappings share it, as CUDA
// requires; closed with the last), and the addresses of its regions
// from the layout that validateDeviceTable checked against the segment's own sizes (again
// here, at open: the segment is shared memory). The handle is opened in the context of
// the device whose kernels use it (`context`: the process's device), so that a reducer on
// one device addresses another device's slots through peer access, as NCCL opens its
// peers' buffers; an opening in the allocation's own context would leave them unmapped
// there.
class DeviceMapping {
 public:
  // kInvalidArgument for a device index past the table, for a GPU this process does not
  // see (its UUID), or for a `context` other than the one this process already opened the
  // allocation in; kNotFound while the coordinator has not published the entry;
  // CorruptError for a table that fails validation. `context` -1: the allocation's own
  // device (this process's ordinal of it).
  DeviceMapping(std::shared_ptr<const CudaLibrary> cuda, const ipc::Segment& segment,
                uint32_t device_index, int context = -1);
  ~DeviceMapping();
  DeviceMapping(const DeviceMapping&) = delete;
  DeviceMapping& operator=(const DeviceMapping&) = delete;

  // This process's ordinal of the device (found by its UUID: the coordinator's may differ).
  int ordinal() const { return ordinal_; }
  // The device in whose context the buffers are mapped here.
  int context() const { return context_; }
  uint32_t slots() const { return slots_; }
  uint64_t params() const { return base_ + layout_.params; }
  uint64_t buffers() const { return base_ + layout_.buffers; }
  // The reduced and accumulation buffers: the first device's only (kInvalidArgument on
  // another).
  uint64_t reduced() const;
  uint64_t accum() const;
  // The `local`-th gradient slot on this device; kInvalidArgument past its slots.
  uint64_t slot(uint32_t local) const;

 private:
  std::shared_ptr<const CudaLibrary> cuda_;
  int ordinal_ = -1;
  int context_ = -1;
  uint32_t slots_ = 0;
  ipc::DeviceLayout layout_{};
  IpcHandle handle_{};
  uint64_t base_ = 0;
};

}  // namespace shmgrad::gpu
