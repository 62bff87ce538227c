// Placement: how a step's cores are split into worker processes x intra-op threads per
// worker, and the probe that chooses one on a trainer's first steps (serve --workers auto;
// docs/DESIGN.md, "Placement"). No libtorch: the trainer and the coordinator link it.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace shmgrad::engine {

// CPUs this process may run on (sched_getaffinity), counting each physical core once.
uint32_t physicalCores();

struct Placement {
  uint32_t workers = 0;  // participants at most (0: every ready worker)
  uint32_t threads = 0;  // intra-op threads of each (0: the engine's threads_per_worker)
  // The trainer computes the step itself, on `threads` threads, in its own slot
  // (ipc::trainerSlot): no worker takes part, no process is woken, nothing is reduced.
  // workers is 0. Where one process beats any split of the batch (small GEMM-bound
  // steps), this is one process's step plus the engine's bookkeeping.
  bool in_trainer = false;
};

// The placement as the probe's report names it: "2x1" (workers x threads) or "trainer x2".
std::string placementName(const Placement& p);

// What serve --workers auto starts: one worker per physical core (at most `max_workers`,
// 0: no bound but the layout's), each able to use every core.
Placement autoStart(uint32_t max_workers);

// What the probe tries for `cores` cores and at most `slots` workers: one worker with
// every thread, then 2, 4, 8, ... workers and one per core, each with cores / workers
// threads (at least 1). One candidate when cores or slots is 1.
std::vector<Placement> placementCandidates(uint32_t cores, uint32_t slots);

// Times candidates on real steps, round by round. A visit of a candidate first runs
// untimed steps, at least one and for at least `settle_s` seconds: a worker whose thread
// count just went down still has OpenMP threads spinning (libgomp spins for milliseconds
// after a parallel region) on cores the other workers now need, and a worker that was idle
// starts cold. Then timed steps, at least one and for at least `timed_s` seconds, each a
// sample of seconds per example (batches may differ in size). The measure of a candidate
// is the median of its samples. The probe ends after `rounds` rounds once every candidate
// has at least `min_samples` samples (long steps give a visit one sample: more rounds
// then, at most max(rounds, min_samples)), or earlier once every candidate has a sample
// and `budget_s` seconds have passed since the first step. Ties (within 1%) go to the
// candidate listed first.
//
// Then it watches the kept placement (watch_samples > 0): its steps go on being timed, in
// windows of at least `watch_samples` samples and `watch_s` seconds (doubling after each
// recheck). `slow_windows` windows in a row whose median per example is slower than the
// fastest other candidate's probe median by more than `recheck_margin` (0.1: 10%) mean
// the probe was misled (a step timed in a fast phase of a noisy machine) or the machine
// changed: the probe runs again, from fresh samples, at most `max_rechecks` times. (One
// slow window alone is often a slow phase of the whole machine, which a recheck would
// not change.)
struct ProbeOptions {
  uint32_t rounds = 3;
  uint32_t min_samples = 0;
  double budget_s = 10;
  double settle_s = 0;
  double timed_s = 0;
  uint32_t watch_samples = 0;  // 0: no watch
  double watch_s = 0;
  double recheck_margin = 0.1;
  uint32_t slow_windows = 1;
  uint32_t max_rechecks = 0;
};

class PlacementProbe {
 public:
  PlacementProbe(std::vector<Placement> candidates, const ProbeOptions& options);

  bool done() const { return done_; }
  bool begun() const { return run_.start_s >= 0; }  // a step has been recorded
  // The steps' times are wanted: probing, or watching the kept placement.
  bool timing() const { return !done_ || watching(); }
  uint32_t rechecks() const { return rechecks_; }
  // The placement the next step runs with (the chosen one once done).
  Placement next() const;
  // The step just run with next() took `seconds` for `examples` examples, ending at
  // `now_s` (any monotonic clock). timed=false: not a sample (a step re-run after a
  // worker was lost). Allocates nothing once done (the watch's window is fixed).
  void record(double seconds, int64_t examples, double now_s, bool timed = true);
  Placement chosen() const;

  struct Result {
    Placement placement;
    double seconds_per_example = 0;  // median of the timed steps; 0 without any
    uint32_t samples = 0;
  };
  std::vector<Result> results() const;
  // One line: each candidate's median per example and samples, and the choice (and the
  // last recheck's cause, after one).
  std::string report() const;

 private:
  void finish();
  bool watching() const {
    return options_.watch_samples > 0 && rechecks_ < options_.max_rechecks && rival_ > 0;
  }
  void watch(double seconds, int64_t examples, double now_s, bool timed);
  void recheck(double median_s);

  std::vector<Placement> candidates_;
  std::vector<std::vector<double>> samples_;  // seconds per example, per candidate
  ProbeOptions options_;
  // Where a run of the probe is (the first, or a recheck's: each starts from this).
  struct Run {
    size_t current = 0;
    uint32_t round = 0;
    double start_s = -1;        // when the run's first step began
    double phase_start_s = -1;  // when the current visit's phase began (-1: a new visit)
    bool timed_phase = false;   // the visit has settled: its steps are samples
    uint32_t phase_steps = 0;   // steps (settling) or samples (timed) in the phase
  } run_;
  bool done_ = false;
  size_t chosen_ = 0;
  // The watch: the fastest other candidate's median when the probe chose (0: none), and
  // the kept placement's last samples (a ring: the window's median is of its last
  // kWindow samples).
  static constexpr size_t kWindow = 256;
  double rival_ = 0;
  size_t rival_index_ = 0;
  double window_[kWindow] = {};
  size_t window_n_ = 0;
  double window_start_s_ = -1;
  uint32_t slow_in_a_row_ = 0;  // windows over the margin since the last one within it
  uint32_t rechecks_ = 0;
  std::string recheck_note_;  // why the last recheck ran ("" before one)
};

}  // namespace shmgrad::engine
