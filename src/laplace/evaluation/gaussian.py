r"""Running metrics of Gaussian predictives and their closed forms.

Gaussian predictives ``N(μ, Σ)`` per point, with ``Σ = Σ_f + σ²I`` (the functional covariance
of the Laplace predictive plus the observation noise), are scored by

* NLL: ``½ (C log 2π + log det Σ + (y − μ)ᵀ Σ⁻¹ (y − μ))``, averaged over points;
* CRPS per output, closed form with ``z = (y − μ)/s``:
  ``s (z (2Φ(z) − 1) + 2φ(z) − 1/√π)``, averaged over points and outputs;
* the probability integral transform ``u = Φ(z)`` per output: a calibrated predictive gives
  uniform ``u``, so the fraction of ``u ≤ p`` is ``p`` for every level ``p`` and the central
  interval of level ``α`` (``|z| ≤ Φ⁻¹((1 + α)/2)``) holds a fraction ``α`` of the targets.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from laplace.evaluation.metrics import SumMetric

__all__ = [
    "GaussianCRPS",
    "GaussianNLL",
    "HeteroscedasticCRPS",
    "HeteroscedasticNLL",
    "PITCalibration",
    "gaussian_crps",
    "gaussian_entropy",
    "gaussian_nll",
    "gaussian_predictive",
    "heteroscedastic_moments",
    "targets_like",
]

_LOG_2PI = math.log(2 * math.pi)


def gaussian_predictive(
    f_mu: Tensor, f_var: Tensor, sigma_noise: float | Tensor = 0.0
) -> tuple[Tensor, Tensor]:
    """Predictive moments ``(f_mu, f_var + σ²I)`` of the targets.

    Args:
        f_mu: Means (B, C) or (B,), or (B, d₁, …) of outputs with extra dimensions.
        f_var: Covariances (B, C, C) or variances (B, C) (or (B,) with a (B,) mean, or
            variances (B, d₁, …) of outputs with extra dimensions, evaluated as independent
            outputs (B, d₁·…)).
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
    """Negative log density of ``target`` under ``N(mean, cov)`` per point, shape (B,).

    Args:
        mean: Means (B, C).
        cov: Covariances (B, C, C) or variances (B, C).
        target: Targets (B, C).

    Returns:
        NLL per point; NaN where a covariance is not positive definite.
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


def gaussian_entropy(cov: Tensor) -> Tensor:
    """Differential entropy ``½ log det(2πe Σ)`` of covariances (B, C, C) or variances (B, C)."""
    if cov.dim() == 2:
        return 0.5 * (_LOG_2PI + 1 + cov.log()).sum(-1)
    return 0.5 * (cov.shape[-1] * (_LOG_2PI + 1) + torch.linalg.slogdet(cov)[1])


class _GaussianMetric(SumMetric):
    """A running metric of a Gaussian predictive ``(f_mu, f_var)`` with noise σ added."""

    def __init__(self, sigma_noise: float | Tensor = 0.0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.sigma_noise = torch.as_tensor(sigma_noise, dtype=torch.float64).detach().clone()

    def update(self, f_mu: Tensor, f_var: Tensor, target: Tensor) -> None:
        """Add a batch: means (B, C), covariances (B, C, C) or variances (B, C), targets."""
        mean, cov = gaussian_predictive(f_mu, f_var, self.sigma_noise)
        self._add(mean, cov, targets_like(target, mean))

    def _add(self, mean: Tensor, cov: Tensor, target: Tensor) -> None:
        raise NotImplementedError


class _GaussianMeanScore(_GaussianMetric):
    """The mean of a score over the entries it returns for each batch."""

    def __init__(self, sigma_noise: float | Tensor = 0.0, **kwargs: Any) -> None:
        super().__init__(sigma_noise, **kwargs)
        self._add_sum("total")
        self._add_sum("count")

    def _add(self, mean: Tensor, cov: Tensor, target: Tensor) -> None:
        scores = self._scores(mean, cov, target)
        self.total += scores.sum(dtype=torch.float64)
        self.count += scores.numel()

    def _scores(self, mean: Tensor, cov: Tensor, target: Tensor) -> Tensor:
        raise NotImplementedError

    def compute(self) -> Tensor:
        """The mean score (NaN before any update)."""
        return self.total / self.count


class GaussianNLL(_GaussianMeanScore):
    """Mean Gaussian NLL per point under ``N(f_mu, f_var + σ²I)``.

    Args:
        sigma_noise: Observation noise σ (0: ``f_var`` is already the predictive variance).
        **kwargs: Keyword arguments of :class:`torchmetrics.Metric`.
    """

    def _scores(self, mean: Tensor, cov: Tensor, target: Tensor) -> Tensor:
        return gaussian_nll(mean, cov, target)


class GaussianCRPS(_GaussianMeanScore):
    """Mean closed-form CRPS over points and outputs under ``N(f_mu, f_var + σ²I)``.

    Args:
        sigma_noise: Observation noise σ (0: ``f_var`` is already the predictive variance).
        **kwargs: Keyword arguments of :class:`torchmetrics.Metric`.
    """

    def _scores(self, mean: Tensor, cov: Tensor, target: Tensor) -> Tensor:
        return gaussian_crps(mean, _variances(cov).sqrt(), target)


def heteroscedastic_moments(
    mean: Tensor, epistemic_variance: Tensor, aleatoric_variance: Tensor
) -> tuple[Tensor, Tensor]:
    """Mean and covariance ``epistemic + diag(aleatoric)`` of heteroscedastic predictions.

    Returns variances (B, C) when the epistemic part is given as variances.
    """
    if epistemic_variance.dim() == mean.dim():
        return mean, epistemic_variance + aleatoric_variance
    return mean, epistemic_variance + torch.diag_embed(aleatoric_variance)


class _HeteroscedasticUpdate:
    """Metrics updated with heteroscedastic predictions ``(mean, epistemic, aleatoric)``."""

    def update(
        self, mean: Tensor, epistemic_variance: Tensor, aleatoric_variance: Tensor, target: Tensor
    ) -> None:
        """Add a batch: means (B, C), epistemic (co)variances, aleatoric variances (B, C)."""
        moments = heteroscedastic_moments(mean, epistemic_variance, aleatoric_variance)
        super().update(*moments, target)


class HeteroscedasticNLL(_HeteroscedasticUpdate, GaussianNLL):
    """:class:`GaussianNLL` of heteroscedastic predictions (their variance includes the noise)."""


class HeteroscedasticCRPS(_HeteroscedasticUpdate, GaussianCRPS):
    """:class:`GaussianCRPS` of heteroscedastic predictions (their variance includes the noise)."""


class PITCalibration(_GaussianMetric):
    """Calibration curve of the probability integral transform and interval coverage.

    Args:
        levels: Levels α in (0, 1) of the central intervals whose coverage is counted.
        n_bins: The curve is evaluated at the levels ``k / n_bins``, ``k = 0..n_bins``.
        sigma_noise: Observation noise σ (0: ``f_var`` is already the predictive variance).
        **kwargs: Keyword arguments of :class:`torchmetrics.Metric`.
    """

    def __init__(
        self,
        levels: Sequence[float] = (0.5, 0.9, 0.95),
        n_bins: int = 15,
        sigma_noise: float | Tensor = 0.0,
        **kwargs: Any,
    ) -> None:
        super().__init__(sigma_noise, **kwargs)
        self.levels = tuple(float(level) for level in levels)
        self.n_bins = n_bins
        self._add_sum("pit_count", n_bins)
        self._add_sum("covered", len(self.levels))
        self._add_sum("count")

    def _add(self, mean: Tensor, cov: Tensor, target: Tensor) -> None:
        z = ((target - mean) / _variances(cov).sqrt()).reshape(-1).to(torch.float64)
        pit = torch.special.ndtr(z)
        index = (pit * self.n_bins).long().clamp(0, self.n_bins - 1)
        self.pit_count += torch.bincount(index, minlength=self.n_bins).to(torch.float64)
        half_widths = torch.special.ndtri(
            (1 + torch.tensor(self.levels, dtype=torch.float64, device=z.device)) / 2
        )
        self.covered += (z.abs().unsqueeze(-1) <= half_widths).sum(0).to(torch.float64)
        self.count += z.numel()

    def compute(self) -> dict[str, Tensor]:
        """The PIT curve and the coverages.

        Returns:
            ``expected`` levels (K+1,), ``observed`` fractions of PIT ≤ level (K+1,) and
            ``coverage`` (one fraction per interval level).
        """
        observed = torch.cat([self.pit_count.new_zeros(1), self.pit_count.cumsum(0)])
        return {
            "expected": torch.linspace(
                0, 1, self.n_bins + 1, dtype=observed.dtype, device=observed.device
            ),
            "observed": observed / self.count,
            "coverage": self.covered / self.count,
        }
