"""The stress run: one engine, many checked steps, faults injected between and during them.

A step goes through named phases: maybe restart the trainer (a child trainer killed
while its step is in flight, then this process attaches again), maybe shrink the engine
and grow it back at once, draw a batch, maybe arm a worker kill or a worker stop, run the
step and check its gradient against plain PyTorch, then an SGD step so the parameters
move. A stopped worker (SIGSTOP: a hung process) makes its step end in a timeout, after
which the same batch again must give the exact gradient, and the stopped worker must be
gone (the engine replaces a worker held up by an abandoned step); a stopped worker that
the step did not need is resumed (SIGCONT) after it. What the
engine computes (model, loss, dataset, kind of worker) is the run's workload
(:mod:`.workloads`): one run per kind of worker, with the same faults and checks.
"""

import copy
import dataclasses
import glob
import itertools
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import types
import time

import torch

from shmgrad import attach, errors, read_status
from shmgrad.testing import physical_cores, tunable
from shmgrad.testing import relative_error
from .soak import cpu_probe, shm_files
from .workloads import CLASSES, DATASET_SIZE, INPUT_SHAPE

CHILD_BATCH = 2000  # the child trainer's batch: long enough to be killed mid-step
MAX_GRADIENT_ERROR = 1e-4  # relative to the reference gradient
KILL_DELAY_MAX_S = 0.05  # a worker kill (or stop) lands this long after the step starts, at most
CHILD_KILL_DELAY_MAX_S = 0.05  # after the child's step is seen in flight
POLL_S = 0.005
ATTACH_TIMEOUT_S = 30.0
REAP_GRACE_S = 0.2  # after stopping the engine, before counting leftovers
PROGRESS_EVERY = 25  # steps between progress lines


CHILD_TRAINER = f"""
import sys, torch, shmgrad
e = shmgrad.attach(sys.argv[1], timeout={ATTACH_TIMEOUT_S})
print("attached", flush=True)
x = torch.randn({CHILD_BATCH}, *{INPUT_SHAPE})
y = torch.randint(0, {CLASSES}, ({CHILD_BATCH},))
while True:
    e.gradient(inputs=x, targets=y)
"""


def arm_signal(rng, counts, pids, sig):
    """A started timer that sends ``sig`` (SIGKILL or SIGSTOP) to one of ``pids``, drawn
    by ``rng``, at a random moment of the step, counting it in ``counts`` if the process
    was still there; its ``victim`` is that pid."""
    victim = rng.choice(pids)

    def send():
        try:
            os.kill(victim, sig)
        except ProcessLookupError:
            return
        if sig == signal.SIGKILL:
            counts.kills += 1
        else:
            counts.stops += 1

    timer = threading.Timer(rng.uniform(0.0, KILL_DELAY_MAX_S), send)
    timer.victim = victim
    timer.start()
    return timer


@dataclasses.dataclass
class Counts:
    """What a run did and found; ``--json`` writes it as is."""

    steps: int = 0
    kills: int = 0  # workers SIGKILLed
    recoveries: int = 0  # step retries the trainer saw
    wrong: int = 0  # wrong gradients (or corrupt step bookkeeping)
    hangs: int = 0  # steps that ran past --step-timeout
    errors: int = 0  # WorkerErrors after repeated deaths: allowed
    trainer_restarts: int = 0
    resizes: int = 0  # shrink-and-grow-back pairs
    structured_steps: int = 0  # eager: explicit batches given as gradient(batch=(x, y))
    accumulated_steps: int = 0  # eager: a batch given as two accumulated micro-batches
    scaled_steps: int = 0  # steps with a loss scale (2^10), unscaled before the check
    in_trainer_steps: int = 0  # steps the trainer computed itself (--workers auto, on the host)
    stops: int = 0  # workers SIGSTOPped
    stop_timeouts: int = 0  # steps with a stopped worker that ended in a timeout, then re-run
    stops_resumed: int = 0  # stopped workers not needed by their batch twice, resumed
    not_replaced: int = 0  # stopped workers still there after their step timed out
    worker_replacements: int = 0  # the engine's worker_restarts over the run
    steps_aborted: int = 0  # the engine's steps_aborted over the run
    leaked_segments: int = 0
    leftover_workers: int = 0  # worker processes still alive after the engine stopped
    elapsed_s: float = 0.0
    soak_findings: int = 0  # --duration: what grew beyond its bound (soak.check_growth)

    @property
    def ok(self) -> bool:
        return (
            self.wrong,
            self.hangs,
            self.not_replaced,
            self.leaked_segments,
            self.leftover_workers,
            self.soak_findings,
        ) == (0, 0, 0, 0, 0, 0)


def _reference(model, loss, x, y, mean):
    """The gradient of ``loss`` (summed over the batch) or of its mean, in this process,
    on the CPU (the engine's model may be on a GPU)."""
    m = copy.deepcopy(model).cpu()
    for p in m.parameters():
        p.grad = None
    total = loss(m(x), y)
    (total / len(y) if mean else total).backward()
    return [p.grad for p in m.parameters()]


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2 :].split()[0] != "Z"


def _print(msg, error=False):
    print(msg, file=sys.stderr if error else sys.stdout, flush=True)


class StressRun:
    """One engine named ``name`` computing ``workload`` (a :mod:`.workloads` class's
    instance), stressed for ``args.steps`` steps, or until ``deadline`` (a
    ``time.monotonic()`` value: the soak mode) with ``sampler`` (a
    :class:`.soak.Sampler`) sampling the run's processes between steps."""

    def __init__(self, args, workload, name, log=_print, deadline=None, sampler=None):
        self.args = args
        self.deadline = deadline
        self.sampler = sampler
        self.shm_after = 0  # the engine's files left in /dev/shm after it stopped
        self.name = name
        self.workload = workload
        self.log = log
        self.rng = random.Random(args.seed)
        # Which steps scale their loss: a stream of its own, so that a seed's faults stay
        # where they were.
        self.scale_rng = random.Random(args.seed + 1)
        self.counts = Counts()
        # --workers auto: one worker per core (resizes then fix the placement).
        self.worker_count = physical_cores() if args.workers == "auto" else args.workers
        self.worker_pids_seen = set()
        self.model = workload.model
        self.trainer = None
        self.opt = None
        self.worker_slots = 0  # the engine's worker slots (its status)

    # -- the run ------------------------------------------------------------------------
    def run(self) -> Counts:
        t_start = time.monotonic()
        with tempfile.TemporaryDirectory(prefix="shmgrad-stress-") as tmp:
            server = None
            try:
                server = self.workload.serve(
                    self.name,
                    self.args.workers,
                    max(self.args.max_batch, CHILD_BATCH),
                    tmp,
                    devices=getattr(self.args, "devices", None),
                )
                self._attach()
                before = read_status(self.name)
                self.worker_slots = before.slots
                if self.sampler is not None:
                    self.sampler.start_run()
                steps = range(self.args.steps) if self.deadline is None else itertools.count()
                for step in steps:
                    if self.deadline is not None and time.monotonic() >= self.deadline:
                        break
                    self._step(step)
                    if self.sampler is not None:
                        self.sampler.maybe_probe(cpu_probe)
                        self._maybe_sample()
                after = read_status(self.name)
                self.counts.worker_replacements = after.worker_restarts - before.worker_restarts
                self.counts.steps_aborted = after.steps_aborted - before.steps_aborted
            finally:
                if self.trainer is not None:
                    self.trainer.close()
                if server is not None:
                    server.stop()
        time.sleep(REAP_GRACE_S)
        self.shm_after = shm_files(self.name)[0]
        self.counts.leaked_segments = len(glob.glob(f"/dev/shm/shmgrad-{os.getuid()}-{self.name}"))
        self.counts.leftover_workers = sum(1 for pid in self.worker_pids_seen if _alive(pid))
        self.counts.elapsed_s = time.monotonic() - t_start
        return self.counts

    def _attach(self):
        self.trainer = attach(self.name, timeout=ATTACH_TIMEOUT_S)
        self.trainer.bind(self.model)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.01)

    def _step(self, step):
        a = self.args
        if self.rng.random() < a.trainer_restart_rate:
            self._restart_trainer()
        if self.worker_count > 1 and self.rng.random() < a.resize_rate:
            self._shrink_and_grow()
        x, y, mean, call = self._draw_batch()
        ref = _reference(self.model, self.workload.loss, x, y, mean)
        if self.rng.random() < getattr(a, "stop_rate", 0.0):
            self._stopped_step(step, call, ref)
        else:
            killer = self._arm(signal.SIGKILL) if self.rng.random() < a.kill_rate else None
            try:
                self._checked_step(step, call, ref)
            finally:
                if killer is not None:
                    killer.join()
        self.counts.steps += 1
        if self.deadline is None and (step + 1) % PROGRESS_EVERY == 0:
            c = self.counts
            self.log(
                f"  {self.workload.kind} step {step + 1}/{a.steps}: kills {c.kills}, "
                f"retries {c.recoveries}, wrong {c.wrong}"
            )

    def _maybe_sample(self):
        if self.sampler.due():
            self.sampler.sample(
                self.workload.kind,
                self.name,
                read_status(self.name),
                self.counts.steps,
                probe=cpu_probe,
            )
            s, c = self.sampler.samples[-1], self.counts
            med = "-" if s.step_median_s is None else f"{s.step_median_s * 1e3:.0f} ms"
            med += f" (probe {s.probe_s * 1e3:.0f} ms, load {s.load1})"
            rss = ", ".join(f"{r} {p['rss_kib'] // 1024}" for r, p in sorted(s.procs.items()))
            self.log(
                f"  {self.workload.kind} {s.t:.0f} s: steps {c.steps}, kills {c.kills}, "
                f"stops {c.stops}, wrong {c.wrong}, hangs {c.hangs}; median step {med}; "
                f"RSS MiB: {rss}"
            )

    # -- the phases ---------------------------------------------------------------------
    def _restart_trainer(self):
        """Hands the engine to a child trainer, kills the child while its step is in
        flight (seen in the status), and attaches again."""
        last_epoch = self.trainer.status().step_epoch
        self.trainer.close()
        self.trainer = None
        child = subprocess.Popen(
            [sys.executable, "-c", CHILD_TRAINER, self.name], stdout=subprocess.PIPE, text=True
        )
        try:
            line = child.stdout.readline().strip()
            if line != "attached":
                raise RuntimeError(f"child trainer failed to attach (exit {child.wait()})")
            try:
                self._wait_for_busy_worker(trainer_pid=child.pid, after_epoch=last_epoch)
            except errors.EngineTimeoutError as exc:
                self.counts.hangs += 1
                self.log(f"  trainer restart: HANG: {exc}", error=True)
            time.sleep(self.rng.uniform(0.0, CHILD_KILL_DELAY_MAX_S))
        finally:
            child.kill()
            child.wait()
            child.stdout.close()
        self._attach()
        self.counts.trainer_restarts += 1

    def _wait_for_busy_worker(self, trainer_pid, after_epoch):
        """Polls the status until a worker works on a step of ``trainer_pid``'s (one
        after ``after_epoch``: a worker marks itself idle only just after a step)."""
        deadline = time.monotonic() + self.args.step_timeout
        while True:
            st = read_status(self.name)
            if st.trainer_pid == trainer_pid and any(
                w.busy_epoch > after_epoch for w in st.ready_workers
            ):
                return
            if time.monotonic() > deadline:
                raise errors.EngineTimeoutError(
                    f"no worker was seen busy with child trainer {trainer_pid}'s step within "
                    f"{self.args.step_timeout:g} s"
                )
            time.sleep(POLL_S)

    def _shrink_and_grow(self):
        """Shrinks to a random size, then grows back before the retired workers have had
        time to exit."""
        self._remember_workers()
        self.trainer.resize(
            self.rng.randint(1, self.worker_count - 1), timeout=self.args.step_timeout
        )
        self.trainer.resize(self.worker_count, timeout=self.args.step_timeout)
        self.counts.resizes += 1

    def _draw_batch(self):
        """A random batch, by index half of the time, explicit otherwise; returns its
        inputs, targets, reduction and the call that computes its gradient (given a
        timeout). An indexed
        step gets an explicit seed, with which the workload rebuilds what the workers
        compute on. A quarter of the steps scale the loss by 2^10 (as a GradScaler would)
        and divide the gradient by it after the call (as its unscale_ does)."""
        scale = 2.0**10 if self.scale_rng.random() < 0.25 else 1.0
        x, y, mean, call = self._draw_unscaled_batch(scale)
        if scale == 1.0:
            return x, y, mean, call
        self.counts.scaled_steps += 1

        def scaled(timeout):
            stats = call(timeout)
            for p in self.model.parameters():
                if p.grad is not None:
                    p.grad.div_(scale)
            return stats

        return x, y, mean, scaled

    def _draw_unscaled_batch(self, loss_scale):
        batch = self.rng.randint(1, self.args.max_batch)
        mean = self.rng.random() < 0.5
        reduction = "mean" if mean else "sum"
        if self.rng.random() < 0.5:
            idx = torch.tensor([self.rng.randrange(DATASET_SIZE) for _ in range(batch)])
            seed = self.rng.randrange(2**32)
            x, y = self.workload.indexed_batch(idx, seed)
            return (
                x,
                y,
                mean,
                lambda timeout: self.trainer.gradient(
                    idx, reduction=reduction, timeout=timeout, loss_scale=loss_scale, seed=seed
                ),
            )
        x, y = torch.randn(batch, *INPUT_SHAPE), torch.randint(0, CLASSES, (batch,))
        # Eager workers also take the batch as a structure, or in two accumulated
        # micro-batches (the second added to the first, once however often it is retried).
        form = self.rng.choice(("explicit", "structured", "accumulated"))
        if self.workload.kind == "eager" and form == "structured":
            self.counts.structured_steps += 1
            return (
                x,
                y,
                mean,
                lambda timeout: self.trainer.gradient(
                    batch=(x, y), reduction=reduction, timeout=timeout, loss_scale=loss_scale
                ),
            )
        if self.workload.kind == "eager" and form == "accumulated" and batch >= 2:
            self.counts.accumulated_steps += 1
            cut = self.rng.randint(1, batch - 1)

            def accumulated(timeout):
                first = self.trainer.gradient(
                    inputs=x[:cut],
                    targets=y[:cut],
                    reduction=reduction,
                    timeout=timeout,
                    loss_scale=loss_scale,
                )
                second = self.trainer.gradient(
                    inputs=x[cut:],
                    targets=y[cut:],
                    reduction=reduction,
                    timeout=timeout,
                    loss_scale=loss_scale,
                    accumulate=True,
                )
                return types.SimpleNamespace(retries=first.retries + second.retries)

            return x, y, mean, accumulated
        return (
            x,
            y,
            mean,
            lambda timeout: self.trainer.gradient(
                inputs=x, targets=y, reduction=reduction, timeout=timeout, loss_scale=loss_scale
            ),
        )

    def _remember_workers(self):
        pids = [w.pid for w in self.trainer.status().ready_workers]
        self.worker_pids_seen.update(pids)
        return pids

    def _arm(self, sig):
        """A timer that sends ``sig`` (SIGKILL or SIGSTOP) to a random ready worker at a
        random moment of the step; its ``victim`` is that worker's pid."""
        # A worker killed a moment ago shows as ready until the coordinator reaps it.
        pids = [pid for pid in self._remember_workers() if _alive(pid)]
        if not pids:
            return None
        return arm_signal(self.rng, self.counts, pids, sig)

    def _stopped_step(self, step, call, ref):
        """A step with a worker stopped at a random moment, under --stop-timeout. If the
        step needed that worker, it times out, and the same batch again (under
        --step-timeout) must give the exact gradient from its replacement, the stopped
        worker gone. If it did not (the worker had done its part, or was idle), the batch
        runs once more with the worker still stopped, which picks it if the batch needs
        every worker, with the same checks; a worker still not needed is resumed. The
        optimizer steps once, after the last call."""
        stopper = self._arm(signal.SIGSTOP)
        try:
            done = self._checked_step(step, call, ref, self.args.stop_timeout, optimize=False)
        finally:
            if stopper is not None:
                stopper.join()
        stopped = stopper is not None and _alive(stopper.victim)
        if stopped and done != "timeout":
            done = self._checked_step(step, call, ref, self.args.stop_timeout, optimize=False)
        timed_out = done == "timeout"
        if timed_out:
            self.counts.stop_timeouts += 1
            done = self._checked_step(step, call, ref, optimize=False)
        if done == "ok":
            self.opt.step()
        if not stopped or not _alive(stopper.victim):
            return
        if timed_out:
            self.counts.not_replaced += 1
            self.log(
                f"  {self.workload.kind} step {step + 1}: worker {stopper.victim}, stopped, is "
                "still there after its step timed out and ran again",
                error=True,
            )
        else:
            self.counts.stops_resumed += 1
        os.kill(stopper.victim, signal.SIGCONT)

    def _checked_step(self, step, call, ref, stop_timeout=None, optimize=True):
        """Runs the step, checks its gradient and (if ``optimize``) steps the optimizer;
        returns "ok", "timeout" or "failed". Under ``stop_timeout`` (a step with a stopped
        worker) a timeout is expected: not counted a hang."""
        try:
            t0 = time.monotonic()
            stats = call(stop_timeout or self.args.step_timeout)
            if self.sampler is not None:
                self.sampler.step_done(time.monotonic() - t0)
            self.counts.recoveries += stats.retries
            # The trainer's own slot comes after the workers' (docs/DESIGN.md, "In the
            # trainer"): a step it computed names it (an accumulated pair says nothing).
            if getattr(stats, "worker_slots", None) == [self.worker_slots]:
                self.counts.in_trainer_steps += 1
            grads = [p.grad.cpu() for p in self.model.parameters()]
            if relative_error(grads, ref) > MAX_GRADIENT_ERROR:
                self.counts.wrong += 1
                self.log(f"  {self.workload.kind} step {step + 1}: WRONG gradient", error=True)
            if optimize:
                self.opt.step()
            return "ok"
        except errors.EngineTimeoutError as exc:
            if stop_timeout is not None:
                return "timeout"
            self.counts.hangs += 1
            self.log(f"  step {step + 1}: HANG: {exc}", error=True)
            if tunable("SHMGRAD_STRESS_DEBUG"):
                self.log(read_status(self.name).text, error=True)
        except errors.WorkerError:
            self.counts.errors += 1  # a clear error after repeated deaths: allowed
        except errors.CorruptSegmentError as exc:
            self.counts.wrong += 1  # the step's bookkeeping is wrong: so may its gradient be
            self.log(f"  {self.workload.kind} step {step + 1}: WRONG: {exc}", error=True)
        return "failed"
