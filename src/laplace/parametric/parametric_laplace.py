"""Parametric Laplace: ``N(θ_MAP, P⁻¹)`` over weights, with dense and diagonal structures.

Internal module; the public path is [`laplace.baselaplace`][laplace.baselaplace].
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor
from torch.utils.data import DataLoader

from laplace.core.base_laplace import BaseLaplace
from laplace.core.passes.curvature_sum import CurvatureSum, FitPass, FitPieces
from laplace.core.priors import as_sigma_noise, prior_log_det, sum_per_prior_entry
from laplace.core.serialization import ParametricState
from laplace.structures import (
    NotPositiveDefiniteError,
    Posterior,
    large_output,
    memory_budgets,
)
from laplace.structures.jacobians import HeadFeatures, position_rows, row_kind
from laplace.structures.memory_budgets import jacobian_chunk_rows
from laplace.structures.per_output import PerOutputPosterior, noise_structure
from laplace.utils import distributed as distributed_utils
from laplace.utils.data import (
    Inputs,
    batch_size_of,
    check_outputs,
    input_chunks,
    prepare_inputs,
)
from laplace.utils.enums import LinkApprox, PredType
from laplace.utils.errors import (
    NotFittedError,
    check_bool,
    check_fits_in_memory,
    check_generator,
    check_positive_int,
)
from laplace.utils.predictive import draws_from_root, gaussian_output_samples

__all__ = ["GLMPlan", "ParametricLaplace"]


@dataclass(frozen=True)
class GLMPlan:
    """What a GLM prediction derives once, before its first chunk of test points.

    Attributes:
        posterior: The posterior at the current hyperparameters.
        kind: The Jacobian kind the subset gives this posterior
            (``laplace.structures.jacobians``).
        variances_only: Why only output variances are computed (a last layer with many
            outputs), else None.
    """

    posterior: Posterior
    kind: type
    variances_only: str | None


class ParametricLaplace(BaseLaplace):
    """Gaussian posterior ``N(θ_MAP, P⁻¹)`` with ``P = H/(σ²T) + diag(p₀)`` over the weights.

    Subclasses choose the structure of the curvature ``H`` through ``_posterior_cls``. After
    ``fit``, ``H`` is the curvature summed over the data, ``loss`` the summed loss, ``mean`` the
    MAP weights (P,). Before it, as in laplace-torch, the posterior is the prior: ``H`` is a zero
    curvature and ``mean`` the prior mean; predictions and samples need ``fit``. See
    [`BaseLaplace`][laplace.core.base_laplace.BaseLaplace] for the arguments.
    """

    _abstract = "use FullLaplace, DiagLaplace, KronLaplace or LowRankLaplace."
    _posterior_cls: type[Posterior]
    _state_format = ParametricState()
    #: The pass over the data that sums the curvature, and its further options.
    _curvature_pass: type[FitPass] = CurvatureSum
    _fit_pass_options: ClassVar[dict[str, Any]] = {}
    #: The fitted curvature; before a fit the zero curvature (None while the parameters are
    #: not known).
    H: Any = None
    _fitted_mean: Tensor | None = None
    _posterior_cache: tuple[Any, Tensor, Tensor, Posterior] | None = None
    #: ``(mean, prior mean, their versions and the prior's length, sums)`` of
    #: ``_squared_deviation_sums``.
    _deviation_cache: tuple[Tensor, Tensor, tuple[int, int, int], Tensor] | None = None
    #: An assigned ``_posterior_scale`` and the posterior object it belongs to.
    _assigned_scale: tuple[Any, Tensor] | None = None

    @BaseLaplace.sigma_noise.setter
    def sigma_noise(self, value: float | Tensor) -> None:
        """Set σ; one σ per output switches to the per-output variant of the structure.

        Raises:
            ValueError: See ``laplace.structures.per_output.noise_structure``.
        """
        sigma = as_sigma_noise(value, self._likelihood_model, self._device, self._dtype)
        if sigma.numel() > 1 or issubclass(self._posterior_cls, PerOutputPosterior):
            self._settle_structure(sigma.numel())
        self._sigma_noise = sigma

    def _settle_structure(self, n_sigma: int) -> None:
        """Set the structure in use: the class's own for one σ, its per-output variant for C.

        An unfitted approximation restarts from the new structure's zero curvature.

        Args:
            n_sigma: Number of noise values (1, or C for one per output).

        Raises:
            ValueError: See ``laplace.structures.per_output.noise_structure``.
        """
        structure = noise_structure(
            self._own_structure(),
            self._posterior_cls,
            n_sigma,
            self._fitted,
            self._backend_cls,
        )
        if structure is not self._posterior_cls:
            self._posterior_cls = structure
            if self.H is not None:
                self._init_H()

    def _init_unfitted(self) -> None:
        """The unfitted posterior once the parameters are known: the structure's prior."""
        self._settle_structure(self._sigma_noise.numel())
        self._init_H()

    def _own_structure(self) -> type[Posterior]:
        """The class's posterior structure for one σ (``_posterior_cls`` of the class)."""
        return type(self)._posterior_cls

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
        return self._subset.prior_mean_vector(self.prior_mean)

    @mean.setter
    def mean(self, value: Tensor | None) -> None:
        self._fitted_mean = value

    # ------------------------------------------------------------------------- posterior
    @property
    def _posterior(self) -> Posterior:
        """The posterior at the current hyperparameters, cached while they do not change.

        Another prior precision with the same ``H`` and ``h = 1/(σ²T)`` (a tuning step) gives
        the cached posterior ``with_prior``, keeping what the structure computed from them.
        """
        h_factor, prior, sizes = self._H_factor, self.prior_precision, self._prior_sizes
        if self.H is None:
            raise NotFittedError("the posterior needs fit() first (or a call to _init_H()).")
        if h_factor.requires_grad:
            return self._posterior_cls(self.H, h_factor, prior, sizes)
        key = (id(self.H), getattr(self.H, "_version", None))
        cache = self._posterior_cache
        if (
            cache is None
            or cache[0] != key
            or not (cache[1] is h_factor or torch.equal(cache[1], h_factor))
        ):
            posterior = self._posterior_cls(self.H, h_factor, prior.detach(), sizes)
            prior_key = prior.detach().clone()
            cache = self._posterior_cache = (key, h_factor, prior_key, posterior)
        if prior.requires_grad:
            return cache[3].with_prior(prior, sizes)
        if not torch.equal(cache[2], prior):
            posterior = cache[3].with_prior(prior, sizes)
            cache = self._posterior_cache = (key, cache[1], prior.clone(), posterior)
        return cache[3]

    @property
    def posterior_precision(self) -> Any:
        """Posterior precision ``P`` in the structure's representation."""
        return self._posterior.precision

    @property
    def scatter(self) -> Tensor:
        """``(θ_MAP − μ₀)ᵀ P₀ (θ_MAP − μ₀)``."""
        prior = self.prior_precision
        return (prior * self._squared_deviation_sums(len(prior))).sum()

    def _squared_deviation_sums(self, n_prior: int) -> Tensor:
        """``(θ_MAP − μ₀)²`` summed per entry of a prior of length ``n_prior``.

        See ``sum_per_prior_entry``; kept while the mean and the prior mean are unchanged.
        """
        sizes = self._prior_sizes  # raises while the parameters are not known
        mean, prior_mean = self.mean, self.prior_mean
        versions = (mean._version, prior_mean._version, n_prior)
        cache = self._deviation_cache
        hit = cache is not None and cache[0] is mean and cache[1] is prior_mean
        if hit and cache[2] == versions:
            return cache[3]
        sums = sum_per_prior_entry((mean - prior_mean).square(), n_prior, sizes)
        if not sums.requires_grad:  # not when the mean is differentiable (enable_backprop)
            self._deviation_cache = (mean, prior_mean, versions, sums)
        return sums

    @property
    def log_det_prior_precision(self) -> Tensor:
        """``log det P₀``."""
        return prior_log_det(self.prior_precision, self._prior_sizes)

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
        finite = (
            math.isfinite(value.item())
            if value.numel() == 1
            else bool(torch.isfinite(value.detach()).all())
        )
        if not finite:
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
        with ``θ*`` the MAP weights. Passing ``prior_precision`` or ``sigma_noise`` replaces the
        stored values.

        Raises:
            RuntimeError: Before ``fit``.
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
            NotFittedError: Before ``fit`` (a ``RuntimeError``).
        """
        return self.mean + self._sample_deviations(n_samples, generator)

    def _sample_deviations(self, n_samples: int, generator: torch.Generator | None) -> Tensor:
        """Draws of ``θ − θ_MAP`` (n_samples, P) over the posterior's parameters."""
        check_positive_int(n_samples, "n_samples")
        check_generator(generator)
        self._check_fitted("sample")
        scale = self._current_assigned_scale()
        if scale is None:
            draws = self._posterior.sample_deviations(n_samples, generator)
        else:
            draws = draws_from_root(scale.new_zeros(scale.shape[-1]), scale, n_samples, generator)
        return self._checked_finite(draws, "posterior samples")

    # ------------------------------------------------------------- posterior scale
    # laplace-torch's cached scale S (S Sᵀ = P⁻¹): here the posterior structure owns it, and an
    # assigned one is used until the curvature or a hyperparameter changes.
    @property
    def posterior_scale(self) -> Tensor:
        """``S`` (P, P) with ``S Sᵀ = P⁻¹``: the assigned ``_posterior_scale``, else computed."""
        assigned = self._current_assigned_scale()
        return assigned if assigned is not None else self._posterior.scale

    def _compute_scale(self) -> None:
        """Compute the posterior scale (laplace-torch's hook); an assigned one is dropped."""
        self._assigned_scale = None
        _ = self._posterior.scale

    @property
    def _posterior_scale(self) -> Tensor:
        """The scale laplace-torch caches here; readable and assignable (None resets it)."""
        return self.posterior_scale

    @_posterior_scale.setter
    def _posterior_scale(self, value: Tensor | None) -> None:
        self._assigned_scale = None if value is None else (self._posterior, value)

    def _current_assigned_scale(self) -> Tensor | None:
        """The assigned scale while the posterior it was assigned for is current."""
        posterior, scale = self._assigned_scale or (None, None)
        return scale if scale is not None and posterior is self._posterior else None

    # ------------------------------------------------------------------------ fit
    @property
    def _structure_options(self) -> dict[str, Any]:
        """Options of the posterior structure's ``finalize`` / ``load_state`` (Kron: damping)."""
        return {"damping": self.damping} if hasattr(self, "damping") else {}

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
            distributed: All-reduce the sums over the ranks of ``torch.distributed``, each
                fitting its shard of the data; None: when the process group is initialised
                and the loader uses a ``DistributedSampler`` (see ``laplace.utils.distributed``).

        When it raises (even on ``KeyboardInterrupt``), the approximation is left as it was.

        Raises:
            ValueError: If the loader is empty or a batch contains non-finite values, or for
                ``override=False`` with a structure that cannot update a fit (low-rank).
            RuntimeError: If the curvature of a batch is not finite.
            DistributedFitError: If another rank failed during a distributed fit, or the ranks
                hold different hyperparameters.
        """
        structure = self._posterior_cls
        if not check_bool(override, "override") and structure.update_refusal is not None:
            raise ValueError(
                f"{type(self).__name__} cannot update a fit (override=False): "
                f"{structure.update_refusal}"
            )
        self._distributed = distributed_utils.resolve(distributed, train_loader)
        n_data = distributed_utils.total_data_count(train_loader, self._distributed)
        if n_data == 0:
            raise ValueError("train_loader is empty: fit needs at least one data point.")
        with distributed_utils.guard(self._distributed, "fit"):
            self._resolve_subset(train_loader)
        if self._distributed:  # every rank refuses ranks built with other hyperparameters
            distributed_utils.check_consistent(
                {
                    "class": type(self).__name__,
                    "n_params": self.n_params,
                    "prior_precision": self.prior_precision,
                    "prior_mean": self.prior_mean,
                    "sigma_noise": self.sigma_noise,
                    "temperature": self.temperature,
                },
                "fit",
            )
        check_fits_in_memory(
            self._fit_bytes(),
            self._device,
            f"a fit of {type(self).__name__} ({structure.__name__} over "
            f"P={self.n_params:,} parameters in {self._dtype})",
            f"use {self._posterior_cls.lighter}.",
        )
        update = not override and self._fitted
        n_before = self.n_data if update else 0
        self.model.eval()
        mean = self._subset.vector()
        if not self._fitted:
            self.H = None  # the prior's zero curvature: freed while summing, rebuilt on failure
        pieces = FitPieces(
            subset=self._subset,
            posterior=self._posterior_cls,
            backend=self.backend,
            likelihood=self._likelihood_model.fit_likelihood,
            zeros=self._zero_curvature,
            n_data=n_before + n_data,  # KFAC normalises by the data of earlier fits too
            previous=self.H if update else None,
            n_before=n_before,
        )
        loop = self._data_loop(
            self._curvature_pass,
            pieces=pieces,
            **self._fit_pass_options,
            progress_bar=progress_bar,
            desc="fit",
            distributed=self._distributed,
            empty_message="train_loader yielded no batches: fit needs at least one batch.",
        )
        H_new, loss_new = loop.run(train_loader)
        for name, value in loop.results.items():
            setattr(self, name, value)
        if update:  # the pass merged the earlier curvature in
            loss_new = self.loss + loss_new
        self.H = structure.finalize(H_new, **self._structure_options)
        self.loss, self.n_data, self.n_outputs = loss_new, n_before + n_data, loop.n_outputs
        self.mean = mean if self.enable_backprop else mean.detach()
        self._posterior_cache = None
        self._fitted = True

    def _zero_curvature(self) -> Any:
        """Empty curvature in the posterior's structure and dimension."""
        return self._posterior_cls.zeros(self._subset.curvature_params)

    def _fit_bytes(self) -> int:
        """Bytes of a fit in the posterior's structure, from the shapes alone (``fit_bytes``)."""
        return self._posterior_cls.fit_bytes(
            self._subset.curvature_params, **self._fit_pass_options
        )

    # ------------------------------------------------------------------ predictives
    def __call__(
        self,
        x: Inputs,
        pred_type: PredType | str = PredType.GLM,
        joint: bool = False,
        link_approx: LinkApprox | str = LinkApprox.PROBIT,
        n_samples: int = 100,
        diagonal_output: bool = False,
        generator: torch.Generator | None = None,
        fitting: bool = False,
        **model_kwargs: Any,
    ) -> Tensor | tuple[Tensor, Tensor]:
        """Posterior predictive at inputs ``x``.

        Args:
            x: Test inputs (B, ...) or a dict-like batch.
            pred_type: ``"glm"`` (linearised network) or ``"nn"`` (sampled weights).
            joint: Regression GLM only: return the joint ``(f_mu (B·C,), f_cov (B·C, B·C))``.
            link_approx: Classification link: ``"probit"``, ``"bridge"``, ``"bridge_norm"`` or
                ``"mc"``; ``pred_type="nn"`` needs ``"mc"``.
            n_samples: Samples for ``"mc"`` and ``"nn"``.
            diagonal_output: Regression GLM: return variances (B, C) instead of (B, C, C).
            generator: Random number generator for sampling.
            fitting: Reward modelling: predict as during fitting (classification).
            **model_kwargs: Extra keyword arguments for the model's forward (NN predictive).

        Returns:
            What the likelihood predicts: classification class probabilities (B, C); binary
            classification label probabilities (B, K); regression ``(f_mu, f_var)``;
            heteroscedastic regression a ``HeteroscedasticPrediction``; your own likelihood
            what its ``predictive`` returns.

        Raises:
            ValueError: For unknown or incompatible ``pred_type`` / ``link_approx`` (binary
                classification takes ``"probit"`` or ``"mc"``), an ``n_samples`` that is not
                a positive integer where samples are drawn, ``joint=True`` with a predictive
                other than regression's, or empty or non-finite inputs.
            RuntimeError: Before ``fit``.
        """
        pred_type, link_approx, likelihood = self._parse_prediction(
            pred_type, link_approx, n_samples, generator, joint, fitting
        )
        self._check_fitted("prediction")
        plan = self._glm_plan() if pred_type == PredType.GLM else None
        if plan is not None and plan.variances_only is not None:
            likelihood.check_variance_prediction(
                link_approx, joint, diagonal_output, plan.variances_only
            )
        x = prepare_inputs(x, self.dict_key_x, self._device, "prediction")
        if plan is None:
            n_points = batch_size_of(x, self.dict_key_x)
            self._check_nn_prediction_memory(n_points, n_samples, grouped=True)
            groups = self._nn_sample_groups(x, n_samples, generator, **model_kwargs)
            return likelihood.sampled_predictive_of(groups)
        if joint:  # the joint moments as they are
            return self._glm_predictive_distribution(x, joint=True, plan=plan)
        diagonal = likelihood.diagonal_moments(diagonal_output)
        f_mu, f_var = self._glm_predictive_distribution(x, diagonal_output=diagonal, plan=plan)
        return likelihood.predict(f_mu, f_var, link_approx, n_samples, generator, diagonal_output)

    def predictive(self, x: Inputs, pred_type="glm", link_approx="probit", n_samples=100):
        """Alias of ``__call__`` kept from older laplace-torch versions."""
        return self(x, pred_type=pred_type, link_approx=link_approx, n_samples=n_samples)

    # ----------------------------------------------------------------------------- GLM
    def _glm_plan(self) -> GLMPlan:
        """The posterior, its Jacobian kind and the variances-only reason, derived once."""
        posterior = self._posterior
        return GLMPlan(
            posterior,
            self._subset.jacobian_kind(posterior.closed_forms),
            self._subset.variances_only_reason(self.n_outputs),
        )

    def _chunk_rows(self, n_points: int, plan: GLMPlan | None = None) -> int:
        """Test points per chunk of a call on ``n_points`` points (``plan`` derived when None)."""
        plan = plan or self._glm_plan()
        if plan.variances_only:
            # A last layer's closed forms hold about C·(D + 1) numbers per point.
            n_in = self._subset.layer.in_features
            return jacobian_chunk_rows(self.n_outputs, n_in + 1, self._dtype)
        subset, outputs = self._subset, self._likelihood_model.outputs
        kind = row_kind(plan.kind, outputs)
        per_point = outputs.per_point(self.n_outputs)
        rows = jacobian_chunk_rows(per_point, len(plan.posterior.prior_diag), self._dtype)
        row_bytes = getattr(getattr(self.backend, "engine", None), "row_bytes", None)
        return kind.chunk_rows(rows, subset.model, subset.params, row_bytes)

    def _glm_predictive_distribution(
        self,
        X: Inputs,
        joint: bool = False,
        diagonal_output: bool = False,
        plan: GLMPlan | None = None,
    ) -> tuple[Tensor, Tensor]:
        """Mean and covariance of the linearised network's outputs (laplace-torch's hook).

        Returns:
            ``(f_mu (B, C), f_var (B, C, C))``; ``(B, C)`` variances if ``diagonal_output``;
            ``(f_mu (B·C,), f_cov (B·C, B·C))`` if ``joint``.

        Raises:
            ValueError: Where the approximation refuses the GLM predictive (many outputs without
                a last layer's closed form, ``laplace.structures.large_output.check_glm``).
        """
        plan = plan or self._glm_plan()
        if plan.kind is not HeadFeatures:
            large_output.check_glm(self.n_outputs)
        self._check_prediction_memory(batch_size_of(X, self.dict_key_x), plan, joint)
        if joint:
            f_mu, J = self._subset.linearize(X, self.backend, (), self.enable_backprop)
            return self._detached(f_mu.reshape(-1), self.functional_covariance(J.dense()))
        means, variances = [], []
        n_points = batch_size_of(X, self.dict_key_x)
        for chunk in input_chunks(X, self._chunk_rows(n_points, plan), self.dict_key_x):
            f_mu, f_var = self._functional_moments(chunk, plan.posterior)
            check_outputs(f_mu, batch_size_of(chunk, self.dict_key_x))
            self._checked_finite(f_var, "predictive variance")
            means.append(f_mu)
            if diagonal_output and f_var.dim() == 3:
                f_var = f_var.diagonal(dim1=-2, dim2=-1)
            variances.append(f_var)
        return torch.cat(means), torch.cat(variances)

    def _check_prediction_memory(self, n_points: int, plan: GLMPlan, joint: bool) -> None:
        """Refuse a GLM prediction of ``n_points`` test points whose estimate exceeds the memory.

        The estimate is the posterior's ``prediction_bytes``; the refusal names the test points
        that would fit at once.

        Raises:
            TooLargeError: (a ``ValueError`` and a ``RuntimeError``) naming the estimate and
                what would fit.
        """
        C = self.n_outputs
        rows_per_point = self._likelihood_model.outputs.per_point(C) // C

        def needed(points: int) -> int:
            rows, variances_only = points * rows_per_point, plan.variances_only is not None
            return plan.posterior.prediction_bytes(rows, C, plan.kind, joint, variances_only)

        def instead(available: int) -> str:
            points = _fitting_count(n_points, needed, available, "test points")
            return (
                f"predict fewer test points at once ({points}), or use {plan.posterior.lighter}."
            )

        check_fits_in_memory(
            needed(n_points),
            self._device,
            f"a GLM prediction{' (joint)' if joint else ''} of {n_points:,} test points with "
            f"C={C:,} outputs ({type(plan.posterior).__name__} over P={self.n_params:,} "
            "parameters)",
            instead,
        )

    def _check_nn_prediction_memory(self, n_points: int, n_samples: int, grouped: bool) -> None:
        """Refuse sampled networks on ``n_points`` test points whose estimate exceeds the memory.

        The estimate, from shapes alone: the fitted state, two (S, P) blocks of weights (the
        draws and the weights made from them) and the sampled outputs (S, R, C). ``grouped``:
        the samples are drawn in groups of ``_nn_sample_groups`` (one group of weights held),
        and a likelihood predicting probabilities averages them a group at a time (one group of
        outputs and their probabilities held).

        Raises:
            TooLargeError: (a ``ValueError`` and a ``RuntimeError``) naming the estimate and
                what would fit.
        """
        plan, likelihood = self._glm_plan(), self._likelihood_model
        posterior, itemsize = plan.posterior, self.mean.element_size()
        held = posterior.held_bytes(0, self.n_outputs, plan.kind)
        values = n_points * likelihood.outputs.per_point(self.n_outputs)
        per_weights = self.n_params * itemsize

        def needed(samples: int) -> int:
            group = samples
            if grouped and samples * per_weights > memory_budgets.NN_SAMPLE_BYTES:
                group = 1
            kept = group if grouped and likelihood.predicts_probabilities else samples
            return held + 2 * group * per_weights + 2 * kept * values * itemsize

        def instead(available: int) -> str:
            samples = _fitting_count(n_samples, needed, available, "samples")
            return (
                f"draw fewer samples ({samples}), predict fewer test points at once, or use "
                f"pred_type='glm' or {posterior.lighter}."
            )

        check_fits_in_memory(
            needed(n_samples),
            self._device,
            f"{n_samples:,} sampled networks (pred_type='nn') on {n_points:,} test points with "
            f"C={self.n_outputs:,} outputs ({type(posterior).__name__} over "
            f"P={self.n_params:,} parameters)",
            instead,
        )

    def _functional_moments(
        self, X: Inputs, posterior: Posterior | None = None
    ) -> tuple[Tensor, Tensor]:
        """``(f_mu (B, C), f_var (B, C, C))`` of the linearised network on one chunk of inputs.

        Outputs with extra dimensions give ``f_mu`` in their shape (B, …) and the covariances of
        their rows (B·T, C, C) (``laplace.utils.outputs``). ``posterior`` is derived when None.
        """
        posterior = self._posterior if posterior is None else posterior
        f_mu, J = self._subset.linearize(
            X, self.backend, posterior.closed_forms, self.enable_backprop
        )
        J = position_rows(J, self._likelihood_model.layout(f_mu.shape))
        return self._detached(f_mu, posterior.functional_variance(J))

    def _detached(self, f_mu: Tensor, f_var: Tensor) -> tuple[Tensor, Tensor]:
        """The moments, detached from the graph unless ``enable_backprop``."""
        return (f_mu, f_var) if self.enable_backprop else (f_mu.detach(), f_var.detach())

    def functional_samples(
        self,
        x: Inputs,
        pred_type: PredType | str = PredType.GLM,
        n_samples: int = 100,
        diagonal_output: bool = False,
        generator: torch.Generator | None = None,
    ) -> Tensor:
        """Samples of the network outputs ``f`` (before any link), shape (S, B, C).

        Raises:
            ValueError: For an unknown ``pred_type`` or a non-positive ``n_samples``, or GLM
                samples without ``diagonal_output=True`` where only output variances are
                computed.
        """
        pred_type = PredType(pred_type)
        check_positive_int(n_samples, "n_samples")
        check_generator(generator)
        self._check_fitted("functional_samples")
        reason = self._subset.variances_only_reason(self.n_outputs)
        if reason is not None and pred_type == PredType.GLM and not diagonal_output:
            raise ValueError(
                f"{reason}: GLM samples need diagonal_output=True (independent outputs), or "
                "use pred_type='nn', which samples the weights from the posterior."
            )
        x = prepare_inputs(x, self.dict_key_x, self._device, "functional_samples")
        if pred_type == PredType.NN:
            n_points = batch_size_of(x, self.dict_key_x)
            self._check_nn_prediction_memory(n_points, n_samples, grouped=False)
            return self._nn_functional_samples(x, n_samples, generator)
        f_mu, f_var = self._glm_predictive_distribution(x, diagonal_output=diagonal_output)
        layout = self._likelihood_model.layout(f_mu.shape)
        return layout.restore(
            gaussian_output_samples(layout.rows(f_mu), f_var, n_samples, generator)
        )

    def predictive_samples(
        self,
        x: Inputs,
        pred_type: PredType | str = PredType.GLM,
        n_samples: int = 100,
        diagonal_output: bool = False,
        generator: torch.Generator | None = None,
    ) -> Tensor:
        """Samples of the predictive: probabilities for classification, outputs for regression.

        Heteroscedastic regression draws ``y = μ + e^{s/2} ε`` per sampled output (the noise
        included); your own likelihood applies its ``inverse_link``.

        Returns:
            Samples, shape (S, B, C).
        """
        f = self.functional_samples(x, pred_type, n_samples, diagonal_output, generator)
        return self._likelihood_model.predictive_likelihood.predictive_sample(f, generator)

    def _nn_functional_samples(
        self,
        X: Inputs,
        n_samples: int = 100,
        generator: torch.Generator | None = None,
        **model_kwargs: Any,
    ) -> Tensor:
        """Outputs of ``n_samples`` networks with weights drawn from the posterior (S, B, C)."""
        thetas = self.sample(n_samples, generator)
        context = torch.enable_grad() if self.enable_backprop else torch.no_grad()
        with context:
            f = self._subset.forward_samples(thetas, X, **model_kwargs)
        check_outputs(f[0], batch_size_of(X, self.dict_key_x))
        return f

    def _nn_sample_groups(
        self,
        X: Inputs,
        n_samples: int,
        generator: torch.Generator | None = None,
        **model_kwargs: Any,
    ) -> Iterator[Tensor]:
        """Outputs of ``n_samples`` sampled networks, in groups (Sᵢ, B, C) of bounded memory.

        All samples form one group while their weights fit in
        ``memory_budgets.NN_SAMPLE_BYTES``; else the first group is one sample, and the later
        ones as many as the weights and outputs of one sample allow.
        """
        per_weights = self.n_params * self.mean.element_size()
        size = n_samples if n_samples * per_weights <= memory_budgets.NN_SAMPLE_BYTES else 1
        done = 0
        while done < n_samples:
            f = self._nn_functional_samples(
                X, min(size, n_samples - done), generator, **model_kwargs
            )
            done += len(f)
            yield f
            size = max(
                1,
                memory_budgets.NN_SAMPLE_BYTES // (per_weights + f[0].numel() * f.element_size()),
            )

    def _nn_predictive_samples(
        self,
        X: Inputs,
        n_samples: int = 100,
        generator: torch.Generator | None = None,
        **model_kwargs: Any,
    ) -> Tensor:
        """Predictive of ``n_samples`` sampled networks (S, B, C): probabilities or outputs.

        laplace-torch's hook, kept for code that calls it.
        """
        X = prepare_inputs(X, self.dict_key_x, self._device, "_nn_predictive_samples")
        f = self._nn_functional_samples(X, n_samples, generator, **model_kwargs)
        return self._likelihood_model.predictive_likelihood.predictive_sample(f, generator)


def _fitting_count(count: int, needed: Callable[[int], int], available: int, what: str) -> str:
    """``"at most k {what} fit"`` for the largest ``k < count`` with ``needed(k) ≤ available``.

    ``needed`` grows with its argument; ``"none fits"`` where not even one does.
    """
    fitting, step = 0, 1 << max(0, count.bit_length() - 1)
    while step:
        if fitting + step < count and needed(fitting + step) <= available:
            fitting += step
        step >>= 1
    return f"at most {fitting:,} {what} fit" if fitting else "none fits"
