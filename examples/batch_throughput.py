#!/usr/bin/env python3
"""Training throughput of the Fashion-MNIST CNN through one engine, per batch size and
max_examples_per_pass: what a growing batch buys on this machine.

Each configuration trains (gradient + SGD step) on --examples examples per round; the
configurations alternate round by round, so background load hits all of them alike.
Prints the median examples/s over the rounds, and min and max, and where a step's time
goes beyond the workers' compute (medians over all steps): the engine's own overhead
(its wall time minus the slowest worker's forward+backward), the rest of the
`engine.gradient` call in the trainer, and `optimizer.step()`.

Run: .venv/bin/python examples/batch_throughput.py
"""

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import shmgrad  # noqa: E402
from fashion_mnist import FashionCNN  # noqa: E402


def main():
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--batch-sizes", default="128,256,512,1024")
    ap.add_argument(
        "--passes",
        default="32,128,0",
        help="max_examples_per_pass values to try (0: one pass per shard)",
    )
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument(
        "--examples", type=int, default=4096, help="examples per configuration per round"
    )
    args = ap.parse_args()

    configs = [
        (b, p)
        for b in map(int, args.batch_sizes.split(","))
        for p in map(int, args.passes.split(","))
        if p == 0 or p < b
    ]
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = FashionCNN()
    rates = {c: [] for c in configs}
    parts = {c: {"compute": [], "engine": [], "trainer": [], "step": []} for c in configs}
    with shmgrad.Engine(
        model=model,
        workers=args.workers,
        loss="cross_entropy",
        dataset="fashion-mnist",
        min_examples_per_worker=4,
    ) as engine:
        engine.bind(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        n = engine.dataset_size
        perm = torch.randperm(n)
        pos = 0
        engine.gradient(perm[:128])  # warm up the workers
        for _ in range(args.rounds):
            for bs, per_pass in configs:
                done, t0 = 0, time.perf_counter()
                while done < args.examples:
                    if pos + bs > n:
                        pos = 0
                    t_call = time.perf_counter()
                    st = engine.gradient(
                        perm[pos : pos + bs], reduction="mean", max_examples_per_pass=per_pass
                    )
                    t_step = time.perf_counter()
                    opt.step()
                    t_end = time.perf_counter()
                    slowest = max(st.compute_seconds)
                    part = parts[(bs, per_pass)]
                    part["compute"].append(slowest)
                    part["engine"].append(st.wall_seconds - slowest)
                    part["trainer"].append(t_step - t_call - st.wall_seconds)
                    part["step"].append(t_end - t_step)
                    pos += bs
                    done += bs
                rates[(bs, per_pass)].append(done / (time.perf_counter() - t0))
    print(
        f"Fashion-MNIST CNN, {args.workers} workers, {args.rounds} rounds of "
        f"{args.examples} examples:"
    )
    for (bs, per_pass), v in rates.items():
        print(
            f"  batch {bs:5d}, max_examples_per_pass {per_pass or 'off':>4}: median "
            f"{statistics.median(v):7.0f} examples/s (min {min(v):.0f}, max {max(v):.0f}); "
            + ", ".join(
                f"{k} {statistics.median(t) * 1e3:.3f}" for k, t in parts[(bs, per_pass)].items()
            )
            + " ms a step"
        )


if __name__ == "__main__":
    main()
