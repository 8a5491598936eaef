r"""Low-rank Laplace over all weights: ``P = U diag(λ) Uᵀ / (σ²T) + diag(p₀)``.

``(U, λ)`` are the top-k eigenpairs of the curvature summed over the training data (the GGN by
default; the empirical Fisher, the Monte-Carlo Fisher or the Hessian with the matching backend),
found from curvature–block products (:mod:`laplace.curvature.eigen`): by default from the
Kronecker eigenvectors of the KFAC curvature refined with the exact curvature (Rayleigh–Ritz,
then a Nyström step; three passes over the data, products computed natively per layer), or
randomised block Krylov, or exactly by Lanczos or LOBPCG. It works with every backend, unlike
laplace-torch 0.3, which needs the unpublished ``asdfghjkl`` package. Internal module; the
public path is :mod:`laplace.baselaplace`.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader

from laplace import distributed as distributed_utils
from laplace.base import BaseLaplace, arguments_for
from laplace.curvature import CurvatureInterface
from laplace.curvature.eigen import SOLVERS, STARTS, top_eigenpairs
from laplace.curvature.products import curvature_product
from laplace.data import batch_size_of, check_outputs
from laplace.errors import (
    check_bool,
    check_finite_result,
    check_int_at_least,
    check_positive_int,
)
from laplace.parametric import ParametricLaplace
from laplace.posterior_scale import PosteriorScaleMixin
from laplace.posteriors.lowrank import LowRankPosterior
from laplace.utils.enums import Likelihood

__all__ = ["LowRankLaplace"]

#: ``backend_kwargs`` entries that configure the eigensolver (not passed to the backend).
#: ``low_rank`` is the name laplace-torch's ``asdfghjkl`` backend uses for ``n_eigenvalues``.
SOLVER_OPTIONS = (
    "n_eigenvalues",
    "low_rank",
    "solver",
    "tol",
    "max_iter",
    "seed",
    "oversampling",
    "start",
    "candidates",
)


class LowRankLaplace(PosteriorScaleMixin, ParametricLaplace):
    """Laplace approximation with a rank-k curvature ``H ≈ U diag(λ) Uᵀ``.

    The posterior precision ``P = U diag(h·λ) Uᵀ + diag(p₀)`` (``h = 1/(σ²T)``) is never formed:
    the log-determinant, ``J P⁻¹ Jᵀ`` and samples use the k × k capacitance matrix
    (see :class:`~laplace.posteriors.lowrank.LowRankPosterior`), all in O(P k²). Before
    :meth:`fit`, ``H`` is an empty eigenbasis ``(U (P, 0), λ (0,))``: the posterior is the prior
    (laplace-torch keeps None there).

    Args:
        model: The trained network.
        likelihood: ``"classification"`` or ``"regression"``.
        backend: Curvature family: ``CurvlinopsGGN`` (default, exact GGN; ``stochastic=True``
            for the Monte-Carlo Fisher), ``CurvlinopsEF``/``AsdlEF``, or a Hessian backend
            (``CurvlinopsHessian``, ``AsdlHessian``). laplace-torch's default is the Hessian.
        sigma_noise: See :class:`~laplace.base.BaseLaplace`.
        prior_precision: See :class:`~laplace.base.BaseLaplace`.
        prior_mean: See :class:`~laplace.base.BaseLaplace`.
        temperature: See :class:`~laplace.base.BaseLaplace`.
        enable_backprop: See :class:`~laplace.base.BaseLaplace`.
        dict_key_x: See :class:`~laplace.base.BaseLaplace`.
        dict_key_y: See :class:`~laplace.base.BaseLaplace`.
        backend_kwargs: Backend options, plus the eigensolver's: ``n_eigenvalues`` (k, default
            10; ``low_rank`` is accepted as in laplace-torch); ``solver``: ``"randomized"``
            (default) on blocks of ``k + oversampling`` vectors (``oversampling`` default 10),
            from ``start="kfac"`` (default where every layer has a KFAC rule: Rayleigh–Ritz
            on ``candidates`` Kronecker eigenvectors, default 12 per vector, and one product)
            or ``"sketch"``, followed by ``max_iter`` block Krylov passes (default 0 after a
            KFAC start, whose result is then the Nyström approximation; 3 after a sketch),
            fewer once every error bound is at most ``tol``; or ``"lanczos"`` or ``"lobpcg"``
            (exact to ``tol``, default 0: machine precision; hundreds of passes); ``seed``
            (start vectors).

    Attributes:
        eigenvalue_errors: After :meth:`fit`, a posteriori relative errors of the eigenvalues,
            shape (k,). After Krylov passes or an exact solver, bounds ``‖H uᵢ − λᵢ uᵢ‖ / λᵢ``
            measured on the training data: an exact eigenvalue of the curvature lies within
            ``eigenvalue_errors[i] · λᵢ`` of ``λᵢ``. After the default KFAC start alone, the
            relative change of each eigenvalue in the Nyström step, an estimate that in
            practice exceeds the remaining error (:mod:`laplace.curvature.eigen`). None before
            a fit; saved in :meth:`state_dict`.

    Raises:
        ValueError: For an unknown solver or start, or a bad ``n_eigenvalues``, ``max_iter``,
            ``tol``, ``seed``, ``oversampling`` or ``candidates``.

    Example:
        >>> la = Laplace(model, "classification", subset_of_weights="all",
        ...              hessian_structure="lowrank", backend_kwargs={"n_eigenvalues": 50})
        >>> la.fit(train_loader)
        >>> probs = la(x_test, link_approx="probit")
    """

    _posterior_cls = LowRankPosterior

    def __init__(
        self,
        model: nn.Module,
        likelihood: Likelihood | str,
        backend: type[CurvatureInterface] | None = None,
        sigma_noise: float | Tensor = 1.0,
        prior_precision: float | Tensor = 1.0,
        prior_mean: float | Tensor = 0.0,
        temperature: float = 1.0,
        enable_backprop: bool = False,
        dict_key_x: str = "input_ids",
        dict_key_y: str = "labels",
        backend_kwargs: dict[str, Any] | None = None,
    ) -> None:
        self._solver_options = _solver_options(backend_kwargs)
        self.eigenvalue_errors: Tensor | None = None
        BaseLaplace.__init__(self, **arguments_for(BaseLaplace.__init__, locals()))
        self._likelihood_model.fit_likelihood.check_low_rank()

    def _backend_options(self, backend_kwargs: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in backend_kwargs.items() if k not in SOLVER_OPTIONS}

    def fit(
        self,
        train_loader: DataLoader,
        override: bool = True,
        progress_bar: bool = False,
        distributed: bool | None = None,
    ):
        """Find the top-k curvature eigenpairs over ``train_loader`` and the summed loss.

        Args:
            train_loader: Batches ``(X, y)`` or dict-like; iterated once per solver product.
            override: Must be True: eigenpairs of a sum are not sums of eigenpairs.
            progress_bar: Show a progress bar over the loss pass.
            distributed: See :meth:`ParametricLaplace.fit`; every curvature-vector product is
                then summed over the ranks, which all run the same eigensolver.

        Raises:
            ValueError: With ``override=False``, an empty loader or non-finite data.
            RuntimeError: If the eigenpairs are not finite.
        """
        if not check_bool(override, "override"):
            raise ValueError(
                "LowRankLaplace cannot update a fit (override=False): the top eigenpairs of a "
                "sum are not the sum of the top eigenpairs; fit again on all the data."
            )
        self._distributed = distributed_utils.resolve(distributed, train_loader)
        self._check_ranks_agree()
        n_data = self._data_count(train_loader)
        if n_data == 0:
            raise ValueError("train_loader is empty: fit needs at least one data point.")
        self.model.eval()
        mean = self._subset.vector()
        loss = torch.zeros((), device=self._device, dtype=self._dtype)
        with torch.no_grad(), distributed_utils.guard(self._distributed, "fit"):
            for X, y in self._batches(train_loader, progress_bar, desc="fit"):
                f = check_outputs(self.model(X), batch_size_of(X, self.dict_key_x))
                self.n_outputs = int(f.shape[-1])
                loss = loss + self.backend._loss(f, y)
        check_finite_result(loss, "loss of the training data")  # before any eigensolver pass
        options = dict(self._solver_options)
        k = int(options.pop("n_eigenvalues"))
        local_n = distributed_utils.data_count(train_loader) if self._distributed else n_data
        reduce = distributed_utils.all_reduce_sum if self._distributed else None
        product = curvature_product(
            self.backend,
            _Batches(self, train_loader),
            local_n,
            native=options.get("solver", "randomized") == "randomized",
            reduce=reduce,
            seed=options.get("seed", 0),
        )
        if self._distributed:
            loss = distributed_utils.all_reduce_sum(loss)
        U, eigenvalues, errors = top_eigenpairs(product, k, **options)
        if not self._posterior_cls.is_finite((U, eigenvalues)):
            raise RuntimeError("the curvature eigenpairs contain NaN or inf; check the model.")
        self.H = (U, eigenvalues)
        self.eigenvalue_errors = errors
        self.loss, self.n_data = loss, n_data
        self.mean = mean if self.enable_backprop else mean.detach()
        self._posterior_cache = None
        self._fitted = True

    @property
    def posterior_precision(self) -> tuple[tuple[Tensor, Tensor], Tensor]:
        """``((U (P, k), h·λ (k,)), p₀ (P,))``, as in laplace-torch.

        The precision is ``U @ diag(h·λ) @ U.T + diag(p₀)``.
        """
        return self._posterior.precision

    @property
    def V(self) -> Tensor:
        """``diag(p₀)⁻¹ U``, shape (P, k)."""
        (U, _), prior_diag = self.posterior_precision
        return U / prior_diag[:, None]

    @property
    def Kinv(self) -> Tensor:
        """Inverse capacitance ``(diag(h·λ)⁻¹ + Uᵀ diag(p₀)⁻¹ U)⁻¹``, shape (k, k)."""
        (U, eigenvalues), _ = self.posterior_precision
        return torch.linalg.inv(torch.diag(eigenvalues.reciprocal()) + U.T @ self.V)

    # ------------------------------------------------------------------------------ state
    def _curvature_state(self) -> dict[str, Tensor]:
        state = {"eigenvectors": self.H[0].detach(), "eigenvalues": self.H[1].detach()}
        if self.eigenvalue_errors is not None:
            state["eigenvalue_errors"] = self.eigenvalue_errors.detach()
        return state

    def _load_curvature_state(self, state: Any) -> tuple[Tensor, Tensor]:
        keys = {"eigenvectors", "eigenvalues"}
        if not isinstance(state, dict) or not keys <= set(state) <= keys | {"eigenvalue_errors"}:
            raise ValueError(
                "state_dict['H'] must hold 'eigenvectors' and 'eigenvalues' (and optionally "
                "'eigenvalue_errors')."
            )
        U, eigenvalues = state["eigenvectors"], state["eigenvalues"]
        errors = state.get("eigenvalue_errors")
        if (
            U.dim() != 2
            or U.shape[0] != self.n_params
            or eigenvalues.shape != U.shape[1:]
            or (errors is not None and errors.shape != eigenvalues.shape)
        ):
            raise ValueError(
                f"state_dict['H'] has eigenvectors {tuple(U.shape)} and eigenvalues "
                f"{tuple(eigenvalues.shape)}, expected (n_params={self.n_params}, k) and (k,) "
                "(and (k,) error bounds)."
            )
        self.eigenvalue_errors = None if errors is None else errors.to(self._device, self._dtype)
        return (
            U.to(device=self._device, dtype=self._dtype),
            eigenvalues.to(device=self._device, dtype=self._dtype),
        )


def _solver_options(backend_kwargs: dict[str, Any] | None) -> dict[str, Any]:
    """The eigensolver's entries of ``backend_kwargs``, with ``n_eigenvalues`` (default 10).

    Raises:
        ValueError: For an unknown solver or start, or a bad ``n_eigenvalues``, ``max_iter``,
            ``tol``, ``seed``, ``oversampling`` or ``candidates``.
    """
    options = dict(backend_kwargs or {})
    solver = {k: options[k] for k in SOLVER_OPTIONS if k in options}
    if "low_rank" in solver:
        solver.setdefault("n_eigenvalues", solver.pop("low_rank"))
    solver.setdefault("n_eigenvalues", 10)
    if solver.get("solver", "randomized") not in SOLVERS:
        raise ValueError(
            f"backend_kwargs['solver'] must be one of {sorted(SOLVERS)}, got {solver['solver']!r}."
        )
    check_positive_int(solver["n_eigenvalues"], "n_eigenvalues")
    if "max_iter" in solver:
        least = 0 if solver.get("solver", "randomized") == "randomized" else 1
        check_int_at_least(solver["max_iter"], "backend_kwargs['max_iter']", least)
    if "tol" in solver:
        tol = solver["tol"]
        if isinstance(tol, bool) or not isinstance(tol, (int, float)) or not 0 <= tol < 1:
            raise ValueError(f"backend_kwargs['tol'] must be a number in [0, 1), got {tol!r}.")
    if "seed" in solver:
        check_int_at_least(solver["seed"], "backend_kwargs['seed']", 0)
    if "oversampling" in solver:
        check_int_at_least(solver["oversampling"], "backend_kwargs['oversampling']", 0)
    if "candidates" in solver:
        check_positive_int(solver["candidates"], "backend_kwargs['candidates']")
    if solver.get("start", "kfac") not in STARTS:
        raise ValueError(
            f"backend_kwargs['start'] must be one of {list(STARTS)}, got {solver['start']!r}."
        )
    return solver


class _Batches:
    """Re-iterable ``(X, y)`` batches of a loader on the model's device (for the operator)."""

    def __init__(self, la: LowRankLaplace, loader: DataLoader) -> None:
        self.la, self.loader = la, loader

    def __iter__(self) -> Iterator[tuple[Any, Tensor]]:
        likelihood = self.la._likelihood_model.fit_likelihood
        for X, y in self.la._batches(self.loader):
            yield X, likelihood.loss_targets(y, self.la._dtype)
