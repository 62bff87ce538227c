"""The native extension ``shmgrad._C``, with a clear error when it is not built or was
built against another torch than the one imported."""

from typing import NamedTuple

import torch

try:
    from . import _C  # noqa: F401
except ImportError as exc:  # pragma: no cover - only without set-up
    raise ImportError(
        "shmgrad's native module is not built or does not load "
        f"({exc}): install shmgrad with pip install --no-build-isolation . in the "
        "environment whose torch it should use (or run tools/setup.sh in the checkout)"
    ) from exc


def _release(version: str) -> str:
    return version.split("+")[0]


_built = _C.build_info()
if _release(_built["torch"]) != _release(torch.__version__):  # pragma: no cover
    raise ImportError(
        f"shmgrad was built against torch {_built['torch']} but this Python imports torch "
        f"{torch.__version__}: C++ extensions only load into the torch they were built "
        "against. Reinstall shmgrad here: pip install --no-build-isolation --force-reinstall "
        "--no-deps ."
    )


# The engine's defaults and environment tunables, declared once in ipc/config.h.
DEFAULTS = dict(_C.DEFAULTS)


class Option(NamedTuple):
    """One field of a native options list (engine/trainer.h's, engine/serve_options.h's)."""

    type: str  # "int", "float", "bool", "str", "list:int"
    default: object  # as Python sees it (an enum's as its integer)
    doc: str
    flag: str = ""  # serve: the option and its value's name ("--max-batch N"); "" for none
    internal: bool = False  # serve: set by the launchers, hidden in --help


# name -> Option, in each list's order: a gradient call's and attach's options, and serve's.
GRADIENT_OPTIONS = {name: Option(*rest) for name, *rest in _C.GRADIENT_OPTIONS}
ATTACH_OPTIONS = {name: Option(*rest) for name, *rest in _C.ATTACH_OPTIONS}
SERVE_OPTIONS = {name: Option(*rest) for name, *rest in _C.SERVE_OPTIONS}

# TUNABLES: name -> (value, default, meaning): the value that applies when it is unset (None
# where the default is not one value), the default in words, and what it tunes.
TUNABLES = {
    name: (_C.TUNABLE_VALUES.get(name), default, meaning) for name, default, meaning in _C.TUNABLES
}


def tunable(name: str):
    """The value of a declared environment tunable, or None when it is unset. Reading one
    that ipc/config.h's kTunables does not declare is a bug."""
    import os

    if name not in TUNABLES:
        raise KeyError(f"{name} is not declared in ipc/config.h's kTunables: declare it there")
    return os.environ.get(name) or None


def tunable_value(name: str) -> str:
    """A declared tunable's value from the environment when set, else its declared value."""
    value = tunable(name)
    if value is not None:
        return value
    if TUNABLES[name][0] is None:
        raise KeyError(f"{name} has no declared value ({TUNABLES[name][1]}): read it with tunable")
    return TUNABLES[name][0]


def build_info() -> dict:
    """What this shmgrad was built with: ``torch`` (the version compiled against),
    ``cxx11_abi``, ``cuda`` (whether the CUDA path is built) and ``cuda_toolkit``, and
    ``compiler``; plus ``torch_runtime``, the torch imported now."""
    info = dict(_built)
    info["torch_runtime"] = torch.__version__
    return info
