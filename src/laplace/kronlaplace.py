r"""``KronLaplace``: Kronecker-factored (KFAC) Laplace over all weights.

Internal module; the public path is :mod:`laplace.baselaplace`.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from laplace import large_output
from laplace.base import BaseLaplace, arguments_for
from laplace.errors import check_positive_int
from laplace.outputs import IGNORE_INDEX
from laplace.parametric import ParametricLaplace
from laplace.posteriors import KronPosterior, Posterior
from laplace.posteriors.kron import kron_block_structure
from laplace.utils.enums import Likelihood
from laplace.utils.matrix import Kron, KronDecomposed

__all__ = ["KronLaplace"]


class KronLaplace(ParametricLaplace):
    r"""Laplace approximation with a Kronecker-factored (KFAC) curvature.

    Per parameter tensor the curvature is a Kronecker product, ``H_W ≈ G ⊗ A`` for a weight
    (``G`` over its outputs, ``A`` over its inputs, see :mod:`laplace.curvature.kfac`) and a
    dense ``G`` for a bias, and the posterior precision is ``P = H/(σ²T) + δ`` with ``δ`` a scalar
    or one value per parameter tensor, added to the eigenvalues of the factors:

    .. math::
        P_W^{-1} = (Q_G \otimes Q_A)\,\big(\lambda_G \lambda_A^\top/(\sigma^2 T) + \delta\big)^{-1}
        (Q_G \otimes Q_A)^\top .

    ``fit`` sums the factors over batches into ``H_facs`` (a :class:`~laplace.utils.matrix.Kron`)
    and sets ``H`` to their eigendecomposition (a :class:`~laplace.utils.matrix.KronDecomposed`),
    computed once, when the posterior is first used; tuning the prior or σ never re-factorises.
    The GLM predictive computes ``J P⁻¹ Jᵀ`` from layer inputs and output gradients
    (:mod:`laplace.kron_glm`, through :class:`~laplace.posteriors.KronPosterior`) without forming
    Jacobians.

    Every parameterised layer is supported, each parameter tensor with a block of its own (see
    :mod:`laplace.curvature.kfac_rules`): Kronecker factors for ``nn.Linear``,
    ``nn.Conv1d/2d/3d``, transformers' ``Conv1D`` and ``nn.Embedding`` (whose vocabulary factor,
    the token counts, is diagonal); the exact curvature block of every other parameter
    (LayerNorm, RMSNorm, GroupNorm and BatchNorm affine parameters, attention projections held
    as raw parameters, any module), dense up to ``backend_kwargs={"kfac_dense_limit": n}``
    entries (default :data:`~laplace.curvature.kfac_rules.KFAC_DENSE_LIMIT`) and diagonal
    above, all in one posterior. The ASDL and BackPACK backends factor Linear and convolution
    layers only and refuse other modules by name.

    **Many outputs** (a vocabulary, :mod:`laplace.large_output`): a Linear or convolution
    layer with more than :data:`~laplace.large_output.LARGE_OUTPUT_THRESHOLD` outputs keeps its
    output factor ``G = Σ g gᵀ`` as a :class:`~laplace.utils.diag_lowrank.DiagLowRank` of at
    most ``output_factor_rank`` columns (its gradient rows, folded as they come), never a dense
    C × C matrix. ``H_facs`` is then a :class:`~laplace.utils.structured_kron.StructuredKron`
    and ``H`` a :class:`~laplace.utils.structured_kron.StructuredKronDecomposed` (log-det,
    marginal likelihood, sampling, ``damping`` and online fits through the structure). This
    needs the native KFAC with a few curvature columns per data point: the Monte-Carlo Fisher
    (``backend_kwargs={"stochastic": True}``) or ``backend=CurvlinopsEF``; the exact GGN of
    that many outputs (C columns per position) is refused at the first batch. When the model
    has that many outputs the GLM predictive (C Jacobian rows per point) is refused too: use
    ``pred_type="nn"`` (one forward pass per weight sample), or
    ``subset_of_weights="last_layer"``.

    Args:
        model: See :class:`~laplace.base.BaseLaplace`.
        likelihood: See :class:`~laplace.base.BaseLaplace`.
        sigma_noise: See :class:`~laplace.base.BaseLaplace`.
        prior_precision: Scalar or one value per parameter tensor (a diagonal prior has no
            Kronecker eigenbasis and is refused).
        prior_mean: See :class:`~laplace.base.BaseLaplace`.
        temperature: See :class:`~laplace.base.BaseLaplace`.
        enable_backprop: See :class:`~laplace.base.BaseLaplace`.
        dict_key_x: See :class:`~laplace.base.BaseLaplace`.
        dict_key_y: See :class:`~laplace.base.BaseLaplace`.
        backend: See :class:`~laplace.base.BaseLaplace`; a GGN or EF backend. Its
            ``backend_kwargs`` may set ``kfac_approx`` (``"expand"`` or ``"reduce"``) and
            ``kfac_dense_limit`` (the native backends).
        damping: Mix the prior into each factor: a weight block's spectrum becomes
            ``(√h·λ_G + √δ)(√h·λ_A + √δ)ᵀ`` instead of ``h·λ_G λ_Aᵀ + δ``.
        backend_kwargs: See :class:`~laplace.base.BaseLaplace`.
        asdl_fisher_kwargs: See :class:`~laplace.base.BaseLaplace`.
        class_dim: See :class:`~laplace.base.BaseLaplace`.
        ignore_index: See :class:`~laplace.base.BaseLaplace`.
        output_factor_rank: Largest rank of the low-rank term of a large layer's output factor
            (default :data:`~laplace.large_output.OUTPUT_FACTOR_RANK`).

    Raises:
        ValueError: For a module the backend cannot Kronecker-factor (ASDL, BackPACK; a
            transformers ``Conv1D`` with more outputs than the threshold), a diagonal prior
            precision, or an ``output_factor_rank`` that is not a positive integer.
    """

    _posterior_cls = KronPosterior
    #: The backend's block shapes, large output factors marked (found once, on first use).
    _block_shapes: list | None = None
    #: The structure those shapes need (found with them).
    _block_structure: type[Posterior] | None = None

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
        backend: Any = None,
        damping: bool = False,
        backend_kwargs: dict[str, Any] | None = None,
        asdl_fisher_kwargs: dict[str, Any] | None = None,
        class_dim: int | None = None,
        ignore_index: int = IGNORE_INDEX,
        output_factor_rank: int = large_output.OUTPUT_FACTOR_RANK,
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
        if self._block_structure is None:
            shapes = self._kron_shapes()
            self._block_structure = kron_block_structure(
                structure, shapes, self.output_factor_rank
            )
        return self._block_structure

    def _zero_curvature(self) -> Kron:
        """Zero factors of the backend's blocks (it refuses modules it cannot factor)."""
        return self._posterior_cls.zeros(self._subset.curvature_params, self._kron_shapes())

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
        """The Kronecker factors summed over the data (None before :meth:`fit`).

        ``H`` is their eigendecomposition; with ``fit(override=False)`` the factors of the
        earlier fits are kept (input factors renormalised by the total data count), so the
        result equals one fit on all the data. With large output factors (see the class) a
        ``StructuredKron`` whose blocks of those layers hold a ``DiagLowRank`` first factor,
        and ``H`` a ``StructuredKronDecomposed``.
        """
        return self._posterior_cls.factors(self.H) if self._fitted else None

    @property
    def _structure_options(self) -> dict[str, Any]:
        return {"damping": self.damping}

    @property
    def posterior_precision(self) -> KronDecomposed:
        """Posterior precision ``H/(σ²T) + δ`` as a ``KronDecomposed``."""
        return self._posterior.precision
