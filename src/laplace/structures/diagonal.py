"""Diagonal posterior: ``P = h·diag(H) + diag(p₀)`` stored as a vector.

A linear head ``fₙ = W φₙ + b`` (``Jₙ = [I_C ⊗ φₙᵀ, I_C]``, ``laplace.structures.last_layer``)
has the diagonal ``Σₙ diag(Mₙ) ⊗ φₙ²``, ``Σₙ diag(Mₙ)`` of its curvature and ``Jₙ diag(σ²) Jₙᵀ`` in
closed form from the features.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cached_property
from typing import ClassVar

import torch
from torch import Tensor
from typing_extensions import override

from laplace.curvature.engine.kfac_rules import plan_blocks
from laplace.curvature.engine.per_sample import PerSampleTrace
from laplace.structures import large_output
from laplace.structures.jacobians import HeadFeatures, Jacobian, LayerTrace
from laplace.structures.kron_glm import layerwise_variance
from laplace.structures.posterior import ClosedForm, Posterior
from laplace.utils.diag_lowrank import DiagLowRankBatch

__all__ = [
    "DiagonalPosterior",
    "diag_functional_variance",
    "diag_head_curvature",
    "diag_head_variance",
]


def diag_head_curvature(
    phi: Tensor, M: Tensor | DiagLowRankBatch, bias: bool, n_data: int, factor: float
) -> Tensor:
    """Diagonal of ``Σₙ Jₙᵀ Mₙ Jₙ`` of a linear head, shape (P,).

    Args:
        phi: Features, shape (N, D).
        M: Output-space curvatures, (N, C, C) or diagonal plus low rank.
        bias: Whether the head has a bias.
        n_data: Unused (the signature of ``HeadCurvature``).
        factor: Unused, as ``n_data``.
    """
    m = M.diagonal() if isinstance(M, DiagLowRankBatch) else M.diagonal(dim1=1, dim2=2)
    parts = [(m.T @ phi.square()).flatten()]
    if bias:
        parts.append(m.sum(0))
    return torch.cat(parts)


def diag_head_variance(posterior: DiagonalPosterior, J: HeadFeatures) -> Tensor:
    """``Jₙ diag(σ²) Jₙᵀ`` from the posterior variances σ² (P,): features (B, D) → (B, C, C).

    The result is diagonal in the outputs; above the large-output threshold only the variances
    (B, C).
    """
    variance, n_w = posterior.variance, J.n_out * J.phi.shape[1]
    f_var = J.phi.square() @ variance[:n_w].reshape(J.n_out, -1).T
    if J.bias:
        f_var = f_var + variance[n_w:]
    return f_var if large_output.is_large_output(J.n_out) else torch.diag_embed(f_var)


def diag_functional_variance(
    trace: PerSampleTrace, precision: Tensor, create_graph: bool = False
) -> Tensor | None:
    """``J P⁻¹ Jᵀ`` (B, C, C) of a diagonal precision (P,) from a recorded forward pass.

    The layer-wise closed forms (``laplace.structures.kron_glm.layerwise_variance``) with
    identity eigenvectors and the inverse precision of each entry.

    Returns:
        The covariances, or None for a subnetwork or when a layer does not see the data points
        along its first dimension (the caller then falls back to Jacobians).
    """
    if trace.engine.indices is not None:  # a subnetwork: blocks are not whole tensors
        return None
    params = trace.engine.needed
    plan = plan_blocks(trace.engine)
    blocks = precision.split([p.numel() for p in params])

    def block(i: int) -> tuple[list[Tensor | None], Tensor]:
        inv = blocks[i].reciprocal()
        if plan[i].kind == "kron":
            return [None, None], inv.reshape(params[i].shape[0], -1)
        return [None], inv

    return layerwise_variance(trace, block, create_graph)


def _trace_variance(posterior: DiagonalPosterior, J: LayerTrace) -> Tensor | None:
    return diag_functional_variance(J.trace, posterior.precision, J.trace.create_graph)


class DiagonalPosterior(Posterior):
    """Gaussian posterior with independent parameters; every operation is O(P) per row.

    The functional variance of a recorded pass needs no Jacobian
    (``diag_functional_variance``).
    """

    backend_route = "diag"
    closed_forms: ClassVar[dict[type[Jacobian], ClosedForm]] = {
        HeadFeatures: diag_head_variance,
        LayerTrace: _trace_variance,
    }
    rowless_kinds = frozenset({HeadFeatures})
    head_curvature = staticmethod(diag_head_curvature)

    @override
    @classmethod
    def fit_bytes(cls, params: Sequence[Tensor], **options: object) -> int:
        """The summed diagonal (P,)."""
        return sum(p.numel() for p in params) * params[0].element_size()

    @override
    def held_bytes(
        self, n_rows: int, n_outputs: int, kind: type[Jacobian], joint: bool = False
    ) -> int:
        """The diagonal, ``h·H``, the precision and the variance (P,) each."""
        n_params, itemsize = len(self.prior_diag), self.itemsize
        return 4 * n_params * itemsize

    @override
    @staticmethod
    def zeros(params: Sequence[Tensor]) -> Tensor:
        n_params = sum(p.numel() for p in params)
        return params[0].new_zeros(n_params)

    prior_free = ("scaled",)

    @cached_property
    def scaled(self) -> Tensor:
        """(P,) ``h·H``, without the prior."""
        return self.h_factor * self.H

    @cached_property
    def precision(self) -> Tensor:
        """(P,) diagonal posterior precision."""
        return self.scaled + self.prior_diag

    @cached_property
    def variance(self) -> Tensor:
        """(P,) diagonal posterior variance."""
        return self.precision.reciprocal()

    @property
    def scale(self) -> Tensor:
        """(P,) posterior standard deviations."""
        return self.variance.sqrt()

    @override
    @property
    def log_det(self) -> Tensor:
        return self.precision.log().sum()

    @override
    def square_form(self, delta: Tensor) -> Tensor:
        return (delta.square() * self.precision).sum()

    @override
    def rows_variance(self, Js: Tensor) -> Tensor:
        scaled = Js * self.variance
        return scaled @ Js.transpose(1, 2)

    @override
    def sample_deviations(self, n_samples: int, generator: torch.Generator | None) -> Tensor:
        z = self._standard_normal((n_samples, len(self.prior_diag)), generator)
        return z * self.scale
