"""workers="auto": the trainer times workers x threads per worker on its first steps and
keeps the fastest (engine/placement.h; issue 38). The probe's choice itself depends on
the machine's speed: these tests check what it ran, what it says and that every step's
gradient is exact, not which placement won."""

import subprocess
import time

import pytest
import torch

import shmgrad
from shmgrad import _C

CORES = _C.physical_cores()
needs_two_cores = pytest.mark.skipif(
    CORES < 2, reason=f"a placement probe needs 2 or more cores; this machine has {CORES}"
)


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))


def _batch(n=24, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 12, generator=g), torch.randint(0, 3, (n,), generator=g)


def _reference(model, x, y):
    ref = _mlp()
    ref.load_state_dict(model.state_dict())
    torch.nn.functional.cross_entropy(ref(x), y, reduction="sum").backward()
    return [p.grad for p in ref.parameters()]


def _threads_forward(model, batch):
    """Eager workers' forward: the loss summed over the shard, plus 1000 x (this worker's
    intra-op threads)^2, a constant (no gradient) that the step's loss reports: one worker
    with 2 threads adds 4000, two with 1 thread each 2000."""
    x, y = batch
    loss = torch.nn.functional.cross_entropy(model(x), y, reduction="sum")
    return loss + 1000.0 * torch.get_num_threads() ** 2


@needs_two_cores
def test_auto_probes_real_steps_keeps_one_and_every_gradient_is_exact():
    model = _mlp()
    x, y = _batch()
    with shmgrad.Engine(
        model=model,
        workers="auto",
        loss="cross_entropy",
        mode="eager",
        forward=_threads_forward,
        loss_reduction="sum",
    ) as engine:
        engine.bind(model)
        st = engine.status()
        assert st.threads_per_worker == CORES and len(st.workers) == CORES, st.text
        assert st.placement == "probing", st.text
        ran = []
        real = torch.nn.functional.cross_entropy(model(x), y, reduction="sum").item()
        reference = _reference(model, x, y)  # no optimizer step: the same every step
        deadline = time.monotonic() + 60
        # The probe settles and times each visit for 50 ms: a few hundred steps this small.
        while time.monotonic() < deadline:
            stats = engine.gradient(inputs=x, targets=y)
            # The placement this step ran with (the next step's is set as it starts, once
            # this one's time to it is known).
            after = engine.status()
            # The workers computed with the threads the placement says, every step.
            placed = after.placement_threads
            # The trainer computing the step itself (python/shmgrad/_in_trainer.py) is one
            # participant with every core's thread.
            workers = 1 if after.placement_in_trainer else (after.placement_workers or CORES)
            assert stats.workers == workers, (len(ran), after.text)
            assert stats.loss - real == pytest.approx(1000.0 * stats.workers * placed**2, abs=0.5)
            ran.append((after.placement_workers, placed))
            for got, want in zip(model.parameters(), reference):
                torch.testing.assert_close(got.grad, want, rtol=1e-5, atol=1e-6)
            if after.placement == "chosen":
                break
        st = engine.status()
        assert st.placement == "chosen", f"still probing after {len(ran)} steps: {st.text}"
        candidates = {(1, CORES), (CORES, 1), (0, CORES)}  # (0, CORES): the trainer's
        assert candidates <= set(ran), ran  # both ends and the trainer were tried
        probe = {(c["workers"], c["threads_per_worker"]): c for c in st.placement_probe}
        assert candidates <= set(probe), st.placement_probe
        assert all(c["steps"] >= 1 and c["ms_per_example"] > 0 for c in probe.values()), probe
        chosen = (st.placement_workers, st.placement_threads)
        assert chosen in probe, (chosen, probe)
        best = min(c["ms_per_example"] for c in probe.values())
        assert probe[chosen]["ms_per_example"] <= best * 1.01 + 1e-12, probe
        assert "placement probe:" in st.placement_report and "chosen" in st.placement_report
        assert "placement chosen:" in st.text, st.text
        assert "placement probe:" in engine.log(), engine.log()
        # Later steps keep the choice.
        for _ in range(3):
            stats = engine.gradient(inputs=x, targets=y)
            real = torch.nn.functional.cross_entropy(model(x), y, reduction="sum").item()
            assert stats.workers == (1 if st.placement_in_trainer else chosen[0] or CORES)
            assert stats.loss - real == pytest.approx(
                1000.0 * stats.workers * chosen[1] ** 2, abs=0.5
            )


@needs_two_cores
def test_a_later_trainer_keeps_the_choice_and_resize_fixes_the_placement():
    model = _mlp()
    x, y = _batch()
    server = shmgrad.serve(model=model, workers="auto", loss="cross_entropy", mode="script")
    try:
        with shmgrad.attach(server.name) as first:
            first.gradient_tensors()  # read directly: no module is bound
            deadline = time.monotonic() + 60
            while first.status().placement == "probing" and time.monotonic() < deadline:
                first.gradient(inputs=x, targets=y)
            st = first.status()
            assert st.placement == "chosen", st.text
            # The trainer's own placement too (a TorchScript engine's trainer computes
            # through a replica of its own): the next trainer loads one and keeps it.
            chosen = (st.placement_workers, st.placement_threads, st.placement_in_trainer)
        with shmgrad.attach(server.name) as second:
            second.gradient_tensors()
            st = second.status()
            assert (
                st.placement == "chosen"
                and (
                    st.placement_workers,
                    st.placement_threads,
                    st.placement_in_trainer,
                )
                == chosen
            ), st.text
            assert st.placement_probe == ()  # no probe of its own
            stats = second.gradient(inputs=x, targets=y)
            assert stats.workers == (1 if chosen[2] else chosen[0] or CORES)
            # resize: the count asked for, the cores shared among them, from now on.
            second.resize(1)
            st = second.status()
            assert (st.placement, st.placement_workers, st.placement_threads) == (
                "fixed",
                0,
                CORES,
            ), st.text
            stats = second.gradient(inputs=x, targets=y)
            assert stats.workers == 1
            torch.testing.assert_close(
                second.gradient_tensors()[0], _reference(model, x, y)[0], rtol=1e-5, atol=1e-6
            )
    finally:
        server.stop()


def test_auto_refuses_what_would_fix_the_placement():
    model = _mlp()
    with pytest.raises(shmgrad.InvalidArgumentError, match="threads_per_worker"):
        shmgrad.Engine(model=model, workers="auto", loss="cross_entropy", threads_per_worker=2)
    with pytest.raises(shmgrad.InvalidArgumentError, match="devices="):
        shmgrad.Engine(model=model, workers="auto", loss="cross_entropy", devices=["cuda:0"])
    with pytest.raises(shmgrad.InvalidArgumentError, match='positive int or "auto"'):
        shmgrad.Engine(model=model, workers="many", loss="cross_entropy")


@pytest.mark.parametrize(
    "args, message",
    [
        (["--workers", "auto", "--threads-per-worker", "2"], "leave out --threads-per-worker"),
        (["--workers", "lots"], "must be 1 to"),
        (["--workers", "0"], "must be 1 to"),
    ],
)
def test_serve_refuses_bad_workers(tmp_path, args, message):
    out = subprocess.run(
        [
            shmgrad.program("shmgrad"),
            "serve",
            "--name",
            "placement-bad",
            "--model",
            str(tmp_path / "none.pt"),
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode != 0 and message in out.stderr, out.stderr


def _context_switches(pid):
    with open(f"/proc/{pid}/status") as f:
        return sum(int(line.split()[1]) for line in f if "ctxt_switches" in line)


def test_workers_a_step_leaves_out_are_not_woken_by_every_step():
    """A step that takes one worker of three (a small batch, as a placement would) wakes
    the other two once, when the first step goes on without them, not every step: their
    context switches over 100 such steps stay far below 100 (each wait also ends every
    200 ms to check the coordinator)."""
    model = _mlp()
    x, y = _batch(4)
    with shmgrad.Engine(
        model=model, workers=3, loss="cross_entropy", mode="script", min_examples_per_worker=4
    ) as engine:
        engine.gradient_tensors()
        for _ in range(5):
            assert engine.gradient(inputs=x, targets=y).workers == 1
        st = engine.status()
        idle = [w.pid for w in st.workers[1:]]  # the step takes the first ready worker
        before = {pid: _context_switches(pid) for pid in idle}
        t0 = time.monotonic()
        for _ in range(100):
            assert engine.gradient(inputs=x, targets=y).workers == 1
        slices = (time.monotonic() - t0) / 0.2 + 2  # the 200 ms liveness checks
        woken = {pid: _context_switches(pid) - n for pid, n in before.items()}
        for pid in idle:
            assert woken[pid] <= slices + 5, (woken, slices)


# -- the trainer's intra-op threads (trainer_threads=, python/shmgrad/_threads.py) --------
def _linear_engine(**kw):
    return shmgrad.Engine(model=torch.nn.Linear(4, 2), workers=1, loss="mse", **kw)


def test_trainer_threads_auto_leaves_the_workers_their_cores_and_close_restores():
    """ "auto": the trainer keeps only the cores the workers leave free (at least 1), so
    that its idle intra-op threads do not spin on the workers' cores; close() restores."""
    before = torch.get_num_threads()
    torch.set_num_threads(CORES + 3)
    try:
        with _linear_engine(threads_per_worker=1) as engine:
            want = max(1, CORES - 1)  # one worker of one thread
            assert engine.trainer_threads == want
            assert torch.get_num_threads() == want
        assert torch.get_num_threads() == CORES + 3
        # A worker per core: the trainer runs on one thread.
        with shmgrad.Engine(
            model=torch.nn.Linear(4, 2), workers=1, threads_per_worker=CORES, loss="mse"
        ) as engine:
            assert engine.trainer_threads == 1 and torch.get_num_threads() == 1
        assert torch.get_num_threads() == CORES + 3
    finally:
        torch.set_num_threads(before)


def test_trainer_threads_explicit_none_nested_and_changed_by_the_caller():
    before = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        with _linear_engine(trainer_threads=None) as engine:
            assert engine.trainer_threads is None and torch.get_num_threads() == 3
        with _linear_engine(trainer_threads=2) as a:
            assert torch.get_num_threads() == 2
            with _linear_engine(trainer_threads=1) as b:  # the smallest holds
                assert torch.get_num_threads() == 1 and b.trainer_threads == 1
            assert torch.get_num_threads() == 2 and a.trainer_threads == 2
        assert torch.get_num_threads() == 3
        # The caller's own setting made while an engine is open stands after close().
        with _linear_engine(trainer_threads=1):
            torch.set_num_threads(2)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("bad", [0, -1, 1.5, "all", True])
def test_trainer_threads_refused_before_anything_starts(bad):
    before = torch.get_num_threads()
    with pytest.raises(shmgrad.InvalidArgumentError, match="trainer_threads must be"):
        _linear_engine(trainer_threads=bad)
    assert torch.get_num_threads() == before
    with pytest.raises(shmgrad.InvalidArgumentError, match="trainer_threads must be"):
        shmgrad.attach("no-such-engine", trainer_threads=bad)


def test_trainer_threads_through_attach():
    """A client attached to an engine served apart holds the trainer's threads the same
    way, and its close() restores them (the engine keeps serving)."""
    before = torch.get_num_threads()
    torch.set_num_threads(CORES + 1)
    try:
        with shmgrad.serve(
            model=torch.nn.Linear(4, 2), workers=1, threads_per_worker=CORES, loss="mse"
        ) as server:
            with shmgrad.attach(server.name) as client:
                assert client.trainer_threads == 1 and torch.get_num_threads() == 1
            assert torch.get_num_threads() == CORES + 1
            with shmgrad.attach(server.name, trainer_threads=None) as client:
                assert torch.get_num_threads() == CORES + 1
    finally:
        torch.set_num_threads(before)


def test_trainer_threads_release_inside_hold_does_not_deadlock(monkeypatch):
    """A dropped client's close() can run from the garbage collector inside hold() on the
    same thread: the registry's lock is reentrant (a plain Lock hangs here)."""
    import threading

    from shmgrad import _threads

    before = torch.get_num_threads()
    _threads.hold("a", 1, "a")
    real = torch.get_num_threads

    def collecting():
        monkeypatch.setattr(torch, "get_num_threads", real)
        _threads.release("a")  # as a client's __del__ would, mid-hold
        return real()

    monkeypatch.setattr(torch, "get_num_threads", collecting)
    done = threading.Thread(target=_threads.hold, args=("b", 1, "b"), daemon=True)
    done.start()
    done.join(10)
    assert not done.is_alive(), "hold() deadlocked on a release from inside it"
    _threads.release("b")
    assert _threads.held("a") is None and _threads.held("b") is None
    assert torch.get_num_threads() == before
