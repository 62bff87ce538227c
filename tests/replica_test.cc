// Tests of worker::Replica in one process: parameters are views of the shared
// parameter buffer, .grad tensors are views of the replica's slot, backward writes the
// exact gradient into that slot and nowhere else, and model-loading errors are typed.
#include <gtest/gtest.h>
#include <torch/script.h>
#include <torch/torch.h>
#include <unistd.h>

#include <cstring>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "gpu/engine_memory.h"
#include "ipc/error.h"
#include "ipc/layout.h"
#include "ipc/segment.h"
#include "tests/segment_testing.h"
#include "tests/test_util.h"
#include "views/segment_views.h"
#include "worker/replica.h"

namespace shmgrad::testing {
namespace {

constexpr int64_t kSide = 8;  // inputs [1, 8, 8]
constexpr int64_t kClasses = 5;

// Input channels: the channels_last CNN needs several (with one, both layouts agree).
int64_t channelsOf(const std::string& kind) { return kind == "cnn_cl" ? 3 : 1; }

// "mlp", "cnn", or "cnn_cl": a CNN with its 4-D weight in channels_last, as
// model.to(memory_format=torch.channels_last) leaves it.
std::string saveModel(const std::string& kind, const std::string& dir, uint64_t seed) {
  const std::string path = dir + "/" + kind + std::to_string(seed) + ".pt";
  if (kind == "mlp") return saveMlp(path, kSide * kSide, 16, kClasses, seed);
  saveCnn(path, kSide, kClasses, seed, channelsOf(kind));
  if (kind == "cnn_cl") {
    torch::jit::Module m = torch::jit::load(path);
    for (auto p : m.parameters()) {
      if (p.dim() == 4) p.set_data(p.detach().contiguous(at::MemoryFormat::ChannelsLast));
    }
    m.save(path);
  }
  return path;
}

ipc::SegmentSpec specFor(const std::string& name, const std::string& model_path,
                         const worker::ModelParams& model, uint32_t slots) {
  ipc::SegmentSpec spec;
  spec.name = name;
  spec.model_path = model_path;
  spec.loss = ipc::LossKind::kCrossEntropy;
  spec.num_slots = slots;
  spec.params = model.specs;
  spec.max_batch = 64;
  spec.input_bytes = 1 << 20;
  spec.target_bytes = 1 << 16;
  return spec;
}

// Writes the model's initial values into the shared parameter buffer, as the
// coordinator does (engine/coordinator.cc).
void writeInitialParams(const ipc::Segment& seg, const worker::ModelParams& model) {
  const ipc::ParamEntry* table = seg.paramTable();
  for (size_t i = 0; i < model.values.size(); ++i) {
    std::memcpy(seg.params() + table[i].offset, model.values[i].data_ptr<float>(),
                table[i].numel * sizeof(float));
  }
}

std::vector<int64_t> shapeOf(const ipc::ParamEntry& e) {
  return std::vector<int64_t>(e.shape.dims, e.shape.dims + e.shape.ndim);
}

// Copies of the tensors a buffer laid out like params (a slot, params) holds.
std::vector<torch::Tensor> readBuffer(const ipc::Segment& seg, const float* buf) {
  std::vector<torch::Tensor> out;
  const ipc::ParamEntry* table = seg.paramTable();
  for (uint32_t i = 0; i < seg.header()->num_params; ++i) {
    out.push_back(views::parameterView(const_cast<float*>(buf), table[i], torch::kFloat32).clone());
  }
  return out;
}

// Number of floats of a buffer laid out like params that are not zero.
int64_t nonZero(const ipc::Segment& seg, const float* buf) {
  int64_t n = 0;
  for (uint64_t i = 0; i < seg.header()->param_floats; ++i) n += buf[i] != 0.0f;
  return n;
}

// Number of non-zero floats in the padding between the parameters of a buffer.
int64_t nonZeroPadding(const ipc::Segment& seg, const float* buf) {
  std::vector<bool> used(seg.header()->param_floats, false);
  const ipc::ParamEntry* table = seg.paramTable();
  for (uint32_t i = 0; i < seg.header()->num_params; ++i) {
    for (uint64_t k = 0; k < table[i].numel; ++k) used[table[i].offset + k] = true;
  }
  int64_t n = 0;
  for (uint64_t i = 0; i < used.size(); ++i) n += !used[i] && buf[i] != 0.0f;
  return n;
}

// Gradient of the summed cross-entropy of the model with its parameters set to values.
std::vector<torch::Tensor> referenceGradientWith(const std::string& model_path,
                                                 const std::vector<torch::Tensor>& values,
                                                 const torch::Tensor& x, const torch::Tensor& y) {
  torch::jit::Module m = torch::jit::load(model_path);
  m.train();
  std::vector<torch::Tensor> params;
  for (const auto& p : m.parameters()) params.push_back(p);
  {
    torch::NoGradGuard no_grad;
    for (size_t i = 0; i < params.size(); ++i) params[i].copy_(values[i]);
  }
  torch::Tensor out = m.forward({x}).toTensor();
  torch::nll_loss(torch::log_softmax(out, 1), y, {}, torch::Reduction::Sum).backward();
  std::vector<torch::Tensor> g;
  for (const auto& p : params) g.push_back(p.grad().clone());
  return g;
}

std::vector<torch::Tensor> add(const std::vector<torch::Tensor>& a,
                               const std::vector<torch::Tensor>& b) {
  std::vector<torch::Tensor> out;
  for (size_t i = 0; i < a.size(); ++i) out.push_back(a[i] + b[i]);
  return out;
}

class ReplicaTest : public ::testing::TestWithParam<std::string> {};

TEST_P(ReplicaTest, GradientsAreWrittenIntoTheSharedSlot) {
  const std::string kind = GetParam();
  const std::string dir = tempDir("replica-" + kind);
  const std::string model_path = saveModel(kind, dir, 3);
  worker::ModelParams model = worker::describeModel(model_path);
  ASSERT_EQ(model.specs.size(), 4u);
  const std::string name = uniqueName("replica-" + kind);
  SegmentGuard guard(name);
  auto seg = ipc::Segment::create(specFor(name, model_path, model, 2));
  writeInitialParams(*seg, model);
  const ipc::SegmentHeader* h = seg->header();
  const ipc::ParamEntry* table = seg->paramTable();
  const uint64_t pf = h->param_floats;

  const gpu::EngineMemory memory(*seg);  // a CPU engine: the segment's own memory
  worker::Replica r0(*seg, 0, memory);
  worker::Replica r1(*seg, 1, memory);
  ASSERT_EQ(r0.parameters().size(), h->num_params);
  ASSERT_EQ(r1.parameters().size(), h->num_params);
  r0.zeroGrad();
  r1.zeroGrad();

  // Parameters are views of the shared buffer at their table offsets; .grad tensors
  // are views of the replica's own slot.
  auto checkViews = [&](worker::Replica& r, uint32_t slot) {
    const float* pbegin = seg->params();
    const float* gbegin = seg->slot(slot);
    for (uint32_t i = 0; i < h->num_params; ++i) {
      const torch::Tensor& p = r.parameters()[i];
      SCOPED_TRACE(std::string("slot ") + std::to_string(slot) + " parameter " + table[i].name);
      ASSERT_TRUE(p.requires_grad());
      ASSERT_EQ(p.sizes().vec(), shapeOf(table[i]));
      // In the model's memory format, as the table says; .grad alike.
      ASSERT_EQ(views::memoryFormatOf(p), static_cast<ipc::MemoryFormat>(table[i].memory_format));
      ASSERT_TRUE(p.is_non_overlapping_and_dense());
      const float* pd = p.data_ptr<float>();
      EXPECT_EQ(pd, pbegin + table[i].offset);
      EXPECT_GE(pd, pbegin);
      EXPECT_LE(pd + p.numel(), pbegin + pf);
      ASSERT_TRUE(p.grad().defined());
      ASSERT_EQ(p.grad().sizes(), p.sizes());
      ASSERT_EQ(p.grad().strides(), p.strides());
      const float* gd = p.grad().data_ptr<float>();
      EXPECT_EQ(gd, gbegin + table[i].offset);
      EXPECT_GE(gd, gbegin);
      EXPECT_LE(gd + p.grad().numel(), gbegin + pf);
    }
  };
  checkViews(r0, 0);
  checkViews(r1, 1);
  if (HasFatalFailure()) return;
  int channels_last = 0;
  for (uint32_t i = 0; i < h->num_params; ++i) {
    channels_last +=
        table[i].memory_format == static_cast<uint32_t>(ipc::MemoryFormat::kChannelsLast);
    EXPECT_EQ(views::memoryFormatOf(model.values[i]),
              static_cast<ipc::MemoryFormat>(table[i].memory_format));
  }
  EXPECT_EQ(channels_last, kind == "cnn_cl" ? 1 : 0);
  std::vector<const void*> param_ptrs, grad_ptrs;
  for (const auto& p : r0.parameters()) {
    param_ptrs.push_back(p.data_ptr());
    grad_ptrs.push_back(p.grad().data_ptr());
  }

  // The shared buffer holds the model's initial values, and the replica sees them.
  for (uint32_t i = 0; i < h->num_params; ++i) {
    EXPECT_TRUE(torch::equal(r0.parameters()[i].detach(), model.values[i])) << table[i].name;
  }

  // Slot 0: backward of a random batch writes the reference gradient into the slot.
  torch::manual_seed(17);
  const int64_t B = 9;
  torch::Tensor x = torch::randn({B, channelsOf(kind), kSide, kSide});
  torch::Tensor y = torch::randint(0, kClasses, {B}, torch::kInt64);
  const double loss = r0.accumulate(x, y);
  auto ref = referenceGradient(model_path, "cross_entropy", x, y);
  auto slot0 = readBuffer(*seg, seg->slot(0));
  EXPECT_LT(relativeError(slot0, ref), 1e-5);
  std::vector<torch::Tensor> grads0;
  for (const auto& p : r0.parameters()) grads0.push_back(p.grad().clone());
  EXPECT_LT(relativeError(grads0, ref), 1e-5);
  {
    torch::jit::Module m = torch::jit::load(model_path);
    torch::NoGradGuard no_grad;
    double want = torch::nn::functional::cross_entropy(
                      m.forward({x}).toTensor(), y,
                      torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kSum))
                      .item<double>();
    EXPECT_NEAR(loss, want, 1e-5 * std::max(1.0, std::abs(want)));
  }
  EXPECT_GT(nonZero(*seg, seg->slot(0)), 0);
  EXPECT_EQ(nonZeroPadding(*seg, seg->slot(0)), 0) << "backward wrote into slot padding";
  // No reallocation: the same storage before and after backward.
  checkViews(r0, 0);
  for (uint32_t i = 0; i < h->num_params; ++i) {
    EXPECT_EQ(r0.parameters()[i].data_ptr(), param_ptrs[i]) << table[i].name;
    EXPECT_EQ(r0.parameters()[i].grad().data_ptr(), grad_ptrs[i]) << table[i].name;
  }
  // Slot 1 and the reduced buffer are untouched; the parameters did not change.
  EXPECT_EQ(nonZero(*seg, seg->slot(1)), 0) << "slot 0's backward wrote into slot 1";
  EXPECT_EQ(nonZero(*seg, seg->reduced()), 0);
  for (uint32_t i = 0; i < h->num_params; ++i) {
    EXPECT_TRUE(torch::equal(r0.parameters()[i].detach(), model.values[i])) << table[i].name;
  }

  // Slot 1: another batch; slot 0 keeps its gradient.
  torch::Tensor x2 = torch::randn({B + 4, channelsOf(kind), kSide, kSide});
  torch::Tensor y2 = torch::randint(0, kClasses, {B + 4}, torch::kInt64);
  r1.accumulate(x2, y2);
  auto ref2 = referenceGradient(model_path, "cross_entropy", x2, y2);
  EXPECT_LT(relativeError(readBuffer(*seg, seg->slot(1)), ref2), 1e-5);
  EXPECT_LT(relativeError(readBuffer(*seg, seg->slot(0)), slot0), 1e-12)
      << "slot 1's backward changed slot 0";
  checkViews(r1, 1);

  // Without zeroGrad, a second backward adds into the slot in place.
  r0.accumulate(x2, y2);
  EXPECT_LT(relativeError(readBuffer(*seg, seg->slot(0)), add(ref, ref2)), 1e-5);
  checkViews(r0, 0);
  for (uint32_t i = 0; i < h->num_params; ++i) {
    EXPECT_EQ(r0.parameters()[i].grad().data_ptr(), grad_ptrs[i]) << table[i].name;
  }
  // zeroGrad clears the slot and keeps the views.
  r0.zeroGrad();
  EXPECT_EQ(nonZero(*seg, seg->slot(0)), 0);
  checkViews(r0, 0);
  EXPECT_GT(nonZero(*seg, seg->slot(1)), 0) << "slot 0's zeroGrad cleared slot 1";

  // An update written into the shared buffer is seen by both replicas at once.
  std::vector<torch::Tensor> updated;
  for (uint32_t i = 0; i < h->num_params; ++i) {
    torch::Tensor v = model.values[i] - 0.1 * ref[i] + 0.25;
    updated.push_back(v);
    v = views::inMemoryFormat(v, static_cast<ipc::MemoryFormat>(table[i].memory_format));
    std::memcpy(seg->params() + table[i].offset, v.data_ptr<float>(),
                table[i].numel * sizeof(float));
  }
  for (uint32_t i = 0; i < h->num_params; ++i) {
    EXPECT_TRUE(torch::equal(r1.parameters()[i].detach(), updated[i])) << table[i].name;
    EXPECT_TRUE(torch::equal(r0.parameters()[i].detach(), updated[i])) << table[i].name;
  }
  seg->params()[table[0].offset] = 42.0f;
  EXPECT_EQ(r1.parameters()[0].detach().reshape({-1})[0].item<float>(), 42.0f);
  std::memcpy(seg->params() + table[0].offset, updated[0].data_ptr<float>(), sizeof(float));
  // And the next backward uses the updated values.
  r1.zeroGrad();
  r1.accumulate(x, y);
  EXPECT_LT(relativeError(readBuffer(*seg, seg->slot(1)),
                          referenceGradientWith(model_path, updated, x, y)),
            1e-5);
  EXPECT_EQ(nonZero(*seg, seg->slot(0)), 0);
}

INSTANTIATE_TEST_SUITE_P(Models, ReplicaTest, ::testing::Values("mlp", "cnn", "cnn_cl"),
                         [](const auto& info) { return std::string(info.param); });

TEST(ReplicaErrorsTest, SlotOutOfRangeAndMismatchedModel) {
  const std::string dir = tempDir("replica-errors");
  const std::string mlp = saveModel("mlp", dir, 5);
  const std::string cnn = saveModel("cnn", dir, 6);
  worker::ModelParams model = worker::describeModel(mlp);
  {
    const std::string name = uniqueName("replica-slot");
    SegmentGuard guard(name);
    auto seg = ipc::Segment::create(specFor(name, mlp, model, 2));
    const gpu::EngineMemory memory(*seg);
    EXPECT_TRUE(
        throwsKind(ErrorKind::kInvalidArgument, [&] { worker::Replica r(*seg, 2, memory); }));
  }
  {
    // With a trainer slot (serve --workers auto), slot 2 is the trainer's: a replica there
    // (worker::ScriptInTrainer's) computes into it; slot 3 is out of range.
    const std::string name = uniqueName("replica-trainer-slot");
    SegmentGuard guard(name);
    ipc::SegmentSpec spec = specFor(name, mlp, model, 2);
    spec.trainer_slot = true;
    auto seg = ipc::Segment::create(spec);
    writeInitialParams(*seg, model);
    const gpu::EngineMemory memory(*seg);
    EXPECT_TRUE(
        throwsKind(ErrorKind::kInvalidArgument, [&] { worker::Replica r(*seg, 3, memory); }));
    worker::Replica r(*seg, 2, memory);
    r.zeroGrad();
    torch::manual_seed(5);
    torch::Tensor x = torch::randn({6, 1, kSide, kSide});
    torch::Tensor y = torch::randint(0, kClasses, {6}, torch::kInt64);
    r.accumulate(x, y);
    EXPECT_LT(relativeError(readBuffer(*seg, seg->slot(2)),
                            referenceGradient(mlp, "cross_entropy", x, y)),
              1e-5);
    EXPECT_EQ(nonZero(*seg, seg->slot(0)), 0);
    EXPECT_EQ(nonZero(*seg, seg->slot(1)), 0);
  }
  {
    // The segment describes the MLP but its model path names the CNN.
    const std::string name = uniqueName("replica-mismatch");
    SegmentGuard guard(name);
    auto seg = ipc::Segment::create(specFor(name, cnn, model, 1));
    const gpu::EngineMemory memory(*seg);
    std::string message;
    EXPECT_TRUE(throwsKind(
        ErrorKind::kInvalidArgument, [&] { worker::Replica r(*seg, 0, memory); }, &message));
    EXPECT_NE(message.find("does not match"), std::string::npos) << message;
  }
}

// The replica's linear layers become shmgrad::linear (worker/direct_linear.h), which
// outside a shard's pass (no DirectLinearScope) is aten::linear: the same outputs and the
// same gradients; SHMGRAD_DIRECT_LINEAR=0 leaves the graph as it is.
TEST(ReplicaDirectLinearTest, LinearLayersAreRewrittenAndComputeAsBefore) {
  const std::string dir = tempDir("replica-direct");
  // The test MLP with its products as linear layers (aten::linear), one without a bias.
  const std::string path = dir + "/linear.pt";
  {
    torch::jit::Module mlp = torch::jit::load(saveModel("mlp", dir, 7));
    torch::jit::Module m("LinearMlp");
    for (const auto& p : mlp.named_parameters()) m.register_parameter(p.name, p.value, false);
    m.define(R"(
def forward(self, x):
    h = torch.relu(torch.linear(torch.flatten(x, 1), self.w1, self.b1))
    return torch.linear(h, self.w2) + self.b2
)");
    m.save(path);
  }
  torch::jit::Module plain = torch::jit::load(path);
  torch::jit::Module rewritten = worker::loadModel(path);
  EXPECT_GE(worker::rewriteLinears(rewritten), 1);
  EXPECT_EQ(worker::rewriteLinears(rewritten), 0);  // none left
  torch::manual_seed(3);
  torch::Tensor x = torch::randn({5, 1, kSide, kSide});
  EXPECT_TRUE(torch::equal(plain.forward({x}).toTensor(), rewritten.forward({x}).toTensor()));

  worker::ModelParams model = worker::describeModel(path);
  const std::string name = uniqueName("replica-direct");
  SegmentGuard guard(name);
  auto seg = ipc::Segment::create(specFor(name, path, model, 1));
  writeInitialParams(*seg, model);
  const gpu::EngineMemory memory(*seg);
  {
    worker::Replica r(*seg, 0, memory);
    EXPECT_EQ(r.directIndex().size(), r.parameters().size());
  }
  ASSERT_EQ(setenv("SHMGRAD_DIRECT_LINEAR", "0", 1), 0);
  {
    worker::Replica r(*seg, 0, memory);
    EXPECT_TRUE(r.directIndex().empty());
  }
  unsetenv("SHMGRAD_DIRECT_LINEAR");
}

TEST(ReplicaErrorsTest, ModelFileErrors) {
  const std::string dir = tempDir("replica-files");
  const std::string missing = dir + "/no-such-model.pt";
  std::string message;
  EXPECT_TRUE(throwsKind(
      ErrorKind::kNotFound, [&] { worker::describeModel(missing); }, &message));
  EXPECT_NE(message.find(missing), std::string::npos) << message;
  EXPECT_TRUE(throwsKind(ErrorKind::kNotFound, [&] { worker::loadModel(missing); }));

  const std::string text = dir + "/not-a-model.pt";
  {
    std::ofstream f(text);
    f << "this is not a TorchScript archive\n";
  }
  EXPECT_TRUE(throwsKind(
      ErrorKind::kInvalidArgument, [&] { worker::describeModel(text); }, &message));
  EXPECT_NE(message.find("TorchScript"), std::string::npos) << message;
  EXPECT_TRUE(throwsKind(
      ErrorKind::kInvalidArgument, [&] { worker::loadModel(text); }, &message));
  EXPECT_NE(message.find("TorchScript"), std::string::npos) << message;

  // A directory is not a model file either.
  EXPECT_TRUE(throwsKind(ErrorKind::kInvalidArgument, [&] { worker::loadModel(dir); }));
}

TEST(ReplicaErrorsTest, ParseLoss) {
  std::string message;
  EXPECT_TRUE(throwsKind(
      ErrorKind::kInvalidArgument, [&] { ipc::parseLoss("foo"); }, &message));
  for (const char* choice : {"cross_entropy", "nll", "mse"}) {
    EXPECT_NE(message.find(choice), std::string::npos) << message;
  }
  EXPECT_NE(message.find("foo"), std::string::npos) << message;
  EXPECT_EQ(ipc::parseLoss("cross_entropy"), ipc::LossKind::kCrossEntropy);
  EXPECT_EQ(ipc::parseLoss("nll"), ipc::LossKind::kNll);
  EXPECT_EQ(ipc::parseLoss("mse"), ipc::LossKind::kMse);
  for (auto k : {ipc::LossKind::kCrossEntropy, ipc::LossKind::kNll, ipc::LossKind::kMse}) {
    EXPECT_EQ(ipc::parseLoss(ipc::lossName(k)), k);
  }
  EXPECT_TRUE(throwsKind(ErrorKind::kInvalidArgument, [&] { ipc::parseLoss(""); }));
}

// The numerics a worker computes with: the engine's record applied to torch (the trainer's
// settings), none set leaves torch as it is, and a hostile record is refused.
TEST(ReplicaNumericsTest, TheEnginesNumericsAreApplied) {
  at::Context& ctx = at::globalContext();
  const auto precision = ctx.float32MatmulPrecision();
  const bool tf32 = ctx.allowTF32CuDNN(), bench = ctx.benchmarkCuDNN(),
             determ = ctx.deterministicCuDNN();
  worker::applyNumerics(ipc::parseNumerics(""));  // none set: nothing changes
  EXPECT_EQ(ctx.float32MatmulPrecision(), precision);
  worker::applyNumerics(ipc::parseNumerics(
      "matmul_precision=medium,cudnn_tf32=0,cudnn_benchmark=1,cudnn_deterministic=1"));
  EXPECT_EQ(ctx.float32MatmulPrecision(), at::Float32MatmulPrecision::MEDIUM);
  EXPECT_FALSE(ctx.allowTF32CuDNN());
  EXPECT_TRUE(ctx.benchmarkCuDNN());
  EXPECT_TRUE(ctx.deterministicCuDNN());
  EXPECT_TRUE(throwsKind(ErrorKind::kCorrupt, [] {
    worker::applyNumerics(ipc::Numerics{ipc::kNumericsSet, 7});
  }));
  ctx.setFloat32MatmulPrecision(precision == at::Float32MatmulPrecision::HIGHEST ? "highest"
                                : precision == at::Float32MatmulPrecision::HIGH  ? "high"
                                                                                 : "medium");
  ctx.setAllowTF32CuDNN(tf32);
  ctx.setBenchmarkCuDNN(bench);
  ctx.setDeterministicCuDNN(determ);
}

}  // namespace
}  // namespace shmgrad::testing
