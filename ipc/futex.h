// Process-shared futex waits and wakes on 32-bit words inside the segment.
//
// These are the only system calls on a step's hot path. A wait always has a
// timeout, so a dead peer can never hang a caller: callers loop, re-check their
// condition (and the liveness of whoever should have woken them), and give up
// when their own deadline passes.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>

namespace shmgrad::ipc {

// Blocks while *word == expected, for at most timeout. Returns false on timeout.
// Spurious returns happen; callers re-check their condition.
bool futexWait(std::atomic<uint32_t>* word, uint32_t expected, std::chrono::nanoseconds timeout);

// Wakes up to count waiters on word (all by default).
void futexWake(std::atomic<uint32_t>* word, int count = 0x7fffffff);

uint64_t monotonicNs();

// Waits until pred() holds, sleeping on word between checks. Each sleep lasts at most
// `slice`, after which `poll()` may decide to stop (returning false, e.g. a peer died).
// Returns true when pred() held, false on deadline or when poll() returned false.
template <typename Pred, typename Poll>
bool waitUntil(std::atomic<uint32_t>* word, Pred pred, Poll poll, uint64_t deadline_ns,
               std::chrono::nanoseconds slice = std::chrono::milliseconds(100),
               int spin = 0) {
  for (int i = 0; i < spin; ++i) {
    if (pred()) return true;
#if defined(__x86_64__)
    __builtin_ia32_pause();
#endif
  }
  for (;;) {
    uint32_t seen = word->load(std::memory_order_acquire);
    if (pred()) return true;
    uint64_t now = monotonicNs();
    if (now >= deadline_ns) return false;
    if (!poll()) return false;
    auto left = std::chrono::nanoseconds(deadline_ns - now);
    futexWait(word, seen, left < slice ? left : slice);
  }
}

}  // namespace shmgrad::ipc
