"""Helpers the tests share: a model slow enough to be killed in the middle of its step,
a gradient call run in a thread, waits on the engine's status, a free TCP port."""

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
