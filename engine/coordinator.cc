#include "engine/coordinator.h"

#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cinttypes>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <thread>

#include "engine/dataset.h"
#include "gpu/cuda_library.h"
#include "ipc/config.h"
#include "ipc/device_table.h"
#include "ipc/error.h"
#include "ipc/futex.h"
#include "ipc/segment.h"
#include "ipc/step.h"
#include "engine/model_file.h"
#include "engine/placement.h"

namespace shmgrad::engine {
namespace {

using ipc::EngineState;
using ipc::WorkerState;

// Tunables of the coordinator's loop; every wait is bounded.
constexpr auto kSuperviseSlice = std::chrono::milliseconds(100);  // reap/resize/stop checks
constexpr auto kGrowPoll = std::chrono::milliseconds(2);  // a grow waits for a retired worker
// A worker that dies before it is ready, again and again (its program or the environment
// broken under a running engine), is restarted after a growing pause instead of at once:
// the first time at once, then after kRestartBackoffFirst, doubling up to
// kRestartBackoffMax, so a crash loop costs little CPU and the log stays readable.
constexpr uint64_t kRestartBackoffFirstNs = 100000000;      // 100 ms
constexpr uint64_t kRestartBackoffMaxNs = 5000000000;       // 5 s
constexpr auto kReadyPoll = std::chrono::milliseconds(50);  // start-up: workers becoming ready
// Stopping: how long the devices' memory waits for the trainer that maps it to let go.
// Within the launcher's SIGTERM-to-SIGKILL grace (config::kDefaultStopTimeoutS).
constexpr auto kDeviceDetachTimeout = std::chrono::seconds(5);
constexpr auto kStopPoll = std::chrono::milliseconds(10);  // stop: workers exiting
constexpr uint64_t kStopGraceNs = 5000000000ull;           // then SIGKILL
constexpr int kExitExecFailed =
    config::kExitCannotExec;                        // the forked child could not exec the worker
constexpr uint64_t kRetireGraceNs = 5000000000ull;  // a retired, idle worker still there: SIGKILL

volatile sig_atomic_t g_signal = 0;

void onSignal(int sig) { g_signal = sig; }

constexpr int kExitDescribeRejected = config::kExitDescribeRejected;

class Coordinator {
 public:
  explicit Coordinator(const ServeOptions& o) : opt_(o) {}

  int run() {
    create();
    installSignals();
    for (uint32_t i = 0; i < opt_.workers; ++i) spawn(i);
    const std::string failure = waitReady();
    if (!failure.empty()) {
      shutdown();
      raise(g_signal != 0 ? ErrorKind::kNotFound : ErrorKind::kWorkerFailed, failure);
    }
    c().engine_state.store(static_cast<uint32_t>(EngineState::kServing), std::memory_order_release);
    ipc::bumpAndWake(&c().coordinator_wake);
    writeServeReport(opt_.status_fd, "serving", "", "");
    if (!opt_.quiet) {
      // Eager workers run the job's own loss: the segment's loss kind is not theirs.
      const std::string loss =
          eager() ? std::string("the job's") : ipc::lossName(static_cast<ipc::LossKind>(h()->loss));
      std::printf("shmgrad: engine '%s' serving: %u workers%s, %u parameter tensors (%" PRIu64
                  " floats), loss %s, segment %s (%.1f MiB)%s%s\n",
                  opt_.name.c_str(), opt_.workers,
                  opt_.auto_placement ? " (workers auto: the trainer places each step)" : "",
                  h()->num_params, h()->param_floats, loss.c_str(),
                  ipc::segmentPath(opt_.name).c_str(), seg_->size() / 1048576.0,
                  h()->data_count > 0 ? ", dataset " : "", h()->data_description);
      for (const auto& [ordinal, ptr] : device_ptrs_) {
        (void)ptr;
        std::printf("shmgrad: cuda:%d holds the engine's device buffers\n", ordinal);
      }
      std::fflush(stdout);
    }
    supervise();
    shutdown();
    return 0;
  }

 private:
  ipc::SegmentHeader* h() { return seg_->header(); }
  bool eager() const { return !opt_.eager_job.empty(); }
  ipc::ControlBlock& c() { return seg_->header()->control; }

  void create() {
    ipc::parseLoss(opt_.loss);  // fail early with the list of losses
    SHMGRAD_CHECK(eager() || opt_.loss_reduction.empty(), ErrorKind::kInvalidArgument,
                  "--loss-reduction is for eager jobs (TorchScript workers' losses are sums)");
    if (opt_.auto_placement) {
      // One worker per core, each able to use them all: the trainer places the steps.
      const Placement start = autoStart(opt_.max_workers);
      opt_.workers = start.workers;
      opt_.threads_per_worker = start.threads;
    }
    SHMGRAD_CHECK(opt_.workers >= 1 && opt_.workers <= ipc::kMaxWorkers,
                  ErrorKind::kInvalidArgument, "--workers ", opt_.workers,
                  " is out of range: use 1 to ", ipc::kMaxWorkers);
    uint32_t slots = opt_.max_workers == 0 ? opt_.workers : opt_.max_workers;
    SHMGRAD_CHECK(slots >= opt_.workers && slots <= ipc::kMaxWorkers, ErrorKind::kInvalidArgument,
                  "--max-workers ", slots, " must be between --workers and ", ipc::kMaxWorkers);
    SHMGRAD_CHECK(
        opt_.threads_per_worker >= 1 && opt_.threads_per_worker <= ipc::kMaxThreadsPerWorker,
        ErrorKind::kInvalidArgument, "--threads-per-worker must be 1 to ",
        ipc::kMaxThreadsPerWorker);
    ipc::checkEngineName(opt_.name);
    // The model's description comes from a process that loads models: the launcher wrote
    // it for eager workers; the TorchScript worker program describes a TorchScript file.
    const ModelDescription model =
        eager() ? readModelFile(opt_.model_path) : describeWithWorker(opt_.model_path);
    Dataset data;
    if (!opt_.dataset.empty()) data = loadDatasetSpec(opt_.dataset);

    ipc::SegmentSpec spec;
    spec.name = opt_.name;
    char resolved[PATH_MAX];
    spec.model_path = realpath(opt_.model_path.c_str(), resolved) ? resolved : opt_.model_path;
    spec.loss = ipc::parseLoss(opt_.loss);
    spec.num_slots = slots;
    spec.threads_per_worker = opt_.threads_per_worker;
    spec.placement_auto = opt_.auto_placement;
    // The trainer may compute a step itself (engine/placement.h, "in the trainer"): on the
    // host, the eager job (python/shmgrad/_in_trainer.py) or the TorchScript model
    // (worker::ScriptInTrainer) in the trainer's process; one more gradient slot.
    spec.trainer_slot = opt_.auto_placement && opt_.devices.empty();
    spec.params = model.params;
    spec.buffers = model.buffers;
    spec.max_batch = opt_.max_batch;
    spec.input_bytes = opt_.input_capacity_mb << 20;
    spec.target_bytes = config::targetBytesFor(opt_.max_batch);
    if (data.count > 0) {
      spec.data_count = data.count;
      spec.data_example_shape = data.example_shape;
      spec.data_target_dtype = data.target_dtype;
      spec.data_target_shape = data.target_shape;
      spec.data_description = data.description;
    }
    spec.numerics = ipc::parseNumerics(opt_.numerics);
    if (eager()) {
      SHMGRAD_CHECK(!opt_.python.empty(), ErrorKind::kInvalidArgument,
                    "--eager-job needs --python (the interpreter the eager workers run)");
      SHMGRAD_CHECK(opt_.dataset.empty() || opt_.eager_dataset_size == 0,
                    ErrorKind::kInvalidArgument,
                    "give --dataset or --eager-dataset-size, not both");
      spec.worker_kind = ipc::WorkerKind::kEager;
      // The spec's default, a sum, is the TorchScript workers' (a named loss).
      spec.loss_reduction = opt_.loss_reduction.empty()
                                ? ipc::LossReduction::kUnknown
                                : ipc::parseLossReduction(opt_.loss_reduction);
      spec.job_path = realpath(opt_.eager_job.c_str(), resolved) ? resolved : opt_.eager_job;
      if (opt_.eager_dataset_size > 0) {
        // The workers hold the dataset: only its size lives here (empty shapes, no data).
        spec.data_count = opt_.eager_dataset_size;
        spec.data_example_shape = {0};
        spec.data_target_shape = {0};
        spec.data_target_dtype = ipc::DType::kInt64;
        spec.data_description = "held by the eager workers";
      }
    }
    seg_ = ipc::Segment::create(spec);
    // Initial parameter values and the dataset, written once before any worker runs.
    const ipc::ParamEntry* table = seg_->paramTable();
    for (size_t i = 0; i < model.param_values.size(); ++i) {
      std::memcpy(seg_->params() + table[i].offset, model.param_values[i].data(),
                  table[i].numel * sizeof(float));
    }
    const ipc::BufferEntry* btable = seg_->bufferTable();
    for (size_t i = 0; i < model.buffer_values.size(); ++i) {
      std::memcpy(seg_->buffers() + btable[i].offset, model.buffer_values[i].data(),
                  btable[i].nbytes);
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
    if (!opt_.devices.empty()) {
      try {
        allocateDevices();
      } catch (...) {
        freeDevices();  // nothing left on a device, nor in /dev/shm
        seg_.reset();
        ipc::Segment::remove(opt_.name);
        throw;
      }
    }
    active_ = opt_.workers;
    c().target_workers.store(opt_.workers);
  }

  // Each device's allocation (layoutDevice), its copy of the initial parameters and
  // buffers, and its IPC handle in the device table, published last (a release store).
  // Before any worker starts: workers are fork+exec'd, so CUDA in this process is safe.
  void allocateDevices() {
    SHMGRAD_CHECK(opt_.devices.size() <= ipc::kMaxDevices, ErrorKind::kInvalidArgument,
                  "--devices names ", opt_.devices.size(), " GPUs; an engine serves at most ",
                  ipc::kMaxDevices);
    const std::string library = gpu::CudaLibrary::defaultPath();
    cuda_ = gpu::CudaLibrary::load(library);
    // The workers (TorchScript or Python) load the same library (gpu::EngineMemory).
    SHMGRAD_SYSCHECK(setenv("SHMGRAD_CUDA_LIBRARY", library.c_str(), 1), "setenv");
    const int visible = cuda_->deviceCount();
    for (int d : opt_.devices) {
      SHMGRAD_CHECK(d >= 0 && d < visible, ErrorKind::kInvalidArgument, "--devices names cuda:", d,
                    ", and this machine shows ", visible, " GPU(s) (cuda:0 to cuda:", visible - 1,
                    ")");
    }
    // Every process maps every device's buffers in its own device's context and reduces
    // across them there (peer access): devices that cannot address each other are
    // refused before anything is allocated.
    for (int d : opt_.devices) {
      for (int peer : opt_.devices) {
        SHMGRAD_CHECK(cuda_->canAccessPeer(d, peer), ErrorKind::kInvalidArgument,
                      "--devices names cuda:", d, " and cuda:", peer,
                      ", which have no peer access (cudaDeviceCanAccessPeer; `nvidia-smi topo "
                      "-p2p r` shows it): an engine reduces across its GPUs through peer "
                      "access, so serve GPUs that have it, or one GPU");
      }
    }
    auto* table = seg_->region<ipc::DeviceTable>(h()->device);
    ipc::initDeviceTable(table, opt_.devices, h()->num_slots, h()->param_floats, h()->buffers.size);
    if (mpsServes()) table->flags |= ipc::kDeviceTableMps;
    // Workers sharing a GPU without MPS time-slice it: each has its own context, and the
    // kernels of different contexts do not run at once.
    const ipc::Placement place = ipc::placeRoundRobin(opt_.workers, table->count);
    for (uint32_t d = 0; d < table->count; ++d) {
      if (place.slots_per_device[d] > 1 && !(table->flags & ipc::kDeviceTableMps) && !opt_.quiet) {
        std::printf(
            "shmgrad: %u workers share cuda:%d without MPS: their kernels take turns on it, so "
            "they are no faster than one (start an MPS daemon, nvidia-cuda-mps-control -d, to "
            "run them at once)\n",
            place.slots_per_device[d], opt_.devices[d]);
        std::fflush(stdout);  // the log is a file: read by the trainer while serving
      }
    }
    for (uint32_t d = 0; d < table->count; ++d) {
      ipc::DeviceEntry& e = table->devices[d];
      const uint64_t ptr = cuda_->alloc(e.ordinal, e.layout.bytes);
      device_ptrs_.emplace_back(e.ordinal, ptr);
      cuda_->copyToDevice(e.ordinal, ptr + e.layout.params, seg_->params(),
                          h()->param_floats * sizeof(float));
      if (h()->buffers.size > 0) {
        cuda_->copyToDevice(e.ordinal, ptr + e.layout.buffers, seg_->buffers(), h()->buffers.size);
      }
      const gpu::IpcHandle handle = cuda_->ipcHandle(e.ordinal, ptr);
      std::memcpy(e.ipc_handle, handle.data(), handle.size());
      const gpu::DeviceUuid uuid = cuda_->deviceUuid(e.ordinal);
      std::memcpy(e.uuid, uuid.data(), uuid.size());
      e.state.store(static_cast<uint32_t>(ipc::DeviceState::kPublished), std::memory_order_release);
    }
  }

  // Whether an MPS daemon serves this process's CUDA contexts: its pipe directory
  // ($CUDA_MPS_PIPE_DIRECTORY, else /tmp/nvidia-mps, as the CUDA runtime looks) holds its
  // control socket.
  static bool mpsServes() {
    const char* env = std::getenv("CUDA_MPS_PIPE_DIRECTORY");
    const std::string control = std::string(env && *env ? env : "/tmp/nvidia-mps") + "/control";
    struct stat st;
    return ::stat(control.c_str(), &st) == 0 && S_ISSOCK(st.st_mode);
  }

  // Waits, at most kDeviceDetachTimeout, until no live trainer maps the devices' memory:
  // CUDA leaves a cudaFree before the importer's cudaIpcCloseMemHandle undefined. The
  // workers are gone by now (stopWorkers); a trainer that still holds views is told in
  // the log, and the memory is freed anyway as the coordinator's exit would free it.
  void awaitDeviceDetach() noexcept {
    if (device_ptrs_.empty()) return;
    const uint64_t deadline =
        ipc::monotonicNs() +
        std::chrono::duration_cast<std::chrono::nanoseconds>(kDeviceDetachTimeout).count();
    int32_t pid = 0;
    while ((pid = c().device_trainer_pid.load(std::memory_order_acquire)) > 0 &&
           ipc::processAlive(pid)) {
      if (ipc::monotonicNs() >= deadline) {
        std::fprintf(stderr,
                     "shmgrad: trainer pid %d still maps the engine's device memory %.0f s "
                     "after the stop; freeing it now: that process's views of it are invalid "
                     "(close the client, and drop gradient_tensors()/parameter_tensors(), "
                     "before stopping the engine)\n",
                     pid, std::chrono::duration<double>(kDeviceDetachTimeout).count());
        return;
      }
      std::this_thread::sleep_for(kReadyPoll);
    }
  }

  void freeDevices() noexcept {
    for (const auto& [ordinal, ptr] : device_ptrs_) {
      const int code = cuda_->free(ordinal, ptr);
      if (code != 0) {
        std::fprintf(stderr, "shmgrad: freeing cuda:%d's buffers failed: %s\n", ordinal,
                     cuda_->describe(code).c_str());
      }
    }
    device_ptrs_.clear();
  }

  void installSignals() {
    struct sigaction sa;
    std::memset(&sa, 0, sizeof(sa));
    sa.sa_handler = onSignal;
    SHMGRAD_SYSCHECK(sigemptyset(&sa.sa_mask), "sigemptyset");
    for (int sig : {SIGTERM, SIGINT, SIGHUP}) {
      SHMGRAD_SYSCHECK(sigaction(sig, &sa, nullptr), "sigaction");
    }
    struct sigaction ignore;
    std::memset(&ignore, 0, sizeof(ignore));
    ignore.sa_handler = SIG_IGN;
    SHMGRAD_SYSCHECK(sigaction(SIGPIPE, &ignore, nullptr), "sigaction(SIGPIPE)");
  }

  // execv's argument vector over `args` (which must outlive it), NULL-terminated.
  static std::vector<char*> argvOf(std::vector<std::string>& args) {
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    return argv;
  }

  // Runs `shmgrad-worker describe PATH OUT` (fork + exec, bounded by the start-up
  // timeout) and reads what it wrote: the coordinator itself loads no model.
  ModelDescription describeWithWorker(const std::string& path) {
    SHMGRAD_CHECK(access(path.c_str(), R_OK) == 0, ErrorKind::kNotFound, "model file ", path,
                  " cannot be read (", detail::errnoText(),
                  "); save one with shmgrad.save_model(module, path)");
    char tmpl[] = "/tmp/shmgrad-describe-XXXXXX";
    const int fd = static_cast<int>(SHMGRAD_SYSCHECK(mkstemp(tmpl), "mkstemp"));
    SHMGRAD_SYSCHECK(close(fd), "close");
    const std::string out = tmpl;
    struct Unlink {
      std::string p;
      ~Unlink() { unlink(p.c_str()); }
    } remove_after{out};
    int pipefd[2];
    SHMGRAD_SYSCHECK(pipe2(pipefd, O_CLOEXEC), "pipe2");
    std::string bin = workerBinary();
    std::vector<std::string> args = {bin, "describe", path, out};
    std::vector<char*> argv = argvOf(args);
    const pid_t pid = static_cast<pid_t>(SHMGRAD_SYSCHECK(fork(), "fork"));
    if (pid == 0) {
      dup2(pipefd[1], STDERR_FILENO);
      execv(argv[0], argv.data());
      _exit(kExitExecFailed);
    }
    SHMGRAD_SYSCHECK(close(pipefd[1]), "close");
    // Its messages, until it exits (it writes little: an error, a warning).
    std::string text;
    const uint64_t deadline =
        ipc::monotonicNs() + static_cast<uint64_t>(opt_.startup_timeout * 1e9);
    SHMGRAD_SYSCHECK(fcntl(pipefd[0], F_SETFL, O_NONBLOCK), "fcntl(O_NONBLOCK)");
    auto drain = [&] {
      char buf[4096];
      long n;
      while ((n = read(pipefd[0], buf, sizeof(buf))) > 0) text.append(buf, static_cast<size_t>(n));
    };
    int status = 0;
    bool exited = false;
    while (!exited) {
      drain();
      exited = SHMGRAD_SYSCHECK(waitpid(pid, &status, WNOHANG), "waitpid") == pid;
      if (!exited && ipc::monotonicNs() > deadline) {
        SHMGRAD_SYSCHECK_OK(kill(pid, SIGKILL), "kill", ESRCH);
        SHMGRAD_SYSCHECK_OK(waitpid(pid, nullptr, 0), "waitpid", ECHILD);
        close(pipefd[0]);
        raise(ErrorKind::kTimeout, "describing the model ", path, " took more than ",
              opt_.startup_timeout, " s (--startup-timeout)");
      }
      if (!exited) std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    drain();
    close(pipefd[0]);
    while (!text.empty() && (text.back() == '\n' || text.back() == ' ')) text.pop_back();
    if (WIFEXITED(status) && WEXITSTATUS(status) == 0) return readModelFile(out);
    if (WIFEXITED(status) && WEXITSTATUS(status) == kExitDescribeRejected) {
      raise(ErrorKind::kInvalidArgument, text);
    }
    raise(ErrorKind::kWorkerFailed, "the worker program ", bin, " could not describe ", path, " (",
          describeExit(status), ")", text.empty() ? "" : ": ", text);
  }

  std::string workerBinary() const {
    if (!opt_.worker_binary.empty()) return opt_.worker_binary;
    char buf[PATH_MAX];
    const long n = SHMGRAD_SYSCHECK(readlink("/proc/self/exe", buf, sizeof(buf) - 1),
                                    "readlink(/proc/self/exe)");
    buf[n] = '\0';
    // The TorchScript worker is its own program, next to this one: the coordinator and
    // the CLI link no libtorch.
    std::string self = buf;
    return self.substr(0, self.rfind('/') + 1) + "shmgrad-worker";
  }

  // fork + exec: the coordinator may already run libtorch's thread pools, so the child
  // does nothing but async-signal-safe calls before exec (docs/DESIGN.md).
  void spawn(uint32_t slot) {
    ipc::WorkerRecord& w = h()->workers[slot];
    respawn_at_[slot] = 0;
    w.state.store(static_cast<uint32_t>(WorkerState::kStarting));
    w.error = 0;
    w.error_text[0] = '\0';
    w.busy_epoch.store(0);
    w.assigned_epoch.store(0);
    std::string bin = workerBinary();
    std::string slot_s = std::to_string(slot), parent_s = std::to_string(getpid());
    std::string threads_s = std::to_string(h()->threads_per_worker);
    std::vector<std::string> args =
        eager() ? std::vector<std::string>{opt_.python, "-m",   "shmgrad._eager_worker",
                                           opt_.name,   slot_s, parent_s}
                : std::vector<std::string>{bin, "run", opt_.name, slot_s, parent_s};
    std::vector<char*> argv = argvOf(args);
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
    const pid_t pid = static_cast<pid_t>(SHMGRAD_SYSCHECK(fork(), "fork"));
    if (pid == 0) {
      execve(argv[0], argv.data(), envp.data());
      _exit(kExitExecFailed);
    }
    w.pid.store(pid, std::memory_order_release);
  }

  // Start-up: until every worker is ready. Returns "" when they are, else why not.
  std::string waitReady() {
    const uint64_t deadline =
        ipc::monotonicNs() + static_cast<uint64_t>(opt_.startup_timeout * 1e9);
    for (;;) {
      uint32_t ready = 0;
      for (uint32_t i = 0; i < active_; ++i) {
        if (h()->workers[i].state.load() == static_cast<uint32_t>(WorkerState::kReady)) ++ready;
      }
      if (ready == active_) return "";
      int status = 0;
      const pid_t pid = reapOne(&status);
      if (pid > 0) {
        const int slot = slotOf(pid);
        const char* why = slot >= 0 && h()->workers[slot].error_text[0]
                              ? h()->workers[slot].error_text
                              : "see its output above";
        if (slot >= 0) h()->workers[slot].pid.store(0);
        return "worker " + std::to_string(slot) + " failed to start (" + describeExit(status) +
               "): " + why;
      }
      if (g_signal != 0) return "interrupted by a signal while the workers started";
      if (ipc::monotonicNs() > deadline) {
        return "workers not ready after " + std::to_string(opt_.startup_timeout) +
               " s (--startup-timeout)";
      }
      const uint32_t v = c().coordinator_wake.load();
      ipc::futexWait(&c().coordinator_wake, v, kReadyPoll);
    }
  }

  // waitpid(-1, WNOHANG), checked: the pid of a child that ended, 0 if none did.
  static pid_t reapOne(int* status) {
    const long pid = SHMGRAD_SYSCHECK_OK(waitpid(-1, status, WNOHANG), "waitpid", ECHILD);
    return pid > 0 ? static_cast<pid_t>(pid) : 0;
  }

  // kill(pid, SIGKILL), checked; a process that is already gone is fine.
  static void killWorker(pid_t pid) { SHMGRAD_SYSCHECK_OK(kill(pid, SIGKILL), "kill", ESRCH); }

  static std::string describeExit(int status) {
    if (WIFSIGNALED(status))
      return std::string("killed by signal ") + std::to_string(WTERMSIG(status));
    if (WIFEXITED(status)) {
      const int code = WEXITSTATUS(status);
      const char* meaning = code == config::kExitWorkerStartupFailed     ? " (start-up failed)"
                            : code == config::kExitWorkerCoordinatorGone ? " (coordinator gone)"
                            : code == config::kExitWorkerDeviceFault
                                ? " (a CUDA kernel fault left its context unusable)"
                            : code == kExitExecFailed ? " (could not exec the worker binary)"
                                                      : "";
      return "exit code " + std::to_string(code) + meaning;
    }
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
      replaceAbandoned();
      const bool growing = resize();
      const uint64_t due = respawnDue();
      uint32_t v = c().coordinator_wake.load(std::memory_order_acquire);
      if (g_signal != 0 || c().stop_requested.load() != 0) return;
      // While a grow waits for a retired worker to exit, poll its exit quickly; a restart
      // that backs off is due at `due`.
      std::chrono::nanoseconds slice = growing ? kGrowPoll : kSuperviseSlice;
      if (due != 0) {
        const uint64_t now = ipc::monotonicNs();
        slice = std::min(slice, std::chrono::nanoseconds(due > now ? due - now : 0));
      }
      ipc::futexWait(&c().coordinator_wake, v, slice);
    }
  }

  // A worker that died is replaced at once. If it took part in the step in flight, that
  // step is aborted so the trainer re-runs it (the replacement computes its shard again).
  void reap() {
    int status = 0;
    pid_t pid;
    while ((pid = reapOne(&status)) > 0) {
      int slot = slotOf(pid);
      if (slot < 0) continue;
      ipc::WorkerRecord& w = h()->workers[slot];
      w.pid.store(0);
      const uint32_t was = w.state.load();
      const bool retired = was == static_cast<uint32_t>(WorkerState::kRetired);
      w.state.store(static_cast<uint32_t>(retired ? WorkerState::kExited : WorkerState::kDead),
                    std::memory_order_release);
      const uint32_t e = c().step_epoch.load(std::memory_order_acquire);
      if (e != 0 && w.assigned_epoch.load() == e) ipc::abortStep(c(), e);
      if (retired) continue;
      if (!opt_.quiet) {
        std::fprintf(stderr, "shmgrad: worker %d (pid %d) died (%s); starting a replacement\n",
                     slot, pid, describeExit(status).c_str());
      }
      w.restarts.fetch_add(1);
      c().worker_restarts.fetch_add(1);
      // Died before it was ready: count the failures in a row, and back off after the first.
      failed_starts_[slot] =
          was == static_cast<uint32_t>(WorkerState::kStarting) ? failed_starts_[slot] + 1 : 0;
      const uint64_t pause = restartPause(failed_starts_[slot]);
      if (pause == 0) {
        spawn(static_cast<uint32_t>(slot));
        continue;
      }
      respawn_at_[slot] = ipc::monotonicNs() + pause;
      std::fprintf(stderr,
                   "shmgrad: worker %d failed to start %u times in a row (last: %s); next try "
                   "in %.1f s\n",
                   slot, failed_starts_[slot], describeExit(status).c_str(), pause / 1e9);
    }
  }

  // The pause before restarting a worker that died before it was ready, `failures` times
  // in a row: none the first time, then kRestartBackoffFirstNs doubling to the maximum.
  static uint64_t restartPause(uint32_t failures) {
    if (failures < 2) return 0;
    uint64_t pause = kRestartBackoffFirstNs;
    for (uint32_t i = 2; i < failures && pause < kRestartBackoffMaxNs; ++i) pause *= 2;
    return std::min(pause, kRestartBackoffMaxNs);
  }

  // Starts the backed-off restarts that are due; returns when the next one is (0: none).
  // A slot retired by a shrink meanwhile is not restarted (resize clears its time).
  uint64_t respawnDue() {
    const uint64_t now = ipc::monotonicNs();
    uint64_t next = 0;
    for (uint32_t i = 0; i < active_; ++i) {
      if (respawn_at_[i] == 0) continue;
      if (now >= respawn_at_[i]) {
        spawn(i);
      } else if (next == 0 || respawn_at_[i] < next) {
        next = respawn_at_[i];
      }
    }
    return next;
  }

  // A step the trainer gave up on at its timeout (abandon_epoch) leaves its participants
  // computing it, or hung in it for good (a dataset read, a collective or a CUDA kernel
  // that never returns), or never started by one that is stopped. Each worker held up by
  // such a step (ipc::heldByAbandoned) ipc::kAbandonGraceNs after this loop first saw it
  // so is killed, and reap() replaces it, so that the engine serves the next call instead
  // of waiting for it forever. A step aborted because a worker died is not abandoned: the
  // trainer waits for its other participants (within its timeout) and re-runs it.
  void replaceAbandoned() {
    const uint32_t abandoned = c().abandon_epoch.load(std::memory_order_acquire);
    const uint64_t now = ipc::monotonicNs();
    for (uint32_t i = 0; i < h()->num_slots; ++i) {
      const ipc::WorkerRecord& w = h()->workers[i];
      const int pid = w.pid.load();
      if (pid <= 0 || !ipc::heldByAbandoned(w, abandoned)) {
        abandoned_since_[i] = 0;
        continue;
      }
      if (abandoned_since_[i] == 0) {
        abandoned_since_[i] = now;
      } else if (now - abandoned_since_[i] > ipc::kAbandonGraceNs && isChild(pid)) {
        std::fprintf(stderr,
                     "shmgrad: worker %u (pid %d) is still held up by step %u, which the trainer "
                     "abandoned at its timeout, %.0f s later; killing it (a replacement starts)\n",
                     i, pid, abandoned, ipc::kAbandonGraceNs / 1e9);
        killWorker(pid);
        abandoned_since_[i] = now;  // once per grace period at most
      }
    }
  }

  // Whether pid is a child of this process not yet reaped: a pid read from the segment is
  // checked before a signal goes to it.
  static bool isChild(pid_t pid) {
    siginfo_t info{};
    return waitid(P_PID, static_cast<id_t>(pid), &info, WEXITED | WNOHANG | WNOWAIT) == 0;
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
        respawn_at_[i] = 0;  // a backed-off restart of this slot is not wanted any more
      }
      ipc::wakeWorkers(c());
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
    ipc::wakeWorkers(c());
    const int pid = w.pid.load();
    if (pid > 0 && w.busy_epoch.load() == 0 &&
        ipc::monotonicNs() - retired_ns_[slot] > kRetireGraceNs) {
      std::fprintf(stderr,
                   "shmgrad: retired worker %u (pid %d) did not exit within %.0f s; killing it "
                   "so its slot can be reused\n",
                   slot, pid, kRetireGraceNs / 1e9);
      killWorker(pid);
      retired_ns_[slot] = ipc::monotonicNs();  // once per grace period at most
    }
  }

  void stopWorkers() {
    const uint64_t deadline = ipc::monotonicNs() + kStopGraceNs;
    for (;;) {
      bool any = false;
      for (uint32_t i = 0; i < h()->num_slots; ++i) {
        const int pid = h()->workers[i].pid.load();
        if (pid <= 0) continue;
        int status;
        const long reaped = SHMGRAD_SYSCHECK_OK(waitpid(pid, &status, WNOHANG), "waitpid", ECHILD);
        if (reaped == pid || reaped < 0) {  // exited now, or not our child any more
          h()->workers[i].pid.store(0);
          h()->workers[i].state.store(static_cast<uint32_t>(WorkerState::kExited));
        } else {
          any = true;
        }
      }
      if (!any) return;
      if (ipc::monotonicNs() > deadline) break;
      std::this_thread::sleep_for(kStopPoll);
    }
    for (uint32_t i = 0; i < h()->num_slots; ++i) {
      const int pid = h()->workers[i].pid.load();
      if (pid <= 0) continue;
      killWorker(pid);
      SHMGRAD_SYSCHECK_OK(waitpid(pid, nullptr, 0), "waitpid", ECHILD);
      h()->workers[i].pid.store(0);
      h()->workers[i].state.store(static_cast<uint32_t>(WorkerState::kExited));
    }
  }

  // --owned-dir: the files a launcher made for this engine (the eager job, the
  // parameters' holder) go with it. Only plain files directly inside are removed, and only
  // from a directory of this uid opened without following a symbolic link: where the
  // directory's parent lets others rename entries (a world-writable folder without the
  // sticky bit), a link swapped in for it must not make us empty the folder it points to.
  void removeOwnedDir() {
    if (opt_.owned_dir.empty()) return;
    const int dir_fd =
        open(opt_.owned_dir.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (dir_fd < 0) {
      if (errno != ENOENT) {
        std::fprintf(stderr, "shmgrad: not removing %s: %s (a symbolic link is not followed)\n",
                     opt_.owned_dir.c_str(), detail::errnoText().c_str());
      }
      return;
    }
    struct stat st {};
    if (fstat(dir_fd, &st) != 0 || st.st_uid != getuid()) {
      std::fprintf(stderr, "shmgrad: not removing %s: it belongs to uid %u, not to this engine's\n",
                   opt_.owned_dir.c_str(), static_cast<unsigned>(st.st_uid));
      close(dir_fd);
      return;
    }
    DIR* d = fdopendir(dir_fd);  // owns dir_fd from here
    if (d == nullptr) close(dir_fd);
    if (d != nullptr) {
      while (dirent* ent = readdir(d)) {
        if (ent->d_type != DT_REG) continue;
        if (unlinkat(dirfd(d), ent->d_name, 0) != 0 && errno != ENOENT) {
          std::fprintf(stderr, "shmgrad: could not remove %s/%s: %s\n", opt_.owned_dir.c_str(),
                       ent->d_name, detail::errnoText().c_str());
        }
      }
      closedir(d);
    }
    if (rmdir(opt_.owned_dir.c_str()) != 0 && errno != ENOENT) {
      std::fprintf(stderr, "shmgrad: could not remove %s: %s\n", opt_.owned_dir.c_str(),
                   detail::errnoText().c_str());
    }
  }

  // Stops every worker (a bounded wait, then SIGKILL) and removes the segment. Never
  // throws before the segment is gone: a failing system call is logged and the
  // shutdown goes on.
  void shutdown() {
    c().engine_state.store(static_cast<uint32_t>(EngineState::kStopping),
                           std::memory_order_release);
    c().stop_requested.store(1);
    ipc::wakeWorkers(c());
    ipc::futexWake(&c().compute_barrier);
    ipc::futexWake(&c().reduce_barrier);
    ipc::bumpAndWake(&c().bucket_progress);
    ipc::bumpAndWake(&c().trainer_wake);
    try {
      stopWorkers();
    } catch (const Error& e) {
      std::fprintf(stderr, "shmgrad: while stopping the workers: %s\n", e.what());
    }
    awaitDeviceDetach();
    freeDevices();
    ipc::Segment::remove(opt_.name);
    removeOwnedDir();
    if (!opt_.quiet) {
      std::printf("shmgrad: engine '%s' stopped after %" PRIu64 " steps; segment removed\n",
                  opt_.name.c_str(), c().steps_served.load());
      std::fflush(stdout);
    }
  }

  ServeOptions opt_;
  std::unique_ptr<ipc::Segment> seg_;
  std::shared_ptr<gpu::CudaLibrary> cuda_;             // loaded for --devices only
  std::vector<std::pair<int, uint64_t>> device_ptrs_;  // (ordinal, allocation) to free
  uint32_t active_ = 0;
  uint64_t retired_ns_[ipc::kMaxWorkers] = {};       // when each slot was last retired
  uint64_t abandoned_since_[ipc::kMaxWorkers] = {};  // held up by an abandoned step since
  uint32_t failed_starts_[ipc::kMaxWorkers] = {};    // deaths in a row before ready
  uint64_t respawn_at_[ipc::kMaxWorkers] = {};       // a backed-off restart is due (0: none)
};

}  // namespace

namespace {
std::string jsonString(const std::string& text) {
  std::string out = "\"";
  for (unsigned char ch : text) {
    switch (ch) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\t':
        out += "\\t";
        break;
      default:
        if (ch < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof(buf), "\\u%04x", ch);
          out += buf;
        } else {
          out += static_cast<char>(ch);
        }
    }
  }
  return out + "\"";
}
}  // namespace

void writeServeReport(int fd, const std::string& event, const std::string& kind,
                      const std::string& message) {
  if (fd < 0) return;
  std::string line = "{\"event\":" + jsonString(event) + ",\"pid\":" + std::to_string(getpid());
  if (!kind.empty()) line += ",\"kind\":" + jsonString(kind);
  if (!message.empty()) line += ",\"message\":" + jsonString(message);
  line += "}\n";
  // One line, once: the reader (the launcher) may be gone, which is not an error here
  // (SIGPIPE is ignored by serve, so a closed pipe is EPIPE).
  size_t done = 0;
  while (done < line.size()) {
    const long n = SHMGRAD_SYSCHECK_OK(write(fd, line.data() + done, line.size() - done),
                                       "write(--status-fd)", EPIPE);
    if (n < 0) return;
    done += static_cast<size_t>(n);
  }
}

int serve(const ServeOptions& options) {
  Coordinator c(options);
  return c.run();
}

}  // namespace shmgrad::engine
