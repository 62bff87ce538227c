#!/usr/bin/env python3
"""Train the Fashion-MNIST CNN of train_fashion_mnist.py on several nodes: each node runs a
shmgrad engine for its share of every batch, and the nodes' trainers all-reduce the
reduced gradients through torch.distributed (gloo). Same model, global batch, learning
rate and epochs as the one-node demo, so the same accuracy.

Under torchrun, one trainer per node (on one machine, --standalone --nproc_per_node 2
stands for two nodes):

    torchrun --nnodes 2 --nproc_per_node 1 --rdzv_backend c10d \\
             --rdzv_endpoint HOST0:29400 examples/train_multinode.py       # on each node
    .venv/bin/python -m torch.distributed.run --standalone --nproc_per_node 2 \\
             examples/train_multinode.py --epochs 1                        # one machine

On a Dask cluster (one call per worker, or per host with --per-host):

    examples/train_multinode.py --dask tcp://SCHEDULER:8786
    examples/train_multinode.py --dask-local 2      # a LocalCluster of 2 worker processes

Each node starts with other initial weights (seed + rank); binding gives every node rank
0's, which are the one-node demo's. Rank 0 prints; every node checks at the end of each
epoch that its parameters are bit-identical to the others'.
"""

import argparse
import datetime
import os
import socket
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import shmgrad  # noqa: E402
from shmgrad.multinode import DEFAULT_TIMEOUT_S, shard  # noqa: E402
from fashion_mnist import FashionCNN, accuracy, load_split  # noqa: E402

TARGET_ACCURACY = 0.85
MASK64 = 2**64 - 1  # checksums print as unsigned


def parse_args(argv=None):
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--workers",
        type=int,
        default=None,
        help="engine workers per node (default: this host's cores divided among the nodes on it)",
    )
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=128, help="the global batch")
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--timeout",
        type=float,
        default=DEFAULT_TIMEOUT_S,
        help="seconds any collective may wait for a peer (default %(default)s)",
    )
    ap.add_argument(
        "--bucket-cap-mb",
        type=float,
        default=None,
        help="all-reduce in buckets of this many MiB (default: one call)",
    )
    launch = ap.add_mutually_exclusive_group()
    launch.add_argument(
        "--dask", metavar="SCHEDULER", help="run on the Dask cluster of this scheduler address"
    )
    launch.add_argument(
        "--dask-local",
        type=int,
        metavar="N",
        help="run on a Dask LocalCluster of N worker processes",
    )
    ap.add_argument(
        "--per-host", action="store_true", help="with --dask: one node per host, not per worker"
    )
    return ap.parse_args(argv)


def train(args):
    """One node's training; torch.distributed is initialised. Returns rank 0's figures
    (and every node's parameter checksum)."""
    rank, nodes = dist.get_rank(), dist.get_world_size()
    hosts = [None] * nodes
    dist.all_gather_object(hosts, socket.gethostname())
    workers = args.workers or max(1, (os.cpu_count() or 1) // hosts.count(socket.gethostname()))
    torch.set_num_threads(1)  # the trainer steps the optimizer; workers do the work
    torch.manual_seed(args.seed)
    model = FashionCNN()  # the one-node demo's weights, and then its batch order:
    order = torch.Generator()
    order.set_state(torch.get_rng_state())
    if rank > 0:  # other weights on the other nodes; bind() gives them rank 0's
        torch.manual_seed(args.seed + rank)
        model = FashionCNN()
    log = print if rank == 0 else (lambda *a, **k: None)
    log(
        f"shmgrad multi-node demo: {nodes} nodes x {workers} workers, global batch "
        f"{args.batch_size}, {args.epochs} epochs, {sum(p.numel() for p in model.parameters())} "
        "parameters"
    )
    test_x, test_y = load_split("test")
    with shmgrad.Engine(
        model=model,
        workers=workers,
        loss="cross_entropy",
        dataset="fashion-mnist",
        process_group=dist.group.WORLD,
        bucket_cap_mb=args.bucket_cap_mb,
    ) as engine:
        engine.bind(model)
        opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
        n = engine.dataset_size
        steps = (n + args.batch_size - 1) // args.batch_size
        for epoch in range(1, args.epochs + 1):
            # The same permutation on every node; each takes its share of each batch.
            perm = torch.randperm(n, generator=order)
            wall = compute = allreduce = loss_sum = 0.0
            t0 = time.perf_counter()
            for step in range(steps):
                idx = perm[step * args.batch_size : (step + 1) * args.batch_size]
                s0 = time.perf_counter()
                stats = engine.gradient(shard(idx, rank, nodes), reduction="mean")
                opt.step()
                wall += time.perf_counter() - s0
                compute += max(stats.compute_seconds, default=0.0)
                allreduce += stats.allreduce_seconds
                loss_sum += stats.loss_sum
                if (step + 1) % 100 == 0:
                    done = min((step + 1) * args.batch_size, n)
                    log(
                        f"  epoch {epoch} step {step + 1}/{steps} loss {loss_sum / done:.4f} "
                        f"{done / (time.perf_counter() - t0):.0f} ex/s",
                        flush=True,
                    )
            elapsed = time.perf_counter() - t0
            checksum = engine.check_consistency()  # raises unless every node agrees
            acc = accuracy(model, test_x, test_y)
            log(
                f"epoch {epoch}: test accuracy {acc * 100:.2f}%, {n / elapsed:.0f} examples/s, "
                f"train loss {loss_sum / n:.4f}; rank 0's step time: "
                f"{100 * allreduce / wall:.1f}% all-reduce, "
                f"{100 * (wall - compute - allreduce) / wall:.1f}% neither forward+backward nor "
                "all-reduce; parameters identical on every node (checksum "
                f"{checksum & MASK64:016x})",
                flush=True,
            )
    return {"rank": rank, "accuracy": acc, "examples_per_s": n / elapsed, "checksum": checksum}


def run_dask(args):
    import logging

    from distributed import Client, LocalCluster

    if args.dask:
        client, cluster = Client(args.dask), None
    else:
        cluster = LocalCluster(
            n_workers=args.dask_local,
            processes=True,
            threads_per_worker=1,
            dashboard_address=None,
            silence_logs=logging.ERROR,
        )
        client = Client(cluster)
    try:
        import cloudpickle
        import fashion_mnist

        import shmgrad.dask

        # The workers (and Dask's scheduler) unpickle `train` and what it uses: ship this
        # example's helper module with it, so that no machine needs examples/ on its path.
        cloudpickle.register_pickle_by_value(fashion_mnist)
        results = shmgrad.dask.run(
            client, train, args, per_host=args.per_host, timeout=args.timeout
        )
    finally:
        client.close()
        if cluster is not None:
            cluster.close()
    for r in results:
        print(
            f"rank {r['rank']}: test accuracy {r['accuracy'] * 100:.2f}%, "
            f"checksum {r['checksum'] & MASK64:016x}"
        )
    return results[0]


def main(argv=None):
    args = parse_args(argv)
    if args.dask or args.dask_local:
        result = run_dask(args)
    elif "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # torchrun
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.timeout))
        try:
            result = train(args)
        finally:
            dist.destroy_process_group()
    else:
        sys.exit("run under torchrun, or with --dask SCHEDULER / --dask-local N (see --help)")
    return 0 if result["accuracy"] >= TARGET_ACCURACY else 1


if __name__ == "__main__":
    sys.exit(main())
