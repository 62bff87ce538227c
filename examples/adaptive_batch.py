#!/usr/bin/env python3
"""Fixed versus adaptive batch sizes on Fashion-MNIST through one shmgrad engine.

Trains the demo CNN twice from the same initial weights, on the same data order, with
SGD + momentum: once with a fixed batch (128) and once with an adaptive schedule from
shmgrad.schedules (GeoDamp by default: the batch starts at 128 and doubles every 2 epochs
up to --max-batch-size 1024; past it the learning rate halves instead). A growing batch reduces the
gradient noise as training proceeds -- the effect of a decaying learning rate -- with far
fewer, larger model updates. The engine's min_examples_per_worker keeps small batches on
fewer workers; max_examples_per_pass keeps a large shard's activations small.

The two runs share one engine and alternate every --slice-examples examples, so background
load on the machine hits both alike; only time inside the training loops is counted
(the test-set evaluation after each epoch is not).

Both runs train --epochs epochs. The summary compares them like for like, twice:

  * to the same accuracy target (--target, by default the fixed run's final test accuracy
    minus 0.5 points): for each run its first epoch at or above the target, with the model
    updates, examples and training wall time it took to get there;
  * after the same number of epochs (--epochs): accuracy, updates, examples, wall time.

The exit status is the like-for-like wall-time comparison: 0 when the adaptive run reached
the target in less wall time than the fixed run needed to reach it, 1 when it did not (it
then says why, for example when both runs kept the same number of workers busy, so that a
bigger batch could not use more of the machine). --json writes every figure to a file.

Larger batches save wall time when they keep more workers busy per update and cost fewer
synchronisations. On a 2-core machine both runs use both workers from batch 128 on, so
only the engine's per-update cost is saved. On a machine with many cores, give the engine
one worker per core and a min_examples_per_worker that keeps the fixed run's batch on part
of them (--workers 16 --min-examples-per-worker 16: batch 128 uses 8 workers, the adaptive
run's 256 and more use 16); tools/device-check runs that setting on its 16-core machine.

Run: .venv/bin/python examples/adaptive_batch.py
"""

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import shmgrad  # noqa: E402
from fashion_mnist import FashionCNN, accuracy, load_split  # noqa: E402

TOLERANCE = 0.005  # "within 0.5 points"


def make_schedule(args):
    s = shmgrad.schedules
    cap = args.max_batch_size
    if args.schedule == "geodamp":
        return s.GeoDamp(args.b0, args.factor, args.delay_epochs, max_batch_size=cap)
    if args.schedule == "padadamp":
        return s.PadaDamp(args.b0, args.rate, max_batch_size=cap)
    return s.AdaDamp(args.b0, max_batch_size=cap)


class Run:
    """One training run: its schedule, learning rate, own weights, optimizer and data order.

    The runs share one engine, so one bound module whose parameters alias the engine's.
    :meth:`train` is a generator that trains for ``epochs`` epochs and pauses (yields)
    after every ``slice_examples`` examples and at the end of each epoch; the caller swaps
    the run's weights in before resuming it (:meth:`load`) and out after (:meth:`save`).
    ``history`` holds one record per epoch.
    """

    def __init__(self, label, schedule, lr, model, init, args):
        self.label, self.schedule, self.lr, self.args = label, schedule, lr, args
        self.weights = [p.detach().clone() for p in init]
        # The optimizers share the parameter objects but keep their own momentum buffers.
        self.opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=args.momentum)
        self.gen = torch.Generator().manual_seed(args.seed + 1)  # same data order for every run
        self.updates = self.examples = 0
        self.wall = 0.0
        self.history = []
        self.workers_used = set()  # the numbers of workers its steps used

    @torch.no_grad()
    def load(self, model):
        for p, w in zip(model.parameters(), self.weights):
            p.copy_(w)

    @torch.no_grad()
    def save(self, model):
        for p, w in zip(model.parameters(), self.weights):
            w.copy_(p)

    def train(self, engine, model, test_x, test_y, loss_sample):
        args, schedule, opt = self.args, self.schedule, self.opt
        n = min(engine.dataset_size, args.train_examples or engine.dataset_size)
        for epoch in range(args.epochs):
            perm = torch.randperm(n, generator=self.gen)
            pos = since_yield = 0
            loss_sum = 0.0
            sizes, workers = set(), set()
            lr_factor = 1.0
            t0 = time.perf_counter()
            while pos < n:
                if (
                    isinstance(schedule, shmgrad.schedules.AdaDamp)
                    and self.updates % args.loss_every == 0
                ):
                    schedule.update_loss(engine, loss_sample)  # before this step's gradient
                bs, lr_factor = schedule(step=self.updates, epoch=epoch)
                for g in opt.param_groups:
                    g["lr"] = self.lr * lr_factor
                idx = perm[pos : pos + bs]
                stats = engine.gradient(idx, reduction="mean")
                opt.step()
                pos += len(idx)
                since_yield += len(idx)
                self.updates += 1
                self.examples += stats.num_examples
                loss_sum += stats.loss_sum
                sizes.add(bs)
                workers.add(stats.workers)
                if since_yield >= args.slice_examples and pos < n:
                    self.wall += time.perf_counter() - t0
                    yield
                    since_yield = 0
                    t0 = time.perf_counter()
            self.wall += time.perf_counter() - t0
            self.workers_used |= workers
            torch.set_num_threads(os.cpu_count() or 1)  # the workers are idle now
            acc = accuracy(model, test_x, test_y)
            torch.set_num_threads(1)
            self.history.append(
                {
                    "epoch": epoch + 1,
                    "accuracy": acc,
                    "updates": self.updates,
                    "examples": self.examples,
                    "wall": round(self.wall, 3),
                    "batch_sizes": sorted(sizes),
                    "workers": sorted(workers),
                }
            )
            shown = sorted(sizes) if len(sizes) <= 3 else [f"{min(sizes)}..{max(sizes)}"]
            print(
                f"  {self.label:8s} epoch {epoch + 1}: batch {'/'.join(map(str, shown))} "
                f"(workers {'/'.join(map(str, sorted(workers)))}), lr {self.lr * lr_factor:.3g}, "
                f"train loss {loss_sum / n:.4f}, test accuracy {acc * 100:.2f}%, "
                f"{self.updates} updates, {self.wall:.1f} s",
                flush=True,
            )
            yield

    def first_reaching(self, target):
        return next((h for h in self.history if h["accuracy"] >= target), None)


def row(label, schedule, h):
    return (
        f"{label:20s} {schedule:42s} {h['epoch']:6d} {h['accuracy'] * 100:7.2f}% "
        f"{h['updates']:8d} {h['examples']:9d} {h['wall']:7.1f}"
    )


def main():
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--epochs", type=int, default=8)
    ap.add_argument("--batch-size", type=int, default=128, help="the fixed run's batch")
    ap.add_argument("--lr", type=float, default=0.05, help="the fixed run's learning rate")
    ap.add_argument("--schedule", choices=("geodamp", "padadamp", "adadamp"), default="geodamp")
    ap.add_argument("--b0", type=int, default=128, help="the adaptive run's initial batch")
    ap.add_argument("--factor", type=float, default=2.0, help="GeoDamp growth factor")
    ap.add_argument(
        "--delay-epochs", type=float, default=2.0, help="GeoDamp epochs between growths"
    )
    ap.add_argument("--rate", type=float, default=1.0, help="PadaDamp examples added per update")
    ap.add_argument(
        "--loss-every", type=int, default=50, help="AdaDamp: updates between loss estimates"
    )
    ap.add_argument("--loss-sample", type=int, default=1000, help="AdaDamp: loss sample size")
    ap.add_argument(
        "--max-batch-size",
        type=int,
        default=1024,
        help="the adaptive batch stops growing here; the learning rate decays instead",
    )
    ap.add_argument(
        "--adaptive-lr",
        type=float,
        default=None,
        help="the adaptive run's base learning rate (default: --lr)",
    )
    ap.add_argument("--momentum", type=float, default=0.9)
    ap.add_argument(
        "--min-examples-per-worker",
        type=int,
        default=4,
        help="at most one worker per this many examples (measured on 2 cores: "
        "batches under 8 are as fast or faster on one worker)",
    )
    ap.add_argument(
        "--max-examples-per-pass",
        type=int,
        default=32,
        help="workers process their shard in passes of this many examples",
    )
    ap.add_argument(
        "--slice-examples",
        type=int,
        default=2048,
        help="the runs alternate every this many examples",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--only", choices=("fixed", "adaptive"), help="run just one of the two")
    ap.add_argument(
        "--target",
        type=float,
        default=None,
        help="the accuracy target in percent (default: the fixed run's final "
        "accuracy minus 0.5 points)",
    )
    ap.add_argument(
        "--train-examples",
        type=int,
        default=None,
        help="train on the first this many examples of the training set only "
        "(a shortened run; default: all 60000)",
    )
    ap.add_argument("--json", default=None, help="write the histories and the summary here")
    args = ap.parse_args()

    torch.manual_seed(args.seed)
    torch.set_num_threads(1)  # the trainer only steps the optimizer; workers do the work
    model = FashionCNN()
    init = [p.detach().clone() for p in model.parameters()]
    test_x, test_y = load_split("test")
    runs = []
    if args.only != "adaptive":
        runs.append(("fixed", shmgrad.schedules.Constant(args.batch_size), args.lr))
    if args.only != "fixed":
        runs.append(
            (
                "adaptive",
                make_schedule(args),
                args.lr if args.adaptive_lr is None else args.adaptive_lr,
            )
        )
    print(
        f"adaptive batch sizes: Fashion-MNIST CNN, {args.workers} workers, "
        f"min_examples_per_worker {args.min_examples_per_worker}, "
        f"max_examples_per_pass {args.max_examples_per_pass}, {args.epochs} epochs, "
        f"SGD momentum {args.momentum}; "
        + "; ".join(f"{label}: {sched!r} lr {lr}" for label, sched, lr in runs),
        flush=True,
    )
    with shmgrad.Engine(
        model=model,
        workers=args.workers,
        loss="cross_entropy",
        dataset="fashion-mnist",
        min_examples_per_worker=args.min_examples_per_worker,
        max_examples_per_pass=args.max_examples_per_pass,
    ) as engine:
        engine.bind(model)
        gen = torch.Generator().manual_seed(args.seed + 2)
        loss_sample = torch.randperm(engine.dataset_size, generator=gen)[: args.loss_sample]
        engine.gradient(torch.arange(args.batch_size))  # warm up the workers
        results = [Run(label, sched, lr, model, init, args) for label, sched, lr in runs]
        active = [(run, run.train(engine, model, test_x, test_y, loss_sample)) for run in results]
        while active:  # alternate the runs slice by slice
            for run, steps in list(active):
                run.load(model)
                if next(steps, StopIteration) is StopIteration:
                    active.remove((run, steps))
                run.save(model)

    target = None if args.target is None else args.target / 100
    summary = summarize(results, target)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "args": vars(args),
                    "cpus": os.cpu_count(),
                    "summary": summary,
                    "runs": {
                        r.label: {"schedule": repr(r.schedule), "lr": r.lr, "history": r.history}
                        for r in results
                    },
                },
                f,
                indent=2,
            )
    return summary["exit_status"]


def summarize(results, target):
    """Prints both comparisons and the verdict; returns them (and the exit status) as a dict."""
    print()
    header = (
        f"{'run':20s} {'schedule':42s} {'epochs':>6s} {'test acc':>8s} {'updates':>8s} "
        f"{'examples':>9s} {'wall s':>7s}"
    )
    print(header)
    for r in results:
        print(row(r.label, repr(r.schedule), r.history[-1]))
    if len(results) < 2:
        return {"exit_status": 0}
    fixed, adaptive = results
    if target is None:
        target = fixed.history[-1]["accuracy"] - TOLERANCE
    f_at, a_at = fixed.first_reaching(target), adaptive.first_reaching(target)
    for r, h in ((fixed, f_at), (adaptive, a_at)):
        if h is not None:
            print(row(f"{r.label} to {target * 100:.2f}%", "(its first epoch at or above it)", h))
        else:
            print(f"{r.label} to {target * 100:.2f}%: not reached in {len(r.history)} epochs")
    f_end, a_end = fixed.history[-1], adaptive.history[-1]
    summary = {
        "target": target,
        "fixed_at_target": f_at,
        "adaptive_at_target": a_at,
        "fixed_at_end": f_end,
        "adaptive_at_end": a_end,
        "workers_used": {
            "fixed": sorted(fixed.workers_used),
            "adaptive": sorted(adaptive.workers_used),
        },
    }

    print()
    print(f"like for like, to the same target ({target * 100:.2f}% test accuracy):")
    if f_at is not None and a_at is not None:
        speed = f_at["wall"] / a_at["wall"]
        print(
            f"  updates   {a_at['updates']} adaptive vs {f_at['updates']} fixed: "
            f"{f_at['updates'] / a_at['updates']:.2f}x fewer"
        )
        print(
            f"  examples  {a_at['examples']} adaptive vs {f_at['examples']} fixed: "
            f"{a_at['examples'] / f_at['examples']:.2f}x as many"
        )
        print(
            f"  wall time {a_at['wall']:.1f} s adaptive vs {f_at['wall']:.1f} s fixed: "
            + (
                f"adaptive {speed:.2f}x faster"
                if speed > 1
                else f"adaptive {1 / speed:.2f}x slower"
            )
        )
        a_rate, f_rate = a_at["examples"] / a_at["wall"], f_at["examples"] / f_at["wall"]
        print(
            f"  throughput {a_rate:.0f} examples/s adaptive vs {f_rate:.0f} fixed: "
            f"{a_rate / f_rate:.2f}x"
        )
        summary["wall_ratio_at_target"] = round(speed, 4)
        summary["throughput_ratio_at_target"] = round(a_rate / f_rate, 4)
    print(f"like for like, after the same {len(fixed.history)} epochs:")
    print(
        f"  accuracy  {a_end['accuracy'] * 100:.2f}% adaptive vs {f_end['accuracy'] * 100:.2f}% "
        f"fixed ({(a_end['accuracy'] - f_end['accuracy']) * 100:+.2f} points)"
    )
    print(
        f"  updates   {a_end['updates']} adaptive vs {f_end['updates']} fixed: "
        f"{f_end['updates'] / a_end['updates']:.2f}x fewer"
    )
    end_speed = f_end["wall"] / a_end["wall"]
    print(
        f"  wall time {a_end['wall']:.1f} s adaptive vs {f_end['wall']:.1f} s fixed: "
        + (
            f"adaptive {end_speed:.2f}x faster"
            if end_speed > 1
            else f"adaptive {1 / end_speed:.2f}x slower"
        )
    )
    summary["wall_ratio_at_end"] = round(end_speed, 4)

    print()
    cpus = os.cpu_count() or 1
    f_workers, a_workers = max(fixed.workers_used), max(adaptive.workers_used)
    if a_at is None:
        verdict = (
            f"FAIL adaptive batches did not pay here: the adaptive run never reached "
            f"{target * 100:.2f}% in {len(adaptive.history)} epochs"
        )
    elif f_at is None or a_at["wall"] < f_at["wall"]:
        verdict = (
            f"ok   adaptive batches paid here: the target in {a_at['wall']:.1f} s against "
            + (f"{f_at['wall']:.1f} s" if f_at else "never reached by the fixed run")
            + f" (workers used: fixed up to {f_workers}, adaptive up to {a_workers}, "
            f"{cpus} cores)"
        )
        if f_at is not None and a_workers <= f_workers:
            verdict += (
                f"; with the same workers busy the gain is in the epochs to the target "
                f"({a_at['examples']} examples against {f_at['examples']}), not in "
                f"throughput ({summary['throughput_ratio_at_target']:.2f}x)"
            )
    else:
        why = (
            f"both runs kept the same {f_workers} workers busy on {cpus} cores, so a bigger "
            f"batch could not use more of the machine and saved only the engine's cost per "
            f"update"
            if a_workers <= f_workers
            else f"the adaptive run used up to {a_workers} workers against the fixed run's "
            f"{f_workers}, and still needed more time: {a_at['epoch']} epochs "
            f"({a_at['examples']} examples) against {f_at['epoch']} ({f_at['examples']})"
        )
        verdict = (
            f"FAIL adaptive batches did not pay here: the target in {a_at['wall']:.1f} s "
            f"against {f_at['wall']:.1f} s for the fixed run; {why}"
        )
    print(verdict)
    summary["verdict"] = verdict
    summary["exit_status"] = 0 if verdict.startswith("ok") else 1
    return summary


if __name__ == "__main__":
    sys.exit(main())
