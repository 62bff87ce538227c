// The worker process: waits for steps, computes its shard's gradient into its slot,
// and reduces its slice of all participating slots. See docs/DESIGN.md.
#pragma once

#include <cstdint>
#include <string>

namespace shmgrad::worker {

struct WorkerOptions {
  std::string engine_name;
  uint32_t slot = 0;
  int parent_pid = 0;       // the coordinator; the worker exits when it is gone
  uint32_t generation = 0;  // which incarnation of this slot (restarts)
};

// Runs until the engine stops, the coordinator dies or the slot is retired.
// Returns the process exit code.
int runWorker(const WorkerOptions& options);

}  // namespace shmgrad::worker
