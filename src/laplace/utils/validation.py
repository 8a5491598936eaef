"""Grid search's validation of a Laplace predictive (laplace-torch's ``validate``, ``get_nll``).

The running metrics are those of the likelihood (``LikelihoodModel.validation_loss``), or the
user's metric or callable.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import torch
from torch import nn
from torch.utils.data import DataLoader

from laplace.utils.data import Inputs, prepare_batch
from laplace.utils.enums import LinkApprox, PredType
from laplace.utils.errors import check_positive_int

if TYPE_CHECKING:
    import torchmetrics

__all__ = ["Predictor", "get_nll", "validate"]


class Predictor(Protocol):
    """What ``validate`` needs of a Laplace approximation: its model and its predictive."""

    model: nn.Module
    n_outputs: int

    def __call__(
        self,
        x: Inputs,
        pred_type: PredType | str,
        link_approx: LinkApprox | str,
        n_samples: int,
        fitting: bool,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Predictive probabilities (B, C), or the GLM's mean (B, C) and variance (B, C, C)."""


def get_nll(out_dist: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean negative log-likelihood ``−(1/B) Σ_b log out_dist[b, targets[b]]``.

    Args:
        out_dist: Predictive class probabilities, shape (B, C).
        targets: Integer class labels, shape (B,).

    Returns:
        A 0-d tensor.

    Raises:
        ValueError: If the shapes of ``out_dist`` and ``targets`` do not match.
    """
    if out_dist.ndim != 2:
        raise ValueError(f"out_dist must have shape (B, C), got {tuple(out_dist.shape)}.")
    if targets.shape != out_dist.shape[:1]:
        raise ValueError(
            f"targets must have shape ({out_dist.shape[0]},) to match out_dist, "
            f"got {tuple(targets.shape)}."
        )
    picked = out_dist.gather(-1, targets.long().unsqueeze(-1)).squeeze(-1)
    return -picked.log().mean()


def _is_metric(loss: object) -> bool:
    """Whether ``loss`` is a ``torchmetrics.Metric`` (never the first import of torchmetrics)."""
    torchmetrics = sys.modules.get("torchmetrics")
    return torchmetrics is not None and isinstance(loss, torchmetrics.Metric)


def _update_metric(metric: torchmetrics.Metric, out: tuple, y: torch.Tensor) -> None:
    """``update(*out, y)`` where ``update`` takes that many arguments, else ``update(out[0], y)``.

    Without a signature to read, the full call is tried first.
    """
    try:
        inspect.signature(metric.update).bind(*out, y)
    except TypeError:  # it takes fewer arguments
        out = out[:1]
    except ValueError:  # no signature to read
        try:
            return metric.update(*out, y)
        except TypeError:
            out = out[:1]
    metric.update(*out, y)


@torch.no_grad()
def validate(
    laplace: Predictor,
    val_loader: DataLoader,
    loss: torchmetrics.Metric
    | Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    | Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
    pred_type: PredType | str = PredType.GLM,
    link_approx: LinkApprox | str = LinkApprox.PROBIT,
    n_samples: int = 100,
    dict_key_y: str = "labels",
) -> float:
    """The validation loss of the predictive of ``laplace`` (model in eval mode) on a loader.

    ``laplace(X, pred_type=..., link_approx=..., n_samples=..., fitting=True)`` gives
    probabilities (B, C) or a regression GLM's ``(f_mu (B, C), f_var (B, C, C))``. A
    ``torchmetrics.Metric`` is reset, updated batch by batch (regression: with
    ``(f_mu, f_var, y)`` if its ``update`` takes three arguments, else ``(f_mu, y)``) and its
    ``compute()`` summed; another callable gets the concatenated predictions once,
    ``loss(probs, y)`` or ``loss(f_mu, f_var, y)``.

    Args:
        laplace: A Laplace approximation (anything callable like one with a ``model``).
        val_loader: Loader yielding ``(X, y)`` pairs or dict-like batches whose targets are
            stored under ``dict_key_y``.
        loss: A torchmetrics metric or a callable returning a scalar.
        pred_type: Predictive type passed to ``laplace``.
        link_approx: Link approximation passed to ``laplace``.
        n_samples: Number of Monte-Carlo samples passed to ``laplace``.
        dict_key_y: Key of the targets in dict-like batches.

    Returns:
        The validation loss as a Python float.

    Raises:
        TypeError: If ``loss`` is neither a metric nor callable.
        ValueError: If ``pred_type``/``link_approx`` are unknown, ``n_samples`` is not a
            positive integer, a batch has an unexpected format, or ``val_loader`` is empty.
    """
    if not callable(loss):
        raise TypeError(
            f"loss must be a torchmetrics.Metric or a callable, got {type(loss).__name__}."
        )
    pred_type = PredType(pred_type)
    link_approx = LinkApprox(link_approx)
    check_positive_int(n_samples, "n_samples")

    laplace.model.eval()
    device = next(laplace.model.parameters()).device
    likelihood = getattr(laplace, "_likelihood_model", None)
    probabilities = likelihood is not None and likelihood.fit_likelihood.predicts_probabilities
    running = _is_metric(loss)
    if running:
        loss.reset()

    # outputs with extra dimensions (found in the fit): their targets are rows of positions,
    # checked with the predictions' shape (``validation_rows``)
    found = likelihood.fit_likelihood.outputs.found if probabilities else None
    positions = found is not None and found[0] > 2
    outputs: list[tuple[torch.Tensor, ...]] = []  # probabilities, or f_mu and f_var
    targets: list[torch.Tensor] = []
    n_batches = 0
    for data in val_loader:
        X, y = prepare_batch(data, getattr(laplace, "dict_key_x", "input_ids"), dict_key_y, device)
        if probabilities and not positions:  # labels, before the predictive's Jacobians
            likelihood.fit_likelihood.check_targets(y, (len(y), laplace.n_outputs))
        out = laplace(
            X, pred_type=pred_type, link_approx=link_approx, n_samples=n_samples, fitting=True
        )
        if likelihood is not None:  # positions of outputs with extra dimensions as rows
            out, y = likelihood.fit_likelihood.validation_rows(out, y)
        n_batches += 1
        out = out if isinstance(out, tuple) else (out,)
        if running:
            _update_metric(loss, out, y)
        else:
            outputs.append(out)
            targets.append(y)

    if n_batches == 0:
        raise ValueError("val_loader yielded no batches.")
    if running:
        return float(loss.compute().sum().item())
    columns = [torch.cat(parts) for parts in zip(*outputs)]
    value = torch.as_tensor(loss(*columns, torch.cat(targets)))
    if value.numel() != 1:
        raise ValueError(f"loss must return a scalar, got a value of shape {tuple(value.shape)}.")
    return float(value.item())
