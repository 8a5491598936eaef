r"""Per-sample vectors times blocks of parameter vectors, per layer, without forming them.

The per-sample vectors ``gₙₖ = Jₙᵀ vₙₖ`` of a recorded batch are the rows of a (K·B, P) matrix
``G``; this module computes ``G V`` (K, B, m) for a block ``V`` (P, m) and ``Gᵀ W`` (P, m), so
``H V = Σ Gᵀ (G V)`` costs one recorded forward and one vectorised backward per batch.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten

from laplace.curvature.engine.layer_rules import ModuleCall
from laplace.curvature.engine.per_sample import PerSampleEngine, PerSampleTrace

__all__ = ["PER_SAMPLE_CACHE_BYTES", "BlockSum", "ParameterBlock", "SampleVectors"]

#: Bytes of per-sample gradients kept between ``G V`` and ``Gᵀ W`` for one batch.
PER_SAMPLE_CACHE_BYTES = 256 * 2**20


def _is_plain_linear(call: ModuleCall) -> bool:
    """A Linear on (B, D_in) inputs: per-sample weight vectors are outer products."""
    return type(call.module) is nn.Linear and call.args[0].dim() == 2


class ParameterBlock:
    """A block of m parameter vectors ``V`` (P, m), with the per-slot views the rules use.

    Args:
        engine: The engine whose parameter order (``engine.needed``) ``V`` follows.
        V: The block, shape (P, m).
    """

    def __init__(self, engine: PerSampleEngine, V: Tensor) -> None:
        self.engine, self.V = engine, V
        self._linear: dict[int, Tensor] = {}

    def slot(self, i: int) -> Tensor:
        """Rows of parameter slot ``i``, shape (n_i, m)."""
        return self.V[self.engine.offsets[i] : self.engine.offsets[i + 1]]

    def linear(self, i: int) -> Tensor:
        """A Linear weight's rows laid out as (D_in, D_out·m), made once per block."""
        if i not in self._linear:
            d_out, d_in = self.engine.needed[i].shape
            rows = self.slot(i).reshape(d_out, d_in, -1)
            self._linear[i] = rows.permute(1, 0, 2).reshape(d_in, -1)
        return self._linear[i]


class BlockSum:
    """Accumulator of ``Gᵀ W`` over batches: a (P, m) result plus the Linear layouts.

    A Linear weight's part of a single vector (m = 1) is accumulated in place in the result;
    for blocks, in a (D_in, D_out·m) layout added to the result at the end.

    Args:
        engine: The engine whose parameter order the result follows.
        m: Number of vectors in the block.
        like: A tensor with the result's dtype and device.
        out: Memory for the result (P, m), zeroed first (None: new memory).
    """

    def __init__(
        self, engine: PerSampleEngine, m: int, like: Tensor, out: Tensor | None = None
    ) -> None:
        self.engine, self.m = engine, m
        self.total = like.new_zeros(engine.n_entries, m) if out is None else out.zero_()
        self._linear: dict[int, Tensor] = {}

    def add(self, value: Tensor) -> None:
        """Add ``value`` (P, m) to the whole result."""
        self.total += value

    def add_rows(self, i: int, value: Tensor) -> None:
        """Add ``value`` (n_i, m) to slot ``i``."""
        self.total[self.engine.offsets[i] : self.engine.offsets[i + 1]] += value

    def add_linear(self, i: int, inputs: Tensor, weights: Tensor) -> None:
        """Add ``inputsᵀ weights`` ((D_in, B) @ (B, D_out·m)) to Linear weight slot ``i``."""
        if self.m == 1:
            d_out, d_in = self.engine.needed[i].shape
            rows = self.total[self.engine.offsets[i] : self.engine.offsets[i + 1]]
            rows.view(d_out, d_in).addmm_(weights.T, inputs)
        elif i in self._linear:
            self._linear[i].addmm_(inputs.T, weights)
        else:
            self._linear[i] = inputs.T @ weights

    def result(self) -> Tensor:
        """The accumulated ``Σ Gᵀ W``, shape (P, m)."""
        for i, value in self._linear.items():
            d_out, d_in = self.engine.needed[i].shape
            rows = self.total[self.engine.offsets[i] : self.engine.offsets[i + 1]]
            rows.view(d_out, d_in, self.m).add_(value.view(d_in, d_out, self.m).permute(1, 0, 2))
        self._linear.clear()
        return self.total


class SampleVectors:
    """The per-sample vectors ``gₙₖ = Jₙᵀ vₙₖ`` of one recorded batch as a (K·B, P) map ``G``.

    Args:
        trace: A recorded forward pass.
        columns: Output columns ``vₖ``, shape (K, *f.shape).
    """

    def __init__(self, trace: PerSampleTrace, columns: Tensor) -> None:
        self.trace, self.columns = trace, columns
        self.K, self.B = columns.shape[0], trace.f.shape[0]
        self.layerwise = trace.layerwise
        #: Per recorded call, the columns' gradients w.r.t. its outputs, each (K, B, ...) (empty
        #: unless ``layerwise``).
        self.output_gradients = trace.output_gradients(columns) if self.layerwise else []
        # Linear layers on (B, D) inputs contract per data point, through (B, K, D) views of
        # their output gradients.
        self._plain_linear = {
            i for i, call in enumerate(trace.calls) if self.layerwise and _is_plain_linear(call)
        }
        self._cache: dict[tuple[int, int], dict[int, Tensor]] = {}
        self._cached_bytes = 0

    @property
    def nbytes(self) -> int:
        """Memory of the recorded batch: layer inputs, outputs and output gradients."""
        tensors = [self.columns, self.trace.f]
        tensors += [g for grads in self.output_gradients for g in grads]
        for call in self.trace.calls:
            tensors += [a for a in call.args if isinstance(a, Tensor)] + list(call.outputs)
            kept = tree_flatten(list(call.cache.values()))[0]  # a rule's pytrees of tensors
            tensors += [t for t in kept if isinstance(t, Tensor)]
        return sum(t.numel() * t.element_size() for t in tensors)

    def drop_graph(self) -> None:
        """Free the autograd graph of the batch; the layer rules need only what was recorded."""
        self.trace.drop_graph()

    def clear_cache(self) -> None:
        """Forget the per-sample gradients kept between ``G V`` and ``Gᵀ W``."""
        self._cache.clear()
        self._cached_bytes = 0

    def release(self) -> None:
        """Free the batch's output gradients and autograd graph: it gives no products after.

        For a batch used once: whoever still refers to it (a loop variable while the next
        batch is recorded) then holds only its layer inputs.
        """
        self.clear_cache()
        self.output_gradients.clear()
        self.trace.drop_graph()

    # ----------------------------------------------------------------- per-sample gradients
    def _per_sample(self, i: int, k: int) -> dict[int, Tensor]:
        """Per-sample gradients (B, n) of call ``i`` for column ``k``, by parameter slot.

        ``i = -1`` gives the rows (B, P) of the whole model, under slot -1 (fallback route).
        Results are kept for the next product within ``PER_SAMPLE_CACHE_BYTES``.
        """
        if (i, k) in self._cache:
            return self._cache[i, k]
        if i < 0:
            out = {-1: self.trace.per_sample(self.columns[k])}
        else:
            g_call = [g[k] for g in self.output_gradients[i]]
            grads = self.trace.slot_grads(self.trace.calls[i], g_call)
            out = {slot: grad.reshape(self.B, -1) for slot, grad in grads.items()}
        nbytes = sum(t.numel() * t.element_size() for t in out.values())
        if self._cached_bytes + nbytes <= PER_SAMPLE_CACHE_BYTES:
            self._cache[i, k] = out
            self._cached_bytes += nbytes
        return out

    # ---------------------------------------------------------------------------- products
    def project(self, block: ParameterBlock) -> Tensor:
        """``G V``: inner products of every per-sample vector with the block, (K, B, m)."""
        V = block.V
        if not self.layerwise:
            return torch.stack([self._per_sample(-1, k)[-1] @ V for k in range(self.K)])
        out = V.new_zeros(self.K, self.B, V.shape[1])
        slot = self.trace.engine.slot
        for i, call in enumerate(self.trace.calls):
            if i in self._plain_linear:
                g = self.output_gradients[i][0]  # (K, B, D_out)
                for name in call.names:
                    j = slot[call.module, name]
                    if name == "weight":
                        t = call.args[0] @ block.linear(j)  # (B, D_out·m)
                        t = t.reshape(self.B, g.shape[-1], -1)
                        out += torch.bmm(g.transpose(0, 1), t).transpose(0, 1)
                    else:
                        out += g @ block.slot(j)
                continue
            for k in range(self.K):
                for j, grad in self._per_sample(i, k).items():
                    out[k] += grad @ block.slot(j)
        return out

    def backproject(self, W: Tensor, total: BlockSum) -> None:
        """Add ``Gᵀ W = Σₙₖ Wₙₖ gₙₖ`` for weights ``W`` (K, B, m) to ``total``."""
        if not self.layerwise:
            for k in range(self.K):
                total.add(self._per_sample(-1, k)[-1].T @ W[k])
            return
        slot = self.trace.engine.slot
        for i, call in enumerate(self.trace.calls):
            if i in self._plain_linear:
                g = self.output_gradients[i][0]  # (K, B, D_out)
                for name in call.names:
                    j = slot[call.module, name]
                    if name == "weight":  # (B, D_out, K) @ (B, K, m)
                        u = torch.bmm(g.permute(1, 2, 0), W.transpose(0, 1))
                        total.add_linear(j, call.args[0], u.reshape(self.B, -1))
                    else:
                        flat = g.reshape(-1, g.shape[-1])
                        total.add_rows(j, flat.T @ W.reshape(-1, W.shape[-1]))
                continue
            for k in range(self.K):
                for j, grad in self._per_sample(i, k).items():
                    total.add_rows(j, grad.T @ W[k])
