"""Native per-sample-gradient engine behind the default backends.

Every curvature is a sum of outer products of per-sample vectors ``gₙₖ = Jₙᵀ vₙₖ``. One hooked
forward records each parameter-owning layer's input ``a`` and output ``z``; one backward pass per
column gives ``g = ∂(vᵀ f)/∂z``, and per-layer rules turn ``(a, g)`` into per-sample gradients;
what the attribution guard does not trust takes batched backward passes, one per data point.
See ``docs/backends.md``, "Inside the native engine".
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import replace

import torch
from torch import Tensor, nn

from laplace.curvature.engine.capture import (
    Columns,
    OutputGradients,
    column_chunks,
    record_forward,
)
from laplace.curvature.engine.guard import Verdict, signature, verify
from laplace.curvature.engine.layer_rules import (
    SELECTED_RULES,
    UNCALLED_CHILDREN,
    ModuleCall,
    per_sample_grads,
    selected_per_sample_grads,
    without_batching_notes,
)
from laplace.curvature.engine.square_sums import (
    EXACT_SUM_RULES,
    SQUARE_SUM_RULES,
    SquareSumRule,
)
from laplace.utils.data import Inputs, upcast
from laplace.utils.linalg import add_gram_upper_, mirror_upper_, symmetric_gram

__all__ = ["COLUMNS_PER_BACKWARD", "Columns", "PerSampleEngine", "PerSampleTrace"]

#: Data points per vectorised backward pass in the batched fallback.
BATCHED_BACKWARD_CHUNK = 32

#: Output columns differentiated together by one vectorised backward pass.
COLUMNS_PER_BACKWARD = 16

#: Bytes of per-sample rows (columns × data points × parameters) summed into a Gram at once.
GRAM_CHUNK_BYTES = 64 * 2**20


def _add(sums: dict[int, Tensor], key: int, value: Tensor) -> None:
    """``sums[key] += value``, out of place; ``value`` starts the sum of a new key."""
    sums[key] = sums[key] + value if key in sums else value


def _add_in_place(sums: dict[int, Tensor], key: int, value: Tensor) -> None:
    """``sums[key] += value`` in place, into a view of a running sum (any shape of its size)."""
    sums[key] += value.detach().reshape(sums[key].shape)


class PerSampleEngine:
    """Per-sample gradients of a model's outputs w.r.t. a list of its parameters.

    Args:
        model: The network; called as ``model(x)``.
        params: Parameters of interest; their flattened concatenation (in this order) is the
            parameter vector of length P.
        indices: Optional LongTensor selecting entries of that vector (a subnetwork); results
            are then restricted to them and only the layers owning selected entries are traced.
    """

    def __init__(
        self, model: nn.Module, params: Sequence[Tensor], indices: Tensor | None = None
    ) -> None:
        self.model = model
        self.params = list(params)
        sizes = torch.tensor([p.numel() for p in self.params])
        offsets = torch.cat([torch.zeros(1, dtype=torch.long), sizes.cumsum(0)])
        if indices is not None:
            indices = torch.as_tensor(indices, dtype=torch.long).cpu()
            owner = torch.bucketize(indices, offsets[1:], right=True)
        needed = range(len(self.params)) if indices is None else sorted(set(owner.tolist()))
        self.needed = [self.params[i] for i in needed]
        #: Start of every slot of ``needed`` in the flattened vector of ``needed``, and its end.
        self.offsets = [0, *torch.tensor([p.numel() for p in self.needed]).cumsum(0).tolist()]
        #: Subnetwork only: the positions of its entries in the flattened vector of ``needed``.
        self.indices = None if indices is None else torch.empty_like(indices)
        #: Subnetwork only: per slot of ``needed``, the selected entries of the flattened
        #: parameter and their positions in the subnetwork vector (on the parameters' device).
        self.selected: dict[int, tuple[Tensor, Tensor]] = {}
        #: Subnetwork only: slots whose positions are consecutive, with their (start, end).
        self.spans: dict[int, tuple[int, int]] = {}
        for slot, i in enumerate(needed if indices is not None else ()):
            positions = (owner == i).nonzero().squeeze(1)
            local = indices[positions] - offsets[i]
            self.indices[positions] = self.offsets[slot] + local
            self.selected[slot] = tuple(t.to(self.params[0].device) for t in (local, positions))
            start, end = int(positions[0]), int(positions[-1]) + 1
            if end - start == len(positions):
                self.spans[slot] = (start, end)
        #: Length of the engine's parameter vector: P, or the number of subnetwork entries.
        self.n_entries = self.offsets[-1] if indices is None else len(indices)
        #: Per module met with outputs that are not one row per data point, how its calls are
        #: recorded (``EXPAND``, ``LIFT``, ``SECOND``), False where none applies (see
        #: ``record_forward``).
        self.shared: dict[nn.Module, str | bool] = {}
        #: The attribution guard's verdict per shape signature of a recorded pass.
        self.verdicts: dict[tuple, Verdict] = {}
        #: Floating-point type of the results (None: the model's, float32 for half precision).
        self.dtype: torch.dtype | None = None
        #: Bytes of the recorded layer outputs per data point in the last recorded pass (None
        #: before any): what sizes the chunks of a layer-wise prediction.
        self.row_bytes: int | None = None
        position = {id(p): i for i, p in enumerate(self.needed)}
        self.owners: dict[nn.Module, list[str]] = {}
        self.slot: dict[tuple[nn.Module, str], int] = {}
        uncalled: set[nn.Module] = set()  # children whose parameters their parent uses
        for module in model.modules():
            named = list(module.named_parameters(recurse=False))
            for child in UNCALLED_CHILDREN.get(type(module), ()):
                uncalled.add(getattr(module, child))
                named += getattr(module, child).named_parameters(prefix=child, recurse=False)
            for name, p in named if module not in uncalled else ():
                if id(p) in position:
                    self.owners.setdefault(module, []).append(name)
                    self.slot[module, name] = position[id(p)]

    def trace(self, x: Inputs, create_graph: bool = False) -> PerSampleTrace:
        """Run one recorded forward pass on ``x``.

        Args:
            x: Model inputs.
            create_graph: Keep results differentiable (w.r.t. ``x`` and the parameters).

        Returns:
            The trace, from which curvature sums and per-sample gradients are computed.
        """
        f, calls = record_forward(
            self.model, self.owners, x, create_graph, self.shared, self.dtype
        )
        f = upcast(f, self.dtype)  # the rules compute in the results' type
        verdict = self.verdict(f, calls, x)
        if verdict.mixed_rows - set(self.shared):  # tables looked up without a batch dim?
            f, calls = record_forward(
                self.model,
                self.owners,
                x,
                create_graph,
                self.shared,
                self.dtype,
                lift=verdict.mixed_rows,
            )
            f = upcast(f, self.dtype)
            verdict = self.verdict(f, calls, x)
        recorded = sum(z.numel() * z.element_size() for call in calls for z in call.outputs)
        self.row_bytes = recorded // max(1, len(f) if f.dim() else 1)
        return PerSampleTrace(self, f, calls, create_graph, verdict)

    def verdict(self, f: Tensor, calls: list[ModuleCall], x: Inputs) -> Verdict:
        """The attribution guard's verdict on a recorded pass, checked once per signature.

        The signature includes how each call was recorded (``shared``): a pass recorded anew
        with a table lifted or a layer read batch-first is checked again.
        """
        key = (signature(f, calls), *(self.shared.get(call.module, False) for call in calls))
        if key not in self.verdicts:
            self.verdicts[key] = verify(self, f, calls, x)
        return self.verdicts[key]

    def describe(self, slot: int) -> str:
        """``"'path' (Type) parameter 'name'"`` for the parameter in ``slot`` (its owner)."""
        names = dict(self.model.named_modules(remove_duplicate=False))
        for (module, name), s in self.slot.items():
            if s == slot:
                path = next((n or "<root>" for n, m in names.items() if m is module), "?")
                return f"module {path!r} ({type(module).__name__}) parameter {name!r}"
        return f"parameter {slot}"


def _trusted(
    calls: list[ModuleCall], verdict: Verdict, engine: PerSampleEngine
) -> list[ModuleCall]:
    """The calls whose rules the verdict trusts, each with the parameters it gives exactly."""
    trusted = []
    for call in calls:
        if call.module in verdict.mixed_rows:
            continue
        names = [n for n in call.names if engine.slot[call.module, n] not in verdict.exact]
        if names:
            trusted.append(call if names == call.names else replace(call, names=names))
    return trusted


class PerSampleTrace:
    """A recorded forward pass; turns output columns into per-sample parameter quantities.

    Attributes:
        f: Model output, shape (B, C), attached to the graph.
        calls: The recorded calls the layer rules use (those the guard trusts).
        exact_slots: Slots of ``engine.needed`` the recorded calls do not give exactly (the
            guard's verdict): their per-sample gradients come from autograd, one backward pass
            per data point.
        exact_reasons: Why, per slot of ``exact_slots``.
    """

    def __init__(
        self,
        engine: PerSampleEngine,
        f: Tensor,
        calls: list[ModuleCall],
        create_graph: bool,
        verdict: Verdict | None = None,
    ) -> None:
        verdict = Verdict() if verdict is None else verdict
        self.engine = engine
        self.f = f
        self.calls = calls = _trusted(calls, verdict, engine)
        self.exact_slots = sorted(verdict.exact)
        self.exact_reasons = dict(verdict.exact)
        self.create_graph = create_graph
        self._grads = OutputGradients(f, calls, create_graph) if calls else None
        counts = Counter(engine.slot[call.module, name] for call in calls for name in call.names)
        batch = f.shape[0]
        self._batched = any(z.dim() == 0 or z.shape[0] != batch for c in calls for z in c.outputs)
        single_use = [
            all(counts[engine.slot[call.module, n]] == 1 for n in call.names) for call in calls
        ]
        #: Per call whose parameters no other call uses, its rule of ``SQUARE_SUM_RULES``
        #: (``square_sum`` asks it whether it applies to its columns).
        self._square_sum_rules = {
            i: rule
            for i, call in enumerate(calls)
            if (rule := SQUARE_SUM_RULES.get(type(call.module))) is not None and single_use[i]
        }
        #: Per call whose parameters no other call uses, its rule of ``EXACT_SUM_RULES``.
        self.exact_sum_rules = {
            i: rule
            for i, call in enumerate(calls)
            if (rule := EXACT_SUM_RULES.get(type(call.module))) is not None and single_use[i]
        }

    def drop_graph(self) -> None:
        """Detach the outputs from the autograd graph and free it.

        Output gradients cannot be taken afterwards; the layer rules, which need only the
        recorded inputs, still apply.
        """
        self.f = self.f.detach()
        self._grads = None
        for call in self.calls:
            call.outputs = [z.detach() for z in call.outputs]
            call.sequence_input, call.input_nodes = None, frozenset()

    @property
    def layerwise(self) -> bool:
        """Whether per-layer rules give every parameter.

        They do when every layer sees the data points along dim 0, no subnetwork restricts the
        parameters and the guard trusts every parameter's calls; otherwise products use the
        per-sample rows of the whole model.
        """
        return not self._batched and self.engine.indices is None and not self.exact_slots

    @property
    def _whole_model(self) -> bool:
        """Whether every per-sample row comes from autograd (no layer rule applies)."""
        return self._batched or (self.engine.indices is not None and bool(self.exact_slots))

    def exact_rows(self, columns: Tensor, slots: Sequence[int] | None = None) -> dict[int, Tensor]:
        """Per slot of ``exact_slots`` (or ``slots``): per-sample gradients (K, B, *shape).

        From autograd, one backward pass per data point.

        Args:
            columns: Output columns, shape (K, *f.shape).
            slots: Slots of ``engine.needed`` (None: ``exact_slots``).
        """
        slots = self.exact_slots if slots is None else slots
        if not slots:
            return {}
        per_column = [self._batched_per_sample(v, slots) for v in columns]
        return {s: torch.stack([rows[s] for rows in per_column]) for s in slots}

    def output_gradients(self, columns: Tensor) -> list[list[Tensor]]:
        """Gradients of several output columns w.r.t. every recorded layer output.

        Args:
            columns: Output columns, shape (K, *f.shape).

        Returns:
            Per recorded call, one tensor of shape (K, *z.shape) per recorded output.
        """
        return [] if self._grads is None else self._grads.columns(columns)

    def _flatten(self, per_slot: dict[int, Tensor], leading: tuple[int, ...]) -> Tensor:
        """Per-slot tensors (*leading, *shape) as one (*leading, P) tensor; zeros where missing."""
        parts = [
            per_slot[slot] if slot in per_slot else self.f.new_zeros(*leading, *p.shape)
            for slot, p in enumerate(self.engine.needed)
        ]
        flat = torch.cat([part.reshape(*leading, -1) for part in parts], dim=-1)
        if self.engine.indices is None:
            return flat
        return flat[..., self.engine.indices.to(flat.device)]

    def slot_grads(self, call: ModuleCall, grads: Sequence[Tensor]) -> dict[int, Tensor]:
        """Per-sample gradients (R, *shape) of a call's parameters by slot of ``engine.needed``.

        Args:
            call: A recorded call (or one built from it, with its module).
            grads: Gradients w.r.t. ``call.outputs``, each (R, ...).
        """
        by_name = per_sample_grads(call, grads)
        return {self.engine.slot[call.module, name]: grad for name, grad in by_name.items()}

    def _per_param(self, g_calls: list[list[Tensor]], calls: Iterable[int]) -> dict[int, Tensor]:
        """Per-sample gradients (B, *shape) by parameter slot, summed over the given calls."""
        out: dict[int, Tensor] = {}
        for i in calls:
            for slot, grad in self.slot_grads(self.calls[i], g_calls[i]).items():
                _add(out, slot, grad)
        return out

    def column_gradients(
        self, columns: Columns | Sequence[Tensor]
    ) -> Iterator[list[list[Tensor]]]:
        """Per chunk of columns, per recorded call, their gradients w.r.t. its outputs.

        ``COLUMNS_PER_BACKWARD`` columns go through one vectorised backward pass, one at a
        time through a convolution, whose batching rule loops over the columns and copies.

        Args:
            columns: Output columns, sliced like a tensor (K, *f.shape), or a list of them.

        Yields:
            Per call, one tensor (k, *z.shape) per recorded output; nothing without calls or
            after ``drop_graph``.
        """
        if self._grads is None:
            return
        size = COLUMNS_PER_BACKWARD if self._grads.vectorised else 1
        for chunk in column_chunks(columns, size):
            yield self.output_gradients(chunk)

    def per_sample(self, v: Tensor) -> Tensor:
        """Per-sample gradients ``Jₙᵀ vₙ`` for one output column.

        Args:
            v: Output column, shape (B, C).

        Returns:
            Shape (B, P) (P restricted to the subnetwork when one is set).
        """
        return self.per_sample_columns(v[None])[0]

    def per_sample_columns(self, columns: Columns, dim: int = 0) -> Tensor:
        """Per-sample gradients ``Jₙᵀ vₙₖ`` for several output columns.

        The columns are differentiated ``COLUMNS_PER_BACKWARD`` at a time by one vectorised
        backward pass.

        Args:
            columns: Output columns, shape (K, *f.shape).
            dim: Axis of the columns in the result: 0 gives (K, B, P), 1 gives (B, K, P).

        Returns:
            The gradients (P restricted to the subnetwork when one is set).
        """
        batch = (self.f.shape[0],)
        if self._whole_model:
            whole = [self._flatten(self._batched_per_sample(v), batch) for v in columns]
            return torch.stack(whole, dim)
        rows = []
        for chunk in column_chunks(columns, COLUMNS_PER_BACKWARD):
            stacked = self.output_gradients(chunk)
            if self.engine.indices is not None:
                rows.append(self._selected_rows(stacked, len(chunk)))
                continue
            exact = self.exact_rows(chunk)
            for k in range(len(chunk)):
                found = self._per_param(
                    [[g[k] for g in grads] for grads in stacked], range(len(stacked))
                )
                found.update({slot: u[k] for slot, u in exact.items()})
                rows.append(self._flatten(found, batch)[None])
        return torch.cat([r.transpose(0, dim) for r in rows], dim)

    def _selected_rows(self, stacked: list[list[Tensor]], n_columns: int) -> Tensor:
        """Per-sample gradients of the subnetwork entries only, (K, B, n_entries).

        ``stacked`` holds per call the gradients w.r.t. its outputs for K columns (K, B, ...).
        """
        out = self.f.new_zeros(n_columns, self.f.shape[0], self.engine.n_entries)
        slot, selected = self.engine.slot, self.engine.selected
        for call, grads in zip(self.calls, stacked):
            entries = {name: selected[slot[call.module, name]][0] for name in call.names}
            if type(call.module) is nn.Linear and call.args[0].dim() == 2:  # all K at once
                values = SELECTED_RULES[nn.Linear](call, grads, entries)
            else:
                per_column = [
                    selected_per_sample_grads(call, [g[k] for g in grads], entries)
                    for k in range(n_columns)
                ]
                values = {name: torch.stack([c[name] for c in per_column]) for name in entries}
            for name, value in values.items():
                span = self.engine.spans.get(slot[call.module, name])
                if span is None:
                    out.index_add_(2, selected[slot[call.module, name]][1], value)
                else:  # consecutive positions (sorted indices): a slice, no scatter
                    out[..., span[0] : span[1]] += value
        return out

    def _batched_per_sample(
        self, v: Tensor, slots: Sequence[int] | None = None
    ) -> dict[int, Tensor]:
        """Per-sample gradients of ``slots`` (None: all) by one backward pass per data point.

        Returns:
            Per slot, shape (B, *shape) (zeros where the outputs do not depend on it).
        """
        batch = self.f.shape[0]
        slots = range(len(self.engine.needed)) if slots is None else slots
        params = [self.engine.needed[s] for s in slots]
        rows: list[list[Tensor]] = [[] for _ in slots]
        for start in range(0, batch, BATCHED_BACKWARD_CHUNK):
            index = torch.arange(start, min(batch, start + BATCHED_BACKWARD_CHUNK))
            cotangents = self.f.new_zeros(len(index), *self.f.shape)
            cotangents[torch.arange(len(index)), index] = v[index]
            with without_batching_notes():
                grads = torch.autograd.grad(
                    self.f,
                    params,
                    grad_outputs=cotangents,
                    is_grads_batched=True,
                    retain_graph=True,
                    create_graph=self.create_graph,
                    allow_unused=True,
                )
            for found, p, g in zip(rows, params, grads, strict=True):
                found.append(
                    self.f.new_zeros(len(index), *p.shape)
                    if g is None
                    else upcast(g, self.f.dtype)
                )
        return {slot: torch.cat(found) for slot, found in zip(slots, rows, strict=True)}

    def _running(self, into: Tensor | None, shape: tuple[int, ...]) -> Tensor | None:
        """``into`` where a result of ``shape`` can be added to it in place, else None.

        It must have the shape and the results' type, and the results must not be
        differentiable (``create_graph``).
        """
        if into is None or self.create_graph:
            return None
        return into if into.shape == shape and into.dtype == self.f.dtype else None

    def square_sum(
        self,
        columns: Columns | Sequence[Tensor],
        gradients: list[list[Tensor]] | None = None,
        into: Tensor | None = None,
    ) -> Tensor:
        """``Σₖ Σₙ (Jₙᵀ vₙₖ)²``: the diagonal of ``Σₖ Σₙ gₙₖ gₙₖᵀ``.

        Columns are differentiated ``COLUMNS_PER_BACKWARD`` at a time.

        Args:
            columns: Output columns, sliced like a tensor (K, *f.shape), or a list of them.
            gradients: The columns' gradients w.r.t. each call's outputs (per call, per output
                (K, B, ...)), where already taken (else they are taken here).
            into: A running sum (P,) the result is added to in place, and returned, where it
                can be (``_running``): no (P,) copy per batch is formed.

        Returns:
            Shape (P,).
        """
        into = self._running(into, (self.engine.n_entries,))
        if self._batched or self.engine.indices is not None:
            total = self.f.new_zeros(self.engine.n_entries) if into is None else into
            for chunk in column_chunks(columns, COLUMNS_PER_BACKWARD):
                squares = self.per_sample_columns(chunk).square().sum((0, 1))
                total += squares if into is None else squares.detach()
            return total
        # per slot, its sum: a view of ``into`` added to in place, or a new tensor
        total: dict[int, Tensor] = {}
        add = _add
        if into is not None:
            ends, add = itertools.pairwise(self.engine.offsets), _add_in_place
            total = {slot: into[start:end] for slot, (start, end) in enumerate(ends)}
        for chunk in column_chunks(columns, COLUMNS_PER_BACKWARD) if self.exact_slots else ():
            for slot, u in self.exact_rows(chunk).items():
                add(total, slot, u.square().sum((0, 1)))
        partials: dict[int, Tensor] = {}  # per call with a rule, its summed statistic
        gathered: dict[int, list[Tensor]] = {}  # per call, gradients of columns not yet in it
        rules = {
            i: rule
            for i, rule in self._square_sum_rules.items()
            if rule.applies(self.calls[i], len(columns))
        }
        exact_sums = self.exact_sum_rules
        slow = [i for i in range(len(self.calls)) if i not in rules and i not in exact_sums]
        chunks = self.column_gradients(columns) if gradients is None else [gradients]
        for stacked in chunks:
            for i, rule in rules.items():
                gathered.setdefault(i, []).append(stacked[i][0])
                wanted = 1 if rule.gathered is None else rule.gathered(self.calls[i])
                if sum(len(g) for g in gathered[i]) >= wanted:
                    self._add_partial(partials, i, rule, gathered.pop(i))
            for i, exact_rule in exact_sums.items():
                call = self.calls[i]
                for name, value in exact_rule(call, stacked[i], ()).items():
                    add(total, self.engine.slot[call.module, name], value)
            for k in range(len(stacked[slow[0]][0]) if slow else 0):
                g_calls = [[g[k] for g in per_call] for per_call in stacked]
                for slot, grad in self._per_param(g_calls, slow).items():
                    add(total, slot, grad.square().sum(0))
            del stacked  # not held while the next chunk's gradients are formed
        for i, rule in rules.items():  # finished one call at a time
            if i in gathered:
                self._add_partial(partials, i, rule, gathered.pop(i))
            if i not in partials:  # no columns
                continue
            call = self.calls[i]
            for name, value in rule.finish(call, partials.pop(i)).items():
                add(total, self.engine.slot[call.module, name], value)
        return self._flatten(total, ()) if into is None else into

    def _add_partial(
        self, partials: dict[int, Tensor], i: int, rule: SquareSumRule, grads: list[Tensor]
    ) -> None:
        """Add call ``i``'s statistic of the gathered gradients' columns (chunks (k, B, ...))."""
        _add(
            partials,
            i,
            rule.partial(self.calls[i], grads[0] if len(grads) == 1 else torch.cat(grads)),
        )

    def gram(self, columns: Columns | Sequence[Tensor], into: Tensor | None = None) -> Tensor:
        """``Σₖ Σₙ gₙₖ gₙₖᵀ`` with ``gₙₖ = Jₙᵀ vₙₖ``.

        The per-sample rows of a chunk of columns are summed into the Gram matrix before the
        next chunk is formed (at most ``GRAM_CHUNK_BYTES`` of them at once).

        Args:
            columns: Output columns, sliced like a tensor (K, *f.shape), or a list of them.
            into: A running sum (P, P) the result is added to in place, above its diagonal
                and mirrored once (``add_gram_upper_``), and returned, where it can be
                (``_running``): no (P, P) matrix per batch is formed.

        Returns:
            Shape (P, P); zero without columns.
        """
        n, batch = self.engine.n_entries, self.f.shape[0]
        itemsize = self.f.element_size()
        size = max(COLUMNS_PER_BACKWARD, GRAM_CHUNK_BYTES // max(1, batch * n * itemsize))
        total = self._running(into, (n, n))
        if total is not None:
            for chunk in column_chunks(columns, size):
                rows = self.per_sample_columns(chunk).detach()
                add_gram_upper_(total, rows.reshape(-1, rows.shape[-1]))
            return mirror_upper_(total)
        for chunk in column_chunks(columns, size):
            rows = self.per_sample_columns(chunk)
            gram = symmetric_gram(rows.reshape(-1, rows.shape[-1]))
            total = gram if total is None else total.add_(gram)
        return self.f.new_zeros(n, n) if total is None else total

    def jacobians(self) -> Tensor:
        """Jacobians of the outputs w.r.t. the parameters, shape (B, C, P)."""
        f = self.f.reshape(self.f.shape[0], -1)
        eye = torch.eye(f.shape[1], dtype=f.dtype, device=f.device)
        columns = eye[:, None, :].expand(-1, f.shape[0], -1).reshape(-1, *self.f.shape)
        return self.per_sample_columns(columns, dim=1)
