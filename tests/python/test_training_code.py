"""Training code as people write it: mean losses, weighted (per-token) means, accumulation,
resume, BatchNorm statistics, mixed precision and the checks at start. Every gradient is
compared with one process's plain PyTorch."""

import copy
import os
import signal
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import shmgrad
from conftest import (
    AUX,
    Branchy,
    Cnn,
    Mlp,
    ci_runs,
    reference_gradient,
    relative_error,
    shard_gradients,
)
from helpers import STEP_TIMEOUT_S, GradientCall, SlowCnn, wait_until_busy

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def grads(model):
    return [p.grad.clone() for p in model.parameters()]


def data(n=48, d_in=20, classes=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, d_in, generator=g), torch.randint(0, classes, (n,), generator=g)


class Pairs(torch.utils.data.Dataset):
    def __init__(self, x, y):
        self.x, self.y = x, y

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


# -- 1. mean losses --------------------------------------------------------------------
@pytest.mark.parametrize("batch", ["dataset", "explicit"])
def test_mean_loss_written_as_users_write_it_is_exact(batch):
    """F.cross_entropy(o, y) (a mean) with 3 workers: found out (on the dataset at start,
    or by each worker on its first shard) and weighted, so the mean is the batch's."""
    torch.manual_seed(0)
    model = Mlp()
    x, y = data(50)
    ref_mean = reference_gradient(model, "cross_entropy", x, y, reduction="mean")
    ref_sum = reference_gradient(model, "cross_entropy", x, y, reduction="sum")
    kwargs = {"dataset": Pairs(x, y)} if batch == "dataset" else {}
    with shmgrad.Engine(
        model=model, workers=3, loss=lambda o, t: F.cross_entropy(o, t), **kwargs
    ) as engine:
        engine.bind(model)
        call = {"indices": list(range(50))} if batch == "dataset" else {"inputs": x, "targets": y}
        st = engine.gradient(**call, reduction="mean")
        assert relative_error(grads(model), ref_mean) < 1e-5
        assert st.count == 50 and st.num_examples == 50
        with torch.no_grad():
            expected = float(F.cross_entropy(model(x), y))
        assert abs(st.loss - expected) < 1e-5 * abs(expected)
        engine.gradient(**call, reduction="sum")
        assert relative_error(grads(model), ref_sum) < 1e-5


def summed_cross_entropy(o, t):
    return F.cross_entropy(o, t, reduction="sum")


def counted_cross_entropy(model, batch):
    return F.cross_entropy(model(batch[0]), batch[1], reduction="sum"), len(batch[1])


DEFAULT_REDUCTIONS = {  # the loss, whether the Engine gets a Dataset, what backward gives
    "CrossEntropyLoss": (dict(loss=torch.nn.CrossEntropyLoss()), True, "mean"),
    "callable-mean-probed-in-trainer": (
        dict(loss=lambda o, t: F.cross_entropy(o, t)),
        False,
        "mean",
    ),
    "callable-mean-dataset": (dict(loss=lambda o, t: F.cross_entropy(o, t)), True, "mean"),
    "named-sum": (dict(loss="cross_entropy", mode="eager"), False, "sum"),
    "callable-sum-probed-in-trainer": (dict(loss=summed_cross_entropy), False, "sum"),
    "sum-and-count": (dict(forward=counted_cross_entropy), False, "mean"),
}


@pytest.mark.parametrize(
    "case",
    ci_runs(
        list(DEFAULT_REDUCTIONS),
        keep=("CrossEntropyLoss", "callable-mean-probed-in-trainer", "sum-and-count"),
    ),
)
def test_default_reduction_is_the_losses_own(case):
    """gradient() without reduction= gives what loss.backward() on the batch would: the
    mean's gradient for a mean loss (a mean module read at start, a callable found out on
    the dataset or, without one, by the trainer on the first batch), the sum's for a sum."""
    engine_args, with_dataset, want = DEFAULT_REDUCTIONS[case]
    torch.manual_seed(11)
    model = Mlp()
    x, y = data(22)
    ref = reference_gradient(model, "cross_entropy", x, y, reduction=want)
    extra = {"dataset": Pairs(x, y)} if with_dataset else {}
    with shmgrad.Engine(model=model, workers=3, **engine_args, **extra) as engine:
        engine.bind(model)
        for _ in range(2):  # found out once, then kept
            st = (
                engine.gradient(range(22)) if with_dataset else engine.gradient(inputs=x, targets=y)
            )
            assert relative_error(grads(model), ref) < 1e-5
        want_loss = F.cross_entropy(model(x), y, reduction=want).item()
        assert abs(st.loss - want_loss) < 1e-5 * abs(want_loss)


class TwoTowers(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 4), torch.nn.Linear(6, 4)

    def forward(self, x, t):
        return F.normalize(self.a(x), dim=1), F.normalize(self.b(t), dim=1)


def contrastive_forward(model, batch):
    """A CLIP-style loss: every example's negatives are the batch's other examples."""
    za, zb = model(*batch)
    logits = za @ zb.T / 0.1
    labels = torch.arange(len(logits))
    return (F.cross_entropy(logits, labels) + F.cross_entropy(logits.T, labels)) / 2


def test_a_loss_that_couples_the_batchs_examples_is_refused_saying_why():
    """In-batch negatives make the loss neither a sum nor a mean of per-example terms: the
    probe cannot tell, and the error says what declaring a reduction would do."""
    g = torch.Generator().manual_seed(5)
    x, t = torch.randn(32, 8, generator=g), torch.randn(32, 6, generator=g)
    with shmgrad.Engine(model=TwoTowers(), workers=2, forward=contrastive_forward) as engine:
        with pytest.raises(shmgrad.InvalidArgumentError) as info:
            engine.gradient(batch=(x, t))
        message = str(info.value)
        assert "loss_reduction=" in message and "couples the batch's examples" in message
        assert "only its own shard's examples" in message


def test_default_reduction_unknown_is_refused_until_it_is_known(npy_dataset):
    """A callable loss over a dataset spec's examples, which the trainer cannot read, an
    empty batch or one the probe fails on: refused, naming reduction= and loss_reduction=;
    given, it works, and once the workers have found the loss out (they publish it in the
    segment), the default is theirs."""
    spec, x, y = npy_dataset
    with shmgrad.Engine(model=Mlp(), workers=1, loss=lambda o, t: F.cross_entropy(o, t)) as e:
        xs, ys = data(4)
        with pytest.raises(shmgrad.InvalidArgumentError, match="empty batch cannot tell"):
            e.gradient(inputs=xs[:0], targets=ys[:0])  # as a node's empty share would
        # A batch the model rejects: the probe's error, not a guessed sum.
        with pytest.raises(shmgrad.InvalidArgumentError, match=r"failed in the trainer \(Runtime"):
            e.gradient(inputs=xs[:, :7], targets=ys)
        assert e.gradient(inputs=xs, targets=ys).count == 4  # found out, and kept
    model = Cnn()
    with shmgrad.Engine(
        model=model, workers=2, loss=lambda o, t: F.cross_entropy(o, t), dataset=spec
    ) as engine:
        engine.bind(model)
        with pytest.raises(shmgrad.InvalidArgumentError, match="reduction='sum' or 'mean'"):
            engine.gradient(range(8))
        assert shmgrad.read_status(engine.name).loss_reduction == "unknown"
        engine.gradient(range(8), reduction="mean")
        want = reference_gradient(model, "cross_entropy", x[:8], y[:8], reduction="mean")
        assert relative_error(grads(model), want) < 1e-5
        assert shmgrad.read_status(engine.name).loss_reduction == "mean"
        engine.gradient(range(8, 16))  # found out by the workers: the default now
        want = reference_gradient(model, "cross_entropy", x[8:16], y[8:16], reduction="mean")
        assert relative_error(grads(model), want) < 1e-5


def test_attached_trainer_takes_the_losses_own_reduction_from_the_engine():
    """A trainer that attaches without the job (as to `shmgrad serve --eager`) reads what
    the loss returns from the engine's segment: known at start, or once the workers have
    found it out; before that gradient() refuses, naming reduction=."""
    xs, ys = data(6)
    with shmgrad.serve(model=Mlp(), workers=2, loss=torch.nn.CrossEntropyLoss()) as server:
        assert server.loss_reduction == "mean"
        model = Mlp()
        with shmgrad.attach(server.name) as client:
            client.bind(model)
            stats = client.gradient(inputs=xs, targets=ys)
            want = reference_gradient(model, "cross_entropy", xs, ys, reduction="mean")
            assert relative_error(grads(model), want) < 1e-5
            assert stats.count == 6
    mean = lambda o, t: F.cross_entropy(o, t)  # noqa: E731 (undeclared, no Dataset)
    with shmgrad.serve(model=Mlp(), workers=2, loss=mean) as server:
        assert server.loss_reduction is None
        model = Mlp()
        with shmgrad.attach(server.name) as client:
            client.bind(model)
            with pytest.raises(shmgrad.InvalidArgumentError, match="reduction='sum' or 'mean'"):
                client.gradient(inputs=xs, targets=ys)
            client.gradient(inputs=xs, targets=ys, reduction="sum")  # the workers find out
            assert shmgrad.read_status(server.name).loss_reduction == "mean"
            client.gradient(inputs=xs, targets=ys)
            want = reference_gradient(model, "cross_entropy", xs, ys, reduction="mean")
            assert relative_error(grads(model), want) < 1e-5
    with shmgrad.serve(model=Mlp(), workers=1, loss="cross_entropy", mode="script") as server:
        assert shmgrad.read_status(server.name).loss_reduction == "sum"


def test_loss_module_with_mean_reduction_is_taken():
    torch.manual_seed(1)
    model = Mlp()
    x, y = data(30)
    ref = reference_gradient(model, "cross_entropy", x, y, reduction="mean")
    with shmgrad.Engine(model=model, workers=2, loss=torch.nn.CrossEntropyLoss()) as engine:
        engine.bind(model)
        engine.gradient(inputs=x, targets=y, reduction="mean", max_examples_per_pass=4)
        assert relative_error(grads(model), ref) < 1e-5


def test_kl_divergence_batchmean_is_a_mean_over_examples():
    """nn.KLDivLoss(reduction="batchmean"), as distillation writes it against a teacher's
    probabilities: the sum over the batch divided by its examples."""
    torch.manual_seed(5)
    model = torch.nn.Sequential(Mlp(), torch.nn.LogSoftmax(1))
    ref = copy.deepcopy(model)
    x, _ = data(27)
    teacher = torch.softmax(torch.randn(27, 5, generator=torch.Generator().manual_seed(6)), 1)
    loss = torch.nn.KLDivLoss(reduction="batchmean")
    loss(ref(x), teacher).backward()
    with shmgrad.Engine(model=model, workers=2, loss=loss) as engine:
        engine.bind(model)
        engine.gradient(inputs=x, targets=teacher, reduction="mean")
        assert relative_error(grads(model), grads(ref)) < 1e-5


class LearnedTemperatureLoss(torch.nn.Module):
    """A loss with a parameter of its own (a learned temperature)."""

    def __init__(self):
        super().__init__()
        self.log_t = torch.nn.Parameter(torch.zeros(()))

    def forward(self, o, t):
        return F.cross_entropy(o * self.log_t.exp(), t, reduction="sum")


def test_parameters_the_loss_holds_outside_the_model_are_refused():
    """They would never get a gradient in the trainer: refused, naming them and the fix,
    whether the loss is the module, a bound method, or a function that refers to it; the
    model's own parameters in a penalty are fine, and so is a frozen loss module."""
    model = Mlp()
    crit = LearnedTemperatureLoss()

    def through_closure(o, t):
        return crit(o, t)

    for loss, forward in [
        (crit, None),
        (crit.forward, None),
        (through_closure, None),
        (None, lambda m, batch: crit(m(batch[0]), batch[1])),
    ]:
        with pytest.raises(shmgrad.InvalidArgumentError, match=r"\(log_t\).*requires_grad_"):
            shmgrad.Engine(model=model, workers=1, loss=loss, forward=forward, loss_reduction="sum")
    torch.manual_seed(7)
    x, y = data(12)

    def penalised(o, t):  # the model's weights: the workers' own shared ones
        return F.cross_entropy(o, t, reduction="sum") + 0.1 * model.fc1.weight.square().sum()

    ref = copy.deepcopy(model)
    (F.cross_entropy(ref(x), y, reduction="sum") + 0.1 * ref.fc1.weight.square().sum()).backward()
    with shmgrad.Engine(model=model, workers=1, loss=penalised, loss_reduction="sum") as engine:
        engine.bind(model)
        engine.gradient(inputs=x, targets=y)
        assert relative_error(grads(model), grads(ref)) < 1e-5
    crit.requires_grad_(False)
    shmgrad.Engine(model=model, workers=1, loss=crit, loss_reduction="sum").close()


def not_sum_nor_mean(o, t):
    return F.cross_entropy(o, t, reduction="sum").sqrt()


def test_loss_neither_sum_nor_mean_is_refused_at_start_naming_loss_reduction():
    model = Mlp()
    x, y = data(10)
    with pytest.raises(shmgrad.InvalidArgumentError, match="loss_reduction="):
        shmgrad.Engine(model=model, workers=2, loss=not_sum_nor_mean, dataset=Pairs(x, y))


def test_loss_neither_sum_nor_mean_is_refused_by_the_workers_and_the_engine_serves():
    """Without a Dataset the workers find out on their first shard: a WorkerError naming
    loss_reduction=, and the engine keeps serving a declared loss."""
    model = Mlp()
    x, y = data(10)
    with shmgrad.Engine(model=model, workers=2, loss=not_sum_nor_mean) as engine:
        engine.bind(model)
        with pytest.raises(shmgrad.WorkerError, match="loss_reduction="):
            engine.gradient(inputs=x, targets=y, reduction="sum")
        assert len(engine.status().ready_workers) == 2
        # Without a reduction, the trainer finds out first (the default follows the loss).
        with pytest.raises(shmgrad.InvalidArgumentError, match="loss_reduction="):
            engine.gradient(inputs=x, targets=y)


def test_declared_loss_reduction_is_checked():
    with pytest.raises(shmgrad.InvalidArgumentError, match="contradicts"):
        shmgrad.Engine(
            model=Mlp(), workers=1, loss=torch.nn.MSELoss(reduction="sum"), loss_reduction="mean"
        )
    with pytest.raises(shmgrad.InvalidArgumentError, match="'sum' or 'mean'"):
        shmgrad.Engine(model=Mlp(), workers=1, loss=F.cross_entropy, loss_reduction="avg")
    with pytest.raises(shmgrad.InvalidArgumentError, match="reduction='mean'"):
        shmgrad.Engine(model=Mlp(), workers=1, loss=torch.nn.CrossEntropyLoss(reduction="none"))
    with pytest.raises(shmgrad.InvalidArgumentError, match="forward="):
        shmgrad.Engine(model=Mlp(), workers=1)


# -- 2. weighted means -----------------------------------------------------------------
PAD = 0
VOCAB = 30


class TinyLm(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, 16, padding_idx=PAD)
        self.out = torch.nn.Linear(16, VOCAB)

    def forward(self, ids):
        return self.out(torch.tanh(self.emb(ids)))


class Sentences(torch.utils.data.Dataset):
    """Token sequences of lengths 2..20: very unequal shares of tokens per worker."""

    def __init__(self, n=40, seed=0):
        g = torch.Generator().manual_seed(seed)
        lengths = [2 + (i * 7) % 19 if i < n // 2 else 2 for i in range(n)]
        self.items = [torch.randint(1, VOCAB, (k,), generator=g) for k in lengths]

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return {"ids": self.items[i]}


def pad(examples):
    ids = torch.nn.utils.rnn.pad_sequence([e["ids"] for e in examples], True, PAD)
    return {"ids": ids[:, :-1], "labels": ids[:, 1:]}


def token_loss(model, batch):
    """The per-token loss summed over the tokens that are not padding, and their count."""
    logits = model(batch["ids"])
    labels = batch["labels"]
    total = F.cross_entropy(
        logits.reshape(-1, VOCAB), labels.reshape(-1), ignore_index=PAD, reduction="sum"
    )
    return total, (labels != PAD).sum()


@pytest.mark.parametrize("workers,passes", [(3, 0), (1, 0), (2, 3)])
def test_token_weighted_mean_is_exact_across_unequal_shares(workers, passes):
    torch.manual_seed(2)
    model = TinyLm()
    ds = Sentences()
    batch = pad([ds[i] for i in range(len(ds))])
    ref = copy.deepcopy(model)
    logits = ref(batch["ids"])
    F.cross_entropy(
        logits.reshape(-1, VOCAB), batch["labels"].reshape(-1), ignore_index=PAD
    ).backward()
    tokens = int((batch["labels"] != PAD).sum())
    with shmgrad.Engine(
        model=model, workers=workers, dataset=ds, collate_fn=pad, forward=token_loss
    ) as engine:
        engine.bind(model)
        st = engine.gradient(range(len(ds)), reduction="mean", max_examples_per_pass=passes)
        assert st.count == tokens and st.num_examples == len(ds)
        assert relative_error(grads(model), grads(ref)) < 1e-5
        assert abs(st.loss - st.loss_sum / tokens) < 1e-12


def token_mean_and_count(model, batch):
    total, count = token_loss(model, batch)
    return total / count, count  # the mean where the sum belongs


def test_forward_returning_a_mean_with_its_count_is_refused_at_start():
    with pytest.raises(shmgrad.InvalidArgumentError, match="the count doubles but the loss stays"):
        shmgrad.Engine(
            model=TinyLm(),
            workers=2,
            dataset=Sentences(),
            collate_fn=pad,
            forward=token_mean_and_count,
        )


IGNORED = -100  # cross_entropy's and nll_loss's default ignore_index: padded labels
TAGS = 6


class Tagger(torch.nn.Module):
    """A tag per token: logits (N, TAGS, T), or log-probabilities for nll_loss."""

    def __init__(self, log_probs=False):
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, 12)
        self.out = torch.nn.Linear(12, TAGS)
        self.log_probs = log_probs

    def forward(self, ids):
        logits = self.out(torch.tanh(self.emb(ids))).transpose(1, 2)
        return logits.log_softmax(1) if self.log_probs else logits


class PaddedTags(Pairs):
    """Sequences of 8 tokens whose labels past 1..7 tokens are IGNORED (padding), as a
    collate that pads labels with -100 makes them: examples differ in the targets a mean
    cross entropy divides by. Example 0 has a single label, example 1 two."""

    def __init__(self, n=30, seed=3):
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(1, VOCAB, (n, 8), generator=g)
        labels = torch.randint(0, TAGS, (n, 8), generator=g)
        for i in range(n):
            labels[i, 1 + i % 7 :] = IGNORED
        super().__init__(ids, labels)


CLASS_WEIGHTS = torch.linspace(0.5, 2.0, TAGS)
CLASS_LOSSES = {
    "CrossEntropyLoss": torch.nn.CrossEntropyLoss(),
    "weights-smoothing": torch.nn.CrossEntropyLoss(weight=CLASS_WEIGHTS, label_smoothing=0.1),
    "F.cross_entropy": F.cross_entropy,
    "NLLLoss-weights": torch.nn.NLLLoss(weight=CLASS_WEIGHTS),
}


@pytest.mark.parametrize("name", ci_runs(list(CLASS_LOSSES), keep=("weights-smoothing",)))
def test_mean_class_loss_divides_by_the_targets_it_keeps(name):
    """nn.CrossEntropyLoss() as written, over padded labels: torch's mean divides by the
    labels it does not ignore (weighted by class with weight=), not by the examples. With
    3 workers and 23 examples the shards hold very different numbers of labels, so a mean
    weighted by examples would be far off."""
    loss = CLASS_LOSSES[name]
    torch.manual_seed(4)
    model = Tagger(log_probs=isinstance(loss, torch.nn.NLLLoss))
    ref = copy.deepcopy(model)
    ds = PaddedTags()
    idx = list(range(3, 26))
    x, y = ds.x[idx], ds.y[idx]
    want_loss = loss(ref(x), y)
    want_loss.backward()
    kept = y[y != IGNORED]
    count = float(CLASS_WEIGHTS[kept].sum()) if "eights" in name else float(kept.numel())
    # The engine's mean weighting shards by their examples instead is far off here.
    assert relative_error(shard_gradients_mean(model, loss, x, y, 3), grads(ref)) > 1e-2
    with shmgrad.Engine(model=model, workers=3, loss=loss, dataset=ds) as engine:
        engine.bind(model)
        st = engine.gradient(idx, reduction="mean")
        assert relative_error(grads(model), grads(ref)) < 1e-5
        assert abs(st.count - count) < 1e-4 * count
        assert abs(st.loss - want_loss.item()) < 1e-5 * want_loss.item()
        # Explicit batches take the same path.
        engine.gradient(inputs=x, targets=y, reduction="mean")
        assert relative_error(grads(model), grads(ref)) < 1e-5


def shard_gradients_mean(model, loss, x, y, workers):
    """The gradient of the shards' means weighted by their examples: what a mean class
    loss would give if each worker's mean counted as its examples'."""
    m = copy.deepcopy(model)
    m.zero_grad(set_to_none=True)
    for xs, ys in zip(x.tensor_split(workers), y.tensor_split(workers)):
        (loss(m(xs), ys) * len(xs) / len(x)).backward()  # adds to .grad
    return grads(m)


def token_mean(outputs, labels):
    """A mean over the labels cross_entropy keeps, written as a function: the engine
    cannot know its denominator."""
    return F.cross_entropy(outputs, labels)


def test_mean_over_tokens_written_as_a_function_is_refused_naming_the_fix():
    """Refused at start (the dataset's first four examples hold 1 to 4 labels), and
    without a dataset by each worker on its first shard, the engine serving on."""
    with pytest.raises(shmgrad.InvalidArgumentError, match="not over the batch's examples"):
        shmgrad.Engine(model=Tagger(), workers=2, loss=token_mean, dataset=PaddedTags())
    ds = PaddedTags()
    with shmgrad.Engine(model=Tagger(), workers=2, loss=token_mean) as engine:
        with pytest.raises(shmgrad.WorkerError, match=r"\(loss_sum, count\) from forward="):
            engine.gradient(inputs=ds.x[:10], targets=ds.y[:10], reduction="mean")
        assert len(engine.status().ready_workers) == 2
        with pytest.raises(shmgrad.InvalidArgumentError, match=r"\(loss_sum, count\) from"):
            engine.gradient(inputs=ds.x[:10], targets=ds.y[:10])  # found out by the trainer
    # Declared, it is taken as a mean over examples: the user said so.
    model = Tagger()
    with shmgrad.Engine(
        model=model, workers=2, loss=token_mean, dataset=ds, loss_reduction="mean"
    ) as engine:
        engine.bind(model)
        assert engine.gradient(range(4), reduction="mean").count == 4


# -- 3. accumulation -------------------------------------------------------------------
@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_accumulated_micro_batches_give_the_union(reduction):
    torch.manual_seed(3)
    model = Mlp()
    x, y = data(60)
    ref = reference_gradient(model, "cross_entropy", x, y, reduction=reduction)
    with shmgrad.Engine(model=model, workers=2, loss="cross_entropy") as engine:
        engine.bind(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        for _ in range(2):  # the second round starts after zero_grad(): afresh
            opt.zero_grad()
            for lo, hi in ((0, 7), (7, 30), (30, 60)):  # 7 examples: one worker alone
                engine.gradient(
                    inputs=x[lo:hi], targets=y[lo:hi], reduction=reduction, accumulate=True
                )
            assert relative_error(grads(model), ref) < 1e-5
        opt.zero_grad(set_to_none=False)  # zeroed in place: also afresh
        engine.gradient(inputs=x, targets=y, reduction=reduction, accumulate=True)
        assert relative_error(grads(model), ref) < 1e-5
        # A call without accumulate replaces; mixing reductions is refused.
        engine.gradient(inputs=x[:30], targets=y[:30], reduction=reduction)
        other = "sum" if reduction == "mean" else "mean"
        with pytest.raises(shmgrad.InvalidArgumentError, match="same reduction"):
            engine.gradient(inputs=x, targets=y, reduction=other, accumulate=True)


def test_accumulating_step_retried_after_a_kill_is_added_once():
    torch.manual_seed(4)
    model = SlowCnn()
    x, y = torch.randn(1001, 1, 28, 28), torch.randint(0, 5, (1001,))
    ref = reference_gradient(model, "cross_entropy", x, y, reduction="mean")
    with shmgrad.Engine(model=model, workers=3, loss="cross_entropy") as engine:
        engine.bind(model)
        engine.gradient(inputs=x[:100], targets=y[:100], reduction="mean")
        before = engine.status()
        call = GradientCall(
            engine,
            inputs=x[100:],
            targets=y[100:],
            reduction="mean",
            accumulate=True,
            timeout=STEP_TIMEOUT_S,
        )
        try:
            wait_until_busy(engine.name, slot=1, after_epoch=before.step_epoch)
            os.kill(before.worker(1).pid, signal.SIGKILL)
        finally:
            call.join()
        assert call.result().retries == 1
        assert relative_error(grads(model), ref) < 1e-5


# -- 5. resume -------------------------------------------------------------------------
def test_state_dict_round_trip_and_checks():
    with shmgrad.Engine(model=Mlp(), workers=1, loss="cross_entropy", seed=7) as engine:
        x, y = data(8)
        engine.gradient_tensors()
        for _ in range(3):
            engine.gradient(inputs=x, targets=y)
        state = engine.state_dict()
        assert state["seed"] == 7 and state["steps"] == 3
        engine.load_state_dict({"version": 1, "seed": 2, "steps": 10})
        assert engine.state_dict()["steps"] == 10
        with pytest.raises(shmgrad.InvalidArgumentError, match="state_dict"):
            engine.load_state_dict({"seed": 1})


@pytest.mark.parametrize("engine_state", ci_runs([True, False], keep=("True",)))
def test_resume_example_continues_bit_for_bit(engine_state):
    """The example as written: equal bit for bit, and different without the engine's
    state (the resumed steps would redraw the first steps' augmentations)."""
    out = subprocess.run(
        [sys.executable, os.path.join(ROOT, "examples", "resume.py"), "--steps", "4"]
        + ([] if engine_state else ["--skip-engine-state"]),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == (0 if engine_state else 1), out.stdout + out.stderr
    assert ("equal bit for bit" in out.stdout) == engine_state, out.stdout


# -- 6. BatchNorm statistics -----------------------------------------------------------
class BnNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(6, 8)
        self.bn = torch.nn.BatchNorm1d(8)
        self.out = torch.nn.Linear(8, 3)

    def forward(self, x):
        return self.out(torch.relu(self.bn(self.fc(x))))


def shard_statistics(model, x, workers):
    """Each worker's running statistics after its shard (shmgrad's split)."""
    stats = []
    for r in range(workers):
        lo, hi = len(x) * r // workers, len(x) * (r + 1) // workers
        m = copy.deepcopy(model).train()
        m(x[lo:hi])
        stats.append((hi - lo, m.bn.running_mean.clone(), m.bn.running_var.clone()))
    return stats


@pytest.mark.parametrize("rule", ci_runs(["average", "first"], keep=("average",)))
def test_batchnorm_statistics_after_a_step(rule):
    torch.manual_seed(5)
    model = BnNet()
    x, y = torch.randn(30, 6) * 3 + 1, torch.randint(0, 3, (30,))
    stats = shard_statistics(model, x, 3)
    with shmgrad.Engine(model=model, workers=3, loss="cross_entropy", buffers=rule) as engine:
        engine.bind(model)
        engine.gradient(inputs=x, targets=y)
        if rule == "average":
            mean = sum(n * m for n, m, _ in stats) / len(x)
            var = sum(n * v for n, _, v in stats) / len(x)
        else:
            _, mean, var = stats[0]
        assert torch.allclose(model.bn.running_mean, mean, rtol=1e-5, atol=1e-6)
        assert torch.allclose(model.bn.running_var, var, rtol=1e-5, atol=1e-6)
        assert int(model.bn.num_batches_tracked) == 1
    with pytest.raises(shmgrad.InvalidArgumentError, match="'average'"):
        shmgrad.attach("no-such-engine", buffers="mean", timeout=0.1)


def test_passes_that_split_batchnorm_batches_warn_once():
    model = BnNet()
    x, y = torch.randn(16, 6), torch.randint(0, 3, (16,))
    with shmgrad.Engine(model=model, workers=2, loss="cross_entropy") as engine:
        engine.bind(model)
        with pytest.warns(UserWarning, match="BatchNorm"):
            engine.gradient(inputs=x, targets=y, max_examples_per_pass=3)
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("error")
            engine.gradient(inputs=x, targets=y, max_examples_per_pass=3)


def test_sync_batchnorm_warns_that_each_worker_normalises_its_own_shard():
    """A model converted with SyncBatchNorm.convert_sync_batchnorm (code ported from DDP):
    the engine has no cross-worker synchronisation, so it says so at start, and each
    worker normalises its shard with its own statistics, as BatchNorm does."""
    torch.manual_seed(8)
    model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(BnNet())
    x, y = torch.randn(30, 6) * 3 + 1, torch.randint(0, 3, (30,))
    shards = [list(range(0, 10)), list(range(10, 20)), list(range(20, 30))]
    ref = shard_gradients(model, x, y, shards)  # no process group here: per shard
    with pytest.warns(UserWarning, match=r"SyncBatchNorm layers \(bn\) normalise each worker"):
        engine = shmgrad.Engine(model=model, workers=3, loss="cross_entropy")
    with engine:
        engine.bind(model)
        engine.gradient(inputs=x, targets=y)
        assert relative_error(grads(model), ref) < 1e-5


def test_a_module_converted_after_bind_is_refused_then_bound_again():
    """model.double() (or .to(), .half()) after bind replaces the parameters' data, and
    their .grad's in place: the optimizer would then step copies no worker sees. gradient()
    refuses, naming the parameter; converted back and bound again, training goes on
    against plain PyTorch, the engine's own gradient views untouched by the conversion."""
    torch.manual_seed(9)
    model = Mlp()
    x, y = data(24)
    with shmgrad.Engine(model=model, workers=2, loss="cross_entropy") as engine:
        engine.bind(model)
        engine.gradient(inputs=x, targets=y)
        model.double()
        with pytest.raises(shmgrad.InvalidArgumentError, match=r"'fc1.weight' \(torch.float64"):
            engine.gradient(inputs=x, targets=y)
        model.float()
        engine.bind(model)
        ref = reference_gradient(model, "cross_entropy", x, y)
        engine.gradient(inputs=x, targets=y)
        assert relative_error(grads(model), ref) < 1e-5
        assert relative_error(engine.gradient_tensors(), ref) < 1e-5
        torch.optim.SGD(model.parameters(), lr=0.1).step()
        for p, shared in zip(model.parameters(), engine.parameter_tensors()):
            assert p.data_ptr() == shared.data_ptr()


def channels_last(t):
    """Whether a tensor is laid out channels_last (and not also row-major)."""
    return not t.is_contiguous() and t.is_contiguous(memory_format=torch.channels_last)


def conv_forward_checking_its_layout(m, batch):
    """An eager worker's forward that refuses to run unless its convolution's weight is
    channels_last, as the trainer's model is."""
    if not channels_last(m.conv.weight):
        raise RuntimeError(f"the worker's conv.weight has strides {m.conv.weight.stride()}")
    return F.cross_entropy(m(batch[0]), batch[1], reduction="sum")


@pytest.mark.parametrize("mode", ["script", "eager"])
def test_a_channels_last_model_keeps_its_layout_in_every_process(mode):
    """model.to(memory_format=torch.channels_last), as users write it for faster
    convolutions: after bind the 4-D weight and its .grad are still channels_last (bind
    made them row-major before, silently slower), the workers' weight too (the eager
    forward checks; TorchScript workers would sum another order), and the gradient and
    3 SGD steps match plain PyTorch's channels_last model."""
    torch.manual_seed(4)
    model = Cnn(channels=3).to(memory_format=torch.channels_last)
    plain = copy.deepcopy(model)
    g = torch.Generator().manual_seed(4)
    x, y = torch.randn(30, 3, 12, 12, generator=g), torch.randint(0, 5, (30,), generator=g)
    kwargs = (
        {"loss": "cross_entropy"}
        if mode == "script"
        else {"forward": conv_forward_checking_its_layout}
    )
    with shmgrad.Engine(model=model, workers=3, mode=mode, **kwargs) as engine:
        engine.bind(model)
        assert channels_last(model.conv.weight) and channels_last(model.conv.weight.grad)
        assert model.fc.weight.is_contiguous()
        opt, plain_opt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, plain))
        for step in range(3):
            batch = slice(10 * step, 10 * step + 10)
            ref = reference_gradient(plain, "cross_entropy", x[batch], y[batch])
            engine.gradient(inputs=x[batch], targets=y[batch])
            assert relative_error(grads(model), ref) < 1e-5, step
            assert channels_last(model.conv.weight.grad)
            opt.step()
            plain_opt.zero_grad()
            F.cross_entropy(plain(x[batch]), y[batch], reduction="sum").backward()
            plain_opt.step()
        assert relative_error(list(model.parameters()), list(plain.parameters())) < 1e-5
        assert channels_last(model.conv.weight)


# -- 7. errors at start ----------------------------------------------------------------
def test_dataloader_and_dict_examples_are_refused_at_start():
    x, y = data(8)
    loader = torch.utils.data.DataLoader(Pairs(x, y), batch_size=4)
    with pytest.raises(shmgrad.InvalidArgumentError, match="loader.dataset"):
        shmgrad.Engine(model=Mlp(), workers=1, loss="cross_entropy", dataset=loader)
    with pytest.raises(shmgrad.InvalidArgumentError, match="forward="):
        shmgrad.Engine(model=Mlp(), workers=1, loss="cross_entropy", dataset=DictPairs(x, y))
    # Examples that default_collate cannot stack: named where it happens, with the fix.
    with pytest.raises(shmgrad.InvalidArgumentError, match="collate_fn="):
        shmgrad.Engine(model=TinyLm(), workers=1, forward=token_loss, dataset=Sentences())


class DictPairs(Pairs):
    def __getitem__(self, i):
        return {"x": self.x[i], "y": self.y[i]}


def test_attached_client_has_a_mode():
    server = shmgrad.serve(model=Mlp(), workers=1, loss=F.cross_entropy)
    try:
        with shmgrad.attach(server.name) as client:
            assert client.mode == "eager"
    finally:
        server.stop()


# -- frozen parameters (fine-tuning) -----------------------------------------------------
def _train_like_pytorch(engine, model, ref, x, y, steps, freeze=None):
    """``steps`` AdamW steps (weight decay 0.1) of ``model`` through ``engine`` and of
    ``ref`` in this process, both optimizers over every parameter as fine-tuning code
    writes it; ``freeze(step, module)`` may change requires_grad before a step. Returns
    the engine's .grad of each parameter at the last step (None where PyTorch leaves it)."""
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)
    ropt = torch.optim.AdamW(ref.parameters(), lr=0.05, weight_decay=0.1)
    for step in range(steps):
        if freeze is not None:
            freeze(step, model)
            freeze(step, ref)
        opt.zero_grad()
        ropt.zero_grad()
        engine.gradient(inputs=x, targets=y, reduction="mean")
        F.cross_entropy(ref(x), y).backward()
        for p, r in zip(model.parameters(), ref.parameters()):
            assert (p.grad is None) == (r.grad is None), "a .grad where PyTorch has None"
        opt.step()
        ropt.step()
    return [p.grad for p in model.parameters()]


@pytest.mark.parametrize("mode", ["eager", "script"])
def test_frozen_parameters_keep_no_grad_and_are_not_decayed(mode):
    """A layer frozen before the engine starts: its .grad stays None, as backward leaves
    it, so AdamW over model.parameters() skips it (no weight decay), and every parameter
    follows plain PyTorch for 4 steps. (A zero .grad instead would decay it.)"""
    torch.manual_seed(9)
    model = Mlp()
    model.fc1.requires_grad_(False)
    ref = copy.deepcopy(model)
    frozen = model.fc1.weight.detach().clone()
    x, y = data(40)
    with shmgrad.Engine(model=model, workers=2, loss="cross_entropy", mode=mode) as engine:
        engine.bind(model)
        _train_like_pytorch(engine, model, ref, x, y, steps=4)
        assert torch.equal(model.fc1.weight, frozen)
        assert relative_error(list(model.parameters()), list(ref.parameters())) < 1e-5


def test_freezing_during_training_leaves_no_grad_and_unfreezing_back_works():
    """A layer frozen after 2 steps, unfrozen again after 4 (the engine started with it
    trainable, so its workers compute its gradient throughout): as plain PyTorch at every
    step, its .grad None while frozen."""
    torch.manual_seed(10)
    model = Mlp()
    ref = copy.deepcopy(model)
    x, y = data(40)

    def freeze(step, module):
        module.fc1.requires_grad_(not 2 <= step < 4)

    with shmgrad.Engine(model=model, workers=2, loss="cross_entropy") as engine:
        engine.bind(model)
        last = _train_like_pytorch(engine, model, ref, x, y, steps=3, freeze=freeze)
        assert last[0] is None and last[2] is not None
        last = _train_like_pytorch(engine, model, ref, x, y, steps=6, freeze=freeze)
        assert all(g is not None for g in last)
        assert relative_error(list(model.parameters()), list(ref.parameters())) < 1e-5


def test_unfreezing_what_the_engine_started_frozen_is_refused():
    """A parameter frozen in the model the engine started with: its workers compute no
    gradient for it, so requiring grad for it later is refused, naming it and the fix,
    before anything runs; frozen again, the engine serves."""
    torch.manual_seed(11)
    model = Mlp()
    model.fc1.requires_grad_(False)
    x, y = data(40)
    with shmgrad.Engine(model=model, workers=2, loss="cross_entropy") as engine:
        engine.bind(model)
        engine.gradient(inputs=x, targets=y)
        served = engine.status().steps_served
        model.fc1.weight.requires_grad_(True)
        with pytest.raises(
            shmgrad.InvalidArgumentError,
            match="parameter 'fc1.weight' requires grad, but it was frozen .* start the engine",
        ):
            engine.gradient(inputs=x, targets=y)
        assert engine.status().steps_served == served
        other = Mlp()
        with pytest.raises(shmgrad.InvalidArgumentError, match="'fc1.weight' \\(and 1 more\\)"):
            engine.bind(other)  # every parameter trainable: fc1's two are not the engine's
        model.fc1.weight.requires_grad_(False)
        engine.gradient(inputs=x, targets=y)
        assert model.fc1.weight.grad is None
        ref = copy.deepcopy(model)
        F.cross_entropy(ref(x), y, reduction="sum").backward()
        assert ref.fc1.weight.grad is None
        assert relative_error(grads(model.fc2), grads(ref.fc2)) < 1e-5


def test_lazy_module_not_yet_initialised_is_refused_naming_the_fix():
    """A LazyLinear before its first forward has no shape: refused at start, naming the
    parameter and the fix; nothing is started. After one forward it trains exactly."""
    model = torch.nn.Sequential(torch.nn.LazyLinear(16), torch.nn.ReLU(), torch.nn.Linear(16, 5))
    x, y = data(24)
    with pytest.raises(
        shmgrad.InvalidArgumentError, match="parameter '0.weight' is not initialised yet.*once"
    ):
        shmgrad.Engine(model=model, workers=2, loss="cross_entropy")
    model(x[:1])
    with shmgrad.Engine(model=model, workers=2, loss="cross_entropy") as engine:
        engine.bind(model)
        engine.gradient(inputs=x, targets=y)
        assert relative_error(grads(model), reference_gradient(model, "cross_entropy", x, y)) < 1e-5


def test_a_ddp_wrapped_model_is_refused_naming_the_module_it_wraps():
    """Code ported from DDP passes its DistributedDataParallel wrapper: refused at start
    and by bind(), naming ddp.module (before, a worker failed to start with torch's "Default
    process group has not been initialized"); the module it wraps trains exactly."""
    import torch.distributed as dist
    from helpers import free_port

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
    )
    try:
        model = Mlp()
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        x, y = data(24)
        with pytest.raises(
            shmgrad.InvalidArgumentError, match=r"DistributedDataParallel.*ddp\.module"
        ):
            shmgrad.Engine(model=ddp, workers=2, loss="cross_entropy")
        with shmgrad.Engine(model=ddp.module, workers=2, loss="cross_entropy") as engine:
            with pytest.raises(shmgrad.InvalidArgumentError, match=r"ddp\.module"):
                engine.bind(ddp)
            engine.bind(ddp.module)
            engine.gradient(inputs=x, targets=y)
            ref = reference_gradient(model, "cross_entropy", x, y)
            assert relative_error(grads(model), ref) < 1e-5
    finally:
        dist.destroy_process_group()


# -- parameters backward does not reach -------------------------------------------------
def grads_or_none(model):
    return [None if p.grad is None else p.grad.clone() for p in model.parameters()]


def assert_same_grads(got, want):
    """The same parameters without a gradient (None), the others equal."""
    assert [g is None for g in got] == [g is None for g in want]
    assert (
        relative_error([g for g in got if g is not None], [g for g in want if g is not None]) < 1e-5
    )


def branch_data(n, seed):
    """Inputs no example of which takes Branchy's branch, and the same with one marked."""
    x, y = data(n, d_in=6, classes=3, seed=seed)
    x[:, 0].clamp_(max=1.0)
    return x, y


@pytest.mark.parametrize("mode", ["eager", "script"])
def test_a_parameter_backward_never_reaches_keeps_grad_none_as_in_pytorch(mode):
    """An auxiliary head no batch takes: plain PyTorch's backward leaves its .grad None, and
    AdamW skips it (no weight decay, no moments). The engine did give it a zero gradient,
    so weight decay moved it every step; now its .grad is None too, the step says which
    parameters nothing reached, and 3 AdamW steps match PyTorch's."""
    torch.manual_seed(0)
    model = Branchy()
    ref = copy.deepcopy(model)
    aux_before = [p.detach().clone() for p in model.aux.parameters()]
    x, y = branch_data(24, seed=1)
    with shmgrad.Engine(model=model, workers=2, loss="cross_entropy", mode=mode) as engine:
        engine.bind(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
        for step in range(3):
            b = slice(8 * step, 8 * step + 8)
            opt.zero_grad()
            st = engine.gradient(inputs=x[b], targets=y[b], reduction="mean")
            assert st.unused_params == list(AUX)
            assert [p.grad is None for p in model.parameters()] == [i in AUX for i in range(6)]
            opt.step()
            ref_opt.zero_grad()
            F.cross_entropy(ref(x[b]), y[b]).backward()
            ref_opt.step()
        assert all(torch.equal(p, q) for p, q in zip(model.aux.parameters(), aux_before))
        for p, q in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-5, atol=1e-6)


def test_a_branch_one_worker_takes_has_its_gradient_and_accumulates():
    """A branch taken in one worker's shard only: the parameters have that worker's
    gradient (a parameter is unreached only when no participant reached it). Accumulated
    micro-batches: a gradient when any micro-batch reached it, None when none did."""
    torch.manual_seed(1)
    model = Branchy()
    x, y = branch_data(16, seed=2)
    marked = x.clone()
    marked[6, 0] = 1000.0  # in the second worker's shard of examples [0, 8)
    halves = [range(0, 4), range(4, 8)]
    with shmgrad.Engine(model=model, workers=2, loss="cross_entropy", mode="eager") as engine:
        engine.bind(model)
        st = engine.gradient(inputs=marked[:8], targets=y[:8])
        assert st.worker_examples == [4, 4] and st.unused_params == []
        assert_same_grads(grads_or_none(model), shard_gradients(model, marked, y, halves))

        def both(first, second):
            """The shards of two micro-batches of 8: `first` then `second` examples."""
            xs = torch.cat([first[0], second[0]])
            ys = torch.cat([first[1], second[1]])
            quarters = [range(0, 4), range(4, 8), range(8, 12), range(12, 16)]
            return shard_gradients(model, xs, ys, quarters)

        plain, hit = (x[8:16], y[8:16]), (marked[:8], y[:8])
        for first, second in ((plain, hit), (hit, plain), (plain, (x[:8], y[:8]))):
            engine.gradient(inputs=first[0], targets=first[1])
            engine.gradient(inputs=second[0], targets=second[1], accumulate=True)
            assert_same_grads(grads_or_none(model), both(first, second))
        assert model.aux.weight.grad is None  # the last pair: no micro-batch took the branch
        # optimizer.zero_grad(set_to_none=True) then accumulate: a fresh result again.
        model.zero_grad(set_to_none=True)
        engine.gradient(inputs=marked[:8], targets=y[:8], accumulate=True)
        assert_same_grads(grads_or_none(model), shard_gradients(model, marked, y, halves))


# -- 9. mixed precision ----------------------------------------------------------------
def test_autocast_forward_gives_float32_gradients():
    torch.manual_seed(6)
    model = Mlp()
    x, y = data(40)

    def forward(m, batch):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = m(batch[0])
        return F.cross_entropy(out.float(), batch[1], reduction="sum")

    ref = copy.deepcopy(model)
    forward(ref, (x, y)).backward()
    with shmgrad.Engine(model=model, workers=2, forward=forward) as engine:
        engine.bind(model)
        engine.gradient(inputs=x, targets=y)
        assert all(p.grad.dtype == torch.float32 for p in model.parameters())
        # bfloat16 products: the split changes the rounding, not the gradient.
        assert relative_error(grads(model), grads(ref)) < 2e-2


@pytest.mark.parametrize("kind", ["script", "eager"])
def test_loss_scale_scales_the_gradient_and_not_the_loss(kind):
    """A fixed loss_scale (a power of two) with TorchScript workers (a named loss) and
    eager ones (a callable): the gradient is the scale times the reference, for a sum
    and a mean, 3 workers and one (alone, writing the result itself); the loss is
    not scaled; a scale that is not a finite number > 0, or not a number, is refused and
    the engine keeps serving."""
    torch.manual_seed(2)
    model = Mlp()
    x, y = data(30)
    loss = "cross_entropy" if kind == "script" else summed_cross_entropy
    with shmgrad.Engine(model=model, workers=3, loss=loss, mode=kind) as engine:
        assert engine.status().worker_kind == kind
        engine.bind(model)
        for reduction in ("sum", "mean"):
            ref = reference_gradient(model, "cross_entropy", x, y, reduction=reduction)
            for mepw in (1, 100):
                st = engine.gradient(
                    inputs=x,
                    targets=y,
                    reduction=reduction,
                    loss_scale=1024.0,
                    min_examples_per_worker=mepw,
                )
                assert st.workers == (3 if mepw == 1 else 1)
                assert relative_error(grads(model), [1024 * g for g in ref]) < 1e-6
                with torch.no_grad():
                    want = float(F.cross_entropy(model(x), y, reduction=reduction))
                assert abs(st.loss - want) < 1e-5 * abs(want)
        for bad, says in [
            (0.0, "finite float32 number > 0"),
            (-4.0, "finite float32 number > 0"),
            (float("inf"), "finite float32 number > 0"),
            (float("nan"), "finite float32 number > 0"),
            (1e39, "finite float32 number > 0"),  # inf in float32
            ("2", "GradScaler or a number"),
            (torch.ones(2), "one number"),
        ]:
            with pytest.raises(shmgrad.InvalidArgumentError, match=says):
                engine.gradient(inputs=x, targets=y, loss_scale=bad)
        engine.gradient(inputs=x, targets=y, reduction="sum", loss_scale=torch.tensor(1.0))
        assert relative_error(grads(model), reference_gradient(model, "cross_entropy", x, y)) < 1e-5


def test_grad_scaler_training_matches_plain_pytorch():
    """float16 autocast with a GradScaler (its default scale, 2^16), written as PyTorch
    users write it, against the same loop through 3 eager workers with loss_scale=scaler:
    the scaler grows (growth interval 2), a batch with an example that overflows float16
    makes both loops skip that step and back off, and the scales and weights stay
    together: the workers' backward takes the mean's 1/B, so it overflows only where
    plain PyTorch's does (summed shards overflowed at step 0). Accumulating with a scale
    other than the previous call's is refused; a disabled scaler scales nothing."""
    torch.manual_seed(3)
    model = Mlp()
    plain = copy.deepcopy(model)
    x, y = data(48 * 8, seed=3)
    x[48 * 5 + 7] = 1e6  # float16's largest is 65504: this step's gradient is NaN
    batches = [torch.arange(48 * k, 48 * (k + 1)) for k in range(8)]

    def forward(m, batch):
        with torch.autocast("cpu", dtype=torch.float16):
            return F.cross_entropy(m(batch[0]), batch[1])  # a mean, computed in float32

    def make(params):
        opt = torch.optim.SGD(params, lr=0.1, momentum=0.9)
        return opt, torch.amp.GradScaler("cpu", growth_interval=2)  # from 2^16

    opt, scaler = make(plain.parameters())
    plain_scales, plain_weights = [], []
    for idx in batches:
        opt.zero_grad()
        scaler.scale(forward(plain, (x[idx], y[idx]))).backward()
        scaler.step(opt)
        scaler.update()
        plain_scales.append(scaler.get_scale())
        plain_weights.append([p.detach().clone() for p in plain.parameters()])

    with shmgrad.Engine(model=model, workers=3, forward=forward, dataset=Pairs(x, y)) as engine:
        engine.bind(model)
        opt, scaler = make(model.parameters())
        for k, idx in enumerate(batches):
            opt.zero_grad()
            st = engine.gradient(idx, loss_scale=scaler)
            assert st.nonfinite == (k == 5)
            scaler.step(opt)
            scaler.update()
            assert scaler.get_scale() == plain_scales[k], f"step {k}"
            # float16 products in another order: 4e-5 after 8 steps here.
            assert relative_error(list(model.parameters()), plain_weights[k]) < 1e-3, k
        assert plain_scales[4] > 2.0**16 and plain_scales[5] == plain_scales[4] / 2

        engine.gradient(batches[0], loss_scale=scaler)
        scaler.update(scaler.get_scale() * 2)
        with pytest.raises(shmgrad.InvalidArgumentError, match="same loss scale"):
            engine.gradient(batches[1], loss_scale=scaler, accumulate=True)
        off = torch.amp.GradScaler("cpu", enabled=False)
        st = engine.gradient(batches[1], loss_scale=off)
        ref = copy.deepcopy(model)
        forward(ref, (x[batches[1]], y[batches[1]])).backward()
        assert relative_error(grads(model), grads(ref)) < 1e-2  # float16 products


# -- 3. structured batches -------------------------------------------------------------
class DictModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, 8)
        self.fc = torch.nn.Linear(8 + 3, 4)

    def forward(self, ids, mask, extra):
        h = (self.emb(ids) * mask.unsqueeze(-1)).sum(1) / mask.sum(1, keepdim=True)
        return self.fc(torch.cat([h, extra["dense"].float()], 1))


def dict_forward(model, batch):
    # The worker sees the trainer's structure and dtypes.
    assert batch["mask"].dtype == torch.bool and batch["extra"]["dense"].dtype == torch.float16
    assert isinstance(batch["pair"], tuple) and isinstance(batch["extra"]["more"], list)
    logits = model(batch["ids"], batch["mask"].float(), batch["extra"])
    return F.cross_entropy(logits, batch["labels"])  # a mean


def dict_batch(n=21, seed=7):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 9, (n,), generator=g)
    mask = torch.arange(9)[None, :] < lengths[:, None]
    return {
        "ids": torch.randint(1, VOCAB, (n, 9), generator=g) * mask,
        "mask": mask,
        "labels": torch.randint(0, 4, (n,), generator=g),
        "extra": {"dense": torch.randn(n, 3, generator=g).half(), "more": [torch.zeros(n)]},
        "pair": (torch.ones(n, 2, dtype=torch.int32), torch.zeros(n, dtype=torch.uint8)),
    }


def test_structured_batch_is_split_and_exact():
    torch.manual_seed(8)
    model = DictModel()
    b = dict_batch()
    ref = copy.deepcopy(model)
    dict_forward(ref, b).backward()
    with shmgrad.Engine(model=model, workers=3, forward=dict_forward) as engine:
        engine.bind(model)
        st = engine.gradient(batch=b, reduction="mean")
        assert st.num_examples == 21 and st.workers == 3
        assert relative_error(grads(model), grads(ref)) < 1e-5
        # Bad batches: a clear error before anything runs, and the engine keeps serving.
        bad = dict(b, labels=b["labels"][:5])
        with pytest.raises(shmgrad.InvalidArgumentError, match="rows but the first has"):
            engine.gradient(batch=bad)
        with pytest.raises(shmgrad.InvalidArgumentError, match=r"batch\['name'\] is a str"):
            engine.gradient(batch=dict(b, name="x"))
        with pytest.raises(shmgrad.InvalidArgumentError, match="batch"):
            engine.gradient(batch=b, indices=[0])
        engine.gradient(batch=b, reduction="mean")
        assert relative_error(grads(model), grads(ref)) < 1e-5


def test_pair_batch_takes_the_default_loss_call():
    torch.manual_seed(9)
    model = Mlp()
    x, y = data(17)
    ref = reference_gradient(model, "cross_entropy", x, y)
    with shmgrad.Engine(model=model, workers=2, loss="cross_entropy", mode="eager") as engine:
        engine.bind(model)
        engine.gradient(batch=(x, y))
        assert relative_error(grads(model), ref) < 1e-5


def popping_mean_loss(model, batch):
    labels = batch.pop("labels")  # a common Hugging Face habit: the probe must allow it
    logits = model(batch["ids"])
    # A mean over examples (each sequence's summed token loss), as a mean must be.
    per_token = F.cross_entropy(logits.transpose(1, 2), labels, ignore_index=PAD, reduction="none")
    return per_token.sum(1).mean()


def test_found_out_mean_with_a_forward_that_pops_from_its_batch():
    torch.manual_seed(10)
    model = TinyLm()
    ds = Sentences(n=12)
    ref = copy.deepcopy(model)
    popping_mean_loss(ref, pad([ds[i] for i in range(12)])).backward()
    with shmgrad.Engine(
        model=model, workers=2, dataset=ds, collate_fn=pad, forward=popping_mean_loss
    ) as engine:
        engine.bind(model)
        engine.gradient(range(12), reduction="mean")
        assert relative_error(grads(model), grads(ref)) < 1e-5


# -- a gradient dropped before the optimizer could use it ----------------------------------
def _discarding_steps(engine, model, opt, x, y, between):
    for _ in range(3):
        engine.gradient(inputs=x, targets=y)
        between()
        opt.step()


@pytest.mark.parametrize(
    "drop, cause",
    [("none", "set to None"), ("zero", "zeroed")],
)
def test_a_gradient_dropped_before_the_step_warns_once_naming_the_cause(drop, cause):
    """The order Lightning's automatic optimization runs a training_step that calls the
    engine in: gradient(), then zero_grad(), then step(), which then trains on nothing."""
    torch.manual_seed(0)
    model = Mlp()
    x, y = data(8)
    with shmgrad.Engine(model=model, workers=2, loss="cross_entropy", mode="eager") as engine:
        engine.bind(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        before = [p.detach().clone() for p in model.parameters()]
        with pytest.warns(RuntimeWarning, match=cause) as record:
            _discarding_steps(
                engine, model, opt, x, y, lambda: opt.zero_grad(set_to_none=drop == "none")
            )
        assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    dropped = [w for w in record if "did not use the engine's gradient" in str(w.message)]
    assert len(dropped) == 1, [str(w.message) for w in record]
    assert "optimizer_zero_grad" in str(dropped[0].message)


def test_a_loop_that_uses_its_gradient_does_not_warn():
    """Clipping and unscaling change .grad in place, an optimizer over other parameters
    steps too, and zero_grad() after the step is the usual place: none of it warns."""
    import warnings

    torch.manual_seed(0)
    model, other = Mlp(), torch.nn.Linear(2, 2)
    x, y = data(8)
    with shmgrad.Engine(model=model, workers=2, loss="cross_entropy", mode="eager") as engine:
        engine.bind(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        opt_other = torch.optim.SGD(other.parameters(), lr=0.1)
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)
            for _ in range(3):
                engine.gradient(inputs=x, targets=y)
                opt_other.zero_grad()  # another model's optimizer, dropping its own .grad
                opt_other.step()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
                opt.step()
                opt.zero_grad()
