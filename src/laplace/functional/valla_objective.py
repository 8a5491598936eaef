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

The likelihood of the fit gives ``Σ_b ℓ_α(y_b)`` (``LikelihoodModel.alpha_energy``): Gaussian
regression in closed form, classification (reward modelling is fitted as classification on
pairs) and binary labels by ``S = mc_softmax_samples`` draws ``f^{(s)} ~ N(m, Σ)`` from the
VaLLA ``generator``, or with ``S = 0`` by the probit approximation, which does not depend on
``α`` (hence ``α ≠ 1`` needs ``S > 0``).

With ``A = Lᵀ J_Z / √δ`` (M, P) and the R factor of the QR decomposition of ``[Aᵀ; I]``
(so ``RᵀR = I + AAᵀ``), the KL of ``q(θ) = N(θ*, (δI + δAᵀA)⁻¹)`` from ``p(θ) = N(θ*, δ⁻¹I)`` is

.. math::
    \mathrm{KL} = \tfrac12 \log\det(I + AA^\top)
        - \tfrac12 \operatorname{tr}\big(AA^\top(I + AA^\top)^{-1}\big)
        = \sum_m \log|R_{mm}| - \tfrac12 \|R^{-\top} A\|_F^2 .

The functions take values, not the VaLLA object, and :class:`InducingPosteriorMixin` is the
variational posterior they define (its parameters, covariances and predictive).

Internal module.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from laplace.base import BaseLaplace
from laplace.data import Inputs
from laplace.likelihoods import LikelihoodModel
from laplace.priors import as_scalar_prior_precision

__all__ = [
    "InducingPosteriorMixin",
    "check_alpha",
    "inducing_covariance",
    "inducing_factor",
    "negative_objective",
]


def check_alpha(alpha: float, mc_softmax_samples: int, likelihood: LikelihoodModel) -> None:
    """Validate ``alpha ∈ [0, 1]`` and ``mc_softmax_samples`` (a non-negative ``int``).

    Raises:
        ValueError: For values out of range, or ``alpha != 1`` without MC samples for a
            likelihood fitted on class probabilities (classification, reward modelling).
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
    probabilities = likelihood.fit_likelihood.predicts_probabilities
    if probabilities and alpha != 1 and mc_softmax_samples == 0:
        raise ValueError(
            f"alpha={alpha} with likelihood={likelihood.kind.value!r} needs mc_softmax_samples "
            "> 0: the probit approximation used otherwise does not depend on alpha."
        )


def inducing_factor(JZ: Tensor, L: Tensor, log_delta: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``A = Lᵀ J_Z/√δ`` (M, P) and the reduced QR factors ``Q, R`` of ``[Aᵀ; I]`` (float64).

    Args:
        JZ: Jacobian rows of the inducing inputs (M, P).
        L: Lower triangular (M, M).
        log_delta: ``log δ``, shape (1,).
    """
    scale = log_delta.to(torch.float64).mul(0.5).exp()
    A = L.to(torch.float64).T @ JZ.to(torch.float64) / scale
    eye = torch.eye(A.shape[0], dtype=torch.float64, device=A.device)
    Q, R = torch.linalg.qr(torch.cat([A.T, eye]), mode="reduced")
    return A, Q, R


def inducing_covariance(Js: Tensor, Q: Tensor, log_delta: Tensor, joint: bool) -> Tensor:
    """``J (δI + δAᵀA)⁻¹ Jᵀ`` as ``‖(I − QQᵀ)[J/√δ, 0]‖²``, never the P×P matrix.

    Args:
        Js: Jacobians (B, C, P).
        Q: The Q factor of :func:`inducing_factor`.
        log_delta: ``log δ``, shape (1,).
        joint: Keep the covariance between points.

    Returns:
        (B, C, C), or (B·C, B·C) with ``joint``, symmetrised, in the dtype of ``Js``.
    """
    B, C, P = Js.shape
    scale = log_delta.to(torch.float64).mul(0.5).exp()
    padded = nn.functional.pad(Js.to(torch.float64).reshape(B * C, P) / scale, (0, Q.shape[1]))
    roots = padded - (padded @ Q) @ Q.T
    if joint:
        cov = roots @ roots.T
    else:
        roots = roots.reshape(B, C, -1)
        cov = roots @ roots.transpose(1, 2)
    return ((cov + cov.transpose(-1, -2)) / 2).to(Js.dtype)


def negative_objective(
    likelihood: LikelihoodModel,
    y: Tensor,
    moments: tuple[Tensor, Tensor, Tensor, Tensor],
    n_data: int,
    temperature: float,
    alpha: float,
    noise_variance: Tensor | None = None,
    n_samples: int = 0,
    generator: torch.Generator | None = None,
) -> Tensor:
    """``−(N/B) Σ_b ℓ_α(y_b)/T + KL`` on a minibatch.

    Args:
        likelihood: The likelihood of the fit (it gives its energy, ``alpha_energy``).
        y: Targets of the minibatch.
        moments: Latent means (B, C) and covariances (B, C, C) of the minibatch, and ``A`` and
            ``R`` of :func:`inducing_factor`.
        n_data: Number N of training points.
        temperature: Likelihood temperature T.
        alpha: ``α`` of the energy.
        noise_variance: ``σ²`` of a likelihood with observation noise.
        n_samples: MC draws of a softmax energy (0: the probit approximation).
        generator: Random number generator of the draws.

    Returns:
        The objective, differentiable in whatever the moments and the noise depend on.
    """
    f, cov, A, R = moments
    log_lik, batch = likelihood.alpha_energy(
        y, f, cov, alpha, noise_variance, n_samples, generator
    )
    solved = torch.linalg.solve_triangular(R.T, A, upper=False)
    kl = R.diagonal().abs().log().sum() - 0.5 * solved.square().sum()
    return -(n_data / batch) * log_lik / temperature + kl


class InducingPosteriorMixin:
    """VaLLA's variational posterior ``q(θ) = N(θ*, (δI + δAᵀA)⁻¹)`` and its predictive.

    The variational parameters are ``nn.Parameter`` attributes: ``L`` (the M(M+1)/2 entries of a
    lower triangular matrix), ``log_prior_precision`` (``log δ``) and, for likelihoods with
    observation noise, ``log_noise_variance`` (``log σ²``); the class provides the inducing
    inputs (``inducing_locations``, ``inducing_classes``, ``num_inducing``) and Jacobians.
    """

    @property
    def prior_precision(self) -> Tensor:
        """Scalar prior precision ``δ = exp(log_prior_precision)``, shape (1,)."""
        return self.log_prior_precision.detach().exp()

    @prior_precision.setter
    def prior_precision(self, value: float | Tensor) -> None:
        log = as_scalar_prior_precision(value, type(self).__name__, self._device, self._dtype)
        self.log_prior_precision = nn.Parameter(log.log().detach().clone())

    @property
    def sigma_noise(self) -> Tensor:
        """Observation noise σ (learnt for regression), shape (1,)."""
        if self.log_noise_variance is None:
            return self._sigma_noise
        return (0.5 * self.log_noise_variance.detach()).exp()

    @sigma_noise.setter
    def sigma_noise(self, value: float | Tensor) -> None:
        BaseLaplace.sigma_noise.fset(self, value)
        if self._likelihood_model.has_noise_hyperparameter:
            self.log_noise_variance = nn.Parameter(2 * self._sigma_noise.detach().log().clone())

    def _init_factor(self) -> None:
        rows, cols = torch.tril_indices(self.num_inducing, self.num_inducing)
        self.L = nn.Parameter((rows == cols).to(self._dtype).to(self._device))

    def _factor_matrix(self) -> Tensor:
        M = self.num_inducing
        rows, cols = torch.tril_indices(M, M, device=self._device)
        return torch.zeros(M, M, dtype=self._dtype, device=self._device).index_put(
            (rows, cols), self.L
        )

    def _inducing_factor(self) -> tuple[Tensor, Tensor, Tensor]:
        """``A`` and the QR factors of :func:`inducing_factor` at the current inducing points."""
        trainable = isinstance(self.inducing_locations, nn.Parameter)
        JZ = torch.cat([J for J, _ in self._jacobian_chunks(self.inducing_locations, trainable)])
        JZ = JZ[torch.arange(self.num_inducing), self.inducing_classes].to(torch.float64)
        return inducing_factor(JZ, self._factor_matrix(), self.log_prior_precision)

    def _moments(self, X: Inputs, joint: bool, differentiable: bool) -> tuple[Tensor, ...]:
        """Latent means and covariances at ``X``, and ``A``, ``R`` of the inducing factor."""
        A, Q, R = self._inducing_factor()
        Js, f = zip(*self._jacobian_chunks(X, differentiable))
        Js, f = torch.cat(Js), torch.cat(f)
        return f, inducing_covariance(Js, Q, self.log_prior_precision, joint), A, R

    def _latent_moments(self, X: Inputs, joint: bool) -> tuple[Tensor, Tensor]:
        f, cov, _, _ = self._moments(X, joint, self.enable_backprop)
        if not self.enable_backprop:
            f, cov = f.detach(), cov.detach()
        return (f.reshape(-1) if joint else f), cov

    def _jacobian_covariance(self, Js: Tensor, joint: bool) -> Tensor:
        Q = self._inducing_factor()[1]
        return inducing_covariance(Js, Q, self.log_prior_precision, joint).detach()
