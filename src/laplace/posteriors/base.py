"""The contract every posterior structure (dense, diagonal, Kronecker, low-rank) implements.

A structure owns two things: how the curvature of a batch is obtained from a backend and summed
over batches, and the Gaussian posterior ``N(θ_MAP, P⁻¹)`` with ``P = h·H + diag(p₀)`` once the
curvature ``H``, the likelihood factor ``h = 1/(σ²T)`` and the prior precision ``p₀`` are known.
Predictives, the marginal likelihood and hyperparameter tuning only talk to this interface, so they
never branch on the structure.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

__all__ = ["NotPositiveDefiniteError", "Posterior"]


class NotPositiveDefiniteError(RuntimeError):
    """The posterior precision could not be factorised: it is not positive definite."""


class Posterior(ABC):
    """Gaussian posterior with precision ``P = h·H + diag(p₀)`` over P parameters.

    Args:
        H: Curvature in the structure's own representation (summed over the data).
        h_factor: Scalar likelihood factor ``h = 1/(σ²T)``, shape () or (1,).
        prior_diag: Diagonal of the prior precision, shape (P,).
    """

    def __init__(self, H: Any, h_factor: Tensor, prior_diag: Tensor) -> None:
        self.H = H
        self.h_factor = h_factor.reshape(())
        self.prior_diag = prior_diag

    # ---------------------------------------------------------------- curvature accumulation
    @staticmethod
    @abstractmethod
    def zeros(params: Sequence[Tensor]) -> Any:
        """Empty curvature for the parameter tensors ``params`` (on their device and dtype)."""

    @staticmethod
    @abstractmethod
    def batch_curvature(backend: Any, X: Any, y: Tensor, n_data: int) -> tuple[Tensor, Any]:
        """``(loss, H_batch)`` of one batch from a curvature backend.

        Args:
            backend: A :class:`~laplace.curvature.CurvatureInterface`.
            X: Inputs of the batch.
            y: Targets of the batch.
            n_data: Number of data points of the whole training set (KFAC rescaling).
        """

    @staticmethod
    def finalize(H: Any) -> Any:
        """The curvature as stored after a fit (e.g. eigen-decomposed); identity by default."""
        return H

    @staticmethod
    def is_finite(H: Any) -> bool:
        """Whether every entry of the curvature is finite.

        A sum is finite iff every summand is (barring overflow), so one reduction suffices.
        """
        return bool(torch.isfinite(H.sum()))

    # ------------------------------------------------------------------------ the posterior
    @property
    @abstractmethod
    def precision(self) -> Any:
        """The posterior precision ``P`` in the structure's representation."""

    @property
    @abstractmethod
    def log_det(self) -> Tensor:
        """``log det P``, a scalar."""

    @abstractmethod
    def square_form(self, delta: Tensor) -> Tensor:
        """``Δᵀ P Δ`` for ``delta`` of shape (P,), a scalar."""

    @abstractmethod
    def functional_variance(self, Js: Tensor) -> Tensor:
        """``J P⁻¹ Jᵀ`` per point: ``Js`` (B, C, P) → (B, C, C)."""

    @abstractmethod
    def functional_covariance(self, Js: Tensor) -> Tensor:
        """Joint ``J P⁻¹ Jᵀ`` over all rows: ``Js`` (N, P) → (N, N)."""

    @abstractmethod
    def sample_deviations(self, n_samples: int, generator: torch.Generator | None) -> Tensor:
        """Draws of ``θ − θ_MAP ~ N(0, P⁻¹)``, shape (n_samples, P)."""

    def _standard_normal(
        self, shape: tuple[int, ...], generator: torch.Generator | None
    ) -> Tensor:
        return torch.randn(
            shape, generator=generator, device=self.prior_diag.device, dtype=self.prior_diag.dtype
        )
