"""Eager Python workers: any nn.Module, any loss, any Dataset, against plain PyTorch."""

import os
import random
import re
import signal
import time

import numpy as np
import pytest
import torch
from torch import nn

import shmgrad
from conftest import relative_error, segments
from helpers import GradientCall, LinearLayers, check_direct_linear_bits, wait_until_busy


class Unscriptable(nn.Module):
    """torch.jit.script rejects it: a lambda attribute, a dict of modules indexed by a
    Python string built at run time, and Python control flow on a list."""

    def __init__(self, d_in=6, hidden=10, d_out=3):
        super().__init__()
        self.blocks = nn.ModuleDict(
            {"in": nn.Linear(d_in, hidden), "out": nn.Linear(hidden, d_out)}
        )
        self.act = lambda t: torch.tanh(t) * 1.5
        self.order = ["in", "out"]

    def forward(self, x):
        for i, name in enumerate(self.order):
            x = self.blocks[name](x)
            if i + 1 < len(self.order):
                x = self.act(x)
        return x


def smooth_loss(out, y):
    """A custom loss: label-smoothed cross entropy, summed over the batch."""
    return nn.functional.cross_entropy(out, y, reduction="sum", label_smoothing=0.1)


class NoisyDataset(torch.utils.data.Dataset):
    """Per-example transforms that draw from Python's random, NumPy and torch."""

    def __init__(self, n=60, d=6):
        g = torch.Generator().manual_seed(7)
        self.x = torch.randn(n, d, generator=g)
        self.y = torch.randint(0, 3, (n,), generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        x = self.x[i].clone()
        if random.random() < 0.5:
            x = x.flip(0)
        x = x + float(np.random.normal(0, 0.1)) + 0.05 * torch.randn(x.shape)
        return x, self.y[i]


def reference(model, loss, dataset, indices, seed, reduction="sum", collate=None):
    """The same step in this process, with the same seeding."""
    x, y = shmgrad.example_batch(dataset, indices, seed, collate)
    model.zero_grad(set_to_none=True)
    out = loss(model(x), y)
    (out / len(indices) if reduction == "mean" else out).backward()
    return [p.grad.detach().clone() for p in model.parameters()], out.item()


def copy_of(model):
    twin = type(model)()
    twin.load_state_dict(model.state_dict())
    return twin


def job_dir(engine):
    """The directory of the engine's pickled job: its serve process's --model lies there
    (other tests' engines, running meanwhile, have their own)."""
    with open(f"/proc/{engine.status().coordinator_pid}/cmdline", "rb") as f:
        args = f.read().decode().split("\0")
    directory = os.path.dirname(args[args.index("--model") + 1])
    assert os.path.basename(directory).startswith("shmgrad-eager-"), directory
    assert os.path.isdir(directory)
    return directory


def test_example_seed_is_documented_and_in_range():
    s = {shmgrad.example_seed(3, i) for i in range(1000)}
    assert len(s) == 1000 and all(0 <= v < 2**32 for v in s)
    assert shmgrad.example_seed(3, 5) == shmgrad.example_seed(3, 5)
    assert shmgrad.example_seed(3, 5) != shmgrad.example_seed(4, 5)


def test_unscriptable_model_custom_loss_dataset_transforms_match_one_process():
    with pytest.raises(Exception):  # noqa: B017 - whatever TorchScript raises
        torch.jit.script(Unscriptable())
    torch.manual_seed(0)
    model, ds = Unscriptable(), NoisyDataset()
    with shmgrad.Engine(
        model=model, loss=smooth_loss, dataset=ds, workers=2, max_workers=3
    ) as engine:
        assert engine.mode == "eager" and engine.status().worker_kind == "eager"
        assert engine.dataset_size == len(ds)
        job = job_dir(engine)
        ref_model = copy_of(model)
        engine.bind(model)
        idx = [3, 17, 0, 44, 9, 31, 58, 2, 25]
        for reduction in ("sum", "mean"):
            stats = engine.gradient(idx, seed=11, reduction=reduction)
            want, loss = reference(ref_model, smooth_loss, ds, idx, 11, reduction)
            assert relative_error([p.grad for p in model.parameters()], want) < 1e-5
            assert abs(stats.loss_sum - loss) < 1e-4 * max(1, abs(loss))
        # The same step over 3 workers (resize) agrees with 2 and with one process.
        engine.resize(3)
        stats = engine.gradient(idx, seed=11)
        assert stats.workers == 3
        want, _ = reference(ref_model, smooth_loss, ds, idx, 11)
        assert relative_error([p.grad for p in model.parameters()], want) < 1e-5
        engine.resize(1)
        assert engine.gradient(idx, seed=11).workers == 1
        assert relative_error([p.grad for p in model.parameters()], want) < 1e-5
    assert not os.path.exists(job), "the pickled job was left on disk"


def test_twenty_adam_steps_agree_with_plain_pytorch():
    torch.manual_seed(1)
    model, ds = Unscriptable(), NoisyDataset()
    ref_model = copy_of(model)
    loss = nn.CrossEntropyLoss(reduction="sum")
    ref_opt = torch.optim.Adam(ref_model.parameters(), lr=0.01)
    with shmgrad.Engine(model=model, loss=loss, dataset=ds, workers=2, seed=5) as engine:
        engine.bind(model)
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
        for step in range(20):
            idx = [(step * 7 + k) % len(ds) for k in range(12)]
            stats = engine.gradient(idx, reduction="mean")  # step seed from the engine's seed
            opt.step()
            reference(ref_model, loss, ds, idx, shmgrad.step_seed(5, step), "mean")
            ref_opt.step()
            assert stats.num_examples == 12
    for p, q in zip(model.parameters(), ref_model.parameters()):
        assert torch.allclose(p, q, rtol=1e-4, atol=1e-5)


def test_auto_mode_keeps_torchscript_workers_and_explicit_modes():
    model = nn.Sequential(nn.Linear(4, 3))
    # A module that scripts runs in TorchScript workers, unless torch deprecates TorchScript.
    auto = "eager" if shmgrad._mode.torchscript_deprecated() else "script"
    with shmgrad.Engine(model=model, loss="mse", workers=1) as engine:
        assert engine.mode == auto and engine.status().worker_kind == auto
    with shmgrad.Engine(model=model, loss="mse", workers=1, mode="script") as engine:
        assert engine.mode == "script" and engine.status().worker_kind == "script"
        assert engine.mode_reason == "asked for: mode='script'"
    with shmgrad.Engine(model=model, loss="mse", workers=1, mode="eager") as engine:
        assert engine.mode == "eager"
        engine.bind(model)
        x, y = torch.randn(5, 4), torch.randn(5, 3)
        engine.gradient(inputs=x, targets=y)
        ref = copy_of_seq(model)
        nn.functional.mse_loss(ref(x), y, reduction="sum").backward()
        assert (
            relative_error([p.grad for p in model.parameters()], [p.grad for p in ref.parameters()])
            < 1e-5
        )
    with pytest.raises(shmgrad.InvalidArgumentError, match="mode='eager'"):
        shmgrad.Engine(model=model, loss=smooth_loss, workers=1, mode="script")
    with pytest.raises(shmgrad.InvalidArgumentError, match="unknown mode"):
        shmgrad.Engine(model=model, loss="mse", workers=1, mode="fast")


def copy_of_seq(model):
    twin = nn.Sequential(nn.Linear(4, 3))
    twin.load_state_dict(model.state_dict())
    return twin


class TokenModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(20, 4)
        self.out = nn.Linear(4, 2)

    def forward(self, ids):
        return self.out(self.emb(ids).mean(1))


def test_integer_inputs_keep_their_dtype_and_forward_replaces_the_loss():
    torch.manual_seed(2)
    model = TokenModel()
    ref = TokenModel()
    ref.load_state_dict(model.state_dict())
    ids, y = torch.randint(0, 20, (8, 5)), torch.randint(0, 2, (8,))

    def forward(m, batch):
        x, t = batch
        assert x.dtype == torch.int64, x.dtype
        return (
            nn.functional.cross_entropy(m(x), t, reduction="sum")
            + 0.5 * m.emb.weight.pow(2).sum() / 8
        )

    # Per shard, the penalty is added once: neither the shard's sum nor its mean, so it
    # must be declared (the engine would refuse it otherwise).
    with shmgrad.Engine(model=model, workers=2, forward=forward, loss_reduction="sum") as engine:
        engine.bind(model)
        engine.gradient(inputs=ids, targets=y)
    total = sum(forward(ref, (ids[i : i + 4], y[i : i + 4])) for i in (0, 4))
    total.backward()
    assert (
        relative_error([p.grad for p in model.parameters()], [p.grad for p in ref.parameters()])
        < 1e-5
    )


class BrokenDataset(NoisyDataset):
    def __getitem__(self, i):
        if i == 13:
            raise KeyError(f"example {i} is missing " + "x" * 900)
        return super().__getitem__(i)


def test_errors_in_dataset_model_and_loss_come_back_whole_and_engine_keeps_serving():
    torch.manual_seed(3)
    model = Unscriptable()
    with shmgrad.Engine(
        model=model, loss=smooth_loss, dataset=BrokenDataset(), workers=2
    ) as engine:
        engine.bind(model)
        with pytest.raises(shmgrad.WorkerError) as info:
            engine.gradient([1, 2, 13, 4])
        err = info.value
        assert err.error_type == "KeyError" and err.worker in (0, 1)
        text = str(err)
        assert "example 13 is missing " + "x" * 900 in text  # the whole message, over 512 bytes
        assert "__getitem__" in text and "Traceback" in text  # the traceback's last frames
        # A shape mistake in the model: a real torch error, whole.
        with pytest.raises(shmgrad.WorkerError, match="mat1 and mat2|shapes cannot be multiplied"):
            engine.gradient(inputs=torch.randn(4, 7), targets=torch.zeros(4, dtype=torch.long))
        assert engine.gradient([1, 2, 3]).num_examples == 3  # still serving


def test_bad_jobs_are_refused_with_the_fix():
    model = Unscriptable()
    with pytest.raises(shmgrad.InvalidArgumentError, match="reduction='mean'"):
        shmgrad.Engine(
            model=model,
            loss=nn.CrossEntropyLoss(reduction="none"),
            dataset=NoisyDataset(),
            workers=1,
        )
    import threading

    lock = threading.Lock()
    with pytest.raises(shmgrad.InvalidArgumentError, match="collate_fn .* cannot be pickled"):
        shmgrad.Engine(
            model=model,
            loss=smooth_loss,
            dataset=NoisyDataset(),
            workers=1,
            collate_fn=lambda b, lock=lock: b,
        )


def test_a_worker_that_cannot_import_the_job_fails_start_up_with_its_message(tmp_path, monkeypatch):
    mod = tmp_path / "vanishing_module.py"
    mod.write_text(
        "import torch\nclass DS(torch.utils.data.Dataset):\n"
        "    def __len__(self): return 4\n"
        "    def __getitem__(self, i): return torch.zeros(6), 0\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    import vanishing_module

    ds = vanishing_module.DS()
    # Gone before the workers start: they cannot unpickle the class.
    mod.unlink()
    import sys

    sys.path.remove(str(tmp_path))
    with pytest.raises(shmgrad.WorkerError, match="vanishing_module"):
        shmgrad.Engine(
            model=Unscriptable(), loss=smooth_loss, dataset=ds, workers=1, startup_timeout=60
        )


def test_a_grow_whose_worker_cannot_start_times_out_naming_it(tmp_path, monkeypatch):
    """The job's module gone after start: a worker added by resize cannot unpickle it. The
    resize ends in EngineTimeoutError naming the worker that is not ready and where the
    reason is; Engine.log() has the worker's error; the engine keeps serving."""
    mod = tmp_path / "module_gone_later.py"
    mod.write_text(
        "import torch\nclass DS(torch.utils.data.Dataset):\n"
        "    def __len__(self): return 4\n"
        "    def __getitem__(self, i): return torch.zeros(6), 0\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    import module_gone_later

    model = nn.Linear(6, 2)
    with shmgrad.Engine(
        model=model,
        loss="cross_entropy",
        dataset=module_gone_later.DS(),
        workers=1,
        max_workers=2,
    ) as engine:
        mod.unlink()
        with pytest.raises(
            shmgrad.EngineTimeoutError,
            match=r"1 workers ready, not 2, after 5 s; not ready: worker 1 .*Engine\.log\(\)",
        ):
            engine.resize(2, timeout=5)
        assert "module_gone_later" in engine.log()
        engine.resize(1)
        engine.bind(model)
        assert engine.gradient([0, 1, 2]).num_examples == 3


class Parametrized(nn.Module):
    """Layers under torch.nn.utils.parametrizations, which torch refuses to pickle."""

    def __init__(self):
        super().__init__()
        from torch.nn.utils import parametrizations

        self.a = parametrizations.weight_norm(nn.Linear(6, 12))
        self.b = parametrizations.spectral_norm(nn.Linear(12, 12))
        self.c = parametrizations.orthogonal(nn.Linear(12, 12))
        self.out = nn.Linear(12, 3)

    def forward(self, x):
        return self.out(torch.tanh(self.c(torch.relu(self.b(torch.relu(self.a(x)))))))


def test_parametrized_modules_reach_eager_workers_and_train_exactly():
    """weight_norm, spectral_norm and orthogonal layers: the workers get them (pickled as
    the plain layers plus their parametrizations, registered again there), with the same
    parameter and buffer names; 3 SGD steps as one process, gradients and spectral_norm's
    power-iteration vectors alike; starting the engine does not touch the model's."""
    import copy

    torch.manual_seed(12)
    model = Parametrized()
    ref = copy.deepcopy(model)
    u = model.b.parametrizations.weight[0]._u.clone()
    x, y = torch.randn(48, 6), torch.randint(0, 3, (48,))
    with shmgrad.Engine(model=model, workers=2, loss="cross_entropy") as engine:
        assert torch.equal(model.b.parametrizations.weight[0]._u, u)
        engine.bind(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        ropt = torch.optim.SGD(ref.parameters(), lr=0.1)
        for _ in range(3):
            opt.zero_grad()
            ropt.zero_grad()
            engine.gradient(inputs=x, targets=y, reduction="mean")
            nn.functional.cross_entropy(ref(x), y).backward()
            got = [p.grad for p in model.parameters()]
            assert relative_error(got, [p.grad for p in ref.parameters()]) < 1e-5
            opt.step()
            ropt.step()
        buffers = dict(ref.named_buffers())
        assert set(dict(model.named_buffers())) == set(buffers)
        for name, b in model.named_buffers():
            assert relative_error([b], [buffers[name]]) < 1e-5, name


class SlowDataset(NoisyDataset):
    def __getitem__(self, i):
        time.sleep(0.02)
        return super().__getitem__(i)


def test_worker_killed_mid_step_is_retried_exactly():
    torch.manual_seed(4)
    model, ds = Unscriptable(), SlowDataset()
    ref_model = copy_of(model)
    with shmgrad.Engine(model=model, loss=smooth_loss, dataset=ds, workers=2) as engine:
        engine.bind(model)
        idx = list(range(40))
        epoch = engine.status().step_epoch
        call = GradientCall(engine, indices=idx, seed=3)
        st = wait_until_busy(engine.name, after_epoch=epoch, slot=1)
        os.kill(st.worker(1).pid, signal.SIGKILL)
        stats = call.result()
        assert stats.retries == 1
        after = engine.status()
        assert (
            after.steps_aborted == 1 and after.step_retries == 1 and after.worker(1).restarts == 1
        )
        want, _ = reference(ref_model, smooth_loss, ds, idx, 3)
        assert relative_error([p.grad for p in model.parameters()], want) < 1e-5


class HangingDataset(NoisyDataset):
    def __getitem__(self, i):
        if i == 5:
            time.sleep(3600)
        return super().__getitem__(i)


def test_hung_worker_ends_in_timeout_and_is_replaced():
    """A worker hung in its step (here a dataset read that never returns) ends the call in
    EngineTimeoutError at its timeout; the coordinator then replaces the worker still busy
    with the abandoned step, and the next call gets the exact gradient from the
    replacement (the engine's only worker: nothing else could have computed it)."""
    torch.manual_seed(3)
    model, ds = Unscriptable(), HangingDataset()
    ref = copy_of(model)
    with shmgrad.Engine(model=model, loss=smooth_loss, dataset=ds, workers=1) as engine:
        engine.bind(model)
        hung_pid = engine.status().worker(0).pid
        t0 = time.monotonic()
        with pytest.raises(shmgrad.EngineTimeoutError, match="did not finish within 2 s"):
            engine.gradient([4, 5, 6], timeout=2, seed=1)
        assert time.monotonic() - t0 < 10
        st = engine.status()
        assert st.steps_aborted == 1 and st.worker(0).pid == hung_pid, st.text
        engine.gradient([1, 2, 3], timeout=60, seed=2)
        st = engine.status()
        assert st.worker(0).restarts == 1 and st.worker(0).pid != hung_pid, st.text
        with pytest.raises(ProcessLookupError):
            os.kill(hung_pid, 0)  # killed and reaped by the coordinator
        want, _ = reference(ref, smooth_loss, ds, [1, 2, 3], 2)
        assert relative_error([p.grad for p in model.parameters()], want) < 1e-5


class DropoutNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 3)
        self.drop = nn.Dropout(0.5)

    def forward(self, x):
        return self.drop(self.fc(x))


def test_eval_mode_of_the_bound_module_reaches_the_workers():
    torch.manual_seed(5)
    model, ds = DropoutNet(), NoisyDataset()
    ref = DropoutNet()
    ref.load_state_dict(model.state_dict())
    with shmgrad.Engine(model=model, loss=smooth_loss, dataset=ds, workers=2) as engine:
        engine.bind(model)
        model.eval()  # dropout off in the workers too: the gradient is deterministic
        ref.eval()
        engine.gradient([1, 2, 3, 4], seed=9)
        want, _ = reference(ref, smooth_loss, ds, [1, 2, 3, 4], 9)
        assert relative_error([p.grad for p in model.parameters()], want) < 1e-5


def test_serve_eager_module_function_and_attach(tmp_path):
    (tmp_path / "eager_job_mod.py").write_text(
        "import torch\nfrom torch import nn\n"
        "class DS(torch.utils.data.Dataset):\n"
        "    def __len__(self): return 30\n"
        "    def __getitem__(self, i):\n"
        "        return torch.full((4,), float(i)) / 30, i % 2\n"
        "def job():\n"
        "    torch.manual_seed(0)\n"
        "    return {'model': nn.Linear(4, 2), 'loss': nn.CrossEntropyLoss(reduction='sum'),\n"
        "            'dataset': DS()}\n"
    )
    import subprocess

    name = f"py{os.getpid()}-serve-eager"
    proc = subprocess.Popen(
        ["shmgrad", "serve", "--eager", "eager_job_mod:job", "--name", name, "--workers", "2"],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        client = shmgrad.attach(name, timeout=60)
        try:
            assert client.status().worker_kind == "eager" and client.dataset_size == 30
            grads = client.gradient_tensors()
            stats = client.gradient([0, 1, 2, 3, 29], seed=1)
            assert stats.num_examples == 5
            import sys

            sys.path.insert(0, str(tmp_path))
            import eager_job_mod

            job = eager_job_mod.job()
            want, _ = reference(job["model"], job["loss"], job["dataset"], [0, 1, 2, 3, 29], 1)
            assert relative_error(grads, want) < 1e-5
        finally:
            client.close()
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, out
    assert not [s for s in segments() if s.endswith(name)]
    # A module that does not exist: a clear error, exit status 1.
    bad = subprocess.run(
        ["shmgrad", "serve", "--eager", "no_such_mod:job", "--name", name],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 1 and "cannot import 'no_such_mod'" in bad.stderr


class BatchNormNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 8)
        self.bn = nn.BatchNorm1d(8)
        self.out = nn.Linear(8, 3)

    def forward(self, x):
        return self.out(torch.relu(self.bn(self.fc(x))))


@pytest.mark.parametrize("mode", ["script", "eager"])
def test_batchnorm_statistics_are_shared_with_the_first_participants_values(mode):
    torch.manual_seed(6)
    model = BatchNormNet()
    ref = BatchNormNet()
    ref.load_state_dict(model.state_dict())
    with shmgrad.Engine(
        model=model, loss="cross_entropy", workers=2, mode=mode, buffers="first"
    ) as engine:
        assert engine.mode == mode
        engine.bind(model)
        for step in range(3):
            x, y = torch.randn(10, 6) + step, torch.randint(0, 3, (10,))
            engine.gradient(inputs=x, targets=y)
            ref.train()
            ref(x[:5])  # the first participant's shard updates the statistics
            assert torch.allclose(model.bn.running_mean, ref.bn.running_mean, atol=1e-6)
            assert torch.allclose(model.bn.running_var, ref.bn.running_var, atol=1e-6)
            assert int(model.bn.num_batches_tracked) == step + 1
        # The bound module evaluates with them, no extra pass; eval mode reaches the
        # workers too (statistics frozen there).
        model.eval()
        ref.eval()
        x = torch.randn(7, 6)
        assert torch.allclose(model(x), ref(x), atol=1e-5)
        before = model.bn.running_mean.clone()
        engine.gradient(inputs=x, targets=torch.zeros(7, dtype=torch.long))
        assert torch.equal(model.bn.running_mean, before)


def test_dataset_spec_is_read_from_shared_memory_by_either_kind_of_worker(npy_dataset):
    # A dataset spec string is loaded into the segment once; eager workers index it there
    # as the TorchScript workers do, so auto mode needs no TorchScript for it.
    import warnings

    from conftest import Cnn, reference_gradient

    spec, x, y = npy_dataset
    torch.manual_seed(0)
    model = Cnn()
    ref_model = __import__("copy").deepcopy(model)
    deprecated = shmgrad._mode.torchscript_deprecated()
    for mode in ("auto", "script"):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            engine = shmgrad.Engine(
                model=model, workers=2, loss="cross_entropy", dataset=spec, mode=mode
            )
        future = [w for w in caught if issubclass(w.category, FutureWarning)]
        with engine:
            if mode == "auto" and deprecated:
                assert engine.mode == "eager" and not future, [str(w.message) for w in future]
            assert engine.status().worker_kind == ("script" if mode == "script" else engine.mode)
            assert engine.dataset_size == len(x)
            engine.bind(model)
            for batch in (1, 7, 120):
                idx = torch.randperm(120)[:batch]
                ref = reference_gradient(ref_model, "cross_entropy", x[idx], y[idx], "mean")
                engine.gradient(idx, reduction="mean")
                assert relative_error([p.grad for p in model.parameters()], ref) < 1e-5, mode
    with pytest.raises(shmgrad.InvalidArgumentError, match="collate_fn"):
        shmgrad.Engine(
            model=model,
            workers=1,
            loss="cross_entropy",
            dataset=spec,
            mode="eager",
            collate_fn=lambda b: b,
        )


def test_auto_modes_reason_is_a_sentence():
    from shmgrad import _mode as eager

    common = dict(model=nn.Linear(2, 2), collate_fn=None, forward=None, loss_names=["mse"])
    mode, why = eager.choose_mode(
        "auto",
        loss=lambda o, t: (o - t).pow(2).sum(),
        dataset=torch.utils.data.TensorDataset(torch.zeros(2, 2)),
        **common,
    )
    assert mode == "eager"
    assert why == (
        "auto: a callable loss and a torch Dataset can run only in Python, so the workers "
        "are eager (Python) workers"
    )
    with pytest.raises(shmgrad.InvalidArgumentError, match=r"cannot take a callable loss: use"):
        eager.choose_mode("script", loss=lambda o, t: o.sum(), dataset=None, **common)


def _numerics_seen():
    """The settings a process computes with."""
    cudnn = torch.backends.cudnn
    return (
        torch.get_float32_matmul_precision(),
        cudnn.allow_tf32,
        cudnn.benchmark,
        cudnn.deterministic,
    )


def test_workers_compute_with_the_trainers_numerics():
    """The trainer's float32 matmul precision and cuDNN settings when the engine starts are
    every worker's (a worker that saw others would round differently)."""
    cudnn = torch.backends.cudnn
    saved = _numerics_seen()
    want = ("medium", False, True, True)

    def forward(model, batch):
        # Read inline: the job's pickle then holds torch.backends.cudnn, a module object of
        # torch's own class that cloudpickle alone cannot pickle.
        seen = (
            torch.get_float32_matmul_precision(),
            torch.backends.cudnn.allow_tf32,
            torch.backends.cudnn.benchmark,
            torch.backends.cudnn.deterministic,
        )
        if seen != want:
            raise RuntimeError(f"the worker computes with {seen}, the trainer with {want}")
        x, y = batch
        return torch.nn.functional.cross_entropy(model(x), y, reduction="sum")

    torch.set_float32_matmul_precision(want[0])
    cudnn.allow_tf32, cudnn.benchmark, cudnn.deterministic = want[1:]
    try:
        model = nn.Linear(4, 3)
        with shmgrad.Engine(
            model=model, workers=2, forward=forward, loss_reduction="sum", mode="eager"
        ) as engine:
            stats = engine.gradient(inputs=torch.randn(6, 4), targets=torch.randint(0, 3, (6,)))
            assert stats.num_examples == 6
    finally:
        torch.set_float32_matmul_precision(saved[0])
        cudnn.allow_tf32, cudnn.benchmark, cudnn.deterministic = saved[1:]


def _buffer_storages(model):
    return {b.untyped_storage().data_ptr() for b in model.buffers()}


def test_a_workers_shared_buffers_are_one_block():
    """A worker's BatchNorm statistics are views of one block laid out as the segment's
    buffer region, so that loading and publishing them is one copy each (on a GPU, one
    transfer a step, not one synchronised copy per buffer)."""

    class TwoNorms(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 6)
            self.bn1, self.bn2 = nn.BatchNorm1d(6), nn.BatchNorm1d(6)
            self.out = nn.Linear(6, 3)

        def forward(self, x):
            return self.out(self.bn2(self.bn1(self.fc(x))))

    def forward(model, batch):
        storages = _buffer_storages(model)
        if len(storages) != 1:
            raise RuntimeError(f"the worker's buffers lie in {len(storages)} storages")
        x, y = batch
        return torch.nn.functional.cross_entropy(model(x), y, reduction="sum")

    torch.manual_seed(0)
    model = TwoNorms()
    assert len(_buffer_storages(model)) == 6  # 2 x (mean, var, count) before
    with shmgrad.Engine(
        model=model, workers=2, forward=forward, loss_reduction="sum", mode="eager"
    ) as engine:
        engine.bind(model)
        x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
        engine.gradient(inputs=x, targets=y)
        assert int(model.bn1.num_batches_tracked) == 1  # published back, in one copy
        assert not torch.equal(model.bn2.running_mean, torch.zeros(6))


class TiedAndPlain(LinearLayers):
    """Linear layers of every kind _direct.py meets: LinearLayers' (plain ones, one without
    a bias, in place too through its own C++ Function, one whose weight is used twice, a
    3-D input it must pass to F.linear), and a subclass it must leave alone."""

    class Scaled(nn.Linear):
        def forward(self, x):
            return super().forward(x) * 0.5

    def __init__(self):
        super().__init__()
        self.scaled = TiedAndPlain.Scaled(16, 16)

    def forward(self, x):
        return self.head(self.scaled(self.body(x)))


@pytest.mark.parametrize("workers,per_pass", [(1, 5), (2, None)])
def test_direct_linear_gives_the_copied_paths_bits(monkeypatch, workers, per_pass):
    """Linear layers computing their gradients straight into the slot (python/shmgrad/
    _direct.py) give the same bits as the write-first copy (SHMGRAD_DIRECT_LINEAR=0), and
    plain PyTorch's gradient, over one shard in passes of 5 (a later pass must add, not
    overwrite) and two workers, two steps each (the second after an optimizer step)."""
    check_direct_linear_bits(monkeypatch, TiedAndPlain, "eager", workers, per_pass, 12)


def test_direct_linear_takes_exact_linear_layers_only():
    """_direct.install patches exact nn.Linear modules of engine parameters, and their
    forward calls the participant's direct_linear only for 2-D float32 inputs outside
    autocast (a stand-in participant records the calls)."""
    from shmgrad import _direct

    class Recorder:
        def __init__(self):
            self.calls = []

        def direct_linear(self, x, w, b, wi, bi):
            self.calls.append((tuple(x.shape), wi, bi))
            return nn.functional.linear(x, w, b)

    model = TiedAndPlain()
    params = list(model.parameters())
    rec = Recorder()
    assert _direct.install(model, params, rec) == 4  # inp, square, no_bias, out; not scaled
    model(torch.randn(4, 12))
    index = {id(p): i for i, p in enumerate(params)}
    w = lambda m: index[id(m.weight)]  # noqa: E731
    assert rec.calls == [
        ((4, 12), w(model.inp), index[id(model.inp.bias)]),
        ((4, 16), w(model.square), index[id(model.square.bias)]),
        ((4, 16), w(model.square), index[id(model.square.bias)]),
        ((4, 16), w(model.no_bias), -1),  # no bias: none passed, no index
    ]  # out's input is 3-D: F.linear
    rec.calls.clear()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(torch.randn(4, 12))
    model.double()(torch.randn(4, 12, dtype=torch.float64))
    assert rec.calls == []


def _caller_loss(out, y):
    """cross_entropy summed over the batch; a batch whose targets say so goes wrong. Its
    error names the Python function below the loss's frame: the runner's call_loss, or,
    called from C++, whatever Python frame was last entered before (the worker's main, the
    trainer's gradient call)."""
    import inspect

    import torch.nn.functional as F

    kind = int(y.min())
    if kind == -1:
        caller = inspect.currentframe().f_back
        raise ValueError(f"a negative target; the frame below the loss is {caller.f_code.co_name}")
    if kind == -2:
        return F.cross_entropy(out, y.clamp(min=0), reduction="none")  # not one number
    if kind == -3:
        return torch.zeros(())  # no gradient to follow
    return F.cross_entropy(out, y, reduction="sum")


def _mean_loss(out, y):
    """A mean the engine does not recognise as one: declared with loss_reduction="mean"."""
    return torch.nn.functional.cross_entropy(out, y) * 1.0


def _placed_engine(model, in_trainer, **options):
    """An eager engine of ``model`` whose steps the trainer computes itself (workers="auto",
    placed in the trainer) or 2 workers do."""
    engine = shmgrad.Engine(
        model=model, workers="auto" if in_trainer else 2, mode="eager", **options
    )
    engine.bind(model)
    if in_trainer:
        engine._trainer.set_placement(0, 1, in_trainer=True)
    return engine


@pytest.mark.parametrize("in_trainer", [False, True], ids=["workers", "trainer"])
def test_the_native_plain_pass_gives_the_python_pass_bits(tmp_path, monkeypatch, in_trainer):
    """A pass that is loss(model(inputs), targets) takes its rows, backward and loss value in
    C++ (python/worker_binding.cc, PlainPass); SHMGRAD_PLAIN_PASS=0 takes the whole pass in
    Python (ShardRunner._compute_pass). Both give the same gradients and losses bit for
    bit: explicit batches in one pass and in passes of 3, indices into a dataset the
    segment holds; a summed loss, a mean (made a sum by the pass's examples) and
    nn.CrossEntropyLoss() (a sum and its count); on 2 workers and in the trainer."""
    g = torch.Generator().manual_seed(7)
    data_x, data_y = torch.randn(30, 12, generator=g), torch.randint(0, 3, (30,), generator=g)
    np.save(tmp_path / "x.npy", data_x.numpy())
    np.save(tmp_path / "y.npy", data_y.numpy())
    spec = f"npy:{tmp_path / 'x.npy'},{tmp_path / 'y.npy'}"
    x, y = data_x[:14] * 1.7, data_y[:14]
    runs = {}
    for plain in ("1", "0"):
        monkeypatch.setenv("SHMGRAD_PLAIN_PASS", plain)
        got = []
        for loss, declared in (
            ("cross_entropy", None),
            (_mean_loss, "mean"),
            (nn.CrossEntropyLoss(), None),
        ):
            torch.manual_seed(0)
            model = LinearLayers()
            with _placed_engine(
                model, in_trainer, loss=loss, loss_reduction=declared, dataset=spec
            ) as engine:
                for call in (
                    dict(inputs=x, targets=y),
                    dict(inputs=x, targets=y, max_examples_per_pass=3),
                    dict(indices=[3, 1, 4, 15, 9, 26, 5, 29]),
                ):
                    stats = engine.gradient(**call, min_examples_per_worker=1)
                    got.append(stats.loss)
                    got.extend(p.grad.clone() for p in model.parameters())
        runs[plain] = got
    assert len(runs["1"]) == len(runs["0"])
    for a, b in zip(runs["1"], runs["0"]):
        if isinstance(a, float):
            assert a == b
        else:
            assert torch.equal(a, b)


@pytest.mark.parametrize("in_trainer", [False, True], ids=["workers", "trainer"])
def test_the_native_plain_pass_reports_errors_as_python_does(monkeypatch, in_trainer):
    """Errors of the plain pass come back as the Python pass's do, whole, and the engine
    goes on: the loss's own exception (its type, message and traceback), a loss that is not
    one number (the runner's TypeError), one that backward cannot follow. The loss is called
    from C++ where the plain pass is on, from the runner's Python where it is off."""
    x = torch.randn(8, 12)
    y = torch.randint(0, 3, (8,))
    for plain in ("1", "0"):
        monkeypatch.setenv("SHMGRAD_PLAIN_PASS", plain)
        torch.manual_seed(0)
        model = LinearLayers()
        with _placed_engine(model, in_trainer, loss=_caller_loss, loss_reduction="sum") as engine:
            with pytest.raises(shmgrad.WorkerError) as info:
                engine.gradient(inputs=x, targets=torch.full((8,), -1))
            text = str(info.value)
            assert info.value.error_type == "ValueError", text
            below = re.search(r"a negative target; the frame below the loss is (\S+)", text)
            assert below is not None, text
            assert (below.group(1) == "call_loss") == (plain == "0"), text
            assert "Traceback" in text and "_caller_loss" in text
            with pytest.raises(shmgrad.WorkerError, match="the loss must be one number"):
                engine.gradient(inputs=x, targets=torch.full((8,), -2))
            with pytest.raises(shmgrad.WorkerError, match="does not require grad"):
                engine.gradient(inputs=x, targets=torch.full((8,), -3))
            stats = engine.gradient(inputs=x, targets=y)
            ref = LinearLayers()
            ref.load_state_dict(model.state_dict())
            want = torch.nn.functional.cross_entropy(ref(x), y, reduction="sum")
            want.backward()
            assert stats.loss == pytest.approx(want.item(), rel=1e-5)
            assert (
                relative_error(
                    [p.grad for p in model.parameters()], [p.grad for p in ref.parameters()]
                )
                < 1e-5
            )
