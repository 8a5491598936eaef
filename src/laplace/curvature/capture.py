"""One hooked forward pass that records the calls of parameter-owning modules.

Forward hooks on every module that directly owns a parameter of interest record each call's
inputs and outputs; the outputs stay in the autograd graph so that gradients of any output
column w.r.t. *layer outputs* (not weights) can be taken afterwards with
``torch.autograd.grad``. The hooks live only for the duration of the forward pass.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, Protocol

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten, tree_map_only

from laplace.curvature.layer_rules import ModuleCall
from laplace.utils.data import Inputs

__all__ = ["Columns", "OutputGradients", "column_chunks", "record_forward"]


class Columns(Protocol):
    """Output columns sliced like a tensor (K, B, ...).

    A tensor, or columns formed a chunk at a time
    (``laplace.utils.outputs.PositionColumns``: one per position of outputs with extra
    dimensions).
    """

    def __len__(self) -> int: ...

    def __getitem__(self, key: slice) -> Tensor: ...


def column_chunks(columns: Columns | Sequence[Tensor], size: int) -> Iterator[Tensor]:
    """Consecutive chunks (k ≤ size, B, ...) of output columns (a list is stacked first)."""
    if isinstance(columns, (list, tuple)):
        columns = torch.stack(list(columns)) if columns else torch.empty(0)
    for start in range(0, len(columns), size):
        yield columns[start : start + size]


def record_forward(
    model: nn.Module, owners: dict[nn.Module, list[str]], x: Inputs, keep_input_graph: bool
) -> tuple[Tensor, list[ModuleCall]]:
    """Run ``model(x)`` recording every call of the modules in ``owners``.

    When an output is later modified in place (``ReLU(inplace=True)``), the recorded tensor no
    longer is the layer output; the forward is then repeated with the hooks handing a copy of
    each output downstream.

    Args:
        model: The model to run.
        owners: Modules to record, each with the names of its direct parameters of interest.
        x: Model inputs (a tensor or a mapping passed whole to the model).
        keep_input_graph: Keep the recorded inputs attached to the graph (needed to
            differentiate results w.r.t. ``x``).

    Returns:
        The model output ``f`` (attached to the graph) and the recorded calls in call order.
    """
    calls: list[ModuleCall] = []
    versions: list[int] = []
    clone_outputs = False

    def hook(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        leaves = [leaf for leaf in tree_flatten(output)[0] if isinstance(leaf, Tensor)]
        slots = [i for i, leaf in enumerate(leaves) if leaf.requires_grad]
        if not slots:
            return None
        if not keep_input_graph:
            args, kwargs = tree_map_only(Tensor, Tensor.detach, (args, kwargs))
        outputs = [leaves[i] for i in slots]
        calls.append(ModuleCall(module, args, kwargs, outputs, slots, owners[module]))
        versions.extend(z._version for z in outputs)
        return tree_map_only(Tensor, Tensor.clone, output) if clone_outputs else None

    handles = [m.register_forward_hook(hook, with_kwargs=True) for m in owners]
    try:
        with torch.enable_grad():
            f = model(x)
            if versions != [z._version for call in calls for z in call.outputs]:
                calls.clear()
                clone_outputs = True  # an output was modified in place: record copies
                f = model(x)
    finally:
        for handle in handles:
            handle.remove()
    return f, calls


class OutputGradients:
    """Gradients of output columns w.r.t. all recorded layer outputs.

    Args:
        f: Model output, shape (B, ...), attached to the graph.
        calls: Recorded calls whose outputs lie in the graph of ``f``.
        create_graph: Build a graph of the gradients (to differentiate them further).
    """

    def __init__(self, f: Tensor, calls: Sequence[ModuleCall], create_graph: bool = False):
        self.f = f
        self.calls = list(calls)
        self.create_graph = create_graph
        self._outputs = [z for call in self.calls for z in call.outputs]
        #: Whether several columns go through one vectorised backward pass; not through a
        #: convolution, whose batching rule loops over the columns and copies.
        self.vectorised = not any(
            isinstance(call.module, nn.modules.conv._ConvNd) for call in self.calls
        )

    def __call__(self, v: Tensor) -> list[list[Tensor]]:
        """Gradients of ``Σ v ⊙ f`` w.r.t. each call's outputs.

        Args:
            v: Output column, same shape as ``f``.

        Returns:
            Per call, one gradient per recorded output (zeros where the output is unused).
        """
        return self._backward(v, batched=False)

    def columns(self, columns: Tensor) -> list[list[Tensor]]:
        """Gradients of several output columns, each stacked along a leading axis.

        Several columns go through one vectorised backward pass (``is_grads_batched``) where
        ``vectorised`` and every operation has a batching rule; otherwise one plain
        backward pass per column (one column: views).

        Args:
            columns: Output columns, shape (K, *f.shape).

        Returns:
            Per call, one tensor of shape (K, *z.shape) per recorded output.
        """
        if self.vectorised and len(columns) > 1:
            try:
                return self._backward(columns, batched=True)
            except RuntimeError:
                pass
        per_column = [self(v) for v in columns]
        return [
            [torch.stack(gs) if len(gs) > 1 else gs[0].unsqueeze(0) for gs in zip(*per_call)]
            for per_call in zip(*per_column)
        ]

    def _backward(self, grad_outputs: Tensor, batched: bool) -> list[list[Tensor]]:
        """Gradients w.r.t. every recorded output (zeros where unused), split per call."""
        grads = torch.autograd.grad(
            self.f,
            self._outputs,
            grad_outputs=grad_outputs,
            retain_graph=True,
            create_graph=self.create_graph,
            allow_unused=True,
            is_grads_batched=batched,
        )
        lead = grad_outputs.shape[:1] if batched else ()
        found = iter(
            z.new_zeros(*lead, *z.shape) if g is None else g for z, g in zip(self._outputs, grads)
        )
        return [[next(found) for _ in call.outputs] for call in self.calls]
