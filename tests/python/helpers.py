"""Helpers the tests share: a model slow enough to be killed in the middle of its step,
a gradient call run in a thread, waits on the engine's status, a free TCP port, and the
gradients of an engine with and without its direct linear layers."""

import socket
import threading
import time

import torch

import shmgrad


class SlowCnn(torch.nn.Module):
    """Big enough that a step over a few thousand examples takes a while on 2 cores."""

    def __init__(self):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(1, 16, 3, padding=1)
        self.conv2 = torch.nn.Conv2d(16, 16, 3, padding=1)
        self.fc = torch.nn.Linear(16 * 14 * 14, 5)

    def forward(self, x):
        x = torch.relu(self.conv2(torch.relu(self.conv1(x))))
        return self.fc(torch.flatten(torch.max_pool2d(x, 2), 1))


def wait_for(cond, timeout, what):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


BUSY_POLL_S = 0.001  # steps below take hundreds of ms: a kill lands early in them
STEP_TIMEOUT_S = 120


class GradientCall:
    """``engine.gradient(**kwargs)`` run in a thread (it releases the GIL while it waits),
    so that the test can watch the step and kill a process in the middle of it."""

    def __init__(self, engine, **kwargs):
        self._outcome = {}
        self._thread = threading.Thread(target=self._run, args=(engine, kwargs), daemon=True)
        self._thread.start()

    def _run(self, engine, kwargs):
        try:
            self._outcome["stats"] = engine.gradient(**kwargs)
        except BaseException as exc:  # handed to the test thread by result()
            self._outcome["error"] = exc

    def join(self):
        self._thread.join(STEP_TIMEOUT_S + 30)
        assert not self._thread.is_alive(), "the gradient call did not return"

    def result(self):
        """The call's GradientStats, or the exception it raised, raised here."""
        self.join()
        if "error" in self._outcome:
            raise self._outcome["error"]
        return self._outcome["stats"]


def wait_until_busy(name, *, after_epoch, slot=None, trainer_pid=None, timeout=60):
    """Polls the engine's status (from the segment: it works while any trainer holds the
    engine) until worker ``slot`` (any ready worker if None) works on a step later than
    ``after_epoch``, and, if given, ``trainer_pid`` holds the engine. Returns the status."""
    deadline = time.monotonic() + timeout
    while True:
        st = shmgrad.read_status(name)
        workers = st.ready_workers if slot is None else [st.worker(slot)]
        if (trainer_pid is None or st.trainer_pid == trainer_pid) and any(
            w is not None and w.busy_epoch > after_epoch for w in workers
        ):
            return st
        assert time.monotonic() < deadline, f"no worker seen busy within {timeout} s:\n{st.text}"
        time.sleep(BUSY_POLL_S)


def free_port():
    """A TCP port on 127.0.0.1 that was free a moment ago (a store or a gloo group's)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LinearLayers(torch.nn.Module):
    """Linear layers of every kind a direct linear layer meets (worker/direct_linear.h):
    plain ones, one without a bias, one whose weight is used twice (its two gradients
    summed by autograd before the slot), and a 3-D input (computed by F.linear as it is).
    TorchScript-able."""

    def __init__(self):
        super().__init__()
        self.inp = torch.nn.Linear(12, 16)
        self.square = torch.nn.Linear(16, 16)
        self.no_bias = torch.nn.Linear(16, 16, bias=False)
        self.out = torch.nn.Linear(16, 3)

    def body(self, x):
        h = torch.tanh(self.inp(x))
        h = torch.tanh(self.square(h))
        h = torch.tanh(self.square(h))  # the same weight again
        return torch.tanh(self.no_bias(h))

    def head(self, h):
        return self.out(h.unsqueeze(1)).squeeze(1)  # 3-D

    def forward(self, x):
        return self.head(self.body(x))


def check_direct_linear_bits(monkeypatch, make_model, mode, workers, per_pass, in_features):
    """Two SGD steps of ``make_model()`` through an engine of ``workers`` workers
    (``mode``), over batches of 20 (in passes of ``per_pass`` where given), with linear
    layers computing their gradients straight into the slot and with the write-first copy
    (SHMGRAD_DIRECT_LINEAR=1, then 0), the model's state restored between the runs: the
    same bits, and plain PyTorch's first gradient to rounding."""
    from conftest import relative_error

    torch.manual_seed(0)
    model = make_model()
    start = {k: v.clone() for k, v in model.state_dict().items()}
    g = torch.Generator().manual_seed(3)
    batches = [
        (torch.randn(20, in_features, generator=g), torch.randint(0, 3, (20,), generator=g))
        for _ in range(2)
    ]
    grads = {}
    for direct in ("1", "0"):
        monkeypatch.setenv("SHMGRAD_DIRECT_LINEAR", direct)
        model.load_state_dict(start)
        options = {} if per_pass is None else {"max_examples_per_pass": per_pass}
        with shmgrad.Engine(
            model=model,
            workers=workers,
            threads_per_worker=1,
            mode=mode,
            loss="cross_entropy",
            **options,
        ) as engine:
            engine.bind(model)
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            out = []
            for x, y in batches:
                opt.zero_grad()
                engine.gradient(inputs=x, targets=y, reduction="sum", timeout=60)
                out.append([p.grad.clone() for p in model.parameters()])
                opt.step()
        grads[direct] = out
    for step_direct, step_copied in zip(grads["1"], grads["0"]):
        for a, b in zip(step_direct, step_copied):
            assert torch.equal(a, b)
    ref = make_model()
    ref.load_state_dict(start)
    x, y = batches[0]
    torch.nn.functional.cross_entropy(ref(x), y, reduction="sum").backward()
    for a, p in zip(grads["1"][0], ref.parameters()):
        assert relative_error(a, p.grad) < 1e-5
