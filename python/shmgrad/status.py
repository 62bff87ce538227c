"""A running engine's state as data: what ``shmgrad status NAME`` prints, field by field.

Read from the engine's shared-memory segment alone, so it works for any engine of this
user, also while another trainer holds it (and from a thread while this process's own
:meth:`Client.gradient` runs).
"""

import dataclasses
from typing import List, Optional

from ._native import _C


@dataclasses.dataclass(frozen=True)
class WorkerStatus:
    """One worker slot."""

    slot: int
    pid: int              # 0: no process in the slot
    state: str            # "starting", "ready", "dead", "exited" or "retired"
    restarts: int         # replacements of this slot's process
    busy_epoch: int       # the step it is working on now, 0 when idle
    assigned_epoch: int   # the last step it was picked for


@dataclasses.dataclass(frozen=True)
class StepSummary:
    """One finished step, from the engine's ring of recent steps."""

    epoch: int
    workers: int
    examples: int
    loss_sum: float
    wall_seconds: float      # the step published to the end of its reduction
    compute_seconds: float   # the slowest worker's forward and backward
    reduce_seconds: float    # the slowest worker's slice of the reduction
    wait_seconds: float      # wall - compute - reduce: synchronisation


@dataclasses.dataclass(frozen=True)
class EngineStatus:
    """An engine's state, as :meth:`Client.status` and :func:`read_status` return it.

    ``text`` is what ``shmgrad status NAME`` prints; it is read a moment after the other
    fields, so a busy engine's text may show a later step than they do.
    """

    name: str
    state: str                 # "starting", "serving", "stopping" or "failed"
    coordinator_pid: int
    coordinator_alive: bool
    segment_path: str
    segment_bytes: int
    model_path: str
    loss: str                  # TorchScript workers' loss (eager workers run the job's own)
    worker_kind: str           # "script" (TorchScript, C++) or "eager" (Python)
    job_path: str              # eager: the pickled job the workers load
    num_params: int            # parameter tensors
    param_floats: int          # floats the parameters take, padding for alignment included
    dataset: str               # "" without one
    dataset_size: int
    max_batch: int
    threads_per_worker: int
    trainer_pid: int           # the trainer that holds the engine, 0 when none does
    step_epoch: int            # the last step published
    steps_served: int
    steps_aborted: int         # steps abandoned because a worker died, then re-run
    step_retries: int
    worker_restarts: int
    target_workers: int        # the worker count asked for (``resize``)
    slots: int                 # gradient slots: the most workers there can be
    workers: List[WorkerStatus]       # every slot that has had a process
    recent_steps: List[StepSummary]   # oldest first
    text: str
    # Why the workers are of this kind, as the process that started the engine chose it
    # (Engine.mode_reason); "" when read by a process that did not start it.
    mode_reason: str = ""

    @property
    def ready_workers(self) -> List[WorkerStatus]:
        """The workers in state ``ready``, by slot."""
        return [w for w in self.workers if w.state == "ready"]

    def worker(self, slot: int) -> Optional[WorkerStatus]:
        """Slot ``slot``'s status, or None if it has never had a process."""
        return next((w for w in self.workers if w.slot == slot), None)

    @classmethod
    def from_native(cls, d: dict, text: str) -> "EngineStatus":
        """Builds one from ``_C.status(name)``'s dict and ``_C.format_status(name)``."""
        plain = {f.name: d[f.name] for f in dataclasses.fields(cls)
                 if f.name not in ("workers", "recent_steps", "text", "mode_reason")}
        return cls(**plain, text=text,
                   workers=[_pick(WorkerStatus, w) for w in d["workers"]],
                   recent_steps=[_pick(StepSummary, s) for s in d["recent_steps"]])


def _pick(cls, d):
    return cls(**{f.name: d[f.name] for f in dataclasses.fields(cls)})


def read_status(name: str) -> EngineStatus:
    """The status of the engine ``name`` (without attaching to it).

    Raises EngineNotFoundError if there is none.
    """
    return EngineStatus.from_native(_C.status(name), _C.format_status(name))
