// A worker's model replica: a TorchScript module whose parameters are views of the
// shared parameter buffer and whose .grad tensors are views of the worker's slot.
#pragma once

#include <torch/script.h>

#include <cstdint>
#include <string>
#include <vector>

#include "ipc/segment.h"

namespace shmgrad::worker {

// Loads a TorchScript model file, with errors that name the file and the fix.
torch::jit::Module loadModel(const std::string& path);

// The model's parameters as the segment will lay them out, and their initial values.
struct ModelParams {
  std::vector<ipc::ParamSpec> specs;
  std::vector<torch::Tensor> values;  // float32, contiguous, CPU
};
ModelParams describeModel(const std::string& path);

// Sum of the loss over a batch (reduction "sum"), for the engine's loss kinds.
torch::Tensor lossSum(ipc::LossKind loss, const torch::Tensor& output, const torch::Tensor& target);

// Parses "cross_entropy" | "nll" | "mse"; throws InvalidArgument naming the choices.
ipc::LossKind parseLoss(const std::string& name);
const char* lossName(ipc::LossKind loss);

class Replica {
 public:
  // Loads the segment's model and binds its parameters to the shared buffer and its
  // gradients to slot `slot`. Throws if the model does not match the segment.
  Replica(const ipc::Segment& segment, uint32_t slot);

  // Zeroes the slot (the gradients stay defined, so autograd accumulates in place).
  void zeroGrad();
  // Forward, loss (sum over the examples) and backward; gradients add into the slot.
  // Returns the loss sum.
  double accumulate(const torch::Tensor& inputs, const torch::Tensor& targets);

  const std::vector<torch::Tensor>& parameters() const { return params_; }
  torch::jit::Module& module() { return module_; }

 private:
  const ipc::Segment& segment_;
  uint32_t slot_;
  torch::jit::Module module_;
  std::vector<torch::Tensor> params_;
  ipc::LossKind loss_;
};

}  // namespace shmgrad::worker
