r"""The training objective of VaLLA: a minibatch alpha-energy (or ELBO) plus the inducing KL.

``−(N/(B T)) Σ_b ℓ_α(y_b) + KL(q ‖ p)`` with ``ℓ_α(y) = (1/α) log E_q[p(y | f)^α]``
(``α = 0``: ``E_q[log p(y | f)]``, the ELBO); the KL and the covariances use the float64 QR
factor of ``[Aᵀ; I]``, ``A = Lᵀ J_Z/√δ``, never the P×P matrix (see
``docs/function_space.md``). The likelihood of the fit gives ``Σ_b ℓ_α(y_b)``
(``LikelihoodModel.alpha_energy``); the functions take values, not the VaLLA object, and
``InducingPosterior`` is the variational posterior they define.

Internal module.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import cast

import torch
from torch import Tensor, nn

from laplace.likelihoods import LikelihoodModel
from laplace.utils.data import Inputs
from laplace.utils.enums import Likelihood

__all__ = [
    "InducingPosterior",
    "check_alpha",
    "inducing_covariance",
    "inducing_factor",
    "inducing_kl",
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
            f"alpha={alpha} with likelihood={cast(Likelihood, likelihood.kind).value!r} requires "
            "mc_softmax_samples "
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
        Q: The Q factor of ``inducing_factor``.
        log_delta: ``log δ``, shape (1,).
        joint: Keep the covariance between points.

    Returns:
        (B, C, C), or (B·C, B·C) with ``joint``, symmetrised, in the dtype of ``Js``.
    """
    B, C, P = Js.shape
    scale = log_delta.to(torch.float64).mul(0.5).exp()
    padded = nn.functional.pad(Js.to(torch.float64).reshape(B * C, P) / scale, (0, Q.shape[1]))
    roots = padded - (padded @ Q) @ Q.T
    roots = roots if joint else roots.reshape(B, C, -1)
    cov = roots @ roots.transpose(-1, -2)
    return ((cov + cov.transpose(-1, -2)) / 2).to(Js.dtype)


def inducing_kl(A: Tensor, R: Tensor) -> Tensor:
    """``KL(q ‖ p)`` from ``A`` and ``R`` of ``inducing_factor``."""
    solved = torch.linalg.solve_triangular(R.T, A, upper=False)
    return R.diagonal().abs().log().sum() - 0.5 * solved.square().sum()


class InducingPosterior:
    """VaLLA's variational posterior ``q(θ) = N(θ*, (δI + δAᵀA)⁻¹)``, ``A = Lᵀ J_Z/√δ``.

    A ``LatentPosterior``; the variational parameters are read at
    every call (the fit changes them in place), so everything stays differentiable in them.

    Args:
        jacobian_chunks: Inputs and whether to keep the graph → ``(Js (b, C, P), f (b, C))``
            over chunks of them.
        variational: The current inducing inputs (M, ...), the output used at each (M,), the
            lower triangular ``L`` (M, M) and ``log δ`` (1,).
    """

    def __init__(
        self,
        jacobian_chunks: Callable[[Inputs, bool], Iterable[tuple[Tensor, Tensor]]],
        variational: Callable[[], tuple[Inputs, Tensor, Tensor, Tensor]],
    ) -> None:
        self._jacobian_chunks, self._variational = jacobian_chunks, variational

    def factor(self) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """``A``, ``Q``, ``R`` of ``inducing_factor`` now, and ``log δ``."""
        Z, classes, L, log_delta = self._variational()
        JZ = torch.cat([J for J, _ in self._jacobian_chunks(Z, isinstance(Z, nn.Parameter))])
        return *inducing_factor(JZ[torch.arange(len(classes)), classes], L, log_delta), log_delta

    def objective_moments(
        self, X: Inputs, joint: bool = False, create_graph: bool = False
    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Latent means and covariances at ``X`` (not detached), and ``A``, ``R`` of the factor."""
        A, Q, R, log_delta = self.factor()
        Js, f = zip(*self._jacobian_chunks(X, create_graph))
        return torch.cat(f), inducing_covariance(torch.cat(Js), Q, log_delta, joint), A, R

    def moments(self, X: Inputs, joint: bool, create_graph: bool) -> tuple[Tensor, Tensor]:
        """Latent means and covariances at ``X``, detached unless ``create_graph``."""
        f, cov, _, _ = self.objective_moments(X, joint, create_graph)
        if not create_graph:
            f, cov = f.detach(), cov.detach()
        return (f.reshape(-1) if joint else f), cov

    def covariance(self, Js: Tensor, joint: bool) -> Tensor:
        """``J Σ_q Jᵀ`` of Jacobians (B, C, P), detached."""
        _, Q, _, log_delta = self.factor()
        return inducing_covariance(Js, Q, log_delta, joint).detach()
