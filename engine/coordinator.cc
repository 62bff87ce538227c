#include "engine/coordinator.h"

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cinttypes>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <sstream>

#include "engine/dataset.h"
#include "ipc/error.h"
#include "ipc/futex.h"
#include "ipc/segment.h"
#include "worker/replica.h"

namespace shmgrad::engine {
namespace {

using ipc::EngineState;
using ipc::WorkerState;

volatile sig_atomic_t g_signal = 0;

void onSignal(int sig) { g_signal = sig; }

class Coordinator {
 public:
  explicit Coordinator(const ServeOptions& o) : opt_(o) {}

  int run() {
    create();
    installSignals();
    for (uint32_t i = 0; i < opt_.workers; ++i) spawn(i);
    if (!waitReady()) {
      shutdown();
      return 1;
    }
    c().engine_state.store(static_cast<uint32_t>(EngineState::kServing), std::memory_order_release);
    c().coordinator_wake.fetch_add(1);
    ipc::futexWake(&c().coordinator_wake);
    if (!opt_.quiet) {
      std::printf("shmgrad: engine '%s' serving: %u workers, %u parameter tensors (%" PRIu64
                  " floats), loss %s, segment %s (%.1f MiB)%s%s\n",
                  opt_.name.c_str(), opt_.workers, h()->num_params, h()->param_floats,
                  worker::lossName(static_cast<ipc::LossKind>(h()->loss)),
                  ipc::segmentPath(opt_.name).c_str(), seg_->size() / 1048576.0,
                  h()->data_count > 0 ? ", dataset " : "", h()->data_description);
      std::fflush(stdout);
    }
    supervise();
    shutdown();
    return 0;
  }

 private:
  ipc::SegmentHeader* h() { return seg_->header(); }
  ipc::ControlBlock& c() { return seg_->header()->control; }

  void create() {
    worker::parseLoss(opt_.loss);  // fail early with the list of losses
    SHMGRAD_CHECK(opt_.workers >= 1 && opt_.workers <= ipc::kMaxWorkers,
                  ErrorKind::kInvalidArgument, "--workers ", opt_.workers,
                  " is out of range: use 1 to ", ipc::kMaxWorkers);
    uint32_t slots = opt_.max_workers == 0 ? opt_.workers : opt_.max_workers;
    SHMGRAD_CHECK(slots >= opt_.workers && slots <= ipc::kMaxWorkers, ErrorKind::kInvalidArgument,
                  "--max-workers ", slots, " must be between --workers and ", ipc::kMaxWorkers);
    SHMGRAD_CHECK(opt_.threads_per_worker >= 1 && opt_.threads_per_worker <= 256,
                  ErrorKind::kInvalidArgument, "--threads-per-worker must be 1 to 256");
    ipc::checkEngineName(opt_.name);
    worker::ModelParams model = worker::describeModel(opt_.model_path);
    Dataset data;
    if (!opt_.dataset.empty()) data = loadDatasetSpec(opt_.dataset);

    ipc::SegmentSpec spec;
    spec.name = opt_.name;
    char resolved[PATH_MAX];
    spec.model_path = realpath(opt_.model_path.c_str(), resolved) ? resolved : opt_.model_path;
    spec.loss = worker::parseLoss(opt_.loss);
    spec.num_slots = slots;
    spec.threads_per_worker = opt_.threads_per_worker;
    spec.params = model.specs;
    spec.max_batch = opt_.max_batch;
    spec.input_bytes = opt_.input_capacity_mb << 20;
    spec.target_bytes = std::max<uint64_t>(static_cast<uint64_t>(opt_.max_batch) * 8, 1 << 20);
    if (data.count > 0) {
      spec.data_count = data.count;
      spec.data_example_shape = data.example_shape;
      spec.data_target_dtype = data.target_dtype;
      spec.data_target_shape = data.target_shape;
      spec.data_description = data.description;
    }
    seg_ = ipc::Segment::create(spec);
    // Initial parameter values and the dataset, written once before any worker runs.
    const ipc::ParamEntry* table = seg_->paramTable();
    for (size_t i = 0; i < model.values.size(); ++i) {
      std::memcpy(seg_->params() + table[i].offset, model.values[i].data_ptr<float>(),
                  table[i].numel * sizeof(float));
    }
    if (data.count > 0) {
      std::memcpy(seg_->region<float>(h()->data_inputs), data.inputs.data(),
                  data.inputs.size() * sizeof(float));
      if (data.target_dtype == ipc::DType::kInt64) {
        std::memcpy(seg_->region<int64_t>(h()->data_targets), data.targets_i64.data(),
                    data.targets_i64.size() * sizeof(int64_t));
      } else {
        std::memcpy(seg_->region<float>(h()->data_targets), data.targets_f32.data(),
                    data.targets_f32.size() * sizeof(float));
      }
    }
    active_ = opt_.workers;
    c().target_workers.store(opt_.workers);
  }

  void installSignals() {
    struct sigaction sa;
    std::memset(&sa, 0, sizeof(sa));
    sa.sa_handler = onSignal;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGTERM, &sa, nullptr);
    sigaction(SIGINT, &sa, nullptr);
    sigaction(SIGHUP, &sa, nullptr);
    signal(SIGPIPE, SIG_IGN);
  }

  std::string workerBinary() const {
    if (!opt_.worker_binary.empty()) return opt_.worker_binary;
    char buf[PATH_MAX];
    ssize_t n = readlink("/proc/self/exe", buf, sizeof(buf) - 1);
    SHMGRAD_CHECK(n > 0, ErrorKind::kSystem, "readlink /proc/self/exe failed");
    buf[n] = '\0';
    return buf;
  }

  // fork + exec: the coordinator may already run libtorch's thread pools, so the child
  // does nothing but async-signal-safe calls before exec (docs/DESIGN.md).
  void spawn(uint32_t slot) {
    ipc::WorkerRecord& w = h()->workers[slot];
    w.state.store(static_cast<uint32_t>(WorkerState::kStarting));
    w.error = 0;
    w.error_text[0] = '\0';
    w.busy_epoch.store(0);
    w.assigned_epoch.store(0);
    std::string bin = workerBinary();
    std::string slot_s = std::to_string(slot), parent_s = std::to_string(getpid());
    std::string threads_s = std::to_string(h()->threads_per_worker);
    std::vector<std::string> args = {bin, "__worker", opt_.name, slot_s, parent_s};
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    // Thread pools sized before libtorch and OpenBLAS start in the worker.
    std::vector<std::string> env_s;
    for (char** e = environ; *e != nullptr; ++e) {
      if (std::strncmp(*e, "OMP_NUM_THREADS=", 16) != 0 &&
          std::strncmp(*e, "OPENBLAS_NUM_THREADS=", 21) != 0 &&
          std::strncmp(*e, "MKL_NUM_THREADS=", 16) != 0) {
        env_s.emplace_back(*e);
      }
    }
    env_s.push_back("OMP_NUM_THREADS=" + threads_s);
    env_s.push_back("OPENBLAS_NUM_THREADS=" + threads_s);
    env_s.push_back("MKL_NUM_THREADS=" + threads_s);
    std::vector<char*> envp;
    for (auto& e : env_s) envp.push_back(e.data());
    envp.push_back(nullptr);
    pid_t pid = fork();
    SHMGRAD_CHECK(pid >= 0, ErrorKind::kSystem, "fork failed: ", detail::errnoText());
    if (pid == 0) {
      execve(argv[0], argv.data(), envp.data());
      _exit(127);
    }
    w.pid.store(pid, std::memory_order_release);
  }

  bool waitReady() {
    const uint64_t deadline =
        ipc::monotonicNs() + static_cast<uint64_t>(opt_.startup_timeout_s * 1e9);
    for (;;) {
      uint32_t ready = 0;
      for (uint32_t i = 0; i < active_; ++i) {
        if (h()->workers[i].state.load() == static_cast<uint32_t>(WorkerState::kReady)) ++ready;
      }
      if (ready == active_) return true;
      int status = 0;
      pid_t pid = waitpid(-1, &status, WNOHANG);
      if (pid > 0) {
        int slot = slotOf(pid);
        std::fprintf(stderr, "shmgrad: worker %d failed to start (%s): %s\n", slot,
                     describeExit(status).c_str(),
                     slot >= 0 && h()->workers[slot].error_text[0] ? h()->workers[slot].error_text
                                                                   : "see its output above");
        if (slot >= 0) h()->workers[slot].pid.store(0);
        return false;
      }
      if (g_signal != 0 || ipc::monotonicNs() > deadline) {
        if (g_signal == 0) {
          std::fprintf(stderr, "shmgrad: workers not ready after %.0f s (--startup-timeout)\n",
                       opt_.startup_timeout_s);
        }
        return false;
      }
      uint32_t v = c().coordinator_wake.load();
      ipc::futexWait(&c().coordinator_wake, v, std::chrono::milliseconds(50));
    }
  }

  static std::string describeExit(int status) {
    if (WIFSIGNALED(status)) return std::string("killed by signal ") + std::to_string(WTERMSIG(status));
    if (WIFEXITED(status)) return "exit code " + std::to_string(WEXITSTATUS(status));
    return "status " + std::to_string(status);
  }

  int slotOf(pid_t pid) {
    for (uint32_t i = 0; i < h()->num_slots; ++i) {
      if (h()->workers[i].pid.load() == pid) return static_cast<int>(i);
    }
    return -1;
  }

  void supervise() {
    for (;;) {
      if (g_signal != 0 || c().stop_requested.load(std::memory_order_acquire) != 0) return;
      reap();
      const bool growing = resize();
      uint32_t v = c().coordinator_wake.load(std::memory_order_acquire);
      if (g_signal != 0 || c().stop_requested.load() != 0) return;
      // While a grow waits for a retired worker to exit, poll its exit quickly.
      ipc::futexWait(&c().coordinator_wake, v, std::chrono::milliseconds(growing ? 2 : 100));
    }
  }

  // A worker that died is replaced at once. If it took part in the step in flight, that
  // step is aborted so the trainer re-runs it (the replacement computes its shard again).
  void reap() {
    int status = 0;
    pid_t pid;
    while ((pid = waitpid(-1, &status, WNOHANG)) > 0) {
      int slot = slotOf(pid);
      if (slot < 0) continue;
      ipc::WorkerRecord& w = h()->workers[slot];
      w.pid.store(0);
      const bool retired = w.state.load() == static_cast<uint32_t>(WorkerState::kRetired);
      w.state.store(static_cast<uint32_t>(retired ? WorkerState::kExited : WorkerState::kDead),
                    std::memory_order_release);
      const uint32_t e = c().step_epoch.load(std::memory_order_acquire);
      if (e != 0 && w.assigned_epoch.load() == e && c().done_epoch.load() != e) {
        c().abort_epoch.store(e, std::memory_order_release);
        c().steps_aborted.fetch_add(1);
        c().trainer_wake.fetch_add(1);
        ipc::futexWake(&c().trainer_wake);
        ipc::futexWake(&c().compute_barrier);
        ipc::futexWake(&c().reduce_barrier);
      }
      if (retired) continue;
      if (!opt_.quiet) {
        std::fprintf(stderr, "shmgrad: worker %d (pid %d) died (%s); starting a replacement\n",
                     slot, pid, describeExit(status).c_str());
      }
      w.restarts.fetch_add(1);
      c().worker_restarts.fetch_add(1);
      spawn(static_cast<uint32_t>(slot));
    }
  }

  // Grows or shrinks the set of running workers to target_workers. Returns true while a
  // grow waits for a slot's retired worker to exit.
  //
  // A slot is reused only once its previous process has been reaped (pid 0). Until then
  // the slot stays `retired`, so the old worker exits whenever it next runs. Spawning at
  // once would overwrite that state: a retired worker not scheduled since (a loaded
  // machine) would then read the new worker's state and keep serving the slot next to
  // its replacement, two processes adding into one gradient slot.
  bool resize() {
    const uint32_t target = c().target_workers.load(std::memory_order_acquire);
    if (target < 1 || target > h()->num_slots) return false;
    if (target < active_) {
      const uint64_t now = ipc::monotonicNs();
      for (uint32_t i = target; i < active_; ++i) {
        h()->workers[i].state.store(static_cast<uint32_t>(WorkerState::kRetired),
                                    std::memory_order_release);
        retired_ns_[i] = now;
      }
      ipc::futexWake(&c().step_epoch);
      active_ = target;
    }
    while (active_ < target) {
      if (h()->workers[active_].pid.load() != 0) {
        hurryRetired(active_);
        return true;
      }
      spawn(active_++);
    }
    return false;
  }

  // A retired worker that a grow waits for: wake it again (it may have gone to sleep just
  // before it was retired) and, if it still has not exited after kRetireGraceNs while idle
  // (stopped, or hung), kill it. One that is finishing a step is left to finish it.
  void hurryRetired(uint32_t slot) {
    ipc::WorkerRecord& w = h()->workers[slot];
    ipc::futexWake(&c().step_epoch);
    const int pid = w.pid.load();
    if (pid > 0 && w.busy_epoch.load() == 0 &&
        ipc::monotonicNs() - retired_ns_[slot] > kRetireGraceNs) {
      std::fprintf(stderr,
                   "shmgrad: retired worker %u (pid %d) did not exit within %.0f s; killing it "
                   "so its slot can be reused\n",
                   slot, pid, kRetireGraceNs / 1e9);
      kill(pid, SIGKILL);
      retired_ns_[slot] = ipc::monotonicNs();  // once per grace period at most
    }
  }

  void shutdown() {
    c().engine_state.store(static_cast<uint32_t>(EngineState::kStopping), std::memory_order_release);
    c().stop_requested.store(1);
    ipc::futexWake(&c().step_epoch);
    ipc::futexWake(&c().compute_barrier);
    ipc::futexWake(&c().reduce_barrier);
    c().trainer_wake.fetch_add(1);
    ipc::futexWake(&c().trainer_wake);
    const uint64_t deadline = ipc::monotonicNs() + 5000000000ull;
    for (;;) {
      bool any = false;
      for (uint32_t i = 0; i < h()->num_slots; ++i) {
        int pid = h()->workers[i].pid.load();
        if (pid <= 0) continue;
        int status;
        if (waitpid(pid, &status, WNOHANG) == pid) {
          h()->workers[i].pid.store(0);
          h()->workers[i].state.store(static_cast<uint32_t>(WorkerState::kExited));
        } else {
          any = true;
        }
      }
      if (!any) break;
      if (ipc::monotonicNs() > deadline) {
        for (uint32_t i = 0; i < h()->num_slots; ++i) {
          int pid = h()->workers[i].pid.load();
          if (pid > 0) {
            kill(pid, SIGKILL);
            waitpid(pid, nullptr, 0);
            h()->workers[i].pid.store(0);
          }
        }
        break;
      }
      usleep(10000);
    }
    ipc::Segment::remove(opt_.name);
    if (!opt_.quiet) {
      std::printf("shmgrad: engine '%s' stopped after %" PRIu64 " steps; segment removed\n",
                  opt_.name.c_str(), c().steps_served.load());
      std::fflush(stdout);
    }
  }

  static constexpr uint64_t kRetireGraceNs = 5000000000ull;

  ServeOptions opt_;
  std::unique_ptr<ipc::Segment> seg_;
  uint32_t active_ = 0;
  uint64_t retired_ns_[ipc::kMaxWorkers] = {};  // when each slot was last retired
};

}  // namespace

int serve(const ServeOptions& options) {
  Coordinator c(options);
  return c.run();
}

bool requestStop(const std::string& name, double timeout_s) {
  {
    auto seg = ipc::Segment::open(name);
    auto& c = seg->header()->control;
    c.stop_requested.store(1, std::memory_order_release);
    c.coordinator_wake.fetch_add(1);
    ipc::futexWake(&c.coordinator_wake);
    int pid = seg->header()->coordinator_pid;
    if (!ipc::processAlive(pid)) {
      // The coordinator is gone (killed): clean up its leftovers ourselves, unless a
      // new coordinator has taken the name meanwhile (it holds the segment's lock).
      try {
        ipc::Segment::removeIfStale(name);
        return true;
      } catch (const Error& e) {
        if (e.kind() != ErrorKind::kBusy) throw;
      }
    }
  }
  const uint64_t deadline = ipc::monotonicNs() + static_cast<uint64_t>(timeout_s * 1e9);
  while (ipc::monotonicNs() < deadline) {
    if (!ipc::Segment::exists(name)) return true;
    usleep(20000);
  }
  return !ipc::Segment::exists(name);
}

void requestResize(const std::string& name, uint32_t n) {
  auto seg = ipc::Segment::open(name);
  SHMGRAD_CHECK(n >= 1 && n <= seg->header()->num_slots, ErrorKind::kInvalidArgument,
                "cannot resize engine '", name, "' to ", n, " workers: it has ",
                seg->header()->num_slots, " slots (start it with --max-workers N to allow more)");
  auto& c = seg->header()->control;
  c.target_workers.store(n, std::memory_order_release);
  c.coordinator_wake.fetch_add(1);
  ipc::futexWake(&c.coordinator_wake);
}

std::string statusText(const std::string& name) {
  auto seg = ipc::Segment::open(name);
  const ipc::SegmentHeader* h = seg->header();
  const ipc::ControlBlock& c = h->control;
  static const char* kStates[] = {"starting", "serving", "stopping", "failed"};
  static const char* kWorkerStates[] = {"empty", "starting", "ready", "dead", "exited", "retired"};
  std::ostringstream os;
  uint32_t st = c.engine_state.load();
  os << "engine " << name << " (" << (st < 4 ? kStates[st] : "?") << "), coordinator pid "
     << h->coordinator_pid << ", segment " << ipc::segmentPath(name) << " ("
     << h->total_size / 1048576.0 << " MiB)\n";
  os << "model " << h->model_path << ", loss "
     << worker::lossName(static_cast<ipc::LossKind>(h->loss)) << ", " << h->num_params
     << " parameter tensors, " << h->param_floats << " floats\n";
  if (h->data_count > 0) os << "dataset " << h->data_description << ": " << h->data_count << " examples\n";
  int holder = c.trainer_pid.load();
  os << "trainer: " << (holder > 0 ? "pid " + std::to_string(holder) : std::string("none"))
     << "\nsteps served " << c.steps_served.load() << ", aborted " << c.steps_aborted.load()
     << ", retried " << c.step_retries.load() << ", worker restarts " << c.worker_restarts.load()
     << "\nworkers (target " << c.target_workers.load() << " of " << h->num_slots << " slots):\n";
  for (uint32_t i = 0; i < h->num_slots; ++i) {
    const ipc::WorkerRecord& w = h->workers[i];
    uint32_t ws = w.state.load();
    if (ws == 0) continue;
    os << "  worker " << i << ": pid " << w.pid.load() << ", " << (ws < 6 ? kWorkerStates[ws] : "?")
       << ", restarts " << w.restarts.load() << "\n";
  }
  uint64_t served = c.steps_served.load();
  uint64_t shown = std::min<uint64_t>(served, ipc::kStatsRing);
  if (shown > 0) {
    os << "last " << shown << " steps (ms): wall = compute (slowest worker) + reduce + wait\n";
    for (uint64_t k = served - shown; k < served; ++k) {
      const ipc::StepRecord& r = h->stats[k % ipc::kStatsRing];
      char line[256];
      std::snprintf(line, sizeof(line),
                    "  step %6u  batch %6" PRId64 "  workers %2u  wall %8.3f = compute %8.3f + "
                    "reduce %7.3f + wait %7.3f  loss/ex %.4f\n",
                    r.epoch, r.examples, r.workers, r.wall_ns / 1e6, r.compute_max_ns / 1e6,
                    r.reduce_max_ns / 1e6, r.wait_ns / 1e6,
                    r.examples > 0 ? r.loss_sum / r.examples : 0.0);
      os << line;
    }
  }
  return os.str();
}

}  // namespace shmgrad::engine
