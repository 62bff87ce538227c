// The client side of an engine: what `shmgrad stop|resize|status`, the Python package
// and any other observer ask of a running engine, through its segment alone. Links no
// libtorch and none of the coordinator's or the worker's code.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "ipc/config.h"
#include "ipc/layout.h"
#include "ipc/record.h"

namespace shmgrad::engine {

// The records of `shmgrad status`, each written once (ipc/record.h): the structs below,
// their Python binding and shmgrad.WorkerStatus, StepSummary and EngineStatus come from
// these lists.

// One worker slot as the segment shows it.
#define SHMGRAD_WORKER_STATUS_FIELDS(X)                                                      \
  X(uint32_t, slot, "")                                                                      \
  X(int32_t, pid, "0: no process in the slot")                                               \
  X(std::string, state, "starting, ready, dead, exited or retired (ipc::kWorkerStateNames)") \
  X(uint32_t, restarts, "replacements of this slot's process")                               \
  X(uint32_t, busy_epoch, "the step it is working on now, 0 when idle")                      \
  X(uint32_t, assigned_epoch, "the last step it was picked for")                             \
  X(std::string, device, "where it computes: cpu, or cuda:N (engines with devices)")
struct WorkerStatus {
  SHMGRAD_WORKER_STATUS_FIELDS(SHMGRAD_DECLARE_FIELD)
};

// One finished step from the segment's ring of recent steps.
#define SHMGRAD_STEP_SUMMARY_FIELDS(X)                                      \
  X(uint32_t, epoch, "")                                                    \
  X(uint32_t, workers, "")                                                  \
  X(int64_t, examples, "")                                                  \
  X(double, loss_sum, "")                                                   \
  X(double, wall_seconds, "the step published to the end of its reduction") \
  X(double, compute_seconds, "the slowest worker's forward and backward")   \
  X(double, reduce_seconds, "the slowest worker's slice of the reduction")  \
  X(double, reduce_early_seconds,                                           \
    "bucketed: the most of a slice done before the last worker computed")   \
  X(double, wait_seconds, "wall - compute - reduce: synchronisation")
struct StepSummary {
  SHMGRAD_STEP_SUMMARY_FIELDS(SHMGRAD_DECLARE_FIELD)
};

// Everything `shmgrad status` prints, as data.
#define SHMGRAD_ENGINE_STATUS_FIELDS(X)                                                          \
  X(std::string, name, "")                                                                       \
  X(std::string, state, "starting, serving, stopping or failed (ipc::kEngineStateNames)")        \
  X(int32_t, coordinator_pid, "")                                                                \
  X(bool, coordinator_alive, "")                                                                 \
  X(std::string, segment_path, "")                                                               \
  X(uint64_t, segment_bytes, "")                                                                 \
  X(std::string, model_path, "")                                                                 \
  X(std::string, loss, "TorchScript workers' loss (eager workers run the job's own)")            \
  X(std::string, loss_reduction,                                                                 \
    "what the loss returns for a batch: sum, mean, weighted ((loss_sum, count)) or unknown")     \
  X(std::string, worker_kind, "script (TorchScript, C++) or eager (Python)")                     \
  X(std::string, job_path, "eager: the pickled job the workers load")                            \
  X(uint32_t, num_params, "parameter tensors")                                                   \
  X(uint64_t, param_floats, "floats the parameters take, padding for alignment included")        \
  X(std::string, dataset, "its description, empty without one")                                  \
  X(int64_t, dataset_size, "")                                                                   \
  X(int64_t, max_batch, "")                                                                      \
  X(uint32_t, threads_per_worker, "")                                                            \
  X(std::string, placement,                                                                      \
    "fixed (workers as started), probing or chosen (serve --workers auto: the trainer chooses)") \
  X(uint32_t, placement_workers, "workers a step uses at most (0: every ready worker)")          \
  X(uint32_t, placement_threads, "intra-op threads of each worker a step uses")                  \
  X(bool, placement_in_trainer, "the trainer computes each step itself (placement_workers 0)")   \
  X(int32_t, trainer_pid, "the trainer that holds the engine, 0 when none does")                 \
  X(uint32_t, step_epoch, "the last step published")                                             \
  X(uint64_t, steps_served, "")                                                                  \
  X(uint64_t, steps_aborted, "steps abandoned because a worker died, then re-run")               \
  X(uint64_t, step_retries, "")                                                                  \
  X(uint64_t, worker_restarts, "")                                                               \
  X(uint32_t, target_workers, "the worker count asked for (resize)")                             \
  X(uint32_t, slots, "gradient slots: the most workers there can be")                            \
  X(std::string, devices, "the GPUs it serves, the trainer's first (cuda:1,cuda:0); empty: CPU") \
  X(uint64_t, param_sync_bytes,                                                                  \
    "device to device bytes a step costs to bring the other GPUs' parameters up to date")        \
  X(bool, mps, "an MPS daemon serves the engine's GPU workers: several on one GPU run at once")  \
  X(std::vector<::shmgrad::engine::WorkerStatus>, workers, "every slot that has had a process")  \
  X(std::vector<::shmgrad::engine::StepSummary>, recent_steps,                                   \
    "oldest first, at most ipc::kStatsRing")
struct EngineStatus {
  SHMGRAD_ENGINE_STATUS_FIELDS(SHMGRAD_DECLARE_FIELD)
};

// Reads a running engine's status from its segment. Throws Error(kNotFound) if there is
// no engine of that name.
EngineStatus readStatus(const std::string& name);
// The same, from the header of a segment mapped at `h` that validateHeader accepted (what
// readStatus runs after opening it; tests/fuzz runs it on any bytes that validate).
EngineStatus statusOf(const std::string& name, const ipc::SegmentHeader* h);
// The text `shmgrad status NAME` prints.
std::string formatStatus(const EngineStatus& status);

// How long `shmgrad stop` and the Python package wait for an engine to stop, unless
// told otherwise (declared in ipc/config.h).
constexpr double kDefaultStopTimeoutS = config::kDefaultStopTimeoutS;
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
