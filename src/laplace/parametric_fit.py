"""``fit`` of the parametric Laplace classes: the curvature and loss summed over the data.

A fit is a sum over batches of per-batch statistics, summed by the accumulator of the posterior
structure (:class:`~laplace.posteriors.Posterior`: ``zeros``, ``add``, ``merge``, ``finalize``),
so ``fit(override=False)`` (online Laplace) and distributed fits (all-reduce of the sums) are
small additions. The pass over the data is a :class:`~laplace.data_loop.DataLoop`: by default
:class:`CurvatureSum`, where the backend gives each batch's curvature in the structure's form;
a class whose parameter subset has its own statistics names another pass (a last layer's closed
forms, :class:`laplace.lllaplace.HeadCurvatureSum`). Internal module.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.utils.data import DataLoader

from laplace import distributed as distributed_utils
from laplace.data import Inputs, batch_size_of, check_outputs, dataset_size
from laplace.data_loop import DataLoop
from laplace.errors import check_bool, check_finite_result
from laplace.posteriors import Posterior

__all__ = ["CurvatureFitMixin", "CurvatureSum", "FitPass", "FitPieces"]


@dataclass(frozen=True)
class FitPieces:
    """What a fit pass wires together.

    Attributes:
        subset: The parameter subset (its ``model``; a last layer's features).
        posterior: The posterior structure, whose accumulator sums the curvature.
        backend: The curvature backend.
        likelihood: The likelihood the targets are checked with.
        zeros: The zero curvature in the structure's form (a fresh sum on every call).
        n_data: Number of data points the summed curvature covers (KFAC normalises by it).
    """

    subset: Any
    posterior: type[Posterior]
    backend: Any
    likelihood: Any
    zeros: Callable[[], Any]
    n_data: int


class FitPass(DataLoop):
    """A pass of a fit over the data: the pieces it wires and the checks of each batch.

    Args:
        *args: See :class:`~laplace.data_loop.DataLoop`.
        pieces: The pieces of the fit.
        **options: See :class:`~laplace.data_loop.DataLoop`.

    Attributes:
        n_outputs: The model's number of outputs, known after the first batch.
    """

    def __init__(self, *args: Any, pieces: FitPieces, **options: Any) -> None:
        super().__init__(*args, **options)
        self.pieces = pieces
        self.n_outputs: int | None = None
        self._output_shape: Sequence[int] | None = None

    def check_batch(self, X: Inputs, y: Tensor, f: Any) -> Tensor:
        """Check the outputs ``f`` of a batch and its targets; the first sets ``n_outputs``.

        Raises:
            ModelOutputError, DataError: See :func:`laplace.data.check_outputs`.
            ValueError: For targets the likelihood refuses.
        """
        f = check_outputs(f, batch_size_of(X, self.dict_key_x))
        self._output_shape, self.n_outputs = f.shape, int(f.shape[-1])
        self.pieces.likelihood.check_targets(y, f.shape)
        return f


class CurvatureSum(FitPass):
    """The pass of a parametric fit: ``(curvature, loss)`` summed over the batches.

    Per batch the likelihood checks the targets (against the outputs' shape, found with one
    forward pass on the first batch), the posterior structure asks the backend for the batch's
    loss and curvature in its form (``batch_curvature``) and its accumulator adds them up.
    Arguments as :class:`FitPass`.
    """

    def start(self) -> list[Any]:
        """Zero curvature and loss."""
        return [self.pieces.zeros(), 0.0]

    def step(self, X: Inputs, y: Tensor) -> tuple[Tensor, Any]:
        """``(loss, H_batch)`` of a batch from the backend, after checking its targets."""
        if self._output_shape is None:
            with torch.no_grad():
                self.check_batch(X, y, self.pieces.subset.model(X))
        else:
            self.pieces.likelihood.check_targets(y, self._output_shape)
        pieces = self.pieces
        return pieces.posterior.batch_curvature(pieces.backend, X, y, pieces.n_data)

    def check(self, stats: tuple[Tensor, Any]) -> None:
        """Refuse a non-finite curvature or loss."""
        loss, H = stats
        if not self.pieces.posterior.is_finite(H):
            raise RuntimeError(
                "the curvature of a training batch contains NaN or inf; check the model's "
                "outputs and the data."
            )
        check_finite_result(loss, "loss of a training batch")

    def add(self, total: list[Any], stats: tuple[Tensor, Any]) -> list[Any]:
        """Add a batch's curvature (in place: one dense sum less in memory) and loss."""
        loss, H = stats
        total[0] = self.pieces.posterior.add(total[0], H)
        total[1] = total[1] + loss.detach()
        return total


class CurvatureFitMixin:
    """:meth:`fit` of a parametric Laplace class: wires its pieces into a pass over the data.

    The class provides ``_posterior_cls`` (its posterior structure) and the parameter subset,
    likelihood and backend of :class:`~laplace.base.BaseLaplace`; its ``_curvature_pass`` may
    name another pass over the data than :class:`CurvatureSum`.
    """

    #: The pass over the data that sums the curvature.
    _curvature_pass: type[FitPass] = CurvatureSum

    @property
    def _structure_options(self) -> dict[str, Any]:
        """Options of the posterior structure's ``finalize`` / ``load_state`` (Kron: damping)."""
        return {}

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
            ValueError: If the loader is empty or a batch contains non-finite values, or for
                ``override=False`` with a structure that cannot update a fit (low-rank).
            RuntimeError: If the curvature of a batch is not finite.
            DistributedFitError: If another rank failed during a distributed fit, or the ranks
                hold different hyperparameters.
        """
        structure = self._posterior_cls
        if not check_bool(override, "override") and structure.update_refusal is not None:
            raise ValueError(
                f"{type(self).__name__} cannot update a fit (override=False): "
                f"{structure.update_refusal}"
            )
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
        H_new, loss_new, n_outputs = self._accumulate(
            train_loader, n_before + n_data, progress_bar
        )
        if update:
            H_new = structure.merge(self.H, H_new, n_before, n_before + n_data)
            loss_new = self.loss + loss_new
        self.H = structure.finalize(H_new, **self._structure_options)
        self.loss, self.n_data, self.n_outputs = loss_new, n_before + n_data, n_outputs
        self.mean = mean if self.enable_backprop else mean.detach()
        self._posterior_cache = None
        self._fitted = True

    def _accumulate(
        self, train_loader: DataLoader, n_data: int, progress_bar: bool
    ) -> tuple[Any, Tensor | float, int]:
        """The curvature and the loss summed over ``train_loader``, and the number of outputs.

        Args:
            train_loader: The training data.
            n_data: Number of data points the summed curvature covers (KFAC normalises by the
                data of earlier fits too).
            progress_bar: Show a progress bar over batches.
        """
        loop = self._data_loop(
            self._curvature_pass,
            pieces=self._fit_pieces(n_data),
            progress_bar=progress_bar,
            desc="fit",
            distributed=self._distributed,
            empty_message="train_loader yielded no batches: fit needs at least one batch.",
        )
        H, loss = loop.run(train_loader)
        return H, loss, loop.n_outputs

    def _fit_pieces(self, n_data: int) -> FitPieces:
        """The pieces a pass over the data wires together, for ``n_data`` data points."""
        return FitPieces(
            subset=self._subset,
            posterior=self._posterior_cls,
            backend=self.backend,
            likelihood=self._likelihood_model.fit_likelihood,
            zeros=self._zero_curvature,
            n_data=n_data,
        )

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
        return self._posterior_cls.zeros(self._subset.curvature_params)

    def _resolve_subset(self, train_loader: DataLoader) -> None:
        """Make sure the parameter subset is known before fitting (all weights: always)."""
