"""A trainer's handle on a running engine: bind a module, ask for gradients, resize,
read the status. :func:`attach` returns one for an engine started elsewhere
(``shmgrad serve``); :class:`shmgrad.Engine` is one that also started its engine."""

import dataclasses
import logging
import math
import operator
import time
import warnings
from typing import List, Optional

import torch

from . import _eager, _gpu, errors, multinode
from ._discard import DiscardWatch
from ._native import _C, DEFAULTS
from ._eager import REDUCTIONS, compiled_original, has_batchnorm, shared_buffers, step_seed
from ._status import EngineStatus, read_status

_REQUIRES_GRAD = operator.attrgetter("requires_grad")

BUFFER_RULES = ("average", "first")  # how a step publishes BatchNorm statistics
STATE_VERSION = 1  # Client.state_dict()'s format
RESIZE_POLL_S = 0.01  # how often resize() looks at the ready worker count
_NONE_UNUSED = frozenset()
_FLOAT32_MAX = torch.finfo(torch.float32).max  # the largest loss_scale a step can carry


class GradientStats:
    """What one :meth:`Client.gradient` call did. Fields are read from the native result
    only when asked for, so a training loop that ignores them pays nothing for them.

    ``num_examples``, ``count`` (the mean's denominator: ``num_examples``, or the sum of the
    counts ``forward`` returned), ``loss`` (the sum, or the mean with ``reduction="mean"``),
    ``loss_sum``, ``wall_seconds`` (the call, as the engine timed it), ``reduce_seconds``
    (slowest worker's slice), ``retries``, ``nonfinite``; per worker that took part, in rank
    order: ``compute_seconds``, ``reduce_seconds_per_worker``, ``wait_seconds``,
    ``worker_examples``, ``worker_slots``, ``nonfinite_workers``; ``workers`` is how many.
    ``unused_params``: the parameters (indices, ``named_parameters()`` order) that no
    participant's backward reached, whose ``.grad`` the bound module leaves None.
    Where the wall time went: ``prepare_seconds`` (checks, batch copy), ``step_seconds``
    (publish to the end of the reduction), ``wake_seconds`` (publish to the last worker
    starting), ``finish_seconds`` (end of the reduction to return).

    Across nodes (an engine with a ``process_group``), ``num_examples``, ``loss``,
    ``loss_sum`` and ``nonfinite`` are the global batch's; ``local_num_examples`` and
    ``local_loss_sum`` this node's, ``allreduce_seconds`` the all-reduce's (not in
    ``wall_seconds``, which is the node's own step), ``allreduce_bytes`` the bytes it
    all-reduced, ``nodes`` how many. On one node these are the same figures, 0.0, 0 and 1.
    """

    __slots__ = ("_native", "_nodes")
    # The native record's scalar fields (engine/trainer.h's field list), read by name.
    _SCALARS = tuple(
        f for f, kind, _ in _C.RECORDS["GradientStats"] if kind != "list:WorkerStepStats"
    )
    _NODE_FIELDS = multinode.NodeStats.__slots__
    _ONE_NODE = {"local_num_examples": "num_examples", "local_loss_sum": "loss_sum"}
    _ONE_NODE_CONSTANTS = {"allreduce_seconds": 0.0, "allreduce_bytes": 0, "nodes": 1}

    def __init__(self, native, nodes=None):
        self._native = native
        self._nodes = nodes  # a multinode.NodeStats across nodes, None on one node

    def __getattr__(self, name):
        if self._nodes is not None and name in GradientStats._NODE_FIELDS:
            return getattr(self._nodes, name)
        if name in GradientStats._SCALARS:
            return getattr(self._native, name)
        if name in GradientStats._ONE_NODE:
            return getattr(self._native, GradientStats._ONE_NODE[name])
        if name in GradientStats._ONE_NODE_CONSTANTS:
            return GradientStats._ONE_NODE_CONSTANTS[name]
        raise AttributeError(f"GradientStats has no field {name!r}")

    def _column(self, field):
        return [getattr(w, field) for w in self._native.workers]

    @property
    def workers(self) -> int:
        return len(self._native.workers)

    @property
    def worker_slots(self) -> List[int]:
        return self._column("slot")

    @property
    def worker_examples(self) -> List[int]:
        return self._column("examples")

    @property
    def compute_seconds(self) -> List[float]:
        return self._column("compute_seconds")

    @property
    def reduce_seconds_per_worker(self) -> List[float]:
        return self._column("reduce_seconds")

    @property
    def wait_seconds(self) -> List[float]:
        return self._column("wait_seconds")

    @property
    def nonfinite_workers(self) -> List[int]:
        return [w.slot for w in self._native.workers if w.nonfinite_loss or w.nonfinite_grad]

    def as_dict(self) -> dict:
        """Every field as a plain dict (e.g. for logging)."""
        names = tuple(dict.fromkeys(self._SCALARS + self._NODE_FIELDS)) + (
            "workers",
            "worker_slots",
            "worker_examples",
            "compute_seconds",
            "reduce_seconds_per_worker",
            "wait_seconds",
            "nonfinite_workers",
        )
        return {n: getattr(self, n) for n in names}

    def __repr__(self):
        return (
            f"GradientStats(num_examples={self.num_examples}, loss={self.loss:.6g}, "
            f"workers={self.workers}, wall_seconds={self.wall_seconds:.6f}, "
            f"retries={self.retries})"
        )


def _check_buffers(buffers: str) -> str:
    if buffers not in BUFFER_RULES:
        raise errors.InvalidArgumentError(
            f"buffers must be 'average' (the workers' BatchNorm statistics averaged) or "
            f"'first' (the first worker's, DDP's rule), got {buffers!r}"
        )
    return buffers


# The fix named wherever gradient() cannot find out its default reduction.
_SAY_REDUCTION = (
    "give gradient(..., reduction='sum' or 'mean'), or start the engine with loss_reduction= "
    "(for shmgrad serve --eager: the job's 'loss_reduction')"
)


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
    # What the loss returns for a batch ("sum", "mean", "weighted"), known to the Engine
    # that started the job (None: not known here), and what to find it out with.
    _loss_reduction = None
    _probe_job = None
    _trainer = None
    _closed = False
    _nodes = None
    _discard_watch = None

    def __init__(
        self,
        name: str,
        trainer,
        *,
        seed: int = 0,
        min_examples_per_worker: int = 1,
        max_examples_per_pass: int = 0,
        process_group=None,
        bucket_cap_mb: Optional[float] = None,
        buffers: str = "average",
    ):
        """Wraps ``trainer``, a native ``_C.Trainer`` attached to engine ``name``. Use
        :func:`attach` (or :class:`shmgrad.Engine`) rather than this."""
        self.buffers = _check_buffers(buffers)
        self.name = name
        self.seed = seed  # eager workers' step seeds derive from it
        self._steps = 0  # gradient calls so far
        self._trainer = trainer
        self._all_bound = []  # the bound module's parameters, in the engine's order
        self._bound = []  # those of them that require grad: the ones given a .grad
        self._requires_grad = []  # each bound parameter's requires_grad, as last seen
        # Which parameters the workers' models train (requires_grad when the engine
        # started): an Engine knows them from its model; attach() takes the bound module's.
        self._engine_trainable = None
        self._bound_module = None
        self._views_handed_out = False  # gradient_tensors()/parameter_tensors() were asked for
        self._warned_unbound = False
        # Warns once when a gradient was dropped before an optimizer step used it.
        self._discard_watch = DiscardWatch(name)
        self.min_examples_per_worker = min_examples_per_worker
        self.max_examples_per_pass = max_examples_per_pass
        # Only eager workers use a step's seed; TorchScript workers get 0, which spares the
        # step the seed's arithmetic.
        try:
            self.mode = _C.status(name)["worker_kind"]  # "script" or "eager"
        except Exception:  # no status: send seeds anyway, as an eager engine needs them
            self.mode = "eager"
        self._eager_workers = self.mode == "eager"
        self._param_info = [(n, tuple(s)) for n, s, _ in trainer.parameters()]
        self._param_views = trainer.parameter_views()
        # The two reduced gradients: a step writes the first, and accumulating steps
        # alternate (each reads the previous result and writes the other one).
        self._grad_sets = (trainer.gradient_views(), trainer.accumulator_views())
        # What the bound module's .grad are: other tensor objects over the same memory, so
        # that a conversion that replaces a .grad's data in place (model.double(), .to())
        # cannot touch the engine's own views; bind makes them.
        self._grad_aliases = self._grad_sets
        self._bound_grad_sets = self._grad_aliases  # those of the bound ones that train
        # The first and last bound parameters' addresses: still in the engine's memory?
        self._bound_ptrs = None
        # The parameters (indices) no participant's backward reached in the last result
        # (every micro-batch of an accumulation), and those whose .grad was set to None
        # for it: they keep .grad None, as after plain PyTorch's backward.
        self._unused = _NONE_UNUSED
        self._nulled = ()
        self._current = 0  # the set that holds the last result
        self._last_count = 0.0  # what the last result is the sum or mean over
        self._last_mean = None  # its reduction; None: no result yet
        self._last_loss_scale = 1.0  # and its loss scale
        self._has_batchnorm = False
        self._warned_passes = False
        # A GPU engine: the bound module's parameters are on this device, and its buffers
        # are device copies of the shared (host) ones, exchanged around each step.
        self._device = None if trainer.device < 0 else torch.device("cuda", trainer.device)
        # Whether the views are of the engine's device memory (a GPU's, or a test double's
        # host memory): close() then lets go of every one of them before the engine stops.
        self._on_device = trainer.on_device
        self._buffer_mirrors = []
        # serve --workers auto: the native trainer times placements on the first steps;
        # this says what it chose, once (status(), log(), the "shmgrad" logger).
        self._placement_probing = trainer.placement()["state"] == "probing"
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
        self._views_handed_out = True
        return list(self._param_views)

    @property
    def _grad_views(self):
        return self._grad_sets[self._current]

    def gradient_tensors(self):
        """Tensors aliasing the engine's reduced gradient, as the last :meth:`gradient`
        left it (an accumulating call leaves it in the engine's other buffer: ask again
        after one)."""
        self._views_handed_out = True
        return list(self._grad_views)

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
        given = module
        module, _ = compiled_original(module)  # a torch.compile'd module: the one it wraps
        named = list(module.named_parameters())
        if len(named) != len(self._param_info):
            raise errors.InvalidArgumentError(
                f"the module has {len(named)} parameters but the engine has "
                f"{len(self._param_info)}: "
                "bind the module the engine was started with"
            )
        for i, ((name, p), (ename, eshape)) in enumerate(zip(named, self._param_info)):
            if name != ename or tuple(p.shape) != eshape or p.dtype != torch.float32:
                raise errors.InvalidArgumentError(
                    f"module parameter {i} {name!r} {tuple(p.shape)} ({p.dtype}) does "
                    "not match the "
                    f"engine's {ename!r} {eshape} (float32): bind the module the engine "
                    "was started with"
                )
        flags = [p.requires_grad for _, p in named]
        if self._engine_trainable is None:
            self._engine_trainable = flags
        self._check_trainable(flags)
        self._grad_aliases = tuple([g.detach() for g in views] for views in self._grad_sets)
        with torch.no_grad():
            for (_, p), view, grad in zip(named, self._param_views, self._grad_aliases[0]):
                view.copy_(p.detach())
                p.data = view
                p.grad = grad
        self._bind_buffers(module)
        self._current = 0
        self._all_bound = [p for _, p in named]
        self._bound_ptrs = (named[0][1].data_ptr(), named[-1][1].data_ptr()) if named else None
        self._unused, self._nulled = _NONE_UNUSED, ()
        self._set_trainable(flags)
        self._bound_module = module
        self._has_batchnorm = has_batchnorm(module)
        if self._nodes is not None:
            self._nodes.broadcast_parameters()  # every node takes rank 0's values
            self._pull_buffers()
        return given

    def _refuse_moved_parameters(self):
        """The bound module's parameters left the engine's memory after bind: an optimizer
        would step private copies that no worker sees (and gradient() would fill .grad
        tensors it no longer steps with). Refused, naming the parameter and the fix."""
        moved, p = next(
            (name, p)
            for (name, _), p, view in zip(self._param_info, self._all_bound, self._param_views)
            if p.data_ptr() != view.data_ptr()
        )
        raise errors.InvalidArgumentError(
            f"the bound module's parameter {moved!r} ({p.dtype}, {p.device}) no longer lies "
            f"in engine {self.name!r}'s memory: its data was replaced after bind "
            "(model.to(), .cuda(), .double(), .half() or an assignment to .data), so the "
            "optimizer would step a copy that no worker sees. Convert the model before "
            "starting the engine and evaluate a converted copy (copy.deepcopy(model).to(...)), "
            "or convert it back and call engine.bind(model) again, which copies its values in"
        )

    def _check_trainable(self, flags):
        """Refuses a parameter that requires grad but that the workers' models have frozen:
        they compute no gradient for it, so it would train on zeros."""
        thawed = [
            name
            for (name, _), now, then in zip(self._param_info, flags, self._engine_trainable)
            if now and not then
        ]
        if thawed:
            raise errors.InvalidArgumentError(
                f"parameter {thawed[0]!r}{f' (and {len(thawed) - 1} more)' if thawed[1:] else ''}"
                " requires grad, but it was frozen (requires_grad=False) in the model the "
                f"engine {self.name!r} started with, so its workers compute no gradient for "
                "it: start the engine with every parameter you will train unfrozen (freezing "
                "one later is fine: its .grad then stays None)"
            )

    def _set_trainable(self, flags):
        """Gives a .grad (a view of the reduced gradient) to the bound parameters that
        require grad, and None to the others, as backward leaves a frozen parameter's: an
        optimizer then skips it (no weight decay, no momentum), as in plain PyTorch."""
        self._requires_grad = flags
        self._bound = [p for p, f in zip(self._all_bound, flags) if f]
        if all(flags):
            self._bound_grad_sets = self._grad_aliases
        else:
            self._bound_grad_sets = tuple(
                [g for g, f in zip(views, flags) if f] for views in self._grad_aliases
            )
        for p, f in zip(self._all_bound, flags):
            if not f:
                p.grad = None
        self._discard_watch.bind(self._bound)

    def _bind_buffers(self, module):
        # The engine's shared buffers (BatchNorm statistics) by name: the module's values
        # are copied in once, then its buffers view them (on a GPU engine: one block on the
        # device, exchanged with them around each step), so after every step it holds the
        # step's statistics (the buffers= rule's) and evaluates with no extra pass.
        views = dict(self._trainer.buffer_views())
        own = dict(shared_buffers(module))
        if set(views) != set(own):
            raise errors.InvalidArgumentError(
                f"the module's buffers {sorted(own)[:4]}... differ from the engine's "
                f"{sorted(views)[:4]}...: bind the module the engine was started with"
            )
        mirror = None
        if self._device is not None and views:
            # Beside the parameters on the GPU: the module's buffers are views of one block
            # there, laid out as the segment's buffer region, exchanged with it in one copy
            # each way around a step (not one synchronised copy per buffer).
            shared = self._trainer.buffer_block()
            block = torch.zeros(shared.numel(), dtype=torch.uint8, device=self._device)
            on_device = dict(zip(views, self._trainer.buffer_views_of(block)))
            mirror = (block, shared)
        with torch.no_grad():
            for n, b in own.items():
                if tuple(b.shape) != tuple(views[n].shape) or b.dtype != views[n].dtype:
                    raise errors.InvalidArgumentError(
                        f"module buffer {n!r} {tuple(b.shape)} ({b.dtype}) does not match the "
                        f"engine's {tuple(views[n].shape)} ({views[n].dtype})"
                    )
                views[n].copy_(b)
                if mirror is None:
                    b.data = views[n]
                else:
                    on_device[n].copy_(b)
                    b.data = on_device[n]
        self._buffer_mirrors = [mirror] if mirror is not None else []

    def _push_buffers(self):
        """A GPU engine's bound module's buffers into the shared ones (before a step): one
        copy of their block."""
        with torch.no_grad():
            for own, shared in self._buffer_mirrors:
                shared.copy_(own)

    def _pull_buffers(self):
        """The shared buffers into a GPU engine's bound module's (after a step): one copy."""
        with torch.no_grad():
            for own, shared in self._buffer_mirrors:
                own.copy_(shared)

    def gradient(
        self,
        indices=None,
        *,
        inputs=None,
        targets=None,
        reduction: Optional[str] = None,
        timeout: float = 600.0,
        max_retries: int = 3,
        min_examples_per_worker: Optional[int] = None,
        max_examples_per_pass: Optional[int] = None,
        raise_on_nonfinite: bool = False,
        seed: Optional[int] = None,
        accumulate: bool = False,
        batch=None,
        loss_scale=1.0,
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
        scale = self._loss_scale(loss_scale)
        if reduction is None:
            reduction = self._default_reduction(inputs, targets, batch)
        elif reduction not in REDUCTIONS:
            raise errors.InvalidArgumentError(
                f"unknown reduction {reduction!r}: use 'sum' or 'mean'"
            )
        if self._all_bound:
            first, last = self._all_bound[0], self._all_bound[-1]
            if (first.data_ptr(), last.data_ptr()) != self._bound_ptrs:
                self._refuse_moved_parameters()
            # A parameter frozen or unfrozen since the last call (about 0.4 us a parameter).
            flags = list(map(_REQUIRES_GRAD, self._all_bound))
            if flags != self._requires_grad:
                self._check_trainable(flags)
                self._set_trainable(flags)
        mean = reduction == "mean"
        nodes = self._nodes  # across nodes the mean is taken after the all-reduce
        mode, prev_count = 0, 0.0  # ipc::Accumulate: a fresh result in the first set
        onto_nodes = False  # across nodes: added by the trainer after the all-reduce
        if accumulate and self._accumulating_onto():
            if self._last_mean != mean:
                raise errors.InvalidArgumentError(
                    f"accumulate=True adds to a result of reduction="
                    f"{'mean' if self._last_mean else 'sum'!r}: give the same reduction to "
                    "every call of one accumulation"
                )
            if self._last_loss_scale != scale:
                raise errors.InvalidArgumentError(
                    f"accumulate=True adds to a result of loss_scale={self._last_loss_scale}, "
                    f"but this call's is {scale}: give the same loss scale to every call of one "
                    "accumulation (call the GradScaler's update() only after its step())"
                )
            prev_count = self._last_count
            if nodes is None:
                mode = 1 if self._current == 0 else 2
            else:
                # The all-reduce works on the first set: the previous (global) result
                # moves to the second once, and each micro-batch is added to it there.
                onto_nodes = True
                if self._current == 0:
                    for a, r in zip(self._grad_sets[1], self._grad_sets[0]):
                        a.copy_(r)
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
        elif not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 2**64:
            raise errors.InvalidArgumentError(f"seed must be an int in [0, 2^64), got {seed!r}")
        self._steps += 1
        train = self._bound_module.training if self._bound_module is not None else True
        if mepp > 0 and train and self._has_batchnorm and not self._warned_passes:
            self._warned_passes = True
            warnings.warn(
                f"engine {self.name!r}: max_examples_per_pass={mepp} splits each worker's "
                "shard into passes, and BatchNorm in train mode normalises each pass with its "
                "own statistics: the gradient differs from one pass over the shard (and the "
                "running statistics are updated once per pass)",
                stacklevel=2,
            )
        args = (
            mean and nodes is None,
            float(timeout),
            int(max_retries),
            int(mepw),
            int(mepp),
            bool(raise_on_nonfinite),
            seed,
            train,
            self.buffers == "average",
            mode,
            prev_count,
            scale,
            # Across nodes a mean is taken after the all-reduce, over the global count: the
            # node computes its sum through its batch's mean (as DDP's ranks backpropagate
            # theirs), so float16 with a GradScaler overflows where DDP's would.
            mean and nodes is not None,
        )
        if batch is not None:
            if indices is not None or inputs is not None or targets is not None:
                raise errors.InvalidArgumentError(
                    "give one of indices, inputs and targets, or batch"
                )
            from ._batch import flatten

            leaves, structure = flatten(batch)
            first = leaves[0]
            empty = nodes is not None and first.dim() > 0 and first.shape[0] == 0

            def local_step():
                return t.gradient_structured(leaves, structure, *args)

        elif indices is not None:
            if inputs is not None or targets is not None:
                raise errors.InvalidArgumentError(
                    "give either indices or inputs and targets, not both"
                )
            idx = indices if isinstance(indices, torch.Tensor) else torch.as_tensor(indices)
            if idx.numel() == 0 and nodes is None:
                raise errors.InvalidArgumentError("empty batch: give at least one index")
            empty = idx.numel() == 0  # across nodes, an empty share (any dtype: [] is float)
            if not empty and (
                idx.dtype.is_floating_point or idx.dtype == torch.bool or idx.is_complex()
            ):
                hint = " (a mask? give mask.nonzero().flatten())" if idx.dtype == torch.bool else ""
                raise errors.InvalidArgumentError(
                    f"indices must be integers, got {idx.dtype}{hint}"
                )
            if idx.dim() != 1:
                idx = idx.reshape(-1) if idx.dim() == 0 else idx
                if idx.dim() != 1:
                    raise errors.InvalidArgumentError(
                        f"indices must be 1-D, got shape {tuple(idx.shape)}"
                    )

            def local_step():
                return t.gradient(
                    idx if idx.dtype == torch.int64 else idx.to(torch.int64), None, None, *args
                )
        else:
            if inputs is None or targets is None:
                raise errors.InvalidArgumentError(
                    "give indices into the engine's dataset, or both inputs and targets"
                )
            # Tensors that autograd tracks are fine: the engine only reads their data and
            # converts a dtype or layout with gradient recording off. Nothing more is
            # looked at here: right after a long step, with the caches cold, every
            # attribute read costs microseconds.
            x = inputs if isinstance(inputs, torch.Tensor) else torch.as_tensor(inputs)
            y = targets if isinstance(targets, torch.Tensor) else torch.as_tensor(targets)
            empty = nodes is not None and x.dim() > 0 and x.shape[0] == 0

            def local_step():
                return t.gradient(None, x, y, *args)

        if self._buffer_mirrors:
            self._push_buffers()
        # What follows the step runs with the caches cold (this process slept through it):
        # every attribute read and context manager here costs microseconds, so the common
        # case (one node, no buffers to mirror) reads as little as it can.
        if nodes is None:
            native = local_step()
            stats, count = GradientStats(native), native.count
            unused = native.unused_params
        else:
            stats = GradientStats(*nodes.gradient(None if empty else local_step, mean))
            count = stats.count
            unused = stats.unused_params
        if mode != 0 or onto_nodes:  # accumulated: unused only if in every micro-batch
            unused = [i for i in unused if i in self._unused]
        self._unused = frozenset(unused) if unused else _NONE_UNUSED
        if self._buffer_mirrors:
            self._pull_buffers()
        if self._placement_probing:
            self._note_placement()
        if onto_nodes:
            # accum = a * accum + b * (this micro-batch's global result), weighted as the
            # workers weigh accumulation on one node (ipc/reduce.h's accumulationWeights).
            acc, fresh = self._grad_sets[1], self._grad_sets[0]
            if mean:
                a, b = _C.accumulation_weights(True, prev_count, count, count)
                torch._foreach_mul_(acc, a)
                torch._foreach_add_(acc, fresh, alpha=b)
            else:
                torch._foreach_add_(acc, fresh)
            self._current, self._last_count = 1, prev_count + count
        elif mode == 0:
            self._current, self._last_count = 0, count
        else:
            self._current, self._last_count = 1 - self._current, prev_count + count
        self._last_mean = mean
        self._last_loss_scale = scale
        if self._all_bound:
            self._relink_grads()
            self._discard_watch.gradient_given(self._first_given())
        elif not self._views_handed_out and not self._warned_unbound:
            self._warned_unbound = True
            warnings.warn(
                f"engine {self.name!r}: gradient() filled the engine's reduced gradient, but no "
                "module is bound, so no .grad changed and an optimizer would not move: call "
                "engine.bind(model) once before training (or read engine.gradient_tensors())",
                stacklevel=2,
            )
        return stats

    def _note_placement(self):
        """After a step of the placement probe: once it has chosen, says what, once."""
        placement = self._trainer.placement()
        if placement["state"] == "probing":
            return
        self._placement_probing = False
        self._placement_report = f"engine {self.name!r}: {placement['report']}"
        logging.getLogger("shmgrad").info("%s", self._placement_report)

    def _loss_scale(self, loss_scale) -> float:
        """gradient()'s ``loss_scale`` as the float the workers multiply their loss by: a
        GradScaler's current scale (1 when it is disabled), or a number."""
        if type(loss_scale) is float and 0 < loss_scale <= _FLOAT32_MAX:
            return loss_scale  # the default (1.0) and fixed scales: no more to look at
        if hasattr(loss_scale, "scale") and hasattr(loss_scale, "unscale_"):  # a GradScaler
            if not loss_scale.is_enabled():
                return 1.0
            # scale() sets the scaler up on the gradients' device as scaler.scale(loss)
            # would (its step() refuses a scaler that never scaled anything), and gives
            # the scale (on a GPU, one small copy to the host).
            one = torch.ones((), device=self._device or "cpu")
            value = float(loss_scale.scale(one))
        elif isinstance(loss_scale, (int, float, torch.Tensor)) and not isinstance(
            loss_scale, bool
        ):
            if isinstance(loss_scale, torch.Tensor) and loss_scale.numel() != 1:
                raise errors.InvalidArgumentError(
                    f"loss_scale must be one number, got a tensor of shape "
                    f"{tuple(loss_scale.shape)}"
                )
            value = float(loss_scale)
        else:
            raise errors.InvalidArgumentError(
                f"loss_scale must be a torch.amp.GradScaler or a number, got "
                f"{type(loss_scale).__name__}"
            )
        if not (math.isfinite(value) and 0 < value <= _FLOAT32_MAX):
            raise errors.InvalidArgumentError(
                f"loss_scale must be a finite float32 number > 0, got {value!r} (1: no loss "
                "scaling; a GradScaler whose scale reached this has seen only overflows: "
                "look for NaN/inf in the loss itself)"
            )
        return value

    def _default_reduction(self, inputs, targets, batch) -> str:
        """gradient()'s reduction when none is given: the loss's own, so that the gradient
        is the one ``loss.backward()`` would give: "mean" for a mean loss (or one that
        returns (loss_sum, count)), "sum" for a sum. Where the workers are to find the
        loss out (an undeclared callable, no Dataset), this trainer probes it first, once,
        on the batch's first examples as the workers would (indices into a dataset spec's
        examples, which it cannot read, an empty batch, or a batch the probe fails on are
        refused naming the fix). An attached client reads what the engine's segment says:
        known at start, or found out by the workers' first step; before that it refuses."""
        known = self._loss_reduction
        if known is None:
            published = self._trainer.loss_reduction()
            if published != "unknown":
                known = self._loss_reduction = published
        if known is None and self._probe_job is None:
            raise errors.InvalidArgumentError(
                f"engine {self.name!r} cannot tell yet whether its loss is the batch's sum or "
                "its mean (its eager workers find out at their first step, and this trainer "
                f"attached without the job): {_SAY_REDUCTION}"
            )
        if known is None:
            probe = None
            if batch is not None:
                probe = batch
            elif inputs is not None and targets is not None:
                probe = (torch.as_tensor(inputs), torch.as_tensor(targets))
            if probe is None:
                raise errors.InvalidArgumentError(
                    "the engine cannot tell yet whether the loss is the batch's sum or its "
                    "mean (its examples are in the engine's dataset, out of this process's "
                    f"reach): {_SAY_REDUCTION}"
                )
            known = self._loss_reduction = self._probe_loss(probe)
        return "sum" if known == "sum" else "mean"

    def _probe_loss(self, batch):
        model, loss, forward = self._probe_job
        if not _eager._batch_length(batch):
            # An empty share (across nodes): it cannot tell, and guessing could make this
            # node sum while the others take the mean.
            raise errors.InvalidArgumentError(
                f"an empty batch cannot tell whether the loss is the batch's sum or its mean: "
                f"{_SAY_REDUCTION}"
            )
        batch = _eager._examples(batch, 0, _eager.PROBE_EXAMPLES)
        param = next(model.parameters(), None)
        if param is not None and param.device.type != "cpu":  # a GPU engine's bound module
            batch = _eager._map_tensors(batch, lambda t: t.to(param.device))
        try:
            return _eager.probe_reduction(model, loss, forward, batch)
        except errors.Error:
            raise
        except Exception as exc:  # not a guess, and not the probe again at every step
            raise errors.InvalidArgumentError(
                f"finding out whether the loss is the batch's sum or its mean failed in the "
                f"trainer ({type(exc).__name__}: {exc}): {_SAY_REDUCTION}"
            ) from exc

    def _accumulating_onto(self) -> bool:
        """Whether an accumulating call has a result to add to: one since the last
        fresh call, unless optimizer.zero_grad() dropped (.grad None) or zeroed it."""
        if self._last_mean is None:
            return False
        views = self._grad_views
        if self._bound:
            nulled = {id(p) for p in self._nulled}  # None for no backward reached them
            if any(p.grad is None for p in self._bound if id(p) not in nulled):
                return False  # zero_grad(set_to_none=True): start afresh
        return any(bool(v.any()) for v in views)  # zero_grad(set_to_none=False) zeroes it

    def _relink_grads(self):
        # optimizer.zero_grad(set_to_none=True) (the default in newer PyTorch) drops every
        # .grad at once; point them at the reduced gradient again. Looking at the first and
        # the last is enough to see that, and keeps the step's Python cost flat in the
        # number of parameters. Identity, not data_ptr(): a .grad that is still our view
        # is the same tensor object (bind assigned it), and the check stays two reads.
        bound = self._bound
        if not bound:
            return
        views = self._bound_grad_sets[self._current]
        if self._nulled or bound[0].grad is not views[0] or bound[-1].grad is not views[-1]:
            for p, g in zip(bound, views):
                if p.grad is None or p.grad.data_ptr() != g.data_ptr():
                    p.grad = g
            self._nulled = ()
        if self._unused:
            # No participant's backward reached these (an unused branch): their .grad is
            # None, as after plain PyTorch's backward, so an optimizer skips them (no weight
            # decay, no momentum) instead of stepping a zero gradient.
            flags, params = self._requires_grad, self._all_bound
            self._nulled = tuple(params[i] for i in self._unused if flags[i])
            for p in self._nulled:
                p.grad = None

    def _first_given(self):
        """The first bound parameter that the last result gave a .grad (None if none)."""
        if not self._nulled:
            return self._bound[0] if self._bound else None
        nulled = {id(p) for p in self._nulled}
        return next((p for p in self._bound if id(p) not in nulled), None)

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
        if self._discard_watch is not None:
            self._discard_watch.close()
        if getattr(self, "_on_device", False):
            self._detach_from_device_memory()
        if self._trainer is not None:
            self._trainer.close()

    def _detach_from_device_memory(self):
        """The engine frees its device memory when it stops, and CUDA leaves freeing memory
        that another process still maps undefined: the bound module keeps copies (made,
        and waited for, before anything of the engine's is dropped), and every view this
        client holds is let go, so that the trainer's mapping closes with the last of them
        and the segment says so (engine/trainer.cc, openMemory). Views handed out by
        gradient_tensors() and parameter_tensors() keep it open while they live."""
        with torch.no_grad():
            for p in self._all_bound:
                p.data = p.data.clone()
                if p.grad is not None:
                    p.grad = p.grad.clone()
        if self._device is not None:
            torch.cuda.synchronize(self._device)  # the copies have read the engine's memory
        self._param_views = []
        self._grad_sets = self._grad_aliases = self._bound_grad_sets = ([], [])
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
    timeout: float = 30.0,
    seed: int = 0,
    min_examples_per_worker: int = 1,
    max_examples_per_pass: int = 0,
    process_group=None,
    bucket_cap_mb: Optional[float] = None,
    buffers: str = "average",
) -> Client:
    """Attaches to an engine started with ``shmgrad serve --name NAME``.

    Waits up to ``timeout`` seconds for it to serve. Raises :class:`EngineNotFoundError`
    if there is none, :class:`BusyError` (naming the holder's pid) if another trainer
    holds it. :meth:`Client.close` releases it without stopping it.

    ``process_group``: a ``torch.distributed`` group with one trainer per node (this
    node's engine is then one of several; collective, see :class:`Client`);
    ``bucket_cap_mb``: all-reduce the gradient in buckets of this many MiB (default: one
    call on the whole buffer); ``buffers``: as :class:`shmgrad.Engine`'s.
    """
    _C.check_engine_name(name)
    _check_buffers(buffers)
    trainer = _C.Trainer.attach(name, timeout=timeout, cuda_library=_gpu.LIBRARY)
    return Client(
        name,
        trainer,
        seed=seed,
        min_examples_per_worker=min_examples_per_worker,
        max_examples_per_pass=max_examples_per_pass,
        process_group=process_group,
        bucket_cap_mb=bucket_cap_mb,
        buffers=buffers,
    )
