// The engine's coordinator: creates the segment, starts and supervises the worker
// processes, and removes everything on stop. See docs/DESIGN.md.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace shmgrad::engine {

struct ServeOptions {
  std::string name;
  std::string model_path;
  uint32_t workers = 1;            // worker processes started
  uint32_t max_workers = 0;        // gradient slots (resize limit); 0: same as workers
  std::string loss = "cross_entropy";
  std::string dataset;             // "" | fashion-mnist | npy:X.npy,Y.npy
  uint32_t threads_per_worker = 1;
  int64_t max_batch = 65536;       // examples per step
  uint64_t input_capacity_mb = 64; // explicit-batch inputs
  double startup_timeout_s = 120;  // all workers ready within this
  // The worker program and the arguments that make it a worker; the slot number,
  // engine name and parent pid are appended. Default: this executable, "__worker".
  std::string worker_binary;
  bool quiet = false;
};

// Runs the engine until `shmgrad stop`, SIGTERM or SIGINT. Returns the exit code.
// Throws shmgrad::Error for bad options before anything is created.
int serve(const ServeOptions& options);

// Asks a running engine to stop and waits (up to timeout) for its segment to vanish.
// Returns true if it stopped.
bool requestStop(const std::string& name, double timeout_s);

// Asks a running engine to run n worker processes (1..slots).
void requestResize(const std::string& name, uint32_t n);

// Human-readable status of a running engine (workers, steps, time breakdown).
std::string statusText(const std::string& name);

}  // namespace shmgrad::engine
