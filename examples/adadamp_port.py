#!/usr/bin/env python3
"""adadamp's Dask MNIST example, written against shmgrad.

adadamp (github.com/stsievert/adadamp) trains PyTorch's MNIST example network on a Dask
cluster (``DaskBaseDamper(module=Net, loss=nn.NLLLoss, optimizer=optim.Adadelta,
optimizer__lr=1.0, batch_size=...)`` on ``datasets.MNIST`` with ToTensor and
Normalize((0.1307,), (0.3081,))): every step ships the model to the Dask workers, each
task deep-copies it and computes the gradient of its shard, and the gradients are summed
and sent back. Here an engine's eager workers do the same with the model's parameters
and gradients in shared memory. Everything else is PyTorch's MNIST example as it is: the
network (conv 1->32->64, dropout, fc 9216->128->10, log_softmax), NLLLoss, Adadelta with
lr 1.0 and the per-epoch StepLR(gamma=0.7), batch 1024.

The lines that differ from a plain PyTorch loop:

    # plain PyTorch                              # shmgrad
    loss_fn = nn.NLLLoss()                       loss_fn = nn.NLLLoss(reduction="sum")
                                                 engine = shmgrad.Engine(model=model,
                                                     loss=loss_fn, dataset=train_set,
                                                     workers=2)
                                                 engine.bind(model)
    loader = DataLoader(train_set,               batches = torch.randperm(
                 batch_size=1024, shuffle=True)      len(train_set)).split(1024)
    for x, y in loader:                          for idx in batches:
        optimizer.zero_grad()
        loss_fn(model(x), y).backward()              engine.gradient(idx, reduction="mean")
        optimizer.step()                             optimizer.step()

The loss is summed over the batch (each worker sums its shard's; the engine adds them and
``reduction="mean"`` divides by the batch), the model is bound once (its parameters
become views of the shared parameters, its ``.grad`` of the reduced gradient), and the
loop sends indices: the workers apply the dataset's transforms themselves.

Data: there is no MNIST package in Debian 12, so this runs on Fashion-MNIST (Debian's
dataset-fashion-mnist; the same 28x28 grayscale images, 10 classes, 60000 + 10000),
loaded with examples/fashion_mnist.py and served like torchvision's datasets (a PIL
image through ToTensor and Normalize); the MNIST example's normalisation constants are
kept unchanged, to change nothing but what shmgrad needs.

By default it stops after --max-steps 40 steps (of the 59 in an epoch), to stay short.
Measured on a 2-vCPU VM (AMD EPYC, Debian 12, torch 1.13.1 CPU) that other people's
work shared, with the defaults (2 eager workers): test accuracy 77.62% after 40 steps,
688 examples/s, 77 s in all.

Run: .venv/bin/python examples/adadamp_port.py [--epochs E] [--max-steps S] [--workers N]
"""

import argparse
import os
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
from torch.optim.lr_scheduler import StepLR
from torchvision import transforms

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import shmgrad  # noqa: E402
from fashion_mnist import accuracy, load_split  # noqa: E402
from train_augmented import TransformedFashionMNIST, as_images  # noqa: E402

MEAN, STD = 0.1307, 0.3081  # the MNIST example's, kept


class Net(nn.Module):
    """PyTorch's MNIST example network (examples/mnist/main.py), as adadamp uses it."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, 1)
        self.conv2 = nn.Conv2d(32, 64, 3, 1)
        self.dropout1 = nn.Dropout(0.25)
        self.dropout2 = nn.Dropout(0.5)
        self.fc1 = nn.Linear(9216, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x):
        x = F.relu(self.conv1(x))
        x = F.relu(self.conv2(x))
        x = F.max_pool2d(x, 2)
        x = torch.flatten(self.dropout1(x), 1)
        x = self.dropout2(F.relu(self.fc1(x)))
        return F.log_softmax(self.fc2(x), dim=1)


def main(argv=None):
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument(
        "--max-steps",
        type=int,
        default=40,
        help="stop after this many steps in all (default 40; 0: no limit)",
    )
    ap.add_argument("--batch-size", type=int, default=1024)
    ap.add_argument("--lr", type=float, default=1.0)
    ap.add_argument("--gamma", type=float, default=0.7)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args(argv)

    torch.manual_seed(args.seed)
    torch.set_num_threads(1)  # the trainer steps the optimizer; the workers do the rest
    transform = transforms.Compose([transforms.ToTensor(), transforms.Normalize((MEAN,), (STD,))])
    x, y = load_split("train")
    train_set = TransformedFashionMNIST(as_images(x), y.numpy(), transform)
    test_x, test_y = load_split("test")
    test_x = (test_x - MEAN) / STD  # what the transform does to a test image

    model = Net()
    loss_fn = nn.NLLLoss(reduction="sum")  # shmgrad: summed
    with shmgrad.Engine(
        model=model,
        loss=loss_fn,
        dataset=train_set,  # shmgrad
        workers=args.workers,
    ) as engine:
        engine.bind(model)  # shmgrad
        optimizer = optim.Adadelta(model.parameters(), lr=args.lr)
        scheduler = StepLR(optimizer, step_size=1, gamma=args.gamma)
        print(
            f"adadamp's MNIST example on Fashion-MNIST: {args.workers} {engine.mode} workers, "
            f"batch {args.batch_size}, Adadelta lr {args.lr}",
            flush=True,
        )
        steps = examples = 0
        train_s = 0.0
        for epoch in range(1, args.epochs + 1):
            t0 = time.perf_counter()
            for idx in torch.randperm(len(train_set)).split(args.batch_size):
                stats = engine.gradient(idx, reduction="mean")  # shmgrad
                optimizer.step()
                steps += 1
                examples += len(idx)
                if steps % 10 == 0:
                    print(f"  epoch {epoch} step {steps}: loss {stats.loss:.4f}", flush=True)
                if steps == args.max_steps:
                    break
            train_s += time.perf_counter() - t0
            scheduler.step()
            acc = accuracy(model, test_x, test_y)  # the bound model, in eval mode
            print(
                f"epoch {epoch}: test accuracy {acc * 100:.2f}% after {steps} steps, "
                f"{examples / train_s:.0f} examples/s",
                flush=True,
            )
            if steps == args.max_steps:
                break
    return 0


if __name__ == "__main__":
    sys.exit(main())
