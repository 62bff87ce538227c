// shmgrad's C++ trainer API: attach to a running engine by name, map its parameters
// and reduced gradient as tensors, and ask for the gradient of a batch.
//
//   auto t = shmgrad::Trainer::attach("demo");
//   std::vector<torch::Tensor> params = t->parameterViews();   // alias the engine's
//   for (size_t i = 0; i < params.size(); ++i)
//     params[i].mutable_grad() = t->gradientViews()[i];         // alias the reduced gradient
//   torch::optim::SGD opt(params, 0.1);
//   auto stats = t->gradient(indices);                           // blocks until reduced
//   opt.step();                                                  // every worker sees it
//
// One trainer holds an engine at a time (a lease on the engine, released by close()
// or the destructor, and taken over automatically when its holder has died).
#pragma once

#include <torch/types.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "engine/placement.h"
#include "ipc/layout.h"
#include "ipc/record.h"
#include "ipc/step.h"

namespace shmgrad {

namespace ipc {
class Segment;
class AdaptiveSpin;
}  // namespace ipc
namespace gpu {
class EngineMemory;
}  // namespace gpu

// The options of attach and of a gradient call, each declared once as a list
// X(type, name, default, doc) (ipc/record.h): the structs below, the Python binding's
// arguments (by field name, in the list's order) and shmgrad._C.ATTACH_OPTIONS and
// GRADIENT_OPTIONS come from these lists; shmgrad.attach's and Client.gradient's defaults
// are taken from there, and a test checks every Python default against them.
// To add an option: one line in its list, its use in engine/trainer.cc, in Python the
// argument it comes from (python/shmgrad/_client.py, GRADIENT_OPTION_SOURCES) where a user
// gives it, and its test.

// cuda_library's default is gpu::CudaLibrary::defaultPath().
#define SHMGRAD_ATTACH_OPTIONS_FIELDS(X)                                             \
  X(double, timeout_seconds, 30, "wait this long for the engine to exist and serve") \
  X(bool, lease, true, "false: a read-only observer (status), no gradients")         \
  X(std::string, cuda_library, "",                                                   \
    "an engine with devices: the libshmgrad_cuda.so to load where "                  \
    "$SHMGRAD_CUDA_LIBRARY does not say (empty: the package's)")
struct AttachOptions {
  SHMGRAD_ATTACH_OPTIONS_FIELDS(SHMGRAD_DECLARE_OPTION)
};

// What the docs of the list below leave out:
// - sum_through_mean: with mean false, the sum still, but computed through the batch's mean
//   (workers backpropagate it, the reducers multiply by B; ipc::Reduction::kSumThroughMean),
//   so float16 with a loss_scale overflows where backward of the mean would. What a node of
//   several asks for when the mean is over the global count, taken after the all-reduce.
// - loss_scale: workers backpropagate the loss times this (a GradScaler's scale, as its
//   scale(loss).backward() does): the reduced gradient is loss_scale times the gradient,
//   overflowing to inf where the scale is too large.
// - seed, train: eager workers draw each example i after seeding with example_seed(seed, i).
// - average_buffers: false is DDP's rule (the first participant's buffers).
// - accumulate (ipc::Accumulate): the reduction writes the buffer that does not hold the
//   previous result; prev_count: with mean, the count the previous result is the mean over.
#define SHMGRAD_GRADIENT_OPTIONS_FIELDS(X)                                                \
  X(bool, mean, false, "the reduced gradient of the mean instead of the sum")             \
  X(bool, sum_through_mean, false, "with mean false: the sum, computed through the mean") \
  X(double, timeout_seconds, 600, "the whole call, retries included")                     \
  X(int, max_retries, 3, "re-runs of a step that lost a worker")                          \
  X(int64_t, min_examples_per_worker, 1, "fewer workers take part in a small batch")      \
  X(int64_t, max_examples_per_pass, 0, ">0: workers process their shard in passes")       \
  X(bool, raise_on_nonfinite, false, "a NaN/inf loss or gradient raises NonFinite")       \
  X(float, loss_scale, 1.0f, "workers backpropagate the loss times this (finite, > 0)")   \
  X(uint64_t, seed, 0, "eager workers: the step's seed")                                  \
  X(bool, train, true, "eager workers: the model runs in train mode")                     \
  X(bool, average_buffers, true,                                                          \
    "shared buffers (BatchNorm statistics) after the step: the participants' average "    \
    "weighted by their examples, or the first participant's")                             \
  X(::shmgrad::ipc::Accumulate, accumulate, ::shmgrad::ipc::Accumulate::kFresh,           \
    "add to the previous result instead of replacing it (ipc::Accumulate)")               \
  X(double, prev_count, 0, "with mean and accumulate: the count the previous result is over")
struct GradientOptions {
  SHMGRAD_GRADIENT_OPTIONS_FIELDS(SHMGRAD_DECLARE_OPTION)
};

// A gradient call's statistics, each record written once (ipc/record.h): the structs,
// their Python binding and shmgrad.GradientStats come from these lists.

// One participant of a step.
#define SHMGRAD_WORKER_STEP_STATS_FIELDS(X)                              \
  X(int, slot, "")                                                       \
  X(int64_t, examples, "")                                               \
  X(double, loss_sum, "")                                                \
  X(double, count, "its weight in a mean: examples, or forward's count") \
  X(double, compute_seconds, "forward + backward")                       \
  X(double, reduce_seconds, "its slice of the reduction")                \
  X(double, reduce_early_seconds,                                        \
    "bucketed: of reduce_seconds, done before the last worker computed") \
  X(double, wait_seconds, "waiting for the other workers after compute") \
  X(bool, nonfinite_loss, "")                                            \
  X(bool, nonfinite_grad, "")                                            \
  X(bool, nonfinite_sum, "its slice of the sum overflowed, slots finite")
struct WorkerStepStats {
  SHMGRAD_WORKER_STEP_STATS_FIELDS(SHMGRAD_DECLARE_FIELD)
};

// Where the wall time went, for accounting the fixed cost of a step (CLOCK_MONOTONIC,
// comparable across processes): wall = prepare + step + finish.
#define SHMGRAD_GRADIENT_STATS_FIELDS(X)                                                        \
  X(int64_t, num_examples, "")                                                                  \
  X(double, loss_sum, "")                                                                       \
  X(double, count, "the mean's denominator: num_examples, or forward's counts summed")          \
  X(double, loss, "loss_sum, or loss_sum / count with mean")                                    \
  X(double, wall_seconds, "this call, entry to return")                                         \
  X(double, prepare_seconds, "entry to publish: checks, batch copy, stale workers")             \
  X(double, step_seconds, "publish to the last reducer's done")                                 \
  X(double, wake_seconds, "publish to the last participant starting (wake-up latency)")         \
  X(double, finish_seconds, "done to return: the trainer's wake-up and collect")                \
  X(double, reduce_seconds, "the slowest worker's slice of the reduction")                      \
  X(int, retries, "re-runs after a worker died")                                                \
  X(double, param_sync_seconds, "engines on several GPUs: the parameters copied to the others") \
  X(bool, nonfinite, "NaN or infinity somewhere (see workers)")                                 \
  X(bool, placement_probing, "a step of the placement probe (workers auto), or of a recheck")   \
  X(std::vector<int>, unused_params,                                                            \
    "parameters (indices) no participant's backward reached: their gradient is zero")           \
  X(std::vector<::shmgrad::WorkerStepStats>, workers, "the workers that took part, in rank order")
struct GradientStats {
  SHMGRAD_GRADIENT_STATS_FIELDS(SHMGRAD_DECLARE_FIELD)
};

// How the steps place their cores (Trainer::placement(); engine/placement.h).
struct PlacementStatus {
  bool automatic = false;   // serve --workers auto: the trainer chooses
  std::string state;        // "fixed", "probing" or "chosen"
  uint32_t workers = 0;     // participants at most (0: every ready worker)
  uint32_t threads = 0;     // intra-op threads of each
  bool in_trainer = false;  // the trainer computes the steps itself (workers 0)
  struct Candidate {
    uint32_t workers, threads;
    double seconds_per_example;  // median of its timed steps (0: none yet)
    uint32_t samples;
    bool in_trainer;
  };
  std::vector<Candidate> probe;  // this trainer's probe, when it ran one
  std::string report;            // the probe in one line ("" without one)
  uint32_t rechecks = 0;         // times the watch ran the probe again (engine/placement.h)
};

struct ParamInfo {
  std::string name;
  std::vector<int64_t> shape;
  int64_t numel = 0;
  ipc::MemoryFormat memory_format = ipc::MemoryFormat::kContiguous;  // its views' order
};

class Trainer {
 public:
  // Attaches to engine `name`, waiting up to options.timeout_seconds for it to serve.
  // Throws Error(kNotFound) if it never appears, Error(kBusy) naming the holder's pid
  // if another live trainer holds it.
  static std::unique_ptr<Trainer> attach(const std::string& name,
                                         const AttachOptions& options = {});
  ~Trainer();
  Trainer(const Trainer&) = delete;
  Trainer& operator=(const Trainer&) = delete;

  const std::string& name() const { return name_; }
  const std::vector<ParamInfo>& parameters() const { return params_; }
  // Tensors aliasing the engine's shared parameters (writes are seen by every worker)
  // and its reduced gradient. They keep the mapping alive while they exist. For an
  // engine with devices they are CUDA tensors on its first device (device()), over
  // memory the coordinator frees when it stops: copy what must outlive the engine.
  std::vector<torch::Tensor> parameterViews() const;
  std::vector<torch::Tensor> gradientViews() const;
  // The whole parameter buffer and the whole reduced gradient as one flat float32
  // tensor each (padding between tensors included, always zero in the gradient): one
  // contiguous buffer for a collective (all-reduce, broadcast) or a checksum.
  torch::Tensor parameterBuffer() const;
  // The model's shared buffers (BatchNorm statistics: float32 and int64), by name in the
  // model's order: after each step they hold the participants' values averaged by their
  // examples (the float ones; the batch count the first's), or the first participant's
  // (GradientOptions::average_buffers false, DDP's rule). Bind
  // a module's buffers to them so that it evaluates with the workers' statistics.
  std::vector<std::pair<std::string, torch::Tensor>> bufferViews() const;
  // The shared buffers' region as one byte tensor, and views of the buffers over `block`, a
  // byte tensor laid out as that region (on a GPU trainer's device): one copy moves them.
  torch::Tensor bufferBlock() const;
  std::vector<torch::Tensor> bufferViewsOf(const torch::Tensor& block) const;
  torch::Tensor gradientBuffer() const;
  // The second reduced gradient, which accumulating steps alternate with the first
  // (GradientOptions::accumulate), as per-parameter views.
  std::vector<torch::Tensor> accumulatorViews() const;
  // The CUDA device the views are on, or -1 (a CPU engine).
  int device() const;
  // Whether this trainer's views are of the engine's device memory (mapped through CUDA
  // IPC until the last of them is gone), whatever kind of tensor they are.
  bool onDevice() const;
  int64_t datasetSize() const;
  int workerCount() const;  // worker processes ready now
  // How steps place their cores (engine/placement.h): `workers` participants at most (0:
  // every ready worker) with `threads` intra-op threads each (0: the engine's
  // threads_per_worker), or with in_trainer (workers 0) this trainer computing each step
  // itself (setInTrainer first). Fixed from now on: ends a probe (serve --workers auto).
  void setPlacement(uint32_t workers, uint32_t threads, bool in_trainer = false);
  // Runs step `epoch` in this process, in the engine's trainer slot (ipc::trainerSlot):
  // the step protocol's participant side (worker::StepParticipant::runStep) with the
  // job's compute, on `threads` intra-op threads. Given by a trainer that can run the
  // engine's job (the Python client, for an eager job): the in-trainer placement becomes
  // possible, and a probe that has not begun also times it. Needs an engine with a
  // trainer slot (serve --workers auto, eager, on the host). `batch`: a step of explicit
  // inputs and targets reads them where this trainer holds them, not copied into the
  // request region (pass it to StepParticipant::runStep, or ScriptInTrainer::run).
  using InTrainerStep =
      std::function<void(uint32_t epoch, uint32_t threads, const ipc::LocalBatch& batch)>;
  void setInTrainer(InTrainerStep step);
  bool hasTrainerSlot() const;
  PlacementStatus placement() const;
  // What the job's loss returns for a batch: "sum", "mean", "weighted" ((loss_sum, count),
  // a mean over the count) or "unknown" (an eager job whose workers have not computed
  // yet). GradientOptions::mean is what takes the mean; a trainer that wants what
  // loss.backward() gives sets it for anything but "sum".
  std::string lossReduction() const;
  // Physical cores this trainer counts when it decides whether a step's processes may
  // spin before sleeping (every participant's threads + the trainer <= cores).
  uint32_t cores() const { return cores_; }
  // How long the last step's wait for its end could spin (0: it slept at once).
  uint64_t awaitSpinNs() const { return await_spin_ns_; }
  int slotCount() const;

  // The gradient of the loss summed (or averaged) over dataset[indices] into the
  // reduced gradient. Blocks until every worker has finished its slice of the
  // reduction, a worker reports an error (Error(kWorkerFailed) with its message), or
  // the timeout passes (Error(kTimeout)). indices: 1-D int64 (or int32) tensor.
  GradientStats gradient(const torch::Tensor& indices, const GradientOptions& options = {});
  // The same for an explicit batch: inputs [B, ...] (float), targets [B] (int64 class
  // labels) or [B, ...] (float, for mse).
  GradientStats gradient(const torch::Tensor& inputs, const torch::Tensor& targets,
                         const GradientOptions& options = {});

  // The same for a structured batch (eager workers): `leaves`, the batch's tensors, each
  // [B, ...] with the same B, any dtype of ipc::LeafType, and `structure`, how they nest
  // (a string the eager workers parse, shorter than ipc::kStructureLen).
  GradientStats gradient(const std::vector<torch::Tensor>& leaves, const std::string& structure,
                         const GradientOptions& options = {});

  // Releases the lease and unmaps (views made earlier keep their mapping alive).
  void close();
  bool closed() const { return seg_ == nullptr; }
  ipc::Segment& segment() const;
  int coordinatorPid() const;

 private:
  Trainer(std::string name, std::shared_ptr<ipc::Segment> seg, const AttachOptions& options);

  // The step protocol's trainer side, in phases (docs/DESIGN.md): run() picks the
  // participants, publishes, awaits, and collects, or aborts (ipc::abortStep) and retries.
  struct Participants {
    uint32_t n = 0;
    uint8_t slots[ipc::kMaxWorkers];  // rank order
    int32_t pids[ipc::kMaxWorkers];   // their pids when picked: a change means the worker was lost
  };
  enum class Outcome { kDone, kLostWorker, kTimedOut, kEngineGone };
  GradientStats run(int64_t batch, const GradientOptions& options, uint32_t kind, uint64_t start,
                    uint64_t deadline);
  Participants pickParticipants(int64_t batch, const GradientOptions& options,
                                uint64_t deadline) const;
  uint32_t publish(int64_t batch, const GradientOptions& options, uint32_t kind,
                   const Participants& participants);
  Outcome await(uint32_t epoch, const Participants& participants, uint64_t deadline);
  void collect(uint32_t epoch, const Participants& participants, int64_t batch,
               const GradientOptions& options, GradientStats* stats) const;
  void checkStepOptions(const GradientOptions& options) const;
  uint64_t deadlineFor(const GradientOptions& options) const;
  bool serving() const;
  std::string goneOnDevice() const;
  void waitIdle(uint64_t deadline_ns);
  void checkUsable() const;
  std::vector<torch::Tensor> views(float* base) const;
  torch::Tensor flatView(float* base) const;
  std::shared_ptr<gpu::EngineMemory> openMemory(const std::string& cuda_library);
  void startPlacement();
  void notePlacement();

  std::string name_;
  std::shared_ptr<ipc::Segment> seg_;
  // Where the parameters and gradients are: the segment's, or the devices' (a trainer
  // holding the lease; an observer needs no device).
  std::shared_ptr<gpu::EngineMemory> mem_;
  bool lease_;
  bool dirty_ = true;           // a previous step may have left stale workers running
  uint32_t cores_ = 1;          // CPUs this process may run on (sched_getaffinity)
  uint64_t spin_ns_ = 0;        // spin budget for steps whose processes all have a core
  uint64_t await_spin_ns_ = 0;  // this step's: every participant thread and the trainer fit
  // The bucketed reduction's cuts (ipc::bucketCuts, SHMGRAD_BUCKET_KB), used by fresh steps
  // of two or more participants on the host; 0 buckets: none.
  uint64_t bucket_cuts_[ipc::kMaxBuckets + 1] = {};
  uint32_t num_buckets_ = 0;
  std::unique_ptr<ipc::AdaptiveSpin> await_spin_;  // how long spinning for a step's end pays
  std::vector<ParamInfo> params_;
  // The placement steps use, and the probe choosing it (serve --workers auto) until done.
  engine::Placement placement_;
  std::unique_ptr<engine::PlacementProbe> probe_;
  InTrainerStep in_trainer_;  // setInTrainer's (empty: this trainer cannot compute)
  // The explicit batch of the step being run (gradient(inputs, targets)), held here until a
  // step's participants are known: copied into the request region once for workers, read
  // where it lies by the in-trainer placement. Empty outside that call.
  struct ExplicitBatch {
    ipc::LocalBatch local;
    uint64_t in_bytes = 0, tg_bytes = 0;
    // A structured batch: leaf k's bytes, and where they go in the input region.
    uint32_t num_leaves = 0;
    uint64_t leaf_offset[ipc::kMaxLeaves] = {};
    uint64_t leaf_bytes[ipc::kMaxLeaves] = {};
    bool copied = false;
  } batch_;
  void copyBatchForWorkers();
  // The probe's last step, timed when the next one starts (start 0: none to time).
  struct ProbedStep {
    uint64_t start = 0;
    int64_t examples = 0;
    bool timed = false;
  } probe_last_;
  std::string placement_report_;  // a probe ended early by setPlacement
  // The last step's participants (pid by slot, 0: not one), valid when it finished: a step
  // that takes another worker wakes the idle ones (ControlBlock::idle_wake).
  int32_t last_pids_[ipc::kMaxWorkers] = {};
  bool last_step_known_ = false;
};

}  // namespace shmgrad
