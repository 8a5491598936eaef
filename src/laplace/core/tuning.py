"""Prior-precision tuning: marginal-likelihood ascent and validation grid search.

Both receive what they need as values and callables (the log marginal likelihood as a function
of the prior precision, the validation loss of a candidate), never the Laplace object, so they
work with any approximation and never branch on its structure.
:func:`optimize_prior_precision`, every Laplace class's method of that name, wires them.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import torch
from torch import Tensor
from torch.utils.data import DataLoader

from laplace.core import distributed as distributed_utils
from laplace.core.data_loop import progress
from laplace.core.priors import as_prior_precision, fix_prior_prec_structure
from laplace.posteriors import NotPositiveDefiniteError
from laplace.utils.enums import LinkApprox, PredType, PriorStructure, TuningMethod, parse_enum
from laplace.utils.errors import (
    ArgumentTypeError,
    check_int_at_least,
    check_positive_float,
    check_positive_int,
)
from laplace.utils.validation import validate

__all__ = [
    "grid_candidates",
    "gridsearch",
    "maximize_marglik",
    "optimize_prior_precision",
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
    the first of equal losses wins (see :func:`search_grid`). After a distributed fit (see
    :mod:`laplace.core.distributed`) each rank validates on its own shard of ``val_loader`` and the
    losses, taken as means over the shard, are averaged over all validation points, so every
    rank picks the same candidate.

    Args:
        candidates: Candidate prior precisions, shape (G,).
        validation_score: The validation loss with a candidate prior precision (shape (1,))
            set; it may raise :class:`~laplace.posteriors.NotPositiveDefiniteError` or a
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


def optimize_prior_precision(
    la: Any,
    pred_type: PredType | str = PredType.GLM,
    method: TuningMethod | str = TuningMethod.MARGLIK,
    n_steps: int = 100,
    lr: float = 1e-1,
    init_prior_prec: float | Tensor = 1.0,
    prior_structure: PriorStructure | str = PriorStructure.SCALAR,
    val_loader: DataLoader | None = None,
    loss: Any = None,
    log_prior_prec_min: float = -4,
    log_prior_prec_max: float = 4,
    grid_size: int = 100,
    link_approx: LinkApprox | str = LinkApprox.PROBIT,
    n_samples: int = 100,
    verbose: bool = False,
    progress_bar: bool = False,
    log_prior_prec_base: float = 10.0,
) -> None:
    """Tune the prior precision by marginal likelihood or by validation grid search.

    The ``optimize_prior_precision`` method of every Laplace approximation ``la``; a class
    that supports fewer options names them in its ``_refused_prior_structures``.

    Args:
        la: The Laplace approximation.
        pred_type: Predictive used by grid search (``"glm"`` or ``"nn"``).
        method: ``"marglik"`` (Adam on log p₀) or ``"gridsearch"`` (needs ``val_loader``).
        n_steps: Adam steps for marglik.
        lr: Adam learning rate for marglik.
        init_prior_prec: Initial precision for marglik; its structure is kept unless it is
            a scalar, which is then expanded to ``prior_structure``.
        prior_structure: ``"scalar"``, ``"layerwise"`` or ``"diag"`` for marglik.
        val_loader: Validation data for grid search.
        loss: Validation loss for grid search: a torchmetrics Metric, a callable, or a name
            (``"nll"``, ``"ece"``, ``"brier"``, ``"crps"``; see
            :mod:`laplace.evaluation`); defaults to running NLL for classification and
            running MSE for regression.
        log_prior_prec_min: Lower end of the grid, as an exponent of ``log_prior_prec_base``.
        log_prior_prec_max: Upper end of the grid.
        grid_size: Number of grid points.
        link_approx: Link approximation used by grid search.
        n_samples: Samples of the predictive for grid search with MC links.
        verbose: Print the chosen prior precision.
        progress_bar: Show a progress bar.
        log_prior_prec_base: Base of the log-spaced grid.

    Raises:
        ValueError: For an unknown method, structure, pred_type or link_approx, grid
            search without ``val_loader``, an unknown ``loss`` name, a negative
            ``n_steps``, a non-positive ``lr`` or ``grid_size``, or a grid that is not
            finite; a non-integer count raises an error that is a ``ValueError`` and a
            ``TypeError``.
    """
    method = parse_enum(TuningMethod, method, "method")
    pred_type = parse_enum(PredType, pred_type, "pred_type")
    link_approx = parse_enum(LinkApprox, link_approx, "link_approx")
    prior_structure = parse_enum(PriorStructure, prior_structure, "prior_structure")
    refusal = la._refused_prior_structures.get(prior_structure)
    if refusal is not None:
        raise ValueError(refusal)
    if method == TuningMethod.MARGLIK:
        check_int_at_least(n_steps, "n_steps", 0)
        check_positive_float(lr, "lr")
    la._check_fitted("optimize_prior_precision")
    if method == TuningMethod.MARGLIK:
        if torch.is_tensor(init_prior_prec) and init_prior_prec.numel() > 1:
            init = as_prior_precision(init_prior_prec, *la._prior_lengths, la._device, la._dtype)
        else:
            init = fix_prior_prec_structure(
                check_positive_float(init_prior_prec, "init_prior_prec"),
                prior_structure,
                *la._prior_lengths,
                la._device,
                la._dtype,
            )
        la.prior_precision = maximize_marglik(
            la.log_marginal_likelihood, init, n_steps, lr, progress_bar
        )
    else:
        if val_loader is None:
            raise ValueError("method='gridsearch' needs a val_loader with validation data.")
        candidates = grid_candidates(
            log_prior_prec_min,
            log_prior_prec_max,
            grid_size,
            log_prior_prec_base,
            la._device,
            la._dtype,
        )
        distributed = getattr(la, "_distributed", False)
        # None: the likelihood's default; a name: its running metric, summed over all ranks
        # when distributed; anything else is the user's metric or callable.
        likelihood = la._likelihood_model.fit_likelihood
        if loss is None:
            loss = likelihood.validation_loss(None, la.n_outputs).to(la._device)
        elif isinstance(loss, str):
            loss = likelihood.validation_loss(
                loss, la.n_outputs, la.sigma_noise, sync_on_compute=distributed
            ).to(la._device)

        def validation_score(prior_precision: Tensor) -> float:
            la.prior_precision = prior_precision
            return validate(
                la,
                val_loader,
                loss,
                pred_type,
                link_approx,
                n_samples,
                dict_key_y=la.dict_key_y,
            )

        la.prior_precision = gridsearch(
            candidates, validation_score, val_loader, distributed, progress_bar
        )
    if verbose:
        print(f"Optimized prior precision is {la.prior_precision}.")
