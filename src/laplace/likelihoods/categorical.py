"""Categorical (softmax) classification, and reward modelling fitted as classification on pairs."""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import TYPE_CHECKING, ClassVar

import torch
from torch import Tensor, nn
from torch.nn import functional as F
from typing_extensions import Unpack, override

from laplace.likelihoods.gaussian import GaussianRegression
from laplace.likelihoods.likelihood_model import ProbabilityPredictions
from laplace.likelihoods.scoring import (
    N_BINS,
    Evaluation,
    EvaluationOptions,
    MetricFactory,
    MetricOptions,
    categorical_entropy,
    probabilities,
)
from laplace.utils.diag_lowrank import DiagLowRankBatch
from laplace.utils.enums import HessianStructure, Likelihood, LinkApprox
from laplace.utils.errors import DataError, LabelError
from laplace.utils.linalg import softmax_hessian_factor
from laplace.utils.outputs import PositionTargets
from laplace.utils.predictive import LINKS, probit_logits

if TYPE_CHECKING:
    from torchmetrics import Metric

__all__ = ["Categorical", "RewardModeling"]


def _nll_loss(
    n_outputs: int, sigma_noise: float | Tensor, **kwargs: Unpack[MetricOptions]
) -> Metric:
    from laplace.utils.running_nll import RunningNLLMetric

    return RunningNLLMetric(**kwargs)


def _brier_loss(
    n_outputs: int, sigma_noise: float | Tensor, **kwargs: Unpack[MetricOptions]
) -> Metric:
    from laplace.likelihoods.running_scores import BrierScore

    return BrierScore(**kwargs)


def _ece_loss(
    n_outputs: int, sigma_noise: float | Tensor, **kwargs: Unpack[MetricOptions]
) -> Metric:
    from torchmetrics.classification import MulticlassCalibrationError

    return MulticlassCalibrationError(n_outputs, N_BINS, "l1", **kwargs)


class Categorical(ProbabilityPredictions):
    """Categorical likelihood with a softmax link; targets are class indices or probabilities."""

    kind = Likelihood.CLASSIFICATION
    default_validation_loss = "nll"
    validation_losses: ClassVar[dict[str, MetricFactory]] = {
        "nll": _nll_loss,
        "brier": _brier_loss,
        "ece": _ece_loss,
    }
    torch_loss = nn.CrossEntropyLoss
    link = staticmethod(partial(torch.softmax, dim=-1))
    #: The bridge and Monte-Carlo links use the covariance between classes.
    output_variances = False
    link_approximations = LINKS
    variance_links = (LinkApprox.PROBIT, LinkApprox.BRIDGE, LinkApprox.BRIDGE_NORM)
    predictions = "class probabilities"
    position_targets = PositionTargets.LABELS

    @override
    def per_sample_loss(self, f: Tensor, y: Tensor) -> Tensor:
        return F.cross_entropy(f, self.prepare_targets(f, y), reduction="none")

    @override
    def loss_gradient(self, f: Tensor, y: Tensor) -> Tensor:
        y = self.prepare_targets(f, y)
        p = torch.softmax(f, dim=-1)
        if y.dtype.is_floating_point:
            return p - y
        return p - F.one_hot(y, f.shape[-1]).to(f.dtype)

    @override
    def output_hessian_sqrt(self, f: Tensor) -> Tensor:
        """A rank-(C − 1) factor of ``Λ = diag(p) − p pᵀ`` (``softmax_hessian_factor``)."""
        return softmax_hessian_factor(torch.softmax(f, dim=-1))

    @override
    def output_hessian(self, f: Tensor) -> Tensor:
        p = torch.softmax(f, dim=-1)
        return torch.diag_embed(p) - p.unsqueeze(-1) * p.unsqueeze(-2)

    @override
    def structured_output_hessian(self, f: Tensor) -> DiagLowRankBatch:
        """``Λₙ = diag(pₙ) − pₙ pₙᵀ`` as ``(d, V, s) = (p, p, −1)``: O(C) per point."""
        p = torch.softmax(f, dim=-1)
        return DiagLowRankBatch(p, p.unsqueeze(-1), -1)

    @override
    def predictive_nll(
        self, f_mu: Tensor, f_var: Tensor, y: Tensor, sigma_noise: Tensor
    ) -> Tensor:
        """Cross-entropy of the logits of the probit approximation (``probit_logits``)."""
        logits = probit_logits(f_mu, f_var)
        return F.cross_entropy(logits, self.class_indices(y), reduction="sum")

    @override
    def draw_log_likelihood(self, y: Tensor, draws: Tensor) -> Tensor:
        y = self.class_indices(y)
        return draws.log_softmax(-1)[:, torch.arange(len(y), device=y.device), y]

    @override
    def evaluation(self, options: EvaluationOptions) -> Evaluation:
        """Class probabilities (B, C) against labels (B,).

        Result: ``accuracy``, ``nll`` (mean ``−log p_y``), ``brier``, ``ece`` and ``mce``
        (torchmetrics' calibration errors of the top-label confidence over ``n_bins`` bins),
        ``confidence`` (mean top-label confidence), ``n`` and the ``reliability`` bins.
        Probabilities (B, C, d₁, …) against labels (B, d₁, …), or (B, T, C) against (B, T), are
        scored position by position (``n`` and the means count positions, labels equal to
        ``ignore_index`` left out; a point's entropy is the mean over its positions).
        """
        n_bins, kwargs = options.n_bins, MetricOptions(sync_on_compute=options.sync)

        def read(prediction: object, target: Tensor) -> tuple[tuple[Tensor], Tensor]:
            if isinstance(prediction, Tensor) and prediction.dim() > 2:
                layout = self.layout(prediction.shape, target)
                prediction, target = layout.rows(prediction), layout.targets(target)
            probs = probabilities(prediction, "classification")
            target = target.reshape(-1).to(probs.device)
            if target.shape[0] != probs.shape[0] or target.dtype.is_floating_point:
                raise ValueError(
                    f"classification targets must be {probs.shape[0]} integer labels; got "
                    f"{target.dtype} of shape {tuple(target.shape)}."
                )
            keep = target != self.outputs.ignore_index
            if not bool(keep.all()):
                probs, target = probs[keep], target[keep]
            return (probs,), target.long()

        def metrics(inputs: tuple[Tensor, ...]) -> dict[str, Metric]:
            from torchmetrics.classification import MulticlassAccuracy, MulticlassCalibrationError

            from laplace.likelihoods.running_scores import BrierScore, ReliabilityBins
            from laplace.utils.running_nll import RunningNLLMetric

            n_classes = inputs[0].shape[-1]
            return {
                "accuracy": MulticlassAccuracy(n_classes, average="micro", **kwargs),
                "nll": RunningNLLMetric(**kwargs).set_dtype(torch.float64),
                "brier": BrierScore(**kwargs),
                "ece": MulticlassCalibrationError(n_classes, n_bins, "l1", **kwargs),
                "mce": MulticlassCalibrationError(n_classes, n_bins, "max", **kwargs),
                "reliability": ReliabilityBins(n_bins, **kwargs),
            }

        def reliability(probs: Tensor, target: Tensor) -> tuple[Tensor, Tensor]:
            confidence, predicted = probs.max(-1)
            return confidence, predicted == target

        def summary(metrics: dict[str, Metric]) -> dict[str, object]:
            result = {k: metrics[k].compute() for k in ("accuracy", "nll", "brier", "ece", "mce")}
            bins = metrics["reliability"].compute()
            n = bins["count"].sum()
            result.update(confidence=(bins["confidence"] * bins["count"]).sum() / n, n=int(n))
            return {**result, "reliability": bins}

        def entropy(prediction: object) -> Tensor:
            if isinstance(prediction, Tensor) and prediction.dim() > 2:
                rows = self.layout(prediction.shape).rows(prediction)
                return categorical_entropy(rows).reshape(prediction.shape[0], -1).mean(1)
            return categorical_entropy(probabilities(prediction, "classification"))

        return Evaluation(read, metrics, summary, entropy, {"reliability": reliability})

    @override
    def inducing_outputs(self, y: Tensor) -> Tensor:
        """The logit of each point's class."""
        return self.class_indices(y)

    @staticmethod
    def class_indices(y: Tensor) -> Tensor:
        """Class indices (B,) as ``long`` from indices (B,), a column (B, 1) or one-hot (B, C).

        Class probabilities (B, C) give their most likely class.

        Raises:
            ValueError: For any other shape.
        """
        if y.dim() == 2:
            y = y[:, 0] if y.shape[1] == 1 else y.argmax(-1)
        if y.dim() != 1:
            raise ValueError(
                f"classification targets must have shape (B,) or (B, C), got {tuple(y.shape)}."
            )
        return y.long()

    @override
    def sample_targets(self, f: Tensor, generator: torch.Generator | None = None) -> Tensor:
        p = torch.softmax(f.detach(), dim=-1)
        return torch.multinomial(p, 1, generator=generator).squeeze(-1)

    @staticmethod
    def _one_hot_rows(y: Tensor) -> bool:
        """Whether ``y`` holds integer rows (B, C) with C ≥ 2: one-hot labels, once checked."""
        return not y.dtype.is_floating_point and y.dim() == 2 and y.shape[1] > 1

    @override
    def prepare_targets(self, f: Tensor, y: Tensor) -> Tensor:
        """Class indices (B,) from labels, a column or one-hot integer rows; probabilities kept.

        Raises:
            ValueError: See ``check_row_targets``.
        """
        self.check_row_targets(y, f.shape)
        if y.dtype.is_floating_point and y.shape == f.shape:
            return y
        y = y.argmax(-1) if self._one_hot_rows(y) else y.reshape(-1)
        if y.shape[0] != f.shape[0]:
            raise ValueError(
                f"classification targets of shape {tuple(y.shape)} do not match the batch of "
                f"{f.shape[0]} outputs."
            )
        return y.long()

    @override
    def loss_targets(self, y: Tensor, dtype: torch.dtype) -> Tensor:
        """Class indices (B,) for one-hot integer rows (checked before); others as given."""
        return y.argmax(-1) if self._one_hot_rows(y) else y

    @override
    def check_row_targets(self, y: Tensor, output_shape: Sequence[int]) -> None:
        """Labels in ``[0, C)`` (B,) or (B, 1), one-hot integer rows (B, C) or probabilities.

        Raises:
            DataError: For floating-point targets that are not (B, C) probabilities, boolean or
                complex targets, or integer rows (B, C) that are not one-hot.
            LabelError: For a class label outside ``[0, C)``.
        """
        n_classes = output_shape[-1]
        if y.numel() == 0 or (y.dtype.is_floating_point and y.shape[1:] == output_shape[1:]):
            return  # class probabilities
        if y.dtype.is_floating_point or y.dtype == torch.bool or y.is_complex():
            raise DataError(
                f"classification targets must be integer class labels of shape (B,) or class "
                f"probabilities of shape (B, {n_classes}); got {y.dtype} targets of shape "
                f"{tuple(y.shape)} (convert labels with y.long())."
            )
        if self._one_hot_rows(y):
            if y.shape[1] != n_classes or not bool(
                ((y == 0) | (y == 1)).all() & (y.sum(1) == 1).all()
            ):
                raise DataError(
                    f"integer classification targets of shape (B, C) must be one-hot rows (one 1 "
                    f"per row, C={n_classes} columns); got {y.dtype} targets of shape "
                    f"{tuple(y.shape)}. Give class labels of shape (B,) or class probabilities "
                    f"(float, shape (B, {n_classes}))."
                )
            return
        low, high = int(y.min()), int(y.max())
        if low < 0 or high >= n_classes:
            bad = low if low < 0 else high
            raise LabelError(
                f"class label {bad} is outside [0, C) for the model's C={n_classes} outputs; "
                "labels must be integers 0, ..., C-1."
            )


class RewardModeling(Categorical):
    """Bradley–Terry reward model: fitted as classification on pairs, predicted as regression.

    Its loss, curvature and targets are ``Categorical``'s (the fit runs on
    ``fit_likelihood``, a plain one); its predictions are ``GaussianRegression``'s.
    """

    kind = Likelihood.REWARD_MODELING
    predicts_probabilities = False
    #: The structures laplace-torch supports for reward modelling, and EKFAC.
    hessian_structures = (HessianStructure.KRON, HessianStructure.DIAG, HessianStructure.EKFAC)
    pairwise = True
    position_targets = None

    def __init__(self) -> None:
        super().__init__()
        self.fit_likelihood = Categorical()
        self.predictive_likelihood = GaussianRegression()
