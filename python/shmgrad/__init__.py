"""shmgrad: data-parallel gradients on one machine through shared memory.

An engine (``shmgrad serve``, :func:`serve`, or :class:`Engine` from Python) runs worker
processes that each keep their own copy of the model: eager Python workers running the
module as it is, or C++ workers running a TorchScript file. The model's parameters live
in one shared-memory buffer; every worker's ``.grad`` tensors are views of its own
gradient slot, so backward writes gradients straight into shared memory, and the workers
then sum the slots in place, each a slice. Nothing is pickled or copied per step.

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

Public modules: ``shmgrad.errors``, ``shmgrad.schedules`` (adaptive batch sizes),
``shmgrad.multinode`` (engines on several nodes), ``shmgrad.dask`` (on a Dask cluster,
imported by its users), ``shmgrad.lightning`` (Lightning's ``strategy="shmgrad"``,
imported by its users, or here when Lightning already is) and ``shmgrad.testing``.
Modules whose names start with ``_`` are internal. The benchmarks and the stress test
(``shmgrad bench``, ``shmgrad stress``) are the separate package ``shmgrad_tools``, which
uses only this public API.
"""

import torch  # noqa: F401  (loads libtorch before the extension)

from . import _backend, errors, multinode, schedules, testing
from ._client import Client, GradientStats, attach
from ._seeding import example_batch, example_seed, seed_everything, step_seed
from ._engine import Engine, Server, save_model, serve
from ._launcher import installed_binary as _installed_binary
from ._native import _C, build_info
from ._status import EngineStatus, StepSummary, WorkerStatus, read_status
from .errors import (
    BusyError,
    ConsistencyError,
    CorruptSegmentError,
    EngineNotFoundError,
    EngineOSError,
    EngineTimeoutError,
    Error,
    InvalidArgumentError,
    NodeError,
    NonFiniteError,
    NoSpaceError,
    WorkerError,
)


_backend.register()


def _register_lightning_strategy():
    """Registers ``strategy="shmgrad"`` with a Lightning imported before shmgrad (importing
    ``shmgrad.lightning`` registers it too); never fails ``import shmgrad``."""
    import sys

    if "pytorch_lightning" in sys.modules or "lightning.pytorch" in sys.modules:
        try:
            from . import lightning  # noqa: F401
        except ImportError:  # a broken Lightning: importing shmgrad.lightning says why
            pass


_register_lightning_strategy()


def heap_environment() -> dict:
    """glibc's heap settings that shmgrad's workers use (freed memory stays in the heap,
    so that a step's activations are not handed back to the kernel and faulted in again),
    as the ``MALLOC_*_`` environment variables that give any process the same settings
    when it starts: ``subprocess.run(cmd, env={**os.environ, **shmgrad.heap_environment()})``."""
    return dict(_C.HEAP_ENVIRONMENT)


def program(name: str) -> str:
    """The path of one of the programs that ship in the package: ``"shmgrad"`` (serve,
    stop, status, ...) or ``"reduce_bench"`` (the reduction benchmark)."""
    env = {"shmgrad": "SHMGRAD_BINARY", "reduce_bench": "SHMGRAD_REDUCE_BENCH"}
    if name not in env:
        raise InvalidArgumentError(f"unknown program {name!r}: use one of {', '.join(env)}")
    return _installed_binary(name, env[name])


__all__ = [
    # engines
    "Engine",
    "Client",
    "Server",
    "serve",
    "attach",
    "save_model",
    "GradientStats",
    "EngineStatus",
    "WorkerStatus",
    "StepSummary",
    "read_status",
    # eager workers' data and seeds
    "example_batch",
    "example_seed",
    "seed_everything",
    "step_seed",
    # the package
    "build_info",
    "heap_environment",
    "program",
    # modules
    "errors",
    "multinode",
    "schedules",
    "testing",
    # errors
    "Error",
    "InvalidArgumentError",
    "EngineNotFoundError",
    "BusyError",
    "EngineTimeoutError",
    "EngineOSError",
    "WorkerError",
    "CorruptSegmentError",
    "NoSpaceError",
    "NonFiniteError",
    "NodeError",
    "ConsistencyError",
]
