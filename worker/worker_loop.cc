#include "worker/worker_loop.h"

#include <dlfcn.h>
#include <malloc.h>
#include <signal.h>
#include <sys/prctl.h>
#include <unistd.h>
#include <torch/csrc/jit/runtime/graph_executor.h>
#include <torch/torch.h>

#include <cerrno>
#include <cstdio>
#include <limits>
#include <tuple>

#include "ipc/error.h"
#include "ipc/segment.h"
#include "views/segment_views.h"
#include "worker/grad_hooks.h"
#include "worker/process.h"
#include "worker/replica.h"
#include "worker/step_protocol.h"

namespace shmgrad::worker {

using views::datasetViews;
using views::examplesView;
namespace {

// The compute phase of a TorchScript worker: the replica's forward, built-in loss and
// backward over one pass of the shard. Everything else is StepParticipant's.
// in_trainer: the trainer's own compute (ScriptInTrainer::run sets the threads around each
// step instead of the shard's placement setting them for good).
class ScriptShardComputer : public ShardComputer {
 public:
  ScriptShardComputer(const ipc::Segment& seg, Replica& replica, StepParticipant& participant,
                      bool in_trainer = false)
      : seg_(seg),
        replica_(replica),
        participant_(participant),
        threads_(seg.header()->threads_per_worker),
        in_trainer_(in_trainer) {
    bindDataset();
    hooks_.watch(participant, replica.parameters());  // buckets reduced as backward goes
  }

  void beginShard(const Shard& s) override {
    if (!in_trainer_) threads_.apply(s.threads);
    replica_.bindGradients(s.grads);  // a no-op unless the buffer changed
    replica_.noteGradVersions();
    replica_.loadBuffers();
    if (replica_.module().is_training() != s.train) replica_.module().train(s.train);
    shardTensors(s, &inputs_, &targets_);
  }

  PassResult computePass(const Shard& s, int64_t begin, int64_t end) override {
    // A loss by name is a sum over the examples: each counts once in a mean.
    // Its linear layers' gradients straight into .grad (worker/direct_linear.h).
    DirectLinearScope direct(&participant_, &replica_.directIndex());
    return {replica_.accumulate(inputs_.narrow(0, begin, end - begin),
                                targets_.narrow(0, begin, end - begin), s.grad_scale),
            static_cast<double>(end - begin)};
  }

  void publishBuffers(uint8_t* dst) override { replica_.publishBuffers(dst); }

  void markGradParams(uint64_t* bits, uint32_t /*num_params*/) override {
    replica_.markGradParams(bits);
  }

 private:
  void bindDataset() { std::tie(data_inputs_, data_targets_) = datasetViews(seg_); }

  // The shard's batch as tensors over the segment (explicit) or gathered from the
  // dataset (indices). Shapes live on the stack: the engine's own code allocates nothing.
  void shardTensors(const Shard& s, torch::Tensor* inputs, torch::Tensor* targets) const {
    const int64_t n = s.size();
    if (s.kind == ipc::BatchKind::kIndices) {
      auto idx = torch::from_blob(const_cast<int64_t*>(s.indices), {n}, torch::kInt64);
      *inputs = data_inputs_.index_select(0, idx);
      *targets = data_targets_.index_select(0, idx);
      return;
    }
    SHMGRAD_CHECK(s.kind == ipc::BatchKind::kExplicit, ErrorKind::kInvalidArgument,
                  "TorchScript workers take inputs and targets, not a structured batch (batch=): "
                  "start the engine with eager workers (mode='eager' and forward=)");
    *inputs = examplesView(s.inputs, n, *s.example_shape, s.input_dtype);
    *targets = examplesView(s.targets, n, *s.target_shape, s.target_dtype);
  }

  const ipc::Segment& seg_;
  Replica& replica_;
  StepParticipant& participant_;
  torch::Tensor data_inputs_, data_targets_;
  torch::Tensor inputs_, targets_;  // the current shard's batch
  worker::StepThreads threads_;     // the placement's threads per step
  const bool in_trainer_;
  GradReadyHooks hooks_;
};

// libtorch's CUDA half. Workers link torch_cpu only, so that a CPU engine's workers load
// no CUDA library; a worker on a device loads it, which registers torch's CUDA kernels.
void loadTorchCuda(int device) {
  if (dlopen("libtorch_cuda.so", RTLD_NOW | RTLD_GLOBAL) == nullptr) {
    raise(ErrorKind::kNotFound,
          "a worker on a GPU needs libtorch_cuda.so, from a CUDA build of torch (", dlerror(),
          "); install torch with CUDA, or serve without devices");
  }
  // Loaded, but torch must see it: a CUDA stub cached before the load would leave the
  // model's tensors on the CPU, silently.
  const int64_t seen = static_cast<int64_t>(torch::cuda::device_count());
  SHMGRAD_CHECK(torch::cuda::is_available() && device < seen, ErrorKind::kInvalidArgument,
                "libtorch_cuda.so is loaded, but torch sees ", seen,
                " CUDA device(s) and this worker computes on cuda:", device,
                ": torch's CUDA state was set up before the load; reinstall shmgrad against a "
                "CUDA build of torch");
}

void configureTorch(uint32_t threads) {
  // Run the TorchScript graph as it is, with eager autograd per op, instead of letting
  // the profiling executor rewrite it into differentiable subgraphs: on the CPU (no
  // fuser) the rewrite only adds work (docs/DESIGN.md, "Processes", says how much).
  torch::jit::setGraphExecutorOptimize(false);
  configureThreads(threads);
}

}  // namespace

int runWorker(const WorkerOptions& o) {
  std::unique_ptr<ipc::Segment> seg;
  try {
    if (!dieWithParent(o.parent_pid)) return kExitCoordinatorGone;
    seg = ipc::Segment::open(o.engine_name);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "shmgrad worker %u: cannot map the engine segment: %s\n", o.slot,
                 e.what());
    return kExitStartupFailed;
  }
  std::unique_ptr<StepParticipant> participant;
  std::unique_ptr<Replica> replica;
  std::unique_ptr<ScriptShardComputer> computer;
  try {
    participant = std::make_unique<StepParticipant>(*seg, o.slot, o.parent_pid);
    keepFreedMemory();
    configureTorch(seg->header()->threads_per_worker);
    applyNumerics(seg->header()->control.numerics);  // the trainer's, where it said
    const gpu::EngineMemory& memory = participant->memory();
    const int device = memory.tensorDevice(memory.ordinal(o.slot));
    if (device >= 0) loadTorchCuda(device);
    replica = std::make_unique<Replica>(*seg, o.slot, memory);
    computer = std::make_unique<ScriptShardComputer>(*seg, *replica, *participant);
  } catch (const std::exception& e) {
    if (participant)
      participant->reportStartupFailure(std::string("worker start-up failed: ") + e.what());
    std::fprintf(stderr, "shmgrad worker %u: %s\n", o.slot, e.what());
    return kExitStartupFailed;
  }
  if (!participant->becomeReady()) return kExitStopped;  // retired while starting
  return participant->serve(*computer);
}

struct ScriptInTrainer::State {
  std::unique_ptr<ipc::Segment> seg;
  std::unique_ptr<StepParticipant> participant;
  std::unique_ptr<Replica> replica;
  std::unique_ptr<ScriptShardComputer> computer;  // last: its hooks go before the replica
};

ScriptInTrainer::ScriptInTrainer(const std::string& engine_name, int coordinator_pid)
    : state_(std::make_unique<State>()) {
  State& s = *state_;
  s.seg = ipc::Segment::open(engine_name);
  const ipc::SegmentHeader* h = s.seg->header();
  SHMGRAD_CHECK(h->worker_kind == static_cast<uint32_t>(ipc::WorkerKind::kScript),
                ErrorKind::kInvalidArgument, "engine '", engine_name,
                "' runs eager workers: its trainer computes through the job "
                "(python/shmgrad/_in_trainer.py)");
  SHMGRAD_CHECK(h->trainer_slots == 1, ErrorKind::kInvalidArgument, "engine '", engine_name,
                "' has no trainer slot: only an engine served with --workers auto on the host "
                "lets its trainer compute");
  const uint32_t slot = ipc::trainerSlot(*h);
  s.participant = std::make_unique<StepParticipant>(*s.seg, slot, coordinator_pid);
  s.replica = std::make_unique<Replica>(*s.seg, slot, s.participant->memory());
  s.computer = std::make_unique<ScriptShardComputer>(*s.seg, *s.replica, *s.participant, true);
}

ScriptInTrainer::~ScriptInTrainer() = default;

void ScriptInTrainer::run(uint32_t epoch, uint32_t threads, const ipc::LocalBatch& batch) {
  // As the worker runs its graph (configureTorch), for this thread and this call only: the
  // trainer's own TorchScript keeps torch's setting.
  torch::jit::GraphOptimizerEnabledGuard plain(false);
  withIntraOpThreads(threads,
                     [&] { state_->participant->runStep(epoch, *state_->computer, batch); });
}

}  // namespace shmgrad::worker
