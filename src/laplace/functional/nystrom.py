r"""ELLA's Nyström features: a seeded subset, the top eigenvectors of its kernel, the Gaussian.

Internal module.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import Tensor
from torch.utils.data import DataLoader

from laplace.likelihoods import Categorical
from laplace.structures import DensePosterior
from laplace.utils.data import Inputs, split_batch, training_indices

__all__ = [
    "NystromPosterior",
    "dataset_labels",
    "nystrom_basis",
    "nystrom_features",
    "nystrom_indices",
]


def nystrom_indices(
    loader: DataLoader,
    subsample_size: int,
    seed: int,
    labels: Callable[[Tensor], Tensor] | None = None,
) -> Tensor:
    """A seeded subset of ``subsample_size`` training indices (M,).

    Args:
        loader: The training data; its sampler decides the indices it reaches.
        subsample_size: Number of points the subset needs.
        seed: Seed of the order.
        labels: Class labels (n,) of dataset indices (n,); given, the classes are taken
            round-robin, each in a seeded order (a balanced subset).

    Raises:
        ValueError: If the loader reaches fewer than ``subsample_size`` points.
    """
    available = training_indices(loader)
    if subsample_size > len(available):
        raise ValueError(
            f"subsample_size={subsample_size} exceeds the {len(available)} training "
            "points the loader reaches."
        )
    generator = torch.Generator().manual_seed(seed)
    if labels is None:
        return available[torch.randperm(len(available), generator=generator)[:subsample_size]]
    classes = labels(available)
    ranks = torch.empty_like(classes)  # each point's position in its class's seeded order
    for c in classes.unique(sorted=True):
        members = torch.where(classes == c)[0]
        order = members[torch.randperm(len(members), generator=generator)]
        ranks[order] = torch.arange(len(order))
    # round-robin: the first point of every class, then the second, ...
    order = torch.argsort(ranks * (int(classes.max()) + 1) + classes)
    return available[order[:subsample_size]]


def dataset_labels(
    loader: DataLoader, dict_key_x: str | None, dict_key_y: str
) -> Callable[[Tensor], Tensor]:
    """Class labels of dataset indices, read from the items of ``loader.dataset``.

    Returns:
        Indices (n,) → class indices (n,) (from labels, columns or one-hot targets).
    """

    def labels(indices: Tensor) -> Tensor:
        items = (loader.dataset[int(i)] for i in indices)
        targets = [split_batch(item, dict_key_x, dict_key_y)[1] for item in items]
        return Categorical.class_indices(torch.stack([torch.as_tensor(t) for t in targets]))

    return labels


def nystrom_basis(
    inputs: Iterable[Inputs],
    jacobian_chunks: Callable[[Inputs], Iterable[tuple[Tensor, Tensor]]],
    n_eigenvalues: int,
    seed: int,
) -> Tensor:
    """``V = J_Mᵀ U Λ^{-1/2}`` (P, K) of a data subset, in float64.

    ``J_M`` (M, P) holds one Jacobian row per subset point, of an output drawn from a generator
    seeded with ``seed + 1``; ``U, Λ`` are the top ``K = n_eigenvalues`` eigenpairs of
    ``J_M J_Mᵀ``, so the columns of ``V`` are orthonormal.

    Args:
        inputs: The subset's inputs, batch by batch.
        jacobian_chunks: Inputs → ``(Js (b, C, P), f)`` over chunks of them.
        n_eigenvalues: K.
        seed: Seed of the subset (the outputs are drawn with ``seed + 1``).

    Raises:
        ValueError: If the subset kernel has fewer than K numerically positive eigenvalues.
    """
    generator = torch.Generator().manual_seed(seed + 1)
    rows = []
    for X in inputs:
        for Js, _ in jacobian_chunks(X):
            pick = torch.randint(Js.shape[1], (Js.shape[0],), generator=generator)
            rows.append(Js[torch.arange(len(pick)), pick.to(Js.device)])
    rows = torch.cat(rows).to(torch.float64)
    values, vectors = torch.linalg.eigh(rows @ rows.T)
    order = torch.argsort(values, descending=True)[:n_eigenvalues]
    tol = torch.finfo(torch.float64).eps * max(rows.shape) * values.abs().max()
    if bool((values[order] <= tol).any()):
        rank = int((values > tol).sum())
        raise ValueError(
            "the subset kernel has insufficient positive rank: numerical rank "
            f"{rank} < n_eigenvalues={n_eigenvalues}; lower n_eigenvalues, raise "
            "subsample_size or change seed."
        )
    return rows.T @ (vectors[:, order] / values[order].sqrt())


class NystromPosterior:
    """ELLA's Gaussian ``N(0, A⁻¹)`` over the Nyström features ``φ(x) = J(x) V`` (C, K).

    ``A = h Σ φᵀ Λ φ + δI`` is a ``DensePosterior`` over the K
    features, rebuilt when ``Σ φᵀ Λ φ``, ``δ`` or ``h`` change. A
    ``LatentPosterior``; the fitted values are read at every call.

    Args:
        features: Inputs and whether to keep the graph → the features ``φ = J V`` (B, C, K) and
            outputs (B, C) at them (``nystrom_features`` of the current ``V``).
        fitted: The current ``V`` (P, K), ``Σ φᵀ Λ φ`` (K, K), prior precision ``δ`` (1,) and
            ``h = 1/(σ²T)``.
    """

    def __init__(
        self,
        features: Callable[[Inputs, bool], tuple[Tensor, Tensor]],
        fitted: Callable[[], tuple[Tensor, Tensor, Tensor, Tensor]],
    ) -> None:
        self._features, self._fitted = features, fitted
        self._cache: tuple[tuple[float, float], Tensor, DensePosterior] | None = None

    @property
    def directions(self) -> Tensor:
        """``V`` (P, K)."""
        return self._fitted()[0]

    @property
    def gaussian(self) -> DensePosterior:
        """The Gaussian over the K features at the current ``Σ φᵀ Λ φ``, ``δ`` and ``h``."""
        _, gram, delta, h = self._fitted()
        delta, h = delta.detach(), h.detach()
        key = (float(delta), float(h))
        if self._cache is None or self._cache[0] != key or self._cache[1] is not gram:
            self._cache = (key, gram, DensePosterior(gram, h, delta.expand(len(gram))))
        return self._cache[2]

    def feature_covariance(self, features: Tensor, joint: bool) -> Tensor:
        """``φ A⁻¹ φᵀ`` of features (B, C, K): (B, C, C), or (B·C, B·C) with ``joint``."""
        if joint:
            return self.gaussian.functional_covariance(features.flatten(0, 1))
        return self.gaussian.functional_variance(features)

    def covariance(self, Js: Tensor, joint: bool) -> Tensor:
        """``feature_covariance`` of the features ``Js V`` of Jacobians (B, C, P)."""
        return self.feature_covariance(Js @ self.directions, joint)

    def moments(self, X: Inputs, joint: bool, create_graph: bool) -> tuple[Tensor, Tensor]:
        """Outputs at ``X`` and the ``feature_covariance`` of their features."""
        features, f = self._features(X, create_graph)
        cov = self.feature_covariance(features, joint)
        return (f.reshape(-1) if joint else f), cov


def nystrom_features(
    jacobian_chunks: Callable[[Inputs, bool], Iterable[tuple[Tensor, Tensor]]],
    V: Tensor,
    X: Inputs,
    create_graph: bool = False,
) -> tuple[Tensor, Tensor]:
    """Features ``φ = J V`` (B, C, K) and outputs (B, C) at ``X``, chunk by chunk."""
    features, outputs = zip(*((Js @ V, f) for Js, f in jacobian_chunks(X, create_graph)))
    return torch.cat(features), torch.cat(outputs)
