r"""Kronecker-factored curvature (KFAC) from one recorded forward and one backward per column.

For a layer ``z = W a (+ b)`` applied at ``T`` positions per row (``T = 1`` for a linear layer on
(B, D) inputs, the output pixels of a convolution, the tokens of a sequence), with layer inputs
``aₙₜ`` (convolution patches) and gradients ``gₙₖₜ = ∂(vₙₖᵀ fₙ)/∂zₙₜ`` of the output columns
``vₖ`` of the curvature (``Σₖ vₖ vₖᵀ = Λ`` for the exact GGN, sampled loss gradients for the MC
Fisher, the loss gradient for the empirical Fisher), KFAC approximates the weight block by
``G ⊗ A`` with, over the N data points of the whole data set,

- expand: ``A = (1/(N·T)) Σₙₜ aₙₜ aₙₜᵀ``,  ``G = Σₖₙₜ gₙₖₜ gₙₖₜᵀ``;
- reduce: ``A = (1/N) Σₙ āₙ āₙᵀ`` with ``āₙ = (1/T) Σₜ aₙₜ``,  ``G = Σₖₙ ḡₙₖ ḡₙₖᵀ`` with
  ``ḡₙₖ = Σₜ gₙₖₜ``,

and the bias block by ``G`` (the bias–weight cross terms are dropped). Summing the factors of
batches gives the factors of the data set. For one linear layer with one output, ``G ⊗ A`` is the
exact GGN block. The factors are split like laplace-torch's (``G/√c ⊗ √c·A`` with ``c`` the
backend's loss factor, ½ for regression), so its per-factor numbers, and thereby damping, agree.

Supported layers: :data:`KFAC_RULES` (``nn.Linear`` on inputs of any rank, ``nn.Conv1d/2d/3d``
without groups); every other module that owns a parameter of interest is refused by
:func:`check_kfac_support` with its name.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from typing import NamedTuple

import torch
from torch import Tensor, nn

from laplace.curvature.capture import OutputGradients
from laplace.curvature.layer_rules import ModuleCall, _conv_patches
from laplace.curvature.per_sample import COLUMNS_PER_BACKWARD, PerSampleTrace
from laplace.utils.linalg import symmetric_gram
from laplace.utils.matrix import Kron

__all__ = ["KFAC_APPROXIMATIONS", "KFAC_RULES", "KfacRule", "check_kfac_support", "kfac"]

#: The weight-sharing approximations of Eschenhagen et al. (2023).
KFAC_APPROXIMATIONS = ("expand", "reduce")


class KfacRule(NamedTuple):
    """How a layer type exposes its inputs and output gradients per position.

    Attributes:
        inputs: Recorded call → layer inputs (R, T, D_in), patches for convolutions.
        grads: Recorded call and the gradient w.r.t. its output → (R, T, D_out).
        check: Module → reason it cannot be Kronecker-factored, or None.
    """

    inputs: Callable[[ModuleCall], Tensor]
    grads: Callable[[ModuleCall, Tensor], Tensor]
    check: Callable[[nn.Module], str | None]


def _rows(t: Tensor) -> Tensor:
    return t.reshape(t.shape[0], -1, t.shape[-1])


def _conv_inputs(call: ModuleCall) -> Tensor:
    return _conv_patches(call)[:, 0]


def _conv_grads(call: ModuleCall, g: Tensor) -> Tensor:
    return g.flatten(2).transpose(1, 2)


def _conv_check(module: nn.Module) -> str | None:
    return "grouped convolutions have no single Kronecker factor" if module.groups != 1 else None


_LINEAR = KfacRule(lambda call: _rows(call.args[0]), lambda call, g: _rows(g), lambda m: None)
_CONV = KfacRule(_conv_inputs, _conv_grads, _conv_check)

#: KFAC rules keyed by exact module type.
KFAC_RULES: dict[type[nn.Module], KfacRule] = {
    nn.Linear: _LINEAR,
    nn.Conv1d: _CONV,
    nn.Conv2d: _CONV,
    nn.Conv3d: _CONV,
}


def check_kfac_support(model: nn.Module, params: Iterable[Tensor]) -> None:
    """Refuse parameters that KFAC cannot model, naming the module that owns them.

    Raises:
        ValueError: If a module with a KFAC-unsupported type owns one of ``params``.
    """
    wanted = {id(p) for p in params}
    for name, module in model.named_modules():
        if not any(id(p) in wanted for p in module.parameters(recurse=False)):
            continue
        rule = KFAC_RULES.get(type(module))
        reason = (
            f"KFAC supports only {sorted(t.__name__ for t in KFAC_RULES)}"
            if rule is None
            else rule.check(module)
        )
        if reason:
            raise ValueError(
                f"module {name or '<root>'!r} ({type(module).__name__}) owns parameters that "
                f"KFAC cannot model: {reason}. Freeze them (requires_grad=False) or use "
                "hessian_structure='diag' or 'full'."
            )


def _gram(t: Tensor, approx: str, mean: bool, scale: float = 1.0) -> Tensor:
    """``scale ·`` Σ of outer products of (R, T, D) rows, shape (D, D), without copying them.

    Expand sums over every position; reduce over the per-row sum (or mean) over positions. Rows
    laid out contiguously go through one symmetric Gram product (each off-diagonal block once),
    scaled before the product where they are fewer numbers than the result; strided ones (the
    gradients of a convolution, (R, D, T) in memory) through a batched product.
    """
    if approx == "reduce" or t.shape[1] == 1 or t.is_contiguous():
        if approx == "reduce":
            rows = t.mean(1) if mean else t.sum(1)
        else:
            rows = t.reshape(-1, t.shape[-1])  # a view: every position is a row
        if scale != 1 and rows.numel() < rows.shape[1] ** 2:
            return symmetric_gram(rows * math.sqrt(scale))
        gram = symmetric_gram(rows)
    else:
        gram = torch.bmm(t.transpose(1, 2), t).sum(0)
    return gram if scale == 1 else gram.mul_(scale)


def _column_gradients(
    trace: PerSampleTrace, columns: list[Tensor]
) -> Iterator[tuple[int, Tensor]]:
    """``(call index, gradient w.r.t. its output)`` for chunks of columns, rows (k·B, ...).

    Columns go through one vectorised backward per chunk of :data:`COLUMNS_PER_BACKWARD`,
    except with a convolution in the model: the batching rule of its backward loops over the
    columns and copies, so one plain backward per column is faster there.
    """
    output_grads = OutputGradients(trace.f, trace.calls)
    if any(isinstance(call.module, nn.modules.conv._ConvNd) for call in trace.calls):
        for v in columns:
            for i, (g,) in enumerate(output_grads(v)):
                yield i, g.detach()
        return
    for start in range(0, len(columns), COLUMNS_PER_BACKWARD):
        chunk = torch.stack(columns[start : start + COLUMNS_PER_BACKWARD])
        for i, (g,) in enumerate(output_grads.stacked(chunk)):
            yield i, g.detach().flatten(0, 1)


def _add(sums: dict[nn.Module, Tensor], module: nn.Module, value: Tensor) -> None:
    if module in sums:
        sums[module] += value
    else:
        sums[module] = value


def kfac(
    trace: PerSampleTrace,
    columns: Iterable[Tensor],
    n_data: int,
    approx: str,
    factor: float,
    gradients: list[list[Tensor]] | None = None,
) -> Kron:
    """KFAC factors of one batch, normalised for a data set of ``n_data`` points.

    Args:
        trace: A recorded forward pass over the batch.
        columns: Output columns ``vₖ`` (B, C) of the curvature.
        n_data: Number of data points N of the whole data set.
        approx: ``"expand"`` or ``"reduce"``.
        factor: The backend's loss factor ``c`` (sets the split of each block between factors).
        gradients: The columns' gradients w.r.t. each call's outputs, each (K, B, ...), where
            already taken (else they are taken here).

    Returns:
        One block per parameter in ``trace.engine.needed`` order.

    Raises:
        ValueError: For an unknown ``approx`` or an unsupported layer.
    """
    if approx not in KFAC_APPROXIMATIONS:
        raise ValueError(f"kfac_approx must be one of {KFAC_APPROXIMATIONS}, got {approx!r}.")
    engine, calls = trace.engine, trace.calls
    for call in calls:
        check_kfac_support(call.module, [getattr(call.module, n) for n in call.names])
    A: dict[nn.Module, Tensor] = {}
    G: dict[nn.Module, Tensor] = {}
    root = math.sqrt(factor)
    for call in calls:
        if "weight" in call.names:
            a = KFAC_RULES[type(call.module)].inputs(call).detach()
            positions = a.shape[1] if approx == "expand" else 1
            _add(A, call.module, _gram(a, approx, mean=True, scale=root / (n_data * positions)))
    rows: dict[int, list[Tensor]] = {}
    if gradients is None:
        stream = _column_gradients(trace, list(columns))
    else:
        stream = ((i, g.detach().flatten(0, 1)) for i, (g,) in enumerate(gradients))
    for i, g in stream:
        # Gradients of one position per row are gathered into one Gram product per call; those
        # of many positions (convolutions) are large, so their Gram is added chunk by chunk.
        g = KFAC_RULES[type(calls[i].module)].grads(calls[i], g)
        if g.shape[1] == 1 or approx == "reduce":
            rows.setdefault(i, []).append(g.sum(1))
        else:
            _add(G, calls[i].module, _gram(g, approx, mean=False))
    for i, gs in rows.items():
        _add(G, calls[i].module, symmetric_gram(torch.cat(gs)))
    blocks: list[list[Tensor] | None] = [None] * len(engine.needed)
    for module, names in engine.owners.items():
        for name in names:
            slot = engine.slot[module, name]
            p = engine.needed[slot]
            if module not in G:  # the module was not called on this batch
                G[module] = p.new_zeros(p.shape[0], p.shape[0])
            if name == "weight":
                a_factor = A.get(module, p.new_zeros(p[0].numel(), p[0].numel()))
                blocks[slot] = [G[module] / root, a_factor]
            else:
                blocks[slot] = [G[module]]
    return Kron(blocks)
