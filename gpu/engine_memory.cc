#include "gpu/engine_memory.h"

#include <cstring>

#include "ipc/config.h"
#include "ipc/device_table.h"
#include "ipc/error.h"
#include "ipc/reduce.h"

namespace shmgrad::gpu {

EngineMemory::EngineMemory(const ipc::Segment& segment, const std::string& cuda_library,
                           int64_t slot)
    : segment_(segment) {
  const ipc::SegmentHeader* h = segment.header();
  const auto* table = segment.region<ipc::DeviceTable>(h->device);
  ipc::validateDeviceTable(*table, h->num_slots, h->param_floats, h->buffers.size, -1);
  if (table->count == 0) return;
  SHMGRAD_CHECK(slot < static_cast<int64_t>(h->num_slots), ErrorKind::kInvalidArgument, "slot ",
                slot, " is out of range: the engine has ", h->num_slots, " slots");
  // Validated above, but shared memory: read once and checked again where it is used.
  const int mine = slot < 0 ? 0 : table->slot_device[slot];
  SHMGRAD_CHECK(mine >= 0 && static_cast<uint32_t>(mine) < table->count, ErrorKind::kCorrupt,
                "device table: slot ", slot, " is placed on device index ", mine, " of ",
                table->count);
  std::string path = cuda_library;
  if (const char* env = config::tunable("SHMGRAD_CUDA_LIBRARY")) path = env;
  cuda_ = CudaLibrary::load(path.empty() ? CudaLibrary::defaultPath() : path);
  // This process's ordinal of its device: the same GPU (its UUID) as the coordinator's.
  context_ = cuda_->localOrdinal(table->devices[mine]);
  for (uint32_t d = 0; d < table->count; ++d) {
    devices_.push_back(std::make_unique<DeviceMapping>(cuda_, segment, d, context_));
  }
}

EngineMemory::~EngineMemory() {
  for (const auto& [ordinal, p] : pinned_) cuda_->hostUnregister(ordinal, p);
}

bool EngineMemory::pinHost(int ordinal, void* p, uint64_t bytes) {
  if (!onDevice() || bytes == 0) return false;
  try {
    cuda_->hostRegister(ordinal, p, bytes);
  } catch (const std::exception&) {
    return false;
  }
  pinned_.emplace_back(ordinal, p);
  return true;
}

const DeviceMapping& EngineMemory::deviceOf(uint32_t slot) const {
  const ipc::SegmentHeader* h = segment_.header();
  SHMGRAD_CHECK(slot < h->num_slots, ErrorKind::kInvalidArgument, "slot ", slot,
                " is out of range: the engine has ", h->num_slots, " slots");
  const auto* table = segment_.region<ipc::DeviceTable>(h->device);
  // Validated at open, but shared memory: checked again where it is used.
  const int d = table->slot_device[slot];
  SHMGRAD_CHECK(d >= 0 && static_cast<size_t>(d) < devices_.size(), ErrorKind::kCorrupt,
                "device table: slot ", slot, " is placed on device ", d, " of ", devices_.size());
  return *devices_[d];
}

int EngineMemory::ordinal(uint32_t slot) const {
  return onDevice() ? deviceOf(slot).ordinal() : -1;
}

int EngineMemory::tensorDevice(int ordinal) const {
  return ordinal < 0 || cuda_->hostMemory() ? -1 : ordinal;
}

namespace {
float* at(uint64_t address) { return reinterpret_cast<float*>(address); }
}  // namespace

float* EngineMemory::params(uint32_t slot) const {
  return onDevice() ? at(deviceOf(slot).params()) : segment_.params();
}

float* EngineMemory::trainerParams() const {
  return onDevice() ? at(devices_[0]->params()) : segment_.params();
}

float* EngineMemory::slot(uint32_t slot) const {
  if (!onDevice()) return segment_.slot(slot);
  const auto* table = segment_.region<ipc::DeviceTable>(segment_.header()->device);
  return at(deviceOf(slot).slot(table->slot_local[slot]));
}

float* EngineMemory::reduced() const {
  return onDevice() ? at(devices_[0]->reduced()) : segment_.reduced();
}

float* EngineMemory::accum() const {
  return onDevice() ? at(devices_[0]->accum()) : segment_.accum();
}

namespace {
uint64_t addr(const void* p) { return reinterpret_cast<uint64_t>(p); }
}  // namespace

void EngineMemory::zero(int ordinal, float* p, uint64_t floats) const {
  if (ordinal < 0) {
    std::memset(p, 0, floats * sizeof(float));
  } else {
    cuda_->zero(ordinal, addr(p), floats * sizeof(float));
  }
}

void EngineMemory::synchronize(int ordinal) const {
  if (ordinal >= 0) cuda_->synchronize(ordinal);
}

void EngineMemory::reduce(int ordinal, float* out, const float* prev, float a,
                          const float* const* ins, uint32_t n, uint64_t begin, uint64_t end,
                          float b) const {
  if (ordinal < 0) {
    if (a == 0.0f) {
      ipc::reduceSlice(out, ins, n, begin, end, b);
    } else {
      ipc::accumulateSlice(out, prev, a, ins, n, begin, end, b);
    }
    return;
  }
  uint64_t addrs[ipc::kMaxWorkers];
  SHMGRAD_CHECK(n <= ipc::kMaxWorkers, ErrorKind::kInvalidArgument, n, " inputs to a reduction");
  for (uint32_t k = 0; k < n; ++k) addrs[k] = addr(ins[k]);
  cuda_->reduce(ordinal, addr(out), a == 0.0f ? 0 : addr(prev), addrs, n, begin, end, a, b);
}

void EngineMemory::scale(int ordinal, float* p, uint64_t begin, uint64_t end, float factor) const {
  if (ordinal < 0) {
    ipc::scaleSlice(p, begin, end, factor);
  } else {
    const uint64_t in = addr(p);
    cuda_->reduce(ordinal, addr(p), 0, &in, 1, begin, end, 0.0f, factor);
  }
}

bool EngineMemory::anyNonFinite(int ordinal, const float* p, uint64_t begin, uint64_t end) const {
  if (ordinal < 0) return ipc::anyNonFinite(p, begin, end);
  return cuda_->anyNonFinite(ordinal, addr(p), begin, end);
}

uint64_t EngineMemory::syncParams() const {
  if (devices_.size() < 2) return 0;
  const DeviceMapping& first = *devices_[0];
  SHMGRAD_CHECK(context_ == first.ordinal(), ErrorKind::kInvalidArgument,
                "the parameters are brought up to date by the trainer, on cuda:", first.ordinal(),
                ", not from cuda:", context_);
  const uint64_t bytes = segment_.header()->param_floats * sizeof(float);
  cuda_->synchronize(first.ordinal());
  for (size_t d = 1; d < devices_.size(); ++d) {
    cuda_->copy(first.ordinal(), devices_[d]->params(), first.params(), bytes);
  }
  return bytes * (devices_.size() - 1);
}

}  // namespace shmgrad::gpu
