"""Eager Python workers: any ``nn.Module``, any loss, any ``torch.utils.data.Dataset``.

The launcher side lives here: choosing the mode, checking and pickling the job once
(cloudpickle, so classes and functions from ``__main__`` or a notebook work), and the
parameter file that tells ``shmgrad serve`` the layout of the shared parameters.
The worker side is :mod:`shmgrad._eager_worker`. docs/DESIGN.md, "Eager workers".
"""

import os
import pickle
import random
import sys
import tempfile
from typing import Callable, List, NamedTuple, Optional, Tuple

import torch

from . import errors

try:
    import numpy
except ImportError:  # pragma: no cover - numpy ships with torch on Debian
    numpy = None

MODES = ("auto", "eager", "script")
JOB_FILE = "job.pkl"
PARAMS_FILE = "params.bin"

_MASK64 = (1 << 64) - 1


def example_seed(seed: int, index: int) -> int:
    """The seed of example ``index`` in a step seeded with ``seed``: an integer in [0, 2^32).

    Before ``dataset[index]`` an eager worker seeds Python's ``random``, NumPy's global
    generator and torch's CPU generator with it, so the transforms' random draws depend on
    the example and the step only, not on which worker took the example. The formula
    (splitmix64's finaliser over a combination of both, top 32 bits)::

        z = (seed * 0x9E3779B97F4A7C15 + index + 1) mod 2^64
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) mod 2^64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) mod 2^64
        return (z ^ (z >> 31)) >> 32

    To reproduce an example in one process::

        s = shmgrad.example_seed(step_seed, i)
        random.seed(s); numpy.random.seed(s); torch.manual_seed(s)
        x, y = dataset[i]
    """
    z = (int(seed) * 0x9E3779B97F4A7C15 + int(index) + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 32


def step_seed(engine_seed: int, step: int) -> int:
    """The seed of the engine's ``step``-th gradient call when the call gives none."""
    return example_seed(engine_seed, (1 << 40) + step)


def seed_everything(seed: int):
    """Seeds the three generators an example's transforms may draw from: Python's
    ``random``, NumPy's global generator and torch's CPU generator. The last is
    ``torch.default_generator.manual_seed``, which gives the CPU the same stream as
    ``torch.manual_seed`` without the latter's other devices' bookkeeping (most of what
    ``torch.manual_seed`` costs per example)."""
    random.seed(seed)
    if numpy is not None:
        numpy.random.seed(seed)
    torch.default_generator.manual_seed(seed)


def example_batch(dataset, indices, seed: int, collate_fn=None):
    """The batch an eager worker builds for ``indices`` of a step seeded with ``seed``:
    each ``dataset[i]`` drawn after :func:`seed_everything` ``(example_seed(seed, i))``,
    then ``collate_fn`` (default ``torch.utils.data.default_collate``). Use it to
    reproduce a step's batch in one process."""
    if collate_fn is None:
        from torch.utils.data import default_collate

        collate_fn = default_collate
    samples = []
    for i in indices:
        seed_everything(example_seed(seed, int(i)))
        samples.append(dataset[int(i)])
    return collate_fn(samples)


# -- losses ------------------------------------------------------------------------
def _named_loss(name):
    f = torch.nn.functional
    table = {
        "cross_entropy": lambda out, y: f.cross_entropy(out, y, reduction="sum"),
        "nll": lambda out, y: f.nll_loss(out, y, reduction="sum"),
        "mse": lambda out, y: f.mse_loss(out, y, reduction="sum"),
    }
    return table[name]


def check_loss(loss, loss_names) -> None:
    """Refuses a loss that cannot be summed over the batch, naming the fix."""
    if isinstance(loss, str):
        if loss not in loss_names:
            raise errors.InvalidArgumentError(
                f"unknown loss {loss!r}: use one of {', '.join(loss_names)}, or pass a callable "
                "loss(outputs, targets) that returns the loss summed over the batch"
            )
        return
    if not callable(loss):
        raise errors.InvalidArgumentError(
            f"loss must be a name ({', '.join(loss_names)}) or a callable, got "
            f"{type(loss).__name__}"
        )
    reduction = getattr(loss, "reduction", None)
    if isinstance(loss, torch.nn.Module) and reduction is not None and reduction != "sum":
        raise errors.InvalidArgumentError(
            f"the loss {type(loss).__name__}(reduction={reduction!r}) is not summed over the "
            f"batch: create it with reduction='sum' (e.g. {type(loss).__name__}(reduction='sum')) "
            "and ask engine.gradient(..., reduction='mean') for the mean"
        )


# -- mode --------------------------------------------------------------------------
# The first torch whose torch.jit.script warns that TorchScript is deprecated.
TORCHSCRIPT_DEPRECATED_SINCE = (2, 10)


def torchscript_deprecated() -> bool:
    """Whether the imported torch deprecates TorchScript (``torch.jit.script`` warns)."""
    return torch.__version__ >= TORCHSCRIPT_DEPRECATED_SINCE  # a TorchVersion


def _scripts(model) -> bool:
    if isinstance(model, torch.jit.ScriptModule):
        return True
    try:
        torch.jit.script(model)
        return True
    except Exception:  # scripting fails in many ways
        return False


def choose_mode(
    mode: str, *, model, loss, dataset, collate_fn, forward, loss_names, compile: bool = False
) -> Tuple[str, str]:
    """``("script" | "eager", why)``: TorchScript workers (C++) or Python workers, as
    asked or chosen, and the reason in words (``Engine.mode_reason``, ``status()``)."""
    if mode not in MODES:
        raise errors.InvalidArgumentError(f"unknown mode {mode!r}: use one of {', '.join(MODES)}")
    python_only = []
    if not isinstance(loss, str):
        python_only.append("a callable loss")
    if dataset is not None and not isinstance(dataset, str):
        python_only.append("a torch Dataset")
    if collate_fn is not None:
        python_only.append("collate_fn")
    if forward is not None:
        python_only.append("forward")
    if compile:
        python_only.append("compile= (or a torch.compile'd module)")
    if mode == "script":
        if python_only:
            raise errors.InvalidArgumentError(
                "mode='script' runs TorchScript workers, which cannot take "
                f"{', '.join(python_only)}: "
                "use mode='eager' (or 'auto')"
            )
        return "script", "asked for: mode='script'"
    if mode == "eager":
        return "eager", "asked for: mode='eager'"
    if python_only:
        return "eager", f"auto: {', '.join(python_only)} need Python workers"
    if isinstance(model, (str, os.PathLike)):
        return "script", "auto: the model is a TorchScript file"
    if isinstance(model, torch.jit.ScriptModule):
        return "script", "auto: the model is a TorchScript module"
    if torchscript_deprecated():
        return "eager", (
            f"auto: torch {torch.__version__} deprecates TorchScript, so a module "
            "runs in eager workers (mode='script' scripts it anyway)"
        )
    if _scripts(model):
        return "script", "auto: the module scripts"
    return "eager", "auto: the module does not script (torch.jit.script failed)"


# -- the job -----------------------------------------------------------------------
class EagerJob(NamedTuple):
    directory: str  # private (0700), removed with the engine
    holder_path: str  # the model's parameters (write_params), for serve
    job_path: str  # the pickled job, 0600
    dataset_size: int  # examples of a Dataset the workers hold (0: none or a spec string)

    def serve_arguments(self) -> List[str]:
        """The options that make ``shmgrad serve`` run this job in eager workers, with
        this interpreter, and remove the job's directory with the engine."""
        return [
            "--eager-job",
            self.job_path,
            "--python",
            sys.executable,
            "--eager-dataset-size",
            str(self.dataset_size),
            "--owned-dir",
            self.directory,
        ]


def _pickle(name, obj, pickler):
    try:
        return pickler.dumps(obj)
    except Exception as exc:
        raise errors.InvalidArgumentError(
            f"the {name} ({type(obj).__name__}) cannot be pickled for the eager workers: {exc}. "
            "Define it at module level or in __main__, and keep open files, locks and sockets "
            "out of it (open them lazily in the worker)"
        ) from exc


def write_params(model: torch.nn.Module, path: str) -> None:
    """The model's description for ``shmgrad serve`` (its parameters' names, shapes and
    float32 values in named_parameters order, and its shared buffers), written by the
    native writer in the one format the coordinator reads (engine/model_file.h)."""
    from ._native import _C

    named = list(model.named_parameters())
    if not named:
        raise errors.InvalidArgumentError(
            "the model has no parameters: nothing to compute a gradient of"
        )
    for name, p in named:
        if p.dtype != torch.float32 or p.device.type != "cpu":
            raise errors.InvalidArgumentError(
                f"parameter {name} is {p.dtype} on {p.device}; shmgrad engines hold float32 "
                "CPU parameters: call model.float().cpu() first"
            )
    _C.write_model_file(
        path,
        [(name, p.detach().contiguous()) for name, p in named],
        [(name, b.detach().contiguous()) for name, b in shared_buffers(model)],
    )


def shared_buffers(model: torch.nn.Module):
    """The buffers the engine shares (float32 and int64, e.g. BatchNorm's running
    statistics and batch count), as (name, tensor) in named_buffers order; others stay
    per worker."""
    return [
        (n, b)
        for n, b in model.named_buffers()
        if b.device.type == "cpu" and b.dtype in (torch.float32, torch.int64)
    ]


def compiled_original(module):
    """``(module, None)`` for a plain module; for one that ``torch.compile`` wrapped, the
    module it wraps and ``{}`` (the workers compile their own copy with default options)."""
    original = getattr(module, "_orig_mod", None)
    if isinstance(original, torch.nn.Module) and type(module).__name__ == "OptimizedModule":
        return original, {}
    return module, None


def compile_options(compile) -> Optional[dict]:
    """``Engine(compile=...)``: False/None (no), True (``torch.compile`` defaults) or a dict
    of ``torch.compile`` keyword arguments; None when the workers do not compile."""
    if compile is None or compile is False:
        return None
    if compile is True:
        return {}
    if isinstance(compile, dict):
        return dict(compile)
    raise errors.InvalidArgumentError(
        f"compile must be True, False or a dict of torch.compile options, got {compile!r}"
    )


def prepare_job(
    *,
    model,
    loss,
    dataset,
    collate_fn: Optional[Callable],
    forward: Optional[Callable],
    loss_names,
    compile: Optional[dict] = None,
) -> EagerJob:
    """Checks and pickles the job once, into a private directory. ``compile``: options
    of the ``torch.compile`` each worker applies to its copy of the model (None: none)."""
    try:
        import cloudpickle
    except ImportError as exc:  # pragma: no cover - tools/setup.sh installs it
        raise errors.InvalidArgumentError(
            "eager workers need cloudpickle: apt-get install python3-cloudpickle"
        ) from exc
    if isinstance(model, (str, os.PathLike)):
        model = torch.jit.load(os.fspath(model))
    if not isinstance(model, torch.nn.Module):
        raise errors.InvalidArgumentError(
            "model must be a torch.nn.Module or a TorchScript file path, got "
            f"{type(model).__name__}"
        )
    check_loss(loss, loss_names)
    if isinstance(dataset, str):
        # A spec string: the coordinator loads it into shared memory once, and every
        # worker reads its examples there (StepParticipant.dataset_views).
        if collate_fn is not None:
            raise errors.InvalidArgumentError(
                f"collate_fn builds batches from a torch Dataset's examples; the dataset spec "
                f"{dataset!r} gives tensors: drop collate_fn, or pass a Dataset"
            )
        dataset = None
    size = 0
    if dataset is not None:
        try:
            size = len(dataset)
        except TypeError as exc:
            raise errors.InvalidArgumentError(
                f"the dataset ({type(dataset).__name__}) has no len(): shmgrad addresses "
                "examples by index, so it needs a map-style Dataset"
            ) from exc
        if size < 1:
            raise errors.InvalidArgumentError("the dataset is empty")
    for what, obj in (
        ("model", model),
        ("loss", loss),
        ("dataset", dataset),
        ("collate_fn", collate_fn),
        ("forward", forward),
    ):
        if obj is not None:
            _pickle(what, obj, cloudpickle)
    blob = _pickle(
        "job",
        {
            "model": model,
            "loss": loss,
            "dataset": dataset,
            "collate_fn": collate_fn,
            "forward": forward,
            "compile": compile,
        },
        cloudpickle,
    )
    directory = tempfile.mkdtemp(prefix="shmgrad-eager-")  # mode 0700
    try:
        holder = os.path.join(directory, PARAMS_FILE)
        write_params(model, holder)
        job = os.path.join(directory, JOB_FILE)
        fd = os.open(job, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(blob)
    except BaseException:
        import shutil

        shutil.rmtree(directory, ignore_errors=True)
        raise
    return EagerJob(directory, holder, job, size)


def load_job(path: str) -> dict:
    with open(path, "rb") as f:
        return pickle.load(f)  # cloudpickle's output loads with pickle


def resolve_loss(loss):
    return _named_loss(loss) if isinstance(loss, str) else loss
