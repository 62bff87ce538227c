"""What a lent GPU machine offers the GPU design (issue 21), measured by tools/device-check.

Needs torch only (not shmgrad's extension): the device, CUDA and NCCL versions; whether
CUDA IPC works between two processes started with spawn (a tensor handed over through
torch.multiprocessing, incremented by the child, seen by the parent); and the seed case's
baselines on the GPU: Wide-ResNet-16-4 at batch 128 on CIFAR-sized inputs as one process,
with a deep copy of the model per gradient (what a task scheduler does), with a pickle
round trip per gradient (what a process-based scheduler pays at least), and through Dask
(threads, a deep copy per task); with --shmgrad=1,2,4 also through shmgrad's GPU workers
(issue 21), all in one run. Writes JSON to the path given, prints it too.
"""

import copy
import json
import os
import sys
import time

import torch
import torch.multiprocessing as mp
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))

BATCH = 128


def _ipc_child(handoff, done):
    t = handoff.get(timeout=120)
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
        seen_by_child = done.get(timeout=120)
    except Exception as e:  # noqa: BLE001 - report whatever broke
        child.kill()
        return {"ok": False, "error": repr(e)}
    child.join(30)
    torch.cuda.synchronize()
    return {
        "ok": seen_by_child == float(1 << 20) and float(t.sum()) == float(1 << 20),
        "seconds_with_child_start": round(time.perf_counter() - started, 2),
    }


def timed_ms(fn, steps, warmup):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / steps * 1e3


def seed_case(steps):
    from shmgrad_tools.bench.models import make_model

    dev = torch.device("cuda")
    model = make_model("wrn").to(dev)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(BATCH, 3, 32, 32, generator=g).to(dev)
    y = torch.randint(0, 10, (BATCH,), generator=g).to(dev)

    def grad_of(m):
        m.zero_grad(set_to_none=True)
        F.cross_entropy(m(x), y, reduction="sum").backward()
        return [p.grad for p in m.parameters()]

    def pickled(m):
        import cloudpickle

        return cloudpickle.loads(cloudpickle.dumps(m))

    res = {
        "one_process_ms": timed_ms(lambda: grad_of(model), steps, 3),
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
                client.submit(task, model, pure=False).result(timeout=120)

            res["dask_threads_deepcopy_per_task_ms"] = timed_ms(dask_step, steps, 2)
    except Exception as e:  # noqa: BLE001 - a missing or broken Dask is a finding
        res["dask_error"] = repr(e)
    base = res["one_process_ms"]
    res["ratios_to_one_process"] = {
        k: round(v / base, 2) for k, v in res.items() if k.endswith("_ms") and k != "one_process_ms"
    }
    return {k: (round(v, 2) if isinstance(v, float) else v) for k, v in res.items()}


def shmgrad_seed_case(steps, workers_list):
    """The seed case through shmgrad's GPU workers on cuda:0 (TorchScript workers, the
    batch given from host memory as a user's loader gives it), 1, 2, 4 workers sharing the
    device; ratios against one process measured in the same run (seed_case)."""
    import shmgrad
    from shmgrad_tools.bench.models import make_model

    g = torch.Generator().manual_seed(0)
    x = torch.randn(BATCH, 3, 32, 32, generator=g)
    y = torch.randint(0, 10, (BATCH,), generator=g)
    res = {}
    for n in workers_list:
        model = make_model("wrn")
        try:
            with shmgrad.Engine(
                model=model, workers=n, loss="cross_entropy", devices=["cuda:0"], mode="script"
            ) as engine:
                engine.bind(model)

                def step():
                    engine.gradient(inputs=x, targets=y)

                res[f"shmgrad_{n}_workers_ms"] = timed_ms(step, steps, 2)
                res[f"shmgrad_{n}_workers_status"] = engine.status().devices
        except Exception as e:  # noqa: BLE001 - what broke is the finding
            res[f"shmgrad_{n}_workers_error"] = repr(e)[:2000]
    return res


def main():
    args = [a for a in sys.argv[1:] if not a.startswith("--shmgrad=")]
    shmgrad_workers = [
        int(w) for a in sys.argv[1:] if a.startswith("--shmgrad=") for w in a[10:].split(",")
    ]
    out = args[0] if args else None
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
    facts["ipc"] = ipc_check()
    steps = int(os.environ.get("GPU_PROBE_STEPS", "20"))
    facts["seed_case_wrn_b128"] = case = seed_case(steps=steps)
    if shmgrad_workers:
        ours = shmgrad_seed_case(steps, shmgrad_workers)
        base = case["one_process_ms"]
        for k, v in ours.items():
            case[k] = round(v, 2) if isinstance(v, float) else v
            if k.endswith("_ms"):
                case["ratios_to_one_process"][k] = round(v / base, 2)
    text = json.dumps(facts, indent=2)
    print(text)
    if out:
        with open(out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
