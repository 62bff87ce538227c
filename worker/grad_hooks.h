// Backward's gradients into the slot, and as they complete: on each parameter's gradient
// accumulator (as DDP's reducer hooks them), a pre hook writes the shard's first gradient
// into .grad instead of adding it to a zeroed slot (StepParticipant::gradFirstWrite), and
// a post hook tells the step protocol that the parameter's .grad is final for the shard
// (StepParticipant::gradReady), so that a bucket of the reduction can start while
// backward still runs (docs/DESIGN.md, "Buckets"). Shared by the TorchScript worker
// (worker_loop.cc) and eager workers (python/worker_binding.cc).
#pragma once

#include <torch/csrc/autograd/function_hook.h>
#include <torch/torch.h>

#include <cstdint>
#include <utility>
#include <vector>

#include "worker/step_protocol.h"

namespace shmgrad::worker {

class GradReadyHooks {
 public:
  GradReadyHooks() = default;
  GradReadyHooks(const GradReadyHooks&) = delete;
  GradReadyHooks& operator=(const GradReadyHooks&) = delete;
  ~GradReadyHooks() { clear(); }

  // Hooks parameter i of `params` (the engine's parameter i) and tells `participant` how
  // each one's completion is known: hooked, frozen (requires_grad false: backward never
  // writes it), or unknown (no accumulator to hook). Replaces earlier hooks.
  void watch(StepParticipant& participant, const std::vector<torch::Tensor>& params);
  void clear();

 private:
  using Accumulator = decltype(torch::autograd::impl::grad_accumulator(
      std::declval<const torch::autograd::Variable&>()));
  // Each accumulator kept alive (a tensor holds its own only weakly) with its hooks.
  struct Hooked {
    Accumulator acc;
    uintptr_t post_key;
    const torch::autograd::FunctionPreHook* pre_hook;
  };
  std::vector<Hooked> hooks_;
};

}  // namespace shmgrad::worker
