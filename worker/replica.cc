#include "worker/replica.h"

#include <sys/stat.h>
#include <torch/torch.h>

#include <cstring>
#include <fstream>

#include "ipc/config.h"
#include "ipc/error.h"
#include "ipc/layout.h"
#include "views/segment_views.h"

namespace shmgrad::worker {

using views::bufferBlockView;
using views::bufferViewsOf;
using views::floatOptions;
using views::inMemoryFormat;
using views::memoryFormatOf;
using views::parameterView;

void applyNumerics(const ipc::Numerics& shared) {
  const ipc::Numerics n = ipc::checkedNumerics(shared);
  if ((n.flags & ipc::kNumericsSet) == 0) return;
  at::Context& ctx = at::globalContext();
  ctx.setFloat32MatmulPrecision(ipc::kMatmulPrecisionNames[n.matmul_precision]);
  ctx.setAllowTF32CuDNN((n.flags & ipc::kCudnnTf32) != 0);
  ctx.setBenchmarkCuDNN((n.flags & ipc::kCudnnBenchmark) != 0);
  ctx.setDeterministicCuDNN((n.flags & ipc::kCudnnDeterministic) != 0);
}

namespace F = torch::nn::functional;

torch::jit::Module loadModel(const std::string& path) {
  struct stat st;
  SHMGRAD_CHECK(::stat(path.c_str(), &st) == 0, ErrorKind::kNotFound, "model file '", path,
                "' does not exist; save one with shmgrad.save_model(module, path) or "
                "torch.jit.save(torch.jit.script(module), path)");
  SHMGRAD_CHECK(S_ISREG(st.st_mode), ErrorKind::kInvalidArgument, "model path '", path,
                "' is not a regular file");
  try {
    return torch::jit::load(path, torch::kCPU);
  } catch (const std::exception& e) {
    std::string what = e.what();
    if (what.size() > 300) what = what.substr(0, 300) + "...";
    raise(ErrorKind::kInvalidArgument, "model file '", path,
          "' is not a TorchScript file that libtorch ", TORCH_VERSION, " can load (", what,
          "); save it with shmgrad.save_model(module, path) or torch.jit.save, or use eager "
          "workers (mode='eager')");
  }
}

ModelParams describeModel(const std::string& path) {
  torch::jit::Module m = loadModel(path);
  ModelParams out;
  for (const auto& np : m.named_parameters(/*recurse=*/true)) {
    const torch::Tensor& t = np.value;
    SHMGRAD_CHECK(t.scalar_type() == torch::kFloat32, ErrorKind::kInvalidArgument, "parameter ",
                  np.name, " of ", path, " is ", t.scalar_type(),
                  "; shmgrad engines hold float32 parameters: call module.float() before saving");
    SHMGRAD_CHECK(t.device().is_cpu(), ErrorKind::kInvalidArgument, "parameter ", np.name,
                  " is on ", t.device(), "; save the CPU model");
    const ipc::MemoryFormat format = memoryFormatOf(t);
    out.specs.push_back({np.name, t.sizes().vec(), format});
    out.values.push_back(inMemoryFormat(t.detach(), format).clone());
  }
  SHMGRAD_CHECK(!out.specs.empty(), ErrorKind::kInvalidArgument, "model ", path,
                " has no parameters: nothing to compute a gradient of");
  for (const auto& nb : m.named_buffers(/*recurse=*/true)) {
    const torch::Tensor& t = nb.value;
    if (!sharedBufferType(t)) continue;
    out.buffer_specs.push_back(
        {nb.name, t.sizes().vec(),
         t.scalar_type() == torch::kInt64 ? ipc::DType::kInt64 : ipc::DType::kFloat32});
    out.buffer_values.push_back(t.detach().contiguous().clone());
  }
  return out;
}

bool sharedBufferType(const torch::Tensor& t) {
  return t.scalar_type() == torch::kFloat32 || t.scalar_type() == torch::kInt64;
}

torch::Tensor lossSum(ipc::LossKind loss, const torch::Tensor& output,
                      const torch::Tensor& target) {
  switch (loss) {
    case ipc::LossKind::kCrossEntropy:
      return F::cross_entropy(output, target, F::CrossEntropyFuncOptions().reduction(torch::kSum));
    case ipc::LossKind::kNll:
      return F::nll_loss(output, target, F::NLLLossFuncOptions().reduction(torch::kSum));
    case ipc::LossKind::kMse:
      SHMGRAD_CHECK(output.sizes() == target.sizes(), ErrorKind::kInvalidArgument,
                    "mse: the model's output has shape ", output.sizes(),
                    " but the targets have shape ", target.sizes(),
                    "; give targets of the output's shape");
      return F::mse_loss(output, target, F::MSELossFuncOptions().reduction(torch::kSum));
  }
  raise(ErrorKind::kInvalidArgument, "unknown loss kind");
}

Replica::Replica(const ipc::Segment& segment, uint32_t slot, const gpu::EngineMemory& memory)
    : segment_(segment),
      slot_(slot),
      memory_(memory),
      loss_(static_cast<ipc::LossKind>(segment.header()->loss)) {
  const ipc::SegmentHeader* h = segment.header();
  SHMGRAD_CHECK(slot < ipc::allSlots(*h), ErrorKind::kInvalidArgument, "worker slot ", slot,
                " >= slots ", ipc::allSlots(*h));
  module_ = loadModel(h->model_path);
  module_.train();
  device_ = memory.ordinal(slot);
  options_ = floatOptions(memory.tensorDevice(device_));
  // On a device the module's own buffers move there; its parameters become views below.
  if (options_.device().is_cuda()) module_.to(options_.device());
  const ipc::ParamEntry* table = segment.paramTable();
  float* params = memory.params(slot);
  float* grads = memory.slot(slot);
  torch::NoGradGuard no_grad;
  size_t i = 0;
  for (const auto& np : module_.named_parameters(/*recurse=*/true)) {
    SHMGRAD_CHECK(i < h->num_params, ErrorKind::kInvalidArgument, "model ", h->model_path,
                  " has more parameters than the engine's table (", h->num_params,
                  "); was the file replaced after the engine started?");
    const ipc::ParamEntry& e = table[i];
    torch::Tensor p = np.value;
    std::vector<int64_t> shape(e.shape.dims, e.shape.dims + e.shape.ndim);
    SHMGRAD_CHECK(
        np.name == e.name && p.sizes().vec() == shape && p.scalar_type() == torch::kFloat32,
        ErrorKind::kInvalidArgument, "model parameter ", i, " (", np.name, ", ", p.sizes(),
        ") does not match the engine's (", e.name, ", ", c10::IntArrayRef(shape),
        "); was the file replaced after the engine started?");
    // The parameter's storage becomes the shared buffer: every worker and the trainer
    // see the same bytes, so an optimizer step is seen by all with no copy.
    p.set_data(parameterView(params, e, options_));
    params_.push_back(p);
    ++i;
  }
  SHMGRAD_CHECK(i == h->num_params, ErrorKind::kInvalidArgument, "model ", h->model_path, " has ",
                i, " parameters but the engine's table has ", h->num_params);
  // On the host, the model's linear layers compute their gradients into the slot
  // (worker/direct_linear.h), as eager workers' do, unless SHMGRAD_DIRECT_LINEAR=0.
  if (!options_.device().is_cuda() &&
      std::string(config::tunableValue("SHMGRAD_DIRECT_LINEAR")) != "0" &&
      rewriteLinears(module_) > 0) {
    for (size_t k = 0; k < params_.size(); ++k) {
      direct_index_.emplace(params_[k].unsafeGetTensorImpl(), static_cast<int64_t>(k));
    }
  }
  bindGradients(grads);
  grad_versions_.assign(params_.size(), 0);
  // Buffers: this replica keeps its own, as views of one block laid out as the segment's
  // buffer region (on its device, for a GPU worker); the shared ones are loaded into it
  // before a step and published from it after, each in one copy. Matched by name and
  // order against the engine's table.
  shared_block_ = bufferBlockView(segment);
  slot_block_ = bufferBlockView(
      segment, [](void*) {}, segment.slotBuffers(slot_));
  buffer_block_ = torch::zeros({shared_block_.numel()},
                               torch::TensorOptions(torch::kUInt8).device(options_.device()));
  const std::vector<torch::Tensor> views = bufferViewsOf(segment, buffer_block_);
  const ipc::BufferEntry* btable = segment.bufferTable();
  size_t b = 0;
  for (const auto& nb : module_.named_buffers(/*recurse=*/true)) {
    if (!sharedBufferType(nb.value)) continue;
    SHMGRAD_CHECK(b < views.size() && nb.name == btable[b].name &&
                      nb.value.sizes() == views[b].sizes() &&
                      nb.value.scalar_type() == views[b].scalar_type(),
                  ErrorKind::kInvalidArgument, "model buffer ", nb.name,
                  " does not match the engine's; was the file replaced after the engine started?");
    views[b].copy_(nb.value);
    torch::Tensor own = nb.value;
    own.set_data(views[b]);  // the module's buffer is now its part of the block
    ++b;
  }
  SHMGRAD_CHECK(b == views.size(), ErrorKind::kInvalidArgument, "model ", h->model_path, " has ", b,
                " shared buffers but the engine has ", views.size());
}

void Replica::loadBuffers() {
  if (buffer_block_.numel() == 0) return;
  torch::NoGradGuard no_grad;
  buffer_block_.copy_(shared_block_);
}

void Replica::publishBuffers(uint8_t* dst) {
  if (buffer_block_.numel() == 0) return;
  torch::NoGradGuard no_grad;
  (dst == segment_.buffers() ? shared_block_ : slot_block_).copy_(buffer_block_);
}

void Replica::bindGradients(float* base) {
  if (base == grads_base_) return;
  const ipc::ParamEntry* table = segment_.paramTable();
  for (size_t i = 0; i < params_.size(); ++i) {
    // A defined .grad is accumulated into in place by autograd: backward writes
    // straight into shared memory.
    params_[i].mutable_grad() = parameterView(base, table[i], options_);
  }
  grads_base_ = base;
}

void Replica::noteGradVersions() {
  for (size_t i = 0; i < params_.size(); ++i) grad_versions_[i] = params_[i].grad()._version();
}

void Replica::markGradParams(uint64_t* bits) const {
  for (size_t i = 0; i < params_.size(); ++i) {
    if (params_[i].grad()._version() != grad_versions_[i]) ipc::setParamBit(bits, i);
  }
}

void Replica::zeroGrad() {
  memory_.zero(device_, memory_.slot(slot_), segment_.header()->param_floats);
}

double Replica::accumulate(const torch::Tensor& inputs, const torch::Tensor& targets,
                           float grad_scale) {
  // On a device the batch is copied there (the step's inputs, never its gradients).
  const bool moved = options_.device().is_cuda();
  torch::jit::IValue out = module_.forward({moved ? inputs.to(options_.device()) : inputs});
  SHMGRAD_CHECK(out.isTensor(), ErrorKind::kInvalidArgument, "the model's forward returned ",
                out.tagKind(), "; shmgrad needs a model whose forward returns one Tensor");
  torch::Tensor loss =
      lossSum(loss_, out.toTensor(), moved ? targets.to(options_.device()) : targets);
  if (grad_scale == 1.0f) {
    loss.backward();
  } else {
    (loss * grad_scale).backward();
  }
  // Read after backward is queued: on a device, reading it first would wait for the
  // forward before backward's kernels could be issued.
  return loss.item<double>();
}

}  // namespace shmgrad::worker
