#include "engine/control.h"

#include <algorithm>
#include <chrono>
#include <cinttypes>
#include <cmath>
#include <cstdarg>
#include <cstdio>
#include <cstring>
#include <thread>

#include "ipc/device_table.h"
#include "ipc/error.h"
#include "ipc/futex.h"
#include "ipc/layout.h"
#include "ipc/segment.h"

namespace shmgrad::engine {
namespace {

// How often requestStop looks for the segment to vanish. The coordinator unlinks it as
// its last act, after its workers have exited; nothing wakes us when it does.
constexpr auto kStopPollInterval = std::chrono::milliseconds(20);
constexpr double kNsPerSecond = 1e9;
constexpr double kMsPerSecond = 1e3;
constexpr double kBytesPerMiB = 1048576.0;

// Appends printf-style text to out (the format is checked by the compiler).
__attribute__((format(printf, 2, 3))) void appendf(std::string* out, const char* fmt, ...) {
  va_list args;
  va_start(args, fmt);
  va_list again;
  va_copy(again, args);
  const int n = std::vsnprintf(nullptr, 0, fmt, args);
  va_end(args);
  if (n > 0) {
    const size_t old = out->size();
    out->resize(old + static_cast<size_t>(n) + 1);  // vsnprintf writes the NUL too
    std::vsnprintf(out->data() + old, static_cast<size_t>(n) + 1, fmt, again);
    out->resize(old + static_cast<size_t>(n));
  }
  va_end(again);
}

// Tells the coordinator to look at the control block again (stop or resize request).
void wakeCoordinator(ipc::ControlBlock& c) { ipc::bumpAndWake(&c.coordinator_wake); }

// A NUL-terminated char array of the header (validateHeader checked the terminator).
template <size_t N>
std::string headerString(const char (&field)[N]) {
  return std::string(field, strnlen(field, N));
}

StepSummary stepSummary(const ipc::StepRecord& r) {
  StepSummary s;
  s.epoch = r.epoch;
  s.workers = r.workers;
  s.examples = r.examples;
  s.loss_sum = r.loss_sum;
  s.wall_seconds = r.wall_ns / kNsPerSecond;
  s.compute_seconds = r.compute_max_ns / kNsPerSecond;
  s.reduce_seconds = r.reduce_max_ns / kNsPerSecond;
  s.reduce_early_seconds = r.reduce_early_max_ns / kNsPerSecond;
  s.wait_seconds = r.wait_ns / kNsPerSecond;
  return s;
}

}  // namespace

EngineStatus readStatus(const std::string& name) {
  auto seg = ipc::Segment::open(name);  // NotFound if there is none; validates the header
  return statusOf(name, seg->header());
}

EngineStatus statusOf(const std::string& name, const ipc::SegmentHeader* h) {
  const ipc::ControlBlock& c = h->control;

  EngineStatus s;
  s.name = name;
  s.state = ipc::engineStateName(static_cast<ipc::EngineState>(c.engine_state.load()));
  s.coordinator_pid = h->coordinator_pid;
  s.coordinator_alive = ipc::processAlive(h->coordinator_pid);
  s.segment_path = ipc::segmentPath(name);
  s.segment_bytes = h->total_size;
  s.model_path = headerString(h->model_path);
  s.loss = ipc::lossName(static_cast<ipc::LossKind>(h->loss));
  s.loss_reduction = ipc::lossReductionName(c.loss_reduction.load());
  s.worker_kind = ipc::workerKindName(static_cast<ipc::WorkerKind>(h->worker_kind));
  s.job_path = headerString(h->job_path);
  s.num_params = h->num_params;
  s.param_floats = h->param_floats;
  if (h->data_count > 0) {
    s.dataset = headerString(h->data_description);
    s.dataset_size = h->data_count;
  }
  s.max_batch = h->max_batch;
  s.threads_per_worker = h->threads_per_worker;
  // What the trainer writes (any value read here is only reported, never used).
  s.placement = ipc::placementStateName(static_cast<ipc::PlacementState>(c.placement_state.load()));
  s.placement_workers = c.placement_workers.load();
  s.placement_threads = ipc::stepThreads(c.placement_threads.load(), h->threads_per_worker);
  s.placement_in_trainer = c.placement_in_trainer.load() == 1;
  s.trainer_pid = c.trainer_pid.load();
  s.step_epoch = c.step_epoch.load();
  s.steps_served = c.steps_served.load();
  s.steps_aborted = c.steps_aborted.load();
  s.step_retries = c.step_retries.load();
  s.worker_restarts = c.worker_restarts.load();
  s.target_workers = c.target_workers.load();
  s.slots = h->num_slots;  // validateHeader: 1..kMaxWorkers
  // The device table was validated with the header; bounds are checked again where read.
  const auto* table = reinterpret_cast<const ipc::DeviceTable*>(
      reinterpret_cast<const uint8_t*>(h) + h->device.offset);
  const uint32_t num_devices = std::min(table->count, ipc::kMaxDevices);
  for (uint32_t d = 0; d < num_devices; ++d) {
    s.devices += (d > 0 ? ",cuda:" : "cuda:") + std::to_string(table->devices[d].ordinal);
  }
  if (num_devices > 1) s.param_sync_bytes = h->param_floats * sizeof(float) * (num_devices - 1);
  s.mps = num_devices > 0 && (table->flags & ipc::kDeviceTableMps) != 0;
  auto deviceOf = [&](uint32_t slot) -> std::string {
    const int d = table->slot_device[slot];
    if (d < 0 || static_cast<uint32_t>(d) >= num_devices) return "cpu";
    return "cuda:" + std::to_string(table->devices[d].ordinal);
  };

  for (uint32_t i = 0; i < h->num_slots; ++i) {
    const ipc::WorkerRecord& w = h->workers[i];
    const auto state = static_cast<ipc::WorkerState>(w.state.load());
    if (state == ipc::WorkerState::kEmpty) continue;
    WorkerStatus ws;
    ws.slot = i;
    ws.pid = w.pid.load();
    ws.state = ipc::workerStateName(state);
    ws.restarts = w.restarts.load();
    ws.busy_epoch = w.busy_epoch.load();
    ws.assigned_epoch = w.assigned_epoch.load();
    ws.device = deviceOf(i);
    s.workers.push_back(std::move(ws));
  }

  // The last reducer writes step k's record into stats[k % kStatsRing] and then bumps
  // steps_served to k + 1, so the newest steps_served (at most kStatsRing) records are
  // complete; read them oldest first.
  const uint64_t shown = std::min<uint64_t>(s.steps_served, ipc::kStatsRing);
  for (uint64_t k = s.steps_served - shown; k < s.steps_served; ++k) {
    s.recent_steps.push_back(stepSummary(h->stats[k % ipc::kStatsRing]));
  }
  return s;
}

std::string formatStatus(const EngineStatus& s) {
  std::string out;
  appendf(&out, "engine %s (%s), coordinator pid %d%s, segment %s (%.1f MiB)\n", s.name.c_str(),
          s.state.c_str(), s.coordinator_pid, s.coordinator_alive ? "" : " (not running)",
          s.segment_path.c_str(), s.segment_bytes / kBytesPerMiB);
  if (s.worker_kind == "eager") {
    appendf(&out,
            "eager workers (Python): job %s, loss reduction %s, %u parameter tensors, %" PRIu64
            " floats\n",
            s.job_path.c_str(), s.loss_reduction.c_str(), s.num_params, s.param_floats);
  } else {
    appendf(&out, "model %s, loss %s, %u parameter tensors, %" PRIu64 " floats\n",
            s.model_path.c_str(), s.loss.c_str(), s.num_params, s.param_floats);
  }
  if (s.dataset_size > 0) {
    appendf(&out, "dataset %s: %" PRId64 " examples\n", s.dataset.c_str(), s.dataset_size);
  }
  out += "trainer: " + (s.trainer_pid > 0 ? "pid " + std::to_string(s.trainer_pid) : "none") + "\n";
  appendf(&out,
          "steps served %" PRIu64 ", aborted %" PRIu64 ", retried %" PRIu64
          ", worker restarts %" PRIu64 "\n",
          s.steps_served, s.steps_aborted, s.step_retries, s.worker_restarts);
  if (!s.devices.empty()) {
    appendf(&out,
            "devices %s (the trainer's first): %" PRIu64
            " bytes copied device to device per step to bring the others' parameters up to "
            "date; MPS %s\n",
            s.devices.c_str(), s.param_sync_bytes, s.mps ? "on" : "off");
  }
  if (s.placement_in_trainer) {
    appendf(&out, "placement %s: the trainer computes, %u threads\n", s.placement.c_str(),
            s.placement_threads);
  } else if (s.placement != "fixed" || s.placement_workers != 0 ||
             s.placement_threads != s.threads_per_worker) {
    appendf(&out, "placement %s: %s workers x %u threads each\n", s.placement.c_str(),
            s.placement_workers == 0 ? "all" : std::to_string(s.placement_workers).c_str(),
            s.placement_threads);
  }
  appendf(&out, "workers (target %u of %u slots):\n", s.target_workers, s.slots);
  for (const WorkerStatus& w : s.workers) {
    appendf(&out, "  worker %u: pid %d, %s, restarts %u, %s\n", w.slot, w.pid, w.state.c_str(),
            w.restarts, w.device.c_str());
  }
  if (!s.recent_steps.empty()) {
    appendf(&out, "last %zu steps (ms): wall = compute (slowest worker) + reduce + wait\n",
            s.recent_steps.size());
    for (const StepSummary& r : s.recent_steps) {
      appendf(&out,
              "  step %6u  batch %6" PRId64
              "  workers %2u  wall %8.3f = compute %8.3f + "
              "reduce %7.3f + wait %7.3f  loss/ex %.4f\n",
              r.epoch, r.examples, r.workers, r.wall_seconds * kMsPerSecond,
              r.compute_seconds * kMsPerSecond, r.reduce_seconds * kMsPerSecond,
              r.wait_seconds * kMsPerSecond, r.examples > 0 ? r.loss_sum / r.examples : 0.0);
    }
  }
  return out;
}

bool requestStop(const std::string& name, double timeout_s) {
  // Bounded, so timeout_s in nanoseconds fits the deadline's uint64_t.
  SHMGRAD_CHECK(std::isfinite(timeout_s) && timeout_s >= 0 && timeout_s <= kMaxStopTimeoutS,
                ErrorKind::kInvalidArgument, "stop timeout ", timeout_s,
                " s is out of range: use 0 to ", kMaxStopTimeoutS, " s");
  {
    auto seg = ipc::Segment::open(name);
    ipc::ControlBlock& c = seg->header()->control;
    c.stop_requested.store(1, std::memory_order_release);
    wakeCoordinator(c);
    if (!ipc::processAlive(seg->header()->coordinator_pid)) {
      // The coordinator is gone (killed): clean up its leftovers ourselves, unless a
      // new coordinator has taken the name meanwhile (it holds the segment's lock, and
      // has just been asked to stop too).
      try {
        ipc::Segment::removeIfStale(name);
        return true;
      } catch (const Error& e) {
        if (e.kind() != ErrorKind::kBusy) throw;
      }
    }
  }
  const uint64_t deadline = ipc::monotonicNs() + static_cast<uint64_t>(timeout_s * kNsPerSecond);
  while (ipc::monotonicNs() < deadline) {
    if (!ipc::Segment::exists(name)) return true;
    std::this_thread::sleep_for(kStopPollInterval);
  }
  return !ipc::Segment::exists(name);
}

void requestResize(const std::string& name, uint32_t n) {
  auto seg = ipc::Segment::open(name);
  const uint32_t slots = seg->header()->num_slots;
  SHMGRAD_CHECK(n >= 1 && n <= slots, ErrorKind::kInvalidArgument, "cannot resize engine '", name,
                "' to ", n, " workers: it has ", slots,
                " slots (start it with --max-workers N to allow more)");
  ipc::ControlBlock& c = seg->header()->control;
  c.target_workers.store(n, std::memory_order_release);
  wakeCoordinator(c);
}

}  // namespace shmgrad::engine
