"""Parametric Laplace: ``N(θ_MAP, P⁻¹)`` over weights, with dense and diagonal structures.

Internal module; the public path is :mod:`laplace.baselaplace`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from laplace.base import BaseLaplace
from laplace.errors import NotFittedError, check_generator, check_positive_int
from laplace.glm import GLMPredictiveMixin
from laplace.parametric_fit import CurvatureFitMixin
from laplace.per_output import noise_structure
from laplace.posterior_scale import PosteriorScaleMixin
from laplace.posteriors import (
    DensePosterior,
    DiagonalPosterior,
    NotPositiveDefiniteError,
    Posterior,
)
from laplace.serialization import StateDictMixin

__all__ = ["DiagLaplace", "FullLaplace", "ParametricLaplace"]


class ParametricLaplace(CurvatureFitMixin, GLMPredictiveMixin, StateDictMixin, BaseLaplace):
    """Gaussian posterior ``N(θ_MAP, P⁻¹)`` with ``P = H/(σ²T) + diag(p₀)`` over the weights.

    Subclasses choose the structure of the curvature ``H`` through ``_posterior_cls``.
    After :meth:`fit`, ``H`` is the curvature summed over the data, ``loss`` the summed loss,
    ``mean`` the MAP weights (P,). Before it, as in laplace-torch, the posterior is the prior:
    ``H`` is a zero curvature in the structure's form, ``mean`` the prior mean (P,), and
    ``posterior_precision``, ``log_prob``, the log-determinants and ``scatter`` follow from
    them; predictions and samples need :meth:`fit`.
    See :class:`~laplace.base.BaseLaplace` for the arguments.
    """

    _abstract = "use FullLaplace, DiagLaplace, KronLaplace or LowRankLaplace."
    _posterior_cls: type[Posterior]

    def _init_state(self) -> None:
        self.H: Any = None
        self._fitted_mean: Tensor | None = None
        self._posterior_cache: tuple[Any, Tensor, Tensor, Posterior] | None = None
        if self._subset.resolved:
            self._init_H()

    def _accept_sigma_noise(self, sigma: Tensor) -> None:
        """Switch to the per-output variant of the structure for one σ per output.

        Raises:
            ValueError: See :func:`laplace.per_output.noise_structure`.
        """
        structure = noise_structure(
            self._own_structure(),
            self._posterior_cls,
            sigma.numel(),
            self._fitted,
            self._backend_cls,
        )
        if structure is not self._posterior_cls:
            self._posterior_cls = structure
            if getattr(self, "H", None) is not None:
                self._init_H()

    def _own_structure(self) -> type[Posterior]:
        """The class's posterior structure for one σ (``_posterior_cls`` of the class)."""
        return type(self)._posterior_cls

    def _transaction_rebuild(self) -> dict[str, Any]:
        # The zero curvature of an unfitted approximation is freed while a first fit sums
        # (a dense one is P × P) and rebuilt if that fit fails.
        return {"H": self._init_H} if not self._fitted and self.H is not None else {}

    def _init_H(self) -> None:
        """Reset ``H`` to the zero curvature of the structure (the posterior is then the prior).

        Raises:
            NotFittedError: If the parameters are not known yet (a last layer not found yet).
        """
        self.H = self._zero_curvature()

    @property
    def mean(self) -> Tensor | None:
        """Posterior mean (P,): the MAP weights once fitted, the prior mean before.

        None while the parameters are not known (a last layer not found yet).
        """
        if self._fitted_mean is not None:
            return self._fitted_mean
        if not self._subset.resolved:
            return None
        return self._prior_mean_vector()

    @mean.setter
    def mean(self, value: Tensor | None) -> None:
        self._fitted_mean = value

    def _prior_mean_vector(self) -> Tensor:
        """The prior mean expanded to the posterior's weight vector, shape (P,)."""
        return torch.broadcast_to(self.prior_mean, (self.n_params,)).clone()

    # ------------------------------------------------------------------------- posterior
    @property
    def _posterior(self) -> Posterior:
        """The posterior at the current hyperparameters, cached while they do not change.

        Before :meth:`fit` it is the prior (``H`` is zero).
        """
        h_factor, prior_diag = self._H_factor, self.prior_precision_diag
        if self.H is None:
            raise NotFittedError("the posterior needs fit() first (or a call to _init_H()).")
        differentiable = h_factor.requires_grad or prior_diag.requires_grad
        curvature_key = (id(self.H), getattr(self.H, "_version", None))
        cache = self._posterior_cache
        if (
            not differentiable
            and cache is not None
            and cache[0] == curvature_key
            and torch.equal(cache[1], h_factor)
            and torch.equal(cache[2], prior_diag)
        ):
            return cache[3]
        posterior = self._posterior_cls(self.H, h_factor, prior_diag)
        if not differentiable:
            self._posterior_cache = (
                curvature_key,
                h_factor.clone(),
                prior_diag.clone(),
                posterior,
            )
        return posterior

    @property
    def posterior_precision(self) -> Any:
        """Posterior precision ``P`` in the structure's representation."""
        return self._posterior.precision

    @property
    def scatter(self) -> Tensor:
        """``(θ_MAP − μ₀)ᵀ P₀ (θ_MAP − μ₀)``."""
        prior_diag = self.prior_precision_diag
        return ((self.mean - self.prior_mean).square() * prior_diag).sum()

    @property
    def log_det_prior_precision(self) -> Tensor:
        """``log det P₀``."""
        return self.prior_precision_diag.log().sum()

    @property
    def log_det_posterior_precision(self) -> Tensor:
        """``log det P``.

        Raises:
            NotPositiveDefiniteError: (a ``RuntimeError``) if it is not finite, saying why.
        """
        return self._checked_finite(self._posterior.log_det, "log det of the posterior precision")

    def _checked_finite(self, value: Tensor, what: str) -> Tensor:
        """``value`` if every entry is finite; otherwise an error saying why it is not.

        Raises:
            NotPositiveDefiniteError: (a ``RuntimeError``) naming the likely causes.
        """
        if not bool(torch.isfinite(value.detach()).all()):
            raise NotPositiveDefiniteError(
                f"the {what} contains NaN or inf: the posterior precision "
                "H/(σ²T) + prior_precision is not positive definite (a Hessian backend's "
                "curvature can be indefinite: use a GGN or EF backend or a larger prior "
                f"precision) or exceeds the range of {self._dtype} (use a float64 model or "
                "a smaller prior precision)."
            )
        return value

    @property
    def log_det_ratio(self) -> Tensor:
        """``log det P − log det P₀``."""
        return self.log_det_posterior_precision - self.log_det_prior_precision

    def square_norm(self, value: Tensor) -> Tensor:
        """``(value − θ_MAP)ᵀ P (value − θ_MAP)``."""
        return self._posterior.square_form(value - self.mean)

    def log_prob(self, value: Tensor, normalized: bool = True) -> Tensor:
        """Log density of ``value`` (P,) under the posterior; unnormalised drops constants."""
        log_prob = -0.5 * self.square_norm(value)
        if normalized:
            log_prob = log_prob + 0.5 * (
                self.log_det_posterior_precision
                - self.prior_precision_diag.numel()
                * torch.log(torch.tensor(2 * torch.pi, device=self._device, dtype=self._dtype))
            )
        return log_prob

    def log_marginal_likelihood(
        self, prior_precision: Tensor | None = None, sigma_noise: Tensor | None = None
    ) -> Tensor:
        """Laplace approximation of the log evidence, differentiable in both hyperparameters.

        ``log p(D) ≈ log p(D | θ*) − ½ (log det P − log det P₀ + (θ* − μ₀)ᵀ P₀ (θ* − μ₀))``
        with ``θ*`` the MAP weights.
        Passing ``prior_precision`` or ``sigma_noise`` replaces the stored values.

        Raises:
            RuntimeError: Before :meth:`fit`.
        """
        self._check_fitted("log_marginal_likelihood")
        if prior_precision is not None:
            self.prior_precision = prior_precision
        if sigma_noise is not None:
            self.sigma_noise = sigma_noise
        return self.log_likelihood - 0.5 * (self.log_det_ratio + self.scatter)

    def functional_variance(self, Js: Tensor) -> Tensor:
        """``J P⁻¹ Jᵀ`` per point: Jacobians (B, C, P) → output covariances (B, C, C)."""
        return self._posterior.functional_variance(Js)

    def functional_covariance(self, Js: Tensor) -> Tensor:
        """Joint output covariance: Jacobians (B, C, P) or (B·C, P) → (B·C, B·C)."""
        return self._posterior.functional_covariance(Js.reshape(-1, Js.shape[-1]))

    def sample(self, n_samples: int = 100, generator: torch.Generator | None = None) -> Tensor:
        """Draw weights ``θ ~ N(θ_MAP, P⁻¹)``, shape (n_samples, P).

        Raises:
            ValueError: If ``n_samples`` is not a positive integer.
            NotFittedError: Before :meth:`fit` (a ``RuntimeError``).
        """
        return self.mean + self._sample_deviations(n_samples, generator)

    def _sample_deviations(self, n_samples: int, generator: torch.Generator | None) -> Tensor:
        """Draws of ``θ − θ_MAP`` (n_samples, P) over the posterior's parameters."""
        check_positive_int(n_samples, "n_samples")
        check_generator(generator)
        self._check_fitted("sample")
        return self._checked_finite(
            self._draw_deviations(n_samples, generator), "posterior samples"
        )

    def _draw_deviations(self, n_samples: int, generator: torch.Generator | None) -> Tensor:
        return self._posterior.sample_deviations(n_samples, generator)


class FullLaplace(PosteriorScaleMixin, ParametricLaplace):
    """Laplace approximation with a dense (P, P) curvature and posterior precision.

    Hyperparameter tuning evaluates ``log det(h·H + δ·I)`` for many ``(h, δ)`` with a scalar
    prior ``δ``: while either is differentiable, it is computed as ``Σᵢ log(h·λᵢ + δ)`` from the
    eigenvalues ``λ`` of ``H``, found once per fit, instead of one Cholesky factorisation (and
    its backward pass) per step.

    ``posterior_scale`` is the lower-triangular ``S`` (P, P) with ``S Sᵀ = P⁻¹``
    (see :class:`~laplace.posterior_scale.PosteriorScaleMixin`).
    """

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


class DiagLaplace(ParametricLaplace):
    """Laplace approximation with a diagonal curvature and posterior precision (P,).

    The GLM predictive is computed without Jacobians
    (:func:`laplace.kron_glm.diag_functional_variance`, every layer); models whose layers do not
    see the data points along dim 0 use the Jacobian rows of the same recorded pass.
    """

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
