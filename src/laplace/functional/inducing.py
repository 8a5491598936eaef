r"""Choice of VaLLA's inducing inputs from the training data: ``"random"`` or ``"kmeans"``.

Internal module.
"""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from laplace.data import Inputs, move_inputs
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

__all__ = [
    "as_inducing",
    "check_inducing_state",
    "choose_inducing",
    "detached_inputs",
    "inducing_count",
    "kmeans",
    "pair_items",
]

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

    ``"random"`` takes ``M`` seeded training points (``⌈M/2⌉`` pairs for reward modelling) in a
    seeded order; ``"kmeans"`` runs :func:`kmeans` on all training inputs (floating-point
    tensors only) and takes the training input nearest to each centre. Reward pairs are split
    into their items (see :func:`pair_items`). Classification uses each point's label as its
    output; regression and reward modelling output 0.

    Raises:
        ValueError: If the data has fewer than ``M`` points, or ``"kmeans"`` gets non-float or
            dict-like inputs.
    """
    M = la.num_inducing
    reward = la.likelihood == Likelihood.REWARD_MODELING
    if strategy == "random":
        available = training_indices(loader)
        order = torch.randperm(len(available), generator=torch.Generator().manual_seed(la.seed))
        loader = subset_loader(loader, available[order][: (M + 1) // 2 if reward else M])
    inputs, labels = [], []
    for X, y in la._batches(loader):
        if reward:
            X = pair_items(X, la.dict_key_x)
            y = torch.zeros(len(y) * 2, dtype=torch.long, device=la._device)
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
        centres = kmeans(flat.cpu(), M, torch.Generator().manual_seed(la.seed)).to(flat)
        chosen = torch.cdist(centres, flat).argmin(1)
    else:  # a seeded order of the drawn points (as laplace-torch)
        generator = torch.Generator().manual_seed(la.seed)
        chosen = torch.randperm(len(labels), generator=generator)[:M].to(labels.device)
    return select_rows(X, chosen, len(labels)), labels[chosen]


def pair_items(X: Inputs, dict_key_x: str) -> Inputs:
    """Reward pairs (B, 2, ...) as their 2B items (B·2, ...); per-pair values are repeated.

    Raises:
        ValueError: If the inputs have no pair axis of length 2.
    """
    pairs = X[dict_key_x] if isinstance(X, MutableMapping) else X
    if pairs.dim() < 3 or pairs.shape[1] != 2:
        raise ValueError(
            f"reward modelling trains on pairs of shape (B, 2, ...), got {tuple(pairs.shape)}."
        )
    B = len(pairs)
    if not isinstance(X, MutableMapping):
        return X.flatten(0, 1)
    return {
        k: v.flatten(0, 1)
        if k == dict_key_x
        else (
            v.repeat_interleave(2, 0) if isinstance(v, Tensor) and v.dim() and len(v) == B else v
        )
        for k, v in X.items()
    }


def as_inducing(Z: Any, device: torch.device, dtype: torch.dtype) -> Inputs:
    """A copy on ``device``; a floating tensor becomes a trainable ``nn.Parameter`` (``dtype``)."""
    if isinstance(Z, MutableMapping):
        return detached_inputs(move_inputs(Z, device))
    Z = move_inputs(torch.as_tensor(Z), device)
    if Z.is_floating_point():
        return torch.nn.Parameter(Z.detach().to(dtype).clone())
    return Z.detach().clone()


def detached_inputs(X: Inputs | None) -> Inputs | None:
    """A detached copy of a tensor or of the tensors of a mapping (None stays None)."""
    if isinstance(X, MutableMapping):
        return {k: v.detach().clone() if isinstance(v, Tensor) else v for k, v in X.items()}
    return None if X is None else X.detach().clone()


def inducing_count(X: Inputs, dict_key_x: str) -> int:
    """Number of inducing inputs: the leading size of ``X`` (or of its tensor ``dict_key_x``)."""
    if isinstance(X, MutableMapping):
        X = X[dict_key_x] if dict_key_x in X else next(v for v in X.values() if torch.is_tensor(v))
    return len(X)


def check_inducing_state(state: dict[str, Any], likelihood: Likelihood, dict_key_x: str) -> None:
    """Check the shapes of a VaLLA state saved with ``num_inducing = M``.

    ``L`` must have ``M(M+1)/2`` entries, the inducing inputs and classes ``M`` rows, the prior
    precision one entry, and the noise must be there iff the likelihood is regression.

    Raises:
        ValueError: Naming the expected shapes.
    """
    M, noise = state["num_inducing"], state["log_noise_variance"]
    if (
        not isinstance(M, int)
        or state["L"].shape != (M * (M + 1) // 2,)
        or state["inducing_classes"].shape != (M,)
        or inducing_count(state["inducing_locations"], dict_key_x) != M
        or (noise is None) != (likelihood != Likelihood.REGRESSION)
        or state["log_prior_precision"].numel() != 1
    ):
        raise ValueError(
            f"inconsistent VaLLA state: with num_inducing={M!r}, L needs M(M+1)/2 entries, the "
            "inducing inputs and classes M rows, the prior precision one entry, and a noise "
            "only for regression."
        )
