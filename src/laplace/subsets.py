"""Parameter subsets: which weights the posterior covers and how a weight vector drives the model.

``AllWeights`` covers every parameter with ``requires_grad=True``; ``LastLayer`` the linear head
of a :class:`~laplace.utils.feature_extractor.FeatureExtractor`, which may only be found on the
first forward pass (``resolved`` tells). Both implement the same small interface.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from torch.func import functional_call

from laplace.data import Inputs
from laplace.utils.feature_extractor import FeatureExtractor

__all__ = ["AllWeights", "LastLayer"]


class _FlatParameters:
    """Flattening of ``self.params`` (named ``self.names``) into one vector, in that order."""

    params: list[Tensor]
    names: list[str]

    @property
    def sizes(self) -> list[int]:
        """Number of entries of each parameter tensor."""
        return [p.numel() for p in self.params]

    @property
    def n_params(self) -> int:
        """Number of weights P covered by the posterior."""
        return sum(self.sizes)

    @property
    def n_layers(self) -> int:
        """Number of parameter tensors (a Linear layer with bias counts twice)."""
        return len(self.params)

    @property
    def device(self) -> torch.device:
        """Device of the parameters."""
        return self.params[0].device

    @property
    def dtype(self) -> torch.dtype:
        """Floating-point type of the parameters."""
        return self.params[0].dtype

    def vector(self) -> Tensor:
        """The current weights as one vector, shape (P,)."""
        return torch.cat([p.reshape(-1) for p in self.params])

    def unflatten(self, theta: Tensor) -> dict[str, Tensor]:
        """Split a vector (P,) into named parameter tensors."""
        chunks = torch.split(theta, self.sizes)
        return {n: c.view_as(p) for n, c, p in zip(self.names, chunks, self.params)}


class AllWeights(_FlatParameters):
    """All trainable parameters of ``model``, flattened in ``model.named_parameters()`` order.

    Args:
        model: The network; parameters with ``requires_grad=False`` stay at their values.

    Raises:
        ValueError: If the model has no trainable parameters.
    """

    #: The parameters are known from construction.
    resolved = True

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

    def forward_with(self, theta: Tensor, X: Any, **model_kwargs: Any) -> Tensor:
        """Model output at weights ``theta`` (P,) without modifying the model."""
        return functional_call(self.model, self.unflatten(theta), (X,), model_kwargs)

    def forward_samples(self, thetas: Tensor, X: Any, **model_kwargs: Any) -> Tensor:
        """Model outputs for each weight sample: thetas (S, P) → (S, B, C)."""
        return torch.stack([self.forward_with(theta, X, **model_kwargs) for theta in thetas])


class LastLayer(_FlatParameters):
    """Weight and bias of a linear head ``f = W φ + b``, flattened as W (C, D) row-major, b (C,).

    Args:
        extractor: The wrapped model; its last layer may still be unknown (``resolved``).
    """

    def __init__(self, extractor: FeatureExtractor) -> None:
        self.model = extractor

    @property
    def resolved(self) -> bool:
        """Whether the last layer is known."""
        return self.model.last_layer is not None

    def resolve(self, X: Inputs) -> None:
        """Find the last layer with one forward pass on ``X`` if it is not known yet."""
        if not self.resolved:
            with torch.no_grad():
                self.model.find_last_layer(X)

    @property
    def layer(self) -> nn.Linear:
        """The linear head.

        Raises:
            RuntimeError: If it has not been found yet.
        """
        if self.model.last_layer is None:
            raise RuntimeError(
                "the last layer is not known yet: it is found on the first batch of fit() "
                "(call fit() first, or pass last_layer_name=...)."
            )
        return self.model.last_layer

    @property
    def params(self) -> list[Tensor]:
        """Weight, then bias if the head has one."""
        return list(self.layer.parameters())

    @property
    def names(self) -> list[str]:
        """Parameter names in the wrapped model (e.g. ``"head.weight"``)."""
        prefix = f"{self.model.last_layer_name}." if self.model.last_layer_name else ""
        return [prefix + name for name, _ in self.layer.named_parameters()]

    @property
    def device(self) -> torch.device:
        """Device of the head, or of the model while the head is unknown."""
        return super().device if self.resolved else next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        """Floating-point type of the head, or of the model while the head is unknown."""
        return super().dtype if self.resolved else next(self.model.parameters()).dtype

    def outputs_and_features(self, X: Inputs, **model_kwargs: Any) -> tuple[Tensor, Tensor]:
        """Model outputs (B, C) and head inputs φ from one forward pass.

        φ is (B, D) when the head maps each data point's features to its outputs (the closed
        forms apply); otherwise (e.g. (B, T, D) without ``feature_reduction``, or reward pairs)
        callers fall back to autograd routes.
        """
        return self.model.forward_with_features(X, **model_kwargs)

    def head(self, thetas: Tensor, phi: Tensor) -> Tensor:
        """Head outputs for weight samples: thetas (S, P), features (B, D) → (S, B, C)."""
        n_out, n_in = self.layer.out_features, self.layer.in_features
        W = thetas[:, : n_out * n_in].reshape(-1, n_out, n_in)
        f = torch.einsum("bd,scd->sbc", phi, W)
        if self.layer.bias is not None:
            f = f + thetas[:, n_out * n_in :].unsqueeze(1)
        return f

    def forward_with(self, theta: Tensor, X: Inputs, **model_kwargs: Any) -> Tensor:
        """Model output with head weights ``theta`` (P,), shape (B, C)."""
        return self.forward_samples(theta.unsqueeze(0), X, **model_kwargs)[0]

    def forward_samples(self, thetas: Tensor, X: Inputs, **model_kwargs: Any) -> Tensor:
        """Outputs for head samples thetas (S, P) → (S, B, C), from one feature pass."""
        _, phi = self.outputs_and_features(X, **model_kwargs)
        if phi.dim() == 2:
            return self.head(thetas, phi)
        net = self.model.model
        return torch.stack(
            [functional_call(net, self.unflatten(t), (X,), model_kwargs) for t in thetas]
        )
