r"""``KronLaplace``: Kronecker-factored (KFAC) Laplace over all weights.

Internal module; the public path is [`laplace.baselaplace`][laplace.baselaplace].
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor, nn

from laplace.core.base_laplace import BaseLaplace, arguments_for
from laplace.core.passes.eigenvalue_correction import EigenvalueCorrectedSum
from laplace.curvature import CurvatureInterface
from laplace.parametric.parametric_laplace import ParametricLaplace
from laplace.structures import KronPosterior, Posterior, large_output
from laplace.structures.kronecker import (
    EKFACPosterior,
    kron_block_structure,
)
from laplace.utils.enums import HessianStructure, Likelihood, SubsetOfWeights
from laplace.utils.errors import check_positive_int
from laplace.utils.matrix import Kron
from laplace.utils.outputs import IGNORE_INDEX

__all__ = ["EKFACLaplace", "KronLaplace"]


class KronLaplace(ParametricLaplace):
    r"""Laplace approximation with a Kronecker-factored (KFAC) curvature.

    Per parameter tensor the curvature is a Kronecker product, ``H_W ≈ G ⊗ A`` for a weight
    (``G`` over its outputs, ``A`` over its inputs, see ``laplace.curvature.engine.kfac``) and a
    dense ``G`` for a bias, and the posterior precision is ``P = H/(σ²T) + δ`` with ``δ`` a scalar
    or one value per parameter tensor, added to the eigenvalues of the factors:

    $$
    P_W^{-1} = (Q_G \otimes Q_A)\,\big(\lambda_G \lambda_A^\top/(\sigma^2 T) + \delta\big)^{-1}
    (Q_G \otimes Q_A)^\top .
    $$

    ``fit`` sums the factors over batches into ``H_facs`` (a [`Kron`][laplace.utils.matrix.Kron])
    and sets ``H`` to their eigendecomposition (a ``KronDecomposed``),
    computed once, when the posterior is first used; tuning the prior or σ never re-factorises.
    ``posterior_precision`` is ``H/(σ²T) + δ`` as a ``KronDecomposed``.
    The GLM predictive computes ``J P⁻¹ Jᵀ`` from layer inputs and output gradients
    (``laplace.structures.kron_glm``, through ``KronPosterior``)
    without forming Jacobians.

    Every parameterised layer has a block: Kronecker factors for Linear, convolution,
    transformers' ``Conv1D`` and embedding layers, the exact (dense or diagonal) block of any
    other parameter (docs: Backends, "KFAC over every layer"). A layer with more outputs than
    ``LARGE_OUTPUT_THRESHOLD`` keeps its output factor as a
    diagonal plus a rank-``output_factor_rank`` term, never a dense C × C matrix; it needs the
    Monte-Carlo or empirical Fisher, and the GLM predictive is refused for it (docs: Large output
    dimensions).

    Arguments not listed are those of [`BaseLaplace`][laplace.core.base_laplace.BaseLaplace].

    Args:
        prior_precision: Scalar or one value per parameter tensor (a diagonal prior has no
            Kronecker eigenbasis and is refused).
        backend: A GGN or EF backend. Its ``backend_kwargs`` may set ``kfac_approx``
            (``"expand"`` or ``"reduce"``) and ``kfac_dense_limit`` (the native backends).
        damping: Mix the prior into each factor: a weight block's spectrum becomes
            ``(√h·λ_G + √δ)(√h·λ_A + √δ)ᵀ`` instead of ``h·λ_G λ_Aᵀ + δ``.
        output_factor_rank: Largest rank of the low-rank term of a large layer's output factor
            (default ``OUTPUT_FACTOR_RANK``).

    Raises:
        ValueError: For a module the backend cannot Kronecker-factor (ASDL, BackPACK; a
            transformers ``Conv1D`` with more outputs than the threshold), a diagonal prior
            precision, or an ``output_factor_rank`` that is not a positive integer.
    """

    _key = (SubsetOfWeights.ALL, HessianStructure.KRON)

    _posterior_cls = KronPosterior
    #: The backend's block shapes, large output factors marked (found once, on first use).
    _block_shapes: list | None = None

    def __init__(
        self,
        model: nn.Module,
        likelihood: Likelihood | str,
        sigma_noise: float | Tensor = 1.0,
        prior_precision: float | Tensor = 1.0,
        prior_mean: float | Tensor = 0.0,
        temperature: float = 1.0,
        enable_backprop: bool = False,
        dict_key_x: str = "input_ids",
        dict_key_y: str = "labels",
        backend: type[CurvatureInterface] | CurvatureInterface | None = None,
        damping: bool = False,
        backend_kwargs: Mapping[str, object] | None = None,
        asdl_fisher_kwargs: Mapping[str, object] | None = None,
        class_dim: int | None = None,
        ignore_index: int = IGNORE_INDEX,
        output_factor_rank: int = large_output.OUTPUT_FACTOR_RANK,
        dtype: torch.dtype | None = None,
    ) -> None:
        self.damping = damping
        self.output_factor_rank = check_positive_int(output_factor_rank, "output_factor_rank")
        BaseLaplace.__init__(self, **arguments_for(BaseLaplace.__init__, locals()))

    def _kron_shapes(self) -> list:
        """The backend's block shapes, large output factors marked (refuses what it cannot)."""
        if self._block_shapes is None:
            threshold = large_output.LARGE_OUTPUT_THRESHOLD
            self._block_shapes = self.backend.kron_shapes(low_rank_above=threshold)
        return self._block_shapes

    def _own_structure(self) -> type[Posterior]:
        """Kronecker factors, with structured output factors for layers with many outputs."""
        structure = super()._own_structure()
        if not self._subset.resolved:
            return structure
        return kron_block_structure(structure, self._kron_shapes(), self.output_factor_rank)

    def _zero_curvature(self) -> Kron:
        """Zero factors of the backend's blocks (it refuses modules it cannot factor)."""
        return self._posterior_cls.zeros(self._subset.curvature_params, self._kron_shapes())

    def _fit_bytes(self) -> int:
        """Bytes of a fit of the backend's blocks, from their shapes alone."""
        return self._posterior_cls.fit_bytes(
            self._subset.curvature_params, shapes=self._kron_shapes()
        )

    @BaseLaplace.prior_precision.setter
    def prior_precision(self, value: float | Tensor) -> None:
        """Set a scalar or layer-wise prior precision (a diagonal one is refused)."""
        BaseLaplace.prior_precision.fset(self, value)
        n = len(self.prior_precision)
        if self.n_layers is not None and n != 1 and n != self.n_layers:
            raise ValueError(
                f"KronLaplace needs a scalar or layer-wise prior precision (length 1 or "
                f"n_layers={self.n_layers}), got length {n}: a diagonal prior has no Kronecker "
                "eigenbasis; use hessian_structure='diag' or 'full' for one."
            )

    @property
    def H_facs(self) -> Kron | None:
        """The Kronecker factors summed over the data (None before ``fit``).

        ``H`` is their eigendecomposition; with ``fit(override=False)`` the factors of the
        earlier fits are kept (input factors renormalised by the total data count), so the
        result equals one fit on all the data. With large output factors (see the class) a
        ``StructuredKron`` whose blocks of those layers hold a ``DiagLowRank`` first factor,
        and ``H`` a ``StructuredKronDecomposed``.
        """
        return self._posterior_cls.factors(self.H) if self._fitted else None


class EKFACLaplace(KronLaplace):
    r"""Laplace approximation with an eigenvalue-corrected KFAC (EKFAC) curvature.

    KFAC's Kronecker eigenbasis ``Q = Q_G ⊗ Q_A`` per block, with the eigenvalues
    ``λ_G λ_Aᵀ`` replaced by ``diag(Qᵀ H Q)`` of the block's exact curvature (George et al.,
    2018): a closer Frobenius fit than KFAC's at the cost of one more tensor of each
    weight's shape. ``fit`` keeps the layers' inputs and output gradients of its pass up to
    ``EKFAC_CACHE_BYTES`` to project them once the eigenbasis is known, and makes one more
    pass over the data where they do not fit. Everything else is
    ``KronLaplace``'s: the prior, σ, the temperature and damping act on the corrected
    eigenvalues (a diagonal prior through its diagonal in the eigenbasis,
    ``EKFACPosterior.precision``); ``H`` is a ``KronDecomposed`` with
    ``corrections``, ``H_facs`` the summed factors; blocks without a Kronecker rule stay
    exact. It needs the native KFAC (``CurvlinopsGGN``, ``CurvlinopsEF``, the default) and
    refuses layers whose output factor would be kept low rank (many outputs).

    Arguments are those of [`KronLaplace`][laplace.baselaplace.KronLaplace].

    Example:
        >>> la = Laplace(model, "classification", "all", hessian_structure="ekfac")
        >>> la.fit(train_loader)
    """

    _key = (SubsetOfWeights.ALL, HessianStructure.EKFAC)

    _posterior_cls = EKFACPosterior
    _curvature_pass = EigenvalueCorrectedSum

    @BaseLaplace.prior_precision.setter
    def prior_precision(self, value: float | Tensor) -> None:
        """Set a scalar, layer-wise or diagonal prior precision (see ``EKFACPosterior``)."""
        BaseLaplace.prior_precision.fset(self, value)

    def _own_structure(self) -> type[Posterior]:
        """EKFAC's posterior.

        Raises:
            ValueError: If the backend would keep an output factor low rank (many outputs),
                naming the threshold and the alternative.
        """
        if self._subset.resolved:
            low_rank = kron_block_structure(KronPosterior, self._kron_shapes(), 1)
            if low_rank is not KronPosterior:
                raise ValueError(
                    "hessian_structure='ekfac' keeps every output factor dense; a layer has "
                    f"more than LARGE_OUTPUT_THRESHOLD={large_output.LARGE_OUTPUT_THRESHOLD} "
                    "outputs. Use hessian_structure='kron' (diagonal-plus-low-rank output "
                    "factors) for it."
                )
        return EKFACPosterior
