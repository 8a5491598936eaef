r"""One Kronecker precision block with a diagonal-plus-low-rank output factor.

The block ``γα·(G ⊗ A) + δ I`` (``G = diag(d) + s·U Uᵀ`` of size C, ``A = Q diag(a) Qᵀ`` of
size D, factor scales ``γ``, ``α``) is, in the input eigenbasis, one C × C matrix per input
eigenvalue ``aⱼ``,

.. math::
    P_j = \operatorname{diag}(e_j) + s \beta_j U U^\top,
    \qquad e_j = \gamma\alpha a_j d + \delta,\ \beta_j = \gamma\alpha a_j

(damped, ``(α aⱼ + √δ)(γ G + √δ I)``: ``eⱼ = (α aⱼ + √δ)(γ d + √δ)``,
``βⱼ = (α aⱼ + √δ) γ``). A bias block ``γ G + δ I`` is the case ``D = 1``, ``a = 1``,
``α = 1`` without damping. See :mod:`laplace.utils.structured_kron` for the formulas used.
"""

from __future__ import annotations

from functools import cached_property

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from laplace.utils.diag_lowrank import DiagLowRank

__all__ = ["StructuredBlock"]


class _PositiveDefiniteLogDet(torch.autograd.Function):
    """``log det`` of symmetric positive-definite matrices (m, k, k) by Cholesky, shape (m,).

    Its backward is ``M⁻¹`` from the same factor: torch's own Cholesky backward runs two
    batched triangular solves, far slower for many small matrices than the forward pass. A
    matrix that is not positive definite gives NaN.
    """

    @staticmethod
    def forward(ctx, M: Tensor) -> Tensor:
        L, info = torch.linalg.cholesky_ex(M)
        ctx.save_for_backward(L)
        value = 2 * L.diagonal(dim1=-2, dim2=-1).log().sum(-1)
        return torch.where(info == 0, value, torch.nan)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: Tensor) -> Tensor:
        (L,) = ctx.saved_tensors
        return grad[:, None, None] * torch.cholesky_inverse(L)


class StructuredBlock:
    """The precision of one block, computed per input eigenvalue (see the module docstring).

    Args:
        G: The output factor.
        Q: Eigenvectors of the input factor (D, D); None for a block of one factor.
        a: Eigenvalues of the input factor (D,); None for a block of one factor.
        scales: The scalars multiplying the factors, ``[γ]`` or ``[γ, α]``.
        delta: The scalar added to the block.
        damping: Mix ``δ`` into each factor instead of adding it to their product.
    """

    def __init__(
        self,
        G: DiagLowRank,
        Q: Tensor | None,
        a: Tensor | None,
        scales: list[Tensor],
        delta: Tensor,
        damping: bool,
    ) -> None:
        self.G, self.Q = G, Q
        if a is None:
            (gamma,) = scales
            self.E, self.beta = (gamma * G.diag + delta).unsqueeze(0), gamma.reshape(1)
        elif damping:
            gamma, alpha = scales
            root = delta.sqrt()
            c = alpha * a + root
            self.E, self.beta = c.unsqueeze(1) * (gamma * G.diag + root), c * gamma
        else:
            gamma, alpha = scales
            t = gamma * alpha * a
            self.E, self.beta = t.unsqueeze(1) * G.diag + delta, t

    @property
    def size(self) -> int:
        """Number of parameters of the block, C·D."""
        return self.E.numel()

    @cached_property
    def inner(self) -> tuple[Tensor, Tensor]:
        """``Kⱼ = Uᵀ diag(1/eⱼ) U`` and ``Mⱼ = I + s βⱼ Kⱼ``, shape (m, k, k) each."""
        K = self.G.weighted_grams(self.E.reciprocal())
        eye = torch.eye(self.G.rank, dtype=K.dtype, device=K.device)
        return K, eye + self.G.sign * self.beta[:, None, None] * K

    @cached_property
    def cholesky(self) -> Tensor:
        """Lower Cholesky factors of the ``Mⱼ`` (m, k, k)."""
        return torch.linalg.cholesky_ex(self.inner[1])[0]

    @cached_property
    def root_factors(self) -> tuple[Tensor, Tensor]:
        """``g(λ) = ((1 + sβλ)^{-½} − 1)/λ`` (m, k) and eigenvectors of ``Kⱼ = X diag(λ) Xᵀ``."""
        values, vectors = torch.linalg.eigh(self.inner[0])
        values = values.clamp_min(0)
        scaled = self.G.sign * self.beta.unsqueeze(1)
        change = torch.expm1(-0.5 * torch.log1p(scaled * values))
        tiny = torch.finfo(values.dtype).tiny
        return torch.where(values > 0, change / values.clamp_min(tiny), -scaled / 2), vectors

    @cached_property
    def inverse_diagonal(self) -> Tensor:
        """``diag(Pⱼ⁻¹)`` for every input eigenvalue j, shape (m, C)."""
        quadratic = self.G.quadratic_diagonals(torch.cholesky_inverse(self.cholesky))
        return self.E.reciprocal() - self.G.sign * self.beta[:, None] * quadratic / self.E.square()

    def logdet(self) -> Tensor:
        """``log det`` of the block: ``Σⱼ (Σ_c log e_jc + log det Mⱼ)``."""
        return self.E.log().sum() + _PositiveDefiniteLogDet.apply(self.inner[1]).sum()

    def rotate(self, flat: Tensor) -> Tensor:
        """The block's rows (R, C·D) in the input eigenbasis, (R, C, m)."""
        X = flat.reshape(flat.shape[0], len(self.G), -1)
        return X if self.Q is None else X @ self.Q

    def rotate_back(self, X: Tensor) -> Tensor:
        """Rows (R, C, m) in the input eigenbasis back to (R, C·D)."""
        return (X if self.Q is None else X @ self.Q.T).flatten(1)

    def apply(self, X: Tensor, exponent: float) -> Tensor:
        """``Pⱼ^exponent`` (a root ``Rⱼ`` for -½) on each column j of ``X`` (R, C, m).

        Raises:
            ValueError: For an exponent other than 1, -1 and -0.5.
        """
        E, U, s = self.E.T, self.G.U, self.G.sign
        if exponent == 1:
            T = torch.einsum("ck,rcm->rkm", U, X) * self.beta
            return X * E + s * torch.einsum("ck,rkm->rcm", U, T)
        if exponent == -1:
            X = X / E
            T = torch.einsum("ck,rcm->mkr", U, X)
            T = torch.cholesky_solve(T, self.cholesky).permute(2, 1, 0) * self.beta
            return X - s * torch.einsum("ck,rkm->rcm", U, T) / E
        if exponent == -0.5:
            X = X / E.sqrt()
            g, vectors = self.root_factors
            T = torch.einsum("ck,rcm->rmk", U, X)
            T = torch.einsum("mkl,rmk->rml", vectors, T) * g
            T = torch.einsum("mkl,rml->rkm", vectors, T)
            return X + torch.einsum("ck,rkm->rcm", U, T) / E
        raise ValueError(
            f"a block with a structured output factor supports exponent 1, -1 or -0.5, got "
            f"{exponent}."
        )

    def diagonal(self, exponent: float) -> Tensor:
        """Diagonal of the block's ``P^exponent`` (exponent 1 or -1), shape (C·D,).

        Raises:
            ValueError: For another exponent.
        """
        if exponent == -1:
            rotated = self.inverse_diagonal
        elif exponent == 1:
            row_norms = self.G.U.square().sum(1)
            rotated = self.E + self.G.sign * self.beta[:, None] * row_norms
        else:
            raise ValueError(
                f"the diagonal of a structured block supports exponent 1 or -1, got {exponent}."
            )
        return (rotated.T if self.Q is None else rotated.T @ self.Q.square().T).flatten()
