"""``BaseLaplace``: hyperparameters, data handling and prior tuning shared by every Laplace.

Internal module; the public path is [`laplace.baselaplace`][laplace.baselaplace].
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable
from functools import partial
from typing import Any, ClassVar

import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader

from laplace.core.passes.data_loop import DataLoop
from laplace.core.priors import (
    as_prior_mean,
    as_prior_precision,
    as_sigma_noise,
    check_temperature,
    expand_to_diagonal,
    fix_prior_prec_structure,
)
from laplace.core.serialization import (
    MEAN_MATCH_ATOL,
    StateFormat,
    check_state_dict,
    identity_mismatch,
)
from laplace.core.subsets import AllWeights, check_parameters, check_posterior_dtype
from laplace.core.transaction import TRANSACTIONAL_METHODS, transactional
from laplace.core.tuning import (
    bayesopt,
    check_bayesopt_arguments,
    grid_candidates,
    gridsearch,
    import_optuna,
    maximize_marglik,
)
from laplace.curvature import CurvatureInterface, CurvlinopsGGN
from laplace.curvature.curvature import check_dict_inputs
from laplace.curvature.registry import check_backend_kwargs
from laplace.likelihoods import LikelihoodModel, make_likelihood
from laplace.utils.data import move_inputs, split_batch
from laplace.utils.distributed import unwrap_model
from laplace.utils.enums import (
    FunctionalApproximation,
    HessianStructure,
    Likelihood,
    LinkApprox,
    PredType,
    PriorStructure,
    SubsetOfWeights,
    TuningMethod,
)
from laplace.utils.errors import (
    AbstractClassError,
    NotFittedError,
    check_generator,
    check_int_at_least,
    check_mapping,
    check_module,
    check_positive_float,
    check_positive_int,
)
from laplace.utils.outputs import IGNORE_INDEX
from laplace.utils.validation import validate

__all__ = ["REGISTRY", "BaseLaplace", "arguments_for"]

#: The Laplace class of each (subset of weights, Hessian structure): every class that names its
#: ``_key`` (the factory [`laplace.Laplace`][laplace.Laplace] picks from it).
REGISTRY: dict[tuple[SubsetOfWeights, HessianStructure], type[BaseLaplace]] = {}


class BaseLaplace:
    """Common hyperparameters, data handling, prior tuning and state of every Laplace.

    The arguments every Laplace class shares are checked and stored here, each under its own
    name (``la.sigma_noise``, ...). The methods named in ``TRANSACTIONAL_METHODS`` change
    nothing when they raise, in every subclass.

    Args:
        model: The trained network; only parameters with ``requires_grad=True`` are treated
            probabilistically.
        likelihood: ``"classification"``, ``"regression"``, ``"reward_modeling"``,
            ``"binary_classification"``, ``"heteroscedastic_regression"`` (see
            [`Likelihood`][laplace.utils.enums.Likelihood]), or your own
            [`laplace.likelihoods.Likelihood`][laplace.likelihoods.Likelihood] instance.
        sigma_noise: Observation noise σ (regression only; must be 1 otherwise): one number,
            or one per output (shape (C,)) with the structures that keep each output's
            curvature (full, diag, kron).
        prior_precision: Gaussian prior precision: scalar, one per parameter tensor, or diagonal.
        prior_mean: Prior mean: scalar or one value per parameter.
        temperature: Likelihood temperature T; the curvature is scaled by 1/(σ²T).
        enable_backprop: Keep predictives differentiable w.r.t. the inputs.
        dict_key_x: Key of the inputs in dict-like batches.
        dict_key_y: Key of the targets in dict-like batches.
        backend: Curvature backend class (or an instance, as ``la.backend`` returns, which
            stands for its class); ``CurvlinopsGGN`` (exact GGN) when None.
        backend_kwargs: Keyword arguments for the backend's constructor.
        asdl_fisher_kwargs: Keyword arguments for ASDL's Fisher (ASDL backends only).
        class_dim: For outputs with extra dimensions (see ``laplace.utils.outputs``): the
            dimension of the outputs (B, …) that holds the classes (outputs), counted like
            torch's ``dim`` (``1`` for (B, C, H, W), ``-1`` for (B, T, C)). None: the one the
            classification targets lack, the last one for regression; needed only where that
            is ambiguous (an error says so).
        ignore_index: Classification: the label whose positions (or data points) are dropped
            from the loss and the curvature, as in ``nn.CrossEntropyLoss`` and Hugging Face.
        dtype: Floating-point type of the curvature, posterior, marginal likelihood and
            predictions: ``torch.float32`` or ``torch.float64``; None: the parameters' type,
            float32 for a half-precision (bfloat16, float16) network, which keeps running in
            its own type.

    Raises:
        ValueError: For an unknown likelihood, a non-positive σ or T, or a bad prior; an
            argument of the wrong type raises an error that is a ``ValueError`` and a
            ``TypeError``.
        TypeError: For an abstract class, a model that is not an ``nn.Module`` or a backend
            that is not a ``CurvatureInterface``.
    """

    #: Set in the body of an abstract class: what to use instead.
    _abstract: str | None = None
    #: The function-space (GP) approximation of the class; None: a weight-space one.
    _function_space: FunctionalApproximation | None = None
    #: The (subset of weights, Hessian structure) the ``Laplace`` factory builds the class for.
    _key: tuple[SubsetOfWeights, HessianStructure]
    #: The parameter subset the posterior covers (a class with ``for_model``).
    _subset_kind: type = AllWeights
    #: Keyword arguments of ``_subset_kind.for_model`` (a constructor sets its own).
    _subset_options: ClassVar[dict[str, Any]] = {}
    #: Entries of ``backend_kwargs`` the class takes itself, not handed to the backend.
    _own_backend_kwargs: tuple[str, ...] = ()
    #: Prior structures ``optimize_prior_precision`` refuses, with the reason.
    _refused_prior_structures: ClassVar[dict[PriorStructure, str]] = {}
    #: How ``state_dict`` saves the approximation and ``load_state_dict`` restores it.
    _state_format: StateFormat = StateFormat()
    #: ``(prior_lengths, prior_sizes)`` of the subset once its parameters are known.
    _prior_layout: tuple[tuple[int | None, int | None], list[int]] | None = None
    #: ``(σ, T, their versions, h)`` of ``_H_factor``.
    _h_factor_cache: tuple[Any, ...] | None = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "_key" in cls.__dict__:
            REGISTRY[cls._key] = cls
        for name in TRANSACTIONAL_METHODS:
            method = getattr(cls, name, None)
            if method is not None and not getattr(method, "_transactional", False):
                setattr(cls, name, transactional(method))

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
        backend: type[CurvatureInterface] | CurvatureInterface | None = None,
        backend_kwargs: dict[str, Any] | None = None,
        asdl_fisher_kwargs: dict[str, Any] | None = None,
        class_dim: int | None = None,
        ignore_index: int = IGNORE_INDEX,
        dtype: torch.dtype | None = None,
    ) -> None:
        if type(self).__dict__.get("_abstract"):
            raise AbstractClassError(f"{type(self).__name__} is abstract: {type(self)._abstract}")
        check_module(model)
        check_parameters([(n, p) for n, p in model.named_parameters() if p.is_meta])
        self._likelihood_model = make_likelihood(likelihood, class_dim, ignore_index)
        self.likelihood = self._likelihood_model.kind
        self.class_dim, self.ignore_index = class_dim, ignore_index
        if self._function_space is not None:
            self._likelihood_model.check_function_space(self._function_space)
        # DistributedDataParallel: curvature of the inner module.
        self._subset = self._subset_kind.for_model(
            unwrap_model(model), self._likelihood_model, **self._subset_options
        )
        self._subset.requested_dtype = check_posterior_dtype(dtype)
        self.model = self._subset.model
        self._bind_subset()
        self.temperature = temperature
        self.enable_backprop = enable_backprop
        self.dict_key_x, self.dict_key_y = dict_key_x, dict_key_y
        self.prior_precision = prior_precision
        self.prior_mean = prior_mean
        self._backend_cls = _backend_class(backend)
        self._likelihood_model.fit_likelihood.check_backend(self._backend_cls)
        self.backend_kwargs = backend_kwargs
        self.asdl_fisher_kwargs = asdl_fisher_kwargs
        options = check_mapping(backend_kwargs, "backend_kwargs")
        own = self._own_backend_kwargs
        self._backend_kwargs = {k: v for k, v in options.items() if k not in own}
        self._backend_kwargs.update(self._subset.backend_options)
        self._asdl_fisher_kwargs = check_mapping(asdl_fisher_kwargs, "asdl_fisher_kwargs")
        check_backend_kwargs(self._backend_cls, self._backend_kwargs)
        self._backend: CurvatureInterface | None = None
        self.loss: Tensor | float = 0.0
        self.n_data = 0
        self.n_outputs = 0
        self._fitted = False
        self.sigma_noise = sigma_noise
        if self._subset.resolved:
            self._init_unfitted()

    def _init_unfitted(self) -> None:
        """The unfitted posterior, once the parameters are known (nothing to build here)."""

    # ------------------------------------------------------------------------- transactions
    def _transaction_parts(self) -> tuple[Any, ...]:
        """The objects whose attributes a transactional call may change (this one first).

        A failed fit forgets the class dimension it found for outputs with extra dimensions
        and the last layer it found.
        """
        return (self, self._likelihood_model.outputs, *self._subset.stateful_parts)

    def _transaction_rebuild(self) -> dict[str, Callable[[], Any]]:
        """State left out of a snapshot and rebuilt after a failed call.

        The zero curvature of an unfitted approximation is freed while a first fit sums (a
        dense one is P × P) and rebuilt if that fit fails.
        """
        unfitted_prior = not self._fitted and getattr(self, "H", None) is not None
        return {"H": self._init_H} if unfitted_prior else {}

    def _resolve_subset(self, train_loader: DataLoader) -> None:
        """Find the parameters on the first batch if they are not known (a last layer)."""
        if self._subset.resolved:
            return
        X, _ = split_batch(next(iter(train_loader)), self.dict_key_x, self.dict_key_y)
        X = move_inputs(X, self._device)
        self.model.eval()
        self._subset.resolve(X[:1] if isinstance(X, Tensor) else X)
        self._on_resolved()

    def _on_resolved(self) -> None:
        """Bind the found parameters and check the hyperparameters given before they were known.

        The number of outputs is then known, and with it the structure (see
        ``laplace.structures.large_output``).
        """
        self._bind_subset()
        self.prior_precision = self.prior_precision
        self.prior_mean = self.prior_mean
        self.sigma_noise = self.sigma_noise
        self._init_unfitted()

    def _bind_subset(self) -> None:
        """Expose the subset's ``params``, ``n_params``, ``n_layers`` (None until it is known).

        The lengths and sizes of its prior are kept too: they are read at every marglik step.
        """
        known = self._subset.resolved
        if known:
            check_parameters(list(zip(self._subset.names, self._subset.params)))
        self.params = self._subset.params if known else None
        self.n_params = self._subset.n_params if known else None
        self.n_layers = self._subset.n_layers if known else None
        if known:
            self._prior_layout = (self._subset.prior_lengths, self._subset.prior_sizes)
        else:
            self._prior_layout = None

    # ------------------------------------------------------------------ device and backend
    @property
    def _device(self) -> torch.device:
        return self._subset.device

    @property
    def dtype(self) -> torch.dtype:
        """Floating-point type of the curvature, posterior and predictions.

        The ``dtype`` asked for, else the parameters' type (float32 for a half-precision
        network).
        """
        return self._subset.dtype

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
                self._likelihood_model.fit_likelihood,
                dict_key_x=self.dict_key_x,
                dict_key_y=self.dict_key_y,
                **kwargs,
            )
            engine = getattr(self._backend, "engine", None)
            if engine is not None:  # the native engine computes in the posterior's type
                engine.dtype = self._dtype
        return self._backend

    # ------------------------------------------------------------------------ hyperparameters
    @property
    def sigma_noise(self) -> Tensor:
        """Observation noise σ: shape () or (1,) as given, or (C,) with one σ per output."""
        return self._sigma_noise

    @sigma_noise.setter
    def sigma_noise(self, value: float | Tensor) -> None:
        """Set σ; one σ per output is refused here (parametric structures alone take it).

        Raises:
            ValueError: For one σ per output.
        """
        sigma = as_sigma_noise(value, self._likelihood_model, self._device, self._dtype)
        if sigma.numel() > 1:
            raise ValueError(
                f"{type(self).__name__} takes one sigma_noise for all outputs; one σ per output "
                "is supported by parametric Laplace with hessian_structure 'full', 'diag' or "
                "'kron'."
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
        """Lengths of a layer-wise and of a diagonal prior; None: no such (not known yet)."""
        return (None, None) if self._prior_layout is None else self._prior_layout[0]

    @property
    def _prior_sizes(self) -> list[int]:
        """Weights under each entry of a layer-wise prior.

        Raises:
            NotFittedError: While the parameters are not known (a last layer not found yet).
        """
        if self._prior_layout is None:
            return self._subset.prior_sizes  # raises
        return self._prior_layout[1]

    @property
    def prior_precision_diag(self) -> Tensor:
        """Prior precision expanded to the diagonal, shape (P,)."""
        return expand_to_diagonal(self.prior_precision, self._prior_sizes)

    @property
    def temperature(self) -> float | Tensor:
        """Likelihood temperature T, a positive finite number, checked on every assignment."""
        return self._temperature

    @temperature.setter
    def temperature(self, value: float | Tensor) -> None:
        self._temperature = check_temperature(value)

    @property
    def prior_mean(self) -> Tensor:
        """Prior mean: a scalar or shape (P,)."""
        return self._prior_mean

    @prior_mean.setter
    def prior_mean(self, value: float | Tensor) -> None:
        self._prior_mean = as_prior_mean(value, self._prior_lengths[1], self._device, self._dtype)

    @property
    def _H_factor(self) -> Tensor:
        """``h = 1/(σ²T)``; the same tensor while σ and T are (unless it is differentiable)."""
        sigma, temperature = self.sigma_noise, self.temperature
        versions = (sigma._version, getattr(temperature, "_version", None))
        cache = self._h_factor_cache
        hit = cache is not None and cache[0] is sigma and cache[1] is temperature
        if hit and cache[2] == versions:
            return cache[3]
        h_factor = 1 / (sigma.square() * temperature)
        if not h_factor.requires_grad:
            self._h_factor_cache = (sigma, temperature, versions, h_factor)
        return h_factor

    @property
    def log_likelihood(self) -> Tensor:
        """Log-likelihood of the training data at the MAP (differentiable in σ)."""
        self._check_fitted("log_likelihood")
        return self._likelihood_model.log_likelihood(
            self.loss, self.n_data, self.n_outputs, self.sigma_noise, self.temperature
        )

    def _parse_prediction(
        self,
        pred_type: PredType | str,
        link_approx: LinkApprox | str,
        n_samples: int,
        generator: torch.Generator | None,
        joint: bool,
        fitting: bool,
    ) -> tuple[PredType, LinkApprox, LikelihoodModel]:
        """The options of a prediction, parsed and checked before any work, and its likelihood.

        Returns:
            ``(pred_type, link_approx, likelihood)``: the likelihood of the fit when
            ``fitting`` (reward modelling predicts pairs then), else the predictive one.

        Raises:
            ValueError: For an unknown or incompatible ``pred_type`` / ``link_approx`` (a
                weight-space approximation takes ``"glm"`` or ``"nn"``, which needs ``"mc"``;
                a function-space one ``"gp"``), an ``n_samples`` that is not a positive
                integer where samples are drawn, or options the likelihood refuses.
        """
        pred_type = PredType(pred_type)
        link_approx = LinkApprox(link_approx)
        if self._function_space is not None and pred_type != PredType.GP:
            raise ValueError(
                f"function-space Laplace predicts with pred_type='gp', got {pred_type.value!r}."
            )
        if self._function_space is None and pred_type == PredType.GP:
            raise ValueError("pred_type='gp' needs a functional (GP) Laplace; use 'glm' or 'nn'.")
        if pred_type == PredType.NN and link_approx != LinkApprox.MC:
            raise ValueError(
                "pred_type='nn' samples networks and supports only link_approx='mc' "
                f"(got {link_approx.value!r})."
            )
        if pred_type == PredType.NN or link_approx == LinkApprox.MC:
            check_positive_int(n_samples, "n_samples")
        check_generator(generator)
        model = self._likelihood_model
        likelihood = model.fit_likelihood if fitting else model.predictive_likelihood
        likelihood.check_prediction(link_approx, joint)
        return pred_type, link_approx, likelihood

    @transactional
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
        temperature_range: tuple[float, float] | None = None,
        seed: int = 0,
    ) -> None:
        """Tune the prior precision by marginal likelihood or by a validation search.

        The validation searches, ``"gridsearch"`` and ``"bayesopt"``, score every candidate
        the same way: the loss of the predictive on ``val_loader`` (inf where the posterior
        cannot be factorised); the first candidate with the lowest finite loss is set. A call
        that raises changes nothing. A class that supports fewer options names them in its
        ``_refused_prior_structures``.

        Args:
            pred_type: Predictive used by the validation searches (``"glm"`` or ``"nn"``).
            method: ``"marglik"`` (Adam on log p₀), ``"gridsearch"`` or ``"bayesopt"``
                (Gaussian-process Bayesian optimisation with Optuna's ``GPSampler``; needs
                the ``bayesopt`` extra). Both validation searches need ``val_loader``.
            n_steps: Adam steps for marglik; for bayesopt the number of validation
                evaluations (each one a pass over ``val_loader``; 10 to 30 suit one to a few
                dimensions).
            lr: Adam learning rate for marglik.
            init_prior_prec: Initial precision for marglik; its structure is kept unless it is
                a scalar, which is then expanded to ``prior_structure``.
            prior_structure: ``"scalar"``, ``"layerwise"`` or ``"diag"`` for marglik;
                ``"scalar"`` (one dimension) or ``"layerwise"`` (one per parameter tensor)
                for bayesopt, which refuses ``"diag"``; grid search tunes a scalar.
            val_loader: Validation data for the validation searches.
            loss: Validation loss of the validation searches: a torchmetrics Metric, a
                callable, or a name (``"nll"``, ``"ece"``, ``"brier"``, ``"crps"``; see
                ``laplace.evaluation``); defaults to running NLL for classification and
                running MSE for regression.
            log_prior_prec_min: Lower end of the searched prior precision, as an exponent of
                ``log_prior_prec_base``.
            log_prior_prec_max: Upper end of the searched prior precision.
            grid_size: Number of grid points.
            link_approx: Link approximation used by the validation searches.
            n_samples: Samples of the predictive for the validation searches with MC links.
            verbose: Print the chosen prior precision (and temperature).
            progress_bar: Show a progress bar.
            log_prior_prec_base: Base of the exponents.
            temperature_range: bayesopt only: ``(low, high)`` bounds (positive, ``low < high``)
                of the temperature ``la.temperature``, searched on a log scale together with
                the prior precision; None keeps the temperature fixed.
            seed: bayesopt only: seed of the search, an integer in ``[0, 2**32)``; the same
                seed and data give the same candidates.

        Raises:
            ValueError: For an unknown method, structure, pred_type or link_approx, a
                validation search without ``val_loader``, an unknown ``loss`` name, a negative
                ``n_steps`` (marglik) or one below 1 (bayesopt), a non-positive ``lr`` or
                ``grid_size``, a search range that is not finite (or, for bayesopt, not
                increasing), a bad ``temperature_range`` or ``seed``, or bayesopt with
                ``prior_structure="diag"``; a non-integer count raises an error that is a
                ``ValueError`` and a ``TypeError``. Every check runs before any evaluation.
            ImportError: For bayesopt without Optuna installed (the ``bayesopt`` extra).
            RuntimeError: If no candidate of a validation search gives a finite loss.

        Warns:
            UserWarning: laplace-torch's, word for word: for class probabilities (classification
                and reward modelling), on every call, that ``link_approx`` should be the one
                used to predict; for ``method="marglik"`` with a ``val_loader``, that the
                loader is ignored.
        """
        method = TuningMethod(method)
        pred_type = PredType(pred_type)
        link_approx = LinkApprox(link_approx)
        prior_structure = PriorStructure(prior_structure)
        if self._likelihood_model.name in (Likelihood.CLASSIFICATION, Likelihood.REWARD_MODELING):
            warnings.warn(
                "By default `link_approx` is `probit`. Make sure to set it equals to the way you "
                "want to call `la(test_data, pred_type=..., link_approx=...)`.",
                stacklevel=2,
            )
        if method == TuningMethod.MARGLIK and val_loader is not None:
            warnings.warn(
                "`val_loader` will be ignored when `method` == 'marglik'. Do you mean to set "
                "`method = 'gridsearch'`?",
                stacklevel=2,
            )
        refusal = self._refused_prior_structures.get(prior_structure)
        if refusal is not None:
            raise ValueError(refusal)
        if temperature_range is not None and method != TuningMethod.BAYESOPT:
            raise ValueError(
                f"temperature_range is searched by method='bayesopt' only, got "
                f"method={method.value!r}; pass temperature_range=None."
            )
        if method == TuningMethod.MARGLIK:
            check_int_at_least(n_steps, "n_steps", 0)
            check_positive_float(lr, "lr")
        elif method == TuningMethod.BAYESOPT:
            if prior_structure == PriorStructure.DIAG:
                raise ValueError(
                    "method='bayesopt' takes prior_structure 'scalar' or 'layerwise': 'diag' has "
                    "one dimension per weight, too many for a Gaussian-process search; use "
                    "method='marglik' for a diagonal prior."
                )
            temperature_range = check_bayesopt_arguments(
                n_steps,
                log_prior_prec_min,
                log_prior_prec_max,
                log_prior_prec_base,
                temperature_range,
                seed,
            )
            import_optuna()
        self._check_fitted("optimize_prior_precision")
        if method == TuningMethod.MARGLIK:
            if torch.is_tensor(init_prior_prec) and init_prior_prec.numel() > 1:
                init = as_prior_precision(
                    init_prior_prec, *self._prior_lengths, self._device, self._dtype
                )
            else:
                init = fix_prior_prec_structure(
                    check_positive_float(init_prior_prec, "init_prior_prec"),
                    prior_structure,
                    *self._prior_lengths,
                    self._device,
                    self._dtype,
                )
            self.prior_precision = maximize_marglik(
                self.log_marginal_likelihood, init, n_steps, lr, progress_bar
            )
        else:
            if val_loader is None:
                raise ValueError(
                    f"method={method.value!r} needs a val_loader with validation data."
                )
            if method == TuningMethod.GRIDSEARCH:
                candidates = grid_candidates(
                    log_prior_prec_min,
                    log_prior_prec_max,
                    grid_size,
                    log_prior_prec_base,
                    self._device,
                    self._dtype,
                )
            distributed = getattr(self, "_distributed", False)
            # None: the likelihood's default; a name: its running metric, summed over all ranks
            # when distributed; anything else is the user's metric or callable.
            likelihood = self._likelihood_model.fit_likelihood
            if loss is None:
                loss = likelihood.validation_loss(None, self.n_outputs).to(self._device)
            elif isinstance(loss, str):
                loss = likelihood.validation_loss(
                    loss, self.n_outputs, self.sigma_noise, sync_on_compute=distributed
                ).to(self._device)

            def validation_score(
                prior_precision: Tensor, temperature: float | None = None
            ) -> float:
                self.prior_precision = prior_precision
                if temperature is not None:
                    self.temperature = temperature
                return validate(
                    self,
                    val_loader,
                    loss,
                    pred_type,
                    link_approx,
                    n_samples,
                    dict_key_y=self.dict_key_y,
                )

            if method == TuningMethod.GRIDSEARCH:
                self.prior_precision = gridsearch(
                    candidates, validation_score, val_loader, distributed, progress_bar
                )
            else:
                n_layers = self._prior_lengths[0]
                n_priors = n_layers if prior_structure == PriorStructure.LAYERWISE else 1
                prior_precision, temperature = bayesopt(
                    validation_score,
                    n_priors,
                    log_prior_prec_min,
                    log_prior_prec_max,
                    log_prior_prec_base,
                    temperature_range,
                    n_steps,
                    seed,
                    val_loader,
                    self._device,
                    self._dtype,
                    distributed,
                    progress_bar,
                )
                self.prior_precision = prior_precision
                if temperature is not None:
                    self.temperature = temperature
        if verbose:
            tuned = temperature_range is not None  # only bayesopt takes a temperature_range
            temperature_note = f" and temperature {self.temperature}" if tuned else ""
            print(f"Optimized prior precision is {self.prior_precision}{temperature_note}.")

    def state_dict(self) -> dict[str, Any]:
        """The fitted state of this approximation.

        Returns:
            A dict of tensors and plain values (loadable with ``weights_only=True``).

        Raises:
            NotFittedError: Before ``fit``.
        """
        self._check_fitted("state_dict")
        fmt = self._state_format
        return {**fmt.identity(self), "mean": self.mean.detach(), **fmt.values(self)}

    @transactional
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore a state saved by ``state_dict`` into this approximation.

        Every check (identity, entries, the mean against the model's weights, the format's values)
        runs before anything is assigned; a state that fails one changes nothing.

        Raises:
            ValueError: If the state belongs to another class, likelihood or architecture, if the
                model's weights are not the saved posterior mean, or if it is not a state
                ``state_dict`` writes (see ``check_state_dict``).
        """
        fmt = self._state_format
        identity = fmt.identity(self)
        check_state_dict(state_dict, identity, (), ())
        for key, value in identity.items():
            if state_dict[key] != value:
                raise ValueError(identity_mismatch(key, state_dict[key], value))
        required = (*identity, "mean", *fmt.value_keys(self))
        tensors = ("mean", *fmt.tensor_keys(self))
        check_state_dict(state_dict, required, tensors, fmt.count_keys(self))
        fmt.prepare(self, state_dict)
        mean = state_dict["mean"].to(device=self._device, dtype=self._dtype)
        current = self._subset.vector().detach()
        if mean.shape != current.shape or not torch.allclose(
            mean, current, rtol=0, atol=MEAN_MATCH_ATOL
        ):
            raise ValueError(
                "the model's weights differ from the posterior mean stored in state_dict (a "
                "state loads into the same pretrained model only); load the model's own "
                "state_dict (the MAP weights) before the Laplace state."
            )
        fmt.check(self, state_dict)
        self._warn_of_differences(state_dict)
        fmt.load(self, state_dict)
        self.mean = mean
        self._fitted = True

    def _warn_of_differences(self, state_dict: dict[str, Any]) -> None:
        """laplace-torch's warnings (word for word) about a state built with other settings."""
        if "temperature" in state_dict and self.temperature != state_dict["temperature"]:
            warnings.warn(
                "Different `temperature` parameters detected. Some calculation might be off!",
                stacklevel=3,
            )
        backprop = state_dict.get("enable_backprop", self.enable_backprop)
        if self.enable_backprop != backprop:
            warnings.warn(
                "Different `enable_backprop` values. You might encounter error when "
                "differentiating the predictive mean and variance.",
                stacklevel=3,
            )

    def _check_fitted(self, what: str = "this method") -> None:
        if not self._fitted:
            raise NotFittedError(f"{what} needs a fitted Laplace approximation: call fit() first.")

    def _batches(self, loader: DataLoader, progress_bar: bool = False, desc: str = "batches"):
        """Yield ``(X, y)`` of each batch on the model's device, checked before any model call.

        Raises:
            ValueError: For batches ``prepare_batch`` refuses, and dict-like batches with a
                backend that cannot take them (BackPACK).
        """
        return self._data_loop(DataLoop, progress_bar=progress_bar, desc=desc).batches(loader)

    def _data_loop(self, loop: type[DataLoop], **options: Any) -> DataLoop:
        """A ``loop`` (a ``DataLoop`` class) over this one's batches.

        ``options`` are its other arguments; the dict keys, the device and the check that the
        backend takes the inputs are this approximation's.
        """
        return loop(
            self.dict_key_x,
            self.dict_key_y,
            self._device,
            check_inputs=partial(check_dict_inputs, self._backend_cls),
            **options,
        )


def _backend_class(
    backend: type[CurvatureInterface] | CurvatureInterface | None,
) -> type[CurvatureInterface]:
    """The backend class for a ``backend`` argument: a class, an instance or None (default).

    Raises:
        TypeError: If it is not a ``CurvatureInterface`` subclass or instance.
    """
    if backend is None:
        return CurvlinopsGGN
    if isinstance(backend, CurvatureInterface):
        return type(backend)
    if isinstance(backend, type) and issubclass(backend, CurvatureInterface):
        return backend
    raise TypeError(f"backend must be a CurvatureInterface subclass, got {backend!r}.")


def arguments_for(constructor: Callable, namespace: dict[str, Any]) -> dict[str, Any]:
    """The arguments of ``constructor`` found in a calling constructor's ``locals()``.

    As in ``BaseLaplace.__init__(self, **arguments_for(BaseLaplace.__init__, locals()))``.

    Args:
        constructor: The ``__init__`` to call.
        namespace: The caller's ``locals()`` (its arguments).
    """
    names = list(inspect.signature(constructor).parameters)[1:]  # after ``self``
    return {name: namespace[name] for name in names if name in namespace}
