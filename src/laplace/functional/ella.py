r"""ELLA: linearised Laplace with a Nyström feature map (Deng et al., 2022).

The features ``φ(x) = J(x) V`` (C, K) on ``K`` orthonormal directions ``V`` of a data subset's
Jacobians define a GLM with posterior precision ``A = Σ φᵀ Λ φ/(σ²T) + δI`` over the training
data (see ``docs/function_space.md``).

Internal module; the public paths are ``laplace.baselaplace`` and ``laplace``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import TypeAlias, cast

import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader

from laplace.core.base_laplace import BaseLaplace, arguments_for
from laplace.core.transaction import preserve_model_gradients
from laplace.core.tuning import grid_candidates, search_grid
from laplace.curvature import CurvatureInterface
from laplace.functional.base_functional import BaseFunctionalLaplace, HistoryState, check_val_steps
from laplace.functional.nystrom import (
    NystromPosterior,
    dataset_labels,
    nystrom_basis,
    nystrom_features,
    nystrom_indices,
)
from laplace.structures import NotPositiveDefiniteError
from laplace.utils.data import Inputs, dataset_size, subset_loader
from laplace.utils.enums import (
    FunctionalApproximation,
    Likelihood,
    LinkApprox,
    PredType,
    PriorStructure,
    TuningMethod,
)
from laplace.utils.errors import check_finite_result, check_positive_int

__all__ = ["ELLA"]


#: A candidate of ``ELLA.optimize_hyperparameters``: a prior precision, or it and ``sigma_noise``.
Candidate: TypeAlias = float | Tensor | tuple[float | Tensor, float | Tensor]
#: The counts of ELLA's state (positive integers).
_COUNTS = ("subsample_size", "n_eigenvalues", "n_data", "n_outputs")


class ELLA(BaseFunctionalLaplace):
    """Linearised Laplace on a rank-``K`` Nyström approximation of the neural tangent kernel.

    The GLM posterior ``N(0, A⁻¹)`` over the features ``φ(x) = J(x) V`` (C, K); see
    ``docs/function_space.md``. ``fit`` runs three steps a subclass can override: ``_indices``
    (the training points spanning the basis), ``_build_basis`` (``V``) and ``_features``
    (``φ`` and the outputs, which the predictions use too).

    Arguments not listed are those of [`BaseLaplace`][laplace.core.base_laplace.BaseLaplace].

    Args:
        likelihood: ``"classification"``, ``"regression"`` or ``"reward_modeling"`` (fitted as
            classification on pairs (B, 2, ...) → logits (B, 2), predicting rewards (B, 1) of
            items (B, ...) as regression).
        subsample_size: Number ``M`` of training points defining the Nyström basis.
        n_eigenvalues: Rank ``K`` of the basis, ``1 ≤ K ≤ M``.
        prior_precision: Isotropic prior precision ``δ`` (a positive scalar).
        prior_mean: Must be 0.
        backend: Backend whose ``jacobians`` are used; ``CurvlinopsGGN`` when None.
        seed: Seed of the subset and of the output chosen per subset point.

    Attributes:
        dual_directions: ``V`` (P, K) after ``fit``.
        feature_gram: ``Σ φᵀ Λ φ`` (K, K), before the ``1/(σ²T)`` scaling.
        fit_history_: ``processed_examples``, ``val_nll`` and ``tuning`` records of the fit.

    Raises:
        ValueError: Unless ``0 < n_eigenvalues <= subsample_size``; for a non-scalar prior
            precision or a non-zero prior mean.
    """

    _function_space = FunctionalApproximation.NYSTROM
    _column_targets = True

    _state_format = HistoryState(
        plain=(*_COUNTS, "seed", "temperature"),
        tensors=("dual_directions", "feature_gram", "prior_precision", "sigma_noise"),
        counts=_COUNTS,
    )
    _centred_prior = "the Nyström prior is centred"

    def __init__(
        self,
        model: nn.Module,
        likelihood: Likelihood | str,
        subsample_size: int,
        n_eigenvalues: int,
        sigma_noise: float | Tensor = 1.0,
        prior_precision: float | Tensor = 1.0,
        prior_mean: float | Tensor = 0.0,
        temperature: float = 1.0,
        enable_backprop: bool = False,
        dict_key_x: str = "input_ids",
        dict_key_y: str = "labels",
        backend: type[CurvatureInterface] | None = None,
        backend_kwargs: Mapping[str, object] | None = None,
        seed: int = 1234,
        dtype: torch.dtype | None = None,
    ) -> None:
        try:
            check_positive_int(subsample_size, "subsample_size")
        except ValueError as error:  # ArgumentTypeError is a ValueError too
            raise type(error)(f"{error} ELLA needs 0 < n_eigenvalues <= subsample_size.") from None
        if check_positive_int(n_eigenvalues, "n_eigenvalues") > subsample_size:
            raise ValueError(
                "ELLA needs n_eigenvalues <= subsample_size, got "
                f"n_eigenvalues={n_eigenvalues!r}, subsample_size={subsample_size!r}."
            )
        super().__init__(**arguments_for(BaseLaplace.__init__, locals()))
        self.subsample_size, self.n_eigenvalues, self.seed = subsample_size, n_eigenvalues, seed
        self.dual_directions: Tensor | None = None
        self.feature_gram: Tensor | None = None
        self.fit_history_: dict[str, list[object]] = _empty_history()
        self._gp = NystromPosterior(self._features, self._nystrom_values)

    @property
    def chol_precision(self) -> Tensor | None:
        """Lower Cholesky factor of ``A = Σφᵀ Λ φ/(σ²T) + δI`` (K, K); None before fit."""
        return None if self.feature_gram is None else self._gp.gaussian.cholesky

    def _nystrom_values(self) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """``V``, ``Σ φᵀ Λ φ``, ``δ`` and ``h = 1/(σ²T)`` of the Nyström posterior."""
        return self.dual_directions, self.feature_gram, self.prior_precision, self._H_factor

    # ---------------------------------------------------------------------------------- fit
    @preserve_model_gradients
    def fit(
        self,
        train_loader: DataLoader,
        *,
        val_loader: DataLoader | None = None,
        val_steps: int | None = None,
        balanced: bool = False,
        progress_bar: bool = False,
    ) -> None:
        """Build the Nyström basis from a subset, then accumulate the projected GGN.

        Args:
            train_loader: Training batches ``(X, y)`` or dict-like.
            val_loader: Validation data whose predictive NLL is recorded in ``fit_history_``.
            val_steps: Record the validation NLL every ``val_steps`` batches (else at the end).
            balanced: Draw the subset round-robin over the classes (classification).
            progress_bar: Show a progress bar.

        Raises:
            ValueError: For a bad ``val_steps``, a subset larger than the data, a subset kernel
                of too low rank, or targets of the wrong shape.
        """
        check_val_steps(val_steps)
        dataset_size(train_loader)
        self.model.eval()
        self._fitted, self.n_data, self.fit_history_ = False, 0, _empty_history()
        likelihood = self._likelihood_model
        indices = self._indices(train_loader, balanced)
        output_shape = self._start_fit(*next(self._batches(subset_loader(train_loader, indices))))
        self._check_fit_memory()
        self._build_basis(train_loader, indices)
        for step, (X, y) in enumerate(self._batches(train_loader, progress_bar, "ELLA"), 1):
            y = self._fit_targets(y, output_shape)
            likelihood.check_targets(y, output_shape)
            phi, f = self._features(X)
            check_finite_result(f, "model output of a training batch")
            likelihood.prepare_targets(f, y)
            gram = check_finite_result(likelihood.ggn(phi, f), "GGN of a training batch")
            self.feature_gram = gram if step == 1 else cast(Tensor, self.feature_gram) + gram
            self.n_data += len(f)
            self.fit_history_["processed_examples"].append(float(self.n_data))
            self._record_validation(val_loader, val_steps, step)
        if self.n_data == 0:
            raise ValueError("train_loader is empty: fit needs at least one data point.")
        self._fitted = True
        self._record_validation(val_loader, val_steps, step, last=True)

    def _indices(self, loader: DataLoader, balanced: bool) -> Tensor:
        """Dataset indices (M,) of the training points whose Jacobians span the basis.

        ``M = subsample_size`` points drawn with ``seed`` among those the loader's sampler
        reaches (``laplace.utils.data.training_indices``), round-robin over the classes when
        ``balanced``.

        Raises:
            ValueError: For ``balanced`` without class labels (classification), or a loader
                reaching fewer than M points.
        """
        if balanced and not self._likelihood_model.fit_likelihood.predicts_probabilities:
            raise ValueError("balanced=True needs classification (it balances the classes).")
        labels = dataset_labels(loader, self.dict_key_x, self.dict_key_y) if balanced else None
        return nystrom_indices(loader, self.subsample_size, self.seed, labels)

    def _build_basis(self, loader: DataLoader, indices: Tensor) -> None:
        """Set ``dual_directions``: the ``nystrom_basis`` of the points ``indices`` of ``loader``.

        Raises:
            ValueError: If their kernel has fewer than ``n_eigenvalues`` positive eigenvalues.
        """
        inputs = (X for X, _ in self._batches(subset_loader(loader, indices)))
        V = nystrom_basis(inputs, self._jacobian_chunks, self.n_eigenvalues, self.seed)
        self.dual_directions = V.to(self._dtype)

    def _fit_bytes(self, batch_size: int) -> int:
        """Bytes of the Nyström basis and the projected GGN, from the settings alone.

        The subset's Jacobian rows (M, P) and their kernel (M, M) with its eigenvectors in
        float64, the basis ``V`` (P, K) in float64 and in the model's type, one chunk of
        Jacobians, and the feature Gram matrix (K, K).
        """
        M, K, P = self.subsample_size, self.n_eigenvalues, self.n_params
        float64 = (M * P + 2 * M * M + P * K) * 8
        return float64 + self._nystrom_held_bytes() + self._jacobian_chunk_bytes(M)

    def _nystrom_held_bytes(self) -> int:
        """The basis ``V`` (P, K) and the Gaussian over the features (two (K, K))."""
        K = self.n_eigenvalues
        return (self.n_params * K + 2 * K * K) * self.mean.element_size()

    def _prediction_bytes(self, n_points: int, joint: bool) -> int:
        """The basis and the Gaussian, one chunk of Jacobians, the features (B, C, K), moments."""
        features = n_points * self.n_outputs * self.n_eigenvalues * self.mean.element_size()
        return (
            self._nystrom_held_bytes()
            + self._jacobian_chunk_bytes(n_points)
            + features
            + self._moment_bytes(n_points, joint)
        )

    def _features(self, X: Inputs, create_graph: bool = False) -> tuple[Tensor, Tensor]:
        """The features ``φ(x) = J(x) V`` (B, C, K) and the outputs (B, C) at ``X``."""
        return nystrom_features(self._jacobian_chunks, self.dual_directions, X, create_graph)

    # ------------------------------------------------------------------------------ tuning
    def optimize_prior_precision(
        self,
        pred_type: PredType | str = PredType.GP,
        method: TuningMethod | str = TuningMethod.GRIDSEARCH,
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
    ) -> None:
        """Grid search of the scalar prior precision by validation NLL (as laplace-torch).

        The grid is ``logspace(log_prior_prec_min, log_prior_prec_max, grid_size)``; the other
        arguments exist for interface compatibility and only their defaults are accepted.

        Raises:
            RuntimeError: Before ``fit``.
            ValueError: For ``pred_type`` other than ``"gp"``, no ``val_loader``, a bad grid size.
            NotImplementedError: For ``method="marglik"`` or non-default compatibility arguments.
        """
        self._check_fitted("optimize_prior_precision")
        if PredType(pred_type) != PredType.GP:
            raise ValueError("ELLA tunes with pred_type='gp'.")
        if TuningMethod(method) != TuningMethod.GRIDSEARCH:
            raise NotImplementedError(
                "ELLA has no marginal likelihood; use method='gridsearch' with a val_loader."
            )
        init = torch.as_tensor(init_prior_prec)
        if (
            (n_steps, lr, loss) != (100, 1e-1, None)
            or init.numel() != 1
            or float(init) != 1.0
            or PriorStructure(prior_structure) != "scalar"
            or LinkApprox(link_approx) != LinkApprox.PROBIT
            or (n_samples, verbose, progress_bar) != (100, False, False)
        ):
            raise NotImplementedError(
                "ELLA's grid search scores the validation NLL with a scalar prior and the "
                "probit link; only the grid arguments can be changed."
            )
        if val_loader is None:
            raise ValueError("method='gridsearch' needs a val_loader with validation data.")
        bounds = (log_prior_prec_min, log_prior_prec_max, grid_size, 10.0)
        grid = grid_candidates(*bounds, "cpu", torch.get_default_dtype())  # as laplace-torch
        self.optimize_hyperparameters(val_loader, grid)

    def optimize_hyperparameters(self, val_loader: DataLoader, grid: Iterable[Candidate]) -> None:
        """Set the candidate of ``grid`` with the lowest validation NLL.

        Candidates are prior precisions or ``(prior_precision, sigma_noise)`` pairs (regression);
        the first with the lowest finite score wins (``laplace.core.tuning.search_grid``); a
        candidate whose posterior cannot be factorised scores NaN. One record per candidate
        (``prior_precision``, ``sigma_noise``, ``val_nll``) is appended to
        ``fit_history_["tuning"]``.

        Raises:
            RuntimeError: Before ``fit``.
            ValueError: For an empty grid, or if no candidate has a finite score (the
                hyperparameters are then restored).
        """
        self._check_fitted("optimize_hyperparameters")
        initial, records = (self.prior_precision, self.sigma_noise), []

        def apply(candidate: Candidate) -> None:
            if isinstance(candidate, (tuple, list)):
                self.prior_precision, self.sigma_noise = candidate
            else:
                self.prior_precision = candidate

        def scored(candidate: Candidate) -> float:
            apply(candidate)
            try:
                value = float(self._validation_nll(val_loader))
            except (NotPositiveDefiniteError, torch.linalg.LinAlgError):
                value = math.nan
            prior_precision, sigma_noise = float(self.prior_precision), float(self.sigma_noise)
            records.append(
                {"prior_precision": prior_precision, "sigma_noise": sigma_noise, "val_nll": value}
            )
            return value

        best = search_grid(grid, scored)[0]
        if best is None:
            self.prior_precision, self.sigma_noise = initial
            if not records:
                raise ValueError("the hyperparameter grid is empty.")
            raise ValueError(
                "No finite validation NLL: no candidate of the grid gives a finite one."
            )
        apply(best)
        self.fit_history_["tuning"].extend(records)


def _empty_history() -> dict[str, list[object]]:
    return {"processed_examples": [], "val_nll": [], "tuning": []}
