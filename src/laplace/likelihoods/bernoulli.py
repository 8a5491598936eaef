"""Binary and multi-label classification: an independent Bernoulli per output (sigmoid link)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, ClassVar

import torch
from torch import Tensor, nn
from torch.nn import functional as F
from typing_extensions import Unpack, override

from laplace.likelihoods.likelihood_model import ProbabilityPredictions
from laplace.likelihoods.scoring import (
    N_BINS,
    Evaluation,
    EvaluationOptions,
    MetricFactory,
    MetricOptions,
    bernoulli_entropy,
    probabilities,
)
from laplace.utils.diag_lowrank import DiagLowRankBatch
from laplace.utils.enums import Likelihood
from laplace.utils.errors import DataError, LabelError
from laplace.utils.outputs import PositionTargets
from laplace.utils.predictive import BERNOULLI_LINKS, probit_logits

if TYPE_CHECKING:
    from torchmetrics import Metric

__all__ = ["Bernoulli", "bernoulli_alpha_energy"]


def _nll_loss(
    n_outputs: int, sigma_noise: float | Tensor, **kwargs: Unpack[MetricOptions]
) -> Metric:
    from laplace.likelihoods.running_scores import BernoulliNLL

    return BernoulliNLL(n_outputs, **kwargs)


def _brier_loss(
    n_outputs: int, sigma_noise: float | Tensor, **kwargs: Unpack[MetricOptions]
) -> Metric:
    from laplace.likelihoods.running_scores import BernoulliBrier

    return BernoulliBrier(n_outputs, **kwargs)


def _ece_loss(
    n_outputs: int, sigma_noise: float | Tensor, **kwargs: Unpack[MetricOptions]
) -> Metric:
    from laplace.likelihoods.running_scores import PerLabelCalibrationError

    return PerLabelCalibrationError(n_outputs, N_BINS, "l1", **kwargs)


class Bernoulli(ProbabilityPredictions):
    r"""Independent Bernoulli labels ``yₖ ~ Bernoulli(σ(fₖ))`` for logits ``f`` of shape (B, K).

    K = 1 is binary classification, K > 1 multi-label classification. The loss is the summed
    binary cross-entropy ``Σₖ −yₖ log σ(fₖ) − (1 − yₖ) log(1 − σ(fₖ))`` (torch's
    ``BCEWithLogitsLoss``), its output Hessian ``Λ = diag(p(1 − p))`` with ``p = σ(f)`` (equal to
    the Fisher), and the predictive the probability that each label is 1, (B, K):
    ``link_approx="probit"`` gives ``σ(μ/√(1 + π v/8))`` per label, ``"mc"`` a Monte-Carlo
    average of ``σ(f)``. Targets have the outputs' shape (or (B,) for K = 1) and hold 0/1
    (integers, booleans or floats; floats in [0, 1] are soft labels). Every Hessian structure
    and function-space approximation applies (its output curvature is diagonal).
    """

    kind = Likelihood.BINARY_CLASSIFICATION
    default_validation_loss = "nll"
    validation_losses: ClassVar[dict[str, MetricFactory]] = {
        "nll": _nll_loss,
        "brier": _brier_loss,
        "ece": _ece_loss,
    }
    torch_loss = nn.BCEWithLogitsLoss
    link = staticmethod(torch.sigmoid)
    #: Independent labels: each probability needs only its own variance.
    output_variances = True
    link_approximations = BERNOULLI_LINKS
    predictions = "label probabilities"
    position_targets = PositionTargets.VALUES

    @override
    def predictive_nll(
        self, f_mu: Tensor, f_var: Tensor, y: Tensor, sigma_noise: Tensor
    ) -> Tensor:
        """Binary cross-entropy of the per-label probit, ``σ(μ/√(1 + π v/8))``, summed."""
        logits = probit_logits(f_mu, f_var)
        targets = self.prepare_targets(f_mu, y)
        return F.binary_cross_entropy_with_logits(logits, targets, reduction="sum")

    @override
    def draw_log_likelihood(self, y: Tensor, draws: Tensor) -> Tensor:
        """The log-likelihood of all labels of a point (of its joint draw)."""
        targets = self.prepare_targets(draws[0], y).expand_as(draws)
        return -F.binary_cross_entropy_with_logits(draws, targets, reduction="none").sum(-1)

    @override
    def evaluation(self, options: EvaluationOptions) -> Evaluation:
        """Label probabilities (B, K) against 0/1 targets (B, K), each label on its own.

        Result: under ``per_label`` each label's ``accuracy`` (threshold ½), ``nll``, ``brier``
        and torchmetrics' binary ``ece`` and ``mce`` over ``n_bins`` bins; their means over the
        labels under the same names; ``n`` (points).
        """
        n_bins, kwargs = options.n_bins, MetricOptions(sync_on_compute=options.sync)

        def read(prediction: object, target: Tensor) -> tuple[tuple[Tensor], Tensor]:
            probs = probabilities(prediction, "multi-label")
            if target.numel() != probs.numel():
                raise ValueError(
                    f"multi-label targets of shape {tuple(target.shape)} do not match the "
                    f"label probabilities of shape {tuple(probs.shape)}."
                )
            return (probs,), target.reshape(probs.shape).to(probs.device).long()

        def metrics(inputs: tuple[Tensor, ...]) -> dict[str, Metric]:
            from laplace.likelihoods.running_scores import (
                BernoulliAccuracy,
                BernoulliBrier,
                BernoulliNLL,
                PerLabelCalibrationError,
            )

            n_labels = inputs[0].shape[-1]
            return {
                "accuracy": BernoulliAccuracy(n_labels, **kwargs),  # torchmetrics' needs K > 1
                "nll": BernoulliNLL(n_labels, **kwargs),
                "brier": BernoulliBrier(n_labels, **kwargs),
                "ece": PerLabelCalibrationError(n_labels, n_bins, "l1", **kwargs),
                "mce": PerLabelCalibrationError(n_labels, n_bins, "max", **kwargs),
            }

        def summary(metrics: dict[str, Metric]) -> dict[str, object]:
            per_label = {name: metric.compute() for name, metric in metrics.items()}
            result: dict[str, object] = {name: value.mean() for name, value in per_label.items()}
            return {**result, "n": int(metrics["nll"].count), "per_label": per_label}

        def entropy(prediction: object) -> Tensor:
            return bernoulli_entropy(probabilities(prediction, "multi-label"))

        return Evaluation(read, metrics, summary, entropy)

    @override
    def inducing_outputs(self, y: Tensor) -> Tensor:
        """The labels in turn (point i takes label i mod K), so every label has inducing rows."""
        n_labels = y.shape[1] if y.dim() > 1 else 1
        return torch.arange(len(y), device=y.device) % n_labels

    @override
    def per_sample_loss(self, f: Tensor, y: Tensor) -> Tensor:
        y = self.prepare_targets(f, y)
        return F.binary_cross_entropy_with_logits(f, y, reduction="none").flatten(1).sum(1)

    @override
    def loss_gradient(self, f: Tensor, y: Tensor) -> Tensor:
        return torch.sigmoid(f) - self.prepare_targets(f, y)

    @override
    def output_hessian_sqrt(self, f: Tensor) -> Tensor:
        return torch.diag_embed(_bernoulli_variance(f).sqrt())

    @override
    def output_hessian(self, f: Tensor) -> Tensor:
        return torch.diag_embed(_bernoulli_variance(f))

    @override
    def structured_output_hessian(self, f: Tensor) -> DiagLowRankBatch:
        """``Λₙ = diag(p(1 − p))`` without low-rank part."""
        return DiagLowRankBatch(_bernoulli_variance(f), f.new_zeros(*f.shape, 0), 1)

    @override
    def sample_targets(self, f: Tensor, generator: torch.Generator | None = None) -> Tensor:
        return torch.bernoulli(torch.sigmoid(f.detach()), generator=generator)

    @override
    def prepare_targets(self, f: Tensor, y: Tensor) -> Tensor:
        self.check_row_targets(y, f.shape)
        return y.reshape(f.shape).to(f.dtype)

    @override
    def loss_targets(self, y: Tensor, dtype: torch.dtype) -> Tensor:
        return y.reshape(len(y), -1).to(dtype)

    @override
    def check_row_targets(self, y: Tensor, output_shape: Sequence[int]) -> None:
        n_labels = output_shape[-1]
        one_label = n_labels == 1 and y.dim() == 1
        if y.is_complex() or not (one_label or tuple(y.shape[1:]) == tuple(output_shape[1:])):
            raise DataError(
                f"binary classification targets must have the outputs' shape (B, {n_labels})"
                + (" or (B,)" if n_labels == 1 else "")
                + f" and hold 0/1 labels; got {y.dtype} targets of shape {tuple(y.shape)}."
            )
        if y.numel() == 0 or y.dtype == torch.bool:
            return
        low, high = float(y.min()), float(y.max())
        if y.dtype.is_floating_point and (low < 0 or high > 1):
            raise ValueError(
                f"binary classification targets must lie in [0, 1] (labels 0/1, or soft "
                f"labels); got values in [{low:g}, {high:g}]."
            )
        if not y.dtype.is_floating_point and (low < 0 or high > 1):
            raise LabelError(
                f"binary label {int(low if low < 0 else high)} is not 0 or 1; each of the "
                f"K={n_labels} outputs is an independent 0/1 label."
            )


def bernoulli_alpha_energy(
    y: Tensor, mean: Tensor, cov: Tensor, alpha: float, n_samples: int, generator: torch.Generator
) -> Tensor:
    """Summed Monte-Carlo ``ℓ_α(y)`` of independent sigmoid labels (B, K) from ``n_samples`` draws.

    The draws are of the joint ``N(mean, cov)``: for ``α > 0`` the labels' correlations enter.
    """
    return Bernoulli().alpha_energy(y, mean, cov, alpha, None, n_samples, generator)


def _bernoulli_variance(f: Tensor) -> Tensor:
    """``p (1 − p)`` with ``p = σ(f)``, as ``σ(f) σ(−f)`` (no cancellation for large |f|)."""
    return torch.sigmoid(f) * torch.sigmoid(-f)
