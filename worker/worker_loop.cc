#include "worker/worker_loop.h"

#include <malloc.h>
#include <signal.h>
#include <sys/prctl.h>
#include <unistd.h>
#include <torch/csrc/jit/runtime/graph_executor.h>
#include <torch/torch.h>

#include <cstdio>
#include <limits>

#include "ipc/error.h"
#include "ipc/segment.h"
#include "worker/buffer_views.h"
#include "worker/replica.h"
#include "worker/step_protocol.h"

namespace shmgrad::worker {
namespace {

// The compute phase of a TorchScript worker: the replica's forward, built-in loss and
// backward over the shard, in passes. Everything else is StepParticipant's.
class ScriptShardComputer : public ShardComputer {
 public:
  ScriptShardComputer(const ipc::Segment& seg, Replica& replica) : seg_(seg), replica_(replica) {
    bindDataset();
  }

  double compute(const Shard& s) override {
    replica_.bindGradients(s.grads);  // a no-op unless the buffer changed
    replica_.loadBuffers();
    if (replica_.module().is_training() != s.train) replica_.module().train(s.train);
    torch::Tensor inputs, targets;
    shardTensors(s, &inputs, &targets);
    // Passes bound the activation memory of a large shard; the gradient of the sum
    // accumulates in the slot across passes.
    const int64_t n = s.size();
    const int64_t pass = s.max_examples_per_pass > 0 ? s.max_examples_per_pass : n;
    double loss = 0;
    for (int64_t b = 0; b < n; b += pass) {
      const int64_t len = std::min(pass, n - b);
      loss += replica_.accumulate(inputs.narrow(0, b, len), targets.narrow(0, b, len),
                                  s.grad_scale);
    }
    return loss;
  }

  void publishBuffers() override { replica_.publishBuffers(); }

 private:
  void bindDataset() {
    const ipc::SegmentHeader* h = seg_.header();
    if (h->data_count <= 0) return;
    std::vector<int64_t> in_shape{h->data_count};
    in_shape.insert(in_shape.end(), h->data_example_shape.dims,
                    h->data_example_shape.dims + h->data_example_shape.ndim);
    std::vector<int64_t> tg_shape{h->data_count};
    tg_shape.insert(tg_shape.end(), h->data_target_shape.dims,
                    h->data_target_shape.dims + h->data_target_shape.ndim);
    data_inputs_ = torch::from_blob(seg_.region<float>(h->data_inputs), in_shape, torch::kFloat32);
    data_targets_ = torch::from_blob(seg_.region<uint8_t>(h->data_targets), tg_shape,
                                     torchType(static_cast<ipc::DType>(h->data_target_dtype)));
  }

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
    *inputs = examplesView(s.inputs, n, *s.example_shape, s.input_dtype);
    *targets = examplesView(s.targets, n, *s.target_shape, s.target_dtype);
  }


  const ipc::Segment& seg_;
  Replica& replica_;
  torch::Tensor data_inputs_, data_targets_;
};

// libtorch has no caching allocator on the CPU: every step frees and re-allocates its
// activations. glibc would hand large freed blocks back to the kernel (brk, munmap) and
// fault them in again, zeroed, on the next step: system calls and page faults in the hot
// path. Keep freed memory in the heap instead; the worker then holds its peak step
// memory (bounded by max_examples_per_pass), as a caching allocator would.
constexpr int kHeapTopPad = 16 << 20;
void keepFreedMemory() {
  mallopt(M_MMAP_MAX, 0);
  mallopt(M_TRIM_THRESHOLD, std::numeric_limits<int>::max());
  mallopt(M_TOP_PAD, kHeapTopPad);
}

void configureTorch(uint32_t threads) {
  // Run the TorchScript graph as it is, with eager autograd per op, instead of letting
  // the profiling executor rewrite it into differentiable subgraphs: on the CPU (no
  // fuser) the rewrite only adds work. Interleaved A/B on 2 vCPUs, median step wall:
  // 4-13% faster (MLP, CNN, WRN; docs/BENCHMARKS.md).
  torch::jit::setGraphExecutorOptimize(false);
  torch::set_num_threads(static_cast<int>(std::max<uint32_t>(1, threads)));
  try {
    torch::set_num_interop_threads(1);
  } catch (const std::exception&) {
    // Already set (the pool started): harmless.
  }
}

}  // namespace

int runWorker(const WorkerOptions& o) {
  std::unique_ptr<ipc::Segment> seg;
  try {
    // Die with the coordinator; the getppid() check covers the race in which it died
    // before this line ran.
    SHMGRAD_SYSCHECK(prctl(PR_SET_PDEATHSIG, SIGKILL), "prctl(PR_SET_PDEATHSIG)");
    if (getppid() != o.parent_pid) return kExitCoordinatorGone;
    seg = ipc::Segment::open(o.engine_name);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "shmgrad worker %u: cannot map the engine segment: %s\n", o.slot, e.what());
    return kExitStartupFailed;
  }
  std::unique_ptr<StepParticipant> participant;
  std::unique_ptr<Replica> replica;
  std::unique_ptr<ScriptShardComputer> computer;
  try {
    participant = std::make_unique<StepParticipant>(*seg, o.slot, o.parent_pid);
    keepFreedMemory();
    configureTorch(seg->header()->threads_per_worker);
    replica = std::make_unique<Replica>(*seg, o.slot);
    computer = std::make_unique<ScriptShardComputer>(*seg, *replica);
  } catch (const std::exception& e) {
    if (participant) participant->reportStartupFailure(std::string("worker start-up failed: ") + e.what());
    std::fprintf(stderr, "shmgrad worker %u: %s\n", o.slot, e.what());
    return kExitStartupFailed;
  }
  if (!participant->becomeReady()) return kExitStopped;  // retired while starting
  return participant->serve(*computer);
}

}  // namespace shmgrad::worker
