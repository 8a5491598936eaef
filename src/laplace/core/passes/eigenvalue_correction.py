"""EKFAC's fit passes: Kronecker factors summed, then their eigenvalues corrected.

Internal module.
"""

from __future__ import annotations

from functools import partial
from typing import cast

from torch import Tensor
from torch.utils.data import DataLoader

from laplace.core.passes.curvature_sum import (
    CurvatureStats,
    CurvatureSum,
    CurvatureTotal,
    FitPieces,
)
from laplace.core.passes.head_curvature_sum import HeadCurvatureSum
from laplace.curvature.engine.kfac import KfacStatistics
from laplace.structures.kronecker import (
    HeadStatistics,
    project_eigenvalues,
)
from laplace.structures.last_layer import HeadCurvature
from laplace.structures.posterior import Curvature, running_sum
from laplace.utils import distributed as distributed_utils
from laplace.utils.data import Inputs
from laplace.utils.diag_lowrank import DiagLowRankBatch
from laplace.utils.matrix import KronDecomposed

__all__ = ["EKFAC_CACHE_BYTES", "EigenvalueCorrectedHeadSum", "EigenvalueCorrectedSum"]

#: Memory for the batches' KFAC statistics kept from the factors' pass for EKFAC's eigenvalues;
#: beyond it they are computed in one more pass over the data.
EKFAC_CACHE_BYTES = 512 * 2**20


class EigenvalueCorrection:
    """A Kronecker-factor pass followed by EKFAC's eigenvalues (put before the pass's class).

    While the factors are summed, each batch's inputs and output gradients are kept
    (``backend.kron_statistics``; a last layer's features and output curvatures,
    ``HeadStatistics``) up to ``EKFAC_CACHE_BYTES``; once the factors are summed
    (and merged with an online fit's earlier ones) and eigendecomposed, each batch's
    ``diag(Qᵀ H Q)`` in that eigenbasis comes from what was kept, or, where the data did not
    fit in it, from one more pass (``backend.kron_eigenvalues``). The sums are all-reduced
    in a distributed fit; an earlier fit's corrected eigenvalues are projected into the
    merged eigenbasis (``laplace.structures.kronecker.project_eigenvalues``). The pass returns
    the corrected ``KronDecomposed`` (see ``EKFACPosterior``).
    """

    pieces: FitPieces
    distributed: bool
    what: str
    running: CurvatureTotal

    def start(self) -> CurvatureTotal:
        """Start keeping the batches' statistics, then start the factors' pass."""
        self.kept: list[KfacStatistics | HeadStatistics] | None = []
        self.kept_bytes = 0
        return super().start()  # type: ignore[misc]

    def keep(self, statistics: KfacStatistics | HeadStatistics) -> None:
        """Keep a batch's statistics while they fit in ``EKFAC_CACHE_BYTES``."""
        if self.kept is None:
            return
        self.kept.append(statistics)
        self.kept_bytes += statistics.nbytes
        if self.kept_bytes > EKFAC_CACHE_BYTES:
            self.kept = None

    def batch_curvature(self, X: Inputs, y: Tensor) -> CurvatureStats:
        """A batch's ``(loss, Kronecker factors)``, keeping its statistics.

        The native engine adds the factors to the running sum in place, as ``CurvatureSum``.
        """
        if self.kept is None:  # the budget is spent: another pass computes the eigenvalues
            return super().batch_curvature(X, y)  # type: ignore[misc]
        backend = self.pieces.backend
        into = running_sum(backend, "kron_statistics", self.running[0])
        loss, H, statistics = backend.kron_statistics(X, y, N=self.pieces.n_data, **into)
        self.keep(statistics)
        return loss, H

    def run(self, loader: DataLoader) -> tuple[KronDecomposed, Tensor]:
        """``(corrected KronDecomposed, loss)`` over ``loader``.

        Raises:
            RuntimeError: If the corrected eigenvalues are not finite.
        """
        factors, loss = super().run(loader)  # type: ignore[misc]  # merged with an online fit's
        pieces = self.pieces
        decomposed = factors.decompose(deferred=True)
        bases = [decomposed.factor_bases(i) for i in range(len(decomposed))]
        kept, self.kept = self.kept or [], None
        if kept:  # each batch's statistics freed once projected
            batches = (kept.pop().eigenvalues(bases) for _ in range(len(kept)))
        else:
            batches = self.passes(  # type: ignore[attr-defined]
                loader, partial(pieces.backend.kron_eigenvalues, bases=bases)
            )
        sums: list[Tensor | None] | None = None
        with distributed_utils.guard(self.distributed, self.what):
            for batch in batches:
                sums = (
                    batch
                    if sums is None
                    # a block is exact (None) in every batch or in none
                    else [s if s is None else s + cast(Tensor, b) for s, b in zip(sums, batch)]
                )
        corrected = [i for i, s in enumerate(sums or []) if s is not None]
        totals = [sums[i] for i in corrected]
        if self.distributed:
            totals = distributed_utils.all_reduce_sum(totals)
        if not all(bool(s.isfinite().all()) for s in totals):
            raise RuntimeError("EKFAC's corrected eigenvalues contain NaN or inf.")
        corrections: list[Tensor | None] = [None] * len(decomposed)
        for i, s in zip(corrected, totals):
            corrections[i] = s
        if pieces.previous is not None:
            earlier = project_eigenvalues(pieces.previous, decomposed)
            corrections = [c if e is None else c + e for c, e in zip(corrections, earlier)]
        return decomposed.corrected(corrections), loss


class EigenvalueCorrectedSum(EigenvalueCorrection, CurvatureSum):
    """EKFAC's pass over all weights: ``CurvatureSum`` of the Kronecker factors, corrected."""


class EigenvalueCorrectedHeadSum(EigenvalueCorrection, HeadCurvatureSum):
    """EKFAC's pass of a last layer: ``HeadCurvatureSum``'s closed forms, corrected."""

    def head_curvature(
        self,
        closed_form: HeadCurvature,
        phi: Tensor,
        M: Tensor | DiagLowRankBatch,
        bias: bool,
        n_rows: int,
    ) -> Curvature:
        """``HeadCurvatureSum.head_curvature``, keeping the features and output curvatures."""
        # EKFAC keeps every output factor dense (``KronLaplace._own_structure``): M (N, C, C)
        self.keep(HeadStatistics(phi, cast(Tensor, M), bias))
        return super().head_curvature(closed_form, phi, M, bias, n_rows)
