"""Whole training loops, as people write them: zero_grad, the gradient, optimizer.step(),
each system in processes of its own (a fresh Python per run, as a user's script), the
systems taking turns run by run, the same batches, the bench's heap settings for all:

  single      one process, N intra-op threads (torch's default on N cores): forward and
              backward over the batch, then the optimizer;
  engine      shmgrad.Engine (--workers, default "auto") bound to the model, the
              optimizer stepped in the trainer: trainer_threads="auto" (the default: the
              trainer computes on the cores the workers leave free, at least 1);
  engine-keep the same engine with trainer_threads=None: the trainer keeps N threads,
              as before trainer_threads existed. Its idle intra-op threads spin after
              every optimizer step (libgomp: GOMP_SPINCOUNT) on the workers' cores.

The engine's runs start timing after the placement probe (workers="auto") has chosen.
Prints each system's median step over its runs and its ratio to single's; with --json,
writes them. ``shmgrad bench`` times ``engine.gradient`` alone against forward and
backward alone; this times what a training loop pays. docs/BENCHMARKS.md cites its runs.

    .venv/bin/python tools/loop_bench.py --model mlp --batch 32
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

SYSTEMS = ("single", "engine", "engine-keep")


def run_one(args) -> dict:
    """One system's run in this process: the median step (seconds) and what it ran."""
    import torch
    import torch.nn.functional as F

    import shmgrad
    from shmgrad_tools.bench import models

    batches = models.make_batches(args.model, args.batch, 8, seed=1)
    model = models.make_model(args.model, seed=0)
    engine = None
    info = {}
    if args.system != "single":
        workers = args.workers if args.workers == "auto" else int(args.workers)
        extra = {} if workers == "auto" else {"threads_per_worker": args.threads_per_worker}
        engine = shmgrad.Engine(
            model=models.make_model(args.model, seed=0),
            workers=workers,
            loss="cross_entropy",
            mode=args.mode,
            trainer_threads="auto" if args.system == "engine" else None,
            **extra,
        )
        model = engine.bind(model)
    if args.optimizer == "adam":
        opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9)

    def step(i):
        x, y = batches[i % len(batches)]
        opt.zero_grad()
        if engine is None:
            F.cross_entropy(model(x), y, reduction="sum").backward()
        else:
            engine.gradient(inputs=x, targets=y, reduction="sum")
        opt.step()

    try:
        i = 0
        deadline = time.monotonic() + args.timeout
        # Until the probe has chosen (workers="auto"), then the warm-up steps. The client's
        # own flag, not status(): a status() call between steps (74 us here) would fall in
        # every probe sample (the time from one step's start to the next's) and was seen to
        # tip the probe's choice.
        while engine is not None and engine._placement_probing:
            step(i)
            i += 1
            if time.monotonic() > deadline:
                raise TimeoutError("the placement probe did not finish in --timeout seconds")
        for _ in range(args.warmup):
            step(i)
            i += 1
        times = []
        for _ in range(args.steps):
            t0 = time.perf_counter()
            step(i)
            times.append(time.perf_counter() - t0)
            i += 1
        info["median_s"] = statistics.median(times)
        info["trainer_threads"] = torch.get_num_threads()
        if engine is not None:
            st = engine.status()
            info["placement"] = (
                f"trainer x{st.placement_threads}"
                if st.placement_in_trainer
                else f"{st.placement_workers}x{st.placement_threads}"
            )
    finally:
        if engine is not None:
            engine.close()
    return info


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="mlp")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--workers", default="auto", help='"auto" or a number')
    p.add_argument("--threads-per-worker", type=int, default=1)
    p.add_argument("--mode", default="eager", choices=("eager", "script"))
    p.add_argument("--optimizer", default="sgd", choices=("sgd", "adam"))
    p.add_argument("--systems", default=",".join(SYSTEMS))
    p.add_argument("--rounds", type=int, default=3, help="runs of each system, in turn")
    p.add_argument("--steps", type=int, default=300, help="timed steps a run")
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--timeout", type=float, default=300, help="seconds a run may take")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--system", help=argparse.SUPPRESS)  # one run, in a child process
    args = p.parse_args(argv)
    if args.system:
        print("RESULT " + json.dumps(run_one(args)), flush=True)
        return 0
    import shmgrad

    systems = [s for s in args.systems.split(",") if s]
    unknown = set(systems) - set(SYSTEMS)
    if unknown:
        p.error(f"unknown systems {sorted(unknown)}: use {', '.join(SYSTEMS)}")
    env = {**os.environ, **shmgrad.heap_environment()}
    passed = list(argv if argv is not None else sys.argv[1:])  # each run takes this run's
    infos = {s: [] for s in systems}  # each run's result, in order
    for r in range(args.rounds):
        order = systems if r % 2 == 0 else systems[::-1]
        for system in order:
            cmd = [sys.executable, os.path.abspath(__file__), "--system", system, *passed]
            proc = subprocess.run(
                cmd, env=env, capture_output=True, text=True, timeout=args.timeout + 60
            )
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
            if proc.returncode != 0 or not lines:
                sys.stderr.write(proc.stdout + proc.stderr)
                raise SystemExit(f"loop_bench: the {system} run failed (rc {proc.returncode})")
            infos[system].append(json.loads(lines[-1][len("RESULT ") :]))
    print(
        f"{args.model} batch {args.batch}, {args.optimizer}, workers={args.workers} "
        f"({args.mode}), {args.rounds} runs each of {args.steps} steps; heap settings alike"
    )
    runs = {s: [i["median_s"] for i in infos[s]] for s in systems}
    base = statistics.median(runs["single"]) if "single" in runs else None
    medians = {}
    for system in systems:
        m = statistics.median(runs[system])
        medians[system] = m
        last = infos[system][-1]
        what = f"trainer threads {last['trainer_threads']}"
        if "placement" in last:
            what += ", placement " + ", ".join(i["placement"] for i in infos[system])
        ratio = f"  single/this {base / m:.3f}" if base else ""
        print(f"  {system:12s} {m * 1e3:9.3f} ms{ratio}   ({what})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"median_s": medians, "runs_s": runs, "infos": infos, "args": vars(args)},
                f,
                indent=1,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
