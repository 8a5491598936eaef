r"""Jacobian-free GLM output covariance ``J P⁻¹ Jᵀ`` of block-wise precisions, layer by layer.

For a layer applied at positions ``t`` with inputs ``aₙₜ`` and gradients ``gₙcₜ = ∂fₙc/∂zₙₜ`` of
output ``c`` w.r.t. its outputs, the Jacobian of ``fₙc`` w.r.t. the weight is
``Σₜ gₙcₜ ⊗ aₙₜ`` and w.r.t. the bias ``Σₜ gₙcₜ``. In the eigenbasis of a weight block,
``P = (Q_G ⊗ Q_A) diag(s) (Q_G ⊗ Q_A)ᵀ``, with ``g̃ = Q_Gᵀ g`` and ``ã = Q_Aᵀ a``:

- one position (``T = 1``): ``Jc P⁻¹ Jdᵀ = Σᵢ g̃cᵢ g̃dᵢ wᵢ`` with ``wᵢ = Σⱼ ãⱼ² / sᵢⱼ``, so no
  (out × in) object per output is ever formed;
- several positions: ``Mc = Σₜ g̃cₜ ãₜᵀ`` (out × in) and ``Jc P⁻¹ Jdᵀ = Σᵢⱼ Mcᵢⱼ Mdᵢⱼ / sᵢⱼ``, or,
  at few positions, ``Σₜᵤ Σᵢ g̃cₜᵢ g̃duᵢ Wₜᵤᵢ`` with ``Wₜᵤᵢ = Σⱼ ãₜⱼ ãᵤⱼ / sᵢⱼ`` (T, T, out);
- bias: ``ḡc = Q_Gᵀ Σₜ gcₜ`` and ``Σᵢ ḡcᵢ ḡdᵢ / sᵢ``.

Blocks ``A ⊗ G`` (transformers' ``Conv1D``) are the same with the roles of the factors swapped.
An embedding's input is one-hot, ``ã`` the row of its token (its factor is diagonal): per data
point and token ``v`` the row ``Σ_{t: xₜ = v} g̃cₜ`` of ``Mc`` is all there is, so the rows of the
(data point, token) pairs that occur are summed and weighted by ``1/s[v]``. Every other
parameter (its exact block, dense or diagonal) uses its per-sample gradients ``uₙc``
(``PER_SAMPLE_RULES``): ``Σᵢ ũcᵢ ũdᵢ / sᵢ`` with ``ũ = Qᵀ u``.

A diagonal precision is the special case of identity eigenvectors (each structure gives its
blocks, ``BlockInverse``, in its own module). All of it comes from one
recorded forward pass and one backward pass per output (w.r.t. layer outputs only): the memory
is that of the activations per output, never the (B, C, P) Jacobian (the ``Mc`` of a layer at
several positions, as large as its Jacobian rows, are formed a block of test points at a time).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
from torch import Tensor, nn

from laplace.curvature.engine.capture import OutputGradients
from laplace.curvature.engine.kfac_rules import KfacRule, as_uses, grouped_rule, kfac_rule
from laplace.curvature.engine.layer_rules import per_sample_grads
from laplace.curvature.engine.per_sample import PerSampleTrace
from laplace.curvature.engine.square_sums import row_token_pairs

__all__ = [
    "COLUMN_BLOCK_BYTES",
    "LAYERWISE_CHUNK_BYTES",
    "LAYERWISE_CHUNK_ROWS",
    "SHARED_LAYER_BLOCK_BYTES",
    "BlockInverse",
    "layerwise_variance",
]

#: Test points per chunk of the layer-wise GLM predictive (it holds activations, not Jacobians).
LAYERWISE_CHUNK_ROWS = 256

#: Bytes of the recorded layer outputs of one chunk of the layer-wise GLM predictive, at most.
#: While it runs a chunk holds about ten times as much (on ResNet-50 67 MB per image for 6.9 MB
#: of layer outputs: the activations of the graph, a column's gradients and the layers'
#: backward and patches), within the two Jacobian chunks the prediction's estimate counts.
LAYERWISE_CHUNK_BYTES = 32 * 2**20

#: Bytes of the per-output (out × in) matrices of a layer applied at several positions formed at
#: once (the test points of a chunk are taken a block at a time).
SHARED_LAYER_BLOCK_BYTES = 64 * 2**20

#: Bytes of the layer-output gradients of the output columns one vectorised backward pass forms.
COLUMN_BLOCK_BYTES = 64 * 2**20

#: Per parameter slot: the eigenvectors of its factors (None: identity) and the inverse
#: spectrum, (m, n) for a two-factor block, (p,) for a one-factor block.
BlockInverse = Callable[[int], tuple[list[Tensor | None], Tensor]]


def _rotate(t: Tensor, Q: Tensor | None) -> Tensor:
    return t if Q is None else t @ Q


def _cat(parts: dict[tuple, Tensor], key: tuple, value: Tensor) -> None:
    """Concatenate the positions of a map used repeatedly (calls, or uses within a call)."""
    parts[key] = torch.cat([parts[key], value], 1) if key in parts else value


class _Slot:
    """One parameter's share of ``J P⁻¹ Jᵀ``: its rows per output, then their weighted Gram.

    Args:
        kind: ``"kron"`` (two factors), ``"bias"`` (a layer's bias) or ``"exact"`` (its
            per-sample gradients).
        module: The layer owning the parameter.
        rule: The KFAC rule of the layer or of its map (unused for ``"exact"``).
        Qs: Eigenvectors of the block's factors (None: identity).
        inv: Inverse spectrum of the block.
        map: The layer's map the parameter belongs to (``Block.map``; "": the layer).
    """

    def __init__(
        self,
        kind: str,
        module: nn.Module,
        rule: KfacRule | None,
        Qs: list[Tensor | None],
        inv: Tensor,
        map: str = "",
    ) -> None:
        self.kind, self.module, self.rule, self.inv = kind, module, rule, inv
        self.key = (module, map)
        self.rows: list[Tensor] = []
        if kind == "kron":  # the factor on the output gradients, and the one on the inputs
            self.Q_out, self.Q_in = (Qs[1], Qs[0]) if rule.inputs_first else (Qs[0], Qs[1])
        else:
            self.Q_out, self.Q_in = Qs[0], None

    def add(self, g: Tensor | None, a: Tensor | None, u: Tensor | None) -> None:
        """Rows of one output: from ``g`` (R, T, D_out) and ``a``, or from ``u`` (R, p).

        Rows are rotated into the eigenbasis once every output's are in (one product for all
        of them), except the products ``Mc`` of a layer with fewer inputs than positions.
        """
        if self.kind == "exact":
            self.rows.append(u)
        elif self.kind == "bias":
            self.rows.append(g.sum(1))
        elif a.shape[1] == 1 and not self.rule.one_hot:
            self.rows.append(g[:, 0])
        elif not self.rule.one_hot and a.shape[2] < a.shape[1]:
            # fewer inputs than positions (a convolution's patches): Mc (out × in) is smaller
            # than the gradients (T × out), so it is formed at once, (R, out·in)
            self.rows.append(self._products(_rotate(g, self.Q_out).unsqueeze(1), a)[:, 0])
        else:  # (R, T, D_out): combined with the inputs once every output's rows are in
            self.rows.append(g)

    def variance(self, a: Tensor | None) -> Tensor:
        """``Σ U w Uᵀ`` over the rows of every output, (B, C, C); the rows are freed."""
        shared = self.kind == "kron" and not self.rule.one_hot and a.shape[1] > 1
        if shared and self.rows[0].dim() == 3:  # gradients (R, T, out) of every output
            return self._shared_variance(a)
        U = torch.stack(self.rows, dim=1)  # (B, C, k), or (B, C, T, D) for an embedding
        self.rows.clear()
        if not shared:  # shared: the products Mc (B, C, out·in), rotated as they were formed
            U = _rotate(U, self.Q_out)
        if self.kind != "kron" or shared:
            return (U * self.inv.flatten()) @ U.transpose(1, 2)
        if self.rule.one_hot:
            return _token_variance(self.module, a, U, self.inv)
        # one position: w = ã² (1/s), shape (B, out)
        a2 = a[:, 0].square()
        weights = a2 @ self.inv if self.rule.inputs_first else a2 @ self.inv.T
        return (U * weights.unsqueeze(1)) @ U.transpose(1, 2)

    def _shared_variance(self, a: Tensor) -> Tensor:
        """``Σ U w Uᵀ`` of a layer at several positions, a block of test points at a time.

        Per point either the products ``Mc = Σₜ g̃cₜ ãₜᵀ`` (out × in per output, as large as
        the layer's Jacobian rows; C (T + C) · out · in multiply-adds) or, at few positions
        (T² ≤ C (T + C)), the position weights of ``_position_block`` (T² · out · in).
        Inputs (B, T, in), rows (B, T, out) per output.
        """
        C, T, out_in = len(self.rows), a.shape[1], self.inv.numel()
        by_positions = T * T <= C * (T + C)
        if by_positions:
            n_out = out_in // a.shape[2]
            per_point = T * T * (a.shape[2] + n_out) + 2 * C * T * n_out
        else:
            per_point = C * out_in
        step = max(1, SHARED_LAYER_BLOCK_BYTES // (per_point * a.element_size()))
        parts = []
        for start in range(0, len(a), step):
            g = torch.stack([rows[start : start + step] for rows in self.rows], 1)
            g, x = _rotate(g, self.Q_out), a[start : start + step]
            parts.append(self._position_block(g, x) if by_positions else self._product_block(g, x))
        self.rows.clear()
        return torch.cat(parts)

    def _product_block(self, g: Tensor, a: Tensor) -> Tensor:
        """``Σᵢⱼ Mcᵢⱼ Mdᵢⱼ / sᵢⱼ`` (b, C, C): rotated gradients (b, C, T, out), inputs (b, T, in).

        ``Mc = Σₜ g̃cₜ ãₜᵀ`` (``_products``).
        """
        M = self._products(g, a)
        return (M * self.inv.flatten()) @ M.transpose(1, 2)

    def _position_block(self, g: Tensor, a: Tensor) -> Tensor:
        """``Σₜᵤ Σᵢ g̃cₜᵢ g̃duᵢ Wₜᵤᵢ`` (b, C, C) with ``Wₜᵤᵢ = Σⱼ ãₜⱼ ãᵤⱼ / sᵢⱼ`` (b, T, T, out).

        Equal to ``_product_block``: ``Σᵢⱼ Mcᵢⱼ Mdᵢⱼ / sᵢⱼ`` with ``Mc = Σₜ g̃cₜ ãₜᵀ``.
        """
        inv = self.inv.T if self.rule.inputs_first else self.inv  # (out, in)
        weights = (a.unsqueeze(2) * a.unsqueeze(1)) @ inv.T
        mixed = torch.einsum("bcto,btuo->bcuo", g, weights)
        return torch.einsum("bcuo,bduo->bcd", mixed, g)

    def _products(self, g: Tensor, a: Tensor) -> Tensor:
        """``Mc = Σₜ g̃cₜ ãₜᵀ`` of gradients (b, C, T, out), inputs (b, T, in): (b, C, out·in)."""
        x = a.unsqueeze(1)
        M = x.transpose(2, 3) @ g if self.rule.inputs_first else g.transpose(2, 3) @ x
        return M.flatten(2)


def _token_variance(module: nn.Embedding, tokens: Tensor, U: Tensor, inv: Tensor) -> Tensor:
    """``J P⁻¹ Jᵀ`` of an embedding from its tokens (B, T) and rotated gradients (B, C, T, D).

    The Jacobian row of output c for data point n and token v is ``Σ_{t: xₙₜ = v} g̃cₜ``; those of
    the (data point, token) pairs present are summed by one scatter and weighted by ``1/s[v]``.
    """
    B, C, T, D = U.shape
    V = module.num_embeddings
    pairs, index, _ = row_token_pairs(tokens, V)
    rows = U.new_zeros(len(pairs), C, D)
    rows = rows.index_add(0, index, U.permute(0, 2, 1, 3).reshape(B * T, C, D))
    weights = inv[pairs % V]  # (n_pairs, D)
    if module.padding_idx is not None:  # its row gets no gradient
        weights = weights * (pairs % V != module.padding_idx).unsqueeze(1)
    per_pair = (rows * weights.unsqueeze(1)) @ rows.transpose(1, 2)
    return U.new_zeros(B, C, C).index_add(0, pairs // V, per_pair)


def _slots(trace: PerSampleTrace, block_inverse: BlockInverse) -> list[_Slot] | None:
    """The slots of the trace's parameters, or None where a two-factor block has no rule."""
    engine, slots = trace.engine, []
    owners: dict[int, list[tuple[nn.Module, str]]] = {}
    for key, i in engine.slot.items():
        owners.setdefault(i, []).append(key)
    for i in range(len(engine.needed)):
        Qs, inv = block_inverse(i)
        (module, name), shared = owners[i][0], len(owners[i]) > 1
        grouped = None if shared else grouped_rule(module, name)
        if grouped is not None and (len(Qs) == 2 or grouped[1] == "bias"):
            map_name, kind, rule = grouped  # a map of an attention layer
            slots.append(_Slot(kind, module, rule, Qs, inv, map_name))
            continue
        rule = None if shared or grouped is not None else kfac_rule(module)
        if len(Qs) == 2:
            if rule is None or name != "weight" or (rule.one_hot and Qs[0] is not None):
                return None  # no rule, or an embedding whose vocabulary factor is not diagonal
            kind = "kron"
        else:
            kind = "bias" if rule is not None and name == "bias" else "exact"
        slots.append(_Slot(kind, module, rule, Qs, inv))
    return slots


def _output_gradients(f: Tensor, calls: list, create_graph: bool) -> Iterator[list[list[Tensor]]]:
    """Per output column of ``f`` (B, C), its gradients w.r.t. every recorded layer output.

    Columns go through one vectorised backward pass a block at a time (as many as
    ``COLUMN_BLOCK_BYTES`` of gradients hold) where ``OutputGradients`` can, else one pass each.
    """
    grads = OutputGradients(f, calls, create_graph)
    B, C = f.shape[0], f.reshape(f.shape[0], -1).shape[1]
    eye = torch.eye(C, dtype=f.dtype, device=f.device)
    columns = eye.unsqueeze(1).expand(C, B, C).reshape(C, *f.shape)
    if not grads.vectorised:
        for column in columns:
            yield grads(column)
        return
    per_column = sum(z.numel() for call in calls for z in call.outputs) * f.element_size()
    step = max(1, COLUMN_BLOCK_BYTES // max(1, per_column))
    for start in range(0, C, step):
        block = grads.columns(columns[start : start + step])
        for k in range(min(step, C - start)):
            yield [[g[k] for g in per_call] for per_call in block]


def layerwise_variance(
    trace: PerSampleTrace, block_inverse: BlockInverse, create_graph: bool
) -> Tensor | None:
    """``J P⁻¹ Jᵀ`` (B, C, C) of the linearised network from a recorded forward pass.

    Args:
        trace: Recorded forward over the test inputs (all parameters, no subnetwork).
        block_inverse: Per parameter, the eigenvectors and inverse spectrum of its block.
        create_graph: Keep the result differentiable w.r.t. the inputs.

    Returns:
        The covariances, or None when a layer does not see the data points along its first
        dimension or a two-factor block has no Kronecker rule (the caller then falls back to
        Jacobians).
    """
    f, calls, engine = trace.f, trace.calls, trace.engine
    B = f.shape[0]
    slots = _slots(trace, block_inverse)
    if slots is None or not trace.layerwise:
        return None
    C = f.reshape(B, -1).shape[1]
    factored = {s.key: s for s in slots if s.kind == "kron"}
    ruled: dict[nn.Module, dict[tuple, KfacRule]] = {}
    for s in slots:
        if s.kind != "exact":
            ruled.setdefault(s.module, {})[s.key] = s.rule
    exact = {i for i, s in enumerate(slots) if s.kind == "exact"}
    inputs: dict[tuple, Tensor] = {}
    for call in calls:
        for key, rule in ruled.get(call.module, {}).items():
            if key in factored:
                for a in as_uses(rule.inputs(call)):
                    _cat(inputs, key, a)
    for key, a in inputs.items():
        if not factored[key].rule.one_hot:
            inputs[key] = _rotate(a, factored[key].Q_in)
    for g_calls in _output_gradients(f, calls, create_graph):
        gs: dict[tuple, Tensor] = {}
        us: dict[int, Tensor] = {}
        for call, g in zip(calls, g_calls):
            for key, rule in ruled.get(call.module, {}).items():
                for use in as_uses(rule.grads(call, g)):
                    _cat(gs, key, use)
            if any(engine.slot[call.module, n] in exact for n in call.names):
                for name, u in per_sample_grads(call, g).items():
                    i = engine.slot[call.module, name]
                    if i in exact:
                        us[i] = us.get(i, 0) + u.flatten(1)
        for i, slot in enumerate(slots):
            if slot.kind == "exact":
                u = us.get(i, f.new_zeros(B, engine.needed[i].numel()))
                slot.add(None, None, u)
            elif slot.key in gs:
                slot.add(gs[slot.key], inputs.get(slot.key), None)
    f_var = f.new_zeros(B, C, C)
    for slot in slots:
        if slot.rows:
            f_var = f_var + slot.variance(inputs.get(slot.key))
    return f_var
