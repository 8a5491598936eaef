r"""The Nyström basis of ELLA: a seeded data subset and the top eigenvectors of its kernel.

Internal module.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor
from torch.utils.data import DataLoader

from laplace.functional.scoring import jacobian_chunks
from laplace.utils.enums import Likelihood
from laplace.utils.functional_utils import split_batch, subset_loader, training_indices

if TYPE_CHECKING:
    from laplace.functional.ella import ELLA

__all__ = ["nystrom_basis", "nystrom_indices"]


def nystrom_indices(la: ELLA, loader: DataLoader, balanced: bool) -> Tensor:
    """Seeded order of the training indices (the first ``M`` form the subset).

    With ``balanced=True`` the classes are taken round-robin, each in a seeded order.
    """
    available = training_indices(loader)
    if la.subsample_size > len(available):
        raise ValueError(
            f"subsample_size={la.subsample_size} exceeds the {len(available)} training "
            "points the loader reaches."
        )
    generator = torch.Generator().manual_seed(la.seed)
    if not balanced:
        return available[torch.randperm(len(available), generator=generator)]
    if la.likelihood == Likelihood.REGRESSION:
        raise ValueError("balanced=True needs classification (it balances the classes).")
    targets = [
        split_batch(loader.dataset[int(i)], la.dict_key_y, la.dict_key_x)[1] for i in available
    ]
    labels = torch.stack([_class_index(t) for t in targets])
    queues = []
    for c in labels.unique(sorted=True):
        members = torch.where(labels == c)[0]
        order = torch.randperm(len(members), generator=generator)
        queues.append(deque(members[order].tolist()))
    chosen: list[int] = []
    while len(chosen) < la.subsample_size and any(queues):
        chosen.extend(q.popleft() for q in queues if q)
    return available[torch.tensor(chosen)]


def nystrom_basis(la: ELLA, loader: DataLoader, indices: Tensor) -> Tensor:
    """``V = J_Mᵀ U Λ^{-1/2}`` (P, K) from one Jacobian row (seeded output) per subset point.

    Raises:
        ValueError: If the subset kernel has fewer than K numerically positive eigenvalues.
    """
    generator = torch.Generator().manual_seed(la.seed + 1)
    rows = []
    for X, _ in la._batches(subset_loader(loader, indices)):
        for Js, _f in jacobian_chunks(la, X):
            pick = torch.randint(Js.shape[1], (Js.shape[0],), generator=generator)
            rows.append(Js[torch.arange(len(pick)), pick.to(Js.device)])
    rows = torch.cat(rows).to(torch.float64)
    values, vectors = torch.linalg.eigh(rows @ rows.T)
    order = torch.argsort(values, descending=True)[: la.n_eigenvalues]
    tol = torch.finfo(torch.float64).eps * max(rows.shape) * values.abs().max()
    if bool((values[order] <= tol).any()):
        rank = int((values > tol).sum())
        raise ValueError(
            f"the subset kernel has numerical rank {rank} < n_eigenvalues="
            f"{la.n_eigenvalues}; lower n_eigenvalues, raise subsample_size or change seed."
        )
    V = rows.T @ (vectors[:, order] / values[order].sqrt())
    return V.to(la._dtype)


def _class_index(target: Any) -> Tensor:
    target = torch.as_tensor(target)
    return target.argmax() if target.numel() > 1 else target.reshape(())
