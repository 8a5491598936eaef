r"""The training objective of VaLLA: a minibatch alpha-energy (or ELBO) plus the inducing KL.

For a minibatch ``b`` of size ``B`` out of ``N`` points, with the latent marginals
``q(f_n) = N(m_n, Σ_n)`` of the linearised network under ``q(θ)``, VaLLA minimises

.. math::
    \mathcal{L} = -\frac{N}{B\,T} \sum_{n \in b} \ell_α(y_n)
        + \mathrm{KL}\big(q(θ) \,\|\, p(θ)\big), \qquad
    \ell_α(y) = \begin{cases}
        \frac{1}{α} \log \mathbb{E}_{q(f)}\big[p(y \mid f)^α\big] & 0 < α \le 1, \\
        \mathbb{E}_{q(f)}\big[\log p(y \mid f)\big] & α = 0 \ (\text{the ELBO}).
    \end{cases}

Gaussian regression with noise ``σ²`` and ``v_n = Σ_n`` has the closed forms

.. math::
    \ell_α(y) = -\tfrac12 \log(2πσ^2) - \frac{(y - m)^2}{2(σ^2 + α v)}
        - \frac{1}{2α} \log\Big(1 + \frac{α v}{σ^2}\Big), \qquad
    \ell_0(y) = -\tfrac12 \log(2πσ^2) - \frac{(y - m)^2 + v}{2σ^2},

the second the limit ``α → 0`` of the first. Classification (and reward modelling, fitted as
classification on pairs) estimates ``ℓ_α`` with ``S = mc_softmax_samples`` draws
``f^{(s)} ~ N(m, Σ)`` from the VaLLA ``generator``:
``ℓ_α ≈ (1/α) log((1/S) Σ_s softmax(f^{(s)})_y^α)`` and ``ℓ_0 ≈ (1/S) Σ_s log softmax(f^{(s)})_y``.
With ``S = 0`` it uses the probit approximation ``log softmax(m / √(1 + π/8 · diag Σ))_y``
(which does not depend on ``α``; hence ``α ≠ 1`` needs ``S > 0``).

With ``A = Lᵀ J_Z / √δ`` (M, P) and the R factor of the QR decomposition of ``[Aᵀ; I]``
(so ``RᵀR = I + AAᵀ``), the KL of ``q(θ) = N(θ*, (δI + δAᵀA)⁻¹)`` from ``p(θ) = N(θ*, δ⁻¹I)`` is

.. math::
    \mathrm{KL} = \tfrac12 \log\det(I + AA^\top)
        - \tfrac12 \operatorname{tr}\big(AA^\top(I + AA^\top)^{-1}\big)
        = \sum_m \log|R_{mm}| - \tfrac12 \|R^{-\top} A\|_F^2 .

Internal module.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from laplace.data import Inputs
from laplace.utils.enums import Likelihood
from laplace.utils.functional_utils import (
    classification_targets,
    draw_gaussian,
    regression_targets,
)

if TYPE_CHECKING:
    from laplace.functional.valla import VaLLA

__all__ = ["check_alpha", "gaussian_alpha_energy", "negative_objective", "softmax_alpha_energy"]


def check_alpha(alpha: float, mc_softmax_samples: int, likelihood: Likelihood) -> None:
    """Validate ``alpha ∈ [0, 1]`` and ``mc_softmax_samples`` (a non-negative ``int``).

    Raises:
        ValueError: For values out of range, or ``alpha != 1`` without MC samples for
            classification and reward modelling.
    """
    if isinstance(alpha, bool) or not (isinstance(alpha, (int, float)) and 0 <= alpha <= 1):
        raise ValueError(f"alpha must be a number in [0, 1], got {alpha!r}.")
    if (
        not isinstance(mc_softmax_samples, int)
        or isinstance(mc_softmax_samples, bool)
        or mc_softmax_samples < 0
    ):
        raise ValueError(
            f"mc_softmax_samples must be a non-negative integer, got {mc_softmax_samples!r}."
        )
    if likelihood != Likelihood.REGRESSION and alpha != 1 and mc_softmax_samples == 0:
        raise ValueError(
            f"alpha={alpha} with likelihood={likelihood.value!r} needs mc_softmax_samples > 0: "
            "the probit approximation used otherwise does not depend on alpha."
        )


def gaussian_alpha_energy(
    y: Tensor, mean: Tensor, var: Tensor, noise_var: Tensor, alpha: float
) -> Tensor:
    """Summed ``ℓ_α(y)`` of Gaussian regression (``alpha = 0``: the expected log-likelihood)."""
    residual = (y - mean).square()
    if alpha == 0:
        energy = (residual + var) / noise_var
    else:
        energy = (
            residual / (noise_var + alpha * var) + torch.log1p(alpha * var / noise_var) / alpha
        )
    return -0.5 * (energy + torch.log(2 * math.pi * noise_var)).sum()


def softmax_alpha_energy(
    y: Tensor, mean: Tensor, cov: Tensor, alpha: float, n_samples: int, generator: torch.Generator
) -> Tensor:
    """Summed MC estimate of ``ℓ_α(y)`` for the softmax likelihood from ``n_samples`` draws."""
    draws = draw_gaussian(mean, cov, n_samples, generator)  # (S, B, C)
    index = y.view(1, -1, 1).expand(n_samples, -1, 1)
    log_p = draws.log_softmax(-1).gather(-1, index).squeeze(-1)  # (S, B)
    if alpha == 0:
        return log_p.mean(0).sum()
    return (torch.logsumexp(alpha * log_p, 0) - math.log(n_samples)).sum() / alpha


def negative_objective(la: VaLLA, X: Inputs, y: Tensor) -> Tensor:
    """``−(N/B) Σ_b ℓ_α(y_b)/T + KL`` on the minibatch ``(X, y)``.

    Differentiable in ``L``, the log prior precision, the log noise and the inducing inputs.
    """
    f, cov, A, R = la._moments(X, joint=False, differentiable=False)
    if la.likelihood == Likelihood.REGRESSION:
        y = regression_targets(y, f)
        var = cov.diagonal(dim1=-2, dim2=-1)
        log_lik = gaussian_alpha_energy(y, f, var, la.log_noise_variance.exp(), la.alpha)
    else:
        y = classification_targets(y)
        if la.mc_softmax_samples:
            log_lik = softmax_alpha_energy(
                y, f, cov, la.alpha, la.mc_softmax_samples, la.generator
            )
        else:
            var = cov.diagonal(dim1=-2, dim2=-1)
            logits = f / torch.sqrt(1 + math.pi / 8 * var)
            log_lik = -nn.functional.cross_entropy(logits, y, reduction="sum")
    solved = torch.linalg.solve_triangular(R.T, A, upper=False)
    kl = R.diagonal().abs().log().sum() - 0.5 * solved.square().sum()
    return -(la.n_data / len(y)) * log_lik / la.temperature + kl
