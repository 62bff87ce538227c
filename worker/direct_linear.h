// nn.Linear layers whose weight and bias gradients backward computes straight into their
// .grad (the worker's slot, or the reduced buffer for a shard alone) where the step
// protocol takes them as the parameter's first write of the shard, instead of a fresh
// gradient that WriteFirstHook then copies there (docs/DESIGN.md, "Write-first"). Eager
// workers call directLinear from python/shmgrad/_direct.py; TorchScript replicas run their
// graphs' aten::linear as shmgrad::linear (rewriteLinears), which calls it within a
// DirectLinearScope.
#pragma once

#include <torch/script.h>

#include <cstdint>
#include <optional>
#include <unordered_map>

#include "worker/step_protocol.h"

namespace shmgrad::worker {

// F.linear(x, weight, bias) (bias absent: none); weight is engine parameter w_index and
// bias b_index. Computes their gradients into their .grad where participant->
// claimDirectWrite allows it, else fresh ones, as F.linear's.
torch::Tensor directLinear(StepParticipant* participant, const torch::Tensor& x,
                           const torch::Tensor& weight, const std::optional<torch::Tensor>& bias,
                           int64_t w_index, int64_t b_index);

// The engine parameters' indices by their tensors (TensorImpl), for shmgrad::linear.
using ParamIndex = std::unordered_map<const void*, int64_t>;

// While one is alive on a thread, shmgrad::linear on that thread computes through
// directLinear for `participant` where the weight (and bias) are in `index`: a
// TorchScript replica's forward within a shard's pass. Elsewhere it is aten::linear.
class DirectLinearScope {
 public:
  DirectLinearScope(StepParticipant* participant, const ParamIndex* index);
  ~DirectLinearScope();
  DirectLinearScope(const DirectLinearScope&) = delete;
  DirectLinearScope& operator=(const DirectLinearScope&) = delete;

 private:
  const DirectLinearScope* outer_;

 public:
  StepParticipant* const participant;
  const ParamIndex* const index;
};

// Rewrites every aten::linear of module's methods (and its submodules' methods) into
// shmgrad::linear; returns how many. A module just loaded, before its first forward.
int rewriteLinears(torch::jit::Module& module);

}  // namespace shmgrad::worker
