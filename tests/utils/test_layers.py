"""Layer helpers (``laplace.utils.layers``): parameters per layer, batch-norm detection."""

from __future__ import annotations

from torch import nn

from laplace.utils import _is_batchnorm, parameters_per_layer


def test_parameters_per_layer_counts_every_tensor():
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2, bias=False))
    model[0].bias.requires_grad_(False)  # frozen tensors are still counted
    assert parameters_per_layer(model) == [12, 4, 8]


def test_is_batchnorm():
    for bn in (nn.BatchNorm1d(3), nn.BatchNorm2d(3), nn.BatchNorm3d(3)):
        assert _is_batchnorm(bn)
    for other in (nn.LayerNorm(3), nn.Linear(2, 2), nn.GroupNorm(1, 3)):
        assert not _is_batchnorm(other)
