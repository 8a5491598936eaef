"""Prior-precision tuning: marginal-likelihood ascent and validation grid search.

Both work with any Laplace approximation through its public interface
(``log_marginal_likelihood``, ``prior_precision``, the predictive), never its structure.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torchmetrics
from torch import Tensor
from torch.utils.data import DataLoader
from tqdm.auto import tqdm

from laplace import distributed as distributed_utils
from laplace.errors import ArgumentTypeError, check_positive_float, check_positive_int
from laplace.evaluation.tasks import validation_metric
from laplace.posteriors import NotPositiveDefiniteError
from laplace.utils.enums import LinkApprox, PredType
from laplace.utils.metrics import RunningNLLMetric
from laplace.utils.utils import validate

if TYPE_CHECKING:
    from laplace.base import BaseLaplace

__all__ = [
    "default_validation_loss",
    "grid_candidates",
    "gridsearch",
    "maximize_marglik",
    "validation_loss",
]


def maximize_marglik(
    la: BaseLaplace, init: Tensor, n_steps: int, lr: float, progress_bar: bool = False
) -> Tensor:
    """Maximise the log marginal likelihood over ``log p₀`` with Adam.

    Args:
        la: A fitted Laplace approximation.
        init: Initial prior precision, any valid structure (scalar/layer-wise/diagonal).
        n_steps: Number of Adam steps.
        lr: Adam learning rate.
        progress_bar: Whether to show a progress bar.

    Returns:
        The optimised prior precision (detached), same shape as ``init``.
    """
    log_prior = init.detach().log().requires_grad_(True)
    optimizer = torch.optim.Adam([log_prior], lr=lr)
    for _ in tqdm(range(n_steps), disable=not progress_bar, desc="marglik tuning"):
        optimizer.zero_grad()
        neg_marglik = -la.log_marginal_likelihood(prior_precision=log_prior.exp())
        neg_marglik.backward()
        optimizer.step()
    return log_prior.detach().exp()


def default_validation_loss(la: BaseLaplace) -> torchmetrics.Metric:
    """Running NLL for probability outputs, running mean squared error otherwise.

    Grid search validates with ``fitting=True``, so the likelihood the model was fitted with
    decides (reward modelling predicts pair probabilities there).
    """
    if la._likelihood_model.fit_likelihood.predicts_probabilities:
        return RunningNLLMetric().to(la._device)
    return torchmetrics.MeanSquaredError(num_outputs=la.n_outputs).to(la._device)


def validation_loss(la: BaseLaplace, loss: Any) -> torchmetrics.Metric | Callable:
    """The grid-search loss for the user's ``loss`` argument.

    None gives :func:`default_validation_loss`; a name (``"nll"``, ``"ece"``, ``"brier"``,
    ``"crps"``, see :func:`laplace.evaluation.validation_metric`) gives that running metric of
    the predictions grid search validates (those of the fit likelihood); anything else is
    returned as it is. Named metrics of a distributed fit add their sums over all ranks.

    Raises:
        ValueError: For an unknown name or one that does not apply to the likelihood.
    """
    if loss is None:
        return default_validation_loss(la)
    if not isinstance(loss, str):
        return loss
    metric = validation_metric(
        loss,
        la._likelihood_model.fit_likelihood.kind,
        la.n_outputs,
        la.sigma_noise,
        sync_on_compute=getattr(la, "_distributed", False),
    )
    return metric.to(la._device)


def grid_candidates(
    low: float, high: float, size: int, base: float, device: torch.device, dtype: torch.dtype
) -> Tensor:
    """The candidate prior precisions ``base ** linspace(low, high, size)`` of a grid search.

    Raises:
        ValueError: For a non-positive ``size``, non-finite exponents, or a base that is not
            positive or is 1; a non-number raises an error that is a ``ValueError`` and a
            ``TypeError``.
    """
    check_positive_int(size, "grid_size")
    for name, value in (("log_prior_prec_min", low), ("log_prior_prec_max", high)):
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise ArgumentTypeError(f"{name} must be a real number, got {value!r}.")
        if not math.isfinite(value):
            raise ValueError(f"{name} must be finite, got {value!r}.")
    if check_positive_float(base, "log_prior_prec_base") == 1:
        raise ValueError("log_prior_prec_base must not be 1: every candidate would equal 1.")
    return torch.logspace(low, high, size, base=base, device=device, dtype=dtype)


def gridsearch(
    la: BaseLaplace,
    candidates: Tensor,
    val_loader: DataLoader,
    loss: torchmetrics.Metric | Callable,
    pred_type: PredType,
    link_approx: LinkApprox,
    n_samples: int,
    progress_bar: bool = False,
) -> Tensor:
    """Pick the candidate prior precision with the lowest validation loss.

    Candidates whose posterior cannot be factorised or whose loss is not finite are skipped;
    the first of equal losses wins. After a distributed fit (see :mod:`laplace.distributed`)
    each rank validates on its own shard of ``val_loader`` and the losses, taken as means over
    the shard, are averaged over all validation points, so every rank picks the same candidate.

    Returns:
        The best candidate, shape (1,).

    Raises:
        RuntimeError: If no candidate gives a finite validation loss.
    """
    distributed = getattr(la, "_distributed", False)
    n_val = distributed_utils.data_count(val_loader) if distributed else 1
    best, best_loss = None, float("inf")
    for prior_prec in tqdm(candidates, disable=not progress_bar, desc="gridsearch"):
        la.prior_precision = prior_prec.reshape(1)
        with distributed_utils.guard(distributed, "gridsearch"):
            try:
                value = validate(
                    la,
                    val_loader,
                    loss,
                    pred_type,
                    link_approx,
                    n_samples,
                    dict_key_y=la.dict_key_y,
                )
            except (NotPositiveDefiniteError, torch.linalg.LinAlgError):
                value = float("inf")
        if distributed:  # the mean over all ranks' validation points
            sums = torch.tensor([value * n_val, n_val], dtype=torch.float64, device=la._device)
            total, count = distributed_utils.all_reduce_sum(sums).tolist()
            value = total / count
        if value < best_loss:
            best, best_loss = prior_prec.reshape(1), value
    if best is None:
        raise RuntimeError("gridsearch: every candidate prior precision gave a non-finite loss.")
    return best
