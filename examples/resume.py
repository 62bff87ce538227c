#!/usr/bin/env python3
"""Checkpoint and resume a shmgrad run, and check that it continues exactly.

A plain PyTorch loop with shmgrad: an MLP, Adam, and a Dataset whose examples are
augmented with random noise in ``__getitem__`` (the workers draw it, seeded by the step
and the example). The run is done twice with the same placement (2 workers):

1. uninterrupted, for ``--steps`` steps;
2. for half the steps, then a checkpoint of everything a run needs -- the model's
   ``state_dict()`` (its BatchNorm statistics included), the optimizer's, and the
   engine's (``engine.state_dict()``: the seed and the step count that the workers' step
   seeds derive from) -- saved with ``torch.save``; the engine is closed, and a fresh
   model, optimizer and engine start from the checkpoint (``load_state_dict`` on each)
   and run the other half.

The two runs' parameters must be equal bit for bit: the example exits 1 otherwise.
Without ``engine.load_state_dict`` the resumed run would redraw the first steps'
augmentations, and differ.

Run: .venv/bin/python examples/resume.py [--steps 6] [--workers 2] [--skip-engine-state]
"""

import argparse
import os
import sys
import tempfile

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import shmgrad  # noqa: E402

BATCH = 64


class NoisyBlobs(torch.utils.data.Dataset):
    """Gaussian blobs, one per class, with fresh noise on every read (an augmentation)."""

    def __init__(self, n=1024, d=16, classes=4):
        g = torch.Generator().manual_seed(0)
        self.centres = torch.randn(classes, d, generator=g) * 2
        self.labels = torch.randint(0, classes, (n,), generator=g)

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        y = self.labels[i]
        return self.centres[y] + torch.randn(self.centres.shape[1]), y


def make_model():
    torch.manual_seed(1)
    return torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.BatchNorm1d(32), torch.nn.ReLU(), torch.nn.Linear(32, 4)
    )


def batches(step):
    """The indices of step ``step``: a fixed permutation per epoch."""
    per_epoch = 1024 // BATCH
    order = torch.randperm(1024, generator=torch.Generator().manual_seed(step // per_epoch))
    k = step % per_epoch
    return order[k * BATCH : (k + 1) * BATCH]


def train(model, optimizer, engine, steps, first):
    for step in range(first, first + steps):
        optimizer.zero_grad()
        engine.gradient(batches(step), reduction="mean")
        optimizer.step()


def start(model, workers):
    return shmgrad.Engine(
        model=model, workers=workers, dataset=NoisyBlobs(), loss=F.cross_entropy, seed=5
    )


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=6, help="steps in all (even)")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument(
        "--skip-engine-state",
        action="store_true",
        help="resume without engine.load_state_dict (to see the runs differ)",
    )
    args = ap.parse_args()
    half = args.steps // 2

    model = make_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    with start(model, args.workers) as engine:
        engine.bind(model)
        train(model, optimizer, engine, 2 * half, 0)
    straight = {k: v.clone() for k, v in model.state_dict().items()}

    model = make_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "checkpoint.pt")
        with start(model, args.workers) as engine:
            engine.bind(model)
            train(model, optimizer, engine, half, 0)
            torch.save(
                {
                    "model": model.state_dict(),
                    "optimizer": optimizer.state_dict(),
                    "engine": engine.state_dict(),
                },
                path,
            )
        print(f"checkpoint after {half} steps: {path}")
        checkpoint = torch.load(path)
    model = make_model()
    model.load_state_dict(checkpoint["model"])
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    optimizer.load_state_dict(checkpoint["optimizer"])
    with start(model, args.workers) as engine:
        engine.bind(model)  # after load_state_dict: bind copies the module's values in
        if not args.skip_engine_state:
            engine.load_state_dict(checkpoint["engine"])
        train(model, optimizer, engine, half, half)
    resumed = model.state_dict()

    worst = max(float((straight[k].double() - resumed[k].double()).abs().max()) for k in straight)
    same = all(torch.equal(straight[k], resumed[k]) for k in straight)
    print(
        f"{2 * half} steps straight vs {half} + checkpoint + {half}: "
        + ("equal bit for bit" if same else f"DIFFERENT (largest difference {worst:.3g})")
    )
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
