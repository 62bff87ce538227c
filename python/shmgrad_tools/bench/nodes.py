"""The multi-node side of ``shmgrad bench --nodes N``: one node, i.e. one rank of a gloo
process group on 127.0.0.1 (started by torch.multiprocessing spawn) whose trainer runs its
own shmgrad engine and all-reduces with the other nodes' through
``shmgrad.Engine(..., process_group=...)``. Timed like a DDP rank (``ddp.py``): a barrier,
then this node's share of the batch; a step runs from the first node's start to the last
node's end."""

import contextlib
import os
import traceback

import torch.distributed as dist

from shmgrad.multinode import shard
from . import models
from .ddp import alternating_steps, ddp_step, join_local_group, rank_steps


def rank_main(
    rank,
    world,
    port,
    model_name,
    batch,
    warmup,
    repeats,
    seed,
    workers,
    engine_prefix,
    bucket_cap_mb,
    pin,
    queue,
    timeout_s,
):
    """Runs ``warmup + repeats`` steps of this node's share of each batch and puts
    ``(rank, {"start", "end", "allreduce", "compute", "grad", ...})`` on ``queue`` (or an
    error). With ``pin``, the node (trainer, coordinator, workers) runs on its share of
    the CPUs only, as a node on its own machine would."""
    try:
        if not pin:
            share_cores_with_other_nodes(world, workers)
        # One thread: the trainer copies its share in, waits and all-reduces.
        join_local_group(rank, world, port, timeout_s, pin)
        try:
            queue.put(
                (
                    rank,
                    _steps(
                        rank,
                        world,
                        model_name,
                        batch,
                        warmup,
                        repeats,
                        seed,
                        workers,
                        engine_prefix,
                        bucket_cap_mb,
                        timeout_s,
                    ),
                )
            )
        finally:
            dist.destroy_process_group()
    except BaseException:  # report, never hang the parent
        queue.put((rank, {"error": traceback.format_exc(limit=6)}))


def share_cores_with_other_nodes(nodes, workers):
    """Nodes on one machine share its cores, which an engine's spin rule does not know:
    it spins when its own step's processes (workers and trainer) have a core each. Apply
    the rule to every node's processes instead: no spinning (SHMGRAD_SPIN_US=0) when they
    outnumber the cores, unless SHMGRAD_SPIN_US is set already."""
    if nodes * (workers + 1) > len(os.sched_getaffinity(0)):
        os.environ.setdefault("SHMGRAD_SPIN_US", "0")


def _steps(
    rank,
    world,
    model_name,
    batch,
    warmup,
    repeats,
    seed,
    workers,
    engine_prefix,
    bucket_cap_mb,
    timeout_s,
):
    batches = models.make_batches(model_name, batch, warmup + repeats, seed)
    out = {}
    with node_step(
        rank,
        world,
        model_name,
        batch,
        batches[0][0],
        warmup,
        seed,
        workers,
        engine_prefix,
        bucket_cap_mb,
        timeout_s,
        out,
    ) as step:
        out.update(rank_steps(batches, warmup, step))
    return out


@contextlib.contextmanager
def node_step(
    rank,
    world,
    model_name,
    batch,
    x0,
    warmup,
    seed,
    workers,
    engine_prefix,
    bucket_cap_mb,
    timeout_s,
    out,
):
    """This node's engine, open for the ``with`` block, and its step on the node's share
    of a batch: ``step(i, x, y)``. Into ``out`` go each timed step's all-reduce seconds
    (``allreduce``) and slowest worker's forward and backward (``compute``), the bytes
    all-reduced, and the first step's gradient (rank 0). ``x0``: a batch's inputs, for
    the engine's input region."""
    model = models.make_model(model_name, seed)
    share = shard(range(batch), rank, world)
    lo, hi = share.start, share.stop
    out.update({"allreduce": [], "compute": [], "grad": None})
    with models.engine(
        model,
        workers,
        f"{engine_prefix}-{rank}",
        hi - lo,
        x0,
        min(120.0, timeout_s),
        process_group=dist.group.WORLD,
        bucket_cap_mb=bucket_cap_mb,
    ) as engine:
        grads = engine.gradient_tensors()  # read directly: no module is bound

        def step(i, x, y):
            st = engine.gradient(
                inputs=x[lo:hi], targets=y[lo:hi], reduction="sum", timeout=timeout_s
            )
            if i >= warmup:
                out["allreduce"].append(st.allreduce_seconds)
                out["compute"].append(max(st.compute_seconds, default=0.0))
            if i == 0 and rank == 0:
                out["grad"] = models.flat(grads).numpy()
            out["allreduce_bytes"] = st.allreduce_bytes

        yield step


def paired_rank_main(
    rank,
    world,
    port,
    model_name,
    batch,
    warmup,
    repeats,
    seed,
    workers,
    engine_prefix,
    bucket_cap_mb,
    pin,
    queue,
    timeout_s,
):
    """``--paired``: this rank is both a shmgrad node and a DDP rank, and each batch goes
    through both in turn (``ddp.alternating_steps``). Puts ``(rank, {"shmgrad-nodes":
    {...}, "ddp": {...}})`` on ``queue``, each like ``rank_main``'s (or an error)."""
    try:
        if not pin:
            share_cores_with_other_nodes(world, workers)
        join_local_group(rank, world, port, timeout_s, pin)
        try:
            batches = models.make_batches(model_name, batch, warmup + repeats, seed)
            node_out, ddp_out = {}, {}
            ddp_run = ddp_step(rank, world, model_name, batch, seed, ddp_out)
            with node_step(
                rank,
                world,
                model_name,
                batch,
                batches[0][0],
                warmup,
                seed,
                workers,
                engine_prefix,
                bucket_cap_mb,
                timeout_s,
                node_out,
            ) as node_run:
                times = alternating_steps(
                    batches, warmup, {"shmgrad-nodes": node_run, "ddp": ddp_run}
                )
            node_out.update(times["shmgrad-nodes"])
            ddp_out.update(times["ddp"])
            queue.put((rank, {"shmgrad-nodes": node_out, "ddp": ddp_out}))
        finally:
            dist.destroy_process_group()
    except BaseException:  # report, never hang the parent
        queue.put((rank, {"error": traceback.format_exc(limit=6)}))
