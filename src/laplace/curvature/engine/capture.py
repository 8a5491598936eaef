"""One hooked forward pass that records the calls of parameter-owning modules.

The outputs stay in the autograd graph, so gradients of any output column w.r.t. layer outputs
can be taken afterwards; the hooks live only for the duration of the forward pass.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator, Sequence
from functools import partial
from typing import Protocol, cast

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten, tree_map_only, tree_unflatten

from laplace.curvature.engine.layer_rules import (
    RECURRENT_LAYERS,
    ModuleCall,
    recurrent_input_gradients,
    without_batching_notes,
)
from laplace.utils.data import Inputs, upcast

__all__ = [
    "EXPAND",
    "LIFT",
    "SECOND",
    "Columns",
    "OutputGradients",
    "column_chunks",
    "own_operations",
    "record_forward",
    "recurrent_cut",
]


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


def _recurrent_dims(module: nn.RNNBase) -> tuple[int, int]:
    """Batch dimensions of a recurrent layer's sequences (input, output) and hidden states."""
    return (0 if module.batch_first else 1), 1


def _native_dims(module: nn.Module, args: tuple, kwargs: dict, n_leaves: int) -> list[int] | None:
    """Per tensor leaf of a call's output, its batch dimension where some is not 0, else None.

    Recurrent layers return ``(output, h_n)`` or ``(output, (h_n, c_n))`` with the hidden
    states batched along dim 1 (and the sequences too unless ``batch_first``); packed and
    unbatched sequences keep their layout. A sequence-first ``nn.MultiheadAttention`` returns
    its output (L, B, E) and its attention weights batch-first.
    """
    if isinstance(module, nn.MultiheadAttention):
        query = args[0] if args else kwargs.get("query")
        if module.batch_first or not isinstance(query, Tensor) or query.dim() != 3:
            return None
        return [1] + [0] * (n_leaves - 1)
    if not isinstance(module, nn.RNNBase) or not isinstance(args[0], Tensor):
        return None
    if args[0].dim() != 3:
        return None
    sequence, state = _recurrent_dims(module)
    return [sequence] + [state] * (n_leaves - 1)


def _batch_first_args(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """A layer's inputs in batch-first layout.

    A recurrent layer's sequence and ``hx``, an attention layer's query, key and value.
    """
    if isinstance(module, nn.MultiheadAttention):
        names = ("query", "key", "value")
        args = tuple(a.movedim(1, 0) if i < 3 else a for i, a in enumerate(args))
        kwargs = {n: v.movedim(1, 0) if n in names else v for n, v in kwargs.items()}
        return args, kwargs
    sequence, state = _recurrent_dims(module)
    move = partial(tree_map_only, Tensor, lambda h: h.movedim(state, 0))
    args = (args[0].movedim(sequence, 0), *map(move, args[1:]))
    return args, {name: move(value) for name, value in kwargs.items()}


def _sequence_input(args: tuple, kwargs: dict) -> Tensor | None:
    """A recurrent layer's input sequence where it alone of the call's inputs carries gradient."""
    if not args or not isinstance(args[0], Tensor):
        return None
    x, others = args[0], tree_flatten((args[1:], kwargs))[0]
    if not x.requires_grad or any(isinstance(t, Tensor) and t.requires_grad for t in others):
        return None
    return x


def _first_rows(x: Inputs) -> int | None:
    """Leading size of the first tensor in the inputs: the batch size, as a first guess."""
    leaves = [leaf for leaf in tree_flatten(x)[0] if isinstance(leaf, Tensor) and leaf.dim()]
    return leaves[0].shape[0] if leaves else None


#: How a module's output shared by the batch is recorded: its size-1 leading dimension
#: expanded along the batch (a table looked up once with a batch dimension of one, (1, T, D)),
#: or a batch dimension put in front (a table looked up without one, ``wpe(arange(T))``,
#: (T, D)). Both give per-sample output gradients of a broadcast.
EXPAND, LIFT = "expand", "lift"
#: How the calls of a module in a sequence-first layout, (T, B, ...), are recorded: as
#: batch-first views (B, T, ...), as a recurrent layer's are.
SECOND = "second"


def _second(batch: int) -> Callable[[Tensor], Tensor]:
    """The batch-first view of a tensor whose second dimension is the batch's."""
    return lambda v: v.movedim(1, 0) if v.dim() >= 2 and v.shape[1] == batch else v


def _broadcast_candidates(calls: list[ModuleCall], batch: int) -> set[nn.Module]:
    """Modules called on batch-independent inputs (leading size 1) with outputs of one row."""
    if batch <= 1:
        return set()
    candidates = set()
    for call in calls:
        if not all(z.dim() > 0 and z.shape[0] == 1 for z in call.outputs):
            continue  # most calls: batched outputs, no need to look at the inputs
        inputs = [a for a in tree_flatten((call.args, call.kwargs))[0] if isinstance(a, Tensor)]
        if all(a.dim() == 0 or a.shape[0] == 1 for a in inputs):
            candidates.add(call.module)
    return candidates


def _lift_candidates(calls: list[ModuleCall], batch: int) -> set[nn.Module]:
    """Modules whose outputs have neither the batch's rows nor one: tables without a batch dim."""
    if batch <= 1:
        return set()
    return {
        call.module
        for call in calls
        if all(z.dim() > 0 and z.shape[0] not in (1, batch) for z in call.outputs)
    }


def _sequence_first(call: ModuleCall, batch: int) -> bool:
    """Whether a call's inputs and outputs all have the batch along dim 1, (T, B, ...).

    Layers with a layout of their own (recurrent, attention) are recorded by it instead.
    """
    if isinstance(call.module, nn.RNNBase | nn.MultiheadAttention):
        return False
    inputs = [a for a in tree_flatten((call.args, call.kwargs))[0] if isinstance(a, Tensor)]
    return bool(inputs) and all(
        t.dim() >= 2 and t.shape[1] == batch for t in [*inputs, *call.outputs]
    )


def _widened(mode: str, batch: int) -> Callable[[Tensor], Tensor]:
    """The map of a shared output (and its call's inputs) to one row per data point."""
    if mode == LIFT:
        return lambda v: v.unsqueeze(0).expand(batch, *v.shape)
    return lambda v: v.expand(batch, *v.shape[1:]) if v.dim() and v.shape[0] == 1 else v


def _broadcast_per_sample(f: Tensor, reference: Tensor, calls: list[ModuleCall]) -> bool:
    """Whether widening the shared outputs along the batch left ``f`` a per-sample function.

    The widened model must give the same outputs, and the first data point's outputs must
    depend on the first row of each widened output only (a broadcast, not a reduction).
    """
    if f.shape != reference.shape or not calls:
        return False
    scale = reference.detach().abs().amax().clamp_min(1)
    tolerance = 64 * torch.finfo(f.dtype).eps * scale
    if not bool(((f.detach() - reference.detach()).abs() <= tolerance).all()):
        return False
    outputs = [z for call in calls for z in call.outputs]
    grads = torch.autograd.grad(f[0].sum(), outputs, retain_graph=True, allow_unused=True)
    return all(g is None or not bool(g[1:].any()) for g in grads)


def record_forward(
    model: nn.Module,
    owners: dict[nn.Module, list[str]],
    x: Inputs,
    keep_input_graph: bool,
    shared: dict[nn.Module, str | bool] | None = None,
    dtype: torch.dtype | None = None,
    lift: Collection[nn.Module] = (),
) -> tuple[Tensor, list[ModuleCall]]:
    """Run ``model(x)`` recording every call of the modules in ``owners``.

    Every call is recorded with the data points along dim 0: a recurrent layer's outputs and
    inputs as batch-first views, and the output of a module shared by the batch and broadcast
    along it as one row per data point, which the model then uses instead, so that its output
    gradients are per data point: a module called on batch-independent inputs with outputs of
    one row (a position embedding looked up once, (1, T, D)) is expanded to (B, T, D); one
    whose outputs have neither the batch's rows nor one (``wpe(arange(T))``, (T, D)), or is
    named in ``lift``, gets a batch dimension in front, (B, T, D); one that is neither, in a
    sequence-first layout (T, B, ...), is recorded as batch-first views (B, T, ...). Whether
    such an output is one row per data point is checked once per module (the model gives the
    same outputs, and each data point's outputs depend only on its own row) and remembered in
    ``shared``; a module that fails the check is recorded as it is.

    When an output is later modified in place (``ReLU(inplace=True)``), the recorded tensor no
    longer is the layer output; the forward is then repeated with the hooks handing a copy of
    each output downstream. Calls are recorded only while the model runs forward here: the
    checks above differentiate the model with the hooks on, and an activation-checkpointed
    block's forward, which such a backward pass runs again, is not a call of the pass.

    Args:
        model: The model to run.
        owners: Modules to record, each with the names of its direct parameters of interest.
        x: Model inputs (a tensor or a mapping passed whole to the model).
        keep_input_graph: Keep the recorded inputs attached to the graph (needed to
            differentiate results w.r.t. ``x``).
        shared: Per module met with outputs that are not one row per data point, how it is
            recorded (``EXPAND``, ``LIFT``, ``SECOND``) or False where none applies (updated
            here).
        dtype: Floating-point type the recorded inputs are cast to (None: half precision to
            float32, others as they are).
        lift: Modules to try recording with a batch dimension in front (the attribution guard
            found their outputs' rows are not data points).

    Returns:
        The model output ``f`` (attached to the graph) and the recorded calls in call order.
    """
    shared = {} if shared is None else shared
    calls: list[ModuleCall] = []
    versions: list[int] = []
    clone_outputs = running = False
    widen: dict[nn.Module, str] = {m: mode for m, mode in shared.items() if mode}
    batch = _first_rows(x)

    def hook(module: nn.Module, args: tuple, kwargs: dict, output: object) -> object:
        if not running:  # a checkpointed block's forward repeated by a backward pass
            return None
        leaves, spec = tree_flatten(output)
        tensors = [i for i, leaf in enumerate(leaves) if isinstance(leaf, Tensor)]
        slots = [j for j, i in enumerate(tensors) if leaves[i].requires_grad]
        if not slots:
            return None
        recurrent = type(module) in RECURRENT_LAYERS
        sequence_input = _sequence_input(args, kwargs) if recurrent else None
        inputs = tree_flatten((args, kwargs))[0]
        input_nodes = frozenset(t.grad_fn for t in inputs if isinstance(t, Tensor) and t.grad_fn)
        if not keep_input_graph:
            args, kwargs = tree_map_only(Tensor, Tensor.detach, (args, kwargs))
        args, kwargs = upcast((args, kwargs), dtype)  # the rules compute in the result's type
        dims = _native_dims(module, args, kwargs, len(tensors))
        mode = widen.get(module)
        if mode == SECOND and batch is not None:
            dims = [int(leaves[i].dim() >= 2 and leaves[i].shape[1] == batch) for i in tensors]
            args, kwargs = tree_map_only(Tensor, _second(batch), (args, kwargs))
        elif dims is not None:
            args, kwargs = _batch_first_args(module, args, kwargs)
        if mode in (EXPAND, LIFT) and batch is not None:
            rows = _widened(mode, batch)
            args, kwargs = tree_map_only(Tensor, rows, (args, kwargs))
            for i in tensors:
                leaves[i] = rows(leaves[i])
        outputs = [leaves[tensors[j]] for j in slots]
        if dims is not None:
            outputs = [z.movedim(dims[j], 0) for j, z in zip(slots, outputs)]
            for j, z in zip(slots, outputs):
                leaves[tensors[j]] = z.movedim(0, dims[j])
        calls.append(
            ModuleCall(
                module,
                args,
                kwargs,
                outputs,
                slots,
                owners[module],
                sequence_input=sequence_input,
                input_nodes=input_nodes,
            )
        )
        versions.extend(z._version for z in outputs)
        if clone_outputs:
            leaves = [leaf.clone() if isinstance(leaf, Tensor) else leaf for leaf in leaves]
        elif dims is None and mode is None:
            return None
        return tree_unflatten(leaves, spec)

    def forward() -> Tensor:
        nonlocal running
        running = True
        try:
            return model(x)
        finally:
            running = False

    def run() -> Tensor:
        nonlocal clone_outputs
        calls.clear()
        versions.clear()
        clone_outputs = False
        f = forward()
        if versions != [z._version for call in calls for z in call.outputs]:
            calls.clear()
            clone_outputs = True  # an output was modified in place: record copies
            f = forward()
        return f

    def try_widening(candidates: set[nn.Module], mode: str, f: Tensor) -> Tensor:
        """Record ``candidates`` widened by ``mode``; keep it where they pass the check."""
        nonlocal batch
        reference, found, before = f, list(calls), batch
        widen.update(dict.fromkeys(candidates, mode))
        batch = f.shape[0]
        try:
            f = run()
            ok = _broadcast_per_sample(f, reference, [c for c in calls if c.module in candidates])
        except Exception:  # the model cannot take the widened rows: not a broadcast
            ok = False
        shared.update(dict.fromkeys(candidates, mode if ok else False))
        if ok:
            return f
        for module in candidates:
            del widen[module]
        batch = before
        calls[:] = found
        return reference

    handles = [m.register_forward_hook(hook, with_kwargs=True) for m in owners]
    try:
        with torch.enable_grad():
            f = run()
            if widen and f.shape[0] != batch:  # the first guess of the batch size was wrong
                batch = f.shape[0]
                f = run()
            candidates = _broadcast_candidates(calls, f.shape[0]) - set(shared)
            if candidates:
                f = try_widening(candidates, EXPAND, f)
            candidates = (_lift_candidates(calls, f.shape[0]) | set(lift)) - set(shared)
            if candidates:
                f = try_widening(candidates, LIFT, f)
            second = {
                call.module
                for call in calls
                if call.module in candidates
                and shared[call.module] is False
                and _sequence_first(call, f.shape[0])
            }
            if second:
                for module in second:
                    del shared[module]
                f = try_widening(second, SECOND, f)
    finally:
        for handle in handles:
            handle.remove()
    return f, calls


def gradient_type(f: Tensor, z: Tensor) -> torch.dtype:
    """The type of the gradients w.r.t. a recorded output ``z``: the wider of ``f``'s and ``z``'s.

    Half-precision layers get float32 (the type of ``f`` after ``upcast``); a float64 layer
    whose output the model casts down keeps float64, the type of its recorded inputs.
    """
    return torch.promote_types(f.dtype, z.dtype)


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
        #: The recurrent call a vectorised pass is cut at (``recurrent_cut``), found on first use.
        self._cut: int | None = None
        self._cut_found = False
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
        ``vectorised`` and every operation has a batching rule, cut at a recurrent layer where
        ``recurrent_cut`` finds one; otherwise one plain backward pass per column (one column:
        views).

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
        if batched and not self.create_graph:
            if not self._cut_found:
                self._cut, self._cut_found = recurrent_cut(self.f, self.calls), True
            if self._cut is not None:
                return self._cut_backward(grad_outputs, self._cut)
        with without_batching_notes():
            grads = torch.autograd.grad(
                self.f,
                self._outputs,
                grad_outputs=grad_outputs,
                retain_graph=True,
                create_graph=self.create_graph,
                allow_unused=True,
                is_grads_batched=batched,
            )
        return self._per_call(grads, self.calls, grad_outputs.shape[:1] if batched else ())

    def _cut_backward(self, columns: Tensor, cut: int) -> list[list[Tensor]]:
        """``_backward`` of K columns cut at the recurrent call ``cut`` (``recurrent_cut``)."""
        later, earlier = self.calls[cut:], self.calls[:cut]
        with without_batching_notes():
            grads = torch.autograd.grad(
                self.f,
                [z for call in later for z in call.outputs],
                grad_outputs=columns,
                retain_graph=True,
                allow_unused=True,
                is_grads_batched=True,
            )
        after = self._per_call(grads, later, columns.shape[:1])
        layer = later[0]
        sequence = cast(Tensor, layer.sequence_input)
        d_sequence = recurrent_input_gradients(layer, after[0])  # (K, B, T, D)
        if not layer.module.batch_first:
            d_sequence = d_sequence.transpose(1, 2)
        with without_batching_notes():
            grads = torch.autograd.grad(
                sequence,
                [z for call in earlier for z in call.outputs],
                grad_outputs=d_sequence.to(sequence.dtype),
                retain_graph=True,
                allow_unused=True,
                is_grads_batched=True,
            )
        return self._per_call(grads, earlier, columns.shape[:1]) + after

    def _per_call(
        self, grads: Sequence[Tensor | None], calls: Sequence[ModuleCall], lead: tuple[int, ...]
    ) -> list[list[Tensor]]:
        """Gradients w.r.t. the calls' outputs in order, split per call (zeros for None)."""
        outputs = [z for call in calls for z in call.outputs]
        found = iter(
            z.new_zeros(*lead, *z.shape, dtype=gradient_type(self.f, z))
            if g is None
            else g.to(gradient_type(self.f, z))
            for z, g in zip(outputs, grads, strict=True)
        )
        return [[next(found) for _ in call.outputs] for call in calls]


def recurrent_cut(f: Tensor, calls: Sequence[ModuleCall]) -> int | None:
    """The recurrent call at which a vectorised backward pass of output columns is cut, or None.

    A fused recurrent kernel has no batching rule: a vectorised backward pass through it runs
    it once per column. Cut at a recurrent call, the pass takes autograd's gradients w.r.t.
    the outputs of that call and of the later ones, pulls the call's back through its
    unrolling to its input sequence (``layer_rules.recurrent_input_gradients``, which leaves
    the pullback for the layer's rule), and goes on from the sequence to the earlier calls'
    outputs: the kernel is not run. That is exact where everything from the earlier calls
    reaches ``f`` through the layer's sequence alone, which is checked on the graph:

    - the pass has one recurrent call, of a type the unrolling covers (``RECURRENT_LAYERS``),
      after some other call, on a batched sequence (3-D) that alone of its inputs carries
      gradient, with no projection and no dropout in training;
    - walking back from its outputs, the layer's own operations reach no earlier call's
      output but through the sequence;
    - walking back from ``f`` around the layer's own operations reaches neither the sequence
      nor an earlier call's output.
    """
    found = [i for i, call in enumerate(calls) if type(call.module) in RECURRENT_LAYERS]
    if len(found) != 1 or found[0] == 0:
        return None
    cut = found[0]
    call, x = calls[cut], calls[cut].sequence_input
    module = cast(nn.RNNBase, call.module)
    if x is None or x.grad_fn is None or x.dim() != 3 or getattr(module, "proj_size", 0):
        return None
    if module.training and module.dropout:
        return None
    earlier = {z.grad_fn for c in calls[:cut] for z in c.outputs} - {None}
    own = own_operations(call)  # its inputs' nodes: the sequence's alone
    if own & earlier or _graph_nodes([f.grad_fn], stop=own) & (earlier | {x.grad_fn}):
        return None
    return cut


def own_operations(call: ModuleCall) -> set[object]:
    """The autograd nodes of a recorded call's own operations.

    Those between its outputs and the nodes that made its inputs (``call.input_nodes``, not
    included): what a recurrent cut checks (``recurrent_cut``) and where the guard looks for a
    parameter's readers.
    """
    nodes = _graph_nodes([z.grad_fn for z in call.outputs], stop=call.input_nodes)
    return nodes - call.input_nodes


def _graph_nodes(starts: Sequence[object], stop: Collection[object]) -> set[object]:
    """The autograd nodes reached from ``starts`` going back, not going on past ``stop``."""
    seen: set[object] = set()
    todo = [node for node in starts if node is not None]
    while todo:
        node = todo.pop()
        if node in seen:
            continue
        seen.add(node)
        if node not in stop:
            todo.extend(n for n, _ in node.next_functions if n is not None)  # type: ignore[attr-defined]
    return seen
