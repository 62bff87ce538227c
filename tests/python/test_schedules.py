"""shmgrad.schedules (adaptive batch sizes) and the engine features they rely on:
min_examples_per_worker, resize and max_examples_per_pass, against plain PyTorch."""

import copy

import numpy as np
import pytest
import torch

import shmgrad
from shmgrad import InvalidArgumentError
from shmgrad.testing import relative_error
from shmgrad.schedules import AdaDamp, Constant, GeoDamp, PadaDamp


# -- schedule values, by hand ----------------------------------------------------------


def test_exported_from_package():
    assert shmgrad.schedules.GeoDamp is GeoDamp
    assert isinstance(shmgrad.schedules.Constant(8), shmgrad.schedules.Schedule)


def test_constant():
    s = Constant(128)
    for step, epoch in ((0, 0), (1, 0), (10000, 7), (None, None)):
        assert s.batch_size(step=step, epoch=epoch) == 128
        assert s.virtual_batch_size(step=step, epoch=epoch) == 128
        assert s.lr_scale(step=step, epoch=epoch) == 1.0
        assert s(step=step, epoch=epoch) == (128, 1.0)
    assert s.max_batch_size is None


def test_padadamp():
    s = PadaDamp(32, 0.5)
    # ceil(32 + 0.5 k)
    expected = {0: 32, 1: 33, 2: 33, 3: 34, 10: 37, 11: 38, 1000: 532}
    for k, b in expected.items():
        assert s.batch_size(step=k) == b
        assert s.batch_size(step=k, epoch=99) == b  # epoch is ignored
        assert s.lr_scale(step=k) == 1.0
    # 32 + 0.1 * 30 is 35.000000000000004 in floating point: still 35, not 36.
    assert PadaDamp(32, 0.1).batch_size(step=30) == 35
    assert PadaDamp(32, 0.1).batch_size(step=31) == 36  # ceil(35.1)
    assert PadaDamp(5, 0).batch_size(step=10**6) == 5


def test_geodamp():
    s = GeoDamp(64, 2, 3)
    # 64 * 2 ** floor(epoch / 3)
    expected = {0: 64, 1: 64, 2: 64, 2.99: 64, 3: 128, 5: 128, 5.5: 128, 6: 256, 9: 512, 12: 1024}
    for e, b in expected.items():
        assert s.batch_size(epoch=e) == b
        assert s.batch_size(step=12345, epoch=e) == b  # step is ignored
        assert s.lr_scale(epoch=e) == 1.0
    s = GeoDamp(10, 1.5, 1)
    assert [s.batch_size(epoch=e) for e in range(4)] == [10, 15, 23, 34]  # ceil(22.5), ceil(33.75)
    # Fractional delays: floor(0.3 / 0.1) is 3 (not 2, as plain floating point says).
    assert GeoDamp(1, 2, 0.1).batch_size(epoch=0.3) == 8
    # Integer factors stay exact however far the batch grows.
    assert GeoDamp(64, 2, 1).virtual_batch_size(epoch=100) == 64 * 2**100
    assert GeoDamp(64, 2, 1, max_batch_size=512)(epoch=100) == (512, 512 / (64 * 2**100))


def test_adadamp_with_loss_values():
    s = AdaDamp(100)
    assert s.batch_size() == 100  # no loss recorded yet
    assert s.update_loss(loss=2.0) == 2.0
    assert s.initial_loss == 2.0
    assert s.batch_size() == 100  # ceil(100 * 2 / 2)
    s.update_loss(loss=0.5)
    assert s.batch_size(step=7, epoch=1) == 400  # ceil(100 * 2 / 0.5)
    s.update_loss(loss=0.3)
    assert s.batch_size() == 667  # ceil(666.67)
    s.update_loss(loss=4.0)
    assert s.batch_size() == 50  # the loss went up: a smaller batch
    s.update_loss(loss=1000.0)
    assert s.batch_size() == 1  # never below 1
    assert s.initial_loss == 2.0  # F(x_0) is the first loss recorded


def test_lr_scaling_past_the_cap():
    s = GeoDamp(64, 2, 1, max_batch_size=256)
    assert [s(epoch=e) for e in range(6)] == [
        (64, 1.0),
        (128, 1.0),
        (256, 1.0),
        (256, 0.5),
        (256, 0.25),
        (256, 0.125),
    ]
    assert s.virtual_batch_size(epoch=5) == 2048
    assert s.batch_size(epoch=5) == 256
    assert s.lr_scale(epoch=5) == 0.125

    p = PadaDamp(100, 10, max_batch_size=200)
    assert p(step=10) == (200, 1.0)  # exactly at the cap
    assert p(step=20) == (200, pytest.approx(200 / 300))
    assert p.virtual_batch_size(step=20) == 300
    assert p.lr_scale(step=30) == pytest.approx(0.5)

    a = AdaDamp(50, max_batch_size=100)
    a.update_loss(loss=1.0)
    a.update_loss(loss=0.125)
    assert a.virtual_batch_size() == 400
    assert a() == (100, 0.25)

    # A cap at the initial batch: lr decays from the first growth on.
    assert GeoDamp(32, 2, 1, max_batch_size=32)(epoch=2) == (32, 0.25)


@pytest.mark.parametrize(
    "make,name",
    [
        (lambda: Constant(0), "batch_size"),
        (lambda: Constant(1.5), "batch_size"),
        (lambda: Constant(True), "batch_size"),
        (lambda: PadaDamp(0, 1), "B0"),
        (lambda: PadaDamp(-4, 1), "B0"),
        (lambda: PadaDamp("32", 1), "B0"),
        (lambda: PadaDamp(32, -1), "rate"),
        (lambda: PadaDamp(32, float("nan")), "rate"),
        (lambda: PadaDamp(32, "1"), "rate"),
        (lambda: PadaDamp(32, 1, max_batch_size=16), "max_batch_size"),
        (lambda: PadaDamp(32, 1, max_batch_size=0), "max_batch_size"),
        (lambda: GeoDamp(64.0, 2, 1), "B0"),
        (lambda: GeoDamp(64, 0.5, 1), "factor"),
        (lambda: GeoDamp(64, float("inf"), 1), "factor"),
        (lambda: GeoDamp(64, 2, 0), "delay_epochs"),
        (lambda: GeoDamp(64, 2, -1), "delay_epochs"),
        (lambda: GeoDamp(64, 2, 1, max_batch_size=32), "max_batch_size"),
        (lambda: GeoDamp(64, 2, 1, max_batch_size=100.0), "max_batch_size"),
        (lambda: AdaDamp(None), "B0"),
        (lambda: AdaDamp(8, max_batch_size=4), "max_batch_size"),
    ],
)
def test_bad_constructor_arguments(make, name):
    with pytest.raises(InvalidArgumentError, match=name):
        make()


def test_bad_call_arguments():
    with pytest.raises(InvalidArgumentError, match="step"):
        PadaDamp(8, 1).batch_size()  # PadaDamp needs step
    with pytest.raises(InvalidArgumentError, match="epoch"):
        GeoDamp(8, 2, 1).batch_size(step=3)  # GeoDamp needs epoch
    for s in (Constant(8), PadaDamp(8, 1), GeoDamp(8, 2, 1), AdaDamp(8)):
        with pytest.raises(InvalidArgumentError, match="step"):
            s(step=-1, epoch=0)
        with pytest.raises(InvalidArgumentError, match="step"):
            s.lr_scale(step=1.5, epoch=0)
        with pytest.raises(InvalidArgumentError, match="epoch"):
            s.batch_size(step=0, epoch=-1)
        with pytest.raises(InvalidArgumentError, match="epoch"):
            s.batch_size(step=0, epoch=float("nan"))
    # Options are keyword-only.
    with pytest.raises(TypeError):
        PadaDamp(8, 1, 100)
    with pytest.raises(TypeError):
        GeoDamp(8, 2, 1).batch_size(0, 0)
    a = AdaDamp(8)
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(InvalidArgumentError, match="loss"):
            a.update_loss(loss=bad)
    with pytest.raises(InvalidArgumentError, match="loss"):
        a.update_loss()
    with pytest.raises(InvalidArgumentError, match="sample_indices"):
        a.update_loss(object())
    with pytest.raises(InvalidArgumentError, match="not both"):
        a.update_loss(object(), [0], loss=1.0)
    assert a.initial_loss is None  # nothing was recorded


# -- the engine: active workers, resize, passes -----------------------------------------


class TinyMlp(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(6, 16)
        self.fc2 = torch.nn.Linear(16, 4)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


N = 200


@pytest.fixture(scope="module")
def engine_setup(tmp_path_factory):
    """One engine for the module: 3 workers of at most 4, min_examples_per_worker=10, a
    small .npy dataset. Yields (engine, bound model, reference copy, inputs, targets)."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(N, 6, generator=g)
    y = torch.randint(0, 4, (N,), generator=g)
    d = tmp_path_factory.mktemp("npy")
    np.save(d / "x.npy", x.numpy())
    np.save(d / "y.npy", y.numpy())
    torch.manual_seed(11)
    model = TinyMlp()
    reference = copy.deepcopy(model)  # never bound: plain single-process PyTorch
    engine = shmgrad.Engine(
        model=model,
        workers=3,
        max_workers=4,
        loss="cross_entropy",
        dataset=f"npy:{d / 'x.npy'},{d / 'y.npy'}",
        min_examples_per_worker=10,
    )
    try:
        engine.bind(model)
        yield engine, model, reference, x, y
    finally:
        engine.close()


def reference_gradient(reference, x, y, reduction="sum"):
    m = copy.deepcopy(reference)
    m.zero_grad()
    torch.nn.functional.cross_entropy(m(x), y, reduction=reduction).backward()
    return [p.grad.clone() for p in m.parameters()]


def assert_matches_reference(engine, model, reference, x, y, idx, reduction="sum", **kw):
    stats = engine.gradient(idx, reduction=reduction, **kw)
    want = reference_gradient(reference, x[idx], y[idx], reduction)
    err = relative_error([p.grad for p in model.parameters()], want)
    assert err < 1e-5, f"relative error {err:g} ({stats.workers} workers)"
    assert stats.num_examples == len(idx)
    assert sum(stats.worker_examples) == len(idx)
    return stats


def test_active_workers_follow_min_examples_per_worker(engine_setup):
    engine, model, reference, x, y = engine_setup
    assert engine.workers == 3
    # at most one worker per 10 examples, at least one, at most the 3 running
    for batch, workers in ((1, 1), (5, 1), (19, 1), (20, 2), (25, 2), (29, 2), (30, 3), (100, 3)):
        idx = torch.arange(batch)
        stats = assert_matches_reference(engine, model, reference, x, y, idx, "mean")
        assert stats.workers == workers, f"batch {batch}"
        assert len(stats.worker_examples) == workers
        assert max(stats.worker_examples) - min(stats.worker_examples) <= 1  # even shards
    # the per-call option overrides the engine's default
    assert engine.gradient(torch.arange(5), min_examples_per_worker=1).workers == 3
    assert engine.gradient(torch.arange(100), min_examples_per_worker=50).workers == 2
    # explicit inputs follow the same rule
    assert engine.gradient(inputs=x[:25], targets=y[:25]).workers == 2


def test_schedule_batches_use_fewer_workers_while_small(engine_setup):
    engine, model, reference, x, y = engine_setup
    sched = PadaDamp(5, 10, max_batch_size=N)
    seen = []
    for k in range(4):  # batches 5, 15, 25, 35
        bs = sched.batch_size(step=k)
        seen.append((bs, engine.gradient(torch.arange(bs), reduction="mean").workers))
    assert seen == [(5, 1), (15, 1), (25, 2), (35, 3)]


def test_adadamp_update_loss_through_the_engine(engine_setup):
    engine, model, reference, x, y = engine_setup
    sample = torch.arange(0, N, 3)
    s = AdaDamp(16, max_batch_size=64)
    got = s.update_loss(engine, sample)
    with torch.no_grad():
        want = torch.nn.functional.cross_entropy(reference(x[sample]), y[sample]).item()
    assert got == pytest.approx(want, rel=1e-5)
    assert s.initial_loss == got and s.batch_size() == 16
    s.update_loss(loss=got / 2)
    assert s.batch_size() == 32
    with pytest.raises(InvalidArgumentError, match="reduction"):
        s.update_loss(engine, sample, reduction="sum")


@pytest.mark.parametrize("workers", [4, 1, 2, 3])  # grow, shrink, grow, back to the start
def test_gradient_right_after_resize_matches_pytorch(engine_setup, workers):
    engine, model, reference, x, y = engine_setup
    engine.resize(workers)
    assert engine.workers == workers
    idx = torch.randperm(N, generator=torch.Generator().manual_seed(workers))[:97]
    for reduction in ("sum", "mean"):
        stats = assert_matches_reference(
            engine, model, reference, x, y, idx, reduction, min_examples_per_worker=1
        )
        assert stats.workers == workers
    # the engine's default min_examples_per_worker (10) still caps the workers
    stats = assert_matches_reference(engine, model, reference, x, y, idx[:15])
    assert stats.workers == 1


def test_max_examples_per_pass(engine_setup):
    engine, model, reference, x, y = engine_setup
    engine.resize(3)
    idx = torch.arange(50, 100)
    for reduction in ("sum", "mean"):
        stats = assert_matches_reference(
            engine, model, reference, x, y, idx, reduction, max_examples_per_pass=7
        )
        assert stats.workers == 3 and sum(stats.worker_examples) == 50
    # one worker doing all 50 examples in 8 passes
    stats = assert_matches_reference(
        engine, model, reference, x, y, idx, max_examples_per_pass=7, min_examples_per_worker=50
    )
    assert stats.workers == 1
    # explicit inputs too
    engine.gradient(inputs=x[idx], targets=y[idx], max_examples_per_pass=7)
    want = reference_gradient(reference, x[idx], y[idx])
    assert relative_error([p.grad for p in model.parameters()], want) < 1e-5


# -- examples/adaptive_batch.py's verdict compares arrival with arrival ------------------


def _adaptive_example():
    import importlib.util
    import os

    path = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "adaptive_batch.py")
    spec = importlib.util.spec_from_file_location("adaptive_batch_example", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class _FakeRun:
    def __init__(self, label, schedule, history, workers):
        self.label, self.schedule, self.history = label, schedule, history
        self.workers_used = set(workers)

    def first_reaching(self, target):
        return next((h for h in self.history if h["accuracy"] >= target), None)


def _history(rows):
    return [
        {"epoch": e, "accuracy": a, "updates": u, "examples": e * 60000, "wall": w}
        for e, (a, u, w) in enumerate(rows, 1)
    ]


def test_adaptive_example_compares_arrival_with_arrival(capsys):
    ex = _adaptive_example()
    # The figures of the run that was called "1.49x faster": the adaptive run reached the
    # target at 20.6 s, the fixed run at 18.5 s (and finished its 8 epochs at 30.6 s).
    fixed = _FakeRun(
        "fixed",
        Constant(128),
        _history(
            [
                (0.86, 469, 3.9),
                (0.87, 938, 7.6),
                (0.88, 1407, 11.2),
                (0.885, 1876, 14.9),
                (0.8937, 2345, 18.5),
                (0.89, 2814, 22.3),
                (0.891, 3283, 26.5),
                (0.8967, 3752, 30.6),
            ]
        ),
        [2],
    )
    adaptive = _FakeRun(
        "adaptive",
        GeoDamp(128, 2, 2, max_batch_size=1024),
        _history(
            [
                (0.86, 469, 4.0),
                (0.87, 938, 7.8),
                (0.88, 1172, 11.3),
                (0.885, 1406, 14.6),
                (0.889, 1523, 17.6),
                (0.8929, 1644, 20.6),
                (0.895, 1703, 23.4),
                (0.897, 1762, 26.2),
            ]
        ),
        [2],
    )
    summary = ex.summarize([fixed, adaptive], None)
    out = capsys.readouterr().out
    assert summary["exit_status"] == 1
    assert summary["fixed_at_target"]["epoch"] == 5 and summary["adaptive_at_target"]["epoch"] == 6
    assert abs(summary["wall_ratio_at_target"] - 18.5 / 20.6) < 1e-3
    assert "adaptive 1.11x slower" in out
    assert "both runs kept the same 2 workers busy" in summary["verdict"]
    # After the same 8 epochs the adaptive run was faster; that is reported apart.
    assert abs(summary["wall_ratio_at_end"] - 30.6 / 26.2) < 1e-3

    # Arriving first, with more workers busy, passes.
    adaptive.history[4]["accuracy"] = 0.8950  # epoch 5, at 17.6 s
    adaptive.workers_used = {8, 16}
    fixed.workers_used = {8}
    summary = ex.summarize([fixed, adaptive], None)
    assert summary["exit_status"] == 0 and summary["verdict"].startswith("ok")

    # Never reaching the target fails, whatever the wall times.
    summary = ex.summarize([fixed, adaptive], 0.95)
    assert summary["exit_status"] == 1 and "never reached" in summary["verdict"]
