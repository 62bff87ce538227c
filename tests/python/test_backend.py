"""The ``shmgrad`` torch.distributed backend (docs/BACKEND.md): every collective against
gloo's result in the same processes, DDP against DDP with gloo, refusals that name the
fix, and a rank that dies or leaves while the others wait.

Ranks are spawned processes (2, or 4 where the sum order matters), as torchrun or
mp.spawn start them; each returns what it found through a queue, so a failing rank's
traceback is in the assertion.
"""

import datetime
import glob
import os
import signal
import time
import traceback
import warnings

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import shmgrad  # noqa: F401  (registers the backend)
from helpers import free_port

TIMEOUT_S = 120


def _entry(fn, rank, world, port, env, queue, args):
    os.environ.update(env)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    try:
        import shmgrad  # noqa: F401

        queue.put((rank, "ok", fn(rank, world, *args)))
    except BaseException:  # noqa: BLE001  (the traceback goes to the test)
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def launch(fn, world=2, args=(), env=None, timeout=TIMEOUT_S, expect_dead=()):
    """Runs fn(rank, world, *args) in `world` spawned processes; returns {rank: result}.
    Ranks in expect_dead may die (their result is their exit code)."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_entry, args=(fn, r, world, port, env or {}, queue, args))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    results, deadline = {}, time.monotonic() + timeout
    try:
        while len(results) < world - len(expect_dead):
            left = deadline - time.monotonic()
            assert left > 0, f"ranks did not finish within {timeout} s: got {sorted(results)}"
            try:
                rank, status, value = queue.get(timeout=min(left, 1.0))
            except Exception:  # noqa: BLE001  (queue.Empty: look at the processes)
                for r, p in enumerate(procs):
                    if r not in expect_dead and p.exitcode not in (None, 0) and r not in results:
                        raise AssertionError(f"rank {r} exited with {p.exitcode}") from None
                continue
            assert status == "ok", f"rank {rank} failed:\n{value}"
            results[rank] = value
        for p in procs:
            p.join(timeout=30)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    for r in expect_dead:
        results[r] = procs[r].exitcode
    return results


def _init(rank, world, timeout_s=60):
    dist.init_process_group(
        "shmgrad", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=timeout_s)
    )


def _group_segments():
    return glob.glob(f"/dev/shm/shmgrad-{os.getuid()}-pg-*")


# ------------------------------------------------------------------------- collectives

REDUCE_DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int8,
    torch.uint8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.bool,
]
OPS = ["SUM", "AVG", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR"]


def _values(dtype, n, seed):
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(n, generator=g) > 0.5
    if dtype.is_floating_point:
        return (torch.randn(n, generator=g) * 3).to(dtype)
    return torch.randint(-100 if dtype != torch.uint8 else 0, 100, (n,), generator=g).to(dtype)


def _expected_reduce(tensors, op):
    """The reference: the ranks' tensors reduced in rank order, in float64 or int64."""
    dtype = tensors[0].dtype
    wide = torch.float64 if dtype.is_floating_point else torch.int64
    xs = [t.to(wide) for t in tensors]
    if dtype == torch.bool:
        stack = torch.stack([t.bool() for t in tensors])
        fn = {
            "SUM": "any",
            "MAX": "any",
            "BOR": "any",
            "PRODUCT": "all",
            "MIN": "all",
            "BAND": "all",
        }.get(op)
        if fn:
            return getattr(stack, fn)(0)
        return (stack.sum(0) % 2).bool()
    out = xs[0].clone()
    for x in xs[1:]:
        out = {
            "SUM": torch.add,
            "AVG": torch.add,
            "PRODUCT": torch.mul,
            "MIN": torch.minimum,
            "MAX": torch.maximum,
            "BAND": torch.bitwise_and,
            "BOR": torch.bitwise_or,
            "BXOR": torch.bitwise_xor,
        }[op](out, x)
    if op == "AVG":  # integers: truncated toward zero, as NCCL's
        out = (
            out / len(xs)
            if dtype.is_floating_point
            else torch.div(out, len(xs), rounding_mode="trunc")
        )
    return out.to(dtype)


def _all_reduces(rank, world):
    _init(rank, world)
    checked, refused = 0, []
    for dtype in REDUCE_DTYPES:
        for op in OPS:
            mine = _values(dtype, 1001, seed=rank)
            everyone = [_values(dtype, 1001, seed=r) for r in range(world)]
            t = mine.clone()
            try:
                dist.all_reduce(t, op=getattr(dist.ReduceOp, op))
            except RuntimeError as exc:
                refused.append((str(dtype), op, str(exc)))
                continue
            want = _expected_reduce(everyone, op)
            if dtype.is_floating_point and op in ("SUM", "AVG", "PRODUCT"):
                # One rounding from the exact result (accumulated in float32 or wider).
                tol = {torch.float16: 1e-3, torch.bfloat16: 8e-3}.get(dtype, 1e-6)
                torch.testing.assert_close(t.double(), want.double(), rtol=tol, atol=tol)
            else:
                assert torch.equal(t, want), (dtype, op, t[:8], want[:8])
            checked += 1
    return checked, refused


def test_all_reduce_every_type_and_op():
    results = launch(_all_reduces)
    checked, refused = results[0]
    # AVG of bool, bitwise ops of floating point: refused, naming why.
    assert checked == len(REDUCE_DTYPES) * len(OPS) - len(refused)
    assert {(d, op) for d, op, _ in refused} == {
        (str(d), op)
        for d in REDUCE_DTYPES
        for op in OPS
        if (d.is_floating_point and op.startswith("B")) or (d == torch.bool and op == "AVG")
    }
    assert all("shmgrad backend" in msg for _, _, msg in refused)


def _like_gloo(rank, world):
    """Each collective through shmgrad and through gloo, same inputs: the same bits."""
    _init(rank, world)
    gloo = dist.new_group(backend="gloo")
    done = []

    def both(name, fn):
        a, b = fn(None), fn(gloo)
        for x, y in zip(a, b):
            assert torch.equal(x, y), f"{name}: shmgrad {x.flatten()[:6]} gloo {y.flatten()[:6]}"
        done.append(name)

    torch.manual_seed(100 + rank)
    big = torch.randn(300_001)  # several rounds of a 0.25 MiB staging buffer
    both("all_reduce (chunked)", lambda g: [_ar(big.clone(), g)])
    half = torch.randn(70_001).half()
    both("all_reduce float16", lambda g: [_ar(half.clone(), g)])
    noncontig = torch.randn(64, 33).t()
    both("all_reduce non-contiguous", lambda g: [_ar(noncontig.clone(), g)])

    def coalesced(g):
        ts = [torch.full((5,), rank + 1.0), torch.arange(7.0) * (rank + 1)]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # torch's deprecation notice
            dist.all_reduce_coalesced(ts, group=g)
        return ts

    both("all_reduce_coalesced", coalesced)

    def broadcast(g):
        torch.manual_seed(7)
        t = torch.randn(200_003) if rank == 1 else torch.zeros(200_003)
        dist.broadcast(t, src=1, group=g)
        return [t]

    both("broadcast (chunked)", broadcast)

    def reduce(g):
        t = torch.arange(10.0) + rank
        dist.reduce(t, dst=1, group=g)
        return [t] if rank == 1 else []

    both("reduce", reduce)

    def all_gather(g):
        out = [torch.empty(100_000) for _ in range(world)]
        dist.all_gather(out, torch.full((100_000,), float(rank)), group=g)
        return out

    both("all_gather (chunked)", all_gather)

    def all_gather_into_tensor(g):
        out = torch.empty(world * 3, 2)
        dist.all_gather_into_tensor(out, torch.full((3, 2), rank * 2.0), group=g)
        return [out]

    both("all_gather_into_tensor", all_gather_into_tensor)

    def reduce_scatter_tensor(g):
        torch.manual_seed(3 + rank)
        inp = torch.randn(world * 50_000)
        out = torch.empty(50_000)
        dist.reduce_scatter_tensor(out, inp, group=g)
        return [out]

    both("reduce_scatter_tensor (chunked)", reduce_scatter_tensor)

    def reduce_scatter(g):
        ins = [torch.full((4,), float(rank * 10 + j)) for j in range(world)]
        out = torch.empty(4)
        dist.reduce_scatter(out, ins, group=g)
        return [out]

    # gloo has no reduce_scatter of lists on the CPU: checked against the arithmetic.
    out = reduce_scatter(None)[0]
    assert torch.equal(out, torch.full((4,), float(sum(r * 10 + rank for r in range(world)))))

    def all_to_all_single(g):
        # Uneven: rank r sends r + j + 1 rows to rank j.
        in_splits = [rank + j + 1 for j in range(world)]
        out_splits = [r + rank + 1 for r in range(world)]
        inp = torch.arange(sum(in_splits) * 3.0).reshape(-1, 3) + 1000 * rank
        out = torch.empty(sum(out_splits), 3)
        dist.all_to_all_single(out, inp, out_splits, in_splits, group=g)
        return [out]

    both("all_to_all_single (uneven)", all_to_all_single)

    def gather(g):
        out = [torch.empty(6) for _ in range(world)] if rank == 0 else None
        dist.gather(torch.full((6,), rank + 0.5), out, dst=0, group=g)
        return out or []

    both("gather", gather)

    def scatter(g):
        ins = [torch.full((5,), 9.0 + j) for j in range(world)] if rank == 1 else None
        out = torch.empty(5)
        dist.scatter(out, ins, src=1, group=g)
        return [out]

    both("scatter", scatter)

    # Asynchronous: a Work whose wait() and future complete with the result.
    t = torch.ones(1000)
    work = dist.all_reduce(t, async_op=True)
    fut_value = work.get_future().wait()
    work.wait()
    assert torch.equal(t, torch.full((1000,), float(world)))
    assert torch.equal(fut_value[0], t)
    dist.barrier()
    # Subgroups: each its own segment.
    pair = dist.new_group(ranks=list(range(world)), backend="shmgrad")
    alone = dist.new_group(ranks=[0], backend="shmgrad")
    t = torch.ones(3)
    dist.all_reduce(t, group=pair)
    assert torch.equal(t, torch.full((3,), float(world)))
    if rank == 0:
        t = torch.ones(3)
        dist.all_reduce(t, group=alone)
        assert torch.equal(t, torch.ones(3))
    dist.barrier()
    return done, _group_segments()


def _ar(t, group):
    dist.all_reduce(t, group=group)
    return t


def test_collectives_give_gloos_bits():
    results = launch(_like_gloo, env={"SHMGRAD_BACKEND_STAGING_MB": "0.25"})
    done, segments = results[0]
    assert len(done) == 12 and len(set(done)) == 12, done
    # Every segment's name is removed once its ranks have attached.
    assert segments == [] and results[1][1] == []
    assert _group_segments() == []


# ---------------------------------------------------------------------------------- DDP


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.body = torch.nn.Sequential(
            torch.nn.Linear(12, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64), torch.nn.ReLU()
        )
        self.head = torch.nn.Linear(64, 3)

    def forward(self, x):
        return self.head(self.body(x))


def _ddp_params(rank, world, steps=4, bucket_cap_mb=0.01):
    """DDP over shmgrad (the default group) and DDP over a gloo group, in the same ranks,
    from the same initial parameters and on the same shards."""
    _init(rank, world)
    gloo = dist.new_group(backend="gloo")
    out = {}
    for name, group in (("shmgrad", None), ("gloo", gloo)):
        torch.manual_seed(0)
        model = torch.nn.parallel.DistributedDataParallel(
            _Net(), bucket_cap_mb=bucket_cap_mb, process_group=group
        )
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        g = torch.Generator().manual_seed(1)
        for _ in range(steps):
            x = torch.randn(8 * world, 12, generator=g)
            y = torch.randint(0, 3, (8 * world,), generator=g)
            xs, ys = x[rank * 8 : rank * 8 + 8], y[rank * 8 : rank * 8 + 8]
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(xs), ys).backward()
            opt.step()
        # numpy arrays travel by value (a tensor through the queue needs this process alive)
        out[name] = [p.detach().numpy().copy() for p in model.parameters()]
        if name == "shmgrad":
            out["arena"] = _arena_stats()  # while the model holds its buckets
    out["DDP_DISABLE_COMM_MEM"] = os.environ.get("DDP_DISABLE_COMM_MEM")
    return out


def _arena_stats(group=None):
    from shmgrad._native import _C

    group = group or dist.group.WORLD
    return _C.process_group_arena_stats(group._get_backend(torch.device("cpu")))


ARENA_MB = {"on": None, "off": "0", "small": "0.01"}  # 0.01 MiB: 3 pages, too few for some


@pytest.mark.parametrize("arena", list(ARENA_MB))
def test_ddp_gives_the_parameters_of_ddp_with_gloo(arena, capfd):
    mb = ARENA_MB[arena]
    ranks = launch(_ddp_params, env={} if mb is None else {"SHMGRAD_BACKEND_ARENA_MB": mb})
    # torch prints a C++ warning raised outside Python (the reducer) on the rank's stderr.
    full = capfd.readouterr().err.count("does not fit in this rank's arena")
    # Two ranks: a + b in either order, the same bits (several buckets of 0.01 MB).
    for a, b in zip(ranks[0]["shmgrad"], ranks[0]["gloo"]):
        assert np.array_equal(a, b)
    for a, b in zip(ranks[0]["shmgrad"], ranks[1]["shmgrad"]):
        assert np.array_equal(a, b)
    for r in (0, 1):
        stats = ranks[r]["arena"]
        assert ranks[r]["DDP_DISABLE_COMM_MEM"] == "0"  # set by the backend's creator
        if arena == "on":
            # DDP's buckets were allocated in the arena and every bucket's all-reduce of
            # every step ran in place (the bucket views' copies in and out are DDP's).
            assert stats["arena_in_use"] > 0 and stats["in_place_allreduces"] >= 4, stats
        elif arena == "small":
            # The first bucket (20 KB) does not fit: ordinary memory, staged, with a warning
            # (once per rank); the result is the same.
            assert stats["arena_bytes"] == 3 * 4096, stats
        else:
            assert stats == {"arena_bytes": 0, "arena_in_use": 0, "in_place_allreduces": 0}
    assert full == (2 if arena == "small" else 0)


def _bucket_views_outlive_the_group(rank, world):
    """DDP with gradient_as_bucket_view: every .grad is a view of a bucket in the arena.
    The process group is destroyed while the model lives on; its gradients stay readable
    (the arena stays mapped while a bucket holds it), and a user's own setting of
    DDP_DISABLE_COMM_MEM is left alone."""
    _init(rank, world)
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(_Net(), gradient_as_bucket_view=True)
    x = torch.randn(8, 12, generator=torch.Generator().manual_seed(rank))
    model(x).square().mean().backward()
    before = [p.grad.clone() for p in model.parameters()]
    stats = _arena_stats()
    dist.destroy_process_group()
    after = [p.grad.clone() for p in model.parameters()]  # read from the arena
    for p in model.parameters():
        p.grad.mul_(2)  # and written
    del model
    same = all(torch.equal(a, b) for a, b in zip(before, after))
    return {"stats": stats, "same": same, "grad": [g.numpy() for g in before]}


def test_ddp_buckets_outlive_their_group():
    ranks = launch(_bucket_views_outlive_the_group)
    for r in (0, 1):
        assert ranks[r]["same"]
        assert ranks[r]["stats"]["in_place_allreduces"] == 1, ranks[r]["stats"]
    for a, b in zip(ranks[0]["grad"], ranks[1]["grad"]):
        assert np.array_equal(a, b)  # the all-reduced gradient, the same on both ranks


def _user_setting_stands(rank, world):
    _init(rank, world)
    model = torch.nn.parallel.DistributedDataParallel(_Net())
    model(torch.randn(4, 12)).sum().backward()
    return {"env": os.environ.get("DDP_DISABLE_COMM_MEM"), "stats": _arena_stats()}


def _torch_strings() -> bytes:
    """The bytes of the libtorch this torch runs on (to ask whether its DDP reads an
    environment variable: torch 2.11 does not read DDP_DISABLE_COMM_MEM, 2.15 does)."""
    import mmap

    path = os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so")
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        return b"DDP_DISABLE_COMM_MEM" if m.find(b"DDP_DISABLE_COMM_MEM") >= 0 else b""


def test_a_users_ddp_disable_comm_mem_stands():
    ranks = launch(_user_setting_stands, env={"DDP_DISABLE_COMM_MEM": "1"})
    assert ranks[0]["env"] == "1"
    if _torch_strings():
        # torch reads the setting (2.12 and later): DDP allocated its buckets itself.
        assert ranks[0]["stats"]["arena_in_use"] == 0, ranks[0]["stats"]


@pytest.mark.full
def test_ddp_with_four_ranks_within_rounding_of_gloo():
    ranks = launch(_ddp_params, world=4)
    # Four ranks: shmgrad adds in rank order, gloo's ring in another; the parameters after
    # 4 steps agree to float32 rounding, and every shmgrad rank holds the same bits.
    for a, b in zip(ranks[0]["shmgrad"], ranks[0]["gloo"]):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    for r in range(1, 4):
        for a, b in zip(ranks[0]["shmgrad"], ranks[r]["shmgrad"]):
            assert np.array_equal(a, b)


# ------------------------------------------------------------------------------ refusals


_UNDER_A_LIMIT = """
import datetime, os, resource, torch, torch.distributed as dist, shmgrad
vm = int([l for l in open("/proc/self/status") if l.startswith("VmSize")][0].split()[1]) * 1024
resource.setrlimit(resource.RLIMIT_AS, (vm + (2 << 30), vm + (2 << 30)))
dist.init_process_group("shmgrad", rank=0, world_size=1, init_method="tcp://127.0.0.1:%d",
                        timeout=datetime.timedelta(seconds=30))
t = torch.ones(4)
dist.all_reduce(t)
print("reduced", t.tolist())
"""


@pytest.mark.parametrize("arena_mb", ["8192", "0"])
def test_a_limit_on_address_space_is_named_with_the_fix(arena_mb):
    """Under ulimit -v (here: 2 GiB above what the process has mapped), a group whose
    arenas do not fit fails at its start naming SHMGRAD_BACKEND_ARENA_MB; with 0 it works."""
    import subprocess
    import sys

    env = dict(os.environ, SHMGRAD_BACKEND_ARENA_MB=arena_mb)
    run = subprocess.run(
        [sys.executable, "-c", _UNDER_A_LIMIT % free_port()],
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    if arena_mb == "0":
        assert run.returncode == 0 and "reduced [1.0, 1.0, 1.0, 1.0]" in run.stdout, run.stderr
    else:
        assert run.returncode != 0, run.stdout
        assert "Cannot allocate memory" in run.stderr, run.stderr
        assert "set it lower, or 0, in every rank" in run.stderr, run.stderr


def _refusals(rank, world):
    _init(rank, world)
    errors = {}

    def refused(name, fn):
        try:
            fn()
        except (RuntimeError, ValueError) as exc:
            errors[name] = str(exc)
            return
        raise AssertionError(f"{name} was not refused")

    refused("recv from any", lambda: dist.recv(torch.ones(3)))
    refused(
        "premul_sum", lambda: dist.all_reduce(torch.ones(3), op=dist._make_nccl_premul_sum(2.0))
    )
    refused("sizes", lambda: dist.all_gather_into_tensor(torch.empty(world * 3), torch.ones(2)))
    # Different collectives on the two ranks: both refused, naming each, then it still works.
    if rank == 0:
        refused("mismatch", lambda: dist.all_reduce(torch.ones(10)))
    else:
        refused("mismatch", lambda: dist.broadcast(torch.ones(100), src=0))
    t = torch.ones(4)
    dist.all_reduce(t)
    assert torch.equal(t, torch.full((4,), float(world)))
    return errors


def test_what_it_cannot_do_is_refused_naming_the_fix():
    errors = launch(_refusals)[0]
    assert "name the source rank" in errors["recv from any"]
    assert "PREMUL_SUM" in errors["premul_sum"]
    assert "all_gather_into_tensor" in errors["sizes"]
    assert "rank 0 called allreduce" in errors["mismatch"]
    assert "rank 1 called broadcast" in errors["mismatch"]


# -------------------------------------------------------------------------------- faults


def _dies_while_others_wait(rank, world, mode):
    _init(rank, world, timeout_s=60)
    t = torch.ones(1000)
    dist.all_reduce(t)  # the group works
    if rank == 1:
        if mode == "kill":
            time.sleep(0.5)
            os.kill(os.getpid(), signal.SIGKILL)
        dist.destroy_process_group()  # "leave": exits the group cleanly, too early
        time.sleep(5)
        return None
    start = time.monotonic()
    errors = []
    for _ in range(2):  # the pending collective, then a later one
        try:
            dist.all_reduce(torch.ones(4_000_000))
        except dist.DistBackendError as exc:
            errors.append(str(exc))
    return errors, time.monotonic() - start


@pytest.mark.parametrize("mode", ["kill", "leave"])
def test_a_rank_that_dies_fails_the_others_at_once(mode):
    before = set(_group_segments())
    dead = (1,) if mode == "kill" else ()
    results = launch(_dies_while_others_wait, args=(mode,), expect_dead=dead)
    errors, waited = results[0]
    if mode == "kill":
        assert results[1] == -signal.SIGKILL  # the fault happened where the test says
        assert "rank 1" in errors[0] and "died" in errors[0]
    else:
        assert "rank 1 left the group" in errors[0]
    assert len(errors) == 2 and errors[1] == errors[0]  # later collectives: the same error
    assert waited < 10, f"took {waited:.1f} s for a group whose timeout is 60 s"
    assert set(_group_segments()) == before


def _cuda(rank, world):
    _init(rank, world)
    try:
        dist.all_reduce(torch.ones(3, device="cuda"))
    except RuntimeError as exc:
        refusal = str(exc)
    else:
        raise AssertionError("a CUDA tensor was not refused")
    dist.destroy_process_group()
    if rank == 0:  # one rank: NCCL needs a GPU per rank
        dist.init_process_group(
            "cpu:shmgrad,cuda:nccl",
            rank=0,
            world_size=1,
            init_method=f"tcp://127.0.0.1:{free_port()}",
        )
        cpu, gpu = torch.ones(3), torch.ones(3, device="cuda")
        dist.all_reduce(cpu)
        dist.all_reduce(gpu)
        assert torch.equal(cpu, gpu.cpu())
    return refusal


@pytest.mark.gpu
def test_cuda_tensors_are_refused_naming_the_per_device_backend():
    if not torch.cuda.is_available():
        pytest.skip("no GPU here: CUDA tensors cannot be made")
    assert "cpu:shmgrad,cuda:nccl" in launch(_cuda)[0]


# --------------------------------------------------------------------------- send, recv


def _point_to_point(rank, world):
    _init(rank, world)
    other = 1 - rank
    torch.manual_seed(rank)
    mine = torch.randn(3_000_001)  # 12 MB: many chunks of the pair's channel
    theirs = torch.empty(3_000_001)
    # Both directions at once (a deadlock if a send waited for its recv in one thread).
    works = [dist.isend(mine, dst=other, tag=7), dist.irecv(theirs, src=other, tag=7)]
    for w in works:
        w.wait()
    torch.manual_seed(other)
    assert torch.equal(theirs, torch.randn(3_000_001))
    # In order between a pair, with a collective between them.
    if rank == 0:
        for i in range(3):
            dist.send(torch.full((4,), float(i)), dst=1)
        dist.all_reduce(torch.ones(2))
        got = torch.empty(2, 3).t()  # non-contiguous
        dist.recv(got, src=1)
        assert torch.equal(got, torch.arange(6.0).reshape(3, 2))
    else:
        dist.all_reduce(torch.ones(2))
        for i in range(3):
            t = torch.empty(4)
            dist.recv(t, src=0)
            assert torch.equal(t, torch.full((4,), float(i)))
        dist.send(torch.arange(6.0).reshape(3, 2), dst=0)
    # Tags that disagree: refused on the receiver, and the group is broken for both.
    errors = []
    try:
        if rank == 0:
            dist.send(torch.ones(3), dst=1, tag=1)
        else:
            dist.recv(torch.ones(3), src=0, tag=2)
        dist.all_reduce(torch.ones(1))
    except dist.DistBackendError as exc:
        errors.append(str(exc))
    return errors


def test_send_and_recv_between_ranks_in_order():
    errors = launch(_point_to_point)
    assert "rank 0 sent 12 bytes with tag 1 but rank 1 expected 12 bytes with tag 2" in errors[1][0]
    assert "tag 1" in errors[0][0]  # the sender's next collective names the cause


# ------------------------------------------------------------------------ FSDP2, torchrun


def _fsdp2_params(rank, world, backend):
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group(backend, rank=rank, world_size=world)
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
    model = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
    for block in model.layers:
        fully_shard(block)
    fully_shard(model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        x = torch.randn(4 * world, 5, 16, generator=g)[rank * 4 : rank * 4 + 4]
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()
    return {k: v.full_tensor().detach().numpy().copy() for k, v in model.state_dict().items()}


def test_fsdp2_trains_a_transformer_to_glooss_parameters():
    shm = launch(_fsdp2_params, args=("shmgrad",))[0]
    gloo = launch(_fsdp2_params, args=("gloo",))[0]
    assert shm.keys() == gloo.keys()
    for k in shm:  # all-gathers and reduce-scatters of 2 ranks: the same bits
        assert np.array_equal(shm[k], gloo[k]), k


TORCHRUN_SCRIPT = """
import os, signal, sys
import torch, torch.distributed as dist
import shmgrad

dist.init_process_group("shmgrad")
rank, attempt = dist.get_rank(), int(os.environ["TORCHELASTIC_RESTART_COUNT"])
torch.manual_seed(0)
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 2))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(3):
    opt.zero_grad()
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
    if attempt == 0 and rank == 1 and step == 1:
        print("killing rank 1 of attempt 0", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
w = torch.cat([p.detach().flatten() for p in model.parameters()])
t = w.clone()
dist.all_reduce(t)
assert torch.equal(t, 2 * w)
print(f"rank {rank} attempt {attempt} trained", flush=True)
dist.destroy_process_group()
"""


@pytest.mark.full
def test_torchrun_restarts_a_fresh_group_after_a_killed_rank(tmp_path):
    import subprocess
    import sys

    script = tmp_path / "train.py"
    script.write_text(TORCHRUN_SCRIPT)
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    before = set(_group_segments())
    proc = subprocess.run(
        [
            torchrun,
            "--standalone",
            "--nproc-per-node",
            "2",
            "--max-restarts",
            "1",
            "--monitor-interval",
            "0.2",
            str(script),
        ],
        capture_output=True,
        text=True,
        timeout=180,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "killing rank 1 of attempt 0" in out  # the fault happened
    assert "rank 0 attempt 1 trained" in out and "rank 1 attempt 1 trained" in out, out
    assert set(_group_segments()) == before


NODES_SCRIPT = """
import json, os, sys
import torch, torch.distributed as dist
import shmgrad

backend = sys.argv[1]
dist.init_process_group(backend)
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
model = torch.nn.parallel.DistributedDataParallel(
    torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
g = torch.Generator().manual_seed(1)
for step in range(3):
    x = torch.randn(4 * world, 8, generator=g)[rank * 4 : rank * 4 + 4]
    opt.zero_grad()
    model(x).pow(2).mean().backward()
    opt.step()
# The rest of the collectives across nodes (through the gloo group of all ranks).
out = [torch.empty(2) for _ in range(world)]
dist.all_gather(out, torch.full((2,), float(rank)))
assert all(torch.equal(o, torch.full((2,), float(r))) for r, o in enumerate(out))
t = torch.full((3,), float(rank))
dist.broadcast(t, src=world - 1)
assert torch.equal(t, torch.full((3,), float(world - 1)))
t = torch.full((3,), rank + 1.0)
dist.all_reduce(t, op=dist.ReduceOp.AVG)
assert torch.allclose(t, torch.full((3,), (world + 1) / 2))
dist.barrier()
params = [p.detach().flatten().tolist() for p in model.parameters()]
# A file per rank: two ranks' long lines on one agent's stdout can interleave.
with open(os.path.join(sys.argv[2], f"params-{rank}.json"), "w") as f:
    json.dump({"rank": rank, "params": params}, f)
dist.destroy_process_group()
"""


def _two_nodes(tmp_path, backend):
    """torchrun --nnodes 2 --nproc-per-node 2 on this machine: two agents, node ranks 0
    and 1, as two machines would run them."""
    import json
    import subprocess
    import sys

    tmp_path = tmp_path / backend  # this run's files only
    tmp_path.mkdir()
    script = tmp_path / "nodes.py"
    script.write_text(NODES_SCRIPT)
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    procs = [
        subprocess.Popen(
            [
                torchrun,
                "--nnodes",
                "2",
                "--node-rank",
                str(node),
                "--nproc-per-node",
                "2",
                "--master-addr",
                "127.0.0.1",
                "--master-port",
                str(port),
                str(script),
                backend,
                str(tmp_path),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        for node in range(2)
    ]
    outs = [p.communicate(timeout=180)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(outs)
    params = {}
    for path in sorted(tmp_path.glob("params-*.json")):
        record = json.loads(path.read_text())
        params[record["rank"]] = record["params"]
    assert sorted(params) == [0, 1, 2, 3], "\n".join(outs)
    return params


@pytest.mark.full
def test_two_nodes_through_torchrun_reduce_within_and_between(tmp_path):
    shm = _two_nodes(tmp_path, "shmgrad")
    gloo = _two_nodes(tmp_path, "gloo")
    for r in range(1, 4):  # every rank holds the same parameters
        assert shm[r] == shm[0]
    # (r0 + r1) + (r2 + r3) against gloo's ring order: float32 rounding apart.
    for a, b in zip(shm[0], gloo[0]):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
