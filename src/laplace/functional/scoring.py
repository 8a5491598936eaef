"""The validation score of the function-space approximations (laplace-torch 0.3's ELLA/VaLLA).

The mean predictive negative log-likelihood per data point: each likelihood object scores its own
predictive (:meth:`~laplace.likelihoods.LikelihoodModel.predictive_nll`: the observation noise
added to the latent variances for regression, summed over outputs; the probit approximation for
class probabilities).

Internal module.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor

from laplace.core.data_loop import DataLoop
from laplace.core.tuning import search_grid
from laplace.likelihoods import LikelihoodModel
from laplace.posteriors import NotPositiveDefiniteError
from laplace.utils.data import Inputs

__all__ = ["ValidationNLL", "tune_hyperparameters"]


class ValidationNLL(DataLoop):
    """A pass over validation data returning the mean predictive NLL per data point.

    Args:
        *args: See :class:`~laplace.core.data_loop.DataLoop`.
        moments: Latent moments at inputs: means (B, C) and covariances (B, C, C).
        likelihood: The likelihood whose predictive is scored.
        sigma_noise: Observation noise σ (for likelihoods that have one).
        **options: See :class:`~laplace.core.data_loop.DataLoop`.
    """

    def __init__(
        self,
        *args: Any,
        moments: Callable[[Inputs], tuple[Tensor, Tensor]],
        likelihood: LikelihoodModel,
        sigma_noise: Tensor,
        **options: Any,
    ) -> None:
        options.setdefault("what", "validation")
        options.setdefault("empty_message", "val_loader yielded no batches.")
        super().__init__(*args, **options)
        self._moments, self._likelihood, self._sigma_noise = moments, likelihood, sigma_noise

    def step(self, X: Inputs, y: Tensor) -> tuple[Tensor, int]:
        """Summed NLL and number of points of a batch."""
        f_mu, f_var = self._moments(X)
        return self._likelihood.predictive_nll(f_mu, f_var, y, self._sigma_noise), len(y)

    def check(self, stats: tuple[Tensor, int]) -> None:
        """A non-finite score is a result (grid search skips the candidate), not an error."""

    def finish(self, total: tuple[Tensor, int]) -> Tensor:
        """The mean over the data points."""
        nll, count = total
        return nll / count


def tune_hyperparameters(
    la: Any, grid: Iterable[Any], score: Callable[[], float]
) -> list[dict[str, float]]:
    """Set the candidate of ``grid`` with the lowest ``score`` on ``la``.

    The first candidate with the lowest finite score wins
    (:func:`laplace.core.tuning.search_grid`).

    Args:
        la: A fitted Laplace approximation.
        grid: Prior precisions, or ``(prior_precision, sigma_noise)`` pairs.
        score: The validation loss of ``la`` with the hyperparameters it holds; a candidate
            whose posterior cannot be factorised scores NaN.

    Returns:
        One record per candidate: ``prior_precision``, ``sigma_noise``, ``val_nll``.

    Raises:
        ValueError: For an empty grid, or if no candidate has a finite score (the
            hyperparameters are then restored).
    """
    initial = (la.prior_precision, la.sigma_noise)
    records = []

    def apply(candidate: Any) -> None:
        if isinstance(candidate, (tuple, list)):
            la.prior_precision, la.sigma_noise = candidate
        else:
            la.prior_precision = candidate

    def scored(candidate: Any) -> float:
        apply(candidate)
        try:
            value = score()
        except (NotPositiveDefiniteError, torch.linalg.LinAlgError):
            value = math.nan
        records.append(
            {
                "prior_precision": float(la.prior_precision),
                "sigma_noise": float(la.sigma_noise),
                "val_nll": value,
            }
        )
        return value

    best, _ = search_grid(grid, scored)
    if best is None:
        la.prior_precision, la.sigma_noise = initial
        if not records:
            raise ValueError("the hyperparameter grid is empty.")
        raise ValueError("no candidate of the grid gives a finite validation NLL.")
    apply(best)
    return records
