"""The passes over the data of a parametric fit: the curvature and loss summed over batches.

A fit is a sum over batches of per-batch statistics, summed by the posterior structure's
accumulator (``zeros``, ``add``, ``merge``, ``finalize``), so ``fit(override=False)`` and
distributed fits are small additions. Internal module.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import torch
from torch import Tensor
from torch.utils.data import DataLoader
from typing_extensions import Unpack

from laplace.core.passes.data_loop import (
    DataLoop,
    LoopArguments,
    LoopOptions,
    Result,
    Stats,
    Total,
)
from laplace.structures import Posterior
from laplace.structures.posterior import Curvature
from laplace.utils import distributed as distributed_utils
from laplace.utils.data import Inputs, batch_size_of, check_outputs, in_fixed_order
from laplace.utils.errors import check_finite_result

if TYPE_CHECKING:
    from laplace.core.subsets import ParameterSubset
    from laplace.curvature.curvature_backend import CurvatureBackend
    from laplace.likelihoods.likelihood_model import LikelihoodModel

__all__ = ["CurvatureSum", "FitPass", "FitPieces", "LossThenProducts"]


@dataclass(frozen=True)
class FitPieces:
    """What a fit pass wires together.

    Attributes:
        subset: The parameter subset (its ``model``; a last layer's features).
        posterior: The posterior structure, whose accumulator sums the curvature.
        backend: The curvature backend.
        likelihood: The likelihood the targets are checked with.
        zeros: A fresh zero curvature in the structure's form on every call (the class's
            ``_zero_curvature``: Kron's block shapes depend on the backend).
        n_data: Number of data points the summed curvature covers (KFAC normalises by it).
        previous: The fitted curvature an online fit (``fit(override=False)``) adds to, else
            None: the pass returns the merged curvature (``Posterior.merge`` for a sum).
        n_before: Number of data points ``previous`` covers.
    """

    subset: ParameterSubset
    posterior: type[Posterior]
    backend: CurvatureBackend
    likelihood: LikelihoodModel
    zeros: Callable[[], Curvature]
    n_data: int
    previous: Curvature | None = None
    n_before: int = 0


class FitPass(DataLoop[Stats, Total, Result]):
    """A pass of a fit over the data: the pieces it wires and the checks of each batch.

    ``run`` gives ``(H, loss)``: the curvature in the structure's form and the summed loss.

    Args:
        *args: ``dict_key_x``, ``dict_key_y`` and ``device``, see ``DataLoop``.
        pieces: The pieces of the fit.
        **options: See ``DataLoop``.

    Attributes:
        n_outputs: The model's number of outputs, known after the first batch.
        results: Attributes the fit sets on the approximation after the pass (by name).
    """

    def __init__(
        self, *args: Unpack[LoopArguments], pieces: FitPieces, **options: Unpack[LoopOptions]
    ) -> None:
        super().__init__(*args, **options)
        self.pieces = pieces
        self.n_outputs: int | None = None
        self.results: dict[str, object] = {}
        self._output_shape: Sequence[int] | None = None

    def check_batch(self, X: Inputs, y: Tensor, f: object) -> Tensor:
        """Check the outputs ``f`` of a batch and its targets; the first sets ``n_outputs``.

        Raises:
            ModelOutputError, DataError: See ``laplace.utils.data.check_outputs``.
            ValueError: For targets the likelihood refuses.
        """
        f = check_outputs(f, batch_size_of(X, self.dict_key_x))
        self._output_shape = f.shape
        self.n_outputs = self.pieces.likelihood.output_count(f.shape, y)
        self.pieces.likelihood.check_targets(y, f.shape)
        return f


#: A batch's ``(loss, curvature)`` in the structure's form.
CurvatureStats = tuple[Tensor, Curvature]
#: The running ``[curvature, loss]`` of a pass (the loss a tensor after the first batch).
CurvatureTotal = list[Curvature]


class CurvatureSum(FitPass[CurvatureStats, CurvatureTotal, tuple[Curvature, Tensor]]):
    """The pass of a parametric fit: ``(curvature, loss)`` summed over the batches.

    Per batch the likelihood checks the targets (against the outputs' shape, found with one
    forward pass on the first batch), the posterior structure asks the backend for the batch's
    loss and curvature in its form (``batch_curvature``), handing it the running sum, which a
    structure may add the batch to in place (the native KFAC: no batch copy of the factors),
    and its accumulator adds up the rest. Arguments as ``FitPass``.

    Attributes:
        running: The running ``[curvature, loss]`` of the pass.
    """

    def start(self) -> CurvatureTotal:
        """Zero curvature and loss."""
        self.running: CurvatureTotal = [self.pieces.zeros(), 0.0]
        return self.running

    def step(self, X: Inputs, y: Tensor) -> CurvatureStats:
        """``(loss, H_batch)`` of a batch from the backend, after checking its targets."""
        if self._output_shape is None:
            with torch.no_grad():
                self.check_batch(X, y, self.pieces.subset.model(X))
        else:
            self.pieces.likelihood.check_targets(y, self._output_shape)
        return self.batch_curvature(X, y)

    def batch_curvature(self, X: Inputs, y: Tensor) -> CurvatureStats:
        """``(loss, H_batch)`` of a checked batch in the posterior structure's form."""
        pieces = self.pieces
        return pieces.posterior.batch_curvature(
            pieces.backend, X, y, pieces.n_data, total=self.running[0]
        )

    def check(self, stats: CurvatureStats) -> None:
        """Refuse a non-finite curvature or loss."""
        loss, H = stats
        if not self.pieces.posterior.is_finite(H):
            raise RuntimeError(
                "the curvature of a training batch contains NaN or inf; check the model's "
                "outputs and the data."
            )
        check_finite_result(loss, "loss of a training batch")

    def add(self, total: CurvatureTotal, stats: CurvatureStats) -> CurvatureTotal:
        """Add a batch's curvature (in place: one dense sum less in memory) and loss.

        A curvature that is the running sum itself has the batch added already.
        """
        loss, H = stats
        if H is not total[0]:
            total[0] = self.pieces.posterior.add(total[0], H)
        total[1] = total[1] + loss.detach()
        return total

    def finish(self, total: CurvatureTotal) -> tuple[Curvature, Tensor]:
        """``(H, loss)`` of the data; an online fit's ``H`` with the earlier fit's merged in."""
        H, loss = total
        pieces = self.pieces
        if pieces.previous is not None:
            H = pieces.posterior.merge(pieces.previous, H, pieces.n_before, pieces.n_data)
        return H, loss


class LossThenProducts(FitPass[Tensor, Tensor, tuple[Curvature, Tensor]]):
    """A fit whose curvature comes from products over the data once the loss is summed.

    One pass sums the loss (``summed_loss``), checking each batch's outputs and targets before
    any product; ``run`` of a subclass then multiplies with the curvature over ``product_data``
    (the low-rank eigensolver, ``laplace.core.passes.top_eigenpairs.TopEigenpairs``; the
    matrix-free posterior, ``laplace.core.passes.curvature_products.CurvatureProducts``).
    Arguments as ``FitPass``.
    """

    def summed_loss(self, loader: DataLoader) -> Tensor:
        """The loss summed over ``loader`` by the data loop (before any product)."""
        return cast(Tensor, DataLoop.run(self, loader))  # the loop's total: the loss

    def step(self, X: Inputs, y: Tensor) -> Tensor:
        """The summed loss of a batch, after checking its outputs and targets."""
        with torch.no_grad():
            f = self.check_batch(X, y, self.pieces.subset.model(X))
            return self.pieces.backend.batch_loss(f, y)

    def check(self, stats: Tensor) -> None:
        """Refuse a non-finite loss (before any product)."""
        check_finite_result(stats, "loss of a training batch")

    def product_data(self, loader: DataLoader) -> Iterable[tuple[Inputs, Tensor]]:
        """Re-iterable batches ``(X, loss targets)`` for products, one pass per iteration.

        A shuffling loader is read in order (``in_fixed_order``): products keep some batches
        between passes, so every pass must yield the same ones.
        """
        dtype, loss_targets = self.pieces.subset.dtype, self.pieces.likelihood.loss_targets
        return self.passes(in_fixed_order(loader), lambda X, y: (X, loss_targets(y, dtype)))

    @property
    def reduce(self) -> Callable[[Tensor], Tensor] | None:
        """The sum of a product over processes in a distributed fit, else None."""
        return distributed_utils.all_reduce_sum if self.distributed else None
