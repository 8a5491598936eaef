r"""Kronecker factors whose output factor is diagonal plus low rank (many outputs).

A weight block ``G ⊗ A`` with ``G = diag(d) + s·U Uᵀ`` (C × C, a
:class:`~laplace.utils.diag_lowrank.DiagLowRank`, never dense) and a dense input
factor ``A = Q_A diag(a) Q_Aᵀ`` (D × D): rotating the weight matrix ``W`` (C × D) to
``W̃ = W Q_A`` makes the posterior precision ``h·(G ⊗ A) + δ I`` block-diagonal over the input
eigenvalues, one C × C block per ``aⱼ``,

.. math::
    P_j = h a_j G + \delta I = \operatorname{diag}(e_j) + s \beta_j U U^\top,
    \qquad e_j = h a_j d + \delta,\ \beta_j = h a_j

(with ``damping=True``: ``P_j = (√h aⱼ + √δ)(√h G + √δ I)``, again of that form). With the
k × k matrices ``Kⱼ = Uᵀ diag(1/eⱼ) U`` and ``Mⱼ = I + s βⱼ Kⱼ`` (positive definite whenever
``Pⱼ`` is), every posterior quantity is exact and costs O(D·C·k²) at most:

- ``log det P = Σⱼ (Σ_c log e_jc + log det Mⱼ)`` (matrix determinant lemma per ``aⱼ``);
- ``Pⱼ⁻¹ = Eⱼ⁻¹ − s βⱼ Eⱼ⁻¹ U Mⱼ⁻¹ Uᵀ Eⱼ⁻¹`` (Woodbury), its diagonal from ``Mⱼ⁻¹``;
- a square root ``Rⱼ = Eⱼ^{-½} (I + s βⱼ Vⱼ Vⱼᵀ)^{-½}``, ``Vⱼ = Eⱼ^{-½} U``, with
  ``Rⱼ Rⱼᵀ = Pⱼ⁻¹``, from the eigen-decomposition of ``Kⱼ = VⱼᵀVⱼ`` (for sampling; it is not the
  symmetric root).

A bias block is ``γ G + δ I``, the case of one input eigenvalue 1. Blocks whose factors are all
dense are handled exactly as :class:`~laplace.utils.matrix.KronDecomposed` does.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor

from laplace.errors import is_real_scalar
from laplace.utils.diag_lowrank import DiagLowRank
from laplace.utils.matrix import Kron, KronDecomposed
from laplace.utils.structured_block import StructuredBlock

__all__ = ["StructuredKron", "StructuredKronDecomposed"]


def _dense(F: Tensor | DiagLowRank) -> Tensor:
    return F.to_dense() if isinstance(F, DiagLowRank) else F


class StructuredKron(Kron):
    """A :class:`~laplace.utils.matrix.Kron` some of whose output factors are ``DiagLowRank``.

    Sums, scaling, ``bmm``, ``logdet`` and ``diag`` work as for ``Kron`` (the structured factor
    supports them); :meth:`decompose` keeps the structured factors and eigen-decomposes only
    the others.
    """

    def decompose(self, damping: bool = False, deferred: bool = False) -> StructuredKronDecomposed:
        """Eigen-decompose the dense factors; keep the structured ones.

        Args:
            damping: See :class:`~laplace.utils.matrix.KronDecomposed`.
            deferred: Accepted for the signature of :meth:`Kron.decompose`; the factors are
                decomposed at once (the same result, only when the work happens differs).
        """
        blocks: list[_Structured | tuple[list[Tensor], list[Tensor]]] = []
        for F in self.kfacs:
            if isinstance(F[0], DiagLowRank):
                eigen = Kron([F[1:]]).decompose() if len(F) == 2 else None
                blocks.append(
                    _Structured(
                        F[0],
                        None if eigen is None else eigen.eigenvectors[0][0],
                        None if eigen is None else eigen.eigenvalues[0][0],
                    )
                )
            else:
                eigen = Kron([F]).decompose()
                blocks.append((eigen.eigenvectors[0], eigen.eigenvalues[0]))
        decomposed = StructuredKronDecomposed(blocks, damping=damping)
        decomposed.factors = self
        return decomposed

    def to_matrix(self) -> Tensor:
        """Dense (P, P) matrix; for tests and small models only."""
        return Kron([[_dense(F) for F in block] for block in self.kfacs]).to_matrix()


class _Structured(NamedTuple):
    """A block ``G ⊗ A`` (or ``G`` alone: ``Q`` and ``a`` None) with a structured ``G``."""

    G: DiagLowRank
    Q: Tensor | None
    a: Tensor | None


class StructuredKronDecomposed(KronDecomposed):
    """Block-diagonal Kronecker posterior precision with structured output factors.

    The interface of :class:`~laplace.utils.matrix.KronDecomposed` (``+`` deltas, ``*`` a
    scalar, ``logdet``, ``bmm``, ``inv_square_form``, ``diag``, ``to_matrix``), computed as the
    module docstring describes. ``bmm(W, exponent=-0.5)`` applies a square root ``R`` with
    ``R Rᵀ = P⁻¹`` (not the symmetric one) to structured blocks; exponents other than 1, -1
    and -0.5 are refused for them.

    Args:
        blocks: Per block a structured block, or ``(eigenvectors, eigenvalues)`` of a dense one.
        deltas: See :class:`~laplace.utils.matrix.KronDecomposed`.
        damping: See :class:`~laplace.utils.matrix.KronDecomposed`.
        scales: Per block the scalars multiplying its factors (all 1 by default).

    Attributes:
        factors: The ``StructuredKron`` this is the decomposition of; None for one derived from
            it by ``+`` or ``*``.
    """

    def __init__(
        self,
        blocks: list,
        deltas: Tensor | None = None,
        damping: bool = False,
        scales: list[list[Tensor]] | None = None,
    ) -> None:
        self.factors = None
        self.blocks, self.damping = blocks, damping
        reference = next(b.G.diag if isinstance(b, _Structured) else b[1][0] for b in blocks)
        self._init_deltas(len(blocks), reference, deltas)
        one = torch.ones((), dtype=reference.dtype, device=reference.device)
        self.scales = scales or [[one] * self._n_factors(b) for b in blocks]
        self._cache: dict[int, StructuredBlock | KronDecomposed] = {}

    @staticmethod
    def _n_factors(block) -> int:
        return (1 if block.a is None else 2) if isinstance(block, _Structured) else len(block[0])

    # ---------------------------------------------------------------------- construction
    @property
    def eigenvectors(self) -> list[list[Tensor]]:
        """Not available: a structured factor is not eigen-decomposed.

        Raises:
            ValueError: Always.
        """
        raise ValueError(
            "a Kronecker precision with a structured (diagonal-plus-low-rank) output factor has "
            "no eigendecomposition (eigenvectors, eigenvalues); use its logdet, bmm, "
            "inv_square_form and diag."
        )

    eigenvalues = eigenvectors

    def block_sizes(self) -> list[int]:
        """Number of parameters of each block."""
        sizes = []
        for b in self.blocks:
            if isinstance(b, _Structured):
                sizes.append(len(b.G) * (1 if b.a is None else len(b.a)))
            else:
                sizes.append(math.prod(len(values) for values in b[1]))
        return sizes

    def __add__(self, deltas: Tensor) -> StructuredKronDecomposed:
        """Add a scalar or one scalar per block to the blocks."""
        self._check_deltas(deltas)
        return StructuredKronDecomposed(
            self.blocks, self.deltas + deltas.reshape(-1), self.damping, self.scales
        )

    def __mul__(self, scalar: float | Tensor) -> StructuredKronDecomposed:
        """Scale every block by ``scalar`` (each of its ``k`` factors by ``scalar^(1/k)``)."""
        if not is_real_scalar(scalar):
            raise ValueError("KronDecomposed can only be multiplied by a scalar.")
        scalar = torch.as_tensor(scalar, dtype=self.deltas.dtype, device=self.deltas.device)
        scalar = scalar.reshape(())
        scales = [[s * scalar ** (1 / len(ss)) for s in ss] for ss in self.scales]
        return StructuredKronDecomposed(self.blocks, self.deltas, self.damping, scales)

    __radd__ = __add__
    __rmul__ = __mul__

    def detach(self) -> StructuredKronDecomposed:
        """Detach the deltas and scales in place (the factors are never part of a graph)."""
        self.deltas = self.deltas.detach()
        self.scales = [[s.detach() for s in ss] for ss in self.scales]
        self._cache.clear()
        return self

    def _dense_block(self, i: int) -> KronDecomposed:
        """Block ``i`` (dense factors) as a one-block ``KronDecomposed``."""
        Qs, ls = self.blocks[i]
        ls = [s * li for s, li in zip(self.scales[i], ls)]
        return KronDecomposed([Qs], [ls], self.deltas[i : i + 1], self.damping)

    def _block(self, i: int) -> StructuredBlock | KronDecomposed:
        """Block ``i`` with its scales and delta: a ``StructuredBlock`` or a ``KronDecomposed``."""
        if i not in self._cache:
            block = self.blocks[i]
            self._cache[i] = (
                StructuredBlock(*block, self.scales[i], self.deltas[i], self.damping)
                if isinstance(block, _Structured)
                else self._dense_block(i)
            )
        return self._cache[i]

    def spectrum(self, i: int) -> Tensor:
        """Eigenvalues of a dense block ``i`` with its delta.

        Raises:
            ValueError: For a block with a structured factor.
        """
        if isinstance(self.blocks[i], _Structured):
            raise ValueError(f"block {i} has a structured output factor and no spectrum.")
        return self._block(i).spectrum(0)

    def rotated_inverse_diagonal(self, i: int) -> tuple[Tensor, Tensor | None]:
        """``diag(Pⱼ⁻¹)`` for every input eigenvalue j of structured block ``i``.

        Returns:
            The diagonals (m, C) and the input eigenvectors ``Q_A`` (D, D) (None for a block of
            one factor): ``diag(P⁻¹)`` at ``(c, d)`` is ``Σⱼ Q_A[d, j]² diag(Pⱼ⁻¹)[c]``.
        """
        block = self._block(i)
        return block.inverse_diagonal, block.Q

    # ------------------------------------------------------------------------- queries
    def logdet(self) -> Tensor:
        """``log det`` of the whole matrix, deltas included."""
        return sum(self._block(i).logdet() for i in range(len(self.blocks)))

    def bmm(self, W: Tensor, exponent: float = -1) -> Tensor:
        """``M^exponent W`` per row of ``W`` (shape (P,), (B, P) or (B, K, P); same shape out)."""
        if W.ndim not in (1, 2, 3):
            raise ValueError(f"W must have shape (P,), (B, P) or (B, K, P), got {tuple(W.shape)}.")
        flat = W.reshape(-1, W.shape[-1])
        out, start = [], 0
        for i, size in enumerate(self.block_sizes()):
            segment, block = flat[:, start : start + size], self._block(i)
            if isinstance(block, StructuredBlock):
                out.append(block.rotate_back(block.apply(block.rotate(segment), exponent)))
            else:
                out.append(block.bmm(segment, exponent))
            start += size
        return torch.cat(out, dim=1).reshape(W.shape)

    def inv_square_form(self, W: Tensor) -> Tensor:
        """``W M⁻¹ Wᵀ`` per batch entry: ``W`` (B, K, P) → (B, K, K)."""
        if W.ndim != 3:
            raise ValueError(f"inv_square_form needs W of shape (B, K, P), got {tuple(W.shape)}.")
        return W @ self.bmm(W, exponent=-1).mT

    def diag(self, exponent: float = 1) -> Tensor:
        """Diagonal of ``M^exponent`` (exponent 1 or -1 for structured blocks), shape (P,)."""
        diags = []
        for i in range(len(self.blocks)):
            block = self._block(i)
            if isinstance(block, StructuredBlock):
                diags.append(block.diagonal(exponent))
            else:
                diags.append(block.diag(exponent))
        return torch.cat(diags)

    def to_matrix(self, exponent: float = 1) -> Tensor:
        """Dense ``M^exponent`` (a root for -0.5), (P, P); for tests and small models only."""
        size = sum(self.block_sizes())
        eye = torch.eye(size, dtype=self.deltas.dtype, device=self.deltas.device)
        return self.bmm(eye, exponent).T
