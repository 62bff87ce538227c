// A participant's result record (ipc::WorkerRecord) as the trainer reads it after a step,
// without libtorch: engine/trainer.cc's collect phase reads each participant's record
// through this, and tests/fuzz runs it on any bytes.
#pragma once

#include <cstdint>

#include "ipc/layout.h"

namespace shmgrad::engine {

// What the trainer takes from one record, copied out of shared memory once.
struct WorkerResult {
  int64_t examples = 0;
  double loss_sum = 0;
  double count = 0;
  uint64_t compute_ns = 0;
  uint64_t reduce_ns = 0;
  uint64_t reduce_early_ns = 0;
  uint64_t barrier_wait_ns = 0;
  bool nonfinite_loss = false;
  bool nonfinite_grad = false;
  bool nonfinite_sum = false;  // its slice of the sum overflowed (nonfinite_grad too)
  uint64_t grad_params[ipc::kMaxParams / 64] = {};  // ipc::paramBit
};

// Reads the record of worker `slot` for step `e`: Error(kCorrupt) if it holds another
// step's result, and the error it recorded as Error(kWorkerFailed) naming the slot, its
// type and its text (each cut at its array's end, terminated or not).
WorkerResult readWorkerResult(const ipc::WorkerRecord& w, uint32_t e, uint32_t slot);

}  // namespace shmgrad::engine
