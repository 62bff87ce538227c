// Step-level operations on the control block that more than one process performs.
#pragma once

#include <atomic>
#include <cstdint>

#include "ipc/futex.h"
#include "ipc/layout.h"

namespace shmgrad::ipc {

// A step's batch where it lies in the computing process's own memory: explicit inputs
// and targets, or a structured batch's tensors (leaves[k]: leaf k from its first row).
// The in-trainer placement's step is computed in the trainer, which holds the batch
// already: its participant reads it there instead of the trainer first copying it into
// the request region (for an MLP on 784 features, 3-4 % of its step). Null: read the
// request region, as every worker does. Never put in shared memory: pointers of one
// process only, handed from the trainer to its own participant.
struct LocalBatch {
  const uint8_t* inputs = nullptr;
  const uint8_t* targets = nullptr;
  const uint8_t* leaves[kMaxLeaves] = {};
};

// The one abort path of a step. Marks step `e` aborted so that every waiter gives up on
// it: the trainer (trainer_wake) and the workers at either barrier (they re-check
// abort_epoch when woken). Called by the trainer (a participant was lost, or its own
// timeout passed) and by the coordinator (it reaped a participant). A step that is
// already done is left alone; an abort is counted once however many callers race on it.
// Returns true if this call aborted the step.
// Wakes every worker wherever it sleeps: the latest step's participants on step_epoch,
// the others on idle_wake (a stop, a retire, a resize: each re-reads the control block).
inline void wakeWorkers(ControlBlock& c) {
  futexWake(&c.step_epoch);
  bumpAndWake(&c.idle_wake);
}

inline bool abortStep(ControlBlock& c, uint32_t e) {
  if (c.done_epoch.load(std::memory_order_acquire) == e) return false;
  const uint32_t previous = c.abort_epoch.exchange(e, std::memory_order_acq_rel);
  if (previous != e) c.steps_aborted.fetch_add(1, std::memory_order_relaxed);
  bumpAndWake(&c.trainer_wake);
  futexWake(&c.compute_barrier);
  futexWake(&c.reduce_barrier);
  bumpAndWake(&c.bucket_progress);  // bucketed steps' participants with nothing to take
  return previous != e;
}

// Whether worker `w` is held up by step `abandoned`, which the trainer gave up on at its
// timeout (ControlBlock::abandon_epoch; 0: none): still busy with it or an older step
// (hung in it), or one of its participants that never finished it, not having run it
// (stopped, or stuck outside its step loop). A healthy participant that was merely slow
// to wake runs the step even after its abort and records it (result_epoch), and a worker
// busy with a later step is not held up.
inline bool heldByAbandoned(const WorkerRecord& w, uint32_t abandoned) {
  if (abandoned == 0) return false;
  const uint32_t busy = w.busy_epoch.load(std::memory_order_acquire);
  if (busy != 0) return busy <= abandoned;
  return w.assigned_epoch.load(std::memory_order_acquire) == abandoned &&
         __atomic_load_n(&w.result_epoch, __ATOMIC_ACQUIRE) != abandoned;
}

// True if step `e` ended, either way.
inline bool stepEnded(const ControlBlock& c, uint32_t e) {
  return c.done_epoch.load(std::memory_order_acquire) == e ||
         c.abort_epoch.load(std::memory_order_acquire) == e;
}

}  // namespace shmgrad::ipc
