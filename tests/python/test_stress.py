"""`shmgrad stress` itself, for a short while, on both kinds of worker (TorchScript and
eager Python): it must find no wrong gradient, no hang and no leaked segment, while
workers are killed and stopped, trainers killed, and the engine shrunk and grown back."""

import json
import os
import subprocess

import pytest

from conftest import fake_allocations


def _run_stress(counts_path, *args, env=None):
    """`shmgrad stress --name stress-test ARGS --json COUNTS_PATH`, bounded."""
    return subprocess.run(
        ["shmgrad", "stress", "--name", "stress-test", *args, "--json", str(counts_path)],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )


def test_stress_short_run(tmp_path):
    counts_path = tmp_path / "stress.json"
    out = _run_stress(
        counts_path,
        "--steps",
        "20",
        "--kill-rate",
        "0.3",
        "--stop-rate",
        "0.1",
        "--stop-timeout",
        "2",
        "--trainer-restart-rate",
        "0.05",
        "--resize-rate",
        "0.2",
        "--seed",
        "1",  # the faults are drawn from the seed: this one gives each kind of fault
        "--step-timeout",
        "30",
    )
    assert out.returncode == 0, out.stdout + out.stderr
    with open(counts_path) as f:
        counts = json.load(f)
    assert counts["ok"] is True, counts
    # The default mode runs both kinds of worker, each with the same faults and checks.
    assert set(counts["runs"]) == {"script", "eager"}, counts
    for kind, run in counts["runs"].items():
        assert run["ok"] is True, (kind, run)
        assert run["steps"] == 20, (kind, run)
        assert run["kills"] > 0, (kind, "the run must actually kill workers")
        assert run["worker_replacements"] > 0, (kind, run)
        assert run["resizes"] > 0, (kind, "the run must actually shrink and grow the engine")
        # A stopped worker the step needed: the step timed out, ran again exactly, and the
        # worker was replaced (not_replaced counts those still there).
        assert run["stops"] > 0 and run["stop_timeouts"] > 0, (kind, run)
        assert run["scaled_steps"] > 0, (kind, "some steps must scale the loss")
        for key in ("wrong", "hangs", "not_replaced", "leaked_segments", "leftover_workers"):
            assert run[key] == 0, (kind, key, run)
    eager = counts["runs"]["eager"]
    assert eager["structured_steps"] > 0 and eager["accumulated_steps"] > 0, eager
    assert counts["steps"] == 40
    assert counts["kills"] == sum(r["kills"] for r in counts["runs"].values())


@pytest.mark.parametrize("mode", ["script", "eager"])
def test_stress_with_auto_placement(tmp_path, mode):
    """`--workers auto`: the engine places its steps itself, the probe running while
    workers are killed and the engine is resized (which fixes the placement); still no
    wrong gradient, hang or leak. With either kind of worker the trainer computes some of
    the steps itself (the probe's first candidate), between steps whose workers are
    killed."""
    counts_path = tmp_path / "stress.json"
    out = _run_stress(
        counts_path,
        "--mode", mode, "--workers", "auto", "--steps", "16", "--kill-rate", "0.3",
        "--resize-rate", "0.1", "--seed", "2", "--step-timeout", "30",
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    with open(counts_path) as f:
        counts = json.load(f)
    run = counts["runs"][mode]
    assert run["ok"] is True and run["steps"] == 16 and run["kills"] > 0, run
    assert run["in_trainer_steps"] > 0, run
    for key in ("wrong", "hangs", "leaked_segments", "leftover_workers"):
        assert run[key] == 0, (key, run)


def test_stress_help_and_bad_arguments(capsys):
    # The command end to end once; its argument checks in this process (each command line
    # costs seconds of imports).
    out = subprocess.run(
        ["shmgrad", "stress", "--help"], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0
    for opt in ("--mode", "--kill-rate", "--stop-rate", "--stop-timeout", "--seed", "--json"):
        assert opt in out.stdout, opt
    from shmgrad_tools.stress.__main__ import parse_args

    for args, message in (
        (["--kill-rate", "2"], "--kill-rate must be a probability in [0, 1], got 2"),
        (["--resize-rate", "-0.5"], "--resize-rate must be a probability"),
        (
            ["--stop-timeout", "60", "--step-timeout", "30"],
            "--stop-timeout must be above 0 and below --step-timeout (30 s), got 60",
        ),
        (["--mode", "fast"], "invalid choice: 'fast'"),
        (
            ["--nodes", "2", "--group-timeout", "20", "--step-timeout", "30"],
            "--group-timeout must be above --step-timeout (30 s), got 20",
        ),
        (["--nodes", "2", "--duration", "1m"], "--duration (the soak) runs one node"),
        (["--node-kill-rate", "1.5"], "--node-kill-rate must be a probability"),
        (["--workers", "many"], 'a number or "auto"'),
    ):
        with pytest.raises(SystemExit) as exit_info:
            parse_args(["--name", "x", *args])
        assert exit_info.value.code != 0
        assert message in capsys.readouterr().err, args


@pytest.mark.full  # long; test_gpu_workers checks GPU workers on the fake device in CI
def test_stress_gpu_workers_on_the_fake_device(tmp_path, fake_cuda_library):
    """--devices: both kinds of worker over two devices (the fake device library here; a
    GPU where tools/device-check runs it), with kills, stops, restarts and resizes."""
    counts_path = tmp_path / "stress.json"
    before = fake_allocations()
    env = dict(os.environ, SHMGRAD_CUDA_LIBRARY=fake_cuda_library, FAKE_CUDA_DEVICES="2")
    out = _run_stress(
        counts_path,
        "--steps",
        "12",
        "--kill-rate",
        "0.3",
        "--stop-rate",
        "0.1",
        "--stop-timeout",
        "2",
        "--resize-rate",
        "0.2",
        "--seed",
        "1",  # a seed whose draws stop a worker a step needs
        "--step-timeout",
        "30",
        "--devices",
        "cuda:0,cuda:1",
        env=env,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    with open(counts_path) as f:
        counts = json.load(f)
    assert counts["ok"] is True and counts["steps"] == 24, counts
    assert counts["kills"] > 0 and counts["resizes"] > 0 and counts["stop_timeouts"] > 0, counts
    assert fake_allocations() == before, "device allocations left behind"


# -- the soak mode (--duration) --------------------------------------------------------
def _sample(
    t,
    kind="script",
    trainer_rss=700_000,
    coord_rss=7_000,
    fds=7,
    worker_rss=150_000,
    step_s=0.02,
    shm_files=1,
    shm_bytes=70_000_000,
    worker_pid=100,
):
    """A soak sample as soak.Sampler records it (sizes in KiB)."""
    return dict(
        t=t,
        kind=kind,
        steps=10 * t,
        procs={
            "trainer": {"pid": 1, "rss_kib": trainer_rss, "fds": fds},
            "coordinator": {"pid": 2, "rss_kib": coord_rss, "fds": 5},
            "worker0": {"pid": worker_pid, "rss_kib": worker_rss, "fds": 3},
            "worker1": {"pid": worker_pid + 1, "rss_kib": worker_rss - 1000, "fds": 3},
        },
        shm_files=shm_files,
        shm_bytes=shm_bytes,
        shm_used=0,
        step_median_s=step_s,
        step_count=100,
    )


def test_soak_growth_check_finds_what_grows():
    """check_growth, a pure function over samples: flat series with noise pass; a series
    that keeps growing past its bound fails, naming the role; a transient peak does not."""
    from shmgrad_tools.stress import soak

    noise = [0, 3000, -2000, 5000, -4000, 1000, 2000, -1000, 4000, 0]
    flat = [
        _sample(t, trainer_rss=700_000 + n, worker_pid=100 + 10 * t) for t, n in enumerate(noise)
    ]
    assert soak.check_growth(flat, {"script": 0}) == []
    # A peak in one sample (a big batch's buffers, a replacement worker starting) passes.
    peak = [dict(s) for s in flat]
    peak[8] = _sample(8, trainer_rss=900_000, coord_rss=40_000, fds=9, step_s=0.5)
    assert soak.check_growth(peak) == []

    mib = 1024
    cases = {
        "trainer's resident memory grew": dict(trainer_rss=lambda t: 700_000 + 20 * mib * t),
        "coordinator's resident memory grew": dict(coord_rss=lambda t: 7_000 + 8 * mib * t),
        "trainer's open file descriptors grew from 8 to 9": dict(fds=lambda t: 7 + t // 3),
        "largest worker's resident memory grew": dict(worker_rss=lambda t: 150_000 + 16 * mib * t),
        "median step time drifted": dict(step_s=lambda t: 0.02 * (1 + 0.1 * t * t)),
        "/dev/shm files grew from 1 to 2": dict(shm_files=lambda t: 1 + (t >= 7)),
        "/dev/shm bytes grew": dict(shm_bytes=lambda t: 70_000_000 + 4096 * t),
    }
    for message, growing in cases.items():
        series = [_sample(t, **{k: f(t) for k, f in growing.items()}) for t in range(10)]
        found = soak.check_growth(series)
        assert len(found) == 1 and message in found[0], (message, found)
    # With a probe time per sample, the step time is judged against it: a machine whose
    # load triples slows the probe as much as the steps (no finding); steps slowing alone
    # are a finding.
    loaded = [
        dict(_sample(t, step_s=0.02 * (1 + 0.1 * t * t)), probe_s=0.01 * (1 + 0.1 * t * t))
        for t in range(10)
    ]
    assert soak.check_growth(loaded) == []
    slowing = [dict(_sample(t, step_s=0.02 * (1 + 0.1 * t * t)), probe_s=0.01) for t in range(10)]
    found = soak.check_growth(slowing)
    assert len(found) == 1 and "median step time / probe time drifted" in found[0], found
    # Each kind (engine) is judged on its own: the eager engine's bigger workers are not
    # growth of the script engine's.
    both = flat + [_sample(t, kind="eager", worker_rss=600_000) for t in range(10, 20)]
    assert soak.check_growth(both) == []
    left = soak.check_growth(flat, {"script": 1})
    assert left == ["script: 1 file(s) of the engine left in /dev/shm after it stopped"], left
    too_few = soak.check_growth(flat[:2])  # warm-up and one sample: no two windows
    assert len(too_few) == 1 and "too few to judge growth" in too_few[0], too_few


def test_soak_sampler_writes_csv(tmp_path):
    """--soak-out NAME.csv: one row per sample and role; this process is the trainer."""
    from shmgrad_tools.stress import soak

    out = tmp_path / "soak.csv"
    sampler = soak.Sampler(60.0, str(out))
    sampler.start_run()
    sampler.step_done(0.01)
    sampler.step_done(0.03)
    sampler.sample("script", "stress-test-none", None, 2, probe=lambda: None)
    rows = out.read_text().splitlines()
    assert rows[0].startswith("t_s,kind,steps,role,pid,rss_kib,fds,"), rows
    assert len(rows) == 2, rows
    fields = dict(zip(rows[0].split(","), rows[1].split(",")))
    assert fields["role"] == "trainer" and int(fields["pid"]) == os.getpid(), fields
    assert int(fields["rss_kib"]) > 1000 and int(fields["fds"]) > 0, fields
    assert float(fields["step_median_s"]) == 0.02 and fields["shm_files"] == "0", fields


def test_soak_duration_parsing(capsys):
    from shmgrad_tools.stress import soak
    from shmgrad_tools.stress.__main__ import parse_args

    for text, seconds in (
        ("3600", 3600),
        ("90s", 90),
        ("30m", 1800),
        ("1h", 3600),
        ("1h30m", 5400),
        ("2.5m", 150),
    ):
        assert soak.parse_duration(text) == seconds, text
    for bad in ("", "1d", "h", "-5", "30 minutes"):
        with pytest.raises(ValueError, match="give seconds"):
            soak.parse_duration(bad)
    for args, message in (
        (["--duration", "1d"], "--duration: duration '1d': give seconds"),
        (["--duration", "0"], "--duration must be above 0"),
        (["--duration", "1m", "--sample-every", "0"], "--sample-every must be above 0"),
        (["--soak-out", "x.json"], "--soak-out needs --duration"),
    ):
        with pytest.raises(SystemExit):
            parse_args(["--name", "x", *args])
        assert message in capsys.readouterr().err, args


@pytest.mark.full  # long: CI stays under 40 minutes
def test_soak_short_run(tmp_path):
    """--duration 20s, a sample every 2 s, faults on: the samples name every process by
    role (the trainer, the coordinator, worker slots) with its memory and descriptors, the
    engine's segment while it runs, step times; the verdict passes and nothing is left."""
    counts_path, soak_path = tmp_path / "stress.json", tmp_path / "soak.json"
    out = _run_stress(
        counts_path,
        "--mode",
        "script",
        "--duration",
        "20s",
        "--sample-every",
        "2",
        "--kill-rate",
        "0.3",
        "--stop-rate",
        "0",
        "--step-timeout",
        "30",
        "--soak-out",
        str(soak_path),
    )
    assert out.returncode == 0, out.stdout + out.stderr
    with open(counts_path) as f:
        counts = json.load(f)
    with open(soak_path) as f:
        soak = json.load(f)
    assert counts["ok"] is True and counts["soak_findings"] == 0, counts
    assert counts["kills"] > 0 and counts["steps"] > 10, counts
    assert soak["verdict"] == {"ok": True, "findings": []}, soak["verdict"]
    assert soak["duration_s"] == 20 and soak["bounds"]["fd_growth"] == 0, soak
    samples = soak["samples"]
    assert len(samples) >= 4, samples
    for s in samples:
        assert {"trainer", "coordinator"} <= set(s["procs"]), s
        for p in s["procs"].values():
            assert p["rss_kib"] > 1000 and p["fds"] > 0, s
        assert s["shm_files"] == 1 and s["shm_bytes"] > 0, s  # the engine's segment
        assert s["load1"] is not None, s
    # With kills at 0.3 a 2-s interval may fall while every worker is being replaced (no
    # worker to sample, no step ended): most samples see both.
    busy = [
        s
        for s in samples
        if any(r.startswith("worker") for r in s["procs"]) and s["step_count"] > 0
    ]
    assert len(busy) >= len(samples) // 2, samples
    for s in busy:
        assert s["step_median_s"] > 0 and s["probe_s"] > 0, s
    assert samples[-1]["t"] <= 20 + 10, samples[-1]  # the steps stop when the time is up
    assert not os.path.exists(f"/dev/shm/shmgrad-{os.getuid()}-stress-test")


# -- several nodes (--nodes) -----------------------------------------------------------
def _run_nodes(tmp_path, *args):
    counts_path = tmp_path / "stress.json"
    out = _run_stress(counts_path, "--nodes", "2", "--workers", "2", *args)
    assert out.returncode == 0, out.stdout + out.stderr[-6000:]
    with open(counts_path) as f:
        return json.load(f), out


def _check_nodes_run(run, steps):
    assert run["ok"] is True and run["nodes"] == 2 and run["steps"] == steps, run
    for key in (
        "wrong",
        "hangs",
        "unexpected",
        "not_replaced",
        "leaked_segments",
        "leftover_workers",
        "leftover_trainers",
    ):
        assert run[key] == 0, (key, run)
    # Both backends formed groups and computed checked steps (--backend both).
    assert set(run["formations"]) == {"gloo", "shmgrad"}, run
    assert all(run["backend_steps"].get(b, 0) > 0 for b in ("gloo", "shmgrad")), run
    assert run["planned_reforms"] == 1, run


@pytest.mark.full  # long: CI stays under 40 minutes
def test_stress_two_nodes_short(tmp_path):
    """--nodes 2: two engines, one trainer process each, grouped over gloo then the
    shmgrad backend; a worker killed, a node trainer SIGKILLed mid-step: the other node
    raised NodeError within the group's timeout, the group re-formed and the same batch
    was exact again; every step's gradient matched one-process PyTorch on the whole
    batch, and nothing is left behind."""
    counts, out = _run_nodes(
        tmp_path,
        "--mode",
        "script",
        "--steps",
        "6",
        "--kill-rate",
        "0.5",
        "--node-kill-rate",
        "0.2",
        "--stop-rate",
        "0",
        "--group-timeout",
        "40",
        "--step-timeout",
        "30",
        "--seed",
        "1",  # draws a trainer kill and worker kills in 6 steps
    )
    _check_nodes_run(counts, 6)
    assert counts["kills"] > 0, counts
    kills = counts["trainer_kills"] - counts["trainer_kills_late"]
    assert counts["trainer_kills"] > 0 and kills > 0, counts
    assert counts["reforms"] == counts["trainer_kills"], counts
    # Every kill that landed mid-step was seen by the other node as NodeError, in time.
    assert counts["node_errors"] >= kills, counts
    # A SIGKILLed peer is seen on its closed connection (or pidfd): well within the timeout.
    assert 0 < counts["node_error_max_s"] < 10, counts
    assert not [p for p in os.listdir("/dev/shm") if "stress-test-n" in p]


@pytest.mark.full
def test_stress_two_nodes_both_kinds(tmp_path):
    """Both kinds of worker on two nodes with every fault: worker kills (also on both
    nodes at once), stopped workers (the stopped node times out, the other raises
    NodeError naming it, the batch again is exact), node trainers killed."""
    counts, out = _run_nodes(
        tmp_path,
        "--steps",
        "30",
        "--kill-rate",
        "0.4",
        "--node-kill-rate",
        "0.1",
        "--stop-rate",
        "0.15",
        "--stop-timeout",
        "2",
        "--group-timeout",
        "40",
        "--step-timeout",
        "30",
        "--seed",
        "1",
    )
    assert set(counts["runs"]) == {"script", "eager"}, counts
    for kind, run in counts["runs"].items():
        _check_nodes_run(run, 30)
        assert run["kills"] > 0 and run["trainer_kills"] > 0 and run["reforms"] > 0, (kind, run)
        assert run["stops"] > 0, (kind, run)
    assert counts["stop_timeouts"] > 0 and counts["kills_on_every_node"] > 0, counts
    assert counts["node_errors"] > counts["trainer_kills"], counts  # stops' NodeErrors too
