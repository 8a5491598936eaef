r"""ELLA: linearised Laplace with a Nyström feature map (Deng et al., 2022).

Internal module; the public paths are :mod:`laplace.baselaplace` and :mod:`laplace`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader

from laplace.base import BaseLaplace, arguments_for
from laplace.curvature import CurvatureInterface
from laplace.data import Inputs, check_outputs, dataset_size, prepare_batch
from laplace.errors import UnsupportedError, check_finite_result
from laplace.functional.base import BaseFunctionalLaplace
from laplace.functional.nystrom import nystrom_basis, nystrom_indices
from laplace.functional.scoring import (
    check_state,
    grid_search,
    jacobian_chunks,
    positive_int,
    validation_nll,
)
from laplace.priors import as_scalar_prior_precision
from laplace.utils.enums import (
    Likelihood,
    LinkApprox,
    PredType,
    PriorStructure,
    TuningMethod,
    parse_enum,
)
from laplace.utils.functional_utils import (
    preserve_model_gradients,
    regression_targets,
    subset_loader,
)

__all__ = ["ELLA"]


class ELLA(BaseFunctionalLaplace):
    r"""Linearised Laplace on a rank-``K`` Nyström approximation of the neural tangent kernel.

    ``fit`` draws ``M = subsample_size`` training points (seeded) and one output per point, and
    stacks their Jacobians into ``J_M`` (M, P). With the eigenpairs ``(λ_k, u_k)`` of the
    ``K = n_eigenvalues`` largest eigenvalues of ``J_M J_Mᵀ``, the columns of

    .. math::
        V = J_M^\top U_K Λ_K^{-1/2} \in \mathbb{R}^{P \times K}

    are orthonormal and span the top-``K`` part of the subset's Jacobian row space. The
    features ``φ(x) = J(x) V`` (C, K) define a GLM with prior ``N(0, δ⁻¹ I_K)``; its posterior
    precision accumulates the GGN over the whole training loader,

    .. math::
        A = \frac{1}{σ^2 T} \sum_n φ(x_n)^\top Λ_n φ(x_n) + δ I_K, \qquad
        f_* \sim \mathcal{N}\big(f(x_*; θ^*),\; φ(x_*) A^{-1} φ(x_*)^\top\big),

    with ``Λ_n`` the output Hessian of the loss (``I`` for regression, ``diag(p) − ppᵀ`` for
    classification). When ``V`` spans the whole Jacobian row space of the training data (e.g.
    ``M = N``, ``K`` = its rank, one output), this is the GLM predictive of
    :class:`~laplace.baselaplace.FullLaplace` at the training inputs, and everywhere when that
    rank is ``P``.

    Jacobians are computed in chunks of at most :data:`~laplace.glm.JACOBIAN_CHUNK_BYTES`; only
    the subset's selected rows (M, P) and the projection ``V`` are stored.

    Args:
        model: The trained network.
        likelihood: ``"classification"``, ``"regression"`` or ``"reward_modeling"`` (fitted as
            classification on pairs (B, 2, ...) → logits (B, 2), predicting rewards (B, 1) of
            items (B, ...) as regression).
        subsample_size: Number ``M`` of training points defining the Nyström basis.
        n_eigenvalues: Rank ``K`` of the basis, ``1 ≤ K ≤ M``.
        sigma_noise: Observation noise σ (regression).
        prior_precision: Isotropic prior precision ``δ`` (a positive scalar).
        prior_mean: Must be 0.
        temperature: Likelihood temperature T.
        enable_backprop: Keep predictives differentiable w.r.t. the inputs.
        dict_key_x: Key of the inputs in dict-like batches.
        dict_key_y: Key of the targets in dict-like batches.
        backend: Backend whose ``jacobians`` are used; ``CurvlinopsGGN`` when None.
        backend_kwargs: Keyword arguments of the backend.
        seed: Seed of the subset and of the output chosen per subset point.

    Attributes:
        dual_directions: ``V`` (P, K) after :meth:`fit`.
        feature_gram: ``Σ φᵀ Λ φ`` (K, K), before the ``1/(σ²T)`` scaling.
        fit_history_: ``processed_examples``, ``val_nll`` and ``tuning`` records of the fit.

    Raises:
        ValueError: Unless ``0 < n_eigenvalues <= subsample_size``; for a non-scalar prior
            precision or a non-zero prior mean.

    Example:
        >>> la = Laplace(model, "regression", "all", "gp", functional_approximation="nystrom",
        ...              subsample_size=100, n_eigenvalues=20)  # doctest: +SKIP
        >>> la.fit(train_loader); f_mu, f_var = la(x)  # doctest: +SKIP
    """

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
        backend_kwargs: dict[str, Any] | None = None,
        seed: int = 1234,
    ) -> None:
        if not (
            positive_int(subsample_size)
            and positive_int(n_eigenvalues)
            and n_eigenvalues <= subsample_size
        ):
            raise ValueError(
                "ELLA needs integers 0 < n_eigenvalues <= subsample_size, got "
                f"n_eigenvalues={n_eigenvalues!r}, subsample_size={subsample_size!r}."
            )
        super().__init__(**arguments_for(BaseLaplace.__init__, locals()))
        if bool((self.prior_mean != 0).any()):
            raise ValueError("ELLA needs prior_mean=0 (the Nyström prior is centred).")
        self.subsample_size, self.n_eigenvalues, self.seed = subsample_size, n_eigenvalues, seed
        self.dual_directions: Tensor | None = None
        self.feature_gram: Tensor | None = None
        self.fit_history_: dict[str, list[Any]] = _empty_history()
        self._factor_key: tuple | None = None
        self._factor: Tensor | None = None

    @property
    def prior_precision(self) -> Tensor:
        """Isotropic prior precision ``δ``, shape (1,)."""
        return self._prior_precision

    @prior_precision.setter
    def prior_precision(self, value: float | Tensor) -> None:
        tensor = as_scalar_prior_precision(value, "ELLA", self._device, self._dtype)
        self._prior_precision = tensor.detach()

    # ------------------------------------------------------------------------------- features
    def _features(self, X: Inputs, enable_backprop: bool = False) -> tuple[Tensor, Tensor]:
        """Features ``φ = J V`` (B, C, K) and outputs (B, C)."""
        feats, outs = [], []
        for Js, f in jacobian_chunks(self, X, enable_backprop):
            feats.append(Js @ self.dual_directions)
            outs.append(f)
        return torch.cat(feats), torch.cat(outs)

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
        if val_steps is not None and not positive_int(val_steps):
            raise ValueError(f"val_steps must be a positive integer, got {val_steps!r}.")
        dataset_size(train_loader)
        self.model.eval()
        self._fitted, self.n_data, self.fit_history_ = False, 0, _empty_history()
        indices = nystrom_indices(self, train_loader, balanced)[: self.subsample_size]
        first = next(iter(subset_loader(train_loader, indices[:1])))
        X0, y0 = prepare_batch(first, self.dict_key_x, self.dict_key_y, self._device)
        with torch.no_grad():
            output_shape = check_outputs(self.model(X0), 1).shape
        self._likelihood_model.check_targets(y0, output_shape)
        self.n_outputs = output_shape[-1]
        self.mean = self._subset.vector().detach()
        self.dual_directions = nystrom_basis(self, train_loader, indices)
        K = self.n_eigenvalues
        self.feature_gram = torch.zeros(K, K, dtype=self._dtype, device=self._device)
        step = 0
        for step, (X, y) in enumerate(self._batches(train_loader, progress_bar, "ELLA"), 1):
            self._likelihood_model.check_targets(y, output_shape)
            features, f = self._features(X)
            check_finite_result(f, "model output of a training batch")
            if self.likelihood == Likelihood.REGRESSION:
                regression_targets(y, f)
                self.feature_gram += torch.einsum("bck,bcl->kl", features, features)
            else:
                Lam = self._likelihood_model.output_hessian(f)
                self.feature_gram += torch.einsum("bck,bcd,bdl->kl", features, Lam, features)
            self.n_data += len(f)
            self.fit_history_["processed_examples"].append(float(self.n_data))
            if val_loader is not None and val_steps and step % val_steps == 0:
                self._fitted = True
                self.fit_history_["val_nll"].append(float(validation_nll(self, val_loader)))
        if self.n_data == 0:
            raise ValueError("train_loader is empty: fit needs at least one data point.")
        self._fitted = True
        if val_loader is not None and (not val_steps or step % val_steps):
            self.fit_history_["val_nll"].append(float(validation_nll(self, val_loader)))

    # --------------------------------------------------------------------------- posterior
    @property
    def chol_precision(self) -> Tensor | None:
        """Lower Cholesky factor of ``A = Σφᵀ Λ φ/(σ²T) + δI`` (K, K); None before fit."""
        if self.feature_gram is None:
            return None
        key = (float(self.prior_precision), float(self.sigma_noise), self.temperature)
        if key != self._factor_key:
            eye = torch.eye(self.n_eigenvalues, dtype=self._dtype, device=self._device)
            A = self._H_factor.detach() * self.feature_gram + self.prior_precision * eye
            self._factor_key, self._factor = key, torch.linalg.cholesky(A)
        return self._factor

    def _feature_covariance(self, features: Tensor, joint: bool) -> Tensor:
        L = self.chol_precision
        if joint:
            flat = features.reshape(-1, self.n_eigenvalues)
            return flat @ torch.cholesky_solve(flat.T, L)
        return features @ torch.cholesky_solve(features.transpose(1, 2), L)

    def _latent_moments(self, X: Inputs, joint: bool) -> tuple[Tensor, Tensor]:
        features, f = self._features(X, self.enable_backprop)
        cov = self._feature_covariance(features, joint)
        return (f.reshape(-1) if joint else f), cov

    def functional_variance(self, Js: Tensor) -> Tensor:
        """Posterior output covariances from Jacobians: (B, C, P) → (B, C, C)."""
        self._check_fitted("functional_variance")
        return self._feature_covariance(Js @ self.dual_directions, joint=False)

    def functional_covariance(self, Js: Tensor) -> Tensor:
        """Joint posterior covariance from Jacobians: (B, C, P) → (B·C, B·C)."""
        self._check_fitted("functional_covariance")
        return self._feature_covariance(Js @ self.dual_directions, joint=True)

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
        loss: Any = None,
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
            RuntimeError: Before :meth:`fit`.
            ValueError: For ``pred_type`` other than ``"gp"``, no ``val_loader``, a bad grid size.
            NotImplementedError: For ``method="marglik"`` or non-default compatibility arguments.
        """
        self._check_fitted("optimize_prior_precision")
        if parse_enum(PredType, pred_type, "pred_type") != PredType.GP:
            raise ValueError("ELLA tunes with pred_type='gp'.")
        if parse_enum(TuningMethod, method, "method") != TuningMethod.GRIDSEARCH:
            raise NotImplementedError(
                "ELLA has no marginal likelihood; use method='gridsearch' with a val_loader."
            )
        defaults = (n_steps, lr, float(torch.as_tensor(init_prior_prec).reshape(-1)[0]), loss)
        if (
            defaults != (100, 1e-1, 1.0, None)
            or torch.as_tensor(init_prior_prec).numel() != 1
            or parse_enum(PriorStructure, prior_structure, "prior_structure") != "scalar"
            or parse_enum(LinkApprox, link_approx, "link_approx") != LinkApprox.PROBIT
            or (n_samples, verbose, progress_bar) != (100, False, False)
        ):
            raise NotImplementedError(
                "ELLA's grid search scores the validation NLL with a scalar prior and the "
                "probit link; only the grid arguments can be changed."
            )
        if val_loader is None:
            raise ValueError("method='gridsearch' needs a val_loader with validation data.")
        if not positive_int(grid_size):
            raise ValueError(f"grid_size must be a positive integer, got {grid_size!r}.")
        grid = torch.logspace(log_prior_prec_min, log_prior_prec_max, grid_size)
        self.optimize_hyperparameters(val_loader, grid)

    def optimize_hyperparameters(self, val_loader: DataLoader, grid: Any) -> None:
        """Set the candidate of ``grid`` with the lowest validation NLL.

        Candidates are prior precisions or ``(prior_precision, sigma_noise)`` pairs; the scores
        are appended to ``fit_history_["tuning"]``.
        """
        self._check_fitted("optimize_hyperparameters")
        self.fit_history_["tuning"].extend(grid_search(self, val_loader, grid))

    def log_marginal_likelihood(self, *args: Any, **kwargs: Any) -> Tensor:
        """Not defined for ELLA (as in laplace-torch): tune by validation grid search."""
        raise NotImplementedError(
            "ELLA has no marginal likelihood; use optimize_prior_precision(method='gridsearch')."
        )

    @property
    def log_likelihood(self) -> Tensor:
        """Not tracked by ELLA (as in laplace-torch)."""
        raise UnsupportedError("ELLA does not accumulate the training log-likelihood.")

    # -------------------------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        """Tensors and plain values, loadable with ``weights_only=True``.

        Holds the basis, the curvature, the hyperparameters, the fit history and the MAP
        weights (checked when loading).
        """
        self._check_fitted("state_dict")
        return {
            "cls_name": type(self).__name__,
            "likelihood": self.likelihood.value,
            "mean": self.mean,
            "subsample_size": self.subsample_size,
            "n_eigenvalues": self.n_eigenvalues,
            "seed": self.seed,
            "dual_directions": self.dual_directions.detach(),
            "feature_gram": self.feature_gram.detach(),
            "prior_precision": self.prior_precision.detach(),
            "sigma_noise": self.sigma_noise.detach(),
            "temperature": self.temperature,
            "n_data": self.n_data,
            "n_outputs": self.n_outputs,
            "fit_history": {k: list(v) for k, v in self.fit_history_.items()},
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore a state saved by :meth:`state_dict` for the same model.

        Raises:
            ValueError: For another class, likelihood, or model weights.
        """
        check_state(self, state_dict)
        self.mean = state_dict["mean"].to(self._device, self._dtype)
        self.subsample_size = state_dict["subsample_size"]
        self.n_eigenvalues = state_dict["n_eigenvalues"]
        self.seed = state_dict["seed"]
        self.dual_directions = state_dict["dual_directions"].to(self._device, self._dtype)
        self.feature_gram = state_dict["feature_gram"].to(self._device, self._dtype)
        self.prior_precision = state_dict["prior_precision"]
        self.sigma_noise = state_dict["sigma_noise"]
        self.temperature = state_dict["temperature"]
        self.n_data, self.n_outputs = state_dict["n_data"], state_dict["n_outputs"]
        self.fit_history_ = {k: list(v) for k, v in state_dict["fit_history"].items()}
        self._factor_key = None
        self._fitted = True


def _empty_history() -> dict[str, list[Any]]:
    return {"processed_examples": [], "val_nll": [], "tuning": []}
