// Where an engine's step memory lives, as a worker or trainer uses it: the segment's CPU
// regions for a CPU engine, or, for an engine with devices, the device buffers the
// coordinator published (every device's allocation opened here through its IPC handle).
// The step protocol and the trainer ask this class for addresses and for the operations
// on them (zero, reduce, the non-finite check), so that one protocol serves both.
//
// Device memory: each slot's parameters and gradient slot are those of the device it is
// placed on; the reduced gradient (and the accumulator) are the first device's, the
// trainer's device, where every reducer writes its slice (peer access). The other devices'
// parameter copies are brought up to date from the first before each step (syncParams).
// A process computes on one device (a worker on its slot's, the trainer on the first), and
// every device's allocation is mapped in that device's context, so its kernels address
// them all (the coordinator checked that the devices are peers).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "gpu/cuda_library.h"
#include "ipc/segment.h"

namespace shmgrad::gpu {

class EngineMemory {
 public:
  // For a CPU engine nothing is loaded. For one with devices, loads the CUDA library
  // ($SHMGRAD_CUDA_LIBRARY, else `cuda_library`, else CudaLibrary::defaultPath(); the
  // coordinator sets the variable for its workers) and opens every published device:
  // kNotFound while one is not published yet, CorruptError for a table that fails
  // validation. `slot`: the worker's, whose device this process computes on; -1 for the
  // trainer (the first device).
  EngineMemory(const ipc::Segment& segment, const std::string& cuda_library = "",
               int64_t slot = -1);
  ~EngineMemory();
  EngineMemory(const EngineMemory&) = delete;
  EngineMemory& operator=(const EngineMemory&) = delete;

  bool onDevice() const { return !devices_.empty(); }
  uint32_t deviceCount() const { return static_cast<uint32_t>(devices_.size()); }
  // The CUDA ordinal holding `slot`'s memory; -1 for a CPU engine.
  int ordinal(uint32_t slot) const;
  // The first device's ordinal (the trainer's); -1 for a CPU engine.
  int trainerOrdinal() const { return onDevice() ? devices_[0]->ordinal() : -1; }
  // The device index for tensors over memory on `ordinal`: -1 for CPU tensors (a CPU
  // engine, or a CUDA library whose memory is host memory: the test double), else it.
  int tensorDevice(int ordinal) const;

  float* params(uint32_t slot) const;  // the copy `slot` computes with
  float* trainerParams() const;        // the copy the trainer's optimizer steps
  float* slot(uint32_t slot) const;
  float* reduced() const;
  float* accum() const;

  // The step's operations on these addresses, on the host or on device `ordinal` (-1:
  // host). reduce: out[i] = a * prev[i] + b * sum_k ins[k][i] for i in [begin, end),
  // summed in list order (prev unused when a == 0).
  void zero(int ordinal, float* p, uint64_t floats) const;
  void synchronize(int ordinal) const;
  void reduce(int ordinal, float* out, const float* prev, float a, const float* const* ins,
              uint32_t n, uint64_t begin, uint64_t end, float b) const;
  // p[i] *= factor for i in [begin, end).
  void scale(int ordinal, float* p, uint64_t begin, uint64_t end, float factor) const;
  bool anyNonFinite(int ordinal, const float* p, uint64_t begin, uint64_t end) const;
  // The trainer's copy of the parameters into every other device's (after its optimizer
  // step, before the next step's forward); waits for the trainer's device first; issued on
  // the trainer's device (kInvalidArgument in a process that computes on another). Returns
  // the bytes copied (0 with one device or none).
  uint64_t syncParams() const;

  const CudaLibrary* cuda() const { return cuda_.get(); }

  // Page-locks host memory that this process copies to device `ordinal` at every step (the
  // request's regions), until this object goes, so that the copy is asynchronous DMA.
  // False when the driver refuses (the copies then work as before); nothing to do for a
  // CPU engine.
  bool pinHost(int ordinal, void* p, uint64_t bytes);

 private:
  const DeviceMapping& deviceOf(uint32_t slot) const;

  const ipc::Segment& segment_;
  std::shared_ptr<const CudaLibrary> cuda_;
  std::vector<std::unique_ptr<DeviceMapping>> devices_;
  int context_ = -1;
  std::vector<std::pair<int, void*>> pinned_;  // (ordinal, address) to unregister
};

}  // namespace shmgrad::gpu
