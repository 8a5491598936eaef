"""The default backend family, named as in laplace-torch (``Curvlinops*``).

Dense and diagonal GGN/EF, Jacobians and per-sample gradients come from the native engine
(:mod:`laplace.curvature.per_sample`), which is far faster than materialising curvlinops'
matrix-free operators column by column. KFAC (:mod:`laplace.curvature.kfac`) reuses its
recorded forward pass and needs only gradients w.r.t. layer outputs, where curvlinops'
``KFACLinearOperator`` also forms weight gradients and loops over samples for the square roots
of the output Hessians. curvlinops is used where it is the right tool: the exact Hessian, which
has no per-sample outer-product structure, is assembled from its Hessian-vector products.
"""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import Any

import torch
from curvlinops import HessianLinearOperator
from torch import Tensor, nn

from laplace.curvature.curvature import CurvatureInterface, EFInterface, GGNInterface
from laplace.curvature.kfac import KFAC_APPROXIMATIONS
from laplace.data import Inputs, batch_size_of
from laplace.errors import check_positive_int
from laplace.utils.enums import Likelihood

__all__ = ["CurvlinopsEF", "CurvlinopsGGN", "CurvlinopsHessian", "CurvlinopsInterface"]

#: Number of unit vectors multiplied at once when assembling Hessian columns.
_HVP_CHUNK = 256


class CurvlinopsInterface(CurvatureInterface):
    """Base of the default backends.

    Args:
        model: See :class:`CurvatureInterface`.
        likelihood: See :class:`CurvatureInterface`.
        last_layer: See :class:`CurvatureInterface`.
        subnetwork_indices: See :class:`CurvatureInterface`.
        dict_key_x: See :class:`CurvatureInterface`.
        dict_key_y: See :class:`CurvatureInterface`.
        kfac_approx: Weight-sharing approximation of KFAC (:meth:`kron`): ``"expand"``
            (default) or ``"reduce"``; a ``backend_kwargs`` entry (keyword only).

    Raises:
        ValueError: For an unknown ``kfac_approx``.
    """

    def __init__(
        self,
        model: nn.Module,
        likelihood: Likelihood | str,
        last_layer: bool = False,
        subnetwork_indices: torch.LongTensor | None = None,
        dict_key_x: str = "input_ids",
        dict_key_y: str = "labels",
        *,
        kfac_approx: str = "expand",
    ) -> None:
        if kfac_approx not in KFAC_APPROXIMATIONS:
            raise ValueError(
                f"kfac_approx must be one of {KFAC_APPROXIMATIONS}, got {kfac_approx!r}."
            )
        super().__init__(model, likelihood, last_layer, subnetwork_indices, dict_key_x, dict_key_y)
        self.kfac_approx = kfac_approx


class CurvlinopsGGN(CurvlinopsInterface, GGNInterface):
    """Exact GGN (or Monte-Carlo Fisher with ``stochastic=True``); the default backend.

    Args:
        model: See :class:`CurvatureInterface`.
        likelihood: See :class:`CurvatureInterface`.
        last_layer: See :class:`CurvatureInterface`.
        subnetwork_indices: See :class:`CurvatureInterface`.
        dict_key_x: See :class:`CurvatureInterface`.
        dict_key_y: See :class:`CurvatureInterface`.
        stochastic: See :class:`GGNInterface`.
        num_samples: See :class:`GGNInterface`; ``full``, ``diag`` and ``kron`` also take
            ``mc_samples=k`` per call, as in laplace-torch.
        kfac_approx: See :class:`CurvlinopsInterface`.
    """

    def __init__(
        self,
        model: nn.Module,
        likelihood: Likelihood | str,
        last_layer: bool = False,
        subnetwork_indices: torch.LongTensor | None = None,
        dict_key_x: str = "input_ids",
        dict_key_y: str = "labels",
        stochastic: bool = False,
        num_samples: int = 1,
        *,
        kfac_approx: str = "expand",
    ) -> None:
        super().__init__(
            model,
            likelihood,
            last_layer,
            subnetwork_indices,
            dict_key_x,
            dict_key_y,
            kfac_approx=kfac_approx,
        )
        self.stochastic = stochastic
        self.num_samples = check_positive_int(num_samples, "num_samples")


class CurvlinopsEF(CurvlinopsInterface, EFInterface):
    """Empirical Fisher of per-sample loss gradients."""


class CurvlinopsHessian(CurvlinopsInterface):
    """Exact Hessian of the summed library loss w.r.t. the parameters.

    Both ``full`` and ``diag`` multiply ``curvlinops.HessianLinearOperator`` with unit vectors
    (chunks of identity columns), so each costs one Hessian-vector product per parameter; with
    ``subnetwork_indices`` only the selected columns are formed, never the P × P matrix.
    """

    def _selected_columns(self, x: Inputs, y: Tensor) -> tuple[Tensor, Any]:
        """Loss and a generator of (column indices, Hessian columns restricted to the rows)."""
        data_kwargs = {}
        if isinstance(x, MutableMapping):
            data_kwargs["batch_size_fn"] = lambda xx: batch_size_of(xx, self.dict_key_x)
        operator = HessianLinearOperator(
            self.model,
            self.lossfunc,
            self.params,
            [(x, self.fit_likelihood.loss_targets(y, self.params[0].dtype))],
            check_deterministic=False,
            **data_kwargs,
        )
        p = self.params[0]
        n_params = operator.shape[0]
        selected = (
            torch.arange(n_params, device=p.device)
            if self.subnetwork_indices is None
            else self.subnetwork_indices.to(p.device)
        )

        def columns():
            for start in range(0, len(selected), _HVP_CHUNK):
                chunk = selected[start : start + _HVP_CHUNK]
                unit = torch.zeros(n_params, len(chunk), dtype=p.dtype, device=p.device)
                unit[chunk, torch.arange(len(chunk), device=p.device)] = 1.0
                yield start, self.factor * (operator @ unit)[selected]

        with torch.no_grad():
            loss = self.fit_likelihood.loss(self.model(x), y)
        return loss, columns()

    def kron(self, x: Inputs, y: Tensor, N: int, **kwargs: Any) -> tuple[Tensor, Any]:
        """KFAC approximates a GGN or Fisher, not the Hessian: always refused.

        Raises:
            NotImplementedError: Always; use ``CurvlinopsGGN`` (exact GGN, or the MC Fisher with
                ``stochastic=True``) or ``CurvlinopsEF`` (empirical Fisher) for KFAC.
        """
        raise NotImplementedError(
            "CurvlinopsHessian has no Kronecker-factored form: KFAC approximates a GGN or a "
            "Fisher. Use backend=CurvlinopsGGN (exact GGN, or the Monte-Carlo Fisher with "
            "backend_kwargs={'stochastic': True}) or backend=CurvlinopsEF (empirical Fisher)."
        )

    def full(self, x: Inputs, y: Tensor, **kwargs: Any) -> tuple[Tensor, Tensor]:
        """Dense Hessian of the summed batch loss.

        Args:
            x: Inputs, shape (B, ...), or a mapping passed whole to the model.
            y: Targets, shape (B, ...).
            **kwargs: Ignored (accepted for interface compatibility).

        Returns:
            The summed batch loss and the Hessian of shape (P, P).
        """
        loss, columns = self._selected_columns(x, y)
        return loss, torch.cat([block for _, block in columns], dim=1).detach()

    def diag(self, x: Inputs, y: Tensor, **kwargs: Any) -> tuple[Tensor, Tensor]:
        """Diagonal of the Hessian of the summed batch loss.

        Args:
            x: Inputs, shape (B, ...), or a mapping passed whole to the model.
            y: Targets, shape (B, ...).
            **kwargs: Ignored (accepted for interface compatibility).

        Returns:
            The summed batch loss and the Hessian diagonal of shape (P,).
        """
        loss, columns = self._selected_columns(x, y)
        parts = []
        for start, block in columns:
            rows = torch.arange(start, start + block.shape[1], device=block.device)
            parts.append(block[rows, torch.arange(block.shape[1], device=block.device)])
        return loss, torch.cat(parts).detach()
