r"""Diagonal-plus-low-rank matrices: output curvatures over many classes without a C × C matrix.

Every output curvature of this library has the form ``diag(d) + s·U Uᵀ`` with a sign
``s = ±1``: softmax ``(p, p, −1)`` (summed over N points, ``G = diag(Σ pₙ) − P Pᵀ`` exactly),
Gaussian regression ``(1, –, +1)``, the empirical or Monte-Carlo Fisher ``(0, ∇ℓ, +1)``.
``DiagLowRankBatch`` holds one per output point, ``DiagLowRank`` their sum (O(C·(k+1))
memory, its rank bounded by ``max_rank`` through truncated SVDs of the columns as they come),
and ``LowRankKronBlock`` the Kronecker block of such a factor, the factor kind of
[`Kron`][laplace.utils.matrix.Kron] above the large-output threshold. ``docs/large_outputs.md``
gives the maths and the error bounds of the truncation.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cached_property

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from laplace.utils.errors import is_real_scalar

__all__ = [
    "DiagLowRank",
    "DiagLowRankBatch",
    "LowRankKronBlock",
    "LowRankShape",
    "checked_scalar",
    "factor_from_state",
    "factor_shape",
    "factor_state",
]


def _check_sign(sign: int) -> int:
    if sign not in (1, -1):
        raise ValueError(f"sign must be +1 or -1, got {sign!r}.")
    return sign


def checked_scalar(value: float | Tensor, owner: str) -> float | Tensor:
    """``value`` as a number or a 0-d tensor, to multiply a structured matrix with.

    Raises:
        ValueError: Naming ``owner``, for a tensor that is not a scalar or a non-number.
    """
    if not is_real_scalar(value):
        raise ValueError(f"{owner} can only be multiplied by a scalar, got {value!r}.")
    return value.reshape(()) if isinstance(value, Tensor) else value


class LowRankShape(tuple):
    """The shape ``(m, m)`` of a factor kept as a diagonal plus a low-rank term.

    Equal to the tuple ``(m, m)``; its type tells a zero curvature to hold a
    ``DiagLowRank`` there instead of a dense matrix.
    """

    def __new__(cls, size: int) -> LowRankShape:
        """The shape ``(size, size)``."""
        return super().__new__(cls, (size, size))


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
        """``Σₙ Mₙ`` as a ``DiagLowRank`` (rank at most ``max_rank`` if given)."""
        U = self.columns.permute(1, 0, 2).flatten(1)  # (C, N·K)
        return DiagLowRank(self.diag.sum(0), U, self.sign, max_rank)

    def to_dense(self) -> Tensor:
        """Dense (N, C, C); for tests and small C only."""
        return torch.diag_embed(self.diag) + self.sign * self.columns @ self.columns.mT


class DiagLowRank:
    """The symmetric C × C matrix ``G = diag(d) + s·U Uᵀ``, never formed densely.

    Sums (``+``, in place with ``add_``) concatenate the low-rank columns and truncate them
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
        self.diag, self.U, self.sign, self.max_rank = diag, U, _check_sign(sign), max_rank
        self.dropped = torch.as_tensor(dropped, dtype=diag.dtype, device=diag.device)
        self._truncate()
        #: ``(G₀, α)`` when this is ``α G₀``: the pair products are then ``G₀``'s, computed once.
        self.scaled_from: tuple[DiagLowRank, Tensor | float] | None = None

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
    def _truncate(self) -> None:
        """Cut ``U`` to ``max_rank`` columns; ``dropped`` grows by the trace of what is removed.

        For ``s = +1`` the diagonal of what was removed moves into ``d``. The columns are taken
        in chunks of ``2·max_rank``: each chunk joins the kept columns
        and the top ``max_rank`` right singular directions of the result are kept (from the
        eigen-decomposition of its small Gram matrix). Each step keeps ``U V`` with ``V``
        orthonormal, so what it removes, ``U (I − V Vᵀ) Uᵀ``, is positive semi-definite; the
        cost is O(C·max_rank) per column instead of O(C·m) for all m columns at once.
        """
        if self.max_rank is None or self.rank <= self.max_rank:
            return
        U, kept, chunk = self.U, self.U[:, :0], max(2 * self.max_rank, 16)
        for start in range(0, U.shape[1], chunk):
            block = torch.cat([kept, U[:, start : start + chunk]], dim=1)
            cut = block.shape[1] - self.max_rank
            if cut <= 0:
                kept = block
                continue
            values, vectors = torch.linalg.eigh(block.T @ block)  # ascending σᵢ²
            self.dropped = self.dropped + values[:cut].clamp_min(0).sum().to(self.dropped.device)
            if self.sign > 0:
                self.diag = self.diag + (block @ vectors[:, :cut]).square().sum(1)
            kept = block @ vectors[:, cut:]
        self.U = kept

    def __add__(self, other: DiagLowRank) -> DiagLowRank:
        """The sum; its rank is truncated to the smaller ``max_rank`` of the two."""
        return self._mapped(Tensor.clone).add_(other)

    __radd__ = __add__

    def add_(self, other: DiagLowRank) -> DiagLowRank:
        """Add ``other`` into this matrix (an accumulator that owns its tensors); returns self.

        The rank of the sum is truncated to the smaller ``max_rank`` of the two; its sign is that
        of a term with columns (a term without has no sign).
        """
        if not isinstance(other, DiagLowRank):
            raise ValueError(
                f"can only add DiagLowRank to DiagLowRank, got {type(other).__name__}."
            )
        if other.shape != self.shape or (self.rank and other.rank and other.sign != self.sign):
            raise ValueError(
                f"cannot add DiagLowRank of size {len(other)} and sign {other.sign:+d} to one of "
                f"size {len(self)} and sign {self.sign:+d}."
            )
        self.sign = self.sign if self.rank else other.sign
        self.diag.add_(other.diag)
        ranks = [r for r in (self.max_rank, other.max_rank) if r is not None]
        self.max_rank = min(ranks) if ranks else None
        self.U = torch.cat([self.U, other.U], dim=1)
        self.dropped = self.dropped + other.dropped
        self._truncate()
        self.__dict__.pop("pair_products", None)
        self.scaled_from = None  # no longer a multiple of the matrix it was scaled from
        return self

    def __mul__(self, scalar: float | Tensor) -> DiagLowRank:
        """``α G`` for a non-negative scalar ``α``.

        Raises:
            ValueError: For a tensor that is not a scalar, or a negative value.
        """
        scalar = checked_scalar(scalar, "DiagLowRank")
        if bool(torch.as_tensor(scalar) < 0):
            raise ValueError("DiagLowRank can only be multiplied by a non-negative scalar.")
        root = scalar**0.5
        scaled = DiagLowRank(
            self.diag * scalar, self.U * root, self.sign, self.max_rank, self.dropped * scalar
        )
        base, factor = self.scaled_from or (self, 1)
        scaled.scaled_from = (base, factor * scalar)
        return scaled

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

    def _scaled_pair_products(self) -> tuple[Tensor, Tensor, Tensor, Tensor | float]:
        """``pair_products`` of the unscaled matrix and the scale α of ``Z`` (1: none)."""
        base, scale = self.scaled_from or (self, 1)
        return (*base.pair_products, scale)

    def weighted_grams(self, weights: Tensor) -> Tensor:
        """``Uᵀ diag(wᵢ) U`` for every row ``wᵢ`` of ``weights`` (m, C), shape (m, k, k)."""
        Z, rows, cols, scale = self._scaled_pair_products()
        packed = (weights @ Z) * scale
        out = weights.new_zeros(weights.shape[0], self.rank, self.rank)
        out[:, rows, cols] = packed
        out[:, cols, rows] = packed
        return out

    def quadratic_diagonals(self, matrices: Tensor) -> Tensor:
        """``u_cᵀ Mᵢ u_c`` for the rows ``u_c`` of ``U`` and symmetric ``Mᵢ`` (m, k, k): (m, C)."""
        Z, rows, cols, scale = self._scaled_pair_products()
        off_diagonal = 2 - (rows == cols).to(matrices.dtype)
        return ((matrices[:, rows, cols] * off_diagonal) @ Z.T) * scale

    # ------------------------------------------------------------------------------ state
    def detach(self) -> DiagLowRank:
        """A copy whose tensors are detached."""
        return self._mapped(Tensor.detach)

    def to(self, *args, **kwargs) -> DiagLowRank:
        """Move (and cast) the tensors, as ``Tensor.to``."""
        return self._mapped(lambda t: t.to(*args, **kwargs))

    def _mapped(self, fn: Callable[[Tensor], Tensor]) -> DiagLowRank:
        return DiagLowRank(fn(self.diag), fn(self.U), self.sign, self.max_rank, fn(self.dropped))


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


class LowRankKronBlock:
    r"""The Kronecker block ``G ⊗ A + δ I`` of a ``DiagLowRank`` ``G``, per input eigenvalue.

    In the eigenbasis ``Q`` of ``A = Q diag(a) Qᵀ`` (D × D) the block is one C × C matrix per
    ``aⱼ``, $P_j = \operatorname{diag}(e_j) + s \beta_j U U^\top$ with ``eⱼ = aⱼ d + δ``,
    ``βⱼ = aⱼ`` (damped, ``(aⱼ + √δ)(G + √δ I)``: ``eⱼ = (aⱼ + √δ)(d + √δ)``, ``βⱼ = aⱼ + √δ``;
    a block of ``G`` alone is the case ``a = 1``, ``Q = I``). With ``Kⱼ = Uᵀ diag(1/eⱼ) U`` and
    ``Mⱼ = I + s βⱼ Kⱼ`` everything is exact and costs O(D·C·k²) at most: ``log det`` by the
    determinant lemma, ``Pⱼ⁻¹`` by Woodbury, and a root ``Rⱼ Rⱼᵀ = Pⱼ⁻¹`` (not the symmetric
    one) from the eigenpairs of ``Kⱼ``.

    Args:
        G: The output factor (C × C).
        a: Eigenvalues of the input factor (D,); None for a block of ``G`` alone.
        Q: Eigenvectors of the input factor (D, D); None with ``a``.
        delta: The scalar added to the block.
        damping: Mix ``δ`` into each factor instead of adding it to their product.
    """

    def __init__(
        self, G: DiagLowRank, a: Tensor | None, Q: Tensor | None, delta: Tensor, damping: bool
    ) -> None:
        self.G, self.Q = G, Q
        if a is None:  # a block of G alone: one input eigenvalue 1, never damped
            a, damping = torch.ones_like(delta).reshape(1), False
        if damping:
            root = delta.sqrt()
            c = a + root
            self.E, self.beta = c.unsqueeze(1) * (G.diag + root), c
        else:
            self.E, self.beta = a.unsqueeze(1) * G.diag + delta, a

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

    def times(self, flat: Tensor, exponent: float) -> Tensor:
        """``P^exponent`` (a root ``R`` for -½) on each row of ``flat`` (R, C·D), same shape.

        Raises:
            ValueError: For an exponent other than 1, -1 and -0.5.
        """
        X = flat.reshape(flat.shape[0], len(self.G), -1)
        X = X if self.Q is None else X @ self.Q
        E, U, s = self.E.T, self.G.U, self.G.sign
        if exponent == 1:
            T = torch.einsum("ck,rcm->rkm", U, X) * self.beta
            X = X * E + s * torch.einsum("ck,rkm->rcm", U, T)
        elif exponent == -1:
            X = X / E
            T = torch.einsum("ck,rcm->mkr", U, X)
            T = torch.cholesky_solve(T, self.cholesky).permute(2, 1, 0) * self.beta
            X = X - s * torch.einsum("ck,rkm->rcm", U, T) / E
        elif exponent == -0.5:
            X = X / E.sqrt()
            g, vectors = self.root_factors
            T = torch.einsum("ck,rcm->rmk", U, X)
            T = torch.einsum("mkl,rmk->rml", vectors, T) * g
            T = torch.einsum("mkl,rml->rkm", vectors, T)
            X = X + torch.einsum("ck,rkm->rcm", U, T) / E
        else:
            raise ValueError(
                "a block with a diagonal-plus-low-rank factor supports exponent 1, -1 or -0.5, "
                f"got {exponent}."
            )
        return (X if self.Q is None else X @ self.Q.T).flatten(1)

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
                f"the diagonal of a diagonal-plus-low-rank block supports exponent 1 or -1, got "
                f"{exponent}."
            )
        return (rotated.T if self.Q is None else rotated.T @ self.Q.square().T).flatten()


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
    """The shape of the factor a ``factor_state`` entry stands for."""
    if isinstance(state, dict):
        return LowRankShape(len(state.get("diag", ())))
    return tuple(state.shape)


def factor_from_state(
    state: Tensor | dict[str, Tensor], like: Tensor | DiagLowRank
) -> Tensor | DiagLowRank:
    """The factor saved by ``factor_state``, of the same kind as ``like``.

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
        f"{kinds[isinstance(like, DiagLowRank)]} (see laplace.structures.large_output)."
    )
