"""TorchScript workers' linear layers compute their weight and bias gradients straight into
the slot (worker/direct_linear.h: the replica's aten::linear nodes become shmgrad::linear),
as eager workers' do (python/shmgrad/_direct.py; issue 38): the same bits as the
write-first copy (SHMGRAD_DIRECT_LINEAR=0), and plain PyTorch's gradient."""

import pytest
from torch import nn

import shmgrad
from shmgrad import _C
from helpers import LinearLayers, check_direct_linear_bits


def test_a_replicas_linear_layers_are_rewritten(tmp_path):
    path = tmp_path / "layers.pt"
    shmgrad.save_model(LinearLayers(), path)
    count, graph = _C.rewrite_linears(str(path))
    # nn.Linear's forward is one method per module type (with and without a bias): each
    # aten::linear in it, and none left.
    assert count >= 2
    assert "shmgrad::linear" in graph and "aten::linear" not in graph
    plain = nn.Sequential(nn.Tanh())
    shmgrad.save_model(plain, tmp_path / "plain.pt")
    assert _C.rewrite_linears(str(tmp_path / "plain.pt"))[0] == 0


@pytest.mark.parametrize("workers,per_pass", [(1, 5), (2, None)])
def test_direct_linear_gives_the_copied_paths_bits(monkeypatch, workers, per_pass):
    """Over one shard in passes of 5 (a later pass must add, not overwrite) and two workers,
    two steps each (the second after an optimizer step)."""
    check_direct_linear_bits(monkeypatch, LinearLayers, "script", workers, per_pass, 12)
