// The client side of an engine: what `shmgrad stop|resize|status`, the Python package
// and any other observer ask of a running engine, through its segment alone. Links no
// libtorch and none of the coordinator's or the worker's code.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace shmgrad::engine {

// One worker slot as the segment shows it.
struct WorkerStatus {
  uint32_t slot = 0;
  int32_t pid = 0;              // 0: no process in the slot
  std::string state;            // ipc::kWorkerStateNames: starting, ready, dead, exited, retired
  uint32_t restarts = 0;        // replacements of this slot
  uint32_t busy_epoch = 0;      // the step it is working on, 0 when idle
  uint32_t assigned_epoch = 0;  // the last step it was picked for
};

// One finished step from the segment's ring of recent steps.
struct StepSummary {
  uint32_t epoch = 0;
  uint32_t workers = 0;
  int64_t examples = 0;
  double loss_sum = 0;
  double wall_seconds = 0;     // publish to the end of the reduction
  double compute_seconds = 0;  // slowest worker's forward + backward
  double reduce_seconds = 0;   // slowest worker's slice of the reduction
  double wait_seconds = 0;     // wall - compute - reduce: synchronisation
};

// Everything `shmgrad status` prints, as data.
struct EngineStatus {
  std::string name;
  std::string state;            // ipc::kEngineStateNames
  int32_t coordinator_pid = 0;
  bool coordinator_alive = false;
  std::string segment_path;
  uint64_t segment_bytes = 0;
  std::string model_path;
  std::string loss;             // ipc::kLossNames (TorchScript workers; eager ones run the job's)
  std::string worker_kind;      // ipc::kWorkerKindNames: "script" or "eager"
  std::string job_path;         // eager: the pickled job the workers load
  uint32_t num_params = 0;
  uint64_t param_floats = 0;
  std::string dataset;          // description, "" without one
  int64_t dataset_size = 0;
  int64_t max_batch = 0;
  uint32_t threads_per_worker = 0;
  int32_t trainer_pid = 0;      // lease holder, 0: none
  uint32_t step_epoch = 0;      // the last step published
  uint64_t steps_served = 0;
  uint64_t steps_aborted = 0;
  uint64_t step_retries = 0;
  uint64_t worker_restarts = 0;
  uint32_t target_workers = 0;
  uint32_t slots = 0;
  std::vector<WorkerStatus> workers;     // every slot that ever had a process
  std::vector<StepSummary> recent_steps; // oldest first, at most ipc::kStatsRing
};

// Reads a running engine's status from its segment. Throws Error(kNotFound) if there is
// no engine of that name.
EngineStatus readStatus(const std::string& name);
// The text `shmgrad status NAME` prints.
std::string formatStatus(const EngineStatus& status);

// How long `shmgrad stop` and the Python package wait for an engine to stop, unless
// told otherwise: the coordinator gives its workers 5 s, then reaps and unlinks.
constexpr double kDefaultStopTimeoutS = 30;
// The longest stop wait requestStop accepts (a day).
constexpr double kMaxStopTimeoutS = 86400;

// Asks a running engine to stop and waits (up to timeout_s) for its segment to vanish.
// Removes the segment itself when the coordinator is already dead. Returns true if the
// engine is gone. timeout_s outside 0..kMaxStopTimeoutS (or NaN) is InvalidArgument.
bool requestStop(const std::string& name, double timeout_s);

// Asks a running engine to run n worker processes (1..slots); throws InvalidArgument
// naming the slot count otherwise.
void requestResize(const std::string& name, uint32_t n);

}  // namespace shmgrad::engine
