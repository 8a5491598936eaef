"""Predictive links: from a Gaussian over outputs ``N(f_μ, Σ_f)`` to predictions.

Pure functions of ``(f_mu, f_var)``; the Laplace classes compute the moments and the likelihood
object picks the link: :data:`LINKS` for the softmax of categorical classification,
:data:`BERNOULLI_LINKS` for the independent sigmoids of binary (multi-label) classification.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial

import torch
from torch import Tensor

from laplace.utils.enums import LinkApprox

__all__ = [
    "BERNOULLI_LINKS",
    "LINKS",
    "gaussian_output_samples",
    "laplace_bridge",
    "monte_carlo_sigmoid",
    "monte_carlo_softmax",
    "probit",
    "probit_sigmoid",
]


def gaussian_output_samples(
    f_mu: Tensor, f_var: Tensor, n_samples: int, generator: torch.Generator | None = None
) -> Tensor:
    """Draw ``f ~ N(f_mu, f_var)`` per point.

    Args:
        f_mu: Means, shape (B, C).
        f_var: Covariances (B, C, C) or variances (B, C).
        n_samples: Number of draws S.
        generator: Random number generator.

    Returns:
        Samples, shape (S, B, C).
    """
    z = torch.randn(
        (n_samples, *f_mu.shape), generator=generator, device=f_mu.device, dtype=f_mu.dtype
    )
    if f_var.dim() == f_mu.dim():
        return f_mu + z * f_var.clamp_min(0).sqrt()
    # A small jitter keeps the factorisation defined for rank-deficient output covariances.
    jitter = 1e-10 * torch.eye(f_var.shape[-1], device=f_var.device, dtype=f_var.dtype)
    scale, _ = torch.linalg.cholesky_ex(f_var + jitter)
    return f_mu + torch.einsum("bij,sbj->sbi", scale, z)


def _variances(f_var: Tensor) -> Tensor:
    return f_var if f_var.dim() == 2 else f_var.diagonal(dim1=-2, dim2=-1)


def probit(f_mu: Tensor, f_var: Tensor, **_: object) -> Tensor:
    """Probit approximation: ``softmax(f_μ / √(1 + π/8 · diag Σ_f))``, shape (B, C)."""
    kappa = (1 + math.pi / 8 * _variances(f_var)).rsqrt()
    return torch.softmax(kappa * f_mu, dim=-1)


def laplace_bridge(f_mu: Tensor, f_var: Tensor, normalize: bool = False, **_: object) -> Tensor:
    """Laplace bridge: the mean of the Dirichlet matched to ``N(f_μ, Σ_f)``, shape (B, C).

    The logits are first conditioned on ``1ᵀf = 0`` (softmax is invariant to a shared shift):
    ``μ ← μ − Σ1 (1ᵀμ) / (1ᵀΣ1)`` and ``Σ ← Σ − Σ11ᵀΣ / (1ᵀΣ1)``. With ``normalize=True`` they
    are then rescaled by the mean variance (``link_approx="bridge_norm"``).
    """
    cov = torch.diag_embed(f_var) if f_var.dim() == f_mu.dim() else f_var
    row_sums = cov.sum(-1)
    total = row_sums.sum(-1, keepdim=True)
    f_mu = f_mu - row_sums * f_mu.sum(-1, keepdim=True) / total
    var = cov.diagonal(dim1=-2, dim2=-1) - row_sums * cov.sum(-2) / total
    n_classes = f_mu.shape[-1]
    if normalize:
        mean_var = var.mean(dim=-1, keepdim=True) / math.sqrt(n_classes / 2)
        f_mu = f_mu / mean_var.sqrt()
        var = var / mean_var
    sum_exp = torch.exp(-f_mu).sum(dim=-1, keepdim=True)
    alpha = (1 - 2 / n_classes + f_mu.exp() / n_classes**2 * sum_exp) / var
    return torch.nan_to_num(alpha / alpha.sum(dim=-1, keepdim=True), nan=1.0)


def monte_carlo_softmax(
    f_mu: Tensor,
    f_var: Tensor,
    n_samples: int = 100,
    generator: torch.Generator | None = None,
    **_: object,
) -> Tensor:
    """Monte-Carlo average of ``softmax(f)`` over ``f ~ N(f_μ, Σ_f)``, shape (B, C)."""
    return _monte_carlo_mean(partial(torch.softmax, dim=-1), f_mu, f_var, n_samples, generator)


LINKS: dict[LinkApprox, Callable[..., Tensor]] = {
    LinkApprox.PROBIT: probit,
    LinkApprox.BRIDGE: laplace_bridge,
    LinkApprox.BRIDGE_NORM: lambda f_mu, f_var, **kw: laplace_bridge(f_mu, f_var, True),
    LinkApprox.MC: monte_carlo_softmax,
}


def probit_sigmoid(f_mu: Tensor, f_var: Tensor, **_: object) -> Tensor:
    """Probit approximation of ``E[sigmoid(f)]`` per output: ``σ(f_μ / √(1 + π v / 8))``.

    Args:
        f_mu: Means (B, K).
        f_var: Covariances (B, K, K) or variances ``v`` (B, K); only the variances are used.

    Returns:
        Label probabilities, shape (B, K).
    """
    kappa = (1 + math.pi / 8 * _variances(f_var)).rsqrt()
    return torch.sigmoid(kappa * f_mu)


def monte_carlo_sigmoid(
    f_mu: Tensor,
    f_var: Tensor,
    n_samples: int = 100,
    generator: torch.Generator | None = None,
    **_: object,
) -> Tensor:
    """Monte-Carlo average of ``sigmoid(f)`` over ``f ~ N(f_μ, Σ_f)``, shape (B, K)."""
    return _monte_carlo_mean(torch.sigmoid, f_mu, f_var, n_samples, generator)


def _monte_carlo_mean(
    link: Callable[[Tensor], Tensor],
    f_mu: Tensor,
    f_var: Tensor,
    n_samples: int,
    generator: torch.Generator | None,
) -> Tensor:
    """``(1/S) Σₛ link(fₛ)`` over ``S = n_samples`` draws ``fₛ ~ N(f_μ, Σ_f)``."""
    return link(gaussian_output_samples(f_mu, f_var, n_samples, generator)).mean(dim=0)


BERNOULLI_LINKS: dict[LinkApprox, Callable[..., Tensor]] = {
    LinkApprox.PROBIT: probit_sigmoid,
    LinkApprox.MC: monte_carlo_sigmoid,
}
