"""The eager workers' reader of a structured batch's description (shmgrad._batch.unflatten),
a string the trainer writes into the step request: randomized, cheap (no engine). Any
description is either the one flatten() writes for the batch it rebuilds, or refused with
CorruptSegmentError; no other exception, no leaf taken twice or out of order, no dict
that loses a duplicate key. (The C++ side of the request is fuzzed: tests/fuzz.)"""

import json
import random

import pytest
import torch

from shmgrad import errors
from shmgrad._batch import flatten, unflatten


def _random_batch(rng, depth=0):
    if depth > 3 or rng.random() < 0.3:
        return torch.zeros(2)
    kind = rng.choice("dlt")
    items = [_random_batch(rng, depth + 1) for _ in range(rng.randint(1, 3))]
    if kind == "d":
        return {f"k{i}": v for i, v in enumerate(items)}
    return items if kind == "l" else tuple(items)


def _same(a, b):
    if isinstance(a, torch.Tensor):
        return a is b
    if type(a) is not type(b) or len(a) != len(b):
        return False
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    return all(_same(x, y) for x, y in zip(a, b))


def _mutate(rng, text):
    chars = list(text)
    for _ in range(rng.randint(1, 4)):
        op = rng.random()
        at = rng.randrange(len(chars) + 1)
        if op < 0.4 and chars:
            chars[min(at, len(chars) - 1)] = rng.choice('{}[]",:0123456789-dlt ae.')
        elif op < 0.7:
            chars.insert(at, rng.choice('{}[]",:0123456789-dlt ae.'))
        elif chars:
            del chars[min(at, len(chars) - 1)]
    return "".join(chars)


CRAFTED = [
    "",
    "null",
    "true",
    "-1",
    "0.0",
    '"0"',
    "[0]",
    "1",
    '{"d":[["a",0],["a",1]]}',
    '{"d":[[1,0]]}',
    '{"d":[["a"]]}',
    '{"d":{"a":0}}',
    '{"l":0}',
    '{"l":[0],"t":[1]}',
    '{"x":[0]}',
    '{"l":[1,0]}',
    '{"l":[0,0]}',
    '{"t":[0,1,2]}',
    '{"l":[' * 100000 + "0" + "]}" * 100000,
    "[" * 100000,
]


def _check(structure, leaves):
    try:
        batch = unflatten(structure, leaves)
    except errors.CorruptSegmentError:
        return False
    again_leaves, again = flatten(batch)
    assert again == json.dumps(json.loads(structure), separators=(",", ":")), structure
    assert len(again_leaves) == len(leaves) and all(x is y for x, y in zip(again_leaves, leaves)), (
        structure
    )
    return True


def test_unflatten_rebuilds_what_flatten_describes():
    rng = random.Random(0)
    for _ in range(200):
        batch = _random_batch(rng)
        leaves, structure = flatten(batch)
        assert _same(unflatten(structure, leaves), batch)


@pytest.mark.parametrize("structure", CRAFTED)
def test_unflatten_refuses_what_flatten_never_writes(structure):
    leaves = [torch.zeros(1), torch.ones(1)]
    assert not _check(structure, leaves)


def test_unflatten_of_random_descriptions_is_flattens_or_refused():
    rng = random.Random(1)
    accepted = 0
    for _ in range(3000):
        leaves, structure = flatten(_random_batch(rng))
        accepted += _check(_mutate(rng, structure), leaves)
    assert accepted < 3000  # the mutations did reach the refusals
