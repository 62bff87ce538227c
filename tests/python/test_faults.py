"""Faults: killed workers, killed trainers, a killed coordinator, strangers, non-finite values."""

import contextlib
import math
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

import shmgrad
from conftest import Mlp, proc_stat, reference_gradient, relative_error, segments, worker_pids
from helpers import STEP_TIMEOUT_S, GradientCall, SlowCnn, wait_for, wait_until_busy


def assert_exact(model, x, y):
    """The bound model's .grad is the summed cross-entropy gradient of one process."""
    ref = reference_gradient(model, "cross_entropy", x, y)
    assert relative_error([p.grad for p in model.parameters()], ref) < 1e-5


def test_killed_idle_worker_is_replaced_and_gradient_stays_exact():
    torch.manual_seed(0)
    model = Mlp(d_in=10, d_out=3)
    x, y = torch.randn(40, 10), torch.randint(0, 3, (40,))
    with shmgrad.Engine(model=model, workers=3, loss="cross_entropy") as engine:
        engine.bind(model)
        before = worker_pids(engine)
        os.kill(before[1], signal.SIGKILL)
        # Detected and replaced within a bounded time.
        wait_for(
            lambda: len(worker_pids(engine)) == 3 and worker_pids(engine)[1] != before[1],
            30,
            "the replacement worker",
        )
        st = engine.status()
        assert st.worker_restarts == 1 and st.worker(1).restarts == 1
        assert st.steps_aborted == 0  # idle: no step to abort
        engine.gradient(inputs=x, targets=y)
        assert_exact(model, x, y)


def test_stopped_worker_ends_the_step_in_timeout_and_is_replaced():
    """A worker that cannot run (SIGSTOP: as stuck outside its step loop) never starts the
    step it is picked for: the call ends in EngineTimeoutError at its timeout, the
    coordinator replaces that worker (not the healthy one, which ran its shard), and the
    next call gets the exact gradient."""
    torch.manual_seed(4)
    model = Mlp(d_in=10, d_out=3)
    x, y = torch.randn(40, 10), torch.randint(0, 3, (40,))
    with shmgrad.Engine(model=model, workers=2, loss="cross_entropy") as engine:
        engine.bind(model)
        before = worker_pids(engine)
        os.kill(before[1], signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            with pytest.raises(shmgrad.EngineTimeoutError, match="did not finish within 2 s"):
                engine.gradient(inputs=x, targets=y, timeout=2)
            assert time.monotonic() - t0 < 10
            engine.gradient(inputs=x, targets=y, timeout=STEP_TIMEOUT_S)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(before[1], signal.SIGKILL)
        st = engine.status()
        assert st.worker(1).restarts == 1 and st.worker(0).restarts == 0, st.text
        assert st.worker(0).pid == before[0] and st.worker(1).pid != before[1], st.text
        assert_exact(model, x, y)


@pytest.mark.parametrize("victim", ["first", "last"])
def test_worker_killed_mid_step_step_is_rerun_exactly(victim):
    """A worker SIGKILLed while it works on the step (seen busy in the status): the step is
    aborted, re-run once with the replacement, and its gradient is still exact. Killed:
    the first or the last of 3 workers (1501 examples: uneven shards)."""
    torch.manual_seed(1)
    model = SlowCnn()
    x, y = torch.randn(1501, 1, 28, 28), torch.randint(0, 5, (1501,))
    ref = reference_gradient(model, "cross_entropy", x, y)
    with shmgrad.Engine(model=model, workers=3, loss="cross_entropy") as engine:
        engine.bind(model)
        engine.gradient(inputs=x[:8], targets=y[:8])  # warm up
        before = engine.status()
        slot = 0 if victim == "first" else len(before.ready_workers) - 1
        call = GradientCall(engine, inputs=x, targets=y, timeout=STEP_TIMEOUT_S)
        try:
            wait_until_busy(engine.name, slot=slot, after_epoch=before.step_epoch)
            os.kill(before.worker(slot).pid, signal.SIGKILL)
        finally:
            call.join()
        stats = call.result()
        assert stats.retries == 1
        assert relative_error([p.grad for p in model.parameters()], ref) < 1e-5
        after = engine.status()
        assert after.steps_aborted == before.steps_aborted + 1
        assert after.step_retries == before.step_retries + 1
        # The coordinator counts the restart just after it aborts the step.
        wait_for(
            lambda: engine.status().worker(slot).restarts == before.worker(slot).restarts + 1,
            10,
            f"worker {slot}'s restart to be counted",
        )
        after = engine.status()
        assert after.worker_restarts == before.worker_restarts + 1
        assert after.worker(slot).pid != before.worker(slot).pid
        # The engine keeps serving.
        stats = engine.gradient(inputs=x[:64], targets=y[:64])
        assert stats.num_examples == 64 and stats.retries == 0


def test_workers_dying_on_every_try_give_a_clear_error():
    torch.manual_seed(2)
    model = SlowCnn()
    x, y = torch.randn(1500, 1, 28, 28), torch.randint(0, 5, (1500,))
    with shmgrad.Engine(model=model, workers=2, loss="cross_entropy") as engine:
        engine.bind(model)
        engine.gradient(inputs=x[:8], targets=y[:8])
        before = engine.status()
        call = GradientCall(engine, inputs=x, targets=y, max_retries=0, timeout=STEP_TIMEOUT_S)
        try:
            wait_until_busy(engine.name, slot=0, after_epoch=before.step_epoch)
            os.kill(before.worker(0).pid, signal.SIGKILL)
        finally:
            call.join()
        with pytest.raises(shmgrad.WorkerError, match="died"):
            call.result()
        after = engine.status()
        assert after.steps_aborted == before.steps_aborted + 1
        assert after.step_retries == before.step_retries  # none allowed
        wait_for(lambda: engine.workers == 2, 30, "the replacement worker")
        engine.gradient(inputs=x[:32], targets=y[:32])
        assert_exact(model, x[:32], y[:32])


TRAINER = """
import torch, shmgrad
e = shmgrad.attach({name!r}, timeout=30)
print("attached", flush=True)
x, y = torch.randn(3000, 1, 28, 28), torch.randint(0, 5, (3000,))
while True:
    e.gradient(inputs=x, targets=y)
"""


def slot_processes(engine, slot):
    """Pids of the live (not zombie) processes that run as worker `slot` of `engine`:
    `shmgrad __worker NAME SLOT PPID` or `python -m shmgrad._eager_worker NAME SLOT PPID`."""
    want = ["__worker", engine.name, str(slot)]
    want_eager = ["shmgrad._eager_worker", engine.name, str(slot)]
    pids = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/cmdline", "rb") as f:
                argv = f.read().decode(errors="replace").split("\0")
            if (argv[1:4] == want or argv[2:5] == want_eager) and proc_stat(int(d))[0] != "Z":
                pids.append(int(d))
        except (OSError, IndexError):
            continue  # exited meanwhile
    return pids


@pytest.mark.parametrize("resume_after", [0.5, None])
def test_slot_is_reused_only_after_its_retired_worker_exited(resume_after):
    """A retired worker that has not run since it was retired (here: stopped) must not
    share its slot with a replacement: it would read the new worker's state instead of
    'retired' and serve the slot too, two processes adding into one gradient slot. Growing
    back waits for it to exit; one that does not exit (never resumed) is killed."""
    torch.manual_seed(2)
    model = Mlp(d_in=10, d_out=3)
    x, y = torch.randn(60, 10), torch.randint(0, 3, (60,))
    with shmgrad.Engine(model=model, workers=3, loss="cross_entropy") as engine:
        engine.bind(model)
        old = worker_pids(engine)[2]
        os.kill(old, signal.SIGSTOP)  # idle in its futex wait: it cannot see 'retired'
        try:
            engine.resize(2)
            if resume_after is not None:
                threading.Timer(resume_after, os.kill, (old, signal.SIGCONT)).start()
            engine.resize(3, timeout=60)
        finally:
            try:
                os.kill(old, signal.SIGCONT)
            except ProcessLookupError:
                pass
        assert worker_pids(engine)[2] != old
        time.sleep(0.5)  # time for a stale process to act on what it sees
        assert slot_processes(engine, 2) == [worker_pids(engine)[2]]
        for _ in range(5):
            stats = engine.gradient(inputs=x, targets=y, min_examples_per_worker=1)
            assert stats.workers == 3
            assert_exact(model, x, y)
        if resume_after is None:
            log = engine.log()
            assert "did not exit" in log, log


def test_worker_retired_while_starting_does_not_come_up():
    """A shrink that arrives while a new worker is still starting retires that worker: it
    exits instead of turning 'ready' over the retirement."""
    torch.manual_seed(3)
    model = Mlp(d_in=10, d_out=3)
    x, y = torch.randn(30, 10), torch.randint(0, 3, (30,))
    with shmgrad.Engine(model=model, workers=1, max_workers=2, loss="cross_entropy") as engine:
        engine.bind(model)
        shmgrad._C.request_resize(engine.name, 2)
        wait_for(
            lambda: getattr(engine.status().worker(1), "state", None) == "starting",
            30,
            "worker 1 to start",
        )
        shmgrad._C.request_resize(engine.name, 1)
        wait_for(lambda: not slot_processes(engine, 1), 30, "the retired worker 1 to exit")
        assert engine.workers == 1
        stats = engine.gradient(inputs=x, targets=y, min_examples_per_worker=1)
        assert stats.workers == 1
        assert_exact(model, x, y)


def test_log_keeps_what_serve_writes_while_it_is_read():
    """serve writes its log through a descriptor that shares the file offset with the
    one Engine.log() reads: a message written while a read has moved that offset (here,
    to the start) must land at the end, not over what is there."""
    torch.manual_seed(4)
    model = Mlp(d_in=10, d_out=3)
    with shmgrad.Engine(model=model, workers=1, loss="cross_entropy") as engine:
        pid = worker_pids(engine)[0]
        os.kill(pid, signal.SIGKILL)
        wait_for(lambda: f"(pid {pid}) died" in engine.log(), 30, "the first death's message")
        before = engine.log()
        os.lseek(engine._server._launcher._log.fileno(), 0, os.SEEK_SET)  # a read's seek
        wait_for(lambda: worker_pids(engine).get(0, pid) != pid, 30, "a replacement")
        pid = worker_pids(engine)[0]
        os.kill(pid, signal.SIGKILL)
        wait_for(lambda: f"(pid {pid}) died" in engine.log(), 30, "the second death's message")
        assert engine.log().startswith(before), engine.log()


@contextlib.contextmanager
def served_slow_cnn(tmp_path, name, model):
    """`shmgrad serve` of ``model`` (2 TorchScript workers) as engine ``name``; stopped
    after."""
    path = shmgrad.save_model(model, tmp_path / "m.pt")
    serve = subprocess.Popen(
        ["shmgrad", "serve", "--name", name, "--model", str(path), "--workers", "2"]
        + ["--loss", "cross_entropy", "--quiet"]
    )
    try:
        yield
    finally:
        subprocess.run(["shmgrad", "stop", name], capture_output=True, timeout=60)
        serve.wait(timeout=30)


@contextlib.contextmanager
def child_trainer(name):
    """A child process attached to engine ``name``, running big steps in a loop; SIGKILLed
    at the end of the block."""
    code = TRAINER.format(name=name)
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "attached"
        yield child
    finally:
        child.kill()
        child.wait()
        child.stdout.close()


def test_killed_trainer_frees_the_engine(tmp_path):
    """A trainer SIGKILLed while a worker is busy with its step: the next trainer attaches
    at once (the lease is taken over), and its gradients are exact."""
    torch.manual_seed(3)
    model = SlowCnn()
    with served_slow_cnn(tmp_path, "trainer-kill", model):
        with child_trainer("trainer-kill") as child:
            wait_until_busy("trainer-kill", after_epoch=0, trainer_pid=child.pid)
        t0 = time.monotonic()
        engine = shmgrad.attach("trainer-kill", timeout=5)
        assert time.monotonic() - t0 < 1.0
        assert engine.status().trainer_pid == os.getpid()
        engine.bind(model)
        x, y = torch.randn(20, 1, 28, 28), torch.randint(0, 5, (20,))
        stats = engine.gradient(inputs=x, targets=y)
        assert stats.num_examples == 20
        assert_exact(model, x, y)
        engine.close()


def test_worker_stopped_in_a_killed_trainers_step_is_replaced(tmp_path):
    """A worker stopped (SIGSTOP) while busy with a trainer's step, then that trainer
    SIGKILLed: the next trainer's first call waits for the worker before it publishes and
    ends in EngineTimeoutError at its timeout, giving that step up; the coordinator
    replaces the worker (not the other), and the next call gets the exact gradient."""
    torch.manual_seed(5)
    model = SlowCnn()
    victim = None
    with served_slow_cnn(tmp_path, "trainer-kill", model):
        try:
            with child_trainer("trainer-kill") as child:
                # Stop a worker while it is busy (its record, frozen, says so).
                for _ in range(20):
                    st = wait_until_busy("trainer-kill", after_epoch=0, trainer_pid=child.pid)
                    busy = [w for w in st.ready_workers if w.busy_epoch > 0]
                    victim, slot = busy[0].pid, busy[0].slot
                    os.kill(victim, signal.SIGSTOP)
                    wait_for(lambda: proc_stat(victim)[0] == "T", 10, "the worker to stop")
                    if shmgrad.read_status("trainer-kill").worker(slot).busy_epoch > 0:
                        break
                    os.kill(victim, signal.SIGCONT)
                else:
                    pytest.fail("no worker could be stopped while busy")
            engine = shmgrad.attach("trainer-kill", timeout=5)
            engine.bind(model)
            x, y = torch.randn(20, 1, 28, 28), torch.randint(0, 5, (20,))
            with pytest.raises(shmgrad.EngineTimeoutError, match="busy with an earlier step"):
                engine.gradient(inputs=x, targets=y, timeout=2)
            engine.gradient(inputs=x, targets=y, timeout=STEP_TIMEOUT_S)
            st = engine.status()
            assert st.worker(slot).pid != victim and st.worker(slot).restarts == 1, st.text
            assert st.worker(1 - slot).restarts == 0, st.text
            assert_exact(model, x, y)
            engine.close()
        finally:
            if victim is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(victim, signal.SIGKILL)


def test_a_worker_that_fails_at_every_start_is_retried_with_a_growing_pause(tmp_path):
    # The worker's program broken under a running engine (a reinstall, say): every restart
    # fails at once. The coordinator backs off (at once, then 0.1 s doubling to 5 s) and
    # says so, instead of restarting thousands of times a second, and serves again once the
    # program is back.
    worker = os.path.join(os.path.dirname(shmgrad.program("shmgrad")), "shmgrad-worker")
    wrapper = tmp_path / "worker.sh"

    def set_wrapper(body):
        new = tmp_path / "worker.sh.new"
        new.write_text("#!/bin/sh\n" + body + "\n")
        new.chmod(0o755)
        os.replace(new, wrapper)  # never a half-written script

    set_wrapper(f'exec "{worker}" "$@"')
    path = shmgrad.save_model(Mlp(d_in=4, d_out=2), tmp_path / "m.pt")
    name = f"backoff-{os.getpid()}"
    serve = subprocess.Popen(
        ["shmgrad", "serve", "--name", name, "--model", str(path), "--workers", "1"]
        + ["--loss", "cross_entropy", "--quiet", "--worker-binary", str(wrapper)],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        engine = shmgrad.attach(name, timeout=60)
        (pid,) = worker_pids(engine).values()
        set_wrapper("exit 3")
        os.kill(pid, signal.SIGKILL)
        time.sleep(3)
        # At once twice, then after 0.1, 0.2, 0.4, 0.8 and 1.6 s: 7 in 3 s, with room for a
        # slow machine; without the pause it was thousands.
        restarts = shmgrad.read_status(name).worker_restarts
        assert 3 <= restarts <= 10, restarts
        set_wrapper(f'exec "{worker}" "$@"')
        x, y = torch.randn(5, 4), torch.randint(0, 2, (5,))
        wait_for(lambda: shmgrad.read_status(name).ready_workers, 20, "the worker back")
        assert engine.gradient(inputs=x, targets=y).num_examples == 5
        engine.close()
    finally:
        subprocess.run(["shmgrad", "stop", name], capture_output=True, timeout=60)
        _, err = serve.communicate(timeout=30)
    assert (
        "failed to start 2 times in a row (last: exit code 3 (start-up failed)); next try in 0.1 s"
        in err
    ), err


def test_killed_coordinator_workers_exit_and_name_is_reusable(tmp_path):
    path = shmgrad.save_model(Mlp(d_in=4, d_out=2), tmp_path / "m.pt")
    cmd = [
        "shmgrad",
        "serve",
        "--name",
        "coord-kill",
        "--model",
        str(path),
        "--workers",
        "2",
        "--loss",
        "cross_entropy",
        "--quiet",
    ]
    serve = subprocess.Popen(cmd)
    engine = shmgrad.attach("coord-kill", timeout=60)
    pids = list(worker_pids(engine).values())
    engine.close()
    serve.kill()
    serve.wait()
    for pid in pids:
        wait_for(
            lambda: not os.path.exists(f"/proc/{pid}") or proc_stat(pid)[0] == "Z",
            10,
            f"worker {pid} to exit",
        )
    # The stale segment is detected, removed, and a new engine of the same name starts.
    serve = subprocess.Popen(cmd)
    try:
        engine = shmgrad.attach("coord-kill", timeout=60)
        x, y = torch.randn(3, 4), torch.randint(0, 2, (3,))
        assert engine.gradient(inputs=x, targets=y).num_examples == 3
        engine.close()
    finally:
        subprocess.run(["shmgrad", "stop", "coord-kill"], capture_output=True, timeout=60)
        serve.wait(timeout=30)
    assert not [s for s in segments() if s.endswith("-coord-kill")]


def test_stranger_cannot_attach_or_read():
    if os.getuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv to act as another uid (CI runs as root)")
    model = Mlp(d_in=4, d_out=2)
    with shmgrad.Engine(model=model, workers=1, loss="cross_entropy", name="stranger") as engine:
        path = shmgrad._C.segment_path("stranger")
        assert os.stat(path).st_mode & 0o777 == 0o600
        as_nobody = ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups"]
        read = subprocess.run(as_nobody + ["cat", path], capture_output=True, timeout=30)
        assert read.returncode != 0 and b"Permission denied" in read.stderr
        # The stranger's own name lookup sees a different segment (the uid is in the name)...
        binary = shmgrad.program("shmgrad")
        other = subprocess.run(
            as_nobody + [binary, "status", "stranger"], capture_output=True, text=True, timeout=30
        )
        assert other.returncode != 0 and "no engine named" in other.stderr, other.stderr
        # ...and opening the owner's file directly is refused by the kernel.
        code = (
            f"import os\ntry:\n os.open({path!r}, os.O_RDWR)\n"
            "except PermissionError:\n print('denied')"
        )
        direct = subprocess.run(
            as_nobody + ["/usr/bin/python3", "-c", code], capture_output=True, text=True, timeout=30
        )
        assert "denied" in direct.stdout
        assert (
            engine.gradient(inputs=torch.randn(2, 4), targets=torch.tensor([0, 1])).num_examples
            == 2
        )


def test_corrupt_segment_is_refused_not_crashed(tmp_path):
    name = "corrupt-test"
    path = f"/dev/shm/shmgrad-{os.getuid()}-{name}"
    with open(path, "wb") as f:
        f.write(b"\x00" * (1 << 20))
    os.chmod(path, 0o600)
    try:
        with pytest.raises(shmgrad.CorruptSegmentError, match="magic"):
            shmgrad.attach(name, timeout=0.1)
        # serve replaces it (no live coordinator holds it).
        model_path = shmgrad.save_model(Mlp(d_in=4, d_out=2), tmp_path / "m.pt")
        with shmgrad.Engine(model=str(model_path), workers=1, loss="cross_entropy", name=name) as e:
            assert (
                e.gradient(inputs=torch.randn(2, 4), targets=torch.tensor([0, 1])).num_examples == 2
            )
    finally:
        if os.path.exists(path):
            os.unlink(path)


def test_no_space_is_a_clear_error():
    free = shutil.disk_usage("/dev/shm").free
    with pytest.raises(shmgrad.NoSpaceError, match="/dev/shm") as info:
        shmgrad.Engine(
            model=Mlp(d_in=4, d_out=2),
            workers=1,
            loss="mse",
            input_capacity_mb=free // (1 << 20) + 1024,
        )
    assert "free" in str(info.value)


def test_nonfinite_values_are_reported_with_the_worker():
    model = Mlp(d_in=4, d_out=2)
    x, y = torch.randn(6, 4), torch.randint(0, 2, (6,))
    x[5, 0] = float("nan")  # in the last worker's shard
    with shmgrad.Engine(model=model, workers=2, loss="cross_entropy") as engine:
        engine.bind(model)
        stats = engine.gradient(inputs=x, targets=y)
        assert stats.nonfinite and stats.nonfinite_workers == [1]
        with pytest.raises(shmgrad.NonFiniteError, match="worker 1"):
            engine.gradient(inputs=x, targets=y, raise_on_nonfinite=True)
        stats = engine.gradient(inputs=x[:5], targets=y[:5], raise_on_nonfinite=True)
        assert not stats.nonfinite


class _HugeOutput(torch.nn.Module):
    """Outputs near 3e38 times its layer: with nll, each example adds -3e38 to the bias's
    gradient (finite alone, infinite for two), and nothing to the weight's (inputs 0)."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(2, 2)
        with torch.no_grad():
            self.fc.weight.zero_()
            self.fc.bias.fill_(1e-3)

    def forward(self, x):
        return self.fc(x) * 3e38


@pytest.mark.parametrize("mode", ["script", "eager"])
def test_one_worker_finds_a_nonfinite_gradient_in_one_pass_and_across_passes(mode):
    # One worker: its slot is the result, and each parameter's hook checks what it writes
    # (so the result is not read again); a later pass's addition must undo that check.
    x, y = torch.zeros(2, 2), torch.zeros(2, dtype=torch.long)
    with shmgrad.Engine(model=_HugeOutput(), workers=1, loss="nll", mode=mode) as engine:
        grads = engine.gradient_tensors()
        st = engine.gradient(inputs=x[:1], targets=y[:1])
        assert not st.nonfinite and grads[1][0].item() == pytest.approx(-3e38, rel=1e-6)
        st = engine.gradient(inputs=x, targets=y)  # -6e38 within backward
        assert st.nonfinite and st.nonfinite_workers == [0] and math.isinf(grads[1][0].item())
        st = engine.gradient(inputs=x, targets=y, max_examples_per_pass=1)  # summed across
        assert st.nonfinite and st.nonfinite_workers == [0] and math.isinf(grads[1][0].item())
        with pytest.raises(shmgrad.NonFiniteError, match="worker 0"):
            engine.gradient(inputs=x, targets=y, max_examples_per_pass=1, raise_on_nonfinite=True)
        assert not engine.gradient(inputs=x[1:], targets=y[1:]).nonfinite
