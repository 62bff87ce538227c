// The engine's defaults, the limits that are not part of the segment layout (those are in
// ipc/layout.h), and every environment variable it reads, each written once. The CLI's
// help, the launcher and the Python API take their defaults from here (Python through
// shmgrad._C.DEFAULTS and shmgrad._C.TUNABLES); docs/DESIGN.md's table of tunables is
// checked against kTunables by a test.
#pragma once

#include <cstdint>

namespace shmgrad::config {

// -- defaults ---------------------------------------------------------------------------
constexpr int64_t kDefaultMaxBatch = 65536;       // examples in one step
constexpr uint64_t kDefaultInputCapacityMb = 64;  // explicit-batch inputs, MiB
constexpr double kDefaultStartupTimeoutS = 120;   // every worker has loaded the model
constexpr uint32_t kDefaultThreadsPerWorker = 1;  // intra-op threads of a worker
constexpr double kDefaultResizeTimeoutS = 120;    // resize: the new workers are ready
// `shmgrad stop`, Python's engine stop: the engine is gone (its segment removed) within this,
// else serve is killed (the coordinator gives its workers 5 s, then reaps and unlinks).
constexpr double kDefaultStopTimeoutS = 30;
// Placement probe (serve --workers auto, engine/placement.h): rounds over the candidates;
// a visit settles (untimed steps: OpenMP threads of a worker whose thread count went down
// spin on for milliseconds), then is timed, each phase at least one step and this long;
// the probe ends early once every candidate has a timed step and the budget is spent.
// Steps long enough to give a visit one sample get more rounds, until every candidate has
// kPlacementMinSamples: a median of 3 such steps chose the slower of two placements 11 %
// apart once in 4 probes (CNN b512, 2 cores, 2026-12-07).
constexpr uint32_t kPlacementProbeRounds = 3;
constexpr uint32_t kPlacementMinSamples = 8;
constexpr double kPlacementProbeBudgetS = 10;
constexpr double kPlacementSettleS = 0.05;
constexpr double kPlacementTimedS = 0.05;
// Then the kept placement is watched: windows of at least 16 steps and 2 s (doubling after
// each recheck); two windows in a row whose median per example is more than 10 % slower
// than the fastest other candidate's in the probe run the probe again, at most 3 times.
// On the 2-vCPU AMD guest a 2x1 step the probe timed at 0.97 ms ran at 3.0 ms in later
// blocks (2026-12-07): the machine has fast and slow phases, and a probe in a fast one
// keeps what a slow one loses with. Two windows: the Intel guest has slow seconds for
// every placement (a CNN step at 4.1 then 6.4 ms, fixed to 2x1), which a recheck would
// not change.
constexpr uint32_t kPlacementWatchSamples = 16;
constexpr double kPlacementWatchS = 2;
constexpr double kPlacementRecheckMargin = 0.1;
constexpr uint32_t kPlacementSlowWindows = 2;
constexpr uint32_t kPlacementMaxRechecks = 3;

// -- sizes derived from the options -----------------------------------------------------
// Explicit-batch targets: room for one 8-byte target (an int64 label) per example of
// max_batch, and at least 1 MiB (a few float32 regression targets per example).
constexpr uint64_t kTargetBytesPerExample = 8;
constexpr uint64_t kMinTargetBytes = uint64_t{1} << 20;
constexpr uint64_t targetBytesFor(int64_t max_batch) {
  const uint64_t per_batch = static_cast<uint64_t>(max_batch) * kTargetBytesPerExample;
  return per_batch > kMinTargetBytes ? per_batch : kMinTargetBytes;
}
// The largest explicit-batch capacity a segment accepts (16 TiB): keeps every offset sum
// far from overflow.
constexpr uint64_t kMaxCapacityBytes = uint64_t{1} << 44;

// -- exit codes -------------------------------------------------------------------------
// A process that could not exec its program exits with this, as a shell reports a command
// it cannot run (the coordinator's forked worker, `shmgrad`'s exec of Python).
constexpr int kExitCannotExec = 127;
// `shmgrad-worker describe MODEL OUT` exits with this when the model cannot be used (not
// TorchScript, a torch that cannot read it, a parameter that is not float32); its message
// on stderr is then the error `shmgrad serve` reports.
constexpr int kExitDescribeRejected = 2;
// A worker process's exit codes (worker/step_protocol.h exits with them; the coordinator
// names them in its log).
constexpr int kExitWorkerStopped = 0;          // stop request, retired slot, engine stopping
constexpr int kExitWorkerCoordinatorGone = 2;  // the parent (coordinator) died
constexpr int kExitWorkerStartupFailed = 3;    // could not map the segment or build the model
// A sticky CUDA error (a kernel fault): the process's context is unusable, so every later
// step would fail; the worker exits after reporting the step's error, and is replaced.
constexpr int kExitWorkerDeviceFault = 4;

// -- environment tunables (NCCL_PARAM's model: declared once, with the default) ------------
struct Tunable {
  const char* name;         // the environment variable
  const char* value;        // the value that applies when it is unset, as the environment would
                            // give it; nullptr where the default is not one value (then: default)
  const char* default_doc;  // the default in words, where value is nullptr
  const char* meaning;
};

inline constexpr Tunable kTunables[] = {
    {"SHMGRAD_SPIN_US", "1000", nullptr,
     "microseconds a trainer spins before it sleeps on a futex while workers compute (0 to "
     "10000; the workers' spin adapts to how long they waited before)"},
    {"SHMGRAD_BUCKET_KB", "1024", nullptr,
     "KiB of gradient per bucket that workers reduce while the slowest still computes "
     "(cut at parameters; at most 16 buckets; 0: reduce after every backward, in one slice "
     "each)"},
    {"SHMGRAD_FASHION_MNIST_DIR", "/usr/share/datasets/fashion-mnist", nullptr,
     "the folder of the Fashion-MNIST files (dataset='fashion-mnist')"},
    {"SHMGRAD_PYTHON", "python3", nullptr,
     "the interpreter `shmgrad` runs for serve --eager, stress and bench, and eager workers"},
    {"SHMGRAD_BINARY", nullptr, "the shmgrad program inside the package",
     "the `shmgrad` program the Python package starts engines with"},
    {"SHMGRAD_REDUCE_BENCH", nullptr, "the reduce_bench program inside the package",
     "the reduction benchmark `shmgrad bench` runs"},
    {"SHMGRAD_STRESS_DEBUG", nullptr, "unset",
     "`shmgrad stress` prints the engine's status at a hang"},
    {"SHMGRAD_CUDA_LIBRARY", nullptr, "libshmgrad_cuda.so inside the package",
     "the CUDA path's library an engine with devices loads (docs/GPU.md)"},
    {"SHMGRAD_BACKEND_STAGING_MB", nullptr, "64 MiB over the ranks, 0.25 to 8 MiB a buffer",
     "the `shmgrad` torch.distributed backend's staging buffer per rank (two each)"},
    {"SHMGRAD_DIRECT_LINEAR", "1", nullptr,
     "eager and TorchScript workers on the host: nn.Linear layers compute their weight and "
     "bias gradients straight into the gradient slot (worker/direct_linear.h; 0: computed "
     "apart and copied in)"},
    {"SHMGRAD_PLAIN_PASS", "1", nullptr,
     "eager workers on the host: a pass that is loss(model(inputs), targets) runs its "
     "batch, backward and loss value in C++, calling only the model and the loss (0: the "
     "whole pass in Python)"},
    {"SHMGRAD_IN_TRAINER", "1", nullptr,
     "workers=\"auto\" on the host: the placement probe also times the trainer computing "
     "each step itself (0: workers only)"},
    {"SHMGRAD_BACKEND_ARENA_MB", nullptr, "4 GiB of address space per rank, 64 GiB over the ranks",
     "the `shmgrad` backend's arena per rank, where DDP's gradient buckets are allocated and "
     "all-reduced in place (0: none; memory is taken only for what is allocated)"},
    {"SHMGRAD_REQUIRE_GPU", nullptr, "unset",
     "the test suite fails a GPU case that would skip (tools/device-check --run --gpu sets it)"},
    {"SHMGRAD_TEST_FULL", nullptr, "unset",
     "the test suite also runs its long tests, marked full (tools/test.sh --full sets it)"},
};

// The value of a declared tunable from the environment, or nullptr when it is unset.
// Reading a name that kTunables does not declare is a bug: it throws.
const char* tunable(const char* name);

// The environment's value of a declared tunable when it is set and not empty, else its
// declared value. A tunable declared without a value is a bug here: it throws.
const char* tunableValue(const char* name);

// A tunable's value as a number: true, with *value set, when the whole text is one (each
// reader then checks its range and names the fix).
bool parseNumber(const char* text, double* value);

}  // namespace shmgrad::config
