// Unit tests of engine/control.h, the client side of an engine: readStatus returns what
// the segment holds, formatStatus prints it, requestResize and requestStop write their
// requests and check their arguments. The segments are made with ipc::Segment::create
// (this process plays the coordinator); no libtorch, no worker process.
#include "engine/control.h"

#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "ipc/error.h"
#include "ipc/futex.h"
#include "ipc/layout.h"
#include "ipc/segment.h"
#include "tests/segment_testing.h"

namespace shmgrad::engine {
namespace {

using testing::SegmentGuard;
using testing::throwsKind;

using ipc::Segment;

constexpr uint32_t kSlots = 3;
constexpr int64_t kDatasetSize = 10;
constexpr char kModelPath[] = "/nonexistent/model.pt";
constexpr char kDatasetDescription[] = "ten examples";

std::string uniqueEngineName() {
  static int counter = 0;
  return "controltest-" + std::to_string(getpid()) + "-" + std::to_string(counter++);
}

// A small engine: two parameter tensors, kSlots slots, a dataset of kDatasetSize.
ipc::SegmentSpec smallSpec(const std::string& name) {
  ipc::SegmentSpec s;
  s.name = name;
  s.model_path = kModelPath;
  s.loss = ipc::LossKind::kMse;
  s.num_slots = kSlots;
  s.threads_per_worker = 2;
  s.params = {{"fc.weight", {3, 5}}, {"fc.bias", {3}}};
  s.max_batch = 100;
  s.input_bytes = 4096;
  s.target_bytes = 1024;
  s.data_count = kDatasetSize;
  s.data_example_shape = {5};
  s.data_target_dtype = ipc::DType::kFloat32;
  s.data_target_shape = {3};
  s.data_description = kDatasetDescription;
  return s;
}

// A pid that is certainly dead: a reaped child's.
pid_t deadPid() {
  pid_t child = fork();
  if (child == 0) _exit(0);
  int status = 0;
  waitpid(child, &status, 0);
  return child;
}

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

// The step record the tests write for the k-th step served (0-based): every field
// different, so a field read from the wrong place or a ring read out of order shows.
ipc::StepRecord stepRecord(uint64_t k) {
  ipc::StepRecord r{};
  r.epoch = static_cast<uint32_t>(k + 1);
  r.workers = static_cast<uint32_t>(k % kSlots + 1);
  r.examples = static_cast<int64_t>(10 * (k + 1));
  r.loss_sum = 0.5 * static_cast<double>(k + 1);
  r.wall_ns = 4000000 + k;     // 4 ms
  r.compute_max_ns = 3000000;  // 3 ms
  r.reduce_max_ns = 500000;    // 0.5 ms
  r.wait_ns = 500000 + k;
  return r;
}

// Writes steps_served steps into the ring the way the last reducer does: record k into
// stats[k % kStatsRing], then steps_served = k + 1.
void serveSteps(ipc::SegmentHeader* h, uint64_t steps_served) {
  for (uint64_t k = 0; k < steps_served; ++k) {
    h->stats[k % ipc::kStatsRing] = stepRecord(k);
    h->control.steps_served.store(k + 1);
  }
}

void setWorker(ipc::SegmentHeader* h, uint32_t slot, int32_t pid, ipc::WorkerState state,
               uint32_t restarts, uint32_t busy_epoch, uint32_t assigned_epoch) {
  ipc::WorkerRecord& w = h->workers[slot];
  w.pid.store(pid);
  w.state.store(static_cast<uint32_t>(state));
  w.restarts.store(restarts);
  w.busy_epoch.store(busy_epoch);
  w.assigned_epoch.store(assigned_epoch);
}

// ---------------------------------------------------------------------------------
// readStatus / formatStatus

// Over the number of steps served: none, fewer than the ring holds, exactly a ring,
// and more (the ring has wrapped, once and more than once).
class ReadStatusTest : public ::testing::TestWithParam<uint64_t> {};

TEST_P(ReadStatusTest, ReturnsExactlyWhatTheSegmentHolds) {
  const uint64_t served = GetParam();
  const std::string name = uniqueEngineName();
  SegmentGuard guard(name);
  auto seg = Segment::create(smallSpec(name));
  ipc::SegmentHeader* h = seg->header();
  ipc::ControlBlock& c = h->control;
  c.engine_state.store(static_cast<uint32_t>(ipc::EngineState::kServing));
  c.trainer_pid.store(4242);
  c.step_epoch.store(static_cast<uint32_t>(served + 1));
  c.steps_aborted.store(3);
  c.step_retries.store(2);
  c.worker_restarts.store(5);
  c.target_workers.store(2);
  // Slot 1 stays empty: it must not be listed.
  setWorker(h, 0, 1001, ipc::WorkerState::kReady, 1, 7, 6);
  setWorker(h, 2, 1003, ipc::WorkerState::kRetired, 0, 0, 4);
  serveSteps(h, served);

  const EngineStatus s = readStatus(name);
  EXPECT_EQ(s.name, name);
  EXPECT_EQ(s.state, "serving");
  EXPECT_EQ(s.coordinator_pid, getpid());
  EXPECT_TRUE(s.coordinator_alive);
  EXPECT_EQ(s.segment_path, ipc::segmentPath(name));
  EXPECT_EQ(s.segment_bytes, seg->size());
  EXPECT_EQ(s.model_path, kModelPath);
  EXPECT_EQ(s.loss, "mse");
  EXPECT_EQ(s.loss_reduction, "sum");  // SegmentSpec's default: a named loss
  EXPECT_EQ(s.num_params, 2u);
  EXPECT_EQ(s.param_floats, h->param_floats);
  EXPECT_EQ(s.dataset, kDatasetDescription);
  EXPECT_EQ(s.dataset_size, kDatasetSize);
  EXPECT_EQ(s.max_batch, 100);
  EXPECT_EQ(s.threads_per_worker, 2u);
  EXPECT_EQ(s.trainer_pid, 4242);
  EXPECT_EQ(s.step_epoch, served + 1);
  EXPECT_EQ(s.steps_served, served);
  EXPECT_EQ(s.steps_aborted, 3u);
  EXPECT_EQ(s.step_retries, 2u);
  EXPECT_EQ(s.worker_restarts, 5u);
  EXPECT_EQ(s.target_workers, 2u);
  EXPECT_EQ(s.slots, kSlots);

  ASSERT_EQ(s.workers.size(), 2u);
  EXPECT_EQ(s.workers[0].slot, 0u);
  EXPECT_EQ(s.workers[0].pid, 1001);
  EXPECT_EQ(s.workers[0].state, "ready");
  EXPECT_EQ(s.workers[0].restarts, 1u);
  EXPECT_EQ(s.workers[0].busy_epoch, 7u);
  EXPECT_EQ(s.workers[0].assigned_epoch, 6u);
  EXPECT_EQ(s.workers[1].slot, 2u);
  EXPECT_EQ(s.workers[1].pid, 1003);
  EXPECT_EQ(s.workers[1].state, "retired");
  EXPECT_EQ(s.workers[1].restarts, 0u);
  EXPECT_EQ(s.workers[1].busy_epoch, 0u);
  EXPECT_EQ(s.workers[1].assigned_epoch, 4u);

  // The newest min(served, kStatsRing) steps, oldest first.
  const uint64_t shown = std::min<uint64_t>(served, ipc::kStatsRing);
  ASSERT_EQ(s.recent_steps.size(), shown);
  for (uint64_t i = 0; i < shown; ++i) {
    const uint64_t k = served - shown + i;
    const ipc::StepRecord want = stepRecord(k);
    const StepSummary& got = s.recent_steps[i];
    SCOPED_TRACE("step record " + std::to_string(k));
    EXPECT_EQ(got.epoch, want.epoch);
    EXPECT_EQ(got.workers, want.workers);
    EXPECT_EQ(got.examples, want.examples);
    EXPECT_DOUBLE_EQ(got.loss_sum, want.loss_sum);
    EXPECT_DOUBLE_EQ(got.wall_seconds, want.wall_ns / 1e9);
    EXPECT_DOUBLE_EQ(got.compute_seconds, want.compute_max_ns / 1e9);
    EXPECT_DOUBLE_EQ(got.reduce_seconds, want.reduce_max_ns / 1e9);
    EXPECT_DOUBLE_EQ(got.wait_seconds, want.wait_ns / 1e9);
  }

  const std::string text = formatStatus(s);
  EXPECT_TRUE(contains(text, "engine " + name + " (serving), coordinator pid " +
                                 std::to_string(getpid()) + ", segment " + ipc::segmentPath(name)))
      << text;
  EXPECT_FALSE(contains(text, "not running")) << text;
  EXPECT_TRUE(
      contains(text, std::string("model ") + kModelPath + ", loss mse, 2 parameter tensors"))
      << text;
  EXPECT_TRUE(contains(text, "dataset ten examples: 10 examples")) << text;
  EXPECT_TRUE(contains(text, "trainer: pid 4242")) << text;
  EXPECT_TRUE(contains(
      text, "steps served " + std::to_string(served) + ", aborted 3, retried 2, worker restarts 5"))
      << text;
  EXPECT_TRUE(contains(text, "workers (target 2 of 3 slots):")) << text;
  EXPECT_TRUE(contains(text, "  worker 0: pid 1001, ready, restarts 1, cpu\n")) << text;
  EXPECT_TRUE(contains(text, "  worker 2: pid 1003, retired, restarts 0, cpu\n")) << text;
  EXPECT_FALSE(contains(text, "worker 1:")) << text;
  EXPECT_EQ(contains(text, "last " + std::to_string(shown) + " steps (ms)"), shown > 0) << text;
  // Every shown step's line, in order, oldest first.
  size_t at = 0;
  for (const StepSummary& r : s.recent_steps) {
    char line[64];
    std::snprintf(line, sizeof(line), "  step %6u  batch %6lld", r.epoch,
                  static_cast<long long>(r.examples));
    const size_t found = text.find(line, at);
    ASSERT_NE(found, std::string::npos) << "missing or out of order: '" << line << "'\n" << text;
    at = found + 1;
  }
}

INSTANTIATE_TEST_SUITE_P(StepsServed, ReadStatusTest,
                         ::testing::Values(0, 1, 3, ipc::kStatsRing, ipc::kStatsRing + 4,
                                           3 * ipc::kStatsRing + 5));

TEST(ReadStatusTest, OutOfRangeStatesReadAsUnknown) {
  // A state word outside its enumeration (a newer writer, a torn header) is shown as
  // "unknown", never used as an index.
  const std::string name = uniqueEngineName();
  SegmentGuard guard(name);
  auto seg = Segment::create(smallSpec(name));
  seg->header()->control.engine_state.store(99);
  seg->header()->workers[1].pid.store(1002);
  seg->header()->workers[1].state.store(77);
  seg->header()->control.loss_reduction.store(5);
  const EngineStatus s = readStatus(name);
  EXPECT_EQ(s.state, "unknown");
  EXPECT_EQ(s.loss_reduction, "unknown");
  ASSERT_EQ(s.workers.size(), 1u);
  EXPECT_EQ(s.workers[0].slot, 1u);
  EXPECT_EQ(s.workers[0].state, "unknown");
  EXPECT_EQ(s.state, ipc::engineStateName(static_cast<ipc::EngineState>(99)));
}

TEST(ReadStatusTest, NoEngineIsNotFound) {
  std::string message;
  EXPECT_TRUE(throwsKind(
      ErrorKind::kNotFound, [] { readStatus(uniqueEngineName()); }, &message));
  EXPECT_TRUE(contains(message, "no engine named")) << message;
}

TEST(FormatStatusTest, UsesTheStructOnly) {
  // No segment behind this status: formatStatus prints what it is given.
  EngineStatus s;
  s.name = "nowhere";
  s.state = "stopping";
  s.coordinator_pid = 12345;
  s.coordinator_alive = false;
  s.segment_path = "/dev/shm/shmgrad-0-nowhere";
  s.segment_bytes = 3 * 1048576;
  s.model_path = "/m.pt";
  s.loss = "nll";
  s.num_params = 4;
  s.param_floats = 64;
  s.trainer_pid = 0;
  s.target_workers = 1;
  s.slots = 2;
  s.devices = "cuda:1,cuda:0";
  s.param_sync_bytes = 256;
  s.workers.push_back({1, 77, "dead", 9, 0, 0, "cuda:0"});
  const std::string text = formatStatus(s);
  EXPECT_TRUE(contains(text,
                       "engine nowhere (stopping), coordinator pid 12345 (not running), "
                       "segment /dev/shm/shmgrad-0-nowhere (3.0 MiB)\n"))
      << text;
  EXPECT_TRUE(contains(text, "model /m.pt, loss nll, 4 parameter tensors, 64 floats\n")) << text;
  EXPECT_FALSE(contains(text, "dataset")) << text;
  EXPECT_TRUE(contains(text, "trainer: none\n")) << text;
  EXPECT_TRUE(contains(text, "  worker 1: pid 77, dead, restarts 9, cuda:0\n")) << text;
  EXPECT_TRUE(contains(text, "devices cuda:1,cuda:0 (the trainer's first): 256 bytes")) << text;
  EXPECT_FALSE(contains(text, "steps (ms)")) << text;
}

// ---------------------------------------------------------------------------------
// requestResize

TEST(RequestResizeTest, SetsTheTargetAndWakesTheCoordinator) {
  const std::string name = uniqueEngineName();
  SegmentGuard guard(name);
  auto seg = Segment::create(smallSpec(name));
  ipc::ControlBlock& c = seg->header()->control;
  const uint32_t wake_before = c.coordinator_wake.load();
  requestResize(name, 2);
  EXPECT_EQ(c.target_workers.load(), 2u);
  EXPECT_NE(c.coordinator_wake.load(), wake_before);
  requestResize(name, kSlots);
  EXPECT_EQ(c.target_workers.load(), kSlots);
}

TEST(RequestResizeTest, OutOfRangeIsInvalidArgumentNamingTheSlots) {
  const std::string name = uniqueEngineName();
  SegmentGuard guard(name);
  auto seg = Segment::create(smallSpec(name));
  ipc::ControlBlock& c = seg->header()->control;
  c.target_workers.store(1);
  for (uint32_t n : {0u, kSlots + 1, ipc::kMaxWorkers + 1}) {
    SCOPED_TRACE("n = " + std::to_string(n));
    std::string message;
    EXPECT_TRUE(throwsKind(
        ErrorKind::kInvalidArgument, [&] { requestResize(name, n); }, &message));
    EXPECT_TRUE(contains(message, "it has 3 slots")) << message;
    EXPECT_TRUE(contains(message, "--max-workers")) << message;
    EXPECT_EQ(c.target_workers.load(), 1u) << "a refused resize must not change the target";
  }
}

TEST(RequestResizeTest, NoEngineIsNotFound) {
  EXPECT_TRUE(throwsKind(ErrorKind::kNotFound, [] { requestResize(uniqueEngineName(), 1); }));
}

// ---------------------------------------------------------------------------------
// requestStop

TEST(RequestStopTest, DeadCoordinatorsSegmentIsRemoved) {
  const std::string name = uniqueEngineName();
  SegmentGuard guard(name);
  auto seg = Segment::create(smallSpec(name));
  const pid_t dead = deadPid();
  ASSERT_FALSE(ipc::processAlive(dead));
  seg->header()->coordinator_pid = dead;
  seg.reset();  // the "coordinator" dies: its lock on the segment goes with it
  ASSERT_TRUE(Segment::exists(name));

  const uint64_t start = ipc::monotonicNs();
  EXPECT_TRUE(requestStop(name, 10));
  EXPECT_FALSE(Segment::exists(name));
  // Removed at once, not after waiting out the timeout.
  EXPECT_LT(ipc::monotonicNs() - start, 5000000000ull);
}

TEST(RequestStopTest, LiveCoordinatorIsAskedAndWaitedFor) {
  const std::string name = uniqueEngineName();
  SegmentGuard guard(name);
  auto seg = Segment::create(smallSpec(name));  // this process is the live coordinator
  ipc::ControlBlock& c = seg->header()->control;
  const uint32_t wake_before = c.coordinator_wake.load();

  // A coordinator thread: waits (bounded) to be woken with a stop request, then removes
  // its segment as the real one does at the end of its shutdown.
  std::atomic<bool> saw_stop{false};
  std::thread coordinator([&] {
    const uint64_t deadline = ipc::monotonicNs() + 10000000000ull;
    saw_stop = ipc::waitUntil(
        &c.coordinator_wake, [&] { return c.stop_requested.load() == 1; }, [] { return true; },
        deadline);
    if (saw_stop) Segment::remove(name);
  });
  const bool stopped = requestStop(name, 10);
  coordinator.join();
  EXPECT_TRUE(saw_stop);
  EXPECT_TRUE(stopped);
  EXPECT_NE(c.coordinator_wake.load(), wake_before);
  EXPECT_FALSE(Segment::exists(name));
}

TEST(RequestStopTest, LiveCoordinatorThatDoesNotStopTimesOut) {
  const std::string name = uniqueEngineName();
  SegmentGuard guard(name);
  auto seg = Segment::create(smallSpec(name));  // alive, and never removes its segment
  const uint64_t start = ipc::monotonicNs();
  EXPECT_FALSE(requestStop(name, 0.2));
  const uint64_t took = ipc::monotonicNs() - start;
  EXPECT_GE(took, 200000000ull);
  EXPECT_LT(took, 5000000000ull);
  EXPECT_EQ(seg->header()->control.stop_requested.load(), 1u);
  EXPECT_TRUE(Segment::exists(name)) << "a live coordinator's segment must be left alone";
}

TEST(RequestStopTest, BadTimeoutIsInvalidArgument) {
  const std::string name = uniqueEngineName();
  SegmentGuard guard(name);
  auto seg = Segment::create(smallSpec(name));
  EXPECT_TRUE(throwsKind(ErrorKind::kInvalidArgument, [&] { requestStop(name, -1); }));
  EXPECT_TRUE(throwsKind(ErrorKind::kInvalidArgument, [&] { requestStop(name, 1e12); }));
  EXPECT_EQ(seg->header()->control.stop_requested.load(), 0u) << "refused before asking";
}

TEST(RequestStopTest, NoEngineIsNotFound) {
  EXPECT_TRUE(throwsKind(ErrorKind::kNotFound, [] { requestStop(uniqueEngineName(), 1); }));
}

}  // namespace
}  // namespace shmgrad::engine
