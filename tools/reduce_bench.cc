// reduce_bench: the bandwidth of shmgrad's in-place slot reduction, against memcpy
// measured in the same run with the same processes.
//
// N processes (fork) share one anonymous MAP_SHARED mapping holding N gradient slots of
// P floats, the reduced buffer and a copy target. Every repetition, each process reduces
// its ipc::sliceBounds slice of the N slots into the reduced buffer with
// ipc::reduceSlice, exactly as the engine's workers do after backward; a repetition takes
// from the first process's start to the last one's end. Bandwidth counts the bytes the
// reduction must move: N slots read plus the reduced buffer written, (N + 1) * P * 4.
// memcpy is measured the same way: each process copies its slice of one slot into the
// copy target (2 * P * 4 bytes read plus written). Prints one JSON object.
//
// usage: reduce_bench [--workers N] [--floats P] [--repeats R] [--warmup W] [--timeout S]
#include <pthread.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "ipc/error.h"
#include "ipc/reduce.h"

namespace {

constexpr uint32_t kMaxProcs = 64;
constexpr uint32_t kMaxRepeats = 100000;

// pthread calls return their error number instead of setting errno: as a system call's
// result for SHMGRAD_SYSCHECK (-1 with errno set, or 0).
long pthreadResult(int rc) {
  if (rc == 0 || rc == PTHREAD_BARRIER_SERIAL_THREAD) return 0;
  errno = rc;
  return -1;
}

uint64_t nowNs() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<uint64_t>(ts.tv_sec) * 1000000000ull + static_cast<uint64_t>(ts.tv_nsec);
}

// The control block at the start of the shared mapping.
struct Control {
  pthread_barrier_t barrier;
};

struct Bench {
  uint32_t n = 2;
  uint64_t p = 16777216;
  uint32_t repeats = 20;
  uint32_t warmup = 3;
  uint32_t timeout_s = 300;
  // Laid out in the shared mapping:
  Control* control = nullptr;
  uint64_t* start_ns = nullptr;  // [2][repeats][n]: reduce, then memcpy
  uint64_t* end_ns = nullptr;
  float* slots = nullptr;    // n * p (each slot padded to a multiple of 16 floats)
  float* reduced = nullptr;  // p
  float* copy = nullptr;     // p
  uint64_t stride = 0;       // floats between slots
};

uint64_t alignUp(uint64_t x, uint64_t a) { return (x + a - 1) / a * a; }

// One process's part: the same loop the engine's workers run after backward.
void runRank(const Bench& b, uint32_t rank) {
  uint64_t lo, hi;
  shmgrad::ipc::sliceBounds(b.p, b.n, rank, &lo, &hi);
  const float* ins[kMaxProcs];
  for (uint32_t k = 0; k < b.n; ++k) ins[k] = b.slots + k * b.stride;
  // First touch of this rank's pages of the outputs (the slots were filled by the parent).
  if (hi > lo) {
    std::memset(b.reduced + lo, 0, (hi - lo) * sizeof(float));
    std::memset(b.copy + lo, 0, (hi - lo) * sizeof(float));
  }
  for (int kind = 0; kind < 2; ++kind) {
    for (uint32_t i = 0; i < b.warmup + b.repeats; ++i) {
      SHMGRAD_SYSCHECK(pthreadResult(pthread_barrier_wait(&b.control->barrier)),
                       "pthread_barrier_wait");
      const uint64_t t0 = nowNs();
      if (kind == 0) {
        shmgrad::ipc::reduceSlice(b.reduced, ins, b.n, lo, hi, 1.0f);
      } else if (hi > lo) {
        std::memcpy(b.copy + lo, ins[0] + lo, (hi - lo) * sizeof(float));
      }
      const uint64_t t1 = nowNs();
      if (i >= b.warmup) {
        const uint64_t at = (static_cast<uint64_t>(kind) * b.repeats + (i - b.warmup)) * b.n + rank;
        b.start_ns[at] = t0;
        b.end_ns[at] = t1;
      }
    }
  }
  SHMGRAD_SYSCHECK(pthreadResult(pthread_barrier_wait(&b.control->barrier)),
                   "pthread_barrier_wait");
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t m = v.size() / 2;
  return v.size() % 2 ? v[m] : 0.5 * (v[m - 1] + v[m]);
}

}  // namespace

int runBench(int argc, char** argv);

int main(int argc, char** argv) {
  try {
    return runBench(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "reduce_bench: %s\n", e.what());
    return 1;
  }
}

int runBench(int argc, char** argv) {
  Bench b;
  CLI::App app{
      "Measures shmgrad's shared-memory slot reduction (ipc::reduceSlice over "
      "ipc::sliceBounds slices, one forked process per slice) and memcpy with the same "
      "processes and the same mapping; prints JSON with median, min and max GB/s.",
      "reduce_bench"};
  app.add_option("--workers", b.n, "processes, and slots reduced")
      ->check(CLI::Range(1u, kMaxProcs))
      ->capture_default_str();
  app.add_option("--floats", b.p, "floats per slot (64 MiB by default, larger than most L3s)")
      ->check(CLI::Range(uint64_t{16}, uint64_t{1} << 32))
      ->capture_default_str();
  app.add_option("--repeats", b.repeats, "timed repetitions of each")
      ->check(CLI::Range(1u, kMaxRepeats))
      ->capture_default_str();
  app.add_option("--warmup", b.warmup, "untimed repetitions first")
      ->check(CLI::Range(0u, 1000u))
      ->capture_default_str();
  app.add_option("--timeout", b.timeout_s, "every process is killed after this many seconds")
      ->check(CLI::Range(1u, 86400u))
      ->capture_default_str();
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const int code = app.exit(e);  // prints the help, or the error and the usage
    return code == 0 ? 0 : 2;
  }

  // Layout: control | times | slots | reduced | copy, each part 4 KiB-aligned.
  b.stride = alignUp(b.p, 1024);  // keeps every slot page-aligned
  const uint64_t times = 2ull * b.repeats * b.n * sizeof(uint64_t);
  const uint64_t off_start = 4096;
  const uint64_t off_end = alignUp(off_start + times, 4096);
  const uint64_t off_slots = alignUp(off_end + times, 4096);
  const uint64_t off_reduced = off_slots + b.n * b.stride * sizeof(float);
  const uint64_t off_copy = off_reduced + b.stride * sizeof(float);
  const uint64_t total = off_copy + b.stride * sizeof(float);
  void* base = mmap(nullptr, total, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (base == MAP_FAILED) {
    std::fprintf(stderr, "reduce_bench: cannot map %llu bytes: %s\n",
                 static_cast<unsigned long long>(total), std::strerror(errno));
    return 1;
  }
  char* c = static_cast<char*>(base);
  b.control = reinterpret_cast<Control*>(c);
  b.start_ns = reinterpret_cast<uint64_t*>(c + off_start);
  b.end_ns = reinterpret_cast<uint64_t*>(c + off_end);
  b.slots = reinterpret_cast<float*>(c + off_slots);
  b.reduced = reinterpret_cast<float*>(c + off_reduced);
  b.copy = reinterpret_cast<float*>(c + off_copy);

  pthread_barrierattr_t attr;
  SHMGRAD_SYSCHECK(pthreadResult(pthread_barrierattr_init(&attr)), "pthread_barrierattr_init");
  SHMGRAD_SYSCHECK(pthreadResult(pthread_barrierattr_setpshared(&attr, PTHREAD_PROCESS_SHARED)),
                   "pthread_barrierattr_setpshared");
  SHMGRAD_SYSCHECK(pthreadResult(pthread_barrier_init(&b.control->barrier, &attr, b.n)),
                   "pthread_barrier_init");
  SHMGRAD_SYSCHECK(pthreadResult(pthread_barrierattr_destroy(&attr)),
                   "pthread_barrierattr_destroy");
  // Gradient-like values in every slot (this also faults their pages in).
  for (uint32_t k = 0; k < b.n; ++k) {
    float* s = b.slots + k * b.stride;
    for (uint64_t i = 0; i < b.p; ++i)
      s[i] = static_cast<float>((i * 2654435761u + k) % 1000) * 1e-3f - 0.5f;
  }

  alarm(b.timeout_s);  // bounded: a stuck barrier ends the run
  std::vector<pid_t> kids;
  for (uint32_t r = 1; r < b.n; ++r) {
    pid_t pid = fork();
    if (pid < 0) {
      std::fprintf(stderr, "reduce_bench: fork failed: %s\n", std::strerror(errno));
      for (pid_t k : kids) SHMGRAD_SYSCHECK_OK(kill(k, SIGKILL), "kill", ESRCH);
      for (pid_t k : kids) SHMGRAD_SYSCHECK_OK(waitpid(k, nullptr, 0), "waitpid", ECHILD);
      return 1;
    }
    if (pid == 0) {
      // Never outlive the parent (it may be killed while we wait at a barrier), nor hang.
      if (prctl(PR_SET_PDEATHSIG, SIGKILL) != 0 || getppid() == 1) _exit(1);
      alarm(b.timeout_s);
      runRank(b, r);
      _exit(0);
    }
    kids.push_back(pid);
  }
  runRank(b, 0);
  bool failed = false;
  for (pid_t k : kids) {
    int st = 0;
    const long reaped = SHMGRAD_SYSCHECK(waitpid(k, &st, 0), "waitpid");
    if (reaped != k || !WIFEXITED(st) || WEXITSTATUS(st) != 0) failed = true;
  }
  if (failed) {
    std::fprintf(stderr, "reduce_bench: a worker process failed\n");
    return 1;
  }

  // Check the reduction once: the reduced buffer is the sum of the slots.
  double max_err = 0;
  for (uint64_t i = 0; i < b.p; i += 997) {
    double want = 0;
    for (uint32_t k = 0; k < b.n; ++k) want += b.slots[k * b.stride + i];
    max_err = std::max(max_err, std::abs(want - static_cast<double>(b.reduced[i])));
  }
  const bool correct =
      max_err < 1e-4 * b.n && std::memcmp(b.copy, b.slots, b.p * sizeof(float)) == 0;

  const double reduce_bytes = static_cast<double>(b.n + 1) * b.p * sizeof(float);
  const double copy_bytes = 2.0 * b.p * sizeof(float);
  std::vector<double> gbps[2], secs[2];
  for (int kind = 0; kind < 2; ++kind) {
    for (uint32_t i = 0; i < b.repeats; ++i) {
      uint64_t lo = UINT64_MAX, hi = 0;
      for (uint32_t r = 0; r < b.n; ++r) {
        const uint64_t at = (static_cast<uint64_t>(kind) * b.repeats + i) * b.n + r;
        lo = std::min(lo, b.start_ns[at]);
        hi = std::max(hi, b.end_ns[at]);
      }
      const double s = std::max<uint64_t>(hi - lo, 1) / 1e9;
      secs[kind].push_back(s);
      gbps[kind].push_back((kind == 0 ? reduce_bytes : copy_bytes) / s / 1e9);
    }
  }
  SHMGRAD_SYSCHECK(pthreadResult(pthread_barrier_destroy(&b.control->barrier)),
                   "pthread_barrier_destroy");
  SHMGRAD_SYSCHECK(munmap(base, total), "munmap");

  auto mm = [](const std::vector<double>& v, bool lo) {
    return lo ? *std::min_element(v.begin(), v.end()) : *std::max_element(v.begin(), v.end());
  };
  const double red = median(gbps[0]), cpy = median(gbps[1]);
  std::printf(
      "{\"workers\": %u, \"floats\": %llu, \"repeats\": %u, \"warmup\": %u, "
      "\"reduce_bytes\": %.0f, \"memcpy_bytes\": %.0f, "
      "\"reduce_seconds_median\": %.9f, \"memcpy_seconds_median\": %.9f, "
      "\"reduce_gbps_median\": %.4f, \"reduce_gbps_min\": %.4f, \"reduce_gbps_max\": %.4f, "
      "\"memcpy_gbps_median\": %.4f, \"memcpy_gbps_min\": %.4f, \"memcpy_gbps_max\": %.4f, "
      "\"ratio\": %.4f, \"correct\": %s}\n",
      b.n, static_cast<unsigned long long>(b.p), b.repeats, b.warmup, reduce_bytes, copy_bytes,
      median(secs[0]), median(secs[1]), red, mm(gbps[0], true), mm(gbps[0], false), cpy,
      mm(gbps[1], true), mm(gbps[1], false), cpy > 0 ? red / cpy : 0.0, correct ? "true" : "false");
  return correct ? 0 : 1;
}
