"""Numerical helpers shared by the benchmarks, the stress tool, the examples and the tests,
and their access to the environment tunables (ipc/config.h's kTunables, docs/DESIGN.md)."""

from typing import Sequence, Union

import torch

from . import errors
from ._native import _C, tunable, tunable_value  # noqa: F401  (re-exported for the tools)


def physical_cores() -> int:
    """The cores this process may run on, SMT siblings once: what ``workers="auto"``
    starts one worker per."""
    return _C.physical_cores()


Tensors = Union[torch.Tensor, Sequence[torch.Tensor]]


def _flat64(x: Tensors) -> torch.Tensor:
    if isinstance(x, (list, tuple)):
        if not x:
            return torch.zeros(0, dtype=torch.float64)
        return torch.cat([torch.as_tensor(t).detach().reshape(-1).double() for t in x])
    return torch.as_tensor(x).detach().reshape(-1).double()


def relative_error(got: Tensors, want: Tensors) -> float:
    """``||got - want|| / ||want||`` over all elements, in float64.

    ``got`` and ``want`` are tensors (or arrays), or sequences of them such as a model's
    gradients, compared element by element in order. When ``want`` is all zeros the
    absolute difference ``||got||`` is returned instead. Raises InvalidArgumentError when
    the two hold different numbers of elements.
    """
    g, w = _flat64(got), _flat64(want)
    if g.numel() != w.numel():
        raise errors.InvalidArgumentError(
            f"relative_error: {g.numel()} elements against {w.numel()}: compare gradients "
            "of the same model"
        )
    diff = float(torch.linalg.vector_norm(g - w))
    norm = float(torch.linalg.vector_norm(w))
    return diff / norm if norm > 0 else diff
