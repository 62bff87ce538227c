"""The multi-node side of ``shmgrad bench --nodes N``: one node, i.e. one rank of a gloo
process group on 127.0.0.1 (started by torch.multiprocessing spawn) whose trainer runs its
own shmgrad engine and all-reduces with the other nodes' through
``shmgrad.Engine(..., process_group=...)``. Timed like a DDP rank (``ddp.py``): a barrier,
then this node's share of the batch; a step runs from the first node's start to the last
node's end."""

import datetime
import math
import os
import traceback

import torch
import torch.distributed as dist

from ..distributed import shard
from ..engine import Engine
from . import models
from .timing import loopback_bytes, now, pin_to_share


def rank_main(rank, world, port, model_name, batch, warmup, repeats, seed, workers,
              engine_prefix, bucket_cap_mb, pin, queue, timeout_s):
    """Runs ``warmup + repeats`` steps of this node's share of each batch and puts
    ``(rank, {"start", "end", "allreduce", "compute", "grad", ...})`` on ``queue`` (or an
    error). With ``pin``, the node (trainer, coordinator, workers) runs on its share of
    the CPUs only, as a node on its own machine would."""
    try:
        if pin:
            pin_to_share(rank, world)
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        os.environ["MASTER_PORT"] = str(port)
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        models.set_threads(1)  # the trainer copies its share in, waits and all-reduces
        dist.init_process_group("gloo", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=timeout_s))
        try:
            queue.put((rank, _steps(rank, world, model_name, batch, warmup, repeats, seed,
                                    workers, engine_prefix, bucket_cap_mb, timeout_s)))
        finally:
            dist.destroy_process_group()
    except BaseException:  # report, never hang the parent
        queue.put((rank, {"error": traceback.format_exc(limit=6)}))


def _steps(rank, world, model_name, batch, warmup, repeats, seed, workers, engine_prefix,
           bucket_cap_mb, timeout_s):
    model = models.make_model(model_name, seed)
    batches = models.make_batches(model_name, batch, warmup + repeats, seed)
    share = shard(range(batch), rank, world)
    lo, hi = share.start, share.stop
    in_mb = batches[0][0].numel() * 4 / 2**20
    out = {"start": [], "end": [], "allreduce": [], "compute": [], "grad": None}
    with Engine(model=model, workers=workers, loss="cross_entropy",
                name=f"{engine_prefix}-{rank}", threads_per_worker=1, max_batch=max(1, hi - lo),
                input_capacity_mb=max(64, int(math.ceil(in_mb)) + 1),
                startup_timeout=min(120.0, timeout_s), process_group=dist.group.WORLD,
                bucket_cap_mb=bucket_cap_mb) as engine:
        for i, (x, y) in enumerate(batches):
            if i == warmup:
                dist.barrier()
                lo_bytes = loopback_bytes()
            dist.barrier()  # every node starts the step together
            t0 = now()
            st = engine.gradient(inputs=x[lo:hi], targets=y[lo:hi], reduction="sum",
                                 timeout=timeout_s)
            t1 = now()
            if i >= warmup:
                out["start"].append(t0)
                out["end"].append(t1)
                out["allreduce"].append(st.allreduce_seconds)
                out["compute"].append(max(st.compute_seconds, default=0.0))
            if i == 0 and rank == 0:
                out["grad"] = torch.cat([g.detach().reshape(-1).double()
                                         for g in engine.gradient_tensors()]).numpy()
        dist.barrier()
        out["loopback_bytes"] = loopback_bytes() - lo_bytes
        out["allreduce_bytes"] = st.allreduce_bytes
    return out
