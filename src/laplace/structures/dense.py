"""Dense posterior: ``P = h·H + diag(p₀)`` stored as a full (P, P) matrix."""

from __future__ import annotations

from collections.abc import Sequence
from functools import cached_property
from typing import ClassVar

import torch
from torch import Tensor
from typing_extensions import override

from laplace.structures import large_output
from laplace.structures.jacobians import HeadFeatures, Jacobian
from laplace.structures.posterior import (
    ClosedForm,
    NotPositiveDefiniteError,
    Posterior,
)
from laplace.utils.diag_lowrank import DiagLowRankBatch
from laplace.utils.errors import check_fits_in_memory
from laplace.utils.linalg import invsqrt_precision

__all__ = ["DensePosterior", "full_head_curvature", "full_head_variance"]

#: Rows of the low-rank part of a head curvature formed at once (numbers).
_ROW_BUDGET = 2**22


def full_head_curvature(
    phi: Tensor, M: Tensor | DiagLowRankBatch, bias: bool, n_data: int, factor: float
) -> Tensor:
    """Dense ``Σₙ Jₙᵀ Mₙ Jₙ`` of a linear head, shape (P, P).

    Dense ``M``: one weighted Gram matrix ``Φᵀ diag(M_{:,c,c'}) Φ`` per class pair ``c ≤ c'``
    (pairs whose weights are all zero, e.g. off-diagonal pairs for regression, are skipped).
    ``Mₙ = diag(dₙ) + s·Vₙ Vₙᵀ``: the blocks ``Σₙ d_nc φₙφₙᵀ`` on the class diagonal plus the
    Gram matrix of the rows ``Jₙᵀ vₙₖ = [vₙₖ ⊗ φₙ, vₙₖ]``.

    Args:
        phi: Features, shape (N, D).
        M: Output-space curvatures, (N, C, C) or diagonal plus low rank.
        bias: Whether the head has a bias.
        n_data: Unused (the signature of ``HeadCurvature``).
        factor: Unused, as ``n_data``.
    """
    D, C = phi.shape[1], M.diag.shape[1] if isinstance(M, DiagLowRankBatch) else M.shape[-1]
    n_w = C * D
    size = n_w + (C if bias else 0)
    H = phi.new_zeros(size, size)
    if isinstance(M, DiagLowRankBatch):
        classes = torch.arange(C, device=phi.device)
        H[:n_w, :n_w].view(C, D, C, D)[classes, :, classes, :] = torch.einsum(
            "nc,nd,ne->cde", M.diag, phi, phi
        )
        if bias:
            cross = M.diag.T @ phi
            H[:n_w, n_w:].view(C, D, C)[classes, :, classes] = cross
            H[n_w:, :n_w].view(C, C, D)[classes, classes, :] = cross
            H[n_w + classes, n_w + classes] = M.diag.sum(0)
        chunk = max(1, _ROW_BUDGET // max(1, M.columns.shape[2] * size))
        for start in range(0, len(phi), chunk):
            V, p = M.columns[start : start + chunk], phi[start : start + chunk]
            rows = torch.einsum("nck,nd->nkcd", V, p).reshape(-1, n_w)
            if bias:
                rows = torch.cat([rows, V.transpose(1, 2).reshape(-1, C)], dim=1)
            H.addmm_(rows.T, rows, alpha=M.sign)
        return H
    H_W = H[:n_w, :n_w].view(C, D, C, D)
    active = (M.abs().amax(0) > 0).tolist()
    for c in range(C):
        for k in range(c, C):
            if not active[c][k]:
                continue
            block = (phi * M[:, c, k, None]).T @ phi
            H_W[c, :, k, :] = block
            if k != c:
                H_W[k, :, c, :] = block.T
    if bias:
        cross = torch.einsum("nck,nd->cdk", M, phi).reshape(n_w, C)
        H[:n_w, n_w:] = cross
        H[n_w:, :n_w] = cross.T
        H[n_w:, n_w:] = M.sum(0)
    return H


def full_head_variance(posterior: DensePosterior, J: HeadFeatures) -> Tensor:
    """``Jₙ Σ Jₙᵀ`` from the posterior covariance ``Σ`` (P, P): features (B, D) → (B, C, C).

    Above the large-output threshold only the variances (B, C).
    """
    covariance, phi, bias = posterior.covariance, J.phi, J.bias
    D, C = phi.shape[1], J.n_out
    n_w = C * D
    if large_output.is_large_output(C):
        class_blocks = covariance[:n_w, :n_w].reshape(C, D, C, D).diagonal(dim1=0, dim2=2)
        f_var = torch.einsum("nd,dec,ne->nc", phi, class_blocks, phi)
        if bias:
            cross = covariance[:n_w, n_w:].reshape(C, D, C).diagonal(dim1=0, dim2=2)
            f_var = f_var + 2 * phi @ cross + covariance[n_w:, n_w:].diagonal()
        return f_var
    left = torch.einsum("nd,cdke->ncke", phi, covariance[:n_w, :n_w].reshape(C, D, C, D))
    f_var = torch.einsum("ncke,ne->nck", left, phi)
    if bias:
        cross = phi @ covariance[:n_w, n_w:].reshape(C, D, C).permute(1, 0, 2).reshape(D, C * C)
        cross = cross.reshape(-1, C, C)
        f_var = f_var + cross + cross.transpose(1, 2) + covariance[n_w:, n_w:]
    return f_var


class DensePosterior(Posterior):
    """Full-covariance Gaussian posterior, factorised once by a Cholesky decomposition.

    ``log det P``, ``J P⁻¹ Jᵀ`` and samples all reuse the lower Cholesky factor ``L`` of
    ``P = L Lᵀ``; the covariance ``P⁻¹`` and its scale are built only when asked for (the
    functional variance of a linear head's features uses the covariance).
    """

    backend_route = "full"
    closed_forms: ClassVar[dict[type[Jacobian], ClosedForm]] = {HeadFeatures: full_head_variance}
    head_curvature = staticmethod(full_head_curvature)
    lighter = (
        "hessian_structure='kron' or 'diag', fewer weights (subset_of_weights='last_layer' or "
        "a subnetwork)"
    )

    @override
    @classmethod
    def fit_bytes(cls, params: Sequence[Tensor], **options: object) -> int:
        """The summed curvature (P, P) and its Cholesky factor (P, P)."""
        n_params = sum(p.numel() for p in params)
        return 2 * n_params**2 * params[0].element_size()

    @override
    def held_bytes(
        self, n_rows: int, n_outputs: int, kind: type[Jacobian], joint: bool = False
    ) -> int:
        """The curvature and its Cholesky factor, a head's covariance (P, P)."""
        n_params, itemsize = len(self.prior_diag), self.itemsize
        matrices = 3 if kind is HeadFeatures and not joint else 2
        return matrices * n_params**2 * itemsize

    @override
    @staticmethod
    def zeros(params: Sequence[Tensor]) -> Tensor:
        """Zero (P, P) curvature.

        Raises:
            TooLargeError: (a ``ValueError`` and a ``RuntimeError``) where it cannot fit in the
                memory of the device, naming the size and the structures that fit.
        """
        n_params, dtype = sum(p.numel() for p in params), params[0].dtype
        check_fits_in_memory(
            n_params**2 * (torch.finfo(dtype).bits // 8),
            params[0].device,
            f"a dense (P, P) curvature of P={n_params:,} parameters in {dtype}",
            "use hessian_structure='kron' or 'diag' (or fewer parameters).",
        )
        return params[0].new_zeros(n_params, n_params)

    @cached_property
    def precision(self) -> Tensor:
        """(P, P) posterior precision."""
        return self.h_factor * self.H + torch.diag(self.prior_diag)

    @cached_property
    def cholesky(self) -> Tensor:
        """(P, P) lower Cholesky factor of the precision."""
        factor, info = torch.linalg.cholesky_ex(self.precision)
        if int(info) != 0:
            raise NotPositiveDefiniteError(
                f"the posterior precision is not positive definite in {factor.dtype} (Cholesky "
                f"failed at column {int(info)}); increase the prior precision, use a float64 "
                "model, or check the curvature for errors."
            )
        return factor

    @cached_property
    def covariance(self) -> Tensor:
        """(P, P) posterior covariance ``P⁻¹``."""
        return torch.cholesky_inverse(self.cholesky)

    @cached_property
    def scale(self) -> Tensor:
        """(P, P) lower-triangular ``S`` with ``S Sᵀ = P⁻¹`` (without forming ``P⁻¹``)."""
        return invsqrt_precision(self.precision)

    @override
    @property
    def log_det(self) -> Tensor:
        return 2 * self.cholesky.diagonal().log().sum()

    @override
    def square_form(self, delta: Tensor) -> Tensor:
        return delta @ self.precision @ delta

    @override
    def rows_variance(self, Js: Tensor) -> Tensor:
        # W = L⁻¹ Jᵀ, so that J P⁻¹ Jᵀ = Wᵀ W.
        B, C, _ = Js.shape
        flat = Js.reshape(-1, Js.shape[-1]).T
        W = torch.linalg.solve_triangular(self.cholesky, flat, upper=False).T.reshape(B, C, -1)
        return W @ W.transpose(1, 2)

    @override
    def sample_deviations(self, n_samples: int, generator: torch.Generator | None) -> Tensor:
        z = self._standard_normal((len(self.prior_diag), n_samples), generator)
        # P = L Lᵀ ⇒ θ − θ_MAP = L⁻ᵀ z has covariance P⁻¹.
        return torch.linalg.solve_triangular(self.cholesky.T, z, upper=True).T
