"""Shared fixtures: small models, a single-process PyTorch reference, and a check that
no test leaves a shared-memory segment behind.

GPU tests carry the ``gpu`` marker (test_gpu_workers.py's ``cuda`` backend, the GPU cases
of test_gpu.py) and skip with the reason where no GPU is. Under ``SHMGRAD_REQUIRE_GPU=1``
(set by ``tools/device-check --run --gpu`` on the GPU machine, never by CI) such a skip is
a failure naming its reason, so a run on a GPU cannot pass by skipping; only a case that
needs more GPUs than the machine has (``skip_for_fewer_gpus``) may still skip.
``--outcomes-log PATH`` writes one JSON line per test case as it finishes (and one when it
starts), so that a run cut short still says what ran (tools/device-check reads it).
"""

import copy
import glob
import json
import os
import re
import time
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch


# The `shmgrad` command of the environment under test (its bin/, as an activated virtual
# environment would put it on the PATH).
os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")
from shmgrad._native import tunable
from shmgrad.testing import relative_error  # noqa: F401  (the tests' one comparison)


class Mlp(torch.nn.Module):
    def __init__(self, d_in=20, hidden=32, d_out=5):
        super().__init__()
        self.fc1 = torch.nn.Linear(d_in, hidden)
        self.fc2 = torch.nn.Linear(hidden, d_out)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(torch.flatten(x, 1))))


class Branchy(torch.nn.Module):
    """A head, and an auxiliary head that only batches with a marked example (a first
    feature above 100) take, as a model with an optional branch does: for the others
    backward never reaches `aux` (its .grad stays None in plain PyTorch)."""

    def __init__(self, d_in=6, hidden=8, d_out=3):
        super().__init__()
        self.body = torch.nn.Linear(d_in, hidden)
        self.head = torch.nn.Linear(hidden, d_out)
        self.aux = torch.nn.Linear(hidden, d_out)

    def forward(self, x):
        h = torch.relu(self.body(x))
        out = self.head(h)
        if bool((x[:, 0] > 100).any()):
            out = out + self.aux(h)
        return out


AUX = (4, 5)  # Branchy's aux.weight and aux.bias, in named_parameters() order


ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
_PYTHON_BLOCK = re.compile(r"^( *)```python( fragment)?\n(.*?)^\1```", re.S | re.M)


def python_blocks(doc):
    """The python code blocks of ``doc`` (a path from the checkout's root): (line,
    is_fragment, code) each, the code dedented as written in a list item. A block marked
    ``python fragment`` is not a whole program (tests/python/test_docs.py only parses it)."""
    with open(os.path.join(ROOT, doc)) as f:
        text = f.read()
    out = []
    for m in _PYTHON_BLOCK.finditer(text):
        code = "\n".join(s[len(m.group(1)) :] for s in m.group(3).splitlines()) + "\n"
        out.append((text.count("\n", 0, m.start()) + 1, bool(m.group(2)), code))
    return out


def shard_gradients(model, x, y, shards):
    """The sum over `shards` (lists of example indices) of each one's summed cross-entropy
    gradient, computed by plain PyTorch on a copy, one backward per shard (a branch taken
    per shard, as each worker takes it); a parameter no backward reached is None."""
    m = copy.deepcopy(model)
    m.zero_grad(set_to_none=True)
    for s in shards:
        torch.nn.functional.cross_entropy(m(x[s]), y[s], reduction="sum").backward()
    return [None if p.grad is None else p.grad.clone() for p in m.parameters()]


class Cnn(torch.nn.Module):
    def __init__(self, d_out=5, channels=1):
        super().__init__()
        self.conv = torch.nn.Conv2d(channels, 4, 3)
        self.fc = torch.nn.Linear(4 * 5 * 5, d_out)

    def forward(self, x):
        return self.fc(torch.flatten(torch.max_pool2d(torch.relu(self.conv(x)), 2), 1))


class LogSoftmaxMlp(Mlp):
    def forward(self, x):
        return torch.log_softmax(self.fc2(torch.relu(self.fc1(torch.flatten(x, 1)))), dim=1)


def reference_gradient(model, loss, inputs, targets, reduction="sum"):
    """The gradient of the loss over the batch, computed by plain PyTorch on a copy."""
    m = copy.deepcopy(model)
    m.zero_grad()
    out = m(inputs)
    fn = {
        "cross_entropy": torch.nn.functional.cross_entropy,
        "nll": torch.nn.functional.nll_loss,
        "mse": torch.nn.functional.mse_loss,
    }[loss]
    fn(out, targets, reduction=reduction).backward()
    return [p.grad.clone() for p in m.parameters()]


def worker_pids(engine):
    """{slot: pid} of the engine's ready workers."""
    return {w.slot: w.pid for w in engine.status().ready_workers}


def proc_stat(pid):
    """The fields of /proc/PID/stat after the command name: [0] state, [7] minor faults."""
    with open(f"/proc/{pid}/stat") as f:
        stat = f.read()
    return stat[stat.rindex(")") + 2 :].split()


def segments():
    return sorted(glob.glob(f"/dev/shm/shmgrad-{os.getuid()}-*"))


# Engines the tests create: unnamed ones are "py<pid>-<n>" (pid of this process), named
# ones use these names. (Other processes' engines on the machine are not ours to judge.)
TEST_ENGINE_NAMES = (
    "side-a",
    "side-b",
    "cli-engine",
    "trainer-kill",
    "coord-kill",
    "stranger",
    "corrupt-test",
    "stress-test",
)


def ours(path):
    name = path.split("-", 2)[2]
    return name.startswith(f"py{os.getpid()}-") or name in TEST_ENGINE_NAMES


@pytest.fixture(autouse=True, scope="session")
def no_leaked_segments():
    before = set(segments())
    yield
    leaked = {s for s in set(segments()) - before if ours(s)}
    assert not leaked, f"segments left in /dev/shm: {sorted(leaked)}"


@pytest.fixture(scope="session")
def fake_cuda_library(tmp_path_factory):
    """tests/fake_cuda.cc built here: libshmgrad_cuda.so's C interface on host memory, a
    stand-in device for engines with devices= on machines without a GPU (set
    SHMGRAD_CUDA_LIBRARY to it)."""
    compiler = shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        pytest.skip("no C++ compiler here to build the fake device library")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = tmp_path_factory.mktemp("fakecuda") / "libfake_cuda.so"
    subprocess.run(
        [
            compiler,
            "-std=c++17",
            "-O1",
            "-shared",
            "-fPIC",
            f"-I{root}",
            os.path.join(root, "tests", "fake_cuda.cc"),
            "-o",
            str(out),
            "-lrt",
        ],
        check=True,
    )
    return str(out)


def fake_allocations():
    """The fake device's allocations in /dev/shm (tests/fake_cuda.cc names them)."""
    return set(glob.glob("/dev/shm/shmgrad-fakecuda-*"))


@pytest.fixture
def npy_dataset(tmp_path):
    """120 examples of [1, 12, 12] inputs with labels 0..4, as .npy files."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(120, 1, 12, 12, generator=g)
    y = torch.randint(0, 5, (120,), generator=g)
    np.save(tmp_path / "x.npy", x.numpy())
    np.save(tmp_path / "y.npy", y.numpy())
    return f"npy:{tmp_path / 'x.npy'},{tmp_path / 'y.npy'}", x, y


# -- GPU cases: skipped with the reason, or failed where a GPU is required ------------
REQUIRE_GPU = tunable("SHMGRAD_REQUIRE_GPU") == "1"
# The one skip a GPU case may take under SHMGRAD_REQUIRE_GPU=1: the machine has a GPU,
# but fewer than the case places workers on (the GPU machine has one).
FEWER_GPUS = "needs more GPUs than this machine has"


def skip_for_fewer_gpus(needed, here):
    """Skips a GPU case that needs `needed` GPUs on a machine with `here` (at least one)."""
    pytest.skip(f"{FEWER_GPUS}: {needed} needed, {here} here")


def _skip_reason(report):
    """The reason a skipped report gives (pytest keeps it as (path, line, reason))."""
    if isinstance(report.longrepr, tuple) and len(report.longrepr) == 3:
        return str(report.longrepr[2]).removeprefix("Skipped: ")
    return str(report.longrepr)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if not (REQUIRE_GPU and report.skipped and item.get_closest_marker("gpu")):
        return
    reason = _skip_reason(report)
    if not reason.startswith(FEWER_GPUS):
        report.outcome = "failed"
        report.longrepr = (
            f"SHMGRAD_REQUIRE_GPU=1: a GPU case may not skip, and this one skipped: {reason}"
        )


# -- --outcomes-log: each case's outcome as it finishes --------------------------------
OUTCOME_REASON_CHARS = 2000  # of a failure's text, its end (where the assertion is)


def pytest_addoption(parser):
    parser.addoption(
        "--outcomes-log",
        default=None,
        help="write a JSON line per test case to this file as each one starts and "
        "finishes: nodeid, outcome, duration, skip or failure reason (tools/device-check)",
    )


class OutcomesLog:
    """Appends JSON lines to a file, flushed at once: {"event": "collected", "nodeids"},
    {"event": "start", "nodeid"}, then {"event": "case", "nodeid", "outcome" (passed,
    failed, error: a failed setup or teardown, skipped), "duration" (s, every phase),
    "reason"}."""

    def __init__(self, path):
        self._file = open(path, "a")
        self._phases = {}

    def _write(self, **record):
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def pytest_collection_finish(self, session):
        self._write(event="collected", nodeids=[item.nodeid for item in session.items])

    def pytest_runtest_logstart(self, nodeid, location):
        self._write(event="start", nodeid=nodeid, time=time.time())

    def pytest_runtest_logreport(self, report):
        self._phases.setdefault(report.nodeid, []).append(report)
        if report.when == "teardown":
            self._write(event="case", **case_outcome(self._phases.pop(report.nodeid)))

    def pytest_unconfigure(self, config):
        self._file.close()


def case_outcome(reports):
    """One test case's outcome from its phases' reports (setup, call, teardown)."""
    outcome, reason = "passed", ""
    for r in reports:
        if r.failed:
            outcome = "failed" if r.when == "call" else "error"
            reason = r.longreprtext[-OUTCOME_REASON_CHARS:]
            break
        if r.skipped:
            outcome, reason = "skipped", _skip_reason(r)
    return {
        "nodeid": reports[0].nodeid,
        "outcome": outcome,
        "duration": round(sum(r.duration for r in reports), 3),
        "reason": reason,
    }


FULL = tunable("SHMGRAD_TEST_FULL") == "1"


def ci_runs(values, keep, ids=None):
    """A parametrised test's cases where CI runs only those in ``keep`` (ids) and the full
    tier all: the others are marked ``full``. ``values`` are single values or tuples (a
    tuple is one case's arguments); ``ids`` default to the values themselves."""
    ids = ids or [str(v) for v in values]
    unknown = set(keep) - set(ids)
    assert not unknown, f"ci_runs: no case {unknown}"
    return [
        pytest.param(
            *(v if isinstance(v, tuple) else (v,)),
            id=i,
            marks=() if i in keep else pytest.mark.full,
        )
        for v, i in zip(values, ids)
    ]


def pytest_collection_modifyitems(config, items):
    if FULL:
        return
    skip = pytest.mark.skip(reason="long: tools/test.sh --full runs it (CI does not)")
    for item in items:
        if item.get_closest_marker("full"):
            item.add_marker(skip)


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "newest_torch_only: run against the newest torch only (tools/test.sh "
        "leaves these out for the oldest supported one: the wheel build, long benchmarks)",
    )
    config.addinivalue_line(
        "markers",
        "gpu: needs a GPU; skips with the reason without one, fails so under "
        "SHMGRAD_REQUIRE_GPU=1 (tools/device-check --run --gpu runs these: -m gpu)",
    )
    config.addinivalue_line(
        "markers",
        "full: long (several ranks, nodes or restarts); skipped unless SHMGRAD_TEST_FULL=1 "
        "(tools/test.sh --full), so CI stays under 40 minutes",
    )
    path = config.getoption("--outcomes-log")
    if path:
        config.pluginmanager.register(OutcomesLog(path), "shmgrad-outcomes-log")
