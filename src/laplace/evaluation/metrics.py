r"""Running metrics of predicted probabilities that torchmetrics lacks.

Each metric is a :class:`torchmetrics.Metric` that keeps float64 sums over the batches it has
seen, so evaluating a loader is one pass with constant memory, and the sums are added across
processes by torchmetrics' synchronisation (``sync_on_compute``). Where torchmetrics has the
metric (accuracy, calibration error, mean squared error, AUROC) the evaluation uses it instead.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torchmetrics import Metric
from torchmetrics.functional.classification import binary_calibration_error
from torchmetrics.utilities import dim_zero_cat

__all__ = [
    "BernoulliAccuracy",
    "BernoulliBrier",
    "BernoulliNLL",
    "BrierScore",
    "PerLabelCalibrationError",
    "ReliabilityBins",
    "SumMetric",
    "bernoulli_entropy",
    "categorical_entropy",
]


class SumMetric(Metric):
    """A metric of float64 sums, added across processes."""

    is_differentiable = False
    higher_is_better = False
    full_state_update = False

    def _add_sum(self, name: str, size: int | None = None) -> None:
        default = torch.zeros(() if size is None else (size,), dtype=torch.float64)
        self.add_state(name, default=default, dist_reduce_fx="sum")


def categorical_entropy(probs: Tensor) -> Tensor:
    """Entropy ``−Σ_c p_c log p_c`` of class probabilities (B, C), shape (B,)."""
    return -torch.special.xlogy(probs, probs).sum(-1)


def bernoulli_entropy(probs: Tensor) -> Tensor:
    """Summed entropy of independent labels with probabilities (B, K), shape (B,)."""
    return -(torch.special.xlogy(probs, probs) + torch.special.xlogy(1 - probs, 1 - probs)).sum(-1)


class BrierScore(SumMetric):
    """Multiclass Brier score ``(1/N) Σ_n Σ_c (p_nc − 1[y_n = c])²`` (between 0 and 2)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._add_sum("total")
        self._add_sum("count")

    def update(self, probs: Tensor, target: Tensor) -> None:
        """Add a batch of probabilities (B, C) and integer labels (B,)."""
        picked = probs.gather(-1, target.long().reshape(-1, 1)).squeeze(-1)
        per_point = probs.square().sum(-1) - 2 * picked + 1
        self.total += per_point.sum(dtype=torch.float64)
        self.count += per_point.numel()

    def compute(self) -> Tensor:
        """The mean Brier score (NaN before any update)."""
        return self.total / self.count


class ReliabilityBins(SumMetric):
    """Per-bin count, summed confidence and summed correctness over equal-width bins of [0, 1].

    Bin ``k`` holds the confidences in ``[k/K, (k+1)/K)``; the last bin also holds 1. The
    expected calibration error is ``Σ_k (n_k/N) |acc_k − conf_k|`` over these bins.

    Args:
        n_bins: Number of bins K.
        **kwargs: Keyword arguments of :class:`torchmetrics.Metric`.
    """

    def __init__(self, n_bins: int = 15, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.n_bins = n_bins
        self._add_sum("count", n_bins)
        self._add_sum("confidence", n_bins)
        self._add_sum("correct", n_bins)

    def update(self, confidence: Tensor, correct: Tensor) -> None:
        """Add confidences (N,) in [0, 1] and whether each prediction was right (N,)."""
        confidence = confidence.reshape(-1).to(torch.float64)
        index = (confidence * self.n_bins).long().clamp(0, self.n_bins - 1)
        self.count += torch.bincount(index, minlength=self.n_bins).to(torch.float64)
        self.confidence += torch.bincount(index, confidence, minlength=self.n_bins)
        correct = correct.reshape(-1).to(torch.float64)
        self.correct += torch.bincount(index, correct, minlength=self.n_bins)

    def compute(self) -> dict[str, Tensor]:
        """Bin edges (K+1,), mean confidence (K,), accuracy (K,) and count (K,) per bin.

        Empty bins have confidence and accuracy 0.
        """
        count = self.count.clamp_min(1)
        return {
            "bin_edges": torch.linspace(
                0, 1, self.n_bins + 1, dtype=count.dtype, device=count.device
            ),
            "confidence": self.confidence / count,
            "accuracy": self.correct / count,
            "count": self.count,
        }


class _PerLabelMean(SumMetric):
    """Mean over points of a score of independent Bernoulli labels, one value per label.

    Args:
        n_labels: Number of labels K.
        **kwargs: Keyword arguments of :class:`torchmetrics.Metric`.
    """

    def __init__(self, n_labels: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._add_sum("total", n_labels)
        self._add_sum("count")

    def update(self, probs: Tensor, target: Tensor) -> None:
        """Add label probabilities (B, K) and targets (B, K) in {0, 1}."""
        probs, target = probs.to(torch.float64), target.reshape(probs.shape).to(torch.float64)
        self.total += self._score(probs, target).sum(0)
        self.count += probs.shape[0]

    @staticmethod
    def _score(probs: Tensor, target: Tensor) -> Tensor:
        raise NotImplementedError

    def compute(self) -> Tensor:
        """The mean score of each label, shape (K,)."""
        return self.total / self.count


class BernoulliNLL(_PerLabelMean):
    """Per-label NLL ``−(1/N) Σ_n [y log p + (1 − y) log(1 − p)]`` of independent labels."""

    @staticmethod
    def _score(probs: Tensor, target: Tensor) -> Tensor:
        return -torch.special.xlogy(target, probs) - torch.special.xlogy(1 - target, 1 - probs)


class BernoulliAccuracy(_PerLabelMean):
    """Per-label accuracy ``(1/N) Σ_n 1[(p > ½) = y]`` of independent labels (any K ≥ 1)."""

    @staticmethod
    def _score(probs: Tensor, target: Tensor) -> Tensor:
        return ((probs > 0.5) == (target > 0.5)).to(probs.dtype)


class BernoulliBrier(_PerLabelMean):
    """Per-label Brier score ``(1/N) Σ_n (p − y)²`` of independent labels."""

    @staticmethod
    def _score(probs: Tensor, target: Tensor) -> Tensor:
        return (probs - target).square()


class PerLabelCalibrationError(Metric):
    """torchmetrics' binary calibration error of each of K independent labels.

    Keeps the label probabilities and targets (N, K) and bins each label's probabilities of
    the positive class against its observed frequency at :meth:`compute`.

    Args:
        n_labels: Number of labels K.
        n_bins: Number of equal-width bins.
        norm: ``"l1"`` (expected calibration error) or ``"max"`` (maximum calibration error).
        **kwargs: Keyword arguments of :class:`torchmetrics.Metric`.
    """

    is_differentiable = False
    higher_is_better = False
    full_state_update = False

    def __init__(self, n_labels: int, n_bins: int = 15, norm: str = "l1", **kwargs: Any) -> None:
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
