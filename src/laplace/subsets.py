"""Parameter subsets: which weights the posterior covers and how a weight vector drives the model.

``AllWeights`` covers every parameter with ``requires_grad=True``; the last-layer and subnetwork
subsets of later structures implement the same small interface.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from torch.func import functional_call

__all__ = ["AllWeights"]


class AllWeights:
    """All trainable parameters of ``model``, flattened in ``model.named_parameters()`` order.

    Args:
        model: The network; parameters with ``requires_grad=False`` stay at their values.

    Raises:
        ValueError: If the model has no trainable parameters.
    """

    def __init__(self, model: nn.Module) -> None:
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        if not named:
            raise ValueError(
                "the model has no parameters with requires_grad=True: nothing to put a "
                "posterior on."
            )
        self.model = model
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self.sizes = [p.numel() for p in self.params]

    @property
    def n_params(self) -> int:
        """Number of weights P covered by the posterior."""
        return sum(self.sizes)

    @property
    def n_layers(self) -> int:
        """Number of parameter tensors (a Linear layer with bias counts twice)."""
        return len(self.params)

    def vector(self) -> Tensor:
        """The current weights as one vector, shape (P,)."""
        return torch.cat([p.reshape(-1) for p in self.params])

    def unflatten(self, theta: Tensor) -> dict[str, Tensor]:
        """Split a vector (P,) into named parameter tensors."""
        chunks = torch.split(theta, self.sizes)
        return {n: c.view_as(p) for n, c, p in zip(self.names, chunks, self.params)}

    def forward_with(self, theta: Tensor, X: Any, **model_kwargs: Any) -> Tensor:
        """Model output at weights ``theta`` (P,) without modifying the model."""
        return functional_call(self.model, self.unflatten(theta), (X,), model_kwargs)
