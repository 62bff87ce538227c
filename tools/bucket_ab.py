"""The bucketed reduction against the unbucketed one, paired: two engines on the same model
and batch, one started with SHMGRAD_BUCKET_KB=0 (the reduction after every backward) and
one with the default buckets, alternating blocks of steps in the same process (so the
machine's drift reaches both alike). Prints each one's median step, its slowest worker's
reduction and the part of it done before the last worker finished computing, and the
ratio of the medians (above 1: buckets are faster). docs/BENCHMARKS.md cites its runs.

    .venv/bin/python tools/bucket_ab.py --mode script --model mlp2 --batch 256
"""

import argparse
import os
import statistics
import time
import warnings

import torch

import shmgrad
from shmgrad_tools.bench import models


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mode", choices=("script", "eager"), default="script")
    ap.add_argument("--model", default="mlp2", choices=models.MODELS)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--steps", type=int, default=10, help="timed steps per block")
    args = ap.parse_args()
    warnings.simplefilter("ignore", FutureWarning)  # TorchScript workers, on purpose
    models.set_threads(1)
    x, y = models.make_batches(args.model, args.batch, 1)[0]
    engines = {}
    for label, kb in (("unbucketed", "0"), ("bucketed", None)):
        # Read when the trainer attaches; empty: the default.
        os.environ["SHMGRAD_BUCKET_KB"] = "" if kb is None else kb
        model = models.make_model(args.model, 0)
        options = {"mode": "script", "loss": "cross_entropy"}
        if args.mode == "eager":
            options = {"mode": "eager", "loss": torch.nn.CrossEntropyLoss()}
        engine = shmgrad.Engine(
            model=model,
            workers=args.workers,
            threads_per_worker=1,
            max_batch=args.batch,
            name=f"bucket-ab-{label}-{os.getpid()}",
            **options,
        )
        engine.__enter__()
        engine.gradient_tensors()  # read directly: no module bound
        engines[label] = engine
    os.environ["SHMGRAD_BUCKET_KB"] = ""
    rows = {label: {"step": [], "reduce": [], "early": []} for label in engines}
    try:
        for _ in range(args.rounds):
            for label, engine in engines.items():
                for _ in range(3):  # untimed: the other engine's block ran before
                    engine.gradient(inputs=x, targets=y)
                for _ in range(args.steps):
                    t = time.perf_counter()
                    st = engine.gradient(inputs=x, targets=y)
                    rows[label]["step"].append(time.perf_counter() - t)
                    rows[label]["reduce"].append(max(st.reduce_seconds_per_worker))
                    rows[label]["early"].append(max(st.reduce_early_seconds))
    finally:
        for engine in engines.values():
            engine.__exit__(None, None, None)
    med = {
        label: {k: statistics.median(v) * 1e3 for k, v in r.items()} for label, r in rows.items()
    }
    print(
        f"{args.mode} workers, {args.model} batch {args.batch}, {args.workers} workers: "
        f"medians in ms over {args.rounds * args.steps} steps each"
    )
    for label, m in med.items():
        print(
            f"  {label:<10} step {m['step']:8.3f}  reduce {m['reduce']:7.3f}  "
            f"early {m['early']:7.3f}"
        )
    print(f"  unbucketed / bucketed: {med['unbucketed']['step'] / med['bucketed']['step']:.3f}x")


if __name__ == "__main__":
    main()
