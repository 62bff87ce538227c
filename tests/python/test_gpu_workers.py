"""GPU workers end to end, on two backends:

- ``fake``, everywhere: the fake device library (tests/fake_cuda.cc, compiled here) stands
  in for libshmgrad_cuda.so. Its "device" allocations are host memory, so tensors over
  them are CPU tensors; everything else is the path a GPU engine takes: the coordinator
  allocates each device's buffers and publishes their IPC handles, workers open them,
  compute with their device's parameters into their slot there, the library reduces the
  slots into the first device's reduced gradient, the trainer's parameters and .grad are
  that memory, and the other devices' parameters are brought up to date before each step.
- ``cuda``, where a GPU is (tools/device-check --gpu): the same tests against the real
  library and device, marked ``gpu``: skipped with the reason elsewhere, failed instead
  under SHMGRAD_REQUIRE_GPU=1 (conftest.py), except a case that needs more GPUs than the
  machine has. TF32 is turned off in every process (NVIDIA_TF32_OVERRIDE=0), so results
  are float32 up to summation order.
"""

import contextlib
import datetime
import gc
import os
import time

import pytest
import torch

import shmgrad
from shmgrad import _gpu, errors

from conftest import (
    Cnn,
    fake_allocations,
    reference_gradient,
    relative_error,
    skip_for_fewer_gpus,
)
from helpers import STEP_TIMEOUT_S, GradientCall, wait_for, wait_until_busy

# After a GPU case, the device's free memory is back to what it was before, within what
# this process's own CUDA context may take meanwhile (an NCCL communicator's leftovers):
# far less than a worker's context (hundreds of MiB) or the engine's buffers.
DEVICE_MEMORY_SLACK_BYTES = 64 << 20
DEVICE_MEMORY_RETURN_S = 10  # for the engine's processes to exit and the driver to free
DEVICE_MEMORY_POLL_S = 0.1


def _warm_up_device_libraries():
    """cuBLAS and cuDNN create their handles and workspaces in this process on first use
    (tens to hundreds of MiB, kept to its end): done before the first measurement, a
    test's own reference, training or eval on the GPU cannot look like a leak."""
    for d in range(torch.cuda.device_count()):
        with torch.cuda.device(d):
            x = torch.randn(8, 1, 12, 12, device="cuda", requires_grad=True)
            for m in (Cnn(), BnCnn()):
                out = m.cuda()(x)
                (out @ out.T).sum().backward()
            torch.cuda.synchronize()


def _free_device_bytes():
    """Each GPU's free memory, after torch's caching allocator gave back what it holds
    unused (blocks of tensors this process freed count as free)."""
    gc.collect()
    for d in range(torch.cuda.device_count()):
        torch.cuda.synchronize(d)
    torch.cuda.empty_cache()
    return [torch.cuda.mem_get_info(d)[0] for d in range(torch.cuda.device_count())]


@pytest.fixture(params=["fake", pytest.param("cuda", marks=pytest.mark.gpu)])
def backend(request, monkeypatch):
    """Sets the engines' environment for the backend; after the test, nothing is left in
    /dev/shm, and on a GPU its free memory is back to what it was."""
    violations = None
    if request.param == "fake":
        monkeypatch.setenv("SHMGRAD_CUDA_LIBRARY", request.getfixturevalue("fake_cuda_library"))
        monkeypatch.setenv("FAKE_CUDA_DEVICES", "2")
        # Where the fake device writes what CUDA leaves undefined (a free of memory that
        # another process still maps): nothing, after any test that does not ask for it.
        violations = request.getfixturevalue("tmp_path") / "fake-cuda-violations"
        monkeypatch.setenv("FAKE_CUDA_VIOLATIONS", str(violations))
        count, free = 2, None
    else:
        monkeypatch.delenv("SHMGRAD_CUDA_LIBRARY", raising=False)
        try:
            count = _gpu.device_count()
        except errors.InvalidArgumentError as exc:
            pytest.skip(f"no GPU here: {exc}")
        monkeypatch.setenv("NVIDIA_TF32_OVERRIDE", "0")
        torch.backends.cudnn.allow_tf32 = False
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.cuda.init()
        _warm_up_device_libraries()
        free = _free_device_bytes()
    before = fake_allocations()
    yield request.param, count
    left = fake_allocations() - before
    assert not left, f"device allocations left behind: {sorted(left)}"
    if violations is not None and violations.exists():
        assert not violations.read_text(), violations.read_text()
    if free is not None:
        # The coordinator frees its allocations at stop and the workers' contexts go with
        # them: free memory comes back.
        deadline = time.monotonic() + DEVICE_MEMORY_RETURN_S
        while any(a < b - DEVICE_MEMORY_SLACK_BYTES for a, b in zip(_free_device_bytes(), free)):
            assert time.monotonic() < deadline, (free, _free_device_bytes())
            time.sleep(DEVICE_MEMORY_POLL_S)


def _needs(backend, devices):
    if backend[1] < len(devices):
        skip_for_fewer_gpus(len(devices), backend[1])


def _cpu(tensors):
    return [t.detach().cpu() for t in tensors]


@contextlib.contextmanager
def _one_rank_group(group_backend):
    """torch.distributed initialised in this process as a group of one rank; yields the
    module, destroys the group after."""
    import torch.distributed as dist
    from helpers import free_port

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group(
        group_backend,
        init_method=f"tcp://127.0.0.1:{free_port()}",
        rank=0,
        world_size=1,
        timeout=datetime.timedelta(seconds=60),
    )
    try:
        yield dist
    finally:
        dist.destroy_process_group()


class BnCnn(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(1, 4, 3)
        self.bn = torch.nn.BatchNorm2d(4)
        self.fc = torch.nn.Linear(4 * 10 * 10, 5)

    def forward(self, x):
        return self.fc(torch.flatten(torch.relu(self.bn(self.conv(x))), 1))


class SleepyCnn(Cnn):
    """Forward sleeps 0.3 s: a step is busy long enough, on any device, to kill a worker
    in the middle of it (eager workers only)."""

    def forward(self, x):
        time.sleep(0.3)
        return super().forward(x)


PLACEMENTS = [
    (["cuda:0"], 1),
    (["cuda:0"], 2),
    (["cuda:0"], 4),
    (["cuda:1", "cuda:0"], 2),
    (["cuda:0", "cuda:1"], 3),
]


@pytest.mark.parametrize("mode", ["eager", "script"])
@pytest.mark.parametrize("devices,workers", PLACEMENTS)
def test_gradients_and_training_match_one_process(backend, devices, workers, mode):
    _needs(backend, devices)
    torch.manual_seed(4)
    model = Cnn()
    ref = Cnn()
    ref.load_state_dict(model.state_dict())
    x, y = torch.randn(90, 1, 12, 12), torch.randint(0, 5, (90,))
    with shmgrad.Engine(
        model=model, workers=workers, loss="cross_entropy", devices=devices, mode=mode
    ) as engine:
        engine.bind(model)
        status = engine.status()
        placed = [devices[i % len(devices)] for i in range(workers)]  # round-robin
        assert [w.device for w in status.workers] == placed
        assert status.devices == ",".join(devices)
        param_bytes = sum(p.numel() for p in model.parameters()) * 4
        assert status.param_sync_bytes >= param_bytes * (len(devices) - 1)
        assert (status.param_sync_bytes > 0) == (len(devices) > 1)
        assert f"restarts 0, {placed[0]}" in status.text
        on_gpu = backend[0] == "cuda"
        assert all(p.is_cuda == on_gpu for p in model.parameters())
        for b in (1, 7, 90):
            engine.gradient(inputs=x[:b], targets=y[:b])
            expected = reference_gradient(ref, "cross_entropy", x[:b], y[:b])
            assert relative_error(_cpu(p.grad for p in model.parameters()), expected) < 1e-5, b
        if on_gpu:  # a batch already on the device is taken as it is
            engine.gradient(inputs=x.cuda(), targets=y.cuda())
            expected = reference_gradient(ref, "cross_entropy", x, y)
            assert relative_error(_cpu(p.grad for p in model.parameters()), expected) < 1e-5
        # Training: the optimizer steps the first device's parameters; workers on the
        # other device compute with them after the engine brings their copy up to date.
        # Through a GradScaler on the trainer's device (a power of two that does not
        # overflow: the same steps as plain float32 PyTorch's without one).
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        scaler = torch.amp.GradScaler("cuda" if on_gpu else "cpu", init_scale=2.0**10)
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
        g = torch.Generator().manual_seed(1)
        for _ in range(20):
            idx = torch.randint(0, 90, (24,), generator=g)
            opt.zero_grad()
            stats = engine.gradient(
                inputs=x[idx], targets=y[idx], reduction="mean", loss_scale=scaler
            )
            assert (stats.param_sync_seconds > 0) == (len(devices) > 1)
            scaler.step(opt)
            scaler.update()
            ref_opt.zero_grad()
            torch.nn.functional.cross_entropy(ref(x[idx]), y[idx]).backward()
            ref_opt.step()
        assert relative_error(_cpu(model.parameters()), list(ref.parameters())) < 1e-4
        assert scaler.get_scale() == 2.0**10  # no step skipped
    # The engine is gone: the module keeps its trained parameters (on a GPU engine, its
    # own copies on the device, made when the trainer closed) and still computes.
    assert relative_error(_cpu(model.parameters()), list(ref.parameters())) < 1e-4
    assert all(p.is_cuda == on_gpu for p in model.parameters())
    device = next(model.parameters()).device
    with torch.no_grad():
        assert model(x[:3].to(device)).shape == (3, 5)


def test_resizing_places_new_workers_round_robin_from_the_trainers_device(backend):
    devices = ["cuda:0", "cuda:1"] if backend[1] >= 2 else ["cuda:0"]
    trainer = devices[-1]
    order = [trainer] + [d for d in devices if d != trainer]  # the trainer's first
    torch.manual_seed(6)
    model, twin = Cnn(), Cnn()
    twin.load_state_dict(model.state_dict())
    x, y = torch.randn(60, 1, 12, 12), torch.randint(0, 5, (60,))
    with shmgrad.Engine(
        model=model,
        workers=2,
        max_workers=4,
        loss="cross_entropy",
        devices=devices,
        trainer_device=trainer,
    ) as engine:
        engine.bind(model)
        assert engine.status().devices == ",".join(order)
        if backend[0] == "cuda":
            assert all(p.device == torch.device(trainer) for p in model.parameters())
        for n in (4, 1, 3):
            engine.resize(n)
            ready = engine.status().ready_workers
            assert len(ready) == n
            assert [w.device for w in ready] == [order[w.slot % len(order)] for w in ready]
            stats = engine.gradient(inputs=x, targets=y)
            assert stats.workers == n
            expected = reference_gradient(twin, "cross_entropy", x, y)
            assert relative_error(_cpu(p.grad for p in model.parameters()), expected) < 1e-5


@pytest.mark.parametrize("devices", [["cuda:0"], ["cuda:0", "cuda:1"]])
def test_eager_batchnorm_and_a_random_dataset_match_one_process(backend, devices):
    """An eager model with BatchNorm over a dataset that augments at random: each worker
    normalises its shard with the shard's statistics (as DDP does), so the reference is
    one process computing each shard from the same draws, and the shared statistics
    afterwards are the shards' average."""
    _needs(backend, devices)
    torch.manual_seed(8)
    data = torch.randn(64, 1, 12, 12)
    labels = torch.randint(0, 5, (64,))

    class Noisy(torch.utils.data.Dataset):
        def __len__(self):
            return len(data)

        def __getitem__(self, i):
            return data[i] + 0.1 * torch.randn(1, 12, 12), labels[i]

    model = BnCnn()
    start = BnCnn()
    start.load_state_dict(model.state_dict())
    with shmgrad.Engine(
        model=model,
        workers=2,
        loss="cross_entropy",
        dataset=Noisy(),
        mode="eager",
        devices=devices,
    ) as engine:
        engine.bind(model)
        idx = list(range(0, 64, 2))  # 32 examples: 16 a worker
        engine.gradient(idx, seed=11)
        x, y = shmgrad.example_batch(Noisy(), idx, 11)
        grads, means = None, []
        for half in (slice(0, 16), slice(16, 32)):
            ref = BnCnn()
            ref.load_state_dict(start.state_dict())
            torch.nn.functional.cross_entropy(ref(x[half]), y[half], reduction="sum").backward()
            g = [p.grad for p in ref.parameters()]
            grads = g if grads is None else [a + b for a, b in zip(grads, g)]
            means.append(ref.bn.running_mean.clone())
        assert relative_error(_cpu(p.grad for p in model.parameters()), grads) < 1e-5
        assert relative_error(model.bn.running_mean.cpu(), (means[0] + means[1]) / 2) < 1e-5
        # The trainer's module evaluates where its parameters are, with those statistics.
        device = next(model.parameters()).device
        assert model.bn.running_mean.device == device
        model.eval()
        with torch.no_grad():
            assert model(x.to(device)).shape == (32, 5)


@pytest.mark.parametrize("devices", [["cuda:0"], ["cuda:0", "cuda:1"]])
def test_worker_killed_mid_step_on_a_device_is_rerun_exactly(backend, devices):
    """A worker (the last device's) SIGKILLed while it computes: the step is aborted and
    re-run with its replacement, which opens the device's buffers again, exactly."""
    _needs(backend, devices)
    torch.manual_seed(1)
    model, twin = SleepyCnn(), SleepyCnn()  # the twin stays on the CPU: the reference
    twin.load_state_dict(model.state_dict())
    x, y = torch.randn(48, 1, 12, 12), torch.randint(0, 5, (48,))
    ref = reference_gradient(twin, "cross_entropy", x, y)
    with shmgrad.Engine(
        model=model, workers=3, loss="cross_entropy", devices=devices, mode="eager"
    ) as engine:
        engine.bind(model)
        engine.gradient(inputs=x[:8], targets=y[:8])  # warm up
        before = engine.status()
        slot = len(devices) - 1  # round-robin: slot 1 is cuda:1's
        call = GradientCall(engine, inputs=x, targets=y, timeout=STEP_TIMEOUT_S)
        try:
            wait_until_busy(engine.name, slot=slot, after_epoch=before.step_epoch)
            os.kill(before.worker(slot).pid, 9)
        finally:
            call.join()
        stats = call.result()
        assert stats.retries == 1
        assert relative_error(_cpu(p.grad for p in model.parameters()), ref) < 1e-5
        wait_for(
            lambda: engine.status().worker(slot).restarts == before.worker(slot).restarts + 1,
            10,
            f"worker {slot}'s restart to be counted",
        )
        assert engine.status().worker(slot).device == devices[slot % len(devices)]
        stats = engine.gradient(inputs=x[:16], targets=y[:16])
        assert stats.num_examples == 16 and stats.retries == 0
        expected = reference_gradient(twin, "cross_entropy", x[:16], y[:16])
        assert relative_error(_cpu(p.grad for p in model.parameters()), expected) < 1e-5


def test_a_node_group_all_reduces_with_the_backend_of_its_engine(backend):
    """Across nodes a GPU engine's gradient is all-reduced by NCCL on its device, a host
    one's by gloo. Here one node (world size 1: NCCL allows one rank per GPU, and a test
    has one GPU at most), in this process: the node group's layout check, broadcasts,
    all-reduce of gradient and record, buffers and checksum, with the backend's tensors
    on the engine's device; the gradient is the engine's own."""
    with _one_rank_group("nccl" if backend[0] == "cuda" else "gloo") as dist:
        torch.manual_seed(12)
        model, twin = BnCnn(), BnCnn()
        twin.load_state_dict(model.state_dict())
        x, y = torch.randn(40, 1, 12, 12), torch.randint(0, 5, (40,))
        with shmgrad.Engine(
            model=model,
            workers=2,
            loss="cross_entropy",
            devices=["cuda:0"],
            mode="eager",
            process_group=dist.group.WORLD,
        ) as engine:
            engine.bind(model)
            stats = engine.gradient(inputs=x, targets=y, reduction="mean")
            assert stats.nodes == 1 and stats.num_examples == 40
            grads = None
            for half in (slice(0, 20), slice(20, 40)):  # each worker's shard, its statistics
                ref = BnCnn()
                ref.load_state_dict(twin.state_dict())
                loss = torch.nn.functional.cross_entropy(ref(x[half]), y[half], reduction="sum")
                (loss / 40).backward()
                g = [p.grad for p in ref.parameters()]
                grads = g if grads is None else [a + b for a, b in zip(grads, g)]
            assert relative_error(_cpu(p.grad for p in model.parameters()), grads) < 1e-5
            assert isinstance(engine.check_consistency(), int)


def test_a_group_of_the_other_backend_is_refused_naming_the_right_one(monkeypatch):
    from shmgrad import multinode

    with _one_rank_group("gloo") as dist:
        world = dist.group.WORLD
        with pytest.raises(errors.InvalidArgumentError, match="use an nccl group"):
            multinode._check_process_group(world, torch.device("cuda", 0))
        assert multinode._check_process_group(world, torch.device("cpu")) is world
        monkeypatch.setattr(dist, "get_backend", lambda pg=None: "nccl")
        with pytest.raises(errors.InvalidArgumentError, match="use a gloo group, or give"):
            multinode._check_process_group(world, torch.device("cpu"))
        assert multinode._check_process_group(world, torch.device("cuda", 0)) is world
        monkeypatch.undo()


def test_a_trainer_attaches_again_while_views_of_the_devices_live(backend):
    """CUDA opens an IPC handle once per process: a second trainer in the same process,
    while tensors of the first one's mapping live, shares that opening (and the fake
    device refuses a second opening as CUDA does)."""
    torch.manual_seed(2)
    model = Cnn()
    x, y = torch.randn(20, 1, 12, 12), torch.randint(0, 5, (20,))
    server = shmgrad.serve(model=model, workers=2, loss="cross_entropy", devices=["cuda:0"])
    try:
        first = shmgrad.attach(server.name)
        kept = first.gradient_tensors()
        first.gradient(inputs=x, targets=y)
        first.close()
        second = shmgrad.attach(server.name)
        try:
            second.gradient(inputs=x, targets=y)
            assert relative_error(_cpu(second.gradient_tensors()), _cpu(kept)) == 0.0
            expected = reference_gradient(model, "cross_entropy", x, y)
            assert relative_error(_cpu(kept), expected) < 1e-5
        finally:
            second.close()
        del kept
    finally:
        server.stop()


# The hung kernel (on a GPU): torch.cuda._sleep spins for a number of SM clock cycles,
# counted here at 2 GHz (the H100's and H200's highest clock is 1.98 GHz), so it lasts at
# least HUNG_KERNEL_S. Long past the call's timeout and the coordinator's 2 s grace
# (ipc::kAbandonGraceNs): the worker is killed mid-kernel. Short enough that if the kill
# failed, the kernel ends by itself, the case fails (no restart) and still ends in about
# 30 s, as tools/device-check's budget needs.
HUNG_KERNEL_S = 20
SM_CLOCK_HZ_AT_MOST = 2_000_000_000
HUNG_CALL_TIMEOUT_S = 3  # the call that meets the hung worker
HUNG_CALL_ENDS_WITHIN_S = 15
# The call after: the abandoned worker killed (after the 2 s grace) and a replacement
# started (an eager worker: Python, torch, a CUDA context), then one small step.
REPLACED_STEP_TIMEOUT_S = 30


class HangingNet(torch.nn.Module):
    """A linear model whose forward, while the file ``hang_file`` exists, launches a CUDA
    kernel that spins for HUNG_KERNEL_S at least (torch.cuda._sleep): a hung kernel. On
    the fake device (CPU tensors) the fake library's device wait hangs instead
    (FAKE_CUDA_HANG_FILE)."""

    def __init__(self, hang_file):
        super().__init__()
        self.fc = torch.nn.Linear(6, 3)
        self.hang_file = hang_file

    def forward(self, x):
        if x.is_cuda and os.path.exists(self.hang_file):
            torch.cuda._sleep(HUNG_KERNEL_S * SM_CLOCK_HZ_AT_MOST)
        return self.fc(x)


def test_a_hung_kernel_ends_in_timeout_and_its_worker_is_replaced(backend, tmp_path, monkeypatch):
    """A worker whose device work does not finish: the call ends in EngineTimeoutError at
    its timeout, the coordinator kills the worker still busy with the abandoned step (its
    CUDA context, and the kernel, go with it), and the next call gets the exact gradient
    from the replacement, the engine's only worker."""
    hang = tmp_path / "hang"
    monkeypatch.setenv("FAKE_CUDA_HANG_FILE", str(hang))  # for the engine's processes
    torch.manual_seed(2)
    model, twin = HangingNet(str(hang)), HangingNet(str(hang))
    twin.load_state_dict(model.state_dict())
    x, y = torch.randn(16, 6), torch.randint(0, 3, (16,))
    with shmgrad.Engine(
        model=model, workers=1, loss="cross_entropy", devices=["cuda:0"], mode="eager"
    ) as engine:
        monkeypatch.delenv("FAKE_CUDA_HANG_FILE")  # this trainer's own device waits do not hang
        engine.bind(model)
        engine.gradient(inputs=x, targets=y, timeout=STEP_TIMEOUT_S)
        pid = engine.status().worker(0).pid
        hang.touch()
        t0 = time.monotonic()
        with pytest.raises(
            shmgrad.EngineTimeoutError, match=f"did not finish within {HUNG_CALL_TIMEOUT_S} s"
        ):
            engine.gradient(inputs=x, targets=y, timeout=HUNG_CALL_TIMEOUT_S)
        assert time.monotonic() - t0 < HUNG_CALL_ENDS_WITHIN_S
        assert engine.status().worker(0).pid == pid  # hung, not dead: the timeout ended the call
        hang.unlink()
        engine.gradient(inputs=x, targets=y, timeout=REPLACED_STEP_TIMEOUT_S)
        st = engine.status()
        assert st.worker(0).restarts == 1 and st.worker(0).pid != pid, st.text
        ref = reference_gradient(twin, "cross_entropy", x, y)
        assert relative_error(_cpu(p.grad for p in model.parameters()), ref) < 1e-5


# -- device memory freed only after every process that maps it has let go ----------------
# The fake device alone (it tells who maps an allocation, faults on demand, and its
# MPS stand-in is a socket): no `cuda` case, which SHMGRAD_REQUIRE_GPU would fail.
@pytest.mark.parametrize("backend", ["fake"], indirect=True)
def test_device_memory_outlives_every_view_of_it(backend):
    """CUDA leaves freeing memory that another process still maps undefined: the trainer
    lets go of every view at close (the bound module keeps copies of its values), and the
    coordinator frees its devices' memory only then. Views kept past close make it wait,
    say so in its log, and the fake device records the free it then makes."""
    x, y = torch.randn(6, 1, 12, 12), torch.randint(0, 5, (6,))
    torch.manual_seed(0)
    model = Cnn()
    with shmgrad.Engine(
        model=model, workers=1, loss="cross_entropy", mode="eager", devices=["cuda:0"]
    ) as engine:
        engine.bind(model)
        engine.gradient(inputs=x, targets=y)
        torch.optim.SGD(model.parameters(), lr=0.1).step()
        trained = [p.detach().clone() for p in model.parameters()]
        grads = [p.grad.clone() for p in model.parameters()]
    # Closed at once (no wait), nothing undefined, and the module kept what it had.
    assert all(torch.equal(a, b) for a, b in zip(trained, model.parameters()))
    assert all(torch.equal(a, p.grad) for a, p in zip(grads, model.parameters()))
    violations = os.environ["FAKE_CUDA_VIOLATIONS"]
    assert not os.path.exists(violations) or not open(violations).read()

    engine = shmgrad.Engine(
        model=model, workers=1, loss="cross_entropy", mode="eager", devices=["cuda:0"]
    )
    engine.bind(model)
    engine.gradient(inputs=x, targets=y)
    kept = engine.gradient_tensors()  # views of the device memory, held past close
    start = time.monotonic()
    engine.close()
    waited = time.monotonic() - start
    del kept
    assert waited >= 4.0, waited  # the coordinator waited for this process to let go
    assert "still maps the engine's device memory" in engine.log(), engine.log()
    with open(violations) as f:
        text = f.read()
    assert f"while pid {os.getpid()} still maps it" in text, text
    os.remove(violations)  # what this test asked for: the fixture checks for no others


# -- one worker per GPU unless asked; several on one GPU said to need MPS ----------------
# The fake device alone (it tells who maps an allocation, faults on demand, and its
# MPS stand-in is a socket): no `cuda` case, which SHMGRAD_REQUIRE_GPU would fail.
@pytest.mark.parametrize("backend", ["fake"], indirect=True)
def test_one_worker_per_gpu_by_default_and_sharing_needs_mps(backend, tmp_path, monkeypatch):
    """Workers on one GPU have a CUDA context each, whose kernels take turns without MPS:
    devices= places one worker per GPU unless workers= asks for more, which is warned
    about (and said in the engine's log) unless an MPS daemon serves the machine;
    status().mps says whether one did when the engine started."""
    x, y = torch.randn(6, 1, 12, 12), torch.randint(0, 5, (6,))
    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", str(tmp_path / "no-mps-here"))
    model = Cnn()
    with shmgrad.Engine(model=model, loss="cross_entropy", devices=["cuda:0", "cuda:1"]) as e:
        status = e.status()
        assert [w.device for w in status.workers] == ["cuda:0", "cuda:1"]
        assert status.mps is False and "MPS off" in status.text
        e.gradient(inputs=x, targets=y)
    with pytest.raises(shmgrad.InvalidArgumentError, match="workers= is required"):
        shmgrad.Engine(model=model, loss="cross_entropy")
    with pytest.warns(UserWarning, match="take turns"):
        engine = shmgrad.Engine(model=model, workers=2, loss="cross_entropy", devices=["cuda:0"])
    with engine:
        assert "2 workers share cuda:0 without MPS" in engine.log()
    # An MPS daemon's control socket where the CUDA runtime looks for it.
    import socket
    import warnings

    pipe = tmp_path / "mps"
    pipe.mkdir()
    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", str(pipe))
    with socket.socket(socket.AF_UNIX) as control:
        control.bind(str(pipe / "control"))
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no warning under MPS
            with shmgrad.Engine(
                model=model, workers=2, loss="cross_entropy", devices=["cuda:0"]
            ) as engine:
                assert engine.status().mps is True and "MPS on" in engine.status().text
                assert "without MPS" not in engine.log()


# -- a kernel fault ends the worker, which is replaced -----------------------------------
# The fake device alone (it tells who maps an allocation, faults on demand, and its
# MPS stand-in is a socket): no `cuda` case, which SHMGRAD_REQUIRE_GPU would fail.
@pytest.mark.parametrize("backend", ["fake"], indirect=True)
def test_a_kernel_fault_ends_its_worker_and_a_replacement_serves(backend, tmp_path, monkeypatch):
    """A sticky CUDA error (a kernel fault) leaves a process's context unusable: the step
    reports it, the worker exits (code 4) instead of failing every later step, and the
    coordinator's replacement serves the next call."""
    fault = tmp_path / "fault"
    monkeypatch.setenv("FAKE_CUDA_FAULT_FILE", str(fault))
    x, y = torch.randn(6, 1, 12, 12), torch.randint(0, 5, (6,))
    model = Cnn()
    with shmgrad.Engine(
        model=model, loss="cross_entropy", mode="eager", devices=["cuda:0", "cuda:1"]
    ) as engine:
        engine.bind(model)
        engine.gradient(inputs=x, targets=y)
        fault.touch()
        with pytest.raises(shmgrad.WorkerError, match="cudaErrorIllegalAddress"):
            engine.gradient(inputs=x, targets=y, max_retries=0)
        fault.unlink()
        restarts = lambda: sum(w.restarts for w in engine.status().workers)  # noqa: E731
        wait_for(lambda: restarts() == 2, 30, "both faulted workers replaced")
        wait_for(lambda: engine.workers == 2, 30, "the replacements ready")
        stats = engine.gradient(inputs=x, targets=y)
        assert stats.num_examples == 6
        expected = reference_gradient(model, "cross_entropy", x, y)
        assert relative_error(_cpu(p.grad for p in model.parameters()), expected) < 1e-5
        assert "kernel fault left its context unusable" in engine.log(), engine.log()
