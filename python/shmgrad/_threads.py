"""The trainer process's intra-op threads while it holds a CPU engine (``trainer_threads=``).

PyTorch's intra-op pool (libgomp in the pip wheels) keeps its threads spinning for
milliseconds after every parallel region (GOMP_SPINCOUNT's default: 300,000 pauses, about
3 ms on this project's Intel guest). In one process that costs nothing, since nothing else
wants the cores. With an engine it does: the trainer's ``optimizer.step()`` is a parallel
region, and for milliseconds afterwards its threads spin on the cores the workers are
computing the next gradient on (measured: one worker of 2 threads, MLP batch 32, a loop
with SGD, 7.6 ms a step against 0.77 ms with the trainer on one thread; docs/BENCHMARKS.md).
The spin is read from the environment when the library loads, before shmgrad is imported,
so the trainer's pool is made as small as the cores the workers leave free instead: the
trainer's own work between steps (the optimizer, logging) then runs on one thread, or on
the free cores.

Several clients in one process: the smallest count asked for holds; the count the process
had before the first is restored when the last closes, unless the caller has changed it
meanwhile.
"""

import logging
import threading
from typing import Optional, Union

import torch

from . import errors

# Reentrant: a client's __del__ (close) may run from the garbage collector inside hold().
_lock = threading.RLock()
_held = {}  # client key -> the thread count it holds
_before = None  # the process's count before the first holder
_set = None  # the count set last


def choose(
    requested: Union[int, str, None], status: dict, cores: int, in_trainer: bool = False
) -> Optional[int]:
    """The trainer's intra-op threads for ``trainer_threads=requested`` on the engine whose
    ``_C.status`` is ``status``, on a machine of ``cores`` physical cores; None: leave the
    process's setting alone. ``"auto"``: a CPU engine's free cores (those its workers'
    threads leave, at least 1), never more than the process had before shmgrad held it;
    with ``in_trainer`` (the trainer computes the steps itself, python/shmgrad/_in_trainer.py)
    all of those; None for an engine with GPUs."""
    if requested is None:
        return None
    if requested == "auto":
        if status.get("devices"):
            return None
        if in_trainer:
            return ceiling()
        workers = max(1, int(status["target_workers"]))
        used = workers * max(1, int(status["threads_per_worker"]))
        return max(1, min(ceiling(), cores - used))
    if isinstance(requested, bool) or not isinstance(requested, int) or requested < 1:
        raise errors.InvalidArgumentError(
            f'trainer_threads must be "auto", None (leave them) or an int >= 1, got {requested!r}'
        )
    return requested


def ceiling() -> int:
    """The most threads "auto" gives: the process's count before the first hold (now, if
    nothing holds it)."""
    with _lock:
        return _before if _held and _before is not None else torch.get_num_threads()


def check(requested):
    """Refuses a bad ``trainer_threads`` before anything starts."""
    if requested not in (None, "auto"):
        choose(requested, {}, 1)


def hold(key, threads: Optional[int], name: str, quiet: bool = False):
    """While ``key`` is held, this process computes on at most ``threads`` intra-op threads
    (held again: the new count replaces the old). A change is logged (``quiet``: at the
    debug level)."""
    global _before, _set
    if threads is None:
        return
    with _lock:
        current = torch.get_num_threads()
        if not _held:
            _before = current
        _held[key] = threads
        target = min(_held.values())
        if target != current:
            torch.set_num_threads(target)
            log = logging.getLogger("shmgrad")
            (log.debug if quiet else log.info)(
                "engine %r: this trainer's intra-op threads %d -> %d while it is attached, %s "
                "(trainer_threads= to choose)",
                name,
                current,
                target,
                "so that they do not spin on the workers' cores"
                if target < current
                else "as it computes the steps itself",
            )
        _set = target


def rehold(key, threads: Optional[int], name: str):
    """``key``'s count becomes ``threads`` (the placement changed: logged at the debug
    level, as the probe's visits change it, and its report says what it chose), unless the
    caller has set its own count since shmgrad last did, which stands."""
    if threads is None:
        return
    with _lock:
        if key not in _held:
            return
        if torch.get_num_threads() != _set:
            _held[key] = threads
            return
        hold(key, threads, name, quiet=True)


def release(key):
    global _before, _set
    with _lock:
        if _held.pop(key, None) is None:
            return
        current = torch.get_num_threads()
        if current != _set:  # the caller set its own count meanwhile: keep it
            if not _held:
                _before = _set = None
            return
        target = min(_held.values()) if _held else _before
        if target is not None and target != current:
            torch.set_num_threads(target)
        _set = target if _held else None
        if not _held:
            _before = None


def held(key) -> Optional[int]:
    with _lock:
        return _held.get(key)
