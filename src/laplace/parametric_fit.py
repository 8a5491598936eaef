"""``fit`` of the parametric Laplace classes: the curvature and loss summed over the data.

A fit is a sum over batches of per-batch statistics (the curvature in the posterior structure's
form and the summed loss), so ``fit(override=False)`` (online Laplace) and distributed fits
(all-reduce of the sums) are small additions. Internal module.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

import torch
from torch import Tensor
from torch.utils.data import DataLoader

from laplace import distributed as distributed_utils
from laplace.data import Inputs, batch_size_of, check_outputs, dataset_size
from laplace.data_loop import DataLoop
from laplace.errors import check_bool, check_finite_result

__all__ = ["CurvatureFitMixin", "CurvatureSum"]


class CurvatureSum(DataLoop):
    """The pass of a parametric fit: ``(curvature, loss)`` summed over the summands of a stream.

    Args:
        stream: ``loader -> iterator of (loss, H)`` summands (one per batch, or per few batches
            for streams that buffer), over batches prepared as :meth:`DataLoop.batches` does.
        zeros: The zero curvature of the posterior's structure (the fresh sum).
        is_finite: Whether a curvature summand is finite.
        **options: See :class:`~laplace.data_loop.DataLoop`.
    """

    def __init__(
        self,
        *args: Any,
        stream: Callable[[DataLoader], Iterator[tuple[Tensor, Any]]],
        zeros: Callable[[], Any],
        is_finite: Callable[[Any], bool],
        **options: Any,
    ) -> None:
        super().__init__(*args, **options)
        self._stream, self._zeros, self._is_finite = stream, zeros, is_finite

    def start(self) -> list[Any]:
        """Zero curvature and loss."""
        return [self._zeros(), 0.0]

    def summands(self, loader: DataLoader) -> Iterator[tuple[Tensor, Any]]:
        """The ``(loss, H)`` summands of the stream."""
        return self._stream(loader)

    def check(self, stats: tuple[Tensor, Any]) -> None:
        """Refuse a non-finite curvature or loss."""
        loss, H = stats
        if not self._is_finite(H):
            raise RuntimeError(
                "the curvature of a training batch contains NaN or inf; check the model's "
                "outputs and the data."
            )
        check_finite_result(loss, "loss of a training batch")

    def add(self, total: list[Any], stats: tuple[Tensor, Any]) -> list[Any]:
        """Add a summand to the sums."""
        loss, H = stats
        total[0] += H  # in place where it can be: one dense sum less in memory
        total[1] = total[1] + loss.detach()
        return total


class CurvatureFitMixin:
    """:meth:`fit` and its data loop for a parametric Laplace class.

    The class provides ``_posterior_cls`` (its posterior structure), the parameter subset, the
    likelihood and backend of :class:`~laplace.base.BaseLaplace`, and ``_init_H`` (its zero
    curvature).
    """

    def fit(
        self,
        train_loader: DataLoader,
        override: bool = True,
        progress_bar: bool = False,
        distributed: bool | None = None,
    ):
        """Accumulate the curvature and loss over ``train_loader`` at the current weights.

        Args:
            train_loader: Batches ``(X, y)`` or dict-like; ``len(train_loader.dataset)`` is N.
            override: Start from zero (True) or add to the previous fit (online Laplace).
            progress_bar: Show a progress bar over batches.
            distributed: All-reduce the sums over the ranks of :mod:`torch.distributed`, each
                fitting its shard of the data; None: when the process group is initialised
                and the loader uses a ``DistributedSampler`` (see :mod:`laplace.distributed`).

        When it raises (bad data, an exception from the model or the loader, a
        ``KeyboardInterrupt``), the approximation is left exactly as before the call (see
        :mod:`laplace.transaction`).

        Raises:
            ValueError: If the loader is empty or a batch contains non-finite values.
            RuntimeError: If the curvature of a batch is not finite.
            DistributedFitError: If another rank failed during a distributed fit, or the ranks
                hold different hyperparameters.
        """
        check_bool(override, "override")
        self._distributed = distributed_utils.resolve(distributed, train_loader)
        n_data = self._data_count(train_loader)
        if n_data == 0:
            raise ValueError("train_loader is empty: fit needs at least one data point.")
        with distributed_utils.guard(self._distributed, "fit"):
            self._resolve_subset(train_loader)
        self._check_ranks_agree()
        update = not override and self._fitted
        n_before = self.n_data if update else 0
        self.model.eval()
        mean = self._subset.vector()
        if not self._fitted:
            self.H = None  # the prior's zero curvature: freed while summing, rebuilt on failure
        H_new, loss_new = self._accumulate(train_loader, n_before + n_data, progress_bar)
        if update:
            H_new, loss_new = self.H + H_new, self.loss + loss_new
        self.H = self._posterior_cls.finalize(H_new)
        self.loss, self.n_data = loss_new, n_before + n_data
        self.mean = mean if self.enable_backprop else mean.detach()
        self._posterior_cache = None
        self._fitted = True

    def _accumulate(
        self, train_loader: DataLoader, n_data: int, progress_bar: bool
    ) -> tuple[Any, Tensor | float]:
        """The curvature and the loss summed over ``train_loader`` (this rank's part).

        Args:
            train_loader: The training data.
            n_data: Number of data points the summed curvature covers (KFAC normalises by the
                data of earlier fits too).
            progress_bar: Show a progress bar over batches.
        """
        loop = self._data_loop(
            CurvatureSum,
            stream=partial(self._curvature_stream, n_data=n_data, progress_bar=progress_bar),
            zeros=self._zero_curvature,
            is_finite=self._posterior_cls.is_finite,
            distributed=self._distributed,
            empty_message="train_loader yielded no batches: fit needs at least one batch.",
        )
        return loop.run(train_loader)

    def _check_ranks_agree(self) -> None:
        """In a distributed fit, refuse ranks built with different hyperparameters.

        Raises:
            DistributedFitError: On every rank, naming what differs.
        """
        if self._distributed:
            distributed_utils.check_consistent(
                {
                    "class": type(self).__name__,
                    "n_params": self.n_params,
                    "prior_precision": self.prior_precision,
                    "prior_mean": self.prior_mean,
                    "sigma_noise": self.sigma_noise,
                    "temperature": self.temperature,
                },
                "fit",
            )

    def _data_count(self, train_loader: DataLoader) -> int:
        """Data points of the fit: all ranks' together when distributed."""
        if not getattr(self, "_distributed", False):
            return dataset_size(train_loader)
        return distributed_utils.all_reduce_sum(distributed_utils.data_count(train_loader))

    def _zero_curvature(self) -> Any:
        """Empty curvature in the posterior's structure and dimension."""
        return self._posterior_cls.zeros(self._subset.params)

    def _resolve_subset(self, train_loader: DataLoader) -> None:
        """Make sure the parameter subset is known before fitting (all weights: always)."""

    def _curvature_stream(
        self, train_loader: DataLoader, n_data: int, progress_bar: bool
    ) -> Iterator[tuple[Tensor, Any]]:
        """Yield ``(loss, H)`` summands over the training data (one per batch by default).

        Also sets ``n_outputs`` from the first batch, and checks the targets of every batch
        before its curvature is computed.

        Args:
            train_loader: The training data.
            n_data: Number of data points the summed curvature covers (KFAC normalisation).
            progress_bar: Show a progress bar over batches.
        """
        output_shape = None
        for X, y in self._batches(train_loader, progress_bar, desc="fit"):
            if output_shape is None:
                with torch.no_grad():
                    f = self.model(X)
                output_shape = check_outputs(f, batch_size_of(X, self.dict_key_x)).shape
                self.n_outputs = self._likelihood_model.output_count(output_shape, y)
            self._likelihood_model.check_targets(y, output_shape)
            yield self._batch_curvature(X, y, n_data)

    def _batch_curvature(self, X: Inputs, y: Tensor, n_data: int) -> tuple[Tensor, Any]:
        """``(loss, H_batch)`` of one batch; from the backend in the posterior's structure."""
        return self._posterior_cls.batch_curvature(self.backend, X, y, n_data)
