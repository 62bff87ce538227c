"""Eager Python workers: any ``nn.Module``, any loss, any ``torch.utils.data.Dataset``.

The launcher side lives here: choosing the mode, checking and pickling the job once
(cloudpickle, so classes and functions from ``__main__`` or a notebook work), and the
parameter file that tells ``shmgrad serve`` the layout of the shared parameters.
The worker side is :mod:`shmgrad._eager_worker`. docs/DESIGN.md, "Eager workers".
"""

import copy
import errno
import functools
import importlib
import io
import math
import os
import pickle
import random
import stat
import sys
import tempfile
import types
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
    """A loss name's function, summed over the batch (ipc/layout.h's kLossFunctions)."""
    from ._native import _C

    fn = getattr(torch.nn.functional, _C.loss_functions()[name])
    return functools.partial(fn, reduction="sum")


REDUCTIONS = ("sum", "mean")  # what a loss returns for a batch, and gradient()'s reduction


def check_loss(loss, loss_names, *, forward=None, loss_reduction=None) -> Optional[str]:
    """Refuses a loss that is neither a sum nor a mean over the batch, naming the fix.
    Returns the loss's reduction when it is known without running it ("sum" or "mean":
    declared with ``loss_reduction=``, a name, or an ``nn`` loss's ``reduction``), None
    when it must be found out on a batch (:func:`probe_reduction`)."""
    if loss_reduction is not None and loss_reduction not in REDUCTIONS:
        raise errors.InvalidArgumentError(
            f"loss_reduction must be 'sum' or 'mean' (what the loss callable or forward "
            f"returns for a batch), got {loss_reduction!r}"
        )
    if loss is None:
        if forward is None:
            raise errors.InvalidArgumentError(
                "give loss= (a name or a callable loss(outputs, targets)), or forward= "
                "(forward(model, batch) -> the batch's loss)"
            )
        return loss_reduction
    if isinstance(loss, str):
        if loss not in loss_names:
            raise errors.InvalidArgumentError(
                f"unknown loss {loss!r}: use one of {', '.join(loss_names)}, or pass a callable "
                "loss(outputs, targets)"
            )
        if forward is None and loss_reduction == "mean":
            raise errors.InvalidArgumentError(
                f"the loss {loss!r} is summed over the batch: drop loss_reduction='mean' (ask "
                "engine.gradient(..., reduction='mean') for the mean)"
            )
        return loss_reduction if forward is not None else "sum"
    if not callable(loss):
        raise errors.InvalidArgumentError(
            f"loss must be a name ({', '.join(loss_names)}) or a callable, got "
            f"{type(loss).__name__}"
        )
    reduction = getattr(loss, "reduction", None)
    if reduction == "batchmean":  # nn.KLDivLoss: the sum over the batch over its examples
        reduction = "mean"
    if forward is None and isinstance(loss, torch.nn.Module) and reduction is not None:
        if reduction not in REDUCTIONS:
            raise errors.InvalidArgumentError(
                f"the loss {type(loss).__name__}(reduction={reduction!r}) does not reduce the "
                f"batch to one number: create it with reduction='mean' (or 'sum')"
            )
        if loss_reduction is not None and loss_reduction != reduction:
            raise errors.InvalidArgumentError(
                f"loss_reduction={loss_reduction!r} contradicts the loss "
                f"{type(loss).__name__}(reduction={reduction!r}): drop loss_reduction="
            )
        return reduction
    return loss_reduction


def _modules_held(fn):
    """The modules a loss or forward callable holds, with where: itself, the object of a
    bound method, a partial's arguments, a function's closure cells and the globals its
    code names (what cloudpickle sends to the workers with it)."""
    if fn is None or isinstance(fn, str):
        return
    if isinstance(fn, torch.nn.Module):
        yield type(fn).__name__, fn
        return
    owner = getattr(fn, "__self__", None)
    if isinstance(owner, torch.nn.Module):
        yield type(owner).__name__, owner
    if isinstance(fn, functools.partial):
        for value in (fn.func, *fn.args, *fn.keywords.values()):
            if isinstance(value, torch.nn.Module):
                yield type(value).__name__, value
    code = getattr(fn, "__code__", None)
    if code is None:
        return
    for name, cell in zip(code.co_freevars, fn.__closure__ or ()):
        try:
            value = cell.cell_contents
        except ValueError:  # a cell not yet filled
            continue
        if isinstance(value, torch.nn.Module):
            yield name, value
    fn_globals = getattr(fn, "__globals__", {})
    for name in code.co_names:
        value = fn_globals.get(name)
        if isinstance(value, torch.nn.Module):
            yield name, value


def check_no_parameters_outside(model, *, loss, forward) -> None:
    """Refuses a loss or forward that holds trainable parameters the model does not have
    (a loss module with a learned weight, a head kept beside the model): the engine shares
    and reduces the model's parameters only, so they would get no gradient in the trainer
    and would silently never train. The model's own parameters, referred to from a loss
    (a penalty on the weights), are the workers' shared ones: they are fine."""
    own = {id(p) for p in model.parameters()}
    for role, fn in (("loss", loss), ("forward", forward)):
        for where, module in _modules_held(fn):
            stray = [
                n for n, p in module.named_parameters() if p.requires_grad and id(p) not in own
            ]
            if stray:
                raise errors.InvalidArgumentError(
                    f"the {role} holds {where}, whose trainable parameters are not the "
                    f"model's ({', '.join(stray[:4])}{', ...' if len(stray) > 4 else ''}): "
                    "the engine shares and reduces the model's parameters only, so these "
                    "would get no gradient in the trainer and never train. Make them part of "
                    "the model (a module holding the model and them, with forward=lambda "
                    "model, batch: ...), or freeze them with requires_grad_(False)"
                )


# How far the loss of a batch given twice may be from twice (a sum) or once (a mean) its
# loss, relative: float32 sums over a duplicated batch round differently.
PROBE_TOLERANCE = 1e-3


def _map_tensors(batch, fn):
    """The batch's structure rebuilt (new dicts and lists: a forward that pops from its
    batch cannot change the caller's) with fn applied to every tensor."""
    if isinstance(batch, torch.Tensor):
        return fn(batch)
    if isinstance(batch, dict):
        return {k: _map_tensors(v, fn) for k, v in batch.items()}
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a namedtuple
        return type(batch)(*(_map_tensors(v, fn) for v in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(_map_tensors(v, fn) for v in batch)
    if hasattr(batch, "keys") and hasattr(batch, "__getitem__"):  # a Mapping (BatchEncoding)
        return {k: _map_tensors(batch[k], fn) for k in batch.keys()}
    return batch


def _duplicated(batch):
    """The batch twice over, along the first dimension of every tensor in it."""
    return _map_tensors(batch, lambda t: torch.cat([t, t]) if t.dim() > 0 else t)


def call_loss(model, loss, forward, batch):
    """What the loss of ``batch`` is for the job: ``forward(model, batch)``, or
    ``loss(model(batch[0]), batch[1])``."""
    if forward is not None:
        return forward(model, batch)
    if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
        raise TypeError(
            f"the batch is a {type(batch).__name__}, but the default loss call is "
            "loss(model(batch[0]), batch[1]): start the engine with forward=lambda model, "
            "batch: ... (e.g. model(**batch).loss)"
        )
    return loss(model(batch[0]), batch[1])


# How many of the probe batch's first examples the check of a mean loses one by one, and
# how far their mean may be from the loss of them together, relative. Tight: with a fresh
# model every example's loss is close to the same value, so a mean over tokens differs
# from the mean over examples by little (5e-4 for a GPT-2 at initialisation), while the
# same examples in one batch or one by one differ by float32 rounding only.
PROBE_EXAMPLES = 4
MEAN_TOLERANCE = 1e-5


def _batch_length(batch) -> Optional[int]:
    """The number of examples in the batch: the first dimension of its first tensor."""
    found = []

    def note(t):
        if t.dim() > 0 and not found:
            found.append(t.shape[0])
        return t

    _map_tensors(batch, note)
    return found[0] if found else None


def _examples(batch, start, stop):
    """Examples start..stop of the batch, along the first dimension of every tensor."""
    return _map_tensors(batch, lambda t: t[start:stop] if t.dim() > 0 else t)


def _loss_value(out) -> float:
    return float(out[0]) / float(out[1]) if isinstance(out, (tuple, list)) else float(out)


def probe_reduction(model, loss, forward, batch) -> str:
    """Finds out whether the job's loss is the batch's sum or its mean: the loss of the
    batch given twice is twice its loss for a sum and the same for a mean (the model in
    eval mode, no gradient). A mean must be over the examples, since each worker's is
    weighted by its shard's examples: the loss of the first examples must be the mean of
    their losses one by one (a mean over tokens or over the targets a loss does not
    ignore is not, once examples differ in them). Raises InvalidArgumentError, naming the
    fix, for a loss that is neither or cannot be told (a loss of 0)."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            # Each call gets its own copy of the structure (a forward may pop labels).
            twice_batch = _duplicated(batch)
            once = call_loss(model, loss, forward, _map_tensors(batch, lambda t: t))
            if isinstance(once, (tuple, list)):  # (loss_sum, count): a sum with its own count
                _check_sum_and_count(once, call_loss(model, loss, forward, twice_batch))
                return "weighted"
            if not isinstance(once, torch.Tensor) or once.numel() != 1:
                raise errors.InvalidArgumentError(
                    "the loss must be one number for the batch, its sum or its mean; got "
                    + (
                        f"a tensor of shape {tuple(once.shape)}"
                        if isinstance(once, torch.Tensor)
                        else type(once).__name__
                    )
                )
            twice = call_loss(model, loss, forward, twice_batch)
            a, b = float(once), float(twice)
            if a != 0 and abs(b - 2 * a) <= PROBE_TOLERANCE * abs(2 * a):
                return "sum"
            if a != 0 and abs(b - a) <= PROBE_TOLERANCE * abs(a):
                _check_mean_over_examples(model, loss, forward, batch)
                return "mean"
    finally:
        model.train(was_training)
    raise errors.InvalidArgumentError(
        f"cannot tell whether the loss is the batch's sum or its mean (loss {a:.6g}, and "
        f"{b:.6g} for the batch given twice, neither the same nor twice as much). If it "
        "is a sum or a mean of per-example terms, say which with Engine(..., "
        "loss_reduction='sum' or 'mean'), or return (loss_sum, count) from forward=. A "
        "loss that couples the batch's examples (in-batch negatives, as in a contrastive "
        "loss) differs when the batch is split: declared, each worker's gradient would "
        "see only its own shard's examples, as each DDP rank does without gathering"
    )


def _check_sum_and_count(once, twice) -> None:
    """Refuses a forward that returns (mean, count) for (loss_sum, count): given twice, the
    batch's count doubles and so must its sum; a mean stays. Anything less clear (a loss
    that mixes the batch's examples) is not refused on a guess."""
    try:
        (s1, c1), (s2, c2) = [(float(s), float(c)) for s, c in (once, twice)]
    except (TypeError, ValueError):
        return  # not two numbers: the worker's own check names what is wrong
    doubled = c1 > 0 and abs(c2 - 2 * c1) <= PROBE_TOLERANCE * 2 * c1
    if doubled and s1 != 0 and abs(s2 - s1) <= PROBE_TOLERANCE * abs(s1):
        raise errors.InvalidArgumentError(
            f"forward returned (loss, count) = ({s1:.6g}, {c1:g}), and ({s2:.6g}, {c2:g}) "
            "for the batch given twice: the count doubles but the loss stays, so it is a "
            "mean. Return the loss summed over what the count counts (e.g. "
            "F.cross_entropy(..., reduction='sum')), and the engine divides by the whole "
            "batch's count"
        )


def _check_mean_over_examples(model, loss, forward, batch) -> None:
    """Refuses a mean loss that is not the mean of its examples' losses (see
    probe_reduction). Not checked where the examples cannot be run one by one (a model
    that needs batch statistics in eval mode): nothing is refused on a guess."""
    n = _batch_length(batch)
    if n is None or n < 2:
        return
    k = min(n, PROBE_EXAMPLES)
    try:
        whole = _loss_value(call_loss(model, loss, forward, _examples(batch, 0, k)))
        each = [
            _loss_value(call_loss(model, loss, forward, _examples(batch, i, i + 1)))
            for i in range(k)
        ]
    except Exception:
        return
    mean = sum(each) / k
    if math.isfinite(whole) and abs(mean - whole) <= MEAN_TOLERANCE * max(abs(whole), 1e-6):
        return
    raise errors.InvalidArgumentError(
        f"the loss is a mean, but not over the batch's examples: {whole:.6g} for the first "
        f"{k} examples, whose losses one by one average {mean:.6g} "
        f"({', '.join(f'{v:.4g}' for v in each)}). A mean over tokens, over the targets a "
        "loss does not ignore (cross_entropy's ignore_index=-100, padding) or with class "
        "weights would be wrong once the batch is split between workers. Return "
        "(loss_sum, count) from forward= (e.g. F.cross_entropy(..., reduction='sum') and "
        "(labels != -100).sum()), or pass the loss module, e.g. loss=nn.CrossEntropyLoss(), "
        "whose denominator the engine computes. If it is a mean over examples and the model "
        "mixes examples even in eval mode, say so with loss_reduction='mean'"
    )


def check_dataset(dataset, *, model, loss, forward, collate_fn, loss_reduction, seed: int = 0):
    """Checks a torch Dataset once, in the trainer, before any worker starts: builds the
    batch of its first PROBE_EXAMPLES examples as a worker would and, with the default
    loss call, that it is an (inputs, targets) pair. Returns the loss's reduction, found
    out on that batch when ``loss_reduction`` is None (:func:`probe_reduction`)."""
    size = len(dataset)
    try:
        batch = example_batch(dataset, range(min(PROBE_EXAMPLES, size)), seed, collate_fn)
    except Exception as exc:
        raise errors.InvalidArgumentError(
            f"building a batch of the dataset's first examples failed ({type(exc).__name__}: "
            f"{exc}): every dataset[i] must work in the trainer too"
            + (
                ""
                if collate_fn is not None
                else ", and collate with default_collate (or give collate_fn=)"
            )
        ) from exc
    if forward is None and not (isinstance(batch, (tuple, list)) and len(batch) == 2):
        raise errors.InvalidArgumentError(
            f"the dataset's examples make a batch of type {type(batch).__name__}"
            + (f" (keys {list(batch)[:6]})" if isinstance(batch, dict) else "")
            + ", but the default loss call is loss(model(batch[0]), batch[1]): give "
            "forward=lambda model, batch: ... (e.g. model(**batch).loss), or a collate_fn= "
            "that returns (inputs, targets)"
        )
    if loss_reduction is not None:
        return loss_reduction
    probe = copy.deepcopy(model)
    try:
        return probe_reduction(probe, resolve_loss(loss), forward, batch)
    except errors.Error:
        raise
    except Exception as exc:
        raise errors.InvalidArgumentError(
            f"the loss of the dataset's first examples failed in the trainer "
            f"({type(exc).__name__}: {exc}): check that "
            + (
                "forward(model, batch)"
                if forward is not None
                else "loss(model(batch[0]), batch[1])"
            )
            + " works on a batch that collate_fn builds"
        ) from exc


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


def _in_words(items: List[str]) -> str:
    """["a", "b", "c"] -> "a, b and c"."""
    return items[0] if len(items) == 1 else f"{', '.join(items[:-1])} and {items[-1]}"


def choose_mode(
    mode: str, *, model, loss, dataset, collate_fn, forward, loss_names, compile: bool = False
) -> Tuple[str, str]:
    """``("script" | "eager", why)``: TorchScript workers (C++) or Python workers, as
    asked or chosen, and the reason in words (``Engine.mode_reason``, ``status()``)."""
    if mode not in MODES:
        raise errors.InvalidArgumentError(f"unknown mode {mode!r}: use one of {', '.join(MODES)}")
    python_only = []
    if loss is not None and not isinstance(loss, str):
        python_only.append("a callable loss")
    if dataset is not None and not isinstance(dataset, str):
        python_only.append("a torch Dataset")
    if collate_fn is not None:
        python_only.append("a collate_fn")
    if forward is not None:
        python_only.append("a forward=")
    if compile:
        python_only.append("torch.compile")
    if mode == "script":
        if python_only:
            raise errors.InvalidArgumentError(
                "mode='script' runs TorchScript workers, which cannot take "
                f"{_in_words(python_only)}: use mode='eager' (or 'auto')"
            )
        return "script", "asked for: mode='script'"
    if mode == "eager":
        return "eager", "asked for: mode='eager'"
    if python_only:
        return "eager", (
            f"auto: {_in_words(python_only)} can run only in Python, so the workers are "
            "eager (Python) workers"
        )
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
class WorkerJob(NamedTuple):
    """What every eager worker of an engine runs: prepare_job checks it and pickles it once,
    each worker loads it (_eager_worker.ShardRunner). A ``shmgrad serve --eager
    MODULE:FUNCTION`` job function returns a dict of these keys, but ``compile``
    (SERVE_JOB_KEYS)."""

    model: torch.nn.Module
    loss: object  # a loss name, or a callable (loss_sum or mean, see loss_reduction)
    dataset: object = None  # a map-style Dataset, or None (a spec string stays in serve)
    collate_fn: Optional[Callable] = None
    forward: Optional[Callable] = None  # forward(model, batch) -> loss, instead of loss
    compile: Optional[dict] = None  # torch.compile's options, each worker compiles its copy
    loss_reduction: Optional[str] = None  # "sum", "mean", "weighted"; None: found out


SERVE_JOB_KEYS = tuple(k for k in WorkerJob._fields if k != "compile")


class EagerJob(NamedTuple):
    directory: str  # private (0700), removed with the engine
    holder_path: str  # the model's parameters (write_params), for serve
    job_path: str  # the pickled job, 0600
    dataset_size: int  # examples of a Dataset the workers hold (0: none or a spec string)
    # "sum", "mean" or "weighted" ((loss_sum, count)) as known at start; None: the workers
    # find out on their first shard (no Dataset to probe, nothing declared).
    loss_reduction: Optional[str] = None

    def serve_arguments(self) -> List[str]:
        """The options that make ``shmgrad serve`` run this job in eager workers, with
        this interpreter, and remove the job's directory with the engine; and what the loss
        returns, where known, for the segment (so that an attached trainer knows it too)."""
        return [
            "--eager-job",
            self.job_path,
            "--python",
            sys.executable,
            "--eager-dataset-size",
            str(self.dataset_size),
            "--owned-dir",
            self.directory,
        ] + (["--loss-reduction", self.loss_reduction] if self.loss_reduction else [])


def _rebuild_parametrized(cls, state, specs):
    """A module pickled by :func:`_reduce_parametrized`, in the worker: the plain module,
    then each tensor's parametrizations registered again, in their order. The values of
    the originals do not matter: the worker's parameters become views of the engine's."""
    from torch.nn.utils import parametrize

    module = cls.__new__(cls)
    module.__dict__.update(state)
    for name, parametrizations, unsafe in specs:
        for p in parametrizations:
            parametrize.register_parametrization(module, name, p, unsafe=unsafe)
    return module


def _reduce_parametrized(module):
    """How to pickle a module with torch.nn.utils.parametrize parametrizations (weight_norm,
    spectral_norm, orthogonal, ...), which torch refuses to pickle: as the class it
    extends, its state with each parametrized tensor as a plain parameter of the
    parametrized value (computed in eval mode: spectral_norm's power iteration does not
    run) and the parametrizations to register on it again. Same parameter names, order
    and buffers after the rebuild."""
    cls = type(module).__bases__[0]
    state = dict(module.__dict__)
    modules = dict(state["_modules"])
    plists = modules.pop("parametrizations")
    params = dict(state["_parameters"])
    specs = []
    for name, plist in plists.items():
        modes = [m.training for m in plist.modules()]
        plist.eval()
        try:
            with torch.no_grad():
                value = plist()
        finally:
            for m, mode in zip(plist.modules(), modes):
                m.training = mode
        trains = any(t.requires_grad for t in plist.parameters(recurse=False))
        params[name] = torch.nn.Parameter(value.detach().clone(), requires_grad=trains)
        specs.append((name, list(plist), plist.unsafe))
    state["_modules"], state["_parameters"] = modules, params
    return _rebuild_parametrized, (cls, state, specs)


def _script_modules():
    """This process's script when the workers could not import it by name, so that its
    classes and functions travel by value, as those of a plain script's ``__main__`` do.
    In a process that multiprocessing's spawn or forkserver started
    (``torch.multiprocessing.spawn``, Lightning's ``ddp_spawn``), the parent's script runs
    as the module ``__mp_main__``, which cloudpickle would pickle by reference: an eager
    worker, whose own ``__main__`` is shmgrad's, would look the names up there. (In any
    other process ``__mp_main__``, where it exists, is ``__main__`` itself, named so.)"""
    module = sys.modules.get("__mp_main__")
    if module is not None and getattr(module, "__name__", None) == "__mp_main__":
        return [module]
    return []


def _module_replaced_in_sys_modules(obj) -> bool:
    """A module object of a ModuleType subclass that sys.modules holds under its name."""
    return (
        isinstance(obj, types.ModuleType)
        and type(obj) is not types.ModuleType
        and sys.modules.get(getattr(obj, "__name__", None)) is obj
    )


def _dumps(obj, cloudpickle):
    """cloudpickle.dumps, which also takes modules with parametrizations, and the classes
    and functions of a spawned process's script (:func:`_script_modules`)."""
    from torch.nn.utils import parametrize

    class Pickler(cloudpickle.CloudPickler):
        def reducer_override(self, obj):
            if isinstance(obj, torch.nn.Module) and parametrize.is_parametrized(obj):
                return _reduce_parametrized(obj)
            if _module_replaced_in_sys_modules(obj):
                # torch.backends.cudnn and its like: a ModuleType subclass that torch puts
                # in sys.modules, which cloudpickle (dispatching on the exact type) cannot
                # pickle; a function that reads torch.backends.cudnn.benchmark takes it.
                return importlib.import_module, (obj.__name__,)
            return super().reducer_override(obj)

    registered = set(cloudpickle.list_registry_pickle_by_value())
    by_value = [m for m in _script_modules() if m.__name__ not in registered]
    for module in by_value:  # for this pickling only: the caller's registry stays as it was
        cloudpickle.register_pickle_by_value(module)
    try:
        buf = io.BytesIO()
        Pickler(buf, protocol=cloudpickle.DEFAULT_PROTOCOL).dump(obj)
        return buf.getvalue()
    finally:
        for module in by_value:
            cloudpickle.unregister_pickle_by_value(module)


def _pickle(name, obj, pickler):
    try:
        return _dumps(obj, pickler)
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
        [(name, p.detach()) for name, p in named],  # as laid out: channels_last stays
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
    module it wraps and ``{}`` (the workers compile their own copy with default options).
    A ``DistributedDataParallel`` wrapper is refused, naming the module it wraps."""
    if isinstance(module, torch.nn.parallel.DistributedDataParallel):
        raise errors.InvalidArgumentError(
            "the model is wrapped in DistributedDataParallel: give shmgrad the module it "
            "wraps (ddp.module), for the engine and for bind(). The engine's workers compute "
            "the data-parallel gradient themselves; across nodes, pass process_group= to "
            "Engine or attach (DDP's all-reduce would be a second one)"
        )
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
    loss_reduction: Optional[str] = None,
) -> EagerJob:
    """Checks and pickles the job once, into a private directory. ``compile``: options
    of the ``torch.compile`` each worker applies to its copy of the model (None: none).
    ``loss_reduction``: "sum" or "mean" as declared; None: read from an ``nn`` loss, or
    found out on the dataset's first examples, or, without a Dataset, by each worker on
    its first shard."""
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
    loss_reduction = check_loss(loss, loss_names, forward=forward, loss_reduction=loss_reduction)
    check_no_parameters_outside(model, loss=loss, forward=forward)
    if isinstance(dataset, torch.utils.data.DataLoader):
        raise errors.InvalidArgumentError(
            "dataset is a DataLoader; shmgrad's workers load the examples themselves: pass "
            "dataset=loader.dataset, collate_fn=loader.collate_fn, and give each batch's "
            "indices to engine.gradient(indices) (e.g. from a sampler)"
        )
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
    if dataset is not None:
        loss_reduction = check_dataset(
            dataset,
            model=model,
            loss=loss,
            forward=forward,
            collate_fn=collate_fn,
            loss_reduction=loss_reduction,
        )
    blob = _pickle(
        "job",
        WorkerJob(model, loss, dataset, collate_fn, forward, compile, loss_reduction),
        cloudpickle,
    )
    # A private directory (mkdtemp: 0700, a fresh unguessable name, made with O_EXCL's
    # guarantee) and owner-only files created exclusively in it: no other user can read,
    # replace or add to them (load_job checks it again before unpickling).
    directory = tempfile.mkdtemp(prefix="shmgrad-eager-")
    try:
        holder = os.path.join(directory, PARAMS_FILE)
        os.close(_create_private(holder))  # 0600 from the start; the writer truncates it
        write_params(model, holder)
        job = os.path.join(directory, JOB_FILE)
        with os.fdopen(_create_private(job), "wb") as f:
            f.write(blob)
    except BaseException:
        import shutil

        shutil.rmtree(directory, ignore_errors=True)
        raise
    return EagerJob(directory, holder, job, size, loss_reduction)


class _JobUnpickler(pickle.Unpickler):
    """pickle's loader (cloudpickle's output loads with it), whose error for a class or
    function pickled by reference that this process cannot find names the object, its
    module and what to do, instead of pointing into shmgrad's worker."""

    def find_class(self, module, name):
        try:
            return super().find_class(module, name)
        except (ImportError, AttributeError) as exc:
            if module in ("__main__", "__mp_main__"):
                why = (
                    f"it was pickled by reference to the script's module {module!r}, which in "
                    "an eager worker is shmgrad's own. In the trainer, "
                    f"cloudpickle.register_pickle_by_value(sys.modules[{module!r}]) before "
                    "the engine starts sends the script's classes and functions by value"
                )
            else:
                why = (
                    f"the worker cannot import it ({type(exc).__name__}: {exc}); it runs with "
                    "the trainer's sys.path and working directory as they were when the "
                    "engine started. Define it at module level in a module on that path, or "
                    "send its module by value: cloudpickle.register_pickle_by_value(module) "
                    "in the trainer before the engine starts"
                )
            raise errors.InvalidArgumentError(
                f"the engine's job refers to {name!r} of module {module!r}, which the eager "
                f"worker cannot find: {why}"
            ) from exc


def _create_private(path: str) -> int:
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)


def load_job(path: str) -> WorkerJob:
    """The job the launcher wrote. Unpickling runs whatever code the pickle names, so it
    is read only from a file no other user can have written or swapped:
    :func:`open_private`."""
    with open_private(path, "the engine's job") as f:
        return _JobUnpickler(f).load()


def open_private(path: str, what: str):
    """Opens ``path`` for reading (a binary file object) if it is a regular file of this
    user, mode 0600 or stricter, in a directory of this user of mode 0700 or stricter, as
    the launcher makes them; raises :class:`~shmgrad.BusyError` naming the path and what
    is wrong otherwise. The directory is opened first (never through a symbolic link) and
    the file is opened relative to it (never through a link either, never blocking on a
    FIFO), so what is checked is what is read: another user cannot swap either between
    the check and the read."""
    path = os.path.abspath(path)
    directory, base = os.path.split(path)
    try:
        dfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise _refused(what, directory, f"cannot be opened as a directory ({exc})") from None
    try:
        _check_private(what, directory, os.fstat(dfd), "directory")
        try:
            fd = os.open(
                base, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dfd
            )
        except OSError as exc:  # O_NOFOLLOW: ELOOP for a symbolic link
            link = exc.errno == errno.ELOOP
            why = "is a symbolic link (not followed)" if link else f"cannot be opened ({exc})"
            raise _refused(what, path, why) from None
    finally:
        os.close(dfd)
    try:
        _check_private(what, path, os.fstat(fd), "file")
    except BaseException:
        os.close(fd)
        raise
    return os.fdopen(fd, "rb")


def _check_private(what, path, st, kind):
    regular = stat.S_ISDIR(st.st_mode) if kind == "directory" else stat.S_ISREG(st.st_mode)
    if not regular:
        raise _refused(what, path, f"is not a {'regular file' if kind == 'file' else kind}")
    if st.st_uid != os.geteuid():
        raise _refused(what, path, f"belongs to uid {st.st_uid}, not to you (uid {os.geteuid()})")
    if st.st_mode & 0o077:
        raise _refused(
            what,
            path,
            f"has mode {stat.S_IMODE(st.st_mode):04o}: other users may read or change it "
            f"(the launcher makes the {kind} {'0700' if kind == 'directory' else '0600'})",
        )


def _refused(what, path, why):
    return errors.BusyError(
        f"{what}: {path} {why}; refused: only a file of yours that no other user can write "
        "or replace is loaded (unpickling runs its code). Start the engine again from the "
        "trainer (shmgrad.Engine or shmgrad.serve write it privately); see docs/DESIGN.md, "
        '"What a local attacker can reach"'
    )


class CountedClassLoss:
    """A mean cross entropy or NLL loss as the engine runs it: ``(loss_sum, count)``.

    ``nn.CrossEntropyLoss()`` and ``nn.NLLLoss()`` with ``reduction="mean"`` (and
    ``F.cross_entropy`` / ``F.nll_loss`` themselves) divide by the weight of the targets
    they do not ignore: their number with ``ignore_index`` (-100 by default, the padding
    of token labels), the sum of ``weight[target]`` with class weights. A shard's mean
    weighted by its examples would then not be the batch's mean, so the loss is computed
    as a sum with that denominator as its count, which is torch's own mean of the whole
    batch once every shard's sums and counts are added up. Class-probability targets
    (floating point) are averaged over examples as they are: the loss is returned as is.
    """

    def __init__(self, loss):
        self.loss = loss  # the module (a device worker moves it, with its class weights)

    def __call__(self, out, target):
        loss = self.loss
        if not isinstance(target, torch.Tensor) or target.is_floating_point():
            return loss(out, target)
        f = torch.nn.functional
        if isinstance(loss, torch.nn.Module):
            weight, ignore = loss.weight, loss.ignore_index
            smoothing = getattr(loss, "label_smoothing", 0.0)
            cross_entropy = isinstance(loss, torch.nn.CrossEntropyLoss)
        else:
            weight, ignore, smoothing = None, -100, 0.0
            cross_entropy = loss is f.cross_entropy
        kept = target != ignore
        if weight is None:
            count = kept.sum()
        else:  # torch's denominator: the class weights of the targets kept
            count = weight[target.masked_select(kept)].sum()
        if cross_entropy:
            total = f.cross_entropy(
                out, target, weight, ignore_index=ignore, reduction="sum", label_smoothing=smoothing
            )
        else:
            total = f.nll_loss(out, target, weight, ignore_index=ignore, reduction="sum")
        return total, count


def counts_its_mean(loss) -> bool:
    """Whether the loss is a mean cross entropy or NLL loss: see CountedClassLoss."""
    f = torch.nn.functional
    if loss is f.cross_entropy or loss is f.nll_loss:
        return True
    return (
        type(loss) in (torch.nn.CrossEntropyLoss, torch.nn.NLLLoss)
        and getattr(loss, "reduction", None) == "mean"
    )


def resolve_loss(loss):
    """The callable a worker computes a batch's loss with: a named loss's function, a mean
    cross entropy or NLL loss returning (loss_sum, count) (CountedClassLoss), or the loss
    as given."""
    if isinstance(loss, str):
        return _named_loss(loss)
    return CountedClassLoss(loss) if counts_its_mean(loss) else loss


def has_batchnorm(module: torch.nn.Module) -> bool:
    """Whether the module normalises with batch statistics in train mode."""
    return any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in module.modules())
