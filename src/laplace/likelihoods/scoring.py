r"""How a likelihood's predictions are scored: scoring rules and one evaluation.

A scoring rule is a function of a batch; the running metrics that average them across batches
and processes are in ``laplace.likelihoods.running_scores`` (which imports torchmetrics, so it
is imported where a metric is built). ``Evaluation`` runs the
metrics a likelihood measures its predictive by (``LikelihoodModel.evaluation``, written in the
likelihood's module); its named validation losses (``LikelihoodModel.validation_loss``) are such
metrics for grid search. A
Gaussian predictive ``N(μ, Σ_f + σ²I)`` is scored by its NLL, its CRPS per output
``s (z (2Φ(z) − 1) + 2φ(z) − 1/√π)`` with ``z = (y − μ)/s``, and the probability integral
transform ``Φ(z)`` (uniform when calibrated).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, NamedTuple, TypeAlias, TypedDict, overload

import torch
from torch import Tensor

if TYPE_CHECKING:
    from torchmetrics import Metric

__all__ = [
    "N_BINS",
    "VALIDATION_LOSSES",
    "Evaluation",
    "EvaluationOptions",
    "MetricFactory",
    "MetricOptions",
    "Metrics",
    "bernoulli_entropy",
    "categorical_entropy",
    "gaussian_crps",
    "gaussian_entropy",
    "gaussian_nll",
    "gaussian_predictive",
    "heteroscedastic_moments",
    "marginal_variances",
    "targets_like",
    "to_plain",
]

#: A validation loss of grid search: ``(n_outputs, sigma_noise, **metric_kwargs) → Metric``.
MetricFactory = Callable[..., "Metric"]


#: Metrics as ``evaluate`` returns them: by name, each a Python float, int, list or dict (JSON),
#: of a type set by its name (``docs/evaluation.md``); read by key, as a parsed JSON object is.
Metrics: TypeAlias = dict[str, Any]


class MetricOptions(TypedDict, total=False):
    """Keyword arguments of ``torchmetrics.Metric`` that the scores pass on.

    Attributes:
        sync_on_compute: Sum the states over the processes of ``torch.distributed``.
    """

    sync_on_compute: bool


#: Default number of equal-width bins of the calibration errors and curves.
N_BINS = 15
#: Every named validation loss a likelihood may offer grid search (lower is better for all).
VALIDATION_LOSSES = ("brier", "crps", "ece", "nll")

_LOG_2PI = math.log(2 * math.pi)


# ------------------------------------------------------------------------------ scoring rules
def categorical_entropy(probs: Tensor) -> Tensor:
    """Entropy ``−Σ_c p_c log p_c`` of class probabilities (B, C), shape (B,)."""
    return -torch.special.xlogy(probs, probs).sum(-1)


def bernoulli_entropy(probs: Tensor) -> Tensor:
    """Summed entropy of independent labels with probabilities (B, K), shape (B,)."""
    return -(torch.special.xlogy(probs, probs) + torch.special.xlogy(1 - probs, 1 - probs)).sum(-1)


def gaussian_entropy(cov: Tensor) -> Tensor:
    """Differential entropy ``½ log det(2πe Σ)`` of covariances (B, C, C) or variances (B, C)."""
    if cov.dim() == 2:
        return 0.5 * (_LOG_2PI + 1 + cov.log()).sum(-1)
    return 0.5 * (cov.shape[-1] * (_LOG_2PI + 1) + torch.linalg.slogdet(cov)[1])


def gaussian_predictive(
    f_mu: Tensor, f_var: Tensor, sigma_noise: float | Tensor = 0.0
) -> tuple[Tensor, Tensor]:
    """Predictive moments ``(f_mu, f_var + σ²I)`` of the targets.

    Args:
        f_mu: Means (B, C) or (B,), or (B, d₁, …) of outputs with extra dimensions.
        f_var: Covariances (B, C, C) or variances (B, C) (or (B,) with a (B,) mean, or
            variances (B, d₁, …), evaluated as independent outputs (B, d₁·…)).
        sigma_noise: Observation noise σ added as ``σ²`` to the variances.

    Returns:
        ``(mean (B, C), covariance (B, C, C) or variances (B, C))``; a single-output
        covariance is returned as variances.

    Raises:
        ValueError: If the shapes do not fit together.
    """
    if f_mu.dim() == 1:
        f_mu, f_var = f_mu.unsqueeze(-1), f_var.reshape(-1, 1)
    elif f_mu.dim() > 2 and f_var.shape == f_mu.shape:  # dense outputs: one variance each
        f_mu, f_var = f_mu.flatten(1), f_var.flatten(1)
    n_outputs = f_mu.shape[-1]
    if f_var.shape not in (f_mu.shape, (*f_mu.shape, n_outputs)):
        raise ValueError(
            f"the predictive variance has shape {tuple(f_var.shape)}; expected "
            f"{tuple(f_mu.shape)} (variances) or {(*f_mu.shape, n_outputs)} (covariances)."
        )
    if f_var.dim() == 3 and n_outputs == 1:
        f_var = f_var.reshape(f_mu.shape)
    noise = torch.as_tensor(sigma_noise, dtype=f_var.dtype, device=f_var.device).square()
    if f_var.dim() == 3:
        return f_mu, f_var + noise * torch.eye(n_outputs, dtype=f_var.dtype, device=f_var.device)
    return f_mu, f_var + noise


def heteroscedastic_moments(
    mean: Tensor, epistemic_variance: Tensor, aleatoric_variance: Tensor
) -> tuple[Tensor, Tensor]:
    """Mean and covariance ``epistemic + diag(aleatoric)`` (variances for epistemic variances)."""
    if epistemic_variance.dim() == mean.dim():
        return mean, epistemic_variance + aleatoric_variance
    return mean, epistemic_variance + torch.diag_embed(aleatoric_variance)


def targets_like(target: Tensor, mean: Tensor) -> Tensor:
    """Regression targets in the shape, dtype and device of the predictive mean (B, C).

    Raises:
        ValueError: If the number of entries differs.
    """
    if target.numel() != mean.numel():
        raise ValueError(
            f"regression targets of shape {tuple(target.shape)} do not match the predictive "
            f"mean of shape {tuple(mean.shape)}."
        )
    return target.reshape(mean.shape).to(device=mean.device, dtype=mean.dtype)


def marginal_variances(cov: Tensor) -> Tensor:
    """The variances (B, C) of covariances (B, C, C), or the variances (B, C) themselves."""
    return cov if cov.dim() == 2 else cov.diagonal(dim1=-2, dim2=-1)


def gaussian_nll(mean: Tensor, cov: Tensor, target: Tensor) -> Tensor:
    """Negative log density of targets (B, C) under ``N(mean, cov)`` per point, shape (B,).

    ``cov`` holds covariances (B, C, C) or variances (B, C); NaN where it is not positive
    definite.
    """
    residual = target - mean
    if cov.dim() == 2:
        return 0.5 * (_LOG_2PI + cov.log() + residual.square() / cov).sum(-1)
    chol, info = torch.linalg.cholesky_ex(cov)
    white = torch.linalg.solve_triangular(chol, residual.unsqueeze(-1), upper=False)
    log_det = 2 * chol.diagonal(dim1=-2, dim2=-1).log().sum(-1)
    nll = 0.5 * (mean.shape[-1] * _LOG_2PI + log_det + white.squeeze(-1).square().sum(-1))
    return torch.where(info == 0, nll, torch.full_like(nll, float("nan")))


def gaussian_crps(mean: Tensor, std: Tensor, target: Tensor) -> Tensor:
    """Closed-form CRPS of ``N(mean, std²)`` at ``target``, elementwise (same shape)."""
    z = (target - mean) / std
    pdf = torch.exp(-0.5 * z.square()) / math.sqrt(2 * math.pi)
    return std * (z * (2 * torch.special.ndtr(z) - 1) + 2 * pdf - 1 / math.sqrt(math.pi))


# ------------------------------------------------------------------------------ evaluation
class EvaluationOptions(NamedTuple):
    """What ``evaluate`` asks of a likelihood's evaluation.

    Attributes:
        n_bins: Bins of the calibration errors, or points of the PIT curve.
        levels: Levels of the central predictive intervals whose coverage is measured.
        sigma_noise: Observation noise σ added to the variances of Gaussian predictions.
        sync: Add the metrics over the processes of ``torch.distributed`` when computing.
    """

    n_bins: int = N_BINS
    levels: tuple[float, ...] = (0.5, 0.9, 0.95)
    sigma_noise: float | Tensor = 0.0
    sync: bool = False


@overload
def to_plain(value: Mapping[str, object]) -> dict[str, object]: ...


@overload
def to_plain(value: object) -> object: ...


def to_plain(value: object) -> object:
    """Tensors to Python floats (0-d) or lists, recursively through dicts: JSON-serialisable."""
    if isinstance(value, Tensor):
        value = value.detach().cpu().double()
        return value.item() if value.dim() == 0 else value.tolist()
    if isinstance(value, dict):
        return {key: to_plain(item) for key, item in value.items()}
    return value


#: A batch as the metrics of an evaluation take it: ``(inputs, targets)``.
Batch = tuple[tuple[Tensor, ...], Tensor]


class Evaluation:
    """Running metrics of a likelihood's predictions, updated batch by batch.

    ``LikelihoodModel.evaluation`` builds it from what its predictions are.

    Args:
        read: ``(prediction, target) → (inputs, targets)``: a checked batch as the metrics take
            it (each metric is updated with ``(*inputs, targets)``).
        metrics: Builds the named metrics from the first batch's inputs (they need its number
            of outputs); they are moved to its targets' device.
        summary: The result from the named metrics (tensors allowed).
        entropy: The entropy of each point's predictive, shape (B,).
        feeds: Named metrics updated with ``feed(*inputs, targets)`` instead.
    """

    def __init__(
        self,
        read: Callable[[object, Tensor], Batch],
        metrics: Callable[[tuple[Tensor, ...]], dict[str, Metric]],
        summary: Callable[[dict[str, Metric]], dict[str, object]],
        entropy: Callable[[object], Tensor],
        feeds: dict[str, Callable[..., tuple[Tensor, ...]]] | None = None,
    ) -> None:
        self.read, self.build, self.summary, self.entropy = read, metrics, summary, entropy
        self.feeds = feeds or {}
        self.metrics: dict[str, Metric] | None = None

    def update(self, prediction: object, target: Tensor) -> None:
        """Add one batch of predictions and targets."""
        inputs, target = self.read(prediction, target)
        if self.metrics is None:
            self.metrics = {k: m.to(target.device) for k, m in self.build(inputs).items()}
        for name, metric in self.metrics.items():
            feed = self.feeds.get(name)
            metric.update(*(feed(*inputs, target) if feed else (*inputs, target)))

    def compute(self) -> Metrics:
        """The result over all batches so far, JSON-serialisable.

        Raises:
            ValueError: Before the first batch.
        """
        if self.metrics is None:
            raise ValueError("no batch was evaluated: the loader yielded no data.")
        return to_plain(self.summary(self.metrics))


def probabilities(prediction: object, what: str) -> Tensor:
    """``prediction`` if it is a probability tensor (B, C).

    Raises:
        ValueError: Naming ``what`` predictions were expected.
    """
    if not isinstance(prediction, Tensor) or prediction.dim() != 2:
        shape = tuple(prediction.shape) if isinstance(prediction, Tensor) else None
        raise ValueError(
            f"{what} predictions must be a probability tensor of shape (B, C); got "
            f"{type(prediction).__name__}" + (f" of shape {shape}." if shape else ".")
        )
    return prediction
