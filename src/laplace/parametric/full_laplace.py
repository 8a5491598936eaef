"""Full Laplace over all weights: a dense (P, P) curvature and posterior precision.

Internal module; the public path is [`laplace.baselaplace`][laplace.baselaplace].
"""

from __future__ import annotations

import torch
from torch import Tensor

from laplace.parametric.parametric_laplace import ParametricLaplace
from laplace.structures import DensePosterior
from laplace.utils.enums import HessianStructure, SubsetOfWeights

__all__ = ["FullLaplace"]


class FullLaplace(ParametricLaplace):
    """Laplace approximation with a dense (P, P) curvature and posterior precision.

    Hyperparameter tuning evaluates ``log det(h·H + δ·I)`` for many ``(h, δ)`` with a scalar
    prior ``δ``: while either is differentiable, it is computed as ``Σᵢ log(h·λᵢ + δ)`` from the
    eigenvalues ``λ`` of ``H``, found once per fit, instead of one Cholesky factorisation (and
    its backward pass) per step.

    ``posterior_scale`` is the lower-triangular ``S`` (P, P) with ``S Sᵀ = P⁻¹``.
    """

    _key = (SubsetOfWeights.ALL, HessianStructure.FULL)

    _posterior_cls = DensePosterior

    @property
    def log_det_posterior_precision(self) -> Tensor:
        """``log det P``."""
        prior, h_factor = self.prior_precision, self._H_factor
        one_curvature = isinstance(self.H, Tensor) and self.H.dim() == 2  # not one per output
        if one_curvature and len(prior) == 1 and (prior.requires_grad or h_factor.requires_grad):
            spectrum = h_factor * self._curvature_eigenvalues() + prior
            if bool((spectrum.detach() > 0).all()):
                return spectrum.log().sum()
        return super().log_det_posterior_precision

    def _curvature_eigenvalues(self) -> Tensor:
        """Eigenvalues of ``H`` (P,), cached while ``H`` is unchanged."""
        key = (id(self.H), self.H._version)
        cache = getattr(self, "_eigenvalue_cache", None)
        if cache is None or cache[0] != key:
            cache = (key, torch.linalg.eigvalsh(self.H.detach()))
            self._eigenvalue_cache = cache
        return cache[1]

    @property
    def posterior_covariance(self) -> Tensor:
        """Posterior covariance ``P⁻¹``, shape (P, P)."""
        return self._posterior.covariance
