"""Diagonal SWAG (Maddox et al., NeurIPS 2019): marginal weight variances from SGD iterates."""

from __future__ import annotations

import copy

import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader

__all__ = ["fit_diagonal_swag_var", "trainable_vector"]


def trainable_vector(model: nn.Module) -> Tensor:
    """The detached trainable parameters of ``model``, flattened in order, shape (P,)."""
    return torch.cat([p.detach().reshape(-1) for p in model.parameters() if p.requires_grad])


def fit_diagonal_swag_var(
    model: nn.Module,
    train_loader: DataLoader,
    criterion: nn.CrossEntropyLoss | nn.MSELoss,
    n_snapshots_total: int = 40,
    snapshot_freq: int = 1,
    lr: float = 0.01,
    momentum: float = 0.9,
    weight_decay: float = 3e-4,
    min_var: float = 1e-30,
) -> Tensor:
    """Marginal variances ``E[θ²] − E[θ]²`` of the weights over snapshots of SGD.

    A copy of ``model`` is trained with SGD; ``model`` itself is not changed.

    Args:
        model: The trained network.
        train_loader: Batches ``(X, y)``.
        criterion: Training loss, e.g. ``nn.CrossEntropyLoss(reduction="mean")``.
        n_snapshots_total: Number of snapshots.
        snapshot_freq: Epochs between snapshots.
        lr: SGD learning rate.
        momentum: SGD momentum.
        weight_decay: SGD weight decay.
        min_var: Lower bound of the returned variances.

    Returns:
        Variances of the flattened trainable weights, shape (P,).
    """
    swag_model = copy.deepcopy(model)
    swag_model.train()
    device = next(swag_model.parameters()).device
    params = [p for p in swag_model.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=weight_decay)
    mean = torch.zeros_like(trainable_vector(swag_model))
    sq_mean = torch.zeros_like(mean)
    n_snapshots = 0
    for epoch in range(snapshot_freq * n_snapshots_total):
        for X, y in train_loader:
            optimizer.zero_grad()
            criterion(swag_model(X.to(device)), y.to(device)).backward()
            optimizer.step()
        if epoch % snapshot_freq == 0:
            theta = trainable_vector(swag_model)
            n_snapshots += 1
            mean += (theta - mean) / n_snapshots
            sq_mean += (theta.square() - sq_mean) / n_snapshots
    return torch.clamp(sq_mean - mean.square(), min=min_var)
