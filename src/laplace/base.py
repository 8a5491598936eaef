"""``BaseLaplace``: hyperparameters, data handling and prior tuning shared by every Laplace.

Internal module; the public path is :mod:`laplace.baselaplace`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader
from tqdm.auto import tqdm

from laplace.curvature import CurvatureInterface, CurvlinopsGGN
from laplace.data import move_inputs, split_batch
from laplace.distributed import unwrap_model
from laplace.likelihoods import make_likelihood
from laplace.priors import as_prior_mean, as_prior_precision, expand_to_diagonal
from laplace.subsets import AllWeights
from laplace.tuning import gridsearch, maximize_marglik, validation_loss
from laplace.utils.enums import (
    Likelihood,
    LinkApprox,
    PredType,
    PriorStructure,
    TuningMethod,
    parse_enum,
)
from laplace.utils.utils import fix_prior_prec_structure

__all__ = ["BaseLaplace"]


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
        model = unwrap_model(model)  # DistributedDataParallel: curvature of the inner module
        self._likelihood_model = make_likelihood(likelihood)
        self.likelihood = self._likelihood_model.kind
        self.model = model
        self._subset = self._make_subset(model)
        self._bind_subset()
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

    def _bind_subset(self) -> None:
        """Expose the subset's ``params``, ``n_params``, ``n_layers`` (None until it is known)."""
        known = self._subset.resolved
        self.params = self._subset.params if known else None
        self.n_params = self._subset.n_params if known else None
        self.n_layers = self._subset.n_layers if known else None

    # ------------------------------------------------------------------ device and backend
    @property
    def _device(self) -> torch.device:
        return self._subset.device

    @property
    def _dtype(self) -> torch.dtype:
        return self._subset.dtype

    @property
    def backend(self) -> CurvatureInterface:
        """The curvature backend instance, created on first use."""
        if self._backend is None:
            kwargs = dict(self._backend_kwargs)
            if self._asdl_fisher_kwargs and getattr(
                self._backend_cls, "accepts_asdl_fisher_kwargs", False
            ):
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
            value, *self._prior_lengths, self._device, self._dtype
        )

    @property
    def _prior_lengths(self) -> tuple[int | None, int | None]:
        """Lengths of a layer-wise and of a diagonal prior (n_layers, n_params); None: no such."""
        return self.n_layers, self.n_params

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
        self._prior_mean = as_prior_mean(value, self._prior_lengths[1], self._device, self._dtype)

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
            loss: Validation loss for grid search: a torchmetrics Metric, a callable, or a name
                (``"nll"``, ``"ece"``, ``"brier"``, ``"crps"``; see
                :mod:`laplace.evaluation`); defaults to running NLL for classification and
                running MSE for regression.
            log_prior_prec_min: Lower end of the grid, as an exponent of ``log_prior_prec_base``.
            log_prior_prec_max: Upper end of the grid.
            grid_size: Number of grid points.
            link_approx: Link approximation used by grid search.
            n_samples: Samples of the predictive for grid search with MC links.
            verbose: Print the chosen prior precision.
            progress_bar: Show a progress bar.
            log_prior_prec_base: Base of the log-spaced grid.

        Raises:
            ValueError: For an unknown method, structure, pred_type or link_approx, grid
                search without ``val_loader``, or an unknown ``loss`` name.
        """
        method = parse_enum(TuningMethod, method, "method")
        pred_type = parse_enum(PredType, pred_type, "pred_type")
        link_approx = parse_enum(LinkApprox, link_approx, "link_approx")
        prior_structure = parse_enum(PriorStructure, prior_structure, "prior_structure")
        self._check_fitted("optimize_prior_precision")
        if method == TuningMethod.MARGLIK:
            if torch.is_tensor(init_prior_prec) and init_prior_prec.numel() > 1:
                init = as_prior_precision(
                    init_prior_prec, *self._prior_lengths, self._device, self._dtype
                )
            else:
                init = fix_prior_prec_structure(
                    init_prior_prec,
                    prior_structure,
                    *self._prior_lengths,
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
            loss = validation_loss(self, loss)
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
