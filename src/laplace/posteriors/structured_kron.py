r"""Kronecker posterior whose output-side factors are diagonal plus low rank (many outputs).

The posterior of :class:`~laplace.posteriors.kron.KronPosterior` with every block's output
factor a :class:`~laplace.utils.diag_lowrank.DiagLowRank` ``G = diag(d) + s·U Uᵀ`` instead of a
dense C × C matrix; log-determinant, ``J P⁻¹ Jᵀ``, square norms and samples are computed through
that structure (:class:`~laplace.utils.structured_kron.StructuredKronDecomposed`). Concrete
classes carry the largest rank kept for ``U`` (:func:`structured_kron_posterior`).
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cache, cached_property, partial
from typing import Any, ClassVar

import torch
from torch import Tensor
from typing_extensions import override

from laplace import large_output
from laplace.jacobians import HeadFeatures, Jacobian
from laplace.last_layer import HeadCurvature
from laplace.posteriors.base import ClosedForm, Posterior
from laplace.posteriors.kron import KronPosterior
from laplace.utils.diag_lowrank import DiagLowRank
from laplace.utils.structured_kron import StructuredKron

__all__ = ["StructuredKronPosterior", "large_output_structure", "structured_kron_posterior"]


def _head_variance(posterior: StructuredKronPosterior, J: HeadFeatures) -> Tensor:
    return large_output.kron_head_variance(posterior.precision, J.phi, J.n_out, J.bias)


class StructuredKronPosterior(KronPosterior):
    """Kronecker posterior with structured output factors, summed from per-point curvatures.

    The curvature is not obtained from a backend's ``kron`` (which returns dense C × C factors):
    it is summed from per-point output curvatures by the last-layer closed form
    (:mod:`laplace.large_output`).
    """

    #: Largest number of low-rank columns of an output factor kept while summing.
    max_rank: ClassVar[int | None] = None
    #: Output variances (B, C) of a linear head (the only Jacobian kind of a last layer).
    closed_forms: ClassVar[dict[type[Jacobian], ClosedForm]] = {HeadFeatures: _head_variance}
    #: The head's curvature from structured output curvatures (rank unbounded here).
    head_curvature: ClassVar[HeadCurvature | None] = ("kron", large_output.kron_curvature)

    @override
    @classmethod
    def zeros(cls, params: Sequence[Tensor], shapes: list | None = None) -> StructuredKron:
        """Zero factors: a ``DiagLowRank`` for each output dimension, dense input factors.

        The structure covers a linear head, whose blocks are ``G ⊗ A`` (weight) and ``G``
        (bias) whatever the backend's ``shapes`` (the signature of :meth:`KronPosterior.zeros`).
        """
        kfacs = []
        for p in params:
            factor = DiagLowRank.zeros(
                p.shape[0], max_rank=cls.max_rank, device=p.device, dtype=p.dtype
            )
            if p.ndim == 1:
                kfacs.append([factor])
            else:
                n_in = p[0].numel()
                kfacs.append([factor, torch.zeros(n_in, n_in, device=p.device, dtype=p.dtype)])
        return StructuredKron(kfacs)

    @override
    @staticmethod
    def batch_curvature(backend: Any, X: Any, y: Tensor, n_data: int) -> tuple[Tensor, Any]:
        """Refused: a backend's ``kron`` would build the dense C × C output factor.

        Raises:
            ValueError: Naming what computes the structured factor and the alternatives.
        """
        raise ValueError(
            "a Kronecker curvature with a diagonal-plus-low-rank output factor (many outputs, "
            "see laplace.large_output) is computed by the last-layer closed form from the "
            "head's features, which needs backend=CurvlinopsGGN or CurvlinopsEF and one head "
            f"row per data point (use feature_reduction for sequence features); "
            f"{type(backend).__name__} on these inputs would build the dense output factor. "
            "Use hessian_structure='diag' otherwise."
        )

    @cached_property
    def block_deltas(self) -> Tensor:
        """Prior precision of each block, shape (n_blocks,)."""
        sizes = self.H.block_sizes()
        starts = torch.tensor([0, *sizes[:-1]], device=self.prior_diag.device).cumsum(0)
        return self.prior_diag[starts]


@cache
def structured_kron_posterior(max_rank: int | None) -> type[StructuredKronPosterior]:
    """The :class:`StructuredKronPosterior` that keeps at most ``max_rank`` low-rank columns."""
    closed_form = partial(large_output.kron_curvature, max_rank=max_rank)
    attributes = {"max_rank": max_rank, "head_curvature": ("kron", closed_form)}
    return type("StructuredKronPosterior", (StructuredKronPosterior,), attributes)


def large_output_structure(
    structure: type[Posterior], n_outputs: int, rank: int | None
) -> type[Posterior]:
    """The posterior structure of a last layer with ``n_outputs`` outputs.

    Above :data:`~laplace.large_output.LARGE_OUTPUT_THRESHOLD` a Kronecker posterior gets
    structured output factors keeping at most ``rank`` low-rank columns; dense and diagonal
    posteriors are unchanged (their closed forms take the structured output curvatures).
    """
    if large_output.is_large_output(n_outputs) and structure is KronPosterior:
        return structured_kron_posterior(rank)
    return structure
