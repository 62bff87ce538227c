"""What it costs a training step that its gradient must end up in shared memory, measured
in one process with no engine: the bound on how close a worker can come to one process of
N threads. Four variants of the same step (forward and backward of a bench model, sum of
cross-entropy, N intra-op threads), taking turns in blocks:

  plain     the loop people write: .grad set to None, then backward (the accumulator
            keeps the gradient autograd allocated; nothing is copied);
  copied    the same, each gradient copied into a /dev/shm buffer as soon as backward
            has it (a post-accumulate hook, which then drops it): what a worker's
            write-first hook does (docs/DESIGN.md, "Write-first"), the least any process
            that hands its gradient to another must do;
  private   the same copy into a private buffer (torch.empty): if it costs what copied
            costs, the price is the copy itself, not shared memory's pages;
  zeroed    .grad preallocated in that buffer: zeroed, then backward adds into it (what
            a worker did before write-first);
  direct    every nn.Linear's weight and bias gradients computed straight into the
            /dev/shm buffer (a custom autograd Function: mm and sum with out=), nothing
            copied: what a worker could do for Linear layers (models of other layers:
            the same as plain for those). Its gradient is checked against plain's, bit
            for bit, before timing;
  slept     plain, after a sleep of one timer slack (time.sleep(0): about 50-60 us on
            Linux, the thread's CPU idles) before each step, outside the timing: what a
            step costs a process that slept waiting for it, as an engine's worker (or its
            trainer) must when there is no core to spin on. On this project's VM guests
            a CPU that idled hands the step back with cold caches.

Prints each one's median and its ratio to plain. docs/BENCHMARKS.md cites its runs.

    .venv/bin/python tools/shm_grad_bound.py --model mlp2 --batch 32
"""

import argparse
import mmap
import os
import statistics
import time

import torch
import torch.nn.functional as F

from shmgrad_tools.bench import models


def shared_floats(n: int) -> torch.Tensor:
    """n float32 in a fresh /dev/shm file (unlinked at once; the mapping keeps it)."""
    path = f"/dev/shm/shm-grad-bound-{os.getpid()}"
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.unlink(path)
        os.ftruncate(fd, n * 4)
        buf = mmap.mmap(fd, n * 4)
    finally:
        os.close(fd)
    return torch.frombuffer(buf, dtype=torch.float32)


class DirectLinear(torch.autograd.Function):
    """F.linear whose weight and bias gradients are written into given buffers (out=)
    instead of returned: autograd's accumulator never sees them."""

    @staticmethod
    def forward(ctx, x, weight, bias, grad_weight, grad_bias):
        ctx.save_for_backward(x, weight)
        ctx.grads = (grad_weight, grad_bias)
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        grad_weight, grad_bias = ctx.grads
        torch.mm(grad_out.t(), x, out=grad_weight)
        torch.sum(grad_out, 0, out=grad_bias)
        grad_x = grad_out.mm(weight) if ctx.needs_input_grad[0] else None
        return grad_x, None, None, None, None


def make_direct(model, views_of):
    """Runs every nn.Linear (with a bias) of model through DirectLinear into its views;
    returns how many."""
    count = 0
    for module in model.modules():
        if isinstance(module, torch.nn.Linear) and module.bias is not None:
            gw, gb = views_of(module.weight), views_of(module.bias)

            def forward(x, m=module, gw=gw, gb=gb):
                return DirectLinear.apply(x, m.weight, m.bias, gw, gb)

            module.forward = forward
            count += 1
    return count


def variant(name, model_name, x, y):
    model = models.make_model(model_name)
    params = list(model.parameters())
    n = sum(p.numel() for p in params)
    shared = torch.empty(n) if name == "private" else shared_floats(n)
    views, off = [], 0
    for p in params:
        views.append(shared[off : off + p.numel()].view_as(p))
        off += p.numel()
    if name == "zeroed":
        for p, v in zip(params, views):
            p.grad = v
    if name == "direct":
        index = {id(p): i for i, p in enumerate(params)}
        if make_direct(model, lambda p: views[index[id(p)]]) == 0:
            raise SystemExit(f"direct: {model_name} has no nn.Linear with a bias to run")
        check_direct(model_name, model, views, x, y)
    if name in ("copied", "private"):

        def hook(v):
            def copy_out(p):
                with torch.no_grad():
                    v.copy_(p.grad)
                p.grad = None

            return copy_out

        for p, v in zip(params, views):
            p.register_post_accumulate_grad_hook(hook(v))

    def step():
        if name == "slept":
            time.sleep(0)
        t0 = time.perf_counter()
        if name == "zeroed":
            for p in params:
                p.grad.zero_()
        else:
            for p in params:
                p.grad = None
        F.cross_entropy(model(x), y, reduction="sum").backward()
        return time.perf_counter() - t0

    return step


def check_direct(model_name, model, views, x, y):
    """direct's gradient (in the views for the Linear layers it runs, in .grad for the
    rest) equals the plain loop's on a fresh model of the same weights, bit for bit."""
    plain = models.make_model(model_name)
    F.cross_entropy(plain(x), y, reduction="sum").backward()
    params = list(model.parameters())
    for p in params:
        p.grad = None
    F.cross_entropy(model(x), y, reduction="sum").backward()
    for p, v, w in zip(params, views, plain.parameters()):
        got = p.grad if p.grad is not None else v
        assert torch.equal(got, w.grad), "direct's gradient differs from the plain loop's"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="mlp2", choices=models.MODELS)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--steps", type=int, default=5, help="timed steps per block")
    a = ap.parse_args()
    models.set_threads(a.threads)
    torch.manual_seed(0)
    x = torch.randn(a.batch, *models.MODELS[a.model].input_shape)
    y = torch.randint(0, 10, (a.batch,))
    names = ("plain", "copied", "private", "zeroed", "direct", "slept")
    steps = {n: variant(n, a.model, x, y) for n in names}
    medians = {n: [] for n in names}
    for r in range(a.rounds):
        for n in names if r % 2 == 0 else reversed(names):
            for _ in range(3):  # untimed: the other variant's data leaves the caches
                steps[n]()
            medians[n].append(statistics.median(steps[n]() for _ in range(a.steps)))
    plain = statistics.median(medians["plain"])
    print(f"{a.model} batch {a.batch}, {a.threads} threads, {a.rounds} rounds of {a.steps} steps")
    for n in names:
        m = statistics.median(medians[n])
        print(f"  {n:7s} {m * 1e3:8.3f} ms  {m / plain:.3f}x plain")


if __name__ == "__main__":
    main()
