#include "ipc/futex.h"

#include <linux/futex.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <cerrno>

#include "ipc/error.h"

namespace shmgrad::ipc {

static_assert(sizeof(std::atomic<uint32_t>) == 4, "futex word must be 4 bytes");

bool futexWait(std::atomic<uint32_t>* word, uint32_t expected, std::chrono::nanoseconds timeout) {
  if (timeout.count() <= 0) return false;
  struct timespec ts;
  ts.tv_sec = static_cast<time_t>(timeout.count() / 1000000000);
  ts.tv_nsec = static_cast<long>(timeout.count() % 1000000000);
  // Not FUTEX_PRIVATE_FLAG: the word is shared between processes.
  long rc =
      syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT, expected, &ts, nullptr, 0);
  if (rc == -1 && errno == ETIMEDOUT) return false;
  return true;  // woken, value changed (EAGAIN) or interrupted (EINTR): re-check
}

void futexWake(std::atomic<uint32_t>* word, int count) {
  // Fails only for a bad address or operation (EFAULT, EINVAL, ENOSYS): a bug, not a state.
  SHMGRAD_SYSCHECK(
      syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE, count, nullptr, nullptr, 0),
      "futex(FUTEX_WAKE)");
}

uint64_t monotonicNs() {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<uint64_t>(ts.tv_sec) * 1000000000ull + static_cast<uint64_t>(ts.tv_nsec);
}

}  // namespace shmgrad::ipc
