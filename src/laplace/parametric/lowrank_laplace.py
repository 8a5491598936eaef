r"""Low-rank Laplace over all weights: ``P = U diag(λ) Uᵀ / (σ²T) + diag(p₀)``.

Internal module; the public path is [`laplace.baselaplace`][laplace.baselaplace].
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import cast

import torch
from torch import Tensor, nn

from laplace.core.base_laplace import BaseLaplace, arguments_for
from laplace.core.passes.top_eigenpairs import DiagonallyCorrectedEigenpairs, TopEigenpairs
from laplace.core.serialization import ParametricState
from laplace.curvature import CurvatureInterface
from laplace.curvature.solvers.eigen import SOLVERS, STARTS, RankedSolverOptions
from laplace.parametric.parametric_laplace import ParametricLaplace
from laplace.structures.low_rank import DiagLowRankPosterior, LowRankPosterior
from laplace.utils.enums import HessianStructure, Likelihood, SubsetOfWeights
from laplace.utils.errors import (
    check_int_at_least,
    check_mapping,
    check_positive_int,
)
from laplace.utils.outputs import IGNORE_INDEX

__all__ = ["DiagLowRankLaplace", "LowRankLaplace"]


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


class LowRankState(ParametricState["LowRankLaplace"]):
    """The state of a low-rank Laplace: the parametric state, with the eigenvalue errors."""

    def curvature_state(self, la: LowRankLaplace) -> dict[str, Tensor]:
        """The eigenpairs, with their a posteriori errors when known."""
        state = cast(dict[str, Tensor], super().curvature_state(la))  # the eigenpairs
        if la.eigenvalue_errors is not None:
            state["eigenvalue_errors"] = la.eigenvalue_errors.detach()
        return state

    def load_curvature(self, la: LowRankLaplace, state: object) -> tuple[Tensor, ...]:
        """The curvature; sets ``la.eigenvalue_errors`` from the state (None if absent)."""
        errors = None
        if isinstance(state, dict) and (errors := state.get("eigenvalue_errors")) is not None:
            state = {k: v for k, v in state.items() if k != "eigenvalue_errors"}
        H = super().load_curvature(la, state)
        if errors is not None and errors.shape != H[1].shape:
            raise ValueError(
                f"state_dict['H'] has eigenvalue errors {tuple(errors.shape)}, expected "
                f"{tuple(H[1].shape)} (one per eigenvalue)."
            )
        la.eigenvalue_errors = None if errors is None else errors.to(la._device, la._dtype)
        return H


def _solver_options(backend_kwargs: Mapping[str, object] | None) -> RankedSolverOptions:
    """The eigensolver's entries of ``backend_kwargs``, with ``n_eigenvalues`` (default 10).

    Raises:
        ArgumentTypeError: For ``backend_kwargs`` that is not a mapping.
        ValueError: For an unknown solver or start, or a bad ``n_eigenvalues``, ``max_iter``,
            ``tol``, ``seed``, ``oversampling`` or ``candidates``.
    """
    options = check_mapping(backend_kwargs, "backend_kwargs")
    solver = {k: v for k, v in options.items() if k in SOLVER_OPTIONS}
    if "low_rank" in solver:
        solver.setdefault("n_eigenvalues", solver.pop("low_rank"))
    solver.setdefault("n_eigenvalues", 10)
    solver.setdefault("solver", "randomized")
    if solver["solver"] not in SOLVERS:
        raise ValueError(
            f"backend_kwargs['solver'] must be one of {sorted(SOLVERS)}, got {solver['solver']!r}."
        )
    check_positive_int(solver["n_eigenvalues"], "n_eigenvalues")
    randomized = solver["solver"] == "randomized"
    least = {"max_iter": 0 if randomized else 1, "seed": 0, "oversampling": 0, "candidates": 1}
    for key, minimum in least.items():
        if key in solver:
            check_int_at_least(solver[key], f"backend_kwargs[{key!r}]", minimum)
    tol = solver.get("tol", 0)
    if isinstance(tol, bool) or not isinstance(tol, (int, float)) or not 0 <= tol < 1:
        raise ValueError(f"backend_kwargs['tol'] must be a number in [0, 1), got {tol!r}.")
    if solver.get("start", "kfac") not in STARTS:
        raise ValueError(
            f"backend_kwargs['start'] must be one of {list(STARTS)}, got {solver['start']!r}."
        )
    return cast(RankedSolverOptions, solver)  # checked above


class LowRankLaplace(ParametricLaplace):
    """Laplace approximation with a rank-k curvature ``H ≈ U diag(λ) Uᵀ``.

    The posterior precision ``P = U diag(h·λ) Uᵀ + diag(p₀)`` (``h = 1/(σ²T)``) is never formed:
    the log-determinant, ``J P⁻¹ Jᵀ`` and samples use the k × k capacitance matrix
    (see ``LowRankPosterior``), all in O(P k²).
    ``posterior_precision`` is ``((U (P, k), h·λ (k,)), p₀ (P,))``, as in laplace-torch. Before
    ``fit``, ``H`` is an empty eigenbasis ``(U (P, 0), λ (0,))``: the posterior is the prior
    (laplace-torch keeps None there).

    Arguments not listed are those of [`BaseLaplace`][laplace.core.base_laplace.BaseLaplace].

    Args:
        likelihood: ``"classification"`` or ``"regression"``.
        backend: Curvature family: ``CurvlinopsGGN`` (default, exact GGN; ``stochastic=True``
            for the Monte-Carlo Fisher), ``CurvlinopsEF``/``AsdlEF``, or a Hessian backend
            (``CurvlinopsHessian``, ``AsdlHessian``). laplace-torch's default is the Hessian.
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
        eigenvalue_errors: After ``fit``, a posteriori relative errors of the eigenvalues,
            shape (k,). After Krylov passes or an exact solver, bounds ``‖H uᵢ − λᵢ uᵢ‖ / λᵢ``
            measured on the training data: an exact eigenvalue of the curvature lies within
            ``eigenvalue_errors[i] · λᵢ`` of ``λᵢ``. After the default KFAC start alone, the
            relative change of each eigenvalue in the Nyström step, an estimate that in
            practice exceeds the remaining error (``laplace.curvature.solvers.eigen``). None before
            a fit; saved in ``state_dict``.

    Raises:
        ValueError: For an unknown solver or start, or a bad ``n_eigenvalues``, ``max_iter``,
            ``tol``, ``seed``, ``oversampling`` or ``candidates``.

    Example:
        >>> la = Laplace(model, "classification", subset_of_weights="all",
        ...              hessian_structure="lowrank", backend_kwargs={"n_eigenvalues": 50})
        >>> la.fit(train_loader)
        >>> probs = la(x_test, link_approx="probit")
    """

    _key = (SubsetOfWeights.ALL, HessianStructure.LOWRANK)

    _posterior_cls = LowRankPosterior
    _curvature_pass = TopEigenpairs
    _own_backend_kwargs = SOLVER_OPTIONS
    _state_format = LowRankState()

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
        backend_kwargs: Mapping[str, object] | None = None,
        class_dim: int | None = None,
        ignore_index: int = IGNORE_INDEX,
        dtype: torch.dtype | None = None,
    ) -> None:
        self._fit_pass_options = {"solver": _solver_options(backend_kwargs)}
        self.eigenvalue_errors: Tensor | None = None
        BaseLaplace.__init__(self, **arguments_for(BaseLaplace.__init__, locals()))
        self._likelihood_model.fit_likelihood.check_low_rank()

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


class DiagLowRankLaplace(LowRankLaplace):
    r"""Diagonal-plus-low-rank Laplace (INF: Lee et al., 2020): top eigenpairs, exact diagonal.

    ``P = U diag(h·λ) Uᵀ + h·D_H + diag(p₀)`` with ``(U, λ)`` the top-k curvature eigenpairs of
    [`LowRankLaplace`][laplace.baselaplace.LowRankLaplace] (same solver and options) and
    ``D_H = max(diag(H) − diag(U diag(λ) Uᵀ), 0)`` from the exact curvature diagonal of a
    diag fit: the precision's diagonal is the curvature's and its k top directions are kept.
    Log-determinant by the determinant lemma, ``J P⁻¹ Jᵀ`` and samples by Woodbury, all in
    O(P k²) (``DiagLowRankPosterior``). ``H`` is ``(U, λ, diag(H))``; ``posterior_precision``
    ``((U, h·λ), h·D_H + p₀)``. A fit costs the low-rank fit plus one pass of the diag fit;
    ``fit(override=False)`` keeps the earlier data as ``U diag(λ) Uᵀ`` (added to the
    eigensolver's products) and their exact diagonal.

    Arguments are those of [`LowRankLaplace`][laplace.baselaplace.LowRankLaplace].

    Example:
        >>> la = Laplace(model, "classification", subset_of_weights="all",
        ...              hessian_structure="diag_lowrank", backend_kwargs={"n_eigenvalues": 50})
    """

    _key = (SubsetOfWeights.ALL, HessianStructure.DIAG_LOWRANK)

    _posterior_cls = DiagLowRankPosterior
    _curvature_pass = DiagonallyCorrectedEigenpairs
