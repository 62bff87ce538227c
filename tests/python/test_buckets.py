"""The bucketed reduction (docs/DESIGN.md, "Buckets"): a bucket of the gradient is reduced
as soon as every worker's backward has completed it, by whichever worker is free, so the
wait for the slowest worker hides that work. Its gradients are the unbucketed reduction's,
bit for bit, and plain PyTorch's; a worker killed while the others wait on its buckets is
retried as any step is."""

import os
import signal
import time

import pytest
import torch
from torch import nn

import shmgrad
from conftest import relative_error
from helpers import GradientCall, wait_until_busy

TINY_BUCKETS = "0.0625"  # KiB: 16 floats, so every parameter of a tiny model starts a bucket


class Net(nn.Module):
    """Parameters in several buckets, BatchNorm statistics, an unused layer and a frozen
    bias (buckets whose parameters backward never writes)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc1 = nn.Linear(12, 32)
        self.bn = nn.BatchNorm1d(32)
        self.fc2 = nn.Linear(32, 32)
        self.fc3 = nn.Linear(32, 4)
        self.unused = nn.Linear(3, 3)
        self.fc2.bias.requires_grad_(False)

    def forward(self, x):
        return self.fc3(torch.relu(self.fc2(torch.relu(self.bn(self.fc1(x))))))


class SlowBackward(torch.autograd.Function):
    """The identity, whose backward sleeps when the rows hold the marker: the worker with
    that shard completes its later layers' buckets, then holds its first layer's back."""

    @staticmethod
    def forward(ctx, h, x):
        ctx.slow = bool((x[:, 0] > 50).any())
        return h.clone()

    @staticmethod
    def backward(ctx, g):
        if ctx.slow and os.path.exists(os.environ.get("BUCKET_TEST_SLOW_FILE", "/nonexistent")):
            time.sleep(float(os.environ.get("BUCKET_TEST_SLOW_S", "0.3")))
        return g, None


class SlowNet(Net):
    def forward(self, x):
        return self.fc3(torch.relu(self.fc2(torch.relu(SlowBackward.apply(self.fc1(x), x)))))


def token_forward(model, batch):
    """A mean over a count that is not the examples (tokens): the reducers rescale."""
    x, y = batch
    per = nn.functional.cross_entropy(model(x), y, reduction="none")
    weight = 1.0 + (y % 2).float()  # odd classes count twice
    return (per * weight).sum(), weight.sum()


def batch(n=37, marker=None):
    torch.manual_seed(1)
    x, y = torch.randn(n, 12), torch.randint(0, 4, (n,))
    if marker is not None:
        x[marker, 0] = 100.0
    return x, y


def engine_grads(monkeypatch, kb, mode, model, calls, workers=3, **options):
    """Each call's reduced gradients (and stats) from an engine whose buckets are kb KiB."""
    monkeypatch.setenv("SHMGRAD_BUCKET_KB", kb)
    kw = {"mode": "script", "loss": "cross_entropy"} if mode == "script" else {"mode": "eager"}
    kw.update(options)
    out = []
    with shmgrad.Engine(model=model, workers=workers, **kw) as engine:
        engine.bind(model)
        for call in calls:
            model.zero_grad(set_to_none=True)
            stats = engine.gradient(**call)
            out.append(
                ([None if p.grad is None else p.grad.clone() for p in model.parameters()], stats)
            )
    return out


def same_bits(a, b):
    return all(
        (u is None and v is None) or (u is not None and v is not None and torch.equal(u, v))
        for u, v in zip(a, b)
    )


@pytest.mark.parametrize("mode", ["script", "eager"])
def test_bucketed_gradients_are_the_unbucketed_ones_bit_for_bit(monkeypatch, mode):
    x, y = batch()
    model = Net()
    if mode == "eager":
        kw = {"loss": nn.CrossEntropyLoss(reduction="sum"), "loss_reduction": "sum"}
    else:
        kw = {}
    calls = [
        {"inputs": x, "targets": y, "reduction": "mean"},
        {"inputs": x, "targets": y, "reduction": "sum", "max_examples_per_pass": 5},  # passes
        {"inputs": x[:7], "targets": y[:7], "reduction": "mean"},
    ]
    plain = engine_grads(monkeypatch, "0", mode, Net(), calls, **kw)
    bucketed = engine_grads(monkeypatch, TINY_BUCKETS, mode, model, calls, **kw)
    for (g0, _), (g1, _) in zip(plain, bucketed):
        assert same_bits(g0, g1)
    # And plain PyTorch's (train mode: BatchNorm's statistics are per shard, as DDP's).
    # The frozen bias and the unused layer: no participant's backward reached them.
    assert [i for i, g in enumerate(bucketed[0][0]) if g is None] == [5, 8, 9]
    ref = Net()
    ref.train()
    shards = [range(0, 12), range(12, 24), range(24, 37)]
    for s in shards:
        (nn.functional.cross_entropy(ref(x[list(s)]), y[list(s)], reduction="sum") / 37).backward()
    got = [g for g in bucketed[0][0] if g is not None]
    want = [p.grad for p in ref.parameters() if p.grad is not None]
    assert relative_error(got, want) < 1e-5


def test_buckets_complete_early_are_reduced_while_the_slowest_computes(monkeypatch, tmp_path):
    """The worker with the marked shard sleeps in its first layer's backward, after its other
    layers' buckets are complete: the other worker reduces them meanwhile (reduce_early),
    and the step's gradient is the unbucketed one, bit for bit, with a mean over tokens
    whose scale is known only at the end (pieces rescaled afterwards)."""
    slow = tmp_path / "slow"
    slow.touch()
    monkeypatch.setenv("BUCKET_TEST_SLOW_FILE", str(slow))
    x, y = batch(16, marker=15)  # the second worker's shard
    calls = [{"inputs": x, "targets": y, "reduction": "mean"}] * 2
    kw = {"forward": token_forward}  # (loss_sum, count): a mean over its counts
    plain = engine_grads(monkeypatch, "0", "eager", SlowNet(), calls, workers=2, **kw)
    bucketed = engine_grads(monkeypatch, TINY_BUCKETS, "eager", SlowNet(), calls, workers=2, **kw)
    for (g0, _), (g1, stats) in zip(plain, bucketed):
        assert same_bits(g0, g1)
        fast = stats.reduce_early_seconds[0]
        assert fast > 0, stats.as_dict()  # done while the other slept
        assert stats.reduce_early_seconds[1] == 0  # the slowest finishes last
    for _, stats in plain:
        assert stats.reduce_early_seconds == [0.0, 0.0]


def test_a_worker_killed_while_the_others_wait_on_its_buckets_is_retried(monkeypatch, tmp_path):
    """Killed in its backward's sleep, with the other worker through its own backward and
    waiting on the killed one's buckets: the step is aborted and retried, exactly."""
    slow = tmp_path / "slow"
    slow.touch()
    monkeypatch.setenv("BUCKET_TEST_SLOW_FILE", str(slow))
    monkeypatch.setenv("BUCKET_TEST_SLOW_S", "30")
    monkeypatch.setenv("SHMGRAD_BUCKET_KB", TINY_BUCKETS)
    x, y = batch(16, marker=15)
    model = SlowNet()
    ref = SlowNet()
    with shmgrad.Engine(
        model=model, workers=2, loss=nn.CrossEntropyLoss(reduction="sum"), loss_reduction="sum"
    ) as engine:
        engine.bind(model)
        engine.gradient(inputs=x[:4], targets=y[:4])  # warm: both workers up
        before = shmgrad.read_status(engine.name)
        victim = before.worker(1).pid
        model.zero_grad(set_to_none=True)
        call = GradientCall(engine, inputs=x, targets=y)
        wait_until_busy(engine.name, after_epoch=before.step_epoch, slot=1)
        time.sleep(1.0)  # the other worker's shard takes milliseconds: it waits on buckets
        st = shmgrad.read_status(engine.name)
        assert st.worker(0).busy_epoch == st.worker(1).busy_epoch == st.step_epoch, st.text
        slow.unlink()  # the retry does not sleep
        os.kill(victim, signal.SIGKILL)
        stats = call.result()
        assert shmgrad.read_status(engine.name).worker(1).pid != victim
    assert stats.retries >= 1
    nn.functional.cross_entropy(ref(x), y, reduction="sum").backward()
    got = [p.grad for p in model.parameters() if p.grad is not None]
    want = [p.grad for p in ref.parameters() if p.grad is not None]
    assert relative_error(got, want) < 1e-5
