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
                               baselines on it), the build's and engine's tests, the CPU
                               scaling benchmark (CNN and WRN at batch 256: shmgrad with
                               1, 2, 4, 8 and 16 workers against DDP-gloo with as many
                               ranks and one process, in one run), then, if time is left,
                               examples/adaptive_batch.py shortened (like for like, one
                               worker per core); all within --deadline (470 s), skipping
                               what does not fit; report.md and the results go into DIR.
  --run --gpu --out DIR        the GPU workers' checks instead (issue 21): the build,
                               tests/python/test_gpu.py and test_gpu_workers.py (their
                               GPU cases: exactness against one process for 1, 2 and 4
                               workers on the device, eager BatchNorm with a random
                               dataset, 20 optimizer steps, a SIGKILLed worker retried,
                               nothing left on the device or in /dev/shm), and the seed
                               case (WRN-16-4, batch 128) as one process, with a deep copy
                               per gradient, through Dask and through shmgrad with 1, 2
                               and 4 workers on the GPU, in one run, with ratios.
  --run --dry-run --out DIR    the same here, against .venv, scaled to this machine
                               (with --gpu, one test of test_gpu_workers.py: the suite
                               runs them all here on the fake device).
"""

import argparse
import datetime
import glob
import json
import os
import platform
import shutil
import subprocess
import sys
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
FASHION_MNIST = "/usr/share/datasets/fashion-mnist"

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
        "gpu_tests": ["test_gpu.py", "test_gpu_workers.py"],  # with --gpu
        "test_timeout": 120,
        "bench_timeout": 270,
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
        "probe_timeout": 60,
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
        # The suite runs all of test_gpu_workers.py here (on the fake device): one of them
        # shows that --gpu's step runs.
        "gpu_tests": [
            "test_gpu.py",
            "test_gpu_workers.py::test_eager_batchnorm_and_a_random_dataset_match_one_process",
        ],
        "test_timeout": 120,
        "bench_timeout": 300,
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
        "probe_timeout": 90,
        "deadline": 900,
    },
}


def log(msg):
    print(f"device-check [{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def run(cmd, *, timeout, cwd=ROOT, env=None, out=None):
    """Runs cmd, its output to the terminal and to `out` (a path) if given; the exit code."""
    log("$ " + " ".join(cmd))
    with open(out, "w") if out else open(os.devnull, "w") as sink:
        proc = subprocess.Popen(
            cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        deadline = time.monotonic() + timeout
        try:
            for line in proc.stdout:
                sys.stdout.write(line)
                sink.write(line)
                if time.monotonic() > deadline:
                    proc.kill()
                    log(f"timed out after {timeout} s")
                    break
        finally:
            try:
                code = proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                code = proc.wait()
    return code


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
        res = subprocess.run([cxx, "--version"], capture_output=True, text=True)
        facts["cxx"] = res.stdout.splitlines()[0] if res.stdout else cxx
    smi = shutil.which("nvidia-smi")
    if smi:
        out = subprocess.run(
            [smi, "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
        )
        facts["gpus"] = out.stdout.strip()
    return facts


def build_env(base_python, dry_run):
    """The machine's own interpreter, with the carried wheels installed into it.

    A venv over /opt/torch/.venv would not see its torch (that is itself a venv, and
    --system-site-packages reaches only the base interpreter's packages); the machine
    starts bare for every lease, so installing into its environment changes nothing lasting.
    """
    if dry_run:
        return base_python  # .venv already has everything
    wheels = os.path.join(PREPARED, "wheels")
    if os.path.isdir(wheels):
        run(
            [
                base_python,
                "-m",
                "pip",
                "install",
                "-q",
                "--no-index",
                "--find-links",
                wheels,
                *DEVICE_WHEELS,
            ],
            timeout=300,
        )
    return base_python


def build_shmgrad(python, out_dir, dry_run):
    import_torch = subprocess.run(
        [python, "-c", "import torch;print(torch.__version__)"],
        capture_output=True,
        text=True,
        check=True,
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
    return run(cmd + [ROOT], timeout=420, env=env, out=os.path.join(out_dir, "build.log"))


def _libz():
    for d in ("/usr/lib/x86_64-linux-gnu", "/lib/x86_64-linux-gnu", "/usr/lib64", "/usr/lib"):
        for name in ("libz.so", "libz.so.1"):
            if os.path.exists(os.path.join(d, name)):
                return os.path.join(d, name)
    return None


def run_checks(args):
    scale = dict(SCALES["local" if args.dry_run else "device"])
    if args.gpu:
        # The GPU workers' checks (issue 21): their tests on both backends, then the seed
        # case through shmgrad on the GPU beside its baselines; the CPU benchmark and the
        # adaptive example are the other runs'.
        scale["tests"] = scale["gpu_tests"]
        scale["test_timeout"] = 240
        scale["probe_args"] = ["--shmgrad=1,2,4"]
        scale["probe_timeout"] = 150
        args.skip = ",".join(filter(None, [args.skip, "bench", "adaptive"]))
    out_dir = os.path.abspath(args.out)
    os.makedirs(out_dir, exist_ok=True)
    base = args.python or (
        os.path.join(ROOT, ".venv", "bin", "python") if args.dry_run else DEVICE_PYTHON
    )
    started = time.monotonic()
    deadline = started + (args.deadline or scale["deadline"])
    report = {
        "facts": machine_facts(base),
        "scale": "local dry run" if args.dry_run else "device",
        "steps": {},
    }
    log(f"facts: {report['facts']}")

    def budget(step_timeout):
        """A step's timeout within the run's deadline; 0 when too little is left."""
        left = int(deadline - time.monotonic()) - 5
        return min(step_timeout, left) if left >= 30 else 0

    def finish():
        report["seconds"] = round(time.monotonic() - started, 1)
        write_report(report, out_dir)

    python = build_env(base, args.dry_run)
    rc = build_shmgrad(python, out_dir, args.dry_run)
    report["steps"]["build"] = rc
    finish()
    env = dict(os.environ)
    data = os.path.join(PREPARED, "data", "fashion-mnist")
    if os.path.isdir(data) and not os.path.isdir(FASHION_MNIST):
        env["SHMGRAD_FASHION_MNIST_DIR"] = data
    # In the order of what a short lease must not miss: the GPU's facts, the tests, the
    # benchmark, the adaptive example (with --gpu the tests first: they are what the GPU
    # path has never shown). A step the deadline leaves no time for is skipped.
    skip = set(args.skip.split(",")) if args.skip else set()

    def probe_step():
        if (
            "gpu-probe" in skip
            or report["facts"].get("cuda_available") != "True"
            or not budget(scale["probe_timeout"])
        ):
            return
        probe = os.path.join(out_dir, "gpu.json")
        report["steps"]["gpu-probe"] = run(
            [python, os.path.join(ROOT, "tools", "gpu_probe.py"), probe]
            + scale.get("probe_args", []),
            timeout=budget(scale["probe_timeout"]),
            env=env,
            out=os.path.join(out_dir, "gpu.log"),
        )
        if os.path.exists(probe):
            with open(probe) as f:
                report["gpu"] = json.load(f)
        finish()

    def tests_step():
        if rc != 0 or "tests" in skip or not budget(scale["test_timeout"]):
            return
        tests = [os.path.join(ROOT, "tests", "python", t) for t in scale["tests"]]
        report["steps"]["tests"] = run(
            [python, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", *tests],
            timeout=budget(scale["test_timeout"]),
            cwd=os.path.join(ROOT, "tests", "python"),
            env=env,
            out=os.path.join(out_dir, "tests.log"),
        )
        finish()

    for step in (tests_step, probe_step) if args.gpu else (probe_step, tests_step):
        step()
    if rc == 0 and "bench" not in skip and budget(scale["bench_timeout"]):
        bench_out = os.path.join(out_dir, "bench")
        report["steps"]["bench"] = run(
            [
                python,
                "-m",
                "shmgrad_tools.bench",
                "--models",
                scale["models"],
                "--batch-sizes",
                scale["batch"],
                "--workers",
                scale["workers"],
                "--systems",
                "single,shmgrad,ddp",
                "--repeats",
                str(scale["repeats"]),
                "--warmup",
                str(scale["warmup"]),
                "--budget",
                str(scale["budget"]),
                "--out",
                bench_out,
            ],
            timeout=budget(scale["bench_timeout"]),
            env=env,
            out=os.path.join(out_dir, "bench.log"),
        )
        finish()
    if rc == 0 and "adaptive" not in skip and budget(scale["adaptive_timeout"]):
        report["adaptive"] = run_adaptive(
            python, scale, budget(scale["adaptive_timeout"]), env, out_dir
        )
        # The example exits 1 when adaptive batches did not pay: a finding, not a failure.
        report["steps"]["adaptive"] = 0 if report["adaptive"].get("exit") in (0, 1) else 1
    skipped = [
        s for s in ("bench", "tests", "adaptive") if s not in report["steps"] and s not in skip
    ]
    if skipped:
        report["skipped"] = skipped
    finish()
    log(f"report: {os.path.join(out_dir, 'report.md')} ({report['seconds']} s)")
    ok = report["steps"] and all(c == 0 for c in report["steps"].values()) and not skipped
    return 0 if ok else 1


def write_report(report, out_dir):
    with open(os.path.join(out_dir, "report.json"), "w") as f:
        json.dump(report, f, indent=2)
    lines = [
        f"# device-check ({report['scale']})",
        "",
        "```",
        json.dumps(report["facts"], indent=2),
        "```",
        "",
    ]
    lines += [f"- {step}: exit {code}" for step, code in report["steps"].items()]
    if report.get("skipped"):
        lines.append(f"- skipped for want of time: {', '.join(report['skipped'])}")
    lines.append(f"- total: {report['seconds']} s")
    if report.get("gpu"):
        lines += ["", "## The GPU", "", "```", json.dumps(report["gpu"], indent=2), "```"]
    table = os.path.join(out_dir, "bench", "results.md")
    if os.path.exists(table):
        lines += ["", open(table).read()]
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
        help="the GPU workers' checks instead of the CPU ones: the GPU tests "
        "(test_gpu.py, test_gpu_workers.py) and the seed case through shmgrad on the GPU",
    )
    ap.add_argument("--out", default="device-check-out", help="the report's folder (--run)")
    ap.add_argument("--python", default=None, help="the interpreter to build against")
    ap.add_argument(
        "--deadline",
        type=int,
        default=None,
        help="seconds for the whole run (device 470, dry run 900); later steps are skipped",
    )
    ap.add_argument(
        "--skip",
        default="",
        help="steps to leave out, comma-separated: gpu-probe, bench, tests, adaptive",
    )
    args = ap.parse_args()
    if args.run:
        return run_checks(args)
    prepare(args.python or sys.executable)
    return 0


if __name__ == "__main__":
    sys.exit(main())
