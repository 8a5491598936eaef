"""Predictive links: from a Gaussian over outputs ``N(f_μ, Σ_f)`` to predictions.

Pure functions of ``(f_mu, f_var)``; the Laplace classes compute the moments and the likelihood
object picks the link: ``LINKS`` for the softmax of categorical classification,
``BERNOULLI_LINKS`` for the independent sigmoids of binary (multi-label) classification.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from functools import partial

import torch
from torch import Tensor

from laplace.utils.enums import LinkApprox

__all__ = [
    "BERNOULLI_LINKS",
    "LINKS",
    "draw_gaussian",
    "draws_from_root",
    "gaussian_output_samples",
    "laplace_bridge",
    "monte_carlo",
    "monte_carlo_sigmoid",
    "monte_carlo_softmax",
    "probit",
    "probit_logits",
    "probit_sigmoid",
]


def gaussian_output_samples(
    f_mu: Tensor, f_var: Tensor, n_samples: int, generator: torch.Generator | None = None
) -> Tensor:
    """Draws (S, B, C) of ``f ~ N(f_mu, f_var)`` per point, S = ``n_samples``.

    ``f_mu`` is (B, C), ``f_var`` covariances (B, C, C) or variances (B, C).
    """
    if f_var.dim() == f_mu.dim():
        z = _standard_normal(f_mu, n_samples, generator)
        return f_mu + z * f_var.clamp_min(0).sqrt()
    # A small jitter keeps the factorisation defined for rank-deficient output covariances.
    jitter = 1e-10 * torch.eye(f_var.shape[-1], device=f_var.device, dtype=f_var.dtype)
    scale, _ = torch.linalg.cholesky_ex(f_var + jitter)
    return draws_from_root(f_mu, scale, n_samples, generator)


def draw_gaussian(
    mean: Tensor, covariance: Tensor, n_samples: int, generator: torch.Generator | None
) -> Tensor:
    """Draw from ``N(mean, covariance)``, differentiably, also when the covariance is singular.

    Shapes: ``mean`` (B, C) and ``covariance`` (B, C, C) give draws (S, B, C); a joint mean
    (B·C,) and covariance (B·C, B·C) give (S, B·C).

    Raises:
        torch.linalg.LinAlgError: If the covariance has clearly negative eigenvalues.
        RuntimeError: If a covariance that requires grad cannot be factored with jitter.
    """
    root = _psd_root((covariance + covariance.transpose(-1, -2)) / 2)
    return draws_from_root(mean, root, n_samples, generator)


def _standard_normal(mean: Tensor, n_samples: int, generator: torch.Generator | None) -> Tensor:
    return torch.randn(
        (n_samples, *mean.shape), generator=generator, device=mean.device, dtype=mean.dtype
    )


def draws_from_root(
    mean: Tensor, root: Tensor, n_samples: int, generator: torch.Generator | None
) -> Tensor:
    """``mean + R z`` with ``z ~ N(0, I)``: (S, B, C) for means (B, C), (S, n) for (n,)."""
    z = _standard_normal(mean, n_samples, generator)
    if mean.dim() == 1:
        return mean + z @ root.T
    return mean + torch.einsum("bij,sbj->sbi", root, z)


def _psd_root(cov: Tensor) -> Tensor:
    """A root ``R`` with ``R Rᵀ = cov`` of a symmetric PSD matrix (batch), singular allowed."""
    root, info = torch.linalg.cholesky_ex(cov)
    if not bool((info != 0).any()):
        return root
    values, vectors = torch.linalg.eigh(cov.detach() if cov.requires_grad else cov)
    size = cov.shape[-1]
    tol = 10 * torch.finfo(cov.dtype).eps * size * values.abs().amax(-1, keepdim=True)
    if bool((values < -tol).any()):
        raise torch.linalg.LinAlgError("the covariance has negative eigenvalues: it is not PSD.")
    if not cov.requires_grad:
        return vectors * values.clamp_min(0).sqrt().unsqueeze(-2)
    # Differentiable: the smallest diagonal jitter that makes the Cholesky succeed.
    scale = cov.diagonal(dim1=-2, dim2=-1).detach().abs().amax(-1)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    shift = -values.amin(-1).clamp_max(0)
    eye = torch.eye(size, dtype=cov.dtype, device=cov.device)
    for multiplier in (1, 10, 100):
        jitter = shift + multiplier * torch.finfo(cov.dtype).eps * scale
        root, info = torch.linalg.cholesky_ex(cov + jitter[..., None, None] * eye)
        if not bool((info != 0).any()):
            return root
    raise RuntimeError("could not factor the differentiable covariance, even with jitter.")


def probit_logits(f_mu: Tensor, f_var: Tensor) -> Tensor:
    """Logits of the probit approximation, ``f_μ / √(1 + π/8 · diag Σ_f)``, shape (B, C)."""
    variances = f_var if f_var.dim() == 2 else f_var.diagonal(dim1=-2, dim2=-1)
    return (1 + math.pi / 8 * variances).rsqrt() * f_mu


def probit(f_mu: Tensor, f_var: Tensor, **_: object) -> Tensor:
    """Probit approximation: ``softmax(f_μ / √(1 + π/8 · diag Σ_f))``, shape (B, C)."""
    return torch.softmax(probit_logits(f_mu, f_var), dim=-1)


def laplace_bridge(f_mu: Tensor, f_var: Tensor, normalize: bool = False, **_: object) -> Tensor:
    """Laplace bridge: the mean of the Dirichlet matched to ``N(f_μ, Σ_f)``, shape (B, C).

    The logits are first conditioned on ``1ᵀf = 0`` (softmax is invariant to a shared shift):
    ``μ ← μ − Σ1 (1ᵀμ) / (1ᵀΣ1)`` and ``Σ ← Σ − Σ11ᵀΣ / (1ᵀΣ1)``. With ``normalize=True`` they
    are then rescaled by the mean variance (``link_approx="bridge_norm"``). Variances (B, C)
    stand for a diagonal ``Σ`` (no (B, C, C) tensor is formed).

    The Dirichlet needs a positive variance in every class after the conditioning. A
    rank-deficient ``Σ`` (a subnetwork of a few weights, a ReLU network with dead paths) can
    leave a class with none; such rows would give "probabilities" outside [0, 1], so they get
    the probit approximation instead, with a warning that counts them.
    """
    mean = f_mu
    if f_var.dim() == f_mu.dim():
        row_sums = column_sums = variances = f_var
    else:
        row_sums, column_sums = f_var.sum(-1), f_var.sum(-2)
        variances = f_var.diagonal(dim1=-2, dim2=-1)
    total = row_sums.sum(-1, keepdim=True)
    f_mu = f_mu - row_sums * f_mu.sum(-1, keepdim=True) / total
    var = variances - row_sums * column_sums / total
    n_classes = f_mu.shape[-1]
    if normalize:
        mean_var = var.mean(dim=-1, keepdim=True) / math.sqrt(n_classes / 2)
        f_mu = f_mu / mean_var.sqrt()
        var = var / mean_var
    sum_exp = torch.exp(-f_mu).sum(dim=-1, keepdim=True)
    alpha = (1 - 2 / n_classes + f_mu.exp() / n_classes**2 * sum_exp) / var
    # a class whose conditioned variance is zero up to round-off has no Dirichlet parameter
    floor = n_classes * torch.finfo(var.dtype).eps * variances.detach().abs().amax(-1, True)
    total_alpha = alpha.sum(dim=-1, keepdim=True)
    valid = ((var > floor) & (alpha > 0) & alpha.isfinite() & total_alpha.isfinite()).all(-1)
    if bool(valid.all()):
        return alpha / total_alpha
    warnings.warn(
        f"link_approx='bridge{'_norm' if normalize else ''}': {int((~valid).sum())} of "
        f"{len(valid)} points have no positive variance in some class after the bridge's "
        "conditioning (a rank-deficient predictive covariance, e.g. a small subnetwork or dead "
        "ReLU paths); they get the probit approximation instead.",
        stacklevel=2,
    )
    alpha = torch.where(valid.unsqueeze(-1), alpha, torch.ones_like(alpha))
    bridged = alpha / alpha.sum(dim=-1, keepdim=True)
    return torch.where(valid.unsqueeze(-1), bridged, probit(mean, f_var))


def monte_carlo(
    link: Callable[[Tensor], Tensor],
    f_mu: Tensor,
    f_var: Tensor,
    n_samples: int = 100,
    generator: torch.Generator | None = None,
    **_: object,
) -> Tensor:
    """Monte-Carlo average of ``link(f)`` over ``f ~ N(f_μ, Σ_f)``, shape (B, C)."""
    return link(gaussian_output_samples(f_mu, f_var, n_samples, generator)).mean(0)


#: ``E[softmax(f)]`` and ``E[sigmoid(f)]`` (per output) by ``monte_carlo``.
monte_carlo_softmax = partial(monte_carlo, partial(torch.softmax, dim=-1))
monte_carlo_sigmoid = partial(monte_carlo, torch.sigmoid)

LINKS: dict[LinkApprox, Callable[..., Tensor]] = {
    LinkApprox.PROBIT: probit,
    LinkApprox.BRIDGE: laplace_bridge,
    LinkApprox.BRIDGE_NORM: lambda f_mu, f_var, **kw: laplace_bridge(f_mu, f_var, True),
    LinkApprox.MC: monte_carlo_softmax,
}


def probit_sigmoid(f_mu: Tensor, f_var: Tensor, **_: object) -> Tensor:
    """Probit approximation (B, K) of ``E[sigmoid(f)]`` per output: ``σ(f_μ / √(1 + π v / 8))``."""
    return torch.sigmoid(probit_logits(f_mu, f_var))


BERNOULLI_LINKS: dict[LinkApprox, Callable[..., Tensor]] = {
    LinkApprox.PROBIT: probit_sigmoid,
    LinkApprox.MC: monte_carlo_sigmoid,
}
