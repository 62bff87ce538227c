"""A tunable on against off, paired: two engines of the same model in one trainer process,
one started with the tunable at "1" and one at "0" (SHMGRAD_DIRECT_LINEAR: linear layers
compute their weight and bias gradients straight into the slot, worker/direct_linear.h, or
apart and copied in; SHMGRAD_PLAIN_PASS: an eager pass that is loss(model(inputs),
targets) runs in C++ around the model and the loss, or all in Python), taking turns step
by step on the same batches (the order reversed every other step). One process's forward
and backward ("single") takes its turn too, on the trainer's threads ("auto": all the
cores for the trainer placement, those the workers leave free otherwise, at least 1: a
fair baseline only for the trainer placement). The bench's heap settings for all (the
tool runs itself again with them where the environment lacks them). A configuration's
placement is WORKERSxTHREADS, or "trainer" (workers="auto" placed in the trainer: it
computes each step itself). Prints, per configuration, each one's median step and the
medians of the per-step ratios off / on (above 1: on is faster), single / on and single /
off; with --json, writes them. docs/BENCHMARKS.md cites its runs.

    .venv/bin/python tools/tunable_ab.py --mode script --configs mlp:32:2x1,mlp2:32:2x1
    .venv/bin/python tools/tunable_ab.py --tunable SHMGRAD_PLAIN_PASS --mode eager \\
        --configs mlp:32:trainer
"""

import argparse
import json
import os
import statistics
import sys
import time

TUNABLES = ("SHMGRAD_DIRECT_LINEAR", "SHMGRAD_PLAIN_PASS")


def run_config(tunable, model_name, batch, place, mode, steps, warmup):
    import torch
    import torch.nn.functional as F

    import shmgrad
    from shmgrad_tools.bench import models

    batches = models.make_batches(model_name, batch, 8, seed=1)
    engines = {}
    times = {"1": [], "0": [], "single": []}
    in_trainer = place == "trainer"
    workers, threads = (0, 0) if in_trainer else (int(n) for n in place.split("x"))
    single = models.make_model(model_name, seed=0)

    def single_step(x, y):
        single.zero_grad()
        F.cross_entropy(single(x), y, reduction="sum").backward()

    try:
        for value in ("1", "0"):
            os.environ[tunable] = value  # read by the workers and the trainer's runner at start
            options = {"workers": "auto"} if in_trainer else {"workers": workers}
            if not in_trainer:
                options["threads_per_worker"] = threads
            engine = shmgrad.Engine(
                model=models.make_model(model_name, seed=0),
                loss="cross_entropy",
                mode=mode,
                **options,
            )
            engines[value] = engine
            engine.bind(models.make_model(model_name, seed=0))
            if in_trainer:
                engine._trainer.set_placement(0, shmgrad._C.physical_cores(), in_trainer=True)
        turns = {
            "1": lambda x, y: engines["1"].gradient(inputs=x, targets=y, reduction="sum"),
            "0": lambda x, y: engines["0"].gradient(inputs=x, targets=y, reduction="sum"),
            "single": single_step,
        }
        single_threads = torch.get_num_threads()  # the engines' trainer threads ("auto")
        for i in range(warmup + steps):
            x, y = batches[i % len(batches)]
            for name in ("1", "0", "single") if i % 2 == 0 else ("single", "0", "1"):
                t0 = time.perf_counter()
                turns[name](x, y)
                if i >= warmup:
                    times[name].append(time.perf_counter() - t0)
    finally:
        os.environ.pop(tunable, None)  # the default again
        for e in engines.values():
            e.close()
    return {
        "tunable": tunable,
        "model": model_name,
        "batch": batch,
        "placement": place,
        "single_threads": single_threads,
        "on_s": statistics.median(times["1"]),
        "off_s": statistics.median(times["0"]),
        "single_s": statistics.median(times["single"]),
        "off_over_on": statistics.median(o / n for n, o in zip(times["1"], times["0"])),
        "single_over_on": statistics.median(s / n for n, s in zip(times["1"], times["single"])),
        "single_over_off": statistics.median(s / o for o, s in zip(times["0"], times["single"])),
    }


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--tunable", default="SHMGRAD_DIRECT_LINEAR", choices=TUNABLES)
    p.add_argument("--mode", default="script", choices=("script", "eager"))
    p.add_argument(
        "--configs",
        default="mlp:32:2x1,mlp:128:2x1,mlp2:32:2x1,mlp2:128:2x1,mlp2:512:2x1,cnn:32:2x1,cnn:128:2x1",
        help="model:batch:WORKERSxTHREADS or model:batch:trainer, comma-separated",
    )
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    import shmgrad

    heap = shmgrad.heap_environment()
    if any(os.environ.get(k) != v for k, v in heap.items()):
        # The heap settings take effect at the process's start: run again with them.
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **heap})
    results = []
    print(f"{args.tunable} 1 against 0, {args.mode} workers, {args.steps} steps each, paired")
    for config in args.configs.split(","):
        model_name, batch, place = config.split(":")
        r = run_config(
            args.tunable, model_name, int(batch), place, args.mode, args.steps, args.warmup
        )
        results.append(r)
        print(
            f"  {model_name:5s} b{batch:<4s} {place:7s}  on {r['on_s'] * 1e3:8.3f} ms"
            f"  off {r['off_s'] * 1e3:8.3f} ms  single {r['single_s'] * 1e3:8.3f} ms"
            f"  off/on {r['off_over_on']:.3f}  single/on {r['single_over_on']:.3f}"
            f"  single/off {r['single_over_off']:.3f}  (single on {r['single_threads']} threads)",
            flush=True,
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"results": results, "args": vars(args)}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
