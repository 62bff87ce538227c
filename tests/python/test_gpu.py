"""shmgrad's CUDA path: built, loaded, checked; on a machine with no GPU every devices=
engine fails at once naming what is missing and leaves nothing behind. Tests that need a
GPU (marked ``gpu``) skip with the reason, or fail so under SHMGRAD_REQUIRE_GPU=1 (run
them on one: tools/device-check --run --gpu)."""

import ctypes
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

import shmgrad
from shmgrad import _gpu, errors

from conftest import segments


def _gpu_or_skip():
    try:
        count = _gpu.device_count()
    except errors.InvalidArgumentError as exc:
        pytest.skip(f"no GPU here: {exc}")
    return count


def test_build_info_says_whether_the_cuda_path_is_built():
    info = shmgrad.build_info()
    assert info["cuda"] == os.path.exists(_gpu.LIBRARY)
    nvcc = shutil.which("nvcc") or (
        "/usr/local/cuda/bin/nvcc" if os.path.exists("/usr/local/cuda/bin/nvcc") else None
    )
    if nvcc is None:
        pytest.skip("no nvcc here: the CUDA path is not expected to be built")
    out = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout
    assert info["cuda"] and f"release {info['cuda_toolkit']}," in out


def test_devices_are_read_and_placed_round_robin():
    assert _gpu.parse_devices() is None
    assert _gpu.parse_devices(devices=["cuda:1", "cuda:0"]) == [1, 0]
    assert _gpu.parse_devices(devices=[torch.device("cuda", 2), 3]) == [2, 3]
    assert _gpu.parse_devices(devices="cuda") == [0]
    assert _gpu.placement(5, [2, 0]) == [2, 0, 2, 0, 2]
    assert _gpu.placement(3, [0]) == [0, 0, 0]
    for bad, words in [
        (dict(devices=["cpu"]), "leave devices= out for a CPU engine"),
        (dict(devices=["cuda:0", "cuda:0"]), "twice"),
        (dict(devices=[]), "empty"),
        (dict(devices=["tpu:0"]), "no device"),
        (dict(devices=["cuda:0"], device="cuda"), "not both"),
        (dict(device="cuda:1"), "device= takes 'cuda'"),
        (dict(device="cpu"), "device= takes 'cuda'"),
    ]:
        with pytest.raises(errors.InvalidArgumentError, match=words):
            _gpu.parse_devices(**bad)
    # The trainer's GPU goes first (its device holds the reduced gradient).
    assert _gpu.parse_devices(devices=["cuda:0", "cuda:1", "cuda:2"], trainer_device="cuda:2") == [
        2,
        0,
        1,
    ]
    assert _gpu.parse_devices(devices=[1, 0], trainer_device=torch.device("cuda", 1)) == [1, 0]
    for bad, words in [
        (dict(devices=["cuda:0"], trainer_device="cuda:1"), "not one of the engine's GPUs"),
        (dict(devices=["cuda:0"], trainer_device="cpu"), "not one of the engine's GPUs"),
        (dict(trainer_device="cuda:0"), "give devices="),
        (dict(devices=["cuda:0"], trainer_device="gpu9"), "no device"),
    ]:
        with pytest.raises(errors.InvalidArgumentError, match=words):
            _gpu.parse_devices(**bad)
    with pytest.raises(errors.InvalidArgumentError, match="1 to 16 devices"):
        _gpu.placement(2, list(range(17)))


def test_devices_without_a_gpu_fail_at_once_and_leave_nothing(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the no-GPU path is not what it shows")
    before = segments()
    model = torch.nn.Linear(3, 2)
    for kwargs in (dict(devices=["cuda:0"]), dict(device="cuda")):
        with pytest.raises(errors.InvalidArgumentError) as info:
            shmgrad.Engine(model=model, workers=2, loss="mse", **kwargs)
        message = str(info.value)
        assert "leave devices= out" in message or "built without" in message, message
        assert any(w in message for w in ("driver", "sees none", "built without")), message
    assert segments() == before
    # No engine process was started: nothing to find among this process's children but
    # multiprocessing's resource tracker, which an earlier test's spawned ranks started.
    children = subprocess.run(
        ["pgrep", "-P", str(os.getpid())], capture_output=True, text=True
    ).stdout.split()

    def command(pid):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                return f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            return ""

    engines = [c for c in children if "multiprocessing.resource_tracker" not in command(c)]
    assert engines == [], [command(c) for c in engines]


def test_each_missing_piece_is_named(monkeypatch):
    monkeypatch.delenv("SHMGRAD_CUDA_LIBRARY", raising=False)
    # Without the CUDA path built.
    monkeypatch.setattr(_gpu, "_library", None)
    monkeypatch.setattr(_gpu, "build_info", lambda: {"cuda": False})
    with pytest.raises(errors.InvalidArgumentError, match="built without it"):
        _gpu.device_count()
    # Built, but the library missing from the installation.
    monkeypatch.setattr(_gpu, "build_info", lambda: {"cuda": True})
    monkeypatch.setattr(_gpu, "LIBRARY", "/nonexistent/libshmgrad_cuda.so")
    with pytest.raises(errors.InvalidArgumentError, match="missing from this installation"):
        _gpu.device_count()
    # A driver and one GPU, then: a torch without CUDA, an ordinal past the GPUs, and,
    # with nothing missing, no error.
    monkeypatch.setattr(_gpu, "device_count", lambda: 1)
    monkeypatch.setattr(torch.version, "cuda", None)
    with pytest.raises(errors.InvalidArgumentError, match="built without CUDA"):
        _gpu.check_devices([0])
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    with pytest.raises(errors.InvalidArgumentError, match="names cuda:1.*shows 1 GPU"):
        _gpu.check_devices([0, 1])
    _gpu.check_devices([0])


def test_the_cuda_library_reports_no_driver_as_an_error_code():
    if not shmgrad.build_info()["cuda"]:
        pytest.skip("the CUDA path is not built here (no nvcc at install time)")
    lib = ctypes.CDLL(_gpu.LIBRARY)
    count = ctypes.c_int(-1)
    code = lib.shmgrad_cuda_device_count(ctypes.byref(count))
    if code == 0 and count.value > 0:
        pytest.skip(f"{count.value} GPU(s) here: the no-driver path is not what it shows")
    assert code in (35, 100) and count.value == 0


@pytest.mark.gpu
def test_inputs_are_reduced_on_the_device_in_list_order():
    _gpu_or_skip()
    lib = _gpu._load()
    g = torch.Generator().manual_seed(0)
    n = 100_003
    host = [torch.randn(n, generator=g) for _ in range(3)]
    dev = [h.cuda() for h in host]
    ins = (ctypes.c_uint64 * 3)(*(d.data_ptr() for d in dev))
    out = torch.empty(n, device="cuda")
    mid = n // 2 // 64 * 64
    for begin, end in ((0, mid), (mid, n)):  # two slices, as two workers reduce them
        code = lib.shmgrad_cuda_reduce(0, out.data_ptr(), 0, ins, 3, begin, end, 0.0, 0.5)
        assert code == 0, _gpu._describe(lib, code)
    expected = 0.5 * ((host[0] + host[1]) + host[2])
    assert torch.equal(out.cpu(), expected)
    # In place over prev (out == prev), a and b powers of two: exact on the device too.
    prev = torch.randn(n, generator=g)
    acc = prev.cuda()
    code = lib.shmgrad_cuda_reduce(0, acc.data_ptr(), acc.data_ptr(), ins, 3, 0, n, 0.25, 2.0)
    assert code == 0, _gpu._describe(lib, code)
    assert torch.equal(acc.cpu(), 0.25 * prev + 2.0 * ((host[0] + host[1]) + host[2]))


_CHILD = """
import ctypes, sys
from shmgrad import _gpu
lib = _gpu._load()
handle = bytes.fromhex(sys.argv[1])
ptr = ctypes.c_uint64(0)
assert lib.shmgrad_cuda_ipc_open(0, handle, ctypes.byref(ptr)) == 0
ptr = ptr.value
buf = (ctypes.c_float * 4)()
assert lib.shmgrad_cuda_copy_to_host(0, buf, ptr, 16) == 0
assert list(buf) == [1.0, 2.0, 3.0, 4.0], list(buf)
buf[0] = -1.0
assert lib.shmgrad_cuda_copy_to_device(0, ptr, buf, 16) == 0
assert lib.shmgrad_cuda_ipc_close(0, ptr) == 0
"""


@pytest.mark.gpu
def test_an_ipc_handle_opens_in_another_process():
    _gpu_or_skip()
    lib = _gpu._load()
    out = ctypes.c_uint64(0)
    assert lib.shmgrad_cuda_alloc(0, 4096, ctypes.byref(out)) == 0
    ptr = out.value
    try:
        values = (ctypes.c_float * 4)(1, 2, 3, 4)
        assert lib.shmgrad_cuda_copy_to_device(0, ptr, values, 16) == 0
        handle = (ctypes.c_uint8 * 64)()
        assert lib.shmgrad_cuda_ipc_handle(0, ptr, handle) == 0
        child = subprocess.run(
            [sys.executable, "-c", _CHILD, bytes(handle).hex()],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert child.returncode == 0, child.stderr
        back = (ctypes.c_float * 4)()
        assert lib.shmgrad_cuda_copy_to_host(0, back, ptr, 16) == 0
        assert back[0] == -1.0  # the child's write, through its mapping
    finally:
        assert lib.shmgrad_cuda_free(0, ptr) == 0


# A GPU case and its neighbours as conftest.py judges them (run in a pytest of their own,
# beside a copy of conftest.py): the `cuda` case skips here as it does without a GPU.
_REQUIRED_CASES = """
import pytest
from conftest import skip_for_fewer_gpus


@pytest.fixture(params=["fake", pytest.param("cuda", marks=pytest.mark.gpu)])
def backend(request):
    if request.param == "cuda":
        pytest.skip("no GPU here: a stand-in for the driver's answer")
    return request.param


def test_on_a_backend(backend):
    pass


@pytest.mark.gpu
def test_on_two_gpus():
    skip_for_fewer_gpus(2, 1)


@pytest.mark.gpu
def test_skips_in_its_body():
    pytest.skip("no GPU here: in the body")


def test_not_a_gpu_case():
    pytest.skip("skipped for a reason of its own")
"""
_REQUIRE_RUN_TIMEOUT_S = 120


def _outcomes_where(tmp_path, require):
    """Runs _REQUIRED_CASES with or without SHMGRAD_REQUIRE_GPU=1: pytest's exit code and
    {test name: (outcome, reason)} from its --outcomes-log."""
    folder = tmp_path / ("required" if require else "free")
    folder.mkdir()
    shutil.copy(os.path.join(os.path.dirname(__file__), "conftest.py"), folder)
    (folder / "test_cases.py").write_text(_REQUIRED_CASES)
    env = {k: v for k, v in os.environ.items() if k != "SHMGRAD_REQUIRE_GPU"}
    if require:
        env["SHMGRAD_REQUIRE_GPU"] = "1"
    log = folder / "outcomes.jsonl"
    res = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
        + ["--outcomes-log", str(log), "test_cases.py"],
        cwd=folder,
        env=env,
        capture_output=True,
        text=True,
        timeout=_REQUIRE_RUN_TIMEOUT_S,
    )
    records = [json.loads(line) for line in log.read_text().splitlines()]
    cases = {
        r["nodeid"].split("::")[1]: (r["outcome"], r["reason"])
        for r in records
        if r["event"] == "case"
    }
    collected = next(r["nodeids"] for r in records if r["event"] == "collected")
    assert len(collected) == len(cases) == 5, res.stdout + res.stderr
    return res.returncode, cases, res.stdout + res.stderr


def test_a_gpu_case_that_skips_fails_where_a_gpu_is_required(tmp_path):
    # Without SHMGRAD_REQUIRE_GPU (CI, here): the GPU cases skip with their reason.
    code, cases, output = _outcomes_where(tmp_path, require=False)
    assert code == 0, output
    assert cases["test_on_a_backend[fake]"] == ("passed", "")
    assert cases["test_on_a_backend[cuda]"] == (
        "skipped",
        "no GPU here: a stand-in for the driver's answer",
    )
    assert cases["test_skips_in_its_body"][0] == "skipped"
    # With it (tools/device-check --run --gpu): each such skip fails the run, naming why it
    # skipped; a case that needs more GPUs than the machine has, and a case that is no
    # GPU case, still skip.
    code, cases, output = _outcomes_where(tmp_path, require=True)
    assert code == 1, output
    assert cases["test_on_a_backend[fake]"] == ("passed", "")
    outcome, reason = cases["test_on_a_backend[cuda]"]
    assert outcome == "error", output  # in its fixture: pytest's "error at setup"
    assert "SHMGRAD_REQUIRE_GPU=1" in reason and "a stand-in for the driver's answer" in reason
    outcome, reason = cases["test_skips_in_its_body"]
    assert outcome == "failed" and "no GPU here: in the body" in reason, output
    assert cases["test_on_two_gpus"] == (
        "skipped",
        "needs more GPUs than this machine has: 2 needed, 1 here",
    )
    assert cases["test_not_a_gpu_case"] == ("skipped", "skipped for a reason of its own")
