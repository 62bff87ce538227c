"""What one gradient call asks the engine for, checked and put in the native trainer's
terms: the batch (indices into the engine's dataset, explicit inputs and targets, or a
structured batch), the loss scale and the step's seed."""

import math

import torch

from . import errors

_FLOAT32_MAX = torch.finfo(torch.float32).max  # the largest loss_scale a step can carry


def local_step(trainer, args, indices, inputs, targets, batch, across_nodes):
    """``(step, empty)``: a function that runs this node's step with the native options
    ``args``, and whether this node's share is empty (across nodes it may be: the node then
    only takes part in the all-reduce). Bad batches are refused here, before anything
    runs."""
    if batch is not None:
        if indices is not None or inputs is not None or targets is not None:
            raise errors.InvalidArgumentError("give one of indices, inputs and targets, or batch")
        from ._batch import flatten

        leaves, structure = flatten(batch)
        first = leaves[0]
        empty = across_nodes and first.dim() > 0 and first.shape[0] == 0
        return (lambda: trainer.gradient_structured(leaves, structure, *args)), empty
    if indices is not None:
        if inputs is not None or targets is not None:
            raise errors.InvalidArgumentError("give either indices or inputs and targets, not both")
        idx = _indices(indices, across_nodes)
        return (lambda: trainer.gradient(idx, None, None, *args)), idx.numel() == 0
    if inputs is None or targets is None:
        raise errors.InvalidArgumentError(
            "give indices into the engine's dataset, or both inputs and targets"
        )
    # Tensors that autograd tracks are fine: the engine only reads their data and converts
    # a dtype or layout with gradient recording off. Nothing more is looked at here: right
    # after a long step, with the caches cold, every attribute read costs microseconds.
    x = inputs if isinstance(inputs, torch.Tensor) else torch.as_tensor(inputs)
    y = targets if isinstance(targets, torch.Tensor) else torch.as_tensor(targets)
    empty = across_nodes and x.dim() > 0 and x.shape[0] == 0
    return (lambda: trainer.gradient(None, x, y, *args)), empty


def _indices(indices, across_nodes):
    """The indices as a 1-D int64 tensor; an empty one only across nodes (a node's share)."""
    idx = indices if isinstance(indices, torch.Tensor) else torch.as_tensor(indices)
    if idx.numel() == 0 and not across_nodes:
        raise errors.InvalidArgumentError("empty batch: give at least one index")
    empty = idx.numel() == 0  # across nodes, an empty share (any dtype: [] is float)
    if not empty and (idx.dtype.is_floating_point or idx.dtype == torch.bool or idx.is_complex()):
        hint = " (a mask? give mask.nonzero().flatten())" if idx.dtype == torch.bool else ""
        raise errors.InvalidArgumentError(f"indices must be integers, got {idx.dtype}{hint}")
    if idx.dim() != 1:
        idx = idx.reshape(-1) if idx.dim() == 0 else idx
        if idx.dim() != 1:
            raise errors.InvalidArgumentError(f"indices must be 1-D, got shape {tuple(idx.shape)}")
    return idx if idx.dtype == torch.int64 else idx.to(torch.int64)


def check_seed(seed):
    """``gradient(seed=...)``: an int in [0, 2^64)."""
    if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 2**64:
        raise errors.InvalidArgumentError(f"seed must be an int in [0, 2^64), got {seed!r}")
    return seed


def loss_scale_value(loss_scale, device) -> float:
    """gradient()'s ``loss_scale`` as the float the workers multiply their loss by: a
    GradScaler's current scale (1 when it is disabled), or a number."""
    if type(loss_scale) is float and 0 < loss_scale <= _FLOAT32_MAX:
        return loss_scale  # the default (1.0) and fixed scales: no more to look at
    if hasattr(loss_scale, "scale") and hasattr(loss_scale, "unscale_"):  # a GradScaler
        if not loss_scale.is_enabled():
            return 1.0
        # scale() sets the scaler up on the gradients' device as scaler.scale(loss) would
        # (its step() refuses a scaler that never scaled anything), and gives the scale (on
        # a GPU, one small copy to the host).
        one = torch.ones((), device=device or "cpu")
        value = float(loss_scale.scale(one))
    elif isinstance(loss_scale, (int, float, torch.Tensor)) and not isinstance(loss_scale, bool):
        if isinstance(loss_scale, torch.Tensor) and loss_scale.numel() != 1:
            raise errors.InvalidArgumentError(
                f"loss_scale must be one number, got a tensor of shape {tuple(loss_scale.shape)}"
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
            "scaling; a GradScaler whose scale reached this has seen only overflows: look "
            "for NaN/inf in the loss itself)"
        )
    return value
