"""Jacobian kinds: how a parameter subset hands its linearisation of the model to a posterior.

The GLM predictive needs ``J P⁻¹ Jᵀ`` (B, C, C). A subset's ``linearize`` returns one of these
kinds; each posterior structure maps the kinds it has a closed form for to that closed form
(``closed_forms``) and uses the dense rows of any other (docs/architecture.md has the table).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Collection
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from laplace.curvature.engine.kfac_rules import kfac_rule
from laplace.curvature.engine.per_sample import PerSampleTrace
from laplace.structures.kron_glm import LAYERWISE_CHUNK_BYTES, LAYERWISE_CHUNK_ROWS
from laplace.utils.data import Inputs
from laplace.utils.outputs import OutputAdapter, OutputLayout

if TYPE_CHECKING:
    from laplace.curvature.curvature_backend import CurvatureBackend

__all__ = [
    "HeadFeatures",
    "Jacobian",
    "JacobianRows",
    "LayerTrace",
    "PositionRows",
    "backend_kind",
    "backend_linearization",
    "position_rows",
    "row_kind",
]


class Jacobian(ABC):
    """The Jacobian ``J`` (B, C, P) of B data points' outputs w.r.t. a subset's weights."""

    @abstractmethod
    def dense(self) -> Tensor:
        """The rows ``J``, shape (B, C, P)."""

    @classmethod
    def chunk_rows(
        cls,
        jacobian_rows: int,
        model: nn.Module,
        params: list[Tensor],
        row_bytes: int | None = None,
    ) -> int:
        """Test points per chunk of this kind for the subset ``params`` of ``model``.

        ``jacobian_rows`` points' (rows, C, P) Jacobian fits the memory budget; the default keeps
        that number (the kind holds about C·P numbers per point). ``row_bytes``: the recorded
        layer outputs of one point in the engine's last pass (None: not known).
        """
        return jacobian_rows


@dataclass(frozen=True)
class JacobianRows(Jacobian):
    """Dense Jacobian rows ``rows`` (B, C, P)."""

    rows: Tensor

    def dense(self) -> Tensor:
        """The rows, shape (B, C, P)."""
        return self.rows


@dataclass(frozen=True)
class HeadFeatures(Jacobian):
    """Features ``phi`` (B, D) of a linear head ``fₙ = W φₙ + b``: ``Jₙ = [I_C ⊗ φₙᵀ, I_C]``.

    ``n_out`` is C; ``bias`` whether the head has one.
    """

    phi: Tensor
    n_out: int
    bias: bool

    def dense(self) -> Tensor:
        """``[I_C ⊗ φₙᵀ, I_C]``, shape (B, C, C·D (+ C with a bias))."""
        phi, B = self.phi, len(self.phi)
        eye = torch.eye(self.n_out, dtype=phi.dtype, device=phi.device)
        Js = (eye[None, :, :, None] * phi[:, None, None, :]).reshape(B, self.n_out, -1)
        return torch.cat([Js, eye.expand(B, -1, -1)], dim=2) if self.bias else Js


@dataclass(frozen=True)
class LayerTrace(Jacobian):
    """``trace``: a recorded pass of the per-sample engine (layer inputs, output gradients)."""

    trace: PerSampleTrace

    def dense(self) -> Tensor:
        """The Jacobian rows from the recorded pass, shape (B, C, P)."""
        return self.trace.jacobians()

    @classmethod
    def chunk_rows(
        cls,
        jacobian_rows: int,
        model: nn.Module,
        params: list[Tensor],
        row_bytes: int | None = None,
    ) -> int:
        """Points per chunk of the layer-wise closed forms (``kron_glm``).

        Parameters of layers with a Kronecker rule cost activations per test point; the others
        (and parameters shared by several layers) their per-sample gradients, (rows, C, p) each,
        a part of the Jacobian that the Jacobian route's chunks bound.

        Returns:
            ``LAYERWISE_CHUNK_ROWS``, fewer where the points' recorded layer outputs
            (``row_bytes`` each) would outgrow ``LAYERWISE_CHUNK_BYTES`` or the per-sample
            gradients of the parameters without a rule the Jacobian route's chunks
            (``jacobian_rows`` points).
        """
        rows = LAYERWISE_CHUNK_ROWS
        if row_bytes:
            rows = min(rows, max(1, LAYERWISE_CHUNK_BYTES // row_bytes))
        sizes = {id(p): p.numel() for p in params}
        owners: dict[int, list[nn.Module]] = {}
        for m in model.modules():
            for p in m.parameters(recurse=False):
                if id(p) in sizes:
                    owners.setdefault(id(p), []).append(m)
        exact = sum(
            sizes[i] for i, ms in owners.items() if len(ms) > 1 or kfac_rule(ms[0]) is None
        )
        if exact == 0:
            return rows
        total = sum(p.numel() for p in params)
        return min(rows, max(1, jacobian_rows * total // exact))


@dataclass(frozen=True)
class PositionRows(Jacobian):
    """``jacobian`` of outputs (B, …) flattened per point, as rows of ``layout``'s positions."""

    jacobian: Jacobian
    layout: OutputLayout

    def dense(self) -> Tensor:
        """The rows (B·T, C, P) of the positions."""
        return self.layout.jacobian_rows(self.jacobian.dense())


def position_rows(jacobian: Jacobian, layout: OutputLayout) -> Jacobian:
    """``jacobian`` for outputs (B, C) and head features, else its ``PositionRows``."""
    if layout.plain or isinstance(jacobian, HeadFeatures):
        return jacobian
    return PositionRows(jacobian, layout)


def row_kind(kind: type[Jacobian], outputs: OutputAdapter) -> type[Jacobian]:
    """The kind ``position_rows`` gives ``kind`` once outputs with extra dimensions are seen."""
    if outputs.last_size is None or kind is HeadFeatures:
        return kind
    return PositionRows


def backend_kind(closed_forms: Collection[type[Jacobian]]) -> type[LayerTrace | JacobianRows]:
    """``LayerTrace`` if the posterior has a closed form for it, else ``JacobianRows``."""
    return LayerTrace if LayerTrace in closed_forms else JacobianRows


def backend_linearization(
    backend: CurvatureBackend,
    X: Inputs,
    kind: type[LayerTrace | JacobianRows],
    enable_backprop: bool,
) -> tuple[Tensor, LayerTrace | JacobianRows]:
    """Outputs and Jacobian of the parameters a curvature backend covers, from one forward pass.

    ``kind`` is ``LayerTrace`` (the backend's ``trace``) or ``JacobianRows`` (its ``jacobians``).

    Returns:
        ``(f (B, C), J)``, differentiable w.r.t. ``X`` with ``enable_backprop``.
    """
    if kind is LayerTrace:
        trace = backend.trace(X, create_graph=enable_backprop)
        return trace.f, LayerTrace(trace)
    Js, f = backend.jacobians(X, enable_backprop=enable_backprop)
    return f, JacobianRows(Js)
