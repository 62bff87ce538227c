"""The seeds of eager workers' examples: every ``dataset[i]`` of a step is drawn after
seeding Python's ``random``, NumPy's global generator and torch's CPU generator with
:func:`example_seed` ``(step_seed, i)``, so an example's random transform depends on the
step and the example only, not on which worker took it."""

import random

import torch


try:
    import numpy
except ImportError:  # pragma: no cover - numpy ships with torch on Debian
    numpy = None

_MASK64 = (1 << 64) - 1


def example_seed(seed: int, index: int) -> int:
    """The seed of example ``index`` in a step seeded with ``seed``: an integer in [0, 2^32).

    Before ``dataset[index]`` an eager worker seeds Python's ``random``, NumPy's global
    generator and torch's CPU generator with it, so the transforms' random draws depend on
    the example and the step only, not on which worker took the example. The formula
    (splitmix64's finaliser over a combination of both, top 32 bits)::

        z = (seed * 0x9E3779B97F4A7C15 + index + 1) mod 2^64
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) mod 2^64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) mod 2^64
        return (z ^ (z >> 31)) >> 32

    To reproduce an example in one process::

        s = shmgrad.example_seed(step_seed, i)
        random.seed(s); numpy.random.seed(s); torch.manual_seed(s)
        x, y = dataset[i]
    """
    z = (int(seed) * 0x9E3779B97F4A7C15 + int(index) + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 32


def step_seed(engine_seed: int, step: int) -> int:
    """The seed of the engine's ``step``-th gradient call when the call gives none."""
    return example_seed(engine_seed, (1 << 40) + step)


def seed_everything(seed: int):
    """Seeds the three generators an example's transforms may draw from: Python's
    ``random``, NumPy's global generator and torch's CPU generator. The last is
    ``torch.default_generator.manual_seed``, which gives the CPU the same stream as
    ``torch.manual_seed`` without the latter's other devices' bookkeeping (most of what
    ``torch.manual_seed`` costs per example)."""
    random.seed(seed)
    if numpy is not None:
        numpy.random.seed(seed)
    torch.default_generator.manual_seed(seed)


def example_batch(dataset, indices, seed: int, collate_fn=None):
    """The batch an eager worker builds for ``indices`` of a step seeded with ``seed``:
    each ``dataset[i]`` drawn after :func:`seed_everything` ``(example_seed(seed, i))``,
    then ``collate_fn`` (default ``torch.utils.data.default_collate``). Use it to
    reproduce a step's batch in one process."""
    if collate_fn is None:
        from torch.utils.data import default_collate

        collate_fn = default_collate
    samples = []
    for i in indices:
        seed_everything(example_seed(seed, int(i)))
        samples.append(dataset[int(i)])
    return collate_fn(samples)
