r"""Diagonal-plus-low-rank matrices: output curvatures over many classes without a C × C matrix.

The output Hessian of a softmax over C classes is ``Λₙ = diag(pₙ) − pₙ pₙᵀ``, and its sum over N
outputs (data points, sequence positions, pixels) is exactly

.. math::
    G = \sum_n \big(\operatorname{diag}(p_n) - p_n p_n^\top\big)
      = \operatorname{diag}\Big(\sum_n p_n\Big) - P P^\top, \qquad P = [p_1, \dots, p_N]
      \in \mathbb{R}^{C \times N},

a diagonal minus a low-rank Gram matrix. Every output curvature of this library has that form
``diag(d) + s·U Uᵀ`` with a sign ``s = ±1``: softmax ``(p, p, −1)``, Gaussian regression
``(1, –, +1)``, the empirical or Monte-Carlo Fisher ``(0, ∇ℓ, +1)``.

:class:`DiagLowRankBatch` holds one such matrix per output point, ``Mₙ = diag(dₙ) + s Vₙ Vₙᵀ``
(``d`` (N, C), ``V`` (N, C, K)); :class:`DiagLowRank` their sum, ``G = diag(Σ dₙ) + s U Uᵀ``
with the columns of all ``Vₙ`` in ``U`` (C, k). Memory is O(C·(k + 1)) instead of O(C²).

**Bounded rank.** Summed over a data set, ``U`` would grow by K columns per point. With
``max_rank`` set, columns are folded in as they come: the kept columns and the next ones are
reduced to their top ``max_rank`` singular directions (an exact truncated SVD of those columns,
through the eigen-decomposition of their small Gram matrix). The removed part
``R = Σ (dropped σᵢ² uᵢuᵢᵀ)`` is positive semi-definite, with trace :attr:`DiagLowRank.dropped`.
For a softmax (``s = −1``) the kept matrix is ``G + R ⪰ G ⪰ 0``, at nuclear-norm distance
``tr R``. For ``s = +1`` (the Fisher estimates, whose gradient columns over a large vocabulary
are nearly orthogonal) the diagonal of ``R`` moves into ``d``: ``G − R + diag(R)`` keeps the
exact diagonal of ``G``, stays positive semi-definite and is within ``2 tr R``. While the true
rank is at most ``max_rank`` nothing is dropped and the representation is exact.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cached_property

import torch
from torch import Tensor

from laplace.errors import is_real_scalar

__all__ = [
    "DiagLowRank",
    "DiagLowRankBatch",
    "factor_from_state",
    "factor_shape",
    "factor_state",
]


def _check_sign(sign: int) -> int:
    if sign not in (1, -1):
        raise ValueError(f"sign must be +1 or -1, got {sign!r}.")
    return sign


class DiagLowRankBatch:
    """Per-point output curvatures ``Mₙ = diag(dₙ) + s·Vₙ Vₙᵀ`` of N points.

    Args:
        diag: ``d``, shape (N, C).
        columns: ``V``, shape (N, C, K) (K may be 0).
        sign: ``s``, +1 or -1.
    """

    def __init__(self, diag: Tensor, columns: Tensor, sign: int) -> None:
        if diag.dim() != 2 or columns.dim() != 3 or columns.shape[:2] != diag.shape:
            raise ValueError(
                f"DiagLowRankBatch needs diag (N, C) and columns (N, C, K), got "
                f"{tuple(diag.shape)} and {tuple(columns.shape)}."
            )
        self.diag, self.columns, self.sign = diag, columns, _check_sign(sign)

    @classmethod
    def cat(cls, batches: list[DiagLowRankBatch]) -> DiagLowRankBatch:
        """The points of several batches (with the same sign and K) together."""
        return cls(
            torch.cat([b.diag for b in batches]),
            torch.cat([b.columns for b in batches]),
            batches[0].sign,
        )

    def masked(self, keep: Tensor) -> DiagLowRankBatch:
        """The curvatures of the points ``keep`` (B,) selects, zero for the others."""
        weight = keep.to(self.diag.dtype)
        return DiagLowRankBatch(
            self.diag * weight[:, None], self.columns * weight[:, None, None], self.sign
        )

    def numel(self) -> int:
        """Numbers held: N·C·(K + 1)."""
        return self.diag.numel() + self.columns.numel()

    def diagonal(self) -> Tensor:
        """``diag(Mₙ)`` of every point, shape (N, C)."""
        return self.diag + self.sign * self.columns.square().sum(-1)

    def sum(self, max_rank: int | None = None) -> DiagLowRank:
        """``Σₙ Mₙ`` as a :class:`DiagLowRank` (rank at most ``max_rank`` if given)."""
        U = self.columns.permute(1, 0, 2).flatten(1)  # (C, N·K)
        return DiagLowRank(self.diag.sum(0), U, self.sign, max_rank)

    def to_dense(self) -> Tensor:
        """Dense (N, C, C); for tests and small C only."""
        return torch.diag_embed(self.diag) + self.sign * self.columns @ self.columns.mT


class DiagLowRank:
    """The symmetric C × C matrix ``G = diag(d) + s·U Uᵀ``, never formed densely.

    Sums (``+``, in place with :meth:`add_`) concatenate the low-rank columns and truncate them
    to ``max_rank`` (see the module docstring); a non-negative scalar scales ``d`` and ``U``
    (``α G = diag(α d) + s (√α U)(√α U)ᵀ``).

    Args:
        diag: ``d``, shape (C,).
        U: Low-rank columns, shape (C, k) (k may be 0).
        sign: ``s``, +1 or -1.
        max_rank: Largest number of columns kept after a sum; None: unbounded.
        dropped: Trace of the positive semi-definite part removed by truncations so far.

    Example:
        >>> p = torch.softmax(torch.randn(5, 3, dtype=torch.float64), -1)
        >>> G = DiagLowRankBatch(p, p.unsqueeze(-1), -1).sum()
        >>> dense = (torch.diag_embed(p) - p.unsqueeze(-1) * p.unsqueeze(-2)).sum(0)
        >>> torch.allclose(G.to_dense(), dense)
        True
    """

    ndim = 2

    def __init__(
        self,
        diag: Tensor,
        U: Tensor,
        sign: int = -1,
        max_rank: int | None = None,
        dropped: Tensor | float = 0.0,
    ) -> None:
        if diag.dim() != 1 or U.dim() != 2 or U.shape[0] != diag.shape[0]:
            raise ValueError(
                f"DiagLowRank needs diag (C,) and U (C, k), got {tuple(diag.shape)} and "
                f"{tuple(U.shape)}."
            )
        if max_rank is not None and (isinstance(max_rank, bool) or max_rank < 0):
            raise ValueError(f"max_rank must be a non-negative integer or None, got {max_rank}.")
        self.diag, self.sign, self.max_rank = diag, _check_sign(sign), max_rank
        dropped = torch.as_tensor(dropped, dtype=diag.dtype, device=diag.device)
        self.U, self.dropped, moved = self._truncated(U, dropped)
        if moved is not None:
            self.diag = diag + moved

    @classmethod
    def zeros(
        cls,
        size: int,
        sign: int = -1,
        max_rank: int | None = None,
        device: torch.device | None = None,
        dtype: torch.dtype | None = None,
    ) -> DiagLowRank:
        """The zero C × C matrix (``d = 0``, no columns)."""
        diag = torch.zeros(size, device=device, dtype=dtype)
        return cls(diag, diag.new_zeros(size, 0), sign, max_rank)

    # ------------------------------------------------------------------------- properties
    @property
    def shape(self) -> torch.Size:
        """(C, C)."""
        return torch.Size((len(self.diag), len(self.diag)))

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of ``d`` and ``U``."""
        return self.diag.dtype

    @property
    def device(self) -> torch.device:
        """The device of ``d`` and ``U``."""
        return self.diag.device

    @property
    def T(self) -> DiagLowRank:
        """The transpose: ``G`` itself (it is symmetric)."""
        return self

    @property
    def rank(self) -> int:
        """Number of low-rank columns k."""
        return self.U.shape[1]

    def __len__(self) -> int:
        return len(self.diag)

    # ------------------------------------------------------------------------- arithmetic
    def _truncated(self, U: Tensor, dropped: Tensor) -> tuple[Tensor, Tensor, Tensor | None]:
        """``U`` cut to ``max_rank`` columns, the new ``dropped`` and (``s = +1``) its diagonal.

        The diagonal of what was removed is to be added to ``d`` (None for ``s = −1``).

        The columns are taken in chunks of ``2·max_rank``: each chunk joins the kept columns
        and the top ``max_rank`` right singular directions of the result are kept (from the
        eigen-decomposition of its small Gram matrix). Each step keeps ``U V`` with ``V``
        orthonormal, so what it removes, ``U (I − V Vᵀ) Uᵀ``, is positive semi-definite; the
        cost is O(C·max_rank) per column instead of O(C·m) for all m columns at once.
        """
        if self.max_rank is None or U.shape[1] <= self.max_rank:
            return U, dropped, None
        kept, chunk = U[:, :0], max(2 * self.max_rank, 16)
        moved = torch.zeros_like(U[:, 0]) if self.sign > 0 else None
        for start in range(0, U.shape[1], chunk):
            block = torch.cat([kept, U[:, start : start + chunk]], dim=1)
            cut = block.shape[1] - self.max_rank
            if cut <= 0:
                kept = block
                continue
            values, vectors = torch.linalg.eigh(block.T @ block)  # ascending σᵢ²
            dropped = dropped + values[:cut].clamp_min(0).sum().to(dropped.device)
            if moved is not None:
                moved = moved + (block @ vectors[:, :cut]).square().sum(1)
            kept = block @ vectors[:, cut:]
        return kept, dropped, moved

    def _sum_sign(self, other: DiagLowRank) -> int:
        """The sign of the sum (that of a term with columns; a term without has no sign)."""
        if not isinstance(other, DiagLowRank):
            raise ValueError(
                f"can only add DiagLowRank to DiagLowRank, got {type(other).__name__}."
            )
        if other.shape != self.shape or (self.rank and other.rank and other.sign != self.sign):
            raise ValueError(
                f"cannot add DiagLowRank of size {len(other)} and sign {other.sign:+d} to one of "
                f"size {len(self)} and sign {self.sign:+d}."
            )
        return self.sign if self.rank else other.sign

    def _merged_rank(self, other: DiagLowRank) -> int | None:
        ranks = [r for r in (self.max_rank, other.max_rank) if r is not None]
        return min(ranks) if ranks else None

    def __add__(self, other: DiagLowRank) -> DiagLowRank:
        """The sum; its rank is truncated to the smaller ``max_rank`` of the two."""
        sign = self._sum_sign(other)
        return DiagLowRank(
            self.diag + other.diag,
            torch.cat([self.U, other.U], dim=1),
            sign,
            self._merged_rank(other),
            self.dropped + other.dropped,
        )

    __radd__ = __add__

    def add_(self, other: DiagLowRank) -> DiagLowRank:
        """Add ``other`` into this matrix (an accumulator that owns its tensors); returns self."""
        self.sign = self._sum_sign(other)
        self.diag.add_(other.diag)
        self.max_rank = self._merged_rank(other)
        self.U, self.dropped, moved = self._truncated(
            torch.cat([self.U, other.U], dim=1), self.dropped + other.dropped
        )
        if moved is not None:
            self.diag.add_(moved)
        self.__dict__.pop("pair_products", None)
        return self

    def __mul__(self, scalar: float | Tensor) -> DiagLowRank:
        """``α G`` for a non-negative scalar ``α``.

        Raises:
            ValueError: For a tensor that is not a scalar, or a negative value.
        """
        if not is_real_scalar(scalar):
            raise ValueError(f"DiagLowRank can only be multiplied by a scalar, got {scalar!r}.")
        if isinstance(scalar, Tensor):
            scalar = scalar.reshape(())
        if bool(torch.as_tensor(scalar) < 0):
            raise ValueError("DiagLowRank can only be multiplied by a non-negative scalar.")
        root = scalar**0.5
        return DiagLowRank(
            self.diag * scalar, self.U * root, self.sign, self.max_rank, self.dropped * scalar
        )

    __rmul__ = __mul__

    def __truediv__(self, scalar: float | Tensor) -> DiagLowRank:
        """``G / α`` for a positive scalar ``α``."""
        return self * (1 / scalar)

    def __matmul__(self, X: Tensor) -> Tensor:
        """``G X`` for ``X`` of shape (C,) or (..., C, m)."""
        diag = self.diag if X.dim() == 1 else self.diag.unsqueeze(-1)
        return diag * X + self.sign * (self.U @ (self.U.T @ X))

    # --------------------------------------------------------------------------- queries
    def diagonal(self) -> Tensor:
        """``diag(G)``, shape (C,)."""
        return self.diag + self.sign * self.U.square().sum(1)

    def logdet(self) -> Tensor:
        """``log det G`` by the matrix determinant lemma (needs ``d > 0``)."""
        inner = (self.U / self.diag.unsqueeze(1)).T @ self.U
        eye = torch.eye(self.rank, dtype=self.dtype, device=self.device)
        return self.diag.log().sum() + torch.logdet(eye + self.sign * inner)

    def to_dense(self) -> Tensor:
        """Dense (C, C); for tests and small C only."""
        return torch.diag(self.diag) + self.sign * self.U @ self.U.T

    @cached_property
    def pair_products(self) -> tuple[Tensor, Tensor, Tensor]:
        """``Z[c, q] = U[c, iq] U[c, jq]`` over the pairs ``iq ≤ jq``, shape (C, k(k+1)/2).

        With it, ``Uᵀ diag(w) U`` for many weight vectors ``w`` (rows of W (m, C)) is one
        product ``W Z`` instead of m products over C; cached (computed once per fit).

        Returns:
            ``Z`` and the row and column indices of the pairs.
        """
        rows, cols = torch.triu_indices(self.rank, self.rank, device=self.device)
        return self.U[:, rows] * self.U[:, cols], rows, cols

    def weighted_grams(self, weights: Tensor) -> Tensor:
        """``Uᵀ diag(wᵢ) U`` for every row ``wᵢ`` of ``weights`` (m, C), shape (m, k, k)."""
        Z, rows, cols = self.pair_products
        packed = weights @ Z
        out = weights.new_zeros(weights.shape[0], self.rank, self.rank)
        out[:, rows, cols] = packed
        out[:, cols, rows] = packed
        return out

    def quadratic_diagonals(self, matrices: Tensor) -> Tensor:
        """``u_cᵀ Mᵢ u_c`` for the rows ``u_c`` of ``U`` and symmetric ``Mᵢ`` (m, k, k): (m, C)."""
        Z, rows, cols = self.pair_products
        off_diagonal = 2 - (rows == cols).to(matrices.dtype)
        return (matrices[:, rows, cols] * off_diagonal) @ Z.T

    # ------------------------------------------------------------------------------ state
    def detach(self) -> DiagLowRank:
        """A copy whose tensors are detached."""
        return self._mapped(Tensor.detach)

    def to(self, *args, **kwargs) -> DiagLowRank:
        """Move (and cast) the tensors, as ``Tensor.to``."""
        return self._mapped(lambda t: t.to(*args, **kwargs))

    def _mapped(self, fn: Callable[[Tensor], Tensor]) -> DiagLowRank:
        return DiagLowRank(fn(self.diag), fn(self.U), self.sign, self.max_rank, fn(self.dropped))


#: The entries of a ``DiagLowRank`` in a ``state_dict``.
_STATE_KEYS = ("diag", "U", "sign", "dropped")


def factor_state(F: Tensor | DiagLowRank) -> Tensor | dict[str, Tensor]:
    """A Kronecker factor as floating-point tensors for a ``state_dict``.

    ``torch.load(weights_only=True)`` reads them; a ``DiagLowRank`` becomes a dict.
    """
    if not isinstance(F, DiagLowRank):
        return F.detach()
    sign = torch.tensor(float(F.sign), dtype=F.dtype, device=F.device)
    return dict(zip(_STATE_KEYS, (F.diag.detach(), F.U.detach(), sign, F.dropped.detach())))


def factor_shape(state: Tensor | dict[str, Tensor]) -> tuple[int, ...]:
    """The shape of the factor a :func:`factor_state` entry stands for."""
    if isinstance(state, dict):
        return (len(state.get("diag", ())),) * 2
    return tuple(state.shape)


def factor_from_state(
    state: Tensor | dict[str, Tensor], like: Tensor | DiagLowRank
) -> Tensor | DiagLowRank:
    """The factor saved by :func:`factor_state`, of the same kind as ``like``.

    Raises:
        ValueError: If ``state`` is of another kind than ``like`` (a structured factor saved
            for a dense one or the reverse), or lacks an entry.
    """
    if isinstance(like, DiagLowRank) and isinstance(state, dict):
        missing = sorted(set(_STATE_KEYS) - set(state))
        if missing:
            raise ValueError(f"state_dict['H'] lacks the entries {missing} of a factor.")
        diag, U, sign, dropped = (state[key] for key in _STATE_KEYS)
        if like.max_rank is not None and U.shape[-1] > like.max_rank:
            raise ValueError(
                f"state_dict['H'] holds a low-rank factor of rank {U.shape[-1]}, more than this "
                f"approximation's output_factor_rank={like.max_rank}: build it with "
                f"output_factor_rank={U.shape[-1]} (or more) to load it unchanged."
            )
        factor = DiagLowRank(diag, U, int(sign), like.max_rank, dropped)
        return factor.to(like.device, like.dtype)
    if isinstance(like, Tensor) and isinstance(state, Tensor):
        return state.to(like.device, like.dtype)
    kinds = {True: "a diagonal-plus-low-rank factor (a dict)", False: "a dense factor (a tensor)"}
    raise ValueError(
        f"state_dict['H'] holds {kinds[isinstance(state, dict)]} where this approximation keeps "
        f"{kinds[isinstance(like, DiagLowRank)]} (see laplace.large_output)."
    )
