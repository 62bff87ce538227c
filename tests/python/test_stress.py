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
