r"""Kronecker-factored posterior: ``P = h·(G ⊗ A) + δ`` per parameter tensor.

The curvature is a :class:`~laplace.utils.matrix.Kron` while it is summed over batches and a
:class:`~laplace.utils.matrix.KronDecomposed` once fitted; every posterior quantity then works in
the eigenbasis ``Q_G ⊗ Q_A`` of each block, where ``P`` is diagonal with spectrum
``h·λ_G λ_Aᵀ + δ``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import cached_property
from typing import Any, ClassVar

import torch
from torch import Tensor
from typing_extensions import override

from laplace.jacobians import HeadFeatures, Jacobian, LayerTrace
from laplace.kron_glm import kron_functional_variance
from laplace.last_layer import KRON_HEAD_CURVATURE, HeadCurvature, kron_head_variance
from laplace.posteriors.base import ClosedForm, Posterior
from laplace.utils.diag_lowrank import factor_from_state, factor_shape, factor_state
from laplace.utils.matrix import Kron, KronDecomposed

__all__ = ["KronAccumulator", "KronPosterior"]


def _head_variance(posterior: KronPosterior, J: HeadFeatures) -> Tensor:
    return kron_head_variance(posterior.precision, J.phi, J.n_out, J.bias)


def _trace_variance(posterior: KronPosterior, J: LayerTrace) -> Tensor | None:
    return kron_functional_variance(J.trace, posterior.precision, J.trace.create_graph)


class KronAccumulator:
    """How Kronecker factors are summed over batches, stored and saved.

    The sum is a ``Kron``; the fitted curvature its deferred eigendecomposition, a
    :class:`~laplace.utils.matrix.KronDecomposed` that keeps the factors (:meth:`factors`).
    Shared by :class:`KronPosterior` and its per-output variant (:mod:`laplace.per_output`).
    """

    @staticmethod
    def is_finite(H: Kron) -> bool:
        """Whether every factor is finite."""
        # Factors are Gram matrices Σ a aᵀ: a NaN or inf in any a shows on the diagonal, so the
        # traces decide (one short reduction per factor instead of one over every entry).
        factors = [F for block in H.kfacs for F in block]
        traces = [F.diagonal().sum() if F.ndim > 1 else F.sum() for F in factors]
        return bool(torch.stack(traces).isfinite().all())

    @classmethod
    def merge(cls, previous: Any, H: Kron, n_before: int, n_data: int) -> Kron:
        """The earlier fit's factors plus ``H``: the factors of one fit on all the data.

        The second factor of a two-factor block is normalised by the data count (the input
        factor of a Linear layer, the gradient factor of an embedding; see
        :mod:`laplace.curvature.kfac`): the earlier ones are renormalised from ``n_before`` to
        ``n_data`` points first.
        """
        scale = n_before / n_data
        factors = cls.factors(previous).kfacs
        return type(H)([[F[0], F[1] * scale] if len(F) == 2 else list(F) for F in factors]) + H

    @staticmethod
    def finalize(H: Kron, damping: bool = False) -> Any:
        """The eigendecomposition of the summed factors, computed when first needed.

        Args:
            H: The summed factors.
            damping: See :class:`~laplace.utils.matrix.KronDecomposed`.
        """
        return H.decompose(damping=damping, deferred=True)

    @staticmethod
    def factors(H: Any) -> Kron:
        """The summed factors a fitted curvature was decomposed from."""
        return H.factors

    @classmethod
    def state(cls, H: Any) -> list[list[Tensor | dict[str, Tensor]]]:
        """The summed factors, per block (a structured factor as a dict of tensors)."""
        return [[factor_state(F) for F in block] for block in cls.factors(H).kfacs]

    @classmethod
    def load_state(cls, state: Any, zeros: Kron, damping: bool = False) -> Any:
        """The fitted curvature from saved factors of the shapes of ``zeros``.

        Raises:
            ValueError: If ``state`` is not a list of lists of factors of those shapes and kinds
                (:func:`~laplace.utils.diag_lowrank.factor_from_state`).
        """
        shapes = [[tuple(F.shape) for F in block] for block in zeros.kfacs]
        if not isinstance(state, list) or not all(
            isinstance(block, list) and all(isinstance(F, Tensor | dict) for F in block)
            for block in state
        ):
            raise ValueError("state_dict['H'] must be a list of lists of Kronecker factors.")
        found = [[factor_shape(F) for F in block] for block in state]
        if found != shapes:
            raise ValueError(
                f"state_dict['H'] has Kronecker factors of shapes {found}, expected {shapes}."
            )
        kfacs = [
            [factor_from_state(F, like) for F, like in zip(block, zero_block)]
            for block, zero_block in zip(state, zeros.kfacs)
        ]
        return cls.finalize(type(zeros)(kfacs), damping=damping)


class KronPosterior(KronAccumulator, Posterior):
    """Gaussian posterior with a block-diagonal Kronecker-factored precision.

    The prior must be constant on every block (a scalar or one value per parameter tensor); the
    per-block value ``δ`` is read from ``prior_diag`` at the first entry of each block, so it stays
    differentiable. ``log det P``, ``J P⁻¹ Jᵀ``, ``Δᵀ P Δ`` and samples
    ``P^{-1/2} z`` cost a few products with the eigenvector matrices of each block; ``J P⁻¹ Jᵀ``
    of a recorded pass or of a linear head's features needs no Jacobian
    (:func:`laplace.kron_glm.kron_functional_variance`,
    :func:`laplace.last_layer.kron_head_variance`).

    Args:
        H: Fitted curvature, a ``KronDecomposed`` (a ``Kron`` is decomposed without damping).
        h_factor: Scalar likelihood factor ``h = 1/(σ²T)``.
        prior_diag: Prior precision expanded to the diagonal, shape (P,), block-wise constant.
    """

    closed_forms: ClassVar[dict[type[Jacobian], ClosedForm]] = {
        HeadFeatures: _head_variance,
        LayerTrace: _trace_variance,
    }
    head_curvature: ClassVar[HeadCurvature | None] = KRON_HEAD_CURVATURE

    def __init__(self, H: Any, h_factor: Tensor, prior_diag: Tensor) -> None:
        if isinstance(H, Kron):
            H = H.decompose()
        super().__init__(H, h_factor, prior_diag)

    @override
    @staticmethod
    def zeros(params: Sequence[Tensor], shapes: list | None = None) -> Kron:
        """Zero factors: of the backend's block ``shapes`` (``G ⊗ A`` per weight when None)."""
        device, dtype = params[0].device, params[0].dtype
        if shapes is None:
            return Kron.init_from_model(params, device, dtype)
        return Kron.zeros(shapes, device, dtype)

    @override
    @staticmethod
    def batch_curvature(backend: Any, X: Any, y: Tensor, n_data: int) -> tuple[Tensor, Kron]:
        return backend.kron(X, y, N=n_data)

    def block_sizes(self) -> list[int]:
        """Number of parameters of each block of ``H``."""
        return [math.prod(values.numel() for values in ls) for ls in self.H.eigenvalues]

    @cached_property
    def block_deltas(self) -> Tensor:
        """Prior precision of each block, shape (n_blocks,)."""
        sizes = self.block_sizes()
        starts = torch.tensor([0, *sizes[:-1]], device=self.prior_diag.device).cumsum(0)
        return self.prior_diag[starts]

    @cached_property
    def precision(self) -> KronDecomposed:
        """The posterior precision ``h·H + δ``."""
        return self.H * self.h_factor + self.block_deltas

    @override
    @property
    def log_det(self) -> Tensor:
        return self.precision.logdet()

    @override
    def square_form(self, delta: Tensor) -> Tensor:
        return delta @ self.precision.bmm(delta, exponent=1)

    @override
    def rows_variance(self, Js: Tensor) -> Tensor:
        return self.precision.inv_square_form(Js)

    @override
    def functional_covariance(self, Js: Tensor) -> Tensor:
        return self.precision.inv_square_form(Js.unsqueeze(0)).squeeze(0)

    @override
    def sample_deviations(self, n_samples: int, generator: torch.Generator | None) -> Tensor:
        z = self._standard_normal((n_samples, len(self.prior_diag)), generator)
        return self.precision.bmm(z, exponent=-0.5)
