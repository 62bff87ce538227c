#include "engine/trainer.h"

#include <sched.h>
#include <unistd.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <iterator>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <thread>

#include "ipc/config.h"
#include "engine/placement.h"
#include "engine/step_results.h"
#include "gpu/engine_memory.h"
#include "ipc/device_table.h"
#include "ipc/error.h"
#include "ipc/layout.h"
#include "ipc/futex.h"
#include "ipc/reduce.h"
#include "ipc/segment.h"
#include "ipc/step.h"
#include "views/segment_views.h"

namespace shmgrad {

using ipc::WorkerState;

namespace {

// Tunables of the trainer's waits (every wait is also bounded by the call's timeout).
constexpr auto kAwaitSlice = std::chrono::milliseconds(100);  // liveness checks while a step runs
// How long the trainer and the participants of a step spin before they sleep on a futex,
// when every one of them has a core (StepRequest::spin_ns; at the barriers, when the
// participants have, StepRequest::barrier_spin_ns). Long enough to cover a short
// step's compute and the gap between two steps, so neither side pays a wake-up; bounded,
// so a long step costs a spare core for no longer than this: SHMGRAD_SPIN_US, whose
// default (1 ms) ipc/config.h's kTunables declares (0 disables spinning).
constexpr auto kIdlePoll = std::chrono::milliseconds(1);      // stale workers after an abort
constexpr auto kNoWorkerPoll = std::chrono::milliseconds(5);  // every worker being replaced
constexpr auto kAttachPoll = std::chrono::milliseconds(20);   // engine not serving yet

// `t` as a contiguous CPU tensor of type `type`: itself when it already is one (read from
// the tensor's own fields), else a converted copy. Going through the dispatcher for
// to() and contiguous() when nothing needs converting cost tens of microseconds per step
// with the caches cold after a long step.
// A tensor that requires grad is read like any other: converting it records nothing.
torch::Tensor cpuContiguous(const torch::Tensor& t, torch::ScalarType type) {
  if (t.device().is_cpu() && t.scalar_type() == type && t.is_contiguous()) return t;
  torch::NoGradGuard no_grad;
  return t.to(torch::kCPU, type).contiguous();
}

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
      SHMGRAD_CHECK(alive || ipc::monotonicNs() < deadline, ErrorKind::kNotFound, "engine '", name,
                    "' is not running: its coordinator (pid ", seg->header()->coordinator_pid,
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
    std::this_thread::sleep_for(kAttachPoll);
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
  return std::unique_ptr<Trainer>(new Trainer(name, std::move(seg), o));
}

Trainer::Trainer(std::string name, std::shared_ptr<ipc::Segment> seg, const AttachOptions& o)
    : name_(std::move(name)), seg_(std::move(seg)), lease_(o.lease) {
  cores_ = engine::physicalCores();
  await_spin_ = std::make_unique<ipc::AdaptiveSpin>();
  {
    const char* env = config::tunableValue("SHMGRAD_SPIN_US");  // the default, when unset
    double us = 0;
    SHMGRAD_CHECK(config::parseNumber(env, &us) && us >= 0 && us * 1000 <= ipc::kMaxSpinNs,
                  ErrorKind::kInvalidArgument, "SHMGRAD_SPIN_US='", env,
                  "' must be microseconds from 0 to ", ipc::kMaxSpinNs / 1000);
    spin_ns_ = static_cast<uint64_t>(us * 1000);
  }
  {
    const char* env = config::tunableValue("SHMGRAD_BUCKET_KB");
    double kb = 0;
    SHMGRAD_CHECK(config::parseNumber(env, &kb) && kb >= 0 && kb <= 1e9,
                  ErrorKind::kInvalidArgument, "SHMGRAD_BUCKET_KB='", env,
                  "' must be KiB from 0 (no buckets) to 1e9; unset it for the default");
    const ipc::SegmentHeader* h = seg_->header();
    num_buckets_ = ipc::bucketCuts(seg_->paramTable(), std::min(h->num_params, ipc::kMaxParams),
                                   h->param_floats, static_cast<uint64_t>(kb * 256), bucket_cuts_);
  }
  const ipc::ParamEntry* table = seg_->paramTable();
  for (uint32_t i = 0; i < seg_->header()->num_params; ++i) {
    ParamInfo p;
    p.name = table[i].name;
    p.shape.assign(table[i].shape.dims, table[i].shape.dims + table[i].shape.ndim);
    p.numel = static_cast<int64_t>(table[i].numel);
    p.memory_format = static_cast<ipc::MemoryFormat>(table[i].memory_format);  // checked
    params_.push_back(std::move(p));
  }
  if (lease_) {
    try {
      mem_ = openMemory(o.cuda_library);
    } catch (...) {
      close();  // the lease is released: nothing of the engine's is held
      throw;
    }
    startPlacement();
  }
}

// serve --workers auto: a placement chosen by an earlier trainer is kept; otherwise this
// one probes the candidates on its first steps (engine/placement.h).
void Trainer::startPlacement() {
  ipc::ControlBlock& c = seg_->header()->control;
  if (c.placement_auto.load(std::memory_order_acquire) != 1) return;
  const auto state = static_cast<ipc::PlacementState>(c.placement_state.load());
  const engine::Placement kept = {c.placement_workers.load(), c.placement_threads.load(),
                                  c.placement_in_trainer.load() == 1};
  // Chosen by a trainer before, or fixed by a resize (an engine nobody placed yet reads
  // fixed with zeros): kept. A probe a dead trainer left unfinished starts again. A
  // trainer that cannot compute (no setInTrainer yet: a C++ trainer, or the Python client
  // before it has loaded the job) uses every ready worker instead of the in-trainer one.
  if (state == ipc::PlacementState::kChosen ||
      (state == ipc::PlacementState::kFixed &&
       (kept.workers != 0 || kept.threads != 0 || kept.in_trainer))) {
    const bool usable = kept.threads <= ipc::kMaxThreadsPerWorker &&
                        kept.workers <= ipc::kMaxWorkers &&
                        (!kept.in_trainer || (in_trainer_ && kept.workers == 0));
    placement_ = usable ? kept : engine::Placement{};
    return;
  }
  engine::ProbeOptions options;
  options.rounds = config::kPlacementProbeRounds;
  options.min_samples = config::kPlacementMinSamples;
  options.budget_s = config::kPlacementProbeBudgetS;
  options.settle_s = config::kPlacementSettleS;
  options.timed_s = config::kPlacementTimedS;
  options.watch_samples = config::kPlacementWatchSamples;
  options.watch_s = config::kPlacementWatchS;
  options.recheck_margin = config::kPlacementRecheckMargin;
  options.slow_windows = config::kPlacementSlowWindows;
  options.max_rechecks = config::kPlacementMaxRechecks;
  std::vector<engine::Placement> candidates =
      engine::placementCandidates(cores_, seg_->header()->num_slots);
  // First: a tie goes to it, as the trainer's own threads are then all the process's
  // between steps too (the optimizer's step), which the probe does not time.
  if (in_trainer_) {
    candidates.insert(candidates.begin(),
                      engine::Placement{0, std::min(cores_, ipc::kMaxThreadsPerWorker), true});
  }
  probe_ = std::make_unique<engine::PlacementProbe>(std::move(candidates), options);
  notePlacement();
}

bool Trainer::hasTrainerSlot() const { return segment().header()->trainer_slots == 1; }

void Trainer::setInTrainer(InTrainerStep step) {
  checkUsable();
  SHMGRAD_CHECK(lease_, ErrorKind::kInvalidArgument, "an observer computes no steps");
  SHMGRAD_CHECK(hasTrainerSlot(), ErrorKind::kInvalidArgument, "engine '", name_,
                "' has no trainer slot: only an engine served with --workers auto on the host "
                "lets its trainer compute");
  SHMGRAD_CHECK(step != nullptr, ErrorKind::kInvalidArgument, "setInTrainer needs a step");
  in_trainer_ = std::move(step);
  ipc::WorkerRecord& w = seg_->header()->workers[ipc::trainerSlot(*seg_->header())];
  w.pid.store(getpid(), std::memory_order_release);
  w.state.store(static_cast<uint32_t>(WorkerState::kReady), std::memory_order_release);
  // A probe that has not timed a step starts again with the in-trainer candidate; a kept
  // in-trainer placement is usable now.
  if (probe_ == nullptr || !probe_->begun()) {
    probe_.reset();
    startPlacement();
  }
}

// The placement the next step uses, in the segment for status readers.
void Trainer::notePlacement() {
  ipc::ControlBlock& c = seg_->header()->control;
  ipc::PlacementState state = ipc::PlacementState::kFixed;
  if (probe_ != nullptr) {
    placement_ = probe_->next();
    state = probe_->done() ? ipc::PlacementState::kChosen : ipc::PlacementState::kProbing;
  }
  c.placement_workers.store(placement_.workers, std::memory_order_relaxed);
  c.placement_threads.store(placement_.threads, std::memory_order_relaxed);
  c.placement_in_trainer.store(placement_.in_trainer ? 1 : 0, std::memory_order_relaxed);
  c.placement_state.store(static_cast<uint32_t>(state), std::memory_order_release);
}

void Trainer::setPlacement(uint32_t workers, uint32_t threads, bool in_trainer) {
  checkUsable();
  SHMGRAD_CHECK(!in_trainer || (in_trainer_ && workers == 0), ErrorKind::kInvalidArgument,
                in_trainer_ ? "the in-trainer placement takes workers=0"
                            : "this trainer cannot compute steps itself (no in-trainer step: "
                              "an eager engine served with --workers auto, from Python)");
  SHMGRAD_CHECK(workers <= ipc::kMaxWorkers, ErrorKind::kInvalidArgument,
                "placement workers must be 0 (every ready worker) to ", ipc::kMaxWorkers, ", got ",
                workers);
  SHMGRAD_CHECK(threads <= ipc::kMaxThreadsPerWorker, ErrorKind::kInvalidArgument,
                "placement threads must be 0 (the engine's threads_per_worker) to ",
                ipc::kMaxThreadsPerWorker, ", got ", threads);
  if (probe_ != nullptr) placement_report_ = probe_->report() + " (ended by set_placement)";
  probe_.reset();
  placement_ = {workers, threads, in_trainer};
  notePlacement();
}

PlacementStatus Trainer::placement() const {
  PlacementStatus out;
  const ipc::ControlBlock& c = seg_->header()->control;
  out.automatic = c.placement_auto.load() == 1;
  out.state = ipc::placementStateName(static_cast<ipc::PlacementState>(c.placement_state.load()));
  out.workers = placement_.workers;
  out.threads = ipc::stepThreads(placement_.threads, seg_->header()->threads_per_worker);
  out.in_trainer = placement_.in_trainer;
  if (probe_ != nullptr) {
    for (const auto& r : probe_->results()) {
      out.probe.push_back({r.placement.workers, r.placement.threads, r.seconds_per_example,
                           r.samples, r.placement.in_trainer});
    }
    out.report = probe_->report();
    out.rechecks = probe_->rechecks();
  } else {
    out.report = placement_report_;
  }
  return out;
}

// The engine's step memory, as this trainer's views hold it. With devices, the segment
// says that this process maps their memory (device_trainer_pid) from before it opens them
// until the last view of them is gone, so that a stopping coordinator frees them only then.
std::shared_ptr<gpu::EngineMemory> Trainer::openMemory(const std::string& cuda_library) {
  ipc::ControlBlock& c = seg_->header()->control;
  // Read only to decide whether to say so; EngineMemory validates the table.
  const bool devices = seg_->region<ipc::DeviceTable>(seg_->header()->device)->count > 0;
  if (!devices) return std::make_shared<gpu::EngineMemory>(*seg_, cuda_library);
  const int32_t me = getpid();
  c.device_trainer_pid.store(me, std::memory_order_release);
  auto release = [seg = seg_, me] {  // says this process maps them no more
    int32_t expected = me;
    seg->header()->control.device_trainer_pid.compare_exchange_strong(expected, 0,
                                                                      std::memory_order_acq_rel);
  };
  try {
    return std::shared_ptr<gpu::EngineMemory>(new gpu::EngineMemory(*seg_, cuda_library),
                                              [release](gpu::EngineMemory* memory) {
                                                delete memory;  // closes this process's mappings
                                                release();
                                              });
  } catch (...) {
    release();
    throw;
  }
}

Trainer::~Trainer() { close(); }

void Trainer::close() {
  if (!seg_) return;
  if (lease_) {
    int32_t me = getpid();
    seg_->header()->control.trainer_pid.compare_exchange_strong(me, 0);
  }
  // The device memory stays mapped while views of it live (each holds it); once the last
  // is gone it is closed and the segment says so (openMemory).
  mem_.reset();
  seg_.reset();
  in_trainer_ = nullptr;
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

// Tensors over one of the parameter-shaped buffers; each holds the mapping (and, on a
// device, the opened device buffers) alive.
std::vector<torch::Tensor> Trainer::views(float* base) const {
  auto keep = seg_;
  auto mem = mem_;
  return views::parameterShapedViews(
      *seg_, base, [keep, mem](void*) {}, device());
}

torch::Tensor Trainer::flatView(float* base) const {
  auto keep = seg_;
  auto mem = mem_;
  return torch::from_blob(
      base, {static_cast<int64_t>(seg_->header()->param_floats)}, [keep, mem](void*) {},
      views::floatOptions(device()));
}

bool Trainer::onDevice() const { return mem_ != nullptr && mem_->onDevice(); }

int Trainer::device() const { return mem_ ? mem_->tensorDevice(mem_->trainerOrdinal()) : -1; }

// The memory views are made over: an observer (no lease) maps no device.
namespace {
const gpu::EngineMemory& usableMemory(const std::shared_ptr<gpu::EngineMemory>& mem) {
  SHMGRAD_CHECK(mem != nullptr, ErrorKind::kInvalidArgument,
                "an observer (attached with lease=false) has no parameter or gradient views; "
                "attach with the lease");
  return *mem;
}
}  // namespace

std::vector<torch::Tensor> Trainer::parameterViews() const {
  checkUsable();
  return views(usableMemory(mem_).trainerParams());
}

std::vector<torch::Tensor> Trainer::gradientViews() const {
  checkUsable();
  return views(usableMemory(mem_).reduced());
}

std::vector<torch::Tensor> Trainer::accumulatorViews() const {
  checkUsable();
  return views(usableMemory(mem_).accum());
}

torch::Tensor Trainer::parameterBuffer() const {
  checkUsable();
  return flatView(usableMemory(mem_).trainerParams());
}

torch::Tensor Trainer::bufferBlock() const {
  checkUsable();
  auto keep = seg_;
  return views::bufferBlockView(*seg_, [keep](void*) {});
}

std::vector<torch::Tensor> Trainer::bufferViewsOf(const torch::Tensor& block) const {
  checkUsable();
  return views::bufferViewsOf(*seg_, block);
}

std::vector<std::pair<std::string, torch::Tensor>> Trainer::bufferViews() const {
  checkUsable();
  auto keep = seg_;
  return views::sharedBufferViews(*seg_, [keep](void*) {});
}

torch::Tensor Trainer::gradientBuffer() const {
  checkUsable();
  return flatView(usableMemory(mem_).reduced());
}

int64_t Trainer::datasetSize() const { return segment().header()->data_count; }

std::string Trainer::lossReduction() const {
  return ipc::lossReductionName(segment().header()->control.loss_reduction.load());
}

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
  checkStepOptions(o);
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
  torch::Tensor idx = cpuContiguous(indices, torch::kInt64);
  const int64_t* src = idx.data_ptr<int64_t>();
  for (int64_t i = 0; i < B; ++i) {
    SHMGRAD_CHECK(src[i] >= 0 && src[i] < h->data_count, ErrorKind::kInvalidArgument, "index ",
                  src[i], " at position ", i, " is out of range: the dataset has ", h->data_count,
                  " examples (valid: 0 to ", h->data_count - 1, ")");
  }
  const uint64_t start = ipc::monotonicNs();
  const uint64_t deadline = deadlineFor(o);
  waitIdle(deadline);
  std::memcpy(seg_->region<int64_t>(h->req_indices), src, B * sizeof(int64_t));
  return run(B, o, static_cast<uint32_t>(ipc::BatchKind::kIndices), start, deadline);
}

namespace {
// The call's batch is forgotten when it returns, however it returns.
template <typename Batch>
struct Forget {
  Batch& b;
  ~Forget() { b = {}; }
};
}  // namespace

GradientStats Trainer::gradient(const torch::Tensor& inputs, const torch::Tensor& targets,
                                const GradientOptions& o) {
  checkUsable();
  ipc::SegmentHeader* h = seg_->header();
  SHMGRAD_CHECK(lease_, ErrorKind::kInvalidArgument, "this trainer attached without a lease");
  checkStepOptions(o);
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
  auto integral = [](const torch::Tensor& t) {
    return !t.is_floating_point() && !t.is_complex() && t.scalar_type() != torch::kBool;
  };
  SHMGRAD_CHECK(inputs.is_floating_point() || integral(inputs), ErrorKind::kInvalidArgument,
                "inputs must be floating-point (sent as float32) or integer (sent as int64, e.g. "
                "token ids), got ",
                inputs.scalar_type());
  SHMGRAD_CHECK(B <= h->max_batch, ErrorKind::kInvalidArgument, "batch of ", B,
                " examples exceeds the engine's --max-batch ", h->max_batch);
  // Inputs keep their kind: float32 for floating point, int64 for integers.
  const bool int_inputs = integral(inputs);
  torch::Tensor x = cpuContiguous(inputs, int_inputs ? torch::kInt64 : torch::kFloat32);
  torch::Tensor y;
  const bool eager = h->worker_kind == static_cast<uint32_t>(ipc::WorkerKind::kEager);
  const auto loss = static_cast<ipc::LossKind>(h->loss);
  if (eager) {
    // Any loss: targets keep their kind too.
    SHMGRAD_CHECK(targets.is_floating_point() || integral(targets), ErrorKind::kInvalidArgument,
                  "targets must be floating-point or integer, got ", targets.scalar_type());
    y = cpuContiguous(targets, integral(targets) ? torch::kInt64 : torch::kFloat32);
  } else if (loss == ipc::LossKind::kMse) {
    SHMGRAD_CHECK(targets.is_floating_point(), ErrorKind::kInvalidArgument,
                  "mse needs floating-point targets, got ", targets.scalar_type());
    y = cpuContiguous(targets, torch::kFloat32);
  } else {
    SHMGRAD_CHECK(integral(targets), ErrorKind::kInvalidArgument,
                  "cross_entropy and nll need integer class labels as targets, got ",
                  targets.scalar_type(), " (convert with targets.long())");
    y = cpuContiguous(targets, torch::kInt64);
  }
  const uint64_t in_bytes = static_cast<uint64_t>(x.numel()) * x.element_size();
  const uint64_t tg_bytes = static_cast<uint64_t>(y.numel()) * y.element_size();
  SHMGRAD_CHECK(in_bytes <= h->req_inputs.size, ErrorKind::kInvalidArgument, "inputs of ", in_bytes,
                " bytes exceed the engine's input capacity of ", h->req_inputs.size,
                " bytes; split the batch or restart with a larger --input-capacity-mb");
  SHMGRAD_CHECK(tg_bytes <= h->req_targets.size, ErrorKind::kInvalidArgument, "targets of ",
                tg_bytes, " bytes exceed the engine's target capacity of ", h->req_targets.size);
  const uint64_t start = ipc::monotonicNs();
  const uint64_t deadline = deadlineFor(o);
  waitIdle(deadline);
  ipc::StepRequest& r = h->request;
  std::memset(&r.example_shape, 0, sizeof(r.example_shape));
  std::memset(&r.target_shape, 0, sizeof(r.target_shape));
  r.input_dtype = static_cast<uint32_t>(int_inputs ? ipc::DType::kInt64 : ipc::DType::kFloat32);
  r.example_shape.ndim = static_cast<uint32_t>(x.dim() - 1);
  for (int64_t d = 1; d < x.dim(); ++d) r.example_shape.dims[d - 1] = x.size(d);
  r.target_dtype = static_cast<uint32_t>(y.scalar_type() == torch::kInt64 ? ipc::DType::kInt64
                                                                          : ipc::DType::kFloat32);
  r.target_shape.ndim = static_cast<uint32_t>(y.dim() - 1);
  for (int64_t d = 1; d < y.dim(); ++d) r.target_shape.dims[d - 1] = y.size(d);
  // x and y outlive the step: run() copies them for workers, or the trainer reads them.
  batch_.local.inputs = static_cast<const uint8_t*>(x.data_ptr());
  batch_.local.targets = static_cast<const uint8_t*>(y.data_ptr());
  batch_.in_bytes = in_bytes;
  batch_.tg_bytes = tg_bytes;
  Forget<ExplicitBatch> forget{batch_};
  return run(B, o, static_cast<uint32_t>(ipc::BatchKind::kExplicit), start, deadline);
}

// Workers read the batch in the request region: written there once per call, before the
// first step that a worker takes part in is published (after waitIdle: no worker of an
// earlier step still reads it).
void Trainer::copyBatchForWorkers() {
  // Nothing held (a step of dataset indices) or copied already (a re-run).
  if (batch_.copied || (batch_.local.inputs == nullptr && batch_.num_leaves == 0)) return;
  const ipc::SegmentHeader* h = seg_->header();
  uint8_t* inputs = seg_->region<uint8_t>(h->req_inputs);
  if (batch_.local.inputs != nullptr) {
    std::memcpy(inputs, batch_.local.inputs, batch_.in_bytes);
    std::memcpy(seg_->region<uint8_t>(h->req_targets), batch_.local.targets, batch_.tg_bytes);
  }
  for (uint32_t k = 0; k < batch_.num_leaves; ++k) {
    std::memcpy(inputs + batch_.leaf_offset[k], batch_.local.leaves[k], batch_.leaf_bytes[k]);
  }
  batch_.copied = true;
}

GradientStats Trainer::gradient(const std::vector<torch::Tensor>& leaves,
                                const std::string& structure, const GradientOptions& o) {
  checkUsable();
  ipc::SegmentHeader* h = seg_->header();
  SHMGRAD_CHECK(lease_, ErrorKind::kInvalidArgument, "this trainer attached without a lease");
  checkStepOptions(o);
  SHMGRAD_CHECK(h->worker_kind == static_cast<uint32_t>(ipc::WorkerKind::kEager),
                ErrorKind::kInvalidArgument,
                "a structured batch (batch=) needs eager workers: this engine runs TorchScript "
                "workers; give inputs= and targets=, or start it with mode='eager'");
  SHMGRAD_CHECK(!leaves.empty() && leaves.size() <= ipc::kMaxLeaves, ErrorKind::kInvalidArgument,
                "a batch holds 1 to ", ipc::kMaxLeaves, " tensors, got ", leaves.size());
  SHMGRAD_CHECK(structure.size() < ipc::kStructureLen, ErrorKind::kInvalidArgument,
                "the batch's structure takes ", structure.size(), " bytes to describe, over ",
                ipc::kStructureLen - 1, ": use fewer or shorter keys");
  const int64_t B = leaves[0].defined() && leaves[0].dim() > 0 ? leaves[0].size(0) : 0;
  std::vector<torch::Tensor> data;
  uint64_t offsets[ipc::kMaxLeaves];
  uint64_t pos = 0;
  for (size_t k = 0; k < leaves.size(); ++k) {
    const torch::Tensor& t = leaves[k];
    SHMGRAD_CHECK(
        t.defined() && t.dim() >= 1 && t.dim() <= ipc::kMaxDims + 1, ErrorKind::kInvalidArgument,
        "batch tensor ", k, " needs a first (batch) dimension and at most ", ipc::kMaxDims + 1,
        " dimensions, got shape ", t.defined() ? shapeText(t.sizes()) : std::string("None"));
    SHMGRAD_CHECK(t.size(0) == B, ErrorKind::kInvalidArgument, "batch tensor ", k, " has ",
                  t.size(0), " rows but the first has ", B,
                  ": every tensor of a batch has the examples along its first dimension");
    SHMGRAD_CHECK(views::leafTypeOf(t.scalar_type()) != 0, ErrorKind::kInvalidArgument,
                  "batch tensor ", k, " has dtype ", t.scalar_type(),
                  ", which shmgrad cannot carry (float32/64, float16, bfloat16, "
                  "int64/32/16/8, uint8, bool)");
    data.push_back(t.device().is_cpu() ? t.detach().contiguous() : t.detach().cpu().contiguous());
    offsets[k] = pos;
    pos = ipc::alignUp(pos + static_cast<uint64_t>(t.numel()) * t.element_size(), ipc::kAlign);
  }
  SHMGRAD_CHECK(B >= 1, ErrorKind::kInvalidArgument, "empty batch: give at least one example");
  SHMGRAD_CHECK(B <= h->max_batch, ErrorKind::kInvalidArgument, "batch of ", B,
                " examples exceeds the engine's --max-batch ", h->max_batch);
  SHMGRAD_CHECK(pos <= h->req_inputs.size, ErrorKind::kInvalidArgument, "the batch's ", pos,
                " bytes exceed the engine's input capacity of ", h->req_inputs.size,
                " bytes; split the batch or restart with a larger input_capacity_mb");
  const uint64_t start = ipc::monotonicNs();
  const uint64_t deadline = deadlineFor(o);
  waitIdle(deadline);
  ipc::StepRequest& r = h->request;
  // The leaves' data outlive the step (`data`): run() copies them for workers, or the
  // trainer reads them where they are.
  for (size_t k = 0; k < data.size(); ++k) {
    const torch::Tensor& t = data[k];
    batch_.local.leaves[k] = static_cast<const uint8_t*>(t.data_ptr());
    batch_.leaf_offset[k] = offsets[k];
    batch_.leaf_bytes[k] = static_cast<uint64_t>(t.numel()) * t.element_size();
    ipc::LeafEntry& leaf = r.leaves[k];
    std::memset(&leaf, 0, sizeof(leaf));
    leaf.type = views::leafTypeOf(t.scalar_type());
    leaf.example_shape.ndim = static_cast<uint32_t>(t.dim() - 1);
    for (int64_t d = 1; d < t.dim(); ++d) leaf.example_shape.dims[d - 1] = t.size(d);
    leaf.offset = offsets[k];
  }
  r.num_leaves = static_cast<uint32_t>(data.size());
  std::memcpy(r.structure, structure.c_str(), structure.size() + 1);
  batch_.num_leaves = r.num_leaves;
  Forget<ExplicitBatch> forget{batch_};
  return run(B, o, static_cast<uint32_t>(ipc::BatchKind::kStructured), start, deadline);
}

// After an aborted or timed-out step, or a previous trainer's death, workers of that step
// may still be computing. They never count in a later step's barriers (epoch tags), but
// they still read the request region: wait for them before it is overwritten. Bounded by
// the caller's deadline (the gradient call's timeout). At the deadline the trainer gives up
// on whatever step still holds them, as at a step's timeout: a worker hung in a step of a
// trainer that died, or a worker stopped in it, is replaced like one hung in this
// trainer's own step, so the next call does not wait for it forever.
void Trainer::waitIdle(uint64_t deadline_ns) {
  if (!dirty_) return;
  ipc::SegmentHeader* h = seg_->header();
  ipc::ControlBlock& c = h->control;
  for (;;) {
    // Busy with a step, or held up by one this trainer abandoned (the coordinator replaces
    // such a worker after a grace period): picked again, it would hold up the next one.
    const uint32_t abandoned = c.abandon_epoch.load(std::memory_order_acquire);
    bool busy = false;
    for (uint32_t i = 0; i < h->num_slots && !busy; ++i) {
      const auto& w = h->workers[i];
      busy = (w.busy_epoch.load(std::memory_order_acquire) != 0 ||
              ipc::heldByAbandoned(w, abandoned)) &&
             ipc::processAlive(w.pid.load());
    }
    if (!busy) break;
    if (ipc::monotonicNs() >= deadline_ns) {
      // Every step a worker can still be busy with or assigned to is the last published
      // one or older, and none of them is this call's: end the last (its healthy
      // participants leave its barriers) and abandon them all.
      const uint32_t last = c.step_epoch.load(std::memory_order_acquire);
      if (last != 0 && !ipc::stepEnded(c, last)) ipc::abortStep(c, last);
      c.abandon_epoch.store(last, std::memory_order_release);
      ipc::bumpAndWake(&c.coordinator_wake);
      ::shmgrad::raise(ErrorKind::kTimeout, "engine '", name_,
                       "': workers still busy with an earlier step (abandoned at a timeout, or "
                       "left by a trainer that died) after the call's timeout; the engine "
                       "replaces a worker still held up by such a step ",
                       ipc::kAbandonGraceNs / 1000000000,
                       " s after it is given up on: try again, with a larger timeout if the "
                       "workers are slow");
    }
    std::this_thread::sleep_for(kIdlePoll);
  }
  dirty_ = false;
}

void Trainer::checkStepOptions(const GradientOptions& o) const {
  SHMGRAD_CHECK(o.min_examples_per_worker >= 1, ErrorKind::kInvalidArgument,
                "min_examples_per_worker must be >= 1");
  SHMGRAD_CHECK(o.max_examples_per_pass >= 0, ErrorKind::kInvalidArgument,
                "max_examples_per_pass must be >= 0 (0: one pass)");
  SHMGRAD_CHECK(o.max_retries >= 0, ErrorKind::kInvalidArgument, "max_retries must be >= 0");
  SHMGRAD_CHECK(o.timeout_seconds > 0, ErrorKind::kInvalidArgument, "timeout must be > 0 seconds");
  SHMGRAD_CHECK(std::isfinite(o.prev_count) && o.prev_count >= 0, ErrorKind::kInvalidArgument,
                "prev_count must be a finite number >= 0");
  SHMGRAD_CHECK(std::isfinite(o.loss_scale) && o.loss_scale > 0, ErrorKind::kInvalidArgument,
                "loss_scale must be a finite number > 0, got ", o.loss_scale,
                " (1: no loss scaling; a GradScaler's scale otherwise)");
  SHMGRAD_CHECK(o.accumulate == ipc::Accumulate::kFresh ||
                    o.accumulate == ipc::Accumulate::kReducedToAccum ||
                    o.accumulate == ipc::Accumulate::kAccumToReduced,
                ErrorKind::kInvalidArgument, "unknown accumulate mode");
  const int32_t holder = seg_->header()->control.trainer_pid.load();
  SHMGRAD_CHECK(holder == getpid(), ErrorKind::kBusy, "this trainer no longer holds engine '",
                name_, "' (held by pid ", holder, "); attach again");
}

uint64_t Trainer::deadlineFor(const GradientOptions& o) const {
  return ipc::monotonicNs() + static_cast<uint64_t>(o.timeout_seconds * 1e9);
}

// What a stopped or dead engine with devices leaves this trainer: its views of the
// devices' memory, which the coordinator allocated and which went with it.
std::string Trainer::goneOnDevice() const {
  if (mem_ == nullptr || !mem_->onDevice()) return "";
  return "; its GPU memory, which the bound module's parameters and .grad are views of, "
         "went with it: their values are lost (restore the model and the optimizer from a "
         "checkpoint, start a new engine and bind again)";
}

bool Trainer::serving() const {
  return seg_->header()->control.engine_state.load(std::memory_order_acquire) ==
         static_cast<uint32_t>(ipc::EngineState::kServing);
}

// Phase 1: the participants. Ready workers, at most one per min_examples_per_worker
// examples and at most B. Waits (within the deadline) while every worker is being
// replaced.
Trainer::Participants Trainer::pickParticipants(int64_t B, const GradientOptions& o,
                                                uint64_t deadline) const {
  static_assert(sizeof(Participants::slots) == ipc::kMaxWorkers,
                "Participants holds one entry per possible worker");
  const ipc::SegmentHeader* h = seg_->header();
  Participants p;
  if (placement_.in_trainer && in_trainer_) {  // this process alone, in its slot
    p.n = 1;
    p.slots[0] = static_cast<uint8_t>(ipc::trainerSlot(*h));
    p.pids[0] = h->workers[p.slots[0]].pid.load(std::memory_order_acquire);
    return p;
  }
  for (;;) {
    for (uint32_t i = 0; i < h->num_slots; ++i) {
      const ipc::WorkerRecord& w = h->workers[i];
      if (isReady(w)) {
        p.slots[p.n] = static_cast<uint8_t>(i);
        p.pids[p.n] = w.pid.load(std::memory_order_acquire);
        ++p.n;
      }
    }
    if (p.n > 0) break;
    SHMGRAD_CHECK(ipc::monotonicNs() < deadline, ErrorKind::kTimeout, "engine '", name_,
                  "' has no ready worker");
    std::this_thread::sleep_for(kNoWorkerPoll);
  }
  const int64_t by_size = std::max<int64_t>(1, B / o.min_examples_per_worker);
  const int64_t placed = placement_.workers > 0 ? placement_.workers : p.n;
  p.n = static_cast<uint32_t>(std::min<int64_t>({p.n, B, by_size, placed}));
  return p;
}

// Phase 2: publish. Writes the request, assigns ranks, resets both barriers to the new
// epoch's tag, then stores step_epoch (release: publishes everything above) and wakes
// the workers. Returns the step's epoch.
uint32_t Trainer::publish(int64_t B, const GradientOptions& o, uint32_t kind,
                          const Participants& p) {
  ipc::SegmentHeader* h = seg_->header();
  ipc::ControlBlock& c = h->control;
  ipc::StepRequest& r = h->request;
  uint32_t e = c.step_epoch.load() + 1;
  if (ipc::barrierTagIsIdle(e)) ++e;  // keep barrier tags and "idle" (0) apart
  r.epoch = e;
  r.kind = kind;
  r.num_examples = B;
  r.num_participants = p.n;
  const ipc::Reduction reduction = o.mean               ? ipc::Reduction::kMean
                                   : o.sum_through_mean ? ipc::Reduction::kSumThroughMean
                                                        : ipc::Reduction::kSum;
  r.reduction = static_cast<uint32_t>(reduction);
  r.scale = reduction == ipc::Reduction::kSum ? 1.0f : ipc::meanScale(B);
  r.loss_scale = o.loss_scale;
  r.max_examples_per_pass = o.max_examples_per_pass;
  r.seed = o.seed;
  r.train_mode = o.train ? 1 : 0;
  r.buffer_rule =
      static_cast<uint32_t>(o.average_buffers ? ipc::BufferRule::kMean : ipc::BufferRule::kFirst);
  r.accumulate = static_cast<uint32_t>(o.accumulate);
  r.prev_count = o.prev_count;
  for (uint32_t k = 0; k < p.n; ++k) {
    r.participants[k] = p.slots[k];
    h->workers[p.slots[k]].assigned_rank.store(k, std::memory_order_relaxed);
    h->workers[p.slots[k]].assigned_epoch.store(e, std::memory_order_release);
  }
  c.compute_barrier.store(ipc::barrierTag(e), std::memory_order_relaxed);
  c.reduce_barrier.store(ipc::barrierTag(e), std::memory_order_relaxed);
  // Buckets where backward's order can hide the reduction: a fresh step of two or more
  // participants in host memory (an accumulating step's weights need every count first).
  const bool bucketed =
      num_buckets_ > 0 && p.n >= 2 && o.accumulate == ipc::Accumulate::kFresh && !onDevice();
  r.num_buckets = bucketed ? num_buckets_ : 0;
  if (bucketed) {
    std::copy(bucket_cuts_, bucket_cuts_ + num_buckets_ + 1, r.bucket_begin);
    for (uint32_t k = 0; k < num_buckets_; ++k) {
      c.buckets[k].ready.store(ipc::barrierTag(e), std::memory_order_relaxed);
      c.buckets[k].claimed.store(ipc::barrierTag(e), std::memory_order_relaxed);
    }
  }
  // Spin only if every thread that runs meanwhile has a core. While the trainer waits
  // for the step, that is the participants' threads and this trainer; otherwise a
  // spinning trainer would take a core from a worker, and it sleeps. Between steps the
  // participants' intra-op threads are idle: a participant's wait for the next step
  // shares the cores with the other participants' main threads and this trainer only
  // (one worker of 2 threads on 2 cores spins there, not while it computes). At the
  // barriers it is the participants' threads alone, as the trainer then either spins
  // (every thread fits) or sleeps.
  r.threads = placement_.threads;
  const uint64_t threads =
      static_cast<uint64_t>(p.n) *
      std::max<uint32_t>(1, ipc::stepThreads(placement_.threads, h->threads_per_worker));
  await_spin_ns_ = threads + 1 <= cores_ ? spin_ns_ : 0;
  r.spin_ns = p.n + 1 <= cores_ ? spin_ns_ : 0;
  r.barrier_spin_ns = threads <= cores_ ? spin_ns_ : 0;
  // Workers the step before went on without sleep on idle_wake: wake them only when this
  // step takes one (by pid: a replaced worker is a newcomer in its slot), or when the
  // step before did not finish (who saw it is unknown).
  bool newcomer = !last_step_known_;
  for (uint32_t k = 0; k < p.n; ++k) newcomer = newcomer || last_pids_[p.slots[k]] != p.pids[k];
  std::fill(std::begin(last_pids_), std::end(last_pids_), 0);
  for (uint32_t k = 0; k < p.n; ++k) last_pids_[p.slots[k]] = p.pids[k];
  last_step_known_ = false;  // until it is done (run())
  r.publish_ns = ipc::monotonicNs();
  c.step_epoch.store(e, std::memory_order_release);
  ipc::futexWake(&c.step_epoch);
  if (newcomer) ipc::bumpAndWake(&c.idle_wake);
  return e;
}

// Phase 3: await. Sleeps on trainer_wake until the step is done or aborted. Once per
// wait slice it checks, from memory, that every participant still runs: one can die
// between being picked and the coordinator reaping it (a zombie still looks alive), so
// the coordinator may never see it as part of this step. The coordinator's liveness and
// the engine's state are checked in the same slice.
Trainer::Outcome Trainer::await(uint32_t e, const Participants& p, uint64_t deadline) {
  const ipc::SegmentHeader* h = seg_->header();
  ipc::ControlBlock& c = seg_->header()->control;
  const int coordinator = h->coordinator_pid;
  Outcome outcome = Outcome::kTimedOut;
  const bool ended = ipc::waitUntil(
      &c.trainer_wake, [&] { return ipc::stepEnded(c, e); },
      [&] {
        for (uint32_t k = 0; k < p.n; ++k) {
          const ipc::WorkerRecord& w = h->workers[p.slots[k]];
          const auto st = static_cast<WorkerState>(w.state.load(std::memory_order_acquire));
          if (w.pid.load() != p.pids[k] || st == WorkerState::kDead || st == WorkerState::kExited) {
            outcome = Outcome::kLostWorker;
            return false;
          }
        }
        if (!ipc::processAlive(coordinator) || !serving()) {
          outcome = Outcome::kEngineGone;
          return false;
        }
        return true;
      },
      deadline, kAwaitSlice, await_spin_ns_, await_spin_.get());
  if (c.done_epoch.load(std::memory_order_acquire) == e) return Outcome::kDone;
  if (ended) return Outcome::kLostWorker;  // aborted by the coordinator: it reaped a participant
  return outcome;
}

// Phase 4: collect the participants' results into stats. A worker's error becomes
// WorkerError with its message; non-finite values raise when asked to.
void Trainer::collect(uint32_t e, const Participants& p, int64_t B, const GradientOptions& o,
                      GradientStats* stats) const {
  const ipc::SegmentHeader* h = seg_->header();
  stats->num_examples = B;
  stats->loss_sum = 0;
  stats->count = 0;
  stats->reduce_seconds = 0;
  stats->nonfinite = false;
  stats->workers.clear();
  stats->unused_params.clear();
  uint64_t reached[ipc::kMaxParams / 64] = {};
  for (uint32_t k = 0; k < p.n; ++k) {
    const engine::WorkerResult w = engine::readWorkerResult(h->workers[p.slots[k]], e, p.slots[k]);
    WorkerStepStats ws;
    ws.slot = p.slots[k];
    ws.examples = w.examples;
    ws.loss_sum = w.loss_sum;
    ws.count = w.count;
    ws.compute_seconds = w.compute_ns / 1e9;
    ws.reduce_seconds = w.reduce_ns / 1e9;
    ws.reduce_early_seconds = w.reduce_early_ns / 1e9;
    ws.wait_seconds = w.barrier_wait_ns / 1e9;
    ws.nonfinite_loss = w.nonfinite_loss;
    ws.nonfinite_grad = w.nonfinite_grad;
    ws.nonfinite_sum = w.nonfinite_sum;
    stats->nonfinite = stats->nonfinite || ws.nonfinite_loss || ws.nonfinite_grad;
    stats->loss_sum += ws.loss_sum;
    stats->count += ws.count;
    stats->reduce_seconds = std::max(stats->reduce_seconds, ws.reduce_seconds);
    stats->workers.push_back(ws);
    for (uint32_t i = 0; i < ipc::kMaxParams / 64; ++i) reached[i] |= w.grad_params[i];
  }
  const uint32_t num_params = std::min(h->num_params, ipc::kMaxParams);
  for (uint32_t i = 0; i < num_params; ++i) {
    if (!ipc::paramBit(reached, i)) stats->unused_params.push_back(static_cast<int>(i));
  }
  SHMGRAD_CHECK(!o.mean || (std::isfinite(stats->count) && stats->count > 0),
                ErrorKind::kInvalidArgument, "the batch's count is ", stats->count,
                ": a mean needs a count > 0 (does forward return (loss_sum, 0), every target "
                "padding?); the reduced gradient of this step is not valid");
  stats->loss = o.mean ? stats->loss_sum / stats->count : stats->loss_sum;
  if (stats->nonfinite && o.raise_on_nonfinite) {
    std::ostringstream os;
    for (const auto& w : stats->workers) {
      if (w.nonfinite_loss || w.nonfinite_grad) {
        os << " worker " << w.slot << (w.nonfinite_loss ? " (loss)" : "")
           << (w.nonfinite_sum    ? " (its slice of the gradients' sum overflowed)"
               : w.nonfinite_grad ? " (gradient)"
                                  : "");
      }
    }
    raise(ErrorKind::kNonFinite, "non-finite values in the step:", os.str());
  }
}

// The step, phase by phase; a step that lost a worker is aborted and re-run with the
// workers that are ready (exact: every participant recomputes its shard).
GradientStats Trainer::run(int64_t B, const GradientOptions& o, uint32_t kind, uint64_t start,
                           uint64_t deadline) {
  ipc::ControlBlock& c = seg_->header()->control;
  GradientStats stats;
  // The probe's sample of the last step: the time from its start to this one's, all that a
  // training loop pays for it (its optimizer's step and whatever else the loop does
  // between two calls, with the trainer's threads as that placement leaves them), not the
  // call alone; then the placement this step runs with. Once chosen, the probe watches the
  // kept placement's steps and may run again (a recheck).
  if (probe_ != nullptr && probe_->timing() && probe_last_.start != 0 &&
      start > probe_last_.start) {
    const bool was_done = probe_->done();
    probe_->record((start - probe_last_.start) / 1e9, probe_last_.examples, start / 1e9,
                   probe_last_.timed);
    if (!was_done || !probe_->done()) notePlacement();
  }
  probe_last_ = {};
  stats.placement_probing = probe_ != nullptr && !probe_->done();
  // Before any device work: a stopped engine's memory is gone (memory reads only: a dead
  // coordinator is found in await, without a system call per step here).
  SHMGRAD_CHECK(serving(), ErrorKind::kNotFound, "engine '", name_, "' has stopped",
                goneOnDevice());
  if (mem_ != nullptr && mem_->onDevice()) {
    // The optimizer's step (on this process's device) is done before any worker reads the
    // parameters, and every other device's copy of them is brought up to date.
    const uint64_t t0 = ipc::monotonicNs();
    mem_->synchronize(mem_->trainerOrdinal());
    if (mem_->syncParams() > 0) stats.param_sync_seconds = (ipc::monotonicNs() - t0) / 1e9;
  }
  for (int attempt = 0;; ++attempt) {
    SHMGRAD_CHECK(serving() && (attempt == 0 || ipc::processAlive(seg_->header()->coordinator_pid)),
                  ErrorKind::kNotFound, "engine '", name_, "' has stopped", goneOnDevice());
    const Participants p = pickParticipants(B, o, deadline);
    const bool here = p.slots[0] == ipc::trainerSlot(*seg_->header()) && in_trainer_;
    if (!here) copyBatchForWorkers();
    const uint32_t e = publish(B, o, kind, p);
    if (here) {
      try {  // computed here: done when this returns (an error of the job is in its record)
        in_trainer_(e, placement_.threads, batch_.local);
      } catch (...) {
        dirty_ = true;
        ipc::abortStep(c, e);
        throw;
      }
    }
    const Outcome outcome = await(e, p, deadline);
    if (outcome == Outcome::kDone) {
      last_step_known_ = true;
      collect(e, p, B, o, &stats);
      const ipc::SegmentHeader* h = seg_->header();
      const uint64_t now = ipc::monotonicNs(), publish = h->request.publish_ns;
      const uint64_t done = std::max(h->control.done_ns, publish);
      uint64_t last_start = publish;
      for (uint32_t k = 0; k < p.n; ++k) {
        last_start = std::max(last_start, h->workers[p.slots[k]].start_ns);
      }
      stats.wall_seconds = (now - start) / 1e9;
      stats.prepare_seconds = (publish - std::min(publish, start)) / 1e9;
      stats.step_seconds = (done - publish) / 1e9;
      stats.wake_seconds = (last_start - publish) / 1e9;
      stats.finish_seconds = (now - std::min(now, done)) / 1e9;
      if (probe_ != nullptr && probe_->timing()) probe_last_ = {start, B, attempt == 0};
      return stats;
    }
    // The step did not finish: end it for every waiter, the one abort path.
    dirty_ = true;
    ipc::abortStep(c, e);
    if (outcome == Outcome::kTimedOut) {
      // Given up on: the coordinator replaces a participant still held up by it after a
      // grace period (hung or stopped), so that the next call does not wait for it forever.
      c.abandon_epoch.store(e, std::memory_order_release);
      ipc::bumpAndWake(&c.coordinator_wake);
    }
    SHMGRAD_CHECK(outcome != Outcome::kEngineGone, ErrorKind::kNotFound, "engine '", name_,
                  "' stopped during the step", goneOnDevice());
    SHMGRAD_CHECK(outcome != Outcome::kTimedOut, ErrorKind::kTimeout, "engine '", name_,
                  "': the step did not finish within ", o.timeout_seconds,
                  " s (timeout_seconds); the engine keeps serving");
    SHMGRAD_CHECK(attempt < o.max_retries, ErrorKind::kWorkerFailed, "engine '", name_,
                  "': a worker died during this batch ", attempt + 1,
                  " times (does the model crash on this input?); the engine keeps serving");
    ++stats.retries;
    c.step_retries.fetch_add(1);
    waitIdle(deadline);
  }
}

}  // namespace shmgrad
