"""docs/LIGHTNING.md's recipe, read from the document and run as written, against
Lightning's own single-process run of the same model; and the obvious port (the engine
called from training_step, nothing overridden), which trains nothing, warns."""

import copy
import os
import re
import warnings

import pytest
import torch

import shmgrad
from conftest import Mlp

DOC = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "LIGHTNING.md")
STEPS = 4
BATCH = 8

pl = pytest.importorskip("pytorch_lightning")


def _recipe():
    with open(DOC) as f:
        (block,) = re.findall(r"```python\n(.*?)```", f.read(), re.S)
    namespace = {}
    exec(compile(block, DOC, "exec"), namespace)
    return namespace["EngineClassifier"]


class PlainClassifier(pl.LightningModule):
    """The same model and optimizer, trained the plain Lightning way."""

    def __init__(self, model, lr=0.05):
        super().__init__()
        self.model, self.lr = model, lr

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.cross_entropy(self.model(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.model.parameters(), lr=self.lr, momentum=0.9)


class ObviousPort(PlainClassifier):
    """training_step calls the engine and returns its loss; zero_grad and backward are
    Lightning's own."""

    def __init__(self, model, engine):
        super().__init__(model)
        self.engine = engine

    def training_step(self, batch, batch_idx):
        x, y = batch
        stats = self.engine.gradient(inputs=x, targets=y)
        return torch.tensor(stats.loss, requires_grad=True)


def _loader():
    g = torch.Generator().manual_seed(0)
    x, y = (
        torch.randn(STEPS * BATCH, 20, generator=g),
        torch.randint(0, 5, (STEPS * BATCH,), generator=g),
    )
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=BATCH)


def _fit(module, **trainer_args):
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=STEPS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **trainer_args,
    )
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", module="pytorch_lightning")  # its advice on workers
        warnings.filterwarnings("ignore", module="lightning_fabric")
        trainer.fit(module, _loader())
    return trainer


@pytest.mark.parametrize("clip", [None, 0.05], ids=["plain", "gradient-clipping"])
def test_the_docs_recipe_trains_as_lightning_does(clip):
    torch.manual_seed(0)
    net = Mlp()
    ref = copy.deepcopy(net)
    start = [p.detach().clone() for p in net.parameters()]
    module = _recipe()(net, workers=2)
    _fit(module, gradient_clip_val=clip)
    assert module.engine is None  # teardown closed it
    _fit(PlainClassifier(ref), gradient_clip_val=clip)
    moved = max(float((a - b).abs().max()) for a, b in zip(ref.parameters(), start))
    assert moved > 1e-3  # the reference trained
    for (name, p), q in zip(net.named_parameters(), ref.parameters()):
        assert torch.allclose(p, q, rtol=1e-5, atol=1e-6), name


def test_the_obvious_port_warns_that_it_trains_nothing():
    torch.manual_seed(0)
    net = Mlp()
    before = [p.detach().clone() for p in net.parameters()]
    with shmgrad.Engine(model=net, workers=2, loss=torch.nn.CrossEntropyLoss()) as engine:
        engine.bind(net)
        with pytest.warns(RuntimeWarning, match=r"set to None.*optimizer_zero_grad"):
            _fit(ObviousPort(net, engine))
    assert all(torch.equal(a, b) for a, b in zip(before, net.parameters()))
