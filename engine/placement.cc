#include "engine/placement.h"

#include <sched.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <utility>

#include "ipc/error.h"
#include "ipc/layout.h"

namespace shmgrad::engine {

uint32_t physicalCores() {
  cpu_set_t cpus;
  CPU_ZERO(&cpus);
  if (sched_getaffinity(0, sizeof(cpus), &cpus) != 0) return 1;
  uint32_t cores = 0;
  for (int cpu = 0; cpu < CPU_SETSIZE; ++cpu) {
    if (!CPU_ISSET(cpu, &cpus)) continue;
    // The first CPU of its sibling list stands for the core.
    std::ifstream f("/sys/devices/system/cpu/cpu" + std::to_string(cpu) +
                    "/topology/thread_siblings_list");
    int first = -1;
    if (!(f >> first)) return static_cast<uint32_t>(CPU_COUNT(&cpus));  // no topology
    if (first == cpu || !CPU_ISSET(first, &cpus)) ++cores;
  }
  return std::max<uint32_t>(1, cores);
}

std::string placementName(const Placement& p) {
  if (p.in_trainer) return "trainer x" + std::to_string(p.threads);
  return std::to_string(p.workers) + "x" + std::to_string(p.threads);
}

Placement autoStart(uint32_t max_workers) {
  const uint32_t cores = std::min(physicalCores(), ipc::kMaxThreadsPerWorker);
  const uint32_t most = max_workers == 0 ? ipc::kMaxWorkers : max_workers;
  return {std::max<uint32_t>(1, std::min(cores, most)), cores};
}

std::vector<Placement> placementCandidates(uint32_t cores, uint32_t slots) {
  cores = std::max<uint32_t>(1, cores);
  const uint32_t most = std::max<uint32_t>(1, std::min(cores, slots));
  std::vector<Placement> out;
  for (uint32_t w = 1; w < most; w *= 2) out.push_back({w, std::max<uint32_t>(1, cores / w)});
  out.push_back({most, std::max<uint32_t>(1, cores / most)});
  return out;
}

PlacementProbe::PlacementProbe(std::vector<Placement> candidates, const ProbeOptions& options)
    : candidates_(std::move(candidates)), samples_(candidates_.size()), options_(options) {
  SHMGRAD_CHECK(!candidates_.empty(), ErrorKind::kInvalidArgument,
                "a placement probe needs at least one candidate");
  options_.rounds = std::max<uint32_t>(1, options_.rounds);
  if (candidates_.size() == 1) done_ = true;  // nothing to choose between
}

Placement PlacementProbe::next() const {
  return done_ ? candidates_[chosen_] : candidates_[run_.current];
}

void PlacementProbe::record(double seconds, int64_t examples, double now_s, bool timed) {
  if (done_) {
    watch(seconds, examples, now_s, timed);
    return;
  }
  if (run_.start_s < 0) run_.start_s = now_s - seconds;
  if (run_.phase_start_s < 0) run_.phase_start_s = now_s - seconds;  // a visit begins
  if (!run_.timed_phase) {
    ++run_.phase_steps;
    if (now_s - run_.phase_start_s >= options_.settle_s) {
      run_.timed_phase = true;  // settled: the next steps are samples
      run_.phase_start_s = now_s;
      run_.phase_steps = 0;
    }
    return;
  }
  if (timed && examples > 0) {
    samples_[run_.current].push_back(seconds / static_cast<double>(examples));
    ++run_.phase_steps;
  }
  if (run_.phase_steps == 0 || now_s - run_.phase_start_s < options_.timed_s) return;
  // The visit is over: the next candidate, or the next round.
  run_.timed_phase = false;
  run_.phase_start_s = -1;
  run_.phase_steps = 0;
  if (++run_.current == candidates_.size()) {
    run_.current = 0;
    ++run_.round;
  }
  size_t fewest = samples_.front().size();  // the samples of the least sampled candidate
  for (const auto& s : samples_) fewest = std::min(fewest, s.size());
  // Rounds end whole: every candidate gets as many visits. A visit ends only with a
  // sample, so max(rounds, min_samples) rounds bound the probe.
  const bool enough =
      run_.current == 0 && run_.round >= options_.rounds && fewest >= options_.min_samples;
  if (enough || (fewest > 0 && now_s - run_.start_s >= options_.budget_s)) finish();
}

namespace {
// The median of v[0, n), reordering it.
double medianInPlace(double* v, size_t n) {
  if (n == 0) return 0;
  std::sort(v, v + n);
  return n % 2 == 1 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}
double median(std::vector<double> v) { return medianInPlace(v.data(), v.size()); }

std::string msPerExample(double seconds_per_example) {
  char ms[32];
  std::snprintf(ms, sizeof ms, "%.4g", seconds_per_example * 1e3);
  return ms;
}
}  // namespace

void PlacementProbe::finish() {
  done_ = true;
  double best = 0;
  std::vector<double> medians(candidates_.size(), 0);
  for (size_t i = 0; i < candidates_.size(); ++i) {
    if (samples_[i].empty()) continue;
    const double m = medians[i] = median(samples_[i]);
    // Only clearly faster (by more than 1%) displaces a candidate listed earlier.
    if (best == 0 || m < best * 0.99) {
      best = m;
      chosen_ = i;
    }
  }
  rival_ = 0;
  for (size_t i = 0; i < candidates_.size(); ++i) {
    if (i != chosen_ && medians[i] > 0 && (rival_ == 0 || medians[i] < rival_)) {
      rival_ = medians[i];
      rival_index_ = i;
    }
  }
  window_n_ = 0;
  window_start_s_ = -1;
  slow_in_a_row_ = 0;
}

// After the choice: the kept placement's steps, window by window, against the fastest
// other candidate's probe median. On the hot path: no allocation but a recheck's.
void PlacementProbe::watch(double seconds, int64_t examples, double now_s, bool timed) {
  if (!watching()) return;
  if (window_start_s_ < 0) window_start_s_ = now_s - seconds;
  if (timed && examples > 0) {
    window_[window_n_ % kWindow] = seconds / static_cast<double>(examples);
    ++window_n_;
  }
  const double span_s = options_.watch_s * static_cast<double>(1u << std::min(rechecks_, 16u));
  if (window_n_ < options_.watch_samples || now_s - window_start_s_ < span_s) return;
  const double m = medianInPlace(window_, std::min(window_n_, kWindow));
  window_n_ = 0;
  window_start_s_ = -1;
  if (m <= rival_ * (1 + options_.recheck_margin)) {
    slow_in_a_row_ = 0;
    return;
  }
  if (++slow_in_a_row_ >= std::max<uint32_t>(1, options_.slow_windows)) recheck(m);
}

void PlacementProbe::recheck(double median_s) {
  ++rechecks_;
  slow_in_a_row_ = 0;
  recheck_note_ = "rechecked " + std::to_string(rechecks_) + " time" + (rechecks_ == 1 ? "" : "s") +
                  ", the last because " + placementName(candidates_[chosen_]) + " then ran at " +
                  msPerExample(median_s) + " ms/example, slower than " +
                  placementName(candidates_[rival_index_]) + "'s " + msPerExample(rival_) +
                  " in the probe";
  for (auto& s : samples_) s.clear();
  run_ = {};
  done_ = false;
  chosen_ = 0;
  rival_ = 0;
}

Placement PlacementProbe::chosen() const { return candidates_[done_ ? chosen_ : run_.current]; }

std::vector<PlacementProbe::Result> PlacementProbe::results() const {
  std::vector<Result> out;
  for (size_t i = 0; i < candidates_.size(); ++i) {
    out.push_back({candidates_[i], median(samples_[i]), static_cast<uint32_t>(samples_[i].size())});
  }
  return out;
}

std::string PlacementProbe::report() const {
  std::ostringstream os;
  os << "placement probe";
  if (!recheck_note_.empty()) os << " (" << recheck_note_ << ")";
  os << ":";
  for (const Result& r : results()) {
    os << " " << placementName(r.placement) << " " << msPerExample(r.seconds_per_example)
       << " ms/example (median of " << r.samples << " steps);";
  }
  if (done_ && candidates_[chosen_].in_trainer) {
    os << " chosen: the trainer computes, " << candidates_[chosen_].threads << " threads";
  } else if (done_) {
    os << " chosen " << candidates_[chosen_].workers << " workers x "
       << candidates_[chosen_].threads << " threads";
  } else {
    os << " still probing";
  }
  return os.str();
}

}  // namespace shmgrad::engine
