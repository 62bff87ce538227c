"""``shmgrad bench --collectives``: the ``shmgrad`` torch.distributed backend against gloo,
in the same processes, collective by collective.

W ranks on 127.0.0.1 (torch.multiprocessing spawn) join a gloo default group and a
``dist.new_group(backend="shmgrad")`` over the same ranks, with one intra-op thread each,
the heap settings the bench gives every process, and GLOO_SOCKET_IFNAME=lo. For each size
n (float32) and each collective, both backends run on the same tensors, taking turns
sample by sample (the order reversed on every other sample), so that both see the same
moments of a noisy machine:

  all_reduce      ``dist.all_reduce`` (SUM) of an n-byte tensor; through shmgrad twice:
                  an ordinary tensor (staged), and one the group's backend allocated in
                  its arena (``allocate_tensor``, as DDP's buckets are: in place);
  all_gather      ``dist.all_gather_into_tensor``: n/W bytes in, n bytes out;
  reduce_scatter  ``dist.reduce_scatter_tensor`` (SUM): n bytes in, n/W bytes out.

The size n is always the larger, per-rank buffer, as nccl-tests counts it; the bandwidth
column is n / time.

A sample is k back-to-back calls after a barrier of the gloo group, timed from the first
rank's start to the last rank's end and divided by k; k is chosen per backend and size
(from a calibration call, the slowest rank's time) so that a sample lasts about
SAMPLE_TARGET_S, which amortises the barrier's exit skew over small calls; the largest
sizes run one call per sample. Latency is the median over samples. How many samples: up
to --repeats, fewer (at least 3) where --budget seconds per collective and size would be
exceeded, decided up front from the calibration so that every rank runs the same calls.
Before timing, each backend's first call at each size runs on known values and its result
is checked on every rank (``correct``); then the buffers are zeroed (a sum of zeros stays
zero and no value ever overflows). That call is the first of --warmup untimed calls
(at least one), the calibration call follows.

The memory-traffic bound. shmgrad's algorithm (backend/shm_comm.cc) stages everything
through its segment with memcpy and reduces in place. Counting the bytes each rank reads
and writes (W ranks, n the size as above):

  all_reduce      copy in (read n, write n), reduce its slice of every rank's staging
                  (read W x n/W = n, write n/W), copy the result out (read n, write n):
                  (5 + 1/W) n
  all_gather      copy its n/W in (read n/W, write n/W), copy every rank's piece out
                  (read n, write n): (2 + 2/W) n
  reduce_scatter  copy its n in (read n, write n), reduce its slice of every rank's
                  staging straight into the output (read W x n/W = n, write n/W):
                  (3 + 1/W) n
  all_reduce in   reduce its slice of every rank's tensor into its own (read n, write
  the arenas      n/W), copy every other slice from the rank that reduced it (read and
                  write (W - 1)/W n): (3 - 1/W) n

The bound is those bytes divided by this machine's copy bandwidth per rank, measured in
the same run, before the collectives and again after them (a machine whose load changes
during the run moves both): every rank ``dst.copy_(src)`` on its own COPY_BYTES tensors
at the same time (larger than the caches; W ranks share the memory bus as they do in a
collective), COPY_SAMPLES times each, each timed from the first rank's start to the last
rank's end, counted as 2 x COPY_BYTES (read and written) per rank; the median of all
samples. The same copy by one process alone (the others waiting) is reported beside it:
what a single process gets from the memory bus.

It is a bound of the memory traffic, not of every implementation: it leaves out the
barriers, the hand-off to the backend's thread, Python and torch's dispatch (which
dominate the small sizes), and it counts every byte at the speed of memory. Where a
collective's data and shmgrad's staging buffers (at most 8 MiB each by default, so a
large tensor goes through them in rounds) stay in the caches, some of the traffic runs at
the caches' speed instead, and shmgrad / bound may drop below 1: read it as "as fast as
memory", not as an error. It does not bound gloo, which moves the bytes through TCP on
the loopback interface.
"""

import datetime
import math
import os
import traceback
from typing import List, NamedTuple

import torch
import torch.distributed as dist

from . import models
from .timing import MIN_TIMED_STEPS, now

OPS = ("all_reduce", "all_gather", "reduce_scatter")
SYSTEMS = ("gloo", "shmgrad")
# all_reduce also runs on tensors in the shmgrad group's arena (in place).
ARENA = "shmgrad-arena"


def systems_of(op: str):
    """The systems that run collective ``op``."""
    return SYSTEMS + (ARENA,) if op == "all_reduce" else SYSTEMS


ELEMENT_BYTES = 4  # float32
# 4 KiB to 256 MiB in powers of 4.
DEFAULT_SIZES = [4 << (10 + 2 * i) for i in range(9)]
DEFAULT_REPEATS = 20
DEFAULT_BUDGET_S = 10.0  # per collective and size, both backends together
SAMPLE_TARGET_S = 0.01  # a sample of k calls lasts about this long
MAX_CALLS_PER_SAMPLE = 64
# The copies that measure the copy bandwidth of the bound: larger than the caches.
COPY_BYTES = 64 << 20
COPY_SAMPLES = 10


def traffic_bytes(op: str, n: int, world: int, in_place: bool = False) -> float:
    """The bytes one rank reads and writes in shmgrad's algorithm for collective ``op``
    on size ``n`` with ``world`` ranks (the module's docstring derives them); with
    ``in_place``, the all-reduce in the arenas."""
    if op == "all_reduce" and in_place:
        return (3 - 1 / world) * n
    if op == "all_reduce":
        return (5 + 1 / world) * n
    if op == "all_gather":
        return (2 + 2 / world) * n
    if op == "reduce_scatter":
        return (3 + 1 / world) * n
    raise ValueError(f"unknown collective {op!r}: use one of {', '.join(OPS)}")


def elements(size: int, world: int) -> int:
    """float32 elements of a size-byte buffer that ``world`` ranks split evenly."""
    return size // ELEMENT_BYTES // world * world


def parse_size(text: str) -> int:
    """'4096', '4K', '1M', '2G' (binary units) -> bytes."""
    t = text.strip().upper().removesuffix("IB").removesuffix("B")
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(t[-1:], 1)
    digits = t[:-1] if t[-1:] in ("K", "M", "G") else t
    value = int(digits)  # ValueError for anything else
    if value <= 0:
        raise ValueError(text)
    return value * scale


def fmt_size(size: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if size >= scale and size % scale == 0:
            return f"{size // scale} {unit}"
    return f"{size} B"


class Plan(NamedTuple):
    """What every rank measures (the same on all of them)."""

    sizes: List[int]
    repeats: int
    warmup: int
    budget_s: float


# -- one rank -------------------------------------------------------------------------
def rank_main(rank, world, port, plan, queue, timeout_s):
    """Joins the groups, measures every size of ``plan`` and puts ``(rank, result)`` on
    ``queue`` (or ``(rank, {"error": traceback})``)."""
    try:
        groups = join_groups(rank, world, port, timeout_s)
        try:
            queue.put((rank, measure_rank(rank, world, plan, groups)))
        finally:
            dist.destroy_process_group()
    except BaseException:  # report, never hang the parent
        queue.put((rank, {"error": traceback.format_exc(limit=6)}))


def join_groups(rank, world, port, timeout_s):
    """A gloo default group and a shmgrad group of the same ranks: {system: group}."""
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    models.set_threads(1)  # as every system of the bench
    import shmgrad  # noqa: F401  (registers the backend)

    timeout = datetime.timedelta(seconds=timeout_s)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timeout)
    shm = dist.new_group(backend="shmgrad", timeout=timeout)
    return {"gloo": dist.group.WORLD, "shmgrad": shm}


def measure_rank(rank, world, plan, groups):
    """This rank's part of every measurement: start and end times of each sample."""
    gloo = groups["gloo"]
    out = {"copy_before": copy_bandwidth(rank, gloo), "sizes": []}
    for size in plan.sizes:
        numel = elements(size, world)
        entry = {"size": size, "bytes": numel * ELEMENT_BYTES, "ops": {}}
        for op in OPS:
            entry["ops"][op] = measure_op(op, numel, rank, world, plan, groups)
        out["sizes"].append(entry)
    out["copy_after"] = copy_bandwidth(rank, gloo)
    return out


def copy_bandwidth(rank, gloo):
    """The copies of the bound (the module's docstring): COPY_SAMPLES copies of
    COPY_BYTES by every rank at once, then by rank 0 alone. Returns {"all": {"start",
    "end"}, "alone": {"start", "end"} (rank 0's; empty elsewhere)}."""
    numel = COPY_BYTES // ELEMENT_BYTES
    src, dst = torch.ones(numel), torch.empty(numel)
    dst.copy_(src)  # the pages faulted in before any timing
    out = {"all": {"start": [], "end": []}, "alone": {"start": [], "end": []}}
    for key, copies in (("all", True), ("alone", rank == 0)):
        for _ in range(COPY_SAMPLES):
            dist.barrier(group=gloo)
            if copies:
                t0 = now()
                dst.copy_(src)
                out[key]["start"].append(t0)
                out[key]["end"].append(now())
    dist.barrier(group=gloo)
    return out


def op_buffers(op, numel, rank, world, arena_group=None):
    """Collective ``op``'s tensors, kept alive by the four functions returned:
    ``call(group)``; ``fill()``, known values in, after which one call leaves a result
    that ``verify()`` checks (True when right on this rank); ``zero()``. With
    ``arena_group`` (all_reduce), the tensor is allocated by that group's backend."""
    w = world
    if op == "all_reduce":
        if arena_group is None:
            t = torch.empty(numel)
        else:
            backend = arena_group._get_backend(torch.device("cpu"))
            t = backend.allocate_tensor(numel, dtype=torch.float32, device=torch.device("cpu"))
        return (
            lambda g: dist.all_reduce(t, group=g),
            lambda: t.fill_(rank + 1),
            lambda: bool((t == w * (w + 1) / 2).all()),
            lambda: t.zero_(),
        )
    blocks = torch.arange(1, w + 1, dtype=torch.float32)[:, None]
    if op == "all_gather":
        inp, out = torch.empty(numel // w), torch.empty(numel)
        return (
            lambda g: dist.all_gather_into_tensor(out, inp, group=g),
            lambda: (inp.fill_(rank + 1), out.zero_()),
            lambda: bool((out.view(w, -1) == blocks).all()),  # block j from rank j
            lambda: (inp.zero_(), out.zero_()),
        )
    if op == "reduce_scatter":
        inp, out = torch.empty(numel), torch.empty(numel // w)
        return (
            lambda g: dist.reduce_scatter_tensor(out, inp, group=g),
            # Block j of rank r holds (r + 1)(j + 1): this rank's block sums to
            # (rank + 1) W (W + 1) / 2.
            lambda: (inp.view(w, -1).copy_(blocks * (rank + 1)), out.zero_()),
            lambda: bool((out == (rank + 1) * w * (w + 1) / 2).all()),
            lambda: (inp.zero_(), out.zero_()),
        )
    raise ValueError(f"unknown collective {op!r}")


def measure_op(op, numel, rank, world, plan, groups):
    """One collective at one size through both backends: the first call of each checked
    on known values, then the timed samples, taking turns."""
    buffers = {system: op_buffers(op, numel, rank, world) for system in SYSTEMS}
    if op == "all_reduce":
        buffers[ARENA] = op_buffers(op, numel, rank, world, arena_group=groups["shmgrad"])
    group = dict(groups, **{ARENA: groups["shmgrad"]})
    correct = {}
    for system, (call, fill, verify, zero) in buffers.items():
        fill()
        call(group[system])
        correct[system] = verify()
        zero()
    calls = {system: (lambda b=b, g=group[system]: b[0](g)) for system, b in buffers.items()}
    times = timed_samples(calls, plan, groups["gloo"], warmup=max(0, plan.warmup - 1))
    for system in buffers:
        times[system]["correct"] = correct[system]
    return times


def timed_samples(calls, plan, gloo, warmup):
    """``calls``: name -> a function of no argument. Warm-up calls, a calibration call of
    each (the slowest rank's time, agreed by all ranks), then the samples, every name in
    turn (the order reversed every other sample). Returns name -> {"calls_per_sample",
    "start", "end"}: each sample's start and end on this rank."""
    names = list(calls)
    for _ in range(warmup):
        for name in names:
            calls[name]()
    est = torch.zeros(len(names), dtype=torch.float64)
    for i, name in enumerate(names):
        dist.barrier(group=gloo)
        t0 = now()
        calls[name]()
        est[i] = now() - t0
    dist.all_reduce(est, op=dist.ReduceOp.MAX, group=gloo)  # every rank plans the same
    k = {
        name: max(1, min(MAX_CALLS_PER_SAMPLE, math.ceil(SAMPLE_TARGET_S / max(e, 1e-9))))
        for name, e in zip(names, est.tolist())
    }
    sample_s = sum(k[name] * e for name, e in zip(names, est.tolist()))
    least = min(MIN_TIMED_STEPS, plan.repeats)
    samples = max(least, min(plan.repeats, int(plan.budget_s / max(sample_s, 1e-9))))
    out = {name: {"calls_per_sample": k[name], "start": [], "end": []} for name in names}
    for s in range(samples):
        for name in names if s % 2 == 0 else names[::-1]:
            fn, rec = calls[name], out[name]
            dist.barrier(group=gloo)
            t0 = now()
            for _ in range(k[name]):
                fn()
            rec["start"].append(t0)
            rec["end"].append(now())
    dist.barrier(group=gloo)
    return out
