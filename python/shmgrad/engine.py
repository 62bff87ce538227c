"""The Python trainer API: start or attach to an engine, bind a module, ask for gradients."""

import atexit
import ctypes
import dataclasses
import itertools
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
import weakref
from typing import List, Optional, Sequence

import torch

from . import errors

try:
    from . import _C
except ImportError as exc:  # pragma: no cover - only without set-up
    raise ImportError(
        "shmgrad's native module is not built: run tools/setup.sh from the shmgrad checkout "
        f"({exc})"
    ) from exc

LOSSES = ("cross_entropy", "nll", "mse")
REDUCTIONS = ("sum", "mean")
_names = itertools.count()
_live_engines = weakref.WeakSet()


def _binary() -> str:
    env = os.environ.get("SHMGRAD_BINARY")
    if env:
        return env
    here = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bin", "shmgrad")
    if os.path.exists(here):
        return here
    found = shutil.which("shmgrad")
    if found:
        return found
    raise errors.EngineNotFoundError(
        "the shmgrad binary is not installed: run tools/setup.sh (or set SHMGRAD_BINARY)"
    )


def save_model(module: torch.nn.Module, path, *, example_inputs=None):
    """Scripts (or, given ``example_inputs``, traces) ``module`` and saves it for the workers.

    Workers load the file with libtorch, so the model must be TorchScript-compatible;
    models that script poorly can be traced with ``example_inputs`` (a tensor or a tuple
    of tensors). Parameters must be float32 on the CPU. Returns ``path``.
    """
    if not isinstance(module, torch.nn.Module):
        raise errors.InvalidArgumentError(
            f"save_model needs a torch.nn.Module, got {type(module).__name__}"
        )
    for name, p in module.named_parameters():
        if p.dtype != torch.float32 or p.device.type != "cpu":
            raise errors.InvalidArgumentError(
                f"parameter {name} is {p.dtype} on {p.device}; shmgrad engines hold float32 CPU "
                "parameters: call module.float().cpu() first"
            )
    try:
        if example_inputs is not None:
            inputs = example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)
            scripted = torch.jit.trace(module, inputs)
        else:
            scripted = torch.jit.script(module)
    except Exception as exc:  # scripting errors come in many types
        raise errors.InvalidArgumentError(
            f"cannot convert {type(module).__name__} to TorchScript ({exc}); "
            "pass example_inputs=... to trace it instead of scripting"
        ) from exc
    torch.jit.save(scripted, os.fspath(path))
    return path


@dataclasses.dataclass
class GradientStats:
    """What one :meth:`Engine.gradient` call did.

    ``compute_seconds``, ``reduce_seconds_per_worker`` and ``wait_seconds`` have one entry
    per worker that took part, in rank order.
    """

    num_examples: int
    loss: float                 # sum (or mean, with reduction="mean") of the loss over the batch
    loss_sum: float
    compute_seconds: List[float]
    reduce_seconds: float       # slowest worker's slice of the reduction
    reduce_seconds_per_worker: List[float]
    wait_seconds: List[float]
    wall_seconds: float
    workers: int
    worker_examples: List[int]
    retries: int
    nonfinite: bool
    nonfinite_workers: List[int]

    @classmethod
    def _from_native(cls, d):
        ws = d["workers"]
        return cls(
            num_examples=d["num_examples"],
            loss=d["loss"],
            loss_sum=d["loss_sum"],
            compute_seconds=[w["compute_seconds"] for w in ws],
            reduce_seconds=d["reduce_seconds"],
            reduce_seconds_per_worker=[w["reduce_seconds"] for w in ws],
            wait_seconds=[w["wait_seconds"] for w in ws],
            wall_seconds=d["wall_seconds"],
            workers=len(ws),
            worker_examples=[w["examples"] for w in ws],
            retries=d["retries"],
            nonfinite=d["nonfinite"],
            nonfinite_workers=[w["slot"] for w in ws if w["nonfinite_loss"] or w["nonfinite_grad"]],
        )


def _set_parent_death_signal():  # runs in the child between fork and exec
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except Exception:
        pass


_ERROR_LINE = re.compile(r"shmgrad \w+: error \((\w+)\): (.*)")


class Engine:
    """A shmgrad engine: start one (``Engine(model=..., workers=..., loss=...)``) or attach to
    a running one (:func:`attach`).

    Starting one runs ``shmgrad serve`` in the background and attaches to it; the engine
    stops when :meth:`close` is called, when the ``with`` block ends, or when this process
    exits. Only one trainer holds an engine at a time.

    Args (keyword-only):
        model: a ``torch.nn.Module`` (saved with :func:`save_model`) or the path of a
            TorchScript file.
        workers: number of worker processes.
        loss: ``"cross_entropy"``, ``"nll"`` or ``"mse"``; summed over the batch.
        dataset: ``None``, ``"fashion-mnist"``, ``"fashion-mnist:test"`` or
            ``"npy:INPUTS.npy,TARGETS.npy"``: loaded once into shared memory and addressed
            by index in :meth:`gradient`.
        name: engine name (default: a unique one); others attach by it.
        threads_per_worker: intra-op threads of each worker (default 1).
        max_workers: gradient slots, the most workers :meth:`resize` can ask for.
        max_batch: most examples in one step.
        startup_timeout: seconds to wait for every worker to load the model.
        min_examples_per_worker: default for :meth:`gradient` (fewer workers take part in a
            small batch: idle workers cost nothing).
        max_examples_per_pass: default for :meth:`gradient` (bounds worker memory).
    """

    def __init__(self, *, model, workers: int, loss: str, dataset: Optional[str] = None,
                 name: Optional[str] = None, threads_per_worker: int = 1,
                 max_workers: Optional[int] = None, max_batch: int = 65536,
                 input_capacity_mb: int = 64, startup_timeout: float = 120.0,
                 min_examples_per_worker: int = 1, max_examples_per_pass: int = 0,
                 _trainer=None):
        self._proc = None
        self._log = None
        self._trainer = None
        self._tmpdir = None
        self._bound = []
        self._closed = False
        self.min_examples_per_worker = min_examples_per_worker
        self.max_examples_per_pass = max_examples_per_pass
        if _trainer is not None:  # attach()
            self._trainer = _trainer
            self.name = name
            self._init_views()
            return
        if loss not in LOSSES:
            raise errors.InvalidArgumentError(f"unknown loss {loss!r}: use one of {', '.join(LOSSES)}")
        if not isinstance(workers, int) or workers < 1:
            raise errors.InvalidArgumentError(f"workers must be a positive int, got {workers!r}")
        if max_workers is not None and (not isinstance(max_workers, int) or max_workers < workers):
            raise errors.InvalidArgumentError(
                f"max_workers must be an int >= workers ({workers}), got {max_workers!r}")
        self.name = name or f"py{os.getpid()}-{next(_names)}"
        _C.check_engine_name(self.name)
        if isinstance(model, torch.nn.Module):
            self._tmpdir = tempfile.mkdtemp(prefix="shmgrad-model-")
            path = os.path.join(self._tmpdir, "model.pt")
            save_model(model, path)
        elif isinstance(model, (str, os.PathLike)):
            path = os.fspath(model)
            if not os.path.isfile(path):
                raise errors.EngineNotFoundError(
                    f"model file {path!r} does not exist; save one with shmgrad.save_model(module, path)")
        else:
            raise errors.InvalidArgumentError(
                f"model must be a torch.nn.Module or a TorchScript file path, got {type(model).__name__}")
        cmd = [_binary(), "serve", "--name", self.name, "--model", path, "--workers", str(workers),
               "--loss", loss, "--threads-per-worker", str(threads_per_worker),
               "--max-batch", str(max_batch), "--input-capacity-mb", str(input_capacity_mb),
               "--startup-timeout", str(startup_timeout)]
        if max_workers is not None:
            cmd += ["--max-workers", str(max_workers)]
        if dataset is not None:
            cmd += ["--dataset", str(dataset)]
        self._log = tempfile.TemporaryFile()
        self._proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT,
                                      stdin=subprocess.DEVNULL, preexec_fn=_set_parent_death_signal)
        _live_engines.add(self)
        deadline = time.monotonic() + startup_timeout + 10
        while True:
            if self._proc.poll() is not None:
                err = self._startup_error()
                self._cleanup_files()
                raise err
            try:
                self._trainer = _C.Trainer.attach(self.name, timeout=0.2)
                break
            except (errors.EngineNotFoundError, errors.TimeoutError, errors.CorruptSegmentError):
                if time.monotonic() > deadline:
                    self.close()
                    raise errors.TimeoutError(
                        f"engine {self.name!r} did not start within {startup_timeout} s") from None
        self._init_views()

    # -- construction helpers -------------------------------------------------------
    def _init_views(self):
        self._param_info = [(n, tuple(s)) for n, s in self._trainer.parameters()]
        self._param_views = self._trainer.parameter_views()
        self._grad_views = self._trainer.gradient_views()

    def _startup_error(self):
        text = self.log()
        for line in text.splitlines():
            m = _ERROR_LINE.search(line)
            if m:
                return errors.error_class(m.group(1))(m.group(2))
        return errors.Error(f"engine {self.name!r} failed to start: {text.strip() or 'no output'}")

    def _cleanup_files(self):
        if self._tmpdir is not None:
            shutil.rmtree(self._tmpdir, ignore_errors=True)
            self._tmpdir = None

    # -- the API --------------------------------------------------------------------
    @property
    def parameters(self):
        """The engine's parameters as ``(name, shape)`` pairs, in the model's order."""
        return list(self._param_info)

    @property
    def dataset_size(self) -> int:
        """Examples in the engine's dataset (0 without one)."""
        return self._check_open().dataset_size()

    @property
    def workers(self) -> int:
        """Worker processes ready now."""
        return self._check_open().worker_count()

    def parameter_tensors(self):
        """Tensors aliasing the engine's shared parameters (writes are seen by every worker)."""
        return list(self._param_views)

    def gradient_tensors(self):
        """Tensors aliasing the engine's reduced gradient (filled by :meth:`gradient`)."""
        return list(self._grad_views)

    def bind(self, module: torch.nn.Module) -> torch.nn.Module:
        """Makes ``module``'s parameters views of the engine's shared parameters (their
        current values are copied in once) and their ``.grad`` views of the reduced gradient.

        Afterwards any ``torch.optim`` optimizer works unchanged: :meth:`gradient` fills
        ``.grad``, ``optimizer.step()`` updates the shared parameters in place, and every
        worker sees the update with no copy. The module must have the engine's parameters
        (same names, shapes, order). Buffers (e.g. BatchNorm statistics) are not shared.
        Returns ``module``.
        """
        self._check_open()
        if not isinstance(module, torch.nn.Module):
            raise errors.InvalidArgumentError(f"bind needs a torch.nn.Module, got {type(module).__name__}")
        named = list(module.named_parameters())
        if len(named) != len(self._param_info):
            raise errors.InvalidArgumentError(
                f"the module has {len(named)} parameters but the engine has {len(self._param_info)}: "
                "bind the module the engine was started with")
        for i, ((name, p), (ename, eshape)) in enumerate(zip(named, self._param_info)):
            if name != ename or tuple(p.shape) != eshape or p.dtype != torch.float32:
                raise errors.InvalidArgumentError(
                    f"module parameter {i} {name!r} {tuple(p.shape)} ({p.dtype}) does not match the "
                    f"engine's {ename!r} {eshape} (float32): bind the module the engine was started with")
        with torch.no_grad():
            for (_, p), view, grad in zip(named, self._param_views, self._grad_views):
                view.copy_(p.detach())
                p.data = view
                p.grad = grad
        self._bound = [p for _, p in named]
        return module

    def gradient(self, indices=None, *, inputs=None, targets=None, reduction: str = "sum",
                 timeout: float = 600.0, max_retries: int = 3,
                 min_examples_per_worker: Optional[int] = None,
                 max_examples_per_pass: Optional[int] = None,
                 raise_on_nonfinite: bool = False) -> GradientStats:
        """Computes the gradient of the loss over a batch into the reduced gradient (and so
        into the ``.grad`` of a bound module).

        Give either ``indices`` (positions in the engine's dataset: a sequence, array or
        integer tensor) or ``inputs`` and ``targets`` (tensors with a batch dimension;
        class labels as integers for cross_entropy/nll, float targets for mse).
        ``reduction="sum"`` gives the gradient of the summed loss, ``"mean"`` of its mean.

        .. warning:: Blocks until every worker has finished its slice of the reduction
           (a synchronisation point of all workers), an error is raised, or ``timeout``
           seconds pass. A step that loses a worker is re-run (up to ``max_retries``) and
           still returns the exact gradient.

        Raises:
            InvalidArgumentError: bad indices, shapes, dtypes, an empty batch.
            WorkerError: the model rejected the input (the worker's message follows).
            TimeoutError: the step did not finish in time. The engine keeps serving.
            NonFiniteError: NaN/inf in loss or gradient, when ``raise_on_nonfinite``.
        """
        t = self._check_open()
        if reduction not in REDUCTIONS:
            raise errors.InvalidArgumentError(f"unknown reduction {reduction!r}: use 'sum' or 'mean'")
        mean = reduction == "mean"
        mepw = self.min_examples_per_worker if min_examples_per_worker is None else min_examples_per_worker
        mepp = self.max_examples_per_pass if max_examples_per_pass is None else max_examples_per_pass
        args = (mean, float(timeout), int(max_retries), int(mepw), int(mepp), bool(raise_on_nonfinite))
        if indices is not None:
            if inputs is not None or targets is not None:
                raise errors.InvalidArgumentError("give either indices or inputs and targets, not both")
            idx = indices if isinstance(indices, torch.Tensor) else torch.as_tensor(indices)
            if idx.numel() == 0:
                raise errors.InvalidArgumentError("empty batch: give at least one index")
            if idx.dtype.is_floating_point or idx.dtype == torch.bool or idx.is_complex():
                raise errors.InvalidArgumentError(f"indices must be integers, got {idx.dtype}")
            if idx.dim() != 1:
                idx = idx.reshape(-1) if idx.dim() == 0 else idx
                if idx.dim() != 1:
                    raise errors.InvalidArgumentError(
                        f"indices must be 1-D, got shape {tuple(idx.shape)}")
            native = t.gradient(idx.to(torch.int64), None, None, *args)
        else:
            if inputs is None or targets is None:
                raise errors.InvalidArgumentError(
                    "give indices into the engine's dataset, or both inputs and targets")
            x = inputs if isinstance(inputs, torch.Tensor) else torch.as_tensor(inputs)
            y = targets if isinstance(targets, torch.Tensor) else torch.as_tensor(targets)
            native = t.gradient(None, x.detach(), y.detach(), *args)
        self._relink_grads()
        return GradientStats._from_native(native)

    def _relink_grads(self):
        # optimizer.zero_grad(set_to_none=True) (the default in newer PyTorch) drops .grad;
        # point it at the reduced gradient again.
        for p, g in zip(self._bound, self._grad_views):
            if p.grad is None or p.grad.data_ptr() != g.data_ptr():
                p.grad = g

    def resize(self, workers: int, *, timeout: float = 120.0):
        """Runs ``workers`` worker processes (1 to ``max_workers``). New workers map the
        current parameters; removed ones exit cleanly. Blocks until that many are ready."""
        t = self._check_open()
        if not isinstance(workers, int) or workers < 1:
            raise errors.InvalidArgumentError(f"workers must be a positive int, got {workers!r}")
        _C.request_resize(self.name, workers)
        deadline = time.monotonic() + timeout
        while t.worker_count() != workers:
            if time.monotonic() > deadline:
                raise errors.TimeoutError(
                    f"engine {self.name!r}: {t.worker_count()} workers ready, not {workers}, after {timeout} s")
            time.sleep(0.01)

    def log(self) -> str:
        """What the engine's coordinator and workers have printed so far (worker restarts,
        retired workers that had to be killed), for an engine this object started; ``""``
        for one it attached to."""
        if self._log is None or self._log.closed:
            return ""
        self._log.seek(0)
        return self._log.read().decode(errors="replace")

    def status(self) -> dict:
        """The engine's state: ``text`` (as ``shmgrad status`` prints it), ``workers`` ready,
        ``slots``, ``coordinator_pid``, ``dataset_size``."""
        t = self._check_open()
        return {
            "name": self.name,
            "text": _C.status_text(self.name),
            "workers": t.worker_count(),
            "slots": t.slot_count(),
            "coordinator_pid": t.coordinator_pid(),
            "dataset_size": t.dataset_size(),
        }

    def close(self, *, timeout: float = 30.0):
        """Releases the engine; stops it if this object started it. Idempotent.

        Bound modules keep working tensors (the shared memory stays mapped while they
        exist), but further gradients need a new engine.
        """
        if self._closed:
            return
        self._closed = True
        if self._trainer is not None:
            self._trainer.close()
        if self._proc is not None:
            if self._proc.poll() is None:
                self._proc.send_signal(signal.SIGTERM)
                try:
                    self._proc.wait(timeout)
                except subprocess.TimeoutExpired:
                    self._proc.kill()
                    self._proc.wait()
            self._log.close()
        self._cleanup_files()

    def _check_open(self):
        if self._closed or self._trainer is None:
            raise errors.InvalidArgumentError(f"engine {getattr(self, 'name', '?')!r} is closed")
        return self._trainer

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    def __repr__(self):
        state = "closed" if self._closed else "open"
        return f"<shmgrad.Engine {self.name!r} {state}>"


def attach(name: str, *, timeout: float = 30.0, min_examples_per_worker: int = 1,
           max_examples_per_pass: int = 0) -> Engine:
    """Attaches to an engine started with ``shmgrad serve --name NAME``.

    Waits up to ``timeout`` seconds for it to serve. Raises :class:`EngineNotFoundError`
    if there is none, :class:`BusyError` (naming the holder's pid) if another trainer
    holds it. :meth:`Engine.close` releases it without stopping it.
    """
    _C.check_engine_name(name)
    trainer = _C.Trainer.attach(name, timeout=timeout)
    return Engine(model=None, workers=0, loss="", name=name, _trainer=trainer,
                  min_examples_per_worker=min_examples_per_worker,
                  max_examples_per_pass=max_examples_per_pass)


@atexit.register
def _close_all():
    for engine in list(_live_engines):
        try:
            engine.close()
        except Exception:
            pass
