"""One data loop for every pass over a loader: fits, kernel builds, scoring and training.

``DataLoop`` prepares each batch, checks and sums the statistics of its ``step`` into a fresh
value (a pass that raises changes nothing) and all-reduces them in a distributed pass;
``Gather`` concatenates instead. docs/architecture.md ("The data loop") lists the passes.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator
from typing import Generic, TypedDict, TypeVar, cast, overload

import torch
from torch import Tensor
from torch.utils.data import (
    DataLoader,
)
from tqdm.auto import tqdm

from laplace.utils import distributed as distributed_utils
from laplace.utils.data import Inputs, concatenate_rows, prepare_batch
from laplace.utils.errors import ArgumentTypeError, check_finite_result

__all__ = [
    "DataLoop",
    "Gather",
    "LoopArguments",
    "LoopOptions",
    "progress",
    "set_progress_bars",
]

T = TypeVar("T")
#: What ``step`` gives for one batch.
Stats = TypeVar("Stats")
#: What the statistics of the batches are added up into (``start``, ``add``).
Total = TypeVar("Total")
#: What ``run`` returns (``finish`` of the total).
Result = TypeVar("Result")
#: The positional arguments of a ``DataLoop``: ``(dict_key_x, dict_key_y, device)``.
LoopArguments = tuple[str | None, str, torch.device]


class LoopOptions(TypedDict, total=False):
    """The keyword arguments of a ``DataLoop`` besides ``step`` (see ``DataLoop``)."""

    check_inputs: Callable[[Inputs], None] | None
    progress_bar: bool
    desc: str
    distributed: bool
    what: str
    empty_message: str | None


SWITCH_VALUES = {"0": False, "false": False, "off": False, "1": True, "true": True, "on": True}


def _switch_from_environment() -> bool | None:
    """``LAPLACE_PROGRESS_BARS`` read as a switch: unset/empty gives None (per-call flags)."""
    value = os.environ.get("LAPLACE_PROGRESS_BARS", "").strip().lower()
    if value and value not in SWITCH_VALUES:
        raise ValueError(
            f"LAPLACE_PROGRESS_BARS={value!r}: expected one of {', '.join(SWITCH_VALUES)} "
            "(or unset, so that each call's progress_bar flag decides)."
        )
    return SWITCH_VALUES.get(value)


_progress_bars: bool | None = _switch_from_environment()


def set_progress_bars(enabled: bool | None) -> None:
    """Show (True) or hide (False) every progress bar of laplace-ng, whatever a call asks.

    None gives the decision back to each call's ``progress_bar`` flag (the default). The
    environment variable ``LAPLACE_PROGRESS_BARS`` (``1``/``0``) sets the same switch at import.

    Raises:
        ArgumentTypeError: (a ``TypeError`` and a ``ValueError``, as the package's other
            argument checks) if ``enabled`` is not a bool or None.
    """
    global _progress_bars
    if enabled is not None and not isinstance(enabled, bool):
        raise ArgumentTypeError(f"enabled must be True, False or None, got {enabled!r}.")
    _progress_bars = enabled


def progress(iterable: Iterable[T], show: bool, desc: str) -> Iterable[T]:
    """``iterable`` with a tqdm bar when the global switch, or else ``show``, says so."""
    enabled = show if _progress_bars is None else _progress_bars
    return tqdm(iterable, disable=not enabled, desc=desc)


class DataLoop(Generic[Stats, Total, Result]):
    """Template method of one pass over a data loader.

    ``run`` is ``total = start()``, then ``check`` and ``add`` of each of ``summands(loader)``
    (``step(X, y)`` per prepared batch), the all-reduce of a distributed pass, ``finish(total)``.
    The loop is generic in the statistics of a batch (``Stats``), their sum (``Total``) and the
    result (``Result``); the default hooks sum tensors (or tuples of them) into their result.

    Args:
        dict_key_x: Key of the inputs in dict-like batches.
        dict_key_y: Key of the targets in dict-like batches.
        device: The model's device; batches are moved there.
        check_inputs: Called on the inputs of every batch (e.g. a backend refusing dict inputs).
        progress_bar: Show a progress bar over the batches.
        desc: Label of the progress bar.
        distributed: Sum the totals over the ranks of ``torch.distributed``; a rank that
            fails makes every rank raise.
        what: Name of the pass in error messages (``"fit"``, ...).
        empty_message: Message of the ``ValueError`` raised when the loader yields no batch;
            None: no error, ``finish`` receives ``start``'s value.
        step: The per-batch statistics ``(X, y) -> stats``, instead of overriding ``step``.
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
        step: Callable[[Inputs, Tensor], Stats] | None = None,
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

        ``progress_bar`` None: as the loop was built.

        Raises:
            ValueError: For batches ``prepare_batch`` refuses, and what ``check_inputs`` raises.
        """
        show = self.progress_bar if progress_bar is None else progress_bar
        for batch in progress(loader, show, self.desc):
            X, y = prepare_batch(batch, self.dict_key_x, self.dict_key_y, self.device)
            if self.check_inputs is not None:
                self.check_inputs(X)
            yield X, y

    def cycle(self, loader: DataLoader, n_steps: int) -> Iterator[tuple[Inputs, Tensor]]:
        """``n_steps`` prepared batches (one per optimiser step), restarting ``loader`` as needed.

        Raises:
            ValueError: If the loader yields no batch (``empty_message``).
        """
        source: Iterator[tuple[Inputs, Tensor]] = iter(())
        for _ in progress(range(n_steps), self.progress_bar, self.desc):
            batch = next(source, None)
            if batch is None:
                source = self.batches(loader, progress_bar=False)
                batch = next(source, None)
            if batch is None:
                raise ValueError(self.empty_message or "the data loader yielded no batches.")
            yield batch

    @overload
    def passes(self, loader: DataLoader, step: None = None) -> Iterable[tuple[Inputs, Tensor]]: ...

    @overload
    def passes(self, loader: DataLoader, step: Callable[[Inputs, Tensor], T]) -> Iterable[T]: ...

    def passes(
        self, loader: DataLoader, step: Callable[[Inputs, Tensor], T] | None = None
    ) -> Iterable[T] | Iterable[tuple[Inputs, Tensor]]:
        """A re-iterable of the prepared batches, one pass per iteration (for iterative solvers).

        Each iteration yields ``step(X, y)`` per batch (None: ``(X, y)``).
        """
        if step is None:
            return _Passes(self, loader, _pair)
        return _Passes(self, loader, step)

    def run(self, loader: DataLoader) -> Result:
        """One pass over ``loader``; returns ``finish`` of the accumulated statistics.

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
                del stats  # added: not held while the next batch's are formed
            if n_summands == 0 and self.empty_message is not None:
                raise ValueError(self.empty_message)
        if self.distributed:
            total = distributed_utils.all_reduce_sum(total)
        return self.finish(total)

    # ------------------------------------------------------------------------------ hooks
    def start(self) -> Total:
        """The value statistics are added to (None: the first statistics)."""
        return cast(Total, None)

    def summands(self, loader: DataLoader) -> Iterator[Stats]:
        """The statistics to add up: ``step`` of each prepared batch."""
        for X, y in self.batches(loader):
            yield self.step(X, y)

    def step(self, X: Inputs, y: Tensor) -> Stats:
        """The statistics of one batch: a tensor or a tuple of tensors (or numbers)."""
        if self._step is None:
            raise NotImplementedError(f"{type(self).__name__} needs a step.")
        return self._step(X, y)

    def check(self, stats: Stats) -> None:
        """Refuse statistics with NaN or inf entries.

        Raises:
            RuntimeError: Naming the pass.
        """
        for value in stats if isinstance(stats, tuple) else (stats,):
            if isinstance(value, Tensor):
                check_finite_result(value, f"result of a batch of the {self.what}")

    def add(self, total: Total, stats: Stats) -> Total:
        """``total + stats``, entry by entry for tuples (of tensors or numbers)."""
        if total is None:
            return cast(Total, stats)
        if isinstance(stats, tuple):
            pairs = zip(cast(tuple, total), stats, strict=True)
            return cast(Total, tuple(t + s for t, s in pairs))
        return cast(Total, cast(Tensor | float, total) + cast(Tensor | float, stats))

    def finish(self, total: Total) -> Result:
        """The result of the pass from the accumulated statistics (the total itself)."""
        return cast(Result, total)


#: The values a ``Gather`` keeps of a batch (default ``(X, y)``), one row per data point.
Row = tuple[Inputs, ...]


class Gather(DataLoop[Row, list[Row], Row]):
    """A pass that concatenates per-batch values row-wise instead of summing them.

    ``run`` returns each of ``step``'s values (default ``(X, y)``) over the batches.
    """

    def start(self) -> list[Row]:
        """An empty list of per-batch values."""
        return []

    def step(self, X: Inputs, y: Tensor) -> Row:
        """The values to keep of a batch: ``(X, y)`` unless a step was given."""
        return (X, y) if self._step is None else self._step(X, y)

    def check(self, stats: Row) -> None:
        """Gathered values are inputs and targets, already checked by the batch preparation."""

    def add(self, total: list[Row], stats: Row) -> list[Row]:
        """Keep the values of a batch."""
        total.append(stats)
        return total

    def finish(self, total: list[Row]) -> Row:
        """Each value concatenated over the batches."""
        return tuple(concatenate_rows(list(field)) for field in zip(*total, strict=True))


def _pair(X: Inputs, y: Tensor) -> tuple[Inputs, Tensor]:
    """A batch as it is: ``(X, y)``."""
    return X, y


class _Passes(Generic[T]):
    """The re-iterable of ``DataLoop.passes``: ``step(X, y)`` of each batch per iteration."""

    def __init__(
        self, loop: DataLoop, loader: DataLoader, step: Callable[[Inputs, Tensor], T]
    ) -> None:
        self.loop, self.loader, self.step = loop, loader, step

    def __iter__(self) -> Iterator[T]:
        for X, y in self.loop.batches(self.loader, progress_bar=False):
            yield self.step(X, y)
