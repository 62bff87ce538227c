"""shmgrad: data-parallel gradients on one machine through shared memory.

An engine (``shmgrad serve``, or :class:`Engine` from Python) runs worker processes that
each keep their own copy of the model (eager Python workers running the module as it is,
or C++ workers running a TorchScript file). The model's parameters live in one shared-memory
buffer; every worker's ``.grad`` tensors are views of its own gradient slot, so backward
writes gradients straight into shared memory, and the workers then sum the slots in
place, each a slice. Nothing is pickled or copied per step.

Typical use::

    import shmgrad, torch
    model = MyNet()
    with shmgrad.Engine(model=model, workers=4, loss="cross_entropy",
                        dataset="fashion-mnist") as engine:
        engine.bind(model)                 # parameters now alias the engine's
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for idx in batches:
            stats = engine.gradient(idx, reduction="mean")   # fills model's .grad
            opt.step()                                       # seen by every worker
"""

import torch  # noqa: F401  (loads libtorch before the extension)

from .errors import (  # noqa: F401
    BusyError,
    ConsistencyError,
    CorruptSegmentError,
    EngineNotFoundError,
    Error,
    InvalidArgumentError,
    NodeError,
    NoSpaceError,
    NonFiniteError,
    TimeoutError,
    WorkerError,
)
from ._native import build_info  # noqa: F401
from .client import Client, GradientStats, attach  # noqa: F401
from .engine import Engine, save_model  # noqa: F401
from .eager import example_seed  # noqa: F401
from .status import EngineStatus, StepSummary, WorkerStatus, read_status  # noqa: F401
from . import distributed, schedules  # noqa: F401

# The benchmarks (shmgrad.bench) and the stress test (shmgrad.stress) are tools beside the
# library: importing shmgrad loads neither. shmgrad.dask (engines on a Dask cluster) is
# imported by its users, and imports Dask's distributed only when it runs.

__all__ = [
    "Engine",
    "Client",
    "GradientStats",
    "EngineStatus",
    "WorkerStatus",
    "StepSummary",
    "attach",
    "build_info",
    "read_status",
    "save_model",
    "example_seed",
    "Error",
    "InvalidArgumentError",
    "EngineNotFoundError",
    "BusyError",
    "TimeoutError",
    "WorkerError",
    "CorruptSegmentError",
    "NoSpaceError",
    "NonFiniteError",
    "NodeError",
    "ConsistencyError",
]
