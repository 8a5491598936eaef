"""Prior-precision tuning: marginal-likelihood ascent, grid search and Bayesian optimisation.

All receive what they need as values and callables (the log marginal likelihood as a function
of the prior precision, the validation loss of a candidate), never the Laplace object, so they
work with any approximation and never branch on its structure.
``optimize_prior_precision``, every Laplace class's method of that name, wires them.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import math
import numbers
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

import torch
from torch import Tensor
from torch.utils.data import DataLoader

from laplace.core.passes.data_loop import progress
from laplace.structures import NotPositiveDefiniteError
from laplace.utils import distributed as distributed_utils
from laplace.utils.errors import (
    ArgumentTypeError,
    check_positive_float,
    check_positive_int,
)

__all__ = [
    "adam_step",
    "bayesopt",
    "check_bayesopt_arguments",
    "grid_candidates",
    "gridsearch",
    "import_optuna",
    "maximize_marglik",
    "search_grid",
    "validation_objective",
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

    Each step is ``torch.optim.Adam``'s with its defaults and the learning rate ``lr``, written
    out for the one tensor ``log p₀`` (``adam_step``): torch's optimizer and its functional
    ``adam`` spend 0.15–0.3 ms per call on argument handling, more than a tuning step of a
    last-layer or diagonal posterior costs.

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
    moments = torch.zeros_like(log_prior), torch.zeros_like(log_prior)
    steps_taken = 0
    for _ in progress(range(n_steps), progress_bar, "marglik tuning"):
        log_prior.grad = None
        neg_marglik = -log_marginal_likelihood(log_prior.exp())
        neg_marglik.backward()
        if log_prior.grad is None:  # no gradient: Adam leaves the parameter as it is
            continue
        steps_taken += 1
        with torch.no_grad():
            adam_step(log_prior, log_prior.grad, *moments, steps_taken, lr)
    return log_prior.detach().exp()


def adam_step(
    param: Tensor, grad: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, step: int, lr: float
) -> None:
    """One step of ``torch.optim.Adam`` with its defaults (β = (0.9, 0.999), ε = 1e-8).

    The operations of torch's single-tensor Adam in its order, so the numbers are its own;
    ``param``, ``exp_avg`` and ``exp_avg_sq`` are updated in place, ``step`` counts from 1.
    """
    beta1, beta2, eps = 0.9, 0.999, 1e-8
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    bias_correction1 = 1 - beta1 ** float(step)
    bias_correction2 = 1 - beta2 ** float(step)
    denom = (exp_avg_sq.sqrt() / bias_correction2**0.5).add_(eps)
    param.addcdiv_(exp_avg, denom, value=-(lr / bias_correction1))


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
    _check_exponent_range(low, high, base)
    return torch.logspace(low, high, size, base=base, device=device, dtype=dtype)


def _check_exponent_range(low: float, high: float, base: float) -> None:
    """Refuse exponents that are not finite real numbers and a base that is not positive or is 1.

    Raises:
        ValueError: For non-finite exponents or a base that is not positive or is 1; a
            non-number raises an error that is a ``ValueError`` and a ``TypeError``.
    """
    for name, value in (("log_prior_prec_min", low), ("log_prior_prec_max", high)):
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise ArgumentTypeError(f"{name} must be a real number, got {value!r}.")
        if not math.isfinite(value):
            raise ValueError(f"{name} must be finite, got {value!r}.")
    if check_positive_float(base, "log_prior_prec_base") == 1:
        raise ValueError("log_prior_prec_base must not be 1: every candidate would equal 1.")


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


def validation_objective(
    validation_score: Callable[[T], float],
    val_loader: DataLoader,
    distributed: bool,
    device: torch.device,
    search: str,
) -> Callable[[T], float]:
    """The score of a candidate as every validation search (grid, Bayesian) sees it.

    A candidate whose posterior cannot be factorised scores inf. After a distributed fit (see
    ``laplace.utils.distributed``) each rank validates on its own shard of ``val_loader`` and the
    losses, taken as means over the shard, are averaged over all validation points, so every
    rank sees the same score.

    Args:
        validation_score: The validation loss with a candidate set; it may raise
            ``NotPositiveDefiniteError`` or a ``LinAlgError`` for a candidate whose posterior
            cannot be factorised.
        val_loader: The validation data ``validation_score`` reads (counted when distributed).
        distributed: Whether the approximation was fitted across processes.
        device: Device of the approximation (of the tensor summed over the ranks).
        search: Name of the search, in the error of a rank whose evaluation failed.

    Returns:
        The score of a candidate: a float, inf where the posterior cannot be factorised.
    """
    n_val = distributed_utils.data_count(val_loader) if distributed else 1

    def score(candidate: T) -> float:
        with distributed_utils.guard(distributed, search):
            try:
                value = validation_score(candidate)
            except (NotPositiveDefiniteError, torch.linalg.LinAlgError):
                value = float("inf")
        if distributed:  # the mean over all ranks' validation points
            sums = torch.tensor([value * n_val, n_val], dtype=torch.float64, device=device)
            total, count = distributed_utils.all_reduce_sum(sums).tolist()
            value = total / count
        return value

    return score


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
    ``laplace.utils.distributed``) each rank validates on its own shard of ``val_loader`` and the
    losses, taken as means over the shard, are averaged over all validation points, so every
    rank picks the same candidate.

    Args:
        candidates: Candidate prior precisions, shape (G,).
        validation_score: The validation loss with a candidate prior precision (shape (1,))
            set; it may raise ``NotPositiveDefiniteError`` or a
            ``LinAlgError`` for a candidate whose posterior cannot be factorised (see
            ``validation_objective``).
        val_loader: The validation data ``validation_score`` reads (counted when distributed).
        distributed: Whether the approximation was fitted across processes.
        progress_bar: Whether to show a progress bar.

    Returns:
        The best candidate, shape (1,).

    Raises:
        RuntimeError: If no candidate gives a finite validation loss.
    """
    score = validation_objective(
        lambda prior_prec: validation_score(prior_prec.reshape(1)),
        val_loader,
        distributed,
        candidates.device,
        "gridsearch",
    )
    best, _ = search_grid(candidates, score, progress_bar)
    if best is None:
        raise RuntimeError("gridsearch: every candidate prior precision gave a non-finite loss.")
    return best.reshape(1)


#: How to install what ``method="bayesopt"`` needs (Optuna).
OPTUNA_EXTRA = "pip install 'laplace-ng[bayesopt]'"


def import_optuna() -> Any:
    """The ``optuna`` module, which ``method="bayesopt"`` searches with.

    Raises:
        ImportError: If Optuna is not installed, naming the ``bayesopt`` extra.
    """
    try:
        return importlib.import_module("optuna")
    except ImportError as missing:
        raise ImportError(
            f"method='bayesopt' needs Optuna: {OPTUNA_EXTRA} (or pip install optuna)."
        ) from missing


def check_bayesopt_arguments(
    n_steps: int,
    low: float,
    high: float,
    base: float,
    temperature_range: tuple[float, float] | None,
    seed: int,
) -> tuple[float, float] | None:
    """Check the arguments of a Bayesian-optimisation search before any evaluation.

    Args:
        n_steps: Number of validation evaluations.
        low: Lower end of the log prior precision, an exponent of ``base``.
        high: Upper end, above ``low``.
        base: Base of the exponents.
        temperature_range: ``(low, high)`` bounds of the temperature, positive and finite,
            ``low < high``; None keeps the temperature fixed.
        seed: Seed of the search, an integer in ``[0, 2**32)``.

    Returns:
        ``temperature_range`` as a pair of floats, or None.

    Raises:
        ValueError: Naming the argument and what it accepts; an argument of the wrong type
            raises an error that is a ``ValueError`` and a ``TypeError``.
    """
    check_positive_int(n_steps, "n_steps")
    _check_exponent_range(low, high, base)
    if not low < high:
        raise ValueError(
            "method='bayesopt' searches between log_prior_prec_min and log_prior_prec_max, "
            f"which must satisfy min < max; got {low!r} and {high!r}."
        )
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
        raise ArgumentTypeError(f"seed must be an integer in [0, 2**32), got {seed!r}.")
    if not 0 <= seed < 2**32:
        raise ValueError(f"seed must be an integer in [0, 2**32), got {seed!r}.")
    if temperature_range is None:
        return None
    accepted = "a pair (low, high) of positive, finite numbers with low < high, or None"
    if not isinstance(temperature_range, (tuple, list)) or len(temperature_range) != 2:
        raise ArgumentTypeError(
            f"temperature_range must be {accepted}; got {temperature_range!r}."
        )
    bounds = tuple(check_positive_float(value, "temperature_range") for value in temperature_range)
    if not bounds[0] < bounds[1]:
        raise ValueError(f"temperature_range must be {accepted}; got {temperature_range!r}.")
    return bounds


@contextlib.contextmanager
def _quiet_optuna(optuna: Any) -> Iterator[None]:
    """Silence Optuna's per-trial log and its warning on clipped infinite scores, for a call.

    Only Optuna's own logger changes, and only until the call ends.
    """
    verbosity = optuna.logging.get_verbosity()
    optuna.logging.set_verbosity(logging.WARNING)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Clip non-finite values")
            yield
    finally:
        optuna.logging.set_verbosity(verbosity)


def bayesopt(
    validation_score: Callable[[Tensor, float | None], float],
    n_priors: int,
    low: float,
    high: float,
    base: float,
    temperature_range: tuple[float, float] | None,
    n_steps: int,
    seed: int,
    val_loader: DataLoader,
    device: torch.device,
    dtype: torch.dtype,
    distributed: bool = False,
    progress_bar: bool = False,
) -> tuple[Tensor, float | None]:
    """Search the prior precision (and temperature) by Gaussian-process Bayesian optimisation.

    Optuna's ``GPSampler`` (seeded: the same arguments give the same search) proposes the
    exponents ``e`` (shape (K,)) of the prior precision ``base ** e`` in ``[low, high]`` and,
    with ``temperature_range``, the temperature on a log scale; its first
    ``min(n_steps, 2 * D + 2)`` proposals (``D`` dimensions) are uniformly random, the others
    maximise the expected improvement of a GP fitted to the scores so far. Each proposal is
    scored by ``validation_objective`` (as in ``gridsearch``: inf where the posterior cannot
    be factorised, averaged over the ranks when distributed, where every rank runs the same
    seeded search and a rank that proposes another candidate raises); the first one with the
    lowest finite score wins.

    Args:
        validation_score: The validation loss with a prior precision (shape (K,)) and a
            temperature (None: the current one) set.
        n_priors: Number K of prior precisions searched: 1, or one per parameter tensor.
        low: Lower end of the exponents.
        high: Upper end of the exponents.
        base: Base of the exponents.
        temperature_range: ``(low, high)`` bounds of the temperature; None keeps it fixed.
        n_steps: Number of validation evaluations.
        seed: Seed of the sampler.
        val_loader: The validation data ``validation_score`` reads.
        device: Device of the prior precision.
        dtype: Dtype of the prior precision.
        distributed: Whether the approximation was fitted across processes.
        progress_bar: Whether to show a progress bar.

    Returns:
        The best prior precision, shape (K,), and the best temperature (None when it is fixed).

    Raises:
        ImportError: If Optuna is not installed.
        RuntimeError: If no candidate gives a finite validation loss.
    """
    optuna = import_optuna()
    names = [f"log_prior_prec_{k}" for k in range(n_priors)]
    space = {name: optuna.distributions.FloatDistribution(low, high) for name in names}
    if temperature_range is not None:
        space["temperature"] = optuna.distributions.FloatDistribution(*temperature_range, log=True)

    def decode(params: dict[str, float]) -> tuple[Tensor, float | None]:
        exponents = torch.tensor([params[name] for name in names], device=device, dtype=dtype)
        return base**exponents, params.get("temperature")

    def evaluate(params: dict[str, float]) -> float:
        if distributed:  # the same seeded search on the same scores: the same proposals
            candidate = [params[name] for name in space]
            distributed_utils.check_consistent({"candidate": candidate}, "bayesopt")
        return validation_score(*decode(params))

    score = validation_objective(evaluate, val_loader, distributed, device, "bayesopt")
    with _quiet_optuna(optuna):
        sampler = optuna.samplers.GPSampler(
            seed=seed, n_startup_trials=min(n_steps, 2 * len(space) + 2)
        )
        study = optuna.create_study(direction="minimize", sampler=sampler)
        steps = progress(range(n_steps), progress_bar, "bayesopt")
        trials = (study.ask(space) for _ in steps)  # each asked once the previous one is told

        def score_and_tell(trial: Any) -> float:
            value = score(trial.params)
            study.tell(trial, value if math.isfinite(value) else math.inf)
            return value

        best, _ = search_grid(trials, score_and_tell)
    if best is None:
        raise RuntimeError("bayesopt: every candidate prior precision gave a non-finite loss.")
    return decode(best.params)
