// The worker side of the step protocol (docs/DESIGN.md, "The step protocol"), shared by
// every kind of worker. A worker kind supplies only its compute phase (a ShardComputer:
// the TorchScript replica in worker_loop.cc, or an eager Python worker through
// python/worker_binding.cc); waiting for a step, validating the request, both barriers,
// the in-place reduction of its slice and the result record are this code's, written once.
//
// No libtorch here: the protocol touches only the segment, and for an engine with devices
// the device buffers through gpu::EngineMemory (libshmgrad_cuda.so, loaded with dlopen).
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>

#include "gpu/engine_memory.h"

#include "ipc/config.h"
#include "ipc/futex.h"
#include "ipc/layout.h"
#include "ipc/segment.h"
#include "ipc/step.h"

namespace shmgrad::worker {

// Exit codes of a worker process, declared in ipc/config.h (the coordinator reads them).
inline constexpr int kExitStopped = config::kExitWorkerStopped;
inline constexpr int kExitCoordinatorGone = config::kExitWorkerCoordinatorGone;
inline constexpr int kExitStartupFailed = config::kExitWorkerStartupFailed;
inline constexpr int kExitDeviceFault = config::kExitWorkerDeviceFault;

// How often an idle worker (no step for this long) checks that its coordinator lives:
// getppid() is a system call, so it never runs between steps that follow each other.
inline constexpr std::chrono::milliseconds kIdleCheckSlice{200};
// How long a worker waits at a barrier for the others before giving up on the step. The
// trainer's own timeout aborts a step much sooner; this only bounds a wait that nobody
// ends (every other participant and the trainer gone).
inline constexpr std::chrono::seconds kBarrierTimeout{3600};

// A participant's share of one step, validated against the segment, as its compute
// phase sees it. Pointers point into the segment; nothing is copied.
struct Shard {
  uint32_t epoch = 0;
  uint32_t rank = 0;  // among the step's participants
  uint32_t participants = 0;
  int64_t begin = 0, end = 0;         // examples [begin, end) of the step's batch
  int64_t max_examples_per_pass = 0;  // > 0: compute in passes of at most this many
  // Intra-op threads to compute with (the trainer's placement); 0: as the worker started.
  uint32_t threads = 0;
  // Multiply the summed loss by this before backward: the step's loss_scale times
  // StepRequest::scale (1/B for a mean or a sum through the mean, as backward of the
  // batch's mean weights these examples; else 1).
  float grad_scale = 1.0f;
  // Where backward must accumulate, already zeroed: this worker's slot, or the reduced
  // buffer itself when it is the step's only participant (no reduction copy) and, on
  // devices, computes on the trainer's device (`alone`).
  float* grads = nullptr;
  bool alone = false;
  // The CUDA ordinal whose memory `grads` (and the parameters this worker computes with)
  // lie in, -1 for a CPU engine.
  int device = -1;

  ipc::BatchKind kind = ipc::BatchKind::kIndices;
  // kIndices: indices[0 .. end-begin) into the engine's dataset, each checked in range.
  const int64_t* indices = nullptr;
  // kExplicit: the shard's inputs and targets, `*_example_numel` elements of
  // `*_dtype` per example, checked to lie inside their request regions.
  const void* inputs = nullptr;
  const void* targets = nullptr;
  ipc::DType input_dtype = ipc::DType::kNone;
  ipc::DType target_dtype = ipc::DType::kNone;
  const ipc::Shape* example_shape = nullptr;  // one input example
  const ipc::Shape* target_shape = nullptr;   // one target (ndim 0: a class label)

  // Eager workers: seed generators with example_seed(seed, i) before dataset[i]; run the
  // module in train (true) or eval mode, as the trainer's module is.
  uint64_t seed = 0;
  bool train = true;
  // kStructured: num_leaves tensors, leaf k's rows of this shard at leaf_data[k] (checked
  // to lie inside req_inputs), described by leaves[k]; `structure` is NUL-terminated.
  uint32_t num_leaves = 0;
  const ipc::LeafEntry* leaves = nullptr;
  const void* leaf_data[ipc::kMaxLeaves] = {};
  const char* structure = nullptr;

  ipc::BufferRule buffer_rule = ipc::BufferRule::kMean;
  ipc::Accumulate accumulate = ipc::Accumulate::kFresh;
  // Bucketed reduction (StepRequest::num_buckets, checked): 0, or the buckets' count,
  // bucket k being floats [bucket_begin[k], bucket_begin[k + 1]) of the gradient.
  uint32_t num_buckets = 0;
  const uint64_t* bucket_begin = nullptr;

  int64_t size() const { return end - begin; }
};

// Reading the step request, over the header's bytes alone (worker/step_request.cc; run by
// prepareShard and computePhase below, and by tests/fuzz on any bytes).
//
// Whether the structural fields of h.request (participants, batch size, kind, reduction,
// scales, rules) are in range for a participant of rank `rank` in step `e`.
bool stepRequestValid(const ipc::SegmentHeader& h, uint32_t e, uint32_t rank);
// Points shard `s` (kind, begin and end set from a valid request) at its examples of the
// batch in the segment mapped at `base`, checking every index and every size against the
// region it lies in. Throws InvalidArgument for an index out of range, Corrupt for sizes no
// trainer writes.
void resolveBatch(const ipc::SegmentHeader& h, const uint8_t* base, Shard* s);

// What a compute phase throws to report its error's type besides its message (an eager
// worker: the Python exception's type name; the message carries the traceback's last
// frames). Any other std::exception is reported with an empty type.
class ShardError : public std::runtime_error {
 public:
  ShardError(std::string type, const std::string& text)
      : std::runtime_error(text), type_(std::move(type)) {}
  const std::string& type() const { return type_; }

 private:
  std::string type_;
};

// What one pass computed: the loss summed over its examples, and its weight in a mean
// (its examples, or the count its loss sums over: tokens that are not padding).
struct PassResult {
  double loss_sum = 0;
  double count = 0;
};

// The compute phase of one kind of worker.
class ShardComputer {
 public:
  virtual ~ShardComputer() = default;
  // Before the shard's passes: point the parameters' .grad at shard.grads (rebind when
  // it changes), load the shared buffers (BatchNorm statistics) into the model and set
  // its train/eval mode as shard.train says.
  virtual void beginShard(const Shard& shard) = 0;
  // Forward and backward over the shard's examples [begin, end) (relative to the shard),
  // the loss times shard.grad_scale, gradients accumulated into shard.grads. Returns the
  // loss summed over those examples, before grad_scale, and their count. The protocol
  // calls it once per pass of at most max_examples_per_pass examples. Throws
  // std::exception when the model rejects the input; what() reaches the trainer as a
  // WorkerError.
  virtual PassResult computePass(const Shard& shard, int64_t begin, int64_t end) = 0;
  // After the shard's passes: set bit i of `bits` (cleared, num_params bits) for each
  // parameter i whose .grad backward accumulated into in them (autograd reached it). The
  // default marks every parameter: a kind of worker that cannot tell gives each a
  // gradient, zeros where none reached it.
  virtual void markGradParams(uint64_t* bits, uint32_t num_params) {
    for (uint32_t i = 0; i < num_params; ++i) ipc::setParamBit(bits, i);
  }
  // Store this worker's shared-buffer values (BatchNorm statistics) into `dst`, laid out
  // like the segment's buffers region: the shared buffers themselves (the step's first
  // participant, after the compute barrier, when every participant has loaded them), or
  // this slot's copy (BufferRule::kMean, before the barrier). Nothing to do for a model
  // without buffers.
  virtual void publishBuffers(uint8_t* /*dst*/) {}
};

// How a compute phase tells the protocol which parameters' gradients backward completes
// one by one (StepParticipant::watchGrad): parameters it calls gradReady for (kHooked),
// and those backward never writes (kNoGrad: frozen). A bucket is reduced before the end
// of a participant's backward only if each of its parameters is one of the two.
enum class GradWatch : uint8_t { kUnknown = 0, kHooked, kNoGrad };

// One worker slot's side of the protocol.
class StepParticipant {
 public:
  StepParticipant(const ipc::Segment& segment, uint32_t slot, int parent_pid);

  // starting -> ready (compare-and-swap, so a slot retired while the model loaded is
  // not turned ready again) and wakes the coordinator. False: retired meanwhile; exit.
  bool becomeReady();
  // Records why start-up failed, for the coordinator's report.
  void reportStartupFailure(const std::string& text);

  // Serves steps until the engine stops, the slot is retired or the coordinator dies.
  // Returns the process exit code (kExit*).
  int serve(ShardComputer& computer);

  // The phases of serve(), in order; public so that tests and other worker kinds can
  // drive them one at a time.
  //
  // Waits for the next step this worker takes part in. Returns its epoch, or 0 when the
  // worker must exit (exitCode() says why).
  uint32_t waitForStep();
  // Runs step e: validate, compute, compute barrier, reduce my slice, reduce barrier,
  // record (the last reducer completes the step and wakes the trainer). `local`: an
  // explicit batch's tensors in this process (the in-trainer placement), read there
  // instead of in the request region.
  void runStep(uint32_t e, ShardComputer& computer, const ipc::LocalBatch& local = {});
  // A failed step's device context is unusable (a sticky CUDA error): exit, be replaced.
  bool deviceFaulted() const;
  void awaitStepEnd(uint32_t e);
  int exitCode() const { return exit_code_; }
  // The step memory this participant computes in: for its compute phase's parameter and
  // gradient views.
  const gpu::EngineMemory& memory() const { return *mem_; }

  // Set once, before steps, by a compute phase that hooks backward (worker/grad_hooks.h):
  // how parameter `param`'s completion is known.
  void watchGrad(uint32_t param, GradWatch how);
  // Backward has accumulated parameter `param`'s .grad for good (autograd's post hook of
  // its accumulator, in the shard's last pass; ignored otherwise): a bucket whose hooked
  // parameters are all complete is marked ready for the others to reduce. Called on the
  // thread that runs backward; allocates nothing.
  void gradReady(uint32_t param);
  // Called before backward's accumulator adds parameter `param`'s gradient into .grad:
  // true when this is its first gradient of the shard and the slot was not zeroed for it
  // (every parameter hooked, on the host), so the caller writes the gradient into .grad
  // instead of adding it (no pass to zero the slot, none to read the zeros back);
  // false: let the accumulator add. Called on the thread that runs backward.
  bool gradFirstWrite(uint32_t param);
  // For a layer that can compute parameter `param`'s gradient straight into .grad (the
  // eager worker's direct Linear): true, once per shard, where gradFirstWrite(param) will
  // answer true; the layer then writes .grad and hands backward's accumulator that very
  // .grad, whose WriteFirstHook consumes the first write. Once per shard, so that a
  // parameter used twice gets one contribution written there and the other fresh (autograd
  // sums them, and the hook writes the sum).
  bool claimDirectWrite(uint32_t param) {
    if (!writing_first_ || param >= ipc::kMaxParams || ipc::paramBit(written_, param) ||
        ipc::paramBit(direct_, param)) {
      return false;
    }
    ipc::setParamBit(direct_, param);
    return true;
  }
  // After gradFirstWrite's true: the caller wrote parameter `param`'s gradient and found
  // every value of it finite. While nothing is added to it, a shard alone (its slot the
  // result) need not read it again for non-finite values (reducePhase).
  void gradWrittenFinite(uint32_t param);
  // Whether what a hook writes is worth checking for non-finite values as it writes it:
  // only a shard alone reads its result again otherwise; a larger step's reducers read
  // every slot anyway (checkNonFinite).
  bool checksWrites() const { return writing_first_ && alone_; }
  // The direct layer's word, after its claimDirectWrite(param), that what it computed into
  // .grad is finite (ipc::productFinite, from its inputs): the hook takes it as checked.
  void vouchFinite(uint32_t param) {
    if (param < ipc::kMaxParams && ipc::paramBit(direct_, param)) ipc::setParamBit(vouched_, param);
  }
  bool vouchedFinite(uint32_t param) const {
    return param < ipc::kMaxParams && ipc::paramBit(vouched_, param);
  }

 private:
  bool prepareShard(uint32_t e, Shard* shard);
  void computePhase(const Shard& shard, ShardComputer& computer);
  bool barrier(std::atomic<uint32_t>& word, uint32_t e, uint32_t n);
  void reducePhase(const Shard& shard);
  float stepRescale(const Shard& shard) const;
  void prepareBuckets(const Shard& shard);
  void markBucket(uint32_t b);
  void markAllBuckets();
  void computePasses(const Shard& shard, ShardComputer& computer);
  bool awaitArrivals(std::atomic<uint32_t>& word, uint32_t e, uint32_t n);
  bool keepWaiting();
  uint64_t barrierDeadline() const;
  bool bucketedReduce(const Shard& shard, ShardComputer& computer, uint64_t t1);
  void shareBuffers(const Shard& shard, ShardComputer& computer);
  void publishBuffers(ShardComputer& computer, uint8_t* dst);
  void checkNonFinite(const float* out, const float* const* ins, uint32_t n, uint64_t b,
                      uint64_t end);
  void reducePiece(const Shard& shard, uint64_t b, uint64_t end, float scale, bool check);
  void averageBuffers(const Shard& shard);
  double stepCount(const Shard& shard) const;
  void completeStep(uint32_t e, uint32_t n);
  void setError(const char* type, const char* text);
  bool stopRequested();
  bool coordinatorGone();

  const ipc::Segment& seg_;
  ipc::SegmentHeader* h_;
  ipc::ControlBlock& c_;
  ipc::WorkerRecord& me_;
  const uint32_t slot_;
  const int parent_pid_;
  std::unique_ptr<gpu::EngineMemory> mem_;
  uint32_t last_epoch_ = 0;
  uint64_t spin_ns_ = 0;          // the current step's StepRequest::spin_ns, bounded
  uint64_t barrier_spin_ns_ = 0;  // and its barrier_spin_ns
  ipc::AdaptiveSpin next_step_spin_, barrier_spin_;  // how long spinning pays, per wait
  ipc::AdaptiveSpin bucket_spin_;  // waits for a bucket (often for the slowest backward)
  // Bucketed steps: how each parameter's completion is known, its bucket, and per bucket
  // its hooked parameters (0: reduced only after this participant's backward) and those
  // still pending in the current shard; set up when the buckets change.
  GradWatch watch_[ipc::kMaxParams] = {};
  uint8_t param_bucket_[ipc::kMaxParams] = {};
  uint16_t bucket_hooked_[ipc::kMaxBuckets] = {};
  uint16_t pending_[ipc::kMaxBuckets] = {};
  bool marked_[ipc::kMaxBuckets] = {};
  uint64_t seen_[ipc::kMaxParams / 64] = {};        // hooked parameters complete in this shard
  uint64_t buckets_of_[ipc::kMaxBuckets + 1] = {};  // the cuts param_bucket_ follows
  uint32_t num_buckets_ = 0;                        // this step's (0: not bucketed)
  uint32_t bucket_participants_ = 0;
  uint32_t mapped_buckets_ = 0;
  uint32_t bucket_epoch_ = 0;
  bool armed_ = false;  // the shard's last pass runs: gradReady counts
  // Write-first shards: the slot is not zeroed; each hooked parameter's first gradient is
  // written (gradFirstWrite), and those backward did not reach are zeroed after the
  // passes. Possible when every parameter is hooked or frozen (write_first_ok_, known
  // once watch_ is final).
  bool writing_first_ = false;
  int write_first_ok_ = -1;  // -1: not known yet
  uint64_t written_[ipc::kMaxParams / 64] = {};
  uint64_t direct_[ipc::kMaxParams / 64] = {};   // claimDirectWrite's, this shard
  uint64_t finite_[ipc::kMaxParams / 64] = {};   // written, found finite, nothing added since
  uint64_t vouched_[ipc::kMaxParams / 64] = {};  // vouchFinite's, this shard
  bool alone_ = false;                           // this shard's Shard::alone
  ipc::LocalBatch local_;  // runStep's: the step's explicit batch in this process
  bool writeFirstPossible();
  bool anyNonFiniteUnchecked(const float* grads);
  void zeroUnwritten(float* grads);
  int exit_code_ = kExitStopped;
};

}  // namespace shmgrad::worker
