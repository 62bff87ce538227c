"""What a lent GPU machine offers the GPU design (issue 21), measured by tools/device-check.

  gpu_probe.py OUT [--shmgrad=1,2,4]
      The machine (needs torch only, not shmgrad's extension): the device, CUDA and NCCL
      versions; whether CUDA IPC works between two processes started with spawn (a tensor
      handed over through torch.multiprocessing, incremented by the child, seen by the
      parent); and the seed case's baselines on the GPU: Wide-ResNet-16-4 at batch 128 on
      CIFAR-sized inputs as one process, with a deep copy of the model per gradient (what a
      task scheduler does), with a pickle round trip per gradient (what a process-based
      scheduler pays at least), and through Dask (threads, a deep copy per task); with
      --shmgrad=1,2,4 also through shmgrad's GPU workers, all in one run.
  gpu_probe.py OUT --sharing=1,2,4 [--model wrn --batch 128 --steps 20]
      Workers sharing one GPU: the seed case as one process, then through shmgrad with 1,
      2 and 4 workers on cuda:0 (TorchScript workers, the batch given from host memory as
      a user's loader gives it): per gradient the mean and median ms, the slowest worker's
      compute, the engine's start and the device memory its processes take. Under MPS when
      the environment names a running daemon's pipes (CUDA_MPS_PIPE_DIRECTORY: every
      process of the run, engine included, is then its client); tools/device-check runs it
      without and with one. A configuration that fails is recorded (exit 1). On the fake
      device (SHMGRAD_CUDA_LIBRARY, no GPU: tools/device-check --dry-run) the one process
      runs on the CPU.

Writes JSON to OUT after each measurement (a run cut short keeps what ran) and prints it
at the end.
"""

import argparse
import copy
import gc
import json
import os
import sys
import time

import torch
import torch.multiprocessing as mp
import torch.nn.functional as F

# The installed shmgrad and shmgrad_tools first: the checkout's python/ has no built
# extension (pip installs it elsewhere), so it comes last, for a torch-only probe.
sys.path.append(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))

BATCH = 128
STEPS = 20
WARMUP_STEPS = 3  # TorchScript's profiling executor optimises a graph after two runs
IPC_TIMEOUT_S = 120
IPC_JOIN_S = 30
DASK_TASK_TIMEOUT_S = 120
# An engine's start (every worker loads libtorch_cuda and creates a CUDA context) and one
# gradient, bounded well inside tools/device-check's step timeouts.
ENGINE_START_TIMEOUT_S = 60
GRADIENT_TIMEOUT_S = 30
ERROR_CHARS = 2000


def _ipc_child(handoff, done):
    t = handoff.get(timeout=IPC_TIMEOUT_S)
    t.add_(1)
    torch.cuda.synchronize()
    done.put(float(t.sum()))


def ipc_check():
    ctx = mp.get_context("spawn")
    handoff, done = ctx.Queue(), ctx.Queue()
    child = ctx.Process(target=_ipc_child, args=(handoff, done))
    started = time.perf_counter()
    child.start()
    t = torch.zeros(1 << 20, device="cuda")
    handoff.put(t)
    try:
        seen_by_child = done.get(timeout=IPC_TIMEOUT_S)
    except Exception as e:  # noqa: BLE001 - report whatever broke
        child.kill()
        return {"ok": False, "error": repr(e)}
    child.join(IPC_JOIN_S)
    torch.cuda.synchronize()
    return {
        "ok": seen_by_child == float(1 << 20) and float(t.sum()) == float(1 << 20),
        "seconds_with_child_start": round(time.perf_counter() - started, 2),
    }


def _synchronize():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed_ms(fn, steps, warmup):
    for _ in range(warmup):
        fn()
    _synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        fn()
    _synchronize()
    return (time.perf_counter() - t0) / steps * 1e3


def seed_batch(batch=BATCH, model_name="wrn"):
    """A batch for the model: the seed case's CIFAR-shaped inputs for "wrn"."""
    from shmgrad_tools.bench.models import MODELS

    g = torch.Generator().manual_seed(0)
    x = torch.randn((batch,) + MODELS[model_name].input_shape, generator=g)
    y = torch.randint(0, 10, (batch,), generator=g)
    return x, y


def seed_case(steps):
    from shmgrad_tools.bench.models import make_model

    dev = torch.device("cuda")
    model = make_model("wrn").to(dev)
    x, y = (t.to(dev) for t in seed_batch())

    def grad_of(m):
        m.zero_grad(set_to_none=True)
        F.cross_entropy(m(x), y, reduction="sum").backward()
        return [p.grad for p in m.parameters()]

    def pickled(m):
        import cloudpickle

        return cloudpickle.loads(cloudpickle.dumps(m))

    res = {
        "one_process_ms": timed_ms(lambda: grad_of(model), steps, WARMUP_STEPS),
        "deepcopy_per_gradient_ms": timed_ms(lambda: grad_of(copy.deepcopy(model)), steps, 2),
        "deepcopy_only_ms": timed_ms(lambda: copy.deepcopy(model), steps, 2),
        "pickle_round_trip_per_gradient_ms": timed_ms(lambda: grad_of(pickled(model)), steps, 2),
    }
    try:
        from distributed import Client, LocalCluster

        with (
            LocalCluster(
                n_workers=1, threads_per_worker=1, processes=False, dashboard_address=None
            ) as cluster,
            Client(cluster) as client,
        ):

            def task(m):
                return len(grad_of(copy.deepcopy(m)))

            def dask_step():
                client.submit(task, model, pure=False).result(timeout=DASK_TASK_TIMEOUT_S)

            res["dask_threads_deepcopy_per_task_ms"] = timed_ms(dask_step, steps, 2)
    except Exception as e:  # noqa: BLE001 - a missing or broken Dask is a finding
        res["dask_error"] = repr(e)
    base = res["one_process_ms"]
    res["ratios_to_one_process"] = {
        k: round(v / base, 2) for k, v in res.items() if k.endswith("_ms") and k != "one_process_ms"
    }
    return {k: (round(v, 2) if isinstance(v, float) else v) for k, v in res.items()}


def _free_device_bytes():
    """cuda:0's free memory after torch's cache gave back what this process holds unused;
    None on the fake device."""
    if not torch.cuda.is_available():
        return None
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return torch.cuda.mem_get_info(0)[0]


def _median(values):
    s = sorted(values)
    return (s[(len(s) - 1) // 2] + s[len(s) // 2]) / 2


def one_process_ms(model_name, x, y, steps):
    """The seed case's gradient in this process, on cuda:0 (on the CPU without a GPU)."""
    from shmgrad_tools.bench.models import make_model

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = make_model(model_name).to(dev)
    x, y = x.to(dev), y.to(dev)

    def step():
        model.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y, reduction="sum").backward()

    return timed_ms(step, steps, WARMUP_STEPS)


def shmgrad_on_one_gpu(model_name, workers, x, y, steps):
    """One engine with `workers` TorchScript workers on cuda:0: its figures."""
    import shmgrad
    from shmgrad_tools.bench.models import make_model

    model = make_model(model_name)
    free_before = _free_device_bytes()
    t0 = time.perf_counter()
    with shmgrad.Engine(
        model=model,
        workers=workers,
        loss="cross_entropy",
        devices=["cuda:0"],
        mode="script",
        startup_timeout=ENGINE_START_TIMEOUT_S,
    ) as engine:
        started_s = time.perf_counter() - t0
        engine.bind(model)
        for _ in range(WARMUP_STEPS):
            engine.gradient(inputs=x, targets=y, timeout=GRADIENT_TIMEOUT_S)
        walls, slowest = [], []
        for _ in range(steps):
            t = time.perf_counter()
            stats = engine.gradient(inputs=x, targets=y, timeout=GRADIENT_TIMEOUT_S)
            walls.append(time.perf_counter() - t)
            slowest.append(max(stats.compute_seconds))
        free_during = _free_device_bytes()
        res = {
            "ms": sum(walls) / len(walls) * 1e3,
            "median_ms": _median(walls) * 1e3,
            "slowest_worker_compute_ms": _median(slowest) * 1e3,
            "start_s": started_s,
            "devices": engine.status().devices,
        }
    if free_before is not None:
        res["engine_device_mib"] = (free_before - free_during) / 2**20
    return {k: (round(v, 2) if isinstance(v, float) else v) for k, v in res.items()}


def sharing(out, workers_list, model_name, batch, steps):
    """The seed case through 1, 2, 4 ... workers sharing cuda:0, beside one process."""
    on_gpu = torch.cuda.is_available()
    res = {
        "model": model_name,
        "batch": batch,
        "steps": steps,
        "device": torch.cuda.get_device_name(0) if on_gpu else "fake device (SHMGRAD_CUDA_LIBRARY)",
        "mps": bool(os.environ.get("CUDA_MPS_PIPE_DIRECTORY")),
        "one_process_ms": None,
        "workers": {},
    }
    x, y = seed_batch(batch, model_name)
    try:
        res["one_process_ms"] = round(one_process_ms(model_name, x, y, steps), 2)
    except Exception as e:  # noqa: BLE001 - under MPS: the daemon unusable, the finding
        res["one_process_error"] = repr(e)[:ERROR_CHARS]
        write(out, res)
        return 1
    write(out, res)
    failed = False
    for n in workers_list:
        try:
            run = shmgrad_on_one_gpu(model_name, n, x, y, steps)
            run["vs_one_process"] = round(run["ms"] / res["one_process_ms"], 2)
        except Exception as e:  # noqa: BLE001 - what broke is the finding
            run, failed = {"error": repr(e)[:ERROR_CHARS]}, True
        res["workers"][str(n)] = run
        write(out, res)
    return 1 if failed else 0


def shmgrad_seed_case(steps, workers_list):
    """--shmgrad: the seed case through shmgrad's GPU workers beside the baselines."""
    x, y = seed_batch()
    res = {}
    for n in workers_list:
        try:
            run = shmgrad_on_one_gpu("wrn", n, x, y, steps)
            res[f"shmgrad_{n}_workers_ms"] = run["ms"]
            res[f"shmgrad_{n}_workers_status"] = run["devices"]
        except Exception as e:  # noqa: BLE001 - what broke is the finding
            res[f"shmgrad_{n}_workers_error"] = repr(e)[:ERROR_CHARS]
    return res


def write(out, result):
    if out:
        with open(out + ".tmp", "w") as f:
            json.dump(result, f, indent=2)
            f.write("\n")
        os.replace(out + ".tmp", out)


def _workers(text):
    return [int(w) for w in text.split(",") if w]


def main(argv=None):
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("out", nargs="?", default=None, help="the JSON file to write")
    ap.add_argument("--shmgrad", type=_workers, default=[], help="worker counts, e.g. 1,2,4")
    ap.add_argument("--sharing", type=_workers, default=[], help="worker counts, e.g. 1,2,4")
    ap.add_argument("--model", default="wrn", help="with --sharing: a bench model (wrn, cnn)")
    ap.add_argument("--batch", type=int, default=BATCH, help="with --sharing")
    ap.add_argument("--steps", type=int, default=STEPS, help="timed gradients per measurement")
    args = ap.parse_args(argv)
    if args.sharing:
        code = sharing(args.out, args.sharing, args.model, args.batch, args.steps)
        if args.out:
            with open(args.out) as f:
                print(f.read())
        return code
    facts = {"cuda_available": torch.cuda.is_available(), "torch": torch.__version__}
    if not torch.cuda.is_available():
        print(json.dumps(facts))
        return 1
    props = torch.cuda.get_device_properties(0)
    facts.update(
        device=props.name,
        capability=f"{props.major}.{props.minor}",
        memory_gib=round(props.total_memory / 2**30, 1),
        multiprocessors=props.multi_processor_count,
        torch_cuda=torch.version.cuda,
        cudnn=torch.backends.cudnn.version(),
        nccl=".".join(map(str, torch.cuda.nccl.version())),
        allocator_conf=os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""),
    )
    write(args.out, facts)
    facts["ipc"] = ipc_check()
    write(args.out, facts)
    facts["seed_case_wrn_b128"] = case = seed_case(steps=args.steps)
    write(args.out, facts)
    if args.shmgrad:
        ours = shmgrad_seed_case(args.steps, args.shmgrad)
        base = case["one_process_ms"]
        for k, v in ours.items():
            case[k] = round(v, 2) if isinstance(v, float) else v
            if k.endswith("_ms"):
                case["ratios_to_one_process"][k] = round(v / base, 2)
        write(args.out, facts)
    print(json.dumps(facts, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
