"""What the engine needs to know of a module: its shared buffers (BatchNorm statistics),
the module a ``torch.compile``'d one wraps, ``compile=``'s options, and whether it has
BatchNorm."""

from typing import Optional

import torch

from . import errors


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


def has_batchnorm(module: torch.nn.Module) -> bool:
    """Whether the module normalises with batch statistics in train mode."""
    return any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in module.modules())
