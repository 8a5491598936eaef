"""Diagonal Laplace over all weights: a diagonal curvature and posterior precision (P,).

Internal module; the public path is [`laplace.baselaplace`][laplace.baselaplace].
"""

from __future__ import annotations

import torch
from torch import Tensor

from laplace.parametric.parametric_laplace import ParametricLaplace
from laplace.structures import DiagonalPosterior
from laplace.utils.enums import HessianStructure, SubsetOfWeights

__all__ = ["DiagLaplace"]


class DiagLaplace(ParametricLaplace):
    """Laplace approximation with a diagonal curvature and posterior precision (P,).

    The GLM predictive is computed without Jacobians, layer by layer
    (``laplace.structures.diagonal.diag_functional_variance``); models whose layers do not see
    the data points along dim 0 use the Jacobian rows of the same recorded pass.
    """

    _key = (SubsetOfWeights.ALL, HessianStructure.DIAG)

    _posterior_cls = DiagonalPosterior

    @property
    def posterior_scale(self) -> Tensor:
        """Posterior standard deviations, shape (P,)."""
        return self._posterior.scale

    @property
    def posterior_variance(self) -> Tensor:
        """Posterior variances, shape (P,)."""
        return self._posterior.variance

    @property
    def posterior_covariance(self) -> Tensor:
        """Posterior covariance as a dense diagonal matrix, shape (P, P)."""
        return torch.diag(self._posterior.variance)
