// The step protocol's synchronisation with threads standing in for processes, so that
// ThreadSanitizer (bazel test --config=tsan, with clang) can check its memory ordering:
// trainer publishes an epoch, workers write their slots, meet at the compute barrier,
// reduce their slices in place, meet at the reduce barrier, and the last one completes
// the step. Also: an aborted step releases the waiters, and stale arrivals never count.
#include <gtest/gtest.h>

#include <atomic>
#include <random>
#include <thread>
#include <vector>

#include "ipc/barrier.h"
#include "ipc/futex.h"
#include "ipc/layout.h"
#include "ipc/reduce.h"

namespace shmgrad::ipc {
namespace {

constexpr uint64_t kFloats = 4096 + 7;
constexpr uint64_t kSecond = 1000000000ull;

struct Shared {
  ControlBlock c{};
  std::atomic<uint32_t> assigned[kMaxWorkers]{};
  std::atomic<uint32_t> nparticipants{0};
  std::atomic<uint32_t> stop{0};
  std::vector<std::vector<float>> slots;
  std::vector<float> reduced;
};

void workerThread(Shared* s, uint32_t id) {
  uint32_t last = 0;
  while (s->stop.load(std::memory_order_acquire) == 0) {
    const uint32_t e = s->c.step_epoch.load(std::memory_order_acquire);
    const uint32_t rank = s->assigned[id].load(std::memory_order_acquire);
    if (e == last || (rank >> 16) != (e & 0xffffu)) {
      futexWait(&s->c.step_epoch, e, std::chrono::milliseconds(20));
      continue;
    }
    last = e;
    const uint32_t r = rank & 0xffffu;
    const uint32_t n = s->nparticipants.load(std::memory_order_relaxed);
    // "Backward": this participant's slot gets values the trainer can predict.
    for (uint64_t i = 0; i < kFloats; ++i)
      s->slots[r][i] = static_cast<float>((e % 97) + r + i % 5);
    const uint64_t deadline = monotonicNs() + 10 * kSecond;
    auto alive = [] { return true; };
    if (!barrierWait(s->c.compute_barrier, e, n, s->c.abort_epoch, deadline, alive, 100)) continue;
    uint64_t b, end;
    sliceBounds(kFloats, n, r, &b, &end);
    const float* ins[kMaxWorkers];
    for (uint32_t k = 0; k < n; ++k) ins[k] = s->slots[k].data();
    reduceSlice(s->reduced.data(), ins, n, b, end, 1.0f);
    if (arriveBarrier(s->c.reduce_barrier, e) == n) {
      s->c.done_epoch.store(e, std::memory_order_release);
      s->c.trainer_wake.fetch_add(1, std::memory_order_acq_rel);
      futexWake(&s->c.trainer_wake);
    }
  }
}

TEST(SyncTest, StepProtocolWithThreadsGivesExactSums) {
  constexpr uint32_t kWorkers = 4;
  Shared s;
  s.slots.assign(kWorkers, std::vector<float>(kFloats, 0.0f));
  s.reduced.assign(kFloats, 0.0f);
  std::vector<std::thread> threads;
  for (uint32_t i = 0; i < kWorkers; ++i) threads.emplace_back(workerThread, &s, i);
  std::mt19937 rng(1);
  for (uint32_t e = 1; e <= 300; ++e) {
    const uint32_t n = 1 + rng() % kWorkers;
    s.nparticipants.store(n, std::memory_order_relaxed);
    // Participants are threads 0..n-1 with rank == id; the others stay idle.
    for (uint32_t i = 0; i < kWorkers; ++i) {
      s.assigned[i].store(i < n ? (((e & 0xffffu) << 16) | i) : 0, std::memory_order_release);
    }
    s.c.compute_barrier.store(barrierTag(e), std::memory_order_relaxed);
    s.c.reduce_barrier.store(barrierTag(e), std::memory_order_relaxed);
    s.c.step_epoch.store(e, std::memory_order_release);
    futexWake(&s.c.step_epoch);
    ASSERT_TRUE(waitUntil(
        &s.c.trainer_wake, [&] { return s.c.done_epoch.load(std::memory_order_acquire) == e; },
        [] { return true; }, monotonicNs() + 10 * kSecond))
        << "epoch " << e << " did not complete";
    for (uint64_t i = 0; i < kFloats; i += 97) {
      float expect = 0;
      for (uint32_t r = 0; r < n; ++r) expect += static_cast<float>((e % 97) + r + i % 5);
      ASSERT_EQ(s.reduced[i], expect) << "epoch " << e << " index " << i;
    }
  }
  s.stop.store(1, std::memory_order_release);
  futexWake(&s.c.step_epoch);
  for (auto& t : threads) t.join();
}

TEST(SyncTest, AbortReleasesWaitersAndStaleArrivalsNeverCount) {
  ControlBlock c{};
  const uint32_t e = 5;
  c.compute_barrier.store(barrierTag(e));
  std::atomic<int> released{0};
  std::vector<std::thread> waiters;
  // Three of four participants arrive; the fourth "died".
  for (int i = 0; i < 3; ++i) {
    waiters.emplace_back([&] {
      bool ok = barrierWait(
          c.compute_barrier, e, 4, c.abort_epoch, monotonicNs() + 20 * kSecond, [] { return true; },
          100);
      if (!ok) released.fetch_add(1);
    });
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  EXPECT_EQ(released.load(), 0);
  const uint64_t t0 = monotonicNs();
  c.abort_epoch.store(e, std::memory_order_release);
  futexWake(&c.compute_barrier);
  for (auto& t : waiters) t.join();
  EXPECT_EQ(released.load(), 3);
  EXPECT_LT(monotonicNs() - t0, 2 * kSecond);

  // The re-run (epoch 6) resets the tag: a late arrival for epoch 5 does not count.
  c.compute_barrier.store(barrierTag(6));
  EXPECT_EQ(arriveBarrier(c.compute_barrier, 5), 0u);
  EXPECT_EQ(arriveBarrier(c.compute_barrier, 6), 1u);
  EXPECT_EQ(c.compute_barrier.load() & 0xffffu, 1u);
}

}  // namespace
}  // namespace shmgrad::ipc

namespace shmgrad::ipc {
namespace {

// Spinning adapts: it stops where it loses and comes back where it wins.
TEST(AdaptiveSpinTest, ShrinksOnLossesDoublesOnWinsAndProbesAgain) {
  constexpr uint64_t kMax = 1000000;
  AdaptiveSpin spin;
  EXPECT_EQ(spin.next(kMax), kMax);  // the first wait may spin the full budget
  EXPECT_EQ(spin.next(0), 0u);       // nothing allowed: no spin
  uint64_t b = spin.next(kMax);
  int losses = 0;
  while (b > 0) {
    spin.result(false, b, kMax);
    const uint64_t n = spin.next(kMax);
    EXPECT_LE(n, b - b / 4);
    b = n;
    ++losses;
  }
  EXPECT_LE(losses, 25);  // 1 ms shrinks by quarters below 2 us within 25 losses
  EXPECT_GE(losses, 20);  // but one loss alone does not end spinning
  // Not spinning now (the loop's last next() was the first wait without); the
  // kSpinProbeEvery-th such wait tries the full budget once.
  int waits_without = 1;
  while (spin.next(kMax) == 0) ++waits_without;
  EXPECT_EQ(waits_without + 1, static_cast<int>(AdaptiveSpin::kSpinProbeEvery));
  spin.result(true, kMax, kMax);  // the probe won: spinning is back
  EXPECT_EQ(spin.next(kMax), kMax);
  spin.result(true, 4000, kMax);
  EXPECT_LE(spin.next(kMax), kMax);  // never above the allowed maximum
  EXPECT_EQ(spin.next(3000), 3000u);
}

}  // namespace
}  // namespace shmgrad::ipc
