r"""Block-diagonal Kronecker-factored matrices: ``Kron`` (to sum) and ``KronDecomposed`` (to use).

One block per parameter tensor, in parameter order, of one of these forms (mixed freely, as
nngeometry's ``PMatMixed``): two factors ``F₀ ⊗ F₁``, ``F₀`` (m × m) on the first dimension of
a parameter of shape (m, ...) and ``F₁`` (n × n) on the flattened others (a Linear weight: its
outputs ⊗ inputs; an embedding: its vocabulary ⊗ its dimension), or one factor (p × p: a bias,
the exact block of a small parameter). A factor is a dense matrix (2-D) or a diagonal (the 1-D
tensor of its entries), which never costs V × V memory (only ``to_matrix`` expands it); the
output factor of a layer with many outputs may be a diagonal plus low rank
(``DiagLowRank``, in a ``StructuredKron``), kept as it is
by ``decompose`` and computed per eigenvalue of the other factor. In a
fitted curvature ``F₀`` of a two-factor block is summed over the data and ``F₁`` normalised by
the number of data points (see ``laplace.curvature.engine.kfac``).

``Kron`` sums factors (as KFAC accumulates them over batches); ``Kron.decompose`` eigen-decomposes
every factor, ``Fᵢ = Qᵢ diag(λᵢ) Qᵢᵀ``, into a ``KronDecomposed``. There

$$
(F_0 \otimes F_1 + \delta I)^{e} = (Q_0 \otimes Q_1)\,
(\lambda_0 \lambda_1^\top + \delta)^{e}\,(Q_0 \otimes Q_1)^\top
$$

for any exponent ``e`` (a diagonal factor is its own eigenvalues, ``Qᵢ = I``, stored as None),
so adding a scalar or layer-wise prior ``δ``, multiplying by a temperature, log-determinants,
``W P⁻¹ Wᵀ``, products with ``P^{±1}``, ``P^{±1/2}``, diagonals and dense views never
re-factorise. With ``damping=True`` a weight block's spectrum is ``(λ₀ + √δ)(λ₁ + √δ)ᵀ``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from typing import ClassVar

import torch
from torch import Tensor, nn

from laplace.utils.diag_lowrank import (
    DiagLowRank,
    LowRankKronBlock,
    LowRankShape,
    checked_scalar,
)
from laplace.utils.linalg import symeig

__all__ = ["Kron", "KronDecomposed"]


def _times(F: Tensor | DiagLowRank, X: Tensor) -> Tensor:
    """``F X`` for ``X`` (..., m, n) and a factor ``F`` (m, m) of any kind."""
    return F @ X if F.ndim > 1 else F.unsqueeze(-1) * X


def _same(A: Tensor, B: Tensor) -> bool:
    """Whether two factors are the same matrix (same type, shape and entries)."""
    return A is B or (A.shape == B.shape and A.dtype == B.dtype and torch.equal(A, B))


def _pair(block: list[Tensor]) -> list[Tensor]:
    """A block's factors as a pair ``[F₀, F₁]``: a one-factor block ``F`` is ``[1] ⊗ F``."""
    if len(block) == 2:
        return block
    return [torch.ones(1, dtype=block[0].dtype, device=block[0].device), block[0]]


def _rotate(X: Tensor, Q0: Tensor | None, Q1: Tensor | None, back: bool = False) -> Tensor:
    """``Q₀ᵀ X Q₁`` (into the eigenbasis), or ``Q₀ X Q₁ᵀ`` (``back``), for ``X`` (..., m, n).

    A None eigenvector matrix is the identity.
    """
    if Q0 is not None:
        X = (Q0 if back else Q0.T) @ X
    return X if Q1 is None else X @ (Q1.T if back else Q1)


def _check_W(W: Tensor) -> tuple[Tensor, tuple[int, ...]]:
    """``W`` of shape (P,), (B, P) or (B, K, P) as (B·K, P), with the shape to restore."""
    if W.ndim not in (1, 2, 3):
        raise ValueError(f"W must have shape (P,), (B, P) or (B, K, P), got {tuple(W.shape)}.")
    return W.reshape(-1, W.shape[-1]), tuple(W.shape)


class Kron:
    """Block-diagonal matrix of Kronecker products, one block per parameter tensor.

    Args:
        kfacs: Per block a list of one factor (p, p) or (p,), or two factors ``[F₀, F₁]`` for
            the block ``F₀ ⊗ F₁``, each (m, m) or (m,).
    """

    #: The class of ``decompose``'s result (assigned below the decomposed classes).
    decomposition: ClassVar[type[KronDecomposed]]

    def __init__(self, kfacs: list[list[Tensor]]) -> None:
        self.kfacs = [list(F) for F in kfacs]

    @classmethod
    def init_from_model(
        cls, model: nn.Module | Iterable[Tensor], device: torch.device, dtype: torch.dtype
    ) -> Kron:
        """Zero factors for the parameters of ``model`` (or an iterable of parameters).

        A 1-D parameter gets one (p, p) factor; a parameter of shape (p_out, ...) gets
        ``[(p_out, p_out), (p_in, p_in)]`` with ``p_in`` the product of the other dimensions.

        Raises:
            ValueError: For a 0-dimensional parameter.
        """
        params = model.parameters() if isinstance(model, nn.Module) else model
        return cls.zeros(cls.shapes_of(params), device, dtype)

    @staticmethod
    def shapes_of(params: Iterable[Tensor]) -> list[list[tuple[int, int]]]:
        """The factor shapes of ``init_from_model`` for ``params`` (from their shapes alone).

        Raises:
            ValueError: For a 0-dimensional parameter.
        """
        shapes = []
        for p in params:
            if p.ndim == 0:
                raise ValueError("Kron needs parameters with at least one dimension.")
            sizes = [p.shape[0]] if p.ndim == 1 else [p.shape[0], p[0].numel()]
            shapes.append([(s, s) for s in sizes])
        return shapes

    @classmethod
    def zeros(cls, shapes: list[list[tuple]], device: torch.device, dtype: torch.dtype) -> Kron:
        """Zero factors of the given shapes: per block one or two shapes (m, m) or (m,)."""
        return cls(
            [[torch.zeros(shape, device=device, dtype=dtype) for shape in F] for F in shapes]
        )

    @property
    def shapes(self) -> list[list[tuple[int, ...]]]:
        """Per block the shapes of its factors (a ``LowRankShape`` for a ``DiagLowRank``)."""
        return [
            [LowRankShape(len(F)) if isinstance(F, DiagLowRank) else tuple(F.shape) for F in b]
            for b in self.kfacs
        ]

    def _check_same_structure(self, other: Kron) -> None:
        if not isinstance(other, Kron):
            raise ValueError(f"can only add Kron to Kron, got {type(other).__name__}.")
        if self.shapes != other.shapes:
            raise ValueError("cannot add Kron objects with different block structures.")

    def __add__(self, other: Kron) -> Kron:
        """Factor-wise sum with another ``Kron`` of the same structure."""
        self._check_same_structure(other)
        return type(self)(
            [[Fi + Fj for Fi, Fj in zip(a, b)] for a, b in zip(self.kfacs, other.kfacs)]
        )

    def __iadd__(self, other: Kron) -> Kron:
        """Factor-wise sum into this ``Kron``'s own factors (an accumulator that owns them).

        Where ``other`` has a wider dtype (float32 ``+=`` float64), the result is ``self +
        other``, a new ``Kron`` of promoted factors, as laplace-torch's ``+=`` gives.
        """
        self._check_same_structure(other)
        if any(
            torch.promote_types(Fi.dtype, Fj.dtype) != Fi.dtype
            for a, b in zip(self.kfacs, other.kfacs)
            for Fi, Fj in zip(a, b)
        ):
            return self + other
        for a, b in zip(self.kfacs, other.kfacs):
            for Fi, Fj in zip(a, b):
                Fi.add_(Fj)
        return self

    def __mul__(self, scalar: float | Tensor) -> Kron:
        """Multiply every block by ``scalar``: each of its ``k`` factors by ``scalar^(1/k)``."""
        scalar = checked_scalar(scalar, "Kron")
        return type(self)([[scalar ** (1 / len(F)) * Fi for Fi in F] for F in self.kfacs])

    __radd__ = __add__
    __rmul__ = __mul__

    def __len__(self) -> int:
        return len(self.kfacs)

    def decompose(self, damping: bool = False, deferred: bool = False) -> KronDecomposed:
        """Eigen-decompose every dense factor (1-D and diagonal-plus-low-rank ones are kept).

        Args:
            damping: See [`KronDecomposed`][laplace.utils.KronDecomposed].
            deferred: Return at once and eigen-decompose when the eigenpairs are first needed
                (a fit then ends with the sum of the factors; the first posterior query pays).
        """
        if deferred:
            return self.decomposition.deferred(self, damping)
        return self.decomposition(*self._eigenpairs(), damping=damping)

    def _eigenpairs(self) -> tuple[list[list[Tensor | None]], list[list[Tensor]]]:
        """Eigenvalues and eigenvectors of every dense factor (the others as they are).

        A bias's block is the output factor of its weight's (KFAC's ``G``): a factor equal to
        the previous block's first one takes its eigenpairs instead of a second decomposition.
        """
        eigenvectors, eigenvalues = [], []
        previous: tuple[Tensor, tuple[Tensor, Tensor]] | None = None
        for block in self.kfacs:
            pairs = []
            for F in block:
                if not (isinstance(F, Tensor) and F.ndim > 1):
                    pairs.append((F, None))
                elif previous is not None and _same(previous[0], F):
                    pairs.append(previous[1])
                else:
                    pairs.append(symeig(F))
            first = block[0]
            dense = isinstance(first, Tensor) and first.ndim > 1
            previous = (first, pairs[0]) if dense and len(block) == 2 else None
            eigenvalues.append([values for values, _ in pairs])
            eigenvectors.append([Q for _, Q in pairs])
        return eigenvectors, eigenvalues

    def bmm(self, W: Tensor, exponent: float = 1) -> Tensor:
        """``H W`` per row of ``W`` (shape (P,), (B, P) or (B, K, P); same shape returned).

        Raises:
            ValueError: For ``exponent != 1`` (decompose first) or a badly shaped ``W``.
        """
        if exponent != 1:
            raise ValueError("Kron.bmm supports only exponent=1; decompose() for other powers.")
        flat, shape = _check_W(W)
        pairs = [_pair(block) for block in self.kfacs]
        parts = flat.split([len(F0) * len(F1) for F0, F1 in pairs], dim=1)
        out = [  # (F₀ ⊗ F₁) vec(X) = vec(F₀ X F₁ᵀ)
            _times(F1, _times(F0, part.reshape(-1, len(F0), len(F1))).mT).mT.flatten(1)
            for (F0, F1), part in zip(pairs, parts)
        ]
        return torch.cat(out, dim=1).reshape(shape)

    def __matmul__(self, W: Tensor) -> Tensor:
        """``H w`` for a vector or each row of ``W``: the same as ``bmm(W)``."""
        return self.bmm(W)

    def logdet(self) -> Tensor:
        """``log det`` of the whole block-diagonal matrix."""
        total = 0
        for F0, F1 in map(_pair, self.kfacs):  # det(F₀ ⊗ F₁) = det(F₀)^p_in · det(F₁)^p_out
            logdets = [F.logdet() if F.ndim > 1 else F.log().sum() for F in (F0, F1)]
            total = total + len(F1) * logdets[0] + len(F0) * logdets[1]
        return total

    def diag(self) -> Tensor:
        """Diagonal of the whole matrix, shape (P,)."""
        diags = []
        for F0, F1 in map(_pair, self.kfacs):
            diagonals = [F.diagonal() if F.ndim > 1 else F for F in (F0, F1)]
            diags.append(torch.outer(*diagonals).flatten())
        return torch.cat(diags)

    def to_matrix(self) -> Tensor:
        """Dense (P, P) matrix; for tests and small models only."""
        P = sum(math.prod(len(F) for F in block) for block in self.kfacs)
        reference = self.kfacs[0][0]
        return self.bmm(torch.eye(P, dtype=reference.dtype, device=reference.device)).T


class KronDecomposed:
    """Eigen-decomposed ``Kron`` plus one scalar ``δ`` per block (a prior precision).

    A diagonal-plus-low-rank first factor ``G`` (a ``DiagLowRank``, many
    outputs) is kept as it is, its own "eigenvalues" with eigenvectors None
    like a diagonal factor; such a block is computed per eigenvalue of its other factor
    (``LowRankKronBlock``) and has no [`spectrum`][laplace.utils.KronDecomposed.spectrum].

    Args:
        eigenvectors: Per block the eigenvector matrices ``Qᵢ`` of its factors (None for a
            diagonal or diagonal-plus-low-rank factor: the identity).
        eigenvalues: Per block the eigenvalues ``λᵢ`` of its factors.
        deltas: Added to each block: a scalar (shape () or (1,)) or one value per block.
        damping: Use the damped spectrum ``(λ₀ + √δ)(λ₁ + √δ)ᵀ`` for weight blocks.
        corrections: EKFAC: per block eigenvalues that replace ``λ₀ λ₁ᵀ`` (or ``λ₀``) in the
            same eigenbasis, in the shape of its spectrum, or None to keep the factors'
            (``laplace.curvature.engine.kfac.kfac_eigenvalues``). Damping then adds the same
            ``√δ(λ₀ ⊕ λ₁) + δ`` to them as to KFAC's.

    Attributes:
        factors: The ``Kron`` this is the decomposition of (see ``deferred``); None when
            built from eigenpairs.
    """

    def __init__(
        self,
        eigenvectors: list[list[Tensor | None]],
        eigenvalues: list[list[Tensor]],
        deltas: Tensor | None = None,
        damping: bool = False,
        corrections: list[Tensor | None] | None = None,
    ) -> None:
        self.factors: Kron | None = None
        self._eigenvectors, self._eigenvalues = eigenvectors, eigenvalues
        self._init_deltas(len(eigenvalues), eigenvalues[0][0], deltas)
        self.damping = damping
        self.corrections = corrections

    @classmethod
    def deferred(cls, kron: Kron, damping: bool = False) -> KronDecomposed:
        """The decomposition of ``kron``, computed when its eigenpairs are first needed.

        ``kron`` stays available as ``factors``.
        """
        self = cls.__new__(cls)
        self.factors, self._eigenvectors, self._eigenvalues = kron, None, None
        self._init_deltas(len(kron), kron.kfacs[0][0], None)
        self.damping = damping
        self.corrections = None
        return self

    def corrected(
        self, corrections: list[Tensor | None], damping: bool | None = None
    ) -> KronDecomposed:
        """The same eigenbasis (and factors) with EKFAC's eigenvalues ``corrections``.

        Args:
            corrections: See the class.
            damping: See the class; None keeps this decomposition's.
        """
        damping = self.damping if damping is None else damping
        out = type(self)(*self._pairs(), self.deltas, damping, corrections)
        out.factors, out._products = self.factors, self._products
        return out

    def _init_deltas(self, n_blocks: int, reference: Tensor, deltas: Tensor | None) -> None:
        if deltas is None:
            deltas = torch.zeros(n_blocks, device=reference.device, dtype=reference.dtype)
        else:
            self._check_deltas(deltas, n_blocks)
            deltas = deltas.reshape(-1).expand(n_blocks)
        self.deltas = deltas
        self._delta_views: tuple[Tensor, ...] | None = None
        self._low_rank: dict[int, LowRankKronBlock] = {}
        #: ``λ₀ λ₁ᵀ`` of two-factor blocks, by block: they depend on the eigenvalues only, so
        #: a decomposition with other deltas or corrections shares them.
        self._products: dict[int, Tensor] = {}

    def _pairs(self) -> tuple[list[list[Tensor | None]], list[list[Tensor]]]:
        """Eigenvectors and eigenvalues per block (decomposing the factors on first use)."""
        if self._eigenvectors is None:
            self._eigenvectors, self._eigenvalues = self.factors._eigenpairs()
        return self._eigenvectors, self._eigenvalues

    @property
    def eigenvectors(self) -> list[list[Tensor]]:
        """Per block the eigenvector matrices ``Qᵢ`` of its factors.

        A diagonal (1-D) factor's are the identity, built here (m × m) as laplace-torch
        returns them; the decomposition itself keeps them implicit (``factor_bases``).
        """
        eigenvectors, eigenvalues = self._pairs()
        return [
            [torch.diag(torch.ones_like(ls)) if Q is None else Q for Q, ls in zip(Qs, lss)]
            for Qs, lss in zip(eigenvectors, eigenvalues)
        ]

    def factor_bases(self, i: int) -> list[Tensor | None]:
        """The eigenvector matrices of block ``i``'s factors, None for the identity."""
        return self._pairs()[0][i]

    @property
    def eigenvalues(self) -> list[list[Tensor]]:
        """Per block the eigenvalues ``λᵢ`` of its factors."""
        return self._pairs()[1]

    def _check_deltas(self, deltas: Tensor, n_blocks: int | None = None) -> None:
        n_blocks = len(self) if n_blocks is None else n_blocks
        if not isinstance(deltas, Tensor):
            raise ValueError("can only add a torch.Tensor to KronDecomposed.")
        if not (deltas.numel() == 1 and deltas.ndim <= 1) and tuple(deltas.shape) != (n_blocks,):
            raise ValueError(
                f"KronDecomposed accepts a scalar or one value per block ({n_blocks}) to add, "
                f"got shape {tuple(deltas.shape)}; a diagonal has no Kronecker eigenbasis."
            )

    def detach(self) -> KronDecomposed:
        """Detach the deltas in place (the factors are never part of a graph); returns self."""
        self.deltas = self.deltas.detach()
        self._delta_views = None
        self._low_rank.clear()
        self._products = {}
        return self

    def __add__(self, deltas: Tensor) -> KronDecomposed:
        """Add a scalar or one scalar per block (e.g. a prior precision) to the blocks."""
        self._check_deltas(deltas)
        deltas = self.deltas + deltas.reshape(-1)
        out = type(self)(*self._pairs(), deltas, self.damping, self.corrections)
        out._products = self._products
        return out

    def __mul__(self, scalar: float | Tensor) -> KronDecomposed:
        """Scale every block by ``scalar`` (its ``k`` eigenvalue sets by ``scalar^(1/k)``)."""
        scalar = checked_scalar(scalar, "KronDecomposed")
        eigenvectors, eigenvalues = self._pairs()
        eigenvalues = [[scalar ** (1 / len(ls)) * li for li in ls] for ls in eigenvalues]
        corrections = self.corrections and [
            None if c is None else scalar * c for c in self.corrections
        ]
        return type(self)(eigenvectors, eigenvalues, self.deltas, self.damping, corrections)

    __radd__ = __add__
    __rmul__ = __mul__

    def __len__(self) -> int:
        return len(self.deltas)

    def block_sizes(self) -> list[int]:
        """Number of parameters of each block."""
        return [math.prod(len(values) for values in ls) for ls in self._pairs()[1]]

    def low_rank_block(self, i: int) -> LowRankKronBlock | None:
        """Block ``i`` with its delta if its first factor is diagonal plus low rank, else None."""
        eigenvectors, eigenvalues = self._pairs()
        ls = eigenvalues[i]
        if not isinstance(ls[0], DiagLowRank):
            return None
        if i not in self._low_rank:
            a, Q = (ls[1], eigenvectors[i][1]) if len(ls) == 2 else (None, None)
            self._low_rank[i] = LowRankKronBlock(ls[0], a, Q, self._delta(i), self.damping)
        return self._low_rank[i]

    def _delta(self, i: int) -> Tensor:
        """The delta of block ``i`` (the deltas are split once, one graph node for all)."""
        if self._delta_views is None:
            self._delta_views = self.deltas.unbind()
        return self._delta_views[i]

    def spectrum(self, i: int) -> Tensor:
        """Eigenvalues of block ``i`` with its delta: (p,) or (p_out, p_in) for ``F₀ ⊗ F₁``.

        Raises:
            ValueError: For a block with a diagonal-plus-low-rank factor.
        """
        ls, delta = self._pairs()[1][i], self._delta(i)
        if isinstance(ls[0], DiagLowRank):
            raise ValueError(f"block {i} has a structured output factor and no spectrum.")
        corrected = None if self.corrections is None else self.corrections[i]
        if len(ls) == 1:
            return (ls[0] if corrected is None else corrected) + delta
        if self.damping:
            root = delta.sqrt()
            damped = torch.outer(ls[0] + root, ls[1] + root)
            return damped if corrected is None else damped - self._product(i) + corrected
        return (self._product(i) if corrected is None else corrected) + delta

    def _product(self, i: int) -> Tensor:
        """``λ₀ λ₁ᵀ`` of the two-factor block ``i``, computed once."""
        product = self._products.get(i)
        if product is None:
            product = self._products[i] = torch.outer(*self._pairs()[1][i])
        return product

    def logdet(self) -> Tensor:
        """``log det`` of the whole matrix, deltas included."""
        total = 0
        for i in range(len(self)):
            block = self.low_rank_block(i)
            total = total + (self.spectrum(i).log().sum() if block is None else block.logdet())
        return total

    def _eigenbasis(self, i: int) -> tuple[Tensor | None, Tensor | None, Tensor]:
        """``Q₀``, ``Q₁`` and the spectrum (m, n) of block ``i`` (one factor: ``Q₀ = I₁``)."""
        spectrum, Qs = self.spectrum(i), self._pairs()[0][i]
        return (*Qs, spectrum) if len(Qs) == 2 else (None, Qs[0], spectrum.unsqueeze(0))

    def _blocks(self, flat: Tensor) -> Iterator[tuple[int, Tensor, LowRankKronBlock | None]]:
        """Per block its index, its columns of ``flat`` (R, P) and ``low_rank_block``."""
        for i, part in enumerate(flat.split(self.block_sizes(), dim=1)):
            yield i, part, self.low_rank_block(i)

    def bmm(self, W: Tensor, exponent: float = -1) -> Tensor:
        """``M^exponent W`` per row of ``W`` (shape (P,), (B, P) or (B, K, P); same shape out).

        A block with a diagonal-plus-low-rank factor takes exponents 1, -1 and -0.5 (a root
        ``R`` with ``R Rᵀ = M⁻¹``, not the symmetric one).
        """
        flat, shape = _check_W(W)
        out = []
        for i, part, block in self._blocks(flat):
            if block is not None:
                out.append(block.times(part, exponent))
                continue
            Q0, Q1, spectrum = self._eigenbasis(i)
            rotated = _rotate(part.reshape(-1, *spectrum.shape), Q0, Q1)
            out.append(_rotate(rotated * spectrum.pow(exponent), Q0, Q1, back=True).flatten(1))
        return torch.cat(out, dim=1).reshape(shape)

    def __matmul__(self, W: Tensor) -> Tensor:
        """``M w`` for a vector or each row of ``W``: ``bmm(W, exponent=1)``."""
        return self.bmm(W, exponent=1)

    def inv_square_form(self, W: Tensor) -> Tensor:
        """``W M⁻¹ Wᵀ`` per batch entry: ``W`` (B, K, P) → (B, K, K)."""
        if W.ndim != 3:
            raise ValueError(f"inv_square_form needs W of shape (B, K, P), got {tuple(W.shape)}.")
        # With M = Q diag(s) Qᵀ: W M⁻¹ Wᵀ = (W Q s^-½)(W Q s^-½)ᵀ, no rotation back needed; a
        # diagonal-plus-low-rank block adds W_b (M_b⁻¹ W_b)ᵀ.
        parts, low_rank = [], 0
        for i, part, block in self._blocks(W.reshape(-1, W.shape[-1])):
            if block is not None:
                solved = block.times(part, -1).reshape(*W.shape[:2], -1)
                low_rank = low_rank + part.reshape(*W.shape[:2], -1) @ solved.mT
                continue
            Q0, Q1, spectrum = self._eigenbasis(i)
            rotated = _rotate(part.reshape(-1, *spectrum.shape), Q0, Q1)
            parts.append((rotated * spectrum.rsqrt()).flatten(1))
        if not parts:
            return low_rank
        half = torch.cat(parts, dim=1).reshape(*W.shape[:2], -1)
        return half @ half.transpose(1, 2) + low_rank

    def diag(self, exponent: float = 1) -> Tensor:
        """Diagonal of ``M^exponent``, shape (P,) (exponent 1 or -1 for a low-rank block)."""
        diags = []
        for i in range(len(self)):
            block = self.low_rank_block(i)
            if block is not None:
                diags.append(block.diagonal(exponent))
                continue
            *Qs, spectrum = self._eigenbasis(i)
            squares = [None if Q is None else Q.square() for Q in Qs]
            diags.append(_rotate(spectrum.pow(exponent), *squares, back=True).flatten())
        return torch.cat(diags)

    def to_matrix(self, exponent: float = 1) -> Tensor:
        """Dense ``M^exponent``, shape (P, P); for tests and small models only."""
        eye = torch.eye(
            sum(self.block_sizes()), dtype=self.deltas.dtype, device=self.deltas.device
        )
        return self.bmm(eye, exponent).T  # the rows of bmm are M^e's columns (R: not symmetric)


class StructuredKron(Kron):
    """A ``Kron`` some of whose first factors are diagonal plus low rank (many outputs).

    Everything is ``Kron``'s; the type tells the fitted curvature apart, and its
    decomposition is a ``StructuredKronDecomposed``.
    """


class StructuredKronDecomposed(KronDecomposed):
    """The decomposition of a ``StructuredKron``: no eigendecomposition to show."""

    @property
    def eigenvectors(self) -> list[list[Tensor | None]]:
        """Not available: a diagonal-plus-low-rank factor is not eigen-decomposed.

        Raises:
            ValueError: Always.
        """
        raise ValueError(
            "a Kronecker precision with a structured (diagonal-plus-low-rank) output factor has "
            "no eigendecomposition (eigenvectors, eigenvalues); use its logdet, bmm, "
            "inv_square_form and diag."
        )

    eigenvalues = eigenvectors


Kron.decomposition = KronDecomposed
StructuredKron.decomposition = StructuredKronDecomposed
