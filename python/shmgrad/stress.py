"""``shmgrad stress``: a node-local stress test of an engine under faults.

It starts an engine named NAME (a small CNN on a generated dataset), then for N steps:
random batch sizes, indexed and explicit batches, every gradient checked against a
plain PyTorch reference, SGD steps in between so the parameters move, workers killed
(SIGKILL) at random moments, the engine shrunk and grown back at once now and then (a
retired worker must be gone before its slot is reused), and the trainer restarted now
and then (a child trainer killed mid-step, then this process attaches again). It ends by
printing

    steps, kills, recoveries, wrong gradients, hangs, leaked segments

and exits non-zero if any of the last three is not 0.

Run: shmgrad stress --name NAME [--steps N] [--kill-rate R] [--seed S]
"""

import argparse
import copy
import glob
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np
import torch

from . import errors
from ._numerics import relative_error
from .client import attach
from .engine import Engine


class StressNet(torch.nn.Module):
    def __init__(self, classes=6):
        super().__init__()
        self.conv = torch.nn.Conv2d(1, 8, 3, padding=1)
        self.fc1 = torch.nn.Linear(8 * 8 * 8, 32)
        self.fc2 = torch.nn.Linear(32, classes)

    def forward(self, x):
        x = torch.max_pool2d(torch.relu(self.conv(x)), 2)
        return self.fc2(torch.relu(self.fc1(torch.flatten(x, 1))))


CHILD_TRAINER = """
import sys, torch, shmgrad
e = shmgrad.attach(sys.argv[1], timeout=30)
print("attached", flush=True)
x, y = torch.randn(2000, 1, 16, 16), torch.randint(0, 6, (2000,))
while True:
    e.gradient(inputs=x, targets=y)
"""


def _reference(model, x, y, mean):
    m = copy.deepcopy(model)
    for p in m.parameters():
        p.grad = None
    loss = torch.nn.functional.cross_entropy(m(x), y, reduction="mean" if mean else "sum")
    loss.backward()
    return [p.grad for p in m.parameters()]


def _worker_pids(engine):
    return [w.pid for w in engine.status().ready_workers]


def _restart_counts(engine):
    return engine.status().worker_restarts


def main(argv=None):
    ap = argparse.ArgumentParser(prog="shmgrad stress", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--name", required=True, help="engine name to create for the test")
    ap.add_argument("--steps", type=int, default=200, help="gradient steps (default 200)")
    ap.add_argument("--kill-rate", type=float, default=0.1,
                    help="probability that a step has a worker killed at a random moment (default 0.1)")
    ap.add_argument("--trainer-restart-rate", type=float, default=0.02,
                    help="probability per step of a trainer restart with a child trainer killed mid-step")
    ap.add_argument("--resize-rate", type=float, default=0.05,
                    help="probability per step of shrinking to a random size and growing back at once")
    ap.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    ap.add_argument("--workers", type=int, default=3, help="worker processes (default 3)")
    ap.add_argument("--max-batch", type=int, default=400, help="largest random batch (default 400)")
    ap.add_argument("--step-timeout", type=float, default=120.0,
                    help="seconds after which a step counts as a hang (default 120)")
    args = ap.parse_args(argv)
    if args.steps < 1 or args.workers < 1 or args.max_batch < 1:
        ap.error("--steps, --workers and --max-batch must be >= 1")
    for flag, rate in (("--kill-rate", args.kill_rate), ("--resize-rate", args.resize_rate),
                       ("--trainer-restart-rate", args.trainer_restart_rate)):
        if not 0 <= rate <= 1:
            ap.error(f"{flag} must be a probability in [0, 1], got {rate:g}")

    rng = random.Random(args.seed)
    torch.manual_seed(args.seed)
    tmp = tempfile.mkdtemp(prefix="shmgrad-stress-")
    n_data = 1000
    data_x = torch.randn(n_data, 1, 16, 16)
    data_y = torch.randint(0, 6, (n_data,))
    np.save(os.path.join(tmp, "x.npy"), data_x.numpy())
    np.save(os.path.join(tmp, "y.npy"), data_y.numpy())
    model = StressNet()
    counts = dict(steps=0, kills=0, recoveries=0, wrong=0, hangs=0, errors=0, trainer_restarts=0,
                  resizes=0)
    segment_glob = f"/dev/shm/shmgrad-{os.getuid()}-{args.name}"
    engine = Engine(model=model, workers=args.workers, loss="cross_entropy", name=args.name,
                    dataset=f"npy:{tmp}/x.npy,{tmp}/y.npy", max_batch=max(args.max_batch, 2000))
    owner = engine  # the engine process belongs to this object; trainers come and go
    trainer = engine
    worker_pids_seen = set()
    t_start = time.monotonic()
    try:
        trainer.bind(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        restarts_before = _restart_counts(trainer)
        for step in range(args.steps):
            if rng.random() < args.trainer_restart_rate:
                # A trainer killed mid-step, then this process attaches again.
                if trainer is owner:
                    owner._trainer.close()  # keep the engine process, drop the lease
                else:
                    trainer.close()
                child = subprocess.Popen([sys.executable, "-c", CHILD_TRAINER, args.name],
                                         stdout=subprocess.PIPE, text=True)
                line = child.stdout.readline().strip()
                time.sleep(rng.uniform(0.0, 0.3))
                child.kill()
                child.wait()
                if line != "attached":
                    raise RuntimeError(f"child trainer failed to attach (exit {child.returncode})")
                trainer = attach(args.name, timeout=5)
                trainer.bind(model)
                opt = torch.optim.SGD(model.parameters(), lr=0.01)
                counts["trainer_restarts"] += 1
            if args.workers > 1 and rng.random() < args.resize_rate:
                # Shrink, then grow back before the retired workers have had time to exit.
                worker_pids_seen.update(_worker_pids(trainer))
                trainer.resize(rng.randint(1, args.workers - 1), timeout=args.step_timeout)
                trainer.resize(args.workers, timeout=args.step_timeout)
                counts["resizes"] += 1
            batch = rng.randint(1, args.max_batch)
            mean = rng.random() < 0.5
            if rng.random() < 0.5:
                idx = torch.tensor([rng.randrange(n_data) for _ in range(batch)])
                x, y = data_x[idx], data_y[idx]
                call = lambda: trainer.gradient(idx, reduction="mean" if mean else "sum",  # noqa: E731
                                                timeout=args.step_timeout)
            else:
                x, y = torch.randn(batch, 1, 16, 16), torch.randint(0, 6, (batch,))
                call = lambda: trainer.gradient(inputs=x, targets=y,  # noqa: E731
                                                reduction="mean" if mean else "sum",
                                                timeout=args.step_timeout)
            ref = _reference(model, x, y, mean)
            killer = None
            if rng.random() < args.kill_rate:
                pids = _worker_pids(trainer)
                if pids:
                    victim = rng.choice(pids)
                    worker_pids_seen.update(pids)

                    def kill(pid=victim):
                        try:
                            os.kill(pid, signal.SIGKILL)
                            counts["kills"] += 1
                        except ProcessLookupError:
                            pass
                    killer = threading.Timer(rng.uniform(0.0, 0.05), kill)
                    killer.start()
            try:
                stats = call()
                counts["recoveries"] += stats.retries
                if relative_error([p.grad for p in model.parameters()], ref) > 1e-4:
                    counts["wrong"] += 1
                opt.step()
            except errors.TimeoutError as exc:
                counts["hangs"] += 1
                print(f"  step {step + 1}: HANG: {exc}", file=sys.stderr, flush=True)
                if os.environ.get("SHMGRAD_STRESS_DEBUG"):
                    print(trainer.status().text, file=sys.stderr, flush=True)
            except errors.WorkerError:
                counts["errors"] += 1  # a clear error after repeated deaths: allowed
            except errors.CorruptSegmentError as exc:
                counts["wrong"] += 1  # the step's bookkeeping is wrong: so may its gradient be
                print(f"  step {step + 1}: WRONG: {exc}", file=sys.stderr, flush=True)
            finally:
                if killer is not None:
                    killer.join()
            counts["steps"] += 1
            if (step + 1) % 25 == 0:
                print(f"  step {step + 1}/{args.steps}: kills {counts['kills']}, "
                      f"retries {counts['recoveries']}, wrong {counts['wrong']}", flush=True)
        counts["worker_replacements"] = _restart_counts(trainer) - restarts_before
    finally:
        if trainer is not owner:
            trainer.close()
        owner.close()
        import shutil
        shutil.rmtree(tmp, ignore_errors=True)
    time.sleep(0.2)
    leaked = len(glob.glob(segment_glob))
    leftover = [p for p in worker_pids_seen if os.path.exists(f"/proc/{p}") and
                open(f"/proc/{p}/stat").read().split(")")[1].split()[0] != "Z"]
    leaked += len(leftover)
    elapsed = time.monotonic() - t_start
    print(f"stress {args.name}: {elapsed:.1f} s, trainer restarts {counts['trainer_restarts']}, "
          f"worker replacements {counts.get('worker_replacements', 0)}, "
          f"shrink-and-grow {counts['resizes']}, errors after repeated deaths {counts['errors']}")
    print(f"steps {counts['steps']}, kills {counts['kills']}, recoveries {counts['recoveries']}, "
          f"wrong gradients {counts['wrong']}, hangs {counts['hangs']}, leaked segments {leaked}")
    return 0 if counts["wrong"] == 0 and counts["hangs"] == 0 and leaked == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
