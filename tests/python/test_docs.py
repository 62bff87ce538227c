"""The commands the README and docs/MULTINODE.md give, run as written there (from the
checkout's root), shortened to one epoch with their own options where a full run does not
fit in CI. The Dask recipe has its own test (test_multinode.py), and the adaptive example
runs shortened in tools/device-check's dry run (test_build.py)."""

import os
import re
import subprocess

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def _commands(doc):
    """Every shell command in the document's code blocks and indented blocks, with its
    backslash continuations joined and its comment removed."""
    with open(os.path.join(ROOT, doc)) as f:
        text = f.read().replace("\\\n", " ")
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith((".venv/bin/", "tools/")):
            out.append(re.sub(r"\s+#.*$", "", line).strip())
    return out


def _run(command, timeout=600):
    proc = subprocess.run(
        ["bash", "-c", command],
        cwd=ROOT,
        env=dict(os.environ, GLOO_SOCKET_IFNAME="lo"),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def test_readme_demo_runs_as_written():
    first = _commands("README.md")[0]
    assert first == "tools/setup.sh && .venv/bin/python examples/train_fashion_mnist.py", first
    demo = first.split("&& ", 1)[1]  # set-up is what this suite runs in
    out = _run(demo + " --epochs 1")
    assert re.search(r"^epoch 1: test accuracy \d+\.\d+%", out, re.M), out[-2000:]


def test_multinode_torchrun_on_one_machine_runs_as_written():
    torchrun = [c for c in _commands("docs/MULTINODE.md") if "--standalone" in c]
    assert len(torchrun) == 1 and "--epochs 2" in torchrun[0], torchrun
    out = _run(torchrun[0].replace("--epochs 2", "--epochs 1"))
    assert "parameters identical on every node (checksum" in out, out[-2000:]
