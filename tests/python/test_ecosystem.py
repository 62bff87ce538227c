"""Models from the PyTorch ecosystem (Hugging Face transformers, timm) in eager workers,
against plain PyTorch in one process, and the text classification example."""

import copy
import os
import re
import subprocess
import sys

import pytest
import torch

import shmgrad
from conftest import relative_error
from text_models import UNEVEN_BATCH, TokenSequences, lm_collate, pad_collate, tiny_bert, tiny_gpt2

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# -- a Hugging Face BERT on variable-length token sequences --------------------------------
def bert_length_weighted_loss(model, batch):
    """A weighted mean: each example's loss weighted by its tokens, as (sum, count)."""
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    logits = model(**inputs).logits
    tokens = batch["attention_mask"].sum(1)
    per_example = torch.nn.functional.cross_entropy(logits, batch["labels"], reduction="none")
    return (per_example * tokens).sum(), tokens.sum()


@pytest.mark.parametrize(
    "forward, engine_args",
    [
        # The model's own loss, the mean over the shard's examples, declared as a mean.
        (lambda model, batch: model(**batch).loss, {"loss_reduction": "mean"}),
        (bert_length_weighted_loss, {}),
    ],
    ids=["outputs-loss-mean", "loss-sum-and-count"],
)
def test_hugging_face_bert_with_padding_collate_matches_one_process(forward, engine_args):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = tiny_bert(transformers)
    ref = copy.deepcopy(model)
    ds = TokenSequences()
    # The shards are unequal, so a mean must be weighted by each shard's examples (or
    # counts); a worker pads its shard to another length than the whole batch's.
    idx = UNEVEN_BATCH
    lengths = [len(ds[i]["input_ids"]) for i in idx]
    assert max(lengths[:5]) != max(lengths[5:]) and max(lengths[:6]) != max(lengths[6:])
    with shmgrad.Engine(
        model=model, workers=2, dataset=ds, collate_fn=pad_collate, forward=forward, **engine_args
    ) as engine:
        assert engine.mode == "eager"
        engine.bind(model)
        stats = engine.gradient(idx, reduction="mean")
        got = [p.grad.clone() for p in model.parameters()]
    assert stats.num_examples == 11 and sorted(stats.worker_examples) == [5, 6]
    ref.zero_grad(set_to_none=True)
    out = forward(ref, pad_collate([ds[i] for i in idx]))
    want_loss = out[0] / out[1] if isinstance(out, tuple) else out  # the batch's mean
    want_loss.backward()
    want = [p.grad for p in ref.parameters()]
    assert all(w is not None for w in want)
    assert relative_error(got, want) < 1e-5
    assert abs(stats.loss - want_loss.item()) < 1e-5 * max(1.0, abs(want_loss.item()))


# -- a Hugging Face causal language model, labels padded with -100 -------------------------
def test_hugging_face_causal_lm_token_mean_is_refused_as_written():
    """`model(**batch).loss` of a causal LM is the mean over the batch's tokens: weighted
    by each shard's examples it would be silently wrong, so the engine refuses it when it
    finds it out (the first sequences differ in length), naming the fix. The fix, the
    guide's (loss_sum, count) recipes (docs/GUIDE.md), is tested in test_recipes.py."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    ds = TokenSequences()
    assert len(ds[0]["input_ids"]) != len(ds[1]["input_ids"])
    with pytest.raises(shmgrad.InvalidArgumentError, match=r"not over the batch's examples"):
        shmgrad.Engine(
            model=tiny_gpt2(transformers),
            workers=2,
            dataset=ds,
            collate_fn=lm_collate,
            forward=lambda model, batch: model(**batch).loss,
        )


# -- a timm ResNet on explicit image batches ------------------------------------------------
def timm_resnet_in_eval_mode(timm):
    """timm's resnet10t (no download) with BatchNorm running statistics other than the
    initial 0 and 1, in eval mode. BatchNorm in train mode normalises each worker's shard
    with the shard's statistics, which are not the batch's: in eval mode (running
    statistics) the split is exact."""
    torch.manual_seed(0)
    model = timm.create_model("resnet10t", pretrained=False, num_classes=5)
    with torch.no_grad():
        model(torch.randn(16, 3, 32, 32, generator=torch.Generator().manual_seed(2)) * 2 + 0.5)
    return model.eval()


def image_batch(n=7):
    """Seven 3x32x32 images and labels 0..4: shards of 4 and 3 examples over 2 workers."""
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, 3, 32, 32, generator=g), torch.randint(0, 5, (n,), generator=g)


def test_timm_resnet_in_eval_mode_matches_one_process():
    timm = pytest.importorskip("timm")
    model = timm_resnet_in_eval_mode(timm)
    ref = copy.deepcopy(model)
    x, y = image_batch()
    # A mean loss module, as written in a plain PyTorch loop: the engine reads its reduction.
    with shmgrad.Engine(model=model, loss=torch.nn.CrossEntropyLoss(), workers=2) as engine:
        assert engine.mode == "eager"
        engine.bind(model)
        assert not model.training
        stats = engine.gradient(inputs=x, targets=y, reduction="mean")
        got = [p.grad.clone() for p in model.parameters()]
    assert stats.num_examples == 7 and sorted(stats.worker_examples) == [3, 4]
    ref.zero_grad(set_to_none=True)
    want_loss = torch.nn.functional.cross_entropy(ref(x), y)
    want_loss.backward()
    want = [p.grad for p in ref.parameters()]
    assert all(w is not None for w in want)
    assert relative_error(got, want) < 1e-5
    assert abs(stats.loss - want_loss.item()) < 1e-5 * max(1.0, abs(want_loss.item()))


def test_eval_mode_steps_leave_batchnorm_statistics_unchanged():
    timm = pytest.importorskip("timm")
    model = timm_resnet_in_eval_mode(timm)
    ref = copy.deepcopy(model)
    x, y = image_batch()
    with shmgrad.Engine(model=model, loss=torch.nn.CrossEntropyLoss(), workers=2) as engine:
        engine.bind(model)
        for _ in range(3):
            assert sorted(engine.gradient(inputs=x, targets=y).worker_examples) == [3, 4]
    # In eval mode no worker changes its BatchNorm statistics: whatever rule combines the
    # workers' copies (default: their average weighted by examples), the result is the same.
    changed = [
        name for (name, b), r in zip(model.named_buffers(), ref.buffers()) if not torch.equal(b, r)
    ]
    assert not changed, f"{len(changed)} buffers changed in eval mode, e.g. {changed[:3]}"


# -- the example ---------------------------------------------------------------------------
def test_train_text_example_runs_and_reports_accuracy():
    pytest.importorskip("transformers")
    proc = subprocess.run(
        [
            sys.executable,
            os.path.join(REPO, "examples", "train_text.py"),
            "--epochs",
            "1",
            "--train-examples",
            "256",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert re.search(r"test accuracy \d+\.\d+%", proc.stdout), proc.stdout
