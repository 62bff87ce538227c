"""Where a step of docs/LIGHTNING.md's strategy="shmgrad" and of its manual recipe goes,
against plain Lightning and a plain PyTorch loop in the same run: a 4-layer CNN on
Fashion-MNIST-shaped batches of 128 (random data), plain runs with 2 threads, the
engines with 2 workers of 1 thread; rounds interleaved, medians per step. Run it with
the heap settings every system gets:

    env $(.venv/bin/python -c 'import shmgrad; print(" ".join(f"{k}={v}" for k, v in
        shmgrad.heap_environment().items()))') .venv/bin/python tools/lightning_step_cost.py

Needs pytorch-lightning (tools/requirements.txt). Prints ms per step, the ratio to the
plain loop, and the engine's own breakdown with and without an optimizer step between
two gradient() calls (the batch's copy, the workers' wake-up)."""

import statistics
import time
import warnings

import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch import nn

import shmgrad
from shmgrad.lightning import EngineStrategy

B, STEPS, ROUNDS, WARMUP = 128, 60, 3, 5


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.c1, self.c2 = nn.Conv2d(1, 16, 3, padding=1), nn.Conv2d(16, 32, 3, padding=1)
        self.f1, self.f2 = nn.Linear(32 * 7 * 7, 128), nn.Linear(128, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.c1(x)), 2)
        x = F.max_pool2d(F.relu(self.c2(x)), 2)
        return self.f2(F.relu(self.f1(x.flatten(1))))


class Plain(pl.LightningModule):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.model(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.model.parameters(), lr=0.01)


class Recipe(Plain):
    """docs/LIGHTNING.md's recipe around an engine started outside."""

    def __init__(self, model, engine):
        super().__init__(model)
        self.engine = engine

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.tensor(self.engine.gradient(inputs=x, targets=y).loss)

    def backward(self, loss, *args, **kwargs):
        pass

    def optimizer_zero_grad(self, epoch, batch_idx, optimizer):
        pass


class StepTimer(pl.Callback):
    def __init__(self):
        self.seconds, self._start = [], None

    def on_train_batch_start(self, *args):
        self._start = time.perf_counter()

    def on_train_batch_end(self, *args):
        self.seconds.append(time.perf_counter() - self._start)


def median_ms(seconds):
    return statistics.median(seconds[WARMUP:]) * 1e3


def plain_loop(x, y):
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    seconds = []
    for i in range(STEPS):
        start = time.perf_counter()
        opt.zero_grad()
        F.cross_entropy(model(x[i * B : (i + 1) * B]), y[i * B : (i + 1) * B]).backward()
        opt.step()
        seconds.append(time.perf_counter() - start)
    return median_ms(seconds)


def lightning(module, data, strategy="auto"):
    timer = StepTimer()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=strategy,
        max_steps=STEPS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[timer],
    )
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=B))
    return median_ms(timer.seconds)


def engine_loop(engine, opt, x, y, *, step):
    """gradient() back to back, or with the optimizer's step between two calls."""
    rows = []
    for i in range(STEPS):
        start = time.perf_counter()
        stats = engine.gradient(inputs=x[i * B : (i + 1) * B], targets=y[i * B : (i + 1) * B])
        if step:
            opt.step()
        rows.append(
            (
                time.perf_counter() - start,
                max(stats.compute_seconds),
                stats.wake_seconds,
                stats.prepare_seconds,
            )
        )
    return [median_ms([r[k] for r in rows]) for k in range(4)]


def main():
    warnings.filterwarnings("ignore")
    torch.set_num_threads(2)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(B * STEPS, 1, 28, 28, generator=g)
    y = torch.randint(0, 10, (B * STEPS,), generator=g)
    data = torch.utils.data.TensorDataset(x, y)
    systems = ("plain loop", "plain Lightning", "engine loop", "recipe", "strategy")
    results = {k: [] for k in systems}
    breakdown = {False: [], True: []}
    model = Net()
    with shmgrad.Engine(model=model, workers=2, loss=nn.CrossEntropyLoss()) as engine:
        engine.bind(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        for _ in range(ROUNDS):
            results["plain loop"].append(plain_loop(x, y))
            results["plain Lightning"].append(lightning(Plain(Net()), data))
            for step in (False, True):
                breakdown[step].append(engine_loop(engine, opt, x, y, step=step))
            results["engine loop"].append(breakdown[True][-1][0])
            results["recipe"].append(lightning(Recipe(model, engine), data))
            # Its own engine of 2 workers of 1 thread, started for each fit (not timed).
            results["strategy"].append(lightning(Plain(Net()), data, EngineStrategy(workers=2)))
    base = statistics.median(results["plain loop"])
    for name, values in results.items():
        ms = statistics.median(values)
        print(f"{name:16s} {ms:7.2f} ms/step  {ms / base:5.2f}x the plain loop")
    for step, rows in breakdown.items():
        call, compute, wake, prepare = (statistics.median(r[k] for r in rows) for k in range(4))
        print(
            f"gradient() {'after an optimizer step' if step else 'back to back':24s}: "
            f"{call:6.2f} ms, slowest worker's compute {compute:6.2f}, last worker's start "
            f"{wake:5.2f} after the publish, the batch's copy {prepare:5.2f}"
        )


if __name__ == "__main__":
    main()
