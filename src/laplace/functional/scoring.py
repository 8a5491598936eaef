"""The validation score of the function-space approximations (laplace-torch 0.3's ELLA/VaLLA).

The mean predictive negative log-likelihood per data point: each likelihood object scores its own
predictive (:meth:`~laplace.likelihoods.LikelihoodModel.predictive_nll`: the observation noise
added to the latent variances for regression, summed over outputs; the probit approximation for
class probabilities).

Internal module.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import Tensor

from laplace.data import Inputs
from laplace.data_loop import DataLoop
from laplace.likelihoods import LikelihoodModel

__all__ = ["ValidationNLL"]


class ValidationNLL(DataLoop):
    """A pass over validation data returning the mean predictive NLL per data point.

    Args:
        *args: See :class:`~laplace.data_loop.DataLoop`.
        moments: Latent moments at inputs: means (B, C) and covariances (B, C, C).
        likelihood: The likelihood whose predictive is scored.
        sigma_noise: Observation noise σ (for likelihoods that have one).
        **options: See :class:`~laplace.data_loop.DataLoop`.
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
