"""Fashion-MNIST helpers shared by the examples: the CNN and the test-set loader."""

import gzip
import os

import numpy as np
import torch

from shmgrad._native import tunable_value

# The folder the engine's dataset="fashion-mnist" reads too: $SHMGRAD_FASHION_MNIST_DIR, else the
# default ipc/config.h declares (Debian's dataset-fashion-mnist package).
DATA_DIR = tunable_value("SHMGRAD_FASHION_MNIST_DIR")


class FashionCNN(torch.nn.Module):
    """A small CNN: two conv/ReLU/max-pool blocks and a linear classifier (20,490 parameters)."""

    def __init__(self):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(1, 16, 3, padding=1)
        self.conv2 = torch.nn.Conv2d(16, 32, 3, padding=1)
        self.fc = torch.nn.Linear(32 * 7 * 7, 10)

    def forward(self, x):
        x = torch.max_pool2d(torch.relu(self.conv1(x)), 2)
        x = torch.max_pool2d(torch.relu(self.conv2(x)), 2)
        return self.fc(torch.flatten(x, 1))


def load_split(split="test"):
    """Inputs [N, 1, 28, 28] in [0, 1] and int64 labels, as the engine's loader makes them."""
    prefix = "t10k" if split == "test" else "train"
    with gzip.open(os.path.join(DATA_DIR, f"{prefix}-images-idx3-ubyte.gz")) as f:
        images = np.frombuffer(f.read(), dtype=np.uint8, offset=16)
    with gzip.open(os.path.join(DATA_DIR, f"{prefix}-labels-idx1-ubyte.gz")) as f:
        labels = np.frombuffer(f.read(), dtype=np.uint8, offset=8)
    x = torch.from_numpy(images.astype(np.float32) / 255.0).reshape(-1, 1, 28, 28)
    return x, torch.from_numpy(labels.astype(np.int64))


@torch.no_grad()
def accuracy(model, x, y, batch=2000):
    model.eval()
    correct = 0
    for i in range(0, len(x), batch):
        correct += (model(x[i : i + batch]).argmax(1) == y[i : i + batch]).sum().item()
    model.train()
    return correct / len(x)
