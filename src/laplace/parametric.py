"""Parametric Laplace: ``N(θ_MAP, P⁻¹)`` over weights, with dense and diagonal structures.

Internal module; the public path is :mod:`laplace.baselaplace`.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader

from laplace import distributed as distributed_utils
from laplace.base import BaseLaplace
from laplace.data import Inputs, dataset_size
from laplace.glm import GLMPredictiveMixin
from laplace.kron_glm import diag_functional_moments, layerwise_chunk_rows
from laplace.posteriors import DensePosterior, DiagonalPosterior, Posterior
from laplace.serialization import StateDictMixin
from laplace.utils.enums import Likelihood

__all__ = ["DiagLaplace", "FullLaplace", "ParametricLaplace"]


class ParametricLaplace(GLMPredictiveMixin, StateDictMixin, BaseLaplace):
    """Gaussian posterior ``N(θ_MAP, P⁻¹)`` with ``P = H/(σ²T) + diag(p₀)`` over the weights.

    Subclasses choose the structure of the curvature ``H`` through ``_posterior_cls``.
    After :meth:`fit`, ``H`` is the curvature summed over the data, ``loss`` the summed loss,
    ``mean`` the MAP weights (P,).
    """

    _posterior_cls: type[Posterior]

    def __init__(self, model: nn.Module, likelihood: Likelihood | str, *args, **kwargs) -> None:
        if type(self) is ParametricLaplace:
            raise TypeError("ParametricLaplace is abstract: use FullLaplace, DiagLaplace, ...")
        super().__init__(model, likelihood, *args, **kwargs)
        self.H: Any = None
        self.mean = self._subset.vector().detach() if self._subset.resolved else None
        self._posterior_cache: tuple[Any, Tensor, Tensor, Posterior] | None = None

    # ---------------------------------------------------------------------------------- fit
    def fit(
        self,
        train_loader: DataLoader,
        override: bool = True,
        progress_bar: bool = False,
        distributed: bool | None = None,
    ):
        """Accumulate the curvature and loss over ``train_loader`` at the current weights.

        Args:
            train_loader: Batches ``(X, y)`` or dict-like; ``len(train_loader.dataset)`` is N.
            override: Start from zero (True) or add to the previous fit (online Laplace).
            progress_bar: Show a progress bar over batches.
            distributed: All-reduce the sums over the ranks of :mod:`torch.distributed`, each
                fitting its shard of the data; None: when the process group is initialised
                and the loader uses a ``DistributedSampler`` (see :mod:`laplace.distributed`).

        Raises:
            ValueError: If the loader is empty or a batch contains non-finite values.
            RuntimeError: If the curvature of a batch is not finite.
            DistributedFitError: If another rank failed during a distributed fit.
        """
        self._distributed = distributed_utils.resolve(distributed, train_loader)
        n_data = self._data_count(train_loader)
        if n_data == 0:
            raise ValueError("train_loader is empty: fit needs at least one data point.")
        with distributed_utils.guard(self._distributed, "fit"):
            self._resolve_subset(train_loader)
        update = not override and self.H is not None
        n_before = self.n_data if update else 0
        self.model.eval()
        self.mean = self._subset.vector()
        if not self.enable_backprop:
            self.mean = self.mean.detach()
        H_new, loss_new = self._zero_curvature(), 0.0
        with distributed_utils.guard(self._distributed, "fit"):
            n_batches = 0
            # KFAC normalises by the data the summed curvature covers, earlier fits included.
            stream = self._curvature_stream(train_loader, n_before + n_data, progress_bar)
            for loss, H_batch in stream:
                if not self._posterior_cls.is_finite(H_batch):
                    raise RuntimeError(
                        "the curvature of a training batch contains NaN or inf; check the "
                        "model's outputs and the data."
                    )
                H_new = H_new + H_batch
                loss_new = loss_new + loss.detach()
                n_batches += 1
            if n_batches == 0:
                raise ValueError("train_loader yielded no batches: fit needs at least one batch.")
        if self._distributed:
            loss_new = torch.as_tensor(loss_new, device=self._device, dtype=self._dtype)
            H_new, loss_new = distributed_utils.all_reduce_sum([H_new, loss_new])
        if update:
            H_new, loss_new = self.H + H_new, self.loss + loss_new
        self.H = self._posterior_cls.finalize(H_new)
        self.loss, self.n_data = loss_new, n_before + n_data
        self._posterior_cache = None

    def _data_count(self, train_loader: DataLoader) -> int:
        """Data points of the fit: all ranks' together when distributed."""
        if not getattr(self, "_distributed", False):
            return dataset_size(train_loader)
        return distributed_utils.all_reduce_sum(distributed_utils.data_count(train_loader))

    def _zero_curvature(self) -> Any:
        """Empty curvature in the posterior's structure and dimension."""
        return self._posterior_cls.zeros(self.params)

    def _resolve_subset(self, train_loader: DataLoader) -> None:
        """Make sure the parameter subset is known before fitting (all weights: always)."""

    def _curvature_stream(
        self, train_loader: DataLoader, n_data: int, progress_bar: bool
    ) -> Iterator[tuple[Tensor, Any]]:
        """Yield ``(loss, H)`` summands over the training data (one per batch by default).

        Also sets ``n_outputs`` from the first batch.

        Args:
            train_loader: The training data.
            n_data: Number of data points the summed curvature covers (KFAC normalisation).
            progress_bar: Show a progress bar over batches.
        """
        first = True
        for X, y in self._batches(train_loader, progress_bar, desc="fit"):
            self._check_finite_inputs(X, y)
            if first:
                with torch.no_grad():
                    self.n_outputs = int(self.model(X).shape[-1])
                first = False
            yield self._batch_curvature(X, y, n_data)

    def _batch_curvature(self, X: Inputs, y: Tensor, n_data: int) -> tuple[Tensor, Any]:
        """``(loss, H_batch)`` of one batch; from the backend in the posterior's structure."""
        return self._posterior_cls.batch_curvature(self.backend, X, y, n_data)

    @staticmethod
    def _check_finite_inputs(X: Inputs, y: Tensor) -> None:
        tensors = (
            [X] if isinstance(X, Tensor) else [v for v in X.values() if isinstance(v, Tensor)]
        )
        for name, t in [("inputs", x) for x in tensors] + [("targets", y)]:
            if t.dtype.is_floating_point and not bool(torch.isfinite(t).all()):
                raise ValueError(f"the training {name} contain NaN or inf values.")

    # ------------------------------------------------------------------------- posterior
    @property
    def _posterior(self) -> Posterior:
        """The posterior at the current hyperparameters, cached while they do not change."""
        self._check_fitted("the posterior")
        h_factor, prior_diag = self._H_factor, self.prior_precision_diag
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
        delta = self.mean - self.prior_mean
        return (delta.square() * self.prior_precision_diag).sum()

    @property
    def log_det_prior_precision(self) -> Tensor:
        """``log det P₀``."""
        return self.prior_precision_diag.log().sum()

    @property
    def log_det_posterior_precision(self) -> Tensor:
        """``log det P``."""
        return self._posterior.log_det

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
        """Draw weights ``θ ~ N(θ_MAP, P⁻¹)``, shape (n_samples, P)."""
        return self.mean + self._posterior.sample_deviations(n_samples, generator)


class FullLaplace(ParametricLaplace):
    """Laplace approximation with a dense (P, P) curvature and posterior precision.

    Hyperparameter tuning evaluates ``log det(h·H + δ·I)`` for many ``(h, δ)`` with a scalar
    prior ``δ``: while either is differentiable, it is computed as ``Σᵢ log(h·λᵢ + δ)`` from the
    eigenvalues ``λ`` of ``H``, found once per fit, instead of one Cholesky factorisation (and
    its backward pass) per step.
    """

    _posterior_cls = DensePosterior

    @property
    def log_det_posterior_precision(self) -> Tensor:
        """``log det P``."""
        prior, h_factor = self.prior_precision, self._H_factor
        if len(prior) == 1 and (prior.requires_grad or h_factor.requires_grad):
            self._check_fitted("log_det_posterior_precision")
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
    def posterior_scale(self) -> Tensor:
        """Lower-triangular ``S`` (P, P) with ``S Sᵀ = P⁻¹``."""
        return self._posterior.scale

    @property
    def posterior_covariance(self) -> Tensor:
        """Posterior covariance ``P⁻¹``, shape (P, P)."""
        return self._posterior.covariance


class DiagLaplace(ParametricLaplace):
    """Laplace approximation with a diagonal curvature and posterior precision (P,).

    The GLM predictive of networks made of Linear and Conv layers is computed without Jacobians
    (:func:`laplace.kron_glm.diag_functional_moments`); other layers use the Jacobian route.
    """

    _posterior_cls = DiagonalPosterior

    def _functional_moments(self, X: Inputs) -> tuple[Tensor, Tensor]:
        trace = self.backend.trace(X, create_graph=self.enable_backprop)
        moments = diag_functional_moments(trace, self.posterior_precision, self.enable_backprop)
        if moments is None:
            return super()._functional_moments(X)
        f_mu, f_var = moments
        if not self.enable_backprop:
            f_mu, f_var = f_mu.detach(), f_var.detach()
        return f_mu, f_var

    def _chunk_rows(self) -> int:
        return layerwise_chunk_rows(self.model, self.params, super()._chunk_rows())

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
