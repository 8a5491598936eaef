"""Subset-of-data GP Laplace over all weights: ``FunctionalLaplace``.

Internal module; the public path is [`laplace.baselaplace`][laplace.baselaplace].
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TypeVar, cast

import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader

from laplace.core.base_laplace import BaseLaplace, arguments_for
from laplace.core.passes.data_loop import Gather
from laplace.core.serialization import StateDict
from laplace.curvature import CurvatureInterface
from laplace.curvature.engine.per_sample import PerSampleEngine
from laplace.functional.base_functional import BaseFunctionalLaplace, FunctionalState
from laplace.functional.kernel import CACHE_BYTES, KernelOptions, SubsetKernel
from laplace.functional.ntk import DenseJacobian, FactoredJacobian, trace_jacobian
from laplace.likelihoods import make_likelihood
from laplace.structures.memory_budgets import JACOBIAN_CHUNK_BYTES, jacobian_chunk_rows
from laplace.utils.data import Inputs, SoDSampler, dataset_size, slice_inputs, subset_loader
from laplace.utils.enums import (
    HessianStructure,
    Likelihood,
    LinkApprox,
    PredType,
    PriorStructure,
    SubsetOfWeights,
    TuningMethod,
)
from laplace.utils.errors import check_int_at_least, check_positive_int

__all__ = ["FunctionalLaplace"]


#: A subset-of-data GP Laplace (over all weights or the last layer).
S = TypeVar("S", bound="FunctionalLaplace")


@dataclass(frozen=True)
class SubsetGPState(FunctionalState[S]):
    """The state of a subset-of-data GP Laplace: its named attributes and the GP's factors.

    The named entries default to those of every subset-of-data GP Laplace.
    """

    plain: tuple[str, ...] = ("n_subset", "independent_outputs", "seed", "n_data", "temperature")
    tensors: tuple[str, ...] = ("prior_mean", "prior_precision", "sigma_noise")
    other_tensors: tuple[str, ...] = SubsetKernel.STATE_TENSORS
    counts: tuple[str, ...] = ("n_data", "n_subset")

    def value_keys(self, la: S) -> tuple[str, ...]:
        """The named attributes and the kernel's entries."""
        return (*super().value_keys(la), *SubsetKernel.STATE_KEYS)

    def values(self, la: S) -> StateDict:
        """The named attributes and the kernel's state."""
        return {**super().values(la), **cast(SubsetKernel, la._gp).state()}  # fitted

    def load(self, la: S, state_dict: StateDict) -> None:
        """Assign the named attributes and rebuild the kernel from its state."""
        super().load(la, state_dict)
        la.n_outputs = state_dict["Lambda"].shape[-1]
        la._gp = SubsetKernel.from_state(state_dict, la._device, la._dtype, **la._kernel_options())
        la.loss = la._gp.loss
        la._posterior_prior_precision = la.prior_precision.detach().clone()


class FunctionalLaplace(BaseFunctionalLaplace):
    r"""GP (function-space) Laplace on a random subset of ``M`` of the ``N`` training points.

    With the subset's kernel ``K = J Jᵀ`` scaled by ``s = (M/N)/δ``
    (``gp_kernel_prior_variance``) and ``Λ`` the diagonal output Hessians times ``1/(σ²T)``,
    ``f_* ~ N(f(x_*; θ*), sK_** − sK_*M (sK_MM + Λ⁻¹)⁻¹ sK_M*)``; see
    ``docs/function_space.md``.

    Arguments not listed are those of [`BaseLaplace`][laplace.core.base_laplace.BaseLaplace].

    Args:
        likelihood: ``"classification"`` or ``"regression"``.
        n_subset: Number ``M`` of training points in the subset (``1 ≤ M ≤ N``).
        prior_precision: Isotropic prior precision ``δ`` (a scalar).
        backend: Accepted for compatibility (laplace-torch defaults to ``BackPackGGN``); the
            Jacobians come from the library's per-sample engine, which all backends agree with.
        independent_outputs: Keep only the per-output diagonal of the kernel.
        seed: Seed of the subset's [`SoDSampler`][laplace.utils.utils.SoDSampler].

    Raises:
        ValueError: For reward modelling, a non-scalar prior precision, or a bad ``n_subset``.
    """

    _key = (SubsetOfWeights.ALL, HessianStructure.GP)
    _state_format = SubsetGPState()

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
        backend_kwargs: Mapping[str, object] | None = None,
        independent_outputs: bool = False,
        seed: int = 0,
        dtype: torch.dtype | None = None,
    ) -> None:
        if make_likelihood(likelihood).pairwise:
            raise ValueError(
                f"{type(self).__name__} does not support likelihood='reward_modeling'; use "
                "hessian_structure='kron' or 'diag', or functional_approximation='nystrom' "
                "(ELLA) or 'variational' (VaLLA)."
            )
        check_positive_int(n_subset, "n_subset")
        check_int_at_least(seed, "seed", 0)
        super().__init__(**arguments_for(BaseLaplace.__init__, locals()))
        self.n_subset = n_subset
        self.independent_outputs = independent_outputs
        self.seed = seed
        self.mean = self._subset.vector().detach() if self._subset.resolved else None
        #: The engine of ``_jacobians``, kept (with what it learnt of the model's calls) while
        #: the subset's parameters stay the same.
        self._jacobian_engine: PerSampleEngine | None = None
        #: The prior precision of the last prediction (or of ``fit``), for laplace-torch's warning
        #: that the GP posterior is recomputed after the prior changed.
        self._posterior_prior_precision: Tensor | None = None

    @property
    def gp_kernel_prior_variance(self) -> Tensor:
        """Scale ``s = (M/N)/δ`` of the kernel ``J Jᵀ``, shape (1,)."""
        self._check_fitted("gp_kernel_prior_variance")
        return (self.n_subset / self.n_data) / self.prior_precision

    # ---------------------------------------------------------------------------------- fit
    def _jacobians(
        self, X: Inputs, enable_backprop: bool = False
    ) -> tuple[DenseJacobian | FactoredJacobian, Tensor]:
        """Jacobian at ``X`` (factored where the layers allow) and outputs (B, C), one pass."""
        params, engine = self._subset.params, self._jacobian_engine
        if engine is None or [id(p) for p in engine.params] != [id(p) for p in params]:
            engine = self._jacobian_engine = PerSampleEngine(self.model, params)
            engine.dtype = self._dtype
        return trace_jacobian(engine, X, enable_backprop)

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
        subset = subset_loader(train_loader, SoDSampler(n_data, self.n_subset, self.seed).indices)
        X, y = self._data_loop(Gather, progress_bar=progress_bar, desc="fit").run(subset)
        self._start_fit(slice_inputs(X, 0, 1, self.n_subset), y)  # before any Jacobian
        self._check_fit_memory()
        self.n_data = n_data
        self._gp = SubsetKernel.build(
            X, y, self._likelihood_model, self.prior_mean - self.mean, **self._kernel_options()
        )
        self.loss = self._gp.loss
        noisy = self._likelihood_model.has_noise_hyperparameter
        if self.independent_outputs and noisy and self.n_outputs > 1:
            warnings.warn(  # laplace-torch's message
                "Using FunctionalLaplace with the diagonal approximation of a GP kernel is not "
                "recommended in the case of multivariate regression. Predictive variance will "
                "likely be overestimated.",
                stacklevel=2,
            )
        self._fitted = True
        self._posterior_prior_precision = self.prior_precision.detach().clone()

    def _checked_inputs(self, x: Inputs, what: str) -> Inputs:
        """As the base class's, with laplace-torch's warning after a change of the prior.

        Warns:
            UserWarning: laplace-torch's message, at the first prediction after the prior
                precision was changed (by assignment, or by a candidate of a grid search).
        """
        x = super()._checked_inputs(x, what)
        current = self.prior_precision.detach()
        if self._posterior_prior_precision is not None and not torch.equal(
            current, self._posterior_prior_precision
        ):
            warnings.warn(
                "The prior precision has changed since fit; recomputing the GP posterior.",
                stacklevel=3,
            )
        self._posterior_prior_precision = current.clone()
        return x

    def _kernel_bytes(self) -> int:
        """The subset kernel, (M·C)² numbers, or (C, M, M) with independent outputs."""
        M, C = self.n_subset, self.n_outputs
        numbers = C * M * M if self.independent_outputs else (M * C) ** 2
        return numbers * self.mean.element_size()

    def _fit_bytes(self, batch_size: int) -> int:
        """The subset's Jacobians (M, C, P), all held while the kernel is built, and the kernel.

        A last layer's Jacobians are its features (fewer numbers): counted as dense rows.
        """
        M, C, itemsize = self.n_subset, self.n_outputs, self.mean.element_size()
        return M * C * self.n_params * itemsize + self._kernel_bytes() + 3 * M * C * itemsize

    def _prediction_bytes(self, n_points: int, joint: bool) -> int:
        """Bytes of a prediction of ``n_points`` test points, from the shapes alone.

        The kernel, its Cholesky factor and the kept subset Jacobians (within ``CACHE_BYTES``);
        the test points' Jacobians and their kernel with the subset, twice (the solve), a chunk
        at a time unless ``joint``; and the moments.
        """
        M, C, itemsize = self.n_subset, self.n_outputs, self.mean.element_size()
        width = M if self.independent_outputs else M * C
        subset = min(M * C * self.n_params * itemsize, CACHE_BYTES)
        held = 2 * self._kernel_bytes() + subset + self._jacobian_chunk_bytes(M)
        rows = n_points * C
        test = rows * (self.n_params + 2 * width) * itemsize
        if not joint:
            test = min(test, 2 * JACOBIAN_CHUNK_BYTES)
        return held + test + self._moment_bytes(n_points, joint)

    def _kernel_scales(self) -> tuple[Tensor, Tensor]:
        """Kernel scale ``s`` and output-curvature factor ``h = 1/(σ²T)`` of predictions."""
        return self.gp_kernel_prior_variance, self._H_factor

    def _kernel_options(self) -> KernelOptions:
        """How ``SubsetKernel`` gets Jacobians of this approximation."""
        return {
            "independent": self.independent_outputs,
            "jacobians": self._jacobians,
            "chunk_rows": jacobian_chunk_rows(self.n_outputs, self.n_params, self._dtype),
            "dict_key_x": self.dict_key_x,
            "scales": self._kernel_scales,
        }

    # ---------------------------------------------------------------------- marginal lik.
    log_likelihood = BaseLaplace.log_likelihood

    @property
    def _noise_variance(self) -> Tensor | None:
        """``σ²`` for likelihoods with observation noise, else None."""
        noisy = self._likelihood_model.has_noise_hyperparameter
        return self.sigma_noise.square() if noisy else None

    @property
    def log_det_ratio(self) -> Tensor:
        """``log det(sK + σ²I)`` (regression) or ``log det(I + W sK W)``, ``W = √Λ``."""
        self._check_fitted("log_det_ratio")
        return self._gp.log_det_ratio(*self._kernel_scales(), self._noise_variance)

    @property
    def scatter(self) -> Tensor:
        """``μᵀ (sK + νI)⁻¹ μ`` with ``ν = σ²`` (regression) or ``1e-5`` (classification)."""
        self._check_fitted("scatter")
        return self._gp.scatter(self.gp_kernel_prior_variance, self._noise_variance)

    def log_marginal_likelihood(
        self, prior_precision: Tensor | None = None, sigma_noise: Tensor | None = None
    ) -> Tensor:
        """GP log marginal likelihood ``log p(D | θ*) − ½ (log_det_ratio + scatter)``.

        Differentiable in both hyperparameters; passing them replaces the stored values.

        Raises:
            RuntimeError: Before ``fit``.
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
        loss: object = None,
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
        """Tune the scalar prior precision; see ``BaseLaplace.optimize_prior_precision``.

        Raises:
            ValueError: For a ``pred_type`` other than ``"gp"`` or a non-scalar structure.
        """
        if PredType(pred_type) != PredType.GP:
            raise ValueError(f"{type(self).__name__} tunes with pred_type='gp'.")
        if PriorStructure(prior_structure) != "scalar":
            raise ValueError(f"{type(self).__name__} needs prior_structure='scalar'.")
        if TuningMethod(method) == TuningMethod.MARGLIK:
            warnings.warn(  # laplace-torch's message
                "Use of method='marglik' in case of FunctionalLaplace is discouraged, rather use "
                "method='CV'.",
                stacklevel=2,
            )
        tune = BaseLaplace.optimize_prior_precision
        tune(self, **arguments_for(tune, locals()))
        self._posterior_prior_precision = self.prior_precision.detach().clone()
