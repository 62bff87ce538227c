"""Where a short step's fixed cost goes: every microsecond beyond forward and backward.

Runs one engine per worker count on the same model and batches, and per step splits the
time of ``engine.gradient(inputs=x, targets=y)``, as seen from this Python process, into:

  python    the Python wrapper and the binding (argument checks, tensor conversion, the
            stats object): the call's time here minus the engine's own wall time;
  prepare   the native call up to publishing the step: checks and copying the batch in;
  wake      publish until the last participant starts: the futex wake-up latency;
  compute   the slowest participant's forward and backward (not a fixed cost);
  barrier   waiting at the compute barrier for the others (0 with one worker);
  reduce    the reduce phase: the slice sums (several workers) or the non-finite check
            of the result (one worker, whose backward wrote the result: no copy);
  early     of reduce, the most any worker did before the slowest finished computing
            (bucketed steps, docs/DESIGN.md "Buckets"): hidden behind that wait, so only
            reduce - early of it follows the slowest worker's backward;
  complete  the rest of the step until the last reducer's done (record, done store);
  finish    done until the call returns: the trainer's wake-up and collecting results;
  fixed     everything but compute.

Alongside, in the same process and in alternating blocks of steps, ``eager`` times
forward and backward of the same model in this process with one thread (what DDP runs at
N = 1), and ``copy`` times copying the batch alone. Medians in microseconds.

With ``--sleep-ms S`` the workers' compute is a fixed sleep instead (eager workers whose
forward sleeps S ms, then computes the loss of the tiny model): sleeping workers need no
core, so many workers on a few cores measure what the engine's own wake-ups, barriers
and reduction cost as the worker count grows. The batch is then 4 examples per worker.

Each worker has one intra-op thread, or ``--threads T`` (one worker of 2 threads: the
placement the probe keeps for a short step on 2 cores).

Run: ``.venv/bin/python -m shmgrad_tools.bench.breakdown --model mlp --batch 32 --workers 1,2``
or ``... --sleep-ms 2 --workers 1,2,4,8,16``
"""

import argparse
import functools
import json
import statistics
import sys
import time
import warnings

import torch

from shmgrad import Engine
from . import models

ROUNDS = 4  # engine and eager steps alternate in blocks, this many times
PARTS = (
    "python",
    "prepare",
    "wake",
    "compute",
    "barrier",
    "reduce",
    "early",
    "complete",
    "finish",
    "fixed",
    "total",
)


def step_parts(dt, st):
    """The parts of one step (seconds) from the Python-side time and the stats."""
    per_worker = list(zip(st.compute_seconds, st.wait_seconds, st.reduce_seconds_per_worker))
    compute = max(c for c, _, _ in per_worker)
    barrier = max(w for _, w, _ in per_worker)
    reduce = max(r for _, _, r in per_worker)
    worker_span = max(c + w + r for c, w, r in per_worker)
    return {
        "python": dt - st.wall_seconds,
        "prepare": st.prepare_seconds,
        "wake": st.wake_seconds,
        "compute": compute,
        "barrier": barrier,
        "reduce": reduce,
        "early": max(st.reduce_early_seconds),
        "complete": max(0.0, st.step_seconds - st.wake_seconds - worker_span),
        "finish": st.finish_seconds,
        "fixed": dt - compute,
        "total": dt,
    }


def sleeping_forward(seconds, model, batch):
    """An eager worker's forward whose compute is a fixed sleep (--sleep-ms)."""
    time.sleep(seconds)
    x, y = batch
    return torch.nn.functional.cross_entropy(model(x), y, reduction="sum")


def measure(model_name, batch, workers, steps, warmup, seed=0, sleep_ms=None, threads=1):
    models.set_threads(1)
    batches = models.make_batches(model_name, batch, 8)
    eager_model = models.make_model(model_name, seed)
    loss_fn = torch.nn.CrossEntropyLoss(reduction="sum")
    rows = {p: [] for p in PARTS}
    eager, copy = [], []
    buf = torch.empty_like(batches[0][0])
    options = {"mode": "script", "loss": "cross_entropy"}
    if sleep_ms is not None:
        options = {
            "mode": "eager",
            "loss": "cross_entropy",
            "forward": functools.partial(sleeping_forward, sleep_ms / 1e3),
            "loss_reduction": "sum",
        }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # TorchScript workers, on purpose
        engine = Engine(
            model=models.make_model(model_name, seed),
            workers=workers,
            threads_per_worker=threads,
            max_batch=batch,
            name=f"breakdown-{workers}-{int(time.time() * 1000) % 100000}",
            **options,
        )
    with engine:
        engine.gradient_tensors()  # the grads are read directly: no module bound
        engine_threads = engine.status().threads_per_worker
        # Rounds of engine steps, then as many eager steps: eager work between every two
        # engine steps would stand for a trainer that computes between steps, not the
        # training loop (gradient, optimizer step) whose fixed cost this measures.
        for _ in range(ROUNDS):
            for i in range(warmup + steps // ROUNDS):
                x, y = batches[i % len(batches)]
                t0 = time.perf_counter()
                st = engine.gradient(inputs=x, targets=y)
                dt = time.perf_counter() - t0
                if i >= warmup:
                    for k, v in step_parts(dt, st).items():
                        rows[k].append(v)
            for i in range(steps // ROUNDS):
                x, y = batches[i % len(batches)]
                t1 = time.perf_counter()
                eager_model.zero_grad(set_to_none=False)
                loss_fn(eager_model(x), y).backward()
                t2 = time.perf_counter()
                buf.copy_(x)
                t3 = time.perf_counter()
                eager.append(t2 - t1)
                copy.append(t3 - t2)
    med = {k: statistics.median(v) * 1e6 for k, v in rows.items()}
    med["eager"] = statistics.median(eager) * 1e6
    med["copy"] = statistics.median(copy) * 1e6
    med["threads_per_worker"] = engine_threads  # as the engine ran them
    return med


def main(argv=None):
    ap = argparse.ArgumentParser(
        prog="python3 -m shmgrad_tools.bench.breakdown",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--model", choices=sorted(models.MODELS), default="mlp")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--workers", default="1,2", help="comma-separated worker counts")
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument(
        "--threads", type=int, default=1, help="intra-op threads of each worker (default 1)"
    )
    ap.add_argument("--json", help="also write the medians here")
    ap.add_argument(
        "--sleep-ms",
        type=float,
        default=None,
        help="workers sleep this long instead of computing (tiny model, 4 examples each)",
    )
    args = ap.parse_args(argv)
    try:
        counts = [int(w) for w in args.workers.split(",")]
    except ValueError:
        ap.error(f"--workers takes comma-separated integers, got {args.workers!r}")
    if min(args.steps, args.warmup, args.batch, args.threads, *counts) < 1:
        ap.error("--steps, --warmup, --batch, --threads and every worker count must be at least 1")
    if args.sleep_ms is not None and not 0 <= args.sleep_ms <= 1000:
        ap.error("--sleep-ms must be 0 to 1000")
    results = {}
    for n in counts:
        if args.sleep_ms is None:
            results[n] = measure(
                args.model, args.batch, n, args.steps, args.warmup, threads=args.threads
            )
        else:
            results[n] = measure(
                "tiny",
                4 * n,
                n,
                args.steps,
                args.warmup,
                sleep_ms=args.sleep_ms,
                threads=args.threads,
            )
    cols = PARTS + ("eager", "copy")
    if args.sleep_ms is None:
        print(
            f"{args.model} batch {args.batch}, {args.threads} thread(s) per worker: medians in "
            f"microseconds over {args.steps} steps"
        )
    else:
        print(
            f"workers sleeping {args.sleep_ms:g} ms instead of computing (tiny model, 4 examples "
            f"each): medians in microseconds over {args.steps} steps"
        )
    print("N  " + " ".join(f"{c:>9}" for c in cols))
    for n, med in results.items():
        print(f"{n:<3}" + " ".join(f"{med[c]:9.1f}" for c in cols))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "model": args.model,
                    "batch": args.batch,
                    "threads_per_worker": args.threads,
                    "steps": args.steps,
                    "medians_us": results,
                },
                f,
                indent=1,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
