// Epoch-tagged barriers on a futex word in shared memory (see layout.h, barrierTag).
//
// The word holds tag(epoch) in its high 16 bits and the arrivals in its low 16 bits.
// The trainer resets it to tag(e) when it publishes step e, so an arrival from a stale
// (aborted) step can never count towards a later one.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>

#include "ipc/futex.h"
#include "ipc/layout.h"

namespace shmgrad::ipc {

// Arrives at the barrier for `epoch`. Returns the arrival count including this one, or
// 0 if the barrier already belongs to another epoch (this step was replaced).
inline uint32_t arriveBarrier(std::atomic<uint32_t>& barrier, uint32_t epoch) {
  uint32_t v = barrier.load(std::memory_order_acquire);
  for (;;) {
    if ((v & kBarrierTagMask) != barrierTag(epoch)) return 0;
    // acq_rel: this participant's writes (its slot, its slice) happen before the
    // reads of whoever sees the completed count.
    if (barrier.compare_exchange_weak(v, v + 1, std::memory_order_acq_rel,
                                      std::memory_order_acquire)) {
      return (v & kBarrierCountMask) + 1;
    }
  }
}

// Whether all n participants of `epoch` have arrived at the barrier.
inline bool barrierComplete(const std::atomic<uint32_t>& barrier, uint32_t epoch, uint32_t n) {
  const uint32_t v = barrier.load(std::memory_order_acquire);
  return (v & kBarrierTagMask) == barrierTag(epoch) && (v & kBarrierCountMask) >= n;
}

// Waits, without arriving, until all n participants of `epoch` have arrived. Returns
// false if the step was aborted (abort_epoch == epoch), replaced (tag changed), poll()
// asked to stop, or the deadline passed.
template <typename Poll>
bool awaitBarrier(std::atomic<uint32_t>& barrier, uint32_t epoch, uint32_t n,
                  const std::atomic<uint32_t>& abort_epoch, uint64_t deadline_ns, Poll poll,
                  uint64_t spin_ns = 0, AdaptiveSpin* adapt = nullptr) {
  auto aborted = [&] {
    uint32_t v = barrier.load(std::memory_order_acquire);
    return (v & kBarrierTagMask) != barrierTag(epoch) ||
           abort_epoch.load(std::memory_order_acquire) == epoch;
  };
  waitUntil(
      &barrier, [&] { return barrierComplete(barrier, epoch, n) || aborted(); }, poll, deadline_ns,
      std::chrono::milliseconds(200), spin_ns, adapt);
  return barrierComplete(barrier, epoch, n) && abort_epoch.load(std::memory_order_acquire) != epoch;
}

// Arrives and waits until all n participants of `epoch` have arrived (awaitBarrier). The
// last arrival wakes the others.
template <typename Poll>
bool barrierWait(std::atomic<uint32_t>& barrier, uint32_t epoch, uint32_t n,
                 const std::atomic<uint32_t>& abort_epoch, uint64_t deadline_ns, Poll poll,
                 uint64_t spin_ns = 0, AdaptiveSpin* adapt = nullptr) {
  const uint32_t count = arriveBarrier(barrier, epoch);
  if (count == 0) return false;
  if (count == n) {
    if (n > 1) futexWake(&barrier);  // alone, nobody waits: no system call
    return true;
  }
  return awaitBarrier(barrier, epoch, n, abort_epoch, deadline_ns, poll, spin_ns, adapt);
}

}  // namespace shmgrad::ipc
