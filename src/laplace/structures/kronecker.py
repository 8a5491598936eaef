r"""Kronecker-factored posterior: ``P = h·(G ⊗ A) + δ`` per parameter tensor.

The curvature is a [`Kron`][laplace.utils.matrix.Kron] while it is summed over batches and a
``KronDecomposed`` once fitted; every posterior quantity then works in
the eigenbasis ``Q_G ⊗ Q_A`` of each block, where ``P`` is diagonal with spectrum
``h·λ_G λ_Aᵀ + δ``. A layer with many outputs (``laplace.structures.large_output``) keeps its
output factor ``G`` diagonal plus low rank (``DiagLowRank``), a
factor kind of the same matrices computed per input eigenvalue; ``kron_block_structure``
configures the structure for it.

With a linear head ``fₙ = W φₙ + b`` (``Jₙ = [I_C ⊗ φₙᵀ, I_C]``,
``laplace.structures.last_layer``) the curvature ``Σₙ Jₙᵀ Mₙ Jₙ`` is ``G ⊗ A`` with ``G = Σₙ
Mₙ``, ``A = Σₙ φₙφₙᵀ / N`` (bias block ``G``), and ``Jₙ P⁻¹ Jₙᵀ`` needs one rotation of the
features, ``φ̃ = Q_Aᵀ φ``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import cache, cached_property, partial
from typing import TYPE_CHECKING, ClassVar, cast

import torch
from torch import Tensor
from typing_extensions import override

from laplace.curvature.engine.per_sample import PerSampleTrace
from laplace.structures import large_output
from laplace.structures.jacobians import HeadFeatures, Jacobian, LayerTrace
from laplace.structures.kron_glm import layerwise_variance
from laplace.structures.posterior import ClosedForm, Posterior, running_sum
from laplace.utils.diag_lowrank import (
    DiagLowRank,
    DiagLowRankBatch,
    LowRankShape,
    factor_from_state,
    factor_shape,
    factor_state,
)
from laplace.utils.matrix import Kron, KronDecomposed, StructuredKron

if TYPE_CHECKING:
    from laplace.curvature.curvature_backend import CurvatureBackend
    from laplace.utils.data import Inputs

__all__ = [
    "EKFACPosterior",
    "HeadStatistics",
    "KronPosterior",
    "kron_block_structure",
    "kron_functional_variance",
    "kron_head_curvature",
    "kron_head_variance",
    "project_eigenvalues",
]


def kron_head_curvature(
    phi: Tensor,
    M: Tensor | DiagLowRankBatch,
    bias: bool,
    n_data: int,
    factor: float,
    max_rank: int | None = None,
) -> Kron:
    """KFAC blocks of a linear head, normalised for a data set of ``n_data`` points.

    Args:
        phi: Features, shape (N, D).
        M: Output-space curvatures, (N, C, C) or diagonal plus low rank (then ``G`` keeps at
            most ``max_rank`` columns, truncated once for the weight and the bias block).
        bias: Whether the head has a bias.
        n_data: Number of data points of the whole data set.
        factor: The backend's loss factor ``c``; blocks are ``[G/√c, √c·A/N]`` as in
            ``laplace.curvature.engine.kfac.kfac``.
        max_rank: See ``M``.
    """
    low_rank = isinstance(M, DiagLowRankBatch)
    G = M.sum(max_rank) if low_rank else M.sum(0)
    root = math.sqrt(factor)
    blocks = [[G / root, (phi.T @ phi) * (root / n_data)]]
    if bias:
        blocks.append([G])
    return (StructuredKron if low_rank else Kron)(blocks)


def kron_head_variance(posterior: KronPosterior, J: HeadFeatures) -> Tensor:
    """``Jₙ P⁻¹ Jₙᵀ`` of a linear head: features (B, D) → (B, C, C) (low-rank ``G``: (B, C)).

    With ``P_W = (Q_G ⊗ Q_A) diag(s) (Q_G ⊗ Q_A)ᵀ`` the weight part is ``Q_G diag(wₙ) Q_Gᵀ``,
    ``wₙᵢ = Σⱼ φ̃ₙⱼ² / sᵢⱼ``; the bias adds ``Q_b diag(1/s_b) Q_bᵀ``. A diagonal-plus-low-rank
    ``G`` gives the variances ``Σⱼ φ̃ₙⱼ² diag(Pⱼ⁻¹)`` (plus the bias block's diagonal).
    """
    precision, phi, bias = posterior.precision, J.phi, J.bias
    weight = precision.low_rank_block(0)
    if weight is not None:
        f_var = (phi @ weight.Q).square() @ weight.inverse_diagonal
        return f_var + precision.low_rank_block(1).inverse_diagonal[0] if bias else f_var
    Q_G, Q_A = precision.factor_bases(0)
    w = (phi @ Q_A).square() @ precision.spectrum(0).reciprocal().T
    f_var = (Q_G * w.unsqueeze(1)) @ Q_G.T
    if bias:
        (Q_b,) = precision.factor_bases(1)
        f_var = f_var + (Q_b * precision.spectrum(1).reciprocal()) @ Q_b.T
    return f_var


def kron_functional_variance(
    trace: PerSampleTrace, precision: KronDecomposed, create_graph: bool = False
) -> Tensor | None:
    """``J P⁻¹ Jᵀ`` (B, C, C) of a Kronecker precision from a recorded forward pass.

    The layer-wise closed forms (``laplace.structures.kron_glm.layerwise_variance``) in the
    eigenbasis of each block.

    Args:
        trace: Recorded forward over the test inputs (all parameters, no subnetwork).
        precision: Posterior precision, one block per parameter in ``trace.engine`` order.
        create_graph: Keep the result differentiable w.r.t. the inputs.

    Returns:
        The covariances, or None when a layer does not see the data points along its first
        dimension or a two-factor block has no Kronecker rule (the caller then falls back to
        Jacobians).
    """

    def block(i: int) -> tuple[list[Tensor | None], Tensor]:
        return precision.factor_bases(i), precision.spectrum(i).reciprocal()

    return layerwise_variance(trace, block, create_graph)


def _trace_variance(posterior: KronPosterior, J: LayerTrace) -> Tensor | None:
    return kron_functional_variance(J.trace, posterior.precision, J.trace.create_graph)


def _kron_numbers(shapes: list, max_rank: int | None, corrected: bool) -> int:
    """Numbers of summed factors of ``shapes`` and their eigendecomposition (from shapes alone).

    A dense (m, m) factor keeps itself, its eigenvectors and eigenvalues (2m² + m); a diagonal
    (m,) one itself and its eigenvalues; a ``LowRankShape`` a ``DiagLowRank`` of ``max_rank``
    columns, twice (the sum and the decomposition's copy). ``corrected``: EKFAC's corrected
    eigenvalues, one per weight of each block.
    """
    total = 0
    for block in shapes:
        for shape in block:
            m = shape[0]
            if isinstance(shape, LowRankShape):
                total += 2 * m * (1 + (max_rank or 0))
            else:
                total += 2 * m if len(shape) == 1 else 2 * m * m + m
        if corrected:
            total += math.prod(shape[0] for shape in block)
    return total


def _low_rank_prediction_numbers(kfacs: list[list[Tensor | DiagLowRank]]) -> int:
    """Numbers a prediction forms for the blocks whose output factor ``G`` is diagonal + low rank.

    Per such block of ``G`` (C × C, rank k) and input factors of D weights
    (``LowRankKronBlock``): the shifted diagonals and the diagonal of the inverse per input
    eigenvalue, (D, C) each, with one (D, C) temporary, and ``G``'s pair products
    (C, k(k+1)/2), kept; forming the largest of those holds two more of its size.
    """
    total = largest = 0
    for block in kfacs:
        G = block[0]
        if isinstance(G, DiagLowRank):
            C, k = len(G.diag), G.rank
            inputs = math.prod(F.shape[0] for F in block[1:])
            total += 3 * inputs * C + C * k * (k + 1) // 2
            largest = max(largest, C * k * (k + 1) // 2)
    return total + 2 * largest


class KronPosterior(Posterior):
    """Gaussian posterior with a block-diagonal Kronecker-factored precision.

    The prior must be constant on every block (a scalar or one value per parameter tensor); the
    per-block value ``δ`` is the prior as given where its entries are the blocks (else it is
    read from ``prior_diag`` at the first entry of each block), so it stays differentiable.
    ``h·H`` (``scaled``) does not depend on the prior: ``with_prior`` shares it. ``log det P``,
    ``J P⁻¹ Jᵀ``, ``Δᵀ P Δ`` and samples ``P^{-1/2} z`` cost a few products with the
    eigenvector matrices of each block; ``J P⁻¹ Jᵀ`` of a recorded pass or of a linear head's
    features needs no Jacobian (``kron_functional_variance``, ``kron_head_variance``).

    Args:
        H: Fitted curvature, a ``KronDecomposed`` (a ``Kron`` is decomposed without damping).
        h_factor: Scalar likelihood factor ``h = 1/(σ²T)``.
        prior_precision: See ``Posterior``; block-wise constant.
        prior_sizes: See ``Posterior``.
    """

    backend_route = "kron"
    closed_forms: ClassVar[dict[type[Jacobian], ClosedForm]] = {
        HeadFeatures: kron_head_variance,
        LayerTrace: _trace_variance,
    }
    rowless_kinds = frozenset({HeadFeatures})
    head_curvature = staticmethod(kron_head_curvature)
    #: Largest number of columns of a diagonal-plus-low-rank output factor kept while summing.
    max_rank: ClassVar[int | None] = None
    #: Layers with more outputs keep such a factor; None: every factor dense.
    low_rank_above: ClassVar[int | None] = None

    prior_free = ("scaled",)
    lighter = (
        "hessian_structure='diag', fewer weights (subset_of_weights='last_layer' or a subnetwork)"
    )
    #: Whether a fit keeps corrected eigenvalues besides the factors' (EKFAC).
    corrected: ClassVar[bool] = False

    def __init__(
        self,
        H: Kron | KronDecomposed,
        h_factor: Tensor,
        prior_precision: Tensor,
        prior_sizes: Sequence[int] | None = None,
    ) -> None:
        if isinstance(H, Kron):
            H = H.decompose()
        super().__init__(H, h_factor, prior_precision, prior_sizes)

    @override
    @classmethod
    def fit_bytes(
        cls, params: Sequence[Tensor], shapes: list | None = None, **options: object
    ) -> int:
        """Per block its summed factors and their eigendecomposition (``_kron_numbers``).

        Args:
            params: See ``Posterior.fit_bytes``.
            shapes: The backend's block shapes, as ``zeros`` (``G ⊗ A`` per weight when None).
            **options: Unused.
        """
        shapes = Kron.shapes_of(params) if shapes is None else shapes
        numbers = _kron_numbers(shapes, cls.max_rank, cls.corrected)
        return numbers * params[0].element_size()

    @override
    def held_bytes(
        self, n_rows: int, n_outputs: int, kind: type[Jacobian], joint: bool = False
    ) -> int:
        """The fitted factors with their eigendecomposition, and what a prediction forms.

        What it forms: from a diagonal-plus-low-rank output factor
        (``_low_rank_prediction_numbers``).
        """
        H, itemsize = self.H, self.itemsize
        if H.factors is not None:
            numbers = _kron_numbers(H.factors.shapes, self.max_rank, self.corrected)
            return (numbers + _low_rank_prediction_numbers(H.factors.kfacs)) * itemsize
        # built from eigenpairs (a per-output posterior's combination): theirs, twice
        pairs = [t for part in H._pairs() for block in part for t in block]
        return 2 * sum(t.numel() * itemsize for t in pairs if isinstance(t, Tensor))

    @override
    @classmethod
    def zeros(cls, params: Sequence[Tensor], shapes: list | None = None) -> Kron:
        """Zero factors of the backend's block ``shapes`` (``G ⊗ A`` per weight when None).

        A [`LowRankShape`][laplace.utils.diag_lowrank.LowRankShape] is a zero
        ``DiagLowRank``.
        """
        device, dtype = params[0].device, params[0].dtype
        if shapes is None:
            return Kron.init_from_model(params, device, dtype)

        def zero(shape: tuple[int, ...]) -> Tensor | DiagLowRank:
            if isinstance(shape, LowRankShape):
                return DiagLowRank.zeros(shape[0], -1, cls.max_rank, device, dtype)
            return torch.zeros(shape, device=device, dtype=dtype)

        kfacs = [[zero(shape) for shape in block] for block in shapes]
        low_rank = any(isinstance(F, DiagLowRank) for block in kfacs for F in block)
        return (StructuredKron if low_rank else Kron)(kfacs)

    @override
    @classmethod
    def batch_curvature(
        cls,
        backend: CurvatureBackend,
        X: Inputs,
        y: Tensor,
        n_data: int,
        total: Kron | None = None,
    ) -> tuple[Tensor, Kron]:
        """``(loss, factors)`` of a batch from the backend's KFAC.

        The native KFAC adds the batch to the running sum ``total`` in place where it can
        (dense factors), and returns it: the fit holds one set of factors, not two.

        Raises:
            ValueError: With low-rank output factors, for a backend whose ``kron`` forms them
                dense (ASDL, BackPACK), naming the alternatives.
        """
        if cls.low_rank_above is None:
            return backend.kron(X, y, N=n_data, **running_sum(backend, "kron", total))
        if not getattr(backend, "native_engine", False):
            raise ValueError(
                "a Kronecker curvature with diagonal-plus-low-rank output factors (many "
                "outputs, see laplace.structures.large_output) needs the native KFAC of "
                "backend=CurvlinopsEF or CurvlinopsGGN with backend_kwargs={'stochastic': "
                f"True}}; {type(backend).__name__} would build the dense output factor. Use "
                "subset_of_weights='last_layer' (one head row per data point; "
                "feature_reduction for sequence features) or hessian_structure='diag' otherwise."
            )
        return backend.kron(
            X, y, N=n_data, low_rank_above=cls.low_rank_above, output_factor_rank=cls.max_rank
        )

    @staticmethod
    def is_finite(H: Kron) -> bool:
        """Whether every factor is finite."""
        # Factors are Gram matrices Σ a aᵀ: a NaN or inf in any a shows on the diagonal, so the
        # traces decide (one short reduction per factor instead of one over every entry).
        factors = [F for block in H.kfacs for F in block]
        traces = [F.diagonal().sum() if F.ndim > 1 else F.sum() for F in factors]
        return bool(torch.stack(traces).isfinite().all())

    @classmethod
    def merge(cls, previous: KronDecomposed, H: Kron, n_before: int, n_data: int) -> Kron:
        """The earlier fit's factors plus ``H``: the factors of one fit on all the data.

        The second factor of a two-factor block is normalised by the data count (the input
        factor of a Linear layer, the gradient factor of an embedding; see
        ``laplace.curvature.engine.kfac``): the earlier ones are renormalised from ``n_before`` to
        ``n_data`` points first.
        """
        scale = n_before / n_data
        factors = cls.factors(previous).kfacs
        return type(H)([[F[0], F[1] * scale] if len(F) == 2 else list(F) for F in factors]) + H

    @staticmethod
    def finalize(H: Kron, damping: bool = False) -> KronDecomposed:
        """The eigendecomposition of the summed factors, computed when first needed.

        Args:
            H: The summed factors.
            damping: See [`KronDecomposed`][laplace.utils.matrix.KronDecomposed].
        """
        return H.decompose(damping=damping, deferred=True)

    @staticmethod
    def factors(H: KronDecomposed) -> Kron:
        """The summed factors a fitted curvature was decomposed from (``finalize`` keeps them)."""
        return cast(Kron, H.factors)

    @classmethod
    def state(cls, H: KronDecomposed) -> list[list[Tensor | dict[str, Tensor]]]:
        """The summed factors, per block (a structured factor as a dict of tensors)."""
        return [[factor_state(F) for F in block] for block in cls.factors(H).kfacs]

    @classmethod
    def load_state(cls, state: object, zeros: Kron, damping: bool = False) -> KronDecomposed:
        """The fitted curvature from saved factors of the shapes of ``zeros``.

        Raises:
            ValueError: If ``state`` is not a list of lists of factors of those shapes and kinds
                (``factor_from_state``).
        """
        shapes = zeros.shapes
        if not isinstance(state, list) or not all(
            isinstance(block, list) and all(isinstance(F, Tensor | dict) for F in block)
            for block in state
        ):
            raise ValueError("state_dict['H'] must be a list of lists of Kronecker factors.")
        found = [[factor_shape(F) for F in block] for block in state]
        if found != shapes:
            raise ValueError(
                f"state_dict['H'] has Kronecker factors of shapes {found}, expected {shapes}."
            )
        kfacs = [
            [factor_from_state(F, like) for F, like in zip(block, zero_block)]
            for block, zero_block in zip(state, zeros.kfacs)
        ]
        return cls.finalize(type(zeros)(kfacs), damping=damping)

    @cached_property
    def given_per_block(self) -> Tensor | None:
        """The prior as given where it is one value for all blocks (1,) or one per block.

        None for a diagonal prior, or layers that are not the blocks.
        """
        prior, sizes = self.prior_precision, self.prior_sizes
        if sizes is None or len(prior) == sum(sizes):
            return None
        return prior if len(prior) == 1 or list(sizes) == self.H.block_sizes() else None

    @cached_property
    def block_deltas(self) -> Tensor:
        """Prior precision of each block, shape (n_blocks,), or (1,) for all of them."""
        given = self.given_per_block
        if given is not None:
            return given
        return torch.stack([block[0] for block in self.prior_diag.split(self.H.block_sizes())])

    @cached_property
    def scaled(self) -> KronDecomposed:
        """``h·H``, without the prior."""
        return self.H * self.h_factor

    @cached_property
    def precision(self) -> KronDecomposed:
        """The posterior precision ``h·H + δ``."""
        return self.scaled + self.block_deltas

    @override
    @property
    def log_det(self) -> Tensor:
        return self.precision.logdet()

    @override
    def square_form(self, delta: Tensor) -> Tensor:
        return delta @ self.precision.bmm(delta, exponent=1)

    @override
    def rows_variance(self, Js: Tensor) -> Tensor:
        return self.precision.inv_square_form(Js)

    @override
    def sample_deviations(self, n_samples: int, generator: torch.Generator | None) -> Tensor:
        z = self._standard_normal((n_samples, sum(self.H.block_sizes())), generator)
        return self.precision.bmm(z, exponent=-0.5)


def _rotated_diagonals(M: Tensor, Q: Tensor | None) -> Tensor:
    """``diag(Qᵀ Mₙ Q)`` of output curvatures M (N, C, C) → (N, C)."""
    return M.diagonal(dim1=1, dim2=2) if Q is None else ((M @ Q) * Q).sum(1)


class HeadStatistics:
    """What a linear head's KFAC is formed from, kept for EKFAC's eigenvalues.

    With ``Jₙ = [I_C ⊗ φₙᵀ, I_C]`` the head's exact curvature is ``Σₙ Mₙ ⊗ φₙφₙᵀ`` (weight) and
    ``Σₙ Mₙ`` (bias), so in the eigenbasis ``Q_G ⊗ Q_A`` its diagonal is
    ``Σₙ diag(Q_Gᵀ Mₙ Q_G) (Q_Aᵀ φₙ)²ᵀ``: no per-sample gradient needed.

    Args:
        phi: Features, (N, D).
        M: Output-space curvatures, (N, C, C).
        bias: Whether the head has a bias.
    """

    def __init__(self, phi: Tensor, M: Tensor, bias: bool) -> None:
        self.phi, self.M, self.bias = phi, M, bias

    @property
    def nbytes(self) -> int:
        """Memory the kept tensors hold."""
        return self.phi.nbytes + self.M.nbytes

    def eigenvalues(self, bases: list[list[Tensor | None]]) -> list[Tensor | None]:
        """The head's blocks' ``diag(Qᵀ H Q)``: (C, D) and, with a bias, (C,); none exact."""
        Q_G, Q_A = bases[0]
        phi = self.phi if Q_A is None else self.phi @ Q_A
        eigenvalues: list[Tensor | None] = [_rotated_diagonals(self.M, Q_G).T @ phi.square()]
        if self.bias:
            eigenvalues.append(_rotated_diagonals(self.M, bases[1][0]).sum(0))
        return eigenvalues


def _rotation_squares(Q_new: Tensor | None, Q_old: Tensor | None) -> Tensor | None:
    """``(Q_newᵀ Q_old)²`` entry by entry (None when both bases are the identity)."""
    if Q_new is None and Q_old is None:
        return None
    if Q_new is None:
        return Q_old.square()
    return Q_new.square().T if Q_old is None else (Q_new.T @ Q_old).square()


def project_eigenvalues(previous: KronDecomposed, basis: KronDecomposed) -> list[Tensor | None]:
    """The diagonal of an earlier EKFAC curvature in another eigenbasis, per block.

    ``diag(Qᵀ Q' diag(s') Q'ᵀ Q) = R₀ s' R₁ᵀ`` with ``Rᵢ = (Qᵢᵀ Qᵢ')²``: how an online fit
    carries the earlier data's corrected eigenvalues ``s'`` (basis ``Q'``) into the eigenbasis
    ``Q`` of the merged factors.

    Args:
        previous: The earlier fit's curvature (eigenbasis and ``corrections``).
        basis: The decomposition whose eigenbasis the result is expressed in.

    Returns:
        Per block the projected eigenvalues in the shape of its spectrum, None where the block
        has no correction.
    """
    projected: list[Tensor | None] = []
    for i, corrected in enumerate(previous.corrections):
        if corrected is None:
            projected.append(None)
            continue
        rotations = [
            _rotation_squares(Q, Q_old)
            for Q, Q_old in zip(basis.factor_bases(i), previous.factor_bases(i), strict=True)
        ]
        if len(rotations) == 1:
            (R,) = rotations
            projected.append(corrected if R is None else R @ corrected)
            continue
        R0, R1 = rotations
        out = corrected if R0 is None else R0 @ corrected
        projected.append(out if R1 is None else out @ R1.T)
    return projected


class EKFACPosterior(KronPosterior):
    """KFAC's eigenbasis with eigenvalues re-fitted to the exact curvature (EKFAC).

    Per Kronecker block with eigenbasis ``Q = Q_G ⊗ Q_A`` the spectrum ``λ_G λ_Aᵀ`` becomes
    ``s = diag(Qᵀ H Q)`` of the block's exact curvature ``H`` (George et al., 2018): the
    Frobenius-closest matrix diagonal in that basis, at the cost of one more tensor of the
    weight's shape. The curvature is a ``KronDecomposed`` with ``corrections``; the prior,
    ``h = 1/(σ²T)`` and damping act on ``s`` as on KFAC's spectrum, so every closed form of
    ``KronPosterior`` holds unchanged. The factors are summed first (``kron``); the fit's
    correction pass (``laplace.core.passes.eigenvalue_correction``) adds up ``s`` over the
    data in their eigenbasis, an online fit's earlier ``s`` projected into it.
    """

    corrected = True

    @cached_property
    def precision(self) -> KronDecomposed:
        """``h·H + δ``; a prior that varies within a block enters as ``diag(Qᵀ diag(p₀) Q)``.

        EKFAC keeps the diagonal of the curvature in the eigenbasis ``Q``; with a diagonal
        prior it keeps the diagonal of the whole precision there: per block
        ``Q diag(h·s + diag(Qᵀ diag(p₀) Q)) Qᵀ``, ``diag(Qᵀ diag(p₀) Q) = (Q₀²)ᵀ p₀ (Q₁²)`` with
        ``p₀`` laid out as the block's spectrum. Scalar and per-tensor priors give KFAC's
        ``h·s + δ`` exactly.

        Raises:
            ValueError: For a prior that varies within a block with ``damping``.
        """
        if self.given_per_block is not None:
            return super().precision
        blocks = self.prior_diag.split(self.H.block_sizes())
        if all(bool((block == block[0]).all()) for block in blocks):
            return super().precision
        if self.H.damping:
            raise ValueError(
                "damping mixes one prior precision per block into the Kronecker factors; a "
                "diagonal prior precision needs damping=False."
            )
        scaled = self.scaled
        spectra = []
        for i, prior in enumerate(blocks):
            spectrum = scaled.spectrum(i)
            projected = prior.reshape(spectrum.shape)
            for dim, Q in enumerate(self.H.factor_bases(i)):
                if Q is not None:
                    projected = (Q.square().T @ projected.movedim(dim, 0)).movedim(0, dim)
            spectra.append(spectrum + projected)
        return KronDecomposed(*self.H._pairs(), None, False, spectra)

    @staticmethod
    def finalize(H: KronDecomposed, damping: bool = False) -> KronDecomposed:
        """The corrected decomposition with the approximation's damping."""
        return H.corrected(H.corrections, damping)

    @classmethod
    def state(cls, H: KronDecomposed) -> dict[str, object]:
        """The summed factors, their eigenpairs and the corrected eigenvalues (empty: None)."""
        like = H.deltas

        def saved(t: Tensor | None) -> Tensor:  # the identity / no correction: empty
            return like.new_empty(0) if t is None else t.detach()

        return {
            "factors": super().state(H),
            "eigenvectors": [[saved(Q) for Q in H.factor_bases(i)] for i in range(len(H))],
            "eigenvalues": H.eigenvalues,
            "corrections": [saved(c) for c in H.corrections],
        }

    @classmethod
    def load_state(cls, state: object, zeros: Kron, damping: bool = False) -> KronDecomposed:
        """The fitted curvature from a saved state of the shapes of ``zeros``.

        The eigenbasis is loaded, not recomputed: the corrected eigenvalues belong to it.

        Raises:
            ValueError: If ``state`` lacks an entry or its shapes differ from ``zeros``'.
        """
        keys = {"factors", "eigenvectors", "eigenvalues", "corrections"}
        if not isinstance(state, dict) or set(state) != keys:
            raise ValueError(f"state_dict['H'] of an EKFAC posterior must hold {sorted(keys)}.")
        decomposed = KronPosterior.load_state(state["factors"], zeros, damping)
        like = zeros.kfacs[0][0]

        def moved(t: Tensor) -> Tensor | None:
            return None if t.numel() == 0 else t.to(like.device, like.dtype)

        vectors = [[moved(Q) for Q in block] for block in state["eigenvectors"]]
        values = [[moved(v) for v in block] for block in state["eigenvalues"]]
        corrections = [moved(c) for c in state["corrections"]]
        shapes = [[tuple(F.shape[:1]) for F in block] for block in zeros.kfacs]
        found = [[tuple(v.shape) for v in block] for block in values]
        spectra = [tuple(s[0] for s in block) for block in shapes]
        corrected = [c is None or tuple(c.shape) == s for c, s in zip(corrections, spectra)]
        if found != shapes or len(corrections) != len(spectra) or not all(corrected):
            raise ValueError(
                "state_dict['H'] holds EKFAC eigenvalues of other shapes than the model's "
                f"blocks {spectra}."
            )
        out = KronDecomposed(vectors, values, None, damping, corrections)
        out.factors = decomposed.factors
        return out


@cache
def _low_rank_outputs(max_rank: int | None, low_rank_above: int) -> type[KronPosterior]:
    """``KronPosterior`` keeping output factors of more than ``low_rank_above`` outputs low rank.

    Its only closed form is a linear head's output variances (over all weights the GLM
    predictive goes through dense rows or is refused).
    """
    attributes = {
        "max_rank": max_rank,
        "low_rank_above": low_rank_above,
        "head_curvature": partial(kron_head_curvature, max_rank=max_rank),
        "closed_forms": {HeadFeatures: kron_head_variance},
    }
    return type("StructuredKronPosterior", (KronPosterior,), attributes)


def kron_block_structure(
    structure: type[Posterior], shapes: list[list[tuple[int, ...]]], rank: int | None
) -> type[Posterior]:
    """The posterior structure of Kronecker blocks of ``shapes`` (a backend's ``kron_shapes``).

    Where a factor is a ``LowRankShape`` (a layer with more
    outputs than ``LARGE_OUTPUT_THRESHOLD``) a Kronecker
    posterior keeps diagonal-plus-low-rank output factors of at most ``rank`` low-rank columns.
    """
    low_rank = any(isinstance(shape, LowRankShape) for block in shapes for shape in block)
    if low_rank and structure is KronPosterior:
        return _low_rank_outputs(rank, large_output.LARGE_OUTPUT_THRESHOLD)
    return structure
