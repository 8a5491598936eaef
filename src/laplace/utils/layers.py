"""Facts about a network's layers: parameter counts per tensor, batch-norm layers."""

from __future__ import annotations

from torch import nn

__all__ = ["is_batchnorm", "parameters_per_layer"]

_BATCHNORM_TYPES = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)


def parameters_per_layer(model: nn.Module) -> list[int]:
    """``[p.numel() for p in model.parameters()]`` (frozen parameters included)."""
    return [p.numel() for p in model.parameters()]


def is_batchnorm(module: nn.Module) -> bool:
    """Whether ``module`` is a ``BatchNorm1d/2d/3d`` (or a subclass)."""
    return isinstance(module, _BATCHNORM_TYPES)
