r"""``KronLaplace``: Kronecker-factored (KFAC) Laplace over all weights.

Internal module; the public path is :mod:`laplace.baselaplace`.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from laplace.base import BaseLaplace, arguments_for
from laplace.curvature.kfac import check_kfac_support
from laplace.parametric import ParametricLaplace
from laplace.posteriors import KronPosterior
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

    Supported layers: ``nn.Linear`` and ``nn.Conv1d/2d/3d`` (ungrouped), also inside larger
    modules. Any other module owning a trainable parameter (normalisation layers, embeddings,
    attention projections held as raw parameters, ...) is refused with its name; freeze it or
    use a diagonal or full structure.

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
            ``backend_kwargs`` may set ``kfac_approx`` (``"expand"`` or ``"reduce"``).
        damping: Mix the prior into each factor: a weight block's spectrum becomes
            ``(√h·λ_G + √δ)(√h·λ_A + √δ)ᵀ`` instead of ``h·λ_G λ_Aᵀ + δ``.
        backend_kwargs: See :class:`~laplace.base.BaseLaplace`.
        asdl_fisher_kwargs: See :class:`~laplace.base.BaseLaplace`.

    Raises:
        ValueError: For a module KFAC cannot model or a diagonal prior precision.
    """

    _posterior_cls = KronPosterior

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
    ) -> None:
        self.damping = damping
        BaseLaplace.__init__(self, **arguments_for(BaseLaplace.__init__, locals()))

    def _init_state(self) -> None:
        super()._init_state()
        if self.params is not None:
            check_kfac_support(self.model, self.params)

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
        result equals one fit on all the data.
        """
        return self._posterior_cls.factors(self.H) if self._fitted else None

    @property
    def _structure_options(self) -> dict[str, Any]:
        return {"damping": self.damping}

    @property
    def posterior_precision(self) -> KronDecomposed:
        """Posterior precision ``H/(σ²T) + δ`` as a ``KronDecomposed``."""
        return self._posterior.precision
