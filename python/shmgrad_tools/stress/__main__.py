"""``shmgrad stress``: a node-local stress test of an engine under faults.

It runs an engine of each kind of worker in turn (--mode):

  script  TorchScript workers: engine NAME, a small CNN, the loss cross_entropy and a
          generated dataset in shared memory;
  eager   eager Python workers: engine NAME-eager, a CNN that TorchScript rejects, a
          callable loss (label-smoothed cross entropy) and a torch Dataset with random
          per-example transforms (flip, shift, noise from Python's random, torch and
          NumPy); indexed steps get an explicit seed, and the reference applies the
          workers' seeding (seed_everything(example_seed(seed, i)) before dataset[i]).

Each engine then gets N steps: random batch sizes, indexed and explicit batches (a
quarter of the steps with a loss scale of 2^10, divided out after the call as a
GradScaler's unscale_ does), every gradient checked against a plain PyTorch reference in
this process, SGD steps in between so the parameters move, workers killed (SIGKILL) at
random moments, the engine shrunk and grown back at once now and then (a retired worker
must be gone before its slot is reused), workers stopped (SIGSTOP, as a hung process) at
random moments (the step ends in a timeout after --stop-timeout; the same batch again
must give the exact gradient and the stopped worker must be gone, replaced; a stopped
worker the step did not need stays stopped for the same batch once more, then is
resumed), and the trainer restarted now and then (a child trainer killed while its step
is in flight, then this process attaches again). It ends by printing, for each kind and
in total,

    steps, kills, stops, recoveries, wrong gradients, hangs, stopped workers not
    replaced, leaked segments, leftover workers

(and, with --json PATH, writes the counters to PATH as JSON: the totals at the top
level, each kind's under "runs") and exits non-zero if any of the last five is not 0.

With --devices the engines' workers compute on those GPUs (docs/GPU.md; on a machine
without one, SHMGRAD_CUDA_LIBRARY may name the test double tests/fake_cuda.cc builds).

Run: shmgrad stress --name NAME [--mode script|eager|both] [--steps N] [--kill-rate R]
                    [--stop-rate R] [--seed S] [--devices cuda:0,...] [--json PATH]
"""

import argparse
import dataclasses
import json
import sys

from .run import Counts, StressRun
from .workloads import WORKLOADS

MODES = ("both",) + tuple(WORKLOADS)


def build_parser():
    ap = argparse.ArgumentParser(
        prog="shmgrad stress",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--name", required=True, help="engine name to create for the test")
    ap.add_argument(
        "--mode",
        choices=MODES,
        default="both",
        help="which kind of worker to stress: script, eager, or both in turn (default both)",
    )
    ap.add_argument(
        "--steps", type=int, default=200, help="gradient steps per kind of worker (default 200)"
    )
    ap.add_argument(
        "--kill-rate",
        type=float,
        default=0.1,
        help="probability that a step has a worker killed at a random moment (default 0.1)",
    )
    ap.add_argument(
        "--stop-rate",
        type=float,
        default=0.02,
        help="probability that a step has a worker stopped (SIGSTOP) at a random moment "
        "(default 0.02)",
    )
    ap.add_argument(
        "--stop-timeout",
        type=float,
        default=5.0,
        help="the timeout of a step with a stopped worker, in seconds (default 5)",
    )
    ap.add_argument(
        "--trainer-restart-rate",
        type=float,
        default=0.02,
        help="probability per step of a trainer restart with a child trainer killed mid-step",
    )
    ap.add_argument(
        "--resize-rate",
        type=float,
        default=0.05,
        help="probability per step of shrinking to a random size and growing back at once",
    )
    ap.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    ap.add_argument("--workers", type=int, default=3, help="worker processes (default 3)")
    ap.add_argument("--max-batch", type=int, default=400, help="largest random batch (default 400)")
    ap.add_argument(
        "--step-timeout",
        type=float,
        default=120.0,
        help="seconds after which a step counts as a hang (default 120)",
    )
    ap.add_argument(
        "--devices",
        default=None,
        help="GPU workers: the engines' devices, e.g. cuda:0,cuda:1 (placed round-robin; "
        "default: CPU workers)",
    )
    ap.add_argument(
        "--json", metavar="PATH", help="also write the run's counters to PATH as one JSON object"
    )
    return ap


def parse_args(argv=None):
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.steps < 1 or args.workers < 1 or args.max_batch < 1:
        ap.error("--steps, --workers and --max-batch must be >= 1")
    if not 0 < args.stop_timeout < args.step_timeout:
        ap.error(
            f"--stop-timeout must be above 0 and below --step-timeout ({args.step_timeout:g} "
            f"s), got {args.stop_timeout:g}"
        )
    if args.devices is not None:
        args.devices = [d if d.startswith("cuda") else f"cuda:{d}" for d in args.devices.split(",")]
    for flag, rate in (
        ("--kill-rate", args.kill_rate),
        ("--stop-rate", args.stop_rate),
        ("--resize-rate", args.resize_rate),
        ("--trainer-restart-rate", args.trainer_restart_rate),
    ):
        if not 0 <= rate <= 1:
            ap.error(f"{flag} must be a probability in [0, 1], got {rate:g}")
    return args


def engine_name(name, kind):
    """The TorchScript engine is NAME, the eager one NAME-eager."""
    return name if kind == "script" else f"{name}-{kind}"


def report(label, c):
    print(
        f"{label}: {c.elapsed_s:.1f} s, trainer restarts {c.trainer_restarts}, "
        f"worker replacements {c.worker_replacements}, steps aborted {c.steps_aborted}, "
        f"shrink-and-grow {c.resizes}, errors after repeated deaths {c.errors}, "
        f"loss-scaled steps {c.scaled_steps}"
        + (
            f", structured batches {c.structured_steps}, accumulated {c.accumulated_steps}"
            if c.structured_steps or c.accumulated_steps
            else ""
        )
    )
    print(
        f"stops {c.stops}: {c.stop_timeouts} steps timed out and ran again, "
        f"{c.stops_resumed} workers not needed (twice) and resumed"
    )
    print(
        f"steps {c.steps}, kills {c.kills}, stops {c.stops}, recoveries {c.recoveries}, "
        f"wrong gradients {c.wrong}, hangs {c.hangs}, stopped workers not replaced "
        f"{c.not_replaced}, leaked segments {c.leaked_segments}, leftover workers "
        f"{c.leftover_workers}"
    )


def total(counts):
    """Every counter summed over the runs."""
    fields = [f.name for f in dataclasses.fields(Counts)]
    return Counts(**{f: sum(getattr(c, f) for c in counts) for f in fields})


def main(argv=None):
    args = parse_args(argv)
    kinds = list(WORKLOADS) if args.mode == "both" else [args.mode]
    runs = {}
    for kind in kinds:
        name = engine_name(args.name, kind)
        print(f"stress {name}: {kind} workers, {args.steps} steps", flush=True)
        runs[kind] = StressRun(args, WORKLOADS[kind](args.seed), name).run()
        report(f"stress {name} ({kind})", runs[kind])
    c = total(runs.values())
    if len(runs) > 1:
        report(f"stress {args.name} (all {len(runs)} kinds)", c)
    if args.json:
        out = dict(
            dataclasses.asdict(c),
            ok=c.ok,
            runs={k: dict(dataclasses.asdict(r), ok=r.ok) for k, r in runs.items()},
        )
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0 if c.ok else 1


if __name__ == "__main__":
    sys.exit(main())
