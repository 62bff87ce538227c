// The layout of one engine's shared-memory segment.
//
// One segment per engine, named "/shmgrad-<uid>-<name>" (see segment.h), created
// by the coordinator with mode 0600 and allocated in full up front. Every process
// that maps it (coordinator, workers, trainer, `shmgrad status`) sees the same bytes:
//
//   offset 0            SegmentHeader (this file): identity, region table, control
//                       words, step request, per-worker records, step statistics
//   header.params_table ParamEntry[num_params]: name, shape, offset of every tensor
//   header.buffers_table BufferEntry[num_buffers]: name, shape, dtype, offset of every
//                       shared buffer (BatchNorm statistics)
//   header.buffers      the shared buffers' bytes, each kAlign-aligned
//   header.params       float32 parameters, each tensor 64-byte aligned
//   header.slots        num_slots gradient slots, each laid out like params, then a copy
//                       of the buffers region (the participant's, averaged by rank 0);
//                       then the trainer's slot, where trainer_slots is 1
//                       (trainerSlot(): the lease holder computes a step itself)
//   header.reduced      the reduced gradient, laid out like params
//   header.accum        a second reduced gradient, laid out like params: accumulating
//                       steps read one and write the other (retry-safe)
//   header.req_indices  int64 dataset indices of the current step
//   header.req_inputs   inputs of an explicit batch (float32, or int64 for eager workers)
//   header.req_targets  targets of an explicit batch (int64 or float32)
//   header.data_inputs  optional read-only dataset: float32 inputs
//   header.data_targets optional read-only dataset: targets
//   header.device       the device table (ipc/device_table.h); all zeros on the CPU
//
// No pointer is ever stored in shared memory: only offsets from the segment start,
// which every reader checks against the segment size before use (validateHeader).
// All fields that change after start-up are std::atomic or are written only while
// the step protocol (docs/DESIGN.md) gives the writer exclusive ownership.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <iterator>

namespace shmgrad::ipc {

constexpr uint64_t kMagic = 0x31444152474d4853ull;  // "SHMGRAD1", little endian
constexpr uint32_t kLayoutVersion = 18;
constexpr uint64_t kAlign = 64;  // every region and tensor starts on a cache line
constexpr uint32_t kAlignFloats = kAlign / sizeof(float);
constexpr uint32_t kMaxWorkers = 64;            // gradient slots in one segment, at most
constexpr uint32_t kMaxThreadsPerWorker = 256;  // intra-op threads of one worker, at most
constexpr uint32_t kMaxParams = 1024;           // parameter tensors in one model, at most
static_assert(kMaxParams % 64 == 0, "WorkerRecord::grad_params holds kMaxParams bits");
constexpr uint32_t kMaxBuffers = 1024;  // shared buffer tensors (BatchNorm statistics), at most
constexpr uint32_t kMaxDims = 8;        // dimensions of a tensor, at most
constexpr uint32_t kNameLen = 128;      // parameter name, NUL-terminated
constexpr uint32_t kErrorLen = 8192;    // a worker's error message (with traceback), NUL-terminated
constexpr uint32_t kErrorTypeLen = 128;     // the error's type name ("TypeError"), NUL-terminated
constexpr uint32_t kPathLen = 512;          // model path, NUL-terminated
constexpr uint32_t kStatsRing = 16;         // last steps kept for `shmgrad status`
constexpr uint32_t kDeviceReserved = 8192;  // bytes kept for CUDA IPC handles
// Buckets of a step's gradient reduced as backward completes them
// (StepRequest::num_buckets), at most; each is cut into one piece per participant.
constexpr uint32_t kMaxBuckets = 16;

// Limits on what a header, a spec or a step request may say. One definition each:
// creation (segment.cc), validation (validateHeader) and the worker's per-step checks
// (worker/step_protocol.cc) all use these.
constexpr int64_t kMaxBatch = int64_t{1} << 36;          // examples in one step / in a dataset
constexpr int64_t kMaxDimSize = int64_t{1} << 40;        // one dimension of a shape
constexpr uint64_t kMaxNumel = uint64_t{1} << 40;        // elements of one tensor or example
constexpr uint64_t kMaxParamFloats = uint64_t{1} << 40;  // floats in the parameter buffer
constexpr uint64_t kMaxSpinNs = 10000000;                // a request's spin_ns, at most (10 ms)
// A worker held up by a step the trainer abandoned at its timeout (abandon_epoch; see
// heldByAbandoned), this long after the coordinator first saw it so, is replaced.
constexpr uint64_t kAbandonGraceNs = 2000000000;

// Enumerations stored in the segment, each with its names right below it. A value read
// from shared memory is checked with the *Valid() helper before it is used as an index.
enum class LossKind : uint32_t { kCrossEntropy = 1, kNll = 2, kMse = 3 };
constexpr const char* kLossNames[] = {nullptr, "cross_entropy", "nll", "mse"};
constexpr uint32_t kNumLossKinds = 3;
// The torch.nn.functional function each loss is, summed over the batch: the TorchScript
// worker calls it in C++ (worker/replica.cc), the eager workers by this name.
constexpr const char* kLossFunctions[] = {nullptr, "cross_entropy", "nll_loss", "mse_loss"};
static_assert(sizeof(kLossFunctions) == sizeof(kLossNames), "a function for every loss");

// What the job's loss returns for a batch, so that a trainer's gradient() takes, by
// default, what loss.backward() would give: the batch's sum, its mean over the examples,
// or a (loss_sum, count) pair (a mean over the count). Known at start (TorchScript workers'
// named losses are sums; the launcher says what it found) or found out by the first eager
// worker that computes (ControlBlock::loss_reduction); kUnknown until then.
enum class LossReduction : uint32_t { kUnknown = 0, kSum = 1, kMean = 2, kWeighted = 3 };
constexpr const char* kLossReductionNames[] = {"unknown", "sum", "mean", "weighted"};

// The numerics every worker computes with: the trainer's torch settings when the engine
// started (python/shmgrad/_numerics.py: "matmul_precision=high,cudnn_tf32=1,..."),
// applied by each worker at start, so that its float32 matmuls and convolutions round as
// the trainer's would. Without kNumericsSet (an engine served without --numerics) the
// workers keep torch's defaults. Read from shared memory: numericsValid checks it.
enum NumericsFlag : uint32_t {
  kNumericsSet = 1u << 0,
  kCudnnTf32 = 1u << 1,           // torch.backends.cudnn.allow_tf32
  kCudnnBenchmark = 1u << 2,      // torch.backends.cudnn.benchmark
  kCudnnDeterministic = 1u << 3,  // torch.backends.cudnn.deterministic
  kNumericsFlags = (1u << 4) - 1,
};
// torch.set_float32_matmul_precision (its "high" is matmul.allow_tf32 = True).
constexpr const char* kMatmulPrecisionNames[] = {"highest", "high", "medium"};
struct Numerics {
  uint32_t flags = 0;             // NumericsFlag bits
  uint32_t matmul_precision = 0;  // index into kMatmulPrecisionNames
};
inline bool numericsValid(const Numerics& n) {
  return (n.flags & ~static_cast<uint32_t>(kNumericsFlags)) == 0 &&
         n.matmul_precision < std::size(kMatmulPrecisionNames);
}

enum class DType : uint32_t { kNone = 0, kFloat32 = 1, kInt64 = 2 };

enum class EngineState : uint32_t { kStarting = 0, kServing = 1, kStopping = 2, kFailed = 3 };
constexpr const char* kEngineStateNames[] = {"starting", "serving", "stopping", "failed"};

enum class WorkerState : uint32_t {
  kEmpty = 0,
  kStarting = 1,
  kReady = 2,
  kDead = 3,
  kExited = 4,
  kRetired = 5
};
constexpr const char* kWorkerStateNames[] = {"empty", "starting", "ready",
                                             "dead",  "exited",   "retired"};

template <typename T, size_t N>
constexpr const char* enumName(const char* const (&names)[N], T v) {
  const auto i = static_cast<size_t>(v);
  return i < N && names[i] != nullptr ? names[i] : "unknown";
}
inline const char* lossName(LossKind v) { return enumName(kLossNames, v); }

// Where the placement stands (ControlBlock::placement_state): kFixed, the engine's
// workers and threads_per_worker as started (or as a resize set them); kProbing, the
// trainer is timing candidates on its steps; kChosen, it keeps the fastest.
enum class PlacementState : uint32_t { kFixed = 0, kProbing = 1, kChosen = 2 };
constexpr const char* kPlacementStateNames[] = {"fixed", "probing", "chosen"};
inline const char* placementStateName(PlacementState v) {
  return enumName(kPlacementStateNames, v);
}
inline const char* engineStateName(EngineState v) { return enumName(kEngineStateNames, v); }
// A value read from shared memory: anything but a known one reads as "unknown".
inline const char* lossReductionName(uint32_t v) {
  return enumName(kLossReductionNames, static_cast<LossReduction>(v));
}
inline const char* workerStateName(WorkerState v) { return enumName(kWorkerStateNames, v); }
inline bool lossKindValid(uint32_t v) { return v >= 1 && v <= kNumLossKinds; }
// Bytes per element of a dtype read from shared memory; 0 for one no region may hold.
inline uint64_t dtypeSize(uint32_t v) {
  return v == static_cast<uint32_t>(DType::kFloat32) ? 4
         : v == static_cast<uint32_t>(DType::kInt64) ? 8
                                                     : 0;
}
inline uint64_t dtypeSize(DType v) { return dtypeSize(static_cast<uint32_t>(v)); }

// kStructured: an explicit batch of several tensors (a dict, tuple or list of them, nested,
// as a tokenizer or a collate_fn makes it) for eager workers: StepRequest::leaves.
enum class BatchKind : uint32_t { kIndices = 1, kExplicit = 2, kStructured = 3 };
constexpr const char* kBatchKindNames[] = {nullptr, "indices", "explicit", "structured"};
constexpr uint32_t kNumBatchKinds = 3;

// The element types a structured batch's tensors may have, stored in the segment.
enum class LeafType : uint32_t {
  kFloat32 = 1,
  kInt64 = 2,
  kFloat64 = 3,
  kFloat16 = 4,
  kBFloat16 = 5,
  kInt32 = 6,
  kInt16 = 7,
  kInt8 = 8,
  kUInt8 = 9,
  kBool = 10
};
// Bytes per element of a leaf type read from shared memory; 0 for an unknown one.
inline uint64_t leafTypeSize(uint32_t v) {
  constexpr uint64_t kSizes[] = {0, 4, 8, 8, 2, 2, 4, 2, 1, 1, 1};
  return v < sizeof(kSizes) / sizeof(kSizes[0]) ? kSizes[v] : 0;
}
constexpr uint32_t kMaxLeaves = 64;       // tensors in one structured batch, at most
constexpr uint32_t kStructureLen = 2048;  // its structure's description, NUL-terminated

// How a step publishes the shared buffers (BufferEntry).
enum class BufferRule : uint32_t { kMean = 0, kFirst = 1 };

// Where a step's reduction writes. kFresh: reduced = scale * sum(slots). The other two
// add to the previous result without overwriting it (so a retried step adds once):
// out = a * prev + b * sum(slots), prev and out being reduced and accum, or the reverse.
enum class Accumulate : uint32_t { kFresh = 0, kReducedToAccum = 1, kAccumToReduced = 2 };

// What a step's reduced gradient is (StepRequest::reduction). kSum: the gradient of the
// summed loss. kMean: of its mean over the step's count (the examples, or forward's
// counts). kSumThroughMean: the sum again, but the workers backpropagate the batch's mean
// (1/B, as for kMean) and the reducers multiply by B, so float16 overflows where the
// mean's backward would: what a node of several computes, the mean over the global count
// being taken after the all-reduce (DDP's ranks backpropagate their own mean alike).
enum class Reduction : uint32_t { kSum = 0, kMean = 1, kSumThroughMean = 2 };

// Which program the workers run: the C++ TorchScript replica, or Python (an eager
// nn.Module, any loss, a torch Dataset the workers hold; python/shmgrad/_eager_worker.py).
enum class WorkerKind : uint32_t { kScript = 0, kEager = 1 };
constexpr const char* kWorkerKindNames[] = {"script", "eager"};
inline const char* workerKindName(WorkerKind v) { return enumName(kWorkerKindNames, v); }

// A byte range of the segment. Checked on attach: offset % kAlign == 0 and
// offset + size <= total_size.
struct Region {
  uint64_t offset;
  uint64_t size;
};

// A tensor's shape: ndim <= kMaxDims, every dim >= 0.
struct Shape {
  uint32_t ndim;
  uint32_t reserved;
  int64_t dims[kMaxDims];
};

// The order of a parameter's elements in every parameter-shaped buffer (its
// ParamEntry::memory_format): row-major, or PyTorch's channels_last for a 4-D (N, C, H, W)
// tensor (C fastest, then W, H, N) and channels_last_3d for a 5-D one. A model converted
// with model.to(memory_format=torch.channels_last) keeps its convolutions' fast layout in
// every process, and every process reads the same order (the views' strides come from it).
enum class MemoryFormat : uint32_t { kContiguous = 0, kChannelsLast = 1, kChannelsLast3d = 2 };
constexpr const char* kMemoryFormatNames[] = {"contiguous", "channels_last", "channels_last_3d"};
inline const char* memoryFormatName(MemoryFormat v) { return enumName(kMemoryFormatNames, v); }

// Whether format `f` (as read from shared memory: any value) applies to a tensor of
// `ndim` dimensions.
constexpr bool memoryFormatFits(uint32_t f, uint32_t ndim) {
  return f == static_cast<uint32_t>(MemoryFormat::kContiguous) ||
         (f == static_cast<uint32_t>(MemoryFormat::kChannelsLast) && ndim == 4) ||
         (f == static_cast<uint32_t>(MemoryFormat::kChannelsLast3d) && ndim == 5);
}

// The strides (in elements) of a tensor of `dims` laid out in `f` (which must fit):
// row-major, or the channel dimension (1) fastest and the others row-major after it.
inline void memoryFormatStrides(const int64_t* dims, uint32_t ndim, MemoryFormat f,
                                int64_t* strides) {
  const bool channels_first = f != MemoryFormat::kContiguous;  // dimension 1 is the fastest
  int64_t step = 1;
  auto next = [&](uint32_t d) {  // d is the fastest dimension not yet given a stride
    strides[d] = step;
    step *= dims[d] > 1 ? dims[d] : 1;
  };
  if (channels_first) next(1);
  for (uint32_t d = ndim; d-- > 0;) {
    if (!(channels_first && d == 1)) next(d);
  }
}

// One parameter tensor of the model, in the order of named_parameters().
struct ParamEntry {
  char name[kNameLen];  // dotted path ("fc1.weight"), NUL-terminated
  Shape shape;          // shape; numel = product of dims
  uint64_t offset;      // in floats from the start of params/slot/reduced; multiple of kAlignFloats
  uint64_t numel;       // offset + numel <= header.param_floats
  uint32_t memory_format;  // MemoryFormat, fitting shape.ndim (checked on attach)
  uint32_t reserved;
};

// One buffer tensor of the model (BatchNorm's running statistics, ...), shared so that
// the trainer's module evaluates with them. Float32 and int64 buffers are shared. Every
// participant loads them into its module before computing; after the compute barrier the
// step's first participant publishes the step's values, by the request's BufferRule:
// kMean, float32 buffers averaged over the participants weighted by their examples (each
// copies its own into the scratch after its slot's gradient before the barrier), int64
// ones (batch counts) the first participant's; kFirst, the first participant's (DDP's rule).
struct BufferEntry {
  char name[kNameLen];  // dotted path ("bn1.running_mean"), NUL-terminated
  Shape shape;
  uint32_t dtype;  // DType: kFloat32 or kInt64
  uint32_t reserved;
  uint64_t offset;  // in bytes from the start of the buffers region; multiple of kAlign
  uint64_t nbytes;  // numel * element size; offset + nbytes <= buffers.size
};

// Epoch-tagged barrier word: the high 16 bits carry the low 16 bits of the step
// epoch, the low 16 bits count arrivals. The trainer resets it to tag(epoch) when it
// publishes a step, so an arrival from a stale (aborted) step never counts.
constexpr uint32_t kBarrierCountMask = 0xffffu;           // the arrivals
constexpr uint32_t kBarrierTagMask = ~kBarrierCountMask;  // the epoch's tag
inline uint32_t barrierTag(uint32_t epoch) { return (epoch & kBarrierCountMask) << 16; }
// An epoch whose tag would be 0, the "idle" barrier word: the trainer skips it.
inline bool barrierTagIsIdle(uint32_t epoch) { return (epoch & kBarrierCountMask) == 0; }

// Per-worker record: written by that worker (results, state) and by the coordinator
// (pid, state on death). Padded to whole cache lines.
struct alignas(64) WorkerRecord {
  std::atomic<int32_t> pid;              // process id, 0 when the slot has no process
  std::atomic<uint32_t> state;           // WorkerState
  std::atomic<uint32_t> assigned_epoch;  // trainer: epoch this worker takes part in
  std::atomic<uint32_t> assigned_rank;   // trainer: its rank among the participants
  std::atomic<uint32_t> busy_epoch;      // worker: epoch it is working on, 0 when idle
  std::atomic<uint32_t> restarts;        // coordinator: replacements of this slot
  std::atomic<uint64_t> heartbeat_ns;    // worker: CLOCK_MONOTONIC at its last loop turn
  // Result of the step in result_epoch, written by the worker before it arrives at
  // the compute barrier (compute part) and at the reduce barrier (reduce_ns).
  uint32_t result_epoch;
  uint32_t error;       // 1: error_type and error_text say why this shard failed
  uint64_t start_ns;    // CLOCK_MONOTONIC when it saw the step (wake-up latency)
  int64_t examples;     // examples in this worker's shard
  double loss_sum;      // sum of the loss over the shard
  double count;         // the shard's weight in a mean: examples, or the counts
                        // (tokens) its loss sums over; finite and >= 0
  uint64_t compute_ns;  // forward + backward
  uint64_t reduce_ns;   // its slice of the reduction (bucketed: the pieces it took)
  // Bucketed steps: of reduce_ns, what it reduced before the step's last participant
  // finished computing (hidden behind that wait).
  uint64_t reduce_early_ns;
  uint64_t barrier_wait_ns;  // time spent waiting for the others
  uint32_t nonfinite_loss;   // 1 when loss_sum is NaN or infinite
  // Set by reducers: 1 when its slot holds a NaN or infinity; 2 when this worker's slice
  // of the reduction summed to one though every slot there was finite (an overflow).
  std::atomic<uint32_t> nonfinite_grad;
  // Bit i: parameter i received a gradient in this shard's backward (autograd reached
  // it); a parameter no participant's backward reached keeps .grad None in the trainer.
  uint64_t grad_params[kMaxParams / 64];
  char error_type[kErrorTypeLen];  // the exception's type ("TypeError"), "" if none
  char error_text[kErrorLen];      // its message and, from Python, the traceback's last frames
};

// Parameter i's bit in a WorkerRecord::grad_params set (i < kMaxParams).
inline void setParamBit(uint64_t* bits, uint32_t i) { bits[i / 64] |= uint64_t{1} << (i % 64); }
inline void clearParamBit(uint64_t* bits, uint32_t i) {
  bits[i / 64] &= ~(uint64_t{1} << (i % 64));
}
inline bool paramBit(const uint64_t* bits, uint32_t i) { return (bits[i / 64] >> (i % 64)) & 1u; }

// The intra-op threads a placement's `threads` stands for (StepRequest::threads,
// ControlBlock::placement_threads): itself, or with 0 the engine's threads_per_worker.
inline uint32_t stepThreads(uint32_t threads, uint32_t threads_per_worker) {
  return threads != 0 ? threads : threads_per_worker;
}

// One tensor of a structured batch: B examples of `example_shape`, at `offset` bytes
// into the req_inputs region (a multiple of kAlign).
struct LeafEntry {
  uint32_t type;  // LeafType
  uint32_t reserved;
  Shape example_shape;
  uint64_t offset;
};

// The step request. Written only by the lease-holding trainer, and only while no
// worker takes part in a step (after done or abort of the previous one).
struct StepRequest {
  uint32_t epoch;             // the epoch this request belongs to
  uint32_t kind;              // BatchKind
  int64_t num_examples;       // batch size B >= 1
  uint32_t num_participants;  // workers taking part, 1..num_slots
  uint32_t reduction;         // Reduction
  // What each worker multiplies its summed loss by before backward (with loss_scale):
  // 1/B for kMean and kSumThroughMean (as backward of the batch's mean gives, so that
  // float16 overflows where plain PyTorch's would), 1 for kSum. A mean over counts other
  // than the examples is rescaled by B / count while reducing, kSumThroughMean by B.
  float scale;
  uint32_t input_dtype;   // explicit: DType of inputs (float32; int64 for eager workers)
  Shape example_shape;    // explicit: shape of one input example
  uint32_t target_dtype;  // explicit: DType of targets
  // Loss scaling (float16 mixed precision): each worker backpropagates its loss times
  // this, so the reduced gradient is loss_scale times the gradient, for a GradScaler to
  // unscale. 1 without; finite and > 0, checked by the trainer and by every worker.
  float loss_scale;
  Shape target_shape;             // explicit: shape of one target (ndim 0 for class labels)
  int64_t max_examples_per_pass;  // >0: a worker splits its shard into passes
  uint64_t publish_ns;            // CLOCK_MONOTONIC when published (for wall time)
  // How long a participant may spin (pause loop, no system call) before it sleeps on a
  // futex, after this step, waiting for the next one. The trainer sets it only when the
  // participants' main threads and the trainer have a core each (participants + 1 <=
  // cores: their intra-op threads are idle between steps); 0 otherwise, as spinning
  // would steal their cores. (The trainer itself spins for the step's end only when
  // participants x threads + 1 <= cores.)
  uint64_t spin_ns;
  // The same bound for the participants' two barriers. While they are at the barriers
  // the trainer either spins too (when participants x threads + 1 <= cores) or sleeps,
  // so the trainer sets it when the participants' threads alone fit the cores
  // (participants x threads <= cores).
  uint64_t barrier_spin_ns;
  // Eager workers: the step's seed (shmgrad.example_seed(seed, i) seeds the generators
  // before dataset[i]) and the trainer module's mode (1: train, 0: eval).
  uint64_t seed;
  uint32_t train_mode;
  uint32_t buffer_rule;  // BufferRule
  uint32_t accumulate;   // Accumulate
  // Intra-op threads each participant computes this step with (the placement: the
  // trainer's choice, engine/placement.h); 0: the engine's threads_per_worker
  // (stepThreads). A worker changes its thread count only when it differs from its last
  // step's.
  uint32_t threads;
  // Accumulating with a mean: the count the previous result is the mean over. The
  // reducers take a = prev_count / (prev_count + C) and b = 1 / (prev_count + C), C the
  // step's count (the participants' counts); a sum takes a = b = 1.
  double prev_count;
  // kStructured: the tensors (the rows of each lie in req_inputs) and how they nest, a
  // string the eager workers parse (python/shmgrad/_batch.py); never trusted unchecked.
  uint32_t num_leaves;
  // Bucketed reduction (docs/DESIGN.md, "Buckets"): 0, the reduction starts after every
  // participant's backward (one slice each); else the gradient's floats are cut at
  // bucket_begin[0] = 0 < ... < bucket_begin[num_buckets] = param_floats (parameter
  // offsets, multiples of 16 floats), each bucket reduced in one piece per participant as
  // soon as every participant's backward completed it, by whichever participant claims the
  // piece first (ControlBlock::buckets). Only for a fresh step of two or more
  // participants on the host; never trusted unchecked.
  uint32_t num_buckets;
  uint64_t bucket_begin[kMaxBuckets + 1];
  char structure[kStructureLen];
  LeafEntry leaves[kMaxLeaves];
  uint8_t participants[kMaxWorkers];  // slot ids, rank order
};

// One finished step, for `shmgrad status`. Written by the last worker to finish the
// reduction into ring[steps_served % kStatsRing].
struct StepRecord {
  uint32_t epoch;
  uint32_t workers;
  int64_t examples;
  double loss_sum;
  uint64_t wall_ns;              // publish to end of reduction
  uint64_t compute_max_ns;       // slowest worker's forward + backward
  uint64_t reduce_max_ns;        // slowest worker's reduction slice
  uint64_t reduce_early_max_ns;  // bucketed: the most of it done before compute ended
  uint64_t wait_ns;              // wall - compute_max - reduce_max: synchronisation cost
};

struct alignas(64) ControlBlock {
  // Futex words each get a cache line: they are hammered by different processes.
  alignas(64) std::atomic<uint32_t> step_epoch;       // trainer publishes a step; workers wait
  alignas(64) std::atomic<uint32_t> compute_barrier;  // tag | arrivals after backward
  alignas(64) std::atomic<uint32_t> reduce_barrier;   // tag | arrivals after the reduction
  alignas(64) std::atomic<uint32_t> trainer_wake;     // bumped on done/abort; trainer waits
  // Where a worker that the latest step went on without sleeps (step_epoch is for the
  // latest step's participants): the trainer bumps and wakes it only when a step takes a
  // worker the step before did not (or it does not know), the coordinator with every wake
  // of the workers (ipc::wakeWorkers). So a placement or a small batch that leaves
  // workers out does not wake them every step.
  alignas(64) std::atomic<uint32_t> idle_wake;
  // Bucketed steps (StepRequest::num_buckets). Per bucket, the participants whose backward
  // has completed it and the pieces of it claimed so far (tag | count each, reset by the
  // trainer like the barriers; a bucket has one piece per participant); bumped and woken
  // by whoever completes a bucket, for participants with nothing ready to take.
  alignas(64) std::atomic<uint32_t> bucket_progress;
  struct alignas(64) BucketWord {
    std::atomic<uint32_t> ready;
    std::atomic<uint32_t> claimed;
  } buckets[kMaxBuckets];
  alignas(64) std::atomic<uint32_t> done_epoch;  // last reducer: step finished
  uint64_t done_ns;                              // CLOCK_MONOTONIC of the last done_epoch store
  std::atomic<uint32_t> abort_epoch;             // coordinator: step lost a worker
  // trainer: the last step it gave up on at its timeout; a worker held up by it
  // (ipc::heldByAbandoned) after the coordinator's grace period is killed and replaced.
  std::atomic<uint32_t> abandon_epoch;
  alignas(64) std::atomic<uint32_t> coordinator_wake;  // bumped on stop/resize requests
  std::atomic<uint32_t> stop_requested;
  std::atomic<uint32_t> engine_state;    // EngineState
  std::atomic<uint32_t> target_workers;  // resize request (issue: adaptive)
  // LossReduction: set at creation, or by the first eager worker that finds it out (a
  // compare-and-swap from kUnknown, so the first answer stays).
  std::atomic<uint32_t> loss_reduction;
  Numerics numerics;  // set at creation, never changed; checked by each worker that reads it
  // How a step's cores are placed: workers x threads per worker (engine/placement.h).
  // placement_auto is set at creation (serve --workers auto: one worker per core, each
  // able to use every core); the lease-holding trainer then probes candidates on its
  // first steps and writes what it uses here, for status readers and for a trainer that
  // attaches later (which keeps a chosen placement instead of probing again).
  std::atomic<uint32_t> placement_auto;          // 1: the trainer chooses
  std::atomic<uint32_t> placement_state;         // PlacementState
  std::atomic<uint32_t> placement_workers;       // participants at most (0: every ready worker)
  std::atomic<uint32_t> placement_threads;       // threads of each (0: threads_per_worker)
  std::atomic<uint32_t> placement_in_trainer;    // 1: the trainer computes (trainerSlot())
  alignas(64) std::atomic<int32_t> trainer_pid;  // the lease: 0 free, else holder
  // An engine with devices: the trainer process that maps their memory (0: none). Set when
  // a trainer opens it, cleared when its last view of it is gone; the coordinator frees
  // that memory only once this is 0 or names a dead process (a cudaFree before the
  // importer's cudaIpcCloseMemHandle is undefined). Never trusted as more than a pid.
  std::atomic<int32_t> device_trainer_pid;
  std::atomic<uint64_t> steps_served;
  std::atomic<uint64_t> steps_aborted;
  std::atomic<uint64_t> worker_restarts;
  std::atomic<uint64_t> step_retries;
};

struct alignas(64) SegmentHeader {
  // Identity, checked first on attach.
  uint64_t magic;           // kMagic
  uint32_t layout_version;  // kLayoutVersion
  uint32_t header_size;     // sizeof(SegmentHeader)
  uint64_t total_size;      // bytes of the whole segment == mapped size
  uint32_t owner_uid;       // uid of the coordinator
  int32_t coordinator_pid;
  uint64_t created_ns;        // CLOCK_REALTIME at creation
  char model_path[kPathLen];  // TorchScript model (script), or its parameters' holder (eager)
  char job_path[kPathLen];    // eager: the pickled job (model, loss, dataset, ...), else
  uint32_t loss;              // LossKind
  uint32_t num_slots;         // gradient slots = most workers, <= kMaxWorkers
  uint32_t num_params;        // <= kMaxParams
  uint32_t threads_per_worker;
  uint64_t param_floats;  // floats in params, in each slot and in reduced (padded)
  int64_t max_batch;      // capacity of req_indices, in examples
  // Regions (offsets and sizes in bytes).
  Region params_table;   // ParamEntry[num_params]
  uint32_t num_buffers;  // <= kMaxBuffers (0: the model has none)
  // 1: slot num_slots is the trainer's own (serve --workers auto with eager workers on the
  // host; engine/placement.h, "in the trainer"): no worker ever runs in it, and the slots
  // region holds num_slots + 1 slots. 0: none.
  uint32_t trainer_slots;
  Region buffers_table;  // BufferEntry[num_buffers]
  Region buffers;        // the shared buffers' bytes
  Region params;         // param_floats floats
  Region slots;          // num_slots * slot_stride bytes
  // Bytes between slots, a multiple of kAlign: each slot holds the gradient
  // (param_floats floats) and then, at slotBufferOffset(), a copy of the shared buffers'
  // bytes (BufferRule::kMean).
  uint64_t slot_stride;
  Region reduced;       // param_floats floats
  Region accum;         // param_floats floats (Accumulate)
  Region req_indices;   // int64[max_batch]
  Region req_inputs;    // inputs of an explicit batch (input_dtype)
  Region req_targets;   // targets of an explicit batch
  Region data_inputs;   // dataset inputs (float32), size 0 without dataset
  Region data_targets;  // dataset targets (DType data_target_dtype)
  Region device;        // kDeviceReserved bytes for CUDA IPC handles
  // Dataset description (valid when data_count > 0).
  int64_t data_count;          // examples
  Shape data_example_shape;    // shape of one input
  uint32_t data_target_dtype;  // DType
  uint32_t worker_kind;        // WorkerKind
  Shape data_target_shape;     // shape of one target (ndim 0: a class label)
  char data_description[128];
  ControlBlock control;
  StepRequest request;
  StepRecord stats[kStatsRing];
  WorkerRecord workers[kMaxWorkers];
};

static_assert(std::atomic<uint32_t>::is_always_lock_free, "futex words must be lock-free");
static_assert(std::atomic<uint64_t>::is_always_lock_free, "counters must be lock-free");
static_assert(sizeof(std::atomic<uint32_t>) == sizeof(uint32_t), "futex word layout");

inline uint64_t alignUp(uint64_t v, uint64_t a) { return (v + a - 1) / a * a; }

// Slots in the slots region: the workers' and the trainer's (validateHeader: <= kMaxWorkers).
inline uint32_t allSlots(const SegmentHeader& h) { return h.num_slots + h.trainer_slots; }
// The trainer's own slot, where trainer_slots is 1: its record is workers[num_slots].
inline uint32_t trainerSlot(const SegmentHeader& h) { return h.num_slots; }

// Where a slot's copy of the shared buffers starts, in bytes from the slot's start.
inline uint64_t slotBufferOffset(uint64_t param_floats) {
  return alignUp(param_floats * sizeof(float), kAlign);
}

}  // namespace shmgrad::ipc
