"""shmgrad bench: one run, one machine, the same models and the same batches, through

  single   one process, no engine: forward+backward over the whole batch with torch
           using N intra-op threads (and once with 1 thread: ``single-1t``);
  shmgrad  a shmgrad engine with N worker processes (1 thread each), explicit batches
           (``engine.gradient(inputs=..., targets=...)``);
  eager    the same with eager Python workers (``mode="eager"``): the same models as
           plain nn.Modules, the same explicit batches;
  auto, eager-auto  the same engines started with ``workers="auto"`` over N cores (the
           bench process, and the engine it starts, restricted to N CPUs): the placement
           probe (1 worker with N threads ... N workers with 1) runs on the batches first,
           then the steps are timed with the placement it chose;
  compiled (not by default) eager workers that torch.compile their model
           (``compile=True``); compilation falls in the warm-up steps;
  bf16     (not by default) eager workers whose forward runs under
           ``torch.autocast("cpu", dtype=torch.bfloat16)`` (parameters and gradients
           float32), against the float32 eager workers (``vs eager``);
  ddp      PyTorch DistributedDataParallel, gloo backend, N processes on 127.0.0.1
           (torch.multiprocessing spawn), each computing its shard and all-reducing;
  ddp-shmgrad  the same DDP, same ranks and settings, over the ``shmgrad``
           torch.distributed backend (``init_process_group("shmgrad")``: this machine's
           shared memory instead of TCP), against ``ddp`` (``vs ddp``) and the engine;
  dask     the task-scheduler approach shmgrad replaces: a Dask ``distributed`` client
           with processes=False and N threads; each step scatters the model, every
           gradient task deep-copies it and computes its shard, one task sums them;
  reduce   the reduction alone: N processes reduce N shared-memory slots of P floats
           (ipc::reduceSlice, the engine's code) in GB/s, against memcpy with the same
           processes in the same run (the reduce_bench binary).

With --nodes K, one run compares instead, on the same models and batches:

  nodes    K nodes on this machine: K processes, each a trainer with its own shmgrad
           engine of --workers workers (default 1) and a gloo process group on
           127.0.0.1; each computes its share of the batch and all-reduces the node's
           reduced gradient (shmgrad.Engine(..., process_group=...)). Timed like DDP;
  ddp      DDP-gloo with K ranks, one thread each;
  shmgrad  one engine with K x workers workers (what one machine would run);
  single   the single process with 1 thread (the gradient reference).
The table gives the all-reduce's share of the step, and the bytes each node sends per
step (ring all-reduce of the buffer, and as the loopback interface counted them). The
nodes stand for machines of their own, which a shared-memory backend cannot span: there
is no ddp-shmgrad with --nodes.

With --collectives, one run measures instead the collectives themselves: all-reduce,
all-gather (all_gather_into_tensor) and reduce-scatter (reduce_scatter_tensor) through
gloo and through the shmgrad backend in the same W processes (--ranks, default 2), for
each size (--sizes, default 4 KiB to 256 MiB in powers of 4), taking turns sample by
sample: latency (median), bandwidth (the per-rank buffer's bytes per second), gloo /
shmgrad, and shmgrad against the memory-traffic bound of its algorithm at this machine's
copy bandwidth, measured in the same run (bench/collectives.py defines each figure).
--repeats is then the samples per collective and size (default 20), --budget the seconds
for both backends at one collective and size (default 10), --warmup the untimed calls,
--timeout the seconds for one rank count.

Each configuration runs warm-up steps first, then up to --repeats timed steps (fewer once
--budget seconds are spent; at least 3). Reported per configuration: median, min, max and
the quartiles of the step time, each alternative's median over shmgrad's median with the
same N (and DDP's over eager's), and shmgrad's and eager's overhead = (step wall time -
slowest worker's forward+backward) / step wall time, the wall time measured around
``engine.gradient`` in this process.

Writes results.json, results.md (the table) and bench.png (step time against workers)
into --out. Everything binds to 127.0.0.1 (Dask uses in-process transports), every wait is
bounded by --timeout, and engines are closed in ``finally``.
"""

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import traceback

import torch

from shmgrad import heap_environment
from shmgrad.testing import tunable
from shmgrad.testing import relative_error
from . import collectives, models, report, runners
from .nodes import NodeRun
from .timing import Budget, log, now, summarize

SYSTEMS = (
    "single",
    "shmgrad",
    "eager",
    "auto",
    "eager-auto",
    "compiled",
    "bf16",
    "ddp",
    "ddp-shmgrad",
    "dask",
    "reduce",
)
# The engine's systems: (worker mode, torch.compile, workers="auto").
ENGINE_SYSTEMS = {
    "shmgrad": ("script", False, False),
    "eager": ("eager", False, False),
    "auto": ("script", False, True),
    "eager-auto": ("eager", False, True),
    "compiled": ("eager", True, False),
    "bf16": ("eager", False, False),
}
# What a user would run instead: the best of these, per configuration, is the bar.
BASELINES = ("single", "ddp")
# DDP's systems and the process group backend of each.
DDP_BACKENDS = {"ddp": "gloo", "ddp-shmgrad": "shmgrad"}
# Compiling costs minutes; bf16 is a comparison of its own (--systems eager,bf16).
DEFAULT_SYSTEMS = [s for s in SYSTEMS if s not in ("compiled", "bf16")]
LARGE_REDUCE_FLOATS = 16 * 1024 * 1024  # 64 MiB a slot: larger than most last-level caches


# -- the run --------------------------------------------------------------------------
def machine_info():
    info = {
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
    }
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    info["cpu_model"] = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        with open("/etc/os-release") as f:
            for line in f:
                if line.startswith("PRETTY_NAME="):
                    info["os"] = line.split("=", 1)[1].strip().strip('"')
    except OSError:
        pass
    try:
        import distributed

        info["distributed"] = distributed.__version__
    except ImportError:
        pass
    return info


def default_workers():
    n = os.cpu_count() or 1
    out, w = [], 1
    while w < n:
        out.append(w)
        w *= 2
    out.append(n)
    return out


def int_list(text):
    try:
        vals = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from None
    if not vals or any(v < 1 for v in vals):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return sorted(set(vals))


def name_list(choices):
    def parse(text):
        vals = [v.strip() for v in text.split(",") if v.strip()]
        bad = [v for v in vals if v not in choices]
        if not vals or bad:
            raise argparse.ArgumentTypeError(
                f"unknown {', '.join(bad) or 'empty list'}: choose from {', '.join(choices)}"
            )
        return list(dict.fromkeys(vals))

    return parse


def size_list(text):
    try:
        vals = [collectives.parse_size(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated sizes such as 4K,1M,64M, got {text!r}"
        ) from None
    if not vals:
        raise argparse.ArgumentTypeError(f"expected sizes, got {text!r}")
    return sorted(set(vals))


def build_parser():
    ap = argparse.ArgumentParser(
        prog="shmgrad bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument(
        "--models",
        type=name_list(tuple(models.MODELS)),
        default=None,
        help="comma-separated models: mlp (784-256-10), mlp2 (784-1024-1024-10, "
        "1.86 M parameters), cnn (the Fashion-MNIST CNN), wrn (Wide-ResNet-16-4 on "
        "[B,3,32,32]), tiny (64-32-10, for tests). Default mlp,cnn,wrn; --quick: "
        "mlp,cnn; --tiny: tiny",
    )
    ap.add_argument(
        "--batch-sizes",
        type=int_list,
        default=None,
        help="comma-separated batch sizes (default 32,128,512; --quick/--tiny: 128)",
    )
    ap.add_argument(
        "--workers",
        type=int_list,
        default=None,
        help="comma-separated worker counts N for shmgrad, DDP, Dask, the "
        "single process's threads and the reduction (default 1,2,4,... up "
        "to os.cpu_count(); --quick/--tiny: 1,2)",
    )
    ap.add_argument(
        "--repeats",
        type=int,
        default=None,
        help="timed steps per configuration after warm-up (default 10; --tiny: 2)",
    )
    ap.add_argument(
        "--warmup",
        type=int,
        default=3,
        help="untimed steps first in every configuration (default 3: TorchScript's "
        "profiling executor, which shmgrad's workers run, optimises the "
        "model during its first 2-3 calls)",
    )
    ap.add_argument(
        "--budget",
        type=float,
        default=None,
        help="seconds of timed steps per configuration: stop repeating once "
        "spent (at least 3 steps or --repeats if fewer; default 60, "
        "--quick 10)",
    )
    ap.add_argument(
        "--systems",
        type=name_list(SYSTEMS),
        default=None,
        help=f"what to measure, comma-separated (default "
        f"{','.join(DEFAULT_SYSTEMS)}; ddp-shmgrad is DDP over the shmgrad "
        "torch.distributed backend; also: compiled, eager workers running "
        "torch.compile'd models, compile time in the warm-up steps; bf16, eager workers "
        "under torch.autocast bfloat16); "
        "ratios need shmgrad (ddp-shmgrad's vs ddp needs ddp)",
    )
    ap.add_argument(
        "--reduce-floats",
        type=int_list,
        default=None,
        help="slot sizes (floats) for the reduction benchmark (default: each "
        f"model's parameter count and {LARGE_REDUCE_FLOATS})",
    )
    ap.add_argument(
        "--reduce-repeats",
        type=int,
        default=None,
        help="timed repetitions of each reduction measurement (default 50; --tiny: 5)",
    )
    ap.add_argument(
        "--timeout",
        type=float,
        default=900.0,
        help="seconds one configuration (one system, model, batch size, N) may "
        "take, start-up included, before it is abandoned (default 900)",
    )
    ap.add_argument(
        "--nodes",
        type=int,
        default=None,
        help="compare K shmgrad nodes on this machine (engines joined by a gloo "
        "process group) with DDP-gloo of K ranks (see above); --workers is "
        "then the workers per node (default 1)",
    )
    ap.add_argument(
        "--bucket-cap-mb",
        type=float,
        default=None,
        help="with --nodes: all-reduce in buckets of this many MiB (default one "
        "call on the whole gradient)",
    )
    ap.add_argument(
        "--paired",
        action="store_true",
        help="also run DDP and shmgrad in the same processes, every batch through "
        "each in turn (the order reversed each batch), so that both see the same "
        "moments of a noisy machine; reported with the median of the per-step "
        "ratios DDP / shmgrad. On one machine: DDP's rank 0 is also the trainer "
        "of an engine of N workers (TorchScript, and eager workers if 'eager' is "
        "measured): ddp-paired, shmgrad-paired, eager-paired; with ddp-shmgrad "
        "measured, the same ranks also run DDP over a shmgrad group of themselves "
        "(the default group stays gloo's): ddp-shmgrad-paired. With --nodes: "
        "each rank is both a shmgrad node and a DDP rank: shmgrad-nodes-paired "
        "and ddp-paired. With single and auto or eager-auto measured: one process "
        "with N threads and the engines with workers='auto' over N cores take turns "
        "in one process, in blocks of 5 steps after 3 ms of untimed ones: "
        "single-paired, auto-paired, eager-auto-paired, with the ratios single / "
        "engine of the blocks' medians",
    )
    ap.add_argument(
        "--pin",
        action="store_true",
        help="with --nodes: run each node (its trainer, coordinator and workers) "
        "and each DDP rank on its own share of the CPUs, as on a machine of "
        "its own. By default all share every CPU, and the nodes' engines do "
        "not spin when all the nodes' processes outnumber the cores (the "
        "engine's own rule, which sees only its node)",
    )
    ap.add_argument(
        "--collectives",
        action="store_true",
        help="measure the collectives instead of training steps (see above): "
        "all-reduce, all-gather and reduce-scatter through gloo and the shmgrad "
        "backend in the same processes, against the memory-traffic bound",
    )
    ap.add_argument(
        "--sizes",
        type=size_list,
        default=None,
        help="with --collectives: comma-separated sizes in bytes, K, M or G (binary), "
        "the larger per-rank buffer of each collective (default 4K,16K,...,256M: 4 KiB "
        "to 256 MiB in powers of 4)",
    )
    ap.add_argument(
        "--ranks",
        type=int_list,
        default=None,
        help="with --collectives: comma-separated rank counts W, one run of processes "
        "each, e.g. 2,4,8,16 (default 2)",
    )
    ap.add_argument("--seed", type=int, default=0, help="seed of the weights and batches")
    ap.add_argument(
        "--settings",
        choices=("alike", "default"),
        default="alike",
        help="alike (default): every system's processes start with the heap "
        "settings shmgrad's workers use (MALLOC_MMAP_MAX_=0, "
        "MALLOC_TRIM_THRESHOLD_=2147483647, MALLOC_TOP_PAD_=16777216: "
        "anyone can give them to their own processes) and one intra-op and "
        "one inter-op thread per process; default: each system as it runs "
        "by default (only shmgrad's workers keep freed memory)",
    )
    ap.add_argument(
        "--quick",
        action="store_true",
        help="a subset that runs in under two minutes on a 2-core machine: "
        "mlp,cnn, batch 128, workers 1,2, budget 10 s",
    )
    ap.add_argument(
        "--tiny", action="store_true", help="for tests: the tiny MLP, 2 repeats, small reductions"
    )
    ap.add_argument(
        "--out",
        default="bench-out",
        help="directory for results.json, results.md and bench.png (default ./bench-out)",
    )
    return ap


def resolve(args):
    if args.collectives:
        return resolve_collectives(args)
    collective_only = [
        opt for opt, v in (("--sizes", args.sizes), ("--ranks", args.ranks)) if v is not None
    ]
    if collective_only:
        raise SystemExit(
            f"shmgrad bench: {', '.join(collective_only)} measure(s) collectives: add --collectives"
        )
    if args.nodes is not None and args.systems is not None and "ddp-shmgrad" in args.systems:
        raise SystemExit(
            "shmgrad bench: ddp-shmgrad does not run with --nodes: the nodes stand for "
            "machines of their own, which a shared-memory backend cannot span (use ddp)"
        )
    if args.systems is None:
        args.systems = list(DEFAULT_SYSTEMS)
    quick = args.quick or args.tiny
    if args.models is None:
        args.models = (
            ["tiny"] if args.tiny else (["mlp", "cnn"] if quick else ["mlp", "cnn", "wrn"])
        )
    if args.batch_sizes is None:
        args.batch_sizes = [128] if quick else [32, 128, 512]
    if args.nodes is not None and args.nodes < 2:
        raise SystemExit("shmgrad bench: --nodes must be at least 2")
    node_only = [
        opt
        for opt, on in (
            ("--pin", args.pin),
            ("--bucket-cap-mb", args.bucket_cap_mb is not None),
        )
        if on
    ]
    if node_only and args.nodes is None:
        raise SystemExit(
            f"shmgrad bench: {', '.join(node_only)} compare(s) nodes: add --nodes K "
            "(e.g. --nodes 2)"
        )
    if args.workers is None:
        args.workers = [1] if args.nodes else ([1, 2] if quick else default_workers())
    if args.repeats is None:
        args.repeats = 2 if args.tiny else 10
    if args.budget is None:
        args.budget = 10.0 if quick else 60.0
    if args.reduce_repeats is None:
        args.reduce_repeats = 5 if args.tiny else 50
    if args.repeats < 1 or args.warmup < 0 or args.reduce_repeats < 1 or args.budget <= 0:
        raise SystemExit(
            "shmgrad bench: --repeats, --reduce-repeats and --budget must be "
            "positive, --warmup >= 0"
        )
    if args.timeout <= 0:
        raise SystemExit("shmgrad bench: --timeout must be positive")
    return args


def resolve_collectives(args):
    """--collectives: its defaults, and the step matrix's options refused by name."""
    step_only = [
        opt
        for opt, given in (
            ("--models", args.models is not None),
            ("--batch-sizes", args.batch_sizes is not None),
            ("--workers", args.workers is not None),
            ("--systems", args.systems is not None),
            ("--reduce-floats", args.reduce_floats is not None),
            ("--reduce-repeats", args.reduce_repeats is not None),
            ("--nodes", args.nodes is not None),
            ("--bucket-cap-mb", args.bucket_cap_mb is not None),
            ("--paired", args.paired),
            ("--pin", args.pin),
            ("--quick", args.quick),
            ("--tiny", args.tiny),
        )
        if given
    ]
    if step_only:
        raise SystemExit(
            f"shmgrad bench: {', '.join(step_only)} choose(s) training steps, which "
            "--collectives does not run: use --sizes, --ranks, --repeats, --budget, "
            "--warmup and --timeout with it"
        )
    args.sizes = args.sizes or list(collectives.DEFAULT_SIZES)
    args.ranks = args.ranks or [2]
    if args.repeats is None:
        args.repeats = collectives.DEFAULT_REPEATS
    if args.budget is None:
        args.budget = collectives.DEFAULT_BUDGET_S
    if args.repeats < 1 or args.warmup < 0 or args.budget <= 0 or args.timeout <= 0:
        raise SystemExit(
            "shmgrad bench: --repeats, --budget and --timeout must be positive, --warmup >= 0"
        )
    small = [
        f"{collectives.fmt_size(size)} at {w} ranks"
        for w in args.ranks
        for size in args.sizes
        if collectives.elements(size, w) == 0
    ]
    if small:
        raise SystemExit(
            f"shmgrad bench: {', '.join(small)}: too small to split into one float32 "
            "element per rank"
        )
    return args


def run_config(records, base, system, workers, fn, ref=None):
    """Runs one configuration (``fn()`` returns ``(out, grad)``), appends its record to
    ``records`` and returns ``(record, grad)``; a failure is recorded, not raised."""
    rec = dict(base, system=system, workers=workers, load_average=os.getloadavg()[0])
    t0 = now()
    try:
        out, grad = fn()
        rec.update(out)
        rec.update(summarize(out["times_s"]))
        rec["grad_rel_err"] = None if grad is None or ref is None else relative_error(grad, ref)
    except Exception as exc:  # one failed system must not stop the others
        rec["error"] = f"{type(exc).__name__}: {exc}"
        log(f"  {system} N={workers}: FAILED {rec['error']}")
        traceback.print_exc(file=sys.stderr)
        grad = None
    rec["config_seconds"] = now() - t0
    if "median_s" in rec:
        log(
            f"  {system:9s} N={workers}: median {rec['median_s'] * 1e3:9.2f} ms "
            f"over {rec['n']} steps"
            + (
                f", overhead {rec['overhead_median'] * 100:.1f}%"
                if "overhead_median" in rec
                else ""
            )
        )
    records.append(rec)
    return rec, grad


def configurations(args, **extra):
    """Every (model, batch size) of the run: yields ``(model_name, batch, batches, base)``
    with the run's batches and the record fields they share."""
    for model_name in args.models:
        params = models.num_parameters(models.make_model(model_name, args.seed))
        for batch in args.batch_sizes:
            log(f"{model_name} ({params} parameters), batch {batch}")
            batches = models.make_batches(model_name, batch, args.warmup + args.repeats, args.seed)
            yield (
                model_name,
                batch,
                batches,
                dict(model=model_name, params=params, batch=batch, warmup=args.warmup, **extra),
            )


def measure(args):
    """Runs every configuration; returns the list of result records."""
    records = []
    budget = Budget(args.repeats, args.budget)
    engine_count = 0
    systems = args.systems

    def record(*a, **k):
        return run_config(records, *a, **k)

    for model_name, batch, batches, base in configurations(args):
        # The reference gradient (batch 0, whole batch, one process, 1 thread).
        ref = None
        single_by_n = {}
        if "single" in systems:
            rec, ref = record(
                base,
                "single-1t",
                1,
                lambda: runners.run_single(
                    model_name, batches, args.warmup, budget, 1, args.seed, now() + args.timeout
                ),
            )
            single_by_n[1] = rec
        for n in args.workers:
            if "single" in systems:
                if n == 1:
                    rec = dict(single_by_n[1], system="single")
                    records.append(rec)
                else:
                    record(
                        base,
                        "single",
                        n,
                        lambda: runners.run_single(
                            model_name,
                            batches,
                            args.warmup,
                            budget,
                            n,
                            args.seed,
                            now() + args.timeout,
                        ),
                        ref,
                    )
            engines = {}
            for system, (mode, compiled, auto) in ENGINE_SYSTEMS.items():
                if system in systems and not (auto and n > len(os.sched_getaffinity(0))):
                    engine_count += 1
                    name = f"bench-{os.getpid()}-{engine_count}"
                    engines[system], _ = record(
                        base,
                        system,
                        n,
                        lambda: runners.run_shmgrad(
                            model_name,
                            batches,
                            args.warmup,
                            budget,
                            n,
                            args.seed,
                            now() + args.timeout,
                            name,
                            mode=mode,
                            compile=compiled,
                            autocast=system == "bf16",
                            auto=auto,
                        ),
                        ref,
                    )
            est = next(
                (e["median_s"] for e in engines.values() if "median_s" in e),
                single_by_n.get(1, {}).get("median_s"),
            )
            reps = runners.ddp_repeats(budget, est)
            for system, backend in DDP_BACKENDS.items():
                if system in systems:
                    record(
                        base,
                        system,
                        n,
                        lambda backend=backend: runners.run_ddp(
                            model_name,
                            batch,
                            args.warmup,
                            reps,
                            n,
                            args.seed,
                            now() + args.timeout,
                            backend=backend,
                        ),
                        ref,
                    )
            if args.paired:
                measure_paired(args, records, base, model_name, batch, n, ref, budget)
                measure_auto_paired(args, records, base, model_name, batches, n, ref, budget)
            if "dask" in systems:
                record(
                    base,
                    "dask",
                    n,
                    lambda: runners.run_dask(
                        model_name, batches, args.warmup, budget, n, args.seed, now() + args.timeout
                    ),
                    ref,
                )
    models.set_threads(1)

    # Ratios to shmgrad (and DDP's to eager), same model, batch and N; a paired record's
    # to the paired shmgrad's (the steps it took turns with).
    shm, eager, shm_paired, ddp_gloo = (
        {
            (r["model"], r["batch"], r["workers"]): r
            for r in records
            if r["system"] == system and "median_s" in r
        }
        for system in ("shmgrad", "eager", "shmgrad-paired", "ddp")
    )
    paired_with_single = {f"{s}-paired" for s in ("single",) + AUTO_PAIRED}
    # Each engine system against the best baseline of its configuration (what a user
    # would run instead: one process with N threads, DDP-gloo): > 1, the engine is faster.
    best = {}
    for r in records:
        if r["system"] in BASELINES and "median_s" in r:
            key = (r["model"], r["batch"], r["workers"])
            if key not in best or r["median_s"] < best[key]["median_s"]:
                best[key] = r
    for r in records:
        key = (r["model"], r["batch"], r["workers"])
        if r["system"] in ENGINE_SYSTEMS and key in best and "median_s" in r:
            r["best_baseline"] = best[key]["system"]
            r["best_baseline_over_this"] = best[key]["median_s"] / r["median_s"]
    for r in records:
        key = (r["model"], r["batch"], r["workers"])
        # A record paired with DDP against the paired engine; one paired with the single
        # process carries its own ratio (paired_ratio_median).
        s = (shm_paired if r["system"].endswith("-paired") else shm).get(key)
        if r["system"] in paired_with_single:
            s = None
        if (
            r["system"] in ("ddp", "ddp-shmgrad", "compiled", "bf16")
            and key in eager
            and "median_s" in r
        ):
            r["ratio_to_eager"] = r["median_s"] / eager[key]["median_s"]
        if r["system"] == "ddp-shmgrad" and key in ddp_gloo and "median_s" in r:
            r["ratio_to_ddp"] = r["median_s"] / ddp_gloo[key]["median_s"]
        if s is not None and "median_s" in r:
            r["ratio_to_shmgrad"] = r["median_s"] / s["median_s"]
        elif r["system"] == "single-1t":
            # single-1t is one number per model and batch: compare with every N's shmgrad.
            r["ratio_to_shmgrad_by_n"] = {
                str(n): r["median_s"] / shm[(r["model"], r["batch"], n)]["median_s"]
                for n in args.workers
                if (r["model"], r["batch"], n) in shm and "median_s" in r
            }
    return records


def measure_paired(args, records, base, model_name, batch, n, ref, budget):
    """--paired on one machine: DDP and the engine systems of the run (shmgrad, eager),
    and DDP over the shmgrad backend if measured, in the same processes, every batch
    through each in turn (runners.run_local_paired); recorded as ddp-paired,
    shmgrad-paired, eager-paired and ddp-shmgrad-paired."""
    systems = [s for s in ("shmgrad", "eager", "ddp-shmgrad") if s in args.systems]
    if systems:
        record_paired(
            records,
            base,
            n,
            ref,
            budget,
            "ddp",
            systems,
            lambda reps: runners.run_local_paired(
                model_name,
                batch,
                args.warmup,
                reps,
                n,
                args.seed,
                now() + args.timeout,
                f"bench-{os.getpid()}-p{len(records)}",
                systems,
            ),
        )


# The engine systems --paired runs in turn with one process of N threads (not with DDP).
AUTO_PAIRED = ("auto", "eager-auto")


def measure_auto_paired(args, records, base, model_name, batches, n, ref, budget):
    """--paired with "single" and "auto" or "eager-auto": one process with n threads and
    the engines with workers="auto" over n cores, in turn in one process
    (runners.run_auto_paired); recorded as single-paired, auto-paired, eager-auto-paired."""
    systems = [s for s in AUTO_PAIRED if s in args.systems]
    if "single" in args.systems and systems and n <= len(os.sched_getaffinity(0)):
        record_paired(
            records,
            base,
            n,
            ref,
            budget,
            "single",
            systems,
            lambda reps: runners.run_auto_paired(
                model_name,
                batches,
                args.warmup,
                reps,
                n,
                args.seed,
                now() + args.timeout,
                f"bench-{os.getpid()}-a{len(records)}",
                systems,
            ),
        )


def record_paired(records, base, n, ref, budget, bar, systems, run):
    """One paired run of ``bar`` (the baseline) and ``systems`` in this configuration:
    ``run(repeats)`` returns ``{system + "-paired": (record, grad)}``, its repeats as many
    as the budget allows by the unpaired medians of the same systems; a record each."""
    est = sum(
        r["median_s"]
        for r in records
        if (r["model"], r["batch"], r["workers"]) == (base["model"], base["batch"], n)
        and r["system"] in [bar] + systems
        and "median_s" in r
    )
    reps = runners.ddp_repeats(budget, est or None)
    paired = shared_run(lambda: run(reps))
    for system in [bar] + systems:
        run_config(records, base, f"{system}-paired", n, paired(f"{system}-paired"), ref)
        if "error" in records[-1]:
            return


def shared_run(run):
    """One run of several systems (``run()`` returns ``{system: (record, grad)}``) that
    their records share: ``shared_run(run)(system)`` is the ``fn`` of ``run_config`` for
    ``system``'s record; the first record's call makes the run."""
    results = {}

    def part(system):
        def get():
            if not results:
                results.update(run())
            return results[system]

        return get

    return part


def measure_nodes(args):
    """--nodes: K shmgrad nodes against DDP with K ranks (and one engine of K x workers
    workers, and the single process as the gradient reference)."""
    records = []
    budget = Budget(args.repeats, args.budget)
    k = args.nodes
    count = 0

    def record(*a, **kw):
        return run_config(records, *a, **kw)

    def record_ddp(base, system, workers, fn, ref):
        """A DDP record, with what its ring all-reduce sends per rank and step."""
        rec, _ = record(base, system, workers, fn, ref)
        rec["sent_bytes_per_node_step"] = runners.ring_bytes_sent(base["params"] * 4, k)

    for model_name, batch, batches, base in configurations(args, nodes=k, pinned=args.pin):
        ref_rec, ref = record(
            base,
            "single-1t",
            1,
            lambda: runners.run_single(
                model_name, batches, args.warmup, budget, 1, args.seed, now() + args.timeout
            ),
        )
        reps = runners.ddp_repeats(budget, ref_rec.get("median_s", 0) / k)

        def node_run(workers, suffix):
            return NodeRun(
                k,
                model_name,
                batch,
                args.warmup,
                reps,
                args.seed,
                workers,
                f"bench-{os.getpid()}-{count}{suffix}",
                args.bucket_cap_mb,
                args.pin,
            )

        for w in args.workers:
            count += 1
            if "shmgrad" in args.systems:
                record(
                    base,
                    "shmgrad",
                    k * w,
                    lambda: runners.run_shmgrad(
                        model_name,
                        batches,
                        args.warmup,
                        budget,
                        k * w,
                        args.seed,
                        now() + args.timeout,
                        f"bench-{os.getpid()}-{count}",
                    ),
                    ref,
                )
            record(
                base,
                "shmgrad-nodes",
                w,
                lambda: runners.run_nodes(node_run(w, "n"), now() + args.timeout),
                ref,
            )
            if args.paired:
                paired = shared_run(
                    lambda w=w: runners.run_paired(node_run(w, "p"), now() + args.timeout)
                )
                record(base, "shmgrad-nodes-paired", w, paired("shmgrad-nodes"), ref)
                if "error" not in records[-1]:
                    record_ddp(base, "ddp-paired", w, paired("ddp"), ref)
        if "ddp" in args.systems:
            record_ddp(
                base,
                "ddp",
                1,
                lambda: runners.run_ddp(
                    model_name,
                    batch,
                    args.warmup,
                    reps,
                    k,
                    args.seed,
                    now() + args.timeout,
                    args.pin,
                ),
                ref,
            )
    models.set_threads(1)
    # DDP over the shmgrad-nodes configurations of the same model and batch (and, paired,
    # of the run it was paired with: the same workers per node).
    for r in records:
        paired = r["system"] == "ddp-paired"
        if r["system"] not in ("ddp", "ddp-paired") or "median_s" not in r:
            continue
        nodes_system = "shmgrad-nodes-paired" if paired else "shmgrad-nodes"
        r["ratio_to_nodes"] = {
            str(s["workers"]): r["median_s"] / s["median_s"]
            for s in records
            if s["system"] == nodes_system
            and "median_s" in s
            and (s["model"], s["batch"]) == (r["model"], r["batch"])
            and (not paired or s["workers"] == r["workers"])
        }
        if paired:
            r["paired_ratio_median"] = statistics.median(r["paired_ratios"])
    return records


def measure_reduce(args, models_params):
    out = []
    if "reduce" not in args.systems:
        return out
    sizes = args.reduce_floats
    if sizes is None:
        sizes = sorted(
            set(p for p in models_params if p >= 16)
            | ({65536} if args.tiny else {LARGE_REDUCE_FLOATS})
        )
    log("reduction: N slots of P floats in shared memory vs memcpy")
    for n in args.workers:
        for p in sizes:
            rec = {"system": "reduce", "workers": n, "floats": p}
            try:
                rec.update(runners.run_reduce(n, p, args.reduce_repeats, args.timeout))
                log(
                    f"  N={n} P={p}: reduce {rec['reduce_gbps_median']:.2f} GB/s, memcpy "
                    f"{rec['memcpy_gbps_median']:.2f} GB/s ({rec['ratio'] * 100:.0f}%)"
                )
            except Exception as exc:
                rec["error"] = f"{type(exc).__name__}: {exc}"
                log(f"  N={n} P={p}: FAILED {rec['error']}")
            out.append(rec)
    return out


def same_settings(argv) -> None:
    """Re-runs this command with the workers' heap settings in its environment, unless it
    has them: every process of every system (this one, DDP's ranks, Dask's threads,
    the engines' coordinators and workers) then starts with the same allocator settings,
    and a comparison measures the engines, not glibc's defaults. Thread settings are
    alike already: one intra-op thread per process (N for the single process's N-thread
    row) and one inter-op thread (models.set_threads)."""
    wanted = heap_environment()
    if all(os.environ.get(k) == v for k, v in wanted.items()):
        return
    env = dict(os.environ, **wanted)
    os.execve(sys.executable, [sys.executable, "-m", "shmgrad_tools.bench", *argv], env)


def settings_info(args) -> dict:
    heap = {k: os.environ.get(k) for k in heap_environment()}
    return {
        "settings": args.settings,
        "heap_environment": heap,
        "intra_op_threads_per_process": 1,
        "inter_op_threads_per_process": 1,
        # What the process groups of DDP's ranks and of --collectives start with.
        "backend_environment": {
            "GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo"),
            "SHMGRAD_BACKEND_STAGING_MB": tunable("SHMGRAD_BACKEND_STAGING_MB"),
        },
    }


def settings_line(args) -> str:
    if args.collectives:
        return (
            "Process settings: "
            + (
                "heap "
                + " ".join(f"{k}={v}" for k, v in heap_environment().items())
                + " for every rank"
                if args.settings == "alike"
                else "glibc's default heap"
            )
            + "; one intra-op and one inter-op thread per rank; both backends in the same "
            f"processes; GLOO_SOCKET_IFNAME={os.environ.get('GLOO_SOCKET_IFNAME', 'lo')}."
        )
    if args.settings == "alike":
        return (
            "Process settings: alike for every system (heap: "
            + " ".join(f"{k}={v}" for k, v in heap_environment().items())
            + "; one intra-op thread per process, N for the single N-thread row; one "
            "inter-op thread)."
        )
    return (
        "Process settings: each system as by default (only shmgrad's workers keep freed "
        "memory; glibc's defaults elsewhere)."
    )


def main(argv=None):
    args = resolve(build_parser().parse_args(argv))
    if args.settings == "alike":
        same_settings(sys.argv[1:] if argv is None else list(argv))
    os.makedirs(args.out, exist_ok=True)
    started = datetime.datetime.now().isoformat(timespec="seconds")
    t0 = now()
    load_before = os.getloadavg()
    info = machine_info()
    log(
        f"machine: {info.get('cpu_model', '?')}, {info['cpu_count']} CPUs, torch {info['torch']}; "
        f"load average {load_before[0]:.2f}"
    )
    if load_before[0] > 0.5 * (os.cpu_count() or 1):
        log(
            "warning: the 1-minute load average is above half the CPUs: if other work is "
            "running, the numbers will be noisy"
        )

    def result(records, reductions, targets, **extra):
        return {
            "schema": 1,
            "command": "shmgrad bench " + " ".join(sys.argv[1:] if argv is None else argv),
            "started": started,
            "duration_s": now() - t0,
            "machine": info,
            "process_settings": settings_info(args),
            "load_average_before": list(load_before),
            "load_average_after": list(os.getloadavg()),
            "args": {k: v for k, v in vars(args).items()},
            "results": records,
            "reduction": reductions,
            "targets": targets,
            **extra,
        }

    if args.collectives:
        return main_collectives(args, result)
    log(
        f"models {','.join(args.models)}, batch sizes {args.batch_sizes}, workers "
        f"{args.workers}, {args.warmup} warm-up + up to {args.repeats} timed steps "
        f"(budget {args.budget:g} s), systems {','.join(args.systems)}"
    )
    if args.nodes:
        records, reductions = measure_nodes(args), []
        targets = report.evaluate_node_targets(records)
        text = report.nodes_table(records, targets)
    else:
        records = measure(args)
        params = [models.num_parameters(models.make_model(m, args.seed)) for m in args.models]
        reductions = measure_reduce(args, params)
        targets = report.evaluate_targets(records, reductions)
        text = report.table(records, reductions, targets)
    text = settings_line(args) + "\n\n" + text
    res = result(records, reductions, targets)
    write_results(args.out, res, text)
    try:
        if not args.nodes:
            report.plot(records, os.path.join(args.out, "bench.png"))
            # Parallel efficiency against one process with one thread (the 16-core
            # machine's curve in tools/device-check).
            report.plot_efficiency(records, os.path.join(args.out, "efficiency.png"))
    except Exception as exc:
        log(f"plot failed: {type(exc).__name__}: {exc}")
    print(text)
    print(
        f"wrote {os.path.join(args.out, 'results.json')}, results.md"
        f"{'' if args.nodes else ', bench.png'} "
        f"({res['duration_s']:.0f} s)"
    )
    failed = [r for r in records + reductions if "error" in r]
    if failed:
        log(f"{len(failed)} configuration(s) failed")
        return 1
    return 0


def write_results(out, result, text):
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump(report.jsonable(result), f, indent=1)
    with open(os.path.join(out, "results.md"), "w") as f:
        f.write(text)


def main_collectives(args, result):
    """--collectives: every rank count in turn, results.json and results.md rewritten
    after each (a run cut short keeps what it measured), then bench.png."""
    log(
        f"collectives {','.join(collectives.OPS)} through {' and '.join(collectives.SYSTEMS)} "
        f"(all_reduce also on tensors in shmgrad's arena), "
        f"ranks {args.ranks}, sizes {','.join(collectives.fmt_size(s) for s in args.sizes)}, "
        f"{args.warmup} warm-up calls, up to {args.repeats} samples (budget {args.budget:g} s "
        "per collective and size)"
    )
    text = ""

    def save(records, runs):
        nonlocal text
        text = settings_line(args) + "\n\n" + report.collectives_table(records, runs)
        write_results(args.out, result(records, [], [], collective_runs=runs), text)

    records, runs = measure_collectives(args, save)
    try:
        report.plot_collectives(records, os.path.join(args.out, "bench.png"))
    except Exception as exc:
        log(f"plot failed: {type(exc).__name__}: {exc}")
    print(text)
    print(f"wrote {os.path.join(args.out, 'results.json')}, results.md, bench.png")
    failed = [r for r in runs if "error" in r]
    wrong = [
        f"{r['collective']} {collectives.fmt_size(r['size'])} W={r['ranks']} {system}"
        for r in records
        for system in collectives.systems_of(r["collective"])
        if not r[system]["correct"]
    ]
    if failed or wrong:
        log(f"{len(failed)} rank count(s) failed; wrong results: {', '.join(wrong) or 'none'}")
        return 1
    return 0


def measure_collectives(args, save):
    """--collectives: one run of processes per rank count (runners.run_collectives);
    ``save(records, runs)`` after each. Returns (records, runs)."""
    plan = collectives.Plan(list(args.sizes), args.repeats, args.warmup, args.budget)
    records, runs = [], []
    for world in args.ranks:
        log(f"collectives: {world} ranks")
        t0 = now()
        try:
            recs, run = runners.run_collectives(world, plan, now() + args.timeout)
        except Exception as exc:  # one failed rank count must not stop the others
            runs.append(
                {"ranks": world, "error": f"{type(exc).__name__}: {exc}", "seconds": now() - t0}
            )
            log(f"  {world} ranks: FAILED {runs[-1]['error']}")
            traceback.print_exc(file=sys.stderr)
        else:
            records += recs
            runs.append(run)
            for r in recs:
                log(
                    f"  {r['collective']:14s} W={world} {collectives.fmt_size(r['size']):>8s}: "
                    f"gloo {r['gloo']['median_s'] * 1e6:10.1f} us, shmgrad "
                    f"{r['shmgrad']['median_s'] * 1e6:10.1f} us, bound "
                    f"{r['bound_s'] * 1e6:10.1f} us"
                )
        save(records, runs)
    return records, runs


if __name__ == "__main__":
    sys.exit(main())
