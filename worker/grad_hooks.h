// Backward's gradients into the slot, and as they complete: on each parameter's gradient
// accumulator (as DDP's reducer hooks them), a pre hook writes the shard's first gradient
// into .grad instead of adding it to a zeroed slot (StepParticipant::gradFirstWrite), and
// a post hook tells the step protocol that the parameter's .grad is final for the shard
// (StepParticipant::gradReady), so that a bucket of the reduction can start while
// backward still runs (docs/DESIGN.md, "Buckets"). Shared by the TorchScript worker
// (worker_loop.cc) and eager workers (python/worker_binding.cc); header-only, as both
// of those already compile torch's headers (a file of its own cost CI a minute of builds).
#pragma once

#include <ATen/Parallel.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/torch.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "ipc/reduce.h"
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

namespace grad_hooks_detail {

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

// Runs before the accumulator adds backward's gradient into .grad: on the parameter's
// first gradient of a write-first shard (StepParticipant::gradFirstWrite) it writes the
// gradient into .grad and hands the accumulator nothing, which then adds nothing (an
// undefined gradient is skipped). So the slot needs no zeroing before backward and is
// not read back while adding to zeros: one pass over it instead of three. That pass also
// looks for non-finite values, so that a shard alone need not read the result again. A
// gradient it cannot write as it is (sparse, another shape or type), or a parameter with
// its own post-accumulate hooks (they run only when the accumulator adds), gets zeros and the
// gradient added, as in a zeroed slot.
class WriteFirstHook : public torch::autograd::FunctionPreHook {
 public:
  // Gradients up to this many floats (1 MiB) are copied on backward's thread alone: an
  // OpenMP region's start and join cost about what the second thread saves on them (MLP
  // 784-256-10 at batch 32, one worker of 2 threads, paired with one process of 2
  // threads: 0.90x -> 0.93x through TorchScript, 0.70x -> 0.77x through eager workers,
  // a gain not confirmed when rerun with the heap settings alike; docs/BENCHMARKS.md).
  static constexpr int64_t kSerialCopyFloats = int64_t{1} << 18;
  WriteFirstHook(StepParticipant& participant, uint32_t param, torch::Tensor variable)
      : participant_(participant), param_(param), variable_(std::move(variable)) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& grads) override {
    if (grads.size() != 1 || !grads[0].defined()) return grads;
    torch::Tensor grad = variable_.grad();
    if (grad.defined() && aliases(grads[0], grad)) {
      // Computed into .grad by the layer itself (claimDirectWrite): the first
      // write is done, nothing is copied or added. Where a shard alone needs to know, what
      // it wrote is finite by the layer's word (its inputs' bound), or read once for
      // non-finite values now, while it is still in the caches.
      if (!participant_.gradFirstWrite(param_) || !participant_.checksWrites()) {
        return {torch::Tensor()};
      }
      if (participant_.vouchedFinite(param_)) {
        participant_.gradWrittenFinite(param_);
      } else if (grad.is_contiguous() && grad.scalar_type() == torch::kFloat) {
        const float* data = grad.const_data_ptr<float>();
        std::atomic<bool> bad{false};
        at::parallel_for(0, grad.numel(), kSerialCopyFloats, [&](int64_t b, int64_t e) {
          if (ipc::anyNonFinite(data, b, e)) bad.store(true, std::memory_order_relaxed);
        });
        if (!bad.load(std::memory_order_relaxed)) participant_.gradWrittenFinite(param_);
      }
      return {torch::Tensor()};
    }
    if (!participant_.gradFirstWrite(param_)) return grads;
    const torch::Tensor& fresh = grads[0];
    if (!grad.defined()) return grads;  // not bound: the accumulator sets it
    torch::NoGradGuard no_grad;
    if (fresh.is_sparse() || fresh.layout() != grad.layout() || fresh.sizes() != grad.sizes() ||
        fresh.scalar_type() != grad.scalar_type() || fresh.device() != grad.device() ||
        torch::autograd::impl::post_acc_grad_hooks(variable_) != nullptr) {
      grad.zero_();
      return grads;
    }
    if (fresh.is_contiguous() && grad.is_contiguous() && grad.scalar_type() == torch::kFloat) {
      // Copied and checked for non-finite values in one pass, on the intra-op threads
      // when it is large.
      const float* src = fresh.const_data_ptr<float>();
      float* dst = grad.mutable_data_ptr<float>();
      std::atomic<bool> bad{false};
      at::parallel_for(0, fresh.numel(), kSerialCopyFloats, [&](int64_t b, int64_t e) {
        if (ipc::copyAnyNonFinite(dst, src, b, e)) bad.store(true, std::memory_order_relaxed);
      });
      // Written through its pointer: moved by hand, as copy_ moves it, the version
      // counter tells the worker that backward reached this parameter.
      torch::autograd::impl::bump_version(grad);
      if (!bad.load(std::memory_order_relaxed)) participant_.gradWrittenFinite(param_);
    } else {
      grad.copy_(fresh);
    }
    return {torch::Tensor()};
  }

 private:
  static bool aliases(const torch::Tensor& a, const torch::Tensor& b) {
    return !a.is_sparse() && a.data_ptr() == b.data_ptr() && a.sizes() == b.sizes() &&
           a.strides() == b.strides() && a.scalar_type() == b.scalar_type() &&
           a.device() == b.device();
  }

  StepParticipant& participant_;
  const uint32_t param_;
  torch::Tensor variable_;  // the parameter (its accumulator holds it too)
};

}  // namespace grad_hooks_detail

inline void GradReadyHooks::watch(StepParticipant& participant,
                                  const std::vector<torch::Tensor>& params) {
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
    const uintptr_t key =
        acc->add_post_hook(std::make_unique<grad_hooks_detail::ReadyHook>(participant, param));
    acc->add_pre_hook(std::make_unique<grad_hooks_detail::WriteFirstHook>(participant, param, p));
    const torch::autograd::FunctionPreHook* pre = acc->pre_hooks().back().get();
    hooks_.push_back({std::move(acc), key, pre});
    participant.watchGrad(param, GradWatch::kHooked);
  }
}

inline void GradReadyHooks::clear() {
  for (Hooked& h : hooks_) {
    h.acc->del_post_hook(h.post_key);
    auto& pre = h.acc->pre_hooks();
    pre.erase(std::remove_if(pre.begin(), pre.end(),
                             [&](const auto& hook) { return hook.get() == h.pre_hook; }),
              pre.end());
  }
  hooks_.clear();
}

}  // namespace shmgrad::worker
