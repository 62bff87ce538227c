"""The models and batches of ``shmgrad bench``.

Every model is TorchScript-compatible (shmgrad workers load them with libtorch) and is
built deterministically from a seed, and every batch is drawn from a seeded generator, so
the benchmark's processes (the trainer, DDP ranks, Dask tasks) all compute on the same
weights and the same batches without shipping them around.
"""

import ctypes
import math
from typing import Dict, List, NamedTuple, Tuple

import torch
from torch import nn
import torch.nn.functional as F

NUM_CLASSES = 10


class MLP(nn.Module):
    """784-256-10: a small fully connected net where per-step overhead dominates."""

    def __init__(self, inputs: int = 784, hidden: int = 256, classes: int = NUM_CLASSES):
        super().__init__()
        self.fc1 = nn.Linear(inputs, hidden)
        self.fc2 = nn.Linear(hidden, classes)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


class WideMLP(nn.Module):
    """784-1024-1024-10 (1.86 M parameters): GEMM-bound, what a new user tries first."""

    def __init__(self, inputs: int = 784, hidden: int = 1024, classes: int = NUM_CLASSES):
        super().__init__()
        self.fc1 = nn.Linear(inputs, hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        self.fc3 = nn.Linear(hidden, classes)

    def forward(self, x):
        return self.fc3(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


class FashionCNN(nn.Module):
    """The Fashion-MNIST CNN of examples/fashion_mnist.py (copied: examples/ is not part of
    the package): two conv/ReLU/max-pool blocks and a linear classifier."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.fc = nn.Linear(32 * 7 * 7, 10)

    def forward(self, x):
        x = torch.max_pool2d(torch.relu(self.conv1(x)), 2)
        x = torch.max_pool2d(torch.relu(self.conv2(x)), 2)
        return self.fc(torch.flatten(x, 1))


class WideBlock(nn.Module):
    """Pre-activation wide residual block (BN-ReLU-conv3x3-BN-ReLU-conv3x3), with a 1x1
    projection shortcut when the shape changes."""

    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.bn1 = nn.BatchNorm2d(cin)
        self.conv1 = nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, stride=1, padding=1, bias=False)
        self.equal = cin == cout and stride == 1
        if self.equal:
            self.shortcut = nn.Identity()
        else:
            self.shortcut = nn.Conv2d(cin, cout, 1, stride=stride, padding=0, bias=False)

    def forward(self, x):
        o = torch.relu(self.bn1(x))
        y = self.conv1(o)
        y = self.conv2(torch.relu(self.bn2(y)))
        if self.equal:
            return y + x
        return y + self.shortcut(o)


class WideResNet(nn.Module):
    """Wide-ResNet-depth-k for 32x32 inputs (Zagoruyko & Komodakis); WRN-16-4 by default
    (about 2.75M parameters). BatchNorm runs in train mode."""

    def __init__(self, depth: int = 16, widen: int = 4, classes: int = NUM_CLASSES):
        super().__init__()
        assert (depth - 4) % 6 == 0, "WRN depth must be 6n+4"
        n = (depth - 4) // 6
        widths = [16, 16 * widen, 32 * widen, 64 * widen]
        self.conv = nn.Conv2d(3, widths[0], 3, stride=1, padding=1, bias=False)
        blocks: List[nn.Module] = []
        cin = widths[0]
        for g, stride in zip(range(3), (1, 2, 2)):
            for i in range(n):
                blocks.append(WideBlock(cin, widths[g + 1], stride if i == 0 else 1))
                cin = widths[g + 1]
        self.blocks = nn.Sequential(*blocks)
        self.bn = nn.BatchNorm2d(cin)
        self.fc = nn.Linear(cin, classes)

    def forward(self, x):
        x = self.blocks(self.conv(x))
        x = torch.relu(self.bn(x))
        x = F.adaptive_avg_pool2d(x, 1)
        return self.fc(torch.flatten(x, 1))


class ModelSpec(NamedTuple):
    name: str
    description: str
    input_shape: Tuple[int, ...]  # one example's shape


MODELS: Dict[str, ModelSpec] = {
    "tiny": ModelSpec("tiny", "tiny MLP 64-32-10 (tests)", (64,)),
    "mlp": ModelSpec("mlp", "MLP 784-256-10", (784,)),
    "mlp2": ModelSpec("mlp2", "MLP 784-1024-1024-10 (1.86 M parameters)", (784,)),
    "cnn": ModelSpec("cnn", "Fashion-MNIST CNN (examples/fashion_mnist.py)", (1, 28, 28)),
    "wrn": ModelSpec("wrn", "Wide-ResNet-16-4, CIFAR-shaped inputs", (3, 32, 32)),
}


def make_model(name: str, seed: int = 0) -> nn.Module:
    """The model ``name`` with weights drawn from ``seed`` (the same in every process)."""
    torch.manual_seed(seed)
    if name == "tiny":
        return MLP(64, 32)
    if name == "mlp":
        return MLP()
    if name == "mlp2":
        return WideMLP()
    if name == "cnn":
        return FashionCNN()
    if name == "wrn":
        return WideResNet(16, 4)
    raise ValueError(f"unknown model {name!r}: use one of {', '.join(MODELS)}")


def set_threads(n: int) -> None:
    """Gives this process ``n`` intra-op threads, in PyTorch and in the BLAS beneath it,
    and one inter-op thread.

    ``torch.set_num_threads`` does not reach OpenBLAS's own thread pool, which Debian's
    PyTorch uses for matrix products and which starts with one thread per core. Without
    this a "1-thread" baseline would still multiply matrices on every core, while a
    shmgrad worker (the engine sets ``OPENBLAS_NUM_THREADS``) uses one.
    """
    torch.set_num_threads(n)
    try:
        torch.set_num_interop_threads(1)  # as the TorchScript worker sets it
    except RuntimeError:
        pass  # already set, or inter-op work already started in this process
    with open("/proc/self/maps") as maps:
        libs = {line.split()[-1] for line in maps if "openblas" in line}
    for path in sorted(libs):
        lib = ctypes.CDLL(path)  # already loaded: the same handle, no second copy
        if hasattr(lib, "openblas_set_num_threads"):
            lib.openblas_set_num_threads(ctypes.c_int(n))


def num_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def make_batches(name: str, batch: int, count: int, seed: int = 1):
    """``count`` batches of ``batch`` random examples (inputs in [0, 1), integer labels in
    [0, 10)) for model ``name``, identical in every process for the same arguments."""
    shape = MODELS[name].input_shape
    g = torch.Generator().manual_seed(seed * 1000003 + batch)
    out = []
    for _ in range(count):
        x = torch.rand((batch,) + shape, generator=g)
        y = torch.randint(0, NUM_CLASSES, (batch,), generator=g)
        out.append((x, y))
    return out


def engine_capacity(batch: int, batch_inputs: torch.Tensor) -> dict:
    """The engine options that fit explicit batches of ``batch`` examples whose inputs are
    ``batch_inputs`` (float32): every bench engine is sized by this one rule, with room
    for twice the inputs and at least shmgrad's default capacity."""
    import shmgrad

    default_mb = shmgrad.Engine.__init__.__kwdefaults__["input_capacity_mb"]
    in_mb = batch_inputs.numel() * batch_inputs.element_size() / 2**20
    return {
        "max_batch": max(batch, 1),
        "input_capacity_mb": max(default_mb, math.ceil(2 * in_mb) + 1),
    }


def engine(model, workers, name, batch, x0, startup_timeout, loss="cross_entropy", **options):
    """The engine every bench system opens: ``model`` on ``workers`` workers of one
    thread each, cross-entropy by default, sized for explicit batches of ``batch``
    examples like ``x0`` (engine_capacity). TorchScript workers are measured on purpose:
    torch's deprecation warning is not news to the person running the bench, and is
    silenced while the engine starts."""
    import warnings

    import shmgrad

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return shmgrad.Engine(
            model=model,
            workers=workers,
            loss=loss,
            name=name,
            # workers="auto" chooses the threads per worker itself (over the cores this
            # process may run on: run_shmgrad restricts them to the N of the row).
            **({} if workers == "auto" else {"threads_per_worker": 1}),
            **engine_capacity(batch, x0),
            startup_timeout=startup_timeout,
            **options,
        )


def flat(tensors) -> torch.Tensor:
    """Tensors (a gradient) as one float64 vector, on the CPU."""
    return torch.cat([t.detach().reshape(-1).double().cpu() for t in tensors])


def flat_grad(model: nn.Module) -> torch.Tensor:
    """The model's gradient as one float64 vector (zeros where a .grad is missing)."""
    return flat(p.grad if p.grad is not None else torch.zeros_like(p) for p in model.parameters())
