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

Several nodes (--nodes 2): NAME-n0, NAME-n1, ... on this machine, one trainer process
each, grouped through torch.distributed (--backend gloo, shmgrad, or both in turn), the
global batch split among them, every node's all-reduced gradient checked against one
process on the whole batch; workers killed and stopped on every node, and a node's
trainer SIGKILLed mid-step (--node-kill-rate): the others must raise NodeError within
--group-timeout, then a new trainer replaces it and the group re-forms (nodes.py). It
prints and writes (--json) its own counters: also unexpected outcomes, leftover
trainers, trainer kills, NodeErrors seen and how fast, groups formed per backend.

Soak (--duration 1h, or 30m, 3600, 90s): steps until the time is up (shared equally by
the kinds of worker), the same faults and checks, and every --sample-every seconds (60)
a sample of each process's resident memory and open file descriptors (the trainer, the
coordinator, each worker slot), the engine's files in /dev/shm and the median step
time, written to --soak-out (JSON, or CSV if the name ends in .csv) as it goes. The run
fails if anything grew beyond its bound after warm-up (soak.py; docs/RELIABILITY.md).

With --devices the engines' workers compute on those GPUs (docs/GPU.md; on a machine
without one, SHMGRAD_CUDA_LIBRARY may name the test double tests/fake_cuda.cc builds).

Run: shmgrad stress --name NAME [--mode script|eager|both] [--steps N] [--kill-rate R]
                    [--stop-rate R] [--seed S] [--devices cuda:0,...] [--json PATH]
                    [--duration 1h [--sample-every 60] [--soak-out PATH]]
                    [--nodes 2 [--backend gloo|shmgrad|both] [--node-kill-rate R]
                     [--group-timeout S]]
"""

import argparse
import dataclasses
import json
import sys
import time

from . import soak
from .run import Counts, StressRun
from .workloads import WORKLOADS

MODES = ("both",) + tuple(WORKLOADS)
# --nodes: the group's timeout beyond the step's, by default (a node's step ends, or
# fails, within --step-timeout; the others' all-reduce waits that long plus this).
GROUP_TIMEOUT_MARGIN_S = 30.0


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
    ap.add_argument(
        "--workers",
        type=_workers,
        default=3,
        help='worker processes (default 3), or "auto": one per core, the trainer choosing '
        "the placement on its first steps (faults included)",
    )
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
    ap.add_argument(
        "--nodes",
        type=int,
        default=1,
        help="engines on this machine, one trainer process each, grouped through "
        "torch.distributed (default 1: one engine, no group; nodes.py)",
    )
    ap.add_argument(
        "--backend",
        choices=("gloo", "shmgrad", "both"),
        default="both",
        help="--nodes: the group's torch.distributed backend; both: each new group "
        "switches, and the group is re-formed half-way (default both)",
    )
    ap.add_argument(
        "--node-kill-rate",
        type=float,
        default=0.03,
        help="--nodes: probability per step that a node's trainer is SIGKILLed mid-step "
        "(default 0.03)",
    )
    ap.add_argument(
        "--group-timeout",
        type=float,
        default=None,
        help="--nodes: the group's timeout in seconds: a node trainer's death must be seen "
        "as NodeError within it; above --step-timeout, so that a node's slow local step "
        "(a worker replaced on a loaded machine) does not time the group out (default "
        "--step-timeout + 30)",
    )
    ap.add_argument(
        "--duration",
        default=None,
        help="soak: run steps until this much time is up (3600, 90s, 30m, 1h, 1h30m), "
        "shared equally by the kinds of worker; --steps is then ignored",
    )
    ap.add_argument(
        "--sample-every",
        type=float,
        default=60.0,
        help="soak: seconds between samples of memory, fds, /dev/shm and step time (default 60)",
    )
    ap.add_argument(
        "--soak-out",
        metavar="PATH",
        help="soak: write the samples, bounds and verdict to PATH (JSON; CSV if it ends in .csv)",
    )
    return ap


def _workers(text):
    """--workers: a count, or "auto"."""
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f'a number or "auto", got {text!r}') from None


def parse_args(argv=None):
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.steps < 1 or (args.workers != "auto" and args.workers < 1) or args.max_batch < 1:
        ap.error("--steps, --workers and --max-batch must be >= 1")
    if not 0 < args.stop_timeout < args.step_timeout:
        ap.error(
            f"--stop-timeout must be above 0 and below --step-timeout ({args.step_timeout:g} "
            f"s), got {args.stop_timeout:g}"
        )
    if args.duration is not None:
        try:
            args.duration = soak.parse_duration(args.duration)
        except ValueError as exc:
            ap.error(f"--duration: {exc}")
        if args.duration <= 0:
            ap.error("--duration must be above 0")
    if not args.sample_every > 0:
        ap.error(f"--sample-every must be above 0 seconds, got {args.sample_every:g}")
    if args.nodes < 1:
        ap.error(f"--nodes must be >= 1, got {args.nodes}")
    if args.nodes > 1 and args.duration is not None:
        ap.error("--duration (the soak) runs one node: leave out --nodes")
    if args.nodes > 1 and args.devices is not None:
        ap.error("--nodes runs CPU workers: leave out --devices")
    if args.group_timeout is None:
        args.group_timeout = args.step_timeout + GROUP_TIMEOUT_MARGIN_S
    if not args.group_timeout > args.step_timeout:
        ap.error(
            f"--group-timeout must be above --step-timeout ({args.step_timeout:g} s), got "
            f"{args.group_timeout:g}: a node's step, retries included, must end (or fail) "
            "before the other nodes' all-reduce gives up on it"
        )
    if args.soak_out and args.duration is None:
        ap.error("--soak-out needs --duration (the soak mode)")
    if args.devices is not None:
        args.devices = [d if d.startswith("cuda") else f"cuda:{d}" for d in args.devices.split(",")]
    for flag, rate in (
        ("--kill-rate", args.kill_rate),
        ("--stop-rate", args.stop_rate),
        ("--resize-rate", args.resize_rate),
        ("--trainer-restart-rate", args.trainer_restart_rate),
        ("--node-kill-rate", args.node_kill_rate),
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
        f"{c.leftover_workers}" + (f", soak findings {c.soak_findings}" if c.soak_findings else "")
    )


def total(counts):
    """Every counter summed over the runs."""
    fields = [f.name for f in dataclasses.fields(Counts)]
    return Counts(**{f: sum(getattr(c, f) for c in counts) for f in fields})


def report_nodes(label, c):
    print(
        f"{label}: {c.elapsed_s:.1f} s, {c.nodes} nodes, groups formed {c.formations}, "
        f"checked steps by backend {c.backend_steps}, re-forms after a trainer kill "
        f"{c.reforms}, planned re-forms {c.planned_reforms}, formations that failed and "
        f"were tried again {c.form_failures}, errors after repeated deaths {c.errors}"
    )
    print(
        f"trainer kills {c.trainer_kills} ({c.trainer_kills_late} after the all-reduce), "
        f"NodeErrors seen {c.node_errors} (the slowest after a trainer kill, by backend: "
        f"{c.node_error_max_s_by_backend} s), worker kills {c.kills} "
        f"({c.kills_on_every_node} steps on every node), stops {c.stops}: "
        f"{c.stop_timeouts} steps timed out and ran again, {c.stops_resumed} resumed"
    )
    print(
        f"steps {c.steps}, recoveries {c.recoveries}, wrong gradients {c.wrong}, hangs "
        f"{c.hangs}, unexpected outcomes {c.unexpected}, stopped workers not replaced "
        f"{c.not_replaced}, leaked segments {c.leaked_segments}, leftover workers "
        f"{c.leftover_workers}, leftover trainers {c.leftover_trainers}"
    )


def finish(args, total_counts, runs):
    """Writes --json (the totals at the top level, each kind's counts under "runs") and
    returns the exit status: 0 when every count that must be 0 is."""
    if args.json:
        out = dict(
            dataclasses.asdict(total_counts),
            ok=total_counts.ok,
            runs={k: dict(dataclasses.asdict(r), ok=r.ok) for k, r in runs.items()},
        )
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0 if total_counts.ok else 1


def main_nodes(args, kinds):
    from .nodes import NodeCounts, NodesRun

    runs = {}
    for kind in kinds:
        name = engine_name(args.name, kind)
        print(
            f"stress {name}-n0..n{args.nodes - 1}: {kind} workers, {args.nodes} nodes, "
            f"{args.steps} steps, backend {args.backend}",
            flush=True,
        )
        runs[kind] = NodesRun(args, WORKLOADS[kind](args.seed), name).run()
        report_nodes(f"stress {name} x{args.nodes} ({kind})", runs[kind])
    c = NodeCounts(nodes=args.nodes)
    for r in runs.values():
        for f in dataclasses.fields(NodeCounts):
            v = getattr(r, f.name)
            if f.name == "nodes":
                continue
            if f.name == "node_error_max_s_by_backend":
                for k, n in v.items():
                    v0 = c.node_error_max_s_by_backend.get(k, 0.0)
                    c.node_error_max_s_by_backend[k] = max(v0, n)
            elif isinstance(v, dict):
                d = getattr(c, f.name)
                for k, n in v.items():
                    d[k] = d.get(k, 0) + n
            elif f.name == "node_error_max_s":
                c.node_error_max_s = max(c.node_error_max_s, v)
            else:
                setattr(c, f.name, getattr(c, f.name) + v)
    if len(runs) > 1:
        report_nodes(f"stress {args.name} x{args.nodes} (all {len(runs)} kinds)", c)
    return finish(args, c, runs)


def main(argv=None):
    args = parse_args(argv)
    kinds = list(WORKLOADS) if args.mode == "both" else [args.mode]
    if args.nodes > 1:
        return main_nodes(args, kinds)
    runs = {}
    sampler = None
    if args.duration is not None:
        sampler = soak.Sampler(args.sample_every, args.soak_out)
        sampler.meta = dict(
            command=["shmgrad", "stress", *(sys.argv[1:] if argv is None else argv)],
            duration_s=args.duration,
            sample_every_s=args.sample_every,
            kinds=kinds,
            bounds=soak.bounds(),
            started_utc=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            machine=soak.machine(),
        )
    shm_after = {}
    for i, kind in enumerate(kinds):
        name = engine_name(args.name, kind)
        deadline = None
        if args.duration is not None:
            # Each kind gets its share of what is left (the engines' starts and stops
            # take their time out of it).
            deadline = time.monotonic() + (args.duration - (time.monotonic() - sampler.t0)) / (
                len(kinds) - i
            )
            print(f"stress {name}: {kind} workers, until {deadline - sampler.t0:.0f} s", flush=True)
        else:
            print(f"stress {name}: {kind} workers, {args.steps} steps", flush=True)
        run = StressRun(args, WORKLOADS[kind](args.seed), name, deadline=deadline, sampler=sampler)
        runs[kind] = run.run()
        shm_after[kind] = run.shm_after
        if sampler is not None:
            findings = soak.check_growth(
                [s for s in sampler.samples if s.kind == kind], {kind: run.shm_after}
            )
            runs[kind].soak_findings = len(findings)
            for f in findings:
                print(f"soak: GROWTH: {f}", file=sys.stderr, flush=True)
        report(f"stress {name} ({kind})", runs[kind])
    if sampler is not None:
        findings = soak.check_growth(sampler.samples, shm_after)
        sampler.write(verdict=dict(ok=not findings, findings=findings))
        print(
            f"soak: {len(sampler.samples)} samples; "
            + ("no growth beyond the bounds" if not findings else f"{len(findings)} finding(s)"),
            flush=True,
        )
    c = total(runs.values())
    if len(runs) > 1:
        report(f"stress {args.name} (all {len(runs)} kinds)", c)
    return finish(args, c, runs)


if __name__ == "__main__":
    sys.exit(main())
