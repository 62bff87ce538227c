#include "worker/direct_linear.h"

#include <ATen/autocast_mode.h>
#include <torch/csrc/jit/api/function_impl.h>
#include <torch/csrc/jit/ir/ir.h>
#include <torch/torch.h>

#include <algorithm>
#include <unordered_set>
#include <utility>
#include <vector>

#include "ipc/reduce.h"

namespace shmgrad::worker {

// nn.Linear whose weight and bias gradients backward computes straight into their .grad
// when the step protocol takes them as the parameter's first write of the shard
// (python/shmgrad/_direct.py says when eager workers use it; TorchScript replicas, see
// rewriteLinears), handing autograd that .grad itself:
// WriteFirstHook sees its own memory and neither copies nor adds. Otherwise a fresh
// gradient, for the accumulator. In C++ so that backward calls no Python. A layer without
// a bias runs DirectLinearNoBias (an undefined tensor cannot be a Function's input).
namespace {
namespace direct {

// What a Function saved of its layer: the participant and the engine's parameter indices.
void save(torch::autograd::AutogradContext* ctx, const torch::Tensor& x,
          const torch::Tensor& weight, StepParticipant* participant, int64_t w_index) {
  ctx->save_for_backward({x});
  ctx->saved_data["weight"] = weight;
  ctx->saved_data["participant"] = reinterpret_cast<int64_t>(participant);
  ctx->saved_data["w_index"] = w_index;
}

StepParticipant* participantOf(torch::autograd::AutogradContext* ctx) {
  return reinterpret_cast<StepParticipant*>(ctx->saved_data["participant"].toInt());
}

// param's .grad, when backward may compute the gradient into it (the protocol's first
// write of the shard, float32, the parameter's shape); else undefined: a fresh gradient.
torch::Tensor target(StepParticipant* participant, const torch::Tensor& param, int64_t index,
                     const torch::Tensor& go, const torch::Tensor& x) {
  torch::Tensor grad = param.grad();
  if (grad.defined() && grad.scalar_type() == torch::kFloat && go.scalar_type() == torch::kFloat &&
      x.scalar_type() == torch::kFloat && grad.is_contiguous() && grad.sizes() == param.sizes() &&
      participant->claimDirectWrite(static_cast<uint32_t>(index))) {
    return grad;
  }
  return torch::Tensor();
}

// The largest magnitude in t as ipc::maxMagnitudeBits gives it, computed once (bits 0:
// not yet); a tensor that is not contiguous counts as holding an infinity.
uint32_t magnitude(const torch::Tensor& t, uint32_t* cached) {
  if (*cached == 0) {
    *cached = t.is_contiguous()
                  ? std::max<uint32_t>(1, ipc::maxMagnitudeBits(t.const_data_ptr<float>(),
                                                                static_cast<uint64_t>(t.numel())))
                  : 0x7f800000u;
  }
  return *cached;
}

// After parameter `index`'s gradient (`grad_numel` floats) was computed into its .grad as
// go.T @ b (b null: go's sum over the batch, b = 1): where a shard alone will read it for
// non-finite values, the bound on go and b vouches for it instead when it can
// (ipc::productFinite) and when that reads fewer floats: go's B x out (once for the
// weight and the bias: go_bits caches it) and b's B x in, against the gradient's in x out.
// A large batch through a small layer reads the gradient (MLP 784-256-10 at batch 512:
// 532 K floats to vouch for the first layer's 200 K).
void vouchIfBounded(StepParticipant* participant, int64_t index, const torch::Tensor& go,
                    uint32_t* go_bits, const torch::Tensor* b, int64_t grad_numel) {
  if (!participant->checksWrites()) return;
  const int64_t reads = (*go_bits == 0 ? go.numel() : 0) + (b == nullptr ? 0 : b->numel());
  if (reads >= grad_numel) return;        // the write-first hook reads the gradient instead
  constexpr uint32_t kOne = 0x3f800000u;  // 1.0f's bits
  uint32_t b_bits = 0;
  if (ipc::productFinite(static_cast<uint64_t>(go.size(0)), magnitude(go, go_bits),
                         b == nullptr ? kOne : magnitude(*b, &b_bits))) {
    participant->vouchFinite(static_cast<uint32_t>(index));
  }
}

// The input's and the weight's gradients of x @ weight.T, given the output's (go) and the
// saved input x (unpacked once by the caller's backward); go_bits as vouchIfBounded's.
std::pair<torch::Tensor, torch::Tensor> inputAndWeight(torch::autograd::AutogradContext* ctx,
                                                       const torch::Tensor& go,
                                                       const torch::Tensor& x, uint32_t* go_bits) {
  const torch::Tensor weight = ctx->saved_data["weight"].toTensor();
  torch::Tensor gx, gw;
  if (ctx->needs_input_grad(0)) gx = go.mm(weight);
  if (ctx->needs_input_grad(1)) {
    StepParticipant* participant = participantOf(ctx);
    const int64_t index = ctx->saved_data["w_index"].toInt();
    torch::Tensor out = target(participant, weight, index, go, x);
    gw = out.defined() ? at::mm_out(out, go.t(), x) : go.t().mm(x);
    if (out.defined()) vouchIfBounded(participant, index, go, go_bits, &x, out.numel());
  }
  return {gx, gw};
}

}  // namespace direct

struct DirectLinear : public torch::autograd::Function<DirectLinear> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x,
                               const torch::Tensor& weight, const torch::Tensor& bias,
                               StepParticipant* participant, int64_t w_index, int64_t b_index) {
    direct::save(ctx, x, weight, participant, w_index);
    ctx->saved_data["bias"] = bias;
    ctx->saved_data["b_index"] = b_index;
    return torch::nn::functional::linear(x, weight, bias);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const torch::Tensor& go = grads[0];
    const torch::Tensor x = ctx->get_saved_variables()[0];
    uint32_t go_bits = 0;
    auto [gx, gw] = direct::inputAndWeight(ctx, go, x, &go_bits);
    torch::Tensor gb;
    if (ctx->needs_input_grad(2)) {
      StepParticipant* participant = direct::participantOf(ctx);
      const int64_t index = ctx->saved_data["b_index"].toInt();
      torch::Tensor out =
          direct::target(participant, ctx->saved_data["bias"].toTensor(), index, go, x);
      gb = out.defined() ? at::sum_out(out, go, {0}) : go.sum(0);
      if (out.defined()) {
        direct::vouchIfBounded(participant, index, go, &go_bits, nullptr, out.numel());
      }
    }
    return {gx, gw, gb, torch::Tensor(), torch::Tensor(), torch::Tensor()};
  }
};

struct DirectLinearNoBias : public torch::autograd::Function<DirectLinearNoBias> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x,
                               const torch::Tensor& weight, StepParticipant* participant,
                               int64_t w_index) {
    direct::save(ctx, x, weight, participant, w_index);
    return torch::nn::functional::linear(x, weight);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    uint32_t go_bits = 0;
    auto [gx, gw] = direct::inputAndWeight(ctx, grads[0], ctx->get_saved_variables()[0], &go_bits);
    return {gx, gw, torch::Tensor(), torch::Tensor()};
  }
};

}  // namespace

torch::Tensor directLinear(StepParticipant* participant, const torch::Tensor& x,
                           const torch::Tensor& weight, const std::optional<torch::Tensor>& bias,
                           int64_t w_index, int64_t b_index) {
  if (!bias.has_value() || !bias->defined()) {
    return DirectLinearNoBias::apply(x, weight, participant, w_index);
  }
  return DirectLinear::apply(x, weight, *bias, participant, w_index, b_index);
}

namespace {

thread_local const DirectLinearScope* current_scope = nullptr;

// shmgrad::linear: directLinear within a scope, on the layers whose parameters are the
// engine's (the conditions _direct.py puts on eager layers), else aten::linear.
torch::Tensor scriptLinear(const torch::Tensor& x, const torch::Tensor& weight,
                           const std::optional<torch::Tensor>& bias) {
  const DirectLinearScope* scope = current_scope;
  if (scope != nullptr && x.dim() == 2 && x.scalar_type() == torch::kFloat &&
      weight.scalar_type() == torch::kFloat && x.device().is_cpu() &&
      !at::autocast::is_autocast_enabled(at::kCPU)) {
    const auto w = scope->index->find(weight.unsafeGetTensorImpl());
    const bool has_bias = bias.has_value() && bias->defined();
    const auto b = has_bias ? scope->index->find(bias->unsafeGetTensorImpl()) : scope->index->end();
    if (w != scope->index->end() && (!has_bias || b != scope->index->end())) {
      return directLinear(scope->participant, x, weight, bias, w->second,
                          has_bias ? b->second : -1);
    }
  }
  return at::linear(x, weight, bias);
}

}  // namespace

DirectLinearScope::DirectLinearScope(StepParticipant* p, const ParamIndex* i)
    : outer_(current_scope), participant(p), index(i) {
  current_scope = this;
}

DirectLinearScope::~DirectLinearScope() { current_scope = outer_; }

namespace {

int rewriteBlock(torch::jit::Block* block, torch::jit::Graph& graph) {
  static const auto kLinear = c10::Symbol::fromQualString("aten::linear");
  static const auto kDirect = c10::Symbol::fromQualString("shmgrad::linear");
  int count = 0;
  std::vector<torch::jit::Node*> linears;
  for (torch::jit::Node* node : block->nodes()) {
    for (torch::jit::Block* inner : node->blocks()) count += rewriteBlock(inner, graph);
    if (node->kind() == kLinear && node->inputs().size() == 3 && node->outputs().size() == 1) {
      linears.push_back(node);
    }
  }
  for (torch::jit::Node* node : linears) {
    torch::jit::WithInsertPoint guard(node);
    // Its output is a Tensor, a new Value's type (Value::setType is not called: under
    // UBSan its check of c10::DynamicType needs type information libtorch does not export).
    torch::jit::Node* direct = graph.insertNode(graph.create(kDirect, node->inputs(), 1));
    node->output()->replaceAllUsesWith(direct->output());
    node->destroy();
    ++count;
  }
  return count;
}

}  // namespace

int rewriteLinears(torch::jit::Module& module) {
  std::unordered_set<const c10::ClassType*> seen;  // a class's methods are shared by its modules
  int count = 0;
  auto rewrite = [&](const torch::jit::Module& m) {
    if (!seen.insert(m.type().get()).second) return;
    for (const torch::jit::Method& method : m.get_methods()) {
      std::shared_ptr<torch::jit::Graph> graph =
          torch::jit::toGraphFunction(method.function()).graph();
      count += rewriteBlock(graph->block(), *graph);
    }
  };
  for (const torch::jit::Module& m : module.modules()) rewrite(m);  // module itself first
  return count;
}

TORCH_LIBRARY_FRAGMENT(shmgrad, m) {
  m.def("linear(Tensor input, Tensor weight, Tensor? bias=None) -> Tensor", &scriptLinear);
}

}  // namespace shmgrad::worker
