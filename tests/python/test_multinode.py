"""Engines on several nodes: two ranks on this machine stand for two nodes (gloo on
127.0.0.1, torch.multiprocessing spawn), each with its own engine and workers, against a
single-process PyTorch reference. Every test is bounded in time and checks that no engine
segment (/dev/shm/shmgrad-*) or process is left behind."""

import copy
import datetime
import glob
import itertools
import json
import logging
import os
import re
import signal
import subprocess
import sys
import time
import warnings

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import shmgrad
from conftest import (
    Branchy,
    Cnn,
    Mlp,
    ci_runs,
    reference_gradient,
    relative_error,
    shard_gradients,
)
from helpers import free_port
from shmgrad.multinode import shard

NODES = 2
PG_TIMEOUT_S = 10  # the process group's timeout in these tests
RANKS_TIMEOUT_S = 180  # one test's ranks, start-up included
CLEANUP_TIMEOUT_S = 30  # a dead rank's engine: serve stops on its parent's death
FAULT_MARGIN_S = 10  # beyond the group's timeout, for the survivor to report
KILL_AFTER_STEPS = 5  # the victim is killed once it has done this many steps
_tags = itertools.count()


# -- running ranks -----------------------------------------------------------------------
def _rank_entry(rank, scenario, port, out_dir, timeout_s, kwargs):
    """One spawned rank: a gloo group on 127.0.0.1, the scenario, its result saved."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=NODES,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    try:
        result = SCENARIOS[scenario](rank, **kwargs)
    finally:
        dist.destroy_process_group()
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))


class Ranks:
    """NODES spawned ranks running ``scenario``; every wait is bounded, and on exit every
    rank still alive is killed."""

    def __init__(self, scenario, tmp_path, *, timeout_s=PG_TIMEOUT_S, **kwargs):
        self.out = str(tmp_path)
        self.deadline = time.monotonic() + RANKS_TIMEOUT_S
        self.ctx = mp.start_processes(
            _rank_entry,
            nprocs=NODES,
            join=False,
            start_method="spawn",
            args=(scenario, free_port(), self.out, timeout_s, kwargs),
        )
        self.procs = self.ctx.processes

    def result(self, rank):
        path = os.path.join(self.out, f"rank{rank}.pt")
        p = self.procs[rank]
        p.join(max(0.0, self.deadline - time.monotonic()))
        assert not p.is_alive(), f"rank {rank} did not finish within {RANKS_TIMEOUT_S} s"
        assert p.exitcode == 0 and os.path.exists(path), f"rank {rank} failed (exit {p.exitcode})"
        return torch.load(path)

    def results(self):
        return [self.result(r) for r in range(NODES)]

    def close(self):
        for p in self.procs:
            if p.is_alive():
                p.kill()
            p.join(10)
        assert not any(p.is_alive() for p in self.procs)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _leftovers(prefix):
    """Engine segments and processes whose engine name starts with ``prefix``."""
    found = glob.glob(f"/dev/shm/shmgrad-{os.getuid()}-{prefix}-*")
    for cmdline in glob.glob("/proc/[0-9]*/cmdline"):
        try:
            with open(cmdline, "rb") as f:
                args = f.read().split(b"\0")
        except OSError:
            continue
        if any(a.startswith(f"{prefix}-".encode()) for a in args):
            found.append(b" ".join(args).decode(errors="replace"))
    return found


@pytest.fixture
def prefix():
    """The prefix of this test's engine names; afterwards none of them may remain."""
    p = f"mn{os.getpid()}x{next(_tags)}"
    yield p
    deadline = time.monotonic() + CLEANUP_TIMEOUT_S
    while _leftovers(p) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _leftovers(p), f"left behind: {_leftovers(p)}"


def _engine(rank, model, prefix, tag, **kwargs):
    return shmgrad.Engine(
        model=model,
        loss="cross_entropy",
        name=f"{prefix}-{tag}-r{rank}",
        process_group=dist.group.WORLD,
        **kwargs,
    )


def _grads(model):
    return [p.grad.detach().clone() for p in model.parameters()]


# -- 1. the gradient of the global batch -------------------------------------------------
# (share of rank 0, share of rank 1, reduction, explicit inputs): uneven shares, a global
# batch smaller than the number of nodes (one share empty), both reductions.
GRADIENT_CASES = [
    (list(range(0, 7)), list(range(7, 33)), "sum", False),
    (list(range(0, 7)), list(range(7, 33)), "mean", False),
    (list(range(40, 43)), list(range(50, 60)), "mean", True),
    ([5], [], "sum", False),
    ([5], [], "mean", False),
    ([], [9], "mean", True),
    (list(range(0, 60)), list(range(60, 120)), "mean", False),
]


def _gradients(rank, spec, prefix, bucket_cap_mb, rank1_mode):
    torch.manual_seed(100 + rank)  # other weights on every node: bind() takes rank 0's
    model = Cnn()
    x, y = _load_npy(spec)
    out = {"cases": []}
    # Nodes need not be alike: rank 0 runs two TorchScript workers, rank 1 one worker of
    # rank1_mode (eager: Python workers with the same data as a torch Dataset).
    mode = "script" if rank == 0 else rank1_mode
    data = torch.utils.data.TensorDataset(x, y) if mode == "eager" else spec
    with _engine(
        rank,
        model,
        prefix,
        "grad",
        workers=2 - rank,
        dataset=data,
        mode=mode,
        bucket_cap_mb=bucket_cap_mb,
    ) as engine:
        out["mode"] = engine.mode
        engine.bind(model)
        out["bound"] = [p.detach().clone() for p in model.parameters()]
        for case in GRADIENT_CASES:
            mine = case[rank]  # a list: an empty one becomes a float tensor, still accepted
            if case[3]:
                mine = torch.tensor(mine, dtype=torch.int64)
                st = engine.gradient(inputs=x[mine], targets=y[mine], reduction=case[2])
            else:
                st = engine.gradient(mine, reduction=case[2])
            out["cases"].append(
                {
                    "grad": _grads(model),
                    "num_examples": st.num_examples,
                    "local_num_examples": st.local_num_examples,
                    "loss": st.loss,
                    "loss_sum": st.loss_sum,
                    "allreduce_seconds": st.allreduce_seconds,
                    "nodes": st.nodes,
                    "workers": st.workers,
                    "bytes": st.allreduce_bytes,
                }
            )
        try:  # every share empty: refused on every node, and the group still works
            engine.gradient(torch.zeros(0, dtype=torch.int64))
        except shmgrad.InvalidArgumentError as exc:
            out["all_empty"] = str(exc)
        st = engine.gradient(torch.tensor([rank]))
        out["after"] = (st.num_examples, _grads(model))
    return out


def _load_npy(spec):
    xs, ys = spec[len("npy:") :].split(",")
    return torch.from_numpy(np.load(xs)), torch.from_numpy(np.load(ys))


# 0.001 MiB: buckets of 262 floats. Rank 1's workers: TorchScript or eager.
@pytest.mark.parametrize("bucket_cap_mb,rank1_mode", [(None, "script"), (0.001, "eager")])
def test_gradient_of_the_global_batch(npy_dataset, tmp_path, prefix, bucket_cap_mb, rank1_mode):
    spec, x, y = npy_dataset
    with Ranks(
        "gradients",
        tmp_path,
        spec=spec,
        prefix=prefix,
        bucket_cap_mb=bucket_cap_mb,
        rank1_mode=rank1_mode,
    ) as ranks:
        results = ranks.results()
    assert [r["mode"] for r in results] == ["script", rank1_mode]
    torch.manual_seed(100)
    model0 = Cnn()  # rank 0's initial weights, which every node took
    assert any(
        not torch.equal(a, b)
        for a, b in zip(model0.parameters(), (torch.manual_seed(101), Cnn())[1].parameters())
    )
    for r in results:
        assert all(torch.equal(a, b) for a, b in zip(r["bound"], model0.parameters()))
    for i, (share0, share1, reduction, _) in enumerate(GRADIENT_CASES):
        union = torch.tensor(share0 + share1)
        ref = reference_gradient(model0, "cross_entropy", x[union], y[union], reduction)
        ref_loss = torch.nn.functional.cross_entropy(
            model0(x[union]), y[union], reduction=reduction
        ).item()
        for rank, (r, share) in enumerate(zip(results, (share0, share1))):
            c = r["cases"][i]
            err = relative_error(c["grad"], ref)
            assert err < 1e-5, (i, rank, reduction, err)
            assert c["num_examples"] == len(union) and c["local_num_examples"] == len(share)
            assert abs(c["loss"] - ref_loss) < 1e-5 * max(1.0, abs(ref_loss)), (i, rank)
            assert c["nodes"] == NODES and c["allreduce_seconds"] > 0
            # The whole gradient (padding included: under 16 floats a tensor) and the
            # record [count, loss sum, non-finite, failed per rank].
            floats = sum(p.numel() for p in model0.parameters())
            assert floats * 4 < c["bytes"] <= floats * 4 + 4 * 15 * 4 + 8 * (3 + NODES)
            assert c["workers"] == (0 if not share else min(len(share), 2 - rank))
    for r in results:
        assert "every node's share was empty" in r["all_empty"]
        ref = reference_gradient(model0, "cross_entropy", x[:2], y[:2])
        assert r["after"][0] == 2 and relative_error(r["after"][1], ref) < 1e-5


# Micro-batches: (share of rank 0, share of rank 1); one share empty in the second.
MICRO_BATCHES = [
    (list(range(0, 5)), list(range(5, 12))),
    ([12, 13, 14], []),
    (list(range(20, 24)), list(range(24, 33))),
]


def _accumulated(rank, spec, prefix):
    torch.manual_seed(100)
    model = Cnn()
    out = {}
    with _engine(rank, model, prefix, "acc", workers=2, dataset=spec) as engine:
        engine.bind(model)
        for reduction in ("sum", "mean"):
            model.zero_grad()  # the first call starts afresh, as after any zero_grad()
            for shares in MICRO_BATCHES:
                st = engine.gradient(shares[rank], reduction=reduction, accumulate=True)
            out[reduction] = (_grads(model), st.count)
    return out


def test_accumulated_micro_batches_across_nodes(npy_dataset, tmp_path, prefix):
    spec, x, y = npy_dataset
    with Ranks("accumulated", tmp_path, spec=spec, prefix=prefix) as ranks:
        results = ranks.results()
    torch.manual_seed(100)
    model0 = Cnn()
    union = torch.tensor([i for shares in MICRO_BATCHES for s in shares for i in s])
    for reduction in ("sum", "mean"):
        ref = reference_gradient(model0, "cross_entropy", x[union], y[union], reduction)
        for rank, r in enumerate(results):
            grads, count = r[reduction]
            assert relative_error(grads, ref) < 1e-5, (rank, reduction)
            assert count == len(MICRO_BATCHES[-1][0]) + len(MICRO_BATCHES[-1][1])


# -- 2. bit-identical parameters after training ------------------------------------------
SGD_STEPS = 20
SGD_BATCH = 13  # shares of 6 and 7


def _sgd(rank, spec, prefix):
    torch.manual_seed(200 + rank)
    model = Cnn()
    out = {}
    with _engine(rank, model, prefix, "sgd", workers=1, dataset=spec) as engine:
        engine.bind(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        # A loss scale so large that the first steps overflow float32: every node's scaler
        # must skip them and back off alike (a power of two: the steps it keeps are exact).
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**127)
        g = torch.Generator().manual_seed(7)  # the same global batches on every node
        out["scales"] = []
        for _ in range(SGD_STEPS):
            idx = torch.randint(0, 120, (SGD_BATCH,), generator=g)
            opt.zero_grad()
            engine.gradient(shard(idx, rank, NODES), reduction="mean", loss_scale=scaler)
            scaler.step(opt)
            scaler.update()
            out["scales"].append(scaler.get_scale())
        out["params"] = [p.detach().clone() for p in model.parameters()]
        out["checksum"] = engine.check_consistency()
        if rank == 1:  # one node drifts: both must see it
            with torch.no_grad():
                engine.parameter_tensors()[0].view(-1)[0] += 1e-3
        try:
            engine.check_consistency()
        except shmgrad.ConsistencyError as exc:
            out["drift"] = (exc.rank, str(exc))
    return out


def test_parameters_stay_bit_identical(npy_dataset, tmp_path, prefix):
    spec, x, y = npy_dataset
    with Ranks("sgd", tmp_path, spec=spec, prefix=prefix) as ranks:
        r0, r1 = ranks.results()
    for a, b in zip(r0["params"], r1["params"]):
        assert torch.equal(a, b)  # bit-identical
    assert r0["checksum"] == r1["checksum"]
    assert r0["drift"][0] == 1 and r1["drift"][0] == 1 and "rank(s) [1]" in r0["drift"][1]
    # The scalers skipped the same first steps (the scale halves at each) and kept the rest.
    assert r0["scales"] == r1["scales"]
    skipped = next(k for k in range(SGD_STEPS) if r0["scales"][k] == r0["scales"][-1]) + 1
    assert 1 <= skipped <= SGD_STEPS - 10, r0["scales"]
    assert r0["scales"][skipped - 1] == 2.0 ** (127 - skipped)
    # Against plain PyTorch (no scaler) from rank 0's weights on the global batches,
    # skipping the same steps.
    torch.manual_seed(200)
    ref = Cnn()
    initial = copy.deepcopy(ref)
    opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    g = torch.Generator().manual_seed(7)
    for step in range(SGD_STEPS):
        idx = torch.randint(0, 120, (SGD_BATCH,), generator=g)
        if step < skipped:
            continue
        opt.zero_grad()
        torch.nn.functional.cross_entropy(ref(x[idx]), y[idx]).backward()
        opt.step()
    assert relative_error(r0["params"], list(ref.parameters())) < 1e-4
    assert relative_error(r0["params"], list(initial.parameters())) > 1e-3  # it trained


# -- 2a. float16 with a GradScaler: DDP's scales, step for step ------------------------------
FP16_STEPS = 8
FP16_SHARE = 24  # each node's share of a global batch of 48
FP16_BAD_STEP = 5  # a batch with an example that overflows float16


def _fp16(rank, prefix):
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(3)  # the same weights on both nodes (DDP's are checked alike)
    model = Mlp()
    ddp = DDP(copy.deepcopy(model))
    g = torch.Generator().manual_seed(3)
    n = FP16_STEPS * NODES * FP16_SHARE
    x, y = torch.randn(n, 20, generator=g), torch.randint(0, 5, (n,), generator=g)
    x[FP16_BAD_STEP * NODES * FP16_SHARE + 7] = 1e6  # float16's largest is 65504
    batches = [
        torch.arange(NODES * FP16_SHARE * k, NODES * FP16_SHARE * (k + 1))
        for k in range(FP16_STEPS)
    ]

    def forward(m, batch):
        with torch.autocast("cpu", dtype=torch.float16):
            return torch.nn.functional.cross_entropy(m(batch[0]), batch[1])  # a mean

    def train(params, step):
        opt = torch.optim.SGD(params, lr=0.1, momentum=0.9)
        scaler = torch.amp.GradScaler("cpu", growth_interval=2)  # from 2^16
        scales = []
        for idx in batches:
            opt.zero_grad()
            step(shard(idx, rank, NODES), scaler)
            scaler.step(opt)
            scaler.update()
            scales.append(scaler.get_scale())
        return scales

    out = {}
    out["ddp_scales"] = train(
        ddp.parameters(),
        lambda idx, scaler: scaler.scale(forward(ddp, (x[idx], y[idx]))).backward(),
    )
    out["ddp_params"] = [p.detach().clone() for p in ddp.parameters()]
    with shmgrad.Engine(
        model=model,
        workers=2,
        forward=forward,
        dataset=torch.utils.data.TensorDataset(x, y),
        name=f"{prefix}-fp16-r{rank}",
        process_group=dist.group.WORLD,
    ) as engine:
        engine.bind(model)
        nonfinite = []

        def step(idx, scaler):
            nonfinite.append(engine.gradient(idx, loss_scale=scaler).nonfinite)

        out["scales"] = train(model.parameters(), step)
        out["nonfinite"] = nonfinite
    out["params"] = [p.detach().clone() for p in model.parameters()]
    return out


@pytest.mark.full  # long
def test_grad_scaler_keeps_ddps_scales(tmp_path, prefix):
    """float16 autocast with the default GradScaler, two nodes of two eager workers, and
    DDP on the same shares in the same processes: each node backpropagates its share's
    mean, as a DDP rank does, so both scalers grow, skip the step whose batch overflows
    float16 and back off at the same steps (summed shards overflowed at the first), and
    the weights stay together."""
    with Ranks("fp16", tmp_path, prefix=prefix) as ranks:
        r0, r1 = ranks.results()
    for r in (r0, r1):
        assert r["scales"] == r["ddp_scales"], (r["scales"], r["ddp_scales"])
        assert r["nonfinite"] == [k == FP16_BAD_STEP for k in range(FP16_STEPS)]
        # float16 products in another order
        assert relative_error(r["params"], r["ddp_params"]) < 1e-3
    assert r0["scales"] == r1["scales"]
    assert r0["scales"][FP16_BAD_STEP - 1] > 2.0**16
    assert r0["scales"][FP16_BAD_STEP] == r0["scales"][FP16_BAD_STEP - 1] / 2


# -- 2b. BatchNorm statistics: DDP's rule across nodes ----------------------------------------
class BnCnn(Cnn):
    def __init__(self):
        super().__init__()
        self.bn = torch.nn.BatchNorm2d(4)

    def forward(self, x):
        x = torch.max_pool2d(torch.relu(self.bn(self.conv(x))), 2)
        return self.fc(torch.flatten(x, 1))


# (share of rank 0, share of rank 1): the buffers come from the first node that computed.
BN_STEPS = [
    (list(range(0, 5)), list(range(5, 17))),
    ([], list(range(20, 23))),
    (list(range(30, 40)), list(range(40, 41))),
]


def _batchnorm(rank, spec, prefix):
    torch.manual_seed(400 + rank)
    model = BnCnn()
    out = {"buffers": []}
    with _engine(rank, model, prefix, "bn", workers=1, dataset=spec) as engine:
        engine.bind(model)
        out["bound"] = {n: b.clone() for n, b in model.named_buffers()}
        for shares in BN_STEPS:
            engine.gradient(shares[rank])
            out["buffers"].append({n: b.clone() for n, b in model.named_buffers()})
        out["checksum"] = engine.check_consistency()
    return out


def test_batchnorm_buffers_follow_ddp(npy_dataset, tmp_path, prefix):
    spec, x, y = npy_dataset
    with Ranks("batchnorm", tmp_path, spec=spec, prefix=prefix) as ranks:
        r0, r1 = ranks.results()
    torch.manual_seed(400)
    ref = BnCnn()  # rank 0's weights and buffers, which every node took
    for n, b in ref.named_buffers():
        assert torch.equal(r0["bound"][n], b) and torch.equal(r1["bound"][n], b)
    for step, shares in enumerate(BN_STEPS):
        first = next(s for s in shares if s)  # the first node that computed
        ref(x[first])  # train mode: updates the running statistics from that shard
        for n, b in ref.named_buffers():
            assert torch.equal(r0["buffers"][step][n], r1["buffers"][step][n]), (step, n)
            assert torch.allclose(r0["buffers"][step][n], b, rtol=1e-5, atol=1e-6), (step, n)
    assert r0["checksum"] == r1["checksum"]


# -- a branch that some nodes take --------------------------------------------------------
def _unused(rank, prefix):
    torch.manual_seed(500)
    model = Branchy()
    g = torch.Generator().manual_seed(9)
    x, y = torch.randn(8, 6, generator=g).clamp(max=1.0), torch.randint(0, 3, (8,), generator=g)
    marked = x.clone()
    marked[6, 0] = 1000.0  # in rank 1's share, its second worker's shard
    out = {}
    mine = shard(torch.arange(8), rank, NODES)
    with _engine(rank, model, prefix, "unused", workers=2, mode="eager") as engine:
        engine.bind(model)
        for case, xs in (("none", x), ("rank 1", marked)):
            st = engine.gradient(inputs=xs[mine], targets=y[mine])
            grads = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
            out[case] = (grads, st.unused_params)
        out["checksum"] = engine.check_consistency()
    return out, x, y, marked


def test_a_parameter_no_node_reaches_keeps_grad_none_on_every_node(tmp_path, prefix):
    """A branch no node takes: its parameters' .grad is None on both nodes (as DDP leaves
    a parameter every rank left unused). Taken on one node only: both nodes have its
    gradient, so their optimizers step alike."""
    with Ranks("unused", tmp_path, prefix=prefix) as ranks:
        (r0, x, y, marked), (r1, _, _, _) = ranks.results()
    torch.manual_seed(500)
    model0 = Branchy()
    shards = [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]  # 2 nodes x 2 workers
    for case, xs in (("none", x), ("rank 1", marked)):
        want = shard_gradients(model0, xs, y, shards)
        for rank, r in enumerate((r0, r1)):
            grads, unused = r[case]
            assert unused == ([4, 5] if case == "none" else []), (case, rank)
            assert [g is None for g in grads] == [g is None for g in want], (case, rank)
            got = [g for g in grads if g is not None]
            assert relative_error(got, [g for g in want if g is not None]) < 1e-5, (case, rank)
    assert r0["checksum"] == r1["checksum"]


# -- 3. a node that dies or hangs ----------------------------------------------------------
def _until_fault(rank, spec, prefix, marker):
    torch.manual_seed(0)
    model = Cnn()
    out = {}
    with _engine(rank, model, prefix, "fault", workers=1, dataset=spec) as engine:
        engine.bind(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        deadline = time.monotonic() + RANKS_TIMEOUT_S
        for step in itertools.count():
            if rank == 1 and step == KILL_AFTER_STEPS:
                open(marker, "w").close()  # the test may now kill or stop this rank
            idx = shard(torch.arange(step % 100, step % 100 + 16), rank, NODES)
            try:
                engine.gradient(idx, reduction="mean")
            except shmgrad.Error as exc:
                out["error"] = (type(exc).__name__, getattr(exc, "rank", None), str(exc))
                out["raised_at"] = time.clock_gettime(time.CLOCK_MONOTONIC)
                out["steps"] = step
                break
            opt.step()
            if time.monotonic() > deadline:
                break
        try:  # the group is broken: the next call raises at once
            t0 = time.monotonic()
            engine.gradient(idx)
        except shmgrad.NodeError:
            out["again_seconds"] = time.monotonic() - t0
    out["closed"] = True  # the engine closed without raising
    return out


@pytest.mark.parametrize("fault", ci_runs(["kill", "stop"], keep=("kill",)))
def test_dead_or_hung_node_raises_within_the_timeout(npy_dataset, tmp_path, prefix, fault):
    spec, _, _ = npy_dataset
    marker = str(tmp_path / "victim-ready")
    with Ranks("until_fault", tmp_path, spec=spec, prefix=prefix, marker=marker) as ranks:
        victim = ranks.procs[1]
        deadline = time.monotonic() + RANKS_TIMEOUT_S
        while not os.path.exists(marker):
            assert time.monotonic() < deadline and victim.is_alive(), "rank 1 never trained"
            time.sleep(0.01)
        time.sleep(0.05)  # into the next steps
        hit = time.clock_gettime(time.CLOCK_MONOTONIC)
        os.kill(victim.pid, signal.SIGKILL if fault == "kill" else signal.SIGSTOP)
        survivor = ranks.result(0)
        if fault == "stop":
            assert victim.is_alive()  # stopped, not dead: the group's timeout caught it
            os.kill(victim.pid, signal.SIGKILL)
        victim.join(10)
        assert victim.exitcode == -signal.SIGKILL  # the fault landed
    kind, rank, message = survivor["error"]
    assert kind == "NodeError" and rank == 1, survivor["error"]
    assert survivor["steps"] >= KILL_AFTER_STEPS
    took = survivor["raised_at"] - hit
    assert 0 < took < PG_TIMEOUT_S + FAULT_MARGIN_S, (took, message)
    if fault == "stop":
        assert took > PG_TIMEOUT_S / 2, (took, message)  # it waited for the timeout
    assert survivor["again_seconds"] < 1.0 and survivor["closed"]


# -- 4. a node with another model ------------------------------------------------------------
def _mismatch(rank, prefix):
    out = {}
    torch.manual_seed(rank)
    model = Cnn(d_out=5 if rank == 0 else 3)  # rank 1's last layer has other shapes
    try:
        with _engine(rank, model, prefix, "other-model", workers=1):
            out["started"] = True
    except shmgrad.InvalidArgumentError as exc:
        out["model"] = str(exc)
    # The group still works: the same model, but another bucket size on rank 1.
    try:
        with _engine(
            rank,
            Cnn(),
            prefix,
            "other-buckets",
            workers=1,
            bucket_cap_mb=None if rank == 0 else 0.001,
        ):
            out["started"] = True
    except shmgrad.InvalidArgumentError as exc:
        out["buckets"] = str(exc)
    # The same shapes, but rank 1's convolution in channels_last: its elements lie in
    # another order in the flat buffer the nodes sum.
    model = Cnn(channels=3)
    if rank == 1:
        model = model.to(memory_format=torch.channels_last)
    try:
        with _engine(rank, model, prefix, "other-layout", workers=1):
            out["started"] = True
    except shmgrad.InvalidArgumentError as exc:
        out["layout"] = str(exc)
    # Converted alike on both: served, and the gradient of the global batch is plain
    # PyTorch's, the convolution still channels_last.
    model = Cnn(channels=3).to(memory_format=torch.channels_last)
    g = torch.Generator().manual_seed(11)
    x, y = torch.randn(9, 3, 12, 12, generator=g), torch.randint(0, 5, (9,), generator=g)
    with _engine(rank, model, prefix, "channels-last", workers=2) as engine:
        engine.bind(model)  # rank 0's weights on both
        ref = reference_gradient(copy.deepcopy(model), "cross_entropy", x, y)
        mine = shard(torch.arange(9), rank, NODES)
        engine.gradient(inputs=x[mine], targets=y[mine], reduction="sum")
        out["cl_error"] = relative_error(_grads(model), ref)
        w = model.conv.weight
        out["cl_kept"] = not w.is_contiguous() and w.grad.stride() == w.stride()
    return out


@pytest.mark.full  # long: four engines in turn
def test_mismatched_models_are_refused(tmp_path, prefix):
    with Ranks("mismatch", tmp_path, prefix=prefix) as ranks:
        results = ranks.results()
    for r in results:
        assert "started" not in r
        assert "rank 1" in r["model"] and "'fc.weight' (3, 100)" in r["model"], r["model"]
        assert "(5, 100)" in r["model"]
        assert "rank 1" in r["buckets"] and "bucket_cap_mb" in r["buckets"], r["buckets"]
        layout = r["layout"]
        assert "rank 1" in layout and "'conv.weight'" in layout, layout
        assert "channels_last there but contiguous on rank 0" in layout, layout
        assert r["cl_error"] < 1e-5 and r["cl_kept"]


# -- 5. shmgrad.dask.run --------------------------------------------------------------------
def _dask_train(spec, prefix, steps):
    rank = dist.get_rank()
    torch.manual_seed(300 + rank)
    model = Cnn()
    with _engine(rank, model, prefix, "dask", workers=1, dataset=spec) as engine:
        engine.bind(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        g = torch.Generator().manual_seed(3)
        for _ in range(steps):
            idx = torch.randint(0, 120, (16,), generator=g)
            engine.gradient(shard(idx, rank, dist.get_world_size()), reduction="mean")
            opt.step()
        return rank, engine.check_consistency()


def test_dask_run_on_a_local_cluster(npy_dataset, prefix):
    import shmgrad.dask
    from distributed import Client, LocalCluster

    spec, _, _ = npy_dataset
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cluster = LocalCluster(
            n_workers=2,
            processes=True,
            threads_per_worker=1,
            dashboard_address=None,
            silence_logs=logging.ERROR,
        )
        client = Client(cluster)
    try:
        results = shmgrad.dask.run(client, _dask_train, spec, prefix, 5, timeout=PG_TIMEOUT_S)
        assert [r for r, _ in results] == [0, 1]
        assert results[0][1] == results[1][1]
        # One call per host: one node, alone in its group.
        (alone,) = shmgrad.dask.run(
            client, _dask_train, spec, prefix, 2, per_host=True, timeout=PG_TIMEOUT_S
        )
        assert alone[0] == 0
    finally:
        client.close()
        cluster.close()


# -- 6. one node, and arguments ----------------------------------------------------------
def test_one_node_reports_its_own_figures_and_refuses_a_bad_group(prefix):
    torch.manual_seed(0)
    model = Mlp(d_in=6, d_out=3)
    x, y = torch.randn(10, 6), torch.randint(0, 3, (10,))
    with shmgrad.Engine(model=model, workers=1, loss="cross_entropy") as engine:
        engine.bind(model)
        st = engine.gradient(inputs=x, targets=y)
        assert st.local_num_examples == st.num_examples == 10 and st.nodes == 1
        assert st.local_loss_sum == st.loss_sum and st.allreduce_seconds == 0.0
        assert st.allreduce_bytes == 0
        assert st.as_dict()["local_num_examples"] == 10
        assert engine.check_consistency() == engine.check_consistency()
        assert engine.node_rank == 0 and engine.node_count == 1
        with pytest.raises(shmgrad.InvalidArgumentError, match="empty batch"):
            engine.gradient([])
    # torch.distributed is not initialised in this process: refused, engine stopped.
    with pytest.raises(shmgrad.InvalidArgumentError, match="init_process_group"):
        shmgrad.Engine(
            model=model,
            workers=1,
            loss="cross_entropy",
            name=f"{prefix}-bad",
            process_group=object(),
        )
    with pytest.raises(shmgrad.InvalidArgumentError, match="rank 2 is not in"):
        shard(list(range(4)), 2, 2)
    assert [len(shard(list(range(5)), r, 3)) for r in range(3)] == [1, 2, 2]


def test_import_shmgrad_loads_neither_dask_nor_distributed():
    code = "import sys, shmgrad; print(' '.join(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    modules = out.stdout.split()
    assert "shmgrad.multinode" in modules and "shmgrad.dask" not in modules
    assert not [m for m in modules if m.split(".")[0] in ("dask", "distributed")]


# -- 7. shmgrad bench --nodes ---------------------------------------------------------------
BENCH_TIMEOUT_S = 240


@pytest.mark.full  # bench --nodes: long; test_bench checks the rest of bench in CI
def test_bench_nodes_tiny(tmp_path):
    """Every system of `shmgrad bench --nodes 2` gives a number and the same gradient; how
    fast is not tested."""
    out = tmp_path / "bench"
    engines = f"/dev/shm/shmgrad-{os.getuid()}-bench-*"
    before = set(glob.glob(engines))
    proc = subprocess.run(  # killed if it runs past the timeout
        [
            sys.executable,
            "-m",
            "shmgrad_tools.bench",
            "--nodes",
            "2",
            "--tiny",
            "--paired",
            "--out",
            str(out),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=str(tmp_path),
        timeout=BENCH_TIMEOUT_S,
    )
    assert proc.returncode == 0, proc.stdout
    assert not set(glob.glob(engines)) - before, proc.stdout
    with open(out / "results.json") as f:
        data = json.load(f)
    records = data["results"]
    assert {r["system"] for r in records} == {
        "single-1t",
        "shmgrad",
        "shmgrad-nodes",
        "ddp",
        "shmgrad-nodes-paired",
        "ddp-paired",
    }
    by = {r["system"]: r for r in records}
    nodes, ddp = by["shmgrad-nodes"], by["ddp"]
    for r in by.values():
        assert r["median_s"] > 0, r
        assert r["system"] == "single-1t" or r["grad_rel_err"] < 1e-4, r
    # --paired: both systems in the same ranks, step by step; one ratio per pair of steps,
    # and the target evaluated on it too.
    pn, pd = by["shmgrad-nodes-paired"], by["ddp-paired"]
    assert pn["n"] == pd["n"] == len(pd["paired_ratios"]) >= 2
    assert pd["paired_ratios"] == [d / s for d, s in zip(pd["times_s"], pn["times_s"])]
    assert pd["ratio_to_nodes"]["1"] == pd["median_s"] / pn["median_s"]
    assert any(t["config"].endswith(", paired") for t in data["targets"])
    for r in (nodes, ddp):
        assert r["sent_bytes_per_node_step"] > 0 and r["loopback_bytes_per_node_step"] > 0
    assert 0 < nodes["allreduce_share_median"] < 1
    # One ring all-reduce of the whole gradient (with padding) and the record, per node.
    assert nodes["sent_bytes_per_node_step"] >= ddp["sent_bytes_per_node_step"]
    assert "all-reduce share" in (out / "results.md").read_text()


SCENARIOS = {
    "accumulated": _accumulated,
    "gradients": _gradients,
    "sgd": _sgd,
    "fp16": _fp16,
    "batchnorm": _batchnorm,
    "until_fault": _until_fault,
    "mismatch": _mismatch,
    "unused": _unused,
}


@pytest.mark.full  # long; test_dask_run_on_a_local_cluster runs shmgrad.dask.run in CI
def test_docs_dask_recipe_runs_as_written(tmp_path):
    """docs/MULTINODE.md's three Dask commands, as written (SCHEDULER: this machine, a free
    port, one epoch), from the checkout's root: two workers, two nodes, one checksum."""
    root = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
    with open(os.path.join(root, "docs", "MULTINODE.md")) as f:
        text = f.read()
    block = text[text.index("### Dask") :]
    block = block[block.index("```sh\n") + 6 : block.index("```\n", block.index("```sh\n") + 6)]
    commands = [line.split("#")[0].strip() for line in block.strip().splitlines()]
    assert len(commands) == 3 and "dask scheduler" in commands[0], commands
    port = str(free_port())
    commands = [c.replace("8786", port).replace("SCHEDULER", "127.0.0.1") for c in commands]
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo")
    started = []

    logs = []

    def start(command, log):
        logs.append(open(log, "w"))
        proc = subprocess.Popen(
            ["bash", "-c", command],
            cwd=root,
            env=env,
            stdout=logs[-1],
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        started.append(proc)
        return proc

    try:
        start(commands[0], tmp_path / "scheduler.log")
        for i in range(2):  # "each machine": two workers on this one
            start(commands[1], tmp_path / f"worker{i}.log")
        # As a person would: once both workers have joined the scheduler.
        wait = (
            "import distributed, sys; "
            f"c = distributed.Client('tcp://127.0.0.1:{port}', timeout=60); "
            "c.wait_for_workers(2, timeout=90); c.close()"
        )
        joined = subprocess.run(
            [sys.executable, "-c", wait], capture_output=True, text=True, timeout=180
        )
        assert joined.returncode == 0, joined.stderr[-2000:]
        client = subprocess.run(
            ["bash", "-c", commands[2] + " --epochs 1"],
            cwd=root,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert client.returncode == 0, client.stdout[-2000:] + client.stderr[-3000:]
        sums = re.findall(
            r"^rank (\d): test accuracy [\d.]+%, checksum ([0-9a-f]{16})$", client.stdout, re.M
        )
        assert [r for r, _ in sums] == ["0", "1"], client.stdout
        assert sums[0][1] == sums[1][1], client.stdout  # both nodes hold the same parameters
    finally:
        for proc in started:
            try:
                os.killpg(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        for proc in started:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        for f in logs:
            f.close()
