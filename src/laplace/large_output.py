r"""Last-layer closed forms for many outputs (LLM vocabularies): no C × C matrix anywhere.

Above :data:`LARGE_OUTPUT_THRESHOLD` outputs a last-layer Laplace keeps every output-space
curvature as a diagonal plus a low-rank term (:mod:`laplace.utils.diag_lowrank`): per point
``Mₙ = diag(dₙ) + s·Vₙ Vₙᵀ`` (the softmax GGN is ``diag(pₙ) − pₙpₙᵀ``, i.e. ``pₙ`` itself), and
for Kronecker factors the sum ``G = diag(Σ pₙ) − P Pᵀ``. What each structure then does:

- **kron** (:class:`~laplace.lllaplace.KronLLLaplace`): the output-side factor of the weight and
  bias blocks is a ``DiagLowRank`` whose low-rank part keeps at most ``output_factor_rank``
  columns (default :data:`OUTPUT_FACTOR_RANK`): exact while the data give no more than that
  rank, otherwise the top singular directions of ``P`` are kept and ``G`` is over-estimated by
  a positive semi-definite ``R`` of trace ``dropped`` (so ``0 ≤ log det P_approx − log det P ≤
  h·(tr A·tr R_weight + tr R_bias) / δ`` for prior precision ``δ``, ``h = 1/(σ²T)`` and input
  factor ``A``).
  Log-determinant, marginal likelihood, predictive variances and samples go through the
  structure (:class:`~laplace.utils.matrix.StructuredKronDecomposed`): the cost of a
  marginal-likelihood step is O(D·C·k²) for D features, C classes and rank k.
- **diag**: the curvature needs only ``diag(Mₙ)`` (``p − p²``); exact.
- **full**: the dense (P, P) curvature is built exactly from the structure (a dense P × P that
  cannot fit in memory is refused before any work, see :mod:`laplace.posteriors.dense`).
- **predictive**: only the output variances (B, C) are computed, never a (B, C, C) covariance.
  ``link_approx="probit"`` and ``"bridge"`` / ``"bridge_norm"`` use them (the bridge then
  conditions the diagonal Gaussian on ``1ᵀf = 0``); ``"mc"``, ``joint=True`` and regression
  without ``diagonal_output=True`` need the covariance between outputs and are refused with the
  alternatives (``pred_type="nn"`` samples the head's weights from the posterior through the
  structure, the same predictive as the GLM for a linear head).

At or below the threshold everything is computed as before (dense output curvatures).
"""

from __future__ import annotations

import torch
from torch import Tensor

from laplace.curvature import CurvatureInterface
from laplace.utils.diag_lowrank import DiagLowRankBatch
from laplace.utils.matrix import StructuredKron, StructuredKronDecomposed

__all__ = [
    "LARGE_OUTPUT_THRESHOLD",
    "OUTPUT_FACTOR_RANK",
    "full_curvature",
    "full_head_variance",
    "glm_refusal",
    "is_large_output",
    "kron_curvature",
    "kron_head_variance",
    "output_curvatures",
    "variances_only_reason",
]

#: Number of outputs C above which last-layer curvatures are kept diagonal plus low rank and the
#: GLM predictive computes only output variances (a dense C × C float32 matrix is 16 MiB here,
#: a batch of 100 points' (C, C) output Hessians 1.6 GiB).
LARGE_OUTPUT_THRESHOLD = 2048

#: Default largest rank of the low-rank term of a Kronecker output factor above the threshold.
OUTPUT_FACTOR_RANK = 32

#: Rows of the low-rank part of a dense head curvature formed at once (numbers).
_ROW_BUDGET = 2**22


def is_large_output(n_outputs: int) -> bool:
    """Whether ``n_outputs`` exceeds :data:`LARGE_OUTPUT_THRESHOLD`."""
    return n_outputs > LARGE_OUTPUT_THRESHOLD


def variances_only_reason(n_outputs: int) -> str | None:
    """Why a last layer's GLM predictive gives only output variances; None at or below."""
    if not is_large_output(n_outputs):
        return None
    return (
        f"the model has C={n_outputs} outputs, more than LARGE_OUTPUT_THRESHOLD="
        f"{LARGE_OUTPUT_THRESHOLD}, so the last-layer GLM predictive computes only output "
        "variances (B, C), no (B, C, C) covariance"
    )


def glm_refusal(n_outputs: int) -> str | None:
    """Why a GLM predictive without a last layer's closed form is refused; None at or below.

    Above the threshold it would need C Jacobian rows per point (C backward passes) and a
    (B, C, C) covariance; only the last layer's closed forms give output variances.
    """
    if not is_large_output(n_outputs):
        return None
    return (
        f"the model has C={n_outputs} outputs, more than LARGE_OUTPUT_THRESHOLD="
        f"{LARGE_OUTPUT_THRESHOLD}: the GLM predictive over these weights needs C Jacobian rows "
        "per point (C backward passes) and a (B, C, C) covariance. Use pred_type='nn' "
        "(link_approx='mc'; one forward pass per weight sample) or subset_of_weights="
        "'last_layer' (output variances in closed form)."
    )


def output_curvatures(backend: CurvatureInterface, f: Tensor, y: Tensor) -> DiagLowRankBatch:
    """A backend's per-point output curvatures ``Mₙ`` as ``diag(dₙ) + s·Vₙ Vₙᵀ``.

    The exact GGN takes its likelihood's own form (``structured_output_hessian`` of
    ``backend.fit_likelihood``: ``(p, p, −1)`` for a softmax, O(C) per point instead of C − 1
    columns of C); other curvatures (empirical Fisher, Monte-Carlo GGN) are their few output
    columns ``vₖ`` (``d = 0``, ``s = +1``).

    Args:
        backend: A GGN or EF backend with the native curvature routes.
        f: Detached outputs of the batch, shape (B, C).
        y: Targets of the batch (rows an ``ignore_index`` drops get zero curvature).
    """
    if backend.separable_columns:  # the exact GGN: columns per row are Λ^½
        M = backend.fit_likelihood.structured_output_hessian(f)
        keep = backend.fit_likelihood.layout(f.shape, y).kept(y)
        return M if keep is None else M.masked(keep)
    V = backend.curvature_columns(f, y).movedim(0, -1)  # rows (B, C): a (K, B, C) tensor
    return DiagLowRankBatch(V.new_zeros(V.shape[:2]), V, 1)


def full_curvature(phi: Tensor, M: DiagLowRankBatch, bias: bool) -> Tensor:
    """Dense ``Σₙ Jₙᵀ Mₙ Jₙ`` of a linear head from structured output curvatures, (P, P).

    With ``Jₙ = [I_C ⊗ φₙᵀ, I_C]``: the diagonal part gives the blocks ``Σₙ d_nc φₙφₙᵀ`` on the
    class diagonal (and ``Σₙ d_nc φₙ``, ``Σₙ d_nc`` with the bias); the low-rank part is the Gram
    matrix of the rows ``Jₙᵀ vₙₖ = [vₙₖ ⊗ φₙ, vₙₖ]``.

    Args:
        phi: Features, shape (N, D).
        M: Output curvatures of the N points.
        bias: Whether the head has a bias.
    """
    n_points, D = phi.shape
    C, K = M.columns.shape[1:]
    n_w = C * D
    size = n_w + (C if bias else 0)
    H = phi.new_zeros(size, size)
    classes = torch.arange(C, device=phi.device)
    H[:n_w, :n_w].view(C, D, C, D)[classes, :, classes, :] = torch.einsum(
        "nc,nd,ne->cde", M.diag, phi, phi
    )
    if bias:
        cross = M.diag.T @ phi
        H[:n_w, n_w:].view(C, D, C)[classes, :, classes] = cross
        H[n_w:, :n_w].view(C, C, D)[classes, classes, :] = cross
        H[n_w + classes, n_w + classes] = M.diag.sum(0)
    chunk = max(1, _ROW_BUDGET // max(1, K * size))
    for start in range(0, n_points, chunk):
        V, p = M.columns[start : start + chunk], phi[start : start + chunk]
        rows = torch.einsum("nck,nd->nkcd", V, p).reshape(-1, n_w)
        if bias:
            rows = torch.cat([rows, V.transpose(1, 2).reshape(-1, C)], dim=1)
        H.addmm_(rows.T, rows, alpha=M.sign)
    return H


def kron_curvature(
    phi: Tensor,
    M: DiagLowRankBatch,
    bias: bool,
    n_data: int,
    factor: float,
    max_rank: int | None = None,
) -> StructuredKron:
    """KFAC blocks of a linear head with structured output factors ``G = Σₙ Mₙ``.

    Arguments as :func:`laplace.last_layer.kron_curvature`; ``G`` keeps at most ``max_rank``
    low-rank columns (truncated once for the weight and the bias block).
    """
    G = M.sum(max_rank)
    root = factor**0.5
    blocks = [[G / root, (phi.T @ phi) * (root / n_data)]]
    if bias:
        blocks.append([G])
    return StructuredKron(blocks)


def full_head_variance(covariance: Tensor, phi: Tensor, n_out: int, bias: bool) -> Tensor:
    """Output variances ``diag(Jₙ Σ Jₙᵀ)`` from the dense covariance ``Σ``: (B, D) → (B, C)."""
    D, n_w = phi.shape[1], n_out * phi.shape[1]
    S = covariance
    class_blocks = S[:n_w, :n_w].reshape(n_out, D, n_out, D).diagonal(dim1=0, dim2=2)
    f_var = torch.einsum("nd,dec,ne->nc", phi, class_blocks, phi)
    if bias:
        cross = S[:n_w, n_w:].reshape(n_out, D, n_out).diagonal(dim1=0, dim2=2)
        f_var = f_var + 2 * phi @ cross + S[n_w:, n_w:].diagonal()
    return f_var


def kron_head_variance(
    precision: StructuredKronDecomposed, phi: Tensor, n_out: int, bias: bool
) -> Tensor:
    """Output variances ``diag(Jₙ P⁻¹ Jₙᵀ)`` with structured output factors: (B, D) → (B, C).

    ``Σⱼ φ̃ₙⱼ² diag(Pⱼ⁻¹)`` with ``φ̃ = Q_Aᵀ φ`` (plus the bias block's diagonal); the diagonals
    of the ``Pⱼ⁻¹`` are computed once per precision.
    """
    weight = precision.low_rank_block(0)
    f_var = (phi @ weight.Q).square() @ weight.inverse_diagonal
    if bias:
        f_var = f_var + precision.low_rank_block(1).inverse_diagonal[0]
    return f_var
