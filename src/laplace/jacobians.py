r"""Jacobian kinds: how a parameter subset hands its linearisation of the model to a posterior.

The GLM predictive needs ``J P⁻¹ Jᵀ`` (B, C, C) for the Jacobian ``J`` of the outputs (B, C)
w.r.t. the P weights of a parameter subset. A subset linearises the model on a chunk of inputs
(``subset.linearize``) and returns one of these kinds; each posterior structure maps the kinds
it has a closed form for to that closed form (``Posterior.closed_forms``) and uses the dense
rows of any other kind (double dispatch: the subset picks the kind, the posterior the maths).

=================  ==========================================  ===============================
kind               holds                                       dense rows (B, C, P) from
=================  ==========================================  ===============================
``JacobianRows``   the rows                                    themselves
``HeadFeatures``   features φ (B, D) of a linear head           ``[I_C ⊗ φᵀ, I_C]``
``LayerTrace``     one recorded forward pass (layer inputs,    the same pass (one backward per
                   outputs)                                    output, no second forward)
=================  ==========================================  ===============================

Each kind also says how many test points a chunk may hold (:meth:`Jacobian.chunk_rows`): its
closed forms and its fallback to dense rows must both fit the memory budget.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from torch import Tensor, nn

from laplace.curvature.per_sample import PerSampleTrace
from laplace.data import Inputs
from laplace.kron_glm import layerwise_chunk_rows
from laplace.last_layer import head_jacobians

__all__ = [
    "HeadFeatures",
    "Jacobian",
    "JacobianRows",
    "LayerTrace",
    "backend_kind",
    "backend_linearization",
]


class Jacobian(ABC):
    """The Jacobian ``J`` (B, C, P) of B data points' outputs w.r.t. a subset's weights."""

    @abstractmethod
    def dense(self) -> Tensor:
        """The rows ``J``, shape (B, C, P)."""

    @classmethod
    def chunk_rows(cls, jacobian_rows: int, model: nn.Module, params: list[Tensor]) -> int:
        """Test points per chunk for this kind.

        Args:
            jacobian_rows: Points whose (rows, C, P) Jacobian fits the memory budget.
            model: The network.
            params: The subset's parameters.

        Returns:
            ``jacobian_rows``: the kind holds about C·P numbers per point, like a Jacobian row.
        """
        return jacobian_rows


@dataclass(frozen=True)
class JacobianRows(Jacobian):
    """Dense Jacobian rows.

    Attributes:
        rows: ``J``, shape (B, C, P).
    """

    rows: Tensor

    def dense(self) -> Tensor:
        """The rows, shape (B, C, P)."""
        return self.rows


@dataclass(frozen=True)
class HeadFeatures(Jacobian):
    """Inputs of a linear head ``fₙ = W φₙ + b``: ``Jₙ = [I_C ⊗ φₙᵀ, I_C]``.

    Attributes:
        phi: Features, shape (B, D).
        n_out: Number of outputs C.
        bias: Whether the head has a bias.
    """

    phi: Tensor
    n_out: int
    bias: bool

    def dense(self) -> Tensor:
        """``[I_C ⊗ φₙᵀ, I_C]``, shape (B, C, C·D (+ C with a bias))."""
        return head_jacobians(self.phi, self.n_out, self.bias)


@dataclass(frozen=True)
class LayerTrace(Jacobian):
    """One recorded forward pass of the per-sample engine over the inputs.

    Layer-wise closed forms (:mod:`laplace.kron_glm`) read the layer inputs and output gradients
    from it; where they do not apply, :meth:`dense` differentiates the same pass.

    Attributes:
        trace: The recorded pass (its ``create_graph`` keeps results differentiable).
    """

    trace: PerSampleTrace

    def dense(self) -> Tensor:
        """The Jacobian rows from the recorded pass, shape (B, C, P)."""
        return self.trace.jacobians()

    @classmethod
    def chunk_rows(cls, jacobian_rows: int, model: nn.Module, params: list[Tensor]) -> int:
        """Layer-wise rows when every layer owning ``params`` has a rule, else Jacobian rows.

        The layer-wise closed forms hold activations, not Jacobian rows; a model with another
        layer takes the dense rows (see :func:`laplace.kron_glm.layerwise_chunk_rows`).
        """
        return layerwise_chunk_rows(model, params, jacobian_rows)


def backend_kind(closed_forms: Collection[type[Jacobian]]) -> type[LayerTrace | JacobianRows]:
    """The kind a curvature backend linearises into for a posterior with these closed forms.

    A recorded pass when the posterior has a closed form for one (its dense rows come from the
    same pass when the closed form does not apply), else dense rows.
    """
    return LayerTrace if LayerTrace in closed_forms else JacobianRows


def backend_linearization(
    backend: Any, X: Inputs, kind: type[LayerTrace | JacobianRows], enable_backprop: bool
) -> tuple[Tensor, LayerTrace | JacobianRows]:
    """Outputs and Jacobian of the parameters a curvature backend covers, from one forward pass.

    Args:
        backend: A :class:`~laplace.curvature.CurvatureInterface`.
        X: Inputs (B, ...), or a dict-like batch.
        kind: :class:`LayerTrace` (the backend's recorded pass) or :class:`JacobianRows` (the
            backend's ``jacobians``), see :func:`backend_kind`.
        enable_backprop: Keep the results differentiable w.r.t. the inputs.

    Returns:
        ``(f (B, C), J)``.
    """
    if kind is LayerTrace:
        trace = backend.trace(X, create_graph=enable_backprop)
        return trace.f, LayerTrace(trace)
    Js, f = backend.jacobians(X, enable_backprop=enable_backprop)
    return f, JacobianRows(Js)
