"""Starting an engine from Python: :func:`serve` launches ``shmgrad serve`` and returns a
:class:`Server`; :class:`Engine` does that, attaches to it and stops it when closed.
:func:`save_model` writes a module as TorchScript for the workers."""

import itertools
import os
import shutil
import tempfile
import warnings
from typing import Optional, Union

import torch

from . import _job, _losses, _mode, _modules
from . import _gpu, _numerics, _threads
from . import errors
from ._native import _C
from ._client import DEFAULT_BUFFERS, GRADIENT_DEFAULTS, Client, _check_buffers
from ._launcher import SERVE_DEFAULTS, STOP_TIMEOUT_S, Launcher, ServeOptions
from ._status import read_status

ATTACH_TIMEOUT_S = 10.0  # attaching to an engine that has just reported it serves
_names = itertools.count()


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


class Server:
    """An engine this process started, with no trainer attached: what ``shmgrad serve``
    does, from Python (:func:`serve`). Trainers attach by name
    (``shmgrad.attach(server.name)``), one at a time, and may come and go. The engine stops
    with :meth:`stop`, at the end of a ``with`` block, or when this process exits.

    Attributes: ``name``, ``pid`` (the coordinator's process), ``mode`` (``"script"`` or
    ``"eager"``) and ``mode_reason`` (why).
    """

    def __init__(
        self,
        launcher: Launcher,
        mode: str,
        mode_reason: str,
        files: Optional[str],
        loss_reduction: Optional[str] = None,
    ):
        self._launcher = launcher
        self._files = files  # the saved model or the eager job: removed at stop
        self.name = launcher.options.name
        self.mode, self.mode_reason = mode, mode_reason
        # What the loss returns for a batch, where known at start: "sum", "mean" or
        # "weighted" ((loss_sum, count)); None: the workers find out on their first shard.
        self.loss_reduction = loss_reduction

    @property
    def pid(self) -> Optional[int]:
        return self._launcher.pid

    def log(self) -> str:
        """What the coordinator and its workers have printed so far (readable after
        :meth:`stop` too)."""
        return self._launcher.log()

    def stop(self, timeout: float = STOP_TIMEOUT_S):
        """Stops the engine: SIGTERM, SIGKILL after ``timeout`` seconds. Idempotent."""
        try:
            self._launcher.stop(timeout)
        finally:
            if self._files is not None:
                shutil.rmtree(self._files, ignore_errors=True)
                self._files = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()

    def __repr__(self):
        return f"Server(name={self.name!r}, pid={self.pid}, mode={self.mode!r})"


def serve(
    *,
    model,
    workers: Union[int, str, None] = None,
    loss=None,
    dataset=None,
    mode: str = "auto",
    collate_fn=None,
    forward=None,
    name: Optional[str] = None,
    threads_per_worker: int = SERVE_DEFAULTS["threads_per_worker"],
    max_workers: Optional[int] = None,
    max_batch: int = SERVE_DEFAULTS["max_batch"],
    input_capacity_mb: int = SERVE_DEFAULTS["input_capacity_mb"],
    startup_timeout: float = SERVE_DEFAULTS["startup_timeout"],
    compile=False,
    loss_reduction: Optional[str] = None,
    devices=None,
    device=None,
    trainer_device=None,
) -> Server:
    """Starts an engine and returns once it serves, without attaching to it: a
    :class:`Server`. The arguments are :class:`Engine`'s (which is this, plus a trainer
    attached). Raises what :class:`Engine` raises at start-up; nothing is left behind."""
    ordinals = _gpu.parse_devices(devices, device, trainer_device)
    if ordinals is not None:
        _gpu.check_devices(ordinals)  # before anything starts: what the machine lacks
    placed = workers == "auto"
    if placed:
        _check_auto_placement(ordinals, threads_per_worker, max_workers)
        # serve starts one worker per physical core (at most max_workers) and the trainer
        # places each step on them; the checks below see that count.
        workers = _C.auto_workers(max_workers or 0)
    workers = _gpu.workers_for(workers, ordinals)
    loss_names = _C.loss_names()
    compile_opts = _modules.compile_options(compile)
    if isinstance(model, torch.nn.Module):
        model, wrapped = _modules.compiled_original(model)  # torch.compile(module) given
        if wrapped is not None and compile_opts is None:
            compile_opts = wrapped
        lazy = next(
            (
                n
                for n, p in model.named_parameters()
                if isinstance(p, torch.nn.parameter.UninitializedParameter)
            ),
            None,
        )
        if lazy is not None:
            raise errors.InvalidArgumentError(
                f"parameter {lazy!r} is not initialised yet (a lazy module's): run the model "
                "once on a batch of your data before starting the engine, so that every "
                "parameter has its shape"
            )
        synced = [n for n, m in model.named_modules() if isinstance(m, torch.nn.SyncBatchNorm)]
        if synced and workers > 1:
            warnings.warn(
                f"the model's SyncBatchNorm layers ({', '.join(synced[:3])}"
                f"{', ...' if len(synced) > 3 else ''}) normalise each worker's shard with its "
                "own batch statistics, as BatchNorm does: the engine has no cross-worker "
                "SyncBatchNorm (its workers are no process group). The gradient is DDP's "
                "without SyncBatchNorm; for the whole batch's statistics, run one worker",
                stacklevel=3,
            )
    mode, mode_reason = _mode.choose_mode(
        mode,
        model=model,
        loss=loss,
        dataset=dataset,
        collate_fn=collate_fn,
        forward=forward,
        loss_names=loss_names,
        compile=compile_opts is not None,
    )
    if mode == "script":
        if loss_reduction not in (None, "sum"):
            raise errors.InvalidArgumentError(
                f"TorchScript workers sum the loss named {loss!r} over the batch: drop "
                f"loss_reduction={loss_reduction!r} (ask gradient(..., reduction='mean') for "
                "the mean)"
            )
        _check_arguments(workers=workers, loss=loss, max_workers=max_workers)
    else:
        _losses.check_loss(loss, loss_names, forward=forward, loss_reduction=loss_reduction)
        _check_arguments(workers=workers, loss=loss_names[0], max_workers=max_workers)
    name = name or f"py{os.getpid()}-{next(_names)}"
    _C.check_engine_name(name)
    eager_job = None
    if mode == "eager":
        eager_job = _job.prepare_job(
            model=model,
            loss=loss,
            dataset=dataset,
            collate_fn=collate_fn,
            forward=forward,
            loss_names=loss_names,
            compile=compile_opts,
            loss_reduction=loss_reduction,
        )
        files = eager_job.directory
        serve_dataset = dataset if isinstance(dataset, str) else None  # into the segment
        model_path, serve_loss = eager_job.holder_path, loss_names[0]
    else:
        files, model_path = _model_file(model)
        serve_loss, serve_dataset = loss, dataset
    options = ServeOptions(
        name=name,
        model_path=model_path,
        workers="auto" if placed else workers,
        loss=serve_loss,
        dataset=serve_dataset,
        threads_per_worker=threads_per_worker,
        max_workers=max_workers,
        max_batch=max_batch,
        input_capacity_mb=input_capacity_mb,
        startup_timeout=startup_timeout,
        eager_job=eager_job,
        devices=tuple(ordinals) if ordinals is not None else None,
        numerics=_numerics.spec(),  # the workers compute as this process would
    )
    loss_reduction = "sum" if eager_job is None else eager_job.loss_reduction  # names sum
    server = Server(Launcher(options), mode, mode_reason, files, loss_reduction)
    try:
        server._launcher.start()
        if ordinals is not None:  # MPS as the coordinator found it: one place decides
            _gpu.warn_sharing(workers, ordinals, read_status(name).mps)
    except BaseException:
        server.stop()
        raise
    return server


def _model_file(model):
    """``(directory to remove at stop or None, the TorchScript file serve loads)``:
    ``model`` itself, or a module saved into a temporary directory that lives as long as
    the engine (replacement workers load it again)."""
    if isinstance(model, torch.nn.Module):
        directory = tempfile.mkdtemp(prefix="shmgrad-model-")
        try:
            return directory, save_model(model, os.path.join(directory, "model.pt"))
        except BaseException:
            shutil.rmtree(directory, ignore_errors=True)
            raise
    if isinstance(model, (str, os.PathLike)):
        path = os.fspath(model)
        if not os.path.isfile(path):
            raise errors.EngineNotFoundError(
                f"model file {path!r} does not exist; save one with "
                "shmgrad.save_model(module, path)"
            )
        return None, path
    raise errors.InvalidArgumentError(
        f"model must be a torch.nn.Module or a TorchScript file path, got {type(model).__name__}"
    )


class Engine(Client):
    """A shmgrad engine this process starts: ``shmgrad serve`` runs in the background, and
    this object is the trainer attached to it (the API of :class:`Client`).

    The engine stops when :meth:`close` is called, when the ``with`` block ends, or when
    this process exits. Only one trainer holds an engine at a time.

    Args (keyword-only):
        model: a ``torch.nn.Module`` (saved with :func:`save_model`) or the path of a
            TorchScript file.
        workers: number of worker processes, or ``"auto"``: one per physical core, each
            able to use every core, and the trainer times a few placements (1 worker with
            every thread, 2, 4, ... workers with the cores shared, one per core; with
            eager workers also this process computing each step itself, on a model of its
            own loaded from the job) on its first steps (real steps: their gradients are
            exact; a bounded probe, seconds) and keeps the fastest
            (``status().placement``, ``placement_in_trainer``, ``placement_probe``,
            :meth:`log`). Required for a CPU engine; with
            ``devices=``, one per GPU by default. Several on one GPU run their kernels at
            once only under MPS (``status().mps``); without it they take turns, and a
            warning says so.
        loss: ``"cross_entropy"``, ``"nll"`` or ``"mse"`` (summed over the batch), or, with
            eager workers, any callable ``loss(outputs, targets)`` that returns the batch's
            sum or mean (``F.cross_entropy(o, y)``, an ``nn`` loss module). Optional with
            ``forward``.
        loss_reduction: ``"sum"`` or ``"mean"``: what the loss callable (or ``forward``)
            returns for a batch. Default: read from an ``nn`` loss module's
            ``reduction``, else found out before training (the loss of the first examples
            given twice doubles for a sum and stays for a mean, the model in eval mode),
            and a loss that is neither is refused. With a mean each worker weights its
            shard by its examples, so ``gradient(..., reduction="mean")`` is the whole
            batch's mean however it is split.
        dataset: ``None``, ``"fashion-mnist"``, ``"fashion-mnist:test"`` or
            ``"npy:INPUTS.npy,TARGETS.npy"`` (loaded once into shared memory, read there by
            every worker), or, with eager workers, any map-style
            ``torch.utils.data.Dataset`` (each worker holds a copy; per-example transforms
            run in the workers). Addressed by index in :meth:`gradient`.
        mode: ``"script"``: TorchScript workers (C++); ``"eager"``: Python workers running
            the module as it is; ``"auto"`` (default): TorchScript for a TorchScript file
            or module, and for a module that scripts when the loss is a name and the
            dataset a spec string or None, on a torch that does not deprecate TorchScript
            (before 2.10); eager otherwise (also with a spec string). ``engine.mode`` and
            ``status().worker_kind`` say which, ``engine.mode_reason`` and
            ``status().mode_reason`` why.
        seed: eager workers seed Python's ``random``, NumPy and torch with
            :func:`shmgrad.example_seed` ``(step_seed, i)`` before ``dataset[i]``, where
            ``step_seed`` is ``gradient(..., seed=S)`` or derived from this seed and the
            step count.
        collate_fn: eager: builds a batch from ``[dataset[i] for i in shard]`` (default
            ``torch.utils.data.default_collate``).
        forward: eager: ``forward(model, batch) -> loss`` replaces
            ``loss(model(batch[0]), batch[1])`` (dict batches, several inputs, losses that
            need more): the batch's sum or mean (``loss_reduction``), or
            ``(loss_sum, count)``, a weighted mean's parts (e.g. the loss summed over the
            tokens that are not padding, and their number): ``reduction="mean"`` then
            divides by the whole batch's count.
        buffers: ``"average"`` (default): after each step the bound module's float
            buffers (BatchNorm running statistics) are the average of the workers', weighted
            by their examples; ``"first"``: the first worker's (DDP's rule).
        name: engine name (default: a unique one); others attach by it.
        threads_per_worker: intra-op threads of each worker (default 1).
        trainer_threads: intra-op threads of this process (the trainer) while the engine
            is open, restored by :meth:`close`. ``"auto"`` (default): on a CPU engine, the
            cores its workers leave free, at least 1 (never more than it has): PyTorch's
            idle intra-op threads spin for milliseconds after each parallel region, such as
            ``optimizer.step()``, on the cores the workers compute on. ``None``: leave the
            process's setting; an int: that many. :attr:`trainer_threads` says what holds.
        max_workers: gradient slots, the most workers :meth:`resize` can ask for.
        max_batch: most examples in one step.
        input_capacity_mb: shared memory for explicit batches (``inputs=``, ``targets=``).
        startup_timeout: seconds to wait for every worker to load the model.
        min_examples_per_worker: default for :meth:`gradient` (fewer workers take part in a
            small batch: idle workers cost nothing).
        max_examples_per_pass: default for :meth:`gradient` (bounds worker memory).
        process_group: a ``torch.distributed`` process group with one trainer per node
            (e.g. ``torch.distributed.group.WORLD``): this engine is then one node of
            several, and :meth:`gradient` returns the gradient of the global batch (see
            docs/MULTINODE.md). Construction waits for every node's engine, refuses a node
            whose model differs and gives every node rank 0's parameters.
        bucket_cap_mb: across nodes, all-reduce the gradient in buckets of this many MiB
            (default: one call on the whole buffer).
        compile: eager workers apply ``torch.compile`` to their own copy of the model:
            ``True`` (its defaults) or a dict of its options. A module already wrapped by
            ``torch.compile`` is taken as ``compile=True`` on the module it wraps (bind
            either). Each worker compiles when it first meets a shape, inside that step
            (warm up before timing); gradients stay exact.
        devices, device: GPUs for the workers (``devices=["cuda:0", "cuda:1"]``, or
            ``device="cuda"`` for every visible one), placed round-robin, several per
            device; the bound module's parameters and ``.grad`` are then the trainer's
            device's memory: the first listed, or ``trainer_device=`` (one of them)
            (docs/GPU.md: built and tested on a stand-in device, not yet run on a GPU).
            On a machine that lacks something it raises at once, before anything starts,
            naming it (no CUDA path built, no driver, no GPU, a torch without CUDA, an
            ordinal past the visible GPUs).

    Raises what ``serve`` reported when it could not start (InvalidArgumentError for a
    file that is not TorchScript or an unknown dataset, NoSpaceError when /dev/shm is too
    small, WorkerError when a worker could not load the model, ...), or an Error quoting
    its output if it died without reporting.
    """

    _server = None

    def __init__(
        self,
        *,
        model,
        workers: Union[int, str, None] = None,
        loss=None,
        dataset=None,
        mode: str = "auto",
        seed: int = 0,
        collate_fn=None,
        forward=None,
        name: Optional[str] = None,
        threads_per_worker: int = SERVE_DEFAULTS["threads_per_worker"],
        max_workers: Optional[int] = None,
        max_batch: int = SERVE_DEFAULTS["max_batch"],
        input_capacity_mb: int = SERVE_DEFAULTS["input_capacity_mb"],
        startup_timeout: float = SERVE_DEFAULTS["startup_timeout"],
        min_examples_per_worker: int = GRADIENT_DEFAULTS["min_examples_per_worker"],
        max_examples_per_pass: int = GRADIENT_DEFAULTS["max_examples_per_pass"],
        process_group=None,
        bucket_cap_mb: Optional[float] = None,
        compile=False,
        loss_reduction: Optional[str] = None,
        buffers: str = DEFAULT_BUFFERS,
        devices=None,
        device=None,
        trainer_device=None,
        trainer_threads: Union[int, str, None] = "auto",
    ):
        if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
            raise errors.InvalidArgumentError(f"seed must be an int >= 0, got {seed!r}")
        _check_buffers(buffers)
        _threads.check(trainer_threads)
        server = serve(
            model=model,
            workers=workers,
            loss=loss,
            dataset=dataset,
            mode=mode,
            collate_fn=collate_fn,
            forward=forward,
            name=name,
            threads_per_worker=threads_per_worker,
            max_workers=max_workers,
            max_batch=max_batch,
            input_capacity_mb=input_capacity_mb,
            startup_timeout=startup_timeout,
            compile=compile,
            loss_reduction=loss_reduction,
            devices=devices,
            device=device,
            trainer_device=trainer_device,
        )
        try:
            trainer = _C.Trainer.attach(
                server.name, timeout_seconds=ATTACH_TIMEOUT_S, cuda_library=_gpu.LIBRARY
            )
        except BaseException:
            server.stop()
            raise
        self._server = server
        self.mode, self.mode_reason = server.mode, server.mode_reason
        try:
            super().__init__(
                server.name,
                trainer,
                seed=seed,
                min_examples_per_worker=min_examples_per_worker,
                max_examples_per_pass=max_examples_per_pass,
                process_group=process_group,
                bucket_cap_mb=bucket_cap_mb,
                buffers=buffers,
                trainer_threads=trainer_threads,
            )
        except BaseException:
            server.stop()
            raise
        # gradient()'s default reduction follows the loss's; where the workers are to find
        # it out, this trainer does on the first explicit batch (_reduction); and the
        # workers train the parameters that required grad when the model was started.
        probe_job = trainable = None
        if isinstance(model, torch.nn.Module):
            original = _modules.compiled_original(model)[0]
            if server.loss_reduction is None:
                probe_job = (original, _losses.resolve_loss(loss), forward)
            trainable = [p.requires_grad for p in original.parameters()]
        self._adopt_job(server.loss_reduction, probe_job, trainable)

    def log(self) -> str:
        """What the engine's coordinator and workers have printed so far: worker restarts,
        retired workers that had to be killed (readable after :meth:`close` too); then,
        with ``workers="auto"``, the placement this trainer chose and what it measured."""
        return ("" if self._server is None else self._server.log()) + super().log()

    def close(self, *, timeout: float = STOP_TIMEOUT_S):
        """Releases the engine and stops it (SIGTERM, SIGKILL after ``timeout`` seconds).
        Idempotent.

        Bound modules keep working tensors (the shared memory stays mapped while they
        exist), but further gradients need a new engine.
        """
        try:
            super().close()
        finally:
            if self._server is not None:
                self._server.stop(timeout)


def _check_auto_placement(ordinals, threads_per_worker, max_workers):
    """``workers="auto"``: the CPU's cores, placed by the trainer; nothing that fixes them."""
    if ordinals is not None:
        raise errors.InvalidArgumentError(
            'workers="auto" places the CPU\'s cores; with devices= leave workers out (one '
            "worker per GPU) or give a number"
        )
    if threads_per_worker != SERVE_DEFAULTS["threads_per_worker"]:
        raise errors.InvalidArgumentError(
            'workers="auto" chooses the threads per worker too: leave threads_per_worker '
            "out, or give workers a number"
        )
    if max_workers is not None and (not isinstance(max_workers, int) or max_workers < 1):
        raise errors.InvalidArgumentError(
            f"max_workers must be a positive int, got {max_workers!r}"
        )


def _check_arguments(*, workers, loss, max_workers):
    losses = _C.loss_names()
    if loss not in losses:
        raise errors.InvalidArgumentError(f"unknown loss {loss!r}: use one of {', '.join(losses)}")
    if not isinstance(workers, int) or isinstance(workers, bool) or workers < 1:
        raise errors.InvalidArgumentError(
            f'workers must be a positive int or "auto", got {workers!r}'
        )
    if max_workers is not None and (not isinstance(max_workers, int) or max_workers < workers):
        raise errors.InvalidArgumentError(
            f"max_workers must be an int >= workers ({workers}), got {max_workers!r}"
        )
