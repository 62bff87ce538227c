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


_parsed = {}  # (description, leaves) -> checked tree (a worker sees few distinct ones)
_MAX_DEPTH = 100  # nesting of a batch's containers, at most


def _corrupt(structure: str, why: str):
    return errors.CorruptSegmentError(
        f"step request: the structured batch's description {structure[:80]!r} {why}; "
        "it is not one the trainer writes (another shmgrad version, or damaged memory)"
    )


def _checked_tree(structure: str, num_leaves: int):
    """The description parsed, and checked to be what :func:`flatten` writes for
    ``num_leaves`` tensors: leaves numbered 0, 1, ... in the order they appear, containers
    of the three kinds, string keys given once. It comes from shared memory: anything else
    raises CorruptSegmentError, never another exception."""
    try:
        tree = json.loads(structure)
    except (ValueError, RecursionError):
        raise _corrupt(structure, "is not JSON") from None
    next_leaf = 0

    def check(node, depth):
        nonlocal next_leaf
        if depth > _MAX_DEPTH:
            raise _corrupt(structure, f"nests deeper than {_MAX_DEPTH}")
        if type(node) is int:  # not bool
            if node != next_leaf:
                raise _corrupt(structure, f"has leaf {node} where leaf {next_leaf} belongs")
            next_leaf += 1
            return
        if not (type(node) is dict and len(node) == 1 and type(next(iter(node.values()))) is list):
            raise _corrupt(structure, "has a node that is neither a leaf nor a container")
        kind, items = next(iter(node.items()))
        if kind == "d":
            keys = set()
            for item in items:
                if not (type(item) is list and len(item) == 2 and type(item[0]) is str):
                    raise _corrupt(structure, "has a dict item that is not [key, value]")
                if item[0] in keys:
                    raise _corrupt(structure, f"gives the key {item[0]!r} twice")
                keys.add(item[0])
                check(item[1], depth + 1)
        elif kind in ("l", "t"):
            for item in items:
                check(item, depth + 1)
        else:
            raise _corrupt(structure, f"has a container of unknown kind {kind!r}")

    check(tree, 0)
    if next_leaf != num_leaves:
        raise _corrupt(structure, f"describes {next_leaf} tensors, not {num_leaves}")
    return tree


def unflatten(structure: str, leaves: List[torch.Tensor]) -> Any:
    """The batch that :func:`flatten` described, over ``leaves``. Raises
    CorruptSegmentError for a description flatten does not write."""
    key = (structure, len(leaves))
    tree = _parsed.get(key)
    if tree is None:
        tree = _checked_tree(structure, len(leaves))
        if len(_parsed) > 64:
            _parsed.clear()
        _parsed[key] = tree

    def build(node):
        if isinstance(node, int):
            return leaves[node]
        if "d" in node:
            return {k: build(v) for k, v in node["d"]}
        if "t" in node:
            return tuple(build(v) for v in node["t"])
        return [build(v) for v in node["l"]]

    return build(tree)
