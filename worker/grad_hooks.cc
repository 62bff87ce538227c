#include "worker/grad_hooks.h"

#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <memory>

namespace shmgrad::worker {

namespace {

// Runs after the accumulator has added backward's gradient into .grad (the parameter's
// last contribution of this backward: autograd sums them before it runs the accumulator).
class ReadyHook : public torch::autograd::FunctionPostHook {
 public:
  ReadyHook(StepParticipant& participant, uint32_t param)
      : participant_(participant), param_(param) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list&) override {
    participant_.gradReady(param_);
    return outputs;
  }

 private:
  StepParticipant& participant_;
  const uint32_t param_;
};

}  // namespace

void GradReadyHooks::watch(StepParticipant& participant, const std::vector<torch::Tensor>& params) {
  clear();
  for (size_t i = 0; i < params.size() && i < ipc::kMaxParams; ++i) {
    const torch::Tensor& p = params[i];
    const auto param = static_cast<uint32_t>(i);
    if (!p.requires_grad()) {
      participant.watchGrad(param, GradWatch::kNoGrad);
      continue;
    }
    Accumulator acc = p.is_leaf() ? torch::autograd::impl::grad_accumulator(p) : Accumulator();
    if (!acc) {
      participant.watchGrad(param, GradWatch::kUnknown);
      continue;
    }
    const uintptr_t key = acc->add_post_hook(std::make_unique<ReadyHook>(participant, param));
    hooks_.emplace_back(std::move(acc), key);
    participant.watchGrad(param, GradWatch::kHooked);
  }
}

void GradReadyHooks::clear() {
  for (auto& [acc, key] : hooks_) acc->del_post_hook(key);
  hooks_.clear();
}

}  // namespace shmgrad::worker
