"""A trainer's handle on a running engine: bind a module, ask for gradients, resize,
read the status. :func:`attach` returns one for an engine started elsewhere
(``shmgrad serve``); :class:`shmgrad.Engine` is one that also started its engine.

The parts of a gradient call live in modules of their own: the bound module
(:mod:`._binding`), the request's batch, loss scale and seed (:mod:`._request`),
accumulation (:mod:`._accumulation`), the default reduction (:mod:`._reduction`) and the
result (:mod:`._stats`)."""

import dataclasses
import logging
import time
import warnings
from typing import Optional, Union

import torch

from . import _gpu, _in_trainer, _request, _threads, errors, multinode
from ._accumulation import Accumulation
from ._binding import Binding
from ._native import _C, ATTACH_OPTIONS, DEFAULTS, GRADIENT_OPTIONS
from ._reduction import DefaultReduction
from ._seeding import step_seed
from ._stats import GradientStats
from ._status import EngineStatus, read_status

__all__ = ["Client", "GradientStats", "attach"]

BUFFER_RULES = ("average", "first")  # how a step publishes BatchNorm statistics
STATE_VERSION = 1  # Client.state_dict()'s format
RESIZE_POLL_S = 0.01  # how often resize() looks at the ready worker count

# A gradient call's options are declared once, in engine/trainer.h's list
# (SHMGRAD_GRADIENT_OPTIONS_FIELDS, here GRADIENT_OPTIONS): the defaults below come from it,
# and the native call takes them positionally, in the list's order: gradient() writes them as
# one tuple (the cheapest call: no dict, no attribute set per option) in the order of
# GRADIENT_OPTION_SOURCES, which import checks against the list's; test_options.py checks
# that each value reaches its field. Where gradient() takes each from: its argument of that
# name, or None where it derives it (from the bound module or this client's state).
# To add an option: its line in the list, its line here and in gradient()'s tuple at the same
# place, its argument in gradient() (or attach() and Engine for a client-wide default), and
# its test.
GRADIENT_OPTION_SOURCES = {
    "mean": "reduction",  # "mean" on one node
    "sum_through_mean": "reduction",  # "mean" across nodes, taken after the all-reduce
    "timeout_seconds": "timeout",
    "max_retries": "max_retries",
    "min_examples_per_worker": "min_examples_per_worker",  # None: the client's
    "max_examples_per_pass": "max_examples_per_pass",  # None: the client's
    "raise_on_nonfinite": "raise_on_nonfinite",
    "loss_scale": "loss_scale",
    "seed": "seed",  # None: derived from the client's seed and step count
    "train": None,  # the bound module's mode
    "average_buffers": None,  # the client's buffers= rule
    "accumulate": "accumulate",  # and whether a result is there to add to
    "prev_count": None,  # what the previous result is over
}
if tuple(GRADIENT_OPTION_SOURCES) != tuple(GRADIENT_OPTIONS):  # pragma: no cover - build skew
    raise ImportError(
        f"engine/trainer.h's gradient options {list(GRADIENT_OPTIONS)} differ from "
        f"{__name__}.GRADIENT_OPTION_SOURCES {list(GRADIENT_OPTION_SOURCES)}: list each, in "
        "the same order, there and in Client.gradient's tuple of native options"
    )
GRADIENT_DEFAULTS = {name: option.default for name, option in GRADIENT_OPTIONS.items()}
DEFAULT_BUFFERS = BUFFER_RULES[0] if GRADIENT_DEFAULTS["average_buffers"] else BUFFER_RULES[1]


def _check_buffers(buffers: str) -> str:
    if buffers not in BUFFER_RULES:
        raise errors.InvalidArgumentError(
            f"buffers must be 'average' (the workers' BatchNorm statistics averaged) or "
            f"'first' (the first worker's, DDP's rule), got {buffers!r}"
        )
    return buffers


class Client:
    """A trainer attached to a running engine; :func:`attach` makes one.

    Only one trainer holds an engine at a time (the lease is released by :meth:`close`,
    at the end of a ``with`` block, or when this process dies). Closing a client does
    not stop the engine.

    With ``process_group`` (a ``torch.distributed`` group with one trainer per node, e.g.
    ``torch.distributed.group.WORLD``), this node's engine is one of several: see
    :mod:`shmgrad.multinode` and docs/MULTINODE.md. Construction, :meth:`bind`,
    :meth:`gradient` and :meth:`check_consistency` are then collective: every node calls
    them, in the same order.
    """

    # Class-level defaults, so that close() works on an object whose __init__ failed.
    mode_reason = ""  # why the workers are of their kind: known to the Engine that chose
    _trainer = None
    _closed = False
    _nodes = None
    _binding = None
    _in_trainer = None
    _engine_status = None
    _trainer_threads = None
    _threads_in_trainer = False

    def __init__(
        self,
        name: str,
        trainer,
        *,
        seed: int = 0,
        min_examples_per_worker: int = GRADIENT_DEFAULTS["min_examples_per_worker"],
        max_examples_per_pass: int = GRADIENT_DEFAULTS["max_examples_per_pass"],
        process_group=None,
        bucket_cap_mb: Optional[float] = None,
        buffers: str = DEFAULT_BUFFERS,
        trainer_threads: Union[int, str, None] = "auto",
    ):
        """Wraps ``trainer``, a native ``_C.Trainer`` attached to engine ``name``. Use
        :func:`attach` (or :class:`shmgrad.Engine`) rather than this."""
        self.buffers = _check_buffers(buffers)
        _threads.check(trainer_threads)
        self.name = name
        self.seed = seed  # eager workers' step seeds derive from it
        self._steps = 0  # gradient calls so far
        self._trainer = trainer
        self.min_examples_per_worker = min_examples_per_worker
        self.max_examples_per_pass = max_examples_per_pass
        # Only eager workers use a step's seed; TorchScript workers get 0, which spares the
        # step the seed's arithmetic.
        try:
            engine_status = _C.status(name)
            self.mode = engine_status["worker_kind"]  # "script" or "eager"
        except Exception:  # no status: send seeds anyway, as an eager engine needs them
            engine_status, self.mode = None, "eager"
        self._eager_workers = self.mode == "eager"
        self._param_info = [(n, tuple(s)) for n, s, _ in trainer.parameters()]
        self._param_views = trainer.parameter_views()
        # A GPU engine: the bound module's parameters are on this device, and its buffers
        # are device copies of the shared (host) ones, exchanged around each step.
        self._device = None if trainer.device < 0 else torch.device("cuda", trainer.device)
        # Whether the views are of the engine's device memory (a GPU's, or a test double's
        # host memory): close() then lets go of every one of them before the engine stops.
        self._on_device = trainer.on_device
        # The two reduced gradients: a step writes the first, accumulating steps alternate.
        grad_sets = (trainer.gradient_views(), trainer.accumulator_views())
        self._acc = Accumulation(grad_sets)
        self._binding = Binding(
            name, trainer, self._param_info, self._param_views, grad_sets, self._device
        )
        self._reduction = DefaultReduction(name, trainer)
        self._warned_passes = False
        # serve --workers auto on the host: this process may compute a
        # step itself, as one of the placements (python/shmgrad/_in_trainer.py).
        self._in_trainer = _in_trainer.prepare(name, trainer)
        # serve --workers auto: the native trainer times placements on the first steps;
        # this says what it chose, once (status(), log(), the "shmgrad" logger).
        placement = trainer.placement()
        self._placement_probing = placement["state"] == "probing"
        self._placement_report = ""
        if process_group is not None:
            try:
                self._nodes = multinode.NodeGroup(
                    process_group,
                    trainer,
                    self._param_info,
                    engine_name=name,
                    bucket_cap_mb=bucket_cap_mb,
                )
            except BaseException:
                self.close()  # an Engine's close() also stops the engine it started
                raise
        # The trainer's intra-op threads: on a CPU engine, those its workers leave free
        # (python/shmgrad/_threads.py: idle threads spin for milliseconds on the workers'
        # cores). Restored by close().
        self._trainer_threads = trainer_threads
        self._engine_status = engine_status
        # A placement chosen before (by an earlier trainer) may be the trainer's own.
        self._threads_in_trainer = placement["in_trainer"] and not self._placement_probing
        if engine_status is not None:
            _threads.hold(
                id(self),
                _threads.choose(
                    trainer_threads, engine_status, _C.physical_cores(), self._threads_in_trainer
                ),
                name,
            )

    @property
    def trainer_threads(self) -> Optional[int]:
        """The intra-op threads this client holds the trainer process to (None: its own
        setting, ``trainer_threads=None`` or a GPU engine); see :class:`shmgrad.Engine`."""
        return _threads.held(id(self))

    def _adopt_job(self, loss_reduction, probe_job, trainable):
        """What an :class:`shmgrad.Engine` knows from the job it started: what its loss
        returns (None: not known), the job to find that out with (model, loss, forward),
        and which parameters its workers train (the model's requires_grad flags)."""
        self._reduction.known = loss_reduction
        self._reduction.probe_job = probe_job
        if trainable is not None and len(trainable) == len(self._param_info):
            self._binding.engine_trainable = trainable

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
        self._binding.views_handed_out = True
        return list(self._param_views)

    def gradient_tensors(self):
        """Tensors aliasing the engine's reduced gradient, as the last :meth:`gradient`
        left it (an accumulating call leaves it in the engine's other buffer: ask again
        after one)."""
        self._binding.views_handed_out = True
        return list(self._acc.views)

    def state_dict(self) -> dict:
        """What this client needs to continue a run identically after a restart: the seed
        and the step count that the eager workers' step seeds derive from. Save it with
        the model's and the optimizer's; :meth:`load_state_dict` on a new engine."""
        return {"version": STATE_VERSION, "seed": self.seed, "steps": self._steps}

    def load_state_dict(self, state: dict):
        """Continues from :meth:`state_dict`'s state: the next :meth:`gradient` draws the
        step seed the saved run's next call would have drawn."""
        if not isinstance(state, dict) or state.get("version") != STATE_VERSION:
            raise errors.InvalidArgumentError(
                f"not a shmgrad engine state (version {STATE_VERSION}): {state!r:.80}; save one "
                "with engine.state_dict()"
            )
        seed, steps = state.get("seed"), state.get("steps")
        for name, v in (("seed", seed), ("steps", steps)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise errors.InvalidArgumentError(f"engine state: {name} must be an int >= 0")
        self.seed, self._steps = seed, steps

    def bind(self, module: torch.nn.Module) -> torch.nn.Module:
        """Makes ``module``'s parameters views of the engine's shared parameters (their
        current values are copied in once) and their ``.grad`` views of the reduced gradient.

        Afterwards any ``torch.optim`` optimizer works unchanged: :meth:`gradient` fills
        ``.grad``, ``optimizer.step()`` updates the shared parameters in place, and every
        worker sees the update with no copy. The module must have the engine's parameters
        (same names, shapes, order). Its float32/int64 buffers (BatchNorm statistics) become
        views of the engine's shared buffers: after each step they hold the workers'
        statistics averaged by their examples (``buffers="first"``: the first worker's,
        DDP's rule; each worker normalises with its own shard's batch statistics, as DDP
        without SyncBatchNorm does).
        Across nodes, every node then takes rank 0's parameters (a broadcast, as DDP does).
        Returns ``module``.
        """
        self._check_open()
        if not isinstance(module, torch.nn.Module):
            raise errors.InvalidArgumentError(
                f"bind needs a torch.nn.Module, got {type(module).__name__}"
            )
        given = self._binding.bind(module, self._nodes)
        self._acc.current = 0  # the .grad view the first reduced gradient
        return given

    def gradient(
        self,
        indices=None,
        *,
        inputs=None,
        targets=None,
        reduction: Optional[str] = None,
        timeout: float = GRADIENT_DEFAULTS["timeout_seconds"],
        max_retries: int = GRADIENT_DEFAULTS["max_retries"],
        min_examples_per_worker: Optional[int] = None,
        max_examples_per_pass: Optional[int] = None,
        raise_on_nonfinite: bool = GRADIENT_DEFAULTS["raise_on_nonfinite"],
        seed: Optional[int] = None,
        accumulate: bool = False,
        batch=None,
        loss_scale=GRADIENT_DEFAULTS["loss_scale"],
    ) -> GradientStats:
        """Computes the gradient of the loss over a batch into the reduced gradient (and so
        into the ``.grad`` of a bound module).

        Give either ``indices`` (positions in the engine's dataset: a sequence, array or
        integer tensor) or ``inputs`` and ``targets`` (tensors with a batch dimension;
        class labels as integers for cross_entropy/nll, float targets for mse), or, with
        eager workers, ``batch``: a dict, tuple or list (nested) of tensors with the
        examples along their first dimension, as a tokenizer or a ``collate_fn`` makes
        it; the engine splits it along that dimension, keeps every dtype, and hands each
        worker's ``forward(model, shard)`` (or ``loss(model(b[0]), b[1])`` for a pair)
        the same structure.
        ``reduction="sum"`` gives the gradient of the summed loss, ``"mean"`` of its mean
        (over the examples, or over the counts ``forward`` returned with its loss). The
        default is the loss's own, what ``loss.backward()`` on the batch would give:
        ``"mean"`` for a mean loss (``nn.CrossEntropyLoss()``, ``F.cross_entropy``, a
        ``forward`` returning ``(loss_sum, count)``), ``"sum"`` for a sum (the named
        losses); an attached client takes what the engine says (``status().loss_reduction``),
        and refuses while an eager job's workers have not found it out yet.

        ``accumulate=True`` adds this batch's gradient to the previous calls' instead of
        replacing it, as ``loss.backward()`` adds to ``.grad``: several micro-batches give
        the gradient of their union (with ``reduction="mean"``, the mean over all their
        examples or counts). It adds to the results since the last call without
        ``accumulate``, or since ``optimizer.zero_grad()`` set ``.grad`` to None (or zeroed
        it). Every call of one accumulation takes the same ``reduction``. A micro-batch
        retried after a worker died is added once. Across nodes each micro-batch is
        all-reduced, then added by the trainer (one pass over the gradient).

        ``loss_scale=scaler`` (a ``torch.amp.GradScaler``) scales the loss as
        ``scaler.scale(loss).backward()`` does: every worker backpropagates its loss times
        the scaler's current scale, so the reduced gradient is scaled, and
        ``scaler.step(optimizer)`` unscales it and skips the step if it overflowed, then
        ``scaler.update()``. A number is a fixed scale (1: none). Every call of one
        accumulation takes the same scale. The returned ``loss`` is not scaled.

        .. warning:: Blocks until every worker has finished its slice of the reduction
           (a synchronisation point of all workers), an error is raised, or ``timeout``
           seconds pass. A step that loses a worker is re-run (up to ``max_retries``) and
           still returns the exact gradient.

        Across nodes (an engine with a ``process_group``), give this node's share of the
        global batch (:func:`shmgrad.multinode.shard`; it may be empty): every node
        then gets the gradient of the whole global batch, the mean over the global count.
        After its own step the node all-reduces its reduced gradient with the others'
        (a synchronisation point of all nodes, bounded by the process group's timeout).

        Eager workers seed Python's ``random``, NumPy and torch with
        :func:`shmgrad.example_seed` ``(seed, i)`` before ``dataset[i]``: ``seed`` as
        given, else derived from the engine's seed and this client's step count
        (:func:`shmgrad.step_seed`). The bound module's train/eval mode goes to the
        workers with the step.

        Raises:
            InvalidArgumentError: bad indices, shapes, dtypes, an empty batch.
            WorkerError: the model rejected the input (the worker's message follows).
            EngineTimeoutError: the step did not finish in time. The engine keeps serving.
            NonFiniteError: NaN/inf in loss or gradient, when ``raise_on_nonfinite``.
            NodeError: across nodes, a peer died, timed out or failed its step.
        """
        t = self._check_open()
        scale = _request.loss_scale_value(loss_scale, self._device)
        mean = self._reduction.is_mean(reduction, inputs, targets, batch)
        binding, acc, nodes = self._binding, self._acc, self._nodes
        binding.check_unchanged()
        # Across nodes the mean is taken after the all-reduce, and accumulated results are
        # added by the trainer (onto_nodes).
        mode, prev_count, onto_nodes = acc.begin(
            accumulate, mean, scale, nodes is not None, binding.grad_dropped
        )
        mepw = (
            self.min_examples_per_worker
            if min_examples_per_worker is None
            else min_examples_per_worker
        )
        mepp = (
            self.max_examples_per_pass if max_examples_per_pass is None else max_examples_per_pass
        )
        if seed is None:
            seed = step_seed(self.seed, self._steps) if self._eager_workers else 0
        else:
            seed = _request.check_seed(seed)
        self._steps += 1
        train = binding.training
        if mepp > 0 and train and binding.has_batchnorm:
            self._warn_passes(mepp)
        # The native options, one per field of GRADIENT_OPTION_SOURCES, in its order.
        args = (
            mean and nodes is None,  # mean
            # sum_through_mean: across nodes a mean is taken after the all-reduce, over the
            # global count: the node computes its sum through its batch's mean (as DDP's
            # ranks backpropagate theirs), so float16 with a GradScaler overflows where
            # DDP's would.
            mean and nodes is not None,
            float(timeout),  # timeout_seconds
            int(max_retries),
            int(mepw),  # min_examples_per_worker
            int(mepp),  # max_examples_per_pass
            bool(raise_on_nonfinite),
            scale,  # loss_scale
            seed,
            train,
            self.buffers == "average",  # average_buffers
            mode,  # accumulate
            prev_count,
        )
        local_step, empty = _request.local_step(
            t, args, indices, inputs, targets, batch, nodes is not None
        )
        if binding.mirrors:
            binding.push_buffers()
        # What follows the step runs with the caches cold (this process slept through it):
        # every attribute read and context manager here costs microseconds, so the common
        # case (one node, no buffers to mirror) reads as little as it can.
        if nodes is None:
            native = local_step()
            stats, count, unused = GradientStats(native), native.count, native.unused_params
        else:
            native, node_stats = nodes.gradient(None if empty else local_step, mean)
            stats = GradientStats(native, node_stats)
            count, unused = stats.count, stats.unused_params
        if binding.mirrors:
            binding.pull_buffers()
        # The probe's steps, and those of a recheck (the watch of the kept placement may
        # start the probe again: engine/placement.h).
        if self._placement_probing or (native is not None and native.placement_probing):
            self._note_placement()
        acc.finish(mode, onto_nodes, mean, scale, prev_count, count)
        # Accumulated: a parameter is unused only if it was in every micro-batch.
        binding.after_step(acc.current, unused, accumulated=mode != 0 or onto_nodes)
        return stats

    def _warn_passes(self, mepp):
        if self._warned_passes:
            return
        self._warned_passes = True
        warnings.warn(
            f"engine {self.name!r}: max_examples_per_pass={mepp} splits each worker's "
            "shard into passes, and BatchNorm in train mode normalises each pass with its "
            "own statistics: the gradient differs from one pass over the shard (and the "
            "running statistics are updated once per pass)",
            stacklevel=3,
        )

    def _note_placement(self):
        """After a step of the placement probe: the trainer's threads for the placement
        that step ran with; once the probe has chosen, says what, once."""
        placement = self._trainer.placement()
        self._follow_placement(placement["in_trainer"])
        if placement["state"] == "probing":
            self._placement_probing = True
            return
        self._placement_probing = False
        self._placement_report = f"engine {self.name!r}: {placement['report']}"
        logging.getLogger("shmgrad").info("%s", self._placement_report)

    def _follow_placement(self, in_trainer: bool, changed: bool = False):
        """The trainer's threads (trainer_threads="auto") for a placement: all it had where
        it computes the steps itself, the cores the workers leave free otherwise. During
        the probe too, which times each candidate from one step's start to the next's:
        what a loop pays for it, its optimizer's step on these threads included.
        ``changed``: the workers changed (a resize), so their free cores may have too."""
        if self._engine_status is None or (in_trainer == self._threads_in_trainer and not changed):
            return
        self._threads_in_trainer = in_trainer
        _threads.rehold(
            id(self),
            _threads.choose(
                self._trainer_threads, self._engine_status, _C.physical_cores(), in_trainer
            ),
            self.name,
        )

    @property
    def node_rank(self) -> int:
        """This node's rank in the engine's process group (0 without one)."""
        return 0 if self._nodes is None else self._nodes.rank

    @property
    def node_count(self) -> int:
        """Nodes in the engine's process group (1 without one)."""
        return 1 if self._nodes is None else self._nodes.size

    def check_consistency(self) -> int:
        """Returns a 64-bit checksum of the engine's parameters and buffers. Across nodes it
        is compared with every node's (collective: every node calls it) and
        ConsistencyError, naming the first rank that differs from rank 0, is raised unless
        all are bit-identical."""
        self._check_open()
        if self._nodes is None:
            return multinode.checksum(
                [self._trainer.parameter_buffer()] + [t for _, t in self._trainer.buffer_views()]
            )
        return self._nodes.check_consistency()

    def resize(self, workers: int, *, timeout: float = DEFAULTS["resize_timeout"]):
        """Runs ``workers`` worker processes (1 to ``max_workers``). New workers map the
        current parameters; removed ones exit cleanly. Blocks until that many are ready."""
        t = self._check_open()
        if not isinstance(workers, int) or workers < 1:
            raise errors.InvalidArgumentError(f"workers must be a positive int, got {workers!r}")
        if t.placement()["auto"]:
            # An engine that placed its steps itself (workers="auto"): the count asked for
            # is the placement from now on, the cores shared among its workers (a probe it
            # ends is reported after the next step, as one that chose).
            t.set_placement(0, max(1, t.cores() // workers))
        _C.request_resize(self.name, workers)
        deadline = time.monotonic() + timeout
        while t.worker_count() != workers:
            if time.monotonic() > deadline:
                waiting = ", ".join(
                    f"worker {w.slot} {w.state} (pid {w.pid}, restarts {w.restarts})"
                    for w in read_status(self.name).workers
                    if w.state != "ready"
                )
                raise errors.EngineTimeoutError(
                    f"engine {self.name!r}: {t.worker_count()} workers ready, not "
                    f"{workers}, after {timeout} s"
                    + (f"; not ready: {waiting}" if waiting else "")
                    + "; the engine's output (Engine.log(), or shmgrad serve's) says why a "
                    "worker did not start"
                )
            time.sleep(RESIZE_POLL_S)
        if self._engine_status is not None:
            # The workers compute from now on (the trainer may have computed itself): the
            # trainer's threads are the cores they leave free again.
            self._engine_status = dict(self._engine_status, target_workers=workers)
            self._follow_placement(False, changed=True)

    def log(self) -> str:
        """What the engine's coordinator and workers have printed so far: ``""`` for an
        engine this process attached to (its output goes where ``shmgrad serve``'s
        does), but the placement this trainer chose (``workers="auto"``); see
        :meth:`shmgrad.Engine.log` for one this process started."""
        return self._placement_report + "\n" if self._placement_report else ""

    def status(self) -> EngineStatus:
        """The engine's state as data (:class:`shmgrad.EngineStatus`: workers with their
        pids, states and the step each works on, steps served, aborted and retried,
        recent steps' time breakdown) and as ``text``, the way ``shmgrad status`` prints
        it. Reads the segment only: safe from another thread while :meth:`gradient`
        runs."""
        t = self._check_open()
        status = read_status(self.name)
        extra = {"mode_reason": self.mode_reason} if self.mode_reason else {}
        placement = t.placement()
        if placement["probe"] or placement["report"]:
            extra["placement_probe"] = tuple(placement["probe"])
            extra["placement_report"] = placement["report"]
        return dataclasses.replace(status, **extra) if extra else status

    def close(self):
        """Releases the engine (the next trainer may attach); idempotent.

        Bound modules keep working tensors (the shared memory stays mapped while they
        exist; a GPU engine's bound module gets its own copies on its device, since the
        engine's device memory goes with the engine), but further gradients need a new
        client.
        """
        if self._closed:
            return
        self._closed = True
        _threads.release(id(self))
        if self._binding is not None:
            self._binding.discard_watch.close()
        if getattr(self, "_on_device", False) and self._binding is not None:
            self._detach_from_device_memory()
        if self._trainer is not None:
            self._trainer.close()
        if self._in_trainer is not None:  # after the trainer, which calls into it
            self._in_trainer.close()
        self._in_trainer = None

    def _detach_from_device_memory(self):
        """The engine frees its device memory when it stops, and CUDA leaves freeing memory
        that another process still maps undefined: the bound module keeps copies, and every
        view this client holds is let go, so that the trainer's mapping closes with the
        last of them and the segment says so (engine/trainer.cc, openMemory). Views handed
        out by gradient_tensors() and parameter_tensors() keep it open while they live."""
        self._binding.keep_copies()
        self._param_views = []
        self._acc.grad_sets = ([], [])
        self._nodes = None  # its flat views and buckets

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
        return f"<shmgrad.{type(self).__name__} {getattr(self, 'name', '?')!r} {state}>"


def attach(
    name: str,
    *,
    timeout: float = ATTACH_OPTIONS["timeout_seconds"].default,
    seed: int = 0,
    min_examples_per_worker: int = GRADIENT_DEFAULTS["min_examples_per_worker"],
    max_examples_per_pass: int = GRADIENT_DEFAULTS["max_examples_per_pass"],
    process_group=None,
    bucket_cap_mb: Optional[float] = None,
    buffers: str = DEFAULT_BUFFERS,
    trainer_threads: Union[int, str, None] = "auto",
) -> Client:
    """Attaches to an engine started with ``shmgrad serve --name NAME``.

    Waits up to ``timeout`` seconds for it to serve. Raises :class:`EngineNotFoundError`
    if there is none, :class:`BusyError` (naming the holder's pid) if another trainer
    holds it. :meth:`Client.close` releases it without stopping it.

    ``process_group``: a ``torch.distributed`` group with one trainer per node (this
    node's engine is then one of several; collective, see :class:`Client`);
    ``bucket_cap_mb``: all-reduce the gradient in buckets of this many MiB (default: one
    call on the whole buffer); ``buffers`` and ``trainer_threads``: as
    :class:`shmgrad.Engine`'s.
    """
    _C.check_engine_name(name)
    _check_buffers(buffers)
    _threads.check(trainer_threads)
    trainer = _C.Trainer.attach(name, timeout_seconds=timeout, cuda_library=_gpu.LIBRARY)
    return Client(
        name,
        trainer,
        seed=seed,
        min_examples_per_worker=min_examples_per_worker,
        max_examples_per_pass=max_examples_per_pass,
        process_group=process_group,
        bucket_cap_mb=bucket_cap_mb,
        buffers=buffers,
        trainer_threads=trainer_threads,
    )
