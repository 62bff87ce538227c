"""`shmgrad bench --quick --tiny`: every system produces a number and the report files
exist. How fast anything is, is not tested."""

import glob
import json
import math
import os
import statistics
import subprocess
import sys

import pytest

EXPECTED_SYSTEMS = {"single-1t", "single", "shmgrad", "eager", "ddp", "ddp-shmgrad", "dask"}
PAIRED_SYSTEMS = {"shmgrad-paired", "eager-paired", "ddp-paired", "ddp-shmgrad-paired"}
OPS = ("all_reduce", "all_gather", "reduce_scatter")


def _finite_positive(x):
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


@pytest.mark.full  # long: every system of the matrix; test_bench's other tests run each part in CI
def test_quick_tiny_bench(tmp_path):
    out = tmp_path / "bench"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "shmgrad_tools.bench",
            "--quick",
            "--tiny",
            "--paired",
            "--out",
            str(out),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=str(tmp_path),
    )
    try:
        log, _ = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, log
    # Engines are named bench-<pid>-<k>: none may be left in /dev/shm.
    assert not glob.glob(f"/dev/shm/shmgrad-{os.getuid()}-bench-{proc.pid}-*"), log

    with open(out / "results.json") as f:
        result = json.load(f)
    assert (out / "results.md").stat().st_size > 0
    png = out / "bench.png"
    assert png.stat().st_size > 0
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"

    records = result["results"]
    assert not [r for r in records if "error" in r], log
    for workers in (1, 2):
        got = {
            r["system"] for r in records if r["workers"] == workers or r["system"] == "single-1t"
        }
        assert EXPECTED_SYSTEMS | PAIRED_SYSTEMS <= got, (workers, got)
        # --paired: DDP and both engines took turns on every batch, one ratio per pair.
        paired = {r["system"]: r for r in records if r["workers"] == workers}
        ddp = paired["ddp-paired"]
        for system in ("shmgrad-paired", "eager-paired"):
            r = paired[system]
            assert r["n"] == ddp["n"] == len(r["paired_ratios"]) >= 2, r
            ratios = [d / s for d, s in zip(ddp["times_s"], r["times_s"])]
            assert r["paired_ratios"] == ratios
            assert _finite_positive(r["paired_ratio_median"])
            assert any(
                t["config"] == f"tiny b128 N={workers}" and t["target"].startswith(system[:-7])
                for t in result["targets"]
            ), result["targets"]
        # DDP over gloo and over the shmgrad backend took turns in the same ranks.
        shm = paired["ddp-shmgrad-paired"]
        assert shm["n"] == ddp["n"] == len(shm["paired_ratios"]), shm
        assert shm["paired_ratios"] == [d / s for d, s in zip(ddp["times_s"], shm["times_s"])]
        assert shm["grad_rel_err"] < 1e-4, shm
    for r in records:
        assert r["model"] == "tiny" and r["batch"] == 128
        assert r["times_s"] and all(_finite_positive(t) for t in r["times_s"]), r
        for key in ("median_s", "min_s", "max_s"):
            assert _finite_positive(r[key]), (key, r)
        assert r["min_s"] <= r["median_s"] <= r["max_s"]
        if r["system"] in ("auto-paired", "eager-auto-paired"):
            assert _finite_positive(r["paired_ratio_median"]), r
        elif r["system"] not in ("single-1t", "single-paired"):
            assert _finite_positive(r["ratio_to_shmgrad"]), r
        if r["system"] in ("shmgrad", "eager", "shmgrad-paired", "eager-paired"):
            assert math.isfinite(r["overhead_median"]) and r["overhead_median"] < 1.0
            assert _finite_positive(r["compute_max_median_s"])
        if r["system"] in ("ddp", "ddp-shmgrad"):
            assert _finite_positive(r["ratio_to_eager"]), r
        if r["system"] == "ddp-shmgrad":
            assert _finite_positive(r["ratio_to_ddp"]), r
        if r.get("grad_rel_err") is not None:
            # Same model, same batch: every system computes the same gradient.
            assert r["grad_rel_err"] < 1e-4, r

    reductions = result["reduction"]
    assert {r["workers"] for r in reductions} == {1, 2}
    for r in reductions:
        assert "error" not in r, r
        assert r["correct"] is True
        assert _finite_positive(r["reduce_gbps_median"]) and _finite_positive(
            r["memcpy_gbps_median"]
        )

    assert result["targets"], "the issue's targets were not evaluated"


def test_help_documents_every_option():
    p = subprocess.run(
        [sys.executable, "-m", "shmgrad_tools.bench", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert p.returncode == 0, p.stderr
    for opt in (
        "--models",
        "--batch-sizes",
        "--workers",
        "--repeats",
        "--warmup",
        "--budget",
        "--systems",
        "--reduce-floats",
        "--reduce-repeats",
        "--timeout",
        "--seed",
        "--quick",
        "--tiny",
        "--out",
        "--nodes",
        "--paired",
        "--pin",
        "--bucket-cap-mb",
        "--collectives",
        "--sizes",
        "--ranks",
        "ddp-shmgrad",
    ):
        assert opt in p.stdout, opt


def test_node_options_without_nodes_are_refused(tmp_path):
    """--pin and --bucket-cap-mb mean nothing on one node: refused, naming the fix,
    before anything runs (no output directory)."""
    out = tmp_path / "never"
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "shmgrad_tools.bench",
            "--tiny",
            "--pin",
            "--bucket-cap-mb",
            "4",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert p.returncode != 0
    assert "--pin, --bucket-cap-mb" in p.stderr and "add --nodes K" in p.stderr, p.stderr
    assert not out.exists()


def test_feed_breakdown_tiny():
    """`python3 -m shmgrad_tools.bench.feed` (the step breakdown behind BENCHMARKS.md's MLP b512
    N=1 analysis) runs, times every kind of step and finds the three gradients equal."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "shmgrad_tools.bench.feed",
            "--model",
            "tiny",
            "--batch",
            "64",
            "--steps",
            "5",
            "--warmup",
            "2",
            "--batches",
            "3",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout
    lines = proc.stdout.splitlines()
    for label in ("eager, 1 thread", "shmgrad inputs=", "shmgrad indices=", "copying the batch"):
        line = next((ln for ln in lines if ln.strip().startswith(label)), None)
        assert line is not None, (label, proc.stdout)
        assert _finite_positive(float(line.split(label)[1].split()[0])), line
    assert "inputs= " in lines[-1] and "indices= " in lines[-1], proc.stdout


@pytest.mark.full  # 10-11 s: a benchmark tool's run, not the engine; CI stays under 40 minutes
def test_augment_tiny(tmp_path):
    """`python3 -m shmgrad_tools.bench.augment` (BENCHMARKS.md's augmentation numbers) runs both
    loops on examples/train_augmented.py's pipeline, finds their gradients equal and
    reports a ratio."""
    out = tmp_path / "augment.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "shmgrad_tools.bench.augment",
            "--models",
            "cnn",
            "--batch-size",
            "16",
            "--steps",
            "2",
            "--warmup",
            "1",
            "--train-examples",
            "200",
            "--json",
            str(out),
            "--examples",
            os.path.join(os.path.dirname(__file__), "..", "..", "examples"),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stdout
    assert "transforms in the workers" in proc.stdout and "target >= 1.6x" in proc.stdout
    assert "parallel speedup of the transforms" in proc.stdout, proc.stdout
    with open(out) as f:
        (r,) = json.load(f)["results"]
    assert r["model"] == "cnn" and r["workers"] == 2 and r["gradient_rel_diff"] < 1e-5
    assert _finite_positive(r["ratio"]) and _finite_positive(r["trainer_transform_median_s"])
    # The bound (T + C) / (T / S + C) lies in (1, S] for any positive T and C.
    assert 0 < r["parallel_speedup"] < 8, r
    assert 1 < r["ratio_bound_ideal"] <= 2 + 1e-9, r
    assert (
        min(1.0, r["parallel_speedup"]) - 1e-9
        <= r["ratio_bound"]
        <= max(1.0, r["parallel_speedup"]) + 1e-9
    ), r
    for loop in ("workers", "trainer"):
        assert _finite_positive(r["examples_per_s"][loop]), r


def test_breakdown_tiny(tmp_path):
    """`python3 -m shmgrad_tools.bench.breakdown` (BENCHMARKS.md's fixed cost of a step)
    runs, through the public GradientStats fields, and its parts add up to each step;
    `--threads` gives each worker that many intra-op threads."""
    out = tmp_path / "breakdown.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "shmgrad_tools.bench.breakdown",
            "--model",
            "tiny",
            "--batch",
            "8",
            "--workers",
            "1,2",
            "--threads",
            "2",
            "--steps",
            "20",
            "--warmup",
            "5",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "2 thread(s) per worker" in proc.stdout, proc.stdout
    result = json.loads(out.read_text())
    assert result["threads_per_worker"] == 2, result
    medians = result["medians_us"]
    assert len(medians) == 2
    assert all(m["threads_per_worker"] == 2 for m in medians.values()), medians
    for parts in medians.values() if isinstance(medians, dict) else medians:
        assert parts["total"] > 0 and 0 <= parts["fixed"] <= parts["total"]


def test_breakdown_with_sleeping_workers(tmp_path):
    """`breakdown --sleep-ms 5`: the workers' compute is a 5 ms sleep, so each step's
    compute part is at least that and the rest is the engine's own cost, at 1 and 3
    workers."""
    out = tmp_path / "breakdown.json"
    proc = subprocess.run(
        [sys.executable, "-m", "shmgrad_tools.bench.breakdown", "--sleep-ms", "5"]
        + ["--workers", "1,3", "--steps", "12", "--warmup", "3", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "workers sleeping 5 ms instead of computing" in proc.stdout, proc.stdout
    medians = json.loads(out.read_text())["medians_us"]
    parts = medians.values() if isinstance(medians, dict) else medians
    assert len(list(parts)) == 2
    for p in medians.values() if isinstance(medians, dict) else medians:
        assert p["compute"] >= 5000 and 0 <= p["fixed"] < p["total"], p


@pytest.mark.full  # 10 s; test_training_code checks autocast's gradients in CI
def test_bf16_autocast_against_float32_eager(tmp_path):
    """`--systems shmgrad,eager,bf16`: eager workers under bfloat16 autocast, reported
    against the float32 eager workers of the same run."""
    out = tmp_path / "bench"
    proc = subprocess.run(
        [sys.executable, "-m", "shmgrad_tools.bench", "--quick", "--tiny", "--workers", "2"]
        + ["--systems", "single,shmgrad,eager,bf16", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=str(tmp_path),
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    with open(out / "results.json") as f:
        records = json.load(f)["results"]
    (bf16,) = [r for r in records if r["system"] == "bf16"]
    assert "error" not in bf16, bf16
    assert _finite_positive(bf16["ratio_to_eager"]) and _finite_positive(bf16["median_s"])
    # bfloat16 products: close to the float32 gradient, not equal to it.
    assert bf16["grad_rel_err"] < 5e-2
    with open(out / "results.md") as f:
        assert "vs eager" in f.read()


def _bench(tmp_path, *args, timeout=240):
    """Runs `shmgrad bench ARGS --out tmp_path/bench`; returns (results.json, results.md)."""
    out = tmp_path / "bench"
    proc = subprocess.run(
        [sys.executable, "-m", "shmgrad_tools.bench", *args, "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=str(tmp_path),
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(out / "results.json") as f:
        result = json.load(f)
    return result, (out / "results.md").read_text()


@pytest.mark.full  # long; test_lightning and test_backend run DDP over the backend in CI
def test_ddp_over_the_shmgrad_backend_beside_ddp_gloo(tmp_path):
    """`--systems ddp,ddp-shmgrad` (and the single process, the gradient's reference):
    DDP over the shmgrad backend computes the same gradient as DDP-gloo, and is reported
    against it."""
    result, table = _bench(
        tmp_path, "--quick", "--tiny", "--workers", "2", "--systems", "single,ddp,ddp-shmgrad"
    )
    by_system = {r["system"]: r for r in result["results"] if r["workers"] == 2}
    assert {"ddp", "ddp-shmgrad"} <= set(by_system), by_system
    ddp, shm = by_system["ddp"], by_system["ddp-shmgrad"]
    for r in (ddp, shm):
        assert "error" not in r, r
        assert r["n"] >= 2 and all(_finite_positive(t) for t in r["times_s"]), r
        assert r["grad_rel_err"] < 1e-4, r
    assert shm["ratio_to_ddp"] == shm["median_s"] / ddp["median_s"]
    row = next(line for line in table.splitlines() if "| ddp-shmgrad |" in line)
    assert f"vs ddp {shm['ratio_to_ddp']:.2f}x" in row, row


def test_ddp_shmgrad_with_nodes_is_refused(tmp_path):
    """--nodes stands for machines of their own: ddp-shmgrad is refused there, by name,
    before anything runs (no output directory)."""
    out = tmp_path / "never"
    p = subprocess.run(
        [sys.executable, "-m", "shmgrad_tools.bench", "--nodes", "2", "--systems", "ddp-shmgrad"]
        + ["--out", str(out)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert p.returncode != 0 and "ddp-shmgrad does not run with --nodes" in p.stderr, p.stderr
    assert not out.exists()


def test_collectives_gloo_and_shmgrad_against_the_bound(tmp_path):
    """`--collectives`: every collective at every size through both backends, each
    first call right, every figure positive, the bound from the module's formulas."""
    result, table = _bench(
        tmp_path,
        "--collectives",
        "--ranks",
        "2",
        "--sizes",
        "4K,1M",
        "--repeats",
        "3",
        "--warmup",
        "1",
        "--budget",
        "2",
    )
    (run,) = result["collective_runs"]
    assert run["ranks"] == 2 and "error" not in run, run
    assert _finite_positive(run["copy"]["all_gbps"]), run
    assert _finite_positive(run["copy"]["alone_gbps"]), run
    records = result["results"]
    got = {(r["collective"], r["size"]) for r in records}
    assert got == {(op, size) for op in OPS for size in (4096, 1 << 20)}, got
    # (5 + 1/W) n, (2 + 2/W) n, (3 + 1/W) n at W = 2.
    per_byte = {"all_reduce": 5.5, "all_gather": 3.0, "reduce_scatter": 3.5}
    for r in records:
        assert r["ranks"] == 2 and r["bytes"] == r["size"], r
        assert r["traffic_bytes"] == per_byte[r["collective"]] * r["size"], r
        assert r["copy_gbps"] == run["copy"]["all_gbps"] and _finite_positive(r["bound_s"]), r
        assert math.isclose(r["bound_s"], r["traffic_bytes"] / (r["copy_gbps"] * 1e9))
        for system in ("gloo", "shmgrad"):
            s = r[system]
            assert s["correct"] is True, (system, r)
            assert s["n"] == len(s["times_s"]) == 3 and s["calls_per_sample"] >= 1, s
            assert all(_finite_positive(t) for t in s["times_s"]), s
            assert s["min_s"] <= s["median_s"] <= s["max_s"], s
            assert math.isclose(s["gbps"], r["size"] / s["median_s"] / 1e9), s
        assert r["gloo_over_shmgrad"] == r["gloo"]["median_s"] / r["shmgrad"]["median_s"]
        assert r["shmgrad_over_bound"] == r["shmgrad"]["median_s"] / r["bound_s"]
        # all_reduce also in the arenas (in place): right, and its own bound, (3 - 1/W) n.
        assert ("shmgrad-arena" in r) == (r["collective"] == "all_reduce"), r
        if r["collective"] == "all_reduce":
            a = r["shmgrad-arena"]
            assert a["correct"] is True and a["n"] == 3 and _finite_positive(a["median_s"]), r
            assert r["arena_traffic_bytes"] == 2.5 * r["size"], r
            assert r["gloo_over_arena"] == r["gloo"]["median_s"] / a["median_s"]
            assert r["staged_over_arena"] == r["shmgrad"]["median_s"] / a["median_s"]
            assert math.isclose(r["arena_over_bound"], a["median_s"] / r["arena_bound_s"])
    rows = [line for line in table.splitlines() if line.startswith("| all_") or "| reduce_" in line]
    assert len(rows) == len(records), table
    assert "Process settings: heap MALLOC_" in table and "GLOO_SOCKET_IFNAME=lo" in table
    assert result["process_settings"]["heap_environment"]["MALLOC_MMAP_MAX_"] == "0"


def test_collective_options_are_checked(tmp_path):
    """--collectives refuses the step matrix's options, and --sizes or --ranks alone ask
    for --collectives, before anything runs (no output directory)."""
    out = tmp_path / "never"
    for args, said in (
        (["--collectives", "--models", "tiny"], "--models choose(s) training steps"),
        (["--sizes", "4K"], "--sizes measure(s) collectives: add --collectives"),
        (["--collectives", "--sizes", "4x"], "expected comma-separated sizes"),
    ):
        p = subprocess.run(
            [sys.executable, "-m", "shmgrad_tools.bench", *args, "--out", str(out)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert p.returncode != 0 and said in p.stderr, (args, p.stderr)
    assert not out.exists()


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="auto over 2 cores needs 2 CPUs")
def test_eager_auto_may_place_the_steps_in_the_trainer(tmp_path):
    """`--systems eager-auto`: the probe also times the trainer computing each step itself
    (docs/DESIGN.md, "In the trainer"); whichever it keeps, the steps run on what it says
    (one participant where it is the trainer) and the row names it."""
    result, table = _bench(tmp_path, "--tiny", "--workers", "2", "--systems", "single,eager-auto")
    auto = next(r for r in result["results"] if r["system"] == "eager-auto")
    assert "error" not in auto, auto
    assert [c["in_trainer"] for c in auto["probe"]].count(True) == 1, auto["probe"]
    where, threads = auto["placement"].split("x")
    row = next(line for line in table.splitlines() if "| eager-auto |" in line)
    if where == "trainer":
        assert auto["participants"] == 1 and threads == "2", auto
        assert "placed in the trainer, 2 threads" in row, row
    else:
        assert auto["participants"] == int(where), auto
        assert f"placed {where} workers x {threads} threads" in row, row
    assert auto["grad_rel_err"] < 1e-4, auto


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="auto over 2 cores needs 2 CPUs")
def test_auto_placement_against_the_best_baseline(tmp_path):
    """`--systems single,auto`: the engine with workers="auto" over N=2 cores probes its
    placement on the batches first (the steps it took and what it chose are reported),
    computes the single process's gradient, and each engine row says the best baseline
    over it."""
    result, table = _bench(tmp_path, "--tiny", "--workers", "2", "--systems", "single,shmgrad,auto")
    by_system = {r["system"]: r for r in result["results"] if r["workers"] == 2}
    auto, single = by_system["auto"], by_system["single"]
    assert "error" not in auto, auto
    where, t = auto["placement"].split("x")
    t = int(t)
    w = 0 if where == "trainer" else int(where)
    assert (w, t) in {(0, 2), (1, 2), (2, 1)}, auto["placement"]
    assert auto["threads"] == t and auto["probe_steps"] >= 4 and auto["probe_s"] > 0, auto
    # TorchScript engines on the host probe the trainer computing the steps itself too.
    candidates = {(c["workers"], c["threads_per_worker"], c["in_trainer"]) for c in auto["probe"]}
    assert candidates == {(0, 2, True), (1, 2, False), (2, 1, False)}, auto["probe"]
    assert auto["grad_rel_err"] < 1e-4, auto
    for system in ("shmgrad", "auto"):
        r = by_system[system]
        assert r["best_baseline"] == "single", r
        assert r["best_baseline_over_this"] == single["median_s"] / r["median_s"], r
    row = next(line for line in table.splitlines() if "| auto |" in line)
    placed = "in the trainer, 2 threads" if w == 0 else f"{w} workers x {t} threads"
    assert f"placed {placed}" in row, row
    # The efficiency curves: one process with one thread over N times each system's.
    png = tmp_path / "bench" / "efficiency.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    single_1t = next(r for r in result["results"] if r["system"] == "single-1t")
    from shmgrad_tools.bench.report import efficiency

    curves = efficiency(result["results"])[("tiny", 128)]
    assert curves["auto"] == [(2, single_1t["median_s"] / (2 * auto["median_s"]))], curves
    assert f"single / this {auto['best_baseline_over_this']:.2f}x" in row, row


def test_auto_paired_with_one_process_of_n_threads(tmp_path):
    """`--systems single,auto --paired`: the single process with 2 threads and the engine
    with workers="auto" over 2 cores take turns in one process, in blocks of steps, one
    ratio per pair of blocks, both computing the single process's gradient; the target is
    evaluated."""
    from shmgrad_tools.bench.runners import PAIRED_BLOCK

    result, table = _bench(
        tmp_path, "--tiny", "--workers", "2", "--systems", "single,auto", "--paired"
    )
    by_system = {r["system"]: r for r in result["results"] if r["workers"] == 2}
    single, auto = by_system["single-paired"], by_system["auto-paired"]
    assert "error" not in auto and "error" not in single, (single, auto)
    assert single["threads"] == 2
    assert auto["n"] == single["n"] == PAIRED_BLOCK * len(auto["paired_ratios"]), auto
    assert len(auto["paired_ratios"]) >= 2, auto

    def block_medians(times):
        return [
            statistics.median(times[k : k + PAIRED_BLOCK])
            for k in range(0, len(times), PAIRED_BLOCK)
        ]

    assert auto["paired_ratios"] == [
        s / a for s, a in zip(block_medians(single["times_s"]), block_medians(auto["times_s"]))
    ]
    assert _finite_positive(auto["paired_ratio_median"])
    assert auto["placement"] in {"trainerx2", "1x2", "2x1"} and auto["probe_steps"] >= 4, auto
    assert auto["grad_rel_err"] < 1e-4 and single["grad_rel_err"] < 1e-4, (single, auto)
    assert any(
        t["config"] == "tiny b128 N=2" and t["target"].startswith("auto at least as fast")
        for t in result["targets"]
    ), result["targets"]
    row = next(line for line in table.splitlines() if "| auto-paired |" in line)
    assert f"single / this: median {auto['paired_ratio_median']:.3f}x" in row, row


def _tool(name, *args, timeout=240):
    """Runs tools/NAME ARGS with this Python; returns its stdout."""
    root = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
    proc = subprocess.run(
        [sys.executable, os.path.join(root, "tools", name), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def test_shm_grad_bound_tiny():
    """tools/shm_grad_bound.py: every variant times; `direct` (Linear gradients computed
    into shared memory) first checks its gradient against the plain loop's, bit for bit
    (an AssertionError would fail the run)."""
    out = _tool("shm_grad_bound.py", "--model", "tiny", "--batch", "8", "--rounds", "2")
    for name in ("plain", "copied", "private", "zeroed", "direct", "slept"):
        assert f"  {name} " in out, out


def test_loop_bench_tiny(tmp_path):
    """tools/loop_bench.py: whole training loops, each system in its own process; the
    engine's trainer holds the cores its worker leaves (trainer_threads="auto"), the
    engine-keep run keeps the process's threads."""
    path = tmp_path / "loop.json"
    out = _tool(
        "loop_bench.py",
        *("--model", "tiny", "--batch", "8", "--workers", "1", "--rounds", "1"),
        *("--steps", "5", "--warmup", "2", "--timeout", "120", "--json", str(path)),
    )
    with open(path) as f:
        result = json.load(f)
    assert set(result["median_s"]) == {"single", "engine", "engine-keep"}, out
    assert all(v > 0 for v in result["median_s"].values()), out
    from shmgrad import _C

    cores = _C.physical_cores()
    single = result["infos"]["single"][0]["trainer_threads"]
    assert result["infos"]["engine"][0]["trainer_threads"] == max(1, min(single, cores - 1)), out
    assert result["infos"]["engine-keep"][0]["trainer_threads"] == single, out
    assert "single/this" in out, out


@pytest.mark.parametrize(
    "tunable, mode, place",
    [("SHMGRAD_DIRECT_LINEAR", "script", "1x1"), ("SHMGRAD_PLAIN_PASS", "eager", "trainer")],
)
def test_tunable_ab_tiny(tmp_path, tunable, mode, place):
    """tools/tunable_ab.py: two engines, the tunable on and off, and one process, taking
    turns."""
    path = tmp_path / "ab.json"
    out = _tool(
        "tunable_ab.py",
        *("--tunable", tunable, "--mode", mode, "--configs", f"tiny:8:{place}"),
        *("--steps", "6", "--warmup", "2", "--json", str(path)),
    )
    with open(path) as f:
        (result,) = json.load(f)["results"]
    assert result["model"] == "tiny" and result["placement"] == place, result
    keys = ("on_s", "off_s", "single_s", "off_over_on", "single_over_on", "single_over_off")
    assert all(_finite_positive(result[k]) for k in keys), result
    assert "off/on" in out, out


@pytest.mark.full
def test_ddp_bound_tiny(tmp_path):
    """tools/ddp_bound.py: DDP's variants and both engines in two rank processes."""
    path = tmp_path / "ddp-bound.json"
    out = _tool(
        "ddp_bound.py", "--model", "tiny", "--batch", "8", "--steps", "8", "--json", str(path)
    )
    with open(path) as f:
        medians = json.load(f)["median_s"]
    want = {
        "plain",
        "free",
        "free+wait",
        "arena",
        "staged",
        "bucket-views",
        "engine",
        "engine-eager",
    }
    assert set(medians) == want, medians
    assert all(_finite_positive(v) for v in medians.values()), medians
    assert "the TorchScript engine" in out
