r"""Jacobian kinds of the function-space approximations: neural tangent kernels between points.

The GP view needs the kernel ``J(x) J(x')ᵀ`` between data points and products ``J(x) v``;
``DenseJacobian`` (the rows (B, C, P)) and ``FactoredJacobian`` (per-layer output
gradients ``G_l`` (B, C, out) and inputs ``a_l`` (B, in) of layers applied once per data point,
``J_c J_dᵀ = Σ_l (g_{l,c} · g_{l,d})(a_l · a_l' + [bias_l])``) implement the same methods, so the
GP code never asks which one it holds; a kernel between different kinds goes through the dense
rows. See ``docs/function_space.md``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from laplace.curvature.engine.capture import OutputGradients
from laplace.curvature.engine.kfac_rules import kfac_rule
from laplace.curvature.engine.per_sample import PerSampleEngine, PerSampleTrace
from laplace.utils.data import Inputs

__all__ = ["DenseJacobian", "FactoredJacobian", "LayerFactor", "layer_factors", "trace_jacobian"]


class DenseJacobian:
    """The Jacobian rows of B points w.r.t. P parameters.

    Args:
        rows: Shape (B, C, P).
    """

    def __init__(self, rows: Tensor) -> None:
        self.rows = rows

    @property
    def shape(self) -> tuple[int, int]:
        """Points and outputs (B, C)."""
        return tuple(self.rows.shape[:2])

    @property
    def row_width(self) -> int:
        """Entries held per point and output (P)."""
        return self.rows.shape[-1]

    @property
    def nbytes(self) -> int:
        """Memory held, in bytes."""
        return self.rows.nbytes

    def dense(self) -> Tensor:
        """The rows (B, C, P)."""
        return self.rows

    def cross(self, other: DenseJacobian | FactoredJacobian, independent: bool) -> Tensor:
        """Kernel ``J Jₒᵀ`` with another point set: (B·C, B'·C), or (C, B, B') per output."""
        right = other.dense()
        if independent:
            return torch.einsum("bcp,mcp->cbm", self.rows, right)
        return self.rows.flatten(0, 1) @ right.flatten(0, 1).T

    def output_blocks(self) -> Tensor:
        """``Jₙ Jₙᵀ`` per point, shape (B, C, C)."""
        return self.rows @ self.rows.transpose(1, 2)

    def output_variances(self) -> Tensor:
        """The diagonal of ``output_blocks``, shape (B, C)."""
        return self.rows.square().sum(-1)

    def matvec(self, v: Tensor) -> Tensor:
        """``J v`` for a parameter vector v (P,), shape (B, C)."""
        return self.rows @ v


class LayerFactor(NamedTuple):
    """The Jacobian factors of one layer applied once per data point.

    Attributes:
        G: Output gradients ``∂f_c/∂z`` per point and output, (B, C, out).
        a: Layer inputs (B, in); None when the weight is not a parameter of interest.
        bias: Whether the bias is a parameter of interest.
        slots: Positions of the weight and bias in the parameter list (None: not included).
    """

    G: Tensor
    a: Tensor | None
    bias: bool
    slots: tuple[int | None, int | None]


def _input_products(layer: LayerFactor, other: LayerFactor | None = None) -> Tensor:
    """``a aₒᵀ + [bias]`` (B, B'), or ``|a|² + [bias]`` per point (B,) without ``other``.

    A layer whose weight is not a parameter of interest (a bias alone) gives ones.
    """
    if layer.a is None:
        return layer.G.new_ones(len(layer.G) if other is None else (len(layer.G), len(other.G)))
    products = layer.a.square().sum(-1) if other is None else layer.a @ other.a.T
    return products + 1 if layer.bias else products


class FactoredJacobian:
    """The Jacobian of B points as per-layer factors (see the module docstring).

    Args:
        layers: One factor per layer, in a fixed order (the same for every point set of a model).
        shapes: Shapes of all parameters of interest, in the order of the parameter vector.
    """

    def __init__(self, layers: list[LayerFactor], shapes: list[torch.Size]) -> None:
        self.layers, self.shapes = layers, shapes

    @property
    def shape(self) -> tuple[int, int]:
        """Points and outputs (B, C)."""
        return tuple(self.layers[0].G.shape[:2])

    @property
    def row_width(self) -> int:
        """Entries held per point and output (the output gradients of all layers)."""
        return sum(layer.G.shape[-1] for layer in self.layers)

    @property
    def nbytes(self) -> int:
        """Memory held, in bytes."""
        return sum(
            layer.G.nbytes + (0 if layer.a is None else layer.a.nbytes) for layer in self.layers
        )

    @property
    def slots(self) -> list[tuple[int | None, int | None]]:
        """The parameters of each layer (factors of point sets with other layers differ)."""
        return [layer.slots for layer in self.layers]

    def cross(self, other: DenseJacobian | FactoredJacobian, independent: bool) -> Tensor:
        """Kernel ``J Jₒᵀ`` with another point set: (B·C, B'·C), or (C, B, B') per output."""
        if not isinstance(other, FactoredJacobian) or self.slots != other.slots:
            return DenseJacobian(self.dense()).cross(other, independent)
        pairs = zip(self.layers, other.layers, strict=True)
        if independent:
            return sum(
                torch.einsum("bco,mco->cbm", mine.G, theirs.G) * _input_products(mine, theirs)
                for mine, theirs in pairs
            )
        total = sum(
            torch.einsum("bco,mdo->bcmd", mine.G, theirs.G)
            * _input_products(mine, theirs)[:, None, :, None]
            for mine, theirs in pairs
        )
        return total.flatten(2).flatten(0, 1)

    def output_blocks(self) -> Tensor:
        """``Jₙ Jₙᵀ`` per point, shape (B, C, C)."""
        return sum(
            (layer.G @ layer.G.transpose(1, 2)) * _input_products(layer)[:, None, None]
            for layer in self.layers
        )

    def output_variances(self) -> Tensor:
        """The diagonal of ``output_blocks``, shape (B, C)."""
        return sum(
            layer.G.square().sum(-1) * _input_products(layer)[:, None] for layer in self.layers
        )

    def matvec(self, v: Tensor) -> Tensor:
        """``J v`` for a parameter vector v (P,), shape (B, C), layer by layer (no dense rows)."""
        pieces = torch.split(v, [s.numel() for s in self.shapes])
        total = 0
        for layer in self.layers:
            weight, bias = layer.slots
            if weight is not None:
                W = pieces[weight].reshape(self.shapes[weight][0], -1)
                total = total + torch.einsum("bco,bo->bc", layer.G, layer.a @ W.T)
            if bias is not None:
                total = total + layer.G @ pieces[bias]
        return total

    def dense(self) -> Tensor:
        """The Jacobian rows (B, C, P), zero for parameters no layer call reached."""
        B, C = self.shape
        blocks = [None] * len(self.shapes)
        for layer in self.layers:
            weight, bias = layer.slots
            if weight is not None:
                blocks[weight] = (layer.G[..., :, None] * layer.a[:, None, None, :]).flatten(2)
            if bias is not None:
                blocks[bias] = layer.G
        G = self.layers[0].G
        return torch.cat(
            [
                G.new_zeros(B, C, shape.numel()) if block is None else block
                for block, shape in zip(blocks, self.shapes, strict=True)
            ],
            dim=2,
        )


def trace_jacobian(
    engine: PerSampleEngine, X: Inputs, create_graph: bool = False
) -> tuple[DenseJacobian | FactoredJacobian, Tensor]:
    """The Jacobian of the parameters of ``engine`` at ``X`` and the outputs, from one pass.

    Factored (``layer_factors``) where the layers allow, else the dense rows of the same
    recorded forward pass.

    Args:
        engine: The parameters of interest (all of them, no subnetwork indices).
        X: Inputs of B points.
        create_graph: Keep the Jacobian and the outputs differentiable w.r.t. ``X``; else they
            are detached.

    Returns:
        The Jacobian and the outputs (B, C).
    """
    trace = engine.trace(X, create_graph)
    f = trace.f.reshape(trace.f.shape[0], -1)
    if create_graph:
        return layer_factors(trace) or DenseJacobian(trace.jacobians()), f
    # without a graph, factors come from detached inputs and gradients; the dense rows of a
    # generic layer (``torch.func``) may still depend on its parameters
    return layer_factors(trace) or DenseJacobian(trace.jacobians().detach()), f.detach()


def layer_factors(trace: PerSampleTrace) -> FactoredJacobian | None:
    """The factored Jacobian of a recorded forward pass.

    Args:
        trace: The recorded pass (all parameters of interest, no subnetwork indices).

    Returns:
        The factors, or None when a layer is not a Linear/Conv layer applied once to each data
        point (weight sharing, sequences, several calls, folded batches): the caller then
        uses dense rows.
    """
    f, calls, engine = trace.f, trace.calls, trace.engine
    B = f.shape[0]
    modules = [call.module for call in calls]
    if (
        not calls
        or len(set(modules)) != len(modules)
        or any(kfac_rule(m) is None or not kfac_rule(m).plain for m in modules)
        or any(len(call.outputs) != 1 or call.outputs[0].shape[:1] != (B,) for call in calls)
    ):
        return None
    rules = [kfac_rule(m) for m in modules]
    inputs = [rule.inputs(call) for rule, call in zip(rules, calls, strict=True)]
    if any(a.shape[1] != 1 for a in inputs):
        return None
    C = f[0].numel()
    columns = torch.eye(C, dtype=f.dtype, device=f.device)[:, None].expand(C, B, C)
    gradients = OutputGradients(f, calls, trace.create_graph).columns(columns.reshape(C, *f.shape))
    layers = []
    for rule, call, a, (g,) in zip(rules, calls, inputs, gradients, strict=True):
        G = rule.grads(call, [g.flatten(0, 1)]).reshape(C, B, -1).transpose(0, 1)
        slots = tuple(
            engine.slot[call.module, name] if name in call.names else None
            for name in ("weight", "bias")
        )
        layers.append(
            LayerFactor(G, None if slots[0] is None else a[:, 0], slots[1] is not None, slots)
        )
    return FactoredJacobian(layers, [p.shape for p in engine.needed])
