"""Direct linear layers against the write-first copy, paired: two engines of the same model
in one trainer process, one started with SHMGRAD_DIRECT_LINEAR=1 (linear layers compute
their weight and bias gradients straight into the slot, worker/direct_linear.h) and one
with 0 (computed apart and copied in), taking turns step by step on the same batches (the
order reversed every other step), the trainer's threads "auto", the bench's heap settings
(the tool runs itself again with them where the environment lacks them). Prints, per
configuration, each engine's median step and the
median of the per-step ratios copied / direct (above 1: direct is faster); with --json,
writes them. docs/BENCHMARKS.md cites its runs.

    .venv/bin/python tools/direct_linear_ab.py --mode script --configs mlp:32:2x1,mlp2:32:2x1
"""

import argparse
import json
import os
import statistics
import sys
import time


def run_config(model_name, batch, workers, threads, mode, steps, warmup):
    import shmgrad
    from shmgrad_tools.bench import models

    batches = models.make_batches(model_name, batch, 8, seed=1)
    engines = {}
    times = {"1": [], "0": []}
    try:
        for direct in ("1", "0"):
            os.environ["SHMGRAD_DIRECT_LINEAR"] = direct  # read by the workers at start
            engines[direct] = shmgrad.Engine(
                model=models.make_model(model_name, seed=0),
                workers=workers,
                threads_per_worker=threads,
                loss="cross_entropy",
                mode=mode,
            )
            engines[direct].bind(models.make_model(model_name, seed=0))
        for i in range(warmup + steps):
            x, y = batches[i % len(batches)]
            for direct in ("1", "0") if i % 2 == 0 else ("0", "1"):
                t0 = time.perf_counter()
                engines[direct].gradient(inputs=x, targets=y, reduction="sum")
                if i >= warmup:
                    times[direct].append(time.perf_counter() - t0)
    finally:
        os.environ["SHMGRAD_DIRECT_LINEAR"] = "1"  # the default again
        for e in engines.values():
            e.close()
    ratios = [c / d for d, c in zip(times["1"], times["0"])]
    return {
        "model": model_name,
        "batch": batch,
        "workers": workers,
        "threads": threads,
        "direct_s": statistics.median(times["1"]),
        "copied_s": statistics.median(times["0"]),
        "copied_over_direct": statistics.median(ratios),
    }


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--mode", default="script", choices=("script", "eager"))
    p.add_argument(
        "--configs",
        default="mlp:32:2x1,mlp:128:2x1,mlp2:32:2x1,mlp2:128:2x1,mlp2:512:2x1,cnn:32:2x1,cnn:128:2x1",
        help="model:batch:WORKERSxTHREADS, comma-separated",
    )
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    import shmgrad

    heap = shmgrad.heap_environment()
    if any(os.environ.get(k) != v for k, v in heap.items()):
        # The heap settings take effect at the process's start: run again with them.
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **heap})
    results = []
    print(f"{args.mode} workers, {args.steps} steps each, paired; heap settings alike")
    for config in args.configs.split(","):
        model_name, batch, place = config.split(":")
        workers, threads = (int(n) for n in place.split("x"))
        r = run_config(model_name, int(batch), workers, threads, args.mode, args.steps, args.warmup)
        results.append(r)
        direct_ms, copied_ms = r["direct_s"] * 1e3, r["copied_s"] * 1e3
        print(
            f"  {model_name:5s} b{batch:<4s} {workers}x{threads}  direct {direct_ms:8.3f} ms"
            f"  copied {copied_ms:8.3f} ms  copied/direct {r['copied_over_direct']:.3f}",
            flush=True,
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"results": results, "args": vars(args)}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
