"""Prior-precision tuning: marginal-likelihood ascent and validation grid search.

Both receive what they need as values and callables (the log marginal likelihood as a function
of the prior precision, the validation loss of a candidate), never the Laplace object, so they
work with any approximation and never branch on its structure.
``optimize_prior_precision``, every Laplace class's method of that name, wires them.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Iterable
from typing import TypeVar

import torch
from torch import Tensor
from torch.utils.data import DataLoader

from laplace.core import distributed as distributed_utils
from laplace.core.data_loop import progress
from laplace.posteriors import NotPositiveDefiniteError
from laplace.utils.errors import (
    ArgumentTypeError,
    check_positive_float,
    check_positive_int,
)

__all__ = [
    "grid_candidates",
    "gridsearch",
    "maximize_marglik",
    "search_grid",
]

T = TypeVar("T")


def maximize_marglik(
    log_marginal_likelihood: Callable[[Tensor], Tensor],
    init: Tensor,
    n_steps: int,
    lr: float,
    progress_bar: bool = False,
) -> Tensor:
    """Maximise the log marginal likelihood over ``log p₀`` with Adam.

    Args:
        log_marginal_likelihood: The log marginal likelihood of a fitted Laplace approximation
            as a differentiable function of the prior precision.
        init: Initial prior precision, any valid structure (scalar/layer-wise/diagonal).
        n_steps: Number of Adam steps.
        lr: Adam learning rate.
        progress_bar: Whether to show a progress bar.

    Returns:
        The optimised prior precision (detached), same shape as ``init``.
    """
    log_prior = init.detach().log().requires_grad_(True)
    optimizer = torch.optim.Adam([log_prior], lr=lr)
    for _ in progress(range(n_steps), progress_bar, "marglik tuning"):
        optimizer.zero_grad()
        neg_marglik = -log_marginal_likelihood(log_prior.exp())
        neg_marglik.backward()
        optimizer.step()
    return log_prior.detach().exp()


def grid_candidates(
    low: float, high: float, size: int, base: float, device: torch.device, dtype: torch.dtype
) -> Tensor:
    """The candidate prior precisions ``base ** linspace(low, high, size)`` of a grid search.

    Raises:
        ValueError: For a non-positive ``size``, non-finite exponents, or a base that is not
            positive or is 1; a non-number raises an error that is a ``ValueError`` and a
            ``TypeError``.
    """
    check_positive_int(size, "grid_size")
    for name, value in (("log_prior_prec_min", low), ("log_prior_prec_max", high)):
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise ArgumentTypeError(f"{name} must be a real number, got {value!r}.")
        if not math.isfinite(value):
            raise ValueError(f"{name} must be finite, got {value!r}.")
    if check_positive_float(base, "log_prior_prec_base") == 1:
        raise ValueError("log_prior_prec_base must not be 1: every candidate would equal 1.")
    return torch.logspace(low, high, size, base=base, device=device, dtype=dtype)


def search_grid(
    candidates: Iterable[T],
    score: Callable[[T], float],
    progress_bar: bool = False,
) -> tuple[T | None, list[float]]:
    """Score every candidate; the first one with the lowest finite score wins.

    Args:
        candidates: Hyperparameter settings to try, in order.
        score: Applies a candidate to the approximation and returns its validation loss
            (NaN or inf when the candidate cannot be evaluated).
        progress_bar: Show a progress bar.

    Returns:
        The best candidate (None when no score is finite) and the scores in candidate order.
    """
    best, best_score, scores = None, math.inf, []
    for candidate in progress(candidates, progress_bar, "gridsearch"):
        value = score(candidate)
        scores.append(value)
        if math.isfinite(value) and value < best_score:
            best, best_score = candidate, value
    return best, scores


def gridsearch(
    candidates: Tensor,
    validation_score: Callable[[Tensor], float],
    val_loader: DataLoader,
    distributed: bool = False,
    progress_bar: bool = False,
) -> Tensor:
    """Pick the candidate prior precision with the lowest validation loss.

    Candidates whose posterior cannot be factorised or whose loss is not finite are skipped;
    the first of equal losses wins (see ``search_grid``). After a distributed fit (see
    ``laplace.core.distributed``) each rank validates on its own shard of ``val_loader`` and the
    losses, taken as means over the shard, are averaged over all validation points, so every
    rank picks the same candidate.

    Args:
        candidates: Candidate prior precisions, shape (G,).
        validation_score: The validation loss with a candidate prior precision (shape (1,))
            set; it may raise ``NotPositiveDefiniteError`` or a
            ``LinAlgError`` for a candidate whose posterior cannot be factorised.
        val_loader: The validation data ``validation_score`` reads (counted when distributed).
        distributed: Whether the approximation was fitted across processes.
        progress_bar: Whether to show a progress bar.

    Returns:
        The best candidate, shape (1,).

    Raises:
        RuntimeError: If no candidate gives a finite validation loss.
    """
    n_val = distributed_utils.data_count(val_loader) if distributed else 1

    def score(prior_prec: Tensor) -> float:
        with distributed_utils.guard(distributed, "gridsearch"):
            try:
                value = validation_score(prior_prec.reshape(1))
            except (NotPositiveDefiniteError, torch.linalg.LinAlgError):
                value = float("inf")
        if distributed:  # the mean over all ranks' validation points
            sums = torch.tensor(
                [value * n_val, n_val], dtype=torch.float64, device=candidates.device
            )
            total, count = distributed_utils.all_reduce_sum(sums).tolist()
            value = total / count
        return value

    best, _ = search_grid(candidates, score, progress_bar)
    if best is None:
        raise RuntimeError("gridsearch: every candidate prior precision gave a non-finite loss.")
    return best.reshape(1)
