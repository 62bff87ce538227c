// The placement probe (engine/placement.h) on made-up step times: which candidates it
// tries, in what order, when it stops, and what it keeps.
#include "engine/placement.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <utility>

namespace shmgrad::engine {
namespace {

// No settling and no minimum timed phase: one untimed and one timed step per visit.
ProbeOptions quick(uint32_t rounds, double budget_s) {
  ProbeOptions o;
  o.rounds = rounds;
  o.budget_s = budget_s;
  return o;
}

std::vector<std::pair<uint32_t, uint32_t>> pairs(const std::vector<Placement>& ps) {
  std::vector<std::pair<uint32_t, uint32_t>> out;
  for (const Placement& p : ps) out.emplace_back(p.workers, p.threads);
  return out;
}

TEST(AutoStart, OneWorkerPerCoreEachAbleToUseEveryCoreBoundedByMaxWorkers) {
  const uint32_t cores = physicalCores();
  const Placement all = autoStart(0);
  EXPECT_EQ(all.threads, cores);
  EXPECT_EQ(all.workers, std::min<uint32_t>(cores, 64));
  const Placement one = autoStart(1);
  EXPECT_EQ(one.workers, 1u);
  EXPECT_EQ(one.threads, cores);
}

TEST(PlacementCandidates, OneWorkerWithEveryThreadFirstThenPowersOfTwoAndOnePerCore) {
  using V = std::vector<std::pair<uint32_t, uint32_t>>;
  EXPECT_EQ(pairs(placementCandidates(2, 2)), (V{{1, 2}, {2, 1}}));
  EXPECT_EQ(pairs(placementCandidates(16, 16)), (V{{1, 16}, {2, 8}, {4, 4}, {8, 2}, {16, 1}}));
  EXPECT_EQ(pairs(placementCandidates(6, 64)), (V{{1, 6}, {2, 3}, {4, 1}, {6, 1}}));
  EXPECT_EQ(pairs(placementCandidates(16, 3)), (V{{1, 16}, {2, 8}, {3, 5}}));  // slots bound it
  EXPECT_EQ(pairs(placementCandidates(1, 8)), (V{{1, 1}}));
  EXPECT_EQ(pairs(placementCandidates(0, 0)), (V{{1, 1}}));
}

// Runs a probe whose steps take `ms_per_example[workers]` per example (batch 100); returns
// the placements the steps ran with, in order.
std::vector<uint32_t> drive(PlacementProbe* probe, std::map<uint32_t, double> ms_per_example,
                            double budget_clock_step_s = 0.001) {
  std::vector<uint32_t> ran;
  double clock = 0;
  for (int step = 0; step < 100 && !probe->done(); ++step) {
    const Placement p = probe->next();
    ran.push_back(p.workers);
    const double seconds = ms_per_example.at(p.workers) * 100 / 1e3;
    clock += budget_clock_step_s;
    probe->record(seconds, 100, clock);
  }
  return ran;
}

TEST(PlacementProbe, VisitsEachCandidateWithAnUntimedThenATimedStepForEveryRound) {
  PlacementProbe probe(placementCandidates(2, 2), quick(3, 1e9));
  const auto ran = drive(&probe, {{1, 0.5}, {2, 0.3}});
  EXPECT_EQ(ran, (std::vector<uint32_t>{1, 1, 2, 2, 1, 1, 2, 2, 1, 1, 2, 2}));
  ASSERT_TRUE(probe.done());
  EXPECT_EQ(probe.chosen().workers, 2u);
  EXPECT_EQ(probe.chosen().threads, 1u);
  EXPECT_EQ(probe.next().workers, 2u);  // every later step
  for (const auto& r : probe.results()) EXPECT_EQ(r.samples, 3u);
  EXPECT_NE(probe.report().find("chosen 2 workers x 1 threads"), std::string::npos)
      << probe.report();
}

TEST(PlacementProbe, KeepsTheFastestPerExampleAndTheFirstListedOnATie) {
  PlacementProbe fast_one(placementCandidates(16, 16), quick(3, 1e9));
  drive(&fast_one, {{1, 0.2}, {2, 0.3}, {4, 0.25}, {8, 0.4}, {16, 0.5}});
  EXPECT_EQ(fast_one.chosen().workers, 1u);
  EXPECT_EQ(fast_one.chosen().threads, 16u);
  PlacementProbe fast_four(placementCandidates(16, 16), quick(3, 1e9));
  drive(&fast_four, {{1, 0.2}, {2, 0.3}, {4, 0.1}, {8, 0.4}, {16, 0.5}});
  EXPECT_EQ(fast_four.chosen().workers, 4u);
  PlacementProbe tie(placementCandidates(2, 2), quick(3, 1e9));
  drive(&tie, {{1, 0.300}, {2, 0.299}});  // within 1%: not clearly faster
  EXPECT_EQ(tie.chosen().workers, 1u);
}

TEST(PlacementProbe, MediansIgnoreAnOutlierAndBatchSizesAreNormalised) {
  PlacementProbe probe(placementCandidates(2, 2), quick(3, 1e9));
  double clock = 0;
  int timed = 0;
  while (!probe.done()) {
    const Placement p = probe.next();
    // One worker: 1 ms per example, once 50 ms (a hiccup); two: 0.8 ms, batches of 10 and 40.
    const int64_t batch = (timed % 2 == 0) ? 10 : 40;
    double per = p.workers == 1 ? 1e-3 : 0.8e-3;
    if (p.workers == 1 && timed == 2) per = 50e-3;
    clock += 0.01;
    probe.record(per * batch, batch, clock);
    ++timed;
  }
  EXPECT_EQ(probe.chosen().workers, 2u);
  EXPECT_NEAR(probe.results()[0].seconds_per_example, 1e-3, 1e-9);
  EXPECT_NEAR(probe.results()[1].seconds_per_example, 0.8e-3, 1e-9);
}

TEST(PlacementProbe, EndsEarlyOnceItsBudgetIsSpentAndEveryCandidateWasTimed) {
  ProbeOptions o = quick(3, 0.5);
  o.min_samples = 8;  // however few samples the candidates have
  PlacementProbe probe(placementCandidates(2, 2), o);
  // Each step takes 0.2 s of the clock: the budget is spent within the first round.
  const auto ran = drive(&probe, {{1, 1.0}, {2, 2.0}}, 0.2);
  EXPECT_EQ(ran, (std::vector<uint32_t>{1, 1, 2, 2}));
  ASSERT_TRUE(probe.done());
  EXPECT_EQ(probe.chosen().workers, 1u);
}

// Steps long enough to give each visit one sample: rounds go on until every candidate has
// min_samples, so that a median of a few noisy steps does not choose.
TEST(PlacementProbe, LongStepsGetMoreRoundsUntilEveryCandidateHasItsSamples) {
  ProbeOptions o = quick(3, 1e9);
  o.min_samples = 8;
  PlacementProbe probe(placementCandidates(2, 2), o);
  const auto ran = drive(&probe, {{1, 0.5}, {2, 0.3}});
  std::vector<uint32_t> want;
  for (int round = 0; round < 8; ++round) want.insert(want.end(), {1, 1, 2, 2});
  EXPECT_EQ(ran, want);
  ASSERT_TRUE(probe.done());
  for (const auto& r : probe.results()) EXPECT_EQ(r.samples, 8u);
  EXPECT_EQ(probe.chosen().workers, 2u);
}

// Short steps: a timed phase gives each visit several samples, and the rounds are enough.
TEST(PlacementProbe, ShortStepsReachTheirSamplesWithinTheRounds) {
  ProbeOptions o = quick(3, 1e9);
  o.min_samples = 8;
  o.timed_s = 0.045;
  PlacementProbe probe(placementCandidates(2, 2), o);
  // Steps of 10 ms: one untimed step, then 5 samples a visit.
  const auto ran = drive(&probe, {{1, 0.1}, {2, 0.2}}, 0.01);
  EXPECT_EQ(ran.size(), 3u * 2u * 6u);
  ASSERT_TRUE(probe.done());
  for (const auto& r : probe.results()) EXPECT_EQ(r.samples, 15u);
  EXPECT_EQ(probe.chosen().workers, 1u);
}

TEST(PlacementProbe, AStepReRunAfterALostWorkerIsNoSample) {
  PlacementProbe probe(placementCandidates(2, 2), quick(1, 1e9));
  probe.record(1.0, 10, 1.0);         // 1x2, untimed
  probe.record(9.0, 10, 2.0, false);  // 1x2, re-run: no sample, the visit goes on
  EXPECT_EQ(probe.next().workers, 1u);
  probe.record(0.1, 10, 3.0);  // 1x2 timed
  EXPECT_EQ(probe.next().workers, 2u);
  probe.record(0.2, 10, 4.0);
  probe.record(0.2, 10, 5.0);
  ASSERT_TRUE(probe.done());
  EXPECT_EQ(probe.chosen().workers, 1u);
  EXPECT_NEAR(probe.results()[0].seconds_per_example, 0.01, 1e-12);
}

TEST(PlacementProbe, AVisitSettlesThenIsTimedEachForItsSeconds) {
  ProbeOptions o = quick(1, 1e9);
  o.settle_s = 0.045;
  o.timed_s = 0.045;
  PlacementProbe probe(placementCandidates(2, 2), o);
  // Steps of 10 ms: 5 settle a visit (the last ends 50 ms after the visit began), 5 more
  // are its samples.
  const auto ran = drive(&probe, {{1, 0.1}, {2, 0.1}}, 0.01);
  EXPECT_EQ(ran,
            (std::vector<uint32_t>{1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2}));
  ASSERT_TRUE(probe.done());
  for (const auto& r : probe.results()) EXPECT_EQ(r.samples, 5u);
  EXPECT_EQ(probe.chosen().workers, 1u);
}

// The watch of the kept placement (options as the trainer's, visits of one step each).
ProbeOptions watched(uint32_t max_rechecks) {
  ProbeOptions o = quick(3, 1e9);
  o.watch_samples = 16;
  o.watch_s = 2;
  o.recheck_margin = 0.1;
  o.slow_windows = 2;
  o.max_rechecks = max_rechecks;
  return o;
}

struct Ran {
  uint32_t workers;
  bool kept;  // the probe was done: the kept placement's step
};

// Runs steps of 128 examples, back to back, taking seconds(step, workers, kept) each (all
// the times here are sums of powers of two: exact, so the windows end on known steps).
template <typename F>
std::vector<Ran> run(PlacementProbe* probe, int steps, F seconds) {
  std::vector<Ran> ran;
  double clock = 0;
  for (int step = 0; step < steps; ++step) {
    const Placement p = probe->next();
    ran.push_back({p.workers, probe->done()});
    const double s = seconds(step, p.workers, probe->done());
    clock += s;
    probe->record(s, 128, clock);
  }
  return ran;
}

std::vector<uint32_t> workersOf(const std::vector<Ran>& ran, size_t from, size_t to) {
  std::vector<uint32_t> out;
  for (size_t i = from; i < to && i < ran.size(); ++i) out.push_back(ran[i].workers);
  return out;
}

const std::vector<uint32_t> kProbeOrder = {1, 1, 2, 2, 1, 1, 2, 2, 1, 1, 2, 2};

// A probe that timed 2 workers in a fast phase of the machine keeps them; when their steps
// then run slower than one worker's did in the probe, it probes again and keeps that.
TEST(PlacementProbe, AKeptPlacementThatTurnsSlowerThanTheRunnerUpIsRechecked) {
  PlacementProbe probe(placementCandidates(2, 2), watched(3));
  // One worker: 125 ms a step. Two: 62.5 ms until step 60, then 250 ms.
  const auto ran = run(&probe, 200, [](int step, uint32_t w, bool) {
    return w == 1 ? 0.125 : (step < 60 ? 0.0625 : 0.25);
  });
  // Steps 0-11 probe. The watch's first window is 2 s of fast steps (12-43); the second,
  // from step 44, has 16 fast steps (1 s) and 4 slow ones (1 s): its median is fast. The
  // third, from step 64, is slow and ends with its 16th sample (step 79, 4 s), and so
  // does the fourth (80-95): two slow windows in a row, the probe runs again (steps
  // 96-107) and keeps one worker.
  EXPECT_EQ(workersOf(ran, 0, 12), kProbeOrder);
  EXPECT_EQ(workersOf(ran, 12, 96), std::vector<uint32_t>(84, 2));
  EXPECT_EQ(workersOf(ran, 96, 108), kProbeOrder);
  EXPECT_FALSE(ran[107].kept);
  EXPECT_EQ(workersOf(ran, 108, 200), std::vector<uint32_t>(92, 1));
  EXPECT_TRUE(ran[108].kept);
  EXPECT_EQ(probe.rechecks(), 1u);
  EXPECT_EQ(probe.chosen().workers, 1u);
  EXPECT_NE(probe.report().find("rechecked 1 time, the last because 2x1 then ran at 1.953 "
                                "ms/example, slower than 1x2's 0.9766 in the probe"),
            std::string::npos)
      << probe.report();
  EXPECT_NE(probe.report().find("chosen 1 workers x 2 threads"), std::string::npos);
}

// A slow phase of the machine that fills one window, not two: no recheck.
TEST(PlacementProbe, OneSlowWindowAloneIsNotRechecked) {
  PlacementProbe probe(placementCandidates(2, 2), watched(3));
  // Two workers kept (62.5 ms against 125 ms); steps 64-79 take 250 ms: the second window
  // (44-66) has 3 of them, the third (67-82) is slow, the fourth (from 83) fast again.
  const auto ran = run(&probe, 300, [](int step, uint32_t w, bool) {
    return w == 1 ? 0.125 : (step >= 64 && step < 80 ? 0.25 : 0.0625);
  });
  EXPECT_EQ(workersOf(ran, 0, 12), kProbeOrder);
  EXPECT_EQ(workersOf(ran, 12, 300), std::vector<uint32_t>(288, 2));
  EXPECT_EQ(probe.rechecks(), 0u);
}

TEST(PlacementProbe, AKeptPlacementWithinTheMarginIsNotRechecked) {
  PlacementProbe probe(placementCandidates(2, 2), watched(3));
  // One worker kept (125 ms against 140.625 ms); every third step a 1 s hiccup, and from
  // step 100 one worker's steps take 148.4375 ms: slower than two workers' in the probe,
  // by 5.6 %, within the margin (10 %).
  const auto ran = run(&probe, 600, [](int step, uint32_t w, bool) {
    if (w == 2) return 0.140625;
    if (step > 12 && step % 3 == 0) return 1.0;
    return step < 100 ? 0.125 : 0.1484375;
  });
  EXPECT_EQ(workersOf(ran, 0, 12), kProbeOrder);
  EXPECT_EQ(workersOf(ran, 12, 600), std::vector<uint32_t>(588, 1));
  EXPECT_EQ(probe.rechecks(), 0u);
  EXPECT_EQ(probe.report().find("rechecked"), std::string::npos);
}

// Whatever is kept runs 1.5 times slower than the other candidate did in the probe: the
// probe runs again after two windows of 2 s, then two of 4 s, and no more than
// max_rechecks times.
TEST(PlacementProbe, RechecksAreBoundedAndTheirWindowsGrow) {
  PlacementProbe probe(placementCandidates(2, 2), watched(2));
  const auto ran = run(&probe, 300, [](int, uint32_t w, bool kept) {
    return kept ? 0.09375 : (w == 1 ? 0.0625 : 0.03125);
  });
  std::vector<int> kept_runs;  // lengths of the runs of kept steps
  for (size_t i = 0; i < ran.size(); ++i) {
    if (!ran[i].kept) continue;
    if (i == 0 || !ran[i - 1].kept) kept_runs.push_back(0);
    ++kept_runs.back();
  }
  // 2 s of 93.75 ms steps: 22 steps, two windows 44; 4 s: 43, two 86; then watched no more.
  ASSERT_EQ(kept_runs.size(), 3u);
  EXPECT_EQ(kept_runs[0], 44);
  EXPECT_EQ(kept_runs[1], 86);
  EXPECT_EQ(kept_runs[2], 300 - 3 * 12 - 44 - 86);
  EXPECT_EQ(probe.rechecks(), 2u);
  EXPECT_NE(probe.report().find("rechecked 2 times"), std::string::npos) << probe.report();
}

TEST(PlacementProbe, OneCandidateNeedsNoProbe) {
  PlacementProbe probe(placementCandidates(1, 4), quick(3, 10));
  EXPECT_TRUE(probe.done());
  EXPECT_EQ(probe.next().workers, 1u);
  EXPECT_EQ(probe.next().threads, 1u);
}

}  // namespace
}  // namespace shmgrad::engine
