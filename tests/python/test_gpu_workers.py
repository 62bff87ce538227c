"""GPU workers end to end, on machines without a GPU: the fake device library
(tests/fake_cuda.cc, compiled here) stands in for libshmgrad_cuda.so. Its "device"
allocations are host memory, so tensors over them are CPU tensors; everything else is the
path a GPU engine takes: the coordinator allocates each device's buffers and publishes
their IPC handles, workers open them, compute with their device's parameters into their
slot there, the library reduces the slots into the first device's reduced gradient, the
trainer's parameters and .grad are that memory, and the other devices' parameters are
brought up to date before each step. On a GPU the same tests run for real in
test_gpu.py (tools/device-check)."""

import glob
import os
import shutil
import signal
import subprocess

import pytest
import torch

import shmgrad

from conftest import Cnn, reference_gradient, relative_error
from test_faults import STEP_TIMEOUT_S, GradientCall, SlowCnn, wait_for, wait_until_busy

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def fake_library(tmp_path_factory):
    compiler = shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        pytest.skip("no C++ compiler here to build the fake device library")
    out = tmp_path_factory.mktemp("fakecuda") / "libfake_cuda.so"
    subprocess.run(
        [
            compiler,
            "-std=c++17",
            "-O1",
            "-shared",
            "-fPIC",
            f"-I{ROOT}",
            os.path.join(ROOT, "tests", "fake_cuda.cc"),
            "-o",
            str(out),
            "-lrt",
        ],
        check=True,
    )
    return str(out)


@pytest.fixture
def fake_devices(fake_library, monkeypatch):
    """Two fake GPUs for this test's engines (their processes inherit the environment)."""
    monkeypatch.setenv("SHMGRAD_CUDA_LIBRARY", fake_library)
    monkeypatch.setenv("FAKE_CUDA_DEVICES", "2")
    before = set(glob.glob("/dev/shm/shmgrad-fakecuda-*"))
    yield
    left = set(glob.glob("/dev/shm/shmgrad-fakecuda-*")) - before
    assert not left, f"device allocations left behind: {sorted(left)}"


class BnCnn(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(1, 4, 3)
        self.bn = torch.nn.BatchNorm2d(4)
        self.fc = torch.nn.Linear(4 * 10 * 10, 5)

    def forward(self, x):
        return self.fc(torch.flatten(torch.relu(self.bn(self.conv(x))), 1))


PLACEMENTS = [
    (["cuda:0"], 1),
    (["cuda:0"], 3),
    (["cuda:1", "cuda:0"], 2),
    (["cuda:0", "cuda:1"], 3),
]


@pytest.mark.parametrize("mode", ["eager", "script"])
@pytest.mark.parametrize("devices,workers", PLACEMENTS)
def test_gradients_and_training_match_one_process(fake_devices, devices, workers, mode):
    torch.manual_seed(4)
    model = Cnn()
    ref = Cnn()
    ref.load_state_dict(model.state_dict())
    x, y = torch.randn(90, 1, 12, 12), torch.randint(0, 5, (90,))
    with shmgrad.Engine(
        model=model, workers=workers, loss="cross_entropy", devices=devices, mode=mode
    ) as engine:
        engine.bind(model)
        for b in (1, 7, 90):
            engine.gradient(inputs=x[:b], targets=y[:b])
            expected = reference_gradient(ref, "cross_entropy", x[:b], y[:b])
            assert relative_error([p.grad for p in model.parameters()], expected) < 1e-5, b
        # Training: the optimizer steps the first device's parameters; workers on the
        # other device compute with them after the engine brings their copy up to date.
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
        g = torch.Generator().manual_seed(1)
        for _ in range(8):
            idx = torch.randint(0, 90, (24,), generator=g)
            opt.zero_grad()
            engine.gradient(inputs=x[idx], targets=y[idx], reduction="mean")
            opt.step()
            ref_opt.zero_grad()
            torch.nn.functional.cross_entropy(ref(x[idx]), y[idx]).backward()
            ref_opt.step()
        assert relative_error(list(model.parameters()), list(ref.parameters())) < 1e-4


def test_eager_batchnorm_and_a_random_dataset_match_one_process(fake_devices):
    """An eager model with BatchNorm over a dataset that augments at random, on two
    devices: each worker normalises its shard with the shard's statistics (as DDP does), so
    the reference is one process computing each shard from the same draws, and the shared
    statistics afterwards are the shards' average."""
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
        devices=["cuda:0", "cuda:1"],
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
        assert relative_error([p.grad for p in model.parameters()], grads) < 1e-5
        assert relative_error(model.bn.running_mean, (means[0] + means[1]) / 2) < 1e-5


def test_worker_killed_mid_step_on_a_device_is_rerun_exactly(fake_devices):
    """A worker on the second device SIGKILLed while it computes: the step is aborted and
    re-run with its replacement (which opens the device's buffers again), exactly."""
    torch.manual_seed(1)
    model = SlowCnn()
    x, y = torch.randn(1501, 1, 28, 28), torch.randint(0, 5, (1501,))
    ref = reference_gradient(model, "cross_entropy", x, y)
    with shmgrad.Engine(
        model=model, workers=3, loss="cross_entropy", devices=["cuda:0", "cuda:1"]
    ) as engine:
        engine.bind(model)
        engine.gradient(inputs=x[:8], targets=y[:8])  # warm up
        before = engine.status()
        slot = 1  # round-robin: slot 1 is cuda:1's
        call = GradientCall(engine, inputs=x, targets=y, timeout=STEP_TIMEOUT_S)
        try:
            wait_until_busy(engine.name, slot=slot, after_epoch=before.step_epoch)
            os.kill(before.worker(slot).pid, signal.SIGKILL)
        finally:
            call.join()
        stats = call.result()
        assert stats.retries == 1
        assert relative_error([p.grad for p in model.parameters()], ref) < 1e-5
        wait_for(
            lambda: engine.status().worker(slot).restarts == before.worker(slot).restarts + 1,
            10,
            f"worker {slot}'s restart to be counted",
        )
        stats = engine.gradient(inputs=x[:64], targets=y[:64])
        assert stats.num_examples == 64 and stats.retries == 0
        assert (
            relative_error(
                [p.grad for p in model.parameters()],
                reference_gradient(model, "cross_entropy", x[:64], y[:64]),
            )
            < 1e-5
        )
