// The engine's coordinator: creates the segment, starts and supervises the worker
// processes, and removes everything on stop. See docs/DESIGN.md.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "ipc/config.h"

namespace shmgrad::engine {

struct ServeOptions {
  std::string name;
  std::string model_path;
  uint32_t workers = 1;      // worker processes started
  uint32_t max_workers = 0;  // gradient slots (resize limit); 0: same as workers
  std::string loss = "cross_entropy";
  std::string dataset;  // "" | fashion-mnist | npy:X.npy,Y.npy
  uint32_t threads_per_worker = config::kDefaultThreadsPerWorker;
  // --workers auto: one worker per physical core (at most max_workers, when given), each
  // able to use every core (threads_per_worker is then the core count); the trainer
  // probes workers x threads on its first steps and keeps the fastest (engine/placement.h).
  bool auto_placement = false;
  int64_t max_batch = config::kDefaultMaxBatch;                  // examples per step
  uint64_t input_capacity_mb = config::kDefaultInputCapacityMb;  // explicit-batch inputs
  double startup_timeout_s = config::kDefaultStartupTimeoutS;    // all workers ready within this
  // The worker program and the arguments that make it a worker; the slot number,
  // engine name and parent pid are appended. Default: this executable, "__worker".
  std::string worker_binary;
  bool quiet = false;
  int status_fd = -1;  // >= 0: write the start-up report there (writeServeReport)
  // Eager workers: run `python -m shmgrad._eager_worker` on this pickled job (model, loss,
  // dataset, ...) instead of the TorchScript worker; model_path then holds the
  // parameters' holder the launcher wrote. eager_dataset_size: examples of the dataset the
  // workers hold (0: none).
  std::string eager_job;
  // What the job's loss returns for a batch, as the launcher found it ("sum", "mean",
  // "weighted"); empty: the workers find out (ipc::LossReduction). Named losses are sums.
  std::string loss_reduction;
  // The trainer's torch numerics for every worker (ipc::parseNumerics); empty: torch's
  // defaults.
  std::string numerics;
  std::string python;
  int64_t eager_dataset_size = 0;
  std::string owned_dir;  // removed (its plain files, then itself) when the engine stops
  // CUDA ordinals: the coordinator allocates each device's buffers (ipc/device_table.h)
  // with libshmgrad_cuda.so and publishes their IPC handles; it frees them at stop. The
  // workers compute in that memory, placed round-robin (docs/GPU.md).
  std::vector<int> devices;
};

// Runs the engine until `shmgrad stop`, SIGTERM or SIGINT. Returns the exit code.
// Throws shmgrad::Error for bad options (before anything is created) and for a failed
// start (a worker could not start: kWorkerFailed, with its message; everything created
// is removed first).
int serve(const ServeOptions& options);

// The structured start-up report on ServeOptions::status_fd (nothing when fd < 0): one
// JSON line, {"event":"serving","pid":P} once every worker is ready (serve writes it),
// or {"event":"failed","pid":P,"kind":K,"message":M} with K an errorKindName (the
// command line writes it when serve throws). A launcher reads it instead of parsing
// the log. The client operations (stop, resize, status) are in engine/control.h.
void writeServeReport(int fd, const std::string& event, const std::string& kind,
                      const std::string& message);

}  // namespace shmgrad::engine
