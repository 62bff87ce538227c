"""``shmgrad stress --nodes N``: N engines on this machine (NAME-n0, NAME-n1, ...), one
trainer each in a child process (:mod:`.node_trainer`), grouped through
``torch.distributed`` (:mod:`shmgrad.multinode`), under faults on every node.

This process is the supervisor: it starts the engines, starts the node trainers, forms
their group (a FileStore in a private temporary directory, a new one each time), and
drives every step: it draws one global batch, gives each node its share
(:func:`shmgrad.multinode.shard`), and checks the all-reduced gradient every node
returns against plain PyTorch on the whole batch in this process, at the parameters the
nodes computed at (which must be bit-identical on every node, and equal to what this
process expects after the SGD steps it approved). The faults:

* worker kills (SIGKILL at a random moment of a step) on a random node, sometimes on
  every node at once: the step must still give the exact gradient;
* worker stops (SIGSTOP: a hung worker) under --stop-timeout: the stopped node's step
  times out (EngineTimeoutError), every other node raises NodeError naming it (the
  failing node joined the all-reduce with a failure flag, so the group stays usable);
  the same batch again must give the exact gradient and the stopped worker must be gone;
* a node trainer SIGKILLed while its node's workers compute (--node-kill-rate): every
  surviving node must raise NodeError within the group's timeout (--group-timeout);
  the survivors leave the group, a new trainer replaces the dead one (its engine lives
  on and takes the new trainer), all re-form a new group and run the same batch again.

The group's backend (--backend): gloo, the ``shmgrad`` backend (all nodes on this
machine: its shared-memory path between the trainers), or both, in turn: every
formation switches, and a planned re-form half-way makes sure both run.
"""

import copy
import dataclasses
import glob
import os
import random
import select
import signal
import subprocess
import sys
import tempfile
import time

import torch

from shmgrad import read_status
from shmgrad.multinode import shard
from shmgrad.testing import relative_error, tunable

from . import node_trainer
from .run import MAX_GRADIENT_ERROR, arm_signal, POLL_S, REAP_GRACE_S, _alive, _print
from .workloads import CLASSES, DATASET_SIZE, INPUT_SHAPE

BACKENDS = ("gloo", "shmgrad")
ATTACH_TIMEOUT_S = 30.0
REPLY_MARGIN_S = 15.0  # beyond a request's own bound, before a missing reply is a hang
# A new trainer's imports (torch): not the system under test, so a bound of its own,
# generous for a loaded machine.
STARTUP_TIMEOUT_S = 180.0
LEAVE_TIMEOUT_S = 30.0
EXIT_TIMEOUT_S = 10.0
TRAINER_KILL_DELAY_MAX_S = 0.02  # after a worker of the victim's node is seen busy
# The global batch of a step whose trainer is killed: large enough that the victim's
# workers are still computing its share when the kill lands.
KILL_BATCH = 2000
PROGRESS_EVERY = 25


@dataclasses.dataclass
class NodeCounts:
    """What a --nodes run did and found; ``--json`` writes it as is."""

    nodes: int = 0
    steps: int = 0
    kills: int = 0  # workers SIGKILLed, over all nodes
    kills_on_every_node: int = 0  # steps with a worker killed on every node at once
    recoveries: int = 0  # step retries the node trainers saw
    stops: int = 0
    stop_timeouts: int = 0  # steps a stopped worker timed out, then ran again
    stops_resumed: int = 0
    not_replaced: int = 0  # stopped workers still there after their step timed out
    trainer_kills: int = 0  # node trainers SIGKILLed mid-step
    trainer_kills_late: int = 0  # of those, the ones that landed after the all-reduce
    node_errors: int = 0  # NodeErrors the other nodes raised (trainer kills, stops, errors)
    node_error_max_s: float = 0.0  # the slowest NodeError after a trainer kill
    # backend -> the slowest NodeError after a trainer kill in a group of that backend
    node_error_max_s_by_backend: dict = dataclasses.field(default_factory=dict)
    reforms: int = 0  # groups formed again after a trainer kill
    planned_reforms: int = 0  # groups formed again with no fault (to switch the backend)
    formations: dict = dataclasses.field(default_factory=dict)  # backend -> groups formed
    backend_steps: dict = dataclasses.field(default_factory=dict)  # backend -> checked steps
    errors: int = 0  # WorkerErrors after repeated deaths (the others: NodeError): allowed
    form_failures: int = 0  # formations that raised and were tried again, once (then formed)
    wrong: int = 0  # wrong gradients, or nodes whose parameters differ
    hangs: int = 0  # replies missing past their bound
    unexpected: int = 0  # an outcome no fault explains (an error without a fault, ...)
    leaked_segments: int = 0
    leftover_workers: int = 0
    leftover_trainers: int = 0  # node trainer processes alive after the run
    elapsed_s: float = 0.0

    @property
    def ok(self) -> bool:
        return (
            self.wrong,
            self.hangs,
            self.unexpected,
            self.not_replaced,
            self.leaked_segments,
            self.leftover_workers,
            self.leftover_trainers,
        ) == (0,) * 7


class NodeProc:
    """A node trainer process and its channel: requests in, one reply each, a reply
    awaited under a deadline (select on the pipe: a dead process reads as EOF)."""

    def __init__(self, rank, log_file):
        self.rank = rank
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "shmgrad_tools.stress.node_trainer"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log_file,
            bufsize=0,
        )
        self.pid = self.proc.pid
        self.ready = False  # its first frame (imports done) has been read

    def wait_ready(self):
        """Waits for the trainer's first frame; raises _RunBroken if it does not come."""
        if self.ready:
            return
        try:
            rep = self.reply(STARTUP_TIMEOUT_S)
        except EOFError:
            rep = None
        if rep is None or not rep.get("ready"):
            raise _RunBroken(
                f"a node trainer (pid {self.pid}) did not start within {STARTUP_TIMEOUT_S:g} s"
            )
        self.ready = True

    def send(self, req):
        node_trainer.send(self.proc.stdin, req)

    def reply(self, timeout):
        """The reply, or None if none came within ``timeout`` seconds; EOFError if the
        process is gone."""
        ready, _, _ = select.select([self.proc.stdout], [], [], max(0.0, timeout))
        if not ready:
            return None
        return node_trainer.receive(self.proc.stdout)

    def kill(self):
        self.proc.kill()
        self.proc.wait()

    def close(self):
        """Asks the trainer to leave and exit; kills it if it does not in time."""
        self.ask_exit()
        self.finish_exit()

    def ask_exit(self):
        if self.proc.poll() is None:
            try:
                self.send({"op": "exit"})
            except OSError:
                pass

    def finish_exit(self):
        if self.proc.poll() is None:
            try:
                self.reply(EXIT_TIMEOUT_S)
            except (OSError, EOFError):
                pass
            try:
                self.proc.wait(EXIT_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.kill()
        for f in (self.proc.stdin, self.proc.stdout):
            f.close()


def _close_all(procs):
    """Closes trainers together: each leaves its group while the others do."""
    for p in procs:
        p.ask_exit()
    for p in procs:
        p.finish_exit()


class NodesRun:
    """N engines named ``name``-n<rank> computing ``workload``, one node trainer each,
    stressed for ``args.steps`` steps."""

    def __init__(self, args, workload, name, log=_print):
        self.args = args
        self.name = name
        self.workload = workload
        self.log = log
        self.n = args.nodes
        self.rng = random.Random(args.seed)
        self.scale_rng = random.Random(args.seed + 1)
        self.counts = NodeCounts(nodes=self.n)
        self.model = copy.deepcopy(workload.model)  # the parameters the nodes must have
        self.engines = [f"{name}-n{r}" for r in range(self.n)]
        self.procs = []
        self.spare = None  # a trainer started ahead, to replace a killed one at once
        self.formation = 0
        self.backend = None
        self.worker_pids_seen = set()
        self.trainer_pids_seen = set()
        self.tmp = None
        self.log_file = None

    # -- the run ------------------------------------------------------------------------
    def run(self) -> NodeCounts:
        t_start = time.monotonic()
        servers = []
        with tempfile.TemporaryDirectory(prefix="shmgrad-stress-nodes-") as tmp:
            self.tmp = tmp
            self.log_file = open(os.path.join(tmp, "trainers.log"), "w+b")
            try:
                # The trainers import torch while the engines start.
                self.procs = [self._start_trainer(r) for r in range(self.n)]
                self.spare = self._start_trainer(None)
                max_batch = max(self.args.max_batch, -(-KILL_BATCH // self.n))
                for r, engine in enumerate(self.engines):
                    d = os.path.join(tmp, f"n{r}")
                    os.mkdir(d)
                    servers.append(self.workload.serve(engine, self.args.workers, max_batch, d))
                self._form()
                planned = self.args.steps // 2 if self.args.backend == "both" else None
                for step in range(self.args.steps):
                    if step == planned:
                        self._reform(planned=True)
                    self._step(step)
            except _RunBroken as exc:
                self.log(f"  nodes: the run cannot go on: {exc}", error=True)
                self._print_trainer_log()
            finally:
                _close_all(self.procs + ([self.spare] if self.spare else []))
                for s in servers:
                    s.stop()
                self.log_file.close()
        time.sleep(REAP_GRACE_S)
        c = self.counts
        c.leaked_segments = sum(
            len(glob.glob(f"/dev/shm/shmgrad-{os.getuid()}-{e}")) for e in self.engines
        )
        c.leftover_workers = sum(1 for pid in self.worker_pids_seen if _alive(pid))
        c.leftover_trainers = sum(1 for pid in self.trainer_pids_seen if _alive(pid))
        c.elapsed_s = time.monotonic() - t_start
        return c

    def _start_trainer(self, rank):
        p = NodeProc(rank, self.log_file)
        self.trainer_pids_seen.add(p.pid)
        return p

    def _print_trainer_log(self):
        self.log_file.flush()
        self.log_file.seek(0)
        tail = self.log_file.read().decode(errors="replace")[-4000:]
        self.log(f"  the node trainers' output ends:\n{tail}", error=True)

    # -- forming and re-forming the group ---------------------------------------------
    def _form(self):
        """Every node joins a new group and attaches to its engine with it; a formation
        that fails with an error (not a hang) is tried once more, with a new store, and
        counted (form_failures)."""
        try:
            self._form_once()
        except _FormFailed as exc:
            self.counts.form_failures += 1
            self.log(f"  nodes: {exc}; every node leaves and forms again", error=True)
            self._leave_all()
            try:
                self._form_once()
            except _FormFailed as again:
                self.counts.unexpected += 1
                raise _RunBroken(f"{again} (the second try)") from again

    def _leave_all(self):
        """Every trainer that has been in a group leaves it (a new one has nothing to
        leave)."""
        members = [(r, p) for r, p in enumerate(self.procs) if p.ready]
        for _, p in members:
            p.send({"op": "leave"})
        for r, p in members:
            rep = self._reply(p, LEAVE_TIMEOUT_S)
            if rep is None or not rep["ok"]:
                self.counts.hangs += rep is None
                self.counts.unexpected += rep is not None
                raise _RunBroken(f"rank {r} could not leave its group: {rep}")

    def _form_once(self):
        """Every node joins group number ``self.formation`` (a new FileStore) and attaches
        to its engine with it."""
        backends = BACKENDS if self.args.backend == "both" else (self.args.backend,)
        # The backends take turns by the groups formed (a failed try keeps its backend).
        self.backend = backends[sum(self.counts.formations.values()) % len(backends)]
        store = os.path.join(self.tmp, f"store-{self.formation}")
        state = {k: v.clone() for k, v in self.model.state_dict().items()}
        for p in self.procs:
            p.wait_ready()
        for r, p in enumerate(self.procs):
            p.send(
                {
                    "op": "form",
                    "store": store,
                    "backend": self.backend,
                    "rank": r,
                    "world": self.n,
                    "group_timeout": self.args.group_timeout,
                    "engine": self.engines[r],
                    "kind": self.workload.kind,
                    "state": state,
                    "attach_timeout": ATTACH_TIMEOUT_S,
                }
            )
        replies = self._replies(ATTACH_TIMEOUT_S + self.args.group_timeout)
        bad = [(r, rep) for r, rep in enumerate(replies) if rep is None or not rep["ok"]]
        self.formation += 1
        if any(rep is None for _, rep in bad):
            self.counts.hangs += 1
            raise _RunBroken(
                f"forming group {self.formation - 1} ({self.backend}): no reply from rank(s) "
                f"{[r for r, rep in bad if rep is None]}"
            )
        if bad:
            r, rep = bad[0]
            raise _FormFailed(
                f"forming group {self.formation - 1} ({self.backend}) failed on rank {r}: "
                + rep["message"].splitlines()[0][:300]
            )
        if tunable("SHMGRAD_STRESS_DEBUG"):
            self.log(
                f"  formed group {self.formation - 1} ({self.backend}): rendezvous, attach, "
                f"bind seconds by rank {[r['seconds'] for r in replies]}"
            )
        self.counts.formations[self.backend] = self.counts.formations.get(self.backend, 0) + 1

    def _reform(self, planned=False, dead=()):
        """Trainers replace the ``dead`` ranks, the live ones leave their group, and
        everyone forms the next group."""
        for r in dead:
            self.procs[r].close()
            self.procs[r] = self.spare if self.spare is not None else self._start_trainer(r)
            self.procs[r].rank = r
            self.spare = None
        self._leave_all()
        self._form()
        if self.spare is None:
            self.spare = self._start_trainer(None)
        if planned:
            self.counts.planned_reforms += 1
        else:
            self.counts.reforms += 1

    def _reply(self, p, timeout):
        try:
            return p.reply(timeout)
        except EOFError:
            return {
                "ok": False,
                "error": "EOFError",
                "message": "the trainer is gone",
                "rank": None,
                "seconds": 0.0,
            }

    def _replies(self, timeout):
        """Every trainer's reply to the request just sent, each waited for until one
        shared deadline (None: none came)."""
        deadline = time.monotonic() + timeout
        return [self._reply(p, deadline - time.monotonic()) for p in self.procs]

    # -- a step -------------------------------------------------------------------------
    def _step(self, step):
        a = self.args
        kill_trainer = self.rng.random() < a.node_kill_rate
        stop = not kill_trainer and self.rng.random() < a.stop_rate
        batch = self._draw_batch(full=kill_trainer)
        if kill_trainer:
            self._killed_trainer_step(step, batch)
        elif stop:
            self._stopped_step(step, batch)
        else:
            killers = self._arm_kills() if self.rng.random() < a.kill_rate else []
            try:
                replies = self._run(batch, a.step_timeout)
            finally:
                for k in killers:
                    k.join()
            if self._settle(step, batch, replies) == "broken":
                self._reform(dead=self._dead())
        self.counts.steps += 1
        if (step + 1) % PROGRESS_EVERY == 0:
            c = self.counts
            self.log(
                f"  {self.workload.kind} x{self.n} step {step + 1}/{a.steps}: kills {c.kills}, "
                f"trainer kills {c.trainer_kills}, re-forms {c.reforms}, wrong {c.wrong}"
            )

    def _draw_batch(self, full=False):
        """A global batch: by index half of the time (with a step seed for eager
        workers), explicit otherwise; a quarter with a loss scale. Returns a dict with
        the whole batch (x, y) for the reference and each node's ``call``."""
        scale = 2.0**10 if self.scale_rng.random() < 0.25 else 1.0
        size = KILL_BATCH if full else self.rng.randint(1, self.args.max_batch)
        mean = self.rng.random() < 0.5
        reduction = "mean" if mean else "sum"
        calls = []
        if self.rng.random() < 0.5:
            idx = torch.tensor([self.rng.randrange(DATASET_SIZE) for _ in range(size)])
            seed = self.rng.randrange(2**32)
            x, y = self.workload.indexed_batch(idx, seed)
            for r in range(self.n):
                calls.append(dict(indices=shard(idx, r, self.n), seed=seed))
        else:
            x, y = torch.randn(size, *INPUT_SHAPE), torch.randint(0, CLASSES, (size,))
            for r in range(self.n):
                calls.append(dict(inputs=shard(x, r, self.n), targets=shard(y, r, self.n)))
        for c in calls:
            c.update(reduction=reduction, loss_scale=scale)
        return dict(x=x, y=y, mean=mean, calls=calls, size=size)

    def _run(self, batch, timeout):
        """Sends the step to every node; their replies (None: a hang)."""
        for p, call in zip(self.procs, batch["calls"]):
            p.send({"op": "step", "call": call, "timeout": timeout})
        return self._replies(timeout + self.args.group_timeout + REPLY_MARGIN_S)

    def _settle(self, step, batch, replies, expect_failure_on=None):
        """Checks a step's replies. Every node succeeded: the gradients against the
        reference, then every node applies it. One node raised its own error and the
        others NodeError naming it: allowed (a WorkerError after repeated deaths), or
        expected (``expect_failure_on``: a stopped worker's node timed out). Returns
        "ok", "failed" or "broken" (the group must be re-formed)."""
        if any(r is None for r in replies):
            self.counts.hangs += 1
            self.log(
                f"  step {step + 1}: HANG: no reply from rank(s) "
                f"{[i for i, r in enumerate(replies) if r is None]}",
                error=True,
            )
            return "broken"
        if all(r["ok"] for r in replies):
            self._check(step, batch, replies)
            return "ok"
        failed = [i for i, r in enumerate(replies) if not r["ok"] and r["error"] != "NodeError"]
        others = [i for i in range(self.n) if i not in failed]
        if len(failed) == 1 and all(
            replies[i]["error"] == "NodeError" and replies[i]["rank"] == failed[0] for i in others
        ):
            self.counts.node_errors += len(others)
            err = replies[failed[0]]["error"]
            if err == "EngineTimeoutError" and expect_failure_on == failed[0]:
                return "timeout"
            if err == "WorkerError":
                self.counts.errors += 1
                return "failed"
        self.counts.unexpected += 1
        self.log(
            f"  step {step + 1}: UNEXPECTED: "
            + "; ".join(
                f"rank {i}: {r['error']}: {r['message'][:300]}"
                for i, r in enumerate(replies)
                if not r["ok"]
            ),
            error=True,
        )
        return "broken"

    def _check(self, step, batch, replies):
        c = self.counts
        c.recoveries += sum(r["retries"] for r in replies)
        c.backend_steps[self.backend] = c.backend_steps.get(self.backend, 0) + 1
        expected = [p.detach() for p in self.model.parameters()]
        for r, rep in enumerate(replies):
            if any(not torch.equal(a, b) for a, b in zip(rep["params"], expected)):
                c.wrong += 1
                self.log(
                    f"  step {step + 1}: WRONG: rank {r}'s parameters differ from the "
                    "ones every node should have",
                    error=True,
                )
        ref = _reference(self.model, self.workload.loss, batch["x"], batch["y"], batch["mean"])
        for r, rep in enumerate(replies):
            if rep["num_examples"] != batch["size"]:
                c.wrong += 1
                self.log(
                    f"  step {step + 1}: WRONG: rank {r} counted "
                    f"{rep['num_examples']} examples of {batch['size']}",
                    error=True,
                )
            grads = [
                torch.zeros_like(p) if g is None else g for g, p in zip(rep["grads"], expected)
            ]
            if relative_error(grads, ref) > MAX_GRADIENT_ERROR:
                c.wrong += 1
                self.log(
                    f"  step {step + 1}: WRONG gradient on rank {r} ({self.backend})", error=True
                )
        for p in self.procs:
            p.send({"op": "apply"})
        applied = self._replies(self.args.step_timeout)
        if any(a is None or not a["ok"] for a in applied):
            self.counts.unexpected += 1
            raise _RunBroken(f"apply failed: {applied}")
        # The same SGD step here, on node 0's gradient (every node's is the same).
        with torch.no_grad():
            for p, g in zip(self.model.parameters(), replies[0]["grads"]):
                if g is not None:
                    p.add_(g, alpha=-node_trainer.NodeTrainer.LR)

    # -- faults -------------------------------------------------------------------------
    def _ready_workers(self, rank):
        pids = [w.pid for w in read_status(self.engines[rank]).ready_workers]
        self.worker_pids_seen.update(pids)
        return [pid for pid in pids if _alive(pid)]

    def _arm(self, rank, sig):
        """A timer that sends ``sig`` to a random ready worker of node ``rank`` at a
        random moment of the step (None if it has none ready)."""
        pids = self._ready_workers(rank)
        if not pids:
            return None
        return arm_signal(self.rng, self.counts, pids, sig)

    def _arm_kills(self):
        """Worker kills on one random node, or (a quarter of the time) on every node."""
        every = self.rng.random() < 0.25
        ranks = range(self.n) if every else [self.rng.randrange(self.n)]
        timers = [t for t in (self._arm(r, signal.SIGKILL) for r in ranks) if t is not None]
        if every and len(timers) == self.n:
            self.counts.kills_on_every_node += 1
        return timers

    def _stopped_step(self, step, batch):
        """A worker of a random node stopped at a random moment under --stop-timeout. If
        its node needed it, that node times out and the others raise NodeError naming it;
        the same batch again (under --step-timeout) must be exact, and the stopped
        worker gone. If not, the worker is resumed after the step."""
        rank = self.rng.randrange(self.n)
        stopper = self._arm(rank, signal.SIGSTOP)
        try:
            replies = self._run(batch, self.args.stop_timeout)
        finally:
            if stopper is not None:
                stopper.join()
        done = self._settle(step, batch, replies, expect_failure_on=rank)
        timed_out = done == "timeout"
        if timed_out:
            self.counts.stop_timeouts += 1
            done = self._settle(step, batch, self._run(batch, self.args.step_timeout))
        if done == "broken":
            self._reform(dead=self._dead())
        if stopper is None or not _alive(stopper.victim):
            return
        if timed_out:
            self.counts.not_replaced += 1
            self.log(
                f"  step {step + 1}: worker {stopper.victim} of rank {rank}, stopped, "
                "is still there after its step timed out and ran again",
                error=True,
            )
        else:
            self.counts.stops_resumed += 1
        os.kill(stopper.victim, signal.SIGCONT)

    def _killed_trainer_step(self, step, batch):
        """Kills a random node's trainer while its node's workers compute its share of a
        full batch; every other node must raise NodeError within the group's timeout.
        Then a new trainer, a new group, and the same batch again."""
        victim = self.rng.randrange(self.n)
        p = self.procs[victim]
        epoch = read_status(self.engines[victim]).step_epoch
        for q, call in zip(self.procs, batch["calls"]):
            q.send({"op": "step", "call": call, "timeout": self.args.step_timeout})
        self._wait_for_busy_worker(victim, p.pid, epoch)
        time.sleep(self.rng.uniform(0.0, TRAINER_KILL_DELAY_MAX_S))
        p.kill()
        killed_at = time.monotonic()
        self.counts.trainer_kills += 1
        late = []
        for r, q in enumerate(self.procs):
            if r == victim:
                continue
            rep = self._reply(q, self.args.group_timeout + REPLY_MARGIN_S)
            seconds = time.monotonic() - killed_at
            if rep is None:
                self.counts.hangs += 1
                self.log(
                    f"  step {step + 1}: HANG: rank {r} raised nothing "
                    f"{self.args.group_timeout + REPLY_MARGIN_S:g} s after rank "
                    f"{victim}'s trainer was killed",
                    error=True,
                )
                raise _RunBroken("a survivor hangs")
            if rep["ok"]:
                late.append(r)  # the kill landed after the all-reduce: no error to see
                continue
            if rep["error"] != "NodeError" or rep["rank"] not in (victim, None):
                self.counts.unexpected += 1
                self.log(
                    f"  step {step + 1}: UNEXPECTED: rank {r} raised {rep['error']} "
                    f"after rank {victim}'s trainer was killed: {rep['message'][:300]}",
                    error=True,
                )
            else:
                self.counts.node_errors += 1
                self.counts.node_error_max_s = max(self.counts.node_error_max_s, seconds)
                by = self.counts.node_error_max_s_by_backend
                by[self.backend] = round(max(by.get(self.backend, 0.0), seconds), 3)
                if seconds > self.args.group_timeout:
                    self.counts.hangs += 1
                    self.log(
                        f"  step {step + 1}: rank {r}'s NodeError came {seconds:.1f} s "
                        f"after the kill, past the group's timeout",
                        error=True,
                    )
        if late:
            self.counts.trainer_kills_late += 1
            self.log(
                f"  step {step + 1}: rank {victim}'s trainer was killed after the "
                "all-reduce: nothing to see for the others"
            )
        self._reform(dead=[victim])
        if self._settle(step, batch, self._run(batch, self.args.step_timeout)) == "broken":
            self._reform(dead=self._dead())

    def _wait_for_busy_worker(self, rank, trainer_pid, after_epoch):
        """Polls node ``rank``'s engine until a worker works on a step of
        ``trainer_pid``'s (so that the kill lands mid-step). Returns early, without a
        finding, if that trainer's reply is already there: the step ended between two
        polls (this process is one of many on a loaded machine), and the kill will land
        after the all-reduce (counted as late)."""
        deadline = time.monotonic() + self.args.step_timeout
        out = self.procs[rank].proc.stdout
        while time.monotonic() < deadline:
            st = read_status(self.engines[rank])
            if st.trainer_pid == trainer_pid and any(
                w.busy_epoch > after_epoch for w in st.ready_workers
            ):
                return
            if select.select([out], [], [], 0)[0]:
                return
            time.sleep(POLL_S)
        self.counts.hangs += 1
        self.log(
            f"  rank {rank}: no worker was seen busy with trainer {trainer_pid}'s step "
            f"within {self.args.step_timeout:g} s",
            error=True,
        )

    def _dead(self):
        return [r for r, p in enumerate(self.procs) if p.proc.poll() is not None]


class _RunBroken(Exception):
    """The run cannot go on (a group that does not form, a hang): it ends, counted."""


class _FormFailed(Exception):
    """A group's formation raised on some rank (not a hang)."""


def _reference(model, loss, x, y, mean):
    m = copy.deepcopy(model)
    for p in m.parameters():
        p.grad = None
    total = loss(m(x), y)
    (total / len(y) if mean else total).backward()
    return [torch.zeros_like(p) if p.grad is None else p.grad for p in m.parameters()]
