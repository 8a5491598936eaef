r"""Kronecker-factored curvature (KFAC) from one recorded forward and one backward per column.

A layer ``z = W a (+ b)`` applied at T positions per row gets ``G ⊗ A`` over the N points of the
data set: expand ``A = (1/(N·T)) Σₙₜ aₙₜ aₙₜᵀ``, ``G = Σₖₙₜ gₙₖₜ gₙₖₜᵀ``; reduce the same of
the positions' mean input and summed gradient. Factors are split ``G/√c ⊗ √c·A`` (c the
backend's loss factor). The conventions in full are in ``docs/backends.md``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace
from typing import NamedTuple

import torch
from torch import Tensor, nn

from laplace.curvature.engine.capture import column_chunks
from laplace.curvature.engine.kfac_rules import (
    KFAC_DENSE_LIMIT,
    Block,
    KfacRule,
    as_uses,
    block_shapes,
    module_name,
    plan_blocks,
)
from laplace.curvature.engine.layer_rules import ModuleCall, tiled_call
from laplace.curvature.engine.per_sample import (
    COLUMNS_PER_BACKWARD,
    Columns,
    PerSampleEngine,
    PerSampleTrace,
)
from laplace.curvature.engine.square_sums import row_product_squares, row_token_pairs
from laplace.utils.data import posterior_dtype
from laplace.utils.diag_lowrank import DiagLowRank, LowRankShape
from laplace.utils.linalg import add_gram_upper_, mirror_upper_
from laplace.utils.matrix import Kron, StructuredKron

__all__ = [
    "GRAM_COPY_ELEMENTS",
    "KFAC_APPROXIMATIONS",
    "KfacStatistics",
    "kfac",
    "kfac_eigenvalues",
]

#: The weight-sharing approximations of Eschenhagen et al. (2023).
KFAC_APPROXIMATIONS = ("expand", "reduce")


#: Largest copy (rows × positions × features) of strided rows made at once by ``_gram``.
GRAM_COPY_ELEMENTS = 2**24


def _add_gram(sums: dict, key: object, t: Tensor, approx: str, scale: float = 1.0) -> None:
    """Add ``scale ·`` Σ of outer products of (R, T, D) rows to ``sums[key]``, above its diagonal.

    Expand sums over every position; reduce over the per-row mean over positions. The rows go
    into the upper triangle of the running sum in place (``add_gram_upper_``; a (D, D) matrix
    is allocated only for the key's first term); ``_complete_grams`` mirrors it once the
    batch is summed. Contiguous rows are a view; strided ones (the gradients of a convolution,
    (R, D, T) in memory) are copied into rows a chunk of at most ``GRAM_COPY_ELEMENTS`` at a
    time: a batched product of the R (D, T) blocks would hold (R, D, D) products, more than
    the rows themselves where T < D (a ResNet's late layers), and compute both triangles.
    """
    if key not in sums:
        sums[key] = t.new_zeros(t.shape[-1], t.shape[-1])
    if approx == "reduce" or t.shape[1] == 1 or t.is_contiguous():
        # reduce: the rows' means; expand: a view, every position a row
        rows = t.mean(1) if approx == "reduce" else t.reshape(-1, t.shape[-1])
        add_gram_upper_(sums[key], rows, alpha=scale)
        return
    per_chunk = max(1, GRAM_COPY_ELEMENTS // (t.shape[1] * t.shape[2]))
    for chunk in t.split(per_chunk):  # one chunk's copy at a time
        add_gram_upper_(sums[key], chunk.reshape(-1, t.shape[-1]), alpha=scale)


def _complete_grams(sums: dict) -> None:
    """Mirror the upper triangle of every (D, D) Gram sum of ``_add_gram`` onto its lower one."""
    for value in sums.values():
        if isinstance(value, Tensor) and value.dim() == 2:
            mirror_upper_(value)


def _token_counts(module: nn.Embedding, tokens: Tensor, approx: str, dtype: torch.dtype) -> Tensor:
    """Diagonal input factor of an embedding: ``Σₙₜ`` one-hot rows (expand) or ``Σₙ cₙ²`` (reduce).

    Of the indices looked up ``tokens`` (R, T); shape (V,), not yet divided by the positions.
    """
    V = module.num_embeddings
    if approx == "expand" or tokens.shape[1] == 1:
        counts = torch.bincount(tokens.flatten(), minlength=V).to(dtype)
    else:  # per (row, token) pair its count in the row, squared and summed over the rows
        pairs, _, per_pair = row_token_pairs(tokens, V)
        counts = torch.zeros(V, dtype=dtype, device=tokens.device)
        counts.index_add_(0, pairs % V, per_pair.to(dtype).square())
    if module.padding_idx is not None:  # its row gets no gradient
        counts[module.padding_idx] = 0
    return counts


def _add_input_factor(
    A: dict,
    key: object,
    rule: KfacRule,
    call: ModuleCall,
    a: Tensor,
    approx: str,
    root: float,
    n: int,
) -> None:
    """Add ``root/n ·`` the input factor of one call with inputs ``a`` (``rule.inputs(call)``).

    The factor is (D_in, D_in) (upper triangle, see ``_add_gram``), or (V,) for an embedding.
    """
    T = a.shape[1]
    if rule.one_hot:  # reduce: the rows' mean one-hot vectors (counts / T), squared
        counts = _token_counts(call.module, a, approx, call.outputs[0].dtype)
        _add(A, key, counts.mul_(root / (n * (T if approx == "expand" else T**2))))
    else:
        _add_gram(A, key, a, approx, scale=root / (n * (T if approx == "expand" else 1)))


def _add(sums: dict, key: object, value: Tensor | DiagLowRank) -> None:
    if key in sums:
        sums[key] += value
    else:
        sums[key] = value


def _low_rank_gram(
    g: Tensor, approx: str, max_rank: int | None, scale: float = 1.0
) -> DiagLowRank:
    """``scale · Σ g gᵀ`` of gradient rows (R, T, C) as ``diag(0) + U Uᵀ`` (rank ≤ ``max_rank``).

    Expand takes every position's row, reduce the per-row sums over positions (as
    ``_gram``); the rows, times ``√scale``, are ``U``'s columns, never multiplied out into a
    C × C matrix.
    """
    rows = g.sum(1) if approx == "reduce" else g.reshape(-1, g.shape[-1])
    if scale != 1.0:
        rows = rows * math.sqrt(scale)
    return DiagLowRank(rows.new_zeros(rows.shape[1]), rows.T, 1, max_rank)


def _check_batch_rows(trace: PerSampleTrace) -> None:
    """Refuse layers whose outputs have fewer rows than the batch.

    Per-sample quantities are read off every layer's output gradients row by row. An output
    shared by the data points and only broadcast over them (a position embedding looked up
    once, (1, T, D)) is recorded expanded along the batch (``record_forward``); one that stays
    shared is combined across the data points, and no per-sample gradient exists. Rows beyond
    the batch (folded batches) are taken as positions.

    Raises:
        ValueError: Naming the first such layer and the alternatives.
    """
    batch = trace.f.shape[0]
    for call in trace.calls:
        rows = call.outputs[0].shape[0] if call.outputs[0].dim() else 0
        if rows < batch:
            name = module_name(trace.engine.model, call.module)
            raise ValueError(
                f"module {name!r} ({type(call.module).__name__}) returns "
                f"outputs of shape {tuple(call.outputs[0].shape)} for a batch of {batch}, shared "
                "by the data points and not only broadcast over them (the model combines them "
                "across the batch): they have no per-sample gradients for KFAC. Freeze its "
                "parameters (requires_grad=False) or use hessian_structure='diag' or 'full'."
            )


def _or_zeros(
    sums: dict, key: object, like: Tensor, shape: tuple[int, ...], max_rank: int | None = None
) -> Tensor | DiagLowRank:
    """``sums[key]``, or zeros of ``shape`` for a module not called on the batch."""
    if key in sums:
        return sums[key]
    if isinstance(shape, LowRankShape):
        return DiagLowRank.zeros(shape[0], 1, max_rank, like.device, like.dtype)
    return like.new_zeros(shape)


def _output_divisor(block: Block, root: float, n_data: int) -> float:
    """What a weight's output-gradient Gram sum is divided by: ``√c``, and ``N`` input-first.

    A weight's ``G ⊗ A`` carries the loss factor ``c`` as ``G/√c ⊗ √c·A``; an input-first
    layer (``A ⊗ G``) normalises ``G`` by the data count instead of ``A``.
    """
    return root * n_data if block.rule.inputs_first else root


def _output_position(block: Block) -> int:
    """Where a block keeps its output-gradient factor: 1 for an input-first weight, else 0.

    An input-first weight's block is ``A ⊗ G``; any other weight's is ``G ⊗ A``, and a bias's
    only factor is its ``G``.
    """
    return 1 if block.kind == "kron" and block.rule.inputs_first else 0


def _sum_into(
    into: Kron, plan: list[Block], shared: set[tuple], sums: tuple[dict, dict, dict]
) -> None:
    """Let the batch's sums ``(A, G, exact)`` be the factors of ``into``, added to in place.

    A key in ``shared`` (a layer's weight and bias, whose blocks take its output-gradient Gram
    scaled differently) keeps its Gram for the batch; ``kfac`` adds it to both blocks.
    """
    A, G, exact = sums
    for slot, (block, factors) in enumerate(zip(plan, into.kfacs, strict=True)):
        if block.kind in ("dense", "diag"):
            exact[slot] = factors[0]
            continue
        out = _output_position(block)
        if block.kind == "kron":
            A[block.key] = factors[1 - out]
        if block.key not in shared:
            G[block.key] = factors[out]


def _can_sum_into(into: Kron | None, like: Tensor, low_rank: set) -> bool:
    """Whether a batch can be summed into ``into`` in place: dense factors of its type."""
    return (
        into is not None
        and not low_rank
        and type(into) is Kron
        and all(F.dtype == like.dtype for block in into.kfacs for F in block)
    )


def _rules_by_module(plan: list[Block], kinds: tuple[str, ...]) -> dict[nn.Module, dict]:
    """Per layer, the rules of its Kronecker-factored maps (``Block.key``) of ``kinds``."""
    rules: dict[nn.Module, dict] = {}
    for block in plan:
        if block.kind in kinds:
            rules.setdefault(block.module, {})[block.key] = block.rule
    return rules


class _ExactBlocks:
    """Sums of the exact blocks (dense or diagonal) from per-sample gradients, by slot.

    A parameter's per-sample gradients come from its layers' rules where every call has one
    row per data point; where a call has more rows than the batch (a folded batch, whose rows
    a Kronecker block takes as positions) or the guard does not trust a call, from autograd,
    one backward pass per data point (``autograd_slots``). A layer with a rule in
    ``EXACT_SUM_RULES`` whose parameters no other call uses (a recurrent layer) gives its sums
    directly, without its per-sample gradients (``summed``).
    """

    def __init__(self, trace: PerSampleTrace, plan: list[Block]) -> None:
        self.trace, self.plan = trace, plan
        self.sums: dict[int, Tensor] = {}
        slot, batch = trace.engine.slot, trace.f.shape[0]
        exact_kind = {s for s, block in enumerate(plan) if block.kind in ("dense", "diag")}
        folded = {
            slot[call.module, name]
            for call in trace.calls
            if call.outputs[0].shape[0] != batch
            for name in call.names
        }
        self.autograd_slots = sorted(set(trace.exact_slots) | (folded & exact_kind))
        self.by_rule = exact_kind - set(self.autograd_slots)
        self.calls, self.summed = [], []
        for i, call in enumerate(trace.calls):
            names = [name for name in call.names if slot[call.module, name] in self.by_rule]
            if not names:
                continue
            if i in trace.exact_sum_rules:  # the parameters of no other call
                dense = {name for name in names if plan[slot[call.module, name]].kind == "dense"}
                self.summed.append((i, replace(call, names=names), dense))
            else:
                self.calls.append((i, call))

    def add_exact(self, columns: Tensor) -> None:
        """Add the blocks of ``autograd_slots`` for a chunk of columns (K, B, ...)."""
        for s, u in self.trace.exact_rows(columns, self.autograd_slots).items():
            self._add_rows(s, u.detach().flatten(0, 1).flatten(1))

    def _named(self, call: ModuleCall, rule: Callable[..., dict], *args: object) -> dict:
        """``rule(*args)``, a layer rule's result for ``call``; a refusal names the module."""
        try:
            return rule(*args)
        except ValueError as error:
            name = module_name(self.trace.engine.model, call.module)
            raise ValueError(f"module {name!r}: {error}") from error

    def _add_rows(self, s: int, u: Tensor) -> None:
        """Add the block of per-sample gradient rows ``u`` (R, n) of slot ``s``.

        A dense block's Gram goes above the diagonal of its running sum, in place
        (``_complete_grams`` mirrors it).
        """
        if self.plan[s].kind == "diag":
            _add(self.sums, s, u.square().sum(0))
        else:
            _add_gram(self.sums, s, u.unsqueeze(1), "expand")

    def add(self, grads: list[list[Tensor]]) -> None:
        """Add the blocks of a chunk of columns (per call, gradients (k, B, ...))."""
        for i, call, dense in self.summed:  # straight from the call's ``EXACT_SUM_RULES``
            rule = self.trace.exact_sum_rules[i]
            for name, value in self._named(call, rule, call, grads[i], dense).items():
                s = self.trace.engine.slot[call.module, name]
                _add(self.sums, s, value if name in dense else value.flatten())
        rows: dict[int, list[Tensor]] = {}  # per slot, per call, the per-sample gradients
        for i, call in self.calls:
            k = len(grads[i][0])  # the chunk's columns, as more rows: (k·B, ...)
            tiled = tiled_call(call, k) if k > 1 else call
            flat = [g.flatten(0, 1) for g in grads[i]]
            per_sample = self._named(call, self.trace.slot_grads, tiled, flat)
            for s, u in per_sample.items():
                if s in self.by_rule:
                    rows.setdefault(s, []).append(u.detach().flatten(1))
        for s, us in rows.items():  # a parameter used by several calls: the sum of their rows
            self._add_rows(s, torch.stack(us).sum(0))


def _check_exact_slots(trace: PerSampleTrace, plan: list[Block]) -> None:
    """Refuse a Kronecker-factored parameter whose recorded calls the guard does not trust.

    Such a parameter's exact block comes from per-sample gradients; one planned as ``G ⊗ A``
    has no inputs and output gradients of all its uses to factor.

    Raises:
        ValueError: Naming the parameter, why, and the alternatives.
    """
    for slot in trace.exact_slots:
        if plan[slot].kind in ("kron", "bias"):
            raise ValueError(
                f"{trace.engine.describe(slot)} has a Kronecker block, but "
                f"{trace.exact_reasons[slot]}: its inputs and output gradients are not all "
                "recorded, so G ⊗ A cannot be formed. Use hessian_structure='diag', 'full' or "
                "'lowrank' (exact for it), call the module for every use (tie weights by "
                "sharing the parameter between modules), or freeze it (requires_grad=False)."
            )


def kfac(
    trace: PerSampleTrace,
    columns: Columns,
    n_data: int,
    approx: str,
    factor: float,
    gradients: list[list[Tensor]] | None = None,
    dense_limit: int = KFAC_DENSE_LIMIT,
    low_rank_above: int | None = None,
    max_rank: int | None = None,
    statistics: KfacStatistics | None = None,
    into: Kron | None = None,
) -> Kron:
    """KFAC factors of one batch, normalised for a data set of ``n_data`` points.

    Args:
        trace: A recorded forward pass over the batch.
        columns: Output columns ``vₖ`` of the curvature, sliced like a tensor (K, B, ...).
        n_data: Number of data points N of the whole data set.
        approx: ``"expand"`` or ``"reduce"``.
        factor: The backend's loss factor ``c`` (sets the split of each block between factors).
        gradients: The columns' gradients w.r.t. each call's outputs, each (K, B, ...), where
            already taken (else they are taken here).
        dense_limit: Largest parameter without a Kronecker rule whose exact block is dense.
        low_rank_above: Layers with more outputs keep their output factor as a
            ``DiagLowRank`` (None: every factor dense).
        max_rank: Largest number of low-rank columns such a factor keeps (None: all).
        statistics: Where given, the inputs and gradients the factors are formed from are kept
            in it, for EKFAC (``KfacStatistics``).
        into: A running sum of earlier batches' factors (this plan's shapes), which the batch
            is added to in place and which is returned: no second copy of the factors is held.
            Taken where its factors are dense and of the curvature's type, else left alone.

    Returns:
        One block per parameter in ``trace.engine.needed`` order
        ([`plan_blocks`][laplace.curvature.engine.kfac_rules.plan_blocks]); a ``StructuredKron``
        where a factor is low rank; ``into`` where the batch was added to it.

    Raises:
        ValueError: For an unknown ``approx``, a trace restricted to a subnetwork, a layer
            whose outputs have fewer rows than the batch, or a ``Conv1D`` with more than
            ``low_rank_above`` outputs.
    """
    if approx not in KFAC_APPROXIMATIONS:
        raise ValueError(f"kfac_approx must be one of {KFAC_APPROXIMATIONS}, got {approx!r}.")
    if trace.engine.indices is not None:
        raise ValueError(
            "KFAC is defined per layer; it does not support subnetwork_indices: use a "
            "subnetwork with hessian_structure='full' or 'diag'."
        )
    _check_batch_rows(trace)
    engine, calls = trace.engine, trace.calls
    plan = plan_blocks(engine, dense_limit, low_rank_above)
    _check_exact_slots(trace, plan)
    kron_rules = _rules_by_module(plan, ("kron", "bias"))
    low_rank = {b.key for b in plan if b.low_rank}
    # the weights with a Kronecker block (not a tied weight's exact block), with their rule
    kron_weights = _rules_by_module(plan, ("kron",))
    root = math.sqrt(factor)
    # a key with a weight and a bias block sums its output Gram unscaled for both
    shared = {b.key for b in plan if b.kind == "bias"} & {b.key for b in plan if b.kind == "kron"}
    scales = {
        b.key: 1 / _output_divisor(b, root, n_data)
        for b in plan
        if b.kind == "kron" and b.key not in shared
    }
    A: dict[tuple, Tensor] = {}
    G: dict[tuple, Tensor] = {}
    exact = _ExactBlocks(trace, plan)
    in_place = _can_sum_into(into, curvature_like(engine), low_rank)
    if in_place:
        _sum_into(into, plan, shared, (A, G, exact.sums))
    inputs: dict[tuple, tuple[Tensor, ...]] = {}
    for i, call in enumerate(calls):
        for key, rule in kron_weights.get(call.module, {}).items():
            n = 1 if rule.inputs_first else n_data
            inputs[i, key] = tuple(a.detach() for a in as_uses(rule.inputs(call)))
            for a in inputs[i, key]:
                _add_input_factor(A, key, rule, call, a, approx, root, n)
    for chunk in column_chunks(columns, COLUMNS_PER_BACKWARD) if exact.autograd_slots else ():
        exact.add_exact(chunk)
    rows: dict[tuple, list[Tensor]] = {}
    kept: dict[tuple, list[Tensor]] = {}
    for stacked in trace.column_gradients(columns) if gradients is None else [gradients]:
        chunk = [[g.detach() for g in grads] for grads in stacked]
        exact.add(chunk)
        for i, call in enumerate(calls):
            for key, rule in kron_rules.get(call.module, {}).items():
                # Gradients of one position per row are gathered into one Gram product per
                # call; those of many positions (convolutions) are large, so their Gram is
                # added chunk by chunk.
                uses = as_uses(rule.grads(call, [g.flatten(0, 1) for g in chunk[i]]))
                for use, g in enumerate(uses):
                    if statistics is not None:
                        kept.setdefault((i, key, use), []).append(
                            g.unflatten(0, chunk[i][0].shape[:2])
                        )
                    if key in low_rank:
                        _add(G, key, _low_rank_gram(g, approx, max_rank, scales.get(key, 1.0)))
                    elif g.shape[1] == 1 or approx == "reduce":
                        rows.setdefault((i, key, use), []).append(g.sum(1))
                    else:
                        _add_gram(G, key, g, "expand", scales.get(key, 1.0))
        del stacked, chunk  # not held while the next chunk's gradients are formed
    for (_, key, _), gs in rows.items():
        _add_gram(G, key, torch.cat(gs).unsqueeze(1), "expand", scales.get(key, 1.0))
    for sums in (A, G, exact.sums):
        _complete_grams(sums)
    for (i, key, use), gs in kept.items():  # a bias without a Kronecker weight needs no inputs
        a = inputs[i, key][use] if (i, key) in inputs else gs[0].new_empty(0)
        statistics.add(key, kron_rules[calls[i].module][key], a, gs)
    if in_place:  # the shared keys' Grams, into their weight's and bias's blocks
        for slot, block in enumerate(plan):
            if block.key in shared and block.key in G:
                weight = block.kind == "kron"
                alpha = 1 / _output_divisor(block, root, n_data) if weight else 1.0
                into.kfacs[slot][_output_position(block)].add_(G[block.key], alpha=alpha)
        return into
    shapes = block_shapes(plan, engine.needed)
    blocks: list[list[Tensor]] = []
    for slot, (block, p, shape) in enumerate(zip(plan, engine.needed, shapes)):
        if block.kind in ("dense", "diag"):
            blocks.append([_or_zeros(exact.sums, slot, p, shape[0])])
        elif block.kind == "bias":
            blocks.append([_or_zeros(G, block.key, p, shape[0], max_rank)])
        else:
            out = _output_position(block)
            G_m = _or_zeros(G, block.key, p, shape[out], max_rank)
            if block.key in shared:
                G_m = G_m / _output_divisor(block, root, n_data)
            factors = [G_m, _or_zeros(A, block.key, p, shape[1 - out])]
            blocks.append(factors[::-1] if out else factors)
    return StructuredKron(blocks) if low_rank else Kron(blocks)


def _rotated(t: Tensor, Q: Tensor | None) -> Tensor:
    return t if Q is None else t @ Q


def _keeps_rows(a: Tensor, grads: list[Tensor]) -> bool:
    """Whether a weight's per-row gradients are cheaper to project than its inputs and gradients.

    Rotating the K columns' gradients (R, T, D_out) and the inputs (R, T, D_in) into the
    eigenbasis costs ``R·T·(K·D_out² + D_in²)``; rotating the per-row gradients
    ``Σₜ gₖᵣₜ aᵣₜᵀ`` (which both routes form) ``K·R·D_out·D_in·(D_out + D_in)``. Small
    kernels applied at many positions (a first convolution) take the second route, which also
    keeps less: (K, R, D_in, D_out) instead of (K, R, T, D_out).
    """
    T, D_in = a.shape[1:]
    K, D_out = sum(len(g) for g in grads), grads[0].shape[-1]
    return T > 1 and T * (K * D_out**2 + D_in**2) > K * D_out * D_in * (D_out + D_in)


def _row_gradients(a: Tensor, g: Tensor) -> Tensor:
    """Transposed per-row weight gradients ``Σₜ aᵣₜ gₖᵣₜᵀ`` (k, R, D_in, D_out)."""
    return a.to(g.dtype).transpose(-1, -2) @ g


def _rotated_row_squares(rows: Tensor, Q_out: Tensor | None, Q_in: Tensor | None) -> Tensor:
    """``Σₖᵣ (Q_outᵀ uₖᵣ Q_in)²`` entry by entry (D_out, D_in) of ``uₖᵣᵀ`` (k, R, D_in, D_out)."""
    rotated = _rotated(_rotated(rows, Q_out).transpose(-1, -2), Q_in)
    return rotated.square().sum((0, 1))


def _projected_squares(
    a: Tensor, grads: list[Tensor], Q_out: Tensor | None
) -> tuple[Tensor, Tensor]:
    """``Σₖᵣ (gₖᵣᵀ aᵣ)²`` entry by entry, (D_out, D_in), and ``Σₖᵣ (Σₜ gₖᵣₜ)²`` (D_out,).

    Args:
        a: Rotated inputs (R, T, D_in).
        grads: The gradients' chunks (k, R, T, D_out), rotated here by ``Q_out``.
        Q_out: The output factor's eigenvectors (None: the identity).

    ``gₖᵣᵀ aᵣ`` is a row's gradient of a weight seen at T positions for column k. One position
    per row needs no per-row matrix: ``Σᵣ (Σₖ gₖᵣ²)(aᵣ²)ᵀ``, one product for all chunks;
    several are formed as ``(Q_outᵀ gᵣᵀ) aᵣ`` (``row_product_squares``).
    """
    T, D_in = a.shape[1:]
    if T == 1:
        row_weights = sum(_rotated(g[:, :, 0], Q_out).square().sum(0) for g in grads)
        return row_weights.T @ a[:, 0].square(), row_weights.sum(0)
    D_out = grads[0].shape[-1]
    total, bias = a.new_zeros(D_out, D_in), a.new_zeros(D_out)
    for g in grads:
        rotated = _rotated(g, Q_out)  # (k, R, T, D_out)
        bias += rotated.sum(2).square().sum((0, 1))
        total += row_product_squares(a, rotated)
    return total, bias


def _embedding_squares(module: nn.Embedding, tokens: Tensor, g: Tensor) -> Tensor:
    """``Σₖᵣ (row r's embedding gradient)²`` entry by entry, (V, D): tokens (R, T), g (k, R, T, D).

    A row's gradient of token v sums its positions holding v (``row_token_pairs``).
    """
    V = module.num_embeddings
    pairs, inverse, _ = row_token_pairs(tokens, V)
    per_pair = g.new_zeros(len(g), len(pairs), g.shape[-1])
    per_pair.index_add_(1, inverse, g.flatten(1, 2))
    total = g.new_zeros(V, g.shape[-1]).index_add_(0, pairs % V, per_pair.square().sum(0))
    if module.padding_idx is not None:
        total[module.padding_idx] = 0
    return total


def curvature_like(engine: PerSampleEngine) -> Tensor:
    """An empty tensor of the engine's device and curvature type (the posterior's)."""
    p = engine.needed[0]
    return p.new_empty(0, dtype=engine.dtype or posterior_dtype(p.dtype))


def _same(Q: Tensor | None, other: Tensor | None) -> bool:
    return Q is not None and other is not None and Q.shape == other.shape and torch.equal(Q, other)


class _KeptCall(NamedTuple):
    """One call's kept statistics.

    ``inputs`` (R, T, D_in) and ``grads`` chunks (k, R, T, D_out); or, where ``rows`` are kept
    (``_keeps_rows``), the transposed per-row weight gradients' chunks (k, R, D_in, D_out),
    ``grads`` then summed over the positions (k, R, 1, D_out) for a bias and ``inputs`` None.
    """

    key: tuple[nn.Module, str]
    rule: KfacRule
    inputs: Tensor | None
    grads: list[Tensor]
    rows: list[Tensor] | None


class KfacStatistics:
    """A batch's layer inputs and output gradients of the Kronecker blocks, for EKFAC.

    What ``kfac`` computes its factors from, kept per call: the inputs ``aₙₜ`` (R, T, D_in)
    (an embedding's token indices) and the gradients ``gₖₙₜ`` (K, R, T, D_out) of all K
    curvature columns, so that ``eigenvalues`` can project them into an eigenbasis found later,
    without another pass over the data. A weight seen at many positions through a small kernel
    keeps its per-row gradients instead, which are both smaller and cheaper to project
    (``_keeps_rows``).

    Args:
        plan: The blocks of the engine's parameters (``plan_blocks``).
        shapes: Their factor shapes (``block_shapes``).
        like: A tensor of the engine's device and curvature type.
    """

    def __init__(self, plan: list[Block], shapes: list, like: Tensor) -> None:
        self.plan, self.shapes, self.like = plan, shapes, like
        self.weight_slots = {b.key: s for s, b in enumerate(plan) if b.kind == "kron"}
        self.bias_slots = {b.key: s for s, b in enumerate(plan) if b.kind == "bias"}
        self.calls: list[_KeptCall] = []

    def add(self, key: tuple, rule: KfacRule, a: Tensor, grads: list[Tensor]) -> None:
        """Keep one use's inputs (R, T, D_in) and column gradients, chunks (k, R, T, D_out).

        Args:
            key: The block's ``Block.key`` (its layer and map).
            rule: The map's rule.
            a: The inputs of this use.
            grads: The gradients' chunks of this use.
        """
        weight = key in self.weight_slots and not rule.one_hot
        if weight and _keeps_rows(a, grads):
            rows = [_row_gradients(a, g) for g in grads]
            sums = [g.sum(2, keepdim=True) for g in grads]
            self.calls.append(_KeptCall(key, rule, None, sums, rows))
        else:
            self.calls.append(_KeptCall(key, rule, a, grads, None))

    @property
    def nbytes(self) -> int:
        """Memory the kept tensors hold."""
        return sum(
            sum(t.nbytes for t in [c.inputs, *c.grads, *(c.rows or [])] if t is not None)
            for c in self.calls
        )

    def eigenvalues(self, bases: list[list[Tensor | None]]) -> list[Tensor | None]:
        r"""``diag(Qᵀ H Q)`` of each Kronecker block's exact curvature in the eigenbasis ``bases``.

        ``Q = Q₀ ⊗ Q₁`` is the block's KFAC eigenbasis and ``H = Σₖₙ uₖₙ uₖₙᵀ`` its exact
        curvature from the per-sample gradients ``uₖₙ`` of the curvature columns (George et al.,
        2018). A weight's ``uₖₙ = Σₜ gₖₙₜ aₙₜᵀ`` gives ``Σₖₙ (Q₀ᵀ uₖₙ Q₁)²`` without forming
        ``H``; a bias's ``(Q₀ᵀ Σₜ gₖₙₜ)²``. Unlike the factors, these sums carry no
        normalisation: over batches they add up to the data's.

        Args:
            bases: Per block the eigenvector matrices of its factors (None: the identity), as
                ``KronDecomposed.factor_bases``.

        Returns:
            Per block the eigenvalues in the shape of its spectrum, (p_out, p_in) or (p,); None
            for the blocks that are exact already (dense or diagonal).
        """
        sums: dict[int, Tensor] = {}
        for key, rule, a, grads, rows in self.calls:
            weight, bias = self.weight_slots.get(key), self.bias_slots.get(key)
            Q_out = Q_in = None
            if weight is not None:
                Q0, Q1 = bases[weight]
                Q_out, Q_in = (Q1, Q0) if rule.inputs_first else (Q0, Q1)
            squares = bias_squares = None
            if weight is not None and rule.one_hot:
                for g in grads:
                    _add(sums, weight, _embedding_squares(key[0], a, _rotated(g, Q_out)))
            elif rows is not None:
                squares = sum(_rotated_row_squares(u, Q_out, Q_in) for u in rows)
            elif weight is not None:
                a = _rotated(a, Q_in).to(grads[0].dtype)
                squares, bias_squares = _projected_squares(a, grads, Q_out)
            if squares is not None:
                _add(sums, weight, squares.T if rule.inputs_first else squares)
            if bias is None:
                continue
            # the bias's basis is the weight's output basis where their factors agree
            Q_bias = bases[bias][0]
            if bias_squares is not None and _same(Q_bias, Q_out):
                _add(sums, bias, bias_squares)
            else:
                for g in grads:
                    _add(sums, bias, _rotated(g.sum(2), Q_bias).square().sum((0, 1)))
        eigenvalues: list[Tensor | None] = []
        for slot, (block, shape) in enumerate(zip(self.plan, self.shapes)):
            if block.kind not in ("kron", "bias"):
                eigenvalues.append(None)
            elif slot in sums:
                eigenvalues.append(sums[slot])
            else:  # a layer not called on this batch
                eigenvalues.append(self.like.new_zeros([s[0] for s in shape]))
        return eigenvalues


def kfac_eigenvalues(
    trace: PerSampleTrace,
    columns: Columns,
    bases: list[list[Tensor | None]],
    dense_limit: int = KFAC_DENSE_LIMIT,
) -> list[Tensor | None]:
    """EKFAC's eigenvalues of a batch in the eigenbasis ``bases`` (``KfacStatistics``).

    Args:
        trace: A recorded forward pass over the batch (all parameters).
        columns: Output columns ``vₖ`` of the curvature, sliced like a tensor (K, B, ...).
        bases: Per block the eigenvector matrices of its factors (None: the identity), in
            ``trace.engine.needed`` order.
        dense_limit: As ``kfac``: which parameters without a Kronecker rule are dense blocks.

    Returns:
        See ``KfacStatistics.eigenvalues``.

    Raises:
        ValueError: As ``kfac``.
    """
    if trace.engine.indices is not None:
        raise ValueError("EKFAC is defined per layer; it does not support subnetwork_indices.")
    _check_batch_rows(trace)
    engine = trace.engine
    plan = plan_blocks(engine, dense_limit)
    _check_exact_slots(trace, plan)
    rules = _rules_by_module(plan, ("kron", "bias"))
    grads: dict[tuple, list[Tensor]] = {}
    for stacked in trace.column_gradients(columns):
        for i, call in enumerate(trace.calls):
            for key, rule in rules.get(call.module, {}).items():
                shape = stacked[i][0].shape[:2]
                uses = as_uses(rule.grads(call, [g.detach().flatten(0, 1) for g in stacked[i]]))
                for use, g in enumerate(uses):
                    grads.setdefault((i, key, use), []).append(g.unflatten(0, shape))
    statistics = KfacStatistics(plan, block_shapes(plan, engine.needed), curvature_like(engine))
    for (i, key, use), gs in grads.items():
        rule = rules[trace.calls[i].module][key]
        statistics.add(key, rule, as_uses(rule.inputs(trace.calls[i]))[use].detach(), gs)
    return statistics.eigenvalues(bases)
