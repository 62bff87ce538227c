#include "engine/trainer.h"

#include <unistd.h>
#include <torch/torch.h>

#include <cmath>
#include <cstring>
#include <thread>

#include "ipc/error.h"
#include "ipc/futex.h"
#include "ipc/segment.h"

namespace shmgrad {

using ipc::WorkerState;

namespace {

// Memory reads only (no system call on the step's hot path): the coordinator marks a
// dead worker within a wait slice, and run() watches its participants while it waits.
bool isReady(const ipc::WorkerRecord& w) {
  return w.state.load(std::memory_order_acquire) == static_cast<uint32_t>(WorkerState::kReady) &&
         w.pid.load(std::memory_order_acquire) > 0;
}

std::string shapeText(c10::IntArrayRef s) {
  std::ostringstream os;
  os << s;
  return os.str();
}

}  // namespace

std::unique_ptr<Trainer> Trainer::attach(const std::string& name, const AttachOptions& o) {
  ipc::checkEngineName(name);
  const uint64_t deadline = ipc::monotonicNs() + static_cast<uint64_t>(o.timeout_seconds * 1e9);
  std::shared_ptr<ipc::Segment> seg;
  for (;;) {
    try {
      seg = ipc::Segment::open(name);
      const bool alive = ipc::processAlive(seg->header()->coordinator_pid);
      if (alive && seg->header()->control.engine_state.load() ==
                       static_cast<uint32_t>(ipc::EngineState::kServing)) {
        break;
      }
      // Starting, or left by a dead coordinator (a new `serve` may be replacing it).
      SHMGRAD_CHECK(alive || ipc::monotonicNs() < deadline, ErrorKind::kNotFound, "engine '",
                    name, "' is not running: its coordinator (pid ",
                    seg->header()->coordinator_pid,
                    ") is gone; start it again with shmgrad serve (the stale segment is "
                    "removed then)");
      seg.reset();
    } catch (const Error& e) {
      // Not there yet, or its header is still being written: retry until the deadline.
      if (e.kind() != ErrorKind::kNotFound && e.kind() != ErrorKind::kCorrupt) throw;
      if (ipc::monotonicNs() >= deadline) throw;
    }
    SHMGRAD_CHECK(ipc::monotonicNs() < deadline, ErrorKind::kTimeout, "engine '", name,
                  "' did not start serving within ", o.timeout_seconds, " s");
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  if (o.lease) {
    auto& c = seg->header()->control;
    const int32_t me = getpid();
    for (;;) {
      int32_t holder = c.trainer_pid.load(std::memory_order_acquire);
      if (holder == me) break;
      if (holder != 0) {
        SHMGRAD_CHECK(!ipc::processAlive(holder), ErrorKind::kBusy, "engine '", name,
                      "' is busy: trainer pid ", holder,
                      " holds it; one trainer attaches at a time (close that one first)");
      }
      if (c.trainer_pid.compare_exchange_strong(holder, me, std::memory_order_acq_rel)) break;
    }
  }
  return std::unique_ptr<Trainer>(new Trainer(name, std::move(seg), o.lease));
}

Trainer::Trainer(std::string name, std::shared_ptr<ipc::Segment> seg, bool lease)
    : name_(std::move(name)), seg_(std::move(seg)), lease_(lease) {
  const ipc::ParamEntry* table = seg_->paramTable();
  for (uint32_t i = 0; i < seg_->header()->num_params; ++i) {
    ParamInfo p;
    p.name = table[i].name;
    p.shape.assign(table[i].shape.dims, table[i].shape.dims + table[i].shape.ndim);
    p.numel = static_cast<int64_t>(table[i].numel);
    params_.push_back(std::move(p));
  }
}

Trainer::~Trainer() { close(); }

void Trainer::close() {
  if (!seg_) return;
  if (lease_) {
    int32_t me = getpid();
    seg_->header()->control.trainer_pid.compare_exchange_strong(me, 0);
  }
  seg_.reset();
}

void Trainer::checkUsable() const {
  SHMGRAD_CHECK(seg_ != nullptr, ErrorKind::kInvalidArgument,
                "this trainer is closed; attach again with Trainer::attach");
}

ipc::Segment& Trainer::segment() const {
  checkUsable();
  return *seg_;
}

int Trainer::coordinatorPid() const { return segment().header()->coordinator_pid; }

// Tensors over one of the parameter-shaped buffers; each holds the mapping alive.
std::vector<torch::Tensor> Trainer::views(float* base) const {
  std::vector<torch::Tensor> out;
  auto keep = seg_;
  const ipc::ParamEntry* table = seg_->paramTable();
  for (size_t i = 0; i < params_.size(); ++i) {
    out.push_back(torch::from_blob(base + table[i].offset, params_[i].shape, [keep](void*) {},
                                   torch::kFloat32));
  }
  return out;
}

std::vector<torch::Tensor> Trainer::parameterViews() const {
  checkUsable();
  return views(seg_->params());
}

std::vector<torch::Tensor> Trainer::gradientViews() const {
  checkUsable();
  return views(seg_->reduced());
}

int64_t Trainer::datasetSize() const { return segment().header()->data_count; }

int Trainer::slotCount() const { return static_cast<int>(segment().header()->num_slots); }

int Trainer::workerCount() const {
  const ipc::SegmentHeader* h = segment().header();
  int n = 0;
  for (uint32_t i = 0; i < h->num_slots; ++i) n += isReady(h->workers[i]) ? 1 : 0;
  return n;
}

GradientStats Trainer::gradient(const torch::Tensor& indices, const GradientOptions& o) {
  checkUsable();
  ipc::SegmentHeader* h = seg_->header();
  SHMGRAD_CHECK(lease_, ErrorKind::kInvalidArgument, "this trainer attached without a lease");
  SHMGRAD_CHECK(h->data_count > 0, ErrorKind::kInvalidArgument, "engine '", name_,
                "' has no dataset: pass inputs and targets, or start it with --dataset");
  SHMGRAD_CHECK(indices.defined() && indices.dim() == 1, ErrorKind::kInvalidArgument,
                "indices must be a 1-D tensor of dataset positions, got shape ",
                indices.defined() ? shapeText(indices.sizes()) : std::string("None"));
  SHMGRAD_CHECK(indices.scalar_type() == torch::kInt64 || indices.scalar_type() == torch::kInt32,
                ErrorKind::kInvalidArgument, "indices must be int64 or int32, got ",
                indices.scalar_type());
  const int64_t B = indices.size(0);
  SHMGRAD_CHECK(B >= 1, ErrorKind::kInvalidArgument, "empty batch: give at least one index");
  SHMGRAD_CHECK(B <= h->max_batch, ErrorKind::kInvalidArgument, "batch of ", B,
                " examples exceeds the engine's --max-batch ", h->max_batch,
                "; split it or restart the engine with a larger --max-batch");
  torch::Tensor idx = indices.to(torch::kCPU, torch::kInt64).contiguous();
  const int64_t* src = idx.data_ptr<int64_t>();
  for (int64_t i = 0; i < B; ++i) {
    SHMGRAD_CHECK(src[i] >= 0 && src[i] < h->data_count, ErrorKind::kInvalidArgument, "index ",
                  src[i], " at position ", i, " is out of range: the dataset has ", h->data_count,
                  " examples (valid: 0 to ", h->data_count - 1, ")");
  }
  waitIdle(ipc::monotonicNs() + 10000000000ull);
  std::memcpy(seg_->region<int64_t>(h->req_indices), src, B * sizeof(int64_t));
  return run(B, o, static_cast<uint32_t>(ipc::BatchKind::kIndices));
}

GradientStats Trainer::gradient(const torch::Tensor& inputs, const torch::Tensor& targets,
                                const GradientOptions& o) {
  checkUsable();
  ipc::SegmentHeader* h = seg_->header();
  SHMGRAD_CHECK(lease_, ErrorKind::kInvalidArgument, "this trainer attached without a lease");
  SHMGRAD_CHECK(inputs.defined() && targets.defined(), ErrorKind::kInvalidArgument,
                "give both inputs and targets");
  SHMGRAD_CHECK(inputs.dim() >= 1 && targets.dim() >= 1, ErrorKind::kInvalidArgument,
                "inputs and targets need a batch dimension; got shapes ", shapeText(inputs.sizes()),
                " and ", shapeText(targets.sizes()));
  const int64_t B = inputs.size(0);
  SHMGRAD_CHECK(B >= 1, ErrorKind::kInvalidArgument, "empty batch: inputs have 0 examples");
  SHMGRAD_CHECK(targets.size(0) == B, ErrorKind::kInvalidArgument, "inputs have ", B,
                " examples but targets have ", targets.size(0), "; give one target per input");
  SHMGRAD_CHECK(inputs.dim() - 1 <= static_cast<int64_t>(ipc::kMaxDims) &&
                    targets.dim() - 1 <= static_cast<int64_t>(ipc::kMaxDims),
                ErrorKind::kInvalidArgument, "too many dimensions");
  SHMGRAD_CHECK(inputs.is_floating_point(), ErrorKind::kInvalidArgument,
                "inputs must be a floating-point tensor, got ", inputs.scalar_type());
  SHMGRAD_CHECK(B <= h->max_batch, ErrorKind::kInvalidArgument, "batch of ", B,
                " examples exceeds the engine's --max-batch ", h->max_batch);
  const auto loss = static_cast<ipc::LossKind>(h->loss);
  torch::Tensor x = inputs.to(torch::kCPU, torch::kFloat32).contiguous();
  torch::Tensor y;
  if (loss == ipc::LossKind::kMse) {
    SHMGRAD_CHECK(targets.is_floating_point(), ErrorKind::kInvalidArgument,
                  "mse needs floating-point targets, got ", targets.scalar_type());
    y = targets.to(torch::kCPU, torch::kFloat32).contiguous();
  } else {
    SHMGRAD_CHECK(!targets.is_floating_point() && !targets.is_complex(),
                  ErrorKind::kInvalidArgument,
                  "cross_entropy and nll need integer class labels as targets, got ",
                  targets.scalar_type(), " (convert with targets.long())");
    y = targets.to(torch::kCPU, torch::kInt64).contiguous();
  }
  const uint64_t in_bytes = static_cast<uint64_t>(x.numel()) * 4;
  const uint64_t tg_bytes = static_cast<uint64_t>(y.numel()) * y.element_size();
  SHMGRAD_CHECK(in_bytes <= h->req_inputs.size, ErrorKind::kInvalidArgument, "inputs of ",
                in_bytes, " bytes exceed the engine's input capacity of ", h->req_inputs.size,
                " bytes; split the batch or restart with a larger --input-capacity-mb");
  SHMGRAD_CHECK(tg_bytes <= h->req_targets.size, ErrorKind::kInvalidArgument, "targets of ",
                tg_bytes, " bytes exceed the engine's target capacity of ", h->req_targets.size);
  waitIdle(ipc::monotonicNs() + 10000000000ull);
  std::memcpy(seg_->region<float>(h->req_inputs), x.data_ptr<float>(), in_bytes);
  std::memcpy(seg_->region<uint8_t>(h->req_targets), y.data_ptr(), tg_bytes);
  ipc::StepRequest& r = h->request;
  std::memset(&r.example_shape, 0, sizeof(r.example_shape));
  std::memset(&r.target_shape, 0, sizeof(r.target_shape));
  r.input_dtype = static_cast<uint32_t>(ipc::DType::kFloat32);
  r.example_shape.ndim = static_cast<uint32_t>(x.dim() - 1);
  for (int64_t d = 1; d < x.dim(); ++d) r.example_shape.dims[d - 1] = x.size(d);
  r.target_dtype = static_cast<uint32_t>(y.scalar_type() == torch::kInt64 ? ipc::DType::kInt64
                                                                          : ipc::DType::kFloat32);
  r.target_shape.ndim = static_cast<uint32_t>(y.dim() - 1);
  for (int64_t d = 1; d < y.dim(); ++d) r.target_shape.dims[d - 1] = y.size(d);
  return run(B, o, static_cast<uint32_t>(ipc::BatchKind::kExplicit));
}

// After an aborted or timed-out step, workers of that step may still be computing.
// They never count in a later step's barriers (epoch tags), but they still read the
// request region: wait for them before it is overwritten.
void Trainer::waitIdle(uint64_t deadline_ns) {
  if (!dirty_) return;
  const ipc::SegmentHeader* h = seg_->header();
  for (;;) {
    bool busy = false;
    for (uint32_t i = 0; i < h->num_slots; ++i) {
      const auto& w = h->workers[i];
      if (w.busy_epoch.load(std::memory_order_acquire) != 0 && ipc::processAlive(w.pid.load())) busy = true;
    }
    if (!busy) break;
    SHMGRAD_CHECK(ipc::monotonicNs() < deadline_ns, ErrorKind::kTimeout, "engine '", name_,
                  "': workers still busy with an abandoned step; try again or restart the engine");
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  dirty_ = false;
}

GradientStats Trainer::run(int64_t B, const GradientOptions& o, uint32_t kind) {
  ipc::SegmentHeader* h = seg_->header();
  ipc::ControlBlock& c = h->control;
  ipc::StepRequest& r = h->request;
  SHMGRAD_CHECK(o.min_examples_per_worker >= 1, ErrorKind::kInvalidArgument,
                "min_examples_per_worker must be >= 1");
  SHMGRAD_CHECK(o.max_examples_per_pass >= 0, ErrorKind::kInvalidArgument,
                "max_examples_per_pass must be >= 0 (0: one pass)");
  SHMGRAD_CHECK(o.max_retries >= 0, ErrorKind::kInvalidArgument, "max_retries must be >= 0");
  const int32_t holder = c.trainer_pid.load();
  SHMGRAD_CHECK(holder == getpid(), ErrorKind::kBusy, "this trainer no longer holds engine '",
                name_, "' (held by pid ", holder, "); attach again");
  const uint64_t start = ipc::monotonicNs();
  const uint64_t deadline = start + static_cast<uint64_t>(o.timeout_seconds * 1e9);
  const int coordinator = h->coordinator_pid;
  GradientStats stats;
  for (int attempt = 0;; ++attempt) {
    SHMGRAD_CHECK(c.engine_state.load() == static_cast<uint32_t>(ipc::EngineState::kServing) &&
                      (attempt == 0 || ipc::processAlive(coordinator)),
                  ErrorKind::kNotFound, "engine '", name_, "' has stopped");
    // Participants: ready workers, at most one per min_examples_per_worker examples.
    uint8_t ready[ipc::kMaxWorkers];
    uint32_t nready = 0;
    while (nready == 0) {
      for (uint32_t i = 0; i < h->num_slots; ++i) {
        if (isReady(h->workers[i])) ready[nready++] = static_cast<uint8_t>(i);
      }
      if (nready > 0) break;
      // Every worker is being replaced: wait for one, within the deadline.
      SHMGRAD_CHECK(ipc::monotonicNs() < deadline, ErrorKind::kTimeout, "engine '", name_,
                    "' has no ready worker");
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    const int64_t by_size = std::max<int64_t>(1, B / o.min_examples_per_worker);
    const uint32_t n = static_cast<uint32_t>(std::min<int64_t>({nready, B, by_size}));
    uint32_t e = c.step_epoch.load() + 1;
    if ((e & 0xffffu) == 0) ++e;  // keep barrier tags and "idle" (0) apart
    r.epoch = e;
    r.kind = kind;
    r.num_examples = B;
    r.num_participants = n;
    r.reduction_scale_is_mean = o.mean ? 1 : 0;
    r.scale = o.mean ? static_cast<float>(1.0 / static_cast<double>(B)) : 1.0f;
    r.max_examples_per_pass = o.max_examples_per_pass;
    for (uint32_t k = 0; k < n; ++k) {
      r.participants[k] = ready[k];
      h->workers[ready[k]].assigned_rank.store(k, std::memory_order_relaxed);
      h->workers[ready[k]].assigned_epoch.store(e, std::memory_order_release);
    }
    c.compute_barrier.store(ipc::barrierTag(e), std::memory_order_relaxed);
    c.reduce_barrier.store(ipc::barrierTag(e), std::memory_order_relaxed);
    r.publish_ns = ipc::monotonicNs();
    c.step_epoch.store(e, std::memory_order_release);  // publishes everything above
    ipc::futexWake(&c.step_epoch);

    // A participant can die between being picked and the coordinator reaping it (a
    // zombie still looks alive), so the coordinator may never see it as part of this
    // step: check the participants' records in every wait slice (memory reads only).
    int32_t pids[ipc::kMaxWorkers];
    for (uint32_t k = 0; k < n; ++k) pids[k] = h->workers[r.participants[k]].pid.load();
    bool lost_worker = false;
    const bool finished = ipc::waitUntil(
        &c.trainer_wake,
        [&] {
          return c.done_epoch.load(std::memory_order_acquire) == e ||
                 c.abort_epoch.load(std::memory_order_acquire) == e;
        },
        [&] {
          for (uint32_t k = 0; k < n; ++k) {
            const ipc::WorkerRecord& w = h->workers[r.participants[k]];
            const uint32_t st = w.state.load();
            if (w.pid.load() != pids[k] || st == static_cast<uint32_t>(WorkerState::kDead) ||
                st == static_cast<uint32_t>(WorkerState::kExited)) {
              lost_worker = true;
              return false;
            }
          }
          return ipc::processAlive(coordinator) &&
                 c.engine_state.load() == static_cast<uint32_t>(ipc::EngineState::kServing);
        },
        deadline, std::chrono::milliseconds(100), /*spin=*/2000);
    if (!finished && lost_worker && c.done_epoch.load(std::memory_order_acquire) != e) {
      c.abort_epoch.store(e, std::memory_order_release);
      c.steps_aborted.fetch_add(1);
      ipc::futexWake(&c.compute_barrier);
      ipc::futexWake(&c.reduce_barrier);
    }
    if (c.done_epoch.load(std::memory_order_acquire) == e) {
      stats.num_examples = B;
      for (uint32_t k = 0; k < n; ++k) {
        const ipc::WorkerRecord& w = h->workers[r.participants[k]];
        SHMGRAD_CHECK(w.result_epoch == e, ErrorKind::kCorrupt, "worker ", int(r.participants[k]),
                      " reported a result for another step");
        if (w.error != 0) {
          char text[ipc::kErrorLen];
          std::memcpy(text, w.error_text, sizeof(text));
          text[ipc::kErrorLen - 1] = '\0';
          raise(ErrorKind::kWorkerFailed, "worker ", int(r.participants[k]),
                " could not compute its shard: ", text);
        }
        WorkerStepStats ws;
        ws.slot = r.participants[k];
        ws.examples = w.examples;
        ws.loss_sum = w.loss_sum;
        ws.compute_seconds = w.compute_ns / 1e9;
        ws.reduce_seconds = w.reduce_ns / 1e9;
        ws.wait_seconds = w.barrier_wait_ns / 1e9;
        ws.nonfinite_loss = w.nonfinite_loss != 0;
        ws.nonfinite_grad = w.nonfinite_grad.load() != 0;
        stats.nonfinite = stats.nonfinite || ws.nonfinite_loss || ws.nonfinite_grad;
        stats.loss_sum += ws.loss_sum;
        stats.reduce_seconds = std::max(stats.reduce_seconds, ws.reduce_seconds);
        stats.workers.push_back(ws);
      }
      stats.loss = o.mean ? stats.loss_sum / static_cast<double>(B) : stats.loss_sum;
      stats.wall_seconds = (ipc::monotonicNs() - start) / 1e9;
      if (stats.nonfinite && o.raise_on_nonfinite) {
        std::ostringstream os;
        for (const auto& w : stats.workers) {
          if (w.nonfinite_loss || w.nonfinite_grad) {
            os << " worker " << w.slot << (w.nonfinite_loss ? " (loss)" : "")
               << (w.nonfinite_grad ? " (gradient)" : "");
          }
        }
        raise(ErrorKind::kNonFinite, "non-finite values in the step:", os.str());
      }
      return stats;
    }
    // Aborted (a worker died), timed out, or the engine went away.
    dirty_ = true;
    if (!finished && !lost_worker) {
      c.abort_epoch.store(e, std::memory_order_release);
      ipc::futexWake(&c.compute_barrier);
      ipc::futexWake(&c.reduce_barrier);
      SHMGRAD_CHECK(ipc::processAlive(coordinator), ErrorKind::kNotFound, "engine '", name_,
                    "' stopped during the step");
      SHMGRAD_CHECK(c.engine_state.load() == static_cast<uint32_t>(ipc::EngineState::kServing),
                    ErrorKind::kNotFound, "engine '", name_, "' is stopping");
      raise(ErrorKind::kTimeout, "engine '", name_, "': the step did not finish within ",
            o.timeout_seconds, " s (timeout_seconds); the engine keeps serving");
    }
    SHMGRAD_CHECK(attempt < o.max_retries, ErrorKind::kWorkerFailed, "engine '", name_,
                  "': a worker died during this batch ", attempt + 1,
                  " times (does the model crash on this input?); the engine keeps serving");
    ++stats.retries;
    c.step_retries.fetch_add(1);
    waitIdle(deadline);
  }
}

}  // namespace shmgrad
