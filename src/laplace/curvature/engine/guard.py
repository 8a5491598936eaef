"""The attribution guard: the native engine proves its view of a model before trusting it.

The engine reads every parameter's per-sample gradients off the recorded calls of the module
that owns it, with each call's outputs taken as one row per data point. Two things can make that
view wrong without any error: a use it does not see (a tied head ``h @ wte.weight.T``,
``F.linear(h, base.weight)``, ``nn.MultiheadAttention``'s ``out_proj``), and rows that are not
data points (a table looked up without a batch dimension, sequence-first layouts).

``verify`` checks both once per shape signature of the pass: for a random output column ``v``
the gradient the rules reconstruct from the recorded calls must equal autograd's gradient of
``vᵀ f`` for every parameter, scaling data point n's outputs by ``sₙ`` must scale each
recorded row's gradient by ``sₙ``, and, where the shapes leave rows in doubt (the batch's
size also behind the batch), changing one data point's inputs must change no other row, and
a call's rows that stay where they are when the batch is shifted by one data point are not
taken as data points'. A parameter that fails is listed in the ``Verdict``; the trace then
takes it through autograd, one backward pass per data point.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten, tree_map_only

from laplace.curvature.engine.capture import gradient_type, own_operations, record_forward
from laplace.curvature.engine.kfac_rules import module_name
from laplace.curvature.engine.layer_rules import (
    ModuleCall,
    call_rows,
    conv_patches,
    per_sample_grads,
)
from laplace.utils.data import Inputs

__all__ = [
    "GUARD_CHUNK_ELEMENTS",
    "HALF_PRECISION",
    "OTHER_POINT_HALF",
    "OTHER_POINT_TOLERANCE",
    "ROUNDOFF_FACTOR",
    "ROW_FLOOR",
    "SCALE_TOLERANCE",
    "Verdict",
    "signature",
    "verify",
]


#: Entries of the reconstructed gradient may differ from autograd's by this many units of
#: round-off (the dtype's eps) of the summed magnitudes ``Σₙ |gₙ| + |g|`` of the entry plus
#: those of the largest entry of the whole gradient.
ROUNDOFF_FACTOR = 256

#: Largest relative deviation of a row's gradient from its data point's scale, by the type of
#: the outputs (the pull-back is linear; a float64 network computing parts in float32 inside,
#: as Llama's RMSNorm does, stays below it).
SCALE_TOLERANCE = {torch.float64: 1e-4, torch.float32: 1e-3}

#: Types of recorded outputs the row check passes over: their gradients underflow, so a
#: row's scale is not seen (the gradient check still covers their parameters).
HALF_PRECISION = (torch.float16, torch.bfloat16)

#: Largest change of an output's rows of the other data points, when one data point's inputs
#: change, as a share of its largest entry, by the type of the outputs (other types:
#: ``OTHER_POINT_HALF``): round-off. Rows that mix data points change by about their size.
OTHER_POINT_TOLERANCE = {torch.float64: 1e-8, torch.float32: 1e-4}
OTHER_POINT_HALF = 5e-2

#: Rows of an output's gradient may deviate by this share of its largest row (round-off of
#: rows far below it).
ROW_FLOOR = 1e-5

#: Largest number of per-sample gradient entries the gradient check forms at once.
GUARD_CHUNK_ELEMENTS = 2**24

#: Seed of the random output column of the gradient check (the check is deterministic).
CHECK_SEED = 20261128


@dataclass(frozen=True)
class Verdict:
    """What the engine may trust of one recorded pass.

    Attributes:
        exact: Per parameter slot (``engine.needed`` order) that the recorded calls do not
            give exactly, the reason; these take the whole-model route.
        mixed_rows: Modules whose recorded outputs are not one row per data point.
    """

    exact: dict[int, str] = field(default_factory=dict)
    mixed_rows: frozenset[nn.Module] = frozenset()


def _row_class(t: Tensor, batch: int) -> str:
    """How a recorded output's leading size relates to the batch (a signature entry)."""
    if t.dim() == 0:
        return "scalar"
    rows = t.shape[0]
    if rows == batch:
        return "batch"
    if rows == 1:
        return "one"
    return "folded" if rows % batch == 0 else "other"


def signature(f: Tensor, calls: Sequence[ModuleCall]) -> tuple:
    """The shape signature of a recorded pass: what a verdict holds for.

    The called modules in order with the relation of each output's leading size to the batch
    (equal, one, a multiple, other) and its number of dimensions; sequence lengths and batch
    sizes that keep these relations share a verdict.
    """
    batch = f.shape[0] if f.dim() else 1
    entries = [
        (
            id(call.module),
            tuple(call.names),
            *((z.dim(), _row_class(z, batch)) for z in call.outputs),
        )
        for call in calls
    ]
    return (f.dim(), *entries)


def _mixed_rows(
    calls: Sequence[ModuleCall],
    first: Sequence[Tensor | None],
    second: Sequence[Tensor | None],
    scales: Tensor,
) -> set[int]:
    """Indices of the calls whose outputs are not one row (or a fold of rows) per data point.

    Two output columns are pulled back to every recorded output: ``v`` (``first``) and ``v``
    with data point n's outputs scaled by a random ``sₙ`` in [1, 2) (``second``). A row that
    depends on data point n alone has the second gradient ``sₙ`` times the first (the pull-back
    is linear); where an output has the batch's rows, row n must scale by ``sₙ``; where it has
    more (a fold of the batch) or fewer, every row must scale by one of the ``sₙ``. A row
    reached by several data points scales by none of them. Every row is checked, so an
    inactive unit (a dead ReLU) silencing some data points hides nothing.

    Args:
        calls: The recorded calls.
        first: The gradients of ``vᵀ f`` w.r.t. the calls' outputs, in order (None: unused).
        second: The same for the scaled column.
        scales: ``sₙ`` per data point (B,).
    """
    tolerance = SCALE_TOLERANCE.get(scales.dtype, 1e-3)
    mixed, position = set(), 0
    for index, call in enumerate(calls):
        for z in call.outputs:
            g, h = first[position], second[position]
            position += 1
            if z.dtype in HALF_PRECISION:  # gradients underflow: the scales are not seen
                continue
            if g is not None and not _scaled_rows(
                g.to(scales.dtype), h.to(scales.dtype), z, scales, tolerance
            ):
                mixed.add(index)
    return mixed


def _dropped(_: object) -> None:
    """A saved tensor of a forward pass never differentiated, not kept."""


def _batch_rows(tree: object, batch: int) -> list[Tensor]:
    """The tensors of a pytree whose leading size is the batch's, detached.

    Of the inputs: each data point's inputs by row; of a call's arguments and outputs: its
    tensors with the batch's rows.
    """
    leaves = tree_flatten(tree)[0]
    return [t.detach() for t in leaves if isinstance(t, Tensor) and t.dim() and len(t) == batch]


def _recorded_again(
    engine: object, x: Inputs, calls: Sequence[ModuleCall], order: Tensor
) -> list[ModuleCall] | None:
    """The pass recorded once more, its data points' inputs taken in ``order`` (B,).

    Every input tensor whose leading size is the batch's is indexed by ``order``; the pass is
    recorded as the first was (``engine.shared``), and no saved tensor is kept (nothing is
    differentiated). None where the calls' modules are not repeated in order.
    """
    batch = len(order)

    def reordered(t: Tensor) -> Tensor:
        return t[order.to(t.device)] if t.dim() and len(t) == batch else t

    with torch.autograd.graph.saved_tensors_hooks(_dropped, _dropped):  # no backward: keep none
        _, again = record_forward(
            engine.model,
            engine.owners,
            tree_map_only(Tensor, reordered, x),
            False,
            dict(engine.shared),
            engine.dtype,
        )
    return again if [c.module for c in again] == [c.module for c in calls] else None


def _round_off(z: Tensor) -> float:
    """How far a recomputed ``z`` may be from it: ``OTHER_POINT_TOLERANCE`` of its largest."""
    tolerance = OTHER_POINT_TOLERANCE.get(z.dtype, OTHER_POINT_HALF)
    return tolerance * float(z.detach().abs().max()) if z.numel() else 0.0


def _rows_reached_by_another_point(
    engine: object, x: Inputs, f: Tensor, calls: Sequence[ModuleCall]
) -> set[int]:
    """Indices of the calls whose output rows change when another data point's inputs do.

    Asked of the outputs whose shapes leave their rows in doubt: the batch's size in front and
    again behind it, as in a sequence-first layout (T, B, ...) with as many positions as data
    points, whose rows are positions, each mixing the data points. The model runs again with
    the first data point's inputs replaced by those of the first one that differs
    (``_recorded_again``); in an output that is one row per data point only the first row may
    change. This reads the outputs' values, not their gradients: units inactive for some data
    points of the checked batch (dead ReLUs) can hide the mix from ``_mixed_rows``, and a
    later batch of the same signature would then meet it unchecked. Calls that the changed
    batch does not repeat in order all count as mixed. A model with a module in training mode
    is not run again: its forward has effects of its own (batch statistics, dropout draws).
    """
    batch = len(f)
    doubtful = {
        index
        for index, call in enumerate(calls)
        if any(z.dim() > 1 and len(z) == batch and batch in z.shape[1:] for z in call.outputs)
    }
    if not doubtful or any(module.training for module in engine.model.modules()):
        return set()
    rows = _batch_rows(x, batch)
    other = next((n for n in range(1, batch) if any(not t[n].equal(t[0]) for t in rows)), None)
    if other is None:  # every data point's inputs are the first's: nothing to tell apart
        return set()
    order = torch.arange(batch)
    order[0] = other
    again = _recorded_again(engine, x, calls, order)
    if again is None:
        return set(range(len(calls)))
    mixed = set()
    for index in sorted(doubtful):
        for z, w in zip(calls[index].outputs, again[index].outputs):
            if z.dim() == 0 or len(z) != batch or w.shape != z.shape:
                continue
            if not bool(((w[1:].detach() - z[1:].detach()).abs() <= _round_off(z)).all()):
                mixed.add(index)
    return mixed


def _rows_of_no_data_point(
    engine: object, x: Inputs, f: Tensor, calls: Sequence[ModuleCall]
) -> set[int]:
    """Indices of the calls whose rows are not data points' but the same whatever the data.

    Asked where the batch's size is also a later size of an input or a recorded output (a
    sequence as long as the batch, a width equal to it): a call with the batch's rows may then
    be reading positions, as a table looked up without a batch dimension (``wpe(arange(T))``)
    with T = B, whose every row each data point uses. Its gradient check can pass: units
    inactive for some data points of the checked batch (dead ReLUs, all of them in a small
    model) can leave each row reached by the data point of its index only, or by none, and a
    later batch of the same signature is not checked. So the model runs again on the batch
    shifted by one data point (point n gets the inputs of point n + 1, ``_recorded_again``),
    and a call is taken as reading no data point's rows when its tensors with the batch's
    rows (inputs and outputs) stay where they were while their rows are not all the same. A
    data point's rows move with it; where every data point's inputs are the same, its rows
    are too. A table indexed by place in the batch (not by position) is taken the same way;
    its rows then come from autograd, exact either way. A model with a module in training
    mode is not run again: its forward has effects of its own (batch statistics, dropout
    draws). Calls that the shifted batch does not repeat in order all count.
    """
    batch = len(f)
    rows = _batch_rows(x, batch)
    tensors = rows + [z for call in calls for z in call.outputs]
    if batch < 2 or not rows or not any(batch in t.shape[1:] for t in tensors):
        return set()
    if any(module.training for module in engine.model.modules()):
        return set()
    again = _recorded_again(engine, x, calls, torch.roll(torch.arange(batch), -1))
    if again is None:
        return set(range(len(calls)))
    fixed = set()
    for index, (call, moved) in enumerate(zip(calls, again)):
        both = [_batch_rows((c.args, c.kwargs, c.outputs), batch) for c in (call, moved)]
        pairs = list(zip(*both))
        if not pairs or any(z.shape != w.shape for z, w in pairs):
            continue
        stayed, distinct = True, False
        for z, w in pairs:
            if z.is_floating_point():
                bound = _round_off(z)
                stayed = stayed and bool(((w - z).abs() <= bound).all())
                distinct = distinct or not bool(((z - z[:1]).abs() <= bound).all())
            else:
                stayed = stayed and bool(z.equal(w))
                distinct = distinct or not bool((z == z[:1]).all())
        if stayed and distinct:
            fixed.add(index)
    return fixed


def _scaled_rows(g: Tensor, h: Tensor, z: Tensor, scales: Tensor, tolerance: float) -> bool:
    """Whether each row of ``h`` is its own data point's scale times the row of ``g``."""
    rows = z.shape[0] if z.dim() else 1
    first, second = g.reshape(rows, -1), h.reshape(rows, -1)
    norm = first.square().sum(-1)
    ratio = (second * first).sum(-1) / norm.clamp_min(torch.finfo(g.dtype).tiny)
    if z.dim() and z.shape[0] == len(scales):
        expected = scales
    else:  # the nearest data point's scale
        expected = scales[(ratio[:, None] - scales[None]).abs().argmin(1)]
    residual = (second - expected[:, None] * first).norm(dim=-1)
    size = second.norm(dim=-1) + expected * norm.sqrt()
    # rows at round-off of the output's largest (a float64 network computing parts in float32)
    floor = ROW_FLOOR * size.max() if size.numel() else 0
    return bool((residual <= tolerance * size + floor).all())


def _row_chunks(
    call: ModuleCall, grads: Sequence[Tensor], size: int
) -> Iterator[tuple[ModuleCall, list[Tensor]]]:
    """The call and its output gradients, a chunk of rows at a time.

    At most ``GUARD_CHUNK_ELEMENTS`` per-sample gradient entries (``size`` per row) at once.
    """
    rows = grads[0].shape[0] if grads[0].dim() else 1
    step = max(1, GUARD_CHUNK_ELEMENTS // max(1, size))
    if step >= rows:
        yield call, list(grads)
        return
    for start in range(0, rows, step):
        part = slice(start, start + step)
        yield call_rows(call, part, rows), [g[part] for g in grads]


def _linear_sums(call: ModuleCall, grads: Sequence[Tensor]) -> dict[str, tuple[Tensor, Tensor]]:
    """``nn.Linear``'s summed gradient ``Σ g aᵀ`` and magnitude ``Σ |g| |a|ᵀ`` by two products."""
    a, g = call.args[0].flatten(0, -2), grads[0].flatten(0, -2)
    out = {}
    if "weight" in call.names:
        out["weight"] = (g.T @ a, g.abs().T @ a.abs())
    if "bias" in call.names:
        out["bias"] = (g.sum(0), g.abs().sum(0))
    return out


def _conv_sums(call: ModuleCall, grads: Sequence[Tensor]) -> dict[str, tuple[Tensor, Tensor]]:
    """A convolution's summed gradient and magnitude over the batch and positions at once."""
    m, g = call.module, grads[0].flatten(2)  # (B, D_out, L)
    out = {}
    if "weight" in call.names:
        patches = conv_patches(call)  # (B, G, L, D_in/G · k)
        g = g.reshape(g.shape[0], m.groups, -1, g.shape[-1]).permute(1, 2, 0, 3).flatten(2)
        patches = patches.permute(1, 0, 2, 3).flatten(1, 2)  # (G, B·L, D_in/G · k)
        total, size = g @ patches, g.abs() @ patches.abs()
        out["weight"] = (total.reshape(m.weight.shape), size.reshape(m.weight.shape))
        g = grads[0].flatten(2)
    if "bias" in call.names:
        out["bias"] = (g.sum((0, 2)), g.abs().sum((0, 2)))
    return out


@dataclass(frozen=True)
class RowSums:
    """A table's summed gradient and magnitude on the rows a pass looked up (zero elsewhere).

    The guard's check of a table costs the rows looked up, not the table: a 32,000-token
    vocabulary is compared on the few hundred rows a batch uses, and everywhere else autograd's
    gradient is only bounded by its largest entry per row.

    Attributes:
        rows: The looked-up rows, sorted and distinct (R,).
        total: Their summed gradient (R, D).
        magnitude: Their summed magnitude (R, D).
    """

    rows: Tensor
    total: Tensor
    magnitude: Tensor

    def merged(self, other: RowSums) -> RowSums:
        """The sums of two sets of calls of tables holding the same parameter."""
        rows, where = torch.cat([self.rows, other.rows]).unique(return_inverse=True)
        width = (len(rows), *self.total.shape[1:])
        total = self.total.new_zeros(width).index_add_(
            0, where, torch.cat([self.total, other.total])
        )
        magnitude = self.magnitude.new_zeros(width).index_add_(
            0, where, torch.cat([self.magnitude, other.magnitude])
        )
        return RowSums(rows, total, magnitude)

    def dense(self, shape: torch.Size) -> tuple[Tensor, Tensor]:
        """The sums as full tensors of the parameter's ``shape``."""
        zeros = self.total.new_zeros(shape)
        return (
            zeros.index_add(0, self.rows, self.total),
            zeros.index_add(0, self.rows, self.magnitude),
        )


def _embedding_sums(call: ModuleCall, grads: Sequence[Tensor]) -> dict[str, RowSums]:
    """``nn.Embedding``'s summed gradient and magnitude on the rows the call looks up.

    Each position's gradient is added to its row, once signed and once in absolute value;
    never a (B, V, D) per-sample tensor, nor a (V, D) one.
    """
    m, g = call.module, grads[0].reshape(-1, call.module.embedding_dim)
    rows, where = call.args[0].reshape(-1).unique(return_inverse=True)
    total = g.new_zeros(len(rows), m.embedding_dim).index_add_(0, where, g)
    magnitude = g.new_zeros(len(rows), m.embedding_dim).index_add_(0, where, g.abs())
    if m.padding_idx is not None:
        padding = rows == m.padding_idx
        total[padding], magnitude[padding] = 0, 0
    return {"weight": RowSums(rows, total, magnitude)}


#: Summed gradients and magnitudes of a call without per-sample gradients, by exact type.
SUMMED_RULES = {
    nn.Embedding: _embedding_sums,
    nn.Linear: _linear_sums,
    nn.Conv1d: _conv_sums,
    nn.Conv2d: _conv_sums,
    nn.Conv3d: _conv_sums,
}


#: A parameter's reconstructed gradient and magnitude: full tensors, or on some rows only.
Sums = tuple[Tensor, Tensor] | RowSums


def _call_sums(call: ModuleCall, grads: Sequence[Tensor], size: int) -> Iterator[tuple[str, Sums]]:
    """Per parameter of a call, its summed gradient and summed magnitude (parts of them)."""
    rule = SUMMED_RULES.get(type(call.module))
    if isinstance(call.module, nn.Embedding) and call.module.scale_grad_by_freq:
        rule = None  # the gradient depends on the call's token counts: the per-sample rule
    if rule is not None:
        yield from rule(call, grads).items()
        return
    for piece, piece_grads in _row_chunks(call, grads, size):
        for name, u in per_sample_grads(piece, piece_grads).items():
            yield name, (u.sum(0), u.abs().sum(0))


def _reconstruction(
    engine: object,
    f: Tensor,
    calls: Sequence[ModuleCall],
    per_call: Sequence[Sequence[Tensor]],
    exact: dict[int, str],
) -> dict[int, Sums]:
    """Per slot, the summed gradient of ``vᵀ f`` the rules give and its summed magnitude.

    ``per_call`` holds, per call, the gradients of ``vᵀ f`` w.r.t. its outputs. A call whose
    rule cannot run (an error other than a rule's refusal, ``ValueError``) leaves
    its slots to ``exact`` with the error as the reason.
    """
    found: dict[int, Sums] = {}
    for call, grads in zip(calls, per_call, strict=True):
        slots = {name: engine.slot[call.module, name] for name in call.names}
        size = sum(engine.needed[slot].numel() for slot in slots.values())
        try:
            for name, sums in _call_sums(call, grads, size):
                slot = slots[name]
                sums = _detached(sums, f.dtype)
                found[slot] = (
                    sums
                    if slot not in found
                    else _added(found[slot], sums, engine.needed[slot].shape)
                )
        except ValueError as error:  # a rule's refusal (BatchNorm in training mode): name it
            raise ValueError(
                f"module {module_name(engine.model, call.module)!r}: {error}"
            ) from error
        except Exception as error:  # a rule that cannot run on this call: not trusted
            for slot in slots.values():
                exact.setdefault(slot, f"its {type(call.module).__name__} rule failed ({error})")
    return found


def _detached(sums: Sums, dtype: torch.dtype) -> Sums:
    """The sums, off the graph, in ``dtype``."""
    if isinstance(sums, RowSums):
        return RowSums(sums.rows, sums.total.detach().to(dtype), sums.magnitude.detach().to(dtype))
    return tuple(part.detach().to(dtype) for part in sums)


def _added(first: Sums, second: Sums, shape: torch.Size) -> Sums:
    """The sums of two calls' contributions to one parameter of ``shape``."""
    if isinstance(first, RowSums) and isinstance(second, RowSums):
        return first.merged(second)
    first, second = (s.dense(shape) if isinstance(s, RowSums) else s for s in (first, second))
    return first[0] + second[0], first[1] + second[1]


def _checked(sums: Sums | None, g: Tensor) -> tuple[float, Callable[[float, float], bool]]:
    """The largest entry of a parameter's size ``Σₙ |gₙ| + |g|`` and its deviation test.

    Args:
        sums: The reconstructed gradient and magnitude (None: no call of the parameter seen).
        g: Autograd's gradient.

    Returns:
        The largest size, and a test ``deviates(tolerance, floor)``: whether some entry of
        the reconstruction differs from ``g`` by more than ``tolerance · (size + floor)``.
    """
    if sums is None:  # a table's unseen rows cost one pass; other shapes their zeros
        empty = g.new_zeros(0, dtype=torch.long)
        sums = RowSums(empty, g[:0], g[:0]) if g.dim() else (g.new_zeros(()), g.new_zeros(()))
    if isinstance(sums, RowSums):
        # off the looked-up rows the reconstruction is zero, and an entry deviates iff |g| does:
        # a row's largest |g| decides
        flat = g.reshape(len(g), -1) if g.dim() else g.reshape(1, 1)
        largest = torch.maximum(flat.amax(1), -flat.amin(1)) if flat.numel() else flat.sum(1)
        seen = g[sums.rows]
        size = sums.magnitude + seen.abs()
        top = max(
            float(largest.max()) if largest.numel() else 0.0,
            float(size.max()) if size.numel() else 0.0,
        )

        def deviates(tolerance: float, floor: float) -> bool:
            rest = largest.index_fill(0, sums.rows, 0)
            return bool(((sums.total - seen).abs() > tolerance * (size + floor)).any()) or bool(
                (rest > tolerance * (rest + floor)).any()
            )

        return top, deviates
    total, magnitude = sums  # the guard's own tensors: updated in place
    size = magnitude.add_(g.abs())

    def deviates(tolerance: float, floor: float) -> bool:
        return bool(total.sub_(g).abs_().gt(size.add_(floor).mul_(tolerance)).any())

    return float(size.max()) if size.numel() else 0.0, deviates


def _readers(f: Tensor, params: Sequence[Tensor]) -> dict[int, set]:
    """Per parameter (by index) the nodes of the graph of ``f`` that take it directly."""
    slots = {id(p): slot for slot, p in enumerate(params)}
    readers: dict[int, set] = {}
    stack, seen = ([f.grad_fn], {f.grad_fn}) if f.grad_fn is not None else ([], set())
    while stack:
        node = stack.pop()
        for following, _ in node.next_functions:
            if following is None or following in seen:
                continue
            variable = getattr(following, "variable", None)
            if variable is not None:  # a leaf's gradient accumulator
                if id(variable) in slots:
                    readers.setdefault(slots[id(variable)], set()).add(node)
                continue
            seen.add(following)
            stack.append(following)
    return readers


def _read_outside_calls(
    engine: object, calls: Sequence[ModuleCall], readers: dict[int, set]
) -> set[int]:
    """Slots of parameters that a node outside their calls reads (``readers``: ``_readers``).

    Each recorded call's own operations are the graph's nodes between its outputs and the
    nodes that made its inputs. A reader that is no operation of a call of a module owning the
    parameter (a row read off a table, ``h @ wte.weight.T``, ``F.linear(h, base.weight)``) is
    a use the rules do not see. This is read off the graph's structure, not its values: units
    inactive for every data point of the checked batch (dead ReLUs) can silence such a use in
    the gradient check, and later batches of the same signature would then miss it.
    """
    own: dict[int, set] = {}
    for call in calls:
        nodes = own_operations(call)
        for name in call.names:
            own.setdefault(engine.slot[call.module, name], set()).update(nodes)
    return {slot for slot, nodes in readers.items() if not nodes <= own.get(slot, set())}


def _looked_up_only(
    engine: object, calls: Sequence[ModuleCall], readers: dict[int, set]
) -> set[int]:
    """Slots of tables the graph uses only through the recorded calls' lookups.

    A table's gradient reaches it through the nodes of autograd's graph that read it
    (``readers``: ``_readers``). When these are exactly the lookups of recorded
    ``nn.Embedding`` calls (their outputs' nodes, the outputs not changed in place since), the
    rule's row sums are its gradient by construction, and the check skips forming autograd's
    (V, D) gradient of the table. Every other reader (a head tied as ``h @ wte.weight.T``, a
    row read directly) leaves the slot to the numeric check.
    """
    lookups: dict[int, set | None] = {}
    for call in calls:
        for name in call.names:
            slot = engine.slot[call.module, name]
            node = call.outputs[0].grad_fn if call.outputs else None
            if type(call.module) is not nn.Embedding or call.module.scale_grad_by_freq:
                lookups[slot] = None  # another kind of call: the numeric check
            elif lookups.get(slot, set()) is not None and node is not None:
                lookups.setdefault(slot, set()).add(node)
    return {
        slot
        for slot, nodes in lookups.items()
        if nodes and readers.get(slot) and readers[slot] <= nodes
    }


def verify(engine: object, f: Tensor, calls: Sequence[ModuleCall], x: Inputs) -> Verdict:
    """Check a recorded pass against autograd (see the module); the verdict for its signature.

    Args:
        engine: The ``PerSampleEngine`` that recorded the pass (its ``needed``, ``slot``).
        f: The model output (B, ...), attached to the graph.
        calls: The recorded calls.
        x: The inputs of the pass.

    Returns:
        The parameters the calls do not give exactly, with reasons, and the modules whose
        outputs are not one row per data point.
    """
    generator = torch.Generator().manual_seed(CHECK_SEED)
    batch = f.shape[0] if f.dim() else 1
    v = torch.randn(f.shape, generator=generator).to(f)
    scales = (1 + torch.rand(batch, generator=generator, dtype=torch.float64)).to(f)
    params = list(engine.needed)
    readers = _readers(f, params)
    tables = _looked_up_only(engine, calls, readers)
    asked = [slot for slot in range(len(params)) if slot not in tables]
    outputs = [z for call in calls for z in call.outputs]
    both = torch.autograd.grad(
        f, [*outputs, *(params[slot] for slot in asked)], v, retain_graph=True, allow_unused=True
    )
    first = both[: len(outputs)]
    mixed = set()
    if batch > 1 and outputs:
        scaled = v * scales.reshape(-1, *[1] * (f.dim() - 1))
        second = torch.autograd.grad(f, outputs, scaled, retain_graph=True, allow_unused=True)
        mixed = (
            _mixed_rows(calls, first, second, scales)
            | _rows_reached_by_another_point(engine, x, f, calls)
            | _rows_of_no_data_point(engine, x, f, calls)
        )
    exact: dict[int, str] = {}
    for index in sorted(mixed):
        call = calls[index]
        for name in call.names:
            exact.setdefault(
                engine.slot[call.module, name],
                f"its {type(call.module).__name__} call returns outputs of shape "
                f"{tuple(call.outputs[0].shape)} for a batch of {len(f)}, which are not one "
                "row per data point",
            )
    called = {engine.slot[call.module, name] for call in calls for name in call.names}
    for slot in _read_outside_calls(engine, calls, readers):
        seen = (
            "its module's calls give only part of its gradient"
            if slot in called
            else "no call of its module is recorded"
        )
        exact.setdefault(slot, f"it is used outside its module's calls ({seen})")
    remaining = iter(first)
    trusted, per_call = [], []  # the gradients of vᵀ f w.r.t. the outputs of trusted calls
    for index, call in enumerate(calls):
        grads = [next(remaining) for _ in call.outputs]
        if index not in mixed:
            trusted.append(call)
            per_call.append(
                [
                    z.new_zeros(z.shape, dtype=gradient_type(f, z))
                    if g is None
                    else g.to(gradient_type(f, z))
                    for z, g in zip(call.outputs, grads, strict=True)
                ]
            )
    autograd = dict(zip(asked, both[len(outputs) :], strict=True))
    found = _reconstruction(engine, f, trusted, per_call, exact)
    for call in calls:  # the pass is recorded as any other (what rules keep is re-made)
        call.cache.clear()
    eps = max(torch.finfo(f.dtype).eps, *(torch.finfo(p.dtype).eps for p in params))
    checks = {
        slot: _checked(
            found.get(slot),
            torch.zeros(p.shape, dtype=f.dtype, device=f.device) if g is None else g.to(f.dtype),
        )
        for slot, p, g in ((slot, params[slot], autograd[slot]) for slot in asked)
    }
    # a table's gradient is its row sums (``_looked_up_only``): its largest size ≤ 2 · magnitude
    tops = [top for top, _ in checks.values()]
    tops += [
        2 * float(found[slot].magnitude.max())
        for slot in tables
        if slot in found and found[slot].magnitude.numel()
    ]
    # a gradient that cancels to round-off (a key bias under softmax) is judged against the
    # largest entry of the whole gradient
    floor = max(tops, default=0.0)
    for slot, (_, deviates) in checks.items():
        if slot not in exact and deviates(ROUNDOFF_FACTOR * eps, floor):
            seen = (
                "no call of its module is recorded"
                if slot not in found
                else "its module's calls give only part of its gradient"
            )
            exact[slot] = f"it is used outside its module's calls ({seen})"
    modules = frozenset(calls[index].module for index in mixed)
    return Verdict(exact, modules)
