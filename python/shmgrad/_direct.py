"""Linear layers whose weight and bias gradients are computed straight into the slot.

In an eager worker each parameter's ``.grad`` is a view of the worker's gradient slot in
shared memory. Backward normally computes a fresh gradient and the write-first hook copies
it into the slot (docs/DESIGN.md, "Write-first"): for GEMM-bound models that copy is 9 to
35 % of a step (tools/shm_grad_bound.py). Here an ``nn.Linear`` runs through a C++
autograd Function (``direct_linear``, worker/direct_linear.cc) whose backward computes the
weight's gradient with ``mm(out=.grad)`` and the bias's with ``sum(out=.grad)`` when the
step protocol takes it as the parameter's first gradient of the shard, and hands autograd
that very ``.grad``: the accumulator's write-first hook sees its own memory and neither
copies nor adds (it reads it once for non-finite values). Any other case (a later pass of
the shard, a zeroed slot, a weight used twice, whose contributions autograd sums first)
gets a fresh gradient, as before.

Only exact ``nn.Linear`` modules (with or without a bias) of float32 engine parameters, on
2-D float32 inputs, outside autocast, on the host, without torch.compile; anything else
runs ``F.linear``.
"""

import torch
import torch.nn.functional as F


def install(model, params, participant):
    """Runs model's exact nn.Linear modules whose parameters are engine parameters
    through participant.direct_linear. Returns how many."""
    index = {id(p): i for i, p in enumerate(params)}
    count = 0
    for module in model.modules():
        if type(module) is not torch.nn.Linear or id(module.weight) not in index:
            continue
        if module.bias is not None and id(module.bias) not in index:
            continue
        if module.weight.dtype != torch.float32:
            continue
        w_index = index[id(module.weight)]
        b_index = -1 if module.bias is None else index[id(module.bias)]
        direct = participant.direct_linear

        def forward(x, m=module, w=w_index, b=b_index, direct=direct):
            if x.dim() != 2 or x.dtype != torch.float32 or torch.is_autocast_enabled("cpu"):
                return F.linear(x, m.weight, m.bias)
            return direct(x, m.weight, m.bias, w, b)

        module.forward = forward
        count += 1
    return count
