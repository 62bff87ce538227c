"""One node's trainer in ``shmgrad stress --nodes N``: a child process that the stress
process drives through its stdin and stdout (:mod:`.nodes`), one request, one reply.

Requests (pickled dicts, each framed by its length; :func:`send` / :func:`receive`):

* ``form``: join a new group (``torch.distributed.init_process_group`` over a FileStore
  the parent names, backend gloo or shmgrad), attach to this node's engine with it
  (collective: every node at once), take the model's parameters (``state``) and bind;
* ``step``: this node's share of a step (``call``: ``gradient()``'s arguments) under
  ``timeout``; the reply carries the parameters the step was computed at and the
  gradient (loss scale divided out), or the error (its type, message, rank, and how
  long after the call it came);
* ``apply``: an SGD step on the last gradient (the parent checked it first);
* ``leave``: close the engine's client and destroy the group (after a failure, or to
  re-form);
* ``exit``.

Its first frame, before any request, says it is ready (its imports done). Stdout is the
channel: the process moves what it would print to stderr first.
"""

import datetime
import os
import pickle
import struct
import sys
import time
import traceback

_LENGTH = struct.Struct("<Q")


def send(f, obj):
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    f.write(_LENGTH.pack(len(data)) + data)
    f.flush()


def _read_exactly(f, n):
    buf = b""
    while len(buf) < n:
        chunk = f.read(n - len(buf))
        if not chunk:
            raise EOFError("the other end closed the channel")
        buf += chunk
    return buf


def receive(f):
    (n,) = _LENGTH.unpack(_read_exactly(f, _LENGTH.size))
    return pickle.loads(_read_exactly(f, n))


class NodeTrainer:
    LR = 0.01

    def __init__(self):
        self.client = None
        self.model = None
        self.opt = None
        self.formed = False

    def form(self, req):
        import torch
        import torch.distributed as dist

        import shmgrad
        from .workloads import WORKLOADS

        t0 = time.monotonic()
        store = dist.FileStore(req["store"], req["world"])
        dist.init_process_group(
            req["backend"],
            store=store,
            rank=req["rank"],
            world_size=req["world"],
            timeout=datetime.timedelta(seconds=req["group_timeout"]),
        )
        self.formed = True
        t1 = time.monotonic()
        if self.model is None:
            torch.manual_seed(0)
            self.model = WORKLOADS[req["kind"]].model_class()
        self.model.load_state_dict(req["state"])
        self.client = shmgrad.attach(
            req["engine"], timeout=req["attach_timeout"], process_group=dist.group.WORLD
        )
        t2 = time.monotonic()
        self.client.bind(self.model)
        # Plain SGD: no state, so a re-formed group's trainers need only the parameters.
        self.opt = torch.optim.SGD(self.model.parameters(), lr=self.LR)
        # How long each phase took: the group's rendezvous, the attach (collective: it
        # waits for every node's engine), the bind (a broadcast) and the optimizer.
        seconds = [t1 - t0, t2 - t1, time.monotonic() - t2]
        return {"ok": True, "backend": dist.get_backend(), "pid": os.getpid(), "seconds": seconds}

    def step(self, req):
        import shmgrad

        params = [p.detach().clone() for p in self.model.parameters()]
        t0 = time.monotonic()
        try:
            stats = self.client.gradient(**req["call"], timeout=req["timeout"])
        except shmgrad.Error as exc:
            return {
                "ok": False,
                "error": type(exc).__name__,
                "message": str(exc),
                "rank": getattr(exc, "rank", None),
                "seconds": time.monotonic() - t0,
            }
        scale = req["call"].get("loss_scale", 1.0)
        grads = []
        for p in self.model.parameters():
            if scale != 1.0 and p.grad is not None:
                p.grad.div_(scale)
            grads.append(None if p.grad is None else p.grad.detach().clone())
        return {
            "ok": True,
            "params": params,
            "grads": grads,
            "retries": stats.retries,
            "num_examples": stats.num_examples,
            "seconds": time.monotonic() - t0,
        }

    def apply(self, req):
        self.opt.step()
        return {"ok": True}

    def leave(self, req):
        import torch.distributed as dist

        if self.client is not None:
            self.client.close()
            self.client = None
        if self.formed:
            dist.destroy_process_group()
            self.formed = False
        return {"ok": True}


def main():
    # The channel is this process's stdout as it was; whatever else prints (libraries,
    # warnings) goes to stderr, so it cannot corrupt a frame.
    channel = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    requests = os.fdopen(0, "rb")
    # Imported before the first request: a spare trainer waits warm, so that replacing a
    # killed one costs a group's formation, not torch's import.
    import torch
    import torch.distributed  # noqa: F401

    import shmgrad  # noqa: F401
    from . import workloads  # noqa: F401

    # An optimizer's first construction and step import more of torch (seconds here).
    warm = torch.zeros(1, requires_grad=True)
    warm.grad = torch.zeros(1)
    torch.optim.SGD([warm], lr=NodeTrainer.LR).step()
    send(channel, {"ok": True, "ready": os.getpid()})  # the first frame: warm

    node = NodeTrainer()
    while True:
        try:
            req = receive(requests)
        except EOFError:
            return 0  # the stress process is gone
        op = req["op"]
        if op == "exit":
            node.leave(req)
            send(channel, {"ok": True})
            return 0
        try:
            reply = getattr(node, op)(req)
        except Exception as exc:  # reported to the parent, which counts it
            reply = {
                "ok": False,
                "error": type(exc).__name__,
                "message": f"{op}: {exc}\n{traceback.format_exc()}",
                "rank": getattr(exc, "rank", None),
                "seconds": 0.0,
            }
        send(channel, reply)


if __name__ == "__main__":
    sys.exit(main())
