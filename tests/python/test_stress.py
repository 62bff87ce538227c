"""`shmgrad stress` itself, for a short while: it must find no wrong gradient, no hang and
no leaked segment, while workers and trainers are killed and the engine is shrunk and
grown back."""

import re
import subprocess


def test_stress_short_run():
    out = subprocess.run(["shmgrad", "stress", "--name", "stress-test", "--steps", "40",
                          "--kill-rate", "0.3", "--trainer-restart-rate", "0.05",
                          "--resize-rate", "0.2", "--seed", "7", "--step-timeout", "30"],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    m = re.search(r"steps (\d+), kills (\d+), recoveries (\d+), wrong gradients (\d+), hangs (\d+), "
                  r"leaked segments (\d+)", out.stdout)
    assert m, out.stdout
    steps, kills, recoveries, wrong, hangs, leaked = map(int, m.groups())
    assert steps == 40
    assert kills > 0, "the run must actually kill workers"
    resizes = int(re.search(r"shrink-and-grow (\d+)", out.stdout).group(1))
    assert resizes > 0, "the run must actually shrink and grow the engine"
    assert (wrong, hangs, leaked) == (0, 0, 0)


def test_stress_help_and_bad_arguments():
    out = subprocess.run(["shmgrad", "stress", "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "--kill-rate" in out.stdout and "--seed" in out.stdout
    out = subprocess.run(["shmgrad", "stress", "--name", "x", "--kill-rate", "2"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "--kill-rate must be a probability in [0, 1], got 2" in out.stderr
    out = subprocess.run(["shmgrad", "stress", "--name", "x", "--resize-rate", "-0.5"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "--resize-rate must be a probability" in out.stderr
