#!/usr/bin/env python3
"""An unchanged LightningModule trained on Fashion-MNIST, through shmgrad or without it.

``FashionClassifier`` and ``FashionMNIST`` below are plain Lightning: nothing in them knows
about shmgrad. Only the Trainer's ``strategy=`` changes:

* ``--strategy shmgrad``: ``shmgrad.lightning.EngineStrategy(workers=N)``. One trainer
  process runs Lightning's loop (validation, logging, the LR schedule, the optimizer); an
  engine's N eager workers each run ``training_step`` on their share of every batch, and
  their gradients are summed in shared memory into the module's ``.grad``.
* ``--strategy ddp_shmgrad``: N DDP processes (Lightning launches them) whose gradients
  are all-reduced by shmgrad's torch.distributed backend (``process_group_backend=
  "shmgrad"``); the registered name where this shmgrad has it, else that DDPStrategy.
* ``--strategy auto``: Lightning's plain single-process run.

The global batch is ``--batch-size`` every way (DDP's processes take a share each), so the
three train the same model on the same batches. Lightning validates on the test split
after each epoch; at the end the first process prints the trained model's accuracy on
all 10000 test images, the time ``fit`` took and the part of it the training loop took
(the rest is starting up: the engine's workers, or DDP's processes, import Lightning).

Run: .venv/bin/python examples/lightning_mnist.py [--strategy shmgrad|ddp_shmgrad|auto]
     [--workers N] [--epochs E] [--limit-train-batches B] [--batch-size B] [--lr LR]
"""

import argparse
import os
import sys
import time
import warnings

import torch
import torch.nn.functional as F
import pytorch_lightning as pl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import shmgrad.lightning  # noqa: E402  (registers strategy="shmgrad")
from fashion_mnist import FashionCNN, accuracy, load_split  # noqa: E402

STRATEGIES = ("shmgrad", "ddp_shmgrad", "auto")


class FashionClassifier(pl.LightningModule):
    """A CNN classifier the plain Lightning way: a mean loss, logged; SGD with momentum
    and a one-cycle LR schedule stepped every batch."""

    def __init__(self, lr: float = 0.05):
        super().__init__()
        self.save_hyperparameters()
        self.net = FashionCNN()

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        self.log("val_loss", F.cross_entropy(logits, y), prog_bar=True)
        self.log("val_acc", (logits.argmax(1) == y).float().mean(), prog_bar=True)

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)
        steps = self.trainer.estimated_stepping_batches
        schedule = torch.optim.lr_scheduler.OneCycleLR(opt, self.hparams.lr, total_steps=steps)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


class FashionMNIST(pl.LightningDataModule):
    """Debian's Fashion-MNIST (/usr/share/datasets/fashion-mnist): 60000 training images,
    shuffled, and the 10000 test images for validation. ``batch_size`` is the global
    batch: a DDP process loads its share."""

    def __init__(self, batch_size: int = 128):
        super().__init__()
        self.batch_size = batch_size

    def setup(self, stage):
        self.train_set = torch.utils.data.TensorDataset(*load_split("train"))
        self.test_set = torch.utils.data.TensorDataset(*load_split("test"))

    def train_dataloader(self):
        per_process = self.batch_size // self.trainer.world_size
        return torch.utils.data.DataLoader(self.train_set, batch_size=per_process, shuffle=True)

    def val_dataloader(self):
        return torch.utils.data.DataLoader(self.test_set, batch_size=1000)


def strategy_for(name: str, workers: int):
    """(the Trainer's strategy, its devices) for a --strategy name."""
    if name == "shmgrad":
        return shmgrad.lightning.EngineStrategy(workers=workers), 1
    if name == "ddp_shmgrad":
        from pytorch_lightning.strategies import DDPStrategy, StrategyRegistry

        if "ddp_shmgrad" in StrategyRegistry:
            return "ddp_shmgrad", workers
        return DDPStrategy(process_group_backend="shmgrad"), workers
    return "auto", 1


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--strategy", choices=STRATEGIES, default="shmgrad")
    parser.add_argument("--workers", type=int, default=2, help="shmgrad workers or DDP ranks")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--limit-train-batches", type=int, default=100)
    parser.add_argument("--batch-size", type=int, default=128, help="the global batch")
    parser.add_argument("--lr", type=float, default=0.05)
    args = parser.parse_args()

    pl.seed_everything(0, verbose=False)
    strategy, devices = strategy_for(args.strategy, args.workers)
    timer = pl.callbacks.Timer()  # the training loop's time: start-ups not included
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_epochs=args.epochs,
        limit_train_batches=args.limit_train_batches,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[timer],
    )
    model, data = FashionClassifier(lr=args.lr), FashionMNIST(args.batch_size)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", ".*does not have many workers.*")  # in-memory data
        warnings.filterwarnings("ignore", ".*sync_dist=True.*")  # DDP: each validates a share
        start = time.perf_counter()
        trainer.fit(model, data)
        seconds = time.perf_counter() - start
    train = timer.time_elapsed("train")
    if trainer.is_global_zero:
        images = args.epochs * args.limit_train_batches * args.batch_size
        processes = f"{args.workers} workers" if devices > 1 or args.strategy == "shmgrad" else ""
        print(
            f"strategy {args.strategy} ({type(trainer.strategy).__name__}"
            f"{', ' + processes if processes else ''}): test accuracy "
            f"{100 * accuracy(model, *load_split('test')):.2f}% after {args.epochs} epoch(s) "
            f"of {args.limit_train_batches} batches of {args.batch_size}; fit {seconds:.1f} s, "
            f"of which the training loop {train:.1f} s ({images / train:.0f} images/s, "
            "validation included)"
        )


if __name__ == "__main__":
    main()
