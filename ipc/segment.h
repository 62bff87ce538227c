// Creating, opening, validating and removing an engine's shared-memory segment.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "ipc/config.h"
#include "ipc/error.h"
#include "ipc/layout.h"

namespace shmgrad::ipc {

// One parameter tensor as the coordinator found it in the model.
struct ParamSpec {
  std::string name;
  std::vector<int64_t> shape;
  MemoryFormat memory_format = MemoryFormat::kContiguous;  // fits shape (checked)
};

// One buffer tensor (float32 or int64) as the coordinator found it in the model.
struct BufferSpec {
  std::string name;
  std::vector<int64_t> shape;
  DType dtype = DType::kFloat32;
};

// Everything that fixes the size of a segment.
struct SegmentSpec {
  std::string name;  // engine name, [A-Za-z0-9_.-]{1,64}
  std::string model_path;
  WorkerKind worker_kind = WorkerKind::kScript;
  std::string job_path;  // eager workers' pickled job
  LossKind loss = LossKind::kCrossEntropy;
  // Named losses are sums; an eager job's may be kUnknown (its workers find out).
  LossReduction loss_reduction = LossReduction::kSum;
  Numerics numerics;       // the workers' torch numerics (none set: torch's defaults)
  uint32_t num_slots = 1;  // gradient slots (most workers at once)
  uint32_t threads_per_worker = 1;
  // serve --workers auto: the trainer chooses workers x threads (ControlBlock::placement_auto).
  bool placement_auto = false;
  // One more slot, the trainer's (SegmentHeader::trainer_slots): host memory only.
  bool trainer_slot = false;
  std::vector<ParamSpec> params;
  std::vector<BufferSpec> buffers;  // shared buffers (BatchNorm statistics), may be empty
  int64_t max_batch = config::kDefaultMaxBatch;                  // examples per step
  uint64_t input_bytes = config::kDefaultInputCapacityMb << 20;  // explicit-batch inputs
  uint64_t target_bytes = config::targetBytesFor(config::kDefaultMaxBatch);  // and targets
  // Optional dataset (count 0: none).
  int64_t data_count = 0;
  std::vector<int64_t> data_example_shape;
  DType data_target_dtype = DType::kNone;
  std::vector<int64_t> data_target_shape;
  std::string data_description;
  // A dataset that eager workers hold themselves is described with empty example and
  // target shapes ({0}): data_count examples addressed by index, no data in the segment.
};

// Checks an engine name; throws InvalidArgument naming the rule otherwise.
void checkEngineName(const std::string& name);
// The one shape check for specs (kInvalidArgument), headers and step requests read from
// shared memory (kCorrupt): ndim <= kMaxDims, every dim in [0, kMaxDimSize), and the
// element count <= kMaxNumel. Returns the element count; throws `kind` naming `what`.
// Allocates nothing unless it throws (a worker runs it on every step request).
uint64_t checkedNumel(ErrorKind kind, const char* what, const int64_t* dims, uint64_t ndim);

// Parses a loss name (ipc::kLossNames); throws InvalidArgument listing the choices.
LossKind parseLoss(const std::string& name);
// Parses "sum", "mean" or "weighted" (kLossReductionNames); throws InvalidArgument.
LossReduction parseLossReduction(const std::string& name);
// Parses serve's --numerics, "matmul_precision=high,cudnn_tf32=1,cudnn_benchmark=0,
// cudnn_deterministic=0" (any of the keys; the others keep torch's defaults); throws
// InvalidArgument naming a key or value it does not know. The empty string: none set.
Numerics parseNumerics(const std::string& spec);
// The same text back, every key; "" when none is set.
std::string numericsText(const Numerics& numerics);
// The record in shared memory, read once and checked: CorruptError for bits or a
// precision it does not know.
Numerics checkedNumerics(const Numerics& shared);
// "/shmgrad-<uid>-<name>": the uid keeps two users' engines of the same name apart.
std::string segmentName(const std::string& engine_name);
// The file backing the segment, "/dev/shm/shmgrad-<uid>-<name>".
std::string segmentPath(const std::string& engine_name);

// Computes the byte layout of a segment for spec (no memory touched).
struct Layout {
  uint64_t total_size = 0;
  uint64_t param_floats = 0;
  std::vector<uint64_t> param_offsets;   // in floats
  std::vector<uint64_t> buffer_offsets;  // in bytes from the buffers region
  Region params_table, buffers_table, buffers, params, slots, reduced, accum, req_indices,
      req_inputs, req_targets, data_inputs, data_targets, device;
  uint64_t slot_stride = 0;
};
Layout computeLayout(const SegmentSpec& spec);

// Validates every field of a mapped header against the mapped size. Throws
// Error(kCorrupt) with the first inconsistency found; never reads out of bounds.
void validateHeader(const SegmentHeader* h, uint64_t mapped_size);

class Segment {
 public:
  // Coordinator: creates and maps a new segment (mode 0600), allocates it in full
  // (posix_fallocate, so a full /dev/shm fails here and never as SIGBUS later) and
  // writes the header. A stale segment of the same name whose coordinator is dead is
  // removed first; a live one is an error naming its pid.
  static std::unique_ptr<Segment> create(const SegmentSpec& spec);
  // Any process of the owner: maps an existing segment and validates its header.
  static std::unique_ptr<Segment> open(const std::string& engine_name);
  // Unlinks the segment name (mappings stay valid until unmapped). Returns false if
  // it did not exist.
  static bool remove(const std::string& engine_name);
  // Removes the segment if no live coordinator holds it (its coordinator died).
  // Throws Error(kBusy) naming the pid if one does. Returns true if it removed one.
  static bool removeIfStale(const std::string& engine_name);
  // True if a segment of that name exists.
  static bool exists(const std::string& engine_name);

  ~Segment();
  Segment(const Segment&) = delete;
  Segment& operator=(const Segment&) = delete;

  SegmentHeader* header() const { return header_; }
  uint8_t* base() const { return base_; }
  uint64_t size() const { return size_; }
  const std::string& engineName() const { return name_; }

  template <typename T>
  T* region(const Region& r) const {
    return reinterpret_cast<T*>(base_ + r.offset);
  }
  const ParamEntry* paramTable() const { return region<ParamEntry>(header_->params_table); }
  float* params() const { return region<float>(header_->params); }
  float* slot(uint32_t i) const {
    return reinterpret_cast<float*>(base_ + header_->slots.offset + i * header_->slot_stride);
  }
  float* reduced() const { return region<float>(header_->reduced); }
  float* accum() const { return region<float>(header_->accum); }
  // Slot i's copy of the shared buffers, laid out like buffers() (BufferRule::kMean).
  uint8_t* slotBuffers(uint32_t i) const {
    return reinterpret_cast<uint8_t*>(slot(i)) + slotBufferOffset(header_->param_floats);
  }
  const BufferEntry* bufferTable() const { return region<BufferEntry>(header_->buffers_table); }
  uint8_t* buffers() const { return region<uint8_t>(header_->buffers); }

 private:
  Segment(std::string name, uint8_t* base, uint64_t size);
  static std::unique_ptr<Segment> initialize(const SegmentSpec& spec, const Layout& l,
                                             uint8_t* base, int fd);
  static void writeHeader(const SegmentSpec& spec, const Layout& l, uint8_t* base);
  std::string name_;
  int lock_fd_ = -1;  // the coordinator's lock on the segment (create only)
  uint8_t* base_;
  uint64_t size_;
  SegmentHeader* header_;
};

// Free bytes on the file system behind /dev/shm (statvfs).
uint64_t shmFreeBytes();

// True if a process with this pid exists (signal 0); EPERM counts as alive.
bool processAlive(int pid);

}  // namespace shmgrad::ipc
