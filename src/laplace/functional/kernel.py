r"""The subset-of-data GP: kernel ``K_MM = J_M J_Mᵀ``, output curvature, and its posterior.

Rows are ordered point-major (``m·C + c``). Jacobians are computed in chunks of points whose
(rows, C, P) block stays under :data:`JACOBIAN_CHUNK_BYTES`; the subset's Jacobians are cached
when they fit in :data:`CACHE_BYTES` and recomputed chunk by chunk otherwise, so neither fitting
nor predicting ever holds an unbounded Jacobian.
"""

from __future__ import annotations

from collections.abc import Iterator, MutableMapping
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from laplace.data import Inputs, batch_size_of, check_outputs
from laplace.errors import check_finite_result
from laplace.glm import jacobian_chunk_rows, slice_inputs
from laplace.posteriors import NotPositiveDefiniteError
from laplace.utils.enums import Likelihood

if TYPE_CHECKING:
    from laplace.functional.sod import FunctionalLaplace

__all__ = ["SubsetKernel"]

#: Bytes of subset Jacobians kept between calls.
CACHE_BYTES = 256 * 2**20
#: Noise added to the classification scatter term (as laplace-torch).
CLASSIFICATION_SCATTER_NOISE = 1e-5
#: Cap of ``1/Λ`` where the output curvature vanishes (as laplace-torch).
MAX_INVERSE_CURVATURE = 10.0


class SubsetKernel:
    """Kernel, output curvature and scatter terms of the data subset of a FunctionalLaplace.

    Attributes:
        X: The subset's inputs (M, ...).
        K: ``J_M J_Mᵀ`` (M·C, M·C), or (C, M, M) with independent outputs.
        Lambda: Diagonal of the output Hessians of the loss, (M, C).
        mu: Scatter vector: ``y − f − J(μ₀ − θ*)`` (regression) or ``J(θ* − μ₀)``, (M, C).
        loss: Summed loss of the subset.
    """

    def __init__(
        self,
        la: FunctionalLaplace,
        X: Inputs,
        K: Tensor,
        Lambda: Tensor,
        mu: Tensor,
        loss: Tensor,
        independent: bool,
    ) -> None:
        self.la, self.X, self.K, self.Lambda, self.mu, self.loss = la, X, K, Lambda, mu, loss
        self.independent = independent
        self.n_points, self.n_outputs = Lambda.shape
        self._cache: list[Tensor] | None = None
        self._factor_key: tuple | None = None
        self._factor: Tensor | None = None

    # ---------------------------------------------------------------------------- building
    @classmethod
    def build(cls, la: FunctionalLaplace, X: Inputs, y: Tensor, independent: bool) -> SubsetKernel:
        """Jacobians, outputs, curvature and scatter terms of the subset ``(X, y)``."""
        self = cls.__new__(cls)
        self.la, self.X, self.independent, self._cache = la, X, independent, None
        self.n_points = batch_size_of(X, la.dict_key_x)
        with torch.no_grad():
            f0 = check_outputs(la.model(slice_inputs(X, 0, 1, self.n_points)), 1)
        self.n_outputs = f0.shape[-1]
        la._likelihood_model.check_targets(y, f0.shape)  # before any Jacobian
        fs, Js = [], []
        for _, J, f in self._chunks():
            fs.append(f)
            Js.append(J)
        f = torch.cat(fs)
        nbytes = self.n_points * self.n_outputs * Js[0].shape[-1] * Js[0].element_size()
        self._cache = Js if nbytes <= CACHE_BYTES else None
        likelihood = la._likelihood_model
        y = likelihood.prepare_targets(f, y)
        self.loss = likelihood.loss(f, y)
        self.Lambda = likelihood.output_hessian(f).diagonal(dim1=-2, dim2=-1)
        shift = la.prior_mean - la.mean
        Jshift = torch.cat([J @ shift for _, J, _ in self._chunks(Js)])
        if la.likelihood == Likelihood.REGRESSION:
            self.mu = y - (f + Jshift)
        else:
            self.mu = -Jshift
        self.K = self._gram()
        for name in ("loss", "Lambda", "mu", "K"):
            check_finite_result(getattr(self, name), f"GP {name} of the training subset")
        self._factor_key, self._factor = None, None
        return self

    def _chunks(self, cached: list[Tensor] | None = None) -> Iterator[tuple[int, Tensor, Any]]:
        """``(start, Js, f)`` per chunk of the subset; ``f`` is None when served from cache."""
        cached = cached if cached is not None else self._cache
        step = self.test_chunk_rows()
        for i, start in enumerate(range(0, self.n_points, step)):
            if cached is not None:
                yield start, cached[i], None
            else:
                chunk = slice_inputs(self.X, start, start + step, self.n_points)
                Js, f = self.la._jacobians(chunk)
                yield start, Js, f

    def test_chunk_rows(self) -> int:
        """Points per Jacobian chunk under :data:`JACOBIAN_CHUNK_BYTES`."""
        return jacobian_chunk_rows(self.n_outputs, self.la.n_params, self.la._dtype)

    def _gram(self) -> Tensor:
        """``J_M J_Mᵀ`` from pairs of chunks (upper blocks mirrored)."""
        M, C = self.n_points, self.n_outputs
        shape = (C, M, M) if self.independent else (M * C, M * C)
        K = self.la.mean.new_zeros(shape)
        for i, Ji, _ in self._chunks():
            for j, Jj, _ in self._chunks():
                if j < i:
                    continue
                if self.independent:
                    block = torch.einsum("acp,bcp->cab", Ji, Jj)
                    K[:, i : i + len(Ji), j : j + len(Jj)] = block
                    K[:, j : j + len(Jj), i : i + len(Ji)] = block.transpose(1, 2)
                else:
                    block = Ji.flatten(0, 1) @ Jj.flatten(0, 1).T
                    K[i * C : (i + len(Ji)) * C, j * C : (j + len(Jj)) * C] = block
                    K[j * C : (j + len(Jj)) * C, i * C : (i + len(Ji)) * C] = block.T
        return K

    # --------------------------------------------------------------------------- posterior
    def _noise(self) -> Tensor:
        """``1/(h Λ)`` with vanishing curvature capped, shape (C, M) or (M·C,)."""
        inv = torch.nan_to_num(1 / (self.la._H_factor * self.Lambda), posinf=MAX_INVERSE_CURVATURE)
        return inv.T if self.independent else inv.reshape(-1)

    def factor(self) -> Tensor:
        """Lower Cholesky factor of ``sK + Λ⁻¹/h``, cached while the hyperparameters hold."""
        la = self.la
        s = la.gp_kernel_prior_variance
        key = (float(s), float(la.sigma_noise), la.temperature)
        differentiable = s.requires_grad or la.sigma_noise.requires_grad
        if differentiable or key != self._factor_key:
            factor, info = torch.linalg.cholesky_ex(s * self.K + torch.diag_embed(self._noise()))
            if bool((info != 0).any()):
                raise NotPositiveDefiniteError(
                    "the GP posterior matrix sK + Λ⁻¹ is not positive definite; increase the "
                    "prior precision or sigma_noise."
                )
            if differentiable:
                return factor
            self._factor_key, self._factor = key, factor
        return self._factor

    def moments(self, X: Inputs) -> tuple[Tensor, Tensor]:
        """Means (B, C) and covariances (B, C, C) at test inputs."""
        Js, f = self.la._jacobians(X, enable_backprop=self.la.enable_backprop)
        return f, self.variance_from_jacobians(Js, joint=False)

    def joint_moments(self, X: Inputs) -> tuple[Tensor, Tensor]:
        """Means (B·C,) and the joint covariance (B·C, B·C) at test inputs."""
        Js, f = self.la._jacobians(X, enable_backprop=self.la.enable_backprop)
        return f.reshape(-1), self.variance_from_jacobians(Js, joint=True)

    def variance_from_jacobians(self, Js: Tensor, joint: bool) -> Tensor:
        """``sK** − sK*M (sK_MM + Λ⁻¹/h)⁻¹ sK_M*`` from test Jacobians (B, C, P)."""
        s = self.la.gp_kernel_prior_variance
        L = self.factor()
        B, C, _ = Js.shape
        if self.independent:
            K_star_M = torch.cat(
                [torch.einsum("bcp,mcp->cbm", Js, Jm) for _, Jm, _ in self._chunks()], dim=2
            )  # (C, B, M)
            V = torch.linalg.solve_triangular(L, s * K_star_M.transpose(1, 2), upper=False)
            if joint:
                cov = s * torch.einsum("acp,bcp->cab", Js, Js) - V.transpose(1, 2) @ V
                out = Js.new_zeros(B, C, B, C)
                idx = torch.arange(C, device=Js.device)
                out[:, idx, :, idx] = cov
                return out.reshape(B * C, B * C)
            var = s * Js.square().sum(-1) - V.square().sum(1).T  # (B, C)
            return torch.diag_embed(var)
        K_star_M = torch.cat(
            [torch.einsum("bcp,mdp->bcmd", Js, Jm).flatten(2) for _, Jm, _ in self._chunks()],
            dim=2,
        )  # (B, C, M·C)
        V = torch.linalg.solve_triangular(L, s * K_star_M.reshape(B * C, -1).T, upper=False)
        if joint:
            flat = Js.reshape(B * C, -1)
            return s * flat @ flat.T - V.T @ V
        V = V.T.reshape(B, C, -1)
        return s * Js @ Js.transpose(1, 2) - V @ V.transpose(1, 2)

    # --------------------------------------------------------------------- marginal lik.
    def _eye(self) -> Tensor:
        n = self.K.shape[-1]
        return torch.eye(n, device=self.K.device, dtype=self.K.dtype)

    def log_det_ratio(self) -> Tensor:
        """``log det(sK + σ²I)`` (regression) or ``log det(I + W sK W)``, ``W = √(hΛ)``."""
        la = self.la
        sK = la.gp_kernel_prior_variance * self.K
        if la.likelihood == Likelihood.REGRESSION:
            return torch.logdet(sK + la.sigma_noise.square() * self._eye()).sum()
        W = (la._H_factor * self.Lambda).sqrt()
        W = W.T if self.independent else W.reshape(-1)
        return torch.logdet(W.unsqueeze(-1) * sK * W.unsqueeze(-2) + self._eye()).sum()

    def scatter(self) -> Tensor:
        """``μᵀ (sK + νI)⁻¹ μ``, ``ν = σ²`` (regression) or a small jitter (classification)."""
        la = self.la
        if la.likelihood == Likelihood.REGRESSION:
            noise = la.sigma_noise.square()
        else:
            noise = torch.tensor(CLASSIFICATION_SCATTER_NOISE, dtype=self.K.dtype)
        A = la.gp_kernel_prior_variance * self.K + noise * self._eye()
        L = torch.linalg.cholesky(A)
        mu = self.mu.T.unsqueeze(-1) if self.independent else self.mu.reshape(-1, 1)
        return torch.linalg.solve_triangular(L, mu, upper=False).square().sum()

    # -------------------------------------------------------------------------------- state
    def state(self) -> dict[str, Any]:
        """Tensors of the fit (the subset's inputs included)."""
        return {
            "X_subset": self.X,
            "K_MM": self.K,
            "Lambda": self.Lambda,
            "mu": self.mu,
            "loss": self.loss.detach(),
        }

    @classmethod
    def from_state(cls, la: FunctionalLaplace, state: dict[str, Any]) -> SubsetKernel:
        """Rebuild from :meth:`state` on the device and dtype of ``la``."""

        def move(t: Any) -> Any:
            if isinstance(t, Tensor):
                return t.to(la._device, la._dtype) if t.is_floating_point() else t.to(la._device)
            return t

        X = state["X_subset"]
        X = {k: move(v) for k, v in X.items()} if isinstance(X, MutableMapping) else move(X)
        return cls(
            la,
            X,
            move(state["K_MM"]),
            move(state["Lambda"]),
            move(state["mu"]),
            move(state["loss"]),
            la.independent_outputs,
        )
