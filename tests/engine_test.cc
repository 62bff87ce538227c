// End-to-end tests of the engine: `shmgrad serve` as a child process, the C++ trainer
// API in the test process, and a single-process libtorch reference for every result.
#include <gtest/gtest.h>
#include <dirent.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <set>
#include <tuple>

#include "engine/trainer.h"
#include "gpu/cuda_library.h"
#include "ipc/device_table.h"
#include "ipc/error.h"
#include "ipc/segment.h"
#include "tests/segment_testing.h"
#include "tests/test_util.h"
#include "worker/worker_loop.h"

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
  EXPECT_EQ(t->lossReduction(), "sum");  // a named loss
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

// A C++ trainer of a TorchScript engine served with --workers auto computes steps itself
// through worker::ScriptInTrainer (the in-trainer placement): each step is the trainer
// slot's, its gradient the reference's and one worker's, bit for bit, for dataset indices
// and for explicit inputs. Explicit inputs are read where the trainer holds them: the
// request region stays untouched until a worker's step needs them there.
TEST(EngineTest, ACppTrainerComputesTheStepsItselfThroughScriptInTrainer) {
  Fixture f = makeFixture("mlp", 9);
  const std::string name = uniqueName("in-trainer");
  EngineProcess engine(name, {"--model", f.model, "--workers", "auto", "--loss", "cross_entropy",
                              "--dataset", "npy:" + f.inputs_npy + "," + f.targets_npy});
  auto t = Trainer::attach(name);
  ASSERT_TRUE(t->hasTrainerSlot());
  worker::ScriptInTrainer in_trainer(name, t->coordinatorPid());
  t->setInTrainer([&](uint32_t e, uint32_t threads, const ipc::LocalBatch& batch) {
    in_trainer.run(e, threads, batch);
  });
  auto grads = t->gradientViews();
  torch::Tensor idx = torch::randperm(kExamples, torch::kInt64).narrow(0, 0, 40);
  torch::Tensor x = f.x.index_select(0, idx), y = f.y.index_select(0, idx);
  auto ref = referenceGradient(f.model, "cross_entropy", x, y);
  const ipc::SegmentHeader* h = t->segment().header();
  const float* region = t->segment().region<float>(h->req_inputs);
  auto regionHoldsX = [&] {
    return std::memcmp(region, x.data_ptr<float>(), x.numel() * sizeof(float)) == 0;
  };
  std::vector<std::vector<torch::Tensor>> got;
  for (const bool here : {true, false}) {
    for (const bool explicit_batch : {false, true}) {
      SCOPED_TRACE(std::string(here ? "in the trainer" : "one worker") +
                   (explicit_batch ? ", explicit inputs" : ", indices"));
      t->setPlacement(here ? 0 : 1, 1, here);
      GradientStats s = explicit_batch ? t->gradient(x, y) : t->gradient(idx);
      ASSERT_EQ(s.workers.size(), 1u);
      EXPECT_EQ(s.workers[0].slot == t->slotCount(), here);
      EXPECT_LT(relativeError(grads, ref), 1e-5);
      EXPECT_EQ(regionHoldsX(), explicit_batch && !here);
      got.emplace_back();
      for (const auto& g : grads) got.back().push_back(g.clone());
    }
  }
  for (size_t k = 1; k < got.size(); ++k) {
    for (size_t i = 0; i < grads.size(); ++i) {
      EXPECT_TRUE(torch::equal(got[0][i], got[k][i])) << "step " << k << ", parameter " << i;
    }
  }
}

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

// `steps` SGD steps (momentum 0.9, mean over `batch` random indices) through the engine,
// the trainer's optimizer stepping its parameter views, against the same training in one
// process: the parameters must agree, and must have moved.
void expectTrainingMatchesOneProcess(Trainer* t, const Fixture& f, int steps, int64_t batch,
                                     uint64_t seed) {
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

  torch::manual_seed(seed);
  for (int step = 0; step < steps; ++step) {
    torch::Tensor idx = torch::randint(0, kExamples, {batch}, torch::kInt64);
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

TEST(EngineTest, TwentySgdStepsMatchSingleProcessTraining) {
  Fixture f = makeFixture("cnn", 21);
  const std::string name = uniqueName("train");
  EngineProcess engine(name, {"--model", f.model, "--workers", "3", "--loss", "cross_entropy",
                              "--dataset", "npy:" + f.inputs_npy + "," + f.targets_npy});
  auto t = Trainer::attach(name);
  expectTrainingMatchesOneProcess(t.get(), f, 20, 32, 5);
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

// --owned-dir: the engine's own files go at stop, but only from a directory of its own
// reached without a symbolic link. A link swapped in for the directory (possible where
// its parent lets others rename entries) must not make stop empty the folder it names.
TEST(EngineTest, StopEmptiesItsOwnedDirButNeverThroughALink) {
  Fixture f = makeFixture("mlp", 52);
  const std::string base = tempDir("owned");
  const std::string owned = base + "/owned";
  const std::string victim = base + "/victim";
  for (const std::string& dir : {owned, victim}) {
    ASSERT_EQ(::mkdir(dir.c_str(), 0700), 0) << dir << ": " << std::strerror(errno);
    std::FILE* file = std::fopen((dir + "/file").c_str(), "w");
    ASSERT_NE(file, nullptr);
    std::fclose(file);
  }
  {
    const std::string name = uniqueName("owned");
    EngineProcess engine(name, {"--model", f.model, "--workers", "1", "--owned-dir", owned});
    Trainer::attach(name);  // serving: its shutdown is the one that removes
    engine.stop();
  }
  struct stat st;
  EXPECT_NE(::lstat(owned.c_str(), &st), 0) << "the engine's own directory must be removed";

  const std::string link = base + "/swapped";
  ASSERT_EQ(::symlink(victim.c_str(), link.c_str()), 0) << std::strerror(errno);
  {
    const std::string name = uniqueName("owned");
    EngineProcess engine(name, {"--model", f.model, "--workers", "1", "--owned-dir", link});
    Trainer::attach(name);  // serving: its shutdown is the one that removes
    engine.stop();
  }
  EXPECT_EQ(::stat((victim + "/file").c_str(), &st), 0)
      << "stop followed the link and emptied the folder it points to";
  EXPECT_EQ(::lstat(link.c_str(), &st), 0);
  ::unlink((victim + "/file").c_str());
  ::unlink(link.c_str());
  ::rmdir(victim.c_str());
  ::rmdir(base.c_str());
}

// -- Device buffers (docs/GPU.md), on tests/fake_cuda.cc: the CUDA path's C interface on
// host memory, where an allocation is a shared-memory object and a handle its name.

constexpr const char* kFakeCuda = "tests/libfake_cuda.so";  // bazel test: runfiles root
constexpr const char* kRealCuda = "gpu/libshmgrad_cuda.so";

// The /dev/shm objects of the fake device's allocations made by process `pid`.
std::vector<std::string> fakeAllocations(pid_t pid) {
  std::vector<std::string> out;
  const std::string prefix = "shmgrad-fakecuda-" + std::to_string(pid) + "-";
  if (DIR* d = opendir("/dev/shm")) {
    while (dirent* e = readdir(d)) {
      if (std::strncmp(e->d_name, prefix.c_str(), prefix.size()) == 0) out.push_back(e->d_name);
    }
    closedir(d);
  }
  return out;
}

// Runs `shmgrad serve ARGS` to its end: its exit status and what it printed.
std::pair<int, std::string> serveToEnd(const std::string& name, const std::string& args) {
  const std::string cmd = shmgradBinary() + " serve --name " + name + " --quiet " + args + " 2>&1";
  FILE* p = popen(cmd.c_str(), "r");
  std::string out;
  char buf[512];
  while (p && std::fgets(buf, sizeof buf, p)) out += buf;
  const int status = p ? pclose(p) : -1;
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, out};
}

TEST(DeviceBuffersTest, EachDeviceGetsItsBuffersAndHandleAndLosesThemAtStop) {
  setenv("SHMGRAD_CUDA_LIBRARY", kFakeCuda, 1);
  setenv("FAKE_CUDA_DEVICES", "2", 1);
  Fixture f = makeFixture("mlp", 5);
  const std::string name = uniqueName("devices");
  EngineProcess engine(name, {"--model", f.model, "--workers", "3", "--devices", "1,0", "--dataset",
                              "npy:" + f.inputs_npy + "," + f.targets_npy});
  pid_t coordinator = 0;
  {
    auto t = Trainer::attach(name);  // validates the header, the device table with it
    coordinator = t->coordinatorPid();
    const ipc::Segment& seg = t->segment();
    const auto* h = seg.header();
    const auto* table = seg.region<ipc::DeviceTable>(h->device);
    ASSERT_EQ(table->count, 2u);
    EXPECT_EQ(table->devices[0].ordinal, 1);  // in the order given
    EXPECT_EQ(table->devices[1].ordinal, 0);
    EXPECT_EQ(table->devices[0].slots, 2u);  // slots 0 and 2: round-robin
    EXPECT_EQ(table->devices[1].slots, 1u);
    EXPECT_EQ(table->slot_device[2], 0);
    EXPECT_EQ(table->slot_local[2], 1);
    EXPECT_EQ(fakeAllocations(coordinator).size(), 2u);
    std::shared_ptr<const gpu::CudaLibrary> cuda = gpu::CudaLibrary::load(kFakeCuda);
    for (uint32_t d = 0; d < table->count; ++d) {
      SCOPED_TRACE("device " + std::to_string(d));
      ASSERT_EQ(table->devices[d].state.load(),
                static_cast<uint32_t>(ipc::DeviceState::kPublished));
      // As the trainer opens it: the handle, in its device's context (the first device's:
      // the trainer above opened every device so), then the regions by the layout.
      const int trainers = table->devices[0].ordinal;
      gpu::DeviceMapping m(cuda, seg, d, trainers);
      EXPECT_EQ(m.ordinal(), table->devices[d].ordinal);
      EXPECT_EQ(m.context(), trainers);
      // CUDA maps an allocation once per process: another device's context is refused.
      EXPECT_TRUE(throwsKind(ErrorKind::kInvalidArgument,
                             [&] { gpu::DeviceMapping again(cuda, seg, d, 1 - trainers); }));
      // The device's copy of the parameters is the segment's; its slots start at zero.
      std::vector<float> params(h->param_floats), slot(h->param_floats, 1.0f);
      cuda->copyToHost(m.ordinal(), params.data(), m.params(), params.size() * 4);
      EXPECT_EQ(std::memcmp(params.data(), seg.params(), params.size() * 4), 0);
      for (uint32_t local = 0; local < m.slots(); ++local) {
        cuda->copyToHost(m.ordinal(), slot.data(), m.slot(local), slot.size() * 4);
        for (float v : slot) ASSERT_EQ(v, 0.0f);
      }
      // A write through one mapping is what another mapping of the device reads: both
      // share this process's one opening of the handle (CUDA, and the fake, refuse a
      // second), which outlives the first mapping.
      const float mark = 3.25f;
      cuda->copyToDevice(m.ordinal(), m.slot(0), &mark, sizeof mark);
      auto other = std::make_unique<gpu::DeviceMapping>(cuda, seg, d, trainers);
      EXPECT_EQ(other->slot(0), m.slot(0));
      {
        gpu::DeviceMapping third(cuda, seg, d, trainers);  // opened, released while others live
      }
      float seen = 0.0f;
      cuda->copyToHost(m.ordinal(), &seen, other->slot(0), sizeof seen);
      EXPECT_EQ(seen, mark);
      cuda->copyToDevice(m.ordinal(), m.slot(0), slot.data(), sizeof mark);  // zero again
      other.reset();
      EXPECT_TRUE(throwsKind(ErrorKind::kInvalidArgument, [&] { (void)m.slot(m.slots()); }));
      // The reduced and accumulation buffers are the first device's alone: the others'
      // allocations end after their slots.
      if (d == 0) {
        EXPECT_EQ(m.reduced(),
                  m.slot(0) + uint64_t{m.slots()} * table->devices[d].layout.slot_stride);
        EXPECT_GT(m.accum(), m.reduced());
      } else {
        EXPECT_TRUE(throwsKind(ErrorKind::kInvalidArgument, [&] { (void)m.reduced(); }));
        EXPECT_TRUE(throwsKind(ErrorKind::kInvalidArgument, [&] { (void)m.accum(); }));
        EXPECT_EQ(table->devices[d].layout.bytes,
                  table->devices[d].layout.slots +
                      uint64_t{m.slots()} * table->devices[d].layout.slot_stride);
      }
    }
    EXPECT_TRUE(throwsKind(ErrorKind::kInvalidArgument,
                           [&] { gpu::DeviceMapping past(cuda, seg, table->count, 1); }));
    // The engine serves, its workers computing in the devices' memory.
    torch::Tensor idx = torch::arange(0, 20, torch::kInt64);
    auto ref = referenceGradient(f.model, "cross_entropy", f.x.index_select(0, idx),
                                 f.y.index_select(0, idx));
    t->gradient(idx);
    EXPECT_LT(relativeError(t->gradientViews(), ref), 1e-5);
  }
  engine.stop();
  EXPECT_FALSE(ipc::Segment::exists(name));
  EXPECT_TRUE(fakeAllocations(coordinator).empty()) << "device memory left behind";
  unsetenv("SHMGRAD_CUDA_LIBRARY");
}

// Each process finds the engine's GPUs by their UUIDs, whatever its own ordinals for them
// (CUDA_VISIBLE_DEVICES, CUDA_DEVICE_ORDER; FAKE_CUDA_VISIBLE for the fake device), and a
// process that does not see one of them is refused, naming it and the fix.
TEST(DeviceBuffersTest, DevicesAreMatchedByUuidInEveryProcess) {
  setenv("SHMGRAD_CUDA_LIBRARY", kFakeCuda, 1);
  setenv("FAKE_CUDA_DEVICES", "2", 1);
  unsetenv("FAKE_CUDA_VISIBLE");
  Fixture f = makeFixture("mlp", 7);
  const std::string name = uniqueName("uuids");
  // The engine computes on its cuda:1 (physical device 1) first, then cuda:0.
  EngineProcess engine(name, {"--model", f.model, "--workers", "2", "--devices", "1,0", "--dataset",
                              "npy:" + f.inputs_npy + "," + f.targets_npy});
  {
    // This process numbers them the other way round: its cuda:0 is physical device 1.
    setenv("FAKE_CUDA_VISIBLE", "1,0", 1);
    auto t = Trainer::attach(name);
    std::shared_ptr<const gpu::CudaLibrary> cuda = gpu::CudaLibrary::load(kFakeCuda);
    gpu::DeviceMapping first(cuda, t->segment(), 0);
    EXPECT_EQ(first.ordinal(), 0);  // physical 1, which the engine calls cuda:1
    EXPECT_EQ(first.context(), 0);  // where the trainer computes: the engine's first GPU
    gpu::DeviceMapping second(cuda, t->segment(), 1, first.context());
    EXPECT_EQ(second.ordinal(), 1);  // physical 0, the engine's cuda:0
    torch::Tensor idx = torch::arange(0, 12, torch::kInt64);
    auto ref = referenceGradient(f.model, "cross_entropy", f.x.index_select(0, idx),
                                 f.y.index_select(0, idx));
    t->gradient(idx);
    EXPECT_LT(relativeError(t->gradientViews(), ref), 1e-5);
  }
  {
    // This process sees physical device 0 only: the engine's first GPU is not there.
    setenv("FAKE_CUDA_VISIBLE", "0", 1);
    std::string message;
    EXPECT_TRUE(throwsKind(
        ErrorKind::kInvalidArgument, [&] { Trainer::attach(name); }, &message));
    EXPECT_NE(message.find("does not see"), std::string::npos) << message;
    EXPECT_NE(message.find("CUDA_VISIBLE_DEVICES"), std::string::npos) << message;
    EXPECT_NE(message.find("GPU-f0f1f2f3-"), std::string::npos) << message;
  }
  unsetenv("FAKE_CUDA_VISIBLE");
  engine.stop();
  EXPECT_FALSE(ipc::Segment::exists(name));
  unsetenv("SHMGRAD_CUDA_LIBRARY");
}

TEST(DeviceBuffersTest, WhatAMachineLacksFailsTheStartAndLeavesNothing) {
  Fixture f = makeFixture("mlp", 6);
  const std::string base = "--model " + f.model + " --workers 2 ";
  struct Case {
    const char* library;
    const char* fake_devices;
    const char* devices;
    const char* words;
    const char* no_peer = "0";
  };
  for (const Case& c : {
           Case{kFakeCuda, "1", "0,3", "names cuda:3, and this machine shows 1 GPU"},
           Case{kFakeCuda, "2", "1,1", "listed twice"}, Case{kFakeCuda, "0", "0", "sees none"},
           Case{kFakeCuda, "2", "0,1", "cuda:0 and cuda:1, which have no peer access", "1"},
           Case{"/nonexistent/libshmgrad_cuda.so", "2", "0", "built without its CUDA path"},
           Case{kRealCuda, "2", "0", "driver"},  // this machine: no NVIDIA driver
       }) {
    SCOPED_TRACE(std::string(c.library) + " --devices " + c.devices);
    if (std::string(c.library) == kRealCuda && access("/dev/nvidiactl", F_OK) == 0) {
      std::printf("skipped: this machine has an NVIDIA driver, so no 'no driver' error\n");
      continue;
    }
    setenv("SHMGRAD_CUDA_LIBRARY", c.library, 1);
    setenv("FAKE_CUDA_DEVICES", c.fake_devices, 1);
    setenv("FAKE_CUDA_NO_PEER", c.no_peer, 1);
    const std::string name = uniqueName("nodev");
    const auto [code, out] = serveToEnd(name, base + "--devices " + c.devices);
    EXPECT_NE(code, 0);
    EXPECT_NE(out.find(c.words), std::string::npos) << out;
    EXPECT_FALSE(ipc::Segment::exists(name)) << "segment left behind";
  }
  unsetenv("SHMGRAD_CUDA_LIBRARY");
  unsetenv("FAKE_CUDA_DEVICES");
  unsetenv("FAKE_CUDA_NO_PEER");
}

// GPU workers end to end on the fake device library (tests/fake_cuda.cc: host memory
// stands in for device memory, and tensors over it are CPU tensors): TorchScript workers
// compute with their device's copy of the parameters into their slot on that device, the
// library reduces the slots into the first device's reduced gradient, and the trainer's
// views are that memory. One worker alone, several on one device, two devices; sum, mean,
// explicit batches, accumulation and training (the other device's parameters brought up
// to date before each step).
class DeviceStepTest : public ::testing::TestWithParam<std::tuple<std::string, int>> {
 protected:
  void SetUp() override {
    setenv("SHMGRAD_CUDA_LIBRARY", kFakeCuda, 1);
    setenv("FAKE_CUDA_DEVICES", "2", 1);
  }
  void TearDown() override {
    unsetenv("SHMGRAD_CUDA_LIBRARY");
    unsetenv("FAKE_CUDA_DEVICES");
  }
};

// True when every float of the segment's own slots is zero: gradients went elsewhere.
bool hostSlotsUntouched(const ipc::Segment& seg) {
  for (uint32_t k = 0; k < seg.header()->num_slots; ++k) {
    const float* slot = seg.slot(k);
    for (uint64_t i = 0; i < seg.header()->param_floats; ++i) {
      if (slot[i] != 0.0f) return false;
    }
  }
  return true;
}

TEST_P(DeviceStepTest, GradientsAreTheReferenceAndLiveInDeviceMemory) {
  const auto [devices, workers] = GetParam();
  Fixture f = makeFixture("cnn", 9);
  const std::string name = uniqueName("devstep");
  EngineProcess engine(
      name, {"--model", f.model, "--workers", std::to_string(workers), "--loss", "cross_entropy",
             "--devices", devices, "--dataset", "npy:" + f.inputs_npy + "," + f.targets_npy});
  auto t = Trainer::attach(name);
  ASSERT_EQ(t->workerCount(), workers);
  const ipc::Segment& seg = t->segment();
  EXPECT_EQ(t->device(), -1);  // the fake's memory is host memory: CPU tensors over it
  EXPECT_NE(t->gradientBuffer().data_ptr(), static_cast<void*>(seg.reduced()));
  EXPECT_NE(t->parameterBuffer().data_ptr(), static_cast<void*>(seg.params()));
  auto grads = t->gradientViews();
  torch::manual_seed(3);
  for (int64_t B : {1, 5, 64}) {
    SCOPED_TRACE("batch " + std::to_string(B));
    torch::Tensor idx = torch::randperm(kExamples, torch::kInt64).narrow(0, 0, B);
    torch::Tensor x = f.x.index_select(0, idx), y = f.y.index_select(0, idx);
    GradientStats s = t->gradient(idx);
    EXPECT_LT(relativeError(grads, referenceGradient(f.model, "cross_entropy", x, y)), 1e-5);
    EXPECT_EQ(static_cast<int64_t>(s.workers.size()), std::min<int64_t>(B, workers));
    GradientOptions mean;
    mean.mean = true;
    t->gradient(x, y, mean);
    EXPECT_LT(relativeError(grads, referenceGradient(f.model, "cross_entropy", x, y, true)), 1e-5);
  }
  // Accumulation: the second step adds into the other buffer, the first left intact.
  torch::Tensor a = torch::arange(0, 40, torch::kInt64), b = torch::arange(40, 75, torch::kInt64);
  t->gradient(a);
  GradientOptions acc;
  acc.accumulate = ipc::Accumulate::kReducedToAccum;
  t->gradient(b, acc);
  torch::Tensor both = torch::cat({a, b});
  EXPECT_LT(relativeError(t->accumulatorViews(),
                          referenceGradient(f.model, "cross_entropy", f.x.index_select(0, both),
                                            f.y.index_select(0, both))),
            1e-5);
  EXPECT_LT(relativeError(grads, referenceGradient(f.model, "cross_entropy", f.x.index_select(0, a),
                                                   f.y.index_select(0, a))),
            1e-5);
  EXPECT_TRUE(hostSlotsUntouched(seg)) << "a worker wrote its gradient into the segment";
}

TEST_P(DeviceStepTest, TrainingMatchesOneProcessOnEveryDevice) {
  const auto [devices, workers] = GetParam();
  Fixture f = makeFixture("cnn", 10);
  const std::string name = uniqueName("devtrain");
  EngineProcess engine(
      name, {"--model", f.model, "--workers", std::to_string(workers), "--loss", "cross_entropy",
             "--devices", devices, "--dataset", "npy:" + f.inputs_npy + "," + f.targets_npy});
  auto t = Trainer::attach(name);
  expectTrainingMatchesOneProcess(t.get(), f, 10, 24, 6);
}

INSTANTIATE_TEST_SUITE_P(Placements, DeviceStepTest,
                         ::testing::Values(std::make_tuple("0", 1), std::make_tuple("0", 3),
                                           std::make_tuple("1,0", 2), std::make_tuple("0,1", 3)),
                         [](const auto& info) {
                           std::string d = std::get<0>(info.param);
                           for (char& c : d) c = c == ',' ? '_' : c;
                           return "cuda" + d + "_" + std::to_string(std::get<1>(info.param)) +
                                  "workers";
                         });

}  // namespace
}  // namespace shmgrad::testing
