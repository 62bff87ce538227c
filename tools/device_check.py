"""The checks for a lent GPU machine, prepared here and run there in one call.

The GPU machine has no network, no apt, no Bazel and no Boost: Python 3.12 with torch
2.11 (CUDA 13.0), CMake, ninja, pybind11, scikit-build-core and pytest in
/opt/torch/.venv, and 16 CPU cores. What it lacks travels with the source tree, in the
ignored folder .device/ (at most 64 MiB):

  prepare (here, the default)  .device/include: the Boost.Interprocess, CLI11 and zlib
                               headers the build includes (found by the preprocessor);
                               .device/wheels: the wheels of Dask's distributed and its
                               dependencies for CPython 3.12; .device/data: Fashion-MNIST.
                               Prints what to carry and the command to run there.
  --run --out DIR (there)      builds shmgrad with pip install --no-build-isolation into
                               the machine's own environment (with /usr/bin/g++: the
                               image's CC/CXX wrappers link libstdc++ statically), then
                               tools/gpu_probe.py (the GPU, CUDA IPC, the seed case's
                               baselines on it), the build's and engine's tests, the
                               collectives of the shmgrad torch.distributed backend
                               against gloo (shmgrad bench --collectives, 2, 4, 8 and 16
                               ranks, 4 KiB to 64 MiB, into DIR/collectives), the CPU
                               scaling benchmark (CNN and WRN at batch 256: shmgrad with
                               1, 2, 4, 8 and 16 workers against DDP over gloo and over
                               the shmgrad backend with as many ranks and one process, in
                               one run), whole training loops (tools/loop_bench.py, the
                               1.86 M-parameter MLP at batch 256: one process, the engine,
                               and the engine whose trainer keeps its 16 threads, one run
                               each; 120 s at most), then, if time is left,
                               examples/adaptive_batch.py
                               shortened (like for like, one worker per core); all within
                               --deadline (470 s).
  --run --gpu --out DIR        the GPU workers' checks instead (issue 21), in this order,
                               within --deadline (450 s: the whole call in 8 minutes):
                               build  as above;
                               tests  the GPU cases only (pytest -m gpu) of
                                      tests/python/test_gpu.py and test_gpu_workers.py
                                      (exactness against one process for 1, 2 and 4
                                      workers on the device, eager BatchNorm with a random
                                      dataset, 20 optimizer steps, a SIGKILLed worker and a
                                      hung kernel each replaced, nothing left on the device
                                      or in /dev/shm; their fake-device half runs in CI)
                                      with SHMGRAD_REQUIRE_GPU=1: a GPU case that skips
                                      fails the run (only a case that needs more GPUs than
                                      the machine has may skip, and is reported);
                               sharing  the seed case (WRN-16-4, batch 128) as one process
                                      and through shmgrad with 1, 2 and 4 workers sharing
                                      the GPU (tools/gpu_probe.py --sharing);
                               sharing-mps  the same under an MPS daemon
                                      (nvidia-cuda-mps-control -d, its pipes and logs in a
                                      temporary folder named to every process of the run,
                                      quit after); a missing binary, or a daemon that does
                                      not start or serve, is recorded and the half left out;
                               gpu-probe  the machine's facts, CUDA IPC, and the seed
                                      case's baselines: a deep copy per gradient, a pickle
                                      round trip, Dask (its wheels installed first).
  --run --dry-run --out DIR    the same here, against .venv, scaled to this machine (with
                               --gpu: the GPU cases skip with their reason, unless the
                               caller sets SHMGRAD_REQUIRE_GPU=1, which makes them fail;
                               the sharing runs a small CNN on the fake device,
                               tests/fake_cuda.cc, and its MPS half where the binary is).

DIR/report.json holds every figure and every test case's outcome (nodeid, outcome,
duration, skip or failure reason, from the tests' --outcomes-log, conftest.py), and is
written after each step and, while the tests and the sharing run, every few seconds: a
call cut short (600 s is the limit of one) still returns what ran. report.md says the
same for a reader; each step's output is in DIR/<step>.log. A step the deadline leaves
no time for is skipped and listed ("skipped for want of time"), and the run fails; one
that cannot run (no GPU, no MPS) is listed with its reason under "not_run".

The collectives step of --run is bounded by its timeout (120 s; 90 s for one rank count)
and estimated at 60 s there: per rank count, W processes start and import torch (about
5 s at 16 ranks on 16 cores), copy 64 MiB 40 times, then 8 sizes x 3 collectives x 2
backends (and all_reduce once more on arena tensors, in place), each a checked call, 1
calibration call and 3 to 5 samples of about 10 ms of calls (--budget 1 s for all the
systems: 3 samples of one call at 64 MiB, where a 16-rank
gloo all-reduce should take a few hundred ms). Here (2 cores, 2026-12-06, load average
4 from other tests) the same settings took 15 s at 2 ranks, 23 s at 4 and 62 s at 8 (4
processes a core); 16 ranks with two sizes took 71 s, most of it 16 processes starting
on 2 cores. On 16 cores no rank count is oversubscribed. The step runs before the
scaling benchmark (whose 270 s timeout then meets the deadline sooner): the backend's
collectives have not run there yet, the benchmark has (2026-12-04). It writes its
results after each rank count, so a step cut short keeps the rank counts it finished.

Time of --run --gpu on the H200 machine (one lease: 15 minutes of device time, its start
included; 600 s a call). Estimated per step from what was measured, and bounded by a
timeout each, all within the 450 s deadline:

  step         estimate  timeout  derived from
  facts            5 s       -    one torch import in a subprocess (3 s here)
  build           60 s    240 s   45 s there (2026-12-04, 16 cores) before the CUDA path;
                                  nvcc adds one 2 s compile (measured here), in parallel
  tests          120 s    240 s   the 12 test_gpu_workers.py cases that fit one GPU take
                                  61 s here on the fake device (2 cores, 2026-12-06); on
                                  the GPU about 16 worker starts add a CUDA context and
                                  libtorch_cuda each (1-3 s), 3 s the memory checks, 25 s
                                  the hung-kernel case; test_gpu.py's 2 cases 5 s
  sharing         35 s    100 s   one process: a torch import and 23 gradients (6.44 ms
                                  each there); per engine its start (about 5 s) and 23
                                  gradients (tens of ms); the engine's stop
  sharing-mps     40 s    100 s   the same, and the daemon's start and quit
  gpu-probe       45 s     90 s   the wheels (10 s), then 35 s there on 2026-12-04
  total          305 s            of 450 s: 145 s of margin before the deadline skips
                                  the last steps (the baselines first)
"""

import argparse
import datetime
import glob
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
PREPARED = os.path.join(ROOT, ".device")
DEVICE_PYTHON = "/opt/torch/.venv/bin/python3"
CARRY_LIMIT_BYTES = 64 << 20
# Wheels for the GPU machine's interpreter; pip matches manylinux tags exactly.
WHEEL_TARGET = ["--python-version", "3.12", "--implementation", "cp", "--only-binary=:all:"] + [
    a
    for tag in (
        "manylinux_2_28_x86_64",
        "manylinux_2_17_x86_64",
        "manylinux2014_x86_64",
        "manylinux_2_5_x86_64",
        "manylinux1_x86_64",
        "any",
    )
    for a in ("--platform", tag)
]
DEVICE_WHEELS = ["distributed"]  # what the machine lacks of tools/requirements.txt
HEADERS = ("boost/interprocess/shared_memory_object.hpp", "CLI/CLI.hpp", "zlib.h")


def _declared_value(name):
    """A tunable's declared value, read from ipc/config.h's kTunables (shmgrad is not
    installed yet when --run starts on the lent machine)."""
    with open(os.path.join(ROOT, "ipc", "config.h")) as f:
        m = re.search(r'\{"' + name + r'",\s*"([^"]*)"', f.read())
    if m is None:
        raise SystemExit(f"device-check: {name} has no declared value in ipc/config.h")
    return m.group(1)


FASHION_MNIST = _declared_value("SHMGRAD_FASHION_MNIST_DIR")
GPU_TESTS = ["test_gpu.py", "test_gpu_workers.py"]
# The variable that turns a GPU case's skip into a failure (tests/python/conftest.py).
REQUIRE_GPU_VARIABLE = "SHMGRAD_REQUIRE_GPU"
MPS_CONTROL = "nvidia-cuda-mps-control"

# Timeouts of the run's own waits (each step's are in SCALES).
WHEELS_TIMEOUT_S = 120
FACTS_TIMEOUT_S = 60
FAKE_DEVICE_BUILD_TIMEOUT_S = 120
MPS_COMMAND_TIMEOUT_S = 10  # one command to the MPS control daemon
MPS_READY_S = 15  # for the daemon to answer after -d, or to be gone after quit
MPS_POLL_S = 0.5
KILL_WAIT_S = 30  # for a killed step's output to end
# SIGTERM to SIGKILL for a step's processes: serve stops its workers and frees what it
# allocated in this time (a SIGKILLed engine leaves its /dev/shm segments behind).
TERM_GRACE_S = 10
GROUP_POLL_S = 0.1
REFRESH_S = 5  # report.json rewritten this often while a step runs
LEAST_STEP_S = 30  # a step is not started with less time than this before the deadline
DEADLINE_MARGIN_S = 5  # the report's last write, after the last step
TIMED_OUT = 124  # a step's exit code when its timeout killed it (as timeout(1) says)
PR_SET_PDEATHSIG = 1  # prctl(2)
TAIL_CHARS = 2000  # of an output quoted in the report

# What --run does, at the machine's scale and at this one's (--dry-run).
SCALES = {
    "device": {
        "workers": "1,2,4,8,16",
        "batch": "256",
        "models": "cnn,wrn",
        "repeats": 10,
        "budget": 6,
        # One warm-up step: a WRN step at batch 256 takes 5.6 s on one of its cores
        # (2026-12-04), and 3 warm-ups made the benchmark alone outlast the lease.
        "warmup": 1,
        # The build's own checks and the engine's; the rest of the suite runs in CI.
        "tests": ["test_gpu.py", "test_build.py", "test_engine.py"],
        "build_timeout": 420,
        "tests_timeout": 120,
        # The shmgrad backend against gloo (shmgrad bench --collectives): few samples,
        # sizes up to 64 MiB, one process group run per rank count.
        "collectives": {
            "ranks": "2,4,8,16",
            "sizes": "4K,16K,64K,256K,1M,4M,16M,64M",
            "repeats": 5,
            "budget": 1,
            "warmup": 1,
            "timeout": 90,  # one rank count
        },
        "collectives_timeout": 120,
        "bench_timeout": 270,
        # Whole training loops (tools/loop_bench.py): the trainer's idle threads spinning
        # after optimizer.step() (trainer_threads=None) against the default, at 16 cores.
        "loop": ["--model", "mlp2", "--batch", "256", "--steps", "30", "--warmup", "10"],
        "loop_timeout": 120,
        # GeoDamp doubling every epoch from 128 to 1024; batch 128 keeps 8 of the 16
        # workers busy (min_examples_per_worker 16), batches of 256 on use all 16.
        "adaptive": [
            "--workers",
            "16",
            "--min-examples-per-worker",
            "16",
            "--epochs",
            "4",
            "--delay-epochs",
            "1",
        ],
        "adaptive_timeout": 120,
        "gpu-probe_timeout": 60,
        # Under 8 minutes: build ~45 s, probe ~35 s, tests, benchmark; the adaptive example
        # runs when time is left (or alone: --skip gpu-probe,tests,bench).
        "deadline": 470,
    },
    "local": {
        "workers": "1,2",
        "batch": "32",
        "models": "cnn",
        "repeats": 3,
        "budget": 2,
        "warmup": 3,
        "tests": ["test_gpu.py", "test_build.py::test_bazel_and_cmake_compile_the_same_sources"],
        "build_timeout": 420,
        "tests_timeout": 120,
        "collectives": {
            "ranks": "2",
            "sizes": "4K,1M",
            "repeats": 3,
            "budget": 1,
            "warmup": 1,
            "timeout": 90,
        },
        "collectives_timeout": 120,
        "bench_timeout": 300,
        "loop": ["--model", "tiny", "--batch", "8", "--workers", "1", "--steps", "5"]
        + ["--warmup", "2"],
        "loop_timeout": 120,
        "adaptive": [
            "--workers",
            "2",
            "--epochs",
            "2",
            "--delay-epochs",
            "1",
            "--train-examples",
            "4096",
        ],
        "adaptive_timeout": 150,
        "gpu-probe_timeout": 90,
        "deadline": 900,
    },
}
# --gpu: the GPU workers' checks (the module's docstring has the estimates).
GPU_SCALES = {
    "device": {
        "build_timeout": 240,
        "tests_timeout": 240,
        "sharing": {"workers": "1,2,4", "model": "wrn", "batch": 128, "steps": 20},
        "sharing_timeout": 100,
        "sharing-mps_timeout": 100,
        "gpu-probe_timeout": 90,
        "deadline": 450,
        "estimates": {
            "facts": 5,
            "build": 60,
            "tests": 120,
            "sharing": 35,
            "sharing-mps": 40,
            "gpu-probe": 45,
        },
    },
    "local": {
        "build_timeout": 420,
        "tests_timeout": 120,
        # On the fake device (tests/fake_cuda.cc) and 2 cores: a small CNN, two engines.
        "sharing": {"workers": "1,2", "model": "cnn", "batch": 32, "steps": 3},
        "sharing_timeout": 120,
        "sharing-mps_timeout": 120,
        "gpu-probe_timeout": 90,
        "deadline": 900,
    },
}


def log(msg):
    print(f"device-check [{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def run(cmd, *, timeout, cwd=ROOT, env=None, out=None, refresh=None):
    """Runs cmd in a process group of its own, its output to the terminal and to `out` (a
    path) if given, and `refresh()` every REFRESH_S while it runs. At `timeout` the whole
    group is killed (an engine's processes with it) and TIMED_OUT returned; otherwise cmd's
    exit code. Processes it left behind are killed too, so that no step inherits them."""
    log("$ " + " ".join(cmd))
    sink = open(out, "w") if out else None
    proc = subprocess.Popen(
        cmd,
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        preexec_fn=_die_with_parent,
    )
    _step_groups[proc.pid] = proc

    def copy_output():
        for line in proc.stdout:
            sys.stdout.write(line)
            if sink:
                sink.write(line)
                sink.flush()

    reader = threading.Thread(target=copy_output, daemon=True)
    reader.start()
    deadline = time.monotonic() + timeout
    while True:
        try:
            code = proc.wait(timeout=max(0.0, min(REFRESH_S, deadline - time.monotonic())))
            break
        except subprocess.TimeoutExpired:
            if refresh:
                refresh()
            if time.monotonic() >= deadline:
                log(f"timed out after {timeout} s: stopping its processes")
                _stop_group(proc.pid, proc)
                proc.wait()
                code = TIMED_OUT
                break
    if _stop_group(proc.pid):
        log("it left processes behind: stopped them")
    del _step_groups[proc.pid]
    reader.join(KILL_WAIT_S)
    if sink and not reader.is_alive():
        sink.close()
    return code


# The process groups of the steps running now, by their leader's pid (each leader's Popen):
# stopped if device-check is.
_step_groups = {}


def _die_with_parent():
    """In a step's process, before exec: SIGKILL when device-check dies, even by SIGKILL
    (an engine's processes follow their trainer, as they do everywhere)."""
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def _stop_on_signal(signum, frame):
    """SIGTERM, SIGINT, SIGHUP: the running step's processes killed, then exit (the
    report is written on the way out)."""
    log(f"stopped by signal {signum}: stopping the running step's processes")
    for pgid, leader in list(_step_groups.items()):
        _stop_group(pgid, leader)
    raise SystemExit(128 + signum)


def _stop_group(pgid, leader=None):
    """SIGTERM to process group `pgid`, SIGKILL to what is left of it TERM_GRACE_S later;
    whether any process was in it. `leader`, a Popen, is reaped meanwhile."""
    try:
        os.killpg(pgid, signal.SIGTERM)
    except ProcessLookupError:
        return False
    deadline = time.monotonic() + TERM_GRACE_S
    while time.monotonic() < deadline:
        if leader is not None:
            leader.poll()
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        time.sleep(GROUP_POLL_S)
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    return True


# -- prepare (here) -------------------------------------------------------------------
def included_headers():
    """The system headers of HEADERS and everything they include, as the compiler sees them."""
    src = "".join(f"#include <{h}>\n" for h in HEADERS)
    res = subprocess.run(
        ["g++", "-std=c++20", "-M", "-x", "c++", "-"],
        input=src,
        text=True,
        capture_output=True,
        check=True,
    )
    names = res.stdout.replace("\\\n", " ").split()
    return sorted(
        {
            n
            for n in names
            if n.startswith("/usr/include/")
            and n[len("/usr/include/") :].split("/")[0] in ("boost", "CLI", "zlib.h", "zconf.h")
        }
    )


def prepare(python):
    shutil.rmtree(PREPARED, ignore_errors=True)
    inc = os.path.join(PREPARED, "include")
    for path in included_headers():
        dest = os.path.join(inc, os.path.relpath(path, "/usr/include"))
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        shutil.copy2(path, dest)
    wheels = os.path.join(PREPARED, "wheels")
    subprocess.run(
        [
            python,
            "-m",
            "pip",
            "download",
            "-q",
            "--disable-pip-version-check",
            "-d",
            wheels,
            *WHEEL_TARGET,
            *DEVICE_WHEELS,
        ],
        check=True,
    )
    if os.path.isdir(FASHION_MNIST):
        shutil.copytree(FASHION_MNIST, os.path.join(PREPARED, "data", "fashion-mnist"))
    size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(PREPARED) for f in fs)
    if size > CARRY_LIMIT_BYTES:
        raise SystemExit(f"{PREPARED} holds {size >> 20} MiB, more than the 64 MiB that travel")
    print(
        f"prepared {PREPARED}: {size / 2**20:.1f} MiB "
        f"({len(glob.glob(os.path.join(wheels, '*.whl')))} wheels)"
    )
    print('carry: [".device"]')
    print('run there: tools/device-check --run --out "$OUT"')
    print('or, the GPU workers: tools/device-check --run --gpu --out "$OUT"')


# -- run (there, or here with --dry-run) ------------------------------------------------
def machine_facts(python):
    facts = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "host_cpus": os.cpu_count(),
        "platform": platform.platform(),
    }
    res = subprocess.run(
        [
            python,
            "-c",
            "import torch,sys;print(torch.__version__);"
            "print(torch.cuda.is_available());print(sys.version.split()[0])",
        ],
        capture_output=True,
        text=True,
        timeout=FACTS_TIMEOUT_S,
    )
    if res.returncode == 0:
        facts["torch"], facts["cuda_available"], facts["python"] = res.stdout.split()
    flags = {
        k: os.environ[k]
        for k in ("CC", "CXX", "CFLAGS", "CXXFLAGS", "CPPFLAGS", "LDFLAGS", "CMAKE_ARGS")
        if k in os.environ
    }
    if flags:
        facts["build_env"] = flags
    cxx = shutil.which(os.environ.get("CXX", "c++"))
    if cxx:
        res = subprocess.run(
            [cxx, "--version"], capture_output=True, text=True, timeout=FACTS_TIMEOUT_S
        )
        facts["cxx"] = res.stdout.splitlines()[0] if res.stdout else cxx
    smi = shutil.which("nvidia-smi")
    if smi:
        out = subprocess.run(
            [smi, "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=FACTS_TIMEOUT_S,
        )
        facts["gpus"] = out.stdout.strip()
    # Whether the build can make the CUDA path (CMakeLists.txt looks there too), and MPS.
    nvcc = shutil.which("nvcc") or shutil.which("nvcc", path="/usr/local/cuda/bin")
    facts["nvcc"] = nvcc
    facts["mps_control"] = shutil.which(MPS_CONTROL)
    return facts


def install_wheels(python, dry_run):
    """The carried wheels (Dask's) installed into the machine's own interpreter.

    A venv over /opt/torch/.venv would not see its torch (that is itself a venv, and
    --system-site-packages reaches only the base interpreter's packages); the machine
    starts bare for every lease, so installing into its environment changes nothing lasting.
    """
    wheels = os.path.join(PREPARED, "wheels")
    if dry_run or not os.path.isdir(wheels):
        return  # .venv already has everything
    run(
        [python, "-m", "pip", "install", "-q", "--no-index", "--find-links", wheels]
        + DEVICE_WHEELS,
        timeout=WHEELS_TIMEOUT_S,
    )


def installed_build_info(python):
    """shmgrad.build_info() of the installed package (whether the CUDA path was built)."""
    res = subprocess.run(
        [python, "-c", "import json, shmgrad; print(json.dumps(shmgrad.build_info()))"],
        capture_output=True,
        text=True,
        timeout=FACTS_TIMEOUT_S,
    )
    if res.returncode != 0:
        return {"error": res.stderr[-TAIL_CHARS:]}
    return json.loads(res.stdout)


def build_shmgrad(python, out_dir, dry_run, timeout):
    import_torch = subprocess.run(
        [python, "-c", "import torch;print(torch.__version__)"],
        capture_output=True,
        text=True,
        check=True,
        timeout=FACTS_TIMEOUT_S,
    )
    torch_version = import_torch.stdout.strip()
    cmd = [
        python,
        "-m",
        "pip",
        "install",
        "-v",
        "--no-build-isolation",
        "--no-deps",
        f"--config-settings=build-dir={ROOT}/build/torch-{torch_version}",
    ]
    include = os.path.join(PREPARED, "include")
    if not dry_run and os.path.isdir(include):
        cmd.append(f"--config-settings=cmake.define.SHMGRAD_EXTRA_INCLUDE={include}")
        cmd.append(f"--config-settings=cmake.define.ZLIB_INCLUDE_DIR={include}")
        libz = _libz()
        if libz:
            cmd.append(f"--config-settings=cmake.define.ZLIB_LIBRARY={libz}")
    env = dict(
        os.environ,
        CMAKE_BUILD_PARALLEL_LEVEL=str(os.cpu_count() or 2),
        SKBUILD_BUILD_VERBOSE="true",  # the compile and link lines, into build.log
    )
    if not dry_run and os.path.exists("/usr/bin/g++") and os.path.exists("/usr/bin/gcc"):
        # The GPU machine's CC/CXX name /opt/gcc/bin wrappers that link libstdc++
        # statically (seen 2026-12-04): the extension then crashes at its first stream read.
        env.update(CC="/usr/bin/gcc", CXX="/usr/bin/g++")
    # A compiler that links libstdc++ statically fails the build (check_extension_link.py).
    return run(cmd + [ROOT], timeout=timeout, env=env, out=os.path.join(out_dir, "build.log"))


def _libz():
    for d in ("/usr/lib/x86_64-linux-gnu", "/lib/x86_64-linux-gnu", "/usr/lib64", "/usr/lib"):
        for name in ("libz.so", "libz.so.1"):
            if os.path.exists(os.path.join(d, name)):
                return os.path.join(d, name)
    return None


def read_outcomes(path):
    """The tests' --outcomes-log (conftest.py) as the report gives it: counts, and every
    collected case in order with its outcome; a case that had not finished when the step
    ended is "running" (the one it was in) or "not run"."""
    collected, started, cases = [], None, {}
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue  # a line cut short by a kill
                if rec["event"] == "collected":
                    collected = rec["nodeids"]
                elif rec["event"] == "start":
                    started = rec["nodeid"]
                elif rec["event"] == "case":
                    cases[rec["nodeid"]] = {k: v for k, v in rec.items() if k != "event"}
    listing = []
    for nodeid in collected or list(cases):
        if nodeid in cases:
            listing.append(cases[nodeid])
        else:
            outcome = "running" if nodeid == started else "not run"
            listing.append({"nodeid": nodeid, "outcome": outcome, "duration": None, "reason": ""})
    counts = {}
    for case in listing:
        counts[case["outcome"]] = counts.get(case["outcome"], 0) + 1
    return {"counts": counts, "cases": listing}


def load_json(path):
    """The JSON in `path`, or {} where it is not (yet) there."""
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def build_fake_device(out_dir):
    """tests/fake_cuda.cc built into out_dir (as conftest.py builds it): the stand-in
    device of a dry run's sharing step; None if it does not build."""
    lib = os.path.join(out_dir, "libfake_cuda.so")
    res = subprocess.run(
        ["g++", "-std=c++17", "-O1", "-shared", "-fPIC", f"-I{ROOT}"]
        + [os.path.join(ROOT, "tests", "fake_cuda.cc"), "-o", lib, "-lrt"],
        capture_output=True,
        text=True,
        timeout=FAKE_DEVICE_BUILD_TIMEOUT_S,
    )
    if res.returncode != 0:
        log(f"the fake device did not build: {res.stderr[-TAIL_CHARS:]}")
        return None
    return lib


class MpsDaemon:
    """An MPS control daemon for the processes of one step: its pipes and logs in a
    temporary folder that `environment` names (every process of the step gets it)."""

    def __init__(self, binary, env, out_dir):
        self.binary, self.out_dir = binary, out_dir
        self.folder = tempfile.mkdtemp(prefix="shmgrad-mps-")
        self.environment = {
            "CUDA_MPS_PIPE_DIRECTORY": os.path.join(self.folder, "pipe"),
            "CUDA_MPS_LOG_DIRECTORY": os.path.join(self.folder, "log"),
        }
        for d in self.environment.values():
            os.makedirs(d)
        self.env = dict(env, **self.environment)
        self.facts = {"binary": binary}

    def _command(self, *args, stdin=""):
        """The control program's exit code and output. Its output goes to a file, not a
        pipe: a daemon that kept a pipe open would leave us waiting for its end."""
        with tempfile.TemporaryFile("w+") as output:
            try:
                code = subprocess.run(
                    [self.binary, *args],
                    input=stdin,
                    env=self.env,
                    stdout=output,
                    stderr=subprocess.STDOUT,
                    text=True,
                    timeout=MPS_COMMAND_TIMEOUT_S,
                ).returncode
            except subprocess.TimeoutExpired:
                code = TIMED_OUT
            output.seek(0)
            text = output.read()[-TAIL_CHARS:]
        return code, text

    def _serving(self):
        return self._command(stdin="get_server_list\n")[0] == 0

    def start(self):
        """Starts the daemon; None when it answers, else why it does not."""
        code, output = self._command("-d")
        self.facts.update(start_exit=code, start_output=output)
        if code != 0:
            return f"{MPS_CONTROL} -d exited {code}: {output}"
        deadline = time.monotonic() + MPS_READY_S
        while not self._serving():
            if time.monotonic() > deadline:
                return f"the MPS daemon did not answer within {MPS_READY_S} s: {self.logs()}"
            time.sleep(MPS_POLL_S)
        return None

    def quit(self):
        code, output = self._command(stdin="quit\n")
        deadline = time.monotonic() + MPS_READY_S
        while self._serving() and time.monotonic() < deadline:
            time.sleep(MPS_POLL_S)
        self.facts.update(quit_exit=code, quit_output=output, stopped=not self._serving())
        self.facts["logs"] = self.logs()
        shutil.copytree(
            self.environment["CUDA_MPS_LOG_DIRECTORY"],
            os.path.join(self.out_dir, "mps-logs"),
            dirs_exist_ok=True,
        )
        shutil.rmtree(self.folder, ignore_errors=True)

    def logs(self):
        """The end of each of the daemon's logs (control.log, server.log)."""
        folder = self.environment["CUDA_MPS_LOG_DIRECTORY"]
        tails = {}
        for name in sorted(os.listdir(folder)):
            with open(os.path.join(folder, name), errors="replace") as f:
                tails[name] = f.read()[-TAIL_CHARS:]
        return tails


class Checks:
    """One --run: its report, deadline and environment, and the steps in order."""

    def __init__(self, args):
        self.args = args
        local = "local" if args.dry_run else "device"
        self.scale = dict(GPU_SCALES[local] if args.gpu else SCALES[local])
        self.out_dir = os.path.abspath(args.out)
        os.makedirs(self.out_dir, exist_ok=True)
        base = args.python or (
            os.path.join(ROOT, ".venv", "bin", "python") if args.dry_run else DEVICE_PYTHON
        )
        self.python = base
        self.skip = set(filter(None, args.skip.split(",")))
        self.started = time.monotonic()
        deadline_s = args.deadline or self.scale["deadline"]
        self.deadline = self.started + deadline_s
        self.report = {
            "facts": machine_facts(base),
            "scale": "local dry run" if args.dry_run else "device",
            "mode": "gpu" if args.gpu else "cpu",
            "deadline_s": deadline_s,
            "steps": {},
            "step_seconds": {},
            "skipped": [],
            "not_run": {},
        }
        if args.gpu and not args.dry_run:
            self.report["estimates_s"] = self.scale["estimates"]
        log(f"facts: {self.report['facts']}")
        self.env = dict(os.environ)
        data = os.path.join(PREPARED, "data", "fashion-mnist")
        if os.path.isdir(data) and not os.path.isdir(FASHION_MNIST):
            self.env["SHMGRAD_FASHION_MNIST_DIR"] = data

    # -- bookkeeping ---------------------------------------------------------------------
    def budget(self, step_timeout):
        """A step's timeout within the run's deadline; 0 when too little is left."""
        left = int(self.deadline - time.monotonic()) - DEADLINE_MARGIN_S
        return min(step_timeout, left) if left >= LEAST_STEP_S else 0

    def save(self):
        self.report["seconds"] = round(time.monotonic() - self.started, 1)
        write_report(self.report, self.out_dir)

    def step(self, name, body, unless=None, within_deadline=True):
        """Runs body(timeout) as step `name`: left out when --skip names it, recorded under
        not_run when `unless` gives a reason, skipped (and listed) when the deadline leaves
        too little time (unless not `within_deadline`: the build, which every other step
        needs, has its own timeout only). body returns the exit code, or None with
        not_run recorded."""
        if name in self.skip:
            return
        if unless:
            log(f"{name}: not run: {unless}")
            self.report["not_run"][name] = unless
            self.save()
            return
        timeout = self.scale[f"{name}_timeout"]
        if within_deadline:
            timeout = self.budget(timeout)
        if not timeout:
            log(f"{name}: skipped, too little time is left")
            self.report["skipped"].append(name)
            self.save()
            return
        t0 = time.monotonic()
        self.report["running"] = name  # what a run cut short was in
        self.save()
        code = body(timeout)
        del self.report["running"]
        if code is not None:
            self.report["steps"][name] = code
        self.report["step_seconds"][name] = round(time.monotonic() - t0, 1)
        self.save()

    def path(self, name):
        return os.path.join(self.out_dir, name)

    def refresher(self, into, key, path):
        """What run() calls while a step runs: the JSON it writes as it goes, into the
        report at into[key], and the report saved."""

        def refresh():
            into[key] = load_json(path)
            self.save()

        return refresh

    @property
    def built(self):
        return self.report["steps"].get("build", 0) == 0

    @property
    def has_gpu(self):
        return self.report["facts"].get("cuda_available") == "True"

    def why_not_built(self):
        return None if self.built else "the build failed (build.log)"

    # -- the steps -------------------------------------------------------------------------
    def build(self, timeout):
        if not self.args.gpu:
            install_wheels(self.python, self.args.dry_run)  # the CPU tests use Dask
        code = build_shmgrad(self.python, self.out_dir, self.args.dry_run, timeout)
        if code == 0:
            self.report["build_info"] = installed_build_info(self.python)
        return code

    def tests(self, timeout):
        outcomes = self.path("tests.jsonl")
        if os.path.exists(outcomes):
            os.remove(outcomes)
        names = GPU_TESTS if self.args.gpu else self.scale["tests"]
        cmd = [self.python, "-m", "pytest", "-q", "-rfEs", "-p", "no:cacheprovider"]
        cmd += ["--outcomes-log", outcomes]
        cmd += [os.path.join(ROOT, "tests", "python", t) for t in names]
        env = dict(self.env)
        if self.args.gpu:
            cmd += ["-m", "gpu"]  # the fake-device half runs in CI
            if not self.args.dry_run:
                env[REQUIRE_GPU_VARIABLE] = "1"
        self.report["tests"] = {"require_gpu": env.get(REQUIRE_GPU_VARIABLE) == "1"}

        def refresh():
            self.report["tests"].update(read_outcomes(outcomes))
            self.save()

        code = run(
            cmd,
            timeout=timeout,
            cwd=os.path.join(ROOT, "tests", "python"),
            env=env,
            out=self.path("tests.log"),
            refresh=refresh,
        )
        self.report["tests"].update(read_outcomes(outcomes))
        return code

    def sharing_environment(self):
        """The sharing step's environment, and why it cannot run (or None). A dry run
        without a GPU shares the fake device."""
        if self.has_gpu:
            return dict(self.env), None
        if not self.args.dry_run:
            return None, "no GPU here (torch.cuda.is_available() is False)"
        lib = build_fake_device(self.out_dir)
        if lib is None:
            return None, "no GPU here, and the fake device did not build"
        return dict(self.env, SHMGRAD_CUDA_LIBRARY=lib, FAKE_CUDA_DEVICES="1"), None

    def sharing(self, name, key, env, timeout):
        """tools/gpu_probe.py --sharing as step `name`: its figures in report["sharing"][key]."""
        spec = self.scale["sharing"]
        result = self.path(f"{name}.json")
        sharing = self.report.setdefault("sharing", {})
        code = run(
            [
                self.python,
                os.path.join(ROOT, "tools", "gpu_probe.py"),
                result,
                f"--sharing={spec['workers']}",
                "--model",
                spec["model"],
                "--batch",
                str(spec["batch"]),
                "--steps",
                str(spec["steps"]),
            ],
            timeout=timeout,
            env=env,
            out=self.path(f"{name}.log"),
            refresh=self.refresher(sharing, key, result),
        )
        sharing[key] = load_json(result)
        return code

    def sharing_with_mps(self, binary, env, timeout):
        daemon = MpsDaemon(binary, env, self.out_dir)
        self.report["mps"] = daemon.facts
        try:
            why = daemon.start()
            if why:
                self.report["not_run"]["sharing-mps"] = why
                return None
            code = self.sharing("sharing-mps", "with_mps", daemon.env, timeout)
        finally:
            daemon.quit()
        error = self.report["sharing"]["with_mps"].get("one_process_error")
        if error:  # not one CUDA process ran: the machine's MPS, not the engine
            self.report["not_run"]["sharing-mps"] = f"the MPS daemon serves no client: {error}"
            return None
        return code

    def gpu_probe(self, timeout):
        if self.args.gpu:
            install_wheels(self.python, self.args.dry_run)  # Dask, for its baseline
        probe = self.path("gpu.json")
        code = run(
            [self.python, os.path.join(ROOT, "tools", "gpu_probe.py"), probe],
            timeout=timeout,
            env=self.env,
            out=self.path("gpu.log"),
            refresh=self.refresher(self.report, "gpu", probe),
        )
        self.report["gpu"] = load_json(probe)
        return code

    def collectives(self, timeout):
        c = self.scale["collectives"]
        return run(
            [self.python, "-m", "shmgrad_tools.bench", "--collectives"]
            + ["--ranks", c["ranks"], "--sizes", c["sizes"], "--repeats", str(c["repeats"])]
            + ["--budget", str(c["budget"]), "--warmup", str(c["warmup"])]
            + ["--timeout", str(c["timeout"]), "--out", self.path("collectives")],
            timeout=timeout,
            env=self.env,
            out=self.path("collectives.log"),
        )

    def bench(self, timeout):
        s = self.scale
        return run(
            [self.python, "-m", "shmgrad_tools.bench"]
            + ["--models", s["models"], "--batch-sizes", s["batch"], "--workers", s["workers"]]
            + ["--systems", "single,shmgrad,auto,ddp,ddp-shmgrad", "--repeats", str(s["repeats"])]
            + ["--warmup", str(s["warmup"]), "--budget", str(s["budget"])]
            + ["--out", self.path("bench")],
            timeout=timeout,
            env=self.env,
            out=self.path("bench.log"),
        )

    def loop(self, timeout):
        out = self.path("loop.json")
        code = run(
            [self.python, os.path.join(ROOT, "tools", "loop_bench.py"), *self.scale["loop"]]
            + ["--rounds", "1", "--timeout", str(max(30, timeout - 20)), "--json", out],
            timeout=timeout,
            env=self.env,
            out=self.path("loop.log"),
        )
        self.report["loop"] = load_json(out)
        return code

    def adaptive(self, timeout):
        self.report["adaptive"] = run_adaptive(
            self.python, self.scale, timeout, self.env, self.out_dir
        )
        # The example exits 1 when adaptive batches did not pay: a finding, not a failure.
        return 0 if self.report["adaptive"].get("exit") in (0, 1) else 1

    # -- the runs ----------------------------------------------------------------------------
    def run_cpu(self):
        """The CPU checks: the GPU's facts, the tests, the benchmark, the adaptive example,
        in the order of what a short lease must not miss."""
        self.step("build", self.build, within_deadline=False)
        no_gpu = None if self.has_gpu else "no GPU here (torch.cuda.is_available() is False)"
        self.step("gpu-probe", self.gpu_probe, unless=self.why_not_built() or no_gpu)
        self.step("tests", self.tests, unless=self.why_not_built())
        self.step("collectives", self.collectives, unless=self.why_not_built())
        self.step("bench", self.bench, unless=self.why_not_built())
        self.step("loop", self.loop, unless=self.why_not_built())
        self.step("adaptive", self.adaptive, unless=self.why_not_built())

    def run_gpu(self):
        """The GPU workers' checks: the tests first (what the GPU path has never shown),
        then workers sharing the GPU without and with MPS, then the seed's baselines."""
        self.step("build", self.build, within_deadline=False)
        self.step("tests", self.tests, unless=self.why_not_built())
        env, why = None, self.why_not_built()
        if why is None and not {"sharing", "sharing-mps"} <= self.skip:
            env, why = self.sharing_environment()
        self.step("sharing", lambda t: self.sharing("sharing", "without_mps", env, t), unless=why)
        binary = shutil.which(MPS_CONTROL, path=(env or self.env).get("PATH"))
        no_mps = None if binary else f"{MPS_CONTROL} is not on the PATH"
        self.step(
            "sharing-mps", lambda t: self.sharing_with_mps(binary, env, t), unless=why or no_mps
        )
        no_gpu = None if self.has_gpu else "no GPU here (torch.cuda.is_available() is False)"
        self.step("gpu-probe", self.gpu_probe, unless=self.why_not_built() or no_gpu)


def run_checks(args):
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, _stop_on_signal)
    checks = Checks(args)
    try:
        if args.gpu:
            checks.run_gpu()
        else:
            checks.run_cpu()
    finally:
        checks.save()
    report = checks.report
    log(f"report: {checks.path('report.md')} ({report['seconds']} s)")
    ok = report["steps"] and all(c == 0 for c in report["steps"].values())
    return 0 if ok and not report["skipped"] else 1


def write_report(report, out_dir):
    """report.json (replaced whole, so a reader never sees half of one) and report.md."""
    tmp = os.path.join(out_dir, "report.json.tmp")
    with open(tmp, "w") as f:
        json.dump(report, f, indent=2)
    os.replace(tmp, os.path.join(out_dir, "report.json"))
    lines = [
        f"# device-check ({report['scale']}, {report['mode']})",
        "",
        "```",
        json.dumps(report["facts"], indent=2),
        "```",
        "",
    ]
    lines += [
        f"- {step}: exit {code} ({report['step_seconds'].get(step, '?')} s)"
        for step, code in report["steps"].items()
    ]
    lines += [f"- {step}: not run: {why}" for step, why in report["not_run"].items()]
    if report.get("running"):
        lines.append(f"- cut short while running: {report['running']}")
    if report["skipped"]:
        lines.append(f"- skipped for want of time: {', '.join(report['skipped'])}")
    lines.append(
        f"- total: {report.get('seconds', '?')} s of the {report['deadline_s']} s deadline"
    )
    lines += tests_section(report.get("tests"))
    lines += sharing_section(report.get("sharing"), report.get("not_run", {}))
    if report.get("gpu"):
        lines += ["", "## The GPU", "", "```", json.dumps(report["gpu"], indent=2), "```"]
    table = os.path.join(out_dir, "collectives", "results.md")
    if os.path.exists(table):
        with open(table) as f:
            lines += ["", "## The shmgrad backend against gloo", "", f.read()]
    table = os.path.join(out_dir, "bench", "results.md")
    if os.path.exists(table):
        with open(table) as f:
            lines += ["", f.read()]
    loop = os.path.join(out_dir, "loop.log")
    if os.path.exists(loop):
        with open(loop) as f:
            text = f.read().strip()[-TAIL_CHARS:]
        lines += ["", "## Whole training loops (tools/loop_bench.py)", "", "```", text, "```"]
    if report.get("adaptive", {}).get("summary_text"):
        lines += [
            "",
            "## Adaptive batches, like for like",
            "",
            "```",
            report["adaptive"]["summary_text"],
            "```",
        ]
    with open(os.path.join(out_dir, "report.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


def tests_section(tests):
    if not tests or "counts" not in tests:
        return []
    counts = ", ".join(f"{n} {outcome}" for outcome, n in sorted(tests["counts"].items()))
    required = " (SHMGRAD_REQUIRE_GPU=1: a GPU case's skip is a failure)"
    lines = ["", "## Tests", "", counts + (required if tests.get("require_gpu") else "")]
    others = [c for c in tests["cases"] if c["outcome"] != "passed"]
    if others:
        lines += ["", "| outcome | case | s | reason |", "|---|---|---:|---|"]
        for c in others:
            reason = " ".join(c["reason"].split())[-300:].replace("|", "/")
            lines.append(f"| {c['outcome']} | `{c['nodeid']}` | {c['duration']} | {reason} |")
    return lines


def sharing_section(sharing, not_run):
    """Workers sharing one GPU, without and with MPS, side by side."""
    if not sharing:
        return []
    halves = [("without MPS", sharing.get("without_mps") or {})]
    halves.append(("with MPS", sharing.get("with_mps") or {}))
    first = halves[0][1] or halves[1][1]
    lines = [
        "",
        "## Workers sharing one GPU",
        "",
        f"{first.get('model')} at batch {first.get('batch')} on {first.get('device')}, "
        f"{first.get('steps')} timed gradients: ms per gradient (mean), against one "
        "process in the same run, the slowest worker's compute (median ms) and the device "
        "memory the engine's processes take (MiB).",
        "",
        "| | " + " | ".join(f"{h}: ms | x | compute | MiB" for h, _ in halves) + " |",
        "|---|" + "---:|---:|---:|---:|" * len(halves),
    ]
    row = ["one process"]
    for _, half in halves:
        row += [str(half.get("one_process_ms", "-")), "1.00" if half else "-", "", ""]
    lines.append("| " + " | ".join(row) + " |")
    counts = list(dict.fromkeys(k for _, h in halves for k in h.get("workers", {})))
    errors = []
    for n in counts:
        row = [f"{n} worker{'s' if n != '1' else ''}"]
        for name, half in halves:
            run_ = half.get("workers", {}).get(n, {})
            if "error" in run_:
                errors.append(f"- {n} workers {name}: {run_['error']}")
            row += [
                str(run_.get(k, "-"))
                for k in ("ms", "vs_one_process", "slowest_worker_compute_ms", "engine_device_mib")
            ]
        lines.append("| " + " | ".join(row) + " |")
    if errors:
        lines += [""] + errors
    if "sharing-mps" in not_run:
        lines += ["", f"MPS: not run: {not_run['sharing-mps']}"]
    return lines


def run_adaptive(python, scale, timeout, env, out_dir):
    """examples/adaptive_batch.py, shortened: its exit status, summary and the lines it printed."""
    result_path = os.path.join(out_dir, "adaptive.json")
    log_path = os.path.join(out_dir, "adaptive.log")
    code = run(
        [
            python,
            os.path.join(ROOT, "examples", "adaptive_batch.py"),
            *scale["adaptive"],
            "--json",
            result_path,
        ],
        timeout=timeout,
        env=env,
        out=log_path,
    )
    result = {"exit": code, "args": scale["adaptive"]}
    if os.path.exists(result_path):
        with open(result_path) as f:
            result["summary"] = json.load(f)["summary"]
    with open(log_path) as f:
        text = f.read()
    start = text.find("\nrun ")
    result["summary_text"] = text[start + 1 :].rstrip() if start >= 0 else ""
    return result


def main():
    ap = argparse.ArgumentParser(
        prog="tools/device-check",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--run", action="store_true", help="run the checks (on the GPU machine)")
    ap.add_argument(
        "--dry-run",
        action="store_true",
        help="with --run: here, against .venv, scaled to this machine",
    )
    ap.add_argument(
        "--gpu",
        action="store_true",
        help="the GPU workers' checks instead of the CPU ones: the GPU cases of "
        "test_gpu.py and test_gpu_workers.py (a skip fails them), workers sharing the GPU "
        "without and with MPS, the seed case's baselines",
    )
    ap.add_argument("--out", default="device-check-out", help="the report's folder (--run)")
    ap.add_argument("--python", default=None, help="the interpreter to build against")
    ap.add_argument(
        "--deadline",
        type=int,
        default=None,
        help="seconds for the whole run (device 470, with --gpu 450, dry run 900); later "
        "steps are skipped",
    )
    ap.add_argument(
        "--skip",
        default="",
        help="steps to leave out, comma-separated: build (use the installed shmgrad), "
        "gpu-probe, tests, collectives, bench, adaptive; with --gpu: sharing, sharing-mps",
    )
    args = ap.parse_args()
    if args.run:
        return run_checks(args)
    prepare(args.python or sys.executable)
    return 0


if __name__ == "__main__":
    sys.exit(main())
