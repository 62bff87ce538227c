"""The in-trainer placement (python/shmgrad/_in_trainer.py, engine/placement.h; issue 38):
an engine served with workers="auto" on the host (eager or TorchScript workers) lets the
trainer compute a step itself, in the engine's trainer slot, under the same step protocol
as a worker.
These tests put the engine on that placement explicitly (the probe's choice depends on the
machine) and check that each step ran in this process, and that its gradient, loss,
buffers and statistics are a worker's: against one process of plain PyTorch, and bit for
bit against one worker alone."""

import gc
import os
import time

import pytest
import torch

import shmgrad
from shmgrad import _C

CORES = _C.physical_cores()
PID_ENV = "SHMGRAD_TEST_TRAINER_PID"


class Net(torch.nn.Module):
    """Linear layers (computed in place), a BatchNorm (shared buffers) and a branch that a
    flag leaves unused."""

    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(6, 10)
        self.bn = torch.nn.BatchNorm1d(10)
        self.fc2 = torch.nn.Linear(10, 3, bias=False)
        self.unused = torch.nn.Linear(3, 3)

    def forward(self, x):
        return self.fc2(torch.tanh(self.bn(self.fc1(x))))


def _net():
    torch.manual_seed(0)
    return Net()


def _where_forward(model, batch):
    """The loss summed over the shard, plus 1000 where this process is the trainer (its pid,
    which every worker reads from the environment it inherited): a constant without a
    gradient, which says in the step's loss who computed it."""
    x, y = batch
    loss = torch.nn.functional.cross_entropy(model(x), y, reduction="sum")
    return loss + (1000.0 if os.getpid() == int(os.environ[PID_ENV]) else 0.0)


def _batch(n=20, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g)


def _reference(model, x, y, scale=1.0):
    """One process of plain PyTorch from the bound module's state: the module with its
    gradient, and the loss."""
    ref = _net()
    ref.load_state_dict(model.state_dict())
    ref.train(model.training)
    loss = torch.nn.functional.cross_entropy(ref(x), y, reduction="sum")
    (scale * loss).backward()
    ref.loss = loss.item()
    return ref


def _auto_engine(forward):
    """An engine of Net with workers="auto" and eager workers, whose forward is ``forward``."""
    return shmgrad.Engine(
        model=_net(),
        workers="auto",
        loss="cross_entropy",
        mode="eager",
        forward=forward,
        loss_reduction="sum",
    )


@pytest.fixture
def engine(monkeypatch):
    monkeypatch.setenv(PID_ENV, str(os.getpid()))
    with _auto_engine(_where_forward) as e:
        yield e


def _place(engine, in_trainer):
    if in_trainer:
        engine._trainer.set_placement(0, CORES, in_trainer=True)
    else:
        engine._trainer.set_placement(1, CORES)


def test_the_trainer_computes_a_workers_step_exactly(engine):
    model = engine.bind(_net())
    x, y = _batch()
    x2, y2 = _batch(seed=2)
    runs = {}
    for in_trainer in (True, False, True):
        _place(engine, in_trainer)
        model.train()
        model.bn.running_mean.zero_()
        model.bn.running_var.fill_(1.0)
        model.bn.num_batches_tracked.zero_()
        ref = _reference(model, x, y)
        stats = engine.gradient(inputs=x, targets=y)
        buffers = [b.clone() for b in model.buffers()]
        assert stats.workers == 1
        assert stats.loss - ref.loss == pytest.approx(1000.0 if in_trainer else 0.0, abs=0.01)
        for (name, got), want in zip(model.named_parameters(), ref.parameters()):
            if name.startswith("unused."):
                assert got.grad is None, name  # as plain backward leaves it
                continue
            torch.testing.assert_close(got.grad, want.grad, rtol=1e-5, atol=1e-6)
        assert stats.unused_params == [5, 6]
        grads = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
        runs.setdefault(in_trainer, []).append((grads, buffers))
        # Accumulated over two batches, in passes of 7: the sum of both (in eval mode, where
        # BatchNorm adds no dependence between examples).
        model.eval()
        engine.gradient(inputs=x, targets=y, max_examples_per_pass=7)
        engine.gradient(inputs=x2, targets=y2, max_examples_per_pass=7, accumulate=True)
        both = _reference(model, torch.cat([x, x2]), torch.cat([y, y2]))
        for (name, got), want in zip(model.named_parameters(), both.parameters()):
            if not name.startswith("unused."):
                torch.testing.assert_close(got.grad, want.grad, rtol=1e-5, atol=1e-5)
        # A mean with a loss scale, as a GradScaler asks for it.
        stats = engine.gradient(inputs=x, targets=y, reduction="mean", loss_scale=8.0)
        mean = _reference(model, x, y, scale=8.0 / len(x))
        for (name, got), want in zip(model.named_parameters(), mean.parameters()):
            if not name.startswith("unused."):
                torch.testing.assert_close(got.grad, want.grad, rtol=1e-5, atol=1e-6)
    # The same bits and the same shared BatchNorm statistics as one worker alone.
    (g_in, b_in), (g_in2, b_in2) = runs[True]
    ((g_w, b_w),) = runs[False]
    for a, b, c in zip(g_in, g_w, g_in2):
        assert (a is None) == (b is None) == (c is None)
        if a is not None:
            assert torch.equal(a, b) and torch.equal(a, c)
    for a, b, c in zip(b_in, b_w, b_in2):
        assert torch.equal(a, b) and torch.equal(a, c)
    st = engine.status()
    assert st.placement_in_trainer and st.placement_workers == 0, st.text
    assert "the trainer computes" in st.text, st.text


def _dict_forward(model, batch):
    """A structured batch, {"x", "y", "seen"}: the loss summed over the shard; marks the
    shard's rows of "seen" in place, as a forward may change what it is given."""
    batch["seen"].fill_(1)
    return torch.nn.functional.cross_entropy(model(batch["x"]), batch["y"], reduction="sum")


def test_a_structured_batch_is_read_where_the_trainer_holds_it():
    """The trainer's own step reads a batch= dict's tensors where the caller holds them
    (its forward's in-place change shows in the caller's tensor, as in one process); a
    worker's step reads the engine's copy in shared memory. The gradients are the same."""
    with _auto_engine(_dict_forward) as engine:
        model = engine.bind(_net())
        x, y = _batch()
        ref = _reference(model, x, y)
        got = {}
        for in_trainer in (True, False):
            _place(engine, in_trainer)
            seen = torch.zeros(len(x), dtype=torch.int64)
            stats = engine.gradient(batch={"x": x, "y": y, "seen": seen})
            assert stats.workers == 1
            assert (stats.worker_slots == [engine._trainer.slot_count()]) == in_trainer
            assert stats.loss == pytest.approx(ref.loss, abs=1e-3)
            assert torch.equal(seen, torch.full_like(seen, 1 if in_trainer else 0)), seen
            got[in_trainer] = [
                None if p.grad is None else p.grad.clone() for p in model.parameters()
            ]
            for (name, g), want in zip(model.named_parameters(), ref.parameters()):
                if not name.startswith("unused."):
                    torch.testing.assert_close(g.grad, want.grad, rtol=1e-5, atol=1e-6)
        for a, b in zip(got[True], got[False]):
            assert (a is None and b is None) or torch.equal(a, b)


def test_an_error_in_the_trainers_step_is_raised_and_the_engine_goes_on(engine):
    model = engine.bind(_net())
    _place(engine, True)
    x, y = _batch()
    with pytest.raises(shmgrad.WorkerError, match="mat1 and mat2 shapes cannot be multiplied"):
        engine.gradient(inputs=torch.randn(4, 5), targets=y[:4])
    real = _reference(model, x, y).loss
    stats = engine.gradient(inputs=x, targets=y)
    assert stats.loss - real == pytest.approx(1000.0, abs=0.01)
    # A NaN from the trainer's step is found as a worker's is.
    with pytest.raises(shmgrad.NonFiniteError):
        engine.gradient(inputs=x * float("nan"), targets=y, raise_on_nonfinite=True)


SLOW_ENV = "SHMGRAD_TEST_SLOW_IN"


def _slowed_forward(model, batch):
    """_where_forward, 3 ms slower where $SHMGRAD_TEST_SLOW_IN says ("trainer" or
    "workers"): the probe's choice made certain."""
    import time

    in_trainer = os.getpid() == int(os.environ[PID_ENV])
    if (os.environ[SLOW_ENV] == "trainer") == in_trainer:
        time.sleep(0.003)
    return _where_forward(model, batch)


@pytest.mark.skipif(CORES < 2, reason=f"a placement probe needs 2 or more cores; {CORES} here")
@pytest.mark.parametrize("slow", ["workers", "trainer"])
def test_the_probe_times_the_trainer_and_threads_follow_the_choice(monkeypatch, slow):
    monkeypatch.setenv(PID_ENV, str(os.getpid()))
    monkeypatch.setenv(SLOW_ENV, slow)
    before = torch.get_num_threads()
    engine = _auto_engine(_slowed_forward)
    try:
        model = engine.bind(_net())
        st = engine.status()
        assert st.placement == "probing", st.text
        assert torch.get_num_threads() == 1  # the workers' cores are left to them
        x, y = _batch()
        seen = set()
        for _ in range(2000):
            real = _reference(model, x, y).loss
            stats = engine.gradient(inputs=x, targets=y)
            st = engine.status()  # the placement this step ran with
            in_trainer = stats.loss - real > 500
            assert in_trainer == st.placement_in_trainer, st.text
            seen.add(in_trainer)
            if st.placement != "probing":
                break
        assert st.placement == "chosen", st.text
        assert seen == {True, False}, seen
        assert any(c["in_trainer"] for c in st.placement_probe), st.placement_probe
        assert "trainer x" in st.placement_report, st.placement_report
        # The faster one is kept, and the trainer's threads follow: all it had where it
        # computes the steps itself, the cores the workers leave (1) otherwise.
        assert st.placement_in_trainer == (slow == "workers"), st.placement_report
        if slow == "workers":
            assert "chosen: the trainer computes" in st.placement_report
            assert torch.get_num_threads() == before
            stats = engine.gradient(inputs=x, targets=y)
            assert stats.worker_slots == [engine._trainer.slot_count()]
            # A resize hands the steps to the workers again, and their cores with them.
            engine.resize(2)
            assert not engine.status().placement_in_trainer
            assert torch.get_num_threads() == 1
            stats = engine.gradient(inputs=x, targets=y)
            assert stats.workers == 2 and stats.loss < 500  # not the trainer's
        else:
            assert torch.get_num_threads() == 1
    finally:
        engine.close()
    assert torch.get_num_threads() == before


FLIP_ENV = "SHMGRAD_TEST_FLIP_FILE"


def _flipping_forward(model, batch):
    """_where_forward, 3 ms slower in the trainer until the file $SHMGRAD_TEST_FLIP_FILE
    exists, in the workers from then on: a machine whose faster placement changes."""
    import time

    in_trainer = os.getpid() == int(os.environ[PID_ENV])
    if os.path.exists(os.environ[FLIP_ENV]) != in_trainer:
        time.sleep(0.003)
    return _where_forward(model, batch)


@pytest.mark.skipif(CORES < 2, reason=f"a placement probe needs 2 or more cores; {CORES} here")
def test_a_kept_placement_that_turns_slow_is_rechecked(monkeypatch, tmp_path):
    """The probe keeps the workers (the trainer is slower then); once they turn slower than
    the trainer was, the watch of the kept placement runs the probe again, which keeps the
    trainer, and the trainer's threads follow."""
    flip = tmp_path / "flip"
    monkeypatch.setenv(PID_ENV, str(os.getpid()))
    monkeypatch.setenv(FLIP_ENV, str(flip))
    before = torch.get_num_threads()
    engine = _auto_engine(_flipping_forward)
    try:
        model = engine.bind(_net())
        x, y = _batch()

        def step():
            real = _reference(model, x, y).loss
            stats = engine.gradient(inputs=x, targets=y)
            st = engine.status()  # the placement this step ran with
            assert (stats.loss - real > 500) == st.placement_in_trainer, st.text
            return stats, st

        for _ in range(2000):
            stats, st = step()
            if st.placement != "probing":
                break
        assert st.placement == "chosen" and not st.placement_in_trainer, st.placement_report
        assert "rechecked" not in st.placement_report
        assert torch.get_num_threads() == 1  # the workers' cores are left to them
        flip.touch()
        # Two watch windows (2 s of steps each) find the kept workers slower than the
        # trainer was in the probe; the probe runs again and keeps the trainer.
        probed_again = 0
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            stats, st = step()
            probed_again += stats.placement_probing
            if st.placement == "chosen" and st.placement_in_trainer:
                break
        assert st.placement == "chosen" and st.placement_in_trainer, st.placement_report
        assert probed_again >= 6, probed_again  # two visits of three candidates at least
        assert engine._trainer.placement()["rechecks"] == 1
        assert "rechecked 1 time, the last because " in st.placement_report, st.placement_report
        assert "chosen: the trainer computes" in st.placement_report
        assert torch.get_num_threads() == before  # all the trainer had, computing itself
        real = _reference(model, x, y)
        engine.gradient(inputs=x, targets=y)
        for got, want in zip(model.parameters(), real.parameters()):
            assert (got.grad is None) == (want.grad is None)
            if want.grad is not None:
                torch.testing.assert_close(got.grad, want.grad, rtol=1e-5, atol=1e-6)
    finally:
        engine.close()
    assert torch.get_num_threads() == before


def test_no_trainer_slot_or_turned_off_means_workers_only(monkeypatch):
    monkeypatch.setenv("SHMGRAD_IN_TRAINER", "0")
    with shmgrad.Engine(model=_net(), workers="auto", loss="cross_entropy", mode="eager") as e:
        assert not any(c["in_trainer"] for c in e.status().placement_probe)
        with pytest.raises(shmgrad.InvalidArgumentError, match="cannot compute steps itself"):
            e._trainer.set_placement(0, CORES, in_trainer=True)
    monkeypatch.delenv("SHMGRAD_IN_TRAINER")
    with shmgrad.Engine(model=_net(), workers=1, loss="cross_entropy", mode="eager") as e:
        assert not e._trainer.has_trainer_slot()
        assert e._in_trainer is None


@pytest.mark.parametrize("features, batch", [(6, 20), (64, 8)])
def test_an_overflowing_gradient_is_found_however_the_step_is_placed(monkeypatch, features, batch):
    """Linear layers vouch for what they compute into .grad from a bound on their inputs
    (ipc::productFinite) instead of reading it, where that reads less (64 features, 8
    examples: the first layer); where the bound does not hold, or reading the gradient
    costs less (6 features, 20 examples), it is read. A loss scale of 1e38 overflows the
    Linear gradients themselves (no other parameter here), one of 1e30 does not: every
    target is class 0, so the last bias's gradient sums terms of about -0.7 x 1e38 in
    every placement. Where each worker's share of those terms is finite and their sum is
    not, the reduction's sum overflows: found too, and said so."""
    monkeypatch.setenv(PID_ENV, str(os.getpid()))
    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Linear(features, 10 if features < 10 else features),
        torch.nn.Tanh(),
        torch.nn.Linear(10 if features < 10 else features, 3),
    )
    with shmgrad.Engine(model=net, workers="auto", loss="cross_entropy", mode="eager") as engine:
        engine.bind(net)
        x = torch.randn(batch, features, generator=torch.Generator().manual_seed(1))
        y = torch.zeros(len(x), dtype=torch.int64)
        placements = [(0, CORES, True), (1, CORES, False)]
        if CORES >= 2:
            placements.append((2, 1, False))
        for workers, threads, in_trainer in placements:
            engine._trainer.set_placement(workers, threads, in_trainer=in_trainer)
            stats = engine.gradient(inputs=x, targets=y, loss_scale=1e38)
            assert stats.nonfinite, (workers, in_trainer)
            assert any(not torch.isfinite(p.grad).all() for p in net.parameters())
            with pytest.raises(shmgrad.NonFiniteError) as raised:
                engine.gradient(inputs=x, targets=y, loss_scale=1e38, raise_on_nonfinite=True)
            # 8 examples over 2 workers: each one's 4 terms are finite, their sum is not.
            overflowed = "sum overflowed" in str(raised.value)
            assert overflowed == (batch == 8 and workers == 2), str(raised.value)
            stats = engine.gradient(inputs=x, targets=y, loss_scale=1e30)
            assert not stats.nonfinite, (workers, in_trainer)
            assert all(torch.isfinite(p.grad).all() for p in net.parameters())


class ScriptNet(torch.nn.Module):
    """Net for TorchScript: linear layers (rewritten to compute in place), a BatchNorm."""

    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(6, 10)
        self.bn = torch.nn.BatchNorm1d(10)
        self.fc2 = torch.nn.Linear(10, 3, bias=False)

    def forward(self, x):
        return self.fc2(torch.tanh(self.bn(self.fc1(x))))


def test_a_torchscript_engines_trainer_computes_a_workers_step_exactly():
    """TorchScript engines compute in the trainer through a C++ replica of their own
    (worker::ScriptInTrainer): the step is the trainer slot's, and its gradient and
    BatchNorm statistics are one worker's, bit for bit, and plain PyTorch's."""
    torch.manual_seed(0)
    net = ScriptNet()
    with shmgrad.Engine(model=net, workers="auto", loss="cross_entropy", mode="script") as engine:
        assert engine.mode == "script" and engine._in_trainer is not None
        model = engine.bind(net)
        x, y = _batch()
        start = {k: v.clone() for k, v in model.state_dict().items()}
        runs = {}
        for in_trainer in (True, False):
            model.load_state_dict(start)
            _place(engine, in_trainer)
            stats = engine.gradient(inputs=x, targets=y, reduction="sum")
            trainer_slot = engine._trainer.slot_count()
            assert (stats.worker_slots == [trainer_slot]) == in_trainer, stats.worker_slots
            assert engine.status().placement_in_trainer == in_trainer
            runs[in_trainer] = [p.grad.clone() for p in model.parameters()] + [
                b.clone() for b in model.buffers()
            ]
            # Over two batches in passes of 7, accumulated, in eval mode.
            model.eval()
            engine.gradient(inputs=x, targets=y, max_examples_per_pass=7, reduction="sum")
            x2, y2 = _batch(seed=2)
            engine.gradient(
                inputs=x2, targets=y2, max_examples_per_pass=7, accumulate=True, reduction="sum"
            )
            ref = ScriptNet()
            ref.load_state_dict(model.state_dict())
            ref.eval()
            loss = torch.nn.functional.cross_entropy(
                ref(torch.cat([x, x2])), torch.cat([y, y2]), reduction="sum"
            )
            loss.backward()
            for got, want in zip(model.parameters(), ref.parameters()):
                torch.testing.assert_close(got.grad, want.grad, rtol=1e-5, atol=1e-5)
            model.train()
        for a, b in zip(runs[True], runs[False]):
            assert torch.equal(a, b)
        ref = ScriptNet()
        ref.load_state_dict(start)
        torch.nn.functional.cross_entropy(ref(x), y, reduction="sum").backward()
        for got, want in zip(runs[True], ref.parameters()):
            torch.testing.assert_close(got, want.grad, rtol=1e-5, atol=1e-6)


def _segment_mappings(name):
    """This process's mappings of engine ``name``'s segment (/proc/self/maps)."""
    with open("/proc/self/maps") as f:
        return [line for line in f if f"shmgrad-{os.getuid()}-{name}" in line]


@pytest.mark.parametrize("mode", ["eager", "script"])
def test_a_closed_engine_leaves_nothing_mapped_in_the_trainer(mode):
    """The trainer's own participant (workers="auto") maps the segment. Once the client is
    closed and the bound module is gone, nothing of it stays mapped in this process: an
    eager participant held the runner's functions, whose model holds the participant, a
    cycle through C++ that the collector cannot see (it kept the whole segment mapped until
    the process exited)."""
    model = _net()
    engine = shmgrad.Engine(model=model, workers="auto", loss="cross_entropy", mode=mode)
    engine.bind(model)
    _place(engine, True)
    x, y = _batch()
    engine.gradient(inputs=x, targets=y)
    name = engine.name
    assert _segment_mappings(name)
    engine.close()
    del engine, model
    gc.collect()
    assert _segment_mappings(name) == []
