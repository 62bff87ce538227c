"""The multi-node side of ``shmgrad bench --nodes N``: one node, i.e. one rank of a gloo
process group on 127.0.0.1 (started by torch.multiprocessing spawn) whose trainer runs its
own shmgrad engine and all-reduces with the other nodes' through
``shmgrad.Engine(..., process_group=...)``. Timed like a DDP rank (``ddp.py``): a barrier,
then this node's share of the batch; a step runs from the first node's start to the last
node's end."""

import contextlib
import dataclasses
import os
import traceback
from typing import Optional

import torch.distributed as dist

from shmgrad.multinode import shard
from . import models
from .ddp import alternating_steps, ddp_step, join_local_group, rank_steps


@dataclasses.dataclass(frozen=True)
class NodeRun:
    """What every rank of a ``--nodes`` run is given (spawn pickles it to each)."""

    world: int  # the nodes
    model_name: str
    batch: int  # the global batch, shared out with shmgrad.multinode.shard
    warmup: int
    repeats: int
    seed: int
    workers: int  # per node
    engine_prefix: str
    bucket_cap_mb: Optional[float] = None
    pin: bool = False  # each node on its share of the CPUs

    def batches(self):
        """The run's batches (warm-up and timed), the same on every rank."""
        return models.make_batches(
            self.model_name, self.batch, self.warmup + self.repeats, self.seed
        )


@contextlib.contextmanager
def _joined(rank, run, port, timeout_s):
    """This rank in the run's gloo group (its store on 127.0.0.1:``port``) for the
    ``with`` block. Nodes on one machine share its cores: see share_cores_with_other_nodes."""
    if not run.pin:
        share_cores_with_other_nodes(run.world, run.workers)
    join_local_group(rank, run.world, port, timeout_s, run.pin)
    try:
        yield
    finally:
        dist.destroy_process_group()


def rank_main(rank, run: NodeRun, port, queue, timeout_s):
    """Runs ``warmup + repeats`` steps of this node's share of each batch and puts
    ``(rank, {"start", "end", "allreduce", "compute", "grad", ...})`` on ``queue`` (or an
    error). With ``pin``, the node (trainer, coordinator, workers) runs on its share of
    the CPUs only, as a node on its own machine would."""
    try:
        # One thread: the trainer copies its share in, waits and all-reduces.
        with _joined(rank, run, port, timeout_s):
            batches = run.batches()
            out = {}
            with node_step(rank, run, batches[0][0], timeout_s, out) as step:
                out.update(rank_steps(batches, run.warmup, step))
            queue.put((rank, out))
    except BaseException:  # report, never hang the parent
        queue.put((rank, {"error": traceback.format_exc(limit=6)}))


def share_cores_with_other_nodes(nodes, workers):
    """Nodes on one machine share its cores, which an engine's spin rule does not know:
    it spins when its own step's processes (workers and trainer) have a core each. Apply
    the rule to every node's processes instead: no spinning (SHMGRAD_SPIN_US=0) when they
    outnumber the cores, unless SHMGRAD_SPIN_US is set already."""
    if nodes * (workers + 1) > len(os.sched_getaffinity(0)):
        os.environ.setdefault("SHMGRAD_SPIN_US", "0")


@contextlib.contextmanager
def node_step(rank, run: NodeRun, x0, timeout_s, out):
    """This node's engine, open for the ``with`` block, and its step on the node's share
    of a batch: ``step(i, x, y)``. Into ``out`` go each timed step's all-reduce seconds
    (``allreduce``) and slowest worker's forward and backward (``compute``), the bytes
    all-reduced, and the first step's gradient (rank 0). ``x0``: a batch's inputs, for
    the engine's input region."""
    model = models.make_model(run.model_name, run.seed)
    share = shard(range(run.batch), rank, run.world)
    lo, hi = share.start, share.stop
    out.update({"allreduce": [], "compute": [], "grad": None})
    with models.engine(
        model,
        run.workers,
        f"{run.engine_prefix}-{rank}",
        hi - lo,
        x0,
        min(120.0, timeout_s),
        process_group=dist.group.WORLD,
        bucket_cap_mb=run.bucket_cap_mb,
    ) as engine:
        grads = engine.gradient_tensors()  # read directly: no module is bound

        def step(i, x, y):
            st = engine.gradient(
                inputs=x[lo:hi], targets=y[lo:hi], reduction="sum", timeout=timeout_s
            )
            if i >= run.warmup:
                out["allreduce"].append(st.allreduce_seconds)
                out["compute"].append(max(st.compute_seconds, default=0.0))
            if i == 0 and rank == 0:
                out["grad"] = models.flat(grads).numpy()
            out["allreduce_bytes"] = st.allreduce_bytes

        yield step


def paired_rank_main(rank, run: NodeRun, port, queue, timeout_s):
    """``--paired``: this rank is both a shmgrad node and a DDP rank, and each batch goes
    through both in turn (``ddp.alternating_steps``). Puts ``(rank, {"shmgrad-nodes":
    {...}, "ddp": {...}})`` on ``queue``, each like ``rank_main``'s (or an error)."""
    try:
        with _joined(rank, run, port, timeout_s):
            batches = run.batches()
            node_out, ddp_out = {}, {}
            ddp_run = ddp_step(rank, run.world, run.model_name, run.batch, run.seed, ddp_out)
            with node_step(rank, run, batches[0][0], timeout_s, node_out) as node_run:
                times = alternating_steps(
                    batches, run.warmup, {"shmgrad-nodes": node_run, "ddp": ddp_run}
                )
            node_out.update(times["shmgrad-nodes"])
            ddp_out.update(times["ddp"])
            queue.put((rank, {"shmgrad-nodes": node_out, "ddp": ddp_out}))
    except BaseException:  # report, never hang the parent
        queue.put((rank, {"error": traceback.format_exc(limit=6)}))
