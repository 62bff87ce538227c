"""``python3 -m shmgrad_tools.bench.augment``: per-example data augmentation in the eager workers
against the same augmentation in the trainer.

It takes examples/train_augmented.py's pipeline as it is: its Dataset (random crop with
padding, horizontal flip, ToTensor, Normalize on one PIL image in ``__getitem__``), its
label-smoothed loss, and a model (``resnet``: the example's SmallResNet; ``cnn``:
examples/fashion_mnist.py's FashionCNN; ``mlp``: shmgrad_tools.bench's 784-256-10 MLP behind a
Flatten, a model whose forward and backward cost less than its examples' transforms). On
one eager engine of N workers it trains
with two loops, alternating step by step so that background load hits both alike:

  workers  ``engine.gradient(idx, reduction="mean", seed=s)``: each worker builds its
           share of the batch, the transforms included (the example's loop);
  trainer  the trainer builds the batch with the workers' seeding (``seed_everything(
           example_seed(s, i))`` before ``dataset[i]``, then ``default_collate``) and
           calls ``engine.gradient(inputs=x, targets=y, reduction="mean")``: the
           transforms run one example after the other in the trainer while the workers
           wait (what a training loop without a DataLoader does);

each step followed by an SGD step. Before timing, it checks that both loops compute the
same gradient for the same batch and seed. It prints, per model, both loops' examples/s,
their ratio (workers / trainer), the trainer's transform time per step and the slowest
worker's compute per step; --json PATH writes the same as JSON.
"""

import argparse
import json
import os
import statistics
import sys
import time

import torch

from shmgrad import Engine, example_batch
from shmgrad.testing import relative_error
from .timing import log

DEFAULT_EXAMPLES = "examples"  # run from the checkout (the installed package has none)
MODELS = ("resnet", "cnn", "mlp")
TARGET_RATIO = 1.6  # the target for N = 2
MAX_GRADIENT_ERROR = 1e-5  # between the two loops' gradients of one batch


def load_example(examples_dir):
    """examples/train_augmented.py as a module (its classes pickle by reference: the
    workers import it from the same directory, which the engine puts on their path)."""
    if not os.path.isfile(os.path.join(examples_dir, "train_augmented.py")):
        raise SystemExit(
            f"shmgrad_tools.bench.augment: no train_augmented.py in {examples_dir}: "
            "pass --examples DIR (the repository's examples/ folder)"
        )
    if examples_dir not in sys.path:
        sys.path.insert(0, examples_dir)
    import train_augmented

    return train_augmented


def make_model(example, name):
    if name == "resnet":
        return example.SmallResNet()
    if name == "mlp":
        from .models import MLP

        return torch.nn.Sequential(torch.nn.Flatten(), MLP())
    from fashion_mnist import FashionCNN  # beside train_augmented.py

    return FashionCNN()


def trainer_batch(dataset, indices, seed):
    """The batch the workers would build for ``indices`` in a step seeded with ``seed``."""
    return example_batch(dataset, indices.tolist(), seed)


def _build_rounds(dataset, indices, rounds, barrier, queue):
    """A calibration child: builds its share of a batch ``rounds`` times, each round
    starting with the others, and sends the seconds each took."""
    torch.set_num_threads(1)
    times = []
    for r in range(rounds):
        barrier.wait()
        t0 = time.perf_counter()
        example_batch(dataset, indices, r)
        times.append(time.perf_counter() - t0)
    queue.put(times)


def parallel_speedup(dataset, batch_size, workers, rounds=12, seed=0):
    """How much faster ``workers`` processes build a batch's examples (transforms
    included) than one process does, on this machine now: the most the workers loop can
    gain on the transforms. 2.0 at N = 2 needs two free cores; a VM whose virtual CPUs
    share the host's cores gets less."""
    import multiprocessing

    g = torch.Generator().manual_seed(seed)
    indices = torch.randint(0, len(dataset), (batch_size,), generator=g).tolist()
    solo = []
    for r in range(rounds):
        t0 = time.perf_counter()
        example_batch(dataset, indices, r)
        solo.append(time.perf_counter() - t0)
    ctx = multiprocessing.get_context("fork")
    barrier, queue = ctx.Barrier(workers), ctx.Queue()
    per = -(-batch_size // workers)
    procs = [
        ctx.Process(
            target=_build_rounds,
            args=(dataset, indices[k * per : (k + 1) * per], rounds, barrier, queue),
        )
        for k in range(workers)
    ]
    for proc in procs:
        proc.start()
    shares = [queue.get(timeout=300) for _ in procs]
    for proc in procs:
        proc.join(timeout=60)
    together = [max(t[r] for t in shares) for r in range(rounds)]
    return statistics.median(solo[2:]) / statistics.median(together[2:])


def measure_model(args, example, dataset, model_name):
    torch.manual_seed(args.seed)
    model = make_model(example, model_name)
    n = len(dataset)
    order = torch.Generator().manual_seed(args.seed)
    with Engine(
        model=model,
        loss=example.smoothed_loss(),
        dataset=dataset,
        workers=args.workers,
        mode="eager",
        seed=args.seed,
        startup_timeout=args.timeout,
    ) as engine:
        engine.bind(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

        def batch():
            return torch.randint(0, n, (args.batch_size,), generator=order)

        # The two loops compute the same gradient for the same batch and seed.
        idx = batch()
        engine.gradient(idx, reduction="mean", seed=args.seed)
        in_workers = [p.grad.clone() for p in model.parameters()]
        x, y = trainer_batch(dataset, idx, args.seed)
        engine.gradient(inputs=x, targets=y, reduction="mean")
        err = relative_error([p.grad for p in model.parameters()], in_workers)
        if err > MAX_GRADIENT_ERROR:
            raise RuntimeError(
                f"{model_name}: the trainer's batch gives another gradient than "
                f"the workers' (relative difference {err:.2e})"
            )

        times = {"workers": [], "trainer": []}
        transform_s, compute_s, explicit_compute_s = [], [], []
        for step in range(args.warmup + args.steps):
            timed = step >= args.warmup
            for loop in ("workers", "trainer"):
                idx, seed = batch(), args.seed + 1 + step
                t0 = time.perf_counter()
                if loop == "workers":
                    stats = engine.gradient(idx, reduction="mean", seed=seed)
                else:
                    x, y = trainer_batch(dataset, idx, seed)
                    t1 = time.perf_counter()
                    stats = engine.gradient(inputs=x, targets=y, reduction="mean")
                opt.step()
                dt = time.perf_counter() - t0
                if timed:
                    times[loop].append(dt)
                    if loop == "workers":
                        compute_s.append(max(stats.compute_seconds))
                    else:
                        transform_s.append(t1 - t0)
                        explicit_compute_s.append(max(stats.compute_seconds))
    rate = {k: args.batch_size * len(v) / sum(v) for k, v in times.items()}
    return {
        "model": model_name,
        "parameters": sum(p.numel() for p in model.parameters()),
        "workers": args.workers,
        "batch": args.batch_size,
        "steps": args.steps,
        "gradient_rel_diff": err,
        "examples_per_s": rate,
        "ratio": rate["workers"] / rate["trainer"],
        "step_median_s": {k: statistics.median(v) for k, v in times.items()},
        "trainer_transform_median_s": statistics.median(transform_s),
        "workers_compute_median_s": statistics.median(compute_s),
        "explicit_compute_median_s": statistics.median(explicit_compute_s),
    }


def ratio_bound(r, speedup):
    """The workers/trainer ratio the two loops' parts allow: the trainer loop takes its
    transforms T plus the workers' forward and backward C, the workers loop T / S + C,
    with S the machine's parallel speedup on the transforms (at most N)."""
    t, c = r["trainer_transform_median_s"], r["explicit_compute_median_s"]
    return (t + c) / (t / speedup + c)


def build_parser():
    ap = argparse.ArgumentParser(
        prog="python3 -m shmgrad_tools.bench.augment",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument(
        "--models",
        default="resnet,cnn,mlp",
        help="comma-separated: resnet (examples/train_augmented.py's SmallResNet), "
        "cnn (examples/fashion_mnist.py's FashionCNN), mlp (784-256-10); "
        "default resnet,cnn,mlp",
    )
    ap.add_argument("--workers", type=int, default=2, help="eager workers N (default 2)")
    ap.add_argument("--batch-size", type=int, default=128, help="default 128")
    ap.add_argument("--steps", type=int, default=20, help="timed steps per loop (default 20)")
    ap.add_argument(
        "--warmup", type=int, default=3, help="untimed steps per loop first (default 3)"
    )
    ap.add_argument(
        "--train-examples",
        type=int,
        default=10000,
        help="training images the engine's dataset holds (default 10000)",
    )
    ap.add_argument(
        "--examples",
        default=DEFAULT_EXAMPLES,
        help="the folder holding train_augmented.py (default: this checkout's examples/)",
    )
    ap.add_argument(
        "--timeout",
        type=float,
        default=120.0,
        help="seconds the engine may take to start (default 120)",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", metavar="PATH", help="also write the results to PATH as JSON")
    return ap


def parse_args(argv=None):
    ap = build_parser()
    args = ap.parse_args(argv)
    args.models = [m.strip() for m in args.models.split(",") if m.strip()]
    bad = [m for m in args.models if m not in MODELS]
    if bad or not args.models:
        ap.error(
            f"--models: unknown {', '.join(bad) or 'empty list'}: choose from {', '.join(MODELS)}"
        )
    if min(args.workers, args.batch_size, args.steps, args.train_examples) < 1 or args.warmup < 0:
        ap.error(
            "--workers, --batch-size, --steps and --train-examples must be >= 1, --warmup >= 0"
        )
    return args


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(1)  # the trainer: one core, like the example's
    example = load_example(os.path.abspath(args.examples))
    dataset = example.training_set(min(args.train_examples, 60000), 2, args.seed)
    log(
        f"augmentation: {', '.join(args.models)}, {args.workers} eager workers, batch "
        f"{args.batch_size}, {args.warmup} + {args.steps} steps per loop; load average "
        f"{os.getloadavg()[0]:.2f}"
    )
    speedup = parallel_speedup(dataset, args.batch_size, args.workers, seed=args.seed)
    print(
        f"parallel speedup of the transforms on this machine now: {args.workers} processes "
        f"build a batch {speedup:.2f}x as fast as one (at most {args.workers})",
        flush=True,
    )
    results = []
    for name in args.models:
        r = measure_model(args, example, dataset, name)
        r["parallel_speedup"] = speedup
        r["ratio_bound"] = ratio_bound(r, speedup)
        r["ratio_bound_ideal"] = ratio_bound(r, float(args.workers))
        results.append(r)
        rate = r["examples_per_s"]
        print(
            f"{name} ({r['parameters']} parameters), N={args.workers}, batch "
            f"{args.batch_size}: transforms in the workers {rate['workers']:.0f} examples/s, "
            f"in the trainer {rate['trainer']:.0f} examples/s: {r['ratio']:.2f}x "
            f"(trainer's transforms {r['trainer_transform_median_s'] * 1e3:.1f} ms a step, "
            f"slowest worker's transforms+forward+backward "
            f"{r['workers_compute_median_s'] * 1e3:.1f} ms; gradients agree to "
            f"{r['gradient_rel_diff']:.1e})",
            flush=True,
        )
        print(
            f"  bound (T + C) / (T / S + C), T the trainer's transforms, C the workers' "
            f"forward+backward {r['explicit_compute_median_s'] * 1e3:.1f} ms: "
            f"{r['ratio_bound']:.2f}x at this machine's S = {speedup:.2f}, "
            f"{r['ratio_bound_ideal']:.2f}x with {args.workers} free cores",
            flush=True,
        )
        if args.workers == 2:
            print(
                f"  target >= {TARGET_RATIO}x at N = 2: "
                f"{'met' if r['ratio'] >= TARGET_RATIO else 'NOT met'}",
                flush=True,
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "command": "python3 -m shmgrad_tools.bench.augment "
                    + " ".join(sys.argv[1:] if argv is None else argv),
                    "load_average_after": os.getloadavg(),
                    "results": results,
                },
                f,
                indent=1,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
