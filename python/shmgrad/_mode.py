"""Which kind of worker runs a job: eager Python workers or TorchScript ones
(``mode="auto"``, ``"eager"``, ``"script"``), and why."""

import os
from typing import List, Tuple

import torch

from . import errors

MODES = ("auto", "eager", "script")


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
