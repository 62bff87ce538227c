"""Lightning's ``strategy="shmgrad"``: an unchanged LightningModule trained on an engine.

``Trainer(strategy="shmgrad")`` (or ``strategy=EngineStrategy(workers=N)``) runs the
module's ``training_step`` in a :class:`shmgrad.Engine`'s eager workers, each on its
shard of every batch, and everything else in the trainer process as Lightning always
does: the loop, validation, callbacks, checkpointing, gradient clipping, LR schedulers and
the optimizer's step on the shared parameters. docs/LIGHTNING.md says what it supports
and what it refuses.

Registration: importing this module registers ``"shmgrad"`` in the strategy registry of
each of ``pytorch_lightning`` and ``lightning.pytorch`` that is imported, or, when neither
is yet, of the first one installed (which it imports); ``import shmgrad`` imports this
module when one of them is already imported. :data:`EngineStrategy` is the class for
``pytorch_lightning`` when this registered it, else for ``lightning.pytorch``;
:func:`strategy_class` gives the one for a named package.

How a step runs, and why (the hooks of Lightning's automatic optimization, in order):

1. ``training_step`` (this strategy's): the batch goes to the engine whole,
   ``engine.gradient(batch=...)``, with the step's ``batch_idx``, epoch and global step
   beside it; each worker calls its copy's ``training_step(shard, batch_idx)`` and
   backpropagates its loss, and the engine reduces the gradients in place into the bound
   module's ``.grad``: the gradient of the whole batch's mean loss, however unevenly the
   batch is split (``loss_reduction="mean"``: each worker's mean is weighted by its
   examples). The strategy then takes the ``.grad`` tensors away (holds them) and returns
   the batch's loss for Lightning's bookkeeping. With ``accumulate_grad_batches=K`` it
   keeps the sum over the micro-batches of each one's gradient over K, which is what
   Lightning's backward of each ``loss / K`` leaves in ``.grad``, and gives that.
2. ``optimizer_zero_grad`` (the module's): finds no ``.grad`` to drop or zero.
3. ``backward`` (this strategy's): runs the ``on_before_backward``/``on_after_backward``
   hooks around giving the held ``.grad`` back (the workers already ran backward).
4. clipping and ``optimizer.step()``, as Lightning does them, on the shared parameters,
   which every worker sees.

``self.log`` in ``training_step``: the workers' is a no-op. Before the first step of each
``fit`` the strategy runs ``training_step`` once in the trainer, on a shard-sized slice of
the first batch with no gradient, recording what it logs; every name logged with the
loss's value is then logged by the trainer at every step with the whole batch's loss (the
same options), and the other names are warned about once, with the fix.
"""

import contextlib
import inspect
import math
import os
import sys
import warnings
from collections.abc import Mapping
from typing import Optional

import torch

from . import _losses, errors
from ._client import GRADIENT_DEFAULTS
from ._engine import Engine

NAME = "shmgrad"
# The Lightning packages a strategy class is made for, in order of preference.
PACKAGES = ("pytorch_lightning", "lightning.pytorch")
LOSS_REDUCTIONS = ("mean", "sum", None)
# Engine(...) options a strategy passes through; it sets model, forward, mode and
# loss_reduction itself, and the rest (loss, dataset, devices, process_group) do not apply.
ENGINE_OPTIONS = (
    "seed",
    "name",
    "threads_per_worker",
    "max_workers",
    "max_batch",
    "input_capacity_mb",
    "startup_timeout",
    "min_examples_per_worker",
    "max_examples_per_pass",
    "compile",
    "buffers",
    "trainer_threads",
)
DOC = "docs/LIGHTNING.md"


def default_workers() -> int:
    """Workers when none are given: one per CPU this process may run on."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - not Linux
        return max(1, os.cpu_count() or 1)


# -- in the workers ---------------------------------------------------------------------


class WorkerTrainer:
    """What ``self.trainer`` is inside ``training_step`` in a worker: the trainer's epoch
    and global step at this step, one process of rank 0 with no logger. Anything else is
    refused naming what to do (the real trainer lives in another process)."""

    global_rank = local_rank = node_rank = 0
    world_size = num_nodes = num_devices = 1
    is_global_zero = False  # self.print() in the workers stays silent
    logger = None
    loggers = ()
    training = True
    sanity_checking = False

    def __init__(self, current_epoch: int, global_step: int):
        self.current_epoch = current_epoch
        self.global_step = global_step

    def __getattr__(self, name):
        raise AttributeError(
            f"self.trainer.{name} is not available in training_step under "
            "strategy='shmgrad': training_step runs in the engine's worker processes, whose "
            "stand-in trainer has current_epoch, global_step, the ranks (0) and no logger. "
            "Read it in the trainer process instead and put what training_step needs into "
            "the batch (on_after_batch_transfer runs in the trainer, on the whole batch)"
        )


def _silent(*args, **kwargs):
    """``self.log``/``self.log_dict`` in a worker: nothing (the trainer logs the loss)."""


def _lightning_modules(module) -> list:
    """The module and the LightningModules inside it (those with a ``_trainer``)."""
    return [m for m in module.modules() if "_trainer" in vars(m)]


@contextlib.contextmanager
def _in_worker_context(lightning_modules, epoch: int, step: int):
    """The LightningModules with the stand-in trainer and silent logging, restored
    afterwards (the engine's probe of the loss, in the trainer, calls this too)."""
    stand_in = WorkerTrainer(epoch, step)
    saved = []
    for m in lightning_modules:
        own = vars(m)
        saved.append((m, own["_trainer"], {k: own[k] for k in ("log", "log_dict") if k in own}))
        own["_trainer"] = stand_in
        own["log"] = own["log_dict"] = _silent
    try:
        yield
    finally:
        for m, trainer, methods in saved:
            own = vars(m)
            own["_trainer"] = trainer
            for k in ("log", "log_dict"):
                if k in methods:
                    own[k] = methods[k]
                else:
                    own.pop(k, None)


def loss_of(output):
    """The loss in what ``training_step`` returned: the tensor, or a dict's ``"loss"``."""
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, Mapping) and "loss" in output:
        return output["loss"]
    if output is None:
        raise TypeError(
            "training_step returned None (Lightning's way to skip a batch): under "
            "strategy='shmgrad' every worker computes a shard of every batch and none can "
            "skip it alone; filter the batch in the DataLoader (or in on_after_batch_transfer)"
        )
    raise TypeError(
        f"training_step returned a {type(output).__name__}: return the loss (a tensor) or a "
        "dict with the key 'loss'"
    )


# The columns of the step's facts that travel beside the batch, one row per example (the
# engine splits every tensor of a batch along its first dimension): the batch index,
# whether training_step takes it (Lightning passes it only to one that does), the epoch
# and the global step.
META_BATCH_IDX, META_TAKES_IDX, META_EPOCH, META_STEP = range(4)


def call_training_step(module, batch, batch_idx: Optional[int]):
    """``training_step`` as Lightning calls it: with ``batch_idx`` where it takes one."""
    if batch_idx is None:
        return module.training_step(batch)
    return module.training_step(batch, batch_idx)


class WorkerStep:
    """``forward(model, batch)`` of the engine's eager workers: the LightningModule's own
    ``training_step`` on the worker's shard, with the trainer's batch index, epoch and
    global step, and its loss. Pickled with the job, by reference to this module."""

    def __init__(self):
        self._found = None  # (module, its LightningModules): looked for once per module

    def __call__(self, module, packed):
        if self._found is None or self._found[0] is not module:
            self._found = (module, _lightning_modules(module))
        meta = packed["meta"][0].tolist()
        batch_idx = meta[META_BATCH_IDX] if meta[META_TAKES_IDX] else None
        with _in_worker_context(self._found[1], meta[META_EPOCH], meta[META_STEP]):
            output = call_training_step(module, packed["batch"], batch_idx)
        return loss_of(output)


def pack(batch, batch_idx: Optional[int], epoch: int, step: int, examples: int):
    """The batch as the workers get it: the batch, and the step's facts one row each."""
    row = [batch_idx or 0, int(batch_idx is not None), epoch, step]
    meta = torch.tensor([row], dtype=torch.int64).expand(examples, len(row))
    return {"batch": batch, "meta": meta.contiguous()}


# -- in the trainer ---------------------------------------------------------------------


def _is_the_loss(value, loss) -> bool:
    """Whether a value ``self.log`` was given is the loss (the tensor, a copy, its number)."""
    if value is loss:
        return True
    try:
        if isinstance(value, torch.Tensor) and value.numel() != 1:
            return False
        logged, given = float(value), float(loss)
    except (TypeError, ValueError, RuntimeError):
        return False
    if math.isnan(logged) and math.isnan(given):
        return True
    return math.isclose(logged, given, rel_tol=1e-6, abs_tol=0.0)


class LogPlan:
    """What ``training_step`` logs, found out once: ``loss_logs``, the ``self.log`` calls
    of the loss as ``(name, kwargs)``, which the trainer repeats at every step with the
    batch's loss."""

    def __init__(self, loss_logs=()):
        self.loss_logs = list(loss_logs)

    def log(self, module, loss, examples: int):
        for name, kwargs in self.loss_logs:
            if "batch_size" in kwargs:  # the probe's slice's: the whole batch's now
                kwargs = dict(kwargs, batch_size=examples)
            module.log(name, loss, **kwargs)


def _options(method, *args, **kwargs) -> dict:
    """The options a ``self.log``/``self.log_dict`` call gave, by name (bound to the real
    method's signature, so positional ones count too)."""
    bound = inspect.signature(method).bind(None, *args, **kwargs).arguments
    return {k: v for k, v in list(bound.items())[2:]}  # after self and name/dictionary


def probe_logging(module, batch, batch_idx: Optional[int], shard: int) -> LogPlan:
    """Runs ``training_step`` once in the trainer, on the first ``shard`` examples of the
    batch with no gradient (the module's buffers and torch's random state restored), and
    returns what it logs. Values other than the loss, and keys of a returned dict other
    than ``"loss"``, stay in the workers: warned about once, with the fix."""
    calls = []
    cls = type(module)

    def log(name, value, *args, **kwargs):
        options = _options(cls.log, name, value, *args, **kwargs)
        del options["value"]
        calls.append((name, value, options))

    def log_dict(dictionary, *args, **kwargs):
        options = _options(cls.log_dict, dictionary, *args, **kwargs)
        for name, value in dictionary.items():
            calls.append((name, value, options))

    own = vars(module)
    saved = {k: own[k] for k in ("log", "log_dict", "print") if k in own}
    buffers = [b.detach().clone() for b in module.buffers()]
    own["log"], own["log_dict"], own["print"] = log, log_dict, _silent
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            output = call_training_step(module, _losses.examples(batch, 0, shard), batch_idx)
            loss = loss_of(output)
    except Exception as exc:  # the workers will say what is wrong, if anything is
        warnings.warn(
            f"strategy='shmgrad' ran training_step once in the trainer to see what it logs, "
            f"and it failed ({type(exc).__name__}: {exc}); self.log of the loss in "
            "training_step is not passed on to Lightning's loggers",
            RuntimeWarning,
            stacklevel=2,
        )
        return LogPlan()
    finally:
        for k in ("log", "log_dict", "print"):
            if k in saved:
                own[k] = saved[k]
            else:
                own.pop(k, None)
        with torch.no_grad():
            for b, before in zip(module.buffers(), buffers):
                b.copy_(before)
    loss_logs = [(n, kw) for n, v, kw in calls if _is_the_loss(v, loss)]
    others = [n for n, v, _ in calls if not _is_the_loss(v, loss)]
    if others:
        warnings.warn(
            f"training_step logs {', '.join(map(repr, others))} with self.log, but under "
            "strategy='shmgrad' training_step runs in the engine's workers, where self.log "
            "does nothing: only the loss reaches Lightning (the trainer logs the whole "
            "batch's loss under the names training_step gives it"
            + (f": {', '.join(repr(n) for n, _ in loss_logs)}" if loss_logs else "")
            + "). Log other values from the trainer process: in validation_step, or in "
            f"on_train_batch_end from the batch ({DOC})",
            UserWarning,
            stacklevel=2,
        )
    if isinstance(output, Mapping) and len(output) > 1:
        extra = [k for k in output if k != "loss"]
        warnings.warn(
            f"training_step returns a dict with {', '.join(map(repr, extra))} beside 'loss': "
            "under strategy='shmgrad' they stay in the engine's workers, and the outputs "
            "that on_train_batch_end receives hold the loss only",
            UserWarning,
            stacklevel=2,
        )
    return LogPlan(loss_logs)


class _EngineStrategyMixin:
    """The strategy's behaviour; :func:`strategy_class` puts it on a Lightning package's
    ``SingleDeviceStrategy``. The documented class is ``EngineStrategy``."""

    strategy_name = NAME
    _pl = None  # the Lightning package (pytorch_lightning or lightning.pytorch)

    def __init__(
        self,
        *,
        workers: Optional[int] = None,
        loss_reduction: Optional[str] = "mean",
        timeout: float = GRADIENT_DEFAULTS["timeout_seconds"],
        max_retries: int = GRADIENT_DEFAULTS["max_retries"],
        checkpoint_io=None,
        **engine_options,
    ):
        if workers is not None and (
            not isinstance(workers, int) or isinstance(workers, bool) or workers < 1
        ):
            raise errors.InvalidArgumentError(
                f"EngineStrategy(workers=...) must be a positive int, got {workers!r}"
            )
        if loss_reduction not in LOSS_REDUCTIONS:
            raise errors.InvalidArgumentError(
                f"EngineStrategy(loss_reduction=...) must be 'mean' (training_step returns "
                "its batch's mean, Lightning's usual loss), 'sum', or None (the engine finds "
                f"out on the first batch), got {loss_reduction!r}"
            )
        unknown = sorted(set(engine_options) - set(ENGINE_OPTIONS))
        if unknown:
            raise errors.InvalidArgumentError(
                f"EngineStrategy got unexpected options {', '.join(unknown)}: it takes "
                f"workers, loss_reduction, timeout, max_retries, checkpoint_io and Engine's "
                f"{', '.join(ENGINE_OPTIONS)}"
            )
        self._parallel_devices = None
        self._num_nodes = 1
        super().__init__(device="cpu", checkpoint_io=checkpoint_io)
        self.workers = workers if workers is not None else default_workers()
        self.loss_reduction = loss_reduction
        self.timeout, self.max_retries = float(timeout), int(max_retries)
        self.engine_options = dict(engine_options)
        self.engine: Optional[Engine] = None  # while fitting
        self.last_stats = None  # the last step's GradientStats
        self._log_plan = None  # found out at the first step of each fit
        self._held = ()  # (parameter, .grad) pairs held from training_step to backward
        # id(parameter) -> (parameter, its gradient summed over an accumulation so far)
        self._sums = {}

    # -- refused at Trainer(...): set by Lightning's accelerator connector ---------------

    @property
    def accelerator(self):
        return self._accelerator

    @accelerator.setter
    def accelerator(self, accelerator):
        if accelerator is not None and not isinstance(
            accelerator, self._pl.accelerators.CPUAccelerator
        ):
            raise errors.InvalidArgumentError(
                f"strategy='shmgrad' trains on the CPU (its workers are CPU processes), but "
                f"the Trainer chose the {type(accelerator).__name__}: pass "
                "Trainer(accelerator='cpu', ...)"
            )
        self._accelerator = accelerator

    @property
    def precision_plugin(self):
        return super().precision_plugin

    @precision_plugin.setter
    def precision_plugin(self, plugin):
        base = self._pl.plugins.precision.Precision
        if plugin is not None and type(plugin) is not base:
            raise errors.InvalidArgumentError(
                f"strategy='shmgrad' trains in float32 (the engine's parameters and "
                f"gradients are float32), but the Trainer chose {type(plugin).__name__}: drop "
                "precision= (or pass precision='32-true')"
            )
        self._precision_plugin = plugin

    @property
    def parallel_devices(self):
        return self._parallel_devices

    @parallel_devices.setter
    def parallel_devices(self, devices):
        if devices is not None and len(devices) != 1:
            raise errors.InvalidArgumentError(
                f"strategy='shmgrad' runs one trainer process and its engine's workers are "
                f"the parallelism, but the Trainer asks for {len(devices)} devices: pass "
                "Trainer(devices=1) (the default on the CPU) and "
                "strategy=EngineStrategy(workers=N) for N workers"
            )
        self._parallel_devices = devices

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, nodes: int):
        if nodes != 1:
            raise errors.InvalidArgumentError(
                f"strategy='shmgrad' runs on one machine, but the Trainer asks for "
                f"num_nodes={nodes}: drop num_nodes= (engines on several nodes are "
                "shmgrad.multinode's, docs/MULTINODE.md)"
            )
        self._num_nodes = nodes

    # -- the engine's lifecycle -----------------------------------------------------------

    def setup(self, trainer) -> None:
        # validate/test/predict run in the trainer alone, with no engine.
        fitting = trainer.state.fn == self._pl.trainer.states.TrainerFn.FITTING
        if fitting:
            self._check_module(self.lightning_module)
        super().setup(trainer)  # the optimizers
        if fitting:
            self._start_engine(self.lightning_module)

    def _check_module(self, module) -> None:
        """Refuses, or warns about, what the workers cannot run; before anything starts."""
        if not module.automatic_optimization:
            raise errors.InvalidArgumentError(
                f"{type(module).__name__} uses manual optimization "
                "(self.automatic_optimization = False), which strategy='shmgrad' cannot run: "
                "training_step runs in the engine's workers, where manual_backward() and "
                "optimizer.step() have no optimizer to step. Use automatic optimization "
                "(training_step returns the loss), or keep manual optimization and call "
                f"the engine from training_step yourself ({DOC}, the manual recipe), or use "
                "strategy='ddp_shmgrad'"
            )
        base = self._pl.LightningModule
        if type(module).backward is not base.backward:
            warnings.warn(
                f"{type(module).__name__} overrides backward(), which strategy='shmgrad' does "
                "not call: the engine's workers run loss.backward() on their shards "
                "themselves. If yours does more, fold that into training_step's loss",
                UserWarning,
                stacklevel=2,
            )

    def _start_engine(self, module) -> None:
        self.engine = Engine(
            model=module,
            workers=self.workers,
            forward=WorkerStep(),
            mode="eager",
            loss_reduction=self.loss_reduction,
            **self.engine_options,
        )
        self.engine.bind(module)  # the module's parameters: views of the shared ones
        self._log_plan = None
        self._held = ()

    def _close_engine(self) -> None:
        engine, self.engine = self.engine, None
        self._held, self._sums = (), {}
        if engine is not None:
            engine.close()

    def teardown(self) -> None:
        try:
            self._close_engine()  # also after an exception: Lightning tears down then
        finally:
            super().teardown()

    # -- a step ---------------------------------------------------------------------------

    def training_step(self, *args, **kwargs):
        if self.engine is None:  # pragma: no cover - Lightning trains only after setup
            return super().training_step(*args, **kwargs)
        batch, batch_idx = self._step_arguments(args, kwargs)
        module, trainer = self.lightning_module, self.lightning_module.trainer
        examples = _losses.batch_length(batch)
        if not examples:
            raise errors.InvalidArgumentError(
                "strategy='shmgrad' splits each batch between its workers along its tensors' "
                f"first dimension, but this batch ({type(batch).__name__}) has no tensor with "
                "one: give the DataLoader batches of tensors with the examples first"
            )
        if self._log_plan is None:
            shard = -(-examples // self.engine.workers)  # the largest a worker gets
            self._log_plan = probe_logging(module, batch, batch_idx, shard)
        stats = self.engine.gradient(
            batch=pack(batch, batch_idx, trainer.current_epoch, trainer.global_step, examples),
            reduction=self.loss_reduction,
            timeout=self.timeout,
            max_retries=self.max_retries,
        )
        self.last_stats = stats
        held = [(p, p.grad) for p in module.parameters() if p.grad is not None]
        accumulate = trainer.accumulate_grad_batches
        if accumulate > 1:
            index = batch_idx if batch_idx is not None else trainer.fit_loop.epoch_loop.batch_idx
            held = self._accumulate(held, fresh=index % accumulate == 0, micro_batches=accumulate)
        # Held until backward: Lightning's optimizer_zero_grad comes first.
        self._held = tuple(held)
        for p, _ in held:
            p.grad = None
        loss = torch.tensor(stats.loss, dtype=torch.float32)
        self._log_plan.log(module, loss, examples)
        return loss

    def _accumulate(self, held, *, fresh: bool, micro_batches: int):
        """Gradient accumulation as Lightning does it: the sum over the micro-batches of
        each one's gradient divided by ``accumulate_grad_batches`` (also for a last window
        that an epoch leaves short), kept here (one copy of the gradient) and copied into
        the engine's gradient after each micro-batch, which ``.grad`` then is. ``fresh``:
        the first micro-batch of a window, where Lightning zeroes the gradient."""
        if fresh:
            self._sums = {}
        sums, weight = self._sums, 1.0 / micro_batches  # by id(): tensors compare by value
        with torch.no_grad():
            for p, grad in held:
                if id(p) in sums:
                    sums[id(p)][1].add_(grad, alpha=weight)
                else:
                    sums[id(p)] = (p, grad * weight)
                grad.copy_(sums[id(p)][1])
        given = {id(p) for p, _ in held}
        # Reached by an earlier micro-batch of the window only: their sum so far.
        return held + [(p, total.clone()) for i, (p, total) in sums.items() if i not in given]

    @staticmethod
    def _step_arguments(args, kwargs):
        """(batch, batch_idx or None) from Lightning's call: it passes batch_idx only to a
        training_step that takes it."""
        names = ("batch", "batch_idx")
        values = dict(zip(names, args), **{k: kwargs[k] for k in names if k in kwargs})
        if "batch" not in values or len(args) + len(kwargs) > 2:
            raise errors.InvalidArgumentError(  # pragma: no cover - Lightning's own call
                "strategy='shmgrad' runs training_step(batch) or training_step(batch, batch_idx)"
            )
        idx = values.get("batch_idx")
        return values["batch"], None if idx is None else int(idx)

    def backward(self, closure_loss, optimizer, *args, **kwargs):
        if self.engine is None:  # pragma: no cover - Lightning trains only after setup
            return super().backward(closure_loss, optimizer, *args, **kwargs)
        module = self.lightning_module
        self.pre_backward(closure_loss)
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
        for p, grad in self._held:  # the workers ran backward: their reduced gradient
            p.grad = grad
        self._held = ()
        closure_loss = self.precision_plugin.post_backward(closure_loss, module)
        self.post_backward(closure_loss)
        return closure_loss

    @classmethod
    def register_strategies(cls, strategy_registry) -> None:
        if NAME not in strategy_registry:
            strategy_registry.register(
                NAME,
                cls,
                description="shmgrad: training_step in an engine's eager workers "
                "(shmgrad.lightning.EngineStrategy)",
            )


_classes = {}
DDP_NAME = "ddp_shmgrad"


def strategy_class(package: str = "pytorch_lightning"):
    """The strategy class for one Lightning package, ``"pytorch_lightning"`` or
    ``"lightning.pytorch"`` (imported if it is not yet), registered there as
    ``"shmgrad"``."""
    if package not in PACKAGES:
        raise errors.InvalidArgumentError(
            f"unknown Lightning package {package!r}: use one of {', '.join(PACKAGES)}"
        )
    cls = _classes.get(package)
    if cls is None:
        import importlib

        pl = importlib.import_module(package)
        strategies = importlib.import_module(f"{package}.strategies")
        cls = type(
            "EngineStrategy",
            (_EngineStrategyMixin, strategies.SingleDeviceStrategy),
            {
                "__module__": __name__,
                "__qualname__": "EngineStrategy",
                "__doc__": STRATEGY_DOC.format(package=package),
                "_pl": pl,
            },
        )
        cls.register_strategies(strategies.StrategyRegistry)
        # DDP over the torch.distributed backend, in one word (docs/BACKEND.md).
        if DDP_NAME not in strategies.StrategyRegistry:
            strategies.StrategyRegistry.register(
                DDP_NAME,
                strategies.DDPStrategy,
                description="DDP over shmgrad's shared-memory torch.distributed backend",
                process_group_backend="shmgrad",
            )
        _classes[package] = cls
    return cls


STRATEGY_DOC = """Lightning ({package}) strategy: ``training_step`` in a shmgrad engine's
eager workers, the rest of Lightning's loop in this process.

``Trainer(strategy="shmgrad")`` or ``Trainer(strategy=EngineStrategy(workers=N))``, on the
CPU with ``devices=1`` (the workers are the parallelism) and 32-bit precision; anything
else is refused when the Trainer is made, naming the fix.

Args (keyword-only):
    workers: the engine's worker processes (default: one per CPU this process may use).
    loss_reduction: what ``training_step``'s loss is over its batch: ``"mean"`` (the
        default, Lightning's usual ``F.cross_entropy(...)``: each worker's mean is weighted
        by its examples, so the gradient is the whole batch's mean however it is split),
        ``"sum"``, or None: the engine finds out on the first batch (and refuses a mean
        that is not over the examples, such as one over tokens).
    timeout, max_retries: each step's, as :meth:`shmgrad.Client.gradient` takes them (a
        step that loses a worker is re-run, with the exact gradient).
    checkpoint_io: Lightning's.
    seed, name, threads_per_worker, max_workers, max_batch, input_capacity_mb,
    startup_timeout, min_examples_per_worker, max_examples_per_pass, compile, buffers,
        trainer_threads: :class:`shmgrad.Engine`'s (trainer_threads: Lightning's process,
        whose validation and callbacks then run on the cores the workers leave).

The engine starts in :meth:`setup` when fitting (validate, test and predict run in this
process alone) and stops in :meth:`teardown`, which Lightning also calls after an
exception. While it runs, ``engine`` is it and ``last_stats`` the last step's
:class:`shmgrad.GradientStats`. Manual optimization is refused; an overridden ``backward``
is warned about (the workers call ``loss.backward()``). docs/LIGHTNING.md has the rest.
"""


def _register_imported() -> list:
    """Registers the strategy with every Lightning package imported so far; with none
    imported, with the first installed one. Returns the classes, in PACKAGES order."""
    imported = [p for p in PACKAGES if p in sys.modules]
    if imported:
        return [strategy_class(p) for p in imported]
    for package in PACKAGES:
        try:
            return [strategy_class(package)]
        except ImportError:
            continue
    raise ImportError(
        "shmgrad.lightning needs Lightning: pip install pytorch-lightning (or lightning)"
    )


EngineStrategy = _register_imported()[0]

__all__ = ["EngineStrategy", "strategy_class", "WorkerTrainer", "NAME"]
