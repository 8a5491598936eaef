r"""Choice of VaLLA's inducing inputs from the training data: ``"random"`` or ``"kmeans"``.

Internal module.
"""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from laplace.data import Inputs
from laplace.utils.enums import Likelihood
from laplace.utils.functional_utils import (
    classification_targets,
    concatenate_rows,
    select_rows,
    subset_loader,
    training_indices,
)

if TYPE_CHECKING:
    from torch.utils.data import DataLoader

    from laplace.functional.valla import VaLLA

__all__ = ["choose_inducing", "kmeans"]

#: Lloyd iterations of :func:`kmeans`.
KMEANS_ITERATIONS = 50


def kmeans(points: Tensor, k: int, generator: torch.Generator) -> Tensor:
    """Lloyd's k-means in torch, initialised at ``k`` distinct random points.

    Args:
        points: (N, D).
        k: Number of centres (``k ≤ N``).
        generator: Seeds the initial centres.

    Returns:
        Centres (k, D); an emptied cluster keeps its previous centre.
    """
    centres = points[torch.randperm(len(points), generator=generator)[:k]].clone()
    for _ in range(KMEANS_ITERATIONS):
        assign = torch.cdist(points, centres).argmin(1)
        counts = torch.bincount(assign, minlength=k).unsqueeze(1)
        sums = torch.zeros_like(centres).index_add_(0, assign, points)
        updated = torch.where(counts > 0, sums / counts.clamp_min(1), centres)
        if torch.equal(updated, centres):
            break
        centres = updated
    return centres


def choose_inducing(la: VaLLA, loader: DataLoader, strategy: str) -> tuple[Inputs, Tensor]:
    """Inducing inputs (M, ...) and their outputs (M,) drawn from the training data.

    ``"random"`` takes ``M`` seeded training points; ``"kmeans"`` runs :func:`kmeans` on all
    training inputs (floating-point tensors only) and takes the training input nearest to each
    centre. Classification uses each point's label as its output; regression output 0.

    Raises:
        ValueError: If the data has fewer than ``M`` points, or ``"kmeans"`` gets non-float or
            dict-like inputs.
    """
    M = la.num_inducing
    generator = torch.Generator().manual_seed(la.seed)
    if strategy == "random":
        available = training_indices(loader)
        loader = subset_loader(
            loader, available[torch.randperm(len(available), generator=generator)][:M]
        )
    inputs, labels = [], []
    for X, y in la._batches(loader):
        inputs.append(X)
        if la.likelihood == Likelihood.CLASSIFICATION:
            labels.append(classification_targets(y))
        else:
            labels.append(torch.zeros(len(y), dtype=torch.long, device=la._device))
    X, labels = concatenate_rows(inputs), torch.cat(labels)
    if len(labels) < M:
        raise ValueError(f"num_inducing={M} exceeds the {len(labels)} training points.")
    if strategy == "kmeans":
        if isinstance(X, MutableMapping) or not X.is_floating_point():
            raise ValueError("inducing_locations='kmeans' needs floating-point tensor inputs.")
        flat = X.detach().reshape(len(X), -1)
        centres = kmeans(flat.cpu(), M, generator).to(flat)
        chosen = torch.cdist(centres, flat).argmin(1)
    else:
        chosen = torch.arange(M, device=labels.device)
    return select_rows(X, chosen, len(labels)), labels[chosen]
