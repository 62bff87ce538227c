"""What a stress run's engine computes, one class per kind of worker: the model, the loss,
the dataset, the options of ``shmgrad serve``, and how the trainer rebuilds an indexed
batch for the reference gradient.

* :class:`ScriptWorkload`: TorchScript workers (C++), a scriptable CNN, the named loss
  ``cross_entropy`` and a dataset the coordinator loads into shared memory (``npy:``).
* :class:`EagerWorkload`: eager Python workers, a CNN that TorchScript rejects, a callable
  loss (label-smoothed cross entropy) and a ``torch.utils.data.Dataset`` whose
  ``__getitem__`` draws per-example random transforms from Python's ``random``, NumPy and
  torch. The reference applies the workers' seeding, ``seed_everything(example_seed(seed,
  i))`` before ``dataset[i]``, so every gradient is checked exactly like the
  TorchScript run's.
"""

import os
import random

import numpy as np
import torch
import torch.nn.functional as F

import shmgrad

DATASET_SIZE = 1000
INPUT_SHAPE = (1, 16, 16)
CLASSES = 6
LABEL_SMOOTHING = 0.1
NOISE_STD = 0.05  # of the eager dataset's per-example noise
MAX_SHIFT = 2  # pixels the eager dataset's random shift moves an image by


class StressNet(torch.nn.Module):
    def __init__(self, classes=CLASSES):
        super().__init__()
        self.conv = torch.nn.Conv2d(1, 8, 3, padding=1)
        self.fc1 = torch.nn.Linear(8 * 8 * 8, 32)
        self.fc2 = torch.nn.Linear(32, classes)

    def forward(self, x):
        x = torch.max_pool2d(torch.relu(self.conv(x)), 2)
        return self.fc2(torch.relu(self.fc1(torch.flatten(x, 1))))


class UnscriptableStressNet(torch.nn.Module):
    """StressNet's layers in a form ``torch.jit.script`` rejects: the activation is a
    lambda held in an attribute and the linear layers are looked up by name in a Python
    loop."""

    LAYERS = ("hidden", "out")

    def __init__(self, classes=CLASSES):
        super().__init__()
        self.conv = torch.nn.Conv2d(1, 8, 3, padding=1)
        self.linear = torch.nn.ModuleDict(
            {"hidden": torch.nn.Linear(8 * 8 * 8, 32), "out": torch.nn.Linear(32, classes)}
        )
        self.act = lambda t: torch.relu(t)

    def forward(self, x):
        x = torch.flatten(torch.max_pool2d(self.act(self.conv(x)), 2), 1)
        for name in self.LAYERS:
            x = self.linear[name](x)
            if name != self.LAYERS[-1]:
                x = self.act(x)
        return x


def smoothed_cross_entropy(outputs, targets):
    """The eager run's loss: a plain callable, summed over the batch."""
    return F.cross_entropy(outputs, targets, reduction="sum", label_smoothing=LABEL_SMOOTHING)


class JitteredDataset(torch.utils.data.Dataset):
    """Per-example random transforms from all three generators the workers seed: a
    horizontal flip (Python's ``random``), a shift (torch), additive noise (NumPy)."""

    def __init__(self, inputs, targets):
        self.inputs = inputs
        self.targets = targets

    def __len__(self):
        return len(self.inputs)

    def __getitem__(self, i):
        x = self.inputs[i]
        if random.random() < 0.5:
            x = x.flip(-1)
        shift = torch.randint(-MAX_SHIFT, MAX_SHIFT + 1, (2,))
        x = torch.roll(x, (int(shift[0]), int(shift[1])), dims=(-2, -1))
        noise = np.random.normal(0.0, NOISE_STD, size=tuple(x.shape)).astype(np.float32)
        return x + torch.from_numpy(noise), self.targets[i]


class ScriptWorkload:
    """TorchScript workers on a dataset in shared memory."""

    kind = "script"
    model_class = StressNet

    def __init__(self, seed):
        torch.manual_seed(seed)
        self.data_x = torch.randn(DATASET_SIZE, *INPUT_SHAPE)
        self.data_y = torch.randint(0, CLASSES, (DATASET_SIZE,))
        self.model = self.model_class()

    def serve(self, name, workers, max_batch, tmp, devices=None) -> shmgrad.Server:
        np.save(os.path.join(tmp, "x.npy"), self.data_x.numpy())
        np.save(os.path.join(tmp, "y.npy"), self.data_y.numpy())
        return shmgrad.serve(
            name=name,
            model=self.model,
            mode="script",
            workers=workers,
            loss="cross_entropy",
            dataset=f"npy:{tmp}/x.npy,{tmp}/y.npy",
            max_batch=max_batch,
            devices=devices,
        )

    def loss(self, outputs, targets):
        return F.cross_entropy(outputs, targets, reduction="sum")

    def indexed_batch(self, indices, seed):
        """The inputs and targets the workers compute on for ``indices`` (TorchScript
        workers ignore the step seed)."""
        return self.data_x[indices], self.data_y[indices]


class EagerWorkload:
    """Eager Python workers: an unscriptable model, a callable loss, a Dataset with random
    per-example transforms, pickled once into a job the engine's workers load."""

    kind = "eager"
    model_class = UnscriptableStressNet

    def __init__(self, seed):
        torch.manual_seed(seed)
        self.dataset = JitteredDataset(
            torch.randn(DATASET_SIZE, *INPUT_SHAPE), torch.randint(0, CLASSES, (DATASET_SIZE,))
        )
        self.model = self.model_class()

    def serve(self, name, workers, max_batch, tmp, devices=None) -> shmgrad.Server:
        return shmgrad.serve(
            name=name,
            model=self.model,
            mode="eager",
            workers=workers,
            loss=smoothed_cross_entropy,
            dataset=self.dataset,
            max_batch=max_batch,
            devices=devices,
        )

    def loss(self, outputs, targets):
        return smoothed_cross_entropy(outputs, targets)

    def indexed_batch(self, indices, seed):
        """The batch the workers build for ``indices`` in a step seeded with ``seed``."""
        return shmgrad.example_batch(self.dataset, indices.tolist(), seed)


WORKLOADS = {w.kind: w for w in (ScriptWorkload, EagerWorkload)}
