r"""A linear last layer ``fₙ = W φₙ + b``: its rows, output curvatures, Jacobians.

With ``θ = (vec_row(W), b)`` the Jacobian is ``Jₙ = [I_C ⊗ φₙᵀ, I_C]``, so any curvature
``Σₙ Jₙᵀ Mₙ Jₙ`` and the GLM output covariance ``Jₙ P⁻¹ Jₙᵀ`` are functions of the features:
no per-sample autograd and no (B, C, P) Jacobian is involved.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, cast

import torch
from torch import Tensor, nn

from laplace.curvature import CurvatureInterface
from laplace.structures.large_output import is_large_output
from laplace.structures.posterior import Curvature, Posterior
from laplace.utils.diag_lowrank import DiagLowRankBatch

if TYPE_CHECKING:
    from laplace.curvature.curvature_backend import CurvatureBackend
    from laplace.likelihoods.likelihood_model import LikelihoodModel

__all__ = [
    "HeadCurvature",
    "cat_output_curvatures",
    "head_curvature",
    "head_features",
    "head_rows",
    "output_curvature",
]


def output_curvature(
    backend: CurvatureBackend, f: Tensor, y: Tensor
) -> tuple[Tensor, Tensor | DiagLowRankBatch]:
    """Summed batch loss and output-space curvature ``Mₙ = Σₖ vₙₖ vₙₖᵀ`` of a backend.

    Above the large-output threshold ``Mₙ = diag(dₙ) + s·Vₙ Vₙᵀ``: the exact GGN takes its
    likelihood's own form (``structured_output_hessian``, ``(p, p, −1)`` for a softmax, O(C)
    per point), other curvatures are their few output columns (``d = 0``, ``s = +1``).

    Args:
        backend: A GGN or EF ``CurvatureInterface``; its output columns
            ``vₖ`` (``curvature_columns``) define the curvature.
        f: Detached outputs, shape (B, C).
        y: Targets of the batch (rows an ``ignore_index`` drops get zero curvature).

    Returns:
        The loss (a scalar) and ``M`` of shape (B, C, C), or diagonal plus low rank.
    """
    loss = backend.batch_loss(f, y)
    if is_large_output(f.shape[-1]) and backend.separable_columns:
        M = backend.fit_likelihood.structured_output_hessian(f)
        keep = backend.fit_likelihood.layout(f.shape, y).kept(y)
        return loss, M if keep is None else M.masked(keep)
    V = cast(Tensor, backend.curvature_columns(f, y)).movedim(0, -1)  # rows (B, C): (K, B, C)
    if is_large_output(f.shape[-1]):
        return loss, DiagLowRankBatch(V.new_zeros(V.shape[:2]), V, 1)
    return loss, V @ V.transpose(1, 2)


def head_rows(
    likelihood: LikelihoodModel,
    backend: CurvatureBackend,
    layer: nn.Linear,
    f: Tensor,
    phi: Tensor,
    y: Tensor,
) -> tuple[Tensor, Tensor, Tensor] | None:
    """Outputs, features and targets of one batch as rows of the head, where closed forms apply.

    Outputs with extra dimensions (B, …) whose head sees one feature vector per position
    become independent rows (``laplace.utils.outputs``, ``head_features``): the head's
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


#: Rows at most ``head_features`` recomputes to check that features and outputs match.
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


#: A closed form ``(φ (N, D), M (N, C, C), bias, n_data, factor) -> curvature`` of the head in a
#: structure's form, equal to its ``backend_route``; a posterior structure names its own as its
#: ``head_curvature`` class attribute.
HeadCurvature = Callable[..., Curvature]


def head_curvature(structure: type[Posterior], backend: CurvatureBackend) -> HeadCurvature | None:
    """The closed form of the backend's curvature of a linear head in ``structure``'s form.

    One exists where the backend's route for the structure is the native one of
    ``CurvatureInterface``, ``Σₙ Jₙᵀ Mₙ Jₙ`` over the backend's
    deterministic curvature columns (GGN and EF families): not for routes of their own (ASDL,
    BackPACK, the Hessian), the Monte-Carlo Fisher (its columns are sampled per batch), or the
    per-output structures (they keep each output's curvature).

    Args:
        structure: The posterior structure (a ``Posterior`` class);
            its ``head_curvature`` attribute names its closed form, if it has one.
        backend: The curvature backend instance.

    Returns:
        ``(φ, M, bias, n_data, factor) -> curvature`` (see ``HeadCurvature``), or None.
    """
    closed_form = structure.head_curvature
    if closed_form is None:
        return None
    route = structure.backend_route
    backend_cls = type(backend)
    native = (
        getattr(backend_cls, route) is getattr(CurvatureInterface, route)
        and backend_cls.row_columns is not CurvatureInterface.row_columns
        and not getattr(backend, "stochastic", False)
    )
    return closed_form if native else None
