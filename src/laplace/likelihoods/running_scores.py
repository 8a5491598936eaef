r"""The running metrics of scoring rules: means, reliability bins, PIT counts (torchmetrics).

Each metric keeps float64 sums that ``torchmetrics`` adds across processes
(``sync_on_compute``); the rules they average are those of ``laplace.likelihoods.scoring``.
This module imports ``torchmetrics``, so the likelihoods import it where they build a metric,
never at ``import laplace``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial

import torch
from torch import Tensor
from torchmetrics import Metric
from torchmetrics.functional.classification import binary_calibration_error
from torchmetrics.utilities import dim_zero_cat
from typing_extensions import Unpack

from laplace.likelihoods.scoring import (
    N_BINS,
    MetricOptions,
    gaussian_crps,
    gaussian_nll,
    gaussian_predictive,
    heteroscedastic_moments,
    marginal_variances,
    targets_like,
)

__all__ = [
    "BernoulliAccuracy",
    "BernoulliBrier",
    "BernoulliNLL",
    "BrierScore",
    "GaussianCRPS",
    "GaussianNLL",
    "HeteroscedasticCRPS",
    "HeteroscedasticNLL",
    "MeanScore",
    "PITCalibration",
    "PerLabelCalibrationError",
    "ReliabilityBins",
]


def _brier(probs: Tensor, target: Tensor) -> Tensor:
    picked = probs.gather(-1, target.long().reshape(-1, 1)).squeeze(-1)
    return probs.square().sum(-1) - 2 * picked + 1


def _per_label(rule: Callable[[Tensor, Tensor], Tensor], probs: Tensor, target: Tensor) -> Tensor:
    probs = probs.to(torch.float64)
    return rule(probs, target.reshape(probs.shape).to(torch.float64))


def _label_nll(p: Tensor, y: Tensor) -> Tensor:
    return -torch.special.xlogy(y, p) - torch.special.xlogy(1 - y, 1 - p)


def _label_accuracy(p: Tensor, y: Tensor) -> Tensor:
    return ((p > 0.5) == (y > 0.5)).to(p.dtype)


def _label_brier(p: Tensor, y: Tensor) -> Tensor:
    return (p - y).square()


def _gaussian_rule(
    rule: Callable[[Tensor, Tensor, Tensor], Tensor],
    sigma_noise: Tensor,
    f_mu: Tensor,
    f_var: Tensor,
    target: Tensor,
) -> Tensor:
    mean, cov = gaussian_predictive(f_mu, f_var, sigma_noise)
    return rule(mean, cov, targets_like(target, mean))


def _crps(mean: Tensor, cov: Tensor, target: Tensor) -> Tensor:
    return gaussian_crps(mean, marginal_variances(cov).sqrt(), target)


def _heteroscedastic_rule(
    rule: Callable[[Tensor, Tensor, Tensor], Tensor],
    mean: Tensor,
    epistemic_variance: Tensor,
    aleatoric_variance: Tensor,
    target: Tensor,
) -> Tensor:
    moments = heteroscedastic_moments(mean, epistemic_variance, aleatoric_variance)
    return _gaussian_rule(rule, torch.zeros((), dtype=torch.float64), *moments, target)


# ------------------------------------------------------------------------------ running metrics
class _Sums(Metric):
    """A metric of float64 sums, added across processes."""

    is_differentiable = False
    higher_is_better = False
    full_state_update = False

    def sum_state(self, name: str, size: int | None = None) -> None:
        """Register a float64 state of shape () or (size,) that processes add up."""
        default = torch.zeros(() if size is None else (size,), dtype=torch.float64)
        self.add_state(name, default=default, dist_reduce_fx="sum")

    def grid(self, n_bins: int) -> Tensor:
        """The levels ``k / n_bins``, ``k = 0..n_bins``, in float64 on the metric's device."""
        return torch.linspace(0, 1, n_bins + 1, dtype=torch.float64, device=self.device)


class MeanScore(_Sums):
    """The running mean of a scoring rule over the entries it returns.

    Args:
        score: Maps the arguments of ``update`` to scores, any shape (each entry one term
            of the mean), or (B, K) with ``n_labels``.
        n_labels: Keep one mean per label (the last dimension of the scores), over the points.
        **kwargs: Keyword arguments of ``torchmetrics.Metric``.
    """

    def __init__(
        self,
        score: Callable[..., Tensor],
        n_labels: int | None = None,
        **kwargs: Unpack[MetricOptions],
    ) -> None:
        super().__init__(**kwargs)
        self.score, self.n_labels = score, n_labels
        self.sum_state("total", n_labels)
        self.sum_state("count")

    def update(self, *batch: Tensor) -> None:
        """Add the scores of a batch."""
        scores = self.score(*batch)
        if self.n_labels is None:
            self.total += scores.sum(dtype=torch.float64)
            self.count += scores.numel()
        else:
            self.total += scores.sum(0)
            self.count += scores.shape[0]

    def compute(self) -> Tensor:
        """The mean score (one per label with ``n_labels``; NaN before any update)."""
        return self.total / self.count


class BrierScore(MeanScore):
    """Multiclass Brier score ``(1/N) Σ_n Σ_c (p_nc − 1[y_n = c])²`` of probabilities (B, C)."""

    def __init__(self, **kwargs: Unpack[MetricOptions]) -> None:
        super().__init__(_brier, **kwargs)


class BernoulliNLL(MeanScore):
    """Per-label NLL ``−(1/N) Σ_n [y log p + (1 − y) log(1 − p)]`` of probabilities (B, K)."""

    def __init__(self, n_labels: int, **kwargs: Unpack[MetricOptions]) -> None:
        super().__init__(partial(_per_label, _label_nll), n_labels, **kwargs)


class BernoulliAccuracy(MeanScore):
    """Per-label accuracy ``(1/N) Σ_n 1[(p > ½) = y]`` of probabilities (B, K), any K ≥ 1."""

    def __init__(self, n_labels: int, **kwargs: Unpack[MetricOptions]) -> None:
        super().__init__(partial(_per_label, _label_accuracy), n_labels, **kwargs)


class BernoulliBrier(MeanScore):
    """Per-label Brier score ``(1/N) Σ_n (p − y)²`` of probabilities (B, K)."""

    def __init__(self, n_labels: int, **kwargs: Unpack[MetricOptions]) -> None:
        super().__init__(partial(_per_label, _label_brier), n_labels, **kwargs)


class GaussianNLL(MeanScore):
    """Mean NLL per point of ``update(f_mu, f_var, y)`` under ``N(f_mu, f_var + σ²I)``.

    Args:
        sigma_noise: Observation noise σ (0: ``f_var`` is already the predictive variance).
        **kwargs: Keyword arguments of ``torchmetrics.Metric``.
    """

    def __init__(self, sigma_noise: float | Tensor = 0.0, **kwargs: Unpack[MetricOptions]) -> None:
        sigma = torch.as_tensor(sigma_noise, dtype=torch.float64).detach().clone()
        super().__init__(partial(_gaussian_rule, gaussian_nll, sigma), **kwargs)


class GaussianCRPS(MeanScore):
    """Mean CRPS over points and outputs of ``update(f_mu, f_var, y)``, noise σ added.

    Args:
        sigma_noise: Observation noise σ (0: ``f_var`` is already the predictive variance).
        **kwargs: Keyword arguments of ``torchmetrics.Metric``.
    """

    def __init__(self, sigma_noise: float | Tensor = 0.0, **kwargs: Unpack[MetricOptions]) -> None:
        sigma = torch.as_tensor(sigma_noise, dtype=torch.float64).detach().clone()
        super().__init__(partial(_gaussian_rule, _crps, sigma), **kwargs)


class HeteroscedasticNLL(MeanScore):
    """``GaussianNLL`` of ``update(mean, epistemic_variance, aleatoric_variance, y)``."""

    def __init__(self, **kwargs: Unpack[MetricOptions]) -> None:
        super().__init__(partial(_heteroscedastic_rule, gaussian_nll), **kwargs)


class HeteroscedasticCRPS(MeanScore):
    """``GaussianCRPS`` of ``update(mean, epistemic_variance, aleatoric_variance, y)``."""

    def __init__(self, **kwargs: Unpack[MetricOptions]) -> None:
        super().__init__(partial(_heteroscedastic_rule, _crps), **kwargs)


class ReliabilityBins(_Sums):
    """Per-bin count, summed confidence and summed correctness over K equal-width bins of [0, 1].

    Bin ``k`` holds the confidences in ``[k/K, (k+1)/K)``, the last also 1; the expected
    calibration error is ``Σ_k (n_k/N) |acc_k − conf_k|``.

    Args:
        n_bins: Number of bins K.
        **kwargs: Keyword arguments of ``torchmetrics.Metric``.
    """

    def __init__(self, n_bins: int = N_BINS, **kwargs: Unpack[MetricOptions]) -> None:
        super().__init__(**kwargs)
        self.n_bins = n_bins
        for name in ("count", "confidence", "correct"):
            self.sum_state(name, n_bins)

    def update(self, confidence: Tensor, correct: Tensor) -> None:
        """Add confidences (N,) in [0, 1] and whether each prediction was right (N,)."""
        confidence = confidence.reshape(-1).to(torch.float64)
        index = (confidence * self.n_bins).long().clamp(0, self.n_bins - 1)
        self.count += torch.bincount(index, minlength=self.n_bins).to(torch.float64)
        self.confidence += torch.bincount(index, confidence, minlength=self.n_bins)
        correct = correct.reshape(-1).to(torch.float64)
        self.correct += torch.bincount(index, correct, minlength=self.n_bins)

    def compute(self) -> dict[str, Tensor]:
        """``bin_edges`` (K+1,), mean ``confidence``, ``accuracy`` (0 if empty), ``count`` (K,)."""
        count = self.count.clamp_min(1)
        return {
            "bin_edges": self.grid(self.n_bins),
            "confidence": self.confidence / count,
            "accuracy": self.correct / count,
            "count": self.count,
        }


class PerLabelCalibrationError(Metric):
    """torchmetrics' binary calibration error of each of K independent labels.

    Keeps the probabilities and targets (N, K) and bins each label at ``compute``.

    Args:
        n_labels: Number of labels K.
        n_bins: Number of equal-width bins.
        norm: ``"l1"`` (expected calibration error) or ``"max"`` (maximum calibration error).
        **kwargs: Keyword arguments of ``torchmetrics.Metric``.
    """

    is_differentiable = False
    higher_is_better = False
    full_state_update = False

    def __init__(
        self,
        n_labels: int,
        n_bins: int = N_BINS,
        norm: str = "l1",
        **kwargs: Unpack[MetricOptions],
    ) -> None:
        super().__init__(**kwargs)
        self.n_labels, self.n_bins, self.norm = n_labels, n_bins, norm
        self.add_state("probs", default=[], dist_reduce_fx="cat")
        self.add_state("target", default=[], dist_reduce_fx="cat")

    def update(self, probs: Tensor, target: Tensor) -> None:
        """Add label probabilities (B, K) and targets (B, K) in {0, 1}."""
        self.probs.append(probs.detach())
        self.target.append(target.reshape(probs.shape).long())

    def compute(self) -> Tensor:
        """The calibration error of each label, shape (K,)."""
        probs, target = dim_zero_cat(self.probs).T.contiguous(), dim_zero_cat(self.target).T
        return torch.stack(
            [
                binary_calibration_error(probs[k], target[k], self.n_bins, self.norm)
                for k in range(self.n_labels)
            ]
        )


class PITCalibration(_Sums):
    """Calibration curve of the probability integral transform and interval coverage.

    ``update(f_mu, f_var, y)`` scores ``N(f_mu, f_var + σ²I)`` per output.

    Args:
        levels: Levels α in (0, 1) of the central intervals ``|z| ≤ Φ⁻¹((1 + α)/2)`` counted.
        n_bins: The curve is evaluated at the levels ``k / n_bins``, ``k = 0..n_bins``.
        sigma_noise: Observation noise σ (0: ``f_var`` is already the predictive variance).
        **kwargs: Keyword arguments of ``torchmetrics.Metric``.
    """

    def __init__(
        self,
        levels: Sequence[float] = (0.5, 0.9, 0.95),
        n_bins: int = N_BINS,
        sigma_noise: float | Tensor = 0.0,
        **kwargs: Unpack[MetricOptions],
    ) -> None:
        super().__init__(**kwargs)
        self.sigma_noise = torch.as_tensor(sigma_noise, dtype=torch.float64).detach().clone()
        self.levels = tuple(float(level) for level in levels)
        self.n_bins = n_bins
        self.sum_state("pit_count", n_bins)
        self.sum_state("covered", len(self.levels))
        self.sum_state("count")

    def update(self, f_mu: Tensor, f_var: Tensor, target: Tensor) -> None:
        """Add a batch: means (B, C), covariances (B, C, C) or variances (B, C), targets."""
        mean, cov = gaussian_predictive(f_mu, f_var, self.sigma_noise)
        target = targets_like(target, mean)
        z = ((target - mean) / marginal_variances(cov).sqrt()).reshape(-1).to(torch.float64)
        index = (torch.special.ndtr(z) * self.n_bins).long().clamp(0, self.n_bins - 1)
        self.pit_count += torch.bincount(index, minlength=self.n_bins).to(torch.float64)
        half_widths = torch.special.ndtri(
            (1 + torch.tensor(self.levels, dtype=torch.float64, device=z.device)) / 2
        )
        self.covered += (z.abs().unsqueeze(-1) <= half_widths).sum(0).to(torch.float64)
        self.count += z.numel()

    def compute(self) -> dict[str, Tensor]:
        """``expected`` levels (K+1,), ``observed`` fractions of PIT ≤ level, ``coverage``."""
        observed = torch.cat([self.pit_count.new_zeros(1), self.pit_count.cumsum(0)])
        return {
            "expected": self.grid(self.n_bins),
            "observed": observed / self.count,
            "coverage": self.covered / self.count,
        }
