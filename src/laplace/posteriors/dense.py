"""Dense posterior: ``P = h·H + diag(p₀)`` stored as a full (P, P) matrix."""

from __future__ import annotations

from collections.abc import Sequence
from functools import cached_property
from typing import Any, ClassVar

import torch
from torch import Tensor
from typing_extensions import override

from laplace.errors import check_fits_in_memory
from laplace.jacobians import HeadFeatures, Jacobian
from laplace.last_layer import FULL_HEAD_CURVATURE, HeadCurvature, full_head_variance
from laplace.posteriors.base import ClosedForm, NotPositiveDefiniteError, Posterior

__all__ = ["DensePosterior", "check_dense_size"]


def check_dense_size(n_params: int, dtype: torch.dtype, device: torch.device) -> None:
    """Refuse a dense (P, P) matrix larger than the memory of the device it would live on.

    Raises:
        TooLargeError: (a ``ValueError`` and a ``RuntimeError``) naming the size and the
            structures that fit.
    """
    check_fits_in_memory(
        n_params**2 * (torch.finfo(dtype).bits // 8),
        device,
        f"a dense (P, P) curvature of P={n_params:,} parameters in {dtype}",
        "use hessian_structure='kron' or 'diag' (or fewer parameters).",
    )


def _head_variance(posterior: DensePosterior, J: HeadFeatures) -> Tensor:
    return full_head_variance(posterior.covariance, J.phi, J.n_out, J.bias)


class DensePosterior(Posterior):
    """Full-covariance Gaussian posterior, factorised once by a Cholesky decomposition.

    ``log det P``, ``J P⁻¹ Jᵀ`` and samples all reuse the lower Cholesky factor ``L`` of
    ``P = L Lᵀ``; the covariance ``P⁻¹`` and its scale are built only when asked for (the
    functional variance of a linear head's features uses the covariance).
    """

    closed_forms: ClassVar[dict[type[Jacobian], ClosedForm]] = {HeadFeatures: _head_variance}
    head_curvature: ClassVar[HeadCurvature | None] = FULL_HEAD_CURVATURE

    @override
    @staticmethod
    def zeros(params: Sequence[Tensor]) -> Tensor:
        """Zero (P, P) curvature; refused where it cannot fit (:func:`check_dense_size`)."""
        n_params = sum(p.numel() for p in params)
        check_dense_size(n_params, params[0].dtype, params[0].device)
        return params[0].new_zeros(n_params, n_params)

    @override
    @staticmethod
    def batch_curvature(backend: Any, X: Any, y: Tensor, n_data: int) -> tuple[Tensor, Tensor]:
        return backend.full(X, y)

    @cached_property
    def precision(self) -> Tensor:
        """(P, P) posterior precision."""
        return self.h_factor * self.H + torch.diag(self.prior_diag)

    @cached_property
    def cholesky(self) -> Tensor:
        """(P, P) lower Cholesky factor of the precision."""
        factor, info = torch.linalg.cholesky_ex(self.precision)
        if int(info) != 0:
            raise NotPositiveDefiniteError(
                f"the posterior precision is not positive definite in {factor.dtype} (Cholesky "
                f"failed at column {int(info)}); increase the prior precision, use a float64 "
                "model, or check the curvature for errors."
            )
        return factor

    @cached_property
    def covariance(self) -> Tensor:
        """(P, P) posterior covariance ``P⁻¹``."""
        return torch.cholesky_inverse(self.cholesky)

    @cached_property
    def scale(self) -> Tensor:
        """(P, P) lower-triangular ``S`` with ``S Sᵀ = P⁻¹``.

        Obtained from the Cholesky factor of the row/column-reversed precision, which avoids
        forming ``P⁻¹`` before factorising it.
        """
        reversed_factor = torch.linalg.cholesky(self.precision.flip(0, 1))
        eye = torch.eye(
            len(self.prior_diag), device=reversed_factor.device, dtype=reversed_factor.dtype
        )
        inv = torch.linalg.solve_triangular(reversed_factor, eye, upper=False)
        return inv.T.flip(0, 1)

    @override
    @property
    def log_det(self) -> Tensor:
        return 2 * self.cholesky.diagonal().log().sum()

    @override
    def square_form(self, delta: Tensor) -> Tensor:
        return delta @ self.precision @ delta

    def _whitened(self, Js: Tensor) -> Tensor:
        """``L⁻¹ Jᵀ`` so that ``J P⁻¹ Jᵀ = (L⁻¹Jᵀ)ᵀ (L⁻¹Jᵀ)``; Js (..., P) → (P, ...)."""
        flat = Js.reshape(-1, Js.shape[-1]).T
        return torch.linalg.solve_triangular(self.cholesky, flat, upper=False)

    @override
    def rows_variance(self, Js: Tensor) -> Tensor:
        B, C, _ = Js.shape
        W = self._whitened(Js).T.reshape(B, C, -1)
        return W @ W.transpose(1, 2)

    @override
    def functional_covariance(self, Js: Tensor) -> Tensor:
        W = self._whitened(Js)
        return W.T @ W

    @override
    def sample_deviations(self, n_samples: int, generator: torch.Generator | None) -> Tensor:
        z = self._standard_normal((len(self.prior_diag), n_samples), generator)
        # P = L Lᵀ ⇒ θ − θ_MAP = L⁻ᵀ z has covariance P⁻¹.
        return torch.linalg.solve_triangular(self.cholesky.T, z, upper=True).T
