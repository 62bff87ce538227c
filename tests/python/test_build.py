"""The builds and the installed package: Bazel and CMake compile the same sources; a wheel
built by `pip wheel` works from a directory outside the checkout; build_info(); the
TorchScript deprecation of today's torch."""

import json
import os
import re
import shutil
import subprocess
import sys
import time
import warnings

import pytest
import torch

import shmgrad
from shmgrad import _mode as eager

from conftest import Mlp, reference_gradient, relative_error

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
# The folders whose sources make the library, the extension and the programs (tests and
# examples are Bazel's alone).
PRODUCT_PACKAGES = ("ipc", "worker", "engine", "python", "tools", "gpu", "backend")


def _bazel_sources():
    out = set()
    for pkg in PRODUCT_PACKAGES:
        with open(os.path.join(ROOT, pkg, "BUILD")) as f:
            text = f.read()
        for block in re.findall(r"srcs\s*=\s*\[([^\]]*)\]", text):
            out.update(f"{pkg}/{name}" for name in re.findall(r'"([^"]+\.(?:cc|cu))"', block))
    return out


def _cmake_sources():
    with open(os.path.join(ROOT, "CMakeLists.txt")) as f:
        text = re.sub(r"#.*", "", f.read())
    return set(re.findall(r"\b([a-z_]+/[A-Za-z0-9_]+\.(?:cc|cu))\b", text))


def _tree_sources():
    return {
        f"{pkg}/{name}"
        for pkg in PRODUCT_PACKAGES
        for name in os.listdir(os.path.join(ROOT, pkg))
        if name.endswith((".cc", ".cu"))
    }


def test_bazel_and_cmake_compile_the_same_sources():
    bazel, cmake, tree = _bazel_sources(), _cmake_sources(), _tree_sources()
    assert bazel, "no sources found in the BUILD files: the parser is broken"
    assert bazel == cmake, (
        f"only in Bazel: {sorted(bazel - cmake)}; only in CMakeLists.txt: {sorted(cmake - bazel)}"
    )
    assert tree == bazel, f"built by neither: {sorted(tree - bazel)}"


def test_source_parity_check_can_fail(tmp_path):
    # The parser sees a source that only one build names.
    assert "tools/reduce_bench.cc" in _cmake_sources()
    assert "tools/reduce_bench.cc" in _bazel_sources()
    assert "ipc/segment.cc" in _cmake_sources() & _bazel_sources()


def test_build_info_names_the_torch_it_was_built_against():
    info = shmgrad.build_info()
    assert info["torch"] == torch.__version__.split("+")[0]
    assert info["torch_runtime"] == torch.__version__
    # The CUDA path: built where nvcc was found (tests/python/test_gpu.py checks which).
    assert isinstance(info["cuda"], bool)
    assert (info["cuda_toolkit"] is None) == (not info["cuda"])
    assert info["cxx11_abi"] == bool(torch._C._GLIBCXX_USE_CXX11_ABI)


def test_auto_mode_follows_the_torchscript_deprecation():
    with warnings.catch_warnings():
        # shmgrad's own code must not trigger TorchScript's deprecation warnings.
        warnings.simplefilter("error", FutureWarning)
        warnings.simplefilter("error", DeprecationWarning)
        mode, why = eager.choose_mode(
            "auto",
            model=Mlp(),
            loss="cross_entropy",
            dataset=None,
            collate_fn=None,
            forward=None,
            loss_names=["cross_entropy"],
        )
    if eager.torchscript_deprecated():
        assert mode == "eager" and "deprecates TorchScript" in why and torch.__version__ in why
    else:
        assert mode == "script" and why == "auto: the module scripts"


def _mlp_case(*, seed, examples):
    """An Mlp, a batch for it and the single-process gradient of its summed loss."""
    torch.manual_seed(seed)
    model = Mlp()
    x, y = torch.randn(examples, 20), torch.randint(0, 5, (examples,))
    return model, x, y, reference_gradient(model, "cross_entropy", x, y)


def test_auto_engine_on_deprecated_torchscript_is_eager_and_says_why():
    if not eager.torchscript_deprecated():
        pytest.skip(f"torch {torch.__version__} does not deprecate TorchScript")
    model, x, y, expected = _mlp_case(seed=0, examples=12)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        with shmgrad.Engine(model=model, workers=2, loss="cross_entropy") as engine:
            assert engine.mode == "eager"
            status = engine.status()
            assert status.worker_kind == "eager"
            assert "deprecates TorchScript" in status.mode_reason
            engine.bind(model)
            engine.gradient(inputs=x, targets=y)
            assert relative_error([p.grad for p in model.parameters()], expected) < 1e-6


def test_script_mode_still_works_when_asked(tmp_path):
    # mode='script' scripts the module (the user asked: the deprecation warning is theirs)
    # and the C++ workers load it with torch::jit::load.
    model, x, y, expected = _mlp_case(seed=1, examples=10)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        path = shmgrad.save_model(model, tmp_path / "m.pt")
    with shmgrad.Engine(model=str(path), workers=2, loss="cross_entropy") as engine:
        assert (
            engine.mode == "script"
            and engine.mode_reason == "auto: the model is a TorchScript file"
        )
        engine.bind(model)
        engine.gradient(inputs=x, targets=y)
        assert relative_error([p.grad for p in model.parameters()], expected) < 1e-6


def test_a_file_that_is_not_torchscript_names_the_torch_version(tmp_path):
    bad = tmp_path / "bad.pt"
    bad.write_bytes(b"not a model")
    with pytest.raises(shmgrad.InvalidArgumentError) as info:
        shmgrad.Engine(model=str(bad), workers=1, loss="cross_entropy")
    assert torch.__version__.split("+")[0] in str(info.value)
    assert "mode='eager'" in str(info.value)


@pytest.mark.parametrize("mode", ["eager", "script"])
def test_default_zero_grad_sets_none_and_the_next_gradient_relinks(mode):
    # PyTorch 2.x: optimizer.zero_grad() sets every .grad to None by default.
    torch.manual_seed(2)
    model, ref = Mlp(), Mlp()
    ref.load_state_dict(model.state_dict())
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        engine = shmgrad.Engine(model=model, workers=2, loss="cross_entropy", mode=mode)
    with engine:
        engine.bind(model)
        for _ in range(3):
            x, y = torch.randn(16, 20), torch.randint(0, 5, (16,))
            opt.zero_grad()
            assert all(p.grad is None for p in model.parameters())
            engine.gradient(inputs=x, targets=y, reduction="mean")
            opt.step()
            ref_opt.zero_grad()
            torch.nn.functional.cross_entropy(ref(x), y).backward()
            ref_opt.step()
        assert relative_error(list(model.parameters()), list(ref.parameters())) < 1e-5


@pytest.mark.newest_torch_only
def test_wheel_installs_outside_the_checkout_and_works_from_anywhere(tmp_path):
    py = sys.executable
    wheels = tmp_path / "wheels"
    build_dir = os.path.join(ROOT, "build", f"torch-{torch.__version__}")  # setup.sh's: incremental
    subprocess.run(
        [
            py,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-build-isolation",
            "--no-deps",
            f"--config-settings=build-dir={build_dir}",
            "-w",
            str(wheels),
            ROOT,
        ],
        check=True,
        timeout=900,
    )
    [wheel] = list(wheels.glob("shmgrad-*.whl"))
    site = tmp_path / "site"
    subprocess.run(
        [py, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), str(wheel)],
        check=True,
        timeout=300,
    )
    for f in ("shmgrad/bin/shmgrad", "shmgrad/bin/shmgrad-worker", "shmgrad/bin/reduce_bench"):
        assert os.access(site / f, os.X_OK), f"{f} is not in the wheel"
    assert list((site / "shmgrad").glob("_C*.so")), "the extension is not in the wheel"
    assert (site / "shmgrad" / "lightning.py").exists(), "shmgrad.lightning is not in the wheel"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHMGRAD_")}
    env["PYTHONPATH"] = str(site)
    script = f"""
import os, sys, subprocess, warnings, torch, shmgrad
assert shmgrad.__file__.startswith({str(site)!r}), shmgrad.__file__
torch.manual_seed(0)
m = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
x, y = torch.randn(9, 6), torch.randint(0, 3, (9,))
ref = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
ref.load_state_dict(m.state_dict())
torch.nn.functional.cross_entropy(ref(x), y, reduction="sum").backward()
for mode in ("eager", "script"):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        e = shmgrad.Engine(model=m, workers=2, loss="cross_entropy", mode=mode)
    with e:
        e.bind(m)
        e.gradient(inputs=x, targets=y)
        pairs = zip(m.parameters(), ref.parameters())
        err = max(float((p.grad - r.grad).abs().max()) for p, r in pairs)
        assert err < 1e-5, (mode, err)
        print("exact", mode, e.status().worker_kind)
"""
    out = subprocess.run(
        [py, "-c", script], cwd=elsewhere, env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "exact eager eager" in out.stdout and "exact script script" in out.stdout
    # The command: serve, status, stop, with the TorchScript model saved here.
    cli = str(site / "bin" / "shmgrad")
    model_path = tmp_path / "m.pt"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        shmgrad.save_model(Mlp(), model_path)
    name = f"wheel-{os.getpid()}"
    serve = subprocess.Popen(
        [
            py,
            cli,
            "serve",
            "--name",
            name,
            "--model",
            str(model_path),
            "--workers",
            "2",
            "--loss",
            "cross_entropy",
        ],
        cwd=elsewhere,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        status = ""
        for _ in range(300):
            st = subprocess.run(
                [py, cli, "status", name],
                cwd=elsewhere,
                env=env,
                capture_output=True,
                text=True,
                timeout=60,
            )
            status = st.stdout
            if st.returncode == 0 and "serving" in status:
                break
            assert serve.poll() is None, serve.stdout.read()
            time.sleep(0.2)
        assert "serving" in status, status
        stop = subprocess.run(
            [py, cli, "stop", name],
            cwd=elsewhere,
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert stop.returncode == 0, stop.stdout + stop.stderr
        serve.communicate(timeout=60)  # waits, and closes its output pipe
        assert serve.returncode == 0
    finally:
        if serve.poll() is None:
            serve.kill()
        serve.communicate()


def test_torch_compile_in_eager_workers_gives_exact_gradients():
    # A torch.compile'd module: each worker compiles its own copy; binding the compiled
    # module binds the one it wraps. Exact against one process, over two optimizer steps.
    torch.manual_seed(3)
    model = Mlp()
    ref = Mlp()
    ref.load_state_dict(model.state_dict())
    compiled = torch.compile(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05)
    with shmgrad.Engine(model=compiled, workers=2, loss="cross_entropy") as engine:
        assert engine.mode == "eager"
        assert engine.bind(compiled) is compiled
        for _ in range(2):
            x, y = torch.randn(16, 20), torch.randint(0, 5, (16,))
            opt.zero_grad()
            engine.gradient(inputs=x, targets=y, reduction="mean")
            ref_opt.zero_grad()
            torch.nn.functional.cross_entropy(ref(x), y).backward()
            assert (
                relative_error(
                    [p.grad for p in model.parameters()], [p.grad for p in ref.parameters()]
                )
                < 1e-5
            )
            opt.step()
            ref_opt.step()
    with pytest.raises(shmgrad.InvalidArgumentError, match="mode='eager'"):
        shmgrad.Engine(model=Mlp(), workers=1, loss="cross_entropy", mode="script", compile=True)
    with pytest.raises(shmgrad.InvalidArgumentError, match="compile must be"):
        shmgrad.Engine(model=Mlp(), workers=1, loss="cross_entropy", compile="yes")


@pytest.mark.newest_torch_only
@pytest.mark.full  # 118 s on a quiet machine; tools/device-check prepares here before a lent run
def test_device_check_prepares_and_dry_runs(tmp_path):
    # Here: what must travel to the GPU machine, within its 64 MiB; then the same run as
    # there, against this environment, scaled down (build, a test, the scaling bench),
    # each test case's outcome in report.json.
    script = os.path.join(ROOT, "tools", "device-check")
    prep = subprocess.run([script], capture_output=True, text=True, timeout=300)
    assert prep.returncode == 0, prep.stdout + prep.stderr
    assert 'carry: [".device"]' in prep.stdout and "tools/device-check --run" in prep.stdout
    device = os.path.join(ROOT, ".device")
    assert os.path.exists(
        os.path.join(device, "include", "boost", "interprocess", "shared_memory_object.hpp")
    )
    assert os.path.exists(os.path.join(device, "include", "CLI", "CLI.hpp"))
    assert any(w.startswith("distributed-") for w in os.listdir(os.path.join(device, "wheels")))
    size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(device) for f in fs)
    assert size < 64 << 20
    out = tmp_path / "out"
    run = subprocess.run(
        [script, "--run", "--dry-run", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    with open(out / "report.json") as f:
        report = json.load(f)
    assert report["steps"] == {
        "build": 0,
        "tests": 0,
        "collectives": 0,
        "bench": 0,
        "loop": 0,
        "adaptive": 0,
    }
    # Whole training loops: every system timed, the trainer's threads as each holds them.
    assert set(report["loop"]["median_s"]) == {"single", "engine", "engine-keep"}
    # The adaptive example ran shortened and compared arrival with arrival.
    adaptive = report["adaptive"]
    assert adaptive["exit"] in (0, 1) and adaptive["summary"]["exit_status"] == adaptive["exit"]
    assert "like for like, to the same target" in adaptive["summary_text"]
    assert adaptive["summary"]["fixed_at_end"]["epoch"] == 2
    with open(out / "bench" / "results.json") as f:
        systems = {r["system"] for r in json.load(f)["results"]}
    assert {"single", "shmgrad", "ddp", "ddp-shmgrad"} <= systems
    with open(out / "collectives" / "results.json") as f:
        collectives = json.load(f)["results"]
    assert {r["collective"] for r in collectives} == {"all_reduce", "all_gather", "reduce_scatter"}
    assert all(r["gloo"]["correct"] and r["shmgrad"]["correct"] for r in collectives)
    report_md = (out / "report.md").read_text()
    assert "## The shmgrad backend against gloo" in report_md
    assert "Process settings: alike" in report_md
    assert "## Adaptive batches, like for like" in report_md
    assert "## Whole training loops (tools/loop_bench.py)" in report_md
    assert report["tests"]["counts"].get("passed", 0) > 0, report["tests"]
    assert all(c["outcome"] in ("passed", "skipped") for c in report["tests"]["cases"])
    # --gpu: the GPU cases only, each in report.json (here without a GPU: skipped, with the
    # reason), and workers sharing a device: the fake one here, without and with MPS (a
    # stand-in control program that records its calls). The build is the one above.
    mps_bin = tmp_path / "mps-bin"
    mps_bin.mkdir()
    (mps_bin / "nvidia-cuda-mps-control").write_text(_MPS_STAND_IN)
    os.chmod(mps_bin / "nvidia-cuda-mps-control", 0o755)
    env = {k: v for k, v in os.environ.items() if k != "SHMGRAD_REQUIRE_GPU"}
    env["PATH"] = f"{mps_bin}{os.pathsep}{env['PATH']}"
    gpu_out = tmp_path / "gpu"
    gpu = subprocess.run(
        [script, "--run", "--dry-run", "--gpu", "--skip", "build", "--out", str(gpu_out)],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert gpu.returncode == 0, gpu.stdout[-3000:] + gpu.stderr[-3000:]
    with open(gpu_out / "report.json") as f:
        report = json.load(f)
    assert report["steps"] == {"tests": 0, "sharing": 0, "sharing-mps": 0}
    assert report["not_run"] == {"gpu-probe": "no GPU here (torch.cuda.is_available() is False)"}
    cases = report["tests"]["cases"]
    names = {c["nodeid"].split("::")[1].split("[")[0] for c in cases}
    assert "test_a_hung_kernel_ends_in_timeout_and_its_worker_is_replaced" in names
    assert "test_an_ipc_handle_opens_in_another_process" in names
    assert not any("[fake" in c["nodeid"] for c in cases)  # CI's half
    for c in cases:
        assert c["outcome"] == "skipped" and c["reason"].startswith("no GPU here"), c
        assert set(c) == {"nodeid", "outcome", "duration", "reason"}
    assert report["tests"]["counts"] == {"skipped": len(cases)}
    without, with_mps = report["sharing"]["without_mps"], report["sharing"]["with_mps"]
    for half, mps in ((without, False), (with_mps, True)):
        assert half["mps"] is mps and half["one_process_ms"] > 0, half
        assert set(half["workers"]) == {"1", "2"}, half
        assert all(run["ms"] > 0 and run["devices"] == "cuda:0" for run in half["workers"].values())
    calls = (gpu_out / "mps-logs" / "calls").read_text().split("\n")
    assert calls[0].startswith("-d pipe=") and "quit" in calls, calls
    assert report["mps"]["start_exit"] == 0 and report["mps"]["stopped"], report["mps"]
    report_md = (gpu_out / "report.md").read_text()
    assert "## Workers sharing one GPU" in report_md and "| 2 workers |" in report_md
    assert "gpu-probe: not run: no GPU here" in report_md
    # Where a GPU is required (--gpu sets SHMGRAD_REQUIRE_GPU=1 on the GPU machine), the
    # same cases' skips fail the run, each with its reason.
    required = subprocess.run(
        [script, "--run", "--dry-run", "--gpu", "--skip", "build,sharing,sharing-mps"]
        + ["--out", str(tmp_path / "required")],
        capture_output=True,
        text=True,
        timeout=600,
        env=dict(env, SHMGRAD_REQUIRE_GPU="1"),
    )
    assert required.returncode == 1, required.stdout[-3000:] + required.stderr[-3000:]
    with open(tmp_path / "required" / "report.json") as f:
        report = json.load(f)
    assert report["steps"] == {"tests": 1} and report["tests"]["require_gpu"]
    assert [c["nodeid"] for c in report["tests"]["cases"]] == [c["nodeid"] for c in cases]
    for c in report["tests"]["cases"]:
        assert c["outcome"] in ("failed", "error"), c
        assert "SHMGRAD_REQUIRE_GPU=1" in c["reason"] and "no GPU here" in c["reason"], c
    # A lease too short for everything: what does not fit is skipped, said, and fails.
    short = subprocess.run(
        [script, "--run", "--dry-run", "--deadline", "1", "--skip", "adaptive"],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
    )
    assert short.returncode == 1, short.stdout[-3000:] + short.stderr[-3000:]
    with open(tmp_path / "device-check-out" / "report.json") as f:
        report = json.load(f)
    assert report["steps"] == {"build": 0}
    assert report["skipped"] == ["tests", "collectives", "bench", "loop"]
    assert (
        "skipped for want of time: tests, collectives, bench, loop"
        in (tmp_path / "device-check-out" / "report.md").read_text()
    )


# A stand-in for nvidia-cuda-mps-control: -d starts "the daemon" (a file in its pipe
# folder), get_server_list answers while it runs, quit stops it; each call is recorded in
# the daemon's log folder, which device-check keeps.
_MPS_STAND_IN = """#!/bin/sh
calls="$CUDA_MPS_LOG_DIRECTORY/calls"
echo "$* pipe=$CUDA_MPS_PIPE_DIRECTORY log=$CUDA_MPS_LOG_DIRECTORY" >> "$calls"
if [ "$1" = "-d" ]; then touch "$CUDA_MPS_PIPE_DIRECTORY/control"; exit 0; fi
read -r command
echo "$command" >> "$calls"
case "$command" in
  get_server_list) [ -e "$CUDA_MPS_PIPE_DIRECTORY/control" ] ;;
  quit) rm -f "$CUDA_MPS_PIPE_DIRECTORY/control" ;;
esac
"""


def _shared_object(tmp_path, name, *flags):
    src = tmp_path / "reads.cc"
    src.write_text(
        "#include <fstream>\n"
        'int first() { std::ifstream f("/proc/self/stat"); int x = 0; f >> x; return x; }\n'
    )
    out = tmp_path / name
    subprocess.run(["g++", "-shared", "-fPIC", "-o", str(out), str(src), *flags], check=True)
    return str(out)


def test_an_extension_with_its_own_libstdcxx_fails_the_build(tmp_path):
    # The GPU machine's compiler wrapper linked libstdc++ statically: the extension crashed
    # at its first stream read. The CMake build checks each torch-linked binary for that.
    if shutil.which("g++") is None or shutil.which("nm") is None:
        pytest.skip("needs g++ and nm")
    check = [sys.executable, os.path.join(ROOT, "tools", "check_extension_link.py")]
    static = _shared_object(tmp_path, "static.so", "-static-libstdc++")
    res = subprocess.run(
        check + [static, "--compiler", "g++-wrapper"], capture_output=True, text=True
    )
    assert res.returncode == 1
    assert "g++-wrapper links libstdc++ statically" in res.stderr and "CXX=" in res.stderr
    dynamic = _shared_object(tmp_path, "dynamic.so")
    assert subprocess.run(check + [dynamic]).returncode == 0
    native = subprocess.run(check + [shmgrad._C.__file__], capture_output=True, text=True)
    assert native.returncode == 0, native.stderr
    with open(os.path.join(ROOT, "CMakeLists.txt")) as f:
        cmake = f.read()
    assert "tools/check_extension_link.py" in cmake and "POST_BUILD" in cmake


def test_defaults_and_tunables_are_declared_once():
    # ipc/config.h declares every environment variable shmgrad reads, with its value where
    # the default is one; docs/DESIGN.md's table agrees with it, every read in the sources
    # goes through config::tunable(Value) or shmgrad._native.tunable(_value), and Python's
    # defaults come from it.
    import inspect

    from shmgrad._native import DEFAULTS, TUNABLES, _C, tunable, tunable_value

    declared = {name: (_C.TUNABLE_VALUES.get(name), d, m) for name, d, m in _C.TUNABLES}
    assert declared == TUNABLES
    for name, (value, default, _) in declared.items():
        assert value is None or value == default, name  # a value is its own default's words
    with open(os.path.join(ROOT, "docs", "DESIGN.md")) as f:
        rows = re.findall(r"^\| `(SHMGRAD_[A-Z_]+)` \| (.*?) \| (.*?) \|$", f.read(), re.M)
    assert {n: (d, m) for n, d, m in rows} == {n: (d, m) for n, (_, d, m) in declared.items()}
    through = re.compile(r"""(?:tunable|tunableValue|tunable_value)\(\s*["'](SHMGRAD_[A-Z_]+)""")
    # Reads that bypass the declaration (writes for child processes, os.environ[...] = or
    # env dicts, are not reads).
    direct = re.compile(
        r"""(?:getenv\(|environ\.get\(|environ\.pop\()\s*["'](SHMGRAD_[A-Z_]+)"""
        r"""|environ\[\s*["'](SHMGRAD_[A-Z_]+)["']\](?!\s*=[^=])"""
    )
    found, bypass = set(), []
    for folder in (
        "backend",
        "engine",
        "examples",
        "gpu",
        "ipc",
        "python",
        "tests",
        "tools",
        "worker",
    ):
        for dirpath, _, files in os.walk(os.path.join(ROOT, folder)):
            for name in files:
                if name.endswith((".cc", ".h", ".cu", ".py")) and name != "test_build.py":
                    path = os.path.join(dirpath, name)
                    with open(path) as f:
                        text = f.read()
                    found |= set(through.findall(text))
                    bypass += [
                        f"{os.path.relpath(path, ROOT)}: {a or b}" for a, b in direct.findall(text)
                    ]
    assert not bypass, f"read these through the declared tunables: {bypass}"
    assert found and found <= set(declared), found - set(declared)
    with pytest.raises(KeyError, match="not declared"):
        tunable("SHMGRAD_NOT_A_TUNABLE")
    with pytest.raises(KeyError, match="no declared value"):
        tunable_value("SHMGRAD_BINARY")
    spin = declared["SHMGRAD_SPIN_US"][0]
    assert spin is not None and 0 <= float(spin) <= 10000
    sig = inspect.signature(shmgrad.Engine.__init__).parameters
    for key in ("max_batch", "input_capacity_mb", "startup_timeout", "threads_per_worker"):
        assert sig[key].default == DEFAULTS[key], key
    assert DEFAULTS["max_batch"] == 65536 and DEFAULTS["startup_timeout"] == 120


def _needed(path):
    out = subprocess.run(["readelf", "-d", path], capture_output=True, text=True, check=True)
    return re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", out.stdout)


def test_the_coordinator_links_no_libtorch():
    # `shmgrad` (the CLI and the coordinator) describes models through shmgrad-worker, the
    # one program that links libtorch; the check sees libtorch where it is linked.
    bin_dir = os.path.dirname(shmgrad.program("shmgrad"))
    torch_libs = ("libtorch", "libc10")
    cli = _needed(os.path.join(bin_dir, "shmgrad"))
    worker = _needed(os.path.join(bin_dir, "shmgrad-worker"))
    assert cli and not [lib for lib in cli if lib.startswith(torch_libs)], cli
    assert [lib for lib in worker if lib.startswith(torch_libs)], worker
    # serve of a file that is not TorchScript: the describer's error, as before.
    bad = subprocess.run(
        [
            shmgrad.program("shmgrad"),
            "serve",
            "--name",
            f"nolib-{os.getpid()}",
            "--model",
            __file__,
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode != 0 and "InvalidArgument" in bad.stderr, bad.stderr
