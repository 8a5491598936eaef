"""Output-space columns of a curvature family, and how they reach the per-sample engine.

Every curvature of the native routes is ``Σₙ Σₖ (Jₙᵀ vₙₖ)(Jₙᵀ vₙₖ)ᵀ`` for output-space columns
``vₖ``: a family (GGN, empirical Fisher) says which columns each row of the outputs has
(:meth:`OutputColumns.row_columns`), and the output layout (:mod:`laplace.outputs`) turns them
into columns of the model's outputs, for outputs with extra dimensions too.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from laplace.curvature.kfac_rules import check_output_columns
from laplace.curvature.per_sample import Columns, PerSampleTrace
from laplace.data import Inputs
from laplace.errors import check_positive_int
from laplace.likelihoods import LikelihoodModel

__all__ = ["OutputColumns"]


class OutputColumns:
    """The curvature columns of a backend family; the backend provides ``trace``."""

    fit_likelihood: LikelihoodModel
    #: One recorded forward pass over inputs (``CurvatureInterface.trace``).
    trace: Callable[[Inputs], PerSampleTrace]

    #: Whether a row's columns are the square root of that row's own curvature (the exact
    #: GGN), so every position of outputs with extra dimensions gets columns of its own;
    #: otherwise a column covers the summed loss of a data point (loss gradients).
    separable_columns: bool = False

    def curvature_columns(
        self,
        f: Tensor,
        y: Tensor,
        generator: torch.Generator | None = None,
        mc_samples: int | None = None,
        separate_positions: bool = True,
    ) -> Columns:
        """Output-space columns ``vₖ`` whose per-sample outer products sum to the curvature.

        The dense and diagonal curvatures are ``Σₙ Σₖ (Jₙᵀ vₖₙ)(Jₙᵀ vₖₙ)ᵀ``; a family (GGN, EF)
        only says which columns each row of the outputs has (:meth:`row_columns`). For outputs
        with extra dimensions (:mod:`laplace.outputs`) positions an ``ignore_index`` drops get
        zero columns, and with ``separate_positions`` the exact GGN gets one column per
        position and row column (the GGN of the summed per-position loss; KFAC's weight
        sharing instead lets each column cover all positions).

        Args:
            f: Detached outputs of the batch, shape (B, ...).
            y: Targets of the batch.
            generator: Random generator of sampled columns (Monte-Carlo Fisher); torch's global
                generator when None.
            mc_samples: Monte-Carlo samples per data point, for a stochastic curvature only.
            separate_positions: Give positions columns of their own where the family's are
                per row (:attr:`separable_columns`).

        Returns:
            The columns, sliced and iterated like a tensor (K, B, ...).

        Raises:
            ValueError: For ``mc_samples`` with a curvature that is not sampled.
        """
        layout = self.fit_likelihood.layout(f.shape, y)
        rows, targets, keep = layout.split(f, y)
        V = self.row_columns(rows, targets, generator, mc_samples)
        if keep is not None:
            V = V * keep[:, None, None]
        return layout.columns(V, separate_positions and self.separable_columns)

    def row_columns(
        self,
        f: Tensor,
        y: Tensor,
        generator: torch.Generator | None = None,
        mc_samples: int | None = None,
    ) -> Tensor:
        """The family's columns of rows ``f`` (R, C) with targets ``y``, shape (R, C, K).

        Arguments as :meth:`curvature_columns`.
        """
        raise NotImplementedError(f"{type(self).__name__} defines no curvature.")

    def _traced_columns(
        self,
        x: Inputs,
        y: Tensor,
        kwargs: dict[str, Any],
        separate_positions: bool = True,
        column_limit: int | None = None,
    ) -> tuple[PerSampleTrace, Tensor, Columns]:
        """The batch's trace, its detached outputs and curvature columns (``mc_samples``).

        With ``column_limit``, columns of each row's own curvature (the exact GGN: one per
        output) are refused before they are formed where the outputs per position exceed it
        (:func:`~laplace.curvature.kfac_rules.check_output_columns`).
        """
        mc_samples = _curvature_options(kwargs)
        trace = self.trace(x)
        f = trace.f.detach()
        if column_limit is not None and self.separable_columns:
            n_columns = self.fit_likelihood.layout(f.shape, y).n_classes
            check_output_columns(trace.engine, n_columns, column_limit)
        columns = self.curvature_columns(
            f, y, mc_samples=mc_samples, separate_positions=separate_positions
        )
        return trace, f, columns


def _curvature_options(kwargs: dict[str, Any]) -> int | None:
    """``mc_samples`` of a curvature call's keyword arguments (None if absent); ``N`` is dropped.

    Raises:
        ValueError: For another keyword argument or an ``mc_samples`` that is not positive.
    """
    options = dict(kwargs)
    options.pop("N", None)
    mc_samples = options.pop("mc_samples", None)
    if options:
        raise ValueError(
            f"unknown keyword arguments {sorted(options)}; the curvature routes accept "
            "mc_samples (stochastic GGN), kfac_approx (kron) and N."
        )
    return None if mc_samples is None else check_positive_int(mc_samples, "mc_samples")
