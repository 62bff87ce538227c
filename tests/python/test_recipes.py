"""docs/GUIDE.md's loss recipes, read from the guide itself and run as written, each with
the kind of model it names, against the gradient of plain PyTorch's ``outputs.loss`` of
the same batch (tiny models built from configs, no download)."""

import copy
import os
import re

import pytest
import torch

import shmgrad
from conftest import ci_runs, python_blocks, relative_error
from text_models import (
    UNEVEN_BATCH,
    TokenSequences,
    lm_collate,
    pad_collate,
    tiny_bert,
    tiny_bert_tagger,
    tiny_gpt2,
    token_tag_collate,
)

GUIDE = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "GUIDE.md")


def _guide():
    with open(GUIDE) as f:
        return f.read()


def _python_block_defining(name):
    """The guide's python code block that defines ``name``, run: its namespace."""
    for _, _, block in python_blocks("docs/GUIDE.md"):
        if f"def {name}(" in block:
            namespace = {"torch": torch}
            exec(compile(block, GUIDE, "exec"), namespace)
            return namespace
    raise AssertionError(f"docs/GUIDE.md has no python block defining {name}")


def _inline_forward(pattern):
    """The one ``forward=lambda ...`` in the guide's text that matches ``pattern``, as a
    function."""
    found = set(re.findall(r"forward=(lambda m, b: [^`\n]*?)(?:`|\)?$)", _guide(), re.M))
    chosen = [text for text in found if re.search(pattern, text)]
    assert len(chosen) == 1, (pattern, found)
    return eval(chosen[0], {"torch": torch})  # noqa: S307 - the guide's own text


def _recipe(name):
    if name == "causal_lm_loss" or name == "token_loss":
        return _python_block_defining(name)[name]
    if name == "causal_lm_one_line":
        return _inline_forward(r"num_items_in_batch=1")
    assert name == "classifier_outputs_loss"
    return _inline_forward(r"^lambda m, b: m\(\*\*b\)\.loss$")


# (recipe, the model it is for, that model's collate_fn)
RECIPES = [
    ("causal_lm_loss", tiny_gpt2, lm_collate),
    ("causal_lm_one_line", tiny_gpt2, lm_collate),
    ("token_loss", tiny_bert_tagger, token_tag_collate),
    ("classifier_outputs_loss", tiny_bert, pad_collate),
]


@pytest.mark.parametrize(
    "name, make_model, collate",
    ci_runs(
        RECIPES, keep=("causal_lm_one_line", "classifier_outputs_loss"), ids=[r[0] for r in RECIPES]
    ),
)
def test_readme_recipe_gives_outputs_loss_gradient(name, make_model, collate):
    transformers = pytest.importorskip("transformers")
    forward = _recipe(name)
    torch.manual_seed(0)
    model = make_model(transformers)
    ref = copy.deepcopy(model)
    ds = TokenSequences()
    with shmgrad.Engine(
        model=model, workers=2, dataset=ds, collate_fn=collate, forward=forward
    ) as engine:
        engine.bind(model)
        stats = engine.gradient(UNEVEN_BATCH)  # the loss's own reduction, as backward()
        got = [p.grad.clone() for p in model.parameters()]
    assert sorted(stats.worker_examples) == [5, 6]
    want_loss = ref(**collate([ds[i] for i in UNEVEN_BATCH])).loss  # the model's own
    want_loss.backward()
    assert relative_error(got, [p.grad for p in ref.parameters()]) < 1e-5
    assert abs(stats.loss - want_loss.item()) < 1e-5 * max(1.0, abs(want_loss.item()))


def test_the_encoder_recipe_on_a_causal_lm_is_another_objective():
    """Why the guide keeps two per-token recipes apart: on a causal LM the unshifted one is
    not the model's loss (it would teach the model to copy its input)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = tiny_gpt2(transformers)
    batch = lm_collate([TokenSequences()[i] for i in UNEVEN_BATCH])
    own = model(**batch).loss
    total, count = _recipe("token_loss")(model, batch)
    shifted_total, shifted_count = _recipe("causal_lm_loss")(model, batch)
    assert abs(float(shifted_total / shifted_count) - own.item()) < 1e-5 * own.item()
    assert int(count) == int(shifted_count) + len(UNEVEN_BATCH)  # one label more a sequence
    assert abs(float(total / count) - own.item()) > 0.01 * own.item()
