"""The in-trainer placement: the trainer process computes a step itself.

Where splitting a small batch over processes cannot beat one process's threads (GEMM-bound
steps of a few hundred microseconds), handing the step to a worker still costs a wake-up,
cold caches and, on a 2-core machine, a trainer whose idle threads must stay off the
worker's cores. An engine served with ``workers="auto"`` on the host has one more
gradient slot, the trainer's (ipc::trainerSlot). The client loads the engine's model into
its own process once (a model of its own, as a worker has: its parameters views of the
shared ones, its ``.grad`` views of the reduced gradient or of that slot), and hands the
native trainer a step that runs the worker's compute under the same step protocol
(worker::StepParticipant::runStep): the same checks, scales, passes, accumulation,
non-finite detection, unused parameters and buffers as a worker's step, with no process
woken and nothing reduced. Eager engines run the job through the eager worker's
:class:`~shmgrad._eager_worker.ShardRunner`; TorchScript engines load the model file into
a C++ replica with the TorchScript worker's compute (worker::ScriptInTrainer), so that
their step calls no Python. The placement probe then times it beside the worker
placements (engine/placement.h) and keeps it only where it is fastest.

The user's own module is never touched: the step runs on the job's (or the file's) copy.
"""

import logging

from ._native import _C, tunable_value

_log = logging.getLogger("shmgrad")


class InTrainer:
    """The trainer slot's participant and its compute (None for a TorchScript engine, whose
    participant computes in C++), kept for as long as the trainer."""

    def __init__(self, participant, runner):
        self.participant = participant
        self.runner = runner

    def close(self):
        """After the trainer closed (it calls into the participant): an eager participant
        lets go of the runner's functions, which hold the model, whose linear layers hold
        the participant, a cycle through C++ the collector cannot see (the segment would
        stay mapped until the process exits)."""
        if self.runner is not None:
            self.participant.release_in_trainer()
        self.runner = None


def prepare(name: str, trainer):
    """An :class:`InTrainer` given to ``trainer`` (a native ``_C.Trainer`` holding the
    lease of engine ``name``), or None where this engine or job cannot compute here (no
    trainer slot, ``SHMGRAD_IN_TRAINER=0``, a torch.compile'd job) or its job (its
    TorchScript model) does not load in this process (logged; the workers compute as
    before)."""
    if not trainer.has_trainer_slot() or tunable_value("SHMGRAD_IN_TRAINER") == "0":
        return None
    if trainer.worker_kind() == "script":
        try:
            script = _C.ScriptInTrainer(name, trainer.coordinator_pid())
        except Exception as exc:  # the model does not load here
            return _workers_only(name, "model", exc)
        trainer.set_in_trainer(script)
        return InTrainer(script, None)
    from ._eager_worker import ShardRunner, describe
    from ._job import load_job

    try:
        participant = _C.StepParticipant(name, trainer.slot_count(), trainer.coordinator_pid())
        job = load_job(participant.job_path)
        if job.compile is not None:
            return None  # compiling again here would cost the probe seconds
        runner = ShardRunner(participant, job)
        participant.prepare_in_trainer(
            runner.begin, runner.compute_pass, runner.publish_buffers, runner.unreached
        )
    except Exception as exc:  # any failure of the job to load here
        return _workers_only(name, "job", describe(exc))
    trainer.set_in_trainer(participant)
    return InTrainer(participant, runner)


def _workers_only(name, what, why):
    """None, logged: this trainer cannot compute the engine's steps, its workers do."""
    _log.warning(
        "engine %r: this trainer cannot run the engine's %s itself (%s); its workers compute "
        "every step",
        name,
        what,
        why,
    )
    return None
