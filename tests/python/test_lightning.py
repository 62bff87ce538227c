"""Lightning and shmgrad. ``strategy="shmgrad"`` (shmgrad.lightning.EngineStrategy) runs an
unchanged LightningModule against Lightning's own single-process run of it: the same
parameters after steps over uneven shards (with gradient clipping, an LR scheduler and a
loss that reads the trainer's epoch and step in the workers), a checkpoint resumed as one
run, a worker SIGKILLed mid-step, what it refuses and warns about, and its engine stopped
after an error. docs/LIGHTNING.md's manual recipe, read from the document and run as
written, against the same reference; and the obvious port (the engine called from
training_step, nothing overridden), which trains nothing, warns."""

import ast
import copy
import inspect
import os
import re
import signal
import threading
import time
import warnings

import pytest
import torch

import shmgrad
from conftest import Mlp, python_blocks

DOC = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "LIGHTNING.md")
STEPS = 4
BATCH = 8

pl = pytest.importorskip("pytorch_lightning")


def _recipe():
    blocks = [code for _, _, code in python_blocks("docs/LIGHTNING.md")]
    (block,) = [b for b in blocks if "class EngineClassifier" in b]  # the manual recipe
    namespace = {}
    exec(compile(block, DOC, "exec"), namespace)
    return namespace["EngineClassifier"]


class PlainClassifier(pl.LightningModule):
    """The same model and optimizer, trained the plain Lightning way."""

    def __init__(self, model, lr=0.05):
        super().__init__()
        self.model, self.lr = model, lr

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.cross_entropy(self.model(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.model.parameters(), lr=self.lr, momentum=0.9)


class ObviousPort(PlainClassifier):
    """training_step calls the engine and returns its loss; zero_grad and backward are
    Lightning's own."""

    def __init__(self, model, engine):
        super().__init__(model)
        self.engine = engine

    def training_step(self, batch, batch_idx):
        x, y = batch
        stats = self.engine.gradient(inputs=x, targets=y)
        return torch.tensor(stats.loss, requires_grad=True)


def _loader():
    g = torch.Generator().manual_seed(0)
    x, y = (
        torch.randn(STEPS * BATCH, 20, generator=g),
        torch.randint(0, 5, (STEPS * BATCH,), generator=g),
    )
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=BATCH)


def _fit(module, **trainer_args):
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=STEPS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **trainer_args,
    )
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", module="pytorch_lightning")  # its advice on workers
        warnings.filterwarnings("ignore", module="lightning_fabric")
        trainer.fit(module, _loader())
    return trainer


@pytest.mark.parametrize("clip", [None, 0.05], ids=["plain", "gradient-clipping"])
def test_the_docs_recipe_trains_as_lightning_does(clip):
    torch.manual_seed(0)
    net = Mlp()
    ref = copy.deepcopy(net)
    start = [p.detach().clone() for p in net.parameters()]
    module = _recipe()(net, workers=2)
    _fit(module, gradient_clip_val=clip)
    assert module.engine is None  # teardown closed it
    _fit(PlainClassifier(ref), gradient_clip_val=clip)
    moved = max(float((a - b).abs().max()) for a, b in zip(ref.parameters(), start))
    assert moved > 1e-3  # the reference trained
    for (name, p), q in zip(net.named_parameters(), ref.parameters()):
        assert torch.allclose(p, q, rtol=1e-5, atol=1e-6), name


def test_the_obvious_port_warns_that_it_trains_nothing():
    torch.manual_seed(0)
    net = Mlp()
    before = [p.detach().clone() for p in net.parameters()]
    with shmgrad.Engine(model=net, workers=2, loss=torch.nn.CrossEntropyLoss()) as engine:
        engine.bind(net)
        with pytest.warns(RuntimeWarning, match=r"set to None.*strategy='shmgrad'.*optimizer_zero"):
            _fit(ObviousPort(net, engine))
    assert all(torch.equal(a, b) for a, b in zip(before, net.parameters()))


# -- strategy="shmgrad" ----------------------------------------------------------------
from shmgrad.errors import InvalidArgumentError, WorkerError  # noqa: E402
from shmgrad.lightning import EngineStrategy  # noqa: E402  (registers "shmgrad")

ODD_BATCH = 7  # over 2 workers: shards of 4 and 3
EXAMPLES = 20  # batches of 7, 7 and 6 an epoch
KILL_AT = 2  # the batch during which a worker is killed
SLOW_S = 0.5  # how long each worker's shard of that batch takes (the kill lands inside)


class Classifier(pl.LightningModule):
    """An unchanged LightningModule: a mean cross entropy, logged, scaled by the trainer's
    epoch and step (the workers must see the trainer's), SGD with momentum and, with
    ``schedule``, an LR that halves every step."""

    def __init__(
        self, model, *, schedule=True, manual=False, log_other=False, fail_at=None, slow_at=None
    ):
        super().__init__()
        self.model, self.schedule = model, schedule
        self.automatic_optimization = not manual
        self.log_other, self.fail_at, self.slow_at = log_other, fail_at, slow_at

    def training_step(self, batch, batch_idx):
        if batch_idx == self.fail_at:
            raise ValueError(f"no batch {batch_idx} for me")
        if batch_idx == self.slow_at:
            time.sleep(SLOW_S)  # only the workers run this batch
        x, y = batch
        out = self.model(x)
        scale = 1 + 0.1 * self.global_step + 0.5 * self.current_epoch
        loss = torch.nn.functional.cross_entropy(out, y) * scale
        self.log("train_loss", loss)
        if self.log_other:
            self.log("train_acc", (out.argmax(1) == y).float().mean())
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", torch.nn.functional.cross_entropy(self.model(x), y))

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.model.parameters(), lr=0.05, momentum=0.9)
        if not self.schedule:
            return opt
        halving = torch.optim.lr_scheduler.StepLR(opt, 1, 0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": halving, "interval": "step"}}


def _data(examples=EXAMPLES):
    g = torch.Generator().manual_seed(1)
    return torch.utils.data.TensorDataset(
        torch.randn(examples, 20, generator=g), torch.randint(0, 5, (examples,), generator=g)
    )


def _strategy_fit(module, strategy, *, examples=EXAMPLES, ckpt_path=None, **trainer_args):
    """``trainer.fit`` of ``module`` (batches of 7, a validation loader) with ``strategy``;
    returns the trainer."""
    args = dict(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=1,
        num_sanity_val_steps=0,
    )
    args.update(trainer_args)
    trainer = pl.Trainer(strategy=strategy, **args)
    loader = torch.utils.data.DataLoader(_data(examples), batch_size=ODD_BATCH)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", module="pytorch_lightning")  # its advice on workers
        warnings.filterwarnings("ignore", module="lightning_fabric")
        trainer.fit(module, loader, loader, ckpt_path=ckpt_path)
    return trainer


def _assert_same_parameters(a, b):
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.allclose(p, q, rtol=1e-5, atol=1e-6), name


class GradNorms(pl.Callback):
    """The gradient's norm before each optimizer step (before clipping)."""

    def __init__(self):
        self.norms = []

    def on_before_optimizer_step(self, trainer, module, optimizer):
        grads = [p.grad for p in module.parameters() if p.grad is not None]
        self.norms.append(float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))))


@pytest.mark.parametrize(
    "options",
    [
        {"max_steps": 4},
        {"max_steps": 3, "gradient_clip_val": 0.05, "accumulate_grad_batches": 2},
    ],
    ids=["plain", "clipping-accumulation"],
)
def test_strategy_trains_as_lightning_does(options):
    """Steps over 2 epochs of batches of 7, 7 and 6 (accumulated: 7 + 7, then the epoch's
    short window of 6, then 7 + 7), the LR halving every step."""
    torch.manual_seed(0)
    net = Mlp()
    ref = copy.deepcopy(net)
    start = [p.detach().clone() for p in net.parameters()]
    strategy, norms = EngineStrategy(workers=2), GradNorms()
    trainer = _strategy_fit(Classifier(net), strategy, callbacks=[norms], **options)
    assert strategy.engine is None  # teardown stopped it
    # The last batch (7) was split 4 and 3: the mean over the batch, not of the shards'.
    assert sorted(strategy.last_stats.worker_examples) == [3, 4]
    assert len(norms.norms) == options["max_steps"]
    if "gradient_clip_val" in options:  # clipping had gradients to clip
        assert min(norms.norms) > options["gradient_clip_val"]
    plain = _strategy_fit(Classifier(ref), "auto", **options)
    moved = max(float((a.detach() - b).abs().max()) for a, b in zip(ref.parameters(), start))
    assert moved > 1e-3  # the reference trained
    _assert_same_parameters(net, ref)
    assert trainer.global_step == plain.global_step == options["max_steps"]
    assert trainer.current_epoch == plain.current_epoch
    for key in ("train_loss", "val_loss"):  # logged as Lightning logs them
        a, b = trainer.callback_metrics[key], plain.callback_metrics[key]
        assert torch.allclose(a, b, rtol=1e-5), (key, a, b)


class TinyData(pl.LightningDataModule):
    def train_dataloader(self):
        return torch.utils.data.DataLoader(_data(), batch_size=ODD_BATCH)

    def val_dataloader(self):
        return torch.utils.data.DataLoader(_data(), batch_size=ODD_BATCH)


def test_the_docs_one_line_way_runs_as_written(tmp_path, monkeypatch):
    with open(DOC) as f:
        doc = f.read()
    (block,) = [b for _, _, b in python_blocks("docs/LIGHTNING.md") if "strategy=" in b]
    monkeypatch.chdir(tmp_path)  # the Trainer's default logger and checkpoints go here
    torch.manual_seed(0)
    net = Mlp()
    start = [p.detach().clone() for p in net.parameters()]
    namespace = {"model": Classifier(net), "datamodule": TinyData()}
    threads = torch.get_num_threads()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", module="pytorch_lightning")
        warnings.filterwarnings("ignore", module="lightning_fabric")
        exec(compile(block, DOC, "exec"), namespace)
    trainer = namespace["trainer"]
    assert isinstance(trainer.strategy, EngineStrategy)
    assert trainer.strategy.workers == shmgrad.lightning.default_workers()
    assert trainer.global_step == 6 and trainer.strategy.engine is None
    assert torch.get_num_threads() == threads  # the engine's close gave them back
    assert any(not torch.equal(p, q) for p, q in zip(net.parameters(), start))
    # The signature shown is the code's: names and defaults.
    (shown,) = re.findall(r"^    (EngineStrategy\(.*?\))$", doc, re.M | re.S)
    args = ast.parse(f"def f{shown[len('EngineStrategy') :]}: pass").body[0].args
    documented = {a.arg: ast.literal_eval(d) for a, d in zip(args.kwonlyargs, args.kw_defaults)}
    params = inspect.signature(EngineStrategy.__init__).parameters.values()
    actual = {p.name: p.default for p in params if p.kind == p.KEYWORD_ONLY}
    assert documented == actual and args.kwarg.arg == "engine_options" and not args.args


def test_strategy_is_registered_and_refuses_what_it_cannot_run():
    trainer = pl.Trainer(strategy="shmgrad", accelerator="cpu", logger=False)
    assert isinstance(trainer.strategy, EngineStrategy) and trainer.strategy.workers >= 1
    for args, fix in [
        (dict(devices=2), r"devices=1.*EngineStrategy\(workers=N\)"),
        (dict(num_nodes=2), r"drop num_nodes="),
        (dict(precision="bf16-mixed"), r"precision='32-true'"),
    ]:
        with pytest.raises(InvalidArgumentError, match=fix):
            pl.Trainer(strategy=EngineStrategy(workers=2), accelerator="cpu", **args)
    with pytest.raises(InvalidArgumentError, match="unexpected options loss"):
        EngineStrategy(workers=2, loss="cross_entropy")
    assert EngineStrategy(workers=2, trainer_threads=None).engine_options["trainer_threads"] is None


def test_manual_optimization_is_refused_naming_the_fix():
    strategy = EngineStrategy(workers=2)
    with pytest.raises(InvalidArgumentError, match=r"manual optimization.*automatic.*LIGHTNING"):
        _strategy_fit(Classifier(Mlp(), manual=True), strategy, max_steps=1)
    assert strategy.engine is None


@pytest.mark.full  # long: CI stays under 40 minutes
def test_checkpoint_resumes_as_one_uninterrupted_run(tmp_path):
    torch.manual_seed(0)
    whole = Mlp()
    # Two epochs of two batches (7 and 7), the LR halving every step, checkpointed after
    # each epoch ...
    every_epoch = pl.callbacks.ModelCheckpoint(dirpath=tmp_path, save_top_k=-1)
    _strategy_fit(
        Classifier(whole),
        EngineStrategy(workers=2),
        examples=14,
        max_epochs=2,
        enable_checkpointing=True,
        callbacks=[every_epoch],
    )
    first = tmp_path / "epoch=0-step=2.ckpt"
    assert sorted(os.listdir(tmp_path)) == [first.name, "epoch=1-step=4.ckpt"]
    # ... and resumed from the first epoch's checkpoint into a fresh module.
    resumed = Classifier(Mlp())  # other initial values: all from the checkpoint
    trainer = _strategy_fit(
        resumed, EngineStrategy(workers=2), examples=14, max_epochs=2, ckpt_path=str(first)
    )
    assert trainer.global_step == 4
    assert trainer.lr_scheduler_configs[0].scheduler.get_last_lr() == [0.05 / 16]
    after_first = torch.load(first, weights_only=True)["state_dict"]["model.fc1.weight"]
    assert not torch.equal(after_first, whole.fc1.weight)  # the second epoch trained
    for (name, p), q in zip(resumed.model.named_parameters(), whole.parameters()):
        assert torch.equal(p, q), name


class KillWorkerMidStep(pl.Callback):
    """At batch ``at``, SIGKILLs worker 1 once it is busy with that batch's step, from a
    thread (the trainer waits in gradient() meanwhile); records what happened."""

    def __init__(self, at):
        self.at, self.killed, self.retries, self.thread = at, None, None, None

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        if batch_idx != self.at:
            return
        engine = trainer.strategy.engine
        epoch, name = engine.status().step_epoch, engine.name
        self.thread = threading.Thread(target=self._kill, args=(name, epoch), daemon=True)
        self.thread.start()

    def _kill(self, name, epoch):
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            worker = shmgrad.read_status(name).worker(1)
            if worker is not None and worker.busy_epoch > epoch:
                os.kill(worker.pid, signal.SIGKILL)
                self.killed = worker.pid
                return
            time.sleep(0.005)

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if batch_idx == self.at:
            self.thread.join(60)
            self.retries = trainer.strategy.last_stats.retries
            self.after = trainer.strategy.engine.status()


def test_a_worker_killed_mid_step_is_replaced_and_training_goes_on():
    torch.manual_seed(0)
    net = Mlp()
    ref = copy.deepcopy(net)
    kill = KillWorkerMidStep(KILL_AT)
    _strategy_fit(
        Classifier(net, slow_at=KILL_AT),
        EngineStrategy(workers=2),
        max_steps=4,
        callbacks=[kill],
    )
    assert kill.killed is not None, "worker 1 was never seen busy with the batch"
    assert kill.retries == 1  # the step lost a worker and ran again
    assert kill.after.step_retries == 1 and kill.after.worker(1).pid != kill.killed
    _strategy_fit(Classifier(ref), "auto", max_steps=4)
    _assert_same_parameters(net, ref)


def test_other_logged_values_warn_and_a_failing_step_stops_the_engine():
    strategy = EngineStrategy(workers=2)
    module = Classifier(Mlp(), log_other=True, fail_at=1)
    with pytest.warns(
        UserWarning,
        match=r"logs 'train_acc'.*names training_step gives it: "
        r"'train_loss'",
    ):
        with pytest.raises(WorkerError, match="no batch 1 for me"):
            _strategy_fit(module, strategy, max_steps=3)
    assert strategy.engine is None  # stopped by Lightning's teardown after the error


def test_lightning_pytorch_gets_a_strategy_class_of_its_own():
    L = pytest.importorskip("lightning.pytorch")
    cls = shmgrad.lightning.strategy_class("lightning.pytorch")
    assert issubclass(cls, L.strategies.SingleDeviceStrategy) and cls is not EngineStrategy
    trainer = L.Trainer(strategy="shmgrad", accelerator="cpu", logger=False)
    assert isinstance(trainer.strategy, cls)


# ------------------------------------------------------------ DDP over the shmgrad backend

DDP_SCRIPT = """
import json, os, sys
import torch, pytorch_lightning as pl
import shmgrad, shmgrad.lightning
from pytorch_lightning.strategies import DDPStrategy


class Net(pl.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.model = torch.nn.Sequential(
            torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.cross_entropy(self.model(x), y)
        self.log("train_loss", loss, sync_dist=True)  # an all-reduce with AVG
        self.log("examples", float(len(x)), sync_dist=True, reduce_fx="sum")
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


mode, out = sys.argv[1], sys.argv[2]
strategy, devices, batch = {
    "single": ("auto", 1, 8),
    "word": ("ddp_shmgrad", 2, 4),
    "class": (DDPStrategy(process_group_backend="shmgrad"), 2, 4),
}[mode]
g = torch.Generator().manual_seed(1)
data = torch.utils.data.TensorDataset(torch.randn(64, 6, generator=g),
                                      torch.randint(0, 3, (64,), generator=g))
if devices > 1:  # rank r's batch i: examples 8 i + 4 r .. 8 i + 4 r + 3, of the same batches
    rank = int(os.environ.get("LOCAL_RANK", "0"))
    data = torch.utils.data.Subset(data, [i for i in range(64) if (i % 8) // 4 == rank])
loader = torch.utils.data.DataLoader(data, batch_size=batch, shuffle=False)


def make(steps, **options):
    return pl.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_steps=steps,
                      logger=False, enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, use_distributed_sampler=False, **options)


net = Net()
if len(sys.argv) > 3:  # an epoch of 2 batches, checkpointed, a fresh module resumed for one more
    trainer = make(2, limit_train_batches=2)
    trainer.fit(net, loader)
    ckpt = os.path.join(sys.argv[3], "epoch0.ckpt")
    trainer.save_checkpoint(ckpt)  # every rank calls it; rank 0 writes
    net = Net()
    with torch.no_grad():
        for p in net.parameters():
            p.add_(1.0)  # other values: all must come from the checkpoint
    trainer = make(4, limit_train_batches=2)
    trainer.fit(net, loader, ckpt_path=ckpt)
else:
    trainer = make(4)
    trainer.fit(net, loader)
if trainer.global_rank == 0:
    backend = (torch.distributed.get_backend() if torch.distributed.is_initialized()
               else None)
    with open(out, "w") as f:
        json.dump({"backend": backend, "loss": float(trainer.callback_metrics["train_loss"]),
                   "params": [p.detach().flatten().tolist() for p in net.parameters()]}, f)
"""


def _run_ddp_script(tmp_path, modes, *, checkpoints=False):
    """DDP_SCRIPT once for each of ``modes`` (Lightning launches its ranks), each run with a
    folder of its own for checkpoints with ``checkpoints``: mode -> the run's result."""
    import json
    import subprocess
    import sys

    script = tmp_path / "ddp.py"
    script.write_text(DDP_SCRIPT)
    results = {}
    for mode in modes:
        out, extra = tmp_path / f"{mode}.json", []
        if checkpoints:
            (tmp_path / mode).mkdir()
            extra = [str(tmp_path / mode)]
        proc = subprocess.run(
            [sys.executable, str(script), mode, str(out), *extra],
            capture_output=True,
            text=True,
            timeout=300,
            cwd=tmp_path,
            env={**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"},
        )
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        results[mode] = json.loads(out.read_text())
    return results


def _assert_shmgrad_ends_where_single_does(results, mode):
    assert results[mode]["backend"] == "shmgrad"
    for a, b in zip(results[mode]["params"], results["single"]["params"]):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode", ["word", pytest.param("class", marks=pytest.mark.full)])
def test_ddp_over_the_shmgrad_backend_trains_as_one_process(tmp_path, mode):
    """strategy="ddp_shmgrad" and DDPStrategy(process_group_backend="shmgrad"): two DDP
    processes (Lightning launches them) on interleaved halves of each batch end where one
    process on the whole batches does, with sync_dist logging through the backend."""
    results = _run_ddp_script(tmp_path, ("single", mode))
    _assert_shmgrad_ends_where_single_does(results, mode)
    # The last step's logged loss: the mean of the two ranks' means = the batch's mean.
    assert abs(results[mode]["loss"] - results["single"]["loss"]) < 1e-5


@pytest.mark.full  # long: CI stays under 40 minutes
def test_ddp_shmgrad_checkpoint_and_resume_as_lightning_on_one_device(tmp_path):
    """strategy="ddp_shmgrad": an epoch of 2 steps, a checkpoint, a fresh module (other
    values) resumed from it for a second epoch, ends where Lightning's single-device run
    does the same (parameters and optimizer state from the checkpoint)."""
    results = _run_ddp_script(tmp_path, ("single", "word"), checkpoints=True)
    for mode in results:
        assert (tmp_path / mode / "epoch0.ckpt").exists()
    _assert_shmgrad_ends_where_single_does(results, "word")
