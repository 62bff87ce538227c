// Process-shared futex waits and wakes on 32-bit words inside the segment.
//
// These are the only system calls on a step's hot path. A wait always has a
// timeout, so a dead peer can never hang a caller: callers loop, re-check their
// condition (and the liveness of whoever should have woken them), and give up
// when their own deadline passes.
#pragma once

#include <atomic>
#include <algorithm>
#include <chrono>
#include <cstdint>

namespace shmgrad::ipc {

// Blocks while *word == expected, for at most timeout. Returns false on timeout.
// Spurious returns happen; callers re-check their condition.
bool futexWait(std::atomic<uint32_t>* word, uint32_t expected, std::chrono::nanoseconds timeout);

// Wakes up to count waiters on word (all by default).
void futexWake(std::atomic<uint32_t>* word, int count = 0x7fffffff);

uint64_t monotonicNs();

// Bumps a wake-counter word and wakes everyone waiting on it: how a process tells
// waiters "something changed, look again" (trainer_wake, coordinator_wake, ...).
inline void bumpAndWake(std::atomic<uint32_t>* word) {
  word->fetch_add(1, std::memory_order_acq_rel);
  futexWake(word);
}

// Waits until pred() holds: first spinning for up to spin_ns, then sleeping on word
// between checks. Each sleep lasts at most `slice`; once per slice `poll()` may decide to
// stop (returning false, e.g. a peer died).
// Returns true when pred() held, false on deadline or when poll() returned false.
inline void cpuRelax() {
#if defined(__x86_64__)
  __builtin_ia32_pause();
#endif
}

// Spins (pause loop, no system call) until pred() holds or spin_ns pass. Returns pred().
// Only worth it when the waiter has a core of its own: see StepRequest::spin_ns.
template <typename Pred>
bool spinUntil(Pred pred, uint64_t spin_ns) {
  if (spin_ns == 0) return pred();
  const uint64_t until = monotonicNs() + spin_ns;
  for (uint32_t i = 1;; ++i) {
    if (pred()) return true;
    cpuRelax();
    if ((i & 63) == 0 && monotonicNs() >= until) return pred();
  }
}

// How long one waiter spins, adapted to how its spins fare (as glibc's adaptive mutexes
// do): a spin that ends with the condition met lets the next one last up to twice as long
// (to `max`); one that runs out shortens it by a quarter, down to nothing (gently, so one
// slow step among short ones does not end spinning). So spinning stays where it
// wins (short steps on an idle machine) and stops by itself where it loses (long steps,
// or other processes competing for the cores), where it would only steal a core from
// the process being waited for. After kSpinProbeEvery waits without spinning it tries the
// full budget once again, in case things changed.
class AdaptiveSpin {
 public:
  static constexpr uint32_t kSpinProbeEvery = 64;
  static constexpr uint64_t kMinSpinNs = 2000;  // below this a spin is not worth starting

  // The budget for the next wait, given the largest allowed now (0: do not spin).
  uint64_t next(uint64_t max) {
    if (max == 0) return 0;
    if (budget_ == 0 && ++idle_ >= kSpinProbeEvery) {
      idle_ = 0;
      return max;
    }
    return budget_ == 0 ? 0 : std::min(budget_, max);
  }
  // What the spin of that wait gave: the condition held (won) or the budget ran out.
  void result(bool won, uint64_t spent_budget, uint64_t max) {
    if (spent_budget == 0) return;
    if (won) {
      budget_ = std::min(max, std::max(spent_budget, budget_) * 2);
    } else {
      const uint64_t shorter = spent_budget - spent_budget / 4;
      budget_ = shorter < kMinSpinNs ? 0 : shorter;
    }
  }

 private:
  uint64_t budget_ = UINT64_MAX;  // the first wait may spin the full budget
  uint32_t idle_ = 0;
};

// Spins until pred() holds for as long as `adapt` allows of `max` (all of it without
// `adapt`), and tells `adapt` how the spin fared. Returns pred().
template <typename Pred>
bool adaptiveSpinUntil(Pred pred, uint64_t max, AdaptiveSpin* adapt) {
  if (adapt == nullptr) return spinUntil(pred, max);
  const uint64_t spin = adapt->next(max);
  const bool won = spinUntil(pred, spin);
  adapt->result(won, spin, max);
  return won;
}

template <typename Pred, typename Poll>
bool waitUntil(std::atomic<uint32_t>* word, Pred pred, Poll poll, uint64_t deadline_ns,
               std::chrono::nanoseconds slice = std::chrono::milliseconds(100),
               uint64_t spin_ns = 0, AdaptiveSpin* adapt = nullptr) {
  if (adaptiveSpinUntil(pred, spin_ns, adapt)) return true;
  // poll() may make system calls (liveness checks): it runs once per slice, not before
  // every sleep, so a wait that a wake ends promptly costs no call beyond the futex.
  const uint64_t slice_ns = static_cast<uint64_t>(slice.count());
  uint64_t next_poll = 0;
  for (;;) {
    uint32_t seen = word->load(std::memory_order_acquire);
    if (pred()) return true;
    uint64_t now = monotonicNs();
    if (now >= deadline_ns) return false;
    if (next_poll == 0) {
      next_poll = now + slice_ns;
    } else if (now >= next_poll) {
      if (!poll()) return false;
      next_poll = now + slice_ns;
    }
    auto left = std::chrono::nanoseconds(deadline_ns - now);
    futexWait(word, seen, left < slice ? left : slice);
  }
}

}  // namespace shmgrad::ipc
