"""Chunked Jacobians, validation scoring, grid search and state checks of ELLA and VaLLA.

The score is laplace-torch 0.3's: the mean predictive negative log-likelihood per data point,
with the observation noise for regression (summed over outputs) and the probit link for
classification.

Internal module.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor
from torch.utils.data import DataLoader

from laplace.data import Inputs, batch_size_of
from laplace.glm import jacobian_chunk_rows, slice_inputs
from laplace.utils.enums import Likelihood
from laplace.utils.functional_utils import classification_targets, regression_targets

if TYPE_CHECKING:
    from laplace.functional.base import BaseFunctionalLaplace

__all__ = ["check_state", "grid_search", "jacobian_chunks", "positive_int", "validation_nll"]


def jacobian_chunks(
    la: BaseFunctionalLaplace, X: Inputs, enable_backprop: bool = False
) -> Iterator[tuple[Tensor, Tensor]]:
    """``(Js (b, C, P), f (b, C))`` over chunks of ``X`` of at most ``JACOBIAN_CHUNK_BYTES``."""
    n = batch_size_of(X, la.dict_key_x)
    step = jacobian_chunk_rows(la.n_outputs, la.n_params, la._dtype)
    for start in range(0, n, step):
        chunk = slice_inputs(X, start, start + step, n)
        Js, f = la.backend.jacobians(chunk, enable_backprop=enable_backprop)
        yield (Js, f) if enable_backprop else (Js.detach(), f.detach())


def positive_int(value: Any) -> bool:
    """Whether ``value`` is an ``int`` (not a ``bool``) greater than 0."""
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def validation_nll(la: BaseFunctionalLaplace, loader: DataLoader) -> Tensor:
    """Mean predictive NLL of ``la`` on ``loader`` (a scalar tensor)."""
    total = torch.zeros((), dtype=la._dtype, device=la._device)
    count = 0
    with torch.no_grad():
        for X, y in la._batches(loader):
            f_mu, f_var = la.predictive_moments(X)
            var = f_var.diagonal(dim1=-2, dim2=-1)
            if la.likelihood == Likelihood.REGRESSION:
                y = regression_targets(y.to(f_mu.dtype), f_mu)
                var = var + la.sigma_noise.square()
                total += (
                    0.5 * ((y - f_mu).square() / var + var.log() + math.log(2 * math.pi)).sum()
                )
            else:
                logits = f_mu / torch.sqrt(1 + math.pi / 8 * var)
                total += torch.nn.functional.cross_entropy(
                    logits, classification_targets(y), reduction="sum"
                )
            count += len(y)
    return total / count


def grid_search(
    la: BaseFunctionalLaplace, val_loader: DataLoader, grid: Iterable[Any]
) -> list[dict[str, float]]:
    """Set the candidate with the lowest :func:`validation_nll` on ``la``.

    Args:
        la: A fitted ELLA or VaLLA.
        val_loader: Validation data.
        grid: Prior precisions, or ``(prior_precision, sigma_noise)`` pairs (regression).

    Returns:
        One record per candidate: ``prior_precision``, ``sigma_noise``, ``val_nll``.

    Raises:
        ValueError: For an empty grid, or if no candidate has a finite score (the
            hyperparameters are then restored).
    """
    initial = (la.prior_precision.detach().clone(), la.sigma_noise.detach().clone())
    records, best, best_score = [], None, math.inf
    for candidate in grid:
        pair = isinstance(candidate, (tuple, list))
        la.prior_precision = candidate[0] if pair else candidate
        if pair:
            la.sigma_noise = candidate[1]
        try:
            score = float(validation_nll(la, val_loader))
        except torch.linalg.LinAlgError:
            score = math.nan
        records.append(
            {
                "prior_precision": float(la.prior_precision),
                "sigma_noise": float(la.sigma_noise),
                "val_nll": score,
            }
        )
        if math.isfinite(score) and score < best_score:
            best, best_score = candidate, score
    if best is None:
        la.prior_precision, la.sigma_noise = initial
        if not records:
            raise ValueError("the hyperparameter grid is empty.")
        raise ValueError("no candidate of the grid gives a finite validation NLL.")
    if isinstance(best, (tuple, list)):
        la.prior_precision, la.sigma_noise = best
    else:
        la.prior_precision = best
    return records


def check_state(la: BaseFunctionalLaplace, state_dict: dict[str, Any]) -> None:
    """Refuse a state of another class, likelihood or MAP (the model's current weights)."""
    name = type(la).__name__
    if state_dict.get("cls_name") != name:
        raise ValueError(f"state_dict was saved by {state_dict.get('cls_name')!r}, not {name!r}.")
    if state_dict["likelihood"] != la.likelihood.value:
        raise ValueError(
            f"state_dict was saved for likelihood={state_dict['likelihood']!r}, this "
            f"approximation uses {la.likelihood.value!r}."
        )
    mean = state_dict["mean"].to(la._device, la._dtype)
    current = la._subset.vector().detach()
    if mean.shape != current.shape or not torch.allclose(mean, current, atol=1e-6):
        raise ValueError("the model's weights are not the MAP weights the state was saved at.")
