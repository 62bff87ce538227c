// The step protocol end to end in one process: the real Trainer (engine/trainer.h)
// drives StepParticipant threads (worker/step_protocol.h) whose compute phase is a
// fake ShardComputer with a known gradient, so every sum can be checked exactly. This
// is the contract any new kind of worker plugs into.
#include <gtest/gtest.h>
#include <torch/torch.h>
#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <limits>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "engine/trainer.h"
#include "ipc/error.h"
#include "ipc/futex.h"
#include "ipc/segment.h"
#include "ipc/step.h"
#include "tests/segment_testing.h"
#include "worker/step_protocol.h"

namespace shmgrad {
namespace {

using ipc::Segment;
using ipc::SegmentSpec;
using worker::Shard;
using worker::ShardComputer;
using worker::StepParticipant;

constexpr int64_t kDataCount = 50;

std::string uniqueName() {
  static int counter = 0;
  return "steptest-" + std::to_string(getpid()) + "-" + std::to_string(counter++);
}

// Example i contributes value(i, j) = (i + 1) * (j + 1) to gradient float j and i to the
// loss. With explicit batches the example's input value plays the part of i.
class FakeComputer : public ShardComputer {
 public:
  FakeComputer(const Segment& seg, std::atomic<int>* calls) : seg_(seg), calls_(calls) {}
  void beginShard(const Shard&) override { calls_->fetch_add(1); }
  worker::PassResult computePass(const Shard& s, int64_t begin, int64_t end) override {
    passes.fetch_add(1);
    const uint64_t floats = seg_.header()->param_floats;
    // As the accumulators' pre hooks would: a parameter's first gradient of the shard is
    // written, not added (the slot was not zeroed for it). This fake's gradient covers the
    // padding after each parameter too (a real backward never writes it): written with it.
    if (hooked != nullptr) {
      const ipc::ParamEntry* table = seg_.paramTable();
      const uint32_t n = seg_.header()->num_params;
      for (uint32_t i = 0; i < n; ++i) {
        if (hooked->gradFirstWrite(i)) {
          const uint64_t end = i + 1 < n ? table[i + 1].offset : floats;
          std::fill(s.grads + table[i].offset, s.grads + end, 0.0f);
        }
      }
    }
    double loss = 0;
    for (int64_t k = begin; k < end; ++k) {
      int64_t i;
      if (s.kind == ipc::BatchKind::kIndices) {
        i = s.indices[k];
      } else if (s.kind == ipc::BatchKind::kStructured) {
        i = static_cast<int64_t>(static_cast<const float*>(s.leaf_data[0])[k]);
      } else {
        i = static_cast<int64_t>(static_cast<const float*>(s.inputs)[k]);
      }
      if (i == fail_on) throw std::runtime_error("example " + std::to_string(i) + " is poison");
      for (uint64_t j = 0; j < floats; ++j) {
        s.grads[j] += s.grad_scale * static_cast<float>((i + 1) * static_cast<int64_t>(j + 1));
      }
      loss += static_cast<double>(i);
    }
    // As backward's hooks would (worker/grad_hooks.h): the last parameter first.
    if (hooked != nullptr) {
      for (uint32_t i = seg_.header()->num_params; i-- > 0;) hooked->gradReady(i);
    }
    last_grads = s.grads;
    last_grad_scale = s.grad_scale;
    return {loss, count_per_example * static_cast<double>(end - begin)};
  }
  int64_t fail_on = -1;
  double count_per_example = 1;       // the pass's count: a weighted mean's denominator
  StepParticipant* hooked = nullptr;  // tells it each parameter's gradient is complete
  float* last_grads = nullptr;
  float last_grad_scale = 0;
  std::atomic<int> passes{0};

 private:
  const Segment& seg_;
  std::atomic<int>* calls_;
};

// A segment, n participant threads and an attached trainer.
class Engine {
 public:
  explicit Engine(uint32_t workers, bool hooks = false) : name_(uniqueName()) {
    SegmentSpec spec;
    spec.name = name_;
    spec.model_path = "/nonexistent/model.pt";
    spec.num_slots = workers;
    spec.params = {{"a", {5, 3}}, {"b", {70}}};  // 15 + 70 floats, padded per tensor
    spec.max_batch = 64;
    spec.input_bytes = 64 * 4;
    spec.target_bytes = 64 * 8;
    spec.data_count = kDataCount;
    spec.data_example_shape = {1};
    spec.data_target_dtype = ipc::DType::kInt64;
    spec.data_description = "test";
    seg_ = Segment::create(spec);
    for (uint32_t i = 0; i < workers; ++i) {
      seg_->header()->workers[i].state.store(static_cast<uint32_t>(ipc::WorkerState::kStarting));
      seg_->header()->workers[i].pid.store(getpid());
      computers_.push_back(std::make_unique<FakeComputer>(*seg_, &calls_));
      participants_.push_back(std::make_unique<StepParticipant>(*seg_, i, getppid()));
      if (hooks) {
        for (uint32_t p = 0; p < seg_->header()->num_params; ++p) {
          participants_[i]->watchGrad(p, worker::GradWatch::kHooked);
        }
        computers_[i]->hooked = participants_[i].get();
      }
      if (!participants_[i]->becomeReady()) throw std::runtime_error("slot not starting");
    }
    for (uint32_t i = 0; i < workers; ++i) {
      threads_.emplace_back(
          [this, i] { exit_codes_[i] = participants_[i]->serve(*computers_[i]); });
    }
    seg_->header()->control.engine_state.store(static_cast<uint32_t>(ipc::EngineState::kServing));
    AttachOptions o;
    o.timeout_seconds = 5;
    trainer_ = Trainer::attach(name_, o);
  }
  ~Engine() { stop(); }

  void stop() {
    if (!seg_) return;
    trainer_.reset();
    seg_->header()->control.stop_requested.store(1);
    ipc::wakeWorkers(seg_->header()->control);
    for (auto& t : threads_) t.join();
    threads_.clear();
    Segment::remove(name_);
    seg_.reset();
  }

  // The expected reduced gradient for dataset indices (or explicit input values) `ids`.
  // The sum (or mean) of the examples' gradients, times `factor` (a loss scale, or one
  // over a weighted mean's count).
  std::vector<float> expected(const std::vector<int64_t>& ids, bool mean,
                              double factor = 1.0) const {
    std::vector<float> out(seg_->header()->param_floats, 0.0f);
    for (uint64_t j = 0; j < out.size(); ++j) {
      double sum = 0;
      for (int64_t i : ids) sum += static_cast<double>((i + 1) * static_cast<int64_t>(j + 1));
      out[j] = static_cast<float>((mean ? sum / ids.size() : sum) * factor);
    }
    return out;
  }
  // Of the reduced buffer, or of `got`.
  double maxRelError(const std::vector<float>& want, const float* got = nullptr) const {
    if (got == nullptr) got = seg_->reduced();
    double worst = 0;
    for (uint64_t j = 0; j < want.size(); ++j) {
      worst =
          std::max<double>(worst, std::abs(got[j] - want[j]) / std::max(1.0f, std::abs(want[j])));
    }
    return worst;
  }

  Trainer& trainer() { return *trainer_; }
  Segment& segment() { return *seg_; }
  FakeComputer& computer(int i) { return *computers_[i]; }
  int calls() const { return calls_.load(); }
  int exitCode(int i) const { return exit_codes_[i]; }

 private:
  std::string name_;
  std::unique_ptr<Segment> seg_;
  std::vector<std::unique_ptr<FakeComputer>> computers_;
  std::vector<std::unique_ptr<StepParticipant>> participants_;
  std::vector<std::thread> threads_;
  int exit_codes_[ipc::kMaxWorkers] = {};
  std::atomic<int> calls_{0};
  std::unique_ptr<Trainer> trainer_;
};

torch::Tensor indexTensor(const std::vector<int64_t>& ids) {
  return torch::tensor(c10::ArrayRef<int64_t>(ids), torch::kInt64);
}

class StepProtocolTest : public ::testing::TestWithParam<std::tuple<uint32_t, int64_t, bool>> {};

TEST_P(StepProtocolTest, ReducedGradientIsTheExactSumOverShards) {
  const auto [workers, batch, mean] = GetParam();
  Engine engine(workers);
  std::vector<int64_t> ids;
  for (int64_t k = 0; k < batch; ++k) ids.push_back((k * 7 + 3) % kDataCount);
  GradientOptions o;
  o.mean = mean;
  o.timeout_seconds = 20;
  for (int step = 0; step < 3; ++step) {  // repeated: slots are zeroed between steps
    GradientStats s = engine.trainer().gradient(indexTensor(ids), o);
    EXPECT_EQ(s.num_examples, batch);
    const uint32_t n = std::min<uint32_t>(workers, static_cast<uint32_t>(batch));
    ASSERT_EQ(s.workers.size(), n);
    double loss = 0;
    for (int64_t i : ids) loss += i;
    EXPECT_DOUBLE_EQ(s.loss_sum, loss);
    EXPECT_LT(engine.maxRelError(engine.expected(ids, mean)), 1e-6);
  }
}

INSTANTIATE_TEST_SUITE_P(WorkersBatchesMean, StepProtocolTest,
                         ::testing::Combine(::testing::Values(1u, 2u, 3u),
                                            ::testing::Values(int64_t{1}, int64_t{7}, int64_t{40}),
                                            ::testing::Bool()));

// The bucketed reduction (SHMGRAD_BUCKET_KB small enough for two buckets here): the same
// bits as the unbucketed one, with the compute phase's hooks or without (every bucket
// complete at the end of compute), for a sum, a mean and a mean over other counts (pieces
// reduced before the counts are in are rescaled after). The hooked run also writes each
// parameter's first gradient instead of zeroing the slot: a slot holding the last step's
// gradient must not leak into the next (the steps repeat).
TEST(StepProtocolBucketTest, BucketsGiveTheUnbucketedBits) {
  std::vector<int64_t> ids;
  for (int64_t k = 0; k < 29; ++k) ids.push_back((k * 5 + 1) % kDataCount);
  std::vector<std::vector<float>> runs;
  for (const char* kb : {"0", "0.0625", "0.0625"}) {
    ASSERT_EQ(setenv("SHMGRAD_BUCKET_KB", kb, 1), 0);
    const bool bucketed = std::string(kb) != "0";
    Engine engine(3, /*hooks=*/runs.size() == 2);  // the third run: hooked
    unsetenv("SHMGRAD_BUCKET_KB");
    const ipc::SegmentHeader* h = engine.segment().header();
    std::vector<float> got;
    for (const double count : {1.0, 2.5}) {
      for (bool mean : {false, true}) {
        for (uint32_t i = 0; i < 3; ++i) engine.computer(i).count_per_example = count;
        GradientOptions o;
        o.mean = mean;
        o.timeout_seconds = 20;
        engine.trainer().gradient(indexTensor(ids), o);
        EXPECT_EQ(h->request.num_buckets, bucketed ? 2u : 0u);
        EXPECT_LT(engine.maxRelError(engine.expected(ids, mean, mean ? 1.0 / count : 1.0)), 1e-6);
        got.insert(got.end(), engine.segment().reduced(),
                   engine.segment().reduced() + h->param_floats);
      }
    }
    runs.push_back(got);
  }
  EXPECT_EQ(runs[0], runs[1]);  // bitwise: float == on every element
  EXPECT_EQ(runs[0], runs[2]);
}

// A mean over counts other than the examples (tokens): 1 / (sum of the counts), with
// one participant (backward's 1/B rescaled) and several.
TEST(StepProtocolCountTest, MeanDividesByTheParticipantsCounts) {
  for (uint32_t workers : {1u, 3u}) {
    Engine engine(workers);
    for (uint32_t i = 0; i < workers; ++i) engine.computer(i).count_per_example = 2.5;
    std::vector<int64_t> ids = {1, 5, 8, 13, 21, 34, 2};
    GradientOptions o;
    o.timeout_seconds = 20;
    o.mean = true;
    GradientStats s = engine.trainer().gradient(indexTensor(ids), o);
    EXPECT_DOUBLE_EQ(s.count, 2.5 * ids.size());
    EXPECT_LT(engine.maxRelError(engine.expected(ids, false, 1.0 / (2.5 * ids.size()))), 1e-6)
        << workers << " workers";
  }
}

// Accumulating steps write the other buffer: reduced -> accum -> reduced, the mean over
// the union of the micro-batches, and the previous result left intact.
TEST(StepProtocolAccumulateTest, MicroBatchesGiveTheMeanOfTheirUnion) {
  Engine engine(2);
  GradientOptions o;
  o.timeout_seconds = 20;
  o.mean = true;
  std::vector<int64_t> a = {3, 4, 5, 6, 7}, b = {10, 20, 30}, c = {40};
  engine.trainer().gradient(indexTensor(a), o);
  std::vector<float> first(engine.segment().reduced(),
                           engine.segment().reduced() + engine.segment().header()->param_floats);
  o.accumulate = ipc::Accumulate::kReducedToAccum;
  o.prev_count = 5;
  engine.trainer().gradient(indexTensor(b), o);
  // The previous result is untouched; the union's mean is in accum.
  EXPECT_TRUE(std::equal(first.begin(), first.end(), engine.segment().reduced()));
  o.accumulate = ipc::Accumulate::kAccumToReduced;
  o.prev_count = 8;
  engine.trainer().gradient(indexTensor(c), o);  // one example: one participant
  std::vector<int64_t> all = a;
  all.insert(all.end(), b.begin(), b.end());
  all.insert(all.end(), c.begin(), c.end());
  EXPECT_LT(engine.maxRelError(engine.expected(all, true)), 1e-6);
}

TEST(StepProtocolAloneTest, TheOnlyParticipantWritesTheReducedBufferDirectly) {
  Engine engine(2);
  GradientOptions o;
  o.timeout_seconds = 20;
  o.min_examples_per_worker = 100;  // one participant for this batch
  o.mean = true;
  std::vector<int64_t> ids = {4, 9, 11};
  GradientStats s = engine.trainer().gradient(indexTensor(ids), o);
  ASSERT_EQ(s.workers.size(), 1u);
  // No reduction copy: backward's buffer was the reduced one, scaled in backward.
  EXPECT_EQ(engine.computer(s.workers[0].slot).last_grads, engine.segment().reduced());
  EXPECT_LT(engine.maxRelError(engine.expected(ids, true)), 1e-6);
  // With two participants the same worker writes its own slot again.
  o.min_examples_per_worker = 1;
  ids = {1, 2, 3, 4};
  s = engine.trainer().gradient(indexTensor(ids), o);
  ASSERT_EQ(s.workers.size(), 2u);
  for (const auto& w : s.workers) {
    EXPECT_EQ(engine.computer(w.slot).last_grads, engine.segment().slot(w.slot));
  }
  EXPECT_LT(engine.maxRelError(engine.expected(ids, true)), 1e-6);
}

// Loss scaling: every participant backpropagates its loss times loss_scale (and a mean's
// 1/B), alone or not, so the result is loss_scale times the gradient; the loss is
// reported unscaled. The trainer refuses a scale that is not finite and > 0.
TEST(StepProtocolLossScaleTest, TheResultIsLossScaleTimesTheGradient) {
  Engine engine(3);
  GradientOptions o;
  o.timeout_seconds = 20;
  o.loss_scale = 1024.0f;
  std::vector<int64_t> ids = {1, 5, 8, 13, 21, 34, 2};
  double loss = 0;
  for (int64_t i : ids) loss += i;
  for (bool mean : {false, true}) {
    for (int64_t min_epw : {int64_t{1}, int64_t{100}}) {  // 3 participants, then alone
      o.mean = mean;
      o.min_examples_per_worker = min_epw;
      GradientStats s = engine.trainer().gradient(indexTensor(ids), o);
      EXPECT_EQ(s.workers.size(), min_epw == 1 ? 3u : 1u);
      EXPECT_DOUBLE_EQ(s.loss_sum, loss);
      EXPECT_LT(engine.maxRelError(engine.expected(ids, mean, 1024.0)), 1e-6)
          << "mean " << mean << " min_epw " << min_epw;
    }
  }
  for (float bad : {0.0f, -2.0f, std::numeric_limits<float>::infinity(),
                    std::numeric_limits<float>::quiet_NaN()}) {
    o.loss_scale = bad;
    std::string message;
    EXPECT_TRUE(testing::throwsKind(
        ErrorKind::kInvalidArgument, [&] { engine.trainer().gradient(indexTensor(ids), o); },
        &message))
        << "loss_scale " << bad;
    EXPECT_NE(message.find("loss_scale"), std::string::npos) << message;
  }
  o.loss_scale = 1.0f;  // the engine kept serving
  o.mean = false;
  o.min_examples_per_worker = 1;
  engine.trainer().gradient(indexTensor(ids), o);
  EXPECT_LT(engine.maxRelError(engine.expected(ids, false)), 1e-6);
}

// A sum through the mean's backward (a node of several): every participant, alone or
// not, accumulating or not, backpropagates loss_scale / B, as backward of the batch's
// mean does, and the result is still loss_scale times the sum.
TEST(StepProtocolSumThroughMeanTest, BackwardTakesTheMeanAndTheResultIsTheSum) {
  Engine engine(3);
  GradientOptions o;
  o.timeout_seconds = 20;
  o.sum_through_mean = true;
  o.loss_scale = 64.0f;
  std::vector<int64_t> ids = {1, 5, 8, 13, 21, 34, 2};
  for (int64_t min_epw : {int64_t{1}, int64_t{100}}) {  // 3 participants, then alone
    o.min_examples_per_worker = min_epw;
    GradientStats s = engine.trainer().gradient(indexTensor(ids), o);
    ASSERT_EQ(s.workers.size(), min_epw == 1 ? 3u : 1u);
    for (const auto& w : s.workers) {
      EXPECT_FLOAT_EQ(engine.computer(w.slot).last_grad_scale, 64.0f / ids.size());
    }
    EXPECT_LT(engine.maxRelError(engine.expected(ids, false, 64.0)), 1e-6) << "min_epw " << min_epw;
  }
  // Accumulated: each micro-batch's backward takes its own 1/B; the sum of the union.
  o.min_examples_per_worker = 1;
  std::vector<int64_t> a = {3, 4, 5, 6, 7}, b = {10, 20, 30};
  engine.trainer().gradient(indexTensor(a), o);
  o.accumulate = ipc::Accumulate::kReducedToAccum;
  engine.trainer().gradient(indexTensor(b), o);
  EXPECT_FLOAT_EQ(engine.computer(0).last_grad_scale, 64.0f / b.size());
  std::vector<int64_t> all = a;
  all.insert(all.end(), b.begin(), b.end());
  EXPECT_LT(engine.maxRelError(engine.expected(all, false, 64.0), engine.segment().accum()), 1e-6);
  // A plain sum backpropagates the loss times loss_scale alone.
  o.sum_through_mean = false;
  o.accumulate = ipc::Accumulate::kFresh;
  engine.trainer().gradient(indexTensor(ids), o);
  EXPECT_FLOAT_EQ(engine.computer(0).last_grad_scale, 64.0f);
}

TEST(StepProtocolPassTest, TheProtocolSplitsEachShardIntoPassesForEveryKindOfWorker) {
  // max_examples_per_pass is applied by the shared protocol, not by each kind of worker:
  // a shard of 20 examples in passes of 6 is 4 passes (6, 6, 6, 2), with the exact sum.
  Engine engine(2);
  GradientOptions o;
  o.timeout_seconds = 20;
  o.max_examples_per_pass = 6;
  std::vector<int64_t> ids;
  for (int64_t k = 0; k < 40; ++k) ids.push_back(k % kDataCount);
  const GradientStats s = engine.trainer().gradient(indexTensor(ids), o);
  ASSERT_EQ(s.workers.size(), 2u);
  EXPECT_EQ(engine.computer(0).passes.load() + engine.computer(1).passes.load(), 8);
  EXPECT_EQ(engine.calls(), 2);  // one beginShard per shard
  EXPECT_LT(engine.maxRelError(engine.expected(ids, false)), 1e-6);
}

TEST(StepProtocolErrorTest, ComputeErrorReachesTheTrainerAndTheEngineKeepsServing) {
  Engine engine(3);
  engine.computer(1).fail_on = 17;
  GradientOptions o;
  o.timeout_seconds = 20;
  std::vector<int64_t> ids = {0, 1, 2, 17, 5, 6};  // rank 1 of 3 gets positions 2..3
  try {
    engine.trainer().gradient(indexTensor(ids), o);
    FAIL() << "expected WorkerError";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kWorkerFailed);
    EXPECT_NE(std::string(e.what()).find("example 17 is poison"), std::string::npos) << e.what();
  }
  ids = {0, 1, 2, 3, 5, 6};
  engine.trainer().gradient(indexTensor(ids), o);
  EXPECT_LT(engine.maxRelError(engine.expected(ids, false)), 1e-6);
}

TEST(StepProtocolExplicitTest, ExplicitBatchesAreReadFromTheRequestRegions) {
  Engine engine(2);
  GradientOptions o;
  o.timeout_seconds = 20;
  std::vector<int64_t> ids = {3, 8, 1, 0, 12};
  auto inputs = indexTensor(ids).to(torch::kFloat32).reshape({5, 1});
  auto targets = torch::zeros({5}, torch::kInt64);
  engine.trainer().gradient(inputs, targets, o);
  EXPECT_LT(engine.maxRelError(engine.expected(ids, false)), 1e-6);
}

// A structured batch: its tensors one after the other in the input region, each shard
// reading its rows of every one.
TEST(StepProtocolStructuredTest, StructuredBatchesAreSplitAlongTheirFirstDimension) {
  Engine engine(2);
  // Structured batches are for eager workers; the fake compute phase plays one here.
  engine.segment().header()->worker_kind = static_cast<uint32_t>(ipc::WorkerKind::kEager);
  GradientOptions o;
  o.timeout_seconds = 20;
  std::vector<int64_t> ids = {3, 8, 1, 0, 12};
  auto first = indexTensor(ids).to(torch::kFloat32).reshape({5, 1});
  auto mask = torch::ones({5, 3}, torch::kBool);
  GradientStats s = engine.trainer().gradient({first, mask}, "{\"t\":[0,1]}", o);
  EXPECT_EQ(s.num_examples, 5);
  EXPECT_LT(engine.maxRelError(engine.expected(ids, false)), 1e-6);
  // Refused before anything is published: rows that differ, a dtype the engine cannot
  // carry; the engine keeps serving.
  EXPECT_THROW(engine.trainer().gradient({first, torch::ones({4})}, "x", o), Error);
  EXPECT_THROW(engine.trainer().gradient({first.to(torch::kComplexFloat)}, "x", o), Error);
  engine.trainer().gradient({first}, "x", o);
  EXPECT_LT(engine.maxRelError(engine.expected(ids, false)), 1e-6);
}

// A leaf table that points outside the input region (as no trainer writes it) is the
// worker's error, never a read out of bounds: hand-published here, past the trainer.
TEST(StepProtocolStructuredTest, HostileLeafTableAndScalesAreRefusedByTheWorkers) {
  Engine engine(1);
  engine.segment().header()->worker_kind = static_cast<uint32_t>(ipc::WorkerKind::kEager);
  GradientOptions o;
  o.timeout_seconds = 20;
  auto first = torch::zeros({4, 1}, torch::kFloat32);
  engine.trainer().gradient({first}, "x", o);  // a valid structured request to start from
  ipc::SegmentHeader* h = engine.segment().header();
  ipc::ControlBlock& c = h->control;
  ipc::StepRequest& r = h->request;
  // Publishes the request as it stands, waits until the worker has answered it (its
  // result record), and returns the epoch. A request the worker can read is completed by
  // it (done_epoch); one that fails the structural checks is not taken part in.
  const auto publish_epoch = [&] {
    const uint32_t e = c.step_epoch.load() + 1;
    r.epoch = e;
    h->workers[0].assigned_rank.store(0);
    h->workers[0].assigned_epoch.store(e);
    c.compute_barrier.store(ipc::barrierTag(e));
    c.reduce_barrier.store(ipc::barrierTag(e));
    c.step_epoch.store(e);
    ipc::futexWake(&c.step_epoch);
    const auto answered = [&] {
      return __atomic_load_n(&h->workers[0].result_epoch, __ATOMIC_ACQUIRE) == e &&
             h->workers[0].busy_epoch.load() == 0;
    };
    for (int i = 0; i < 2000 && !answered(); ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    EXPECT_TRUE(answered());
    return e;
  };
  const auto publish = [&] {
    const uint32_t e = publish_epoch();
    EXPECT_EQ(c.done_epoch.load(), e);
    return std::string(h->workers[0].error_text);
  };
  r.leaves[0].offset = h->req_inputs.size;  // past the end
  EXPECT_NE(publish().find("outside the input region"), std::string::npos);
  r.leaves[0].offset = 0;
  r.leaves[0].example_shape.dims[0] = int64_t{1} << 20;  // rows larger than the region
  EXPECT_NE(publish().find("outside the input region"), std::string::npos);
  r.leaves[0].example_shape.dims[0] = 1;
  r.leaves[0].type = 99;
  EXPECT_NE(publish().find("type"), std::string::npos);
  r.leaves[0].type = static_cast<uint32_t>(ipc::LeafType::kFloat32);
  r.num_leaves = ipc::kMaxLeaves + 1;
  EXPECT_NE(publish().find("structured batch header"), std::string::npos);
  // The worker records why it did not take part and leaves the step to the trainer's abort.
  r.num_leaves = 1;
  auto refused = [&](const std::string& what) {
    const uint32_t e = publish_epoch();
    EXPECT_NE(c.done_epoch.load(), e) << what;
    EXPECT_NE(std::string(h->workers[0].error_text).find("corrupt step request"), std::string::npos)
        << what;
    ipc::abortStep(c, e);
  };
  for (float bad : {0.0f, -1.0f, std::numeric_limits<float>::quiet_NaN()}) {
    r.loss_scale = bad;
    refused("loss_scale " + std::to_string(bad));
  }
  r.loss_scale = 1.0f;
  r.reduction = static_cast<uint32_t>(ipc::Reduction::kSumThroughMean) + 1;
  refused("reduction " + std::to_string(r.reduction));
}

TEST(StepProtocolExitTest, StopRequestEndsEveryParticipantWithTheStoppedCode) {
  Engine engine(2);
  GradientOptions o;
  o.timeout_seconds = 20;
  engine.trainer().gradient(indexTensor({1, 2}), o);
  EXPECT_EQ(engine.calls(), 2);
  engine.stop();
  EXPECT_EQ(engine.exitCode(0), worker::kExitStopped);
  EXPECT_EQ(engine.exitCode(1), worker::kExitStopped);
}

}  // namespace
}  // namespace shmgrad

namespace shmgrad {
namespace {

// Waiters spin only when every thread that runs meanwhile has a core of its own: the
// trainer and the participants' threads while the trainer awaits the step, the
// participants' main threads and the trainer between steps (their intra-op threads are
// idle then), the participants' threads alone at the barriers.
TEST(StepProtocolSpinTest, SpinOnlyWhenEveryThreadHasACore) {
  cpu_set_t cpus;
  CPU_ZERO(&cpus);
  ASSERT_EQ(sched_getaffinity(0, sizeof(cpus), &cpus), 0);
  const std::pair<uint32_t, uint32_t> placements[] = {{1, 1}, {2, 1}, {3, 1}, {1, 2}, {2, 2}};
  for (auto [workers, threads] : placements) {
    SCOPED_TRACE(std::to_string(workers) + " workers x " + std::to_string(threads));
    Engine engine(workers);
    engine.segment().header()->threads_per_worker = threads;
    const uint32_t cores = engine.trainer().cores();
    EXPECT_GE(cores, 1u);
    EXPECT_LE(cores, static_cast<uint32_t>(CPU_COUNT(&cpus)));  // siblings count once
    GradientOptions o;
    o.timeout_seconds = 20;
    engine.trainer().gradient(indexTensor({1, 2, 3, 4, 5, 6}), o);
    const ipc::StepRequest& r = engine.segment().header()->request;
    const uint32_t all = workers * threads;
    EXPECT_EQ(r.spin_ns > 0, workers + 1 <= cores) << cores << " cores";
    EXPECT_EQ(engine.trainer().awaitSpinNs() > 0, all + 1 <= cores) << cores << " cores";
    EXPECT_EQ(r.barrier_spin_ns > 0, all <= cores) << cores << " cores";
    EXPECT_LE(r.spin_ns, ipc::kMaxSpinNs);
    EXPECT_LE(r.barrier_spin_ns, ipc::kMaxSpinNs);
    EXPECT_LE(engine.trainer().awaitSpinNs(), r.barrier_spin_ns);  // spins only if they do
  }
}

}  // namespace
}  // namespace shmgrad
