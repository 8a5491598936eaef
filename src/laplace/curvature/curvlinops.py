"""The default backend family, named as in laplace-torch (``Curvlinops*``).

Despite the name, the GGN and EF backends compute with laplace-ng's own per-layer engine;
curvlinops supplies the exact Hessian (``CurvlinopsHessian``) and the operators of the low-rank
eigensolvers. See ``docs/backends.md``.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor, nn

from laplace.curvature.curvature import CurvatureInterface, EFInterface, GGNInterface
from laplace.curvature.engine.kfac import KFAC_APPROXIMATIONS, KfacStatistics
from laplace.curvature.engine.kfac_rules import KFAC_DENSE_LIMIT
from laplace.likelihoods.likelihood_model import LossModule
from laplace.utils.data import Inputs, batch_size_of
from laplace.utils.enums import Likelihood
from laplace.utils.errors import check_int_at_least, check_positive_int
from laplace.utils.matrix import Kron

__all__ = ["CurvlinopsEF", "CurvlinopsGGN", "CurvlinopsHessian", "CurvlinopsInterface"]

#: Number of unit vectors multiplied at once when assembling Hessian columns.
_HVP_CHUNK = 256
#: Why ``CurvlinopsHessian`` has no ``kron``.
_NO_HESSIAN_KFAC = (
    "CurvlinopsHessian has no Kronecker-factored form: KFAC approximates a GGN or a "
    "Fisher. Use backend=CurvlinopsGGN (exact GGN, or the Monte-Carlo Fisher with "
    "backend_kwargs={'stochastic': True}) or backend=CurvlinopsEF (empirical Fisher)."
)


class CurvlinopsInterface(CurvatureInterface):
    """Base of the default backends.

    Takes the arguments of ``CurvatureInterface``, and:

    Args:
        kfac_approx: Weight-sharing approximation of KFAC (``kron``): ``"expand"``
            (default) or ``"reduce"``; a ``backend_kwargs`` entry (keyword only).
        kfac_dense_limit: Largest parameter outside Linear, convolution and embedding layers
            (normalisation layers, any other module) whose ``kron`` block is its exact dense
            block; larger ones get the exact diagonal. Default
            ``KFAC_DENSE_LIMIT``; a ``backend_kwargs`` entry
            (keyword only).

    Raises:
        ValueError: For an unknown ``kfac_approx`` or a ``kfac_dense_limit`` that is not a
            non-negative integer.
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
        kfac_dense_limit: int = KFAC_DENSE_LIMIT,
    ) -> None:
        if kfac_approx not in KFAC_APPROXIMATIONS:
            raise ValueError(
                f"kfac_approx must be one of {KFAC_APPROXIMATIONS}, got {kfac_approx!r}."
            )
        check_int_at_least(kfac_dense_limit, "kfac_dense_limit", 0)
        super().__init__(model, likelihood, last_layer, subnetwork_indices, dict_key_x, dict_key_y)
        self.kfac_approx = kfac_approx
        self.kfac_dense_limit = kfac_dense_limit


class CurvlinopsGGN(CurvlinopsInterface, GGNInterface):
    """Exact GGN (or Monte-Carlo Fisher with ``stochastic=True``); the default backend.

    Computed by laplace-ng's per-layer engine (faster than curvlinops' operators, see
    ``docs/backends.md``); curvlinops' ``GGNLinearOperator`` and ``FisherMCLinearOperator``
    serve the low-rank Laplace's Lanczos and LOBPCG eigensolvers.

    Takes the arguments of ``CurvatureInterface``, and:

    Args:
        stochastic: See ``GGNInterface``.
        num_samples: See ``GGNInterface``; ``full``, ``diag`` and ``kron`` also take
            ``mc_samples=k`` per call, as in laplace-torch.
        kfac_approx: See [`CurvlinopsInterface`][laplace.curvature.CurvlinopsInterface].
        kfac_dense_limit: See [`CurvlinopsInterface`][laplace.curvature.CurvlinopsInterface].
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
        kfac_dense_limit: int = KFAC_DENSE_LIMIT,
    ) -> None:
        super().__init__(
            model,
            likelihood,
            last_layer,
            subnetwork_indices,
            dict_key_x,
            dict_key_y,
            kfac_approx=kfac_approx,
            kfac_dense_limit=kfac_dense_limit,
        )
        self.stochastic = stochastic
        self.num_samples = check_positive_int(num_samples, "num_samples")


class CurvlinopsEF(CurvlinopsInterface, EFInterface):
    """Empirical Fisher of per-sample loss gradients, by the per-layer engine.

    curvlinops' ``EFLinearOperator`` serves the low-rank Lanczos and LOBPCG eigensolvers.
    """


class CurvlinopsHessian(CurvlinopsInterface):
    """Exact Hessian of the summed library loss w.r.t. the parameters.

    ``full`` and ``diag`` multiply ``curvlinops.HessianLinearOperator`` with chunks of unit
    vectors: one Hessian-vector product per parameter (per selected entry with
    ``subnetwork_indices``; the P × P matrix is never formed). The operator differentiates the
    likelihood's own loss, so outputs with extra dimensions and ``ignore_index`` work as elsewhere.
    """

    def _selected_columns(self, x: Inputs, y: Tensor) -> tuple[Tensor, Iterator[Tensor]]:
        """The summed loss and chunks of Hessian columns, rows and columns of the subnetwork.

        The chunk starting at entry ``s`` of the selected parameters holds their diagonal
        entries on its diagonal ``-s``.
        """
        from curvlinops import HessianLinearOperator  # imports SciPy: on first use

        operator = HessianLinearOperator(
            self.model,
            LossModule(self.fit_likelihood, reduction="sum"),
            self.params,
            [(x, y)],
            check_deterministic=False,
            batch_size_fn=lambda X: batch_size_of(X, self.dict_key_x),
        )
        p, n_params = self.params[0], operator.shape[0]
        selected = self._select(torch.arange(n_params, device=p.device))

        def columns() -> Iterator[Tensor]:
            for start in range(0, len(selected), _HVP_CHUNK):
                chunk = selected[start : start + _HVP_CHUNK]
                unit = torch.zeros(n_params, len(chunk), dtype=p.dtype, device=p.device)
                unit[chunk, torch.arange(len(chunk), device=p.device)] = 1.0
                yield (operator @ unit)[selected]

        with torch.no_grad():
            loss = self.fit_likelihood.loss(self.model(x), y)
        return loss, columns()

    def kron(self, x: Inputs, y: Tensor, N: int, **kwargs: object) -> tuple[Tensor, Kron]:
        """KFAC approximates a GGN or Fisher, not the Hessian: always refused.

        Raises:
            NotImplementedError: Always; use ``CurvlinopsGGN`` (exact GGN, or the MC Fisher with
                ``stochastic=True``) or ``CurvlinopsEF`` (empirical Fisher) for KFAC.
        """
        raise NotImplementedError(_NO_HESSIAN_KFAC)

    def kron_statistics(
        self, x: Inputs, y: Tensor, N: int, **kwargs: object
    ) -> tuple[Tensor, Kron, KfacStatistics]:
        """Refused as ``kron``.

        Raises:
            NotImplementedError: Always.
        """
        raise NotImplementedError(_NO_HESSIAN_KFAC)

    def full(self, x: Inputs, y: Tensor, **kwargs: object) -> tuple[Tensor, Tensor]:
        """As ``CurvatureInterface.full``: the dense Hessian of the summed batch loss.

        Keyword arguments are accepted and ignored.
        """
        loss, columns = self._selected_columns(x, y)
        return loss, torch.cat(list(columns), dim=1).detach()

    def diag(self, x: Inputs, y: Tensor, **kwargs: object) -> tuple[Tensor, Tensor]:
        """As ``CurvatureInterface.diag``: the Hessian's diagonal.

        Keyword arguments are accepted and ignored.
        """
        loss, columns = self._selected_columns(x, y)
        diagonals = [block.diagonal(-_HVP_CHUNK * i).clone() for i, block in enumerate(columns)]
        return loss, torch.cat(diagonals).detach()
