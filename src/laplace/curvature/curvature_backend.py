"""The contract between a curvature backend and the parts that call it (a structural type).

Every [`CurvatureInterface`][laplace.curvature.CurvatureInterface] satisfies ``CurvatureBackend``;
``CurvatureOptions`` and ``KronOptions`` name the keyword arguments the curvature routes take.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, TypedDict

import torch
from torch import Tensor, nn

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from laplace.curvature.engine.capture import Columns
    from laplace.curvature.engine.kfac import KfacStatistics
    from laplace.curvature.engine.per_sample import PerSampleEngine, PerSampleTrace
    from laplace.likelihoods.likelihood_model import LikelihoodModel
    from laplace.utils.data import Inputs
    from laplace.utils.matrix import Kron

__all__ = ["CurvatureBackend", "CurvatureOptions", "KronOptions"]


class CurvatureOptions(TypedDict, total=False):
    """Keyword arguments of ``full``, ``diag`` and ``kron_eigenvalues``.

    Attributes:
        N: Number of data points of the whole data set; accepted and unused (as in
            laplace-torch).
        mc_samples: Monte-Carlo samples per data point (the stochastic GGN only).
        into: A running sum of earlier batches' curvature that ``full`` and ``diag`` of a
            backend with ``native_engine`` add the batch to in place, and return.
    """

    N: int
    mc_samples: int
    into: Tensor


class KronOptions(TypedDict, total=False):
    """Keyword arguments of ``kron`` and ``kron_statistics`` (which take ``N`` by name).

    Attributes:
        mc_samples: Monte-Carlo samples per data point (the stochastic GGN only).
        kfac_approx: Weight-sharing approximation, ``"expand"`` or ``"reduce"``.
        low_rank_above: Keep the output factors of layers with more outputs diagonal plus low
            rank (``kron`` only).
        output_factor_rank: The largest rank of those output factors.
        into: A running sum of earlier batches' factors that the native KFAC adds the batch
            to in place, and returns (``kron`` of a backend with ``native_engine`` only).
    """

    mc_samples: int
    kfac_approx: str
    low_rank_above: int | None
    output_factor_rank: int | None
    into: Kron


class CurvatureBackend(Protocol):
    """What the structures, fit passes and subsets read from and call on a curvature backend.

    Shapes: inputs ``x`` (B, ...) (or a mapping passed whole to the model), targets ``y``
    (B, ...), outputs ``f`` (B, C), P the number of parameters the backend covers (the
    subnetwork's K where it has one). Every curvature is summed over the batch, and returned
    with the summed batch loss.
    """

    @property
    def model(self) -> nn.Module:
        """The network (a feature extractor for a last-layer backend)."""
        ...

    @property
    def params(self) -> list[nn.Parameter]:
        """The trainable parameters the backend covers, in model order."""
        ...

    @property
    def engine(self) -> PerSampleEngine:
        """The native per-sample engine over ``params``."""
        ...

    @property
    def fit_likelihood(self) -> LikelihoodModel:
        """The likelihood the curvature and the loss are computed with."""
        ...

    @property
    def lossfunc(self) -> nn.Module:
        """The likelihood's summed torch loss."""
        ...

    @property
    def factor(self) -> float:
        """``lossfunc`` times ``factor`` is the library's loss (½ for regression, else 1)."""
        ...

    @property
    def kfac_approx(self) -> str:
        """Weight-sharing approximation of ``kron``, ``"expand"`` or ``"reduce"``."""
        ...

    @property
    def kfac_dense_limit(self) -> int:
        """Largest exact ``kron`` block kept dense."""
        ...

    @property
    def separable_columns(self) -> bool:
        """Whether each row's curvature columns are its own (the exact GGN)."""
        ...

    @property
    def dict_key_x(self) -> str:
        """Key of the input tensor when the model takes a mapping."""
        ...

    def trace(self, x: Inputs, create_graph: bool = False) -> PerSampleTrace:
        """One recorded forward pass of the native engine over ``x``."""
        ...

    def jacobians(self, x: Inputs, enable_backprop: bool = False) -> tuple[Tensor, Tensor]:
        """Jacobians ``Js`` (B, C, P) of the outputs and the outputs ``f`` (B, C)."""
        ...

    def batch_loss(self, f: Tensor, y: Tensor) -> Tensor:
        """Summed library loss of a batch with outputs ``f`` (B, C), detached."""
        ...

    def curvature_columns(
        self,
        f: Tensor,
        y: Tensor,
        generator: torch.Generator | None = None,
        mc_samples: int | None = None,
        separate_positions: bool = True,
    ) -> Columns:
        """Output-space columns (K, B, ...) whose per-sample outer products sum to the curvature.

        Shapes as in ``CurvatureInterface.curvature_columns``.
        """
        ...

    def row_columns(
        self,
        f: Tensor,
        y: Tensor,
        generator: torch.Generator | None = None,
        mc_samples: int | None = None,
    ) -> Tensor:
        """The family's columns (R, C, K) of rows ``f`` (R, C) with targets ``y``."""
        ...

    def full(
        self, x: Inputs, y: Tensor, **kwargs: Unpack[CurvatureOptions]
    ) -> tuple[Tensor, Tensor]:
        """The summed loss and the dense curvature (P, P)."""
        ...

    def diag(
        self, x: Inputs, y: Tensor, **kwargs: Unpack[CurvatureOptions]
    ) -> tuple[Tensor, Tensor]:
        """The summed loss and the curvature's diagonal (P,)."""
        ...

    def kron(
        self, x: Inputs, y: Tensor, N: int, **kwargs: Unpack[KronOptions]
    ) -> tuple[Tensor, Kron]:
        """The summed loss and the Kronecker-factored curvature, factors normalised for ``N``."""
        ...

    def kron_statistics(
        self, x: Inputs, y: Tensor, N: int, **kwargs: Unpack[KronOptions]
    ) -> tuple[Tensor, Kron, KfacStatistics]:
        """``kron`` with the layer inputs and output gradients its factors are formed from."""
        ...

    def kron_eigenvalues(
        self,
        x: Inputs,
        y: Tensor,
        bases: list[list[Tensor | None]],
        **kwargs: Unpack[CurvatureOptions],
    ) -> list[Tensor | None]:
        """EKFAC's eigenvalues of a batch in the eigenbasis ``bases``, None for exact blocks."""
        ...

    def kron_shapes(self, low_rank_above: int | None = None) -> list[list[tuple[int, ...]]]:
        """Per parameter the shapes of its ``kron`` block's factors."""
        ...
