r"""Matrix-free posterior: ``P = h·H + diag(p₀)`` used only through products ``H V``.

Every quantity of the posterior is a Krylov computation (``laplace.curvature.solvers.krylov``):

- ``J P⁻¹ Jᵀ`` by conjugate gradients on ``P X = Jᵀ``; or, for many test points, from S
  posterior samples ``x`` as ``(1/S) Σ (J x)(J x)ᵀ``. The columns of a solver block share one
  Krylov space (``block_conjugate_gradients``): the S samples of a predictive take a fraction
  of the iterations each would alone. Conjugate gradients run unpreconditioned by default:
  diagonal and KFAC preconditioners took as many or more iterations
  (``matfree-preconditioners`` in ``benchmarks/``).
- Samples by sample-then-optimise (Antorán et al., 2023): ``b = √h·Gᵀ ω + √p₀ ⊙ ε`` with
  standard normal ``ω, ε`` has covariance ``P``, so ``x = P⁻¹ b ~ N(0, P⁻¹)``.
- ``log det P`` by stochastic Lanczos quadrature. For a scalar prior δ one Lanczos run per probe
  on ``H`` serves every ``(h, δ)``, so ``log det P ≈ mean_i Σⱼ wᵢⱼ log(h·θᵢⱼ + δ)`` is
  differentiated in ``h`` and δ without a product. A layer-wise or diagonal prior ``D``:
  ``log det D + log det(I + h·D^{-1/2} H D^{-1/2})``, one Lanczos run per value of ``D``.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from functools import cached_property
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from laplace.curvature.engine.block_product import ParameterBlock, SampleVectors
from laplace.curvature.solvers.krylov import (
    LanczosQuadrature,
    SolveReport,
    block_conjugate_gradients,
    lanczos_quadrature,
    rademacher_probes,
)
from laplace.structures.jacobians import Jacobian, LayerTrace
from laplace.structures.posterior import Posterior
from laplace.utils import distributed as distributed_utils
from laplace.utils.errors import (
    NotFittedError,
    UnsupportedError,
    check_bool,
    check_int_at_least,
    check_positive_int,
)

if TYPE_CHECKING:
    from laplace.curvature.solvers.products import NativeProduct

__all__ = [
    "SOLVER_BLOCK_BYTES",
    "ConvergenceError",
    "LogDetReport",
    "MatFreeCurvature",
    "MatFreeOptions",
    "MatFreePosterior",
    "NoProductDataError",
]

#: Memory for the vectors of one block of a solver (conjugate gradients keeps about six per
#: column, a reorthogonalised Lanczos run one per step and probe); larger problems are solved a
#: block of columns at a time.
SOLVER_BLOCK_BYTES = 64 * 2**20

#: Vectors conjugate gradients keeps per column (solution, residual, preconditioned residual,
#: direction, product, right-hand side).
_CG_VECTORS = 6


class ConvergenceError(RuntimeError):
    """An iterative solver did not reach its tolerance (``strict=True``)."""


class NoProductDataError(NotFittedError):
    """The matrix-free posterior has no training data to multiply its curvature with."""


@dataclass(frozen=True)
class MatFreeOptions:
    """Settings of the matrix-free solvers (see ``MatFreeLaplace`` for their meaning)."""

    tol: float = 1e-4
    max_iter: int = 1000
    strict: bool = False
    preconditioner: str | None = None
    n_probes: int = 10
    lanczos_steps: int = 30
    predictive: str = "auto"
    variance_samples: int = 64
    seed: int = 0
    cache_bytes: int | None = None
    block_bytes: int = SOLVER_BLOCK_BYTES

    def __post_init__(self) -> None:
        """Refuse settings the solvers cannot use, naming them and the accepted values.

        Raises:
            ValueError: For a tolerance outside (0, 1), a non-positive count, an unknown
                preconditioner or predictive route.
        """
        tol = self.tol
        if isinstance(tol, bool) or not isinstance(tol, (int, float)) or not 0 < tol < 1:
            raise ValueError(f"tol must be a number in (0, 1), got {tol!r}.")
        for name in ("max_iter", "n_probes", "lanczos_steps", "variance_samples", "block_bytes"):
            check_positive_int(getattr(self, name), name)
        check_int_at_least(self.seed, "seed", 0)
        check_bool(self.strict, "strict")
        if self.preconditioner not in ("diag", None):
            raise ValueError(
                f"preconditioner must be 'diag' or None, got {self.preconditioner!r}."
            )
        if self.predictive not in ("auto", "cg", "samples"):
            raise ValueError(
                f"predictive must be 'auto', 'cg' or 'samples', got {self.predictive!r}."
            )
        if self.cache_bytes is not None:
            check_int_at_least(self.cache_bytes, "cache_bytes", 0)

    def as_dict(self) -> dict[str, object]:
        """The settings as plain values (for a state)."""
        return asdict(self)

    def route(self, n_rows: int) -> str:
        """``"cg"`` or ``"samples"``: the route of the GLM variances of ``n_rows`` output rows."""
        if self.predictive != "auto":
            return self.predictive
        return "samples" if n_rows > self.variance_samples else "cg"


@dataclass(frozen=True)
class LogDetReport:
    """A stochastic Lanczos quadrature estimate of ``log det P`` and of its prior derivative.

    Attributes:
        estimate: The estimate of ``log det P``.
        standard_error: Its standard error over the probes (0 when the probes span the space).
        prior_gradient: Estimate of ``∂ log det P / ∂δ = tr P⁻¹`` for a scalar prior δ, else None.
        prior_gradient_standard_error: Its standard error over the probes, else None.
        n_probes: Number of probes.
        steps: Lanczos steps per probe.
        products: Curvature-vector products the Lanczos runs made (0: a cached run was used).
    """

    estimate: float
    standard_error: float
    prior_gradient: float | None
    prior_gradient_standard_error: float | None
    n_probes: int
    steps: int
    products: int


def _standard_error(values: Tensor, exact: bool) -> float:
    """Standard error of the mean of ``values`` (0 when ``exact``)."""
    if exact or len(values) < 2:
        return 0.0
    return float(values.std() / len(values) ** 0.5)


class MatFreeCurvature:
    """The curvature over the training data as products, with what the solvers keep.

    Args:
        n_params: P.
        like: A tensor of the posterior's device and type.
        options: The solver settings.
        product: ``H V`` over the data (None: no data, e.g. after ``load_state_dict``).
        diagonal: ``diag(H)`` (P,), for the preconditioner (None: none kept).
        fitted: False for the zero curvature of an unfitted approximation (the prior).
        distributed: Whether the products sum over the processes of a distributed fit (every
            solve is then collective: all processes must solve the same systems).
        reduce_rank: This process's rank in a distributed fit (its sketches draw their own
            numbers), else 0.

    Attributes:
        products: Curvature-vector products made so far (a block of m vectors counts m).
        passes: Passes over the training data made for products and sketches.
        last_solve: The ``SolveReport`` of the last conjugate-gradient solve.
        last_log_det: The ``LogDetReport`` of the last log-determinant.
    """

    def __init__(
        self,
        n_params: int,
        like: Tensor,
        options: MatFreeOptions,
        product: NativeProduct | None = None,
        diagonal: Tensor | None = None,
        fitted: bool = True,
        distributed: bool = False,
        reduce_rank: int = 0,
    ) -> None:
        self.n_params, self.like, self.options = n_params, like, options
        self.product, self.diagonal, self.fitted = product, diagonal, fitted
        self.distributed, self.reduce_rank = distributed, reduce_rank
        self.products, self.passes = 0, 0
        self.last_solve: SolveReport | None = None
        self.last_log_det: LogDetReport | None = None
        #: Lanczos quadratures by prior: ``(None, q)`` for a scalar prior (on ``H``), ``(D, q)``
        #: for a diagonal ``D`` (on ``D^{-1/2} H D^{-1/2}``).
        self.quadratures: list[tuple[Tensor | None, LanczosQuadrature]] = []
        #: The route of the GLM variances of the current prediction (``"cg"`` or
        #: ``"samples"``), chosen for all its test points; None: by the rows at hand.
        self.variance_route: str | None = None
        #: Posterior samples ``x`` (P, S) solved for the predictive, with the ``(h, p₀)`` they
        #: belong to, while they fit in ``options.block_bytes``.
        self.sample_cache: tuple[Tensor, Tensor, Tensor] | None = None

    @property
    def dtype(self) -> torch.dtype:
        """Floating-point type of the products."""
        return self.like.dtype

    def _require_product(self) -> NativeProduct:
        if self.product is None:
            raise NoProductDataError(
                "MatFreeLaplace has no training data to multiply its curvature with: a "
                "state_dict keeps the preconditioner, the solver settings and the "
                "log-determinant's quadrature, not the data. Call fit(train_loader) first."
            )
        return self.product

    def matmat(self, V: Tensor, out: Tensor | None = None) -> Tensor:
        """``H V`` for ``V`` (P, m): one pass over the data (none for the zero curvature).

        Args:
            V: The block (P, m).
            out: Memory the result may be written into (P, m), overwritten (see
                ``laplace.curvature.solvers.krylov.MatMat``); used where it has the products' type.
        """
        if out is not None and out.dtype != self.dtype:
            out = None
        if not self.fitted:
            return torch.zeros_like(V) if out is None else out.zero_()
        product = self._require_product()
        self.products += V.shape[1]
        self.passes += 1
        return product.matmat(V.to(self.dtype), out).to(V.dtype)

    def sketch(self, m: int, generator: torch.Generator) -> Tensor:
        """``Gᵀ ω`` (P, m) with standard normal ``ω``: covariance ``H``; one pass over the data."""
        if not self.fitted:
            return self.like.new_zeros(self.n_params, m)
        product = self._require_product()
        self.passes += 1
        return product.sketch(m, generator).to(self.dtype)


class PrecisionOperator:
    """The posterior precision ``P = h·H + diag(p₀)`` as a linear operator (P × P).

    ``P @ V`` multiplies a vector (P,) or a block (P, m); no P × P matrix is formed.
    """

    def __init__(self, posterior: MatFreePosterior) -> None:
        self.posterior = posterior
        self.shape = (posterior.n_params, posterior.n_params)

    def __matmul__(self, V: Tensor) -> Tensor:
        """``P V`` for ``V`` (P,) or (P, m)."""
        block = V.unsqueeze(1) if V.dim() == 1 else V
        out = self.posterior.matmat(block)
        return out.squeeze(1) if V.dim() == 1 else out


class MatFreePosterior(Posterior):
    """Gaussian posterior with precision ``P = h·H + diag(p₀)`` known only through products.

    ``H`` is a ``MatFreeCurvature``. See the module docstring for the solvers.
    """

    #: The form of the curvature the preconditioner keeps (its diagonal).
    backend_route = "diag"
    update_refusal = (
        "a matrix-free posterior keeps no curvature of earlier data, only the data its products "
        "run over, and those would be evaluated at the new weights; fit on all the data."
    )

    def __init__(
        self,
        H: MatFreeCurvature,
        h_factor: Tensor,
        prior_precision: Tensor,
        prior_sizes: Sequence[int] | None = None,
    ) -> None:
        super().__init__(H, h_factor, prior_precision, prior_sizes)
        self.n_params = len(self.prior_diag)

    # ---------------------------------------------------------------------- memory
    lighter = (
        "a smaller block_bytes, preconditioner=None, hessian_structure='diag' or fewer weights"
    )

    @classmethod
    def fit_bytes(
        cls, params: Sequence[Tensor], options: MatFreeOptions | None = None, **kwargs: object
    ) -> int:
        """The preconditioner's diagonal (P,) and one solver block (``options.block_bytes``).

        The recorded training batches (within ``options.cache_bytes``) are not counted.

        Args:
            params: See ``Posterior.fit_bytes``.
            options: The solver settings (the defaults when None).
            **kwargs: Unused.
        """
        options = MatFreeOptions() if options is None else options
        n_params = sum(p.numel() for p in params)
        diagonal = n_params if options.preconditioner == "diag" else 0
        return diagonal * params[0].element_size() + options.block_bytes

    def held_bytes(
        self, n_rows: int, n_outputs: int, kind: type[Jacobian], joint: bool = False
    ) -> int:
        """The fit, the solution of a joint prediction's rows (P, R·C)."""
        options, itemsize = self.options, self.itemsize
        diagonal = self.n_params if options.preconditioner == "diag" else 0
        solution = n_rows * n_outputs * self.n_params if joint else 0
        return (diagonal + solution) * itemsize + options.block_bytes

    # ---------------------------------------------------------------------- accumulation
    @staticmethod
    def zeros(params: Sequence[Tensor]) -> MatFreeCurvature:
        """The zero curvature (an unfitted approximation: the posterior is the prior)."""
        like = params[0].new_empty(0)
        n_params = sum(p.numel() for p in params)
        return MatFreeCurvature(n_params, like, MatFreeOptions(), fitted=False)

    @staticmethod
    def state(H: MatFreeCurvature) -> dict[str, Tensor]:
        """The preconditioner's diagonal and the scalar prior's Lanczos quadrature."""
        empty = H.like.new_empty(0)
        scalar = [q for key, q in H.quadratures if key is None]
        return {
            "fitted": torch.tensor(float(H.fitted), dtype=H.like.dtype, device=H.like.device),
            "diagonal": empty if H.diagonal is None else H.diagonal.detach(),
            "nodes": scalar[0].nodes if scalar else empty,
            "weights": scalar[0].weights if scalar else empty,
        }

    @classmethod
    def load_state(
        cls, state: object, zeros: MatFreeCurvature, options: MatFreeOptions | None = None
    ) -> MatFreeCurvature:
        """A curvature without data from a saved state (products need ``fit`` again).

        Raises:
            ValueError: If the state is not a matrix-free one or its shapes do not match.
        """
        keys = {"fitted", "diagonal", "nodes", "weights"}
        if not isinstance(state, dict) or set(state) != keys:
            raise ValueError(
                f"state_dict['H'] must be a matrix-free state with keys {sorted(keys)}."
            )
        like = zeros.like
        diagonal = state["diagonal"].to(device=like.device, dtype=like.dtype)
        if diagonal.numel() not in (0, zeros.n_params):
            raise ValueError(
                f"state_dict['H']['diagonal'] has {diagonal.numel()} entries, expected "
                f"{zeros.n_params} (one per weight) or none."
            )
        H = MatFreeCurvature(
            zeros.n_params,
            like,
            options or zeros.options,
            diagonal=diagonal if diagonal.numel() else None,
            fitted=bool(state["fitted"] != 0),
        )
        nodes, weights = state["nodes"], state["weights"]
        if nodes.numel():
            if nodes.shape != weights.shape or nodes.dim() != 2:
                raise ValueError("state_dict['H'] holds a malformed Lanczos quadrature.")
            quadrature = LanczosQuadrature(
                nodes.to(like.device, like.dtype), weights.to(like.device, like.dtype), 0
            )
            H.quadratures.append((None, quadrature))
        return H

    # ------------------------------------------------------------------------ the operator
    @property
    def options(self) -> MatFreeOptions:
        """The solver settings."""
        return self.H.options

    @cached_property
    def precision(self) -> PrecisionOperator:
        """``P`` as a linear operator."""
        return PrecisionOperator(self)

    @property
    def scale(self) -> Tensor:
        """Refused: a square root of ``P⁻¹`` would be a P × P matrix.

        Raises:
            UnsupportedError: (a ``NotImplementedError`` and an ``AttributeError``).
        """
        raise UnsupportedError(
            "MatFreeLaplace forms no P × P matrix, so it has no posterior_scale; draw "
            "samples with sample(n_samples) (sample-then-optimise) instead."
        )

    def matmat(self, V: Tensor) -> Tensor:
        """``P V = h·H V + p₀ ⊙ V`` for ``V`` (P, m)."""
        return self.h_factor * self.H.matmat(V) + self.prior_diag[:, None] * V

    @cached_property
    def _preconditioner_diagonal(self) -> Tensor | None:
        """``h·diag(H) + p₀`` (P,), or None without a preconditioner."""
        if self.options.preconditioner is None:
            return None
        diagonal = self.H.diagonal
        prior = self.prior_diag.detach()
        if diagonal is None or not self.H.fitted:
            return prior
        return self.h_factor.detach() * diagonal.to(prior.dtype) + prior

    def precondition(self, R: Tensor) -> Tensor:
        """``M⁻¹ R`` with the diagonal posterior ``M``."""
        return R / self._preconditioner_diagonal[:, None]

    def _block_columns(self, vectors_per_column: int) -> int:
        """Columns of one solver block within ``options.block_bytes``."""
        per_column = vectors_per_column * self.n_params * self.prior_diag.element_size()
        return max(1, self.options.block_bytes // per_column)

    def solve(self, B: Tensor) -> Tensor:
        """``P⁻¹ B`` for ``B`` (P, m) by conjugate gradients, a block of columns at a time.

        The report of the whole solve is kept in ``H.last_solve``.

        Raises:
            ConvergenceError: With ``strict=True``, if a column does not reach ``tol``.
        """
        X, report = self._solve(B)
        self._settle(report)
        return X

    def _solve(self, B: Tensor, overwrite: bool = False) -> tuple[Tensor, SolveReport]:
        """``P⁻¹ B`` and its report, a block of columns at a time (nothing is reported yet).

        With ``overwrite``, ``B``'s memory holds the residuals.
        """
        options = self.options
        h, prior = self.h_factor.detach(), self.prior_diag.detach()
        if self.H.distributed:
            distributed_utils.check_consistent(
                {"right-hand sides": B},
                "matrix-free solve",
                "after a distributed fit every product sums over all processes, so every "
                "process must solve the same systems: predict the same inputs on every process "
                "(or use predictive='samples', whose solves do not depend on the inputs)",
            )

        def matmat(V: Tensor, out: Tensor | None) -> Tensor:
            return self.H.matmat(V, out).mul_(h).addcmul_(prior[:, None], V)

        precondition = None if options.preconditioner is None else self.precondition
        step = self._block_columns(_CG_VECTORS)
        solutions, reports = [], []
        for start in range(0, B.shape[1], step):
            X, report = block_conjugate_gradients(
                matmat,
                B[:, start : start + step],
                options.tol,
                options.max_iter,
                precondition,
                overwrite=overwrite,
            )
            solutions.append(X)
            reports.append(report)
        X = solutions[0] if len(solutions) == 1 else torch.cat(solutions, dim=1)
        return X, SolveReport.merged(reports)

    def _settle(self, report: SolveReport) -> None:
        """Keep ``report`` as ``H.last_solve``; warn, or raise if strict, if it did not converge.

        Raises:
            ConvergenceError: With ``strict=True``, if a column did not reach ``tol``.
        """
        options = self.options
        self.H.last_solve = report
        if not report.converged:
            message = (
                f"conjugate gradients did not reach the relative residual tol={options.tol:g} "
                f"within max_iter={options.max_iter} iterations: {report}. Raise max_iter, "
                "loosen tol or raise the prior precision."
            )
            if options.strict:
                raise ConvergenceError(message)
            warnings.warn(message, RuntimeWarning, stacklevel=4)

    # --------------------------------------------------------------------- log-determinant
    @property
    def log_det(self) -> Tensor:
        """``log det P`` by stochastic Lanczos quadrature (report in ``H.last_log_det``).

        Raises:
            ValueError: For a gradient w.r.t. a layer-wise or diagonal prior precision.
        """
        prior = self.prior_diag
        scalar = bool((prior.detach() == prior.detach()[0]).all())
        if not scalar and prior.requires_grad:
            raise ValueError(
                "MatFreeLaplace differentiates log det P w.r.t. a scalar prior precision only "
                "(its derivative is Hutchinson's trace of P⁻¹ with the Lanczos probes); use a "
                "scalar prior_precision (marglik_training: prior_structure='scalar'), or "
                "optimize_prior_precision(method='gridsearch')."
            )
        h = self.h_factor
        if scalar:
            delta = prior[0]
            quadrature, products = self._quadrature(None)
            shifted = h * quadrature.nodes + delta
            per_probe = (quadrature.weights * shifted.log()).sum(1)
            gradients = (quadrature.weights / shifted.detach()).sum(1)
        else:
            quadrature, products = self._quadrature(prior.detach())
            per_probe = (quadrature.weights * (1 + h * quadrature.nodes).log()).sum(1)
            per_probe = per_probe + prior.log().sum()
            gradients = None
        exact = len(per_probe) >= self.n_params
        self.H.last_log_det = LogDetReport(
            estimate=float(per_probe.detach().mean()),
            standard_error=_standard_error(per_probe.detach(), exact),
            prior_gradient=None if gradients is None else float(gradients.mean()),
            prior_gradient_standard_error=None
            if gradients is None
            else _standard_error(gradients, exact),
            n_probes=len(per_probe),
            steps=quadrature.nodes.shape[1],
            products=products,
        )
        return per_probe.mean()

    def _quadrature(self, prior: Tensor | None) -> tuple[LanczosQuadrature, int]:
        """The Lanczos quadrature for a scalar prior (None) or a diagonal one, and its cost.

        Cached on the curvature: a scalar prior's serves every ``(h, δ)``.
        """
        for key, quadrature in self.H.quadratures:
            if (key is None and prior is None) or (
                key is not None and prior is not None and torch.equal(key, prior)
            ):
                return quadrature, 0
        options = self.options
        like = self.prior_diag.detach()
        generator = torch.Generator(device=like.device).manual_seed(options.seed)
        n_probes = min(options.n_probes, self.n_params)  # P orthogonal ones span the space
        steps = min(options.lanczos_steps, self.n_params)
        scale = None if prior is None else prior.rsqrt()[:, None]

        def matmat(V: Tensor, out: Tensor | None) -> Tensor:
            if scale is None:
                return self.H.matmat(V, out)
            return self.H.matmat(scale * V, out).mul_(scale)

        per_probe_bytes = (steps + 3) * self.n_params * like.element_size()
        reorthogonalize = per_probe_bytes * n_probes <= options.block_bytes
        if n_probes == self.n_params:  # drawn together: their orthogonality makes them exact
            probe_blocks = [rademacher_probes(self.n_params, n_probes, generator, like)]
        else:  # drawn a block at a time, in memory of the block's vectors
            step = n_probes if reorthogonalize else self._block_columns(4)
            probe_blocks = (
                rademacher_probes(self.n_params, min(step, n_probes - i), generator, like)
                for i in range(0, n_probes, step)
            )
        parts = [
            lanczos_quadrature(matmat, probes, steps, reorthogonalize, overwrite=True)
            for probes in probe_blocks
        ]
        quadrature = LanczosQuadrature(
            nodes=torch.cat([q.nodes for q in parts]),
            weights=torch.cat([q.weights for q in parts]),
            products=sum(q.products for q in parts),
        )
        if prior is not None:  # one diagonal prior at a time
            self.H.quadratures = [(k, q) for k, q in self.H.quadratures if k is None]
        self.H.quadratures.append((prior, quadrature))
        return quadrature, quadrature.products

    # ------------------------------------------------------------------------- the rest
    def square_form(self, delta: Tensor) -> Tensor:
        """``Δᵀ P Δ``: one product."""
        return delta @ self.matmat(delta[:, None])[:, 0]

    def draw_precision_samples(self, n_samples: int, generator: torch.Generator | None) -> Tensor:
        """``b = √h·Gᵀ ω + √p₀ ⊙ ε`` (P, n_samples), of covariance ``P``: one pass.

        The sketch of each process draws its own ``ω`` (seeded from ``generator`` and the
        rank); ``ε`` is the same on every process. Memory: ``ε``, the sketch and one batch.
        """
        like = self.prior_diag.detach()
        seed = int(torch.randint(0, 2**62, (1,), generator=generator, device=like.device))
        sketch_generator = torch.Generator(device=like.device).manual_seed(
            seed + 7919 * self.H.reduce_rank
        )
        epsilon = torch.randn(
            self.n_params, n_samples, generator=generator, device=like.device, dtype=like.dtype
        )
        epsilon.mul_(like.sqrt()[:, None])
        return (
            self.H.sketch(n_samples, sketch_generator)
            .mul_(self.h_factor.detach().sqrt())
            .add_(epsilon)
        )

    def sample_blocks(
        self, n_samples: int, generator: torch.Generator | None
    ) -> Iterator[tuple[Tensor, SolveReport]]:
        """Draws of ``θ − θ_MAP ~ N(0, P⁻¹)`` by sample-then-optimise, (P, m) at a time.

        Each block is drawn and solved in the memory of one solver block (the draw's memory
        holds the residuals), with its report.
        """
        step = self._block_columns(_CG_VECTORS)
        for start in range(0, n_samples, step):
            m = min(step, n_samples - start)
            yield self._solve(self.draw_precision_samples(m, generator), overwrite=True)

    def sample_deviations(self, n_samples: int, generator: torch.Generator | None) -> Tensor:
        """Draws of ``θ − θ_MAP ~ N(0, P⁻¹)`` (n_samples, P) by sample-then-optimise."""
        blocks, reports = zip(*self.sample_blocks(n_samples, generator), strict=True)
        self._settle(SolveReport.merged(list(reports)))
        return torch.cat(blocks, dim=1).T

    def sampled_outputs(self, project: Callable[[Tensor], Tensor]) -> Tensor:
        """``project(x)`` for the ``variance_samples`` posterior deviations x, stacked on dim -1.

        The deviations are seeded (the same on every call) and solved a block at a time, each
        block projected (e.g. ``J x``, (B·C, m)) before the next is drawn; they are kept on the
        curvature for these hyperparameters while all of them fit in ``block_bytes``.
        """
        h, prior = self.h_factor.detach(), self.prior_diag.detach()
        cache = self.H.sample_cache
        if cache is not None and torch.equal(cache[1], h) and torch.equal(cache[2], prior):
            return project(cache[0])
        n_samples = self.options.variance_samples
        keep = n_samples * self.n_params * prior.element_size() <= self.options.block_bytes
        generator = torch.Generator(device=prior.device).manual_seed(self.options.seed)
        outputs, kept, reports = [], [], []
        for X, report in self.sample_blocks(n_samples, generator):
            outputs.append(project(X))
            reports.append(report)
            if keep:
                kept.append(X)
            del X  # not held while the next block is drawn and solved
        self._settle(SolveReport.merged(reports))
        if keep:
            self.H.sample_cache = (torch.cat(kept, dim=1), h.clone(), prior.clone())
        return torch.cat(outputs, dim=-1)

    def rows_variance(self, Js: Tensor) -> Tensor:
        """``J P⁻¹ Jᵀ`` per point from dense rows ``Js`` (B, C, P), shape (B, C, C)."""
        B, C, _ = Js.shape
        rows = Js.reshape(B * C, -1)
        if self._use_samples(B * C):
            f = self.sampled_outputs(lambda X: rows @ X.to(rows.dtype)).reshape(B, C, -1)
            return f @ f.transpose(1, 2) / f.shape[-1]
        X = self.solve(rows.T.to(self.prior_diag.dtype))
        covariance = (rows @ X).reshape(B, C, B, C)
        return covariance.diagonal(dim1=0, dim2=2).permute(2, 0, 1)

    def functional_covariance(self, Js: Tensor) -> Tensor:
        """Joint ``J P⁻¹ Jᵀ`` over all rows ``Js`` (N, P), shape (N, N), by conjugate gradients."""
        return Js @ self.solve(Js.T.to(self.prior_diag.dtype))

    def _use_samples(self, n_rows: int) -> bool:
        """Whether ``J P⁻¹ Jᵀ`` of ``n_rows`` output rows comes from posterior samples."""
        return (self.H.variance_route or self.options.route(n_rows)) == "samples"


def matfree_trace_variance(posterior: MatFreePosterior, J: LayerTrace) -> Tensor:
    """``J P⁻¹ Jᵀ`` (B, C, C) from a recorded pass over the test points.

    The sampled route never forms ``J``: each block of posterior samples ``X`` is projected as
    ``J X`` by the per-layer engine (``laplace.curvature.engine.block_product``), the trace's
    per-sample vectors taking the output directions as columns. Conjugate gradients need the
    rows ``Jᵀ`` (P, B·C) as right-hand sides anyway: they solve with the dense rows.
    """
    trace = J.trace
    f = trace.f
    B, C = f.shape[0], f[0].numel()
    if not posterior._use_samples(B * C):
        return posterior.rows_variance(J.dense())
    eye = torch.eye(C, dtype=f.dtype, device=f.device)
    vectors = SampleVectors(trace, eye.reshape(C, 1, *f.shape[1:]).expand(C, B, *f.shape[1:]))
    engine, dtype = trace.engine, posterior.prior_diag.dtype
    f_samples = posterior.sampled_outputs(  # (C, B, S)
        lambda X: vectors.project(ParameterBlock(engine, X.to(dtype)))
    ).permute(1, 0, 2)
    return f_samples @ f_samples.transpose(1, 2) / f_samples.shape[-1]


MatFreePosterior.closed_forms = {LayerTrace: matfree_trace_variance}
