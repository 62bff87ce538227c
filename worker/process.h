// What every worker process does around its compute, whatever computes its shards (the
// TorchScript replica in worker_loop.cc, or an eager Python module through
// python/worker_binding.cc): die with the coordinator, keep freed memory in the heap, and
// the engine's thread settings. Written once for both kinds of worker (and the next).
// Header only: each user already links libtorch.
#pragma once

#include <ATen/Parallel.h>
#include <malloc.h>
#include <signal.h>
#include <sys/prctl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <limits>

#include "ipc/error.h"
#include "ipc/layout.h"

namespace shmgrad::worker {

// libtorch has no caching allocator on the CPU: every step frees and re-allocates its
// activations. glibc would hand large freed blocks back to the kernel (brk, munmap) and
// fault them in again, zeroed, on the next step: system calls and page faults in the hot
// path. Workers keep freed memory in the heap instead and hold their peak step memory
// (bounded by max_examples_per_pass), as a caching allocator would. Any process can have
// the same settings from glibc's environment variables (shmgrad.heap_environment()).
struct HeapSetting {
  int param;        // mallopt's
  const char* env;  // glibc's variable for the same setting, read at process start
  int value;
};
inline constexpr HeapSetting kHeapSettings[] = {
    {M_MMAP_MAX, "MALLOC_MMAP_MAX_", 0},
    {M_TRIM_THRESHOLD, "MALLOC_TRIM_THRESHOLD_", std::numeric_limits<int>::max()},
    {M_TOP_PAD, "MALLOC_TOP_PAD_", 16 << 20},
};

// Under AddressSanitizer or ThreadSanitizer their allocator replaces glibc's, and mallopt
// does not apply (it returns 0): the sanitizer builds skip it.
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
inline constexpr bool kGlibcAllocator = false;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
inline constexpr bool kGlibcAllocator = false;
#else
inline constexpr bool kGlibcAllocator = true;
#endif
#else
inline constexpr bool kGlibcAllocator = true;
#endif

inline void keepFreedMemory() {
  if (!kGlibcAllocator) return;
  for (const HeapSetting& s : kHeapSettings) {
    // mallopt returns 1 on success and 0 (errno unset) on a bad parameter.
    SHMGRAD_SYSCHECK(mallopt(s.param, s.value) == 1 ? 0 : (errno = EINVAL, -1), s.env);
  }
}

// Dies with the coordinator (SIGKILL when it exits). False when it is gone already: the
// getppid() check covers the race in which it died before the prctl.
inline bool dieWithParent(int parent_pid) {
  SHMGRAD_SYSCHECK(prctl(PR_SET_PDEATHSIG, SIGKILL), "prctl(PR_SET_PDEATHSIG)");
  return getppid() == parent_pid;
}

// The engine's threads_per_worker intra-op threads, and one inter-op thread: the worker's
// parallelism is the engine's processes, not a second pool.
inline void configureThreads(uint32_t threads) {
  at::set_num_threads(static_cast<int>(std::max<uint32_t>(1, threads)));
  try {
    at::set_num_interop_threads(1);
  } catch (const std::exception&) {
    // Already set (the pool started): harmless.
  }
}

// A step's intra-op threads (Shard::threads, the trainer's placement; 0: as the engine
// started the worker), set only when they change: at most once per step of a placement
// probe, never in a step whose placement is settled.
class StepThreads {
 public:
  explicit StepThreads(uint32_t started)
      : started_(std::max<uint32_t>(1, started)), current_(started_) {}
  void apply(uint32_t threads) {
    const uint32_t want = ipc::stepThreads(threads, started_);
    if (want == current_) return;
    at::set_num_threads(static_cast<int>(want));
    current_ = want;
  }

 private:
  uint32_t started_, current_;
};

// The in-trainer placement's threads (Trainer::setInTrainer): fn runs on `threads` intra-op
// threads (0: as the process has them), and the process has its own again afterwards, also
// when fn throws. Both kinds of in-trainer compute (eager and TorchScript) use it.
template <typename Fn>
void withIntraOpThreads(uint32_t threads, Fn&& fn) {
  const int before = at::get_num_threads();
  const bool change = threads != 0 && static_cast<int>(threads) != before;
  if (change) at::set_num_threads(static_cast<int>(threads));
  try {
    fn();
  } catch (...) {
    if (change) at::set_num_threads(before);
    throw;
  }
  if (change) at::set_num_threads(before);
}

}  // namespace shmgrad::worker
