"""Predictions handed to ``evaluate`` as the inputs of the identity predictive.

The loader's inputs *are* the predictions (class probabilities, or ``(mean, var)`` pairs via
``MomentsDataset``), so a metric can be checked against an independent reference without a
Laplace approximation.
"""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader, TensorDataset

from laplace.evaluation import evaluate


def _probs(n: int, c: int, seed: int = 0, scale: float = 2.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.softmax(scale * torch.randn(n, c, generator=gen, dtype=torch.float64), -1)


def _labels(probs: torch.Tensor, seed: int = 1) -> torch.Tensor:
    """Labels drawn from the probabilities (so the predictions are roughly calibrated)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.multinomial(probs, 1, generator=gen).squeeze(-1)


def identity(x):
    return x


def _evaluate_predictions(X, y, batch_size=7, **kwargs):
    return evaluate(identity, DataLoader(TensorDataset(X, y), batch_size=batch_size), **kwargs)


class MomentsDataset(torch.utils.data.Dataset):
    """Items ((mean, var), y): the identity predictive then returns (mean, var) batches."""

    def __init__(self, mean, var, y):
        self.mean, self.var, self.y = mean, var, y

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return (self.mean[i], self.var[i]), self.y[i]
