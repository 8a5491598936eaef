r"""Low-rank posterior: ``P = U diag(h·λ) Uᵀ + diag(p₀)`` from the top-k curvature eigenpairs.

With ``D = diag(p₀)`` (``DiagLowRankPosterior``: plus the curvature's diagonal correction),
``W = D^{-1/2} U diag(h·λ)^{1/2}`` (P, k) and the k × k capacitance
``M = I + WᵀW = L Lᵀ``:

- ``log det P = Σ log p₀ + log det M`` (matrix determinant lemma);
- ``P⁻¹ = D^{-1/2} (I − W M⁻¹ Wᵀ) D^{-1/2} = D⁻¹ − Z Zᵀ`` (Woodbury) with the (P, k) basis
  ``Z = D^{-1/2} W L⁻ᵀ``, so ``J P⁻¹ Jᵀ = J D⁻¹ Jᵀ − (J Z)(J Z)ᵀ``: the diagonal posterior's
  functional variance minus k directions (``laplace.structures.kron_glm`` computes both from
  layer quantities, without Jacobians);
- samples ``D^{-1/2} (I + WWᵀ)^{-1/2} z`` with
  ``(I + WWᵀ)^{-1/2} = I + W Q diag(c) Qᵀ Wᵀ``, ``WᵀW = Q diag(s) Qᵀ`` and
  ``c = −1 / (√(1+s) (1 + √(1+s)))``.

Every operation costs O(P k²); nothing of size P × P is formed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import cached_property
from typing import TYPE_CHECKING, ClassVar, cast

import torch
from torch import Tensor
from typing_extensions import override

from laplace.curvature.engine.block_product import ParameterBlock, SampleVectors
from laplace.structures.diagonal import diag_functional_variance
from laplace.structures.jacobians import Jacobian, LayerTrace
from laplace.structures.posterior import (
    ClosedForm,
    Curvature,
    Posterior,
)

if TYPE_CHECKING:
    from laplace.curvature.curvature_backend import CurvatureBackend
    from laplace.utils.data import Inputs

__all__ = ["DiagLowRankPosterior", "LowRankPosterior", "lowrank_functional_variance"]


def lowrank_functional_variance(posterior: LowRankPosterior, J: LayerTrace) -> Tensor | None:
    """``J P⁻¹ Jᵀ`` (B, C, C) of ``P⁻¹ = D⁻¹ − Z Zᵀ`` from a recorded forward pass ``J.trace``.

    The diagonal case (``diag_functional_variance``) minus
    ``(J Z)(J Z)ᵀ``, ``J Z`` the products of every output's per-sample gradients with the k
    columns of ``Z`` (``SampleVectors``, per layer).

    ``D`` is the posterior's ``diagonal`` (P,), ``Z`` the ``woodbury_basis``
    (P, k); the result is differentiable w.r.t. the inputs where the trace asks for it.

    Returns:
        The covariances, or None when the diagonal route does not apply (the caller then
        falls back to Jacobians).
    """
    trace = J.trace
    f_var = diag_functional_variance(trace, posterior.diagonal, trace.create_graph)
    if f_var is None:
        return None
    B, C, _ = f_var.shape
    eye = torch.eye(C, dtype=f_var.dtype, device=f_var.device)
    columns = eye[:, None, :].expand(C, B, C).reshape(C, *trace.f.shape)
    basis = ParameterBlock(trace.engine, posterior.woodbury_basis)
    JZ = SampleVectors(trace, columns).project(basis)
    JZ = JZ.transpose(0, 1)  # (B, C, k)
    return f_var - JZ @ JZ.transpose(1, 2)


class LowRankPosterior(Posterior):
    """Gaussian posterior whose curvature is ``U diag(λ) Uᵀ``: ``H = (U (P, k), λ (k,))``."""

    closed_forms: ClassVar[dict[type[Jacobian], ClosedForm]] = {
        LayerTrace: lowrank_functional_variance
    }
    update_refusal = (
        "the top eigenpairs of a sum are not the sum of the top eigenpairs; fit again on all "
        "the data."
    )
    lighter = (
        "fewer eigenpairs (backend_kwargs={'n_eigenvalues': k}), hessian_structure='diag' or "
        "fewer weights"
    )
    #: (P,) vectors a fit keeps besides the eigenpairs (INF: the curvature's diagonal).
    fitted_diagonals: ClassVar[int] = 0

    @override
    @classmethod
    def fit_bytes(
        cls,
        params: Sequence[Tensor],
        solver: Mapping[str, object] | None = None,
        **options: object,
    ) -> int:
        """The eigenpairs ``U`` (P, k) and ``λ`` (k,) (and INF's diagonal (P,)).

        Args:
            params: See ``Posterior.fit_bytes``.
            solver: The eigensolver's options; ``n_eigenvalues`` is k (10 when not given).
            **options: Unused.
        """
        n_params = sum(p.numel() for p in params)
        rank = min(int(cast(int, (solver or {}).get("n_eigenvalues", 10))), n_params)
        numbers = n_params * rank + rank + cls.fitted_diagonals * n_params
        return numbers * params[0].element_size()

    @override
    def held_bytes(
        self, n_rows: int, n_outputs: int, kind: type[Jacobian], joint: bool = False
    ) -> int:
        """The fit, ``W`` and the Woodbury basis (P, k), the capacitance (k, k)."""
        U, itemsize = self.H[0], self.itemsize
        n_params, rank = U.shape
        fitted = n_params * rank + rank + self.fitted_diagonals * n_params
        return (fitted + 2 * n_params * rank + rank**2 + 2 * n_params) * itemsize

    @override
    @staticmethod
    def zeros(params: Sequence[Tensor]) -> tuple[Tensor, Tensor]:
        n_params = sum(p.numel() for p in params)
        return params[0].new_zeros(n_params, 0), params[0].new_zeros(0)

    @override
    @staticmethod
    def batch_curvature(
        backend: CurvatureBackend,
        X: Inputs,
        y: Tensor,
        n_data: int,
        total: Curvature | None = None,
    ) -> tuple[Tensor, Curvature]:
        raise NotImplementedError(
            "the low-rank curvature is not a sum over batches: its eigenpairs are computed "
            "over the whole training set at once (LowRankLaplace.fit)."
        )

    @override
    @staticmethod
    def is_finite(H: tuple[Tensor, Tensor]) -> bool:
        return bool(torch.isfinite(H[0]).all() and torch.isfinite(H[1]).all())

    @override
    @staticmethod
    def state(H: tuple[Tensor, Tensor]) -> dict[str, Tensor]:
        return {"eigenvectors": H[0].detach(), "eigenvalues": H[1].detach()}

    @override
    @classmethod
    def load_state(
        cls, state: object, zeros: tuple[Tensor, Tensor], **options: object
    ) -> tuple[Tensor, Tensor]:
        if not isinstance(state, dict) or set(state) != {"eigenvectors", "eigenvalues"}:
            raise ValueError("state_dict['H'] must hold 'eigenvectors' and 'eigenvalues'.")
        U, eigenvalues = state["eigenvectors"], state["eigenvalues"]
        n_params = zeros[0].shape[0]
        if U.dim() != 2 or U.shape[0] != n_params or eigenvalues.shape != U.shape[1:]:
            raise ValueError(
                f"state_dict['H'] has eigenvectors {tuple(U.shape)} and eigenvalues "
                f"{tuple(eigenvalues.shape)}, expected (n_params={n_params}, k) and (k,)."
            )
        like = zeros[1]
        return U.to(like.device, like.dtype), eigenvalues.to(like.device, like.dtype)

    @cached_property
    def diagonal(self) -> Tensor:
        """The diagonal ``D`` of ``P = U diag(h·λ) Uᵀ + D``: the prior precision, (P,)."""
        return self.prior_diag

    @cached_property
    def scaled_eigenvalues(self) -> Tensor:
        """``h·λ``, shape (k,)."""
        return self.h_factor * self.H[1]

    @cached_property
    def precision(self) -> tuple[tuple[Tensor, Tensor], Tensor]:
        """``((U, h·λ), D)``: ``P = U diag(h·λ) Uᵀ + diag(D)``."""
        return (self.H[0], self.scaled_eigenvalues), self.diagonal

    @cached_property
    def _inv_sqrt_prior(self) -> Tensor:
        return self.diagonal.rsqrt()

    @cached_property
    def W(self) -> Tensor:
        """``D^{-1/2} U diag(h·λ)^{1/2}``, shape (P, k)."""
        return self.H[0] * self.scaled_eigenvalues.sqrt() * self._inv_sqrt_prior[:, None]

    @cached_property
    def capacitance_cholesky(self) -> Tensor:
        """Lower Cholesky factor of ``M = I + WᵀW``, shape (k, k)."""
        W = self.W
        eye = torch.eye(W.shape[1], device=W.device, dtype=W.dtype)
        return torch.linalg.cholesky(eye + W.T @ W)

    @override
    @property
    def log_det(self) -> Tensor:
        L = self.capacitance_cholesky
        return self.diagonal.log().sum() + 2 * L.diagonal().log().sum()

    @override
    def square_form(self, delta: Tensor) -> Tensor:
        projected = self.H[0].T @ delta
        return (delta.square() * self.diagonal).sum() + (
            projected.square() * self.scaled_eigenvalues
        ).sum()

    @cached_property
    def woodbury_basis(self) -> Tensor:
        """``Z = D^{-1/2} W L⁻ᵀ`` with ``P⁻¹ = D⁻¹ − Z Zᵀ``, shape (P, k)."""
        scaled = self.W * self._inv_sqrt_prior[:, None]
        return torch.linalg.solve_triangular(self.capacitance_cholesky, scaled.T, upper=False).T

    @override
    def rows_variance(self, Js: Tensor) -> Tensor:
        JZ = Js @ self.woodbury_basis
        return (Js / self.diagonal) @ Js.transpose(1, 2) - JZ @ JZ.transpose(1, 2)

    @override
    def sample_deviations(self, n_samples: int, generator: torch.Generator | None) -> Tensor:
        z = self._standard_normal((len(self.prior_diag), n_samples), generator)
        return self._scale_times(z).T

    def _scale_times(self, z: Tensor) -> Tensor:
        """``S z = D^{-1/2} (I + WWᵀ)^{-1/2} z`` for ``z`` of shape (P, n); ``S Sᵀ = P⁻¹``."""
        s, Q = torch.linalg.eigh(self.W.T @ self.W)
        root = (1 + s.clamp(min=0)).sqrt()
        c = -1 / (root * (1 + root))
        WQ = self.W @ Q
        z = z + WQ @ (c[:, None] * (WQ.T @ z))
        return z * self._inv_sqrt_prior[:, None]

    @cached_property
    def scale(self) -> Tensor:
        """Dense (P, P) ``S`` with ``S Sᵀ = P⁻¹``; O(P²) memory, formed only when asked for."""
        P = len(self.prior_diag)
        return self._scale_times(torch.eye(P, device=self.W.device, dtype=self.W.dtype))


class DiagLowRankPosterior(LowRankPosterior):
    r"""Diagonal plus low rank (INF, Lee et al., 2020): top-k eigenpairs with an exact diagonal.

    ``H = (U (P, k), λ (k,), d (P,))`` with ``d`` the curvature's exact diagonal; the precision
    is ``P = U diag(h·λ) Uᵀ + D`` with ``D = h·max(d − diag(U diag(λ) Uᵀ), 0) + p₀``: its
    diagonal is the exact curvature's (where the correction is not clipped) and its top
    directions are kept. Everything else is ``LowRankPosterior``'s with this ``D``: the
    determinant lemma, Woodbury, samples. The eigenpairs and the diagonal are sums over the
    data found by the fit (``laplace.parametric.lowrank_laplace.DiagonallyCorrectedEigenpairs``),
    which merges an online fit's earlier curvature in.
    """

    update_refusal = None
    fitted_diagonals = 1

    @override
    @staticmethod
    def zeros(params: Sequence[Tensor]) -> tuple[Tensor, Tensor, Tensor]:
        U, eigenvalues = LowRankPosterior.zeros(params)
        return U, eigenvalues, U.new_zeros(len(U))

    @override
    @staticmethod
    def is_finite(H: tuple[Tensor, Tensor, Tensor]) -> bool:
        return all(bool(torch.isfinite(t).all()) for t in H)

    @cached_property
    def correction(self) -> Tensor:
        """``max(d − diag(U diag(λ) Uᵀ), 0)``, shape (P,)."""
        U, eigenvalues, diagonal = self.H
        return (diagonal - U.square() @ eigenvalues).clamp(min=0)

    @cached_property
    def diagonal(self) -> Tensor:
        """``D = h·correction + p₀``, shape (P,)."""
        return self.h_factor * self.correction + self.prior_diag

    @override
    @staticmethod
    def state(H: tuple[Tensor, Tensor, Tensor]) -> dict[str, Tensor]:
        return {**LowRankPosterior.state(H[:2]), "diagonal": H[2].detach()}

    @override
    @classmethod
    def load_state(
        cls, state: object, zeros: tuple[Tensor, Tensor, Tensor], **options: object
    ) -> tuple[Tensor, Tensor, Tensor]:
        if not isinstance(state, dict) or "diagonal" not in state:
            raise ValueError(
                "state_dict['H'] must hold 'eigenvectors', 'eigenvalues' and 'diagonal'."
            )
        pairs = {k: v for k, v in state.items() if k != "diagonal"}
        U, eigenvalues = LowRankPosterior.load_state(pairs, zeros[:2])
        diagonal = state["diagonal"]
        if diagonal.shape != zeros[2].shape:
            raise ValueError(
                f"state_dict['H'] has a diagonal of shape {tuple(diagonal.shape)}, expected "
                f"{tuple(zeros[2].shape)}."
            )
        return U, eigenvalues, diagonal.to(U.device, U.dtype)
