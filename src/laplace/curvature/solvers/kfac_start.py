r"""A start block for the low-rank eigensolver from the Kronecker-factored curvature.

The eigenvectors of a KFAC block ``G ⊗ A`` are ``q_G,i ⊗ q_A,j`` with eigenvalues
``λ_G,i λ_A,j``; the M with the largest eigenvalues over all layers, the columns of ``V``
(P, M), span most of the top eigenvectors of ``H``. Rayleigh–Ritz on them (the eigenpairs of
``Vᵀ H V``) picks the b best directions ``Q₀ = V C``, and one backprojection gives
``Y = H Q₀``. A layer's per-sample vector ``Σₜ gₜ aₜᵀ`` projects onto ``q_G ⊗ q_A`` as
``Σₜ (q_Gᵀ gₜ)(aₜᵀ q_A)``, so no dense block is formed. Three passes over the data.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from laplace.curvature.engine.kfac import kfac
from laplace.curvature.engine.kfac_rules import check_kronecker_layers, kfac_rule, plan_blocks
from laplace.curvature.engine.per_sample import PerSampleTrace
from laplace.curvature.solvers.products import NativeProduct
from laplace.utils.linalg import symeig, symmetric_gram
from laplace.utils.matrix import Kron

__all__ = ["CANDIDATES_PER_VECTOR", "KfacStart", "kfac_start"]

#: Kronecker candidates per vector of the start block, by default.
CANDIDATES_PER_VECTOR = 12


class KfacStart(NamedTuple):
    """The start block of the eigensolver and its product with the curvature.

    Attributes:
        Q: Orthonormal Ritz vectors of the curvature on the Kronecker candidates, (P, b).
        HQ: The curvature times ``Q``, (P, b).
        values: Their Ritz values, in descending order, (b,).
    """

    Q: Tensor
    HQ: Tensor
    values: Tensor


class _Block(NamedTuple):
    """The candidates of one parameter tensor: eigenvector pairs ``(g_index[a], a_index[a])``.

    ``QG`` (p_out, r_G) and ``QA`` (p_in, r_A) hold the leading eigenvectors of the factors (a
    bias has no ``QA``); ``start`` is the position of the block's first candidate among all.
    """

    slot: int
    QG: Tensor
    QA: Tensor | None
    g_index: Tensor
    a_index: Tensor
    start: int


class _Candidates:
    """The ``n_candidates`` Kronecker eigenvectors of the KFAC curvature with top eigenvalues."""

    def __init__(self, factors: Kron, n_candidates: int) -> None:
        pairs = []
        for F in factors.kfacs:
            values, vectors = zip(*(symeig(Fi) for Fi in F))  # values clamped at 0
            values, vectors = [v.flip(0) for v in values], [Q.flip(1) for Q in vectors]
            score = values[0] if len(F) == 1 else torch.outer(values[0], values[1]).flatten()
            pairs.append((vectors, score))
        scores = torch.cat([score for _, score in pairs])
        chosen = torch.zeros(len(scores), dtype=torch.bool, device=scores.device)
        chosen[scores.topk(min(n_candidates, len(scores))).indices] = True
        self.blocks: list[_Block] = []
        offset, start = 0, 0
        for slot, (vectors, score) in enumerate(pairs):
            index = chosen[offset : offset + len(score)].nonzero().squeeze(1)
            offset += len(score)
            if len(index) == 0:
                continue
            width = 1 if len(vectors) == 1 else vectors[1].shape[0]
            g_index, a_index = index // width, index % width
            QA = None if len(vectors) == 1 else vectors[1][:, : int(a_index.max()) + 1]
            QG = vectors[0][:, : int(g_index.max()) + 1]
            self.blocks.append(_Block(slot, QG, QA, g_index, a_index, start))
            start += len(index)
        self.n = start

    def project(self, trace: PerSampleTrace, grads: list[list[Tensor]]) -> Tensor:
        """``G V``: the batch's per-sample vectors on the candidates, shape (K, B, M).

        Args:
            trace: The recorded batch.
            grads: Per call, the gradients of the K columns w.r.t. its outputs, (K, B, ...).
        """
        K, B = grads[0][0].shape[:2] if grads else (0, trace.f.shape[0])
        out = trace.f.new_zeros(K, B, self.n)
        by_slot = {block.slot: block for block in self.blocks}
        for call, (g,) in zip(trace.calls, grads):
            rule = kfac_rule(call.module)
            rows = rule.grads(call, [g.detach().flatten(0, 1)])  # (K·B, T, p_out)
            for name in call.names:
                block = by_slot.get(trace.engine.slot[call.module, name])
                if block is None:
                    continue
                x = (rows @ block.QG).unflatten(0, (K, B))  # (K, B, T, r_G)
                if block.QA is None:
                    value = x.sum(2).index_select(-1, block.g_index)
                else:
                    y = rule.inputs(call).detach() @ block.QA  # (B, T, r_A)
                    value = _kronecker_projection(x, y, block.g_index, block.a_index)
                out[..., block.start : block.start + len(block.g_index)] += value
        return out

    def vectors(self, C: Tensor, n_params: int, offsets: list[int]) -> Tensor:
        """``V C``: the candidates combined by the columns of ``C`` (M, b), shape (P, b)."""
        out = C.new_zeros(n_params, C.shape[1])
        for block in self.blocks:
            rows = C[block.start : block.start + len(block.g_index)]  # (n, b)
            target = out[offsets[block.slot] : offsets[block.slot + 1]]
            if block.QA is None:
                target += block.QG[:, block.g_index] @ rows
                continue
            grid = C.new_zeros(C.shape[1], block.QG.shape[1], block.QA.shape[1])
            grid[:, block.g_index, block.a_index] = rows.T
            dense = block.QG @ grid @ block.QA.T  # (b, p_out, p_in)
            target += dense.flatten(1).T
        return out


def _kronecker_projection(x: Tensor, y: Tensor, i: Tensor, j: Tensor) -> Tensor:
    """``Σₜ x[k, n, t, iₐ] y[n, t, jₐ]`` for the pairs ``(iₐ, jₐ)``, shape (K, B, len(i))."""
    if x.shape[2] == 1:
        return x[:, :, 0].index_select(-1, i) * y[:, 0].index_select(-1, j)
    grid = x.transpose(2, 3) @ y  # (K, B, r_G, r_A)
    return grid.flatten(2).index_select(-1, i * y.shape[-1] + j)


def kfac_start(product: NativeProduct, width: int, n_candidates: int) -> KfacStart | None:
    """The start block of ``width`` Ritz vectors of ``H`` on ``n_candidates`` KFAC eigenvectors.

    Args:
        product: The curvature over the data set.
        width: Number b of vectors in the block.
        n_candidates: Number M ≥ b of Kronecker candidates (at most P).

    Returns:
        The block, its product with ``H`` and its Ritz values; None where KFAC does not apply
        (a layer other than Linear and convolution layers, a model whose layers do not see the
        data points along dim 0, a subnetwork).
    """
    backend = product.backend
    try:  # candidates need G ⊗ A blocks of dense inputs: Linear and convolution layers only
        check_kronecker_layers(backend.model, backend.params, "the KFAC start")
    except ValueError:
        return None
    factors, n_data = None, 0
    for vectors in product.batches():
        trace, gradients = vectors.trace, vectors.output_gradients
        if not vectors.layerwise:
            return None
        blocks = plan_blocks(trace.engine) if factors is None else ()  # the engine's, once
        if any(block.kind not in ("kron", "bias") for block in blocks):  # tied weights
            return None
        batch = kfac(trace, list(vectors.columns), 1, "expand", backend.factor, gradients)
        n_data += vectors.B
        factors = batch if factors is None else factors + batch
    if factors is None:
        return None
    # Input factors are means over the data (normalised by N, biases' blocks are not).
    n_data = product.reduce(torch.tensor(float(n_data), device=product.device))
    factors = Kron(
        [
            [product.reduce(F) / (n_data if i else 1) for i, F in enumerate(block)]
            for block in factors.kfacs
        ]
    )
    candidates = _Candidates(factors, max(n_candidates, width))
    gram = None
    for vectors in product.batches():
        projected = candidates.project(vectors.trace, vectors.output_gradients)
        update = symmetric_gram(projected.flatten(0, 1))
        gram = update if gram is None else gram.add_(update)
    values, C = torch.linalg.eigh(product.reduce(gram))
    values, C = values.flip(0)[:width], C.flip(1)[:, :width]
    HQ = product.backproject(
        lambda vectors: candidates.project(vectors.trace, vectors.output_gradients) @ C, width
    )
    Q = candidates.vectors(C, product.n_params, backend.engine.offsets)
    return KfacStart(Q, HQ, values)
