r"""Closed forms for a linear last layer ``fₙ = W φₙ + b``: curvature and GLM output covariance.

With the head's weights flattened as ``θ = (vec_row(W), b)`` (W of shape (C, D) row-major, then
b of shape (C,)), the Jacobian of the outputs is ``Jₙ = [I_C ⊗ φₙᵀ, I_C]``. Any curvature of the
form ``Σₙ Jₙᵀ Mₙ Jₙ`` with an output-space matrix ``Mₙ = Σₖ vₙₖ vₙₖᵀ`` (the output Hessian
``Λₙ`` for the GGN, ``∇ℓ ∇ℓᵀ`` for the empirical Fisher) is then a function of the features:

- weight block ``Σₙ Mₙ ⊗ φₙ φₙᵀ``, weight–bias block ``Σₙ Mₙ ⊗ φₙ``, bias block ``Σₙ Mₙ``;
- diagonal ``Σₙ diag(Mₙ) ⊗ φₙ²`` and ``Σₙ diag(Mₙ)``;
- KFAC ``G ⊗ A`` with ``G = Σₙ Mₙ`` and ``A = Σₙ φₙ φₙᵀ / N`` (split between the factors as
  :mod:`laplace.curvature.kfac` does, so the numbers are identical), bias block ``G``.

The GLM output covariance ``Jₙ Σ Jₙᵀ`` of a posterior covariance ``Σ`` is likewise
``Σ_{c,c'} φₙᵀ Σ_{(c,·),(c',·)} φₙ`` plus bias terms; for a Kronecker posterior it costs one
rotation of the features. No per-sample autograd and no (B, C, P) Jacobian is involved.

Above :data:`~laplace.large_output.LARGE_OUTPUT_THRESHOLD` outputs, ``Mₙ`` is kept as a
diagonal plus low rank (a :class:`~laplace.utils.diag_lowrank.DiagLowRankBatch`) and the
functions here hand over to :mod:`laplace.large_output` (output variances (B, C) only).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from laplace import large_output
from laplace.curvature import CurvatureInterface
from laplace.large_output import is_large_output
from laplace.utils.diag_lowrank import DiagLowRankBatch
from laplace.utils.matrix import Kron, KronDecomposed

__all__ = [
    "DIAG_HEAD_CURVATURE",
    "FULL_HEAD_CURVATURE",
    "KRON_HEAD_CURVATURE",
    "HeadCurvature",
    "cat_output_curvatures",
    "diag_curvature",
    "diag_head_variance",
    "full_curvature",
    "full_head_variance",
    "head_curvature",
    "head_features",
    "head_jacobians",
    "head_rows",
    "kron_curvature",
    "kron_head_variance",
    "output_curvature",
]


def output_curvature(
    backend: Any, f: Tensor, y: Tensor
) -> tuple[Tensor, Tensor | DiagLowRankBatch]:
    """Summed batch loss and output-space curvature ``Mₙ = Σₖ vₙₖ vₙₖᵀ`` of a backend.

    Args:
        backend: A GGN or EF :class:`~laplace.curvature.CurvatureInterface`; its output columns
            ``vₖ`` (``curvature_columns``) define the curvature.
        f: Detached outputs, shape (B, C).
        y: Targets of the batch.

    Returns:
        The loss (a scalar) and ``M`` of shape (B, C, C), or above the large-output threshold
        a diagonal plus low rank (:func:`laplace.large_output.output_curvatures`).
    """
    if is_large_output(f.shape[-1]):
        return backend.batch_loss(f, y), large_output.output_curvatures(backend, f, y)
    V = backend.curvature_columns(f, y).movedim(0, -1)  # rows (B, C): a (K, B, C) tensor
    return backend.batch_loss(f, y), V @ V.transpose(1, 2)


def head_rows(
    likelihood: Any, backend: Any, layer: nn.Linear, f: Tensor, phi: Tensor, y: Tensor
) -> tuple[Tensor, Tensor, Tensor] | None:
    """Outputs, features and targets of one batch as rows of the head, where closed forms apply.

    Outputs with extra dimensions (B, …) whose head sees one feature vector per position
    become independent rows (:mod:`laplace.outputs`, :func:`head_features`): the head's
    curvature is a sum over rows when the backend's columns are per row (the exact GGN; the
    empirical and Monte-Carlo Fisher of the summed loss of a data point are not).

    Args:
        likelihood: The likelihood object (its ``layout``).
        backend: The curvature backend (its ``separable_columns``).
        layer: The head.
        f: Outputs (B, …).
        phi: Head inputs.
        y: Targets.

    Returns:
        ``(f (R, C), φ (R, D), y)`` of the rows, or None (the caller then uses autograd).
    """
    layout = likelihood.layout(f.shape, y)
    if layout.plain:
        features = phi if phi.dim() == 2 and len(phi) == len(f) else None
    elif backend.separable_columns:
        features = head_features(layer, phi, layout.rows(f), layout.n_positions)
    else:
        return None
    return None if features is None else (layout.rows(f), features, layout.targets(y))


#: Rows at most :func:`head_features` recomputes to check that features and outputs match.
CHECKED_ROWS = 16


def head_features(layer: nn.Linear, phi: Tensor, rows: Tensor, n_positions: int) -> Tensor | None:
    """Head inputs (B, *positions, D) as the rows (B·T, D) of outputs with extra dimensions.

    The head applies to every position (token features (B, T, D) for logits (B, T, C); pixel
    features (B, H, W, D) for logits moved to (B, C, H, W)); its positions must be the outputs'
    positions in the same order, with the class dimension the head's outputs. That is checked
    on a few rows (the head recomputed there) instead of assumed.

    Args:
        layer: The head.
        phi: Its inputs.
        rows: The outputs' rows (B·T, C) (``OutputLayout.rows``).
        n_positions: T.

    Returns:
        The feature rows, or None when they are not the rows of the outputs.
    """
    batch = len(rows) // max(1, n_positions)
    if phi.dim() < 3 or phi.shape[0] != batch or math.prod(phi.shape[1:-1]) != n_positions:
        return None
    features = phi.reshape(-1, phi.shape[-1])
    if layer.out_features != rows.shape[-1]:
        return None
    step = max(1, len(rows) // CHECKED_ROWS)
    with torch.no_grad():
        recomputed, expected = layer(features[::step]), rows[::step].detach()
    tolerance = 1e-4 * float(expected.abs().max().clamp_min(1))
    return features if torch.allclose(recomputed, expected, rtol=1e-4, atol=tolerance) else None


def cat_output_curvatures(Ms: list[Tensor | DiagLowRankBatch]) -> Tensor | DiagLowRankBatch:
    """The output curvatures of several batches (of one kind) together."""
    return DiagLowRankBatch.cat(Ms) if isinstance(Ms[0], DiagLowRankBatch) else torch.cat(Ms)


def full_curvature(phi: Tensor, M: Tensor, bias: bool) -> Tensor:
    """Dense ``Σₙ Jₙᵀ Mₙ Jₙ`` of a linear head, shape (P, P).

    One weighted Gram matrix ``Φᵀ diag(M_{:,c,c'}) Φ`` per class pair ``c ≤ c'`` (pairs whose
    weights are all zero, e.g. off-diagonal pairs for regression, are skipped).

    Args:
        phi: Features, shape (N, D).
        M: Output-space curvature, shape (N, C, C).
        bias: Whether the head has a bias.
    """
    if isinstance(M, DiagLowRankBatch):
        return large_output.full_curvature(phi, M, bias)
    D, C = phi.shape[1], M.shape[-1]
    n_w = C * D
    H = phi.new_zeros(n_w + (C if bias else 0), n_w + (C if bias else 0))
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


def diag_curvature(phi: Tensor, M: Tensor, bias: bool) -> Tensor:
    """Diagonal of ``Σₙ Jₙᵀ Mₙ Jₙ`` of a linear head, shape (P,).

    Args:
        phi: Features, shape (N, D).
        M: Output-space curvature, shape (N, C, C).
        bias: Whether the head has a bias.
    """
    m = M.diagonal() if isinstance(M, DiagLowRankBatch) else M.diagonal(dim1=1, dim2=2)
    parts = [(m.T @ phi.square()).flatten()]
    if bias:
        parts.append(m.sum(0))
    return torch.cat(parts)


def kron_curvature(phi: Tensor, M: Tensor, bias: bool, n_data: int, factor: float) -> Kron:
    """KFAC blocks of a linear head, normalised for a data set of ``n_data`` points.

    (Structured output curvatures have their own closed form,
    :func:`laplace.large_output.kron_curvature`.)

    Args:
        phi: Features, shape (N, D).
        M: Output-space curvature, shape (N, C, C).
        bias: Whether the head has a bias.
        n_data: Number of data points of the whole data set.
        factor: The backend's loss factor ``c``; blocks are ``[G/√c, √c·A/N]`` as in
            :func:`laplace.curvature.kfac.kfac`.
    """
    G = M.sum(0)
    root = math.sqrt(factor)
    blocks = [[G / root, (phi.T @ phi) * (root / n_data)]]
    if bias:
        blocks.append([G])
    return Kron(blocks)


#: A closed form ``(φ (N, D), M (N, C, C), bias, n_data, factor) -> curvature`` of the head in a
#: structure's form, with the backend route (``"full"``, ``"diag"``, ``"kron"``) it equals.
HeadCurvature = tuple[str, Callable[..., Any]]

#: The closed forms of the head's curvature; a posterior structure names its own as its
#: ``head_curvature`` class attribute.
FULL_HEAD_CURVATURE: HeadCurvature = (
    "full",
    lambda phi, M, bias, n_data, factor: full_curvature(phi, M, bias),
)
DIAG_HEAD_CURVATURE: HeadCurvature = (
    "diag",
    lambda phi, M, bias, n_data, factor: diag_curvature(phi, M, bias),
)
KRON_HEAD_CURVATURE: HeadCurvature = ("kron", kron_curvature)


def head_curvature(structure: type, backend: Any) -> Callable[..., Any] | None:
    """The closed form of the backend's curvature of a linear head in ``structure``'s form.

    One exists where the backend's route for the structure is the native one of
    :class:`~laplace.curvature.CurvatureInterface`, ``Σₙ Jₙᵀ Mₙ Jₙ`` over the backend's
    deterministic curvature columns (GGN and EF families): not for routes of their own (ASDL,
    BackPACK, the Hessian), the Monte-Carlo Fisher (its columns are sampled per batch), or the
    per-output structures (they keep each output's curvature).

    Args:
        structure: The posterior structure (a :class:`~laplace.posteriors.Posterior` class);
            its ``head_curvature`` attribute names its closed form, if it has one.
        backend: The curvature backend instance.

    Returns:
        ``(φ, M, bias, n_data, factor) -> curvature`` (see :data:`HeadCurvature`), or None.
    """
    entry = getattr(structure, "head_curvature", None)
    if entry is None:
        return None
    route, closed_form = entry
    backend_cls = type(backend)
    native = (
        getattr(backend_cls, route) is getattr(CurvatureInterface, route)
        and backend_cls.row_columns is not CurvatureInterface.row_columns
        and not getattr(backend, "stochastic", False)
    )
    return closed_form if native else None


def head_jacobians(phi: Tensor, n_out: int, bias: bool) -> Tensor:
    """``Jₙ = [I_C ⊗ φₙᵀ, I_C]``, shape (B, C, P)."""
    B = phi.shape[0]
    eye = torch.eye(n_out, dtype=phi.dtype, device=phi.device)
    Js = (eye[None, :, :, None] * phi[:, None, None, :]).reshape(B, n_out, -1)
    if bias:
        Js = torch.cat([Js, eye.expand(B, -1, -1)], dim=2)
    return Js


def full_head_variance(covariance: Tensor, phi: Tensor, n_out: int, bias: bool) -> Tensor:
    """``Jₙ Σ Jₙᵀ`` from the dense posterior covariance ``Σ`` (P, P): (B, D) → (B, C, C).

    Above the large-output threshold only the variances (B, C).
    """
    if is_large_output(n_out):
        return large_output.full_head_variance(covariance, phi, n_out, bias)
    D, C = phi.shape[1], n_out
    n_w = C * D
    S_W = covariance[:n_w, :n_w].reshape(C, D, C, D)
    left = torch.einsum("nd,cdke->ncke", phi, S_W)
    f_var = torch.einsum("ncke,ne->nck", left, phi)
    if bias:
        cross = phi @ covariance[:n_w, n_w:].reshape(C, D, C).permute(1, 0, 2).reshape(D, C * C)
        cross = cross.reshape(-1, C, C)
        f_var = f_var + cross + cross.transpose(1, 2) + covariance[n_w:, n_w:]
    return f_var


def diag_head_variance(variance: Tensor, phi: Tensor, n_out: int, bias: bool) -> Tensor:
    """``Jₙ diag(σ²) Jₙᵀ`` from the posterior variances σ² (P,): (B, D) → (B, C, C).

    The result is diagonal in the outputs; above the large-output threshold only the variances
    (B, C).
    """
    D = phi.shape[1]
    f_var = phi.square() @ variance[: n_out * D].reshape(n_out, D).T
    if bias:
        f_var = f_var + variance[n_out * D :]
    return f_var if is_large_output(n_out) else torch.diag_embed(f_var)


def kron_head_variance(precision: KronDecomposed, phi: Tensor, n_out: int, bias: bool) -> Tensor:
    """``Jₙ P⁻¹ Jₙᵀ`` for a Kronecker precision, in the eigenbasis: (B, D) → (B, C, C).

    With ``P_W = (Q_G ⊗ Q_A) diag(s) (Q_G ⊗ Q_A)ᵀ`` and ``φ̃ = Q_Aᵀ φ``, the weight part is
    ``Q_G diag(wₙ) Q_Gᵀ`` with ``wₙᵢ = Σⱼ φ̃ₙⱼ² / sᵢⱼ``; the bias adds ``Q_b diag(1/s_b) Q_bᵀ``.
    (A structured output factor has its own closed form, :func:`laplace.large_output.
    kron_head_variance`.)
    """
    Q_G, Q_A = precision.eigenvectors[0]
    w = (phi @ Q_A).square() @ precision.spectrum(0).reciprocal().T
    f_var = (Q_G * w.unsqueeze(1)) @ Q_G.T
    if bias:
        (Q_b,) = precision.eigenvectors[1]
        f_var = f_var + (Q_b * precision.spectrum(1).reciprocal()) @ Q_b.T
    return f_var
