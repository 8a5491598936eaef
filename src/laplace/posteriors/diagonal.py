"""Diagonal posterior: ``P = h·diag(H) + diag(p₀)`` stored as a vector."""

from __future__ import annotations

from collections.abc import Sequence
from functools import cached_property
from typing import Any, ClassVar

import torch
from torch import Tensor
from typing_extensions import override

from laplace.jacobians import HeadFeatures, Jacobian, LayerTrace
from laplace.kron_glm import diag_functional_variance
from laplace.last_layer import DIAG_HEAD_CURVATURE, HeadCurvature, diag_head_variance
from laplace.posteriors.base import ClosedForm, Posterior

__all__ = ["DiagonalPosterior"]


def _head_variance(posterior: DiagonalPosterior, J: HeadFeatures) -> Tensor:
    return diag_head_variance(posterior.variance, J.phi, J.n_out, J.bias)


def _trace_variance(posterior: DiagonalPosterior, J: LayerTrace) -> Tensor | None:
    return diag_functional_variance(J.trace, posterior.precision, J.trace.create_graph)


class DiagonalPosterior(Posterior):
    """Gaussian posterior with independent parameters; every operation is O(P) per row.

    The functional variance of a recorded pass over Linear and Conv layers needs no Jacobian
    (:func:`laplace.kron_glm.diag_functional_variance`).
    """

    closed_forms: ClassVar[dict[type[Jacobian], ClosedForm]] = {
        HeadFeatures: _head_variance,
        LayerTrace: _trace_variance,
    }
    head_curvature: ClassVar[HeadCurvature | None] = DIAG_HEAD_CURVATURE

    @override
    @staticmethod
    def zeros(params: Sequence[Tensor]) -> Tensor:
        n_params = sum(p.numel() for p in params)
        return params[0].new_zeros(n_params)

    @override
    @staticmethod
    def batch_curvature(backend: Any, X: Any, y: Tensor, n_data: int) -> tuple[Tensor, Tensor]:
        return backend.diag(X, y)

    @cached_property
    def precision(self) -> Tensor:
        """(P,) diagonal posterior precision."""
        return self.h_factor * self.H + self.prior_diag

    @cached_property
    def variance(self) -> Tensor:
        """(P,) diagonal posterior variance."""
        return self.precision.reciprocal()

    @property
    def scale(self) -> Tensor:
        """(P,) posterior standard deviations."""
        return self.variance.sqrt()

    @override
    @property
    def log_det(self) -> Tensor:
        return self.precision.log().sum()

    @override
    def square_form(self, delta: Tensor) -> Tensor:
        return (delta.square() * self.precision).sum()

    @override
    def rows_variance(self, Js: Tensor) -> Tensor:
        scaled = Js * self.variance
        return scaled @ Js.transpose(1, 2)

    @override
    def functional_covariance(self, Js: Tensor) -> Tensor:
        return (Js * self.variance) @ Js.T

    @override
    def sample_deviations(self, n_samples: int, generator: torch.Generator | None) -> Tensor:
        z = self._standard_normal((n_samples, len(self.prior_diag)), generator)
        return z * self.scale
