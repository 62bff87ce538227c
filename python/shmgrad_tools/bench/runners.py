"""The systems ``shmgrad bench`` measures, one runner each: a single process, a shmgrad
engine (TorchScript or eager workers), DDP over gloo or over the shmgrad backend, shmgrad
engines on several nodes (``--nodes``), Dask with a deep copy per task, the reduction
alone, and the collectives of gloo and the shmgrad backend (``--collectives``).

Every runner of a training step takes the same batches and returns ``(record, grad)``:
the step times and what else it measured, and the gradient of batch 0 as one float64
vector (the report compares it with the single process's).
"""

import copy
import json
import logging
import os
import queue as queue_mod
import socket
import statistics
import subprocess
import warnings

import torch
import torch.multiprocessing as mp
import torch.nn.functional as F

from shmgrad import program
from . import collectives, ddp, models
from . import nodes as nodes_rank
from . import paired as paired_rank
from .timing import now, summarize, timed_steps


# -- 1. single process ----------------------------------------------------------------
def single_step(model, x, y):
    """One training step's gradient in this process, as a plain loop computes it (the
    gradients set to None, then backward): its seconds."""
    t0 = now()
    for p in model.parameters():
        p.grad = None
    F.cross_entropy(model(x), y, reduction="sum").backward()
    return now() - t0


def run_single(model_name, batches, warmup, budget, threads, seed, deadline):
    models.set_threads(threads)
    model = models.make_model(model_name, seed)
    model.train()
    grad = None

    def step(i, x, y, left):
        nonlocal grad
        dt = single_step(model, x, y)
        if i == 0:
            grad = models.flat_grad(model)
        return dt

    times = timed_steps(batches, warmup, budget, deadline, "single-process", step)
    return {"times_s": times, "threads": threads}, grad


# -- 2. shmgrad -----------------------------------------------------------------------
def bf16_forward(model, batch):
    """The bench's loss with the model under bfloat16 autocast (the bf16 system)."""
    x, y = batch
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(x)
    return F.cross_entropy(out.float(), y, reduction="sum")


def run_shmgrad(
    model_name,
    batches,
    warmup,
    budget,
    workers,
    seed,
    deadline,
    engine_name,
    mode="script",
    compile=False,
    autocast=False,
    auto=False,
):
    """An engine of ``workers`` workers, TorchScript (``mode="script"``) or eager Python
    (``mode="eager"``: the same nn.Module run as it is, torch.compile'd in each worker
    with ``compile``, its forward under bfloat16 autocast with ``autocast``), fed the
    batches explicitly. ``auto``: ``workers="auto"`` over ``workers`` cores (this process,
    and so the engine it starts, restricted to that many CPUs while it runs); its placement
    probe runs on the batches before the warm-up and the timed steps."""
    models.set_threads(1)  # the trainer only copies the batch in and waits
    model = models.make_model(model_name, seed)
    batch = batches[0][0].shape[0]
    engine = None
    cpus = os.sched_getaffinity(0)
    try:
        if auto:
            if workers > len(cpus):
                raise RuntimeError(f"{workers} cores asked for, {len(cpus)} available")
            os.sched_setaffinity(0, sorted(cpus)[:workers])
        t_start = now()
        engine = models.engine(
            model,
            "auto" if auto else workers,
            engine_name,
            batch,
            batches[0][0],
            max(10.0, min(120.0, deadline - now())),
            mode=mode,
            compile=compile,
            **({"forward": bf16_forward, "loss_reduction": "sum"} if autocast else {}),
        )
        startup = now() - t_start
        overheads, engine_overheads, compute, reduce_s, engine_wall = [], [], [], [], []
        grads = engine.gradient_tensors()  # read directly: no module is bound
        grad = None
        placement = {}
        if auto:
            placement = probe_placement(engine, batches, deadline)
            workers = placement["participants"]  # the steps' participants

        def step(i, x, y, left):
            nonlocal grad
            t0 = now()
            st = engine.gradient(inputs=x, targets=y, reduction="sum", timeout=left)
            dt = now() - t0
            if st.workers != workers:
                raise RuntimeError(f"the step ran on {st.workers} workers, not {workers}")
            if i == 0:
                grad = models.flat(grads)
            if i >= warmup:
                slowest = max(st.compute_seconds)
                compute.append(slowest)
                reduce_s.append(st.reduce_seconds)
                engine_wall.append(st.wall_seconds)
                overheads.append((dt - slowest) / dt)
                engine_overheads.append(
                    (st.wall_seconds - slowest) / st.wall_seconds if st.wall_seconds > 0 else 0.0
                )
            return dt

        label = (
            "shmgrad"
            if mode == "script"
            else f"shmgrad ({mode}{', compiled' if compile else ''}{', bf16' if autocast else ''})"
        ) + (" auto" if auto else "")
        times = timed_steps(batches, warmup, budget, deadline, label, step)
        record = {
            **placement,
            "times_s": times,
            "threads": placement.get("threads", 1),
            "startup_s": startup,
            "overhead_median": statistics.median(overheads),
            "overhead_per_step": overheads,
            "engine_overhead_median": statistics.median(engine_overheads),
            "compute_max_median_s": statistics.median(compute),
            "reduce_median_s": statistics.median(reduce_s),
            "engine_wall_median_s": statistics.median(engine_wall),
        }
        if workers > 1:
            # The engine's whole reduce phase (ipc::reduceSlice and the non-finite check of
            # the reduced slice), as bandwidth over the bytes the reduction must move; one
            # worker reduces nothing (its slot is the result), so no bandwidth then.
            record["reduce_phase_gbps"] = (
                (workers + 1)
                * models.num_parameters(model)
                * 4
                / max(record["reduce_median_s"], 1e-12)
                / 1e9
            )
        return record, grad
    finally:
        if engine is not None:
            engine.close()
        os.sched_setaffinity(0, cpus)


PROBE_LIMIT_S = 120  # the probe's own budget is 10 s after every candidate's first sample


def probe_placement(engine, batches, deadline):
    """Runs an engine started with workers="auto" on the batches, in turn, until its
    placement probe has chosen: what it chose, its steps and seconds, and what it measured."""
    t0, steps = now(), 0
    # The probe settles and times each visit for 50 ms: thousands of steps this short. The
    # client's own flag, not status(): a status() call between steps (74 us on the 2-vCPU
    # guest) would fall in every probe sample (one step's start to the next's).
    while engine._placement_probing:
        if now() > min(deadline, t0 + PROBE_LIMIT_S):
            raise RuntimeError(
                f"the placement probe did not choose in {steps} steps ({now() - t0:.0f} s)"
            )
        x, y = batches[steps % len(batches)]
        engine.gradient(inputs=x, targets=y, reduction="sum", timeout=max(1.0, deadline - now()))
        steps += 1
    st = engine.status()
    # The trainer computing the steps itself: one participant, its own.
    if st.placement_in_trainer:
        where, participants = "trainer", 1
    else:
        participants = st.placement_workers or len(st.ready_workers)
        where = str(participants)
    return {
        "threads": st.placement_threads,
        "placement": f"{where}x{st.placement_threads}",
        "participants": participants,
        "probe_steps": steps,
        "probe_s": now() - t0,
        "probe": list(st.placement_probe),
    }


# A paired run against one process with N threads alternates blocks of this many timed
# steps, each block after untimed steps for at least PAIRED_SETTLE_S: the other system's
# threads stop spinning meanwhile (libgomp's OpenMP threads after a parallel region, the
# engine's workers after a step, each for about a millisecond at most), and the timed
# steps follow each other as in a training loop. A pause instead (idle cores, then one
# step) measured a cold step: one MLP step at batch 32 took 2.3 ms after a 10 ms pause
# and 1.1 ms back to back, for either system.
PAIRED_BLOCK = 5
PAIRED_SETTLE_S = 0.003


def run_auto_paired(
    model_name, batches, warmup, repeats, workers, seed, deadline, engine_prefix, systems
):
    """``--paired`` with the single process and ``systems`` of "auto" and "eager-auto":
    one process with ``workers`` intra-op threads and, in the same process, an engine with
    workers="auto" over the same ``workers`` CPUs for each of ``systems`` (its placement
    probed first on the batches), in turn in blocks of PAIRED_BLOCK timed steps (the
    order reversed each round), each block after untimed steps for PAIRED_SETTLE_S. So
    both see the same moments of a noisy machine, and neither runs while the other's
    threads still spin. Returns ``{"single-paired": ..., system + "-paired": ...}``;
    each engine's record carries the ratios single / engine of the blocks' medians, a
    moment apart (``paired_ratios``), and their median."""
    cpus = os.sched_getaffinity(0)
    if workers > len(cpus):
        raise RuntimeError(f"{workers} cores asked for, {len(cpus)} available")
    batch = batches[0][0].shape[0]
    engines = {}
    try:
        os.sched_setaffinity(0, sorted(cpus)[:workers])  # the engines' processes inherit it
        models.set_threads(1)  # the trainer only copies the batch in and waits
        for k, system in enumerate(systems):
            engine = models.engine(
                models.make_model(model_name, seed),
                "auto",
                f"{engine_prefix}-{k}",
                batch,
                batches[0][0],
                max(10.0, min(120.0, deadline - now())),
                mode="script" if system == "auto" else "eager",
            )
            engines[system] = [engine, engine.gradient_tensors(), None]  # closed if the probe fails
            engines[system][2] = probe_placement(engine, batches, deadline)
        models.set_threads(workers)
        model = models.make_model(model_name, seed)
        model.train()
        names = ["single"] + list(systems)
        times = {s: [] for s in names}
        grads = {}

        def step(system, i, x, y):
            if system == "single":
                dt = single_step(model, x, y)
                if i == 0:
                    grads[system] = models.flat_grad(model)
                return dt
            engine, views, _ = engines[system]
            t0 = now()
            engine.gradient(
                inputs=x, targets=y, reduction="sum", timeout=max(1.0, deadline - now())
            )
            dt = now() - t0
            if i == 0:
                grads[system] = models.flat(views)
            return dt

        for system in names:  # batch 0 first: the gradient each reports
            for i in range(max(1, warmup)):
                step(system, i, *batches[i % len(batches)])
        blocks = {s: [] for s in names}
        for r in range(max(2, -(-repeats // PAIRED_BLOCK))):
            if now() > deadline:
                raise RuntimeError(f"paired run over its deadline after {r} rounds")
            for system in names if r % 2 == 0 else names[::-1]:
                settle = now() + PAIRED_SETTLE_S
                k = r * PAIRED_BLOCK
                step(system, -1, *batches[k % len(batches)])
                while now() < settle:
                    step(system, -1, *batches[k % len(batches)])
                block = [
                    step(system, -1, *batches[(k + j) % len(batches)]) for j in range(PAIRED_BLOCK)
                ]
                times[system].extend(block)
                blocks[system].append(statistics.median(block))
        out = {"single-paired": ({"times_s": times["single"], "threads": workers}, grads["single"])}
        for system in systems:
            ratios = [a / b for a, b in zip(blocks["single"], blocks[system])]
            placement = engines[system][2]
            out[f"{system}-paired"] = (
                {
                    **placement,
                    "times_s": times[system],
                    "paired_ratios": ratios,
                    "paired_ratio_median": statistics.median(ratios),
                },
                grads[system],
            )
        return out
    finally:
        for engine, _, _ in engines.values():
            engine.close()
        models.set_threads(1)
        os.sched_setaffinity(0, cpus)


# -- 3. DDP (gloo, or the shmgrad backend) ----------------------------------------------
def _free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_ranks(target, ranks, args, deadline, what):
    """Spawns ``ranks`` processes running ``target(rank, *args, queue, timeout_s)``, each
    putting ``(rank, result)`` on the queue; returns ``({rank: result}, seconds)``. Every
    wait is bounded by ``deadline``; ranks still alive at the end are killed."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    timeout_s = max(30, int(deadline - now()))
    t_start = now()
    procs = mp.start_processes(
        target, nprocs=ranks, join=False, start_method="spawn", args=args + (q, timeout_s)
    )
    results = {}
    try:
        while len(results) < ranks:
            left = deadline - now()
            if left <= 0:
                raise TimeoutError(f"{what} run went past --timeout")
            try:
                rank, res = q.get(timeout=min(1.0, left))
            except queue_mod.Empty:
                if any(p.exitcode not in (None, 0) for p in procs.processes):
                    # Give a crashing rank a moment to report its traceback first.
                    try:
                        rank, res = q.get(timeout=2.0)
                    except queue_mod.Empty:
                        codes = [p.exitcode for p in procs.processes]
                        raise RuntimeError(f"a {what} rank died (exit codes {codes})") from None
                else:
                    continue
            if "error" in res:
                raise RuntimeError(f"{what} rank {rank} failed:\n{res['error']}")
            results[rank] = res
        for p in procs.processes:
            p.join(max(1.0, min(30.0, deadline - now())))
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
    return results, now() - t_start


def _step_times(results):
    """Per step, from the first rank's start to the last rank's end."""
    starts = [r["start"] for r in results.values()]
    ends = [r["end"] for r in results.values()]
    return [max(e[i] for e in ends) - min(s[i] for s in starts) for i in range(len(starts[0]))]


def run_ddp(model_name, batch, warmup, repeats, workers, seed, deadline, pin=False, backend="gloo"):
    """DDP with ``workers`` ranks whose process group is ``backend``'s: "gloo" (TCP on
    127.0.0.1) or "shmgrad" (the backend over this machine's shared memory)."""
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    port = _free_port()
    os.environ["MASTER_PORT"] = str(port)
    results, total = _run_ranks(
        ddp.rank_main,
        workers,
        (workers, port, model_name, batch, warmup, repeats, seed, pin, backend),
        deadline,
        f"DDP ({backend})",
    )
    times = _step_times(results)
    return {
        "times_s": times,
        "threads": 1,
        "total_s": total,
        "loopback_bytes_per_node_step": (
            results[0]["loopback_bytes"] / max(1, len(times)) / workers
        ),
    }, results[0]["grad"]


def ring_bytes_sent(payload_bytes, nodes):
    """Bytes each rank sends in a ring all-reduce (gloo's algorithm for CPU tensors):
    reduce-scatter, then all-gather, each (nodes-1)/nodes of the buffer."""
    return 2 * (nodes - 1) / nodes * payload_bytes


# -- 3b. shmgrad on several nodes -------------------------------------------------------
def run_nodes(run: nodes_rank.NodeRun, deadline):
    """``run.world`` ranks on 127.0.0.1, each a shmgrad engine of ``run.workers`` workers
    with a gloo process group (bench/nodes.py), timed like DDP; with ``run.pin`` each on
    its share of the CPUs."""
    results, total = _run_ranks(
        nodes_rank.rank_main, run.world, (run, _free_port()), deadline, "shmgrad node"
    )
    out = _nodes_summary(results, run.world, run.workers)
    out.update(
        {
            "total_s": total,
            "loopback_bytes_per_node_step": results[0]["loopback_bytes"]
            / max(1, len(out["times_s"]))
            / run.world,
        }
    )
    return out, results[0]["grad"]


def _nodes_summary(results, nodes, workers):
    """The record of a shmgrad-nodes run from its ranks' results (``nodes.node_step``'s
    figures and the step times)."""
    times = _step_times(results)
    steps = range(len(times))
    # The all-reduce's share of a step, averaged over the nodes (a node that arrives
    # first waits in the all-reduce for the others: that wait counts as all-reduce).
    shares = [
        statistics.mean(r["allreduce"][i] for r in results.values()) / times[i] for i in steps
    ]
    return {
        "times_s": times,
        "threads": 1,
        "nodes": nodes,
        "workers_per_node": workers,
        "allreduce_share_median": statistics.median(shares),
        "allreduce_median_s": statistics.median(
            statistics.mean(r["allreduce"][i] for r in results.values()) for i in steps
        ),
        "compute_max_median_s": statistics.median(
            max(r["compute"][i] for r in results.values()) for i in steps
        ),
        "allreduce_bytes": results[0]["allreduce_bytes"],
        "sent_bytes_per_node_step": ring_bytes_sent(results[0]["allreduce_bytes"], nodes),
    }


def run_paired(run: nodes_rank.NodeRun, deadline):
    """``--paired``: ``run.world`` ranks that are each a shmgrad node and a DDP rank, every
    batch through both in turn (bench/nodes.py ``paired_rank_main``). Returns
    ``{"shmgrad-nodes": (record, grad), "ddp": (record, grad)}``; the records carry the
    per-step ratios DDP / shmgrad (``paired_ratios``), each of two steps a moment apart."""
    results, total = _run_ranks(
        nodes_rank.paired_rank_main,
        run.world,
        (run, _free_port()),
        deadline,
        "paired shmgrad node and DDP rank",
    )
    node = {r: res["shmgrad-nodes"] for r, res in results.items()}
    ranks = {r: res["ddp"] for r, res in results.items()}
    node_rec = _nodes_summary(node, run.world, run.workers)
    ddp_rec = {"times_s": _step_times(ranks), "threads": 1, "nodes": run.world}
    ratios = [d / s for d, s in zip(ddp_rec["times_s"], node_rec["times_s"])]
    for rec in (node_rec, ddp_rec):
        rec.update({"total_s": total, "paired_ratios": ratios})
    return {"shmgrad-nodes": (node_rec, node[0]["grad"]), "ddp": (ddp_rec, ranks[0]["grad"])}


def run_local_paired(
    model_name, batch, warmup, repeats, workers, seed, deadline, engine_prefix, systems
):
    """``--paired`` on one machine: DDP with ``workers`` ranks and, in its rank 0, an
    engine of ``workers`` workers for each engine system of ``systems`` ("shmgrad",
    "eager"), and with "ddp-shmgrad" DDP over a shmgrad group of the same ranks, every
    batch through each in turn (bench/paired.py). Returns ``{system + "-paired": (record,
    grad)}`` for "ddp" and each of ``systems``; each record but DDP-gloo's carries the
    per-step ratios DDP / this (``paired_ratios``) of steps a moment apart, and their
    median."""
    results, total = _run_ranks(
        paired_rank.rank_main,
        workers,
        (workers, _free_port(), model_name, batch, warmup, repeats, seed, engine_prefix, systems),
        deadline,
        "paired DDP rank and shmgrad trainer",
    )
    ddp_times = _step_times({r: res["ddp"] for r, res in results.items()})
    out = {
        "ddp-paired": (
            {"times_s": ddp_times, "threads": 1, "total_s": total},
            results[0]["ddp"]["grad"],
        )
    }
    for system in systems:
        if system == paired_rank.DDP_SHMGRAD:  # timed across the ranks, like DDP-gloo
            times = _step_times({r: res[system] for r, res in results.items()})
            ratios = [d / s for d, s in zip(ddp_times, times)]
            out[f"{system}-paired"] = (
                {
                    "times_s": times,
                    "threads": 1,
                    "total_s": total,
                    "paired_ratios": ratios,
                    "paired_ratio_median": statistics.median(ratios),
                },
                results[0][system]["grad"],
            )
            continue
        res = results[0][system]  # the engine's trainer is rank 0
        times = [e - s for s, e in zip(res["start"], res["end"])]
        ratios = [d / s for d, s in zip(ddp_times, times)]
        out[f"{system}-paired"] = (
            {
                "times_s": times,
                "threads": 1,
                "total_s": total,
                "compute_max_median_s": statistics.median(res["compute"]),
                "overhead_median": statistics.median(
                    (t - c) / t for t, c in zip(times, res["compute"])
                ),
                "paired_ratios": ratios,
                "paired_ratio_median": statistics.median(ratios),
            },
            res["grad"],
        )
    return out


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

    models.set_threads(1)  # the threads of the in-process Dask worker start with this
    model = models.make_model(model_name, seed)
    model.train()
    batch = batches[0][0].shape[0]
    bounds = [(batch * r // workers, batch * (r + 1) // workers) for r in range(workers)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        client = Client(
            processes=False,
            n_workers=1,
            threads_per_worker=workers,
            dashboard_address=None,
            silence_logs=logging.ERROR,
        )
    try:
        grad = None

        def step(i, x, y, left):
            nonlocal grad
            t0 = now()
            # The parameters change every step in training: the model is shipped every step.
            model_f = client.scatter(model, hash=False)
            shards = client.scatter([(x[lo:hi], y[lo:hi]) for lo, hi in bounds], hash=False)
            parts = [client.submit(_dask_gradient_shard, model_f, s, pure=False) for s in shards]
            total = client.submit(_dask_sum, parts, pure=False)
            grads = total.result(timeout=left)
            dt = now() - t0
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
REDUCE_TIMEOUT_MARGIN_S = 10  # reduce_bench bounds its own waits by --timeout


def run_reduce(workers, floats, repeats, timeout):
    exe = program("reduce_bench")
    cmd = [
        exe,
        "--workers",
        str(workers),
        "--floats",
        str(floats),
        "--repeats",
        str(repeats),
        "--timeout",
        str(max(1, int(timeout))),
    ]
    p = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        timeout=timeout + REDUCE_TIMEOUT_MARGIN_S,
    )
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {p.returncode}: {p.stderr.strip()}")
    return json.loads(p.stdout)


# -- 6. the collectives of gloo and the shmgrad backend ------------------------------
def run_collectives(world, plan: collectives.Plan, deadline):
    """``world`` ranks measuring every size of ``plan`` through gloo and the shmgrad
    backend in the same processes (bench/collectives.py). Returns ``(records, run)``: one
    record per collective and size, and what the run measured once (the copy bandwidth,
    its seconds)."""
    results, total = _run_ranks(
        collectives.rank_main, world, (world, _free_port(), plan), deadline, "collectives"
    )
    copy = _copy_bandwidth(results, world)
    records = []
    for i, size in enumerate(plan.sizes):
        entries = [results[r]["sizes"][i] for r in range(world)]
        n = entries[0]["bytes"]
        for op in collectives.OPS:
            traffic = collectives.traffic_bytes(op, n, world)
            rec = {
                "collective": op,
                "ranks": world,
                "size": size,
                "bytes": n,
                "dtype": "float32",
                "traffic_bytes": traffic,
                "copy_gbps": copy["all_gbps"],
                "bound_s": traffic / (copy["all_gbps"] * 1e9),
            }
            for system in collectives.systems_of(op):
                parts = [e["ops"][op][system] for e in entries]
                times = _sample_times(parts)
                rec[system] = dict(
                    summarize(times),
                    times_s=times,
                    calls_per_sample=parts[0]["calls_per_sample"],
                    correct=all(p["correct"] for p in parts),
                )
                rec[system]["gbps"] = n / rec[system]["median_s"] / 1e9
            rec["gloo_over_shmgrad"] = rec["gloo"]["median_s"] / rec["shmgrad"]["median_s"]
            rec["shmgrad_over_bound"] = rec["shmgrad"]["median_s"] / rec["bound_s"]
            if collectives.ARENA in rec:
                arena = rec[collectives.ARENA]
                rec["arena_traffic_bytes"] = collectives.traffic_bytes(op, n, world, True)
                rec["arena_bound_s"] = rec["arena_traffic_bytes"] / (copy["all_gbps"] * 1e9)
                rec["gloo_over_arena"] = rec["gloo"]["median_s"] / arena["median_s"]
                rec["staged_over_arena"] = rec["shmgrad"]["median_s"] / arena["median_s"]
                rec["arena_over_bound"] = arena["median_s"] / rec["arena_bound_s"]
            records.append(rec)
    return records, {"ranks": world, "seconds": total, "copy": copy}


def _copy_bandwidth(results, world):
    """The copy bandwidth of the bound from the ranks' copies before and after the
    collectives (collectives.copy_bandwidth): per rank with every rank copying at once,
    and of one process alone; bytes read and written per second (GB/s), medians over the
    samples of both."""
    moved = 2 * collectives.COPY_BYTES

    def times(key, ranks):
        return [
            t
            for when in ("copy_before", "copy_after")
            for t in _step_times({r: results[r][when][key] for r in ranks})
        ]

    every, alone = summarize(times("all", range(world))), summarize(times("alone", [0]))
    return {
        "bytes": collectives.COPY_BYTES,
        "all": every,
        "alone": alone,
        "all_gbps": moved / every["median_s"] / 1e9,
        "alone_gbps": moved / alone["median_s"] / 1e9,
    }


def _sample_times(parts):
    """Per sample of k calls, from the first rank's start to the last rank's end, over k:
    ``parts`` are the ranks' {"calls_per_sample", "start", "end"}."""
    k = parts[0]["calls_per_sample"]
    return [t / k for t in _step_times(dict(enumerate(parts)))]
