"""What to measure for each kind of predictive: one evaluation class per kind of prediction.

Class probabilities (:class:`CategoricalEvaluation`), independent label probabilities
(:class:`BernoulliEvaluation`), Gaussian predictives (:class:`GaussianEvaluation`) and
heteroscedastic ones (:class:`HeteroscedasticEvaluation`). Each evaluation also names the
validation losses it offers to grid search
(``optimize_prior_precision(method="gridsearch", loss="ece")``). Which likelihood is evaluated
by which class is the table of :mod:`laplace.evaluation.registry`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import torch
from torch import Tensor
from torchmetrics import MeanSquaredError, Metric
from torchmetrics.classification import MulticlassAccuracy, MulticlassCalibrationError

from laplace.evaluation.gaussian import (
    GaussianCRPS,
    GaussianNLL,
    HeteroscedasticCRPS,
    HeteroscedasticNLL,
    PITCalibration,
    gaussian_entropy,
    gaussian_predictive,
    heteroscedastic_moments,
    targets_like,
)
from laplace.evaluation.metrics import (
    BernoulliAccuracy,
    BernoulliBrier,
    BernoulliNLL,
    BrierScore,
    PerLabelCalibrationError,
    ReliabilityBins,
    bernoulli_entropy,
    categorical_entropy,
)
from laplace.outputs import IGNORE_INDEX, OutputAdapter, OutputLayout, PositionTargets
from laplace.utils.metrics import RunningNLLMetric

__all__ = [
    "BernoulliEvaluation",
    "CategoricalEvaluation",
    "Evaluation",
    "GaussianEvaluation",
    "HeteroscedasticEvaluation",
    "MetricFactory",
    "to_plain",
]

#: Builds a validation metric from ``(n_outputs, sigma_noise, **torchmetrics_kwargs)``.
MetricFactory = Callable[..., Metric]

#: Default number of equal-width confidence bins of the calibration errors.
N_BINS = 15


def to_plain(value: Any) -> Any:
    """Tensors to Python floats (0-d) or lists, recursively through dicts: JSON-serialisable."""
    if isinstance(value, Tensor):
        value = value.detach().cpu().double()
        return value.item() if value.dim() == 0 else value.tolist()
    if isinstance(value, dict):
        return {key: to_plain(item) for key, item in value.items()}
    return value


class Evaluation(ABC):
    """Running metrics of one kind of predictive, updated batch by batch.

    The metrics are built at the first batch (they need the number of outputs) on the device
    of its predictions; targets are moved there.

    Args:
        n_bins: Bins of the calibration errors and reliability diagram (classification) or
            points of the PIT calibration curve (regression).
        levels: Levels of the central predictive intervals whose coverage is measured.
        sigma_noise: Observation noise σ added to regression variances.
        sync: Add the metrics' states over the processes of :mod:`torch.distributed` when
            computing (every process must then call :meth:`compute`).
        class_dim: Classification outputs with extra dimensions (B, C, d₁, …) or (B, T, C):
            the class dimension, None for the one the targets lack (see
            :class:`~laplace.outputs.OutputAdapter`).
        ignore_index: The label of positions (or points) left out of the metrics.
    """

    #: Validation losses this predictive offers to grid search, by name.
    validation_losses: ClassVar[dict[str, MetricFactory]] = {}

    def __init__(
        self,
        n_bins: int = N_BINS,
        levels: Sequence[float] = (0.5, 0.9, 0.95),
        sigma_noise: float | Tensor = 0.0,
        sync: bool = False,
        class_dim: int | None = None,
        ignore_index: int = IGNORE_INDEX,
    ) -> None:
        self.n_bins, self.levels, self.sigma_noise = n_bins, tuple(levels), sigma_noise
        self.outputs = OutputAdapter(class_dim, ignore_index)
        self._metric_kwargs = {"sync_on_compute": sync}
        self._metrics: dict[str, Metric] | None = None

    def update(self, prediction: Any, target: Tensor) -> None:
        """Add one batch of predictions and targets."""
        prediction, target = self._checked(prediction, target)
        if self._metrics is None:
            built = self._build(prediction, self._metric_kwargs)
            self._metrics = {name: metric.to(target.device) for name, metric in built.items()}
        self._update(self._metrics, prediction, target)

    def compute(self) -> dict[str, Any]:
        """The metrics of all batches so far as a JSON-serialisable dict.

        Raises:
            ValueError: Before the first batch.
        """
        if self._metrics is None:
            raise ValueError("no batch was evaluated: the loader yielded no data.")
        return to_plain(self._compute(self._metrics))

    @abstractmethod
    def entropy(self, prediction: Any) -> Tensor:
        """Entropy of each point's predictive distribution, shape (B,)."""

    @abstractmethod
    def _checked(self, prediction: Any, target: Tensor) -> tuple[Any, Tensor]:
        """Check a batch and bring it to the shapes the metrics expect."""

    @abstractmethod
    def _build(self, prediction: Any, kwargs: dict[str, Any]) -> dict[str, Metric]:
        """The metrics, given the first batch's (checked) prediction."""

    @abstractmethod
    def _update(self, metrics: dict[str, Metric], prediction: Any, target: Tensor) -> None:
        """Update the metrics with a checked batch."""

    @abstractmethod
    def _compute(self, metrics: dict[str, Metric]) -> dict[str, Any]:
        """The result, tensors allowed."""


def _probabilities(prediction: Any, what: str) -> Tensor:
    if not isinstance(prediction, Tensor) or prediction.dim() != 2:
        shape = tuple(prediction.shape) if isinstance(prediction, Tensor) else None
        raise ValueError(
            f"{what} predictions must be a probability tensor of shape (B, C); got "
            f"{type(prediction).__name__}" + (f" of shape {shape}." if shape else ".")
        )
    return prediction


class CategoricalEvaluation(Evaluation):
    """Class probabilities (B, C) against integer labels (B,).

    Probabilities of outputs with extra dimensions, (B, C, d₁, …) against labels (B, d₁, …)
    (segmentation) or (B, T, C) against (B, T) (sequences), are scored position by position:
    ``n`` and every mean count positions. Labels equal to ``ignore_index`` are left out.

    Result keys: ``accuracy``, ``nll`` (mean ``−log p_y``), ``brier`` (mean ``Σ_c (p_c −
    1[y = c])²``), ``ece`` and ``mce`` (torchmetrics' expected and maximum calibration error of
    the top-label confidence over ``n_bins`` equal-width bins), ``confidence`` (mean top-label
    confidence), ``n`` (points) and ``reliability`` (the per-bin ``bin_edges``, mean
    ``confidence``, ``accuracy`` and ``count`` of the reliability diagram).
    """

    validation_losses: ClassVar[dict[str, MetricFactory]] = {
        "nll": lambda n_outputs, sigma_noise, **kw: RunningNLLMetric(**kw),
        "brier": lambda n_outputs, sigma_noise, **kw: BrierScore(**kw),
        "ece": lambda n_outputs, sigma_noise, **kw: MulticlassCalibrationError(
            n_outputs, N_BINS, "l1", **kw
        ),
    }

    def _checked(self, prediction: Any, target: Tensor) -> tuple[Tensor, Tensor]:
        if isinstance(prediction, Tensor) and prediction.dim() > 2:
            target = target.to(prediction.device)
            layout = self._layout(prediction, target)
            prediction, target = layout.rows(prediction), layout.targets(target)
        probs = _probabilities(prediction, "classification")
        target = target.reshape(-1).to(probs.device)
        if target.shape[0] != probs.shape[0] or target.dtype.is_floating_point:
            raise ValueError(
                f"classification targets must be {probs.shape[0]} integer labels; got "
                f"{target.dtype} of shape {tuple(target.shape)}."
            )
        keep = target != self.outputs.ignore_index
        if not bool(keep.all()):
            probs, target = probs[keep], target[keep]
        return probs, target.long()

    def _layout(self, prediction: Tensor, target: Tensor | None) -> OutputLayout:
        """Where the classes are in probabilities with extra dimensions (from the targets)."""
        return self.outputs.layout(
            prediction.shape, target, PositionTargets.LABELS, "classification"
        )

    def _build(self, prediction: Tensor, kwargs: dict[str, Any]) -> dict[str, Metric]:
        n_classes = prediction.shape[-1]
        return {
            "accuracy": MulticlassAccuracy(n_classes, average="micro", **kwargs),
            "nll": RunningNLLMetric(**kwargs).set_dtype(torch.float64),
            "brier": BrierScore(**kwargs),
            "ece": MulticlassCalibrationError(n_classes, self.n_bins, "l1", **kwargs),
            "mce": MulticlassCalibrationError(n_classes, self.n_bins, "max", **kwargs),
            "reliability": ReliabilityBins(self.n_bins, **kwargs),
        }

    def _update(self, metrics: dict[str, Metric], prediction: Tensor, target: Tensor) -> None:
        for name in ("accuracy", "nll", "brier", "ece", "mce"):
            metrics[name].update(prediction, target)
        confidence, predicted = prediction.max(-1)
        metrics["reliability"].update(confidence, predicted == target)

    def _compute(self, metrics: dict[str, Metric]) -> dict[str, Any]:
        result = {name: metrics[name].compute() for name in ("accuracy", "nll", "brier")}
        result.update(ece=metrics["ece"].compute(), mce=metrics["mce"].compute())
        bins = metrics["reliability"].compute()
        n = bins["count"].sum()
        result.update(confidence=(bins["confidence"] * bins["count"]).sum() / n, n=int(n))
        result["reliability"] = bins
        return result

    def entropy(self, prediction: Any) -> Tensor:
        """Entropy ``−Σ_c p_c log p_c`` of each point's class probabilities, shape (B,).

        With extra dimensions, the mean entropy over a point's positions.
        """
        if isinstance(prediction, Tensor) and prediction.dim() > 2:
            rows = self._layout(prediction, None).rows(prediction)
            return categorical_entropy(rows).reshape(prediction.shape[0], -1).mean(1)
        return categorical_entropy(_probabilities(prediction, "classification"))


class BernoulliEvaluation(Evaluation):
    """Independent label probabilities (B, K) against binary targets (B, K).

    Each label is scored on its own; the result holds these per-label values under
    ``per_label`` (``accuracy`` at threshold ½, Bernoulli ``nll``, ``brier``, and
    torchmetrics' binary ``ece`` and ``mce`` over ``n_bins`` bins) and their means over the
    labels under the same names, plus ``n`` (points).
    """

    validation_losses: ClassVar[dict[str, MetricFactory]] = {
        "nll": lambda n_outputs, sigma_noise, **kw: BernoulliNLL(n_outputs, **kw),
        "brier": lambda n_outputs, sigma_noise, **kw: BernoulliBrier(n_outputs, **kw),
        "ece": lambda n_outputs, sigma_noise, **kw: PerLabelCalibrationError(
            n_outputs, N_BINS, "l1", **kw
        ),
    }

    def _checked(self, prediction: Any, target: Tensor) -> tuple[Tensor, Tensor]:
        probs = _probabilities(prediction, "multi-label")
        if target.numel() != probs.numel():
            raise ValueError(
                f"multi-label targets of shape {tuple(target.shape)} do not match the label "
                f"probabilities of shape {tuple(probs.shape)}."
            )
        return probs, target.reshape(probs.shape).to(probs.device).long()

    def _build(self, prediction: Tensor, kwargs: dict[str, Any]) -> dict[str, Metric]:
        n_labels = prediction.shape[-1]
        return {
            "accuracy": BernoulliAccuracy(n_labels, **kwargs),  # torchmetrics' needs K > 1
            "nll": BernoulliNLL(n_labels, **kwargs),
            "brier": BernoulliBrier(n_labels, **kwargs),
            "ece": PerLabelCalibrationError(n_labels, self.n_bins, "l1", **kwargs),
            "mce": PerLabelCalibrationError(n_labels, self.n_bins, "max", **kwargs),
        }

    def _update(self, metrics: dict[str, Metric], prediction: Tensor, target: Tensor) -> None:
        for metric in metrics.values():
            metric.update(prediction, target)

    def _compute(self, metrics: dict[str, Metric]) -> dict[str, Any]:
        per_label = {name: metric.compute() for name, metric in metrics.items()}
        result: dict[str, Any] = {name: value.mean() for name, value in per_label.items()}
        result.update(n=int(metrics["nll"].count), per_label=per_label)
        return result

    def entropy(self, prediction: Any) -> Tensor:
        """Summed entropy of each point's independent labels, shape (B,)."""
        return bernoulli_entropy(_probabilities(prediction, "multi-label"))


class GaussianEvaluation(Evaluation):
    """Gaussian predictives ``(f_mu (B, C), f_var (B, C, C) or (B, C))`` against targets.

    The predictive covariance is ``f_var + σ²I``. Result keys: ``nll`` (mean joint NLL per
    point), ``rmse`` (over points and outputs, torchmetrics), ``crps`` (mean closed-form
    Gaussian CRPS per output), ``coverage`` (``{"0.9": fraction, ...}``: the fraction of
    targets inside the central interval of each level), ``calibration_curve`` (``expected``
    levels and the ``observed`` fraction of PIT values below each) and ``n`` (points).
    """

    validation_losses: ClassVar[dict[str, MetricFactory]] = {
        "nll": lambda n_outputs, sigma_noise, **kw: GaussianNLL(sigma_noise, **kw),
        "crps": lambda n_outputs, sigma_noise, **kw: GaussianCRPS(sigma_noise, **kw),
    }

    def _moments(self, prediction: Any) -> tuple[Tensor, Tensor]:
        """The predictive mean and (co)variance of a batch of predictions."""
        if not (isinstance(prediction, tuple) and len(prediction) == 2):
            raise ValueError(
                "regression predictions must be a (mean, variance) pair; got "
                f"{type(prediction).__name__}."
            )
        return gaussian_predictive(*prediction, self.sigma_noise)

    def _checked(self, prediction: Any, target: Tensor) -> tuple[Any, Tensor]:
        mean, cov = self._moments(prediction)
        return (mean, cov), targets_like(target, mean)

    def _build(self, prediction: Any, kwargs: dict[str, Any]) -> dict[str, Metric]:
        return {
            "nll": GaussianNLL(**kwargs),
            "rmse": MeanSquaredError(squared=False, **kwargs).set_dtype(torch.float64),
            "crps": GaussianCRPS(**kwargs),
            "pit": PITCalibration(self.levels, self.n_bins, **kwargs),
        }

    def _update(self, metrics: dict[str, Metric], prediction: Any, target: Tensor) -> None:
        mean, cov = prediction
        metrics["nll"].update(mean, cov, target)
        metrics["rmse"].update(mean.reshape(-1), target.reshape(-1))
        metrics["crps"].update(mean, cov, target)
        metrics["pit"].update(mean, cov, target)

    def _compute(self, metrics: dict[str, Metric]) -> dict[str, Any]:
        result = {name: metrics[name].compute() for name in ("nll", "rmse", "crps")}
        pit = metrics["pit"].compute()
        result["coverage"] = {
            f"{level:g}": fraction
            for level, fraction in zip(self.levels, pit["coverage"], strict=True)
        }
        result["calibration_curve"] = {"expected": pit["expected"], "observed": pit["observed"]}
        result["n"] = int(metrics["nll"].count)
        return result

    def entropy(self, prediction: Any) -> Tensor:
        """Differential entropy of each point's predictive Gaussian, shape (B,)."""
        return gaussian_entropy(self._moments(prediction)[1])


class HeteroscedasticEvaluation(GaussianEvaluation):
    """Heteroscedastic predictions ``(mean, epistemic, aleatoric)`` against targets.

    Evaluated as the Gaussian ``N(mean, epistemic + diag(aleatoric))``; no ``sigma_noise``.
    """

    validation_losses: ClassVar[dict[str, MetricFactory]] = {
        "nll": lambda n_outputs, sigma_noise, **kw: HeteroscedasticNLL(**kw),
        "crps": lambda n_outputs, sigma_noise, **kw: HeteroscedasticCRPS(**kw),
    }

    def _moments(self, prediction: Any) -> tuple[Tensor, Tensor]:
        if not (isinstance(prediction, tuple) and len(prediction) == 3):
            raise ValueError(
                "heteroscedastic predictions must be (mean, epistemic_variance, "
                f"aleatoric_variance); got {type(prediction).__name__}."
            )
        return heteroscedastic_moments(*prediction)
