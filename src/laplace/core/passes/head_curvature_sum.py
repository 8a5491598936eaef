"""The pass of a last-layer fit: the linear head's curvature in closed form from its features.

Internal module; ``laplace.lllaplace``'s classes name it as their ``_curvature_pass``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, cast

import torch
from torch import Tensor
from torch.utils.data import DataLoader

from laplace.core.passes.curvature_sum import CurvatureStats, CurvatureSum
from laplace.structures.last_layer import (
    HeadCurvature,
    cat_output_curvatures,
    head_curvature,
    head_rows,
    output_curvature,
)
from laplace.structures.posterior import Curvature
from laplace.utils.diag_lowrank import DiagLowRankBatch

if TYPE_CHECKING:
    from laplace.core.subsets import LastLayer

#: Feature and output-curvature entries buffered before they are turned into curvature.
BUFFER_ELEMENTS = 2**24


class HeadCurvatureSum(CurvatureSum):
    """The pass of a last-layer fit: the curvature of the linear head from its features.

    Where the posterior structure has a closed form of the backend's curvature
    (``laplace.structures.last_layer.head_curvature``), a batch's statistics are the head's
    features φ (B, D) and the output-space curvature M (B, C, C) of the backend (one forward pass,
    no autograd; above the large-output threshold M is diagonal plus low rank, see
    ``laplace.structures.large_output``); they are buffered up to ``BUFFER_ELEMENTS``
    entries and turned into the structure's curvature by the closed form, which the structure's
    accumulator sums. Outputs with extra dimensions whose head sees one feature vector per position
    give one row per position (``laplace.structures.last_layer.head_rows``; KFAC normalised
    over their N·T rows). A batch whose head sees several rows per data point otherwise, and every
    batch where there is no closed form (per-output structures, ASDL, BackPACK, Hessian or
    Monte-Carlo backends), gives the backend's batch curvature as in
    ``CurvatureSum``.
    """

    def summands(self, loader: DataLoader) -> Iterator[CurvatureStats]:
        """The ``(loss, H)`` summands: one per buffer of features (or per batch without)."""
        pieces = self.pieces
        closed_form = head_curvature(pieces.posterior, pieces.backend)
        if closed_form is None:
            yield from super().summands(loader)
            return
        subset = cast("LastLayer", pieces.subset)  # the pass of the last-layer classes
        backend, n_data = pieces.backend, pieces.n_data
        bias = subset.layer.bias is not None

        # (loss, φ, M) of the buffered batches
        buffer: list[tuple[Tensor, Tensor, Tensor | DiagLowRankBatch]] = []
        buffer_rows = None

        def flush() -> CurvatureStats:
            losses, phis, Ms = zip(*buffer, strict=True)
            buffer.clear()
            phi, M = torch.cat(phis), cat_output_curvatures(list(Ms))
            loss = cast(Tensor, sum(losses, 0.0))  # of at least one batch
            return loss, self.head_curvature(closed_form, phi, M, bias, buffer_rows)

        for X, y in self.batches(loader):
            with torch.no_grad():
                f, phi = subset.outputs_and_features(X)
            self.check_batch(X, y, f)
            rows = head_rows(pieces.likelihood, backend, subset.layer, f, phi, y)
            if rows is None:  # the closed forms do not apply to this batch: autograd
                yield self.batch_curvature(X, y)
                continue
            # KFAC's expand: positions as data, N·T rows with this batch's T (a buffer holds
            # batches of one T, so sequences padded per batch are normalised by their own T)
            n_rows = n_data * (len(rows[1]) // len(f))
            if buffer and n_rows != buffer_rows:
                yield flush()
            buffer_rows = n_rows
            f, phi, y = rows
            with torch.no_grad():
                batch_loss, M = output_curvature(backend, f.detach(), y)
            buffer.append((batch_loss, phi.detach(), M))
            if sum(p.numel() + m.numel() for _, p, m in buffer) >= BUFFER_ELEMENTS:
                yield flush()
        if buffer:
            yield flush()

    def head_curvature(
        self,
        closed_form: HeadCurvature,
        phi: Tensor,
        M: Tensor | DiagLowRankBatch,
        bias: bool,
        n_rows: int,
    ) -> Curvature:
        """The structure's curvature of buffered features φ (N, D) and output curvatures M.

        Args:
            closed_form: The structure's closed form (``head_curvature``).
            phi: The head's features, (N, D).
            M: The output-space curvatures, (N, C, C) (or diagonal plus low rank).
            bias: Whether the head has a bias.
            n_rows: Number of rows of the whole data set (KFAC's normalisation).
        """
        return closed_form(phi, M, bias, n_rows, self.pieces.backend.factor)
