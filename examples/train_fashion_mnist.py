#!/usr/bin/env python3
"""Train a small CNN on Fashion-MNIST through a shmgrad engine.

The engine loads the 60000 training images once into shared memory; every step this
script sends only the batch's indices, the workers write their gradients straight into
shared memory and reduce them in place, and torch.optim.SGD updates the shared
parameters that every worker reads. Run: .venv/bin/python examples/train_fashion_mnist.py
"""

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import shmgrad  # noqa: E402
from fashion_mnist import FashionCNN, accuracy, load_split  # noqa: E402


def main():
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    torch.manual_seed(args.seed)
    model = FashionCNN()
    test_x, test_y = load_split("test")
    print(
        f"shmgrad demo: Fashion-MNIST, {sum(p.numel() for p in model.parameters())} parameters, "
        f"{args.workers} workers, batch {args.batch_size}, {args.epochs} epochs"
    )
    with shmgrad.Engine(
        model=model, workers=args.workers, loss="cross_entropy", dataset="fashion-mnist"
    ) as engine:
        engine.bind(model)
        opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
        n = engine.dataset_size
        steps_per_epoch = (n + args.batch_size - 1) // args.batch_size
        tty = sys.stdout.isatty()
        cr = "\r" if tty else ""
        for epoch in range(1, args.epochs + 1):
            perm = torch.randperm(n)
            wall = compute = 0.0
            loss_sum = 0.0
            t0 = time.perf_counter()
            for step in range(steps_per_epoch):
                idx = perm[step * args.batch_size : (step + 1) * args.batch_size]
                s0 = time.perf_counter()
                stats = engine.gradient(idx, reduction="mean")
                opt.step()
                step_time = time.perf_counter() - s0
                wall += step_time
                compute += max(stats.compute_seconds)
                loss_sum += stats.loss_sum
                every = 25 if tty else 100
                if (step + 1) % every == 0 or step + 1 == steps_per_epoch:
                    done = (step + 1) * args.batch_size
                    print(
                        f"{cr}  epoch {epoch} step {step + 1}/{steps_per_epoch} "
                        f"loss {loss_sum / min(done, n):.4f} "
                        f"{min(done, n) / (time.perf_counter() - t0):.0f} ex/s",
                        end="" if tty else "\n",
                        flush=True,
                    )
            elapsed = time.perf_counter() - t0
            acc = accuracy(model, test_x, test_y)
            print(
                f"{cr}epoch {epoch}: test accuracy {acc * 100:.2f}%, {n / elapsed:.0f} examples/s, "
                f"train loss {loss_sum / n:.4f}, share of step time not forward+backward "
                f"{100 * (wall - compute) / wall:.1f}%"
            )
        print(engine.status().text.rstrip())
    return 0 if acc >= 0.85 else 1


if __name__ == "__main__":
    sys.exit(main())
