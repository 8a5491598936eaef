"""Squared per-sample gradients summed over a batch, without the per-sample gradients.

The diagonal curvature ``Σₖ Σₙ (∂θ (vₙₖᵀ fₙ))²`` of some layers follows from a chunk of output
gradients (K, B, …) of the columns ``vₖ`` and the layer's recorded call directly
(``SQUARE_SUM_RULES``): for a linear layer on (B, D_in) inputs the squared weight gradient
summed over samples and columns is ``(Σₖ gₖ²)ᵀ a²``; an embedding's sums its positions per
(sample, token) pair (``row_token_pairs``) and never forms a (B, V, D) gradient; a convolution at
few output positions sums the Gram products of its positions (``_conv_position_grams``). Other
layers go through ``laplace.curvature.engine.layer_rules``' per-sample gradients.

``EXACT_SUM_RULES`` give a chunk's finished sums of a layer's parameters directly, the squares
of some and the Gram matrix ``Σₖₙ uₖₙ uₖₙᵀ`` of others (the dense exact blocks of KFAC): a
recurrent layer's come from one vectorised pullback of all the chunk's columns through one
unrolling of the batch (``layer_rules.recurrent_pullback``), its weights' squares from
per-row products a few rows at a time, never all (K, B, G, D) per-sample gradients at once.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from laplace.curvature.engine.layer_rules import (
    RECURRENT_LAYERS,
    ModuleCall,
    conv_patches,
    recurrent_pullback,
    recurrent_weight_rows,
)
from laplace.utils.linalg import symmetric_gram

__all__ = [
    "EXACT_SUM_RULES",
    "PER_SAMPLE_ENTRY_COST",
    "PRODUCT_CHUNK_ELEMENTS",
    "SQUARE_SUM_RULES",
    "ExactSumRule",
    "SquareSumRule",
    "row_product_squares",
    "row_token_pairs",
]

#: Largest chunk (rows × columns × weight entries) of per-row weight gradients formed at once
#: by ``row_product_squares``: 4 MB in float32, so that a chunk is squared and summed while it
#: is still in the cache.
PRODUCT_CHUNK_ELEMENTS = 2**20

#: What forming, squaring and summing one per-sample gradient entry of a convolution costs
#: beyond its L multiply-adds, in multiply-adds of one large matrix product: 50–190 measured on
#: the project's 2-core AMD EPYC (float32, ResNet-50's layer shapes), where the per-sample
#: products are small and memory-bound and the position Grams are one product.
PER_SAMPLE_ENTRY_COST = 64


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
        applies: Whether the rule takes this call, for K columns in all (some rules are
            cheaper than per-sample gradients only for enough columns).
        partial: A chunk's statistic from the output gradients (K, B, …); they add up.
        finish: The squared gradients per parameter name from the summed statistic.
        gathered: Where ``partial`` contracts the columns (a Gram over them, whose output
            costs as much for one column as for many), the number of columns whose gradients
            are gathered from the chunks before one ``partial``; None: each chunk on its own.
    """

    applies: Callable[[ModuleCall, int], bool]
    partial: Callable[[ModuleCall, Tensor], Tensor]
    finish: Callable[[ModuleCall, Tensor], dict[str, Tensor]]
    gathered: Callable[[ModuleCall], int] | None = None


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


def row_product_squares(a: Tensor, g: Tensor) -> Tensor:
    """``Σₖᵣ (gₖᵣᵀ aᵣ)²`` entry by entry, (D_out, D_in).

    Of inputs ``a`` (R, T, D_in) and gradients ``g`` (K, R, T, D_out): ``gₖᵣᵀ aᵣ = Σₜ gₖᵣₜ aᵣₜᵀ``
    is row r's gradient of a weight seen at T positions for column k. They are formed for all
    K columns at once by batched products of the rows' transposed views (the inputs broadcast
    over the columns), a chunk of rows of at most ``PRODUCT_CHUNK_ELEMENTS`` at a time,
    squared and summed in place.
    """
    K, D_out, D_in = len(g), g.shape[-1], a.shape[-1]
    a = a.to(g.dtype)
    total = g.new_zeros(D_out, D_in)
    step = max(1, PRODUCT_CHUNK_ELEMENTS // (K * D_out * D_in))
    for start in range(0, len(a), step):
        rows = slice(start, start + step)
        total += torch.matmul(g[:, rows].transpose(-1, -2), a[rows]).square_().sum((0, 1))
    return total


def _conv_positions(call: ModuleCall) -> int:
    """Output positions L of a convolution call (1 for a 1 × 1 output)."""
    return call.outputs[0][0, 0].numel()


def _conv_grams_pay_off(call: ModuleCall, n_columns: int) -> bool:
    """Whether ``_conv_position_grams`` costs less than K columns' per-sample gradients.

    Per sample and weight entry the Grams cost L² multiply-adds for all columns, the per-sample
    gradients ``K · (L + PER_SAMPLE_ENTRY_COST)``: the Grams win at few positions (ResNet's
    last stages: 2 × 2 and 4 × 4) and lose at many (its first: 16 × 16 and more).
    """
    positions = _conv_positions(call)
    return positions * positions <= n_columns * (positions + PER_SAMPLE_ENTRY_COST)


def _conv_position_grams(call: ModuleCall, grads: Tensor) -> Tensor:
    """A chunk's ``Σₖ gₖₗ gₖₘ`` per sample, group and pair of output positions (B, G, L, L, O/G).

    A convolution's per-sample weight gradient is ``Σₗ gₗ pₗᵀ`` over its L output positions
    (``p`` the input patches, ``layer_rules.conv_patches``), so its square summed over the
    columns is ``Σₗₘ (Σₖ gₖₗ gₖₘ) (pₗ ⊙ pₘ)``: the columns enter only through these Grams.
    """
    m = call.module
    g = grads.flatten(3)  # (K, B, O, L)
    g = g.reshape(*g.shape[:2], m.groups, -1, g.shape[-1])
    return torch.einsum("kbgol,kbgom->bglmo", g, g)


def _conv_square_sum(call: ModuleCall, grams: Tensor) -> dict[str, Tensor]:
    """Σₙ squared per-sample gradients of a convolution from its summed position Grams.

    The weight's ``Σₗₘ Gₗₘ (pₗ ⊙ pₘ)`` is one product over (sample, position pair) per group,
    a chunk of samples at a time (the (L, L, C_in/G · k) patch products of a sample are formed
    only within its chunk); the bias's is ``Σₗₘ Gₗₘ``.
    """
    m, out = call.module, {}
    if "weight" in call.names:
        patches = conv_patches(call).to(grams.dtype)  # (B, G, L, C_in/G · k)
        per_sample = grams[0].numel() // grams.shape[-1] * patches.shape[-1]
        step = max(1, PRODUCT_CHUNK_ELEMENTS // per_sample)
        total = grams.new_zeros(m.groups, grams.shape[-1], patches.shape[-1])
        for start in range(0, len(patches), step):
            p = patches[start : start + step]
            pairs = p.unsqueeze(3) * p.unsqueeze(2)  # (b, G, L, L, C_in/G · k)
            total += torch.einsum("bglmo,bglmi->goi", grams[start : start + step], pairs)
        out["weight"] = total.reshape(m.weight.shape)
    if "bias" in call.names:
        out["bias"] = grams.sum((0, 2, 3)).flatten()
    return out


def _recurrent_sums(
    call: ModuleCall, grads: Sequence[Tensor], dense: Collection[str]
) -> dict[str, Tensor]:
    """Exact sums of ``nn.RNN``, ``nn.LSTM`` and ``nn.GRU`` parameters for K columns.

    Every step's linear maps ``ihₜ = W_ih xₜ + b_ih`` and ``hhₜ = W_hh hₜ₋₁ + b_hh`` get their
    gradients ``δ`` (K, R, T, G) from one pullback of the K columns; a weight's per-sample
    gradient is ``Σₜ δₜ aₜᵀ`` (``a`` the step's ``xₜ`` or ``hₜ₋₁``), a bias's ``Σₜ δₜ``.
    Where the cell reads ``ih + hh`` only (LSTM, RNN), both weights have the same ``δ``, and
    their squares come from one product of the joined inputs ``[xₜ, hₜ₋₁]``: a pass over the
    (K, R, T, G) gradients less, and one larger product (about 20 % less time for both).
    """
    out = {}
    for suffix, (inputs, previous, d_ih, d_hh) in recurrent_pullback(call, grads).items():
        weights = [f"weight_{name}{suffix}" for name in ("ih", "hh")]
        if d_ih is d_hh and all(w in call.names and w not in dense for w in weights):
            joined = row_product_squares(torch.cat([inputs, previous], -1), d_ih)
            out.update(zip(weights, joined.split([inputs.shape[-1], previous.shape[-1]], -1)))
        sums = None
        for name, a, d in (("ih", inputs, d_ih), ("hh", previous, d_hh)):
            weight, bias = f"weight_{name}{suffix}", f"bias_{name}{suffix}"
            if weight in dense:
                rows = recurrent_weight_rows(a, d)
                out[weight] = symmetric_gram(rows.reshape(-1, rows[0, 0].numel()))
            elif weight in call.names and weight not in out:
                out[weight] = row_product_squares(a, d)
            if bias in call.names:
                sums = sums if sums is not None and d_ih is d_hh else d.sum(2).flatten(0, 1)
                out[bias] = symmetric_gram(sums) if bias in dense else sums.square().sum(0)
    return out


#: The exact sums of a call's parameters for a chunk of K columns: from the call (its ``names``
#: the parameters wanted), the gradients w.r.t. each of its recorded outputs (K, B, ...) and
#: the names whose Gram matrix is wanted, per name ``Σₖₙ uₖₙ²`` (the parameter's shape), or
#: ``Σₖₙ uₖₙ uₖₙᵀ`` (n, n) for those names, of the per-sample gradients ``uₖₙ``.
ExactSumRule = Callable[[ModuleCall, Sequence[Tensor], Collection[str]], dict[str, Tensor]]

#: Layers whose exact sums a chunk of columns gives at once, keyed by exact module type.
EXACT_SUM_RULES: dict[type[nn.Module], ExactSumRule] = dict.fromkeys(
    RECURRENT_LAYERS, _recurrent_sums
)


#: Layers whose ``Σₖₙ (∂θ)²`` needs no per-sample gradients, keyed by exact module type.
SQUARE_SUM_RULES: dict[type[nn.Module], SquareSumRule] = {
    nn.Linear: SquareSumRule(
        applies=lambda call, n_columns: call.args[0].dim() == 2,
        partial=lambda call, grads: grads.square().sum(0),
        finish=_linear_square_sum,
    ),
    nn.Embedding: SquareSumRule(
        applies=lambda call, n_columns: not call.module.scale_grad_by_freq,
        partial=_embedding_square_sum,
        finish=lambda call, total: {"weight": total},
    ),
    **{
        conv: SquareSumRule(
            applies=_conv_grams_pay_off,
            partial=_conv_position_grams,
            finish=_conv_square_sum,
            # L columns' gradients (B, O, L) hold as many numbers as one Gram (B, L, L, O)
            gathered=_conv_positions,
        )
        for conv in (nn.Conv1d, nn.Conv2d, nn.Conv3d)
    },
}
