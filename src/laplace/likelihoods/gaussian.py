"""Homoscedastic Gaussian regression, with one σ for all outputs or one σ per output."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, ClassVar

import torch
from torch import Tensor, nn
from typing_extensions import Unpack, override

from laplace.likelihoods.likelihood_model import LikelihoodModel
from laplace.likelihoods.scoring import (
    Evaluation,
    EvaluationOptions,
    MetricFactory,
    MetricOptions,
    gaussian_entropy,
    gaussian_predictive,
    targets_like,
)
from laplace.utils.diag_lowrank import DiagLowRankBatch
from laplace.utils.enums import Likelihood
from laplace.utils.errors import DataError
from laplace.utils.outputs import PositionTargets

if TYPE_CHECKING:
    from torchmetrics import Metric

__all__ = ["GaussianRegression", "check_real_targets", "gaussian_evaluation"]


def _nll_loss(
    n_outputs: int, sigma_noise: float | Tensor, **kwargs: Unpack[MetricOptions]
) -> Metric:
    from laplace.likelihoods.running_scores import GaussianNLL

    return GaussianNLL(sigma_noise, **kwargs)


def _crps_loss(
    n_outputs: int, sigma_noise: float | Tensor, **kwargs: Unpack[MetricOptions]
) -> Metric:
    from laplace.likelihoods.running_scores import GaussianCRPS

    return GaussianCRPS(sigma_noise, **kwargs)


class GaussianRegression(LikelihoodModel[tuple[Tensor, Tensor]]):
    r"""Gaussian ``N(y; f, diag(σ²))``; the stored loss and curvature are σ-free.

    ``σ`` is one number or one per output (shape (C,)). With one σ per output the library keeps
    the loss and the curvature of each output apart (``ℓ_c = ½ Σₙ (yₙ_c − fₙ_c)²``,
    ``H_c = Σₙ Jₙ_cᵀ Jₙ_c``), so that the posterior precision
    ``Σ_c H_c / (σ_c² T) + P₀`` and the log-likelihood

    $$
    \log p(\mathcal{D}) = -\sum_c \Big(\frac{\ell_c}{\sigma_c^2 T}
    + \frac{N}{2} \log(2\pi\sigma_c^2)\Big)
    $$

    stay differentiable in every ``σ_c``.
    """

    kind = Likelihood.REGRESSION
    has_noise_hyperparameter = True
    torch_loss = nn.MSELoss
    loss_scale = 0.5
    supports_joint = True
    position_targets = PositionTargets.VALUES
    validation_losses: ClassVar[dict[str, MetricFactory]] = {
        "nll": _nll_loss,
        "crps": _crps_loss,
    }

    @override
    def output_count(self, output_shape: Sequence[int], y: Tensor | None = None) -> int:
        """Every output is an observation: T·C per data point (the normaliser's count)."""
        return self.layout(output_shape, y).size

    @override
    def per_sample_loss(self, f: Tensor, y: Tensor) -> Tensor:
        y = self.prepare_targets(f, y)
        return 0.5 * (y - f).square().flatten(1).sum(1)

    @override
    def ggn(self, J: Tensor, f: Tensor) -> Tensor:
        return torch.einsum("bck,bcl->kl", J, J)

    @override
    def predictive_nll(
        self, f_mu: Tensor, f_var: Tensor, y: Tensor, sigma_noise: Tensor
    ) -> Tensor:
        """Gaussian NLL with the latent variances plus ``σ²``, summed over outputs and points."""
        y = self.prepare_targets(f_mu, y.to(f_mu.dtype))
        var = f_var.diagonal(dim1=-2, dim2=-1) + sigma_noise.square()
        return 0.5 * ((y - f_mu).square() / var + var.log() + math.log(2 * math.pi)).sum()

    @override
    def alpha_energy(
        self,
        y: Tensor,
        f: Tensor,
        cov: Tensor,
        alpha: float,
        noise_variance: Tensor | None,
        n_samples: int,
        generator: torch.Generator | None,
    ) -> Tensor:
        r"""The closed form with ``v = diag cov``, ``σ² = noise_variance`` (no draws).

        $$
        \ell_α = -\tfrac12 \log(2πσ^2) - \frac{(y - f)^2}{2(σ^2 + α v)}
            - \frac{1}{2α} \log\Big(1 + \frac{α v}{σ^2}\Big), \qquad
        \ell_0 = -\tfrac12 \log(2πσ^2) - \frac{(y - f)^2 + v}{2σ^2}.
        $$
        """
        y = self.prepare_targets(f, y)
        var = cov.diagonal(dim1=-2, dim2=-1)
        residual = (y - f).square()
        if alpha == 0:
            energy = (residual + var) / noise_variance
        else:
            energy = residual / (noise_variance + alpha * var)
            energy = energy + torch.log1p(alpha * var / noise_variance) / alpha
        return -0.5 * (energy + torch.log(2 * math.pi * noise_variance)).sum()

    @override
    def evaluation(self, options: EvaluationOptions) -> Evaluation:
        """Predictions ``(f_mu, f_var)`` scored as ``N(f_mu, f_var + σ²I)``."""

        def moments(prediction: object) -> tuple[Tensor, Tensor]:
            if not (isinstance(prediction, tuple) and len(prediction) == 2):
                raise ValueError(
                    "regression predictions must be a (mean, variance) pair; got "
                    f"{type(prediction).__name__}."
                )
            return gaussian_predictive(*prediction, options.sigma_noise)

        return gaussian_evaluation(moments, options)

    def loss_per_output(self, f: Tensor, y: Tensor) -> Tensor:
        """Summed loss of each output ``½ Σₙ (yₙ_c − fₙ_c)²``, shape (C,)."""
        y = self.prepare_targets(f, y)
        return 0.5 * (y - f).square().sum(0)

    @override
    def loss_gradient(self, f: Tensor, y: Tensor) -> Tensor:
        return f - self.prepare_targets(f, y)

    @override
    def output_hessian_sqrt(self, f: Tensor) -> Tensor:
        eye = torch.eye(f.shape[-1], dtype=f.dtype, device=f.device)
        return eye.expand(f.shape[0], -1, -1)

    @override
    def structured_output_hessian(self, f: Tensor) -> DiagLowRankBatch:
        """``Λₙ = I`` as a diagonal without low-rank part."""
        return DiagLowRankBatch(torch.ones_like(f), f.new_zeros(*f.shape, 0), 1)

    @override
    def sample_targets(self, f: Tensor, generator: torch.Generator | None = None) -> Tensor:
        noise = torch.randn(f.shape, dtype=f.dtype, device=f.device, generator=generator)
        return f + noise

    @override
    def log_likelihood(
        self, loss: Tensor, n_data: int, n_outputs: int, sigma_noise: Tensor, temperature: float
    ) -> Tensor:
        """Log-likelihood from the summed loss: one number, or one per output (C,).

        Raises:
            ValueError: For one σ per output with a loss summed over the outputs (the losses
                of the outputs cannot be told apart).
        """
        sigma2 = sigma_noise.square()
        loss = torch.as_tensor(loss, dtype=sigma2.dtype, device=sigma2.device)
        if sigma2.numel() == 1 and loss.numel() == 1:
            normaliser = 0.5 * n_data * n_outputs * torch.log(2 * math.pi * sigma2)
            return -loss / (sigma2 * temperature) - normaliser
        if loss.numel() != n_outputs:
            raise ValueError(
                f"sigma_noise has {sigma2.numel()} entries (one per output) but the loss was "
                "summed over the outputs; fit the approximation with this sigma_noise to keep "
                "the loss of each output."
            )
        sigma2 = sigma2.reshape(-1).expand(n_outputs)
        normaliser = 0.5 * n_data * torch.log(2 * math.pi * sigma2).sum()
        return -(loss.reshape(-1) / sigma2).sum() / temperature - normaliser

    @override
    def prepare_targets(self, f: Tensor, y: Tensor) -> Tensor:
        self.check_row_targets(y, f.shape)
        if y.shape != f.shape:
            raise ValueError(f"a batch of {len(y)} regression targets for {len(f)} model outputs.")
        return y

    @override
    def check_row_targets(self, y: Tensor, output_shape: Sequence[int]) -> None:
        check_real_targets(y, output_shape, "regression")

    @override
    def column_targets(self, y: Tensor, output_shape: Sequence[int]) -> Tensor:
        """Targets (B,) of one output (B, 1) as (B, 1); any other targets as given."""
        if y.dim() == 1 and tuple(output_shape[1:]) == (1,):
            return y.unsqueeze(-1)
        return y


def check_real_targets(
    y: Tensor, target_shape: Sequence[int], what: str, source: str = "the model output"
) -> None:
    """Refuse targets that are not real numbers of shape (B, ...) like ``target_shape``.

    Args:
        y: The targets.
        target_shape: The shape they must have (the batch size is not compared).
        what: The likelihood, for the message.
        source: Where ``target_shape`` comes from, for the message.

    Raises:
        DataError: For boolean or complex targets (a ``ValueError`` and a ``RuntimeError``).
        ValueError: For targets of another shape.
    """
    if y.dtype == torch.bool or y.is_complex():
        raise DataError(f"{what} targets must be real numbers, got {y.dtype} targets.")
    if y.dim() != len(target_shape) or tuple(y.shape[1:]) != tuple(target_shape[1:]):
        raise ValueError(
            f"{what} targets of shape {tuple(y.shape)} do not match {source} "
            f"of shape {tuple(target_shape)} (B = batch size): give targets of shape "
            f"(B, {', '.join(str(d) for d in target_shape[1:])}), e.g. y.reshape(len(y), -1) "
            "for one output; they are not reshaped silently."
        )


def gaussian_evaluation(
    moments: Callable[[object], tuple[Tensor, Tensor]], options: EvaluationOptions
) -> Evaluation:
    """Gaussian predictives against targets (regression and the likelihoods that predict like it).

    Result: ``nll`` (mean joint NLL per point), ``rmse`` (over points and outputs), ``crps``
    (mean per output), ``coverage`` (``{"0.9": fraction, ...}`` of targets inside each central
    interval), ``calibration_curve`` (PIT ``expected`` levels and ``observed`` fractions), ``n``.

    Args:
        moments: A prediction's predictive mean (B, C) and covariances (B, C, C) or variances.
        options: The evaluation's options (its ``sigma_noise`` is for ``moments`` to add).
    """
    levels, kwargs = options.levels, MetricOptions(sync_on_compute=options.sync)

    def read(prediction: object, target: Tensor) -> tuple[tuple[Tensor, Tensor], Tensor]:
        mean, cov = moments(prediction)
        return (mean, cov), targets_like(target, mean)

    def metrics(inputs: tuple[Tensor, ...]) -> dict[str, Metric]:
        from torchmetrics import MeanSquaredError

        from laplace.likelihoods.running_scores import GaussianCRPS, GaussianNLL, PITCalibration

        return {
            "nll": GaussianNLL(**kwargs),
            "rmse": MeanSquaredError(squared=False, **kwargs).set_dtype(torch.float64),
            "crps": GaussianCRPS(**kwargs),
            "pit": PITCalibration(levels, options.n_bins, **kwargs),
        }

    def rows(mean: Tensor, cov: Tensor, target: Tensor) -> tuple[Tensor, Tensor]:
        return mean.reshape(-1), target.reshape(-1)

    def summary(metrics: dict[str, Metric]) -> dict[str, object]:
        result = {name: metrics[name].compute() for name in ("nll", "rmse", "crps")}
        pit = metrics["pit"].compute()
        coverage = zip(levels, pit["coverage"], strict=True)
        result["coverage"] = {f"{level:g}": fraction for level, fraction in coverage}
        result["calibration_curve"] = {"expected": pit["expected"], "observed": pit["observed"]}
        return {**result, "n": int(metrics["nll"].count)}

    def entropy(prediction: object) -> Tensor:
        return gaussian_entropy(moments(prediction)[1])

    return Evaluation(read, metrics, summary, entropy, {"rmse": rows})
