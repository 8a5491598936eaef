r"""Posteriors with one observation noise per output (regression with a vector ``sigma_noise``).

With ``σ = (σ₁, …, σ_C)`` the output Hessian of Gaussian regression, ``diag(1/σ²)``, is diagonal,
so the GGN splits into one curvature per output,

$$
H(\sigma) = \sum_c H_c / \sigma_c^2, \qquad H_c = \sum_n m_{nc}\, J_{nc}^\top J_{nc},
$$

with ``m_nc = 1`` for the exact GGN (the Monte-Carlo Fisher's ``Σ_k v_nkc²`` estimates it). The
``H_c`` are kept along a leading output axis in the base structure's form, and the posterior at
any σ is the base structure's posterior of ``Σ_c h_c H_c`` with ``h_c = 1/(σ_c² T)``: the marginal
likelihood stays differentiable in every ``σ_c``. Memory is C times the base structure's.

Only the native GGN routes expose the per-output columns; the empirical Fisher mixes the outputs
and is refused, and so are low-rank and function-space posteriors.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cache, cached_property
from typing import TYPE_CHECKING, ClassVar, cast

import torch
from torch import Tensor

from laplace.curvature import CurvatureInterface, GGNInterface
from laplace.curvature.engine.kfac import kfac
from laplace.curvature.engine.kfac_rules import check_gradient_factor_first
from laplace.structures import DensePosterior, DiagonalPosterior, KronPosterior, Posterior
from laplace.structures.posterior import Curvature
from laplace.utils.matrix import Kron, KronDecomposed

if TYPE_CHECKING:
    from laplace.curvature.curvature_backend import CurvatureBackend
    from laplace.curvature.engine.per_sample import PerSampleTrace
    from laplace.likelihoods.gaussian import GaussianRegression
    from laplace.structures.jacobians import Jacobian
    from laplace.utils.data import Inputs

__all__ = ["OutputKron", "PerOutputPosterior", "noise_structure"]


class OutputKron(Kron):
    """Kronecker factors whose output-gradient factors are kept per output: (C, p_out, p_out).

    ``decompose`` only records ``damping``: the factors are combined and eigen-decomposed for
    each σ by ``PerOutputPosterior``.
    """

    def __init__(self, kfacs: list[list[Tensor]], damping: bool = False) -> None:
        super().__init__(kfacs)
        self.damping = damping

    def decompose(  # type: ignore[override]
        self, damping: bool = False, deferred: bool = True
    ) -> OutputKron:
        """The same factors, to be decomposed per σ with ``damping`` (always ``deferred``)."""
        return OutputKron(self.kfacs, damping)

    def combine(self, weights: Tensor) -> KronDecomposed:
        """``Σ_c w_c G_c ⊗ A`` per block, eigen-decomposed; ``weights`` of shape (C,)."""
        summed = [[torch.tensordot(weights, F[0], dims=1), *F[1:]] for F in self.kfacs]
        return Kron(summed).decompose(damping=self.damping)


class PerOutputPosterior(Posterior):
    """Posterior of ``P = Σ_c h_c H_c + diag(p₀)`` from per-output curvatures ``H`` (C, ...).

    Concrete classes come from ``noise_structure``: they put this accumulation of each
    output's curvature before the base structure, whose posterior they are, of the combined
    curvature ``Σ_c h_c H_c`` with a likelihood factor of one.

    Args:
        H: Per-output curvature, stacked along the first axis.
        h_factor: ``1/(σ²T)``, shape (C,), or one value for every output.
        prior_precision: See ``Posterior``.
        prior_sizes: See ``Posterior``.
    """

    #: The structure of each output's curvature and of the posterior.
    structure: ClassVar[type[Posterior]]
    #: Number of outputs C.
    n_outputs: ClassVar[int]
    #: No closed form of a head's summed curvature: each output's curvature is kept.
    head_curvature: ClassVar[None] = None

    def __init__(
        self,
        H: Curvature,
        h_factor: Tensor,
        prior_precision: Tensor,
        prior_sizes: Sequence[int] | None = None,
    ) -> None:
        weights = h_factor.reshape(-1).expand(self.n_outputs)
        one = torch.ones((), dtype=prior_precision.dtype, device=prior_precision.device)
        super().__init__(self.combine(H, weights), one, prior_precision, prior_sizes)

    @cached_property
    def inner(self) -> Posterior:
        """The same posterior as an object of the base structure."""
        return self.structure(self.H, self.h_factor, self.prior_precision, self.prior_sizes)

    @classmethod
    def fit_bytes(cls, params: Sequence[Tensor], **options: object) -> int:
        """Each output's summed curvature (C, ...) and the base structure's fit of their sum.

        The first is measured on ``zeros`` of the meta device: shapes, no memory.
        """
        meta = [torch.empty_like(p, device="meta") for p in params]
        stacked = cls.zeros(meta, **options)
        factors = stacked.kfacs if isinstance(stacked, Kron) else [[stacked]]
        numbers = sum(F.numel() for block in factors for F in block if isinstance(F, Tensor))
        summed = numbers * params[0].element_size()
        return summed + cls.structure.fit_bytes(params, **options)

    def held_bytes(
        self, n_rows: int, n_outputs: int, kind: type[Jacobian], joint: bool = False
    ) -> int:
        """The base structure's, of the combined curvature."""
        return self.inner.held_bytes(n_rows, n_outputs, kind, joint)

    @classmethod
    def zeros(cls, params: Sequence[Tensor]) -> Curvature:
        """Zero curvature of every output, stacked (C, ...)."""
        zero = cls.structure.zeros(params)
        return zero.new_zeros(cls.n_outputs, *zero.shape)

    @classmethod
    def batch_curvature(
        cls,
        backend: CurvatureBackend,
        X: Inputs,
        y: Tensor,
        n_data: int,
        total: Curvature | None = None,
    ) -> tuple[Tensor, Curvature]:
        """``(loss (C,), H_batch (C, ...))``: each output's loss and curvature (``total`` unused).

        Raises:
            ValueError: If the model's number of outputs is not C, or its outputs have extra
                dimensions.
        """
        trace = backend.trace(X)
        f = trace.f.detach()
        backend.fit_likelihood.outputs.require_plain(f.shape, "sigma_noise with one σ per output")
        if f.shape[-1] != cls.n_outputs:
            raise ValueError(
                f"sigma_noise has {cls.n_outputs} entries (one per output) but the model has "
                f"{f.shape[-1]} outputs."
            )
        V = cast(Tensor, backend.curvature_columns(f, y))  # plain outputs: a tensor (K, B, C)
        weights = sum(v.square() for v in V)
        eye = torch.eye(cls.n_outputs, dtype=f.dtype, device=f.device)
        columns = [weights[:, c, None].sqrt() * eye[c] for c in range(cls.n_outputs)]
        parts = [cls.output_curvature(backend, trace, column, n_data) for column in columns]
        regression = cast("GaussianRegression", backend.fit_likelihood)  # one σ per output
        return regression.loss_per_output(f, y), cls.stack(parts)

    @classmethod
    def output_curvature(
        cls, backend: CurvatureBackend, trace: PerSampleTrace, column: Tensor, n_data: int
    ) -> Curvature:
        """The curvature ``H_c`` of one output column (B, C) in the structure's form."""
        products = trace.gram if cls.backend_route == "full" else trace.square_sum
        return products([column]).detach()

    #: The curvatures of the C outputs, stacked (C, ...).
    stack = staticmethod(torch.stack)

    @staticmethod
    def combine(H: Curvature, weights: Tensor) -> Curvature:
        """``Σ_c w_c H_c`` in the structure's form, ``weights`` of shape (C,)."""
        return torch.tensordot(weights, H, dims=1)


class _PerOutputKron(PerOutputPosterior):
    """Per-output Kronecker factors: one output-gradient factor per output, inputs shared."""

    @classmethod
    def zeros(cls, params: Sequence[Tensor], shapes: list | None = None) -> OutputKron:
        """Zero factors with one output-gradient factor per output."""
        zero = KronPosterior.zeros(params, shapes)
        return OutputKron(
            [[F[0].expand(cls.n_outputs, *F[0].shape).clone(), *F[1:]] for F in zero.kfacs]
        )

    @staticmethod
    def factors(H: OutputKron) -> OutputKron:
        """The fitted factors are kept as they are."""
        return H

    @classmethod
    def output_curvature(
        cls, backend: CurvatureBackend, trace: PerSampleTrace, column: Tensor, n_data: int
    ) -> Kron:
        """The Kronecker factors of one output column (B, C)."""
        check_gradient_factor_first(trace.engine, "one sigma_noise per output")
        limit = backend.kfac_dense_limit
        return kfac(trace, [column], n_data, backend.kfac_approx, backend.factor, None, limit)

    @staticmethod
    def stack(parts: list[Kron]) -> OutputKron:
        """The factors of the C outputs, output-gradient factors stacked (C, p_out, p_out)."""
        blocks = zip(*(part.kfacs for part in parts), strict=True)
        return OutputKron([[torch.stack([b[0] for b in bl]), *bl[0][1:]] for bl in blocks])

    #: ``Σ_c w_c G_c ⊗ A`` per block, eigen-decomposed (``OutputKron.combine``).
    combine = staticmethod(OutputKron.combine)


#: Per base structure: the per-output class placed before it.
_FAMILIES: dict[type[Posterior], type[PerOutputPosterior]] = {
    DensePosterior: PerOutputPosterior,
    DiagonalPosterior: PerOutputPosterior,
    KronPosterior: _PerOutputKron,
}


@cache
def _per_output(structure: type[Posterior], n_outputs: int) -> type[PerOutputPosterior]:
    attributes = {"structure": structure, "n_outputs": n_outputs}
    return type(f"PerOutput{structure.__name__}", (_FAMILIES[structure], structure), attributes)


def noise_structure(
    structure: type[Posterior],
    current: type[Posterior],
    n_sigma: int,
    fitted: bool,
    backend_cls: type[CurvatureInterface],
) -> type[Posterior]:
    """The posterior structure for ``n_sigma`` noise values (one, or one per output).

    Args:
        structure: The class's own structure.
        current: The structure in use now.
        n_sigma: Number of entries of the new ``sigma_noise``.
        fitted: Whether the curvature was fitted with ``current``.
        backend_cls: The curvature backend.

    Returns:
        ``structure`` for one σ, its per-output variant for C > 1, or ``current`` when it
        serves (a fitted per-output curvature also serves one σ).

    Raises:
        ValueError: For a structure without a per-output variant (low-rank), a backend that
            cannot give the per-output curvature, or a fitted curvature that does not fit.
    """
    if current is structure and n_sigma == 1:
        return current
    if fitted:
        if issubclass(current, PerOutputPosterior) and n_sigma in (1, current.n_outputs):
            return current
        raise ValueError(
            f"sigma_noise has {n_sigma} entries, but this approximation was fitted with "
            f"{'one σ per output' if current is not structure else 'one σ'}: one σ per output "
            "needs the curvature of each output. Set sigma_noise first, then fit."
        )
    if n_sigma == 1:
        return structure
    if structure not in _FAMILIES:
        raise ValueError(
            "one sigma_noise per output is supported with hessian_structure 'full', 'diag' and "
            "'kron' (the curvature of each output is kept); this approximation is "
            f"{structure.__name__}."
        )
    route = structure.backend_route
    if not issubclass(backend_cls, GGNInterface) or getattr(backend_cls, route) is not getattr(
        CurvatureInterface, route
    ):
        raise ValueError(
            "one sigma_noise per output needs the curvature of each output, which only the "
            "GGN of backend=CurvlinopsGGN (exact, or stochastic=True) gives: the empirical "
            "Fisher and the Hessian mix the outputs, ASDL and BackPACK return their sum; got "
            f"{backend_cls.__name__}."
        )
    return _per_output(structure, n_sigma)
