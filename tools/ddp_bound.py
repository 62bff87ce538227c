"""How close DDP over the ``shmgrad`` backend can come to the engine's step: the same
model and batch through variants of DDP and through two engines, in the same W = 2 rank
processes, taking turns step by step (bench.ddp.alternating_steps: a barrier before every
step, the order reversed every other step), one intra-op thread per rank, the bench's heap
settings. Rank 0's times are reported (every step starts at a barrier of both ranks):

  plain      the rank's shard, forward and backward, no DDP, no communication: the floor;
  free       DDP with a comm hook that returns the bucket untouched: all of DDP's own
             work (its autograd hooks, the buckets' copies in and out, its forward
             wrapper) and no communication at all;
  free+wait  the same, then one barrier: DDP's own work plus waiting for the slower rank,
             the least any synchronous all-reduce of the gradient must cost;
  arena      DDP as a script runs it: its buckets allocated in the group's arena
             (DDP_DISABLE_COMM_MEM=0), all-reduced in place;
  staged     the same with the buckets in ordinary memory (DDP_DISABLE_COMM_MEM=1 while
             the model is built): the staged all-reduce;
  bucket-views  ``arena`` with gradient_as_bucket_view=True (no copies of the gradient
             into and out of the buckets);
  engine     shmgrad.Engine with 2 TorchScript workers of one thread, and with 2 eager
             workers (``engine-eager``), in rank 0's process; rank 1 waits at the next
             barrier meanwhile.

Prints each one's median and its ratio to the TorchScript engine; with --json, writes
them. docs/BENCHMARKS.md cites its runs.

    .venv/bin/python tools/ddp_bound.py --model mlp --batch 128
"""

import argparse
import json
import os
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from shmgrad_tools.bench import models
from shmgrad_tools.bench.ddp import alternating_steps, join_local_group

HEAP = {
    "MALLOC_MMAP_MAX_": "0",
    "MALLOC_TRIM_THRESHOLD_": "2147483647",
    "MALLOC_TOP_PAD_": "16777216",
}
DDP_VARIANTS = ("plain", "free", "free+wait", "arena", "staged", "bucket-views")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def untouched(state, bucket):
    """A comm hook that communicates nothing."""
    fut = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


def ddp_step(kind, name, rank, world, batch):
    os.environ["DDP_DISABLE_COMM_MEM"] = "1" if kind == "staged" else "0"
    model = models.make_model(name, 0)
    net = model
    if kind != "plain":
        net = torch.nn.parallel.DistributedDataParallel(
            model, gradient_as_bucket_view=kind == "bucket-views"
        )
        if kind.startswith("free"):
            net.register_comm_hook(None, untouched)
    lo, hi = batch * rank // world, batch * (rank + 1) // world

    def step(i, x, y):
        for p in model.parameters():
            p.grad = None
        F.cross_entropy(net(x[lo:hi]), y[lo:hi], reduction="sum").backward()
        if kind == "free+wait":
            dist.barrier()

    return step


def rank_main(rank, world, port, name, batch, steps, queue):
    try:
        join_local_group(rank, world, port, 120, False, "shmgrad")
        batches = models.make_batches(name, batch, steps, 1)
        run = {kind: ddp_step(kind, name, rank, world, batch) for kind in DDP_VARIANTS}
        engines = []
        for mode in ("script", "eager"):
            system = "engine" if mode == "script" else "engine-eager"
            if rank == 0:
                e = models.engine(
                    models.make_model(name, 0), world, f"ddp-bound-{mode}-{os.getpid()}",
                    batch, batches[0][0], 120, mode=mode,
                )  # fmt: skip
                engines.append(e)
                run[system] = lambda i, x, y, e=e: e.gradient(
                    inputs=x, targets=y, reduction="sum", timeout=60
                )
            else:
                run[system] = lambda i, x, y: None
        times = alternating_steps(batches, min(10, steps // 4), run)
        for e in engines:
            e.close()
        if rank == 0:
            queue.put(
                {
                    k: statistics.median(e - s for s, e in zip(v["start"], v["end"]))
                    for k, v in times.items()
                    if k != "loopback_bytes"
                }
            )
        dist.destroy_process_group()
    except BaseException as exc:  # noqa: BLE001  (reported, never a hang)
        queue.put({"error": f"rank {rank}: {type(exc).__name__}: {exc}"})


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="mlp", choices=sorted(models.MODELS))
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--steps", type=int, default=60, help="per variant, 10 of them warm-up")
    ap.add_argument("--json", help="write the medians (seconds) here")
    args = ap.parse_args(argv)
    for k, v in HEAP.items():
        os.environ.setdefault(k, v)  # the spawned ranks and the engines inherit them
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=rank_main, args=(r, 2, port, args.model, args.batch, args.steps, queue))
        for r in range(2)
    ]
    for p in procs:
        p.start()
    try:
        medians = queue.get(timeout=600)
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    if "error" in medians:
        print(medians["error"], file=sys.stderr)
        return 1
    base = medians["engine"]
    print(f"{args.model} batch {args.batch}, 2 ranks / 2 workers of one thread, rank 0's medians")
    for k, v in medians.items():
        print(f"  {k:13s} {v * 1e3:8.3f} ms   {v / base:6.3f}x the TorchScript engine")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "model": args.model,
                    "batch": args.batch,
                    "steps": args.steps,
                    "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                    "torch": torch.__version__,
                    "median_s": medians,
                },
                f,
                indent=1,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
