// A worker's model replica: a TorchScript module whose parameters are views of the
// shared parameter buffer and whose .grad tensors are views of the worker's slot.
#pragma once

#include <torch/script.h>

#include <cstdint>
#include <string>
#include <vector>

#include "gpu/engine_memory.h"
#include "ipc/segment.h"
#include "worker/direct_linear.h"

namespace shmgrad::worker {

// Loads a TorchScript model file, with errors that name the file and the fix.
torch::jit::Module loadModel(const std::string& path);

// The model's parameters as the segment will lay them out, and their initial values.
struct ModelParams {
  std::vector<ipc::ParamSpec> specs;
  std::vector<torch::Tensor> values;  // float32, contiguous, CPU
  // Its float32 and int64 buffers (BatchNorm statistics), shared like the parameters.
  std::vector<ipc::BufferSpec> buffer_specs;
  std::vector<torch::Tensor> buffer_values;
};

// True for a buffer the engine shares (float32 or int64); others stay per worker.
bool sharedBufferType(const torch::Tensor& t);

ModelParams describeModel(const std::string& path);

// Sum of the loss over a batch (reduction "sum"), for the engine's loss kinds.
torch::Tensor lossSum(ipc::LossKind loss, const torch::Tensor& output, const torch::Tensor& target);

// Makes this process compute with the numerics the engine was started with (the trainer's
// torch settings: float32 matmul precision, cuDNN's TF32, benchmark and determinism); a
// record without ipc::kNumericsSet leaves torch's defaults. CorruptError for bits or a
// precision it does not know (the record is read from shared memory).
void applyNumerics(const ipc::Numerics& numerics);

class Replica {
 public:
  // Loads the segment's model and binds its parameters to the shared parameters and its
  // gradients to slot `slot`, where `memory` keeps them: the segment, or for an engine
  // with devices the slot's device (the model moved there). Throws if the model does not
  // match the segment.
  Replica(const ipc::Segment& segment, uint32_t slot, const gpu::EngineMemory& memory);

  // Zeroes the slot (the gradients stay defined, so autograd accumulates in place).
  void zeroGrad();
  // Points every parameter's .grad at `base` (laid out like the parameters: the slot,
  // or the reduced buffer when this worker is a step's only participant). A no-op when
  // they already point there.
  void bindGradients(float* base);
  // Forward, loss (sum over the examples, times grad_scale) and backward; gradients add
  // into the bound buffer. Returns the unscaled loss sum.
  double accumulate(const torch::Tensor& inputs, const torch::Tensor& targets,
                    float grad_scale = 1.0f);

  // Loads the shared buffers into this replica's own (before computing a step), and
  // stores its own into the shared ones (the step's first participant, after the compute
  // barrier): DDP's rule, the buffers after a step are those of the first participant.
  void loadBuffers();
  // Into the shared buffers, or into this slot's copy of them (dst as in
  // ShardComputer::publishBuffers).
  void publishBuffers(uint8_t* dst);

  // Which parameters backward reaches, by the version counter of each .grad (autograd
  // adds to a defined .grad in place, which bumps it): note the versions before a shard,
  // then set bit i of `bits` for each parameter whose .grad changed since.
  void noteGradVersions();
  void markGradParams(uint64_t* bits) const;

  const std::vector<torch::Tensor>& parameters() const { return params_; }
  // The engine parameters' indices by tensor, for a DirectLinearScope around a pass: empty
  // where the module's linear layers were not rewritten (on a device, or
  // SHMGRAD_DIRECT_LINEAR=0), which then compute fresh gradients.
  const ParamIndex& directIndex() const { return direct_index_; }
  torch::jit::Module& module() { return module_; }

 private:
  const ipc::Segment& segment_;
  uint32_t slot_;
  const gpu::EngineMemory& memory_;
  int device_ = -1;               // the slot's CUDA ordinal, -1: the host
  torch::TensorOptions options_;  // float32, on the device the memory is
  torch::jit::Module module_;
  std::vector<torch::Tensor> params_;
  float* grads_base_ = nullptr;
  std::vector<int64_t> grad_versions_;  // one per parameter, sized once
  // The module's buffers' block (its own, on its device), and byte views of the segment's
  // shared buffers and of this slot's copy of them (BufferRule::kMean).
  torch::Tensor buffer_block_, shared_block_, slot_block_;
  ipc::LossKind loss_;
  ParamIndex direct_index_;
};

}  // namespace shmgrad::worker
