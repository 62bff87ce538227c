#include "worker/worker_loop.h"

#include <malloc.h>
#include <signal.h>
#include <sys/prctl.h>
#include <unistd.h>
#include <torch/csrc/jit/runtime/graph_executor.h>
#include <torch/torch.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>

#include "ipc/barrier.h"
#include "ipc/error.h"
#include "ipc/futex.h"
#include "ipc/reduce.h"
#include "ipc/segment.h"
#include "worker/replica.h"

namespace shmgrad::worker {
namespace {

using ipc::SegmentHeader;
using ipc::WorkerRecord;
using ipc::WorkerState;

constexpr auto kIdleSlice = std::chrono::milliseconds(200);
constexpr uint64_t kBarrierTimeoutNs = 3600ull * 1000000000ull;  // the trainer's own timeout ends a step sooner

void setError(WorkerRecord& me, const std::string& text) {
  me.error = 1;
  std::snprintf(me.error_text, ipc::kErrorLen, "%s", text.c_str());
}

class WorkerProcess {
 public:
  WorkerProcess(const WorkerOptions& o, std::unique_ptr<ipc::Segment> seg)
      : opt_(o), seg_(std::move(seg)), h_(seg_->header()), c_(h_->control),
        me_(h_->workers[o.slot]) {}

  int run() {
    std::unique_ptr<Replica> replica;
    try {
      replica = std::make_unique<Replica>(*seg_, opt_.slot);
      bindDataset();
    } catch (const std::exception& e) {
      setError(me_, std::string("worker start-up failed: ") + e.what());
      std::fprintf(stderr, "shmgrad worker %u: %s\n", opt_.slot, e.what());
      return 3;
    }
    replica_ = replica.get();
    me_.busy_epoch.store(0);
    // starting -> ready, unless a shrink retired this slot while we loaded the model:
    // a plain store would overwrite `retired` and leave a worker beyond the target.
    uint32_t starting = static_cast<uint32_t>(WorkerState::kStarting);
    if (!me_.state.compare_exchange_strong(starting, static_cast<uint32_t>(WorkerState::kReady),
                                           std::memory_order_acq_rel)) {
      return 0;
    }
    wakeCoordinator();

    // A step is ours when step_epoch == assigned_epoch (the trainer stores the latter
    // first). Comparing the two, rather than waiting for step_epoch to change from a
    // value read at start-up, means a step published right after this worker became
    // ready is not missed.
    // Between steps only memory is read; getppid() (a system call) runs only after an
    // idle slice passed with no step.
    uint32_t last = 0;
    bool idle_timeout = true;
    for (;;) {
      me_.heartbeat_ns.store(ipc::monotonicNs(), std::memory_order_relaxed);
      if (stopRequested() || (idle_timeout && shouldExit())) return exit_code_;
      const uint32_t cur = c_.step_epoch.load(std::memory_order_acquire);
      if (cur != last && me_.assigned_epoch.load(std::memory_order_acquire) == cur) {
        last = cur;
        step(cur);
        idle_timeout = false;
        continue;
      }
      idle_timeout = !ipc::futexWait(&c_.step_epoch, cur, kIdleSlice);
    }
  }

 private:
  // stopRequested(), or the coordinator died (PDEATHSIG backs this up). getppid() is a
  // system call: the idle loop calls this only after a slice with no step.
  bool shouldExit() {
    if (stopRequested()) return true;
    if (getppid() != opt_.parent_pid) {
      exit_code_ = 2;
      return true;
    }
    return false;
  }

  bool stopRequested() {
    if (c_.stop_requested.load(std::memory_order_acquire) != 0 ||
        c_.engine_state.load() == static_cast<uint32_t>(ipc::EngineState::kStopping) ||
        me_.state.load(std::memory_order_acquire) == static_cast<uint32_t>(WorkerState::kRetired)) {
      exit_code_ = 0;
      return true;
    }
    return false;
  }

  bool engineGone() {
    return c_.stop_requested.load(std::memory_order_acquire) != 0 ||
           getppid() != opt_.parent_pid;
  }

  void wakeCoordinator() {
    c_.coordinator_wake.fetch_add(1, std::memory_order_acq_rel);
    ipc::futexWake(&c_.coordinator_wake);
  }

  void bindDataset() {
    if (h_->data_count <= 0) return;
    std::vector<int64_t> in_shape{h_->data_count};
    in_shape.insert(in_shape.end(), h_->data_example_shape.dims,
                    h_->data_example_shape.dims + h_->data_example_shape.ndim);
    std::vector<int64_t> tg_shape{h_->data_count};
    tg_shape.insert(tg_shape.end(), h_->data_target_shape.dims,
                    h_->data_target_shape.dims + h_->data_target_shape.ndim);
    data_inputs_ = torch::from_blob(seg_->region<float>(h_->data_inputs), in_shape,
                                    torch::TensorOptions().dtype(torch::kFloat32));
    auto tdtype = h_->data_target_dtype == static_cast<uint32_t>(ipc::DType::kInt64) ? torch::kInt64
                                                                                     : torch::kFloat32;
    data_targets_ = torch::from_blob(seg_->region<uint8_t>(h_->data_targets), tg_shape,
                                     torch::TensorOptions().dtype(tdtype));
  }

  // Builds this shard's inputs and targets. Every size read from the request is
  // checked against the region it points into.
  void shardTensors(const ipc::StepRequest& r, int64_t lo, int64_t hi, torch::Tensor* inputs,
                    torch::Tensor* targets) {
    const int64_t n = hi - lo;
    if (r.kind == static_cast<uint32_t>(ipc::BatchKind::kIndices)) {
      SHMGRAD_CHECK(h_->data_count > 0, ErrorKind::kInvalidArgument,
                    "this engine has no dataset: pass inputs and targets, or start it with --dataset");
      const int64_t* idx = seg_->region<int64_t>(h_->req_indices) + lo;
      for (int64_t i = 0; i < n; ++i) {
        SHMGRAD_CHECK(idx[i] >= 0 && idx[i] < h_->data_count, ErrorKind::kInvalidArgument,
                      "index ", idx[i], " is out of range for the dataset of ", h_->data_count,
                      " examples");
      }
      auto it = torch::from_blob(const_cast<int64_t*>(idx), {n}, torch::kInt64);
      *inputs = data_inputs_.index_select(0, it);
      *targets = data_targets_.index_select(0, it);
      return;
    }
    SHMGRAD_CHECK(r.kind == static_cast<uint32_t>(ipc::BatchKind::kExplicit), ErrorKind::kCorrupt,
                  "step request has unknown batch kind ", r.kind);
    SHMGRAD_CHECK(r.example_shape.ndim <= ipc::kMaxDims && r.target_shape.ndim <= ipc::kMaxDims,
                  ErrorKind::kCorrupt, "step request: bad ndim");
    uint64_t in_numel = 1, tg_numel = 1;
    for (uint32_t i = 0; i < r.example_shape.ndim; ++i) {
      SHMGRAD_CHECK(r.example_shape.dims[i] >= 0 && r.example_shape.dims[i] < (1 << 30),
                    ErrorKind::kCorrupt, "step request: bad input shape");
      in_numel *= static_cast<uint64_t>(r.example_shape.dims[i]);
    }
    for (uint32_t i = 0; i < r.target_shape.ndim; ++i) {
      SHMGRAD_CHECK(r.target_shape.dims[i] >= 0 && r.target_shape.dims[i] < (1 << 30),
                    ErrorKind::kCorrupt, "step request: bad target shape");
      tg_numel *= static_cast<uint64_t>(r.target_shape.dims[i]);
    }
    const bool tg_i64 = r.target_dtype == static_cast<uint32_t>(ipc::DType::kInt64);
    const uint64_t tsize = tg_i64 ? 8 : 4;
    const uint64_t B = static_cast<uint64_t>(r.num_examples);
    SHMGRAD_CHECK(in_numel == 0 || B <= h_->req_inputs.size / (in_numel * 4), ErrorKind::kCorrupt,
                  "step request: inputs larger than the input region");
    SHMGRAD_CHECK(tg_numel == 0 || B <= h_->req_targets.size / (tg_numel * tsize),
                  ErrorKind::kCorrupt, "step request: targets larger than the target region");
    std::vector<int64_t> in_shape{n}, tg_shape{n};
    in_shape.insert(in_shape.end(), r.example_shape.dims, r.example_shape.dims + r.example_shape.ndim);
    tg_shape.insert(tg_shape.end(), r.target_shape.dims, r.target_shape.dims + r.target_shape.ndim);
    float* in = seg_->region<float>(h_->req_inputs) + static_cast<uint64_t>(lo) * in_numel;
    uint8_t* tg = seg_->region<uint8_t>(h_->req_targets) + static_cast<uint64_t>(lo) * tg_numel * tsize;
    *inputs = torch::from_blob(in, in_shape, torch::kFloat32);
    *targets = torch::from_blob(tg, tg_shape, tg_i64 ? torch::kInt64 : torch::kFloat32);
  }

  void step(uint32_t e) {
    me_.busy_epoch.store(e, std::memory_order_release);
    const ipc::StepRequest& r = h_->request;
    const uint32_t n = r.num_participants;
    const uint32_t rank = me_.assigned_rank.load(std::memory_order_acquire);
    const uint64_t t0 = ipc::monotonicNs();
    me_.error = 0;
    me_.error_text[0] = '\0';
    me_.examples = 0;
    me_.loss_sum = 0;
    me_.nonfinite_loss = 0;
    me_.nonfinite_grad.store(0, std::memory_order_relaxed);
    me_.reduce_ns = 0;
    me_.barrier_wait_ns = 0;
    bool valid = n >= 1 && n <= h_->num_slots && rank < n && r.num_examples >= 1 &&
                 r.num_examples <= h_->max_batch && r.epoch == e;
    for (uint32_t k = 0; valid && k < n; ++k) valid = r.participants[k] < h_->num_slots;
    if (!valid) {
      setError(me_, "corrupt step request (participants, rank or batch size out of range)");
    } else {
      const int64_t B = r.num_examples;
      const int64_t lo = B * rank / n, hi = B * (rank + 1) / n;
      me_.examples = hi - lo;
      try {
        replica_->zeroGrad();
        if (hi > lo) {
          torch::Tensor inputs, targets;
          shardTensors(r, lo, hi, &inputs, &targets);
          // Passes bound the activation memory of a large shard; the gradient of the
          // sum accumulates in the slot across passes.
          const int64_t pass = r.max_examples_per_pass > 0 ? r.max_examples_per_pass : (hi - lo);
          double loss = 0;
          for (int64_t s = 0; s < hi - lo; s += pass) {
            int64_t len = std::min(pass, hi - lo - s);
            loss += replica_->accumulate(inputs.narrow(0, s, len), targets.narrow(0, s, len));
          }
          me_.loss_sum = loss;
          me_.nonfinite_loss = std::isfinite(loss) ? 0 : 1;
        }
      } catch (const std::exception& ex) {
        setError(me_, ex.what());
      }
    }
    const uint64_t t1 = ipc::monotonicNs();
    me_.compute_ns = t1 - t0;
    me_.result_epoch = e;

    // Barrier 1: every participant's slot is complete before anyone reads it.
    if (!valid || !barrier(c_.compute_barrier, e, n)) return finish();
    const uint64_t t2 = ipc::monotonicNs();

    uint64_t b, end;
    ipc::sliceBounds(h_->param_floats, n, rank, &b, &end);
    const float* ins[ipc::kMaxWorkers];
    for (uint32_t k = 0; k < n; ++k) ins[k] = seg_->slot(r.participants[k]);
    float* out = seg_->reduced();
    ipc::reduceSlice(out, ins, n, b, end, r.scale);
    if (ipc::anyNonFinite(out, b, end)) {
      // Name the culprits: whose slot holds the non-finite values in this slice.
      for (uint32_t k = 0; k < n; ++k) {
        if (ipc::anyNonFinite(ins[k], b, end)) {
          h_->workers[r.participants[k]].nonfinite_grad.store(1, std::memory_order_relaxed);
        }
      }
    }
    const uint64_t t3 = ipc::monotonicNs();
    me_.reduce_ns = t3 - t2;
    me_.barrier_wait_ns = t2 - t1;

    // Barrier 2: the last to finish its slice completes the step.
    uint32_t count = ipc::arriveBarrier(c_.reduce_barrier, e);
    if (count == n) completeStep(e, n);
    finish();
  }

  // Arrives and waits for all n participants. False if the step was aborted.
  bool barrier(std::atomic<uint32_t>& word, uint32_t e, uint32_t n) {
    // A retiring worker finishes its step; only a stop or the coordinator's death ends
    // the wait early.
    return ipc::barrierWait(word, e, n, c_.abort_epoch, ipc::monotonicNs() + kBarrierTimeoutNs,
                            [&] { return !engineGone(); });
  }

  void completeStep(uint32_t e, uint32_t n) {
    const ipc::StepRequest& r = h_->request;
    ipc::StepRecord rec{};
    rec.epoch = e;
    rec.workers = n;
    rec.examples = r.num_examples;
    for (uint32_t k = 0; k < n; ++k) {
      const WorkerRecord& w = h_->workers[r.participants[k]];
      rec.loss_sum += w.loss_sum;
      rec.compute_max_ns = std::max(rec.compute_max_ns, w.compute_ns);
      rec.reduce_max_ns = std::max(rec.reduce_max_ns, w.reduce_ns);
    }
    uint64_t now = ipc::monotonicNs();
    rec.wall_ns = now > r.publish_ns ? now - r.publish_ns : 0;
    uint64_t busy = rec.compute_max_ns + rec.reduce_max_ns;
    rec.wait_ns = rec.wall_ns > busy ? rec.wall_ns - busy : 0;
    uint64_t served = c_.steps_served.load(std::memory_order_relaxed);
    h_->stats[served % ipc::kStatsRing] = rec;
    c_.steps_served.store(served + 1, std::memory_order_release);
    c_.done_epoch.store(e, std::memory_order_release);
    c_.trainer_wake.fetch_add(1, std::memory_order_acq_rel);
    ipc::futexWake(&c_.trainer_wake);
  }

  void finish() { me_.busy_epoch.store(0, std::memory_order_release); }

  WorkerOptions opt_;
  std::unique_ptr<ipc::Segment> seg_;
  SegmentHeader* h_;
  ipc::ControlBlock& c_;
  WorkerRecord& me_;
  Replica* replica_ = nullptr;
  torch::Tensor data_inputs_, data_targets_;
  int exit_code_ = 0;
};

}  // namespace

int runWorker(const WorkerOptions& o) {
  // Die with the coordinator; the getppid() check in the loop covers the race where
  // it died before this line ran.
  prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (getppid() != o.parent_pid) return 2;
  std::unique_ptr<ipc::Segment> seg;
  try {
    seg = ipc::Segment::open(o.engine_name);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "shmgrad worker %u: cannot map the engine segment: %s\n", o.slot, e.what());
    return 3;
  }
  if (o.slot >= seg->header()->num_slots) {
    std::fprintf(stderr, "shmgrad worker: slot %u out of range\n", o.slot);
    return 3;
  }
  // libtorch has no caching allocator on the CPU: every step frees and re-allocates its
  // activations. glibc would hand large freed blocks back to the kernel (brk, munmap) and
  // fault them in again, zeroed, on the next step: system calls and page faults in the
  // hot path. Keep freed memory in the heap instead; the worker then holds its peak
  // step memory (bounded by max_examples_per_pass), as a caching allocator would.
  mallopt(M_MMAP_MAX, 0);
  mallopt(M_TRIM_THRESHOLD, std::numeric_limits<int>::max());
  mallopt(M_TOP_PAD, 16 << 20);
  // Run the TorchScript graph as it is, with eager autograd per op, instead of letting
  // the profiling executor rewrite it into differentiable subgraphs: on the CPU (no
  // fuser) the rewrite only adds work. Interleaved A/B on 2 vCPUs, median step wall:
  // 4-13% faster (MLP, CNN, WRN; docs/BENCHMARKS.md).
  torch::jit::setGraphExecutorOptimize(false);
  const uint32_t threads = std::max<uint32_t>(1, seg->header()->threads_per_worker);
  torch::set_num_threads(static_cast<int>(threads));
  try {
    torch::set_num_interop_threads(1);
  } catch (...) {
    // Already set: harmless.
  }
  WorkerProcess w(o, std::move(seg));
  return w.run();
}

}  // namespace shmgrad::worker
