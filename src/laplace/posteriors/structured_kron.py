r"""Kronecker posterior whose output-side factors are diagonal plus low rank (many outputs).

The posterior of :class:`~laplace.posteriors.kron.KronPosterior` with the output factor of
every layer with many outputs (a linear head's; over all weights, any Linear or convolution
layer above the threshold) a :class:`~laplace.utils.diag_lowrank.DiagLowRank`
``G = diag(d) + s·U Uᵀ`` instead of a dense C × C matrix, the other blocks as they are;
log-determinant, ``J P⁻¹ Jᵀ``, square norms and samples are computed through that structure
(:class:`~laplace.utils.matrix.StructuredKronDecomposed`). Concrete classes carry the
largest rank kept for ``U`` and the threshold (:func:`structured_kron_posterior`).
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cache, partial
from typing import Any, ClassVar

import torch
from torch import Tensor
from typing_extensions import override

from laplace import large_output
from laplace.curvature.kfac_rules import LowRankShape
from laplace.jacobians import HeadFeatures, Jacobian
from laplace.last_layer import HeadCurvature
from laplace.posteriors.base import ClosedForm, Posterior
from laplace.posteriors.kron import KronPosterior
from laplace.utils.diag_lowrank import DiagLowRank
from laplace.utils.matrix import StructuredKron

__all__ = [
    "StructuredKronPosterior",
    "kron_block_structure",
    "structured_kron_posterior",
]


def _head_variance(posterior: StructuredKronPosterior, J: HeadFeatures) -> Tensor:
    return large_output.kron_head_variance(posterior.precision, J.phi, J.n_out, J.bias)


class StructuredKronPosterior(KronPosterior):
    """Kronecker posterior whose large output factors are diagonal plus low rank.

    A linear head (last layer) sums its curvature from per-point output curvatures by the
    closed form (:mod:`laplace.large_output`); over all weights, the native KFAC keeps the
    output factor of every layer with more than :attr:`low_rank_above` outputs as a
    ``DiagLowRank`` (the other blocks as :class:`KronPosterior` has them,
    :mod:`laplace.curvature.kfac`).
    """

    #: Largest number of low-rank columns of an output factor kept while summing.
    max_rank: ClassVar[int | None] = None
    #: Layers with more outputs than this keep their output factor low rank.
    low_rank_above: ClassVar[int | None] = None
    #: Output variances (B, C) of a linear head (over all weights, dense rows or refused).
    closed_forms: ClassVar[dict[type[Jacobian], ClosedForm]] = {HeadFeatures: _head_variance}
    #: The head's curvature from structured output curvatures (rank unbounded here).
    head_curvature: ClassVar[HeadCurvature | None] = ("kron", large_output.kron_curvature)

    @override
    @classmethod
    def zeros(cls, params: Sequence[Tensor], shapes: list | None = None) -> StructuredKron:
        """Zero factors: a ``DiagLowRank`` where ``shapes`` has a ``LowRankShape``.

        Args:
            params: The parameter tensors.
            shapes: The backend's block shapes (``kron_shapes(low_rank_above)``); None: every
                parameter a linear head's, ``G ⊗ A`` (weight) or ``G`` (bias), ``G`` low rank.
        """
        if shapes is None:
            shapes = [
                [LowRankShape(p.shape[0])] + ([] if p.ndim == 1 else [(p[0].numel(),) * 2])
                for p in params
            ]
        device, dtype = params[0].device, params[0].dtype

        def zero(shape: tuple[int, ...]) -> Tensor | DiagLowRank:
            if isinstance(shape, LowRankShape):
                return DiagLowRank.zeros(shape[0], -1, cls.max_rank, device, dtype)
            return torch.zeros(shape, device=device, dtype=dtype)

        return StructuredKron([[zero(shape) for shape in block] for block in shapes])

    @override
    @classmethod
    def batch_curvature(
        cls, backend: Any, X: Any, y: Tensor, n_data: int
    ) -> tuple[Tensor, StructuredKron]:
        """``(loss, factors)`` of a batch from the native KFAC, large output factors low rank.

        Raises:
            ValueError: For a backend whose ``kron`` forms dense output factors (ASDL,
                BackPACK), naming the alternatives.
        """
        if not getattr(backend, "low_rank_kfac", False):
            raise ValueError(
                "a Kronecker curvature with diagonal-plus-low-rank output factors (many "
                "outputs, see laplace.large_output) needs the native KFAC of "
                "backend=CurvlinopsEF or CurvlinopsGGN with backend_kwargs={'stochastic': "
                f"True}}; {type(backend).__name__} would build the dense output factor. Use "
                "subset_of_weights='last_layer' (one head row per data point; "
                "feature_reduction for sequence features) or hessian_structure='diag' otherwise."
            )
        return backend.kron(
            X, y, N=n_data, low_rank_above=cls.low_rank_above, output_factor_rank=cls.max_rank
        )

    @override
    def block_sizes(self) -> list[int]:
        return self.H.block_sizes()  # a structured factor has no eigenvalues


@cache
def structured_kron_posterior(
    max_rank: int | None, low_rank_above: int
) -> type[StructuredKronPosterior]:
    """The :class:`StructuredKronPosterior` keeping at most ``max_rank`` low-rank columns.

    Args:
        max_rank: Largest number of low-rank columns of an output factor.
        low_rank_above: Layers with more outputs keep a low-rank output factor.
    """
    closed_form = partial(large_output.kron_curvature, max_rank=max_rank)
    attributes = {
        "max_rank": max_rank,
        "low_rank_above": low_rank_above,
        "head_curvature": ("kron", closed_form),
    }
    return type("StructuredKronPosterior", (StructuredKronPosterior,), attributes)


def kron_block_structure(
    structure: type[Posterior], shapes: list[list[tuple[int, ...]]], rank: int | None
) -> type[Posterior]:
    """The posterior structure of Kronecker blocks of ``shapes`` (a backend's ``kron_shapes``).

    Where a factor is a :class:`~laplace.curvature.kfac_rules.LowRankShape` (a layer with more
    outputs than :data:`~laplace.large_output.LARGE_OUTPUT_THRESHOLD`) a Kronecker posterior
    gets structured output factors keeping at most ``rank`` low-rank columns.
    """
    low_rank = any(isinstance(shape, LowRankShape) for block in shapes for shape in block)
    if low_rank and structure is KronPosterior:
        return structured_kron_posterior(rank, large_output.LARGE_OUTPUT_THRESHOLD)
    return structure
