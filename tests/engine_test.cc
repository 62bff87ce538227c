// End-to-end tests of the engine: `shmgrad serve` as a child process, the C++ trainer
// API in the test process, and a single-process libtorch reference for every result.
#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <set>
#include <tuple>

#include "engine/trainer.h"
#include "ipc/error.h"
#include "ipc/segment.h"
#include "tests/test_util.h"

namespace shmgrad::testing {
namespace {

constexpr int64_t kSide = 12;  // CNN inputs [1, 12, 12]
constexpr int64_t kClasses = 5;
constexpr int64_t kExamples = 300;

struct Fixture {
  std::string dir, model, inputs_npy, targets_npy;
  torch::Tensor x, y;
};

Fixture makeFixture(const std::string& kind, uint64_t seed) {
  Fixture f;
  f.dir = tempDir(kind + std::to_string(seed));
  f.model = f.dir + "/" + kind + ".pt";
  if (kind == "mlp")
    saveMlp(f.model, kSide * kSide, 16, kClasses, seed);
  else
    saveCnn(f.model, kSide, kClasses, seed);
  torch::manual_seed(seed + 100);
  f.x = torch::randn({kExamples, 1, kSide, kSide});
  f.y = torch::randint(0, kClasses, {kExamples}, torch::kInt64);
  f.inputs_npy = f.dir + "/x.npy";
  f.targets_npy = f.dir + "/y.npy";
  writeNpy(f.inputs_npy, f.x);
  writeNpy(f.targets_npy, f.y);
  return f;
}

std::vector<torch::Tensor> clone(const std::vector<torch::Tensor>& v) {
  std::vector<torch::Tensor> out;
  for (const auto& t : v) out.push_back(t.clone());
  return out;
}

class GradientTest : public ::testing::TestWithParam<std::tuple<std::string, int>> {};

TEST_P(GradientTest, MatchesSingleProcessReference) {
  const auto [kind, workers] = GetParam();
  Fixture f = makeFixture(kind, 7);
  const std::string name = uniqueName(kind + std::to_string(workers));
  EngineProcess engine(
      name, {"--model", f.model, "--workers", std::to_string(workers), "--loss", "cross_entropy",
             "--dataset", "npy:" + f.inputs_npy + "," + f.targets_npy});
  auto t = Trainer::attach(name);
  ASSERT_EQ(t->workerCount(), workers);
  ASSERT_EQ(t->datasetSize(), kExamples);
  auto grads = t->gradientViews();
  for (int64_t B : {1, 7, 127, 256}) {
    SCOPED_TRACE("batch " + std::to_string(B));
    // Indices into the shared dataset (a permutation, not a prefix).
    torch::Tensor idx = torch::randperm(kExamples, torch::kInt64).narrow(0, 0, B);
    auto ref = referenceGradient(f.model, "cross_entropy", f.x.index_select(0, idx),
                                 f.y.index_select(0, idx));
    GradientStats s = t->gradient(idx);
    EXPECT_LT(relativeError(grads, ref), 1e-5);
    EXPECT_EQ(s.num_examples, B);
    EXPECT_EQ(static_cast<int64_t>(s.workers.size()), std::min<int64_t>(B, workers));
    int64_t covered = 0;
    for (const auto& w : s.workers) covered += w.examples;
    EXPECT_EQ(covered, B);

    // The same batch given explicitly, reduced as a mean.
    torch::Tensor x = f.x.index_select(0, idx), y = f.y.index_select(0, idx);
    GradientOptions mean;
    mean.mean = true;
    auto ref_mean = referenceGradient(f.model, "cross_entropy", x, y, /*mean=*/true);
    GradientStats sm = t->gradient(x, y, mean);
    EXPECT_LT(relativeError(grads, ref_mean), 1e-5);
    EXPECT_NEAR(sm.loss, s.loss_sum / B, 1e-4 * std::max(1.0, std::abs(sm.loss)));
  }
}

INSTANTIATE_TEST_SUITE_P(ModelsAndWorkers, GradientTest,
                         ::testing::Combine(::testing::Values("mlp", "cnn"),
                                            ::testing::Values(1, 2, 3, 4)),
                         [](const auto& info) {
                           return std::get<0>(info.param) + "_" +
                                  std::to_string(std::get<1>(info.param)) + "workers";
                         });

TEST(EngineTest, MoreWorkersThanExamplesAndOtherLosses) {
  Fixture f = makeFixture("mlp", 11);
  const std::string name = uniqueName("mse");
  EngineProcess engine(name, {"--model", f.model, "--workers", "3", "--loss", "mse"});
  auto t = Trainer::attach(name);
  auto grads = t->gradientViews();
  for (int64_t B : {1, 2, 3, 5}) {
    torch::Tensor x = torch::randn({B, 1, kSide, kSide});
    torch::Tensor y = torch::randn({B, kClasses});
    auto ref = referenceGradient(f.model, "mse", x, y);
    GradientStats s = t->gradient(x, y);
    EXPECT_LT(relativeError(grads, ref), 1e-5) << "batch " << B;
    EXPECT_EQ(static_cast<int64_t>(s.workers.size()), std::min<int64_t>(B, 3));
  }
}

TEST(EngineTest, TwentySgdStepsMatchSingleProcessTraining) {
  Fixture f = makeFixture("cnn", 21);
  const std::string name = uniqueName("train");
  EngineProcess engine(name, {"--model", f.model, "--workers", "3", "--loss", "cross_entropy",
                              "--dataset", "npy:" + f.inputs_npy + "," + f.targets_npy});
  auto t = Trainer::attach(name);
  std::vector<torch::Tensor> params = t->parameterViews();
  std::vector<torch::Tensor> grads = t->gradientViews();
  for (size_t i = 0; i < params.size(); ++i) {
    params[i].set_requires_grad(true);
    params[i].mutable_grad() = grads[i];
  }
  torch::optim::SGD opt(params, torch::optim::SGDOptions(0.05).momentum(0.9));

  torch::jit::Module ref = torch::jit::load(f.model);
  std::vector<torch::Tensor> ref_params;
  for (const auto& p : ref.parameters()) ref_params.push_back(p);
  torch::optim::SGD ref_opt(ref_params, torch::optim::SGDOptions(0.05).momentum(0.9));

  torch::manual_seed(5);
  for (int step = 0; step < 20; ++step) {
    torch::Tensor idx = torch::randint(0, kExamples, {32}, torch::kInt64);
    GradientOptions o;
    o.mean = true;
    t->gradient(idx, o);
    opt.step();

    ref_opt.zero_grad();
    torch::Tensor out = ref.forward({f.x.index_select(0, idx)}).toTensor();
    torch::nn::functional::cross_entropy(out, f.y.index_select(0, idx)).backward();
    ref_opt.step();
  }
  EXPECT_LT(relativeError(params, ref_params), 1e-4);
  // And the parameters did move: the comparison is not of two unchanged models.
  torch::jit::Module init = torch::jit::load(f.model);
  std::vector<torch::Tensor> init_params;
  for (const auto& p : init.parameters()) init_params.push_back(p.detach());
  EXPECT_GT(relativeError(params, init_params), 1e-3);
}

TEST(EngineTest, BadInputIsAnErrorAndTheEngineKeepsServing) {
  Fixture f = makeFixture("cnn", 31);
  const std::string name = uniqueName("bad");
  EngineProcess engine(name, {"--model", f.model, "--workers", "2", "--dataset",
                              "npy:" + f.inputs_npy + "," + f.targets_npy});
  auto t = Trainer::attach(name);
  auto expectKind = [](ErrorKind kind, auto&& fn) {
    try {
      fn();
      ADD_FAILURE() << "no error raised";
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), kind) << e.what();
    }
  };
  expectKind(ErrorKind::kInvalidArgument, [&] {
    t->gradient(torch::tensor({int64_t{0}, kExamples}, torch::kInt64));
  });
  expectKind(ErrorKind::kInvalidArgument,
             [&] { t->gradient(torch::tensor({int64_t{-1}}, torch::kInt64)); });
  expectKind(ErrorKind::kInvalidArgument, [&] { t->gradient(torch::empty({0}, torch::kInt64)); });
  // Inputs the model rejects: the worker's own message comes back.
  try {
    t->gradient(torch::randn({4, 3, 7}), torch::zeros({4}, torch::kInt64));
    ADD_FAILURE() << "no error raised";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kWorkerFailed);
    EXPECT_NE(std::string(e.what()).find("could not compute its shard"), std::string::npos)
        << e.what();
  }
  // The next valid call works and is exact.
  torch::Tensor idx = torch::arange(10, torch::kInt64);
  t->gradient(idx);
  auto ref =
      referenceGradient(f.model, "cross_entropy", f.x.narrow(0, 0, 10), f.y.narrow(0, 0, 10));
  EXPECT_LT(relativeError(t->gradientViews(), ref), 1e-5);
}

TEST(EngineTest, SecondTrainerIsToldWhoHoldsTheEngine) {
  Fixture f = makeFixture("mlp", 41);
  const std::string name = uniqueName("lease");
  EngineProcess engine(name, {"--model", f.model, "--workers", "1"});
  auto t = Trainer::attach(name);
  pid_t child = fork();
  if (child == 0) {
    int code = 1;
    try {
      Trainer::attach(name);
    } catch (const Error& e) {
      code = (e.kind() == ErrorKind::kBusy &&
              std::string(e.what()).find(std::to_string(getppid())) != std::string::npos)
                 ? 0
                 : 2;
    }
    _exit(code);
  }
  int status = 0;
  waitpid(child, &status, 0);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "status " << status;
  t->close();
  EXPECT_NO_THROW(Trainer::attach(name));
}

TEST(EngineTest, StopRemovesSegmentAndWorkers) {
  Fixture f = makeFixture("mlp", 51);
  const std::string name = uniqueName("stop");
  EngineProcess engine(name, {"--model", f.model, "--workers", "3"});
  std::vector<pid_t> pids;
  {
    auto t = Trainer::attach(name);
    t->gradient(torch::randn({4, 1, kSide, kSide}), torch::zeros({4}, torch::kInt64));
    const auto* h = t->segment().header();
    for (uint32_t i = 0; i < h->num_slots; ++i) pids.push_back(h->workers[i].pid.load());
  }
  ASSERT_EQ(pids.size(), 3u);
  for (pid_t p : pids) ASSERT_TRUE(processRunning(p));
  ASSERT_TRUE(ipc::Segment::exists(name));
  const std::string path = ipc::segmentPath(name);
  struct stat st;
  ASSERT_EQ(::stat(path.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u) << "segment must be owner-only";
  engine.stop();
  EXPECT_FALSE(ipc::Segment::exists(name));
  for (pid_t p : pids) EXPECT_FALSE(processRunning(p)) << "worker " << p << " left behind";
}

}  // namespace
}  // namespace shmgrad::testing
