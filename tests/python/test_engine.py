"""The Python trainer API against a plain PyTorch reference."""

import os
import subprocess
import sys
import time

import pytest
import torch

import shmgrad
from conftest import (
    Cnn,
    LogSoftmaxMlp,
    Mlp,
    proc_stat,
    reference_gradient,
    relative_error,
    segments,
    worker_pids,
)


@pytest.mark.parametrize("workers", [1, 2, 3])
@pytest.mark.parametrize(
    "model_cls,loss", [(Mlp, "cross_entropy"), (Cnn, "cross_entropy"), (LogSoftmaxMlp, "nll")]
)
def test_gradient_matches_pytorch(workers, model_cls, loss, npy_dataset):
    spec, x, y = npy_dataset
    torch.manual_seed(workers)
    model = model_cls(d_in=144) if model_cls is not Cnn else Cnn()
    ref_model = __import__("copy").deepcopy(model)
    with shmgrad.Engine(model=model, workers=workers, loss=loss, dataset=spec) as engine:
        engine.bind(model)
        for batch in (1, 5, 33, 120):
            idx = torch.randperm(120)[:batch]
            for reduction in ("sum", "mean"):
                ref = reference_gradient(ref_model, loss, x[idx], y[idx], reduction)
                stats = engine.gradient(idx, reduction=reduction)
                assert relative_error([p.grad for p in model.parameters()], ref) < 1e-5
                assert stats.num_examples == batch
                assert stats.workers == min(batch, workers)
                assert sum(stats.worker_examples) == batch
                # The same batch given explicitly.
                stats = engine.gradient(inputs=x[idx], targets=y[idx], reduction=reduction)
                assert relative_error([p.grad for p in model.parameters()], ref) < 1e-5
                assert len(stats.compute_seconds) == stats.workers
                assert stats.wall_seconds > 0 and stats.reduce_seconds >= 0


def test_mse_explicit_batches():
    torch.manual_seed(0)
    model = Mlp(d_in=8, d_out=3)
    with shmgrad.Engine(model=model, workers=2, loss="mse") as engine:
        engine.bind(model)
        for batch in (1, 2, 9):
            x, y = torch.randn(batch, 8), torch.randn(batch, 3)
            ref = reference_gradient(model, "mse", x, y)
            engine.gradient(inputs=x, targets=y)
            assert relative_error([p.grad for p in model.parameters()], ref) < 1e-5


def test_inputs_that_require_grad_and_replaced_grads():
    """Inputs that autograd tracks give the same gradient and are left alone; a .grad the
    user replaced (not only set to None) is pointed back at the engine's gradient."""
    torch.manual_seed(3)
    model = Mlp(d_in=8, d_out=3)
    x, y = torch.randn(7, 8), torch.tensor([0, 1, 2, 0, 1, 2, 0])
    ref = reference_gradient(model, "cross_entropy", x, y)
    with shmgrad.Engine(model=model, workers=2, loss="cross_entropy") as engine:
        engine.bind(model)
        # float32 as it is; float64 and a non-contiguous layout converted by the engine.
        for xg in (
            x.clone().requires_grad_(True),
            x.double().requires_grad_(True),
            x.t().contiguous().t().requires_grad_(True),
        ):
            engine.gradient(inputs=xg, targets=y)
            assert relative_error([p.grad for p in model.parameters()], ref) < 1e-5
            assert xg.grad is None and xg.requires_grad and xg.grad_fn is None
        params = list(model.parameters())
        params[0].grad = torch.zeros_like(params[0])  # a new tensor, not the engine's
        params[-1].grad = params[-1].grad.clone()
        engine.gradient(inputs=x, targets=y)
        views = engine.gradient_tensors()
        assert params[0].grad.data_ptr() == views[0].data_ptr()
        assert params[-1].grad.data_ptr() == views[-1].data_ptr()
        assert relative_error([p.grad for p in params], ref) < 1e-5


def test_fifty_sgd_momentum_steps_match_plain_pytorch(npy_dataset):
    spec, x, y = npy_dataset
    torch.manual_seed(1)
    model = Cnn()
    ref = __import__("copy").deepcopy(model)
    initial = [p.detach().clone() for p in model.parameters()]
    with shmgrad.Engine(model=model, workers=3, loss="cross_entropy", dataset=spec) as engine:
        engine.bind(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
        g = torch.Generator().manual_seed(2)
        for _ in range(50):
            idx = torch.randint(0, 120, (16,), generator=g)
            opt.zero_grad()  # set_to_none or not: the engine relinks .grad
            engine.gradient(idx, reduction="mean")
            opt.step()
            ref_opt.zero_grad()
            torch.nn.functional.cross_entropy(ref(x[idx]), y[idx]).backward()
            ref_opt.step()
        # The engine's shared parameters are the bound module's parameters.
        shared = engine.parameter_tensors()
        for p, s in zip(model.parameters(), shared):
            assert p.data_ptr() == s.data_ptr()
        assert relative_error(list(model.parameters()), list(ref.parameters())) < 1e-4
        assert relative_error(list(model.parameters()), initial) > 1e-3  # it trained


def test_optimizer_step_is_seen_by_workers():
    """After the trainer changes the shared parameters, workers compute with the new ones."""
    torch.manual_seed(4)
    model = Mlp(d_in=6, d_out=2)
    x, y = torch.randn(10, 6), torch.randint(0, 2, (10,))
    with shmgrad.Engine(model=model, workers=2, loss="cross_entropy") as engine:
        engine.bind(model)
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(-0.5).add_(0.1)
        engine.gradient(inputs=x, targets=y)
        ref = reference_gradient(model, "cross_entropy", x, y)
        assert relative_error([p.grad for p in model.parameters()], ref) < 1e-5


class WideActivations(torch.nn.Module):
    """A cheap model whose activations are larger than glibc's largest mmap threshold
    (32 MiB): [B, 64, 784] float32 is 51 MiB for a worker's 256 examples."""

    def __init__(self):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.rand(64))
        self.out = torch.nn.Linear(784, 10)

    def forward(self, x):
        h = torch.relu(x.unsqueeze(1) * self.scale.view(1, -1, 1))
        return self.out(h.mean(1))


def test_steady_steps_take_no_page_faults_in_workers():
    """The hot path allocates nothing from the kernel. glibc gives a block over 32 MiB its
    own mmap and unmaps it on free, so without the workers' heap settings every step
    faults its large activations in again (measured: about 62,700 faults a step for this
    model, torch 2.15). With them the memory stays in the heap: after a warm-up, steps
    take no faults, except that now and then a large block lands on heap pages not used
    before while glibc's free lists settle (measured: one burst of about 12,000 faults in
    40 steps). The bound is a tenth of the unfixed rate."""
    torch.manual_seed(5)
    model = WideActivations()
    x, y = torch.rand(512, 784), torch.randint(0, 10, (512,))
    with shmgrad.Engine(model=model, workers=2, loss="cross_entropy") as engine:
        engine.bind(model)
        for _ in range(10):
            engine.gradient(inputs=x, targets=y)
        workers = list(worker_pids(engine).values())
        assert len(workers) == 2
        before = {w: int(proc_stat(w)[7]) for w in workers}
        steps = 20
        for _ in range(steps):
            engine.gradient(inputs=x, targets=y)
        ref = reference_gradient(model, "cross_entropy", x, y)
        assert relative_error([p.grad for p in model.parameters()], ref) < 1e-5
        for w in workers:
            faults = int(proc_stat(w)[7]) - before[w]
            assert faults < 6000 * steps, f"worker {w}: {faults} page faults in {steps} steps"


def expect_error(cls, fn, *words):
    with pytest.raises(cls) as info:
        fn()
    for w in words:
        assert w in str(info.value), str(info.value)
    assert isinstance(info.value, shmgrad.Error)


def test_bad_input_raises_and_engine_keeps_serving(npy_dataset, tmp_path):
    spec, x, y = npy_dataset
    model = Cnn()
    with shmgrad.Engine(model=model, workers=2, loss="cross_entropy", dataset=spec) as engine:
        engine.bind(model)
        expect_error(
            shmgrad.InvalidArgumentError, lambda: engine.gradient([0, 120]), "out of range", "120"
        )
        expect_error(shmgrad.InvalidArgumentError, lambda: engine.gradient([-1]), "out of range")
        expect_error(shmgrad.InvalidArgumentError, lambda: engine.gradient([]), "empty batch")
        expect_error(shmgrad.InvalidArgumentError, lambda: engine.gradient([0.5]), "integers")
        mask = torch.zeros(10, dtype=torch.bool)
        expect_error(
            shmgrad.InvalidArgumentError, lambda: engine.gradient(mask), "mask.nonzero().flatten()"
        )
        expect_error(
            shmgrad.InvalidArgumentError, lambda: engine.gradient([1], reduction="max"), "reduction"
        )
        expect_error(shmgrad.InvalidArgumentError, lambda: engine.gradient(), "indices")
        expect_error(
            shmgrad.InvalidArgumentError,
            lambda: engine.gradient(
                inputs=torch.randn(3, 1, 12, 12), targets=torch.zeros(2).long()
            ),
            "3 examples",
            "2",
        )
        # Inputs the model rejects: the worker's own message comes back.
        expect_error(
            shmgrad.WorkerError,
            lambda: engine.gradient(inputs=torch.randn(4, 3, 5), targets=torch.zeros(4).long()),
            "could not compute its shard",
        )
        # A module that does not match the engine's parameters.
        expect_error(
            shmgrad.InvalidArgumentError, lambda: engine.bind(Mlp(d_in=144)), "does not match"
        )
        # The next valid call works and is exact.
        ref = reference_gradient(model, "cross_entropy", x[:7], y[:7])
        engine.gradient(list(range(7)))
        assert relative_error([p.grad for p in model.parameters()], ref) < 1e-5


def test_bad_engine_arguments(tmp_path):
    expect_error(
        shmgrad.InvalidArgumentError,
        lambda: shmgrad.Engine(model=Mlp(), workers=1, loss="hinge"),
        "unknown loss",
        "cross_entropy",
    )
    expect_error(
        shmgrad.EngineNotFoundError,
        lambda: shmgrad.Engine(model=str(tmp_path / "missing.pt"), workers=1, loss="mse"),
        "does not exist",
    )
    not_ts = tmp_path / "not_torchscript.pt"
    not_ts.write_text("definitely not a model")
    expect_error(
        shmgrad.InvalidArgumentError,
        lambda: shmgrad.Engine(model=str(not_ts), workers=1, loss="mse"),
        "TorchScript",
    )
    expect_error(
        shmgrad.InvalidArgumentError,
        lambda: shmgrad.Engine(model=Mlp(), workers=0, loss="mse"),
        "workers",
    )
    expect_error(
        shmgrad.InvalidArgumentError,
        lambda: shmgrad.Engine(model=Mlp(), workers=1, loss="mse", name="bad/name"),
        "name",
    )
    expect_error(
        shmgrad.InvalidArgumentError,
        lambda: shmgrad.Engine(model=Mlp(), workers=1, loss="mse", dataset="imagenet"),
        "dataset",
    )
    expect_error(shmgrad.EngineNotFoundError, lambda: shmgrad.attach("no-such-engine", timeout=0.2))


def test_two_engines_side_by_side():
    torch.manual_seed(5)
    a, b = Mlp(d_in=4, d_out=2), Mlp(d_in=6, d_out=3)
    xa, ya = torch.randn(8, 4), torch.randint(0, 2, (8,))
    xb, yb = torch.randn(8, 6), torch.randint(0, 3, (8,))
    with (
        shmgrad.Engine(model=a, workers=1, loss="cross_entropy", name="side-a") as ea,
        shmgrad.Engine(model=b, workers=2, loss="cross_entropy", name="side-b") as eb,
    ):
        ea.bind(a)
        eb.bind(b)
        for _ in range(3):
            ea.gradient(inputs=xa, targets=ya)
            eb.gradient(inputs=xb, targets=yb)
        assert (
            relative_error(
                [p.grad for p in a.parameters()], reference_gradient(a, "cross_entropy", xa, ya)
            )
            < 1e-5
        )
        assert (
            relative_error(
                [p.grad for p in b.parameters()], reference_gradient(b, "cross_entropy", xb, yb)
            )
            < 1e-5
        )
    assert not [s for s in segments() if s.endswith(("-side-a", "-side-b"))]


def test_attach_to_served_engine_and_busy(tmp_path):
    model = Mlp(d_in=4, d_out=2)
    path = shmgrad.save_model(model, tmp_path / "m.pt")
    serve = subprocess.Popen(
        [
            "shmgrad",
            "serve",
            "--name",
            "cli-engine",
            "--model",
            str(path),
            "--workers",
            "2",
            "--loss",
            "cross_entropy",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        engine = shmgrad.attach("cli-engine", timeout=60)
        x, y = torch.randn(5, 4), torch.randint(0, 2, (5,))
        engine.bind(model)
        engine.gradient(inputs=x, targets=y)
        assert (
            relative_error(
                [p.grad for p in model.parameters()],
                reference_gradient(model, "cross_entropy", x, y),
            )
            < 1e-5
        )
        # A second trainer (another process) is told who holds the engine.
        code = (
            "import shmgrad,os\n"
            "try:\n shmgrad.attach('cli-engine', timeout=5)\nexcept shmgrad.BusyError as e:\n"
            f" assert 'pid {__import__('os').getpid()}' in str(e), str(e); print('busy-ok')\n"
        )
        out = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=60
        )
        assert "busy-ok" in out.stdout, out.stdout + out.stderr
        st = shmgrad.read_status("cli-engine")
        assert st.steps_served == 1 and st.trainer_pid == os.getpid(), st
        assert [w.slot for w in st.ready_workers] == [0, 1]
        # `shmgrad status` prints the same status as text.
        status = subprocess.run(
            ["shmgrad", "status", "cli-engine"], capture_output=True, text=True, timeout=30
        )
        assert status.returncode == 0 and status.stdout == st.text, status.stdout + status.stderr
        engine.close()
        # Released: the next attach succeeds at once.
        shmgrad.attach("cli-engine", timeout=5).close()
    finally:
        stop = subprocess.run(
            ["shmgrad", "stop", "cli-engine"], capture_output=True, text=True, timeout=60
        )
        serve.communicate(timeout=30)  # waits, and closes its output pipe
    assert stop.returncode == 0, stop.stderr
    assert serve.returncode == 0
    assert not [s for s in segments() if s.endswith("-cli-engine")]


def test_save_model_traces_with_example_inputs(tmp_path):
    class Untypable(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(3, 2)

        def forward(self, x, *rest):  # varargs do not script
            return self.fc(x)

    m = Untypable()
    with pytest.raises(shmgrad.InvalidArgumentError, match="example_inputs"):
        shmgrad.save_model(m, tmp_path / "a.pt")
    shmgrad.save_model(m, tmp_path / "b.pt", example_inputs=torch.randn(2, 3))
    loaded = torch.jit.load(str(tmp_path / "b.pt"))
    x = torch.randn(4, 3)
    assert torch.allclose(loaded(x), m(x))


def test_cli_help_documents_options():
    out = subprocess.run(["shmgrad", "serve", "--help"], capture_output=True, text=True, timeout=30)
    for opt in ("--name", "--model", "--workers", "--loss", "--dataset", "--threads-per-worker"):
        assert opt in out.stdout
    out = subprocess.run(["shmgrad", "--help"], capture_output=True, text=True, timeout=30)
    for cmd in ("serve", "stop", "status", "resize", "stress", "bench"):
        assert cmd in out.stdout


def test_cli_finds_its_program_without_importing_torch(tmp_path):
    """The console script (shmgrad_tools.cli) finds bin/shmgrad in the installed package
    without importing shmgrad or torch, so that status, stop and --help answer at once; a
    missing program is named by shmgrad.program's error."""
    code = (
        "import sys, shmgrad_tools.cli as c; p = c.program_path(); "
        "print(p, 'torch' in sys.modules, 'shmgrad' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    path, torch_loaded, shmgrad_loaded = out.stdout.split()
    assert path == shmgrad.program("shmgrad") and os.path.isfile(path)
    assert (torch_loaded, shmgrad_loaded) == ("False", "False")
    # $SHMGRAD_BINARY wins; a package without its program is refused by the library.
    env = dict(os.environ, SHMGRAD_BINARY=str(tmp_path / "elsewhere"))
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env
    )
    assert out.stdout.split()[0] == str(tmp_path / "elsewhere")
    fake = tmp_path / "shmgrad"
    fake.mkdir()
    (fake / "__init__.py").write_text(
        "def program(name):\n    raise RuntimeError('no program ' + name + ' here')\n"
    )
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    out = subprocess.run(
        [sys.executable, "-c", "import shmgrad_tools.cli as c; c.main()"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert out.returncode != 0 and "no program shmgrad here" in out.stderr, out.stderr


def test_status_is_data(npy_dataset):
    spec, x, y = npy_dataset
    model = Cnn()
    with shmgrad.Engine(
        model=model, workers=2, max_workers=3, loss="cross_entropy", dataset=spec
    ) as engine:
        st = engine.status()
        assert isinstance(st, shmgrad.EngineStatus)
        assert (st.name, st.state, st.loss) == (engine.name, "serving", "cross_entropy")
        assert st.coordinator_alive and os.path.exists(f"/proc/{st.coordinator_pid}")
        assert st.segment_path == shmgrad._C.segment_path(engine.name) and st.segment_bytes > 0
        assert st.num_params == len(list(model.parameters()))
        assert st.param_floats >= sum(p.numel() for p in model.parameters())  # padded
        assert st.dataset_size == 120 and st.max_batch == 65536 and st.threads_per_worker == 1
        assert (st.target_workers, st.slots) == (2, 3)
        assert st.trainer_pid == os.getpid()
        assert (st.steps_served, st.steps_aborted, st.step_retries, st.worker_restarts) == (
            0,
            0,
            0,
            0,
        )
        assert st.recent_steps == []
        assert [(w.slot, w.state, w.busy_epoch) for w in st.workers] == [
            (0, "ready", 0),
            (1, "ready", 0),
        ]
        assert all(
            isinstance(w, shmgrad.WorkerStatus) and os.path.exists(f"/proc/{w.pid}")
            for w in st.workers
        )
        assert engine.name in st.text

        engine.gradient(list(range(33)))
        st = engine.status()
        assert st.steps_served == 1
        (step,) = st.recent_steps
        assert isinstance(step, shmgrad.StepSummary)
        assert (step.epoch, step.workers, step.examples) == (st.step_epoch, 2, 33)
        assert step.wall_seconds > 0 and step.compute_seconds > 0 and step.reduce_seconds >= 0
        assert all(w.assigned_epoch == st.step_epoch for w in st.workers)
        # A worker marks itself idle just after the step it took part in.
        deadline = time.monotonic() + 10
        while any(w.busy_epoch for w in engine.status().workers):
            assert time.monotonic() < deadline, engine.status()
            time.sleep(0.01)

        engine.resize(1)
        st = shmgrad.read_status(engine.name)  # the same, without the trainer
        assert st.target_workers == 1 and [w.slot for w in st.ready_workers] == [0]
    with pytest.raises(shmgrad.EngineNotFoundError):
        shmgrad.read_status(engine.name)


def test_import_loads_the_engine_alone():
    """`import shmgrad` loads the library, not the tools beside it or what only they need."""
    code = "import sys, shmgrad; print(' '.join(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    modules = out.stdout.split()
    assert "shmgrad._engine" in modules
    tools = [m for m in modules if m.startswith("shmgrad_tools")]
    heavy = [m for m in modules if m.split(".")[0] in ("matplotlib", "distributed", "dask")]
    assert tools == [] and heavy == []


def test_stats_are_read_lazily_and_unbound_gradient_warns_once():
    torch.manual_seed(3)
    model = Mlp(d_in=6, d_out=3)
    x, y = torch.randn(10, 6), torch.randint(0, 3, (10,))
    with shmgrad.Engine(model=model, workers=2, loss="cross_entropy") as engine:
        with pytest.warns(UserWarning, match="bind"):
            engine.gradient(inputs=x, targets=y)
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a second warning would raise here
            stats = engine.gradient(inputs=x, targets=y, reduction="mean")
        assert stats.num_examples == 10 and stats.workers == 2
        assert stats.worker_examples == [5, 5] and sorted(stats.worker_slots) == [0, 1]
        ref = torch.nn.functional.cross_entropy(model(x), y, reduction="mean").item()
        assert abs(stats.loss - ref) < 1e-5 and abs(stats.loss_sum - 10 * ref) < 1e-4
        # The wall time splits into its parts.
        parts = stats.prepare_seconds + stats.step_seconds + stats.finish_seconds
        assert 0 < parts <= stats.wall_seconds + 1e-6
        assert 0 <= stats.wake_seconds <= stats.step_seconds
        d = stats.as_dict()
        assert d["compute_seconds"] == stats.compute_seconds and len(d["compute_seconds"]) == 2
        with pytest.raises(AttributeError):
            stats.no_such_field  # noqa: B018


def test_tools_use_only_the_public_api():
    """shmgrad_tools (bench, stress) imports nothing of shmgrad's internals, and every name
    shmgrad.__all__ lists exists; public modules are listed, internal ones start with _."""
    root = os.path.join(os.path.dirname(__file__), "..", "..", "python")
    private = []
    for dirpath, _, files in os.walk(os.path.join(root, "shmgrad_tools")):
        for name in files:
            if name.endswith(".py"):
                with open(os.path.join(dirpath, name)) as f:
                    for n, line in enumerate(f, 1):
                        if (
                            "shmgrad._" in line
                            or "._native" in line
                            or line.lstrip().startswith("from .. import")
                        ):
                            private.append(f"{name}:{n}: {line.strip()}")
    assert private == []
    assert all(hasattr(shmgrad, n) for n in shmgrad.__all__)
    modules = {f[:-3] for f in os.listdir(os.path.join(root, "shmgrad")) if f.endswith(".py")}
    public = {m for m in modules if not m.startswith("_")}
    assert public == {"errors", "schedules", "multinode", "dask", "testing", "lightning"}
    # dask and lightning are imported by their users (they need packages of their own)
    assert public - {"dask", "lightning"} <= set(shmgrad.__all__)
