"""Public Laplace classes over all weights: ``BaseLaplace``, ``ParametricLaplace`` and structures.

These classes are a façade with laplace-torch's names and behaviour. The work is done by
composable pieces: a likelihood object (:mod:`laplace.likelihoods`), a parameter subset
(:mod:`laplace.subsets`), a posterior structure (:mod:`laplace.posteriors`), a curvature backend
(:mod:`laplace.curvature`), predictive links (:mod:`laplace.predictive`) and tuning
(:mod:`laplace.tuning`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader
from tqdm.auto import tqdm

from laplace.curvature import CurvatureInterface, CurvlinopsGGN
from laplace.data import Inputs, dataset_size, move_inputs, split_batch
from laplace.glm import GLMPredictiveMixin
from laplace.likelihoods import make_likelihood
from laplace.posteriors import DensePosterior, DiagonalPosterior, Posterior
from laplace.priors import as_prior_mean, as_prior_precision, expand_to_diagonal
from laplace.serialization import StateDictMixin
from laplace.subsets import AllWeights
from laplace.tuning import default_validation_loss, gridsearch, maximize_marglik
from laplace.utils.enums import (
    Likelihood,
    LinkApprox,
    PredType,
    PriorStructure,
    TuningMethod,
    parse_enum,
)
from laplace.utils.utils import fix_prior_prec_structure

__all__ = ["BaseLaplace", "DiagLaplace", "FullLaplace", "ParametricLaplace"]


class BaseLaplace:
    """Common hyperparameters, data handling and prior tuning of every Laplace approximation.

    Args:
        model: The trained network; only parameters with ``requires_grad=True`` are treated
            probabilistically.
        likelihood: ``"classification"``, ``"regression"`` or ``"reward_modeling"``.
        sigma_noise: Observation noise σ (regression only; must be 1 for classification).
        prior_precision: Gaussian prior precision: scalar, one per parameter tensor, or diagonal.
        prior_mean: Prior mean: scalar or one value per parameter.
        temperature: Likelihood temperature T; the curvature is scaled by 1/(σ²T).
        enable_backprop: Keep predictives differentiable w.r.t. the inputs.
        dict_key_x: Key of the inputs in dict-like batches.
        dict_key_y: Key of the targets in dict-like batches.
        backend: Curvature backend class; ``CurvlinopsGGN`` (exact GGN) when None.
        backend_kwargs: Keyword arguments for the backend's constructor.
        asdl_fisher_kwargs: Keyword arguments for ASDL's Fisher (ASDL backends only).

    Raises:
        ValueError: For an unknown likelihood, a non-positive σ or T, or a bad prior.
    """

    def __init__(
        self,
        model: nn.Module,
        likelihood: Likelihood | str,
        sigma_noise: float | Tensor = 1.0,
        prior_precision: float | Tensor = 1.0,
        prior_mean: float | Tensor = 0.0,
        temperature: float = 1.0,
        enable_backprop: bool = False,
        dict_key_x: str = "input_ids",
        dict_key_y: str = "labels",
        backend: type[CurvatureInterface] | None = None,
        backend_kwargs: dict[str, Any] | None = None,
        asdl_fisher_kwargs: dict[str, Any] | None = None,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}.")
        self._likelihood_model = make_likelihood(likelihood)
        self.likelihood = self._likelihood_model.kind
        self.model = model
        self._subset = self._make_subset(model)
        self.params = self._subset.params
        self.n_params = self._subset.n_params
        self.n_layers = self._subset.n_layers
        if not temperature > 0:
            raise ValueError(f"temperature must be positive, got {temperature}.")
        self.temperature = temperature
        self.enable_backprop = enable_backprop
        self.dict_key_x, self.dict_key_y = dict_key_x, dict_key_y
        self.sigma_noise = sigma_noise
        self.prior_precision = prior_precision
        self.prior_mean = prior_mean
        self._backend_cls = backend if backend is not None else CurvlinopsGGN
        if not (
            isinstance(self._backend_cls, type)
            and issubclass(self._backend_cls, CurvatureInterface)
        ):
            raise TypeError(
                f"backend must be a CurvatureInterface subclass, got {self._backend_cls!r}."
            )
        self._backend_kwargs = dict(backend_kwargs or {})
        self._asdl_fisher_kwargs = dict(asdl_fisher_kwargs or {})
        self._backend: CurvatureInterface | None = None
        self.loss: Tensor | float = 0.0
        self.n_data = 0
        self.n_outputs: int | None = None

    def _make_subset(self, model: nn.Module) -> AllWeights:
        return AllWeights(model)

    # ------------------------------------------------------------------ device and backend
    @property
    def _device(self) -> torch.device:
        return self.params[0].device

    @property
    def _dtype(self) -> torch.dtype:
        return self.params[0].dtype

    @property
    def backend(self) -> CurvatureInterface:
        """The curvature backend instance, created on first use."""
        if self._backend is None:
            kwargs = dict(self._backend_kwargs)
            if self._asdl_fisher_kwargs:
                kwargs["asdl_fisher_kwargs"] = self._asdl_fisher_kwargs
            self._backend = self._backend_cls(
                self.model,
                self._likelihood_model.fit_likelihood.kind,
                dict_key_x=self.dict_key_x,
                dict_key_y=self.dict_key_y,
                **kwargs,
            )
        return self._backend

    # ------------------------------------------------------------------------ hyperparameters
    @property
    def sigma_noise(self) -> Tensor:
        """Observation noise σ, shape (1,) as given or ()."""
        return self._sigma_noise

    @sigma_noise.setter
    def sigma_noise(self, value: float | Tensor) -> None:
        sigma = torch.as_tensor(value, device=self._device, dtype=self._dtype)
        if sigma.numel() != 1:
            raise ValueError(f"sigma_noise must be a scalar, got shape {tuple(sigma.shape)}.")
        if not bool(sigma.detach() > 0):
            raise ValueError(f"sigma_noise must be positive, got {sigma.item()}.")
        if self.likelihood != Likelihood.REGRESSION and not bool(sigma.detach() == 1):
            raise ValueError(
                f"sigma_noise must be 1 for likelihood={self.likelihood.value!r}; "
                "observation noise only applies to regression."
            )
        self._sigma_noise = sigma

    @property
    def prior_precision(self) -> Tensor:
        """Prior precision: length 1 (scalar), ``n_layers`` or ``n_params``."""
        return self._prior_precision

    @prior_precision.setter
    def prior_precision(self, value: float | Tensor) -> None:
        self._prior_precision = as_prior_precision(
            value, self.n_layers, self.n_params, self._device, self._dtype
        )

    @property
    def prior_precision_diag(self) -> Tensor:
        """Prior precision expanded to the diagonal, shape (P,)."""
        return expand_to_diagonal(self.prior_precision, self._subset.sizes)

    @property
    def prior_mean(self) -> Tensor:
        """Prior mean: a scalar or shape (P,)."""
        return self._prior_mean

    @prior_mean.setter
    def prior_mean(self, value: float | Tensor) -> None:
        self._prior_mean = as_prior_mean(value, self.n_params, self._device, self._dtype)

    @property
    def _H_factor(self) -> Tensor:
        return 1 / (self.sigma_noise.square() * self.temperature)

    @property
    def log_likelihood(self) -> Tensor:
        """Log-likelihood of the training data at the MAP (differentiable in σ)."""
        self._check_fitted("log_likelihood")
        return self._likelihood_model.log_likelihood(
            self.loss, self.n_data, self.n_outputs, self.sigma_noise, self.temperature
        )

    def _check_fitted(self, what: str) -> None:
        if self.n_outputs is None:
            raise RuntimeError(f"{what} needs a fitted Laplace approximation: call fit() first.")

    def _batches(self, loader: DataLoader, progress_bar: bool = False, desc: str = "batches"):
        """Yield ``(X, y)`` of each batch on the model's device."""
        for batch in tqdm(loader, disable=not progress_bar, desc=desc):
            X, y = split_batch(batch, self.dict_key_x, self.dict_key_y)
            yield move_inputs(X, self._device), y.to(self._device)

    # ------------------------------------------------------------------------------ tuning
    def optimize_prior_precision(
        self,
        pred_type: PredType | str = PredType.GLM,
        method: TuningMethod | str = TuningMethod.MARGLIK,
        n_steps: int = 100,
        lr: float = 1e-1,
        init_prior_prec: float | Tensor = 1.0,
        prior_structure: PriorStructure | str = PriorStructure.SCALAR,
        val_loader: DataLoader | None = None,
        loss: Any = None,
        log_prior_prec_min: float = -4,
        log_prior_prec_max: float = 4,
        grid_size: int = 100,
        link_approx: LinkApprox | str = LinkApprox.PROBIT,
        n_samples: int = 100,
        verbose: bool = False,
        progress_bar: bool = False,
        log_prior_prec_base: float = 10.0,
    ) -> None:
        """Tune the prior precision by marginal likelihood or by validation grid search.

        Args:
            pred_type: Predictive used by grid search (``"glm"`` or ``"nn"``).
            method: ``"marglik"`` (Adam on log p₀) or ``"gridsearch"`` (needs ``val_loader``).
            n_steps: Adam steps for marglik.
            lr: Adam learning rate for marglik.
            init_prior_prec: Initial precision for marglik; its structure is kept unless it is
                a scalar, which is then expanded to ``prior_structure``.
            prior_structure: ``"scalar"``, ``"layerwise"`` or ``"diag"`` for marglik.
            val_loader: Validation data for grid search.
            loss: Validation loss (a torchmetrics Metric or a callable); defaults to running NLL
                for classification and running MSE for regression.
            log_prior_prec_min: Lower end of the grid, as an exponent of ``log_prior_prec_base``.
            log_prior_prec_max: Upper end of the grid.
            grid_size: Number of grid points.
            link_approx: Link approximation used by grid search.
            n_samples: Samples of the predictive for grid search with MC links.
            verbose: Print the chosen prior precision.
            progress_bar: Show a progress bar.
            log_prior_prec_base: Base of the log-spaced grid.

        Raises:
            ValueError: For an unknown method, structure, pred_type or link_approx, or grid
                search without ``val_loader``.
        """
        method = parse_enum(TuningMethod, method, "method")
        pred_type = parse_enum(PredType, pred_type, "pred_type")
        link_approx = parse_enum(LinkApprox, link_approx, "link_approx")
        prior_structure = parse_enum(PriorStructure, prior_structure, "prior_structure")
        self._check_fitted("optimize_prior_precision")
        if method == TuningMethod.MARGLIK:
            if torch.is_tensor(init_prior_prec) and init_prior_prec.numel() > 1:
                init = as_prior_precision(
                    init_prior_prec, self.n_layers, self.n_params, self._device, self._dtype
                )
            else:
                init = fix_prior_prec_structure(
                    init_prior_prec,
                    prior_structure,
                    self.n_layers,
                    self.n_params,
                    self._device,
                    self._dtype,
                )
            self.prior_precision = maximize_marglik(self, init, n_steps, lr, progress_bar)
        else:
            if val_loader is None:
                raise ValueError("method='gridsearch' needs a val_loader with validation data.")
            candidates = torch.logspace(
                log_prior_prec_min,
                log_prior_prec_max,
                grid_size,
                base=log_prior_prec_base,
                device=self._device,
                dtype=self._dtype,
            )
            loss = default_validation_loss(self) if loss is None else loss
            self.prior_precision = gridsearch(
                self,
                candidates,
                val_loader,
                loss,
                pred_type,
                link_approx,
                n_samples,
                progress_bar,
            )
        if verbose:
            print(f"Optimized prior precision is {self.prior_precision}.")


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
        self.mean = self._subset.vector().detach()
        self._posterior_cache: tuple[Tensor, Tensor, Posterior] | None = None

    # ---------------------------------------------------------------------------------- fit
    def fit(self, train_loader: DataLoader, override: bool = True, progress_bar: bool = False):
        """Accumulate the curvature and loss over ``train_loader`` at the current weights.

        Args:
            train_loader: Batches ``(X, y)`` or dict-like; ``len(train_loader.dataset)`` is N.
            override: Start from zero (True) or add to the previous fit (online Laplace).
            progress_bar: Show a progress bar over batches.

        Raises:
            ValueError: If the loader is empty or a batch contains non-finite values.
            RuntimeError: If the curvature of a batch is not finite.
        """
        n_data = dataset_size(train_loader)
        if n_data == 0:
            raise ValueError("train_loader is empty: fit needs at least one data point.")
        if override or self.H is None:
            self.H = self._posterior_cls.zeros(self.n_params, self._device, self._dtype)
            self.loss, self.n_data = 0.0, 0
        self.model.eval()
        self.mean = self._subset.vector()
        if not self.enable_backprop:
            self.mean = self.mean.detach()
        n_batches = 0
        for X, y in self._batches(train_loader, progress_bar, desc="fit"):
            self._check_finite_inputs(X, y)
            if self.n_outputs is None or n_batches == 0:
                with torch.no_grad():
                    self.n_outputs = int(self.model(X).shape[-1])
            loss, H_batch = self._posterior_cls.batch_curvature(self.backend, X, y)
            if not self._posterior_cls.is_finite(H_batch):
                raise RuntimeError(
                    "the curvature of a training batch contains NaN or inf; check the model's "
                    "outputs and the data."
                )
            self.H = self.H + H_batch
            self.loss = self.loss + loss.detach()
            n_batches += 1
        if n_batches == 0:
            raise ValueError("train_loader yielded no batches: fit needs at least one batch.")
        self.n_data += n_data
        self._posterior_cache = None

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
        cache = self._posterior_cache
        if (
            not differentiable
            and cache is not None
            and torch.equal(cache[0], h_factor)
            and torch.equal(cache[1], prior_diag)
        ):
            return cache[2]
        posterior = self._posterior_cls(self.H, h_factor, prior_diag)
        if not differentiable:
            self._posterior_cache = (h_factor.clone(), prior_diag.clone(), posterior)
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
                - self.n_params
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
    """Laplace approximation with a dense (P, P) curvature and posterior precision."""

    _posterior_cls = DensePosterior

    @property
    def posterior_scale(self) -> Tensor:
        """Lower-triangular ``S`` (P, P) with ``S Sᵀ = P⁻¹``."""
        return self._posterior.scale

    @property
    def posterior_covariance(self) -> Tensor:
        """Posterior covariance ``P⁻¹``, shape (P, P)."""
        return self._posterior.covariance


class DiagLaplace(ParametricLaplace):
    """Laplace approximation with a diagonal curvature and posterior precision (P,)."""

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
