r"""Subset-of-data GP Laplace over all weights: ``FunctionalLaplace``.

Internal module; the public path is :mod:`laplace.baselaplace`.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader

from laplace.base import BaseLaplace, arguments_for
from laplace.curvature import CurvatureInterface
from laplace.data import Inputs, batch_size_of, dataset_size
from laplace.errors import check_int_at_least
from laplace.functional.base import BaseFunctionalLaplace
from laplace.functional.kernel import SubsetKernel
from laplace.glm import slice_inputs
from laplace.priors import as_scalar_prior_precision, check_temperature
from laplace.serialization import check_state_dict
from laplace.utils.enums import (
    Likelihood,
    LinkApprox,
    PredType,
    PriorStructure,
    TuningMethod,
    parse_enum,
)
from laplace.utils.functional_utils import concatenate_rows
from laplace.utils.utils import SoDSampler

__all__ = ["FunctionalLaplace"]

#: Entries of a state and those holding floating-point tensors.
FUNCTIONAL_KEYS = (
    "cls_name",
    "likelihood",
    "mean",
    "n_subset",
    "independent_outputs",
    "seed",
    "n_data",
    "prior_mean",
    "prior_precision",
    "sigma_noise",
    "temperature",
    "X_subset",
    "K_MM",
    "Lambda",
    "mu",
    "loss",
)
FUNCTIONAL_TENSORS = (
    "mean",
    "prior_mean",
    "prior_precision",
    "sigma_noise",
    "K_MM",
    "Lambda",
    "mu",
    "loss",
)


class FunctionalLaplace(BaseFunctionalLaplace):
    r"""GP (function-space) Laplace on a random subset of ``M`` of the ``N`` training points.

    With Jacobians ``J_M`` (M·C, P) of the subset, an isotropic prior precision ``δ`` and the
    kernel ``K = J Jᵀ`` scaled by ``s = (M/N)/δ`` (:attr:`gp_kernel_prior_variance`), the GP
    posterior over the outputs at test points ``*`` is

    .. math::
        f_* \sim \mathcal{N}\big(f(x_*; θ^*),\; sK_{**} - sK_{*M}(sK_{MM} + Λ_{MM}^{-1})^{-1}
        sK_{M*}\big),

    with ``Λ_MM`` the diagonal of the output Hessians of the log-likelihood times ``1/(σ²T)``
    (classification keeps only the diagonal of ``diag(p) − ppᵀ``, as laplace-torch does). When
    ``M = N`` and the likelihood is Gaussian this is exactly the GLM predictive of
    :class:`~laplace.baselaplace.FullLaplace` (Woodbury identity). With
    ``independent_outputs=True`` only the diagonal ``C×C`` blocks of the kernel are kept (one
    independent GP per output).

    Args:
        model: The trained network.
        likelihood: ``"classification"`` or ``"regression"``.
        n_subset: Number ``M`` of training points in the subset (``1 ≤ M ≤ N``).
        sigma_noise: See :class:`~laplace.base.BaseLaplace`.
        prior_precision: Isotropic prior precision ``δ`` (a scalar).
        prior_mean: See :class:`~laplace.base.BaseLaplace`.
        temperature: See :class:`~laplace.base.BaseLaplace`.
        enable_backprop: See :class:`~laplace.base.BaseLaplace`.
        dict_key_x: See :class:`~laplace.base.BaseLaplace`.
        dict_key_y: See :class:`~laplace.base.BaseLaplace`.
        backend: Backend whose ``jacobians`` are used; ``CurvlinopsGGN`` when None
            (laplace-torch defaults to ``BackPackGGN``; all backends give the same Jacobians).
        backend_kwargs: See :class:`~laplace.base.BaseLaplace`.
        independent_outputs: Keep only the per-output diagonal of the kernel.
        seed: Seed of the subset's :class:`~laplace.utils.utils.SoDSampler`.

    Raises:
        ValueError: For reward modelling, a non-scalar prior precision, or a bad ``n_subset``.
    """

    _key = ("all", "gp")

    def __init__(
        self,
        model: nn.Module,
        likelihood: Likelihood | str,
        n_subset: int,
        sigma_noise: float | Tensor = 1.0,
        prior_precision: float | Tensor = 1.0,
        prior_mean: float | Tensor = 0.0,
        temperature: float = 1.0,
        enable_backprop: bool = False,
        dict_key_x: str = "input_ids",
        dict_key_y: str = "labels",
        backend: type[CurvatureInterface] | None = None,
        backend_kwargs: dict[str, Any] | None = None,
        independent_outputs: bool = False,
        seed: int = 0,
    ) -> None:
        if parse_enum(Likelihood, likelihood, "likelihood") == Likelihood.REWARD_MODELING:
            raise ValueError(
                f"{type(self).__name__} does not support likelihood='reward_modeling'; use "
                "hessian_structure='kron' or 'diag', or functional_approximation='nystrom' "
                "(ELLA) or 'variational' (VaLLA)."
            )
        if isinstance(n_subset, bool) or not isinstance(n_subset, int) or n_subset < 1:
            raise ValueError(f"n_subset must be a positive integer, got {n_subset!r}.")
        check_int_at_least(seed, "seed", 0)
        super().__init__(**arguments_for(BaseLaplace.__init__, locals()))
        self.n_subset = n_subset
        self.independent_outputs = independent_outputs
        self.seed = seed
        self.mean = self._subset.vector().detach() if self._subset.resolved else None
        self._kernel: SubsetKernel | None = None
        self._fitted = False

    # ------------------------------------------------------------------------ hyperparameters
    @property
    def prior_precision(self) -> Tensor:
        """Isotropic prior precision ``δ``, shape (1,)."""
        return self._prior_precision

    @prior_precision.setter
    def prior_precision(self, value: float | Tensor) -> None:
        self._prior_precision = as_scalar_prior_precision(
            value, type(self).__name__, self._device, self._dtype
        )

    @property
    def gp_kernel_prior_variance(self) -> Tensor:
        """Scale ``s = (M/N)/δ`` of the kernel ``J Jᵀ``, shape (1,)."""
        self._check_fitted("gp_kernel_prior_variance")
        return (self.n_subset / self.n_data) / self.prior_precision

    # ---------------------------------------------------------------------------------- fit
    def _resolve_subset(self, train_loader: DataLoader) -> None:
        """Make sure the parameters are known before fitting (all weights: always)."""

    def _jacobians(self, X: Inputs, enable_backprop: bool = False) -> tuple[Tensor, Tensor]:
        """Jacobians (B, C, P) and outputs (B, C) at the MAP."""
        Js, f = self.backend.jacobians(X, enable_backprop=enable_backprop)
        return (Js, f) if enable_backprop else (Js.detach(), f.detach())

    def fit(self, train_loader: DataLoader, progress_bar: bool = False) -> None:
        """Draw the data subset and build its kernel, output curvature and scatter terms.

        Args:
            train_loader: Batches ``(X, y)`` or dict-like; ``len(train_loader.dataset)`` is N.
            progress_bar: Show a progress bar over the subset's batches.

        Raises:
            ValueError: If ``n_subset`` exceeds N or the data is empty.
        """
        n_data = dataset_size(train_loader)
        if n_data == 0:
            raise ValueError("train_loader is empty: fit needs at least one data point.")
        if self.n_subset > n_data:
            raise ValueError(
                f"n_subset={self.n_subset} is larger than the training set (N={n_data})."
            )
        self._resolve_subset(train_loader)
        self.model.eval()
        self.mean = self._subset.vector().detach()
        subset_loader = DataLoader(
            train_loader.dataset,
            batch_size=train_loader.batch_size or 1,
            sampler=SoDSampler(n_data, self.n_subset, self.seed),
            collate_fn=train_loader.collate_fn,
        )
        inputs, targets = [], []
        for X, y in self._batches(subset_loader, progress_bar, desc="fit"):
            inputs.append(X)
            targets.append(y)
        self.n_data = n_data
        self._kernel = SubsetKernel.build(
            self, concatenate_rows(inputs), torch.cat(targets), self.independent_outputs
        )
        self.n_outputs = self._kernel.n_outputs
        self.loss = self._kernel.loss
        if self.likelihood == Likelihood.REGRESSION and self.n_outputs > 1:  # noqa: SIM102
            if self.independent_outputs:
                warnings.warn(
                    "independent_outputs=True with multi-output regression drops the "
                    "covariance between outputs; the predictive variance is likely too large.",
                    stacklevel=2,
                )
        self._fitted = True

    # --------------------------------------------------------------------------- predictive
    def _latent_moments(self, X: Inputs, joint: bool) -> tuple[Tensor, Tensor]:
        kernel = self._kernel
        if joint:
            return kernel.joint_moments(X)
        n = batch_size_of(X, self.dict_key_x)
        step = kernel.test_chunk_rows()
        means, variances = [], []
        for start in range(0, n, step):
            f_mu, f_var = kernel.moments(slice_inputs(X, start, start + step, n))
            means.append(f_mu)
            variances.append(f_var)
        return torch.cat(means), torch.cat(variances)

    def functional_variance(self, Js_star: Tensor) -> Tensor:
        """GP posterior output covariances from test Jacobians: (B, C, P) → (B, C, C)."""
        self._check_fitted("functional_variance")
        return self._kernel.variance_from_jacobians(Js_star, joint=False)

    def functional_covariance(self, Js_star: Tensor) -> Tensor:
        """Joint GP posterior covariance from test Jacobians: (B, C, P) → (B·C, B·C)."""
        self._check_fitted("functional_covariance")
        return self._kernel.variance_from_jacobians(Js_star, joint=True)

    # ---------------------------------------------------------------------- marginal lik.
    @property
    def log_det_ratio(self) -> Tensor:
        """``log det(sK + σ²I)`` (regression) or ``log det(I + W sK W)``, ``W = √Λ``."""
        self._check_fitted("log_det_ratio")
        return self._kernel.log_det_ratio()

    @property
    def scatter(self) -> Tensor:
        """``μᵀ (sK + νI)⁻¹ μ`` with ``ν = σ²`` (regression) or ``1e-5`` (classification)."""
        self._check_fitted("scatter")
        return self._kernel.scatter()

    def log_marginal_likelihood(
        self, prior_precision: Tensor | None = None, sigma_noise: Tensor | None = None
    ) -> Tensor:
        """GP log marginal likelihood ``log p(D | θ*) − ½ (log_det_ratio + scatter)``.

        Differentiable in both hyperparameters; passing them replaces the stored values.

        Raises:
            RuntimeError: Before :meth:`fit`.
            ValueError: For ``sigma_noise`` with a likelihood other than regression.
        """
        self._check_fitted("log_marginal_likelihood")
        if prior_precision is not None:
            self.prior_precision = prior_precision
        if sigma_noise is not None:
            self.sigma_noise = sigma_noise
        return self.log_likelihood - 0.5 * (self.log_det_ratio + self.scatter)

    def optimize_prior_precision(
        self,
        pred_type: PredType | str = PredType.GP,
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
        """Tune the scalar prior precision; see :meth:`BaseLaplace.optimize_prior_precision`.

        Raises:
            ValueError: For a ``pred_type`` other than ``"gp"`` or a non-scalar structure.
        """
        if parse_enum(PredType, pred_type, "pred_type") != PredType.GP:
            raise ValueError(f"{type(self).__name__} tunes with pred_type='gp'.")
        if parse_enum(PriorStructure, prior_structure, "prior_structure") != "scalar":
            raise ValueError(f"{type(self).__name__} needs prior_structure='scalar'.")
        if parse_enum(TuningMethod, method, "method") == TuningMethod.MARGLIK:
            warnings.warn(
                "the subset-of-data GP marginal likelihood is a rough proxy; "
                "method='gridsearch' with a val_loader is usually better.",
                stacklevel=2,
            )
        BaseLaplace.optimize_prior_precision(
            self,
            pred_type,
            method,
            n_steps,
            lr,
            init_prior_prec,
            prior_structure,
            val_loader,
            loss,
            log_prior_prec_min,
            log_prior_prec_max,
            grid_size,
            link_approx,
            n_samples,
            verbose,
            progress_bar,
            log_prior_prec_base,
        )

    # -------------------------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        """Tensors and plain values: the subset's inputs, kernel and fit terms, hyperparameters.

        Loadable with ``torch.load(..., weights_only=True)``.
        """
        self._check_fitted("state_dict")
        return {
            "cls_name": type(self).__name__,
            "likelihood": self.likelihood.value,
            "mean": self.mean,
            "n_subset": self.n_subset,
            "independent_outputs": self.independent_outputs,
            "seed": self.seed,
            "n_data": self.n_data,
            "prior_mean": self.prior_mean.detach(),
            "prior_precision": self.prior_precision.detach(),
            "sigma_noise": self.sigma_noise.detach(),
            "temperature": self.temperature,
            **self._kernel.state(),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore a state saved by :meth:`state_dict` for the same model and options.

        Raises:
            ValueError: For another class, likelihood, or model weights, or a state
                :meth:`state_dict` cannot have written (see
                :func:`~laplace.serialization.check_state_dict`).
        """
        check_state_dict(
            state_dict, self._state_keys(), FUNCTIONAL_TENSORS, ("n_data", "n_subset")
        )
        if state_dict.get("cls_name") != type(self).__name__:
            raise ValueError(
                f"state_dict was saved by {state_dict.get('cls_name')!r}, not "
                f"{type(self).__name__!r}."
            )
        if state_dict["likelihood"] != self.likelihood.value:
            raise ValueError(
                f"state_dict was saved for likelihood={state_dict['likelihood']!r}, this "
                f"approximation uses {self.likelihood.value!r}."
            )
        self._restore_subset(state_dict)
        mean = state_dict["mean"].to(self._device, self._dtype)
        current = self._subset.vector().detach()
        if mean.shape != current.shape or not torch.allclose(mean, current, atol=1e-6):
            raise ValueError("the model's weights are not the MAP weights the state was saved at.")
        self.mean = mean
        self.n_subset = state_dict["n_subset"]
        self.independent_outputs = state_dict["independent_outputs"]
        self.seed = state_dict["seed"]
        self.n_data = state_dict["n_data"]
        self.prior_mean = state_dict["prior_mean"]
        self.prior_precision = state_dict["prior_precision"]
        self.sigma_noise = state_dict["sigma_noise"]
        self.temperature = check_temperature(state_dict["temperature"])
        self._kernel = SubsetKernel.from_state(self, state_dict)
        self.n_outputs, self.loss = self._kernel.n_outputs, self._kernel.loss
        self._fitted = True

    def _restore_subset(self, state_dict: dict[str, Any]) -> None:
        """Make the parameters known before loading (all weights: always)."""

    def _state_keys(self) -> tuple[str, ...]:
        """The entries :meth:`state_dict` writes."""
        return FUNCTIONAL_KEYS
