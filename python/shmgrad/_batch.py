"""Structured batches: a dict, tuple or list of tensors (nested), as a tokenizer or a
``collate_fn`` makes them, carried through the engine's shared memory.

The trainer flattens a batch into its tensors (the leaves, in a fixed order) and a short
description of how they nest, a JSON string: a leaf is its index, a dict
``{"d": [[key, item], ...]}``, a list ``{"l": [...]}``, a tuple ``{"t": [...]}``. The
native trainer copies the leaves into the segment and the description into the step
request; each eager worker rebuilds the same structure over its shard's rows
(:func:`unflatten`), parsing a description once.
"""

import json
from typing import Any, List, Tuple

import torch

from . import errors

try:
    import numpy
except ImportError:  # pragma: no cover - numpy ships with torch
    numpy = None


def _path(path) -> str:
    return "batch" + "".join(f"[{p!r}]" for p in path)


def flatten(batch) -> Tuple[List[torch.Tensor], str]:
    """``(leaves, structure)`` of a batch. Raises InvalidArgumentError, naming where, for a
    leaf that is not a tensor or a key that is not a string."""
    leaves: List[torch.Tensor] = []

    def walk(obj, path):
        if isinstance(obj, torch.Tensor):
            leaves.append(obj)
            return len(leaves) - 1
        if numpy is not None and isinstance(obj, numpy.ndarray):
            leaves.append(torch.as_tensor(obj))
            return len(leaves) - 1
        if isinstance(obj, dict) or (hasattr(obj, "keys") and hasattr(obj, "__getitem__")):
            items = []
            for k in obj.keys():
                if not isinstance(k, str):
                    raise errors.InvalidArgumentError(
                        f"{_path(path)} has the key {k!r}; a batch's dict keys must be strings"
                    )
                items.append([k, walk(obj[k], path + (k,))])
            return {"d": items}
        if isinstance(obj, (list, tuple)):
            kind = "t" if isinstance(obj, tuple) else "l"
            return {kind: [walk(v, path + (i,)) for i, v in enumerate(obj)]}
        raise errors.InvalidArgumentError(
            f"{_path(path)} is a {type(obj).__name__}, not a tensor: a batch holds tensors "
            "(in dicts, tuples and lists) with the examples along their first dimension; "
            "turn it into a tensor, or leave it out of the batch"
        )

    structure = walk(batch, ())
    if not leaves:
        raise errors.InvalidArgumentError("the batch holds no tensor")
    return leaves, json.dumps(structure, separators=(",", ":"))


_parsed = {}  # description -> parsed structure (a worker sees few distinct ones)


def unflatten(structure: str, leaves: List[torch.Tensor]) -> Any:
    """The batch that :func:`flatten` described, over ``leaves``."""
    tree = _parsed.get(structure)
    if tree is None:
        tree = json.loads(structure)
        if len(_parsed) > 64:
            _parsed.clear()
        _parsed[structure] = tree

    def build(node):
        if isinstance(node, int):
            return leaves[node]
        if "d" in node:
            return {k: build(v) for k, v in node["d"]}
        if "t" in node:
            return tuple(build(v) for v in node["t"])
        return [build(v) for v in node["l"]]

    return build(tree)
