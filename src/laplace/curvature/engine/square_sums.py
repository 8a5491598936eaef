"""Squared per-sample gradients summed over a batch, without the per-sample gradients.

The diagonal curvature ``Σₖ Σₙ (∂θ (vₙₖᵀ fₙ))²`` of some layers follows from a chunk of output
gradients (K, B, …) of the columns ``vₖ`` and the layer's recorded call directly
(``SQUARE_SUM_RULES``): for a linear layer on (B, D_in) inputs the squared weight gradient
summed over samples and columns is ``(Σₖ gₖ²)ᵀ a²``; an embedding's sums its positions per
(sample, token) pair (``row_token_pairs``) and never forms a (B, V, D) gradient. Other layers
go through ``laplace.curvature.engine.layer_rules``' per-sample gradients.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from laplace.curvature.engine.layer_rules import ModuleCall

__all__ = ["SQUARE_SUM_RULES", "SquareSumRule", "row_token_pairs"]


def row_token_pairs(tokens: Tensor, n_tokens: int) -> tuple[Tensor, Tensor, Tensor]:
    """The distinct (row, token) pairs of token indices (R, T), as keys ``row·V + token``.

    A row's gradient w.r.t. an embedding sums the positions holding the same token, so the
    embedding's per-row quantities live on these pairs (never an (R, V, D) tensor).

    Returns:
        The keys (n_pairs,) (``key % V`` the token, ``key // V`` the row), the pair of every
        entry of ``tokens`` (R·T,), and the count of every pair (n_pairs,).
    """
    rows = torch.arange(len(tokens), device=tokens.device).unsqueeze(1)
    keys = tokens.reshape(len(tokens), -1) + n_tokens * rows
    pairs, inverse, counts = torch.unique(keys, return_inverse=True, return_counts=True)
    return pairs, inverse.flatten(), counts


@dataclass(frozen=True)
class SquareSumRule:
    """How a layer's ``Σₖₙ (∂θ)²`` follows from its output gradients, a chunk of columns at a time.

    Attributes:
        applies: Whether the rule takes this call.
        partial: A chunk's statistic from the output gradients (K, B, …); they add up.
        finish: The squared gradients per parameter name from the summed statistic.
    """

    applies: Callable[[ModuleCall], bool]
    partial: Callable[[ModuleCall, Tensor], Tensor]
    finish: Callable[[ModuleCall, Tensor], dict[str, Tensor]]


def _embedding_square_sum(call: ModuleCall, grads: Tensor) -> Tensor:
    """Σₖₙ squared per-sample gradients of an Embedding from output gradients (K, B, …, D).

    Each (column, sample) is a row of ``row_token_pairs``: its positions are summed per
    token, squared and added to the token's row of the result (V, D).
    """
    m, tokens = call.module, call.args[0]
    D, V = m.embedding_dim, m.num_embeddings
    rows = tokens.reshape(1, len(tokens), -1).expand(len(grads), -1, -1).flatten(0, 1)
    pairs, inverse, _ = row_token_pairs(rows, V)
    summed = grads.new_zeros(len(pairs), D).index_add_(0, inverse, grads.reshape(-1, D))
    out = grads.new_zeros(V, D).index_add_(0, pairs % V, summed.square())
    if m.padding_idx is not None:  # its row gets no gradient
        out[m.padding_idx] = 0
    return out


def _linear_square_sum(call: ModuleCall, squares: Tensor) -> dict[str, Tensor]:
    """Σₙ squared per-sample gradients of a Linear on 2-D input from ``Σₖ gₖ²`` (B, D_out)."""
    out = {}
    if "weight" in call.names:
        out["weight"] = squares.T @ call.args[0].square()
    if "bias" in call.names:
        out["bias"] = squares.sum(0)
    return out


#: Layers whose ``Σₖₙ (∂θ)²`` needs no per-sample gradients, keyed by exact module type.
SQUARE_SUM_RULES: dict[type[nn.Module], SquareSumRule] = {
    nn.Linear: SquareSumRule(
        applies=lambda call: call.args[0].dim() == 2,
        partial=lambda call, grads: grads.square().sum(0),
        finish=_linear_square_sum,
    ),
    nn.Embedding: SquareSumRule(
        applies=lambda call: not call.module.scale_grad_by_freq,
        partial=_embedding_square_sum,
        finish=lambda call, total: {"weight": total},
    ),
}
