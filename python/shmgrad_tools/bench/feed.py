"""Where a short one-worker step's time goes: eager PyTorch against shmgrad fed two ways.

Alternates, step by step in one process, three ways to compute the gradient of the same
batch with the same model:

* ``eager``: forward and backward in this process, 1 thread (what DDP runs with N=1);
* ``inputs``: ``engine.gradient(inputs=x, targets=y)``, which copies the batch into the
  engine's shared memory (what ``shmgrad bench`` measures);
* ``indices``: ``engine.gradient(indices)`` into a dataset the engine already holds
  (what training on the engine's dataset does).

It prints each one's median step time, the engine's own overhead (its wall time minus
the slowest worker's forward+backward) and the time of copying the batch alone. It
checks on the first step that all three gave the same gradient (exit status 1 if not).
Run: ``.venv/bin/python -m shmgrad_tools.bench.feed --model mlp --batch 512 --workers 1``
"""

import argparse
import os
import statistics
import sys
import tempfile
import time

import numpy as np
import torch

from shmgrad import Engine
from shmgrad.testing import relative_error
from . import models


def main(argv=None):
    ap = argparse.ArgumentParser(
        prog="python3 -m shmgrad_tools.bench.feed",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--model", choices=sorted(models.MODELS), default="mlp")
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--steps", type=int, default=400, help="timed steps of each kind")
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--batches", type=int, default=8, help="distinct batches, used in turn")
    args = ap.parse_args(argv)
    if args.warmup < 1 or args.steps < 1 or args.batch < 1 or args.batches < 1:
        ap.error(
            "--warmup, --steps, --batch and --batches must be at least 1 "
            "(the first, untimed step also checks the gradients)"
        )

    models.set_threads(1)
    batches = models.make_batches(args.model, args.batch, args.batches)
    xs = torch.cat([x for x, _ in batches])
    ys = torch.cat([y for _, y in batches])
    ref = models.make_model(args.model)
    times = {k: [] for k in ("eager", "inputs", "indices", "copy")}
    overhead = {"inputs": [], "indices": []}
    grad_diff = {}
    with tempfile.TemporaryDirectory(prefix="shmgrad-feed-") as tmp:
        xpath, ypath = os.path.join(tmp, "x.npy"), os.path.join(tmp, "y.npy")
        np.save(xpath, xs.numpy())
        np.save(ypath, ys.numpy().astype(np.int64))
        with Engine(
            model=models.make_model(args.model),
            workers=args.workers,
            loss="cross_entropy",
            threads_per_worker=1,
            max_batch=args.batch,
            dataset=f"npy:{xpath},{ypath}",
        ) as engine:
            buf = torch.empty_like(batches[0][0])
            for step in range(args.warmup + args.steps):
                i = step % args.batches
                x, y = batches[i]
                idx = torch.arange(i * args.batch, (i + 1) * args.batch)
                t = [time.perf_counter()]
                for p in ref.parameters():
                    p.grad = None
                torch.nn.functional.cross_entropy(ref(x), y, reduction="sum").backward()
                t.append(time.perf_counter())
                st_in = engine.gradient(inputs=x, targets=y, reduction="sum")
                t.append(time.perf_counter())
                if step == 0:
                    grad_diff["inputs"] = relative_error(
                        engine.gradient_tensors(), models.flat_grad(ref)
                    )
                st_ix = engine.gradient(idx, reduction="sum")
                t.append(time.perf_counter())
                buf.copy_(x)
                t.append(time.perf_counter())
                if step == 0:
                    grad_diff["indices"] = relative_error(
                        engine.gradient_tensors(), models.flat_grad(ref)
                    )
                if step < args.warmup:
                    continue
                for k, a, b in zip(("eager", "inputs", "indices", "copy"), t, t[1:]):
                    times[k].append(b - a)
                for k, st in (("inputs", st_in), ("indices", st_ix)):
                    overhead[k].append(st.wall_seconds - max(st.compute_seconds))

    ms = lambda v: statistics.median(v) * 1e3  # noqa: E731
    eager = ms(times["eager"])
    print(
        f"{args.model}, batch {args.batch}, {args.workers} worker(s), {args.steps} steps of each, "
        f"median step time:"
    )
    print(f"  eager, 1 thread     {eager:9.3f} ms")
    for k in ("inputs", "indices"):
        print(
            f"  shmgrad {k + '=':11s} {ms(times[k]):9.3f} ms ({ms(times[k]) / eager:.2f}x eager; "
            f"engine overhead {ms(overhead[k]):.3f} ms)"
        )
    print(f"  copying the batch   {ms(times['copy']):9.3f} ms")
    print(
        "gradients against eager on the first batch: relative difference "
        + ", ".join(f"{k}= {v:.1e}" for k, v in grad_diff.items())
    )
    if any(v > 1e-4 for v in grad_diff.values()):
        print("FAIL: shmgrad's gradient differs from eager PyTorch's")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
