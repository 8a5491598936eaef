r"""Heteroscedastic Gaussian regression: the network predicts the mean and the log-variance.

The model outputs (B, 2C): the means ``μ`` in the first C columns and the log-variances
``s = log σ²`` in the last C, as users train with ``nn.GaussianNLLLoss``. The loss is the summed
Gaussian negative log-likelihood without its constant, ``½ Σ_c ((y_c − μ_c)² e^{−s_c} + s_c)``;
the curvature is the GGN with the Gaussian's Fisher information in ``(μ, s)``,

$$
\Lambda = \operatorname{diag}(e^{-s_1}, \dots, e^{-s_C}, \tfrac12, \dots, \tfrac12),
$$

which (unlike the Hessian of the loss) is positive definite and does not depend on the targets.
Under the linearised network the outputs are Gaussian, ``(μ, s) ~ N(m, V)``, and the predictive
of ``y`` has mean ``m_μ``, epistemic variance ``V_μμ`` and expected aleatoric variance
``E[e^{s}] = exp(m_s + ½ diag V_ss)`` (the lognormal mean).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, ClassVar, NamedTuple

import torch
from torch import Tensor
from typing_extensions import Unpack, override

from laplace.likelihoods.gaussian import check_real_targets, gaussian_evaluation
from laplace.likelihoods.likelihood_model import LikelihoodModel, ReducedLoss, SamplingOptions
from laplace.likelihoods.scoring import (
    Evaluation,
    EvaluationOptions,
    MetricFactory,
    MetricOptions,
    heteroscedastic_moments,
)
from laplace.utils.enums import FunctionalApproximation, HessianStructure, Likelihood, LinkApprox

if TYPE_CHECKING:
    from torchmetrics import Metric

__all__ = [
    "HeteroscedasticGaussian",
    "HeteroscedasticGaussianNLLLoss",
    "HeteroscedasticPrediction",
]


def _nll_loss(
    n_outputs: int, sigma_noise: float | Tensor, **kwargs: Unpack[MetricOptions]
) -> Metric:
    from laplace.likelihoods.running_scores import HeteroscedasticNLL

    return HeteroscedasticNLL(**kwargs)


def _crps_loss(
    n_outputs: int, sigma_noise: float | Tensor, **kwargs: Unpack[MetricOptions]
) -> Metric:
    from laplace.likelihoods.running_scores import HeteroscedasticCRPS

    return HeteroscedasticCRPS(**kwargs)


class HeteroscedasticPrediction(NamedTuple):
    """The predictive of heteroscedastic regression at B points with C outputs.

    Attributes:
        mean: Predictive mean of ``y``, shape (B, C).
        epistemic_variance: Variance of the mean from the posterior over weights: covariances
            (B, C, C), or variances (B, C) with ``diagonal_output=True`` or ``pred_type="nn"``.
        aleatoric_variance: Expected noise variance ``E[σ²(x)] = E[e^{s}]``, shape (B, C).
    """

    mean: Tensor
    epistemic_variance: Tensor
    aleatoric_variance: Tensor

    @property
    def variance(self) -> Tensor:
        """Total predictive variance of each output, ``epistemic + aleatoric``, shape (B, C)."""
        epistemic = self.epistemic_variance
        if epistemic.dim() == self.mean.dim() + 1:
            epistemic = epistemic.diagonal(dim1=-2, dim2=-1)
        return epistemic + self.aleatoric_variance


class HeteroscedasticGaussianNLLLoss(ReducedLoss):
    """``½ ((y − μ)² e^{−s} + s)`` per target entry for outputs ``f = [μ, s]`` of shape (B, 2C).

    Args:
        reduction: ``"mean"`` (over the B·C target entries, as ``nn.GaussianNLLLoss``),
            ``"sum"`` or ``"none"`` (shape (B, C)).
    """

    def forward(self, f: Tensor, y: Tensor) -> Tensor:
        """The loss of outputs (B, 2C) and targets (B, C)."""
        mu, s = split_outputs(f)
        return self.reduce(0.5 * ((y - mu).square() * torch.exp(-s) + s))


def split_outputs(f: Tensor) -> tuple[Tensor, Tensor]:
    """Means (..., C) and log-variances (..., C) of outputs (..., 2C)."""
    n_outputs = f.shape[-1] // 2
    return f[..., :n_outputs], f[..., n_outputs:]


class HeteroscedasticGaussian(LikelihoodModel[HeteroscedasticPrediction]):
    """Gaussian ``N(y; μ(x), e^{s(x)})`` with the network predicting ``[μ, s]`` (B, 2C).

    σ is predicted, so it is not a hyperparameter (``sigma_noise`` must be 1). The GLM
    predictive returns a ``HeteroscedasticPrediction``; ``predictive_samples`` draws
    ``y = μ + e^{s/2} ε`` from sampled outputs. Low-rank Laplace is not offered (its
    eigensolver works on the loss's own Hessian, which differs from the Fisher used here); of
    the function-space approximations, the subset-of-data GP.
    """

    kind = Likelihood.HETEROSCEDASTIC_REGRESSION
    torch_loss = HeteroscedasticGaussianNLLLoss
    predictions = "heteroscedastic predictions"
    default_validation_loss = "nll"
    validation_losses: ClassVar[dict[str, MetricFactory]] = {
        "nll": _nll_loss,
        "crps": _crps_loss,
    }
    loss_module_curvature = False
    #: Subset-of-data GP: its output curvature is diagonal, so the GP uses it exactly.
    function_space = (FunctionalApproximation.SOD,)
    hessian_structures = (
        HessianStructure.FULL,
        HessianStructure.DIAG,
        HessianStructure.KRON,
        HessianStructure.EKFAC,
        HessianStructure.GP,
    )

    @override
    def per_sample_loss(self, f: Tensor, y: Tensor) -> Tensor:
        y = self.prepare_targets(f, y)
        return HeteroscedasticGaussianNLLLoss("none")(f, y).flatten(1).sum(1)

    @override
    def loss_gradient(self, f: Tensor, y: Tensor) -> Tensor:
        y = self.prepare_targets(f, y)
        mu, s = split_outputs(f)
        precision = torch.exp(-s)
        residual = mu - y
        return torch.cat([residual * precision, 0.5 * (1 - residual.square() * precision)], -1)

    @override
    def output_hessian_sqrt(self, f: Tensor) -> Tensor:
        _, s = split_outputs(f)
        return torch.diag_embed(torch.cat([torch.exp(-0.5 * s), torch.full_like(s, 0.5**0.5)], -1))

    @override
    def sample_targets(self, f: Tensor, generator: torch.Generator | None = None) -> Tensor:
        return self.predictive_sample(f.detach(), generator)

    @override
    def log_likelihood(
        self, loss: Tensor, n_data: int, n_outputs: int, sigma_noise: Tensor, temperature: float
    ) -> Tensor:
        return -loss / temperature - 0.5 * n_data * (n_outputs // 2) * math.log(2 * math.pi)

    @override
    def prepare_targets(self, f: Tensor, y: Tensor) -> Tensor:
        self.check_row_targets(y, f.shape)
        if len(y) != len(f):
            raise ValueError(f"a batch of {len(y)} regression targets for {len(f)} model outputs.")
        return y

    @override
    def check_row_targets(self, y: Tensor, output_shape: Sequence[int]) -> None:
        if output_shape[-1] % 2:
            raise ValueError(
                "heteroscedastic regression needs model outputs (B, 2C): C means, then C "
                f"log-variances; the model has {output_shape[-1]} outputs."
            )
        target_shape = (*output_shape[:-1], output_shape[-1] // 2)
        check_real_targets(
            y, target_shape, "heteroscedastic regression", "the means of the model output"
        )

    @override
    def evaluation(self, options: EvaluationOptions) -> Evaluation:
        """Predictions ``(mean, epistemic, aleatoric)`` scored as one Gaussian.

        Its covariance is ``epistemic + diag(aleatoric)``, no ``sigma_noise`` added.
        """

        def moments(prediction: object) -> tuple[Tensor, Tensor]:
            if not (isinstance(prediction, tuple) and len(prediction) == 3):
                raise ValueError(
                    "heteroscedastic predictions must be (mean, epistemic_variance, "
                    f"aleatoric_variance); got {type(prediction).__name__}."
                )
            return heteroscedastic_moments(*prediction)

        return gaussian_evaluation(moments, options)

    @override
    def glm_predictive(
        self,
        f_mu: Tensor,
        f_var: Tensor,
        link_approx: LinkApprox,
        **sampling: Unpack[SamplingOptions],
    ) -> HeteroscedasticPrediction:
        """Mean, epistemic and expected aleatoric variance from ``N(f_mu, f_var)`` over [μ, s]."""
        m_mu, m_s = split_outputs(f_mu)
        n_outputs = m_mu.shape[-1]
        if f_var.dim() == f_mu.dim():
            epistemic, v_s = split_outputs(f_var)
        else:
            epistemic = f_var[..., :n_outputs, :n_outputs]
            v_s = f_var.diagonal(dim1=-2, dim2=-1)[..., n_outputs:]
        return HeteroscedasticPrediction(m_mu, epistemic, torch.exp(m_s + 0.5 * v_s))

    @override
    def sampled_predictive(self, f: Tensor) -> HeteroscedasticPrediction:
        mu, s = split_outputs(f)
        return HeteroscedasticPrediction(mu.mean(dim=0), mu.var(dim=0), torch.exp(s).mean(dim=0))

    @override
    def predictive_sample(self, f: Tensor, generator: torch.Generator | None = None) -> Tensor:
        """Draws ``y = μ + e^{s/2} ε`` (..., C), one per output sample ``f`` (..., 2C)."""
        mu, s = split_outputs(f)
        noise = torch.randn(mu.shape, dtype=f.dtype, device=f.device, generator=generator)
        return mu + torch.exp(0.5 * s) * noise
