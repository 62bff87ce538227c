// The worker process: waits for steps, computes its shard's gradient into its slot,
// and reduces its slice of all participating slots. See docs/DESIGN.md.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "ipc/step.h"

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

// The in-trainer placement of a TorchScript engine (serve --workers auto, on the host): the
// engine's trainer slot (ipc::trainerSlot) computed in the trainer's own process, with a
// replica of its own (parameters views of the shared ones, .grad views of that slot or of
// the reduced buffer) and the TorchScript worker's compute under the same step protocol.
// Its run() is what Trainer::setInTrainer takes. Made in the trainer process once (it
// loads the model); throws where the engine has no trainer slot or the model does not load.
class ScriptInTrainer {
 public:
  ScriptInTrainer(const std::string& engine_name, int coordinator_pid);
  ~ScriptInTrainer();
  ScriptInTrainer(const ScriptInTrainer&) = delete;
  ScriptInTrainer& operator=(const ScriptInTrainer&) = delete;

  // Step `epoch`, computed here on `threads` intra-op threads (0: as the process has them),
  // which the process has again afterwards. An error of the step is in its record.
  // `batch`: an explicit batch where the trainer holds it (Trainer::InTrainerStep).
  void run(uint32_t epoch, uint32_t threads, const ipc::LocalBatch& batch = {});

 private:
  struct State;
  std::unique_ptr<State> state_;
};

}  // namespace shmgrad::worker
