"""laplace-torch's running NLL of class probabilities (public at ``laplace.utils.metrics``)."""

from __future__ import annotations

import torch
from torch import Tensor
from torchmetrics import Metric

from laplace.utils.public import at_public_path

__all__ = ["RunningNLLMetric"]


class RunningNLLMetric(Metric):
    """Mean NLL ``−(1/N) Σ_{n: y_n ≠ ignore_index} log p_n[y_n]`` of class probabilities.

    The states (summed NLL and label count) are float32 as in laplace-torch
    (``metric.set_dtype(torch.float64)`` for double precision) and summed across processes.

    Args:
        ignore_index: Label value whose entries are skipped (e.g. padding tokens).
        sync_on_compute: Sum the states over all processes before computing.

    Example:
        >>> metric = RunningNLLMetric()
        >>> metric.update(torch.tensor([[0.5, 0.5], [0.1, 0.9]]), torch.tensor([0, 1]))
        >>> round(metric.compute().item(), 4)
        0.3993
    """

    is_differentiable = False
    higher_is_better = False
    full_state_update = False

    nll_sum: Tensor
    n_valid_labels: Tensor

    def __init__(self, ignore_index: int = -100, sync_on_compute: bool = True) -> None:
        super().__init__(sync_on_compute=sync_on_compute)
        self.add_state("nll_sum", default=torch.tensor(0.0), dist_reduce_fx="sum")
        self.add_state("n_valid_labels", default=torch.tensor(0.0), dist_reduce_fx="sum")
        self.ignore_index: int = ignore_index

    def update(self, probs: Tensor, targets: Tensor) -> None:
        """Add probabilities (..., C) and integer labels (...), skipping ``ignore_index``.

        Raises:
            ValueError: If the shapes of ``probs`` and ``targets`` do not match.
        """
        if probs.ndim < 1 or probs.shape[:-1] != targets.shape:
            raise ValueError(
                "targets must have the shape of probs without its last (class) dimension; "
                f"got probs {tuple(probs.shape)} and targets {tuple(targets.shape)}."
            )
        targets = targets.reshape(-1).long()
        valid = targets != self.ignore_index
        picked = probs.reshape(-1, probs.shape[-1])[valid].gather(-1, targets[valid, None])
        self.nll_sum -= picked.log().sum()
        self.n_valid_labels += valid.sum()

    def compute(self) -> Tensor:
        """Mean NLL over the labels seen since the last reset (NaN before any)."""
        return self.nll_sum / self.n_valid_labels


at_public_path("laplace.utils.metrics", RunningNLLMetric)
