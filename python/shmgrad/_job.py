"""An eager engine's job: checked and pickled once (cloudpickle, so classes and functions
from ``__main__`` or a notebook work) into a private directory with the parameter file
that tells ``shmgrad serve`` the layout of the shared parameters; each worker loads it
(only from a 0600 file of its user in a 0700 directory). docs/DESIGN.md, "Eager
workers"."""

import errno
import importlib
import io
import os
import pickle
import stat
import sys
import tempfile
import types
from typing import Callable, List, NamedTuple, Optional

import torch

from . import errors
from ._losses import check_dataset, check_loss, check_no_parameters_outside
from ._modules import shared_buffers

JOB_FILE = "job.pkl"
PARAMS_FILE = "params.bin"


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
        from ._launcher import SERVE_FLAGS as flag  # engine/serve_options.h's launcher options

        return [
            flag["eager_job"],
            self.job_path,
            flag["python"],
            sys.executable,
            flag["eager_dataset_size"],
            str(self.dataset_size),
            flag["owned_dir"],
            self.directory,
        ] + ([flag["loss_reduction"], self.loss_reduction] if self.loss_reduction else [])


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
    dataset, size = _dataset_of(dataset, collate_fn)
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
    directory, holder, job = _write_private(model, blob)
    return EagerJob(directory, holder, job, size, loss_reduction)


def _dataset_of(dataset, collate_fn):
    """The job's dataset and its size: a map-style Dataset the workers hold, or None (a
    spec string, which the coordinator loads into shared memory, or no dataset)."""
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
    return dataset, size


def _write_private(model, blob):
    """The job's directory, parameter file and pickled job."""
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
    return directory, holder, job


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
