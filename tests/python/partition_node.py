"""One node of test_partition.py, run inside a network namespace (``ip netns exec NS
python partition_node.py ...``): its own engine (one worker) and its trainer, in a gloo
group with the node of the other namespace. It talks to the test in JSON lines: events on
stdout, commands on stdin.

Start-up: rank 0 picks a free port on its address (printed as ``{"event": "port"}``); each
node starts its engine and prints ``{"event": "ready"}``; then ``go PORT`` makes it join
the group (the TCPStore on rank 0's address) and bind its model.

Commands: ``train K`` runs K steps of a global batch of BATCH examples (each node its
share), printing for each ``{"event": "step", ...}`` with the step's all-reduce seconds and
the gradient's largest relative difference from one process's plain PyTorch backward of
the whole batch, then applies SGD; a step that raises prints ``{"event": "error", ...}``
(the error's type, rank and message, and the CLOCK_MONOTONIC time it was raised) and ends
the command. ``quit`` closes the engine and the group and exits 0 (``{"event":
"closed"}`` first).
"""

import argparse
import datetime
import json
import os
import socket
import sys
import time

BATCH = 16
FEATURES, HIDDEN, CLASSES = 8, 32, 4
LR = 0.05


def say(**event):
    print(json.dumps(event), flush=True)


def command():
    line = sys.stdin.readline()
    if not line:
        sys.exit("partition_node: the test closed stdin")
    return line.split()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--master", required=True, help="rank 0's address (the TCPStore's)")
    p.add_argument("--ifname", required=True, help="the link's device (GLOO_SOCKET_IFNAME)")
    p.add_argument("--name", required=True, help="this node's engine name")
    p.add_argument("--timeout", type=float, required=True, help="the group's timeout, s")
    args = p.parse_args()
    if args.rank == 0:
        with socket.socket() as s:  # a free port in this namespace, for the TCPStore
            s.bind((args.master, 0))
            say(event="port", port=s.getsockname()[1])

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    import shmgrad
    from shmgrad.multinode import shard

    torch.set_num_threads(1)
    torch.manual_seed(0)

    def make():
        return torch.nn.Sequential(
            torch.nn.Linear(FEATURES, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, CLASSES)
        )

    model, reference = make(), make()
    server = shmgrad.serve(model=model, workers=1, loss="cross_entropy", name=args.name)
    engine = None
    try:
        say(event="ready", pid=os.getpid(), coordinator=server.pid)
        go, port = command()
        assert go == "go", go
        os.environ["GLOO_SOCKET_IFNAME"] = args.ifname
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://{args.master}:{port}",
            rank=args.rank,
            world_size=2,
            timeout=datetime.timedelta(seconds=args.timeout),
        )
        engine = shmgrad.attach(args.name, process_group=dist.group.WORLD)
        engine.bind(model)
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        step = 0
        while True:
            words = command()
            if words[0] == "quit":
                break
            assert words[0] == "train", words
            for _ in range(int(words[1])):
                g = torch.Generator().manual_seed(step)  # the same global batch on both nodes
                x = torch.randn(BATCH, FEATURES, generator=g)
                y = torch.randint(0, CLASSES, (BATCH,), generator=g)
                mine = shard(torch.arange(BATCH), args.rank, 2)
                t0 = time.perf_counter()
                try:
                    stats = engine.gradient(inputs=x[mine], targets=y[mine], reduction="mean")
                except shmgrad.Error as exc:
                    say(
                        event="error",
                        kind=type(exc).__name__,
                        rank=getattr(exc, "rank", None),
                        message=str(exc),
                        t=time.clock_gettime(time.CLOCK_MONOTONIC),
                        step=step,
                    )
                    break
                seconds = time.perf_counter() - t0
                reference.load_state_dict(model.state_dict())
                reference.zero_grad()
                F.cross_entropy(reference(x), y).backward()
                error = max(
                    float((p.grad - r.grad).abs().max() / r.grad.abs().max().clamp_min(1e-12))
                    for p, r in zip(model.parameters(), reference.parameters())
                )
                opt.step()
                say(
                    event="step",
                    step=step,
                    seconds=seconds,
                    allreduce=stats.allreduce_seconds,
                    examples=stats.num_examples,
                    error=error,
                    t=time.clock_gettime(time.CLOCK_MONOTONIC),
                )
                step += 1
            say(event="done", step=step)
    finally:
        if engine is not None:
            engine.close()
        server.stop()
        if dist.is_initialized():
            dist.destroy_process_group()
    say(event="closed")


if __name__ == "__main__":
    main()
