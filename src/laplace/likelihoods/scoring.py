r"""How a likelihood's predictions are scored: scoring rules, running metrics, one evaluation.

A scoring rule is a function of a batch; ``MeanScore`` keeps the float64 running mean of
one, summed across processes by torchmetrics (``sync_on_compute``). ``Evaluation`` runs the
metrics a likelihood measures its predictive by (``LikelihoodModel.evaluation``, written in the
likelihood's module); its named validation losses (``LikelihoodModel.validation_loss``) are such
metrics for grid search. A
Gaussian predictive ``N(μ, Σ_f + σ²I)`` is scored by its NLL, its CRPS per output
``s (z (2Φ(z) − 1) + 2φ(z) − 1/√π)`` with ``z = (y − μ)/s``, and the probability integral
transform ``Φ(z)`` (uniform when calibrated).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, NamedTuple

import torch
from torch import Tensor
from torchmetrics import Metric
from torchmetrics.functional.classification import binary_calibration_error
from torchmetrics.utilities import dim_zero_cat

__all__ = [
    "N_BINS",
    "VALIDATION_LOSSES",
    "BernoulliAccuracy",
    "BernoulliBrier",
    "BernoulliNLL",
    "BrierScore",
    "Evaluation",
    "EvaluationOptions",
    "GaussianCRPS",
    "GaussianNLL",
    "HeteroscedasticCRPS",
    "HeteroscedasticNLL",
    "MeanScore",
    "MetricFactory",
    "PITCalibration",
    "PerLabelCalibrationError",
    "ReliabilityBins",
    "bernoulli_entropy",
    "categorical_entropy",
    "gaussian_crps",
    "gaussian_entropy",
    "gaussian_nll",
    "gaussian_predictive",
    "heteroscedastic_moments",
    "targets_like",
    "to_plain",
]

#: A validation loss of grid search: ``(n_outputs, sigma_noise, **metric_kwargs) → Metric``.
MetricFactory = Callable[..., Metric]
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


def _variances(cov: Tensor) -> Tensor:
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


def _brier(probs: Tensor, target: Tensor) -> Tensor:
    picked = probs.gather(-1, target.long().reshape(-1, 1)).squeeze(-1)
    return probs.square().sum(-1) - 2 * picked + 1


def _per_label(rule: Callable[[Tensor, Tensor], Tensor], probs: Tensor, target: Tensor) -> Tensor:
    probs = probs.to(torch.float64)
    return rule(probs, target.reshape(probs.shape).to(torch.float64))


def _label_nll(p: Tensor, y: Tensor) -> Tensor:
    return -torch.special.xlogy(y, p) - torch.special.xlogy(1 - y, 1 - p)


def _label_accuracy(p: Tensor, y: Tensor) -> Tensor:
    return ((p > 0.5) == (y > 0.5)).to(p.dtype)


def _label_brier(p: Tensor, y: Tensor) -> Tensor:
    return (p - y).square()


def _gaussian_rule(
    rule: Callable[[Tensor, Tensor, Tensor], Tensor],
    sigma_noise: Tensor,
    f_mu: Tensor,
    f_var: Tensor,
    target: Tensor,
) -> Tensor:
    mean, cov = gaussian_predictive(f_mu, f_var, sigma_noise)
    return rule(mean, cov, targets_like(target, mean))


def _crps(mean: Tensor, cov: Tensor, target: Tensor) -> Tensor:
    return gaussian_crps(mean, _variances(cov).sqrt(), target)


def _heteroscedastic_rule(
    rule: Callable[[Tensor, Tensor, Tensor], Tensor],
    mean: Tensor,
    epistemic_variance: Tensor,
    aleatoric_variance: Tensor,
    target: Tensor,
) -> Tensor:
    moments = heteroscedastic_moments(mean, epistemic_variance, aleatoric_variance)
    return _gaussian_rule(rule, torch.zeros((), dtype=torch.float64), *moments, target)


# ------------------------------------------------------------------------------ running metrics
class _Sums(Metric):
    """A metric of float64 sums, added across processes."""

    is_differentiable = False
    higher_is_better = False
    full_state_update = False

    def sum_state(self, name: str, size: int | None = None) -> None:
        """Register a float64 state of shape () or (size,) that processes add up."""
        default = torch.zeros(() if size is None else (size,), dtype=torch.float64)
        self.add_state(name, default=default, dist_reduce_fx="sum")

    def grid(self, n_bins: int) -> Tensor:
        """The levels ``k / n_bins``, ``k = 0..n_bins``, in float64 on the metric's device."""
        return torch.linspace(0, 1, n_bins + 1, dtype=torch.float64, device=self.device)


class MeanScore(_Sums):
    """The running mean of a scoring rule over the entries it returns.

    Args:
        score: Maps the arguments of ``update`` to scores, any shape (each entry one term
            of the mean), or (B, K) with ``n_labels``.
        n_labels: Keep one mean per label (the last dimension of the scores), over the points.
        **kwargs: Keyword arguments of ``torchmetrics.Metric``.
    """

    def __init__(
        self, score: Callable[..., Tensor], n_labels: int | None = None, **kwargs: Any
    ) -> None:
        super().__init__(**kwargs)
        self.score, self.n_labels = score, n_labels
        self.sum_state("total", n_labels)
        self.sum_state("count")

    def update(self, *batch: Tensor) -> None:
        """Add the scores of a batch."""
        scores = self.score(*batch)
        if self.n_labels is None:
            self.total += scores.sum(dtype=torch.float64)
            self.count += scores.numel()
        else:
            self.total += scores.sum(0)
            self.count += scores.shape[0]

    def compute(self) -> Tensor:
        """The mean score (one per label with ``n_labels``; NaN before any update)."""
        return self.total / self.count


class BrierScore(MeanScore):
    """Multiclass Brier score ``(1/N) Σ_n Σ_c (p_nc − 1[y_n = c])²`` of probabilities (B, C)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(_brier, **kwargs)


class BernoulliNLL(MeanScore):
    """Per-label NLL ``−(1/N) Σ_n [y log p + (1 − y) log(1 − p)]`` of probabilities (B, K)."""

    def __init__(self, n_labels: int, **kwargs: Any) -> None:
        super().__init__(partial(_per_label, _label_nll), n_labels, **kwargs)


class BernoulliAccuracy(MeanScore):
    """Per-label accuracy ``(1/N) Σ_n 1[(p > ½) = y]`` of probabilities (B, K), any K ≥ 1."""

    def __init__(self, n_labels: int, **kwargs: Any) -> None:
        super().__init__(partial(_per_label, _label_accuracy), n_labels, **kwargs)


class BernoulliBrier(MeanScore):
    """Per-label Brier score ``(1/N) Σ_n (p − y)²`` of probabilities (B, K)."""

    def __init__(self, n_labels: int, **kwargs: Any) -> None:
        super().__init__(partial(_per_label, _label_brier), n_labels, **kwargs)


class GaussianNLL(MeanScore):
    """Mean NLL per point of ``update(f_mu, f_var, y)`` under ``N(f_mu, f_var + σ²I)``.

    Args:
        sigma_noise: Observation noise σ (0: ``f_var`` is already the predictive variance).
        **kwargs: Keyword arguments of ``torchmetrics.Metric``.
    """

    def __init__(self, sigma_noise: float | Tensor = 0.0, **kwargs: Any) -> None:
        sigma = torch.as_tensor(sigma_noise, dtype=torch.float64).detach().clone()
        super().__init__(partial(_gaussian_rule, gaussian_nll, sigma), **kwargs)


class GaussianCRPS(MeanScore):
    """Mean CRPS over points and outputs of ``update(f_mu, f_var, y)``, noise σ added.

    Args:
        sigma_noise: Observation noise σ (0: ``f_var`` is already the predictive variance).
        **kwargs: Keyword arguments of ``torchmetrics.Metric``.
    """

    def __init__(self, sigma_noise: float | Tensor = 0.0, **kwargs: Any) -> None:
        sigma = torch.as_tensor(sigma_noise, dtype=torch.float64).detach().clone()
        super().__init__(partial(_gaussian_rule, _crps, sigma), **kwargs)


class HeteroscedasticNLL(MeanScore):
    """``GaussianNLL`` of ``update(mean, epistemic_variance, aleatoric_variance, y)``."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(partial(_heteroscedastic_rule, gaussian_nll), **kwargs)


class HeteroscedasticCRPS(MeanScore):
    """``GaussianCRPS`` of ``update(mean, epistemic_variance, aleatoric_variance, y)``."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(partial(_heteroscedastic_rule, _crps), **kwargs)


class ReliabilityBins(_Sums):
    """Per-bin count, summed confidence and summed correctness over K equal-width bins of [0, 1].

    Bin ``k`` holds the confidences in ``[k/K, (k+1)/K)``, the last also 1; the expected
    calibration error is ``Σ_k (n_k/N) |acc_k − conf_k|``.

    Args:
        n_bins: Number of bins K.
        **kwargs: Keyword arguments of ``torchmetrics.Metric``.
    """

    def __init__(self, n_bins: int = N_BINS, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.n_bins = n_bins
        for name in ("count", "confidence", "correct"):
            self.sum_state(name, n_bins)

    def update(self, confidence: Tensor, correct: Tensor) -> None:
        """Add confidences (N,) in [0, 1] and whether each prediction was right (N,)."""
        confidence = confidence.reshape(-1).to(torch.float64)
        index = (confidence * self.n_bins).long().clamp(0, self.n_bins - 1)
        self.count += torch.bincount(index, minlength=self.n_bins).to(torch.float64)
        self.confidence += torch.bincount(index, confidence, minlength=self.n_bins)
        correct = correct.reshape(-1).to(torch.float64)
        self.correct += torch.bincount(index, correct, minlength=self.n_bins)

    def compute(self) -> dict[str, Tensor]:
        """``bin_edges`` (K+1,), mean ``confidence``, ``accuracy`` (0 if empty), ``count`` (K,)."""
        count = self.count.clamp_min(1)
        return {
            "bin_edges": self.grid(self.n_bins),
            "confidence": self.confidence / count,
            "accuracy": self.correct / count,
            "count": self.count,
        }


class PerLabelCalibrationError(Metric):
    """torchmetrics' binary calibration error of each of K independent labels.

    Keeps the probabilities and targets (N, K) and bins each label at ``compute``.

    Args:
        n_labels: Number of labels K.
        n_bins: Number of equal-width bins.
        norm: ``"l1"`` (expected calibration error) or ``"max"`` (maximum calibration error).
        **kwargs: Keyword arguments of ``torchmetrics.Metric``.
    """

    is_differentiable = False
    higher_is_better = False
    full_state_update = False

    def __init__(
        self, n_labels: int, n_bins: int = N_BINS, norm: str = "l1", **kwargs: Any
    ) -> None:
        super().__init__(**kwargs)
        self.n_labels, self.n_bins, self.norm = n_labels, n_bins, norm
        self.add_state("probs", default=[], dist_reduce_fx="cat")
        self.add_state("target", default=[], dist_reduce_fx="cat")

    def update(self, probs: Tensor, target: Tensor) -> None:
        """Add label probabilities (B, K) and targets (B, K) in {0, 1}."""
        self.probs.append(probs.detach())
        self.target.append(target.reshape(probs.shape).long())

    def compute(self) -> Tensor:
        """The calibration error of each label, shape (K,)."""
        probs, target = dim_zero_cat(self.probs).T.contiguous(), dim_zero_cat(self.target).T
        return torch.stack(
            [
                binary_calibration_error(probs[k], target[k], self.n_bins, self.norm)
                for k in range(self.n_labels)
            ]
        )


class PITCalibration(_Sums):
    """Calibration curve of the probability integral transform and interval coverage.

    ``update(f_mu, f_var, y)`` scores ``N(f_mu, f_var + σ²I)`` per output.

    Args:
        levels: Levels α in (0, 1) of the central intervals ``|z| ≤ Φ⁻¹((1 + α)/2)`` counted.
        n_bins: The curve is evaluated at the levels ``k / n_bins``, ``k = 0..n_bins``.
        sigma_noise: Observation noise σ (0: ``f_var`` is already the predictive variance).
        **kwargs: Keyword arguments of ``torchmetrics.Metric``.
    """

    def __init__(
        self,
        levels: Sequence[float] = (0.5, 0.9, 0.95),
        n_bins: int = N_BINS,
        sigma_noise: float | Tensor = 0.0,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.sigma_noise = torch.as_tensor(sigma_noise, dtype=torch.float64).detach().clone()
        self.levels = tuple(float(level) for level in levels)
        self.n_bins = n_bins
        self.sum_state("pit_count", n_bins)
        self.sum_state("covered", len(self.levels))
        self.sum_state("count")

    def update(self, f_mu: Tensor, f_var: Tensor, target: Tensor) -> None:
        """Add a batch: means (B, C), covariances (B, C, C) or variances (B, C), targets."""
        mean, cov = gaussian_predictive(f_mu, f_var, self.sigma_noise)
        target = targets_like(target, mean)
        z = ((target - mean) / _variances(cov).sqrt()).reshape(-1).to(torch.float64)
        index = (torch.special.ndtr(z) * self.n_bins).long().clamp(0, self.n_bins - 1)
        self.pit_count += torch.bincount(index, minlength=self.n_bins).to(torch.float64)
        half_widths = torch.special.ndtri(
            (1 + torch.tensor(self.levels, dtype=torch.float64, device=z.device)) / 2
        )
        self.covered += (z.abs().unsqueeze(-1) <= half_widths).sum(0).to(torch.float64)
        self.count += z.numel()

    def compute(self) -> dict[str, Tensor]:
        """``expected`` levels (K+1,), ``observed`` fractions of PIT ≤ level, ``coverage``."""
        observed = torch.cat([self.pit_count.new_zeros(1), self.pit_count.cumsum(0)])
        return {
            "expected": self.grid(self.n_bins),
            "observed": observed / self.count,
            "coverage": self.covered / self.count,
        }


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


def to_plain(value: Any) -> Any:
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
        read: Callable[[Any, Tensor], Batch],
        metrics: Callable[[tuple[Tensor, ...]], dict[str, Metric]],
        summary: Callable[[dict[str, Metric]], dict[str, Any]],
        entropy: Callable[[Any], Tensor],
        feeds: dict[str, Callable[..., tuple[Tensor, ...]]] | None = None,
    ) -> None:
        self.read, self.build, self.summary, self.entropy = read, metrics, summary, entropy
        self.feeds = feeds or {}
        self.metrics: dict[str, Metric] | None = None

    def update(self, prediction: Any, target: Tensor) -> None:
        """Add one batch of predictions and targets."""
        inputs, target = self.read(prediction, target)
        if self.metrics is None:
            self.metrics = {k: m.to(target.device) for k, m in self.build(inputs).items()}
        for name, metric in self.metrics.items():
            feed = self.feeds.get(name)
            metric.update(*(feed(*inputs, target) if feed else (*inputs, target)))

    def compute(self) -> dict[str, Any]:
        """The result over all batches so far, JSON-serialisable.

        Raises:
            ValueError: Before the first batch.
        """
        if self.metrics is None:
            raise ValueError("no batch was evaluated: the loader yielded no data.")
        return to_plain(self.summary(self.metrics))


def probabilities(prediction: Any, what: str) -> Tensor:
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
