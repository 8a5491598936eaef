"""Matrix-free Laplace over all weights: the exact curvature's posterior by Krylov solvers.

Internal module; the public path is [`laplace.baselaplace`][laplace.baselaplace].
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor, nn

from laplace.core.base_laplace import BaseLaplace, arguments_for
from laplace.core.passes.curvature_products import CurvatureProducts
from laplace.core.serialization import ParametricState, StateDict
from laplace.curvature import CurvatureInterface, EFInterface, GGNInterface
from laplace.curvature.solvers.krylov import SolveReport
from laplace.parametric.parametric_laplace import GLMPlan, ParametricLaplace
from laplace.structures.jacobians import LayerTrace, row_kind
from laplace.structures.matrix_free import (
    LogDetReport,
    MatFreeOptions,
    MatFreePosterior,
    PrecisionOperator,
)
from laplace.utils import distributed as distributed_utils
from laplace.utils.data import Inputs, batch_size_of
from laplace.utils.enums import HessianStructure, Likelihood, SubsetOfWeights
from laplace.utils.outputs import IGNORE_INDEX

__all__ = ["MatFreeLaplace"]


class MatFreeState(ParametricState["MatFreeLaplace"]):
    """The state of a matrix-free Laplace: the parametric state, with the solver settings.

    The data are not saved: products need ``fit`` again after ``load_state_dict``; the
    scalar prior's Lanczos quadrature is, so the marginal likelihood needs no data.
    """

    def values(self, la: MatFreeLaplace) -> StateDict:
        """The parametric state and ``solver_options``."""
        return {**super().values(la), "solver_options": la.solver_options.as_dict()}

    def value_keys(self, la: MatFreeLaplace) -> tuple[str, ...]:
        """The parametric entries and ``solver_options``."""
        return (*super().value_keys(la), "solver_options")

    def check(self, la: MatFreeLaplace, state_dict: StateDict) -> None:
        """Refuse solver settings the solvers cannot use (see ``MatFreeOptions``)."""
        super().check(la, state_dict)
        settings = state_dict["solver_options"]
        if not isinstance(settings, dict) or set(settings) != set(MatFreeOptions().as_dict()):
            raise ValueError(
                "state_dict['solver_options'] must hold the settings "
                f"{sorted(MatFreeOptions().as_dict())}."
            )
        MatFreeOptions(**settings)

    def load(self, la: MatFreeLaplace, state_dict: StateDict) -> None:
        """The settings first (the curvature takes them), then the parametric entries."""
        la.solver_options = MatFreeOptions(**state_dict["solver_options"])
        super().load(la, state_dict)


class MatFreeLaplace(ParametricLaplace):
    r"""Laplace approximation with the exact curvature, used only through products.

    ``P = h·H + diag(p₀)`` (``h = 1/(σ²T)``) with ``H`` the GGN (or empirical / Monte-Carlo
    Fisher) summed over the training data, as ``FullLaplace`` has it, but no P × P matrix is
    formed: products ``H V`` cost one pass over the training data (the native per-layer engine
    keeps the batches it records between passes within ``cache_bytes``, and reads a shuffling
    loader in order; curvlinops' ``GGNLinearOperator`` makes a forward, a JVP and a VJP per
    vector and batch and was slower on the benchmark network, docs/performance.md), and

    - the GLM predictive solves ``P X = Jᵀ`` by conjugate gradients to the relative residual
      ``tol`` (``predictive="cg"``), or estimates ``J P⁻¹ Jᵀ`` from ``variance_samples``
      posterior samples (``"samples"``; its relative Monte-Carlo error is about ``√(2/S)``),
      whose cost does not grow with the test points; ``"auto"`` (default) takes samples when
      a call has more output rows (points × outputs) than ``variance_samples``;
    - ``sample`` / ``pred_type="nn"`` draw by sample-then-optimise (exact up to ``tol``);
    - ``log_marginal_likelihood`` estimates ``log det P`` by stochastic Lanczos quadrature with
      ``n_probes`` probes of ``lanczos_steps`` steps, run once per fit for a scalar prior and
      then differentiable in the prior precision and σ at no further product
      (``log_det_report`` holds the estimate's standard error and its prior derivative's).

    Arguments not listed are those of [`BaseLaplace`][laplace.core.base_laplace.BaseLaplace].

    Args:
        backend: A GGN or empirical-Fisher backend (default ``CurvlinopsGGN``;
            ``stochastic=True`` for the Monte-Carlo Fisher). A Hessian backend is refused:
            conjugate gradients need a positive definite precision.
        tol: Relative residual ``‖P x − b‖ / ‖b‖`` every conjugate-gradient solve reaches,
            in (0, 1).
        max_iter: Most conjugate-gradient iterations per solve.
        strict: Raise ``ConvergenceError`` when a solve does not reach ``tol``; else warn with
            the residual reached.
        preconditioner: None (default: measured fastest, see
            ``laplace.structures.matrix_free``) or ``"diag"`` (the diagonal posterior, from the
            curvature's exact diagonal computed at ``fit``).
        n_probes: Probes of the log-determinant's stochastic Lanczos quadrature.
        lanczos_steps: Lanczos steps per probe.
        predictive: ``"auto"``, ``"cg"`` or ``"samples"`` (see above).
        variance_samples: Posterior samples S of the sampled GLM variances.
        seed: Seed of the probes, the sampled variances and a Monte-Carlo Fisher's targets.
        cache_bytes: Memory for the batches the products keep between passes (None: 128 MiB;
            0: record every batch on every pass).
        block_bytes: Memory for one block of solver vectors; larger solves run a block of
            columns at a time.

    Attributes:
        solve_report: The ``SolveReport`` of the last conjugate-gradient solve (residuals,
            iterations, products).
        log_det_report: The ``LogDetReport`` of the last log-determinant.
        product_count: Curvature-vector products made since ``fit``.

    Raises:
        ValueError: For a Hessian (or other) backend without products, and for solver
            settings out of range (naming them).

    Example:
        >>> la = Laplace(model, "classification", subset_of_weights="all",
        ...              hessian_structure="matfree", tol=1e-4)
        >>> la.fit(train_loader)
        >>> la.optimize_prior_precision(method="marglik")
        >>> probs = la(x_test, link_approx="probit")
    """

    _key = (SubsetOfWeights.ALL, HessianStructure.MATFREE)

    _posterior_cls = MatFreePosterior
    _curvature_pass = CurvatureProducts
    _state_format = MatFreeState()

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
        tol: float = 1e-4,
        max_iter: int = 1000,
        strict: bool = False,
        preconditioner: str | None = None,
        n_probes: int = 10,
        lanczos_steps: int = 30,
        predictive: str = "auto",
        variance_samples: int = 64,
        seed: int = 0,
        cache_bytes: int | None = None,
        block_bytes: int | None = None,
    ) -> None:
        options = {
            "tol": tol,
            "max_iter": max_iter,
            "strict": strict,
            "preconditioner": preconditioner,
            "n_probes": n_probes,
            "lanczos_steps": lanczos_steps,
            "predictive": predictive,
            "variance_samples": variance_samples,
            "seed": seed,
            "cache_bytes": cache_bytes,
        }
        if block_bytes is not None:
            options["block_bytes"] = block_bytes
        self.solver_options = MatFreeOptions(**options)
        BaseLaplace.__init__(self, **arguments_for(BaseLaplace.__init__, locals()))
        if not isinstance(self.backend, (GGNInterface, EFInterface)):
            raise ValueError(
                f"MatFreeLaplace needs a GGN or empirical-Fisher backend for its products, got "
                f"{type(self.backend).__name__}: conjugate gradients need a positive definite "
                "precision, which an indefinite Hessian does not give (use CurvlinopsGGN, "
                "CurvlinopsEF or a stochastic GGN backend)."
            )

    @property
    def solver_options(self) -> MatFreeOptions:
        """The solver settings."""
        return self._solver_options

    @solver_options.setter
    def solver_options(self, value: MatFreeOptions) -> None:
        """Change the settings; what was computed under other ones is forgotten."""
        self._solver_options = value
        if self.H is not None and self.H.options != value:
            self.H.options = value
            self.H.quadratures, self.H.sample_cache = [], None
            self._posterior_cache = None

    @property
    def _fit_pass_options(self) -> dict[str, object]:
        """The solver settings, which the fit pass gives the curvature."""
        return {"options": self.solver_options}

    @property
    def _structure_options(self) -> dict[str, object]:
        """The solver settings, which a loaded curvature takes."""
        return {"options": self.solver_options}

    def _init_H(self) -> None:
        """The zero curvature, with this approximation's solver settings."""
        super()._init_H()
        self.H.options = self.solver_options

    @property
    def posterior_precision(self) -> PrecisionOperator:
        """``P`` as a linear operator: ``la.posterior_precision @ V`` for ``V`` (P,) or (P, m)."""
        return self._posterior.precision

    @property
    def solve_report(self) -> SolveReport | None:
        """The report of the last conjugate-gradient solve (None before one)."""
        return None if self.H is None else self.H.last_solve

    @property
    def log_det_report(self) -> LogDetReport | None:
        """The report of the last log-determinant (None before one)."""
        return None if self.H is None else self.H.last_log_det

    @property
    def product_count(self) -> int:
        """Curvature-vector products made since ``fit`` (a block of m vectors counts m)."""
        return 0 if self.H is None else self.H.products

    def _chunk_rows(self, n_points: int, plan: GLMPlan | None = None) -> int:
        """Test points per chunk of a call on ``n_points`` points.

        The sampled route with the Jacobian-free kind takes all the call's points at once
        (their recorded passes, not their Jacobians), so that its solves are made once per
        call; conjugate gradients as many points as a solver block holds.
        """
        plan = plan or self._glm_plan()
        rows = super()._chunk_rows(n_points, plan)
        if self.H.variance_route == "samples":
            kind = row_kind(plan.kind, self._likelihood_model.outputs)
            return max(rows, n_points) if kind is LayerTrace else rows
        per_point = self._likelihood_model.outputs.per_point(self.n_outputs)
        solver = self.solver_options.block_bytes // (
            2 * per_point * self.n_params * self.mean.element_size()
        )
        return max(1, min(rows, solver))

    def _glm_predictive_distribution(
        self,
        X: Inputs,
        joint: bool = False,
        diagonal_output: bool = False,
        plan: GLMPlan | None = None,
    ) -> tuple[Tensor, Tensor]:
        """As ``ParametricLaplace``'s, with the variance route chosen for all points at once."""
        n_points = batch_size_of(X, self.dict_key_x)
        n_rows = n_points * self._likelihood_model.outputs.per_point(self.n_outputs)
        route = "cg" if joint else self.solver_options.route(n_rows)
        if self.H.distributed:  # every process must take the same route (its solves are shared)
            distributed_utils.check_consistent(
                {"predictive route": route},
                "prediction",
                "predict the same number of points on every process, or pass "
                "predictive='samples' (or 'cg') to MatFreeLaplace",
            )
        self.H.variance_route = route
        try:
            return super()._glm_predictive_distribution(X, joint, diagonal_output, plan)
        finally:
            self.H.variance_route = None
