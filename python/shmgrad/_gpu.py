"""shmgrad's CUDA path, seen from Python: ``devices=`` read into CUDA ordinals, their
round-robin placement, and the checks that say at once what a machine lacks.

The CUDA path is ``libshmgrad_cuda.so`` beside the extension (gpu/cuda_ops.h), built when
nvcc was found at install time and loaded (by gpu/cuda_library.h, with dlopen) only for an
engine given devices: a CPU engine needs no CUDA library. docs/GPU.md says where an engine's
device memory lives and how a step runs on it.
"""

import ctypes
import os
from typing import List, Optional

import torch

from . import errors
from ._native import _C, build_info, tunable

LIBRARY = os.path.join(os.path.dirname(os.path.abspath(__file__)), "libshmgrad_cuda.so")

_library = None


def parse_devices(devices=None, device=None, trainer_device=None) -> Optional[List[int]]:
    """The CUDA ordinals an engine serves, from ``devices=`` (a list of ``"cuda:N"``,
    ``torch.device`` or ints) or ``device="cuda"`` (every visible GPU), the trainer's
    first (the first listed, or ``trainer_device``, which must be one of them); None for a
    CPU engine. Refuses CPU devices, duplicates and both arguments together."""
    ordinals = _parse_ordinals(devices, device)
    if trainer_device is None:
        return ordinals
    if ordinals is None:
        raise errors.InvalidArgumentError(
            "trainer_device= names the trainer's GPU among the engine's: give devices= (or "
            "device='cuda') too"
        )
    kind, ordinal = _device_of(
        trainer_device,
        f"trainer_device={trainer_device!r} is no device: name one of devices= ('cuda:1')",
    )
    if kind != "cuda" or ordinal not in ordinals:
        raise errors.InvalidArgumentError(
            f"trainer_device={trainer_device!r} is not one of the engine's GPUs "
            f"({', '.join(f'cuda:{o}' for o in ordinals)}): name one of them"
        )
    return [ordinal] + [o for o in ordinals if o != ordinal]


def _device_of(item, no_device: str):
    """``(type, ordinal)`` of a device given as ``"cuda:N"``, a ``torch.device`` or an int
    (a CUDA ordinal; no index means 0); InvalidArgumentError(no_device) for anything else."""
    try:
        d = torch.device(f"cuda:{item}" if isinstance(item, int) else item)
    except (RuntimeError, TypeError) as exc:
        raise errors.InvalidArgumentError(no_device) from exc
    return d.type, d.index if d.index is not None else 0


def _parse_ordinals(devices, device) -> Optional[List[int]]:
    if devices is None and device is None:
        return None
    if devices is not None and device is not None:
        raise errors.InvalidArgumentError(
            "give devices= (a list of GPUs) or device='cuda' (every visible GPU), not both"
        )
    if device is not None:
        d = torch.device(device) if not isinstance(device, torch.device) else device
        if d.type != "cuda" or d.index is not None:
            raise errors.InvalidArgumentError(
                f"device={device!r}: device= takes 'cuda' (every visible GPU); name GPUs "
                "with devices=['cuda:0', ...], and leave both out for a CPU engine"
            )
        count = device_count()
        return list(range(count))
    if isinstance(devices, (str, int, torch.device)):
        devices = [devices]
    ordinals = []
    for item in devices:
        kind, ordinal = _device_of(
            item,
            f"devices= holds {item!r}, which is no device: name GPUs as 'cuda:0', 'cuda:1', "
            "... or by their index",
        )
        if kind != "cuda":
            raise errors.InvalidArgumentError(
                f"devices= holds {item!r}: it lists GPUs ('cuda:0', ...); leave devices= out "
                "for a CPU engine"
            )
        if ordinal in ordinals:
            raise errors.InvalidArgumentError(
                f"devices= lists cuda:{ordinal} twice: give each GPU once (workers share GPUs "
                "round-robin; workers= sets how many)"
            )
        ordinals.append(ordinal)
    if not ordinals:
        raise errors.InvalidArgumentError("devices= is empty: list at least one GPU")
    return ordinals


def workers_for(workers: Optional[int], ordinals: Optional[List[int]]) -> Optional[int]:
    """The engine's worker count: as given, or one per GPU."""
    if workers is None:
        if ordinals is None:
            raise errors.InvalidArgumentError(
                "workers= is required for an engine on the CPU (one per core you give it); "
                "with devices=, it defaults to one per GPU"
            )
        return len(ordinals)
    return workers


def warn_sharing(workers: int, ordinals: List[int], mps: bool) -> None:
    """Several workers on one GPU are allowed, but each has its own CUDA context, and
    without MPS the kernels of different contexts take turns on the GPU: slower than one
    worker there, not wrong, so it is warned about, not refused. ``mps``: what the
    coordinator found when it started (``status().mps``)."""
    if workers > len(ordinals) and not mps:
        import warnings

        warnings.warn(
            f"{workers} workers on {len(ordinals)} GPU(s): the workers sharing a GPU take "
            "turns on it (each has its own CUDA context, and without MPS their kernels do "
            "not run at once), so they are no faster than one worker per GPU. Start an MPS "
            "daemon (nvidia-cuda-mps-control -d) to run them at once, or leave workers= out "
            "for one per GPU",
            stacklevel=4,
        )


def placement(workers: int, ordinals: List[int]) -> List[int]:
    """Each worker slot's CUDA ordinal: round-robin over ``ordinals``."""
    return [ordinals[d] for d in _C.place_round_robin(workers, len(ordinals))]


def _library_path() -> str:
    """$SHMGRAD_CUDA_LIBRARY (as for the engine's own processes), else LIBRARY, or the
    error naming why this installation has none."""
    override = tunable("SHMGRAD_CUDA_LIBRARY")
    if override:
        return override
    if not build_info()["cuda"]:
        raise errors.InvalidArgumentError(
            "devices= needs shmgrad's CUDA path, and this shmgrad was built without it (no "
            "nvcc was found when it was installed): install the CUDA toolkit, then reinstall "
            "shmgrad with pip install --no-build-isolation . (or set CUDA_HOME)"
        )
    if not os.path.exists(LIBRARY):
        raise errors.InvalidArgumentError(
            f"devices= needs {LIBRARY}, which is missing from this installation: reinstall shmgrad"
        )
    return LIBRARY


def _load():
    """libshmgrad_cuda.so through ctypes, every function typed: the device tests' direct
    access to the library (an engine's processes load it in C++)."""
    global _library
    if _library is not None:
        return _library
    lib = ctypes.CDLL(_library_path(), mode=ctypes.RTLD_LOCAL)
    i, u32, u64, f32, vp = (
        ctypes.c_int,
        ctypes.c_uint32,
        ctypes.c_uint64,
        ctypes.c_float,
        ctypes.c_void_p,
    )
    for fn, args in {
        "shmgrad_cuda_error_name": [i],
        "shmgrad_cuda_error_string": [i],
        "shmgrad_cuda_device_count": [ctypes.POINTER(i)],
        "shmgrad_cuda_alloc": [i, u64, ctypes.POINTER(u64)],
        "shmgrad_cuda_free": [i, u64],
        "shmgrad_cuda_ipc_handle": [i, u64, vp],
        "shmgrad_cuda_ipc_open": [i, vp, ctypes.POINTER(u64)],
        "shmgrad_cuda_ipc_close": [i, u64],
        "shmgrad_cuda_copy_to_device": [i, u64, vp, u64],
        "shmgrad_cuda_copy_to_host": [i, vp, u64, u64],
        "shmgrad_cuda_memory_kind": [],
        "shmgrad_cuda_zero": [i, u64, u64],
        "shmgrad_cuda_synchronize": [i],
        "shmgrad_cuda_can_access_peer": [i, i, ctypes.POINTER(i)],
        "shmgrad_cuda_copy": [i, u64, u64, u64],
        "shmgrad_cuda_reduce": [i, u64, u64, ctypes.POINTER(u64), u32, u64, u64, f32, f32],
        "shmgrad_cuda_any_nonfinite": [i, u64, u64, u64, ctypes.POINTER(i)],
    }.items():
        getattr(lib, fn).argtypes = args
    lib.shmgrad_cuda_error_name.restype = ctypes.c_char_p
    lib.shmgrad_cuda_error_string.restype = ctypes.c_char_p
    if lib.shmgrad_cuda_api_version() != _C.CUDA_API_VERSION:
        raise errors.InvalidArgumentError(
            f"{LIBRARY} has interface {lib.shmgrad_cuda_api_version()}, this shmgrad "
            f"{_C.CUDA_API_VERSION}: reinstall shmgrad"
        )
    _library = lib
    return lib


def _describe(lib, code: int) -> str:
    name = lib.shmgrad_cuda_error_name(code).decode()
    return f"{name}: {lib.shmgrad_cuda_error_string(code).decode()}"


def device_count() -> int:
    """The GPUs the CUDA runtime sees; an error naming what is missing (no driver, no
    GPU) when it sees none: the coordinator's own check (gpu/cuda_library.h)."""
    return _C.cuda_device_count(_library_path())


def check_devices(ordinals: List[int]) -> None:
    """Raises, before anything starts, what keeps an engine from these GPUs."""
    count = device_count()
    if torch.version.cuda is None:
        raise errors.InvalidArgumentError(
            f"devices= needs a CUDA build of torch, and torch {torch.__version__} is built "
            "without CUDA: install a CUDA build (pip install torch from the package index)"
        )
    missing = [o for o in ordinals if o >= count]
    if missing:
        raise errors.InvalidArgumentError(
            f"devices= names cuda:{missing[0]}, and this machine shows {count} GPU(s) "
            f"(cuda:0 to cuda:{count - 1})"
        )
