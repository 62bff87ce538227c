// The device table: where an engine's GPU buffers live, in the segment's `device` region.
//
// For an engine with devices=, the coordinator makes one cudaMalloc allocation on each
// device it serves (libshmgrad_cuda.so) and lays it out like the segment's CPU regions:
//
//   params    the device's copy of the parameters (float32, each tensor where the
//             segment's ParamEntry puts it, so one offset table serves every copy)
//   buffers   its copy of the shared buffers (BatchNorm statistics)
//   slots     one gradient slot per worker placed on the device, slot_stride apart
//   reduced   the reduced gradient (the first device's only: the trainer's, into which
//             every reducer writes its slice)
//   accum     the second reduced buffer of accumulating steps (the first device's only)
//
// and publishes the allocation's CUDA IPC handle here; workers and trainers open it and
// view the regions as tensors. Like every value read from shared memory, the table is
// checked before use (validateDeviceTable): a layout that differs from the one computed
// here from the segment's own sizes, a device index or slot out of range, a slot given
// twice, is kCorrupt, never a wild device pointer.
#pragma once

#include <cstdint>
#include <vector>

#include "ipc/layout.h"

namespace shmgrad::ipc {

constexpr uint32_t kMaxDevices = 16;       // devices one engine serves, at most
constexpr uint32_t kIpcHandleBytes = 64;   // cudaIpcMemHandle_t
constexpr uint32_t kDeviceUuidBytes = 16;  // cudaUUID_t
constexpr uint64_t kDeviceAlign = 256;     // cudaMalloc's alignment; every region's too
constexpr int8_t kNoDevice = -1;           // a slot placed on no device

// Byte offsets of one device's regions within its allocation; `bytes` is its size.
// `reduced` and `accum` are 0 (none) on every device but the first.
struct DeviceLayout {
  uint64_t params;
  uint64_t buffers;
  uint64_t slots;
  uint64_t slot_stride;
  uint64_t reduced;
  uint64_t accum;
  uint64_t bytes;
};

enum class DeviceState : uint32_t { kEmpty = 0, kPublished = 1 };

struct DeviceEntry {
  int32_t ordinal;              // the CUDA device ordinal, as the coordinator's process sees it
  uint32_t slots;               // gradient slots in this device's allocation
  std::atomic<uint32_t> state;  // DeviceState; kPublished is stored after the handle
  uint32_t reserved;
  DeviceLayout layout;
  uint8_t ipc_handle[kIpcHandleBytes];
  // The GPU's UUID: what names it in every process. An ordinal depends on each process's
  // CUDA_VISIBLE_DEVICES and CUDA_DEVICE_ORDER; a worker or trainer finds its own ordinal
  // for this UUID (gpu::CudaLibrary::localOrdinal), and refuses when it does not see it.
  uint8_t uuid[kDeviceUuidBytes];
};

// DeviceTable::flags.
enum DeviceTableFlag : uint32_t {
  // An MPS daemon served the coordinator when it started (its pipe directory had a control
  // socket): several workers on one GPU then run their kernels at once, where without it
  // their contexts time-slice the GPU.
  kDeviceTableMps = 1u << 0,
  kDeviceTableFlags = (1u << 1) - 1,
};

struct DeviceTable {
  uint32_t count;  // devices in use; 0 for a CPU engine
  uint32_t flags;  // DeviceTableFlag bits
  DeviceEntry devices[kMaxDevices];
  int8_t slot_device[kMaxWorkers];  // each slot's index into devices, or kNoDevice
  uint8_t slot_local[kMaxWorkers];  // each slot's index among its device's slots
};
static_assert(sizeof(DeviceTable) <= kDeviceReserved, "the device table fits its region");

// The layout of one device's allocation for `param_floats` parameters, `buffer_bytes`
// bytes of buffers and `slots` gradient slots, and, if `reduces` (the first device), the
// reduced and accumulation buffers (each region kDeviceAlign-aligned).
// kInvalidArgument when the sizes exceed the engine's limits.
DeviceLayout layoutDevice(uint64_t param_floats, uint64_t buffer_bytes, uint32_t slots,
                          bool reduces);

// Round-robin placement of `slots` worker slots on `devices` devices: slot i on device
// i % devices, as its (i / devices)-th slot there. Several workers per device are allowed.
struct Placement {
  std::vector<int> device;  // per slot
  std::vector<int> local;   // per slot
  std::vector<uint32_t> slots_per_device;
};
Placement placeRoundRobin(uint32_t slots, uint32_t devices);

// Fills `table` for `ordinals` (distinct), placing `num_slots` slots round-robin; the
// handles and UUIDs stay empty and every state kEmpty until the coordinator publishes them.
void initDeviceTable(DeviceTable* table, const std::vector<int>& ordinals, uint32_t num_slots,
                     uint64_t param_floats, uint64_t buffer_bytes);

// Checks everything a reader uses against the segment's own sizes: kCorrupt naming the
// first problem. `visible_devices` bounds the ordinals (-1: do not check them here).
void validateDeviceTable(const DeviceTable& table, uint32_t num_slots, uint64_t param_floats,
                         uint64_t buffer_bytes, int visible_devices);

}  // namespace shmgrad::ipc
