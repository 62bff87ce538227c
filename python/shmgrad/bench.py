"""shmgrad bench: one run, one machine, the same models and the same batches, through

  single   one process, no engine: forward+backward over the whole batch with torch
           using N intra-op threads (and once with 1 thread: ``single-1t``);
  shmgrad  a shmgrad engine with N worker processes (1 thread each), explicit batches
           (``engine.gradient(inputs=..., targets=...)``);
  ddp      PyTorch DistributedDataParallel, gloo backend, N processes on 127.0.0.1
           (torch.multiprocessing spawn), each computing its shard and all-reducing;
  dask     the task-scheduler approach shmgrad replaces: a Dask ``distributed`` client
           with processes=False and N threads; each step scatters the model, every
           gradient task deep-copies it and computes its shard, one task sums them;
  reduce   the reduction alone: N processes reduce N shared-memory slots of P floats
           (ipc::reduceSlice, the engine's code) in GB/s, against memcpy with the same
           processes in the same run (the reduce_bench binary).

Each configuration runs warm-up steps first, then up to --repeats timed steps (fewer once
--budget seconds are spent; at least 3). Reported per configuration: median, min, max and
the quartiles of the step time, each alternative's median over shmgrad's median with the
same N, and shmgrad's overhead = (step wall time - slowest worker's forward+backward) /
step wall time, the wall time measured around ``engine.gradient`` in this process.

Writes results.json, results.md (the table) and bench.png (step time against workers)
into --out. Everything binds to 127.0.0.1 (Dask uses in-process transports), every wait is
bounded by --timeout, and engines are closed in ``finally``.
"""

import argparse
import copy
import datetime
import json
import logging
import math
import os
import platform
import queue as queue_mod
import socket
import statistics
import subprocess
import sys
import time
import traceback
import warnings

import torch
import torch.nn.functional as F

from . import bench_models
from ._numerics import relative_error

SYSTEMS = ("single", "shmgrad", "ddp", "dask", "reduce")
ALTERNATIVES = ("single", "single-1t", "ddp", "dask")
LABELS = {
    "single-1t": "single process, 1 thread",
    "single": "single process, N threads",
    "shmgrad": "shmgrad, N workers",
    "ddp": "DDP gloo, N processes",
    "dask": "Dask deep-copy, N threads",
}
MIN_TIMED_STEPS = 3
LARGE_REDUCE_FLOATS = 16 * 1024 * 1024  # 64 MiB a slot: larger than most last-level caches


def log(msg):
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _now():
    return time.clock_gettime(time.CLOCK_MONOTONIC)


# -- statistics -------------------------------------------------------------------------
def summarize(times):
    """median, min, max, quartiles (seconds) of a list of step times."""
    if not times:
        return {}
    s = sorted(times)
    if len(s) >= 2:
        q = statistics.quantiles(s, n=4, method="inclusive")
        q1, q3 = q[0], q[2]
    else:
        q1 = q3 = s[0]
    return {"median_s": statistics.median(s), "min_s": s[0], "max_s": s[-1],
            "q1_s": q1, "q3_s": q3, "n": len(s)}


class Budget:
    """Decides how many timed steps a configuration gets: all --repeats, or fewer (at
    least MIN_TIMED_STEPS) once --budget seconds of timed steps are spent."""

    def __init__(self, repeats, seconds):
        self.repeats = repeats
        self.seconds = seconds
        self.minimum = min(MIN_TIMED_STEPS, repeats)

    def more(self, done, spent):
        if done >= self.repeats:
            return False
        return done < self.minimum or spent < self.seconds


def timed_steps(batches, warmup, budget, deadline, what, step):
    """The timing loop every system shares: ``step(i, x, y, left)`` runs batch ``i`` with
    ``left`` seconds to the deadline and returns the seconds that count as its step time.
    The first ``warmup`` steps are untimed; then steps run while ``budget`` allows.
    Returns the timed steps' times."""
    times, spent = [], 0.0
    for i, (x, y) in enumerate(batches):
        if i >= warmup and not budget.more(len(times), spent):
            break
        left = deadline - _now()
        if left <= 0:
            raise TimeoutError(f"{what} run went past --timeout")
        dt = step(i, x, y, left)
        if i >= warmup:
            times.append(dt)
            spent += dt
    return times


# -- 1. single process ----------------------------------------------------------------
def run_single(model_name, batches, warmup, budget, threads, seed, deadline):
    bench_models.set_threads(threads)
    model = bench_models.make_model(model_name, seed)
    model.train()
    grad = None

    def step(i, x, y, left):
        nonlocal grad
        t0 = _now()
        for p in model.parameters():
            p.grad = None
        loss = F.cross_entropy(model(x), y, reduction="sum")
        loss.backward()
        dt = _now() - t0
        if i == 0:
            grad = bench_models.flat_grad(model)
        return dt

    times = timed_steps(batches, warmup, budget, deadline, "single-process", step)
    return {"times_s": times, "threads": threads}, grad


# -- 2. shmgrad -----------------------------------------------------------------------
def run_shmgrad(model_name, batches, warmup, budget, workers, seed, deadline, engine_name):
    from .engine import Engine  # imports the native module only when shmgrad is measured

    bench_models.set_threads(1)  # the trainer only copies the batch in and waits
    model = bench_models.make_model(model_name, seed)
    batch = batches[0][0].shape[0]
    in_mb = batches[0][0].numel() * 4 / 2**20
    engine = None
    try:
        t_start = _now()
        engine = Engine(model=model, workers=workers, loss="cross_entropy", name=engine_name,
                        threads_per_worker=1, max_batch=max(batch, 1),
                        input_capacity_mb=max(64, int(math.ceil(in_mb * 2)) + 1),
                        startup_timeout=max(10.0, min(120.0, deadline - _now())))
        startup = _now() - t_start
        overheads, engine_overheads, compute, reduce_s, engine_wall = [], [], [], [], []
        grad = None

        def step(i, x, y, left):
            nonlocal grad
            t0 = _now()
            st = engine.gradient(inputs=x, targets=y, reduction="sum", timeout=left)
            dt = _now() - t0
            if st.workers != workers:
                raise RuntimeError(f"the step ran on {st.workers} workers, not {workers}")
            if i == 0:
                grad = torch.cat([g.detach().reshape(-1).double() for g in engine.gradient_tensors()])
            if i >= warmup:
                slowest = max(st.compute_seconds)
                compute.append(slowest)
                reduce_s.append(st.reduce_seconds)
                engine_wall.append(st.wall_seconds)
                overheads.append((dt - slowest) / dt)
                engine_overheads.append((st.wall_seconds - slowest) / st.wall_seconds
                                        if st.wall_seconds > 0 else 0.0)
            return dt

        times = timed_steps(batches, warmup, budget, deadline, "shmgrad", step)
        return {
            "times_s": times,
            "threads": 1,
            "startup_s": startup,
            "overhead_median": statistics.median(overheads),
            "overhead_per_step": overheads,
            "engine_overhead_median": statistics.median(engine_overheads),
            "compute_max_median_s": statistics.median(compute),
            "reduce_median_s": statistics.median(reduce_s),
            # The engine's whole reduce phase (ipc::reduceSlice and the non-finite check of
            # the reduced slice), as bandwidth over the bytes the reduction must move.
            "reduce_phase_gbps": ((workers + 1) * bench_models.num_parameters(model) * 4
                                  / max(statistics.median(reduce_s), 1e-12) / 1e9),
            "engine_wall_median_s": statistics.median(engine_wall),
        }, grad
    finally:
        if engine is not None:
            engine.close()


# -- 3. DDP (gloo) --------------------------------------------------------------------
def _free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ddp(model_name, batch, warmup, repeats, workers, seed, deadline):
    import torch.multiprocessing as mp
    from . import bench_ddp

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    port = _free_port()
    os.environ["MASTER_PORT"] = str(port)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    timeout_s = max(30, int(deadline - _now()))
    t_start = _now()
    procs = mp.start_processes(
        bench_ddp.rank_main, nprocs=workers, join=False, start_method="spawn",
        args=(workers, port, model_name, batch, warmup, repeats, seed, q, timeout_s))
    results = {}
    try:
        while len(results) < workers:
            left = deadline - _now()
            if left <= 0:
                raise TimeoutError("DDP run went past --timeout")
            try:
                rank, res = q.get(timeout=min(1.0, left))
            except queue_mod.Empty:
                if any(p.exitcode not in (None, 0) for p in procs.processes):
                    # Give a crashing rank a moment to report its traceback first.
                    try:
                        rank, res = q.get(timeout=2.0)
                    except queue_mod.Empty:
                        codes = [p.exitcode for p in procs.processes]
                        raise RuntimeError(f"a DDP rank died (exit codes {codes})") from None
                else:
                    continue
            if "error" in res:
                raise RuntimeError(f"DDP rank {rank} failed:\n{res['error']}")
            results[rank] = res
        for p in procs.processes:
            p.join(max(1.0, min(30.0, deadline - _now())))
    finally:
        for p in procs.processes:
            if p.is_alive():
                p.terminate()
        for p in procs.processes:
            p.join(5)
            if p.is_alive():
                p.kill()
                p.join(5)
        q.close()
    total = _now() - t_start
    starts = [results[r]["start"] for r in range(workers)]
    ends = [results[r]["end"] for r in range(workers)]
    times = [max(e[i] for e in ends) - min(s[i] for s in starts) for i in range(len(starts[0]))]
    return {"times_s": times, "threads": 1, "total_s": total}, results[0]["grad"]


def ddp_repeats(budget, est_step):
    """DDP ranks run a fixed number of steps: as many as the budget allows, by the step
    time of shmgrad (or the single process) in this configuration."""
    if est_step is None or est_step <= 0:
        return budget.repeats
    n = int(budget.seconds / est_step)
    return max(budget.minimum, min(budget.repeats, n))


# -- 4. Dask --------------------------------------------------------------------------
def _dask_gradient(model, x, y):
    """One gradient task: a private deep copy of the model, forward+backward on a shard."""
    # Per task thread (OpenMP's thread count is per thread); run_dask set OpenBLAS's,
    # which is per process, once.
    torch.set_num_threads(1)
    m = copy.deepcopy(model)
    m.train()
    loss = F.cross_entropy(m(x), y, reduction="sum")
    loss.backward()
    return [p.grad for p in m.parameters()]


def _dask_gradient_shard(model, shard):
    return _dask_gradient(model, shard[0], shard[1])


def _dask_sum(grads):
    out = [g.clone() for g in grads[0]]
    for gs in grads[1:]:
        for o, g in zip(out, gs):
            o.add_(g)
    return out


def run_dask(model_name, batches, warmup, budget, workers, seed, deadline):
    from distributed import Client

    bench_models.set_threads(1)  # the threads of the in-process Dask worker start with this
    model = bench_models.make_model(model_name, seed)
    model.train()
    batch = batches[0][0].shape[0]
    bounds = [(batch * r // workers, batch * (r + 1) // workers) for r in range(workers)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        client = Client(processes=False, n_workers=1, threads_per_worker=workers,
                        dashboard_address=None, silence_logs=logging.ERROR)
    try:
        grad = None

        def step(i, x, y, left):
            nonlocal grad
            t0 = _now()
            # The parameters change every step in training: the model is shipped every step.
            model_f = client.scatter(model, hash=False)
            shards = client.scatter([(x[lo:hi], y[lo:hi]) for lo, hi in bounds], hash=False)
            parts = [client.submit(_dask_gradient_shard, model_f, s, pure=False) for s in shards]
            total = client.submit(_dask_sum, parts, pure=False)
            grads = total.result(timeout=left)
            dt = _now() - t0
            if i == 0:
                grad = torch.cat([g.reshape(-1).double() for g in grads])
            return dt

        times = timed_steps(batches, warmup, budget, deadline, "Dask", step)
        return {"times_s": times, "threads": 1}, grad
    finally:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            client.close(timeout=30)


# -- 5. the reduction alone -----------------------------------------------------------
def reduce_binary():
    env = os.environ.get("SHMGRAD_REDUCE_BENCH")
    if env:
        return env
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "bin", "reduce_bench")


def run_reduce(workers, floats, repeats, timeout):
    exe = reduce_binary()
    if not os.path.exists(exe):
        raise FileNotFoundError(f"{exe} is not installed: run tools/setup.sh "
                                "(or set SHMGRAD_REDUCE_BENCH)")
    cmd = [exe, "--workers", str(workers), "--floats", str(floats), "--repeats", str(repeats),
           "--timeout", str(max(1, int(timeout)))]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout + 10,
                       stdin=subprocess.DEVNULL)
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {p.returncode}: {p.stderr.strip()}")
    return json.loads(p.stdout)


# -- the run --------------------------------------------------------------------------
def machine_info():
    info = {"cpu_count": os.cpu_count(), "platform": platform.platform(),
            "python": platform.python_version(), "torch": torch.__version__}
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
        v = subprocess.run(["dpkg-query", "-W", "-f=${Version}", "python3-torch"],
                           capture_output=True, text=True, timeout=10)
        if v.returncode == 0 and v.stdout:
            info["torch_package"] = "python3-torch " + v.stdout.strip()
    except (OSError, subprocess.SubprocessError):
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
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not vals or any(v < 1 for v in vals):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return sorted(set(vals))


def name_list(choices):
    def parse(text):
        vals = [v.strip() for v in text.split(",") if v.strip()]
        bad = [v for v in vals if v not in choices]
        if not vals or bad:
            raise argparse.ArgumentTypeError(
                f"unknown {', '.join(bad) or 'empty list'}: choose from {', '.join(choices)}")
        return list(dict.fromkeys(vals))
    return parse


def build_parser():
    ap = argparse.ArgumentParser(
        prog="shmgrad bench", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", type=name_list(tuple(bench_models.MODELS)), default=None,
                    help="comma-separated models: mlp (784-256-10), cnn (the Fashion-MNIST "
                         "CNN), wrn (Wide-ResNet-16-4 on [B,3,32,32]), tiny (64-32-10, for "
                         "tests). Default mlp,cnn,wrn; --quick: mlp,cnn; --tiny: tiny")
    ap.add_argument("--batch-sizes", type=int_list, default=None,
                    help="comma-separated batch sizes (default 32,128,512; --quick/--tiny: 128)")
    ap.add_argument("--workers", type=int_list, default=None,
                    help="comma-separated worker counts N for shmgrad, DDP, Dask, the "
                         "single process's threads and the reduction (default 1,2,4,... up "
                         "to os.cpu_count(); --quick/--tiny: 1,2)")
    ap.add_argument("--repeats", type=int, default=None,
                    help="timed steps per configuration after warm-up (default 10; --tiny: 2)")
    ap.add_argument("--warmup", type=int, default=3,
                    help="untimed steps first in every configuration (default 3: TorchScript's "
                         "profiling executor, which shmgrad's workers run, optimises the "
                         "model during its first 2-3 calls)")
    ap.add_argument("--budget", type=float, default=None,
                    help="seconds of timed steps per configuration: stop repeating once "
                         "spent (at least 3 steps or --repeats if fewer; default 60, "
                         "--quick 10)")
    ap.add_argument("--systems", type=name_list(SYSTEMS), default=list(SYSTEMS),
                    help=f"what to measure, comma-separated (default all: {','.join(SYSTEMS)}); "
                         "ratios need shmgrad")
    ap.add_argument("--reduce-floats", type=int_list, default=None,
                    help="slot sizes (floats) for the reduction benchmark (default: each "
                         f"model's parameter count and {LARGE_REDUCE_FLOATS})")
    ap.add_argument("--reduce-repeats", type=int, default=None,
                    help="timed repetitions of each reduction measurement (default 50; "
                         "--tiny: 5)")
    ap.add_argument("--timeout", type=float, default=900.0,
                    help="seconds one configuration (one system, model, batch size, N) may "
                         "take, start-up included, before it is abandoned (default 900)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the weights and batches")
    ap.add_argument("--quick", action="store_true",
                    help="a subset that runs in under two minutes on a 2-core machine: "
                         "mlp,cnn, batch 128, workers 1,2, budget 10 s")
    ap.add_argument("--tiny", action="store_true",
                    help="for tests: the tiny MLP, 2 repeats, small reductions")
    ap.add_argument("--out", default="bench-out",
                    help="directory for results.json, results.md and bench.png "
                         "(default ./bench-out)")
    return ap


def resolve(args):
    quick = args.quick or args.tiny
    if args.models is None:
        args.models = ["tiny"] if args.tiny else (["mlp", "cnn"] if quick else ["mlp", "cnn", "wrn"])
    if args.batch_sizes is None:
        args.batch_sizes = [128] if quick else [32, 128, 512]
    if args.workers is None:
        args.workers = [1, 2] if quick else default_workers()
    if args.repeats is None:
        args.repeats = 2 if args.tiny else 10
    if args.budget is None:
        args.budget = 10.0 if quick else 60.0
    if args.reduce_repeats is None:
        args.reduce_repeats = 5 if args.tiny else 50
    if args.repeats < 1 or args.warmup < 0 or args.reduce_repeats < 1 or args.budget <= 0:
        raise SystemExit("shmgrad bench: --repeats, --reduce-repeats and --budget must be "
                         "positive, --warmup >= 0")
    if args.timeout <= 0:
        raise SystemExit("shmgrad bench: --timeout must be positive")
    return args


def measure(args):
    """Runs every configuration; returns the list of result records."""
    records = []
    budget = Budget(args.repeats, args.budget)
    steps = args.warmup + args.repeats
    engine_count = 0
    systems = args.systems

    def record(base, system, workers, fn, ref=None):
        rec = dict(base, system=system, workers=workers, load_average=os.getloadavg()[0])
        t0 = _now()
        try:
            out, grad = fn()
            rec.update(out)
            rec.update(summarize(out["times_s"]))
            rec["grad_rel_err"] = (None if grad is None or ref is None
                                   else relative_error(grad, ref))
        except Exception as exc:  # one failed system must not stop the others
            rec["error"] = f"{type(exc).__name__}: {exc}"
            log(f"  {system} N={workers}: FAILED {rec['error']}")
            traceback.print_exc(file=sys.stderr)
            grad = None
        rec["config_seconds"] = _now() - t0
        if "median_s" in rec:
            log(f"  {system:9s} N={workers}: median {rec['median_s'] * 1e3:9.2f} ms "
                f"over {rec['n']} steps" + (f", overhead {rec['overhead_median'] * 100:.1f}%"
                                             if "overhead_median" in rec else ""))
        records.append(rec)
        return rec, grad

    for model_name in args.models:
        params = bench_models.num_parameters(bench_models.make_model(model_name, args.seed))
        for batch in args.batch_sizes:
            log(f"{model_name} ({params} parameters), batch {batch}")
            batches = bench_models.make_batches(model_name, batch, steps, args.seed)
            base = {"model": model_name, "params": params, "batch": batch,
                    "warmup": args.warmup}
            # The reference gradient (batch 0, whole batch, one process, 1 thread).
            ref = None
            single_by_n = {}
            if "single" in systems:
                rec, ref = record(base, "single-1t", 1, lambda: run_single(
                    model_name, batches, args.warmup, budget, 1, args.seed,
                    _now() + args.timeout))
                single_by_n[1] = rec
            for n in args.workers:
                if "single" in systems:
                    if n == 1:
                        rec = dict(single_by_n[1], system="single")
                        records.append(rec)
                    else:
                        record(base, "single", n, lambda: run_single(
                            model_name, batches, args.warmup, budget, n, args.seed,
                            _now() + args.timeout), ref)
                shm = None
                if "shmgrad" in systems:
                    engine_count += 1
                    name = f"bench-{os.getpid()}-{engine_count}"
                    shm, _ = record(base, "shmgrad", n, lambda: run_shmgrad(
                        model_name, batches, args.warmup, budget, n, args.seed,
                        _now() + args.timeout, name), ref)
                if "ddp" in systems:
                    est = (shm or {}).get("median_s") or single_by_n.get(1, {}).get("median_s")
                    reps = ddp_repeats(budget, est)
                    record(base, "ddp", n, lambda: run_ddp(
                        model_name, batch, args.warmup, reps, n, args.seed,
                        _now() + args.timeout), ref)
                if "dask" in systems:
                    record(base, "dask", n, lambda: run_dask(
                        model_name, batches, args.warmup, budget, n, args.seed,
                        _now() + args.timeout), ref)
    bench_models.set_threads(1)

    # Ratios to shmgrad, same model, batch and N.
    shm = {(r["model"], r["batch"], r["workers"]): r for r in records
           if r["system"] == "shmgrad" and "median_s" in r}
    for r in records:
        s = shm.get((r["model"], r["batch"], r["workers"]))
        if s is not None and "median_s" in r:
            r["ratio_to_shmgrad"] = r["median_s"] / s["median_s"]
        elif r["system"] == "single-1t":
            # single-1t is one number per model and batch: compare with every N's shmgrad.
            r["ratio_to_shmgrad_by_n"] = {
                str(n): r["median_s"] / shm[(r["model"], r["batch"], n)]["median_s"]
                for n in args.workers if (r["model"], r["batch"], n) in shm and "median_s" in r}
    return records


def measure_reduce(args, models_params):
    out = []
    if "reduce" not in args.systems:
        return out
    sizes = args.reduce_floats
    if sizes is None:
        sizes = sorted(set(p for p in models_params if p >= 16) |
                       ({65536} if args.tiny else {LARGE_REDUCE_FLOATS}))
    log("reduction: N slots of P floats in shared memory vs memcpy")
    for n in args.workers:
        for p in sizes:
            rec = {"system": "reduce", "workers": n, "floats": p}
            try:
                rec.update(run_reduce(n, p, args.reduce_repeats, args.timeout))
                log(f"  N={n} P={p}: reduce {rec['reduce_gbps_median']:.2f} GB/s, memcpy "
                    f"{rec['memcpy_gbps_median']:.2f} GB/s ({rec['ratio'] * 100:.0f}%)")
            except Exception as exc:
                rec["error"] = f"{type(exc).__name__}: {exc}"
                log(f"  N={n} P={p}: FAILED {rec['error']}")
            out.append(rec)
    return out


# -- targets (issue 5) ----------------------------------------------------------------
def evaluate_targets(records, reductions):
    """The issue's targets, checked on what was measured: a list of dicts."""
    out = []
    for r in records:
        if r["system"] == "shmgrad" and "overhead_median" in r and r["model"] in ("cnn", "wrn") \
                and r["batch"] == 128:
            out.append({"target": "shmgrad overhead < 5% (CNN, WRN at batch 128)",
                        "config": f"{r['model']} b{r['batch']} N={r['workers']}",
                        "value": f"{r['overhead_median'] * 100:.1f}%",
                        "met": r["overhead_median"] < 0.05})
    for r in reductions:
        if "ratio" in r:
            out.append({"target": "reduction > 70% of memcpy bandwidth",
                        "config": f"N={r['workers']} P={r['floats']}",
                        "value": f"{r['reduce_gbps_median']:.1f} vs {r['memcpy_gbps_median']:.1f} "
                                 f"GB/s = {r['ratio'] * 100:.0f}%",
                        "met": r["ratio"] > 0.70})
    memcpy = {(r["workers"], r["floats"]): r["memcpy_gbps_median"] for r in reductions
              if "memcpy_gbps_median" in r}
    for r in records:
        bw = memcpy.get((r["workers"], r["params"]))
        if r["system"] == "shmgrad" and "reduce_phase_gbps" in r and bw:
            r["reduce_phase_vs_memcpy"] = r["reduce_phase_gbps"] / bw
            out.append({"target": "engine's reduce phase (GradientStats.reduce_seconds) > 70% "
                                  "of memcpy bandwidth",
                        "config": f"{r['model']} b{r['batch']} N={r['workers']} P={r['params']}",
                        "value": f"{r['reduce_phase_gbps']:.1f} vs {bw:.1f} GB/s = "
                                 f"{r['reduce_phase_vs_memcpy'] * 100:.0f}%",
                        "met": r["reduce_phase_vs_memcpy"] > 0.70})
    for r in records:
        if r["system"] in ("ddp", "dask") and "ratio_to_shmgrad" in r:
            out.append({"target": f"shmgrad faster than {r['system']}",
                        "config": f"{r['model']} b{r['batch']} N={r['workers']}",
                        "value": f"{r['system']}/shmgrad = {r['ratio_to_shmgrad']:.3f}x",
                        "met": r["ratio_to_shmgrad"] > 1.0})
    return out


# -- reporting ------------------------------------------------------------------------
def fmt_ms(s):
    return "-" if s is None else (f"{s * 1e3:.3f}" if s < 0.01 else f"{s * 1e3:.1f}")


def table(records, reductions, targets):
    """The results as Markdown tables."""
    lines = ["| model | batch | N | system | median ms | min ms | max ms | IQR ms | steps "
             "| vs shmgrad | notes |",
             "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---|"]
    order = {"single-1t": 0, "single": 1, "shmgrad": 2, "ddp": 3, "dask": 4}
    rows = sorted(records, key=lambda r: (r["model"], r["batch"], r["workers"],
                                          order.get(r["system"], 9)))
    seen_1t = set()
    for r in rows:
        key = (r["model"], r["batch"])
        if r["system"] == "single-1t":
            if key in seen_1t:
                continue
            seen_1t.add(key)
        if "error" in r:
            lines.append(f"| {r['model']} | {r['batch']} | {r['workers']} | {r['system']} | "
                         f"FAILED | | | | | | {r['error'][:80]} |")
            continue
        if r["system"] == "single-1t":
            by_n = r.get("ratio_to_shmgrad_by_n", {})
            ratio = ", ".join(f"N={n}: {v:.2f}x" for n, v in by_n.items()) or "-"
        else:
            ratio = f"{r['ratio_to_shmgrad']:.2f}x" if "ratio_to_shmgrad" in r else "-"
        notes = []
        if r["system"] == "shmgrad":
            notes.append(f"overhead {r['overhead_median'] * 100:.1f}%")
            notes.append(f"slowest worker f+b {fmt_ms(r['compute_max_median_s'])} ms")
            notes.append(f"reduce phase {fmt_ms(r['reduce_median_s'])} ms "
                         f"({r['reduce_phase_gbps']:.1f} GB/s)")
        if r["system"] in ("single", "single-1t"):
            notes.append(f"{r['threads']} thread{'s' if r['threads'] > 1 else ''}")
        if r.get("grad_rel_err") is not None and r["system"] != "single-1t":
            notes.append(f"grad rel. diff {r['grad_rel_err']:.1e}")
        iqr = r["q3_s"] - r["q1_s"]
        lines.append(f"| {r['model']} | {r['batch']} | {r['workers'] if r['system'] != 'single-1t' else '-'} "
                     f"| {r['system']} | {fmt_ms(r['median_s'])} | {fmt_ms(r['min_s'])} | "
                     f"{fmt_ms(r['max_s'])} | {fmt_ms(iqr)} | {r['n']} | {ratio} | {'; '.join(notes)} |")
    if reductions:
        lines += ["", "| reduce N | floats P | reduce GB/s (median) | min-max | memcpy GB/s "
                  "(median) | min-max | reduce/memcpy |", "|---:|---:|---:|---:|---:|---:|---:|"]
        for r in reductions:
            if "error" in r:
                lines.append(f"| {r['workers']} | {r['floats']} | FAILED | | | | {r['error'][:60]} |")
                continue
            lines.append(f"| {r['workers']} | {r['floats']} | {r['reduce_gbps_median']:.2f} | "
                         f"{r['reduce_gbps_min']:.1f}-{r['reduce_gbps_max']:.1f} | "
                         f"{r['memcpy_gbps_median']:.2f} | {r['memcpy_gbps_min']:.1f}-"
                         f"{r['memcpy_gbps_max']:.1f} | {r['ratio'] * 100:.0f}% |")
    if targets:
        lines += ["", "| target | configuration | measured | met |", "|---|---|---|---|"]
        for t in targets:
            lines.append(f"| {t['target']} | {t['config']} | {t['value']} | "
                         f"{'yes' if t['met'] else 'NO'} |")
    return "\n".join(lines) + "\n"


def plot(records, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(r["model"] for r in records))
    batches = sorted(set(r["batch"] for r in records))
    width = max(9.0, 4.2 * len(batches))
    height = 3.4 * len(models) + 0.9
    fig, axes = plt.subplots(len(models), len(batches), squeeze=False, figsize=(width, height))
    styles = {"single-1t": ("tab:gray", "--", ""), "single": ("tab:blue", "-", "o"),
              "shmgrad": ("tab:red", "-", "s"), "ddp": ("tab:green", "-", "^"),
              "dask": ("tab:purple", "-", "D")}
    for i, m in enumerate(models):
        for j, b in enumerate(batches):
            ax = axes[i][j]
            rs = [r for r in records if r["model"] == m and r["batch"] == b and "median_s" in r]
            ns = sorted(set(r["workers"] for r in rs if r["system"] != "single-1t"))
            for system, (color, ls, marker) in styles.items():
                pts = sorted((r["workers"], r) for r in rs if r["system"] == system)
                if system == "single-1t" and pts and ns:
                    r = pts[0][1]
                    ax.plot([ns[0], ns[-1]], [r["median_s"] * 1e3] * 2, color=color, ls=ls,
                            label=LABELS[system])
                    continue
                if not pts:
                    continue
                xs = [n for n, _ in pts]
                ys = [r["median_s"] * 1e3 for _, r in pts]
                lo = [(r["median_s"] - r["min_s"]) * 1e3 for _, r in pts]
                hi = [(r["max_s"] - r["median_s"]) * 1e3 for _, r in pts]
                ax.errorbar(xs, ys, yerr=[lo, hi], color=color, ls=ls, marker=marker,
                            capsize=3, label=LABELS[system])
            ax.set_title(f"{m}, batch {b}")
            ax.set_xlabel("workers N")
            ax.set_ylabel("step time, ms (median, min-max)")
            ax.set_yscale("log")
            if ns:
                ax.set_xticks(ns)
            ax.grid(True, which="both", alpha=0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=3, fontsize=8)
    fig.tight_layout(rect=(0, 0.75 / height, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _jsonable(x):
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    return x


def main(argv=None):
    args = resolve(build_parser().parse_args(argv))
    os.makedirs(args.out, exist_ok=True)
    started = datetime.datetime.now().isoformat(timespec="seconds")
    t0 = _now()
    load_before = os.getloadavg()
    info = machine_info()
    log(f"machine: {info.get('cpu_model', '?')}, {info['cpu_count']} CPUs, torch {info['torch']}; "
        f"load average {load_before[0]:.2f}")
    if load_before[0] > 0.5 * (os.cpu_count() or 1):
        log("warning: the 1-minute load average is above half the CPUs: if other work is "
            "running, the numbers will be noisy")
    log(f"models {','.join(args.models)}, batch sizes {args.batch_sizes}, workers "
        f"{args.workers}, {args.warmup} warm-up + up to {args.repeats} timed steps "
        f"(budget {args.budget:g} s), systems {','.join(args.systems)}")
    records = measure(args)
    params = [bench_models.num_parameters(bench_models.make_model(m, args.seed))
              for m in args.models]
    reductions = measure_reduce(args, params)
    targets = evaluate_targets(records, reductions)
    text = table(records, reductions, targets)
    result = {
        "schema": 1,
        "command": "shmgrad bench " + " ".join(sys.argv[1:] if argv is None else argv),
        "started": started,
        "duration_s": _now() - t0,
        "machine": info,
        "load_average_before": list(load_before),
        "load_average_after": list(os.getloadavg()),
        "args": {k: v for k, v in vars(args).items()},
        "results": records,
        "reduction": reductions,
        "targets": targets,
    }
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(_jsonable(result), f, indent=1)
    with open(os.path.join(args.out, "results.md"), "w") as f:
        f.write(text)
    try:
        plot(records, os.path.join(args.out, "bench.png"))
    except Exception as exc:
        log(f"plot failed: {type(exc).__name__}: {exc}")
    print(text)
    print(f"wrote {os.path.join(args.out, 'results.json')}, results.md, bench.png "
          f"({result['duration_s']:.0f} s)")
    failed = [r for r in records + reductions if "error" in r]
    if failed:
        log(f"{len(failed)} configuration(s) failed")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
