r"""One data loop for every pass over a loader: fits, kernel builds, scoring and training.

Every pass over a ``DataLoader`` does the same things around the work that differs:

1. split each batch into inputs and targets (``(X, y)`` tuples or dict-like batches), move them
   to the model's device and refuse NaN/inf values before any model call
   (:func:`laplace.data.prepare_batch`), plus the caller's own check of the inputs (e.g. a
   backend that cannot take dict-like inputs);
2. show a progress bar;
3. turn each batch into statistics, refuse non-finite ones, and add them up;
4. in a distributed pass, make a failure of one rank an error on every rank and all-reduce the
   sums (:mod:`laplace.distributed`).

:class:`DataLoop` is that template method; a loop implements :meth:`DataLoop.step` (the
statistics of one batch) and overrides the other hooks where it differs. :class:`Gather` keeps
per-batch values and concatenates them instead of summing. :meth:`DataLoop.batches` is steps
1–2 alone, :meth:`DataLoop.cycle` the loop of an optimiser that takes one batch per step, and
:meth:`DataLoop.passes` a re-iterable of the batches for solvers that take several passes.

Transactional calls (:mod:`laplace.transaction`) rely on the loop accumulating into the fresh
value :meth:`DataLoop.start` returns (in place is fine there) and returning it: the caller
assigns the results only after :meth:`DataLoop.run` returns, so a pass that raises changes
nothing.

Example:
    >>> class BatchCount(DataLoop):
    ...     def step(self, X, y):
    ...         return torch.tensor(float(len(y)))
    >>> BatchCount("input_ids", "labels", torch.device("cpu")).run(loader)  # doctest: +SKIP
    tensor(20.)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import Tensor
from torch.utils.data import (
    DataLoader,
    RandomSampler,
    SequentialSampler,
    Subset,
    SubsetRandomSampler,
)
from tqdm.auto import tqdm

from laplace import distributed as distributed_utils
from laplace.data import Inputs, concatenate_rows, prepare_batch
from laplace.errors import check_finite_result

__all__ = ["DataLoop", "Gather", "subset_loader", "training_indices"]


class DataLoop:
    """Template method of one pass over a data loader.

    :meth:`run` is::

        total = start()
        for stats in summands(loader):    # by default step(X, y) per prepared batch
            check(stats)                  # refuse non-finite statistics
            total = add(total, stats)
        total = all-reduce(total)         # distributed passes only
        return finish(total)

    Args:
        dict_key_x: Key of the inputs in dict-like batches.
        dict_key_y: Key of the targets in dict-like batches.
        device: The model's device; batches are moved there.
        check_inputs: Called on the inputs of every batch (e.g. a backend refusing dict inputs).
        progress_bar: Show a progress bar over the batches.
        desc: Label of the progress bar.
        distributed: Sum the totals over the ranks of :mod:`torch.distributed`; a rank that
            fails makes every rank raise (:func:`laplace.distributed.guard`).
        what: Name of the pass in error messages (``"fit"``, ...).
        empty_message: Message of the ``ValueError`` raised when the loader yields no batch;
            None: no error, :meth:`finish` receives :meth:`start`'s value.
        step: The per-batch statistics as a callable ``(X, y) -> stats``, instead of
            overriding :meth:`step`.
    """

    def __init__(
        self,
        dict_key_x: str | None,
        dict_key_y: str,
        device: torch.device,
        *,
        check_inputs: Callable[[Inputs], None] | None = None,
        progress_bar: bool = False,
        desc: str = "batches",
        distributed: bool = False,
        what: str = "fit",
        empty_message: str | None = "the data loader yielded no batches.",
        step: Callable[[Inputs, Tensor], Any] | None = None,
    ) -> None:
        self.dict_key_x, self.dict_key_y, self.device = dict_key_x, dict_key_y, device
        self.check_inputs = check_inputs
        self.progress_bar, self.desc = progress_bar, desc
        self.distributed, self.what = distributed, what
        self.empty_message = empty_message
        self._step = step

    def batches(
        self, loader: DataLoader, progress_bar: bool | None = None
    ) -> Iterator[tuple[Inputs, Tensor]]:
        """Yield ``(X, y)`` of each batch on the device, checked before any model call.

        Args:
            loader: Batches ``(X, y)`` or dict-like (see :func:`laplace.data.split_batch`).
            progress_bar: Show a progress bar; None: as the loop was built.

        Raises:
            ValueError: For batches :func:`~laplace.data.prepare_batch` refuses (NaN/inf values,
                mismatched inputs and targets, missing keys), and what ``check_inputs`` raises.
        """
        show = self.progress_bar if progress_bar is None else progress_bar
        for batch in tqdm(loader, disable=not show, desc=self.desc):
            X, y = prepare_batch(batch, self.dict_key_x, self.dict_key_y, self.device)
            if self.check_inputs is not None:
                self.check_inputs(X)
            yield X, y

    def cycle(self, loader: DataLoader, n_steps: int) -> Iterator[tuple[Inputs, Tensor]]:
        """``n_steps`` prepared batches, restarting ``loader`` when it runs out.

        The loop of an optimiser that takes one batch per step; the progress bar counts steps.

        Raises:
            ValueError: If the loader yields no batch (``empty_message``).
        """
        source: Iterator[tuple[Inputs, Tensor]] = iter(())
        for _ in tqdm(range(n_steps), disable=not self.progress_bar, desc=self.desc):
            batch = next(source, None)
            if batch is None:
                source = self.batches(loader, progress_bar=False)
                batch = next(source, None)
            if batch is None:
                raise ValueError(self.empty_message or "the data loader yielded no batches.")
            yield batch

    def passes(
        self, loader: DataLoader, step: Callable[[Inputs, Tensor], Any] | None = None
    ) -> Iterable[Any]:
        """A re-iterable of the prepared batches: every iteration is one more pass over them.

        For solvers that go over the data several times (the eigensolvers of low-rank
        Laplace, curvlinops' operators); no progress bar.

        Args:
            loader: The data loader.
            step: What to yield per batch, ``(X, y) -> value``; None: ``(X, y)``.
        """
        return _Passes(self, loader, step)

    def run(self, loader: DataLoader) -> Any:
        """One pass over ``loader``; returns :meth:`finish` of the accumulated statistics.

        Raises:
            ValueError: If the loader yields no batch (unless ``empty_message`` is None), or a
                batch is refused.
            DistributedFitError: In a distributed pass, if another rank failed.
        """
        total, n_summands = self.start(), 0
        with distributed_utils.guard(self.distributed, self.what):
            for stats in self.summands(loader):
                self.check(stats)
                total = self.add(total, stats)
                n_summands += 1
            if n_summands == 0 and self.empty_message is not None:
                raise ValueError(self.empty_message)
        if self.distributed:
            total = distributed_utils.all_reduce_sum(total)
        return self.finish(total)

    # ------------------------------------------------------------------------------ hooks
    def start(self) -> Any:
        """The value statistics are added to (None: the first statistics)."""
        return None

    def summands(self, loader: DataLoader) -> Iterator[Any]:
        """The statistics to add up: :meth:`step` of each prepared batch."""
        for X, y in self.batches(loader):
            yield self.step(X, y)

    def step(self, X: Inputs, y: Tensor) -> Any:
        """The statistics of one batch: a tensor or a tuple of tensors (or numbers)."""
        if self._step is None:
            raise NotImplementedError(f"{type(self).__name__} needs a step.")
        return self._step(X, y)

    def check(self, stats: Any) -> None:
        """Refuse statistics with NaN or inf entries.

        Raises:
            RuntimeError: Naming the pass (see :func:`laplace.errors.check_finite_result`).
        """
        for value in stats if isinstance(stats, tuple) else (stats,):
            if isinstance(value, Tensor):
                check_finite_result(value, f"result of a batch of the {self.what}")

    def add(self, total: Any, stats: Any) -> Any:
        """``total + stats``, entry by entry for tuples."""
        if total is None:
            return stats
        if isinstance(stats, tuple):
            return tuple(t + s for t, s in zip(total, stats, strict=True))
        return total + stats

    def finish(self, total: Any) -> Any:
        """The result of the pass from the accumulated statistics."""
        return total


class Gather(DataLoop):
    """A pass that keeps the per-batch values and concatenates them row-wise.

    :meth:`step` returns a tuple of batched values (tensors or inputs); :meth:`run` returns
    the tuple of their concatenations over the batches (:func:`laplace.data.concatenate_rows`).
    The default step keeps ``(X, y)``. Nothing is all-reduced.
    """

    def start(self) -> list[tuple[Any, ...]]:
        """An empty list of per-batch values."""
        return []

    def step(self, X: Inputs, y: Tensor) -> tuple[Any, ...]:
        """The values to keep of a batch: ``(X, y)`` unless a step was given."""
        return (X, y) if self._step is None else self._step(X, y)

    def check(self, stats: Any) -> None:
        """Gathered values are inputs and targets, already checked by the batch preparation."""

    def add(self, total: list[tuple[Any, ...]], stats: tuple[Any, ...]) -> list[tuple[Any, ...]]:
        """Keep the values of a batch."""
        total.append(stats)
        return total

    def finish(self, total: list[tuple[Any, ...]]) -> tuple[Any, ...]:
        """Each value concatenated over the batches."""
        return tuple(concatenate_rows(list(field)) for field in zip(*total, strict=True))


class _Passes:
    """See :meth:`DataLoop.passes`."""

    def __init__(
        self, loop: DataLoop, loader: DataLoader, step: Callable[[Inputs, Tensor], Any] | None
    ) -> None:
        self.loop, self.loader, self.step = loop, loader, step

    def __iter__(self) -> Iterator[Any]:
        for X, y in self.loop.batches(self.loader, progress_bar=False):
            yield (X, y) if self.step is None else self.step(X, y)


def training_indices(loader: DataLoader) -> Tensor:
    """Dataset indices the loader's sampler can reach, shape (n,), ``long``.

    A sequential sampler gives ``0..N-1`` (cut to whole batches with ``drop_last``); a random
    permutation sampler the same without consuming its generator; a ``SubsetRandomSampler`` its
    indices; any other sampler is iterated once.

    Raises:
        ValueError: For an empty sampler, out-of-range indices, or a ``drop_last`` batch sampler
            without a positive batch size.
    """
    batch_sampler = loader.batch_sampler
    sampler = loader.sampler if batch_sampler is None else getattr(batch_sampler, "sampler", None)
    n = len(loader.dataset)
    if sampler is None:
        indices = [i for batch in batch_sampler for i in batch]
    elif isinstance(sampler, SequentialSampler):
        indices = list(range(n))
        if getattr(batch_sampler, "drop_last", False):
            size = getattr(batch_sampler, "batch_size", None)
            if not isinstance(size, int) or size <= 0:
                raise ValueError("a drop_last batch sampler needs a positive batch_size.")
            indices = indices[: len(batch_sampler) * size]
    elif (
        isinstance(sampler, RandomSampler) and not sampler.replacement and sampler.num_samples == n
    ):
        indices = list(range(n))
    elif isinstance(sampler, SubsetRandomSampler):
        indices = list(sampler.indices)
    else:
        indices = list(sampler)
    result = torch.as_tensor(indices, dtype=torch.long)
    if result.dim() != 1 or result.numel() == 0:
        raise ValueError("the training loader's sampler yields no indices.")
    if bool((result < 0).any()) or bool((result >= n).any()):
        raise ValueError(f"the training sampler yields indices outside [0, {n}).")
    return result


def subset_loader(loader: DataLoader, indices: Tensor) -> DataLoader:
    """A non-shuffled loader over ``loader.dataset[indices]``, same batch size and collate."""
    size = loader.batch_size or getattr(loader.batch_sampler, "batch_size", 1)
    return DataLoader(
        Subset(loader.dataset, indices.cpu().tolist()),
        batch_size=size,
        collate_fn=loader.collate_fn,
        shuffle=False,
    )
