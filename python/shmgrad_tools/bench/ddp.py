"""The DistributedDataParallel side of ``shmgrad bench``: one rank of a gloo process group
on 127.0.0.1 (or of a ``shmgrad`` one: the backend over this machine's shared memory),
started by torch.multiprocessing (spawn). Kept apart from the runners so that
a spawned rank imports only this, the models and the clock, not Dask or the report."""

import datetime
import os
import traceback

import torch
import torch.distributed as dist
import torch.nn.functional as F

from . import models
from .timing import loopback_bytes, now, pin_to_share


def join_local_group(rank, world, port, timeout_s, pin, backend="gloo"):
    """This rank joins a ``backend`` group ("gloo", or "shmgrad") on 127.0.0.1 with one
    intra-op thread; with ``pin``, it runs on its share of the CPUs only
    (``timing.pin_to_share``)."""
    if pin:
        pin_to_share(rank, world)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    models.set_threads(1)
    if backend == "shmgrad":
        import shmgrad  # noqa: F401  (registers the backend)
    dist.init_process_group(
        backend, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=timeout_s)
    )


def rank_steps(batches, warmup, step):
    """The timing loop every rank of a multi-process system shares: a barrier, then
    ``step(i, x, y)`` on batch i. Returns the timed steps' start and end times and the
    bytes sent on the loopback interface during them (``timing.loopback_bytes``)."""
    times = alternating_steps(batches, warmup, {"step": step})
    return dict(times["step"], loopback_bytes=times["loopback_bytes"])


def alternating_steps(batches, warmup, steps):
    """``rank_steps`` for several systems in the same ranks (``steps``: name -> step):
    each batch goes through every system in turn, each behind its own barrier, the order
    reversed on every other batch, so that all see the same moments of a noisy machine.
    Returns name -> the timed steps' start and end times, and under "loopback_bytes" the
    bytes sent on the loopback interface during the timed steps, all systems together."""
    names = list(steps)
    times = {n: {"start": [], "end": []} for n in names}
    for i, (x, y) in enumerate(batches):
        if i == warmup:
            dist.barrier()
            lo_bytes = loopback_bytes()
        for name in names if i % 2 == 0 else names[::-1]:
            dist.barrier()  # every rank starts the step together
            t0 = now()
            steps[name](i, x, y)
            t1 = now()
            if i >= warmup:
                times[name]["start"].append(t0)
                times[name]["end"].append(t1)
    dist.barrier()
    times["loopback_bytes"] = loopback_bytes() - lo_bytes
    return times


def ddp_step(rank, world, model_name, batch, seed, out, group=None):
    """A DDP model of ``model_name`` over process group ``group`` (the default group if
    None) and its step on this rank's shard of a batch: ``step(i, x, y)``; the first
    step's gradient of the sum goes into ``out["grad"]`` (rank 0)."""
    model = models.make_model(model_name, seed)
    model.train()
    ddp = torch.nn.parallel.DistributedDataParallel(model, process_group=group)
    lo, hi = batch * rank // world, batch * (rank + 1) // world
    out["grad"] = None

    def step(i, x, y):
        for p in model.parameters():
            p.grad = None
        loss = F.cross_entropy(ddp(x[lo:hi]), y[lo:hi], reduction="sum")
        loss.backward()  # DDP all-reduces (averages) the gradient buckets here
        if i == 0 and rank == 0:
            # DDP averages over ranks; times world gives the gradient of the sum.
            out["grad"] = (models.flat_grad(model) * world).numpy()

    return step


def rank_main(
    rank, world, port, model_name, batch, warmup, repeats, seed, pin, backend, queue, timeout_s
):
    """Runs ``warmup + repeats`` DDP steps on this rank's shard of each batch over a
    ``backend`` group and puts ``(rank, {"start": [...], "end": [...], "grad": ...})`` on
    ``queue`` (or an error)."""
    try:
        join_local_group(rank, world, port, timeout_s, pin, backend)  # 1 thread, as a worker
        try:
            out = {}
            step = ddp_step(rank, world, model_name, batch, seed, out)
            batches = models.make_batches(model_name, batch, warmup + repeats, seed)
            out.update(rank_steps(batches, warmup, step))
            queue.put((rank, out))
        finally:
            dist.destroy_process_group()
    except BaseException:  # report, never hang the parent
        queue.put((rank, {"error": traceback.format_exc(limit=6)}))
