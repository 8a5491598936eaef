r"""VaLLA's inducing points: given, or chosen from the training data (``"random"``, ``"kmeans"``).

Everything here takes values: inputs, targets, likelihood objects and settings.

Internal module.
"""

from __future__ import annotations

from collections.abc import Callable, MutableMapping

import torch
from torch import Tensor
from torch.utils.data import DataLoader

from laplace.core.passes.data_loop import DataLoop
from laplace.likelihoods import LikelihoodModel
from laplace.utils.data import (
    Inputs,
    batch_size_of,
    move_inputs,
    select_rows,
    subset_loader,
    training_indices,
)
from laplace.utils.errors import check_positive_int

__all__ = [
    "INDUCING_STATE",
    "STRATEGIES",
    "as_inducing",
    "detached_inputs",
    "inducing_from_data",
    "inducing_setup",
]

#: Strategies that choose the inducing inputs from the training data.
STRATEGIES = ("random", "kmeans")
#: The state entries of the inducing points (and those a refit starts from).
INDUCING_STATE = (
    "inducing_locations",
    "inducing_classes",
    "inducing_strategy",
    "initial_inducing_locations",
    "initial_inducing_classes",
)
#: Lloyd iterations of ``kmeans``.
KMEANS_ITERATIONS = 50


def inducing_setup(
    inducing_locations: Inputs | str,
    num_inducing: int | None,
    inducing_classes: Tensor | None,
    device: torch.device,
    dtype: torch.dtype,
    dict_key_x: str,
) -> tuple[str | None, Inputs | str, int, Tensor]:
    """Check VaLLA's inducing arguments.

    Returns:
        The strategy (None for given inputs), the inducing inputs (the strategy's name until a
        fit chooses them), their number M, and the output used at each (M,).

    Raises:
        ValueError: For an unknown strategy, a bad ``num_inducing`` or ``inducing_classes`` of
            the wrong shape.
    """
    if isinstance(inducing_locations, str):
        if inducing_locations not in STRATEGIES:
            raise ValueError(
                f"inducing_locations must be inputs or one of {list(STRATEGIES)}, got "
                f"{inducing_locations!r}."
            )
        strategy, Z = inducing_locations, inducing_locations
        M = check_positive_int(num_inducing, "num_inducing")
    else:
        strategy, Z = None, as_inducing(inducing_locations, device, dtype)
        M = batch_size_of(Z, dict_key_x)
        if num_inducing is not None and num_inducing != M:
            raise ValueError(f"num_inducing={num_inducing} but {M} inducing inputs given.")
    classes = torch.zeros(M, dtype=torch.long)
    if inducing_classes is not None:
        classes = torch.as_tensor(inducing_classes, dtype=torch.long)
    if classes.shape != (M,):
        raise ValueError(f"inducing_classes must have shape ({M},).")
    return strategy, Z, M, classes.to(device)


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


def inducing_from_data(
    loader: DataLoader,
    strategy: str,
    M: int,
    seed: int,
    likelihood: LikelihoodModel,
    dict_key_x: str,
    gather: Callable[..., DataLoop],
) -> tuple[Inputs, Tensor]:
    """Inducing inputs (M, ...) and outputs (M,) chosen among the training points.

    The candidates are ``M`` seeded training points (``"random"``; ⌈M/2⌉ pairs of items for
    reward modelling) or all of them (``"kmeans"``), reward pairs split into their items (see
    ``pair_items``); the predictive likelihood chooses the output of each
    (``inducing_outputs``: classification the point's class, binary classification the labels
    in turn, regression output 0). ``"random"`` takes ``M`` candidates in a seeded order (as
    laplace-torch); ``"kmeans"`` runs ``kmeans`` on the candidates (floating-point tensors
    only) and takes the one nearest to each centre.

    Args:
        loader: The training data.
        strategy: ``"random"`` or ``"kmeans"``.
        M: Number of inducing points.
        seed: Seed of the choice.
        likelihood: The likelihood (pairs, class labels).
        dict_key_x: Key of the inputs in dict-like batches.
        gather: Builds the ``Gather`` loop of the candidates from its
            ``step`` argument.

    Raises:
        ValueError: If there are fewer than ``M`` candidates, or ``"kmeans"`` gets non-float or
            dict-like inputs.
    """
    if strategy == "random":
        available = training_indices(loader)
        order = torch.randperm(len(available), generator=torch.Generator().manual_seed(seed))
        count = (M + 1) // 2 if likelihood.pairwise else M
        loader = subset_loader(loader, available[order][:count])

    def candidates(X: Inputs, y: Tensor) -> tuple[Inputs, Tensor]:
        if likelihood.pairwise:
            X, y = pair_items(X, dict_key_x), y.new_zeros(2 * len(y), dtype=torch.long)
        return X, likelihood.predictive_likelihood.inducing_outputs(y)

    X, labels = gather(step=candidates).run(loader)
    if len(labels) < M:
        raise ValueError(f"num_inducing={M} exceeds the {len(labels)} training points.")
    generator = torch.Generator().manual_seed(seed)
    if strategy == "kmeans":
        if isinstance(X, MutableMapping) or not X.is_floating_point():
            raise ValueError(
                "inducing_locations='kmeans': kmeans requires floating-point tensor inputs."
            )
        flat = X.detach().reshape(len(X), -1)
        chosen = torch.cdist(kmeans(flat.cpu(), M, generator).to(flat), flat).argmin(1)
    else:
        chosen = torch.randperm(len(labels), generator=generator)[:M].to(labels.device)
    return select_rows(X, chosen, len(labels)), labels[chosen]


def pair_items(X: Inputs, dict_key_x: str) -> Inputs:
    """Reward pairs (B, 2, ...) as their 2B items (B·2, ...); per-pair values are repeated.

    Per-pair values of a mapping are its other tensors and lists (collated metadata, e.g.
    strings) of length B; each is given once per item.

    Raises:
        ValueError: If the inputs have no pair axis of length 2.
    """
    pairs = X[dict_key_x] if isinstance(X, MutableMapping) else X
    if pairs.dim() < 3 or pairs.shape[1] != 2:
        raise ValueError(
            f"reward modelling trains on pairs of shape (B, 2, ...), got {tuple(pairs.shape)}."
        )
    if not isinstance(X, MutableMapping):
        return X.flatten(0, 1)
    B = len(pairs)

    def per_item(value: object) -> object:
        if isinstance(value, Tensor) and value.dim() and len(value) == B:
            return value.repeat_interleave(2, 0)
        if isinstance(value, (list, tuple)) and len(value) == B:  # collated metadata
            return type(value)(item for item in value for _ in range(2))
        return value

    return {k: pairs.flatten(0, 1) if k == dict_key_x else per_item(v) for k, v in X.items()}


def as_inducing(Z: object, device: torch.device, dtype: torch.dtype) -> Inputs:
    """A copy on ``device``; a floating tensor becomes a trainable ``nn.Parameter`` (``dtype``)."""
    if isinstance(Z, MutableMapping):
        return detached_inputs(move_inputs(Z, device))
    tensor = move_inputs(torch.as_tensor(Z), device)
    if tensor.is_floating_point():
        return torch.nn.Parameter(tensor.detach().to(dtype).clone())
    return tensor.detach().clone()


def detached_inputs(X: Inputs | None) -> Inputs | None:
    """A detached copy of a tensor or of the tensors of a mapping (None stays None)."""
    if isinstance(X, MutableMapping):
        return {k: v.detach().clone() if isinstance(v, Tensor) else v for k, v in X.items()}
    return None if X is None else X.detach().clone()
