r"""Which block of the Kronecker-factored curvature each parameter gets: the KFAC dispatch table.

``plan_blocks`` gives every parameter tensor one block of four kinds: ``"kron"`` (the weight of
a layer with a rule in ``KFAC_RULES`` or ``GROUPED_KFAC_RULES``), ``"bias"`` (its bias, the
output-gradient factor ``G``), ``"dense"`` (any other parameter of at most ``dense_limit``
entries, its exact block) and ``"diag"`` (the rest, its exact diagonal). See
``docs/backends.md`` for the table and the conventions.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch
from torch import Tensor, nn

from laplace.curvature.engine.layer_rules import (
    ModuleCall,
    attention_arguments,
    attention_output,
    attention_pullback,
    conv_patches,
    tiled_call,
)
from laplace.utils.diag_lowrank import LowRankShape

__all__ = [
    "GROUPED_KFAC_RULES",
    "KFAC_DENSE_LIMIT",
    "KFAC_RULES",
    "OPTIONAL_KFAC_RULES",
    "Block",
    "KfacRule",
    "as_uses",
    "block_shapes",
    "check_gradient_factor_first",
    "check_kronecker_layers",
    "grouped_rule",
    "kfac_rule",
    "module_name",
    "plan_blocks",
]

#: Largest parameter (entries) outside a Kronecker rule whose exact block is kept dense; larger
#: ones keep the exact diagonal (a dense block of 2048 entries is 4M numbers, 16 MB in float32).
KFAC_DENSE_LIMIT = 2048


@dataclass(frozen=True)
class KfacRule:
    """How a layer type exposes its inputs and output gradients per position.

    A map applied to several inputs in one call (``nn.MultiheadAttention``'s input projection
    in cross-attention) gives a tuple of uses from both ``inputs`` and ``grads``, in the same
    order; its factors sum over the uses, as over the calls of a layer called several times.

    Attributes:
        inputs: Recorded call → layer inputs (R, T, D_in) (patches for convolutions), or the
            indices (R, T) of the rows an embedding looks up (``one_hot``); or a tuple of uses.
        grads: Recorded call and the gradients w.r.t. its recorded outputs (k·R rows each, for
            k columns) → (k·R, T, D_out); or a tuple of uses.
        check: Module → reason the rule does not apply (the exact fallback then takes the
            module), or None (the default: it always applies).
        inputs_first: The weight is laid out (D_in, D_out), so its block is ``A ⊗ G``.
        one_hot: The inputs are one-hot rows (given as indices): ``A`` is diagonal, the token
            counts.
    """

    inputs: Callable[[ModuleCall], Tensor | tuple[Tensor, ...]]
    grads: Callable[[ModuleCall, Sequence[Tensor]], Tensor | tuple[Tensor, ...]]
    check: Callable[[nn.Module], str | None] = lambda module: None
    inputs_first: bool = False
    one_hot: bool = False

    @property
    def plain(self) -> bool:
        """Whether the block is ``G ⊗ A`` of dense inputs (Linear and convolution layers)."""
        return not (self.inputs_first or self.one_hot)


def _rows(t: Tensor) -> Tensor:
    return t.reshape(t.shape[0], -1, t.shape[-1])


_LINEAR = KfacRule(lambda call: _rows(call.args[0]), lambda call, g: _rows(g[0]))
_CONV = KfacRule(
    lambda call: conv_patches(call)[:, 0],
    lambda call, g: g[0].flatten(2).transpose(1, 2),
    lambda m: "grouped convolutions have no single Kronecker factor" if m.groups != 1 else None,
)
_EMBEDDING = KfacRule(
    lambda call: call.args[0].reshape(len(call.args[0]), -1),
    _LINEAR.grads,
    lambda m: (
        "scale_grad_by_freq makes its gradient depend on the batch's token frequencies"
        if m.scale_grad_by_freq
        else None
    ),
    inputs_first=True,
    one_hot=True,
)
_CONV1D = KfacRule(_LINEAR.inputs, _LINEAR.grads, inputs_first=True)

#: KFAC rules keyed by exact module type.
KFAC_RULES: dict[type[nn.Module], KfacRule] = {
    nn.Linear: _LINEAR,
    nn.Conv1d: _CONV,
    nn.Conv2d: _CONV,
    nn.Conv3d: _CONV,
    nn.Embedding: _EMBEDDING,
}

#: Rules for classes of optional libraries, by the module path and name of the class.
OPTIONAL_KFAC_RULES: dict[str, dict[str, KfacRule]] = {
    "transformers.pytorch_utils": {"Conv1D": _CONV1D},
}


def _input_uses(call: ModuleCall) -> list[list[int]]:
    """The projections (0: query, 1: key, 2: value) of an attention call grouped by input.

    Projections reading one tensor (all three in self-attention, key and value in a decoder's
    cross-attention) are one application of the input projection to it.
    """
    arguments = attention_arguments(call)
    inputs = [arguments[name] for name in ("query", "key", "value")]
    uses: list[list[int]] = []
    for i, x in enumerate(inputs):
        for use in uses:
            y = inputs[use[0]]
            if y is x or (y.shape == x.shape and torch.equal(y, x)):
                use.append(i)
                break
        else:
            uses.append([i])
    return uses


def _pulled(call: ModuleCall, grads: Sequence[Tensor]) -> list[Tensor]:
    """The gradients (k·R rows) of the query, key and value projections of an attention call.

    The call tiled for k columns is kept in its cache, so the attention recomputed for it
    serves every map of the layer and every chunk of k columns.
    """
    k = len(grads[0]) // len(call.outputs[0])
    if k > 1:
        if f"tiled{k}" not in call.cache:
            call.cache[f"tiled{k}"] = tiled_call(call, k)  # type: ignore[assignment]
        call = call.cache[f"tiled{k}"]  # type: ignore[assignment]
    return attention_pullback(call, grads)[1]


def _in_projection_inputs(call: ModuleCall) -> tuple[Tensor, ...]:
    inputs = attention_arguments(call)
    names = ("query", "key", "value")
    return tuple(_rows(inputs[names[use[0]]]) for use in _input_uses(call))


def _in_projection_grads(call: ModuleCall, grads: Sequence[Tensor]) -> tuple[Tensor, ...]:
    """Per use, the gradients of the packed projection (k·R, T, 3E), zero off the use's part."""
    pulled = _pulled(call, grads)
    uses = []
    for use in _input_uses(call):
        like = pulled[use[0]]
        parts = [pulled[i] if i in use else torch.zeros_like(like) for i in range(3)]
        uses.append(torch.cat(parts, -1))
    return tuple(uses)


def _projection(index: int) -> KfacRule:
    """The rule of the separate query (0), key (1) or value (2) projection weight."""
    name = ("query", "key", "value")[index]
    return KfacRule(
        lambda call: _rows(attention_arguments(call)[name]),
        lambda call, g: _pulled(call, g)[index],
    )


_IN_PROJECTION = KfacRule(_in_projection_inputs, _in_projection_grads)
_OUT_PROJECTION = KfacRule(lambda call: attention_output(call), _LINEAR.grads)

#: Layers whose parameters belong to several Linear maps, each its own Kronecker block: per
#: parameter name, the map's name, whether it is the map's weight or bias, and its rule.
#: ``nn.MultiheadAttention``: the input projection (packed ``in_proj_weight`` (3E, E), or
#: separate q/k/v weights where kdim or vdim differ from E, with the packed ``in_proj_bias``)
#: is applied once per distinct input among query, key and value (self-attention: once, its
#: output gradients the stacked ``[δ_q; δ_k; δ_v]``); the output projection reads the
#: attention output ``a``.
GROUPED_KFAC_RULES: dict[type[nn.Module], dict[str, tuple[str, str, KfacRule]]] = {
    nn.MultiheadAttention: {
        "in_proj_weight": ("in_proj", "kron", _IN_PROJECTION),
        "in_proj_bias": ("in_proj", "bias", _IN_PROJECTION),
        "q_proj_weight": ("q_proj", "kron", _projection(0)),
        "k_proj_weight": ("k_proj", "kron", _projection(1)),
        "v_proj_weight": ("v_proj", "kron", _projection(2)),
        "out_proj.weight": ("out_proj", "kron", _OUT_PROJECTION),
        "out_proj.bias": ("out_proj", "bias", _OUT_PROJECTION),
    }
}


def as_uses(t: Tensor | tuple[Tensor, ...]) -> tuple[Tensor, ...]:
    """A rule's inputs or gradients as a tuple of uses (``KfacRule``)."""
    return t if isinstance(t, tuple) else (t,)


def grouped_rule(module: nn.Module, name: str) -> tuple[str, str, KfacRule] | None:
    """The map, block kind and rule of parameter ``name`` of a layer in ``GROUPED_KFAC_RULES``."""
    return GROUPED_KFAC_RULES.get(type(module), {}).get(name)


def kfac_rule(module: nn.Module) -> KfacRule | None:
    """The KFAC rule of ``module``'s exact type if it applies to the module, else None."""
    cls = type(module)
    rule = KFAC_RULES.get(cls) or OPTIONAL_KFAC_RULES.get(cls.__module__, {}).get(cls.__qualname__)
    return rule if rule is not None and rule.check(module) is None else None


class Block(NamedTuple):
    """The block of one parameter: its kind and, for ``"kron"``/``"bias"``, the layer's rule.

    Attributes:
        kind: ``"kron"``, ``"bias"``, ``"dense"`` or ``"diag"`` (see the module).
        module: The layer owning the parameter (None for the exact kinds).
        rule: Its KFAC rule (None for the exact kinds).
        low_rank: Its output-gradient factor is a diagonal plus a low-rank term (many outputs).
        map: The Linear map of the layer the parameter belongs to, for a layer in
            ``GROUPED_KFAC_RULES`` ("": the layer itself).
    """

    kind: str
    module: nn.Module | None = None
    rule: KfacRule | None = None
    low_rank: bool = False
    map: str = ""

    @property
    def key(self) -> tuple[nn.Module | None, str]:
        """What the block's factors are summed under: the layer and its map."""
        return self.module, self.map


def module_name(model: nn.Module, module: nn.Module) -> str:
    """The name of ``module`` in ``model``: ``"<root>"`` for the model, ``"?"`` if absent."""
    return next((name or "<root>" for name, m in model.named_modules() if m is module), "?")


class EngineParameters(Protocol):
    """What a block plan reads of a ``PerSampleEngine``: its model and parameters."""

    @property
    def model(self) -> nn.Module:
        """The network the engine traces."""
        ...

    @property
    def needed(self) -> list[Tensor]:
        """The parameters the engine differentiates, in its order."""
        ...

    @property
    def slot(self) -> dict[tuple[nn.Module, str], int]:
        """The index in ``needed`` of each (module, parameter name) that uses a parameter."""
        ...


def plan_blocks(
    engine: EngineParameters,
    dense_limit: int = KFAC_DENSE_LIMIT,
    low_rank_above: int | None = None,
) -> list[Block]:
    """The block of every parameter of a per-sample engine, in ``engine.needed`` order.

    Args:
        engine: A ``PerSampleEngine``.
        dense_limit: Largest parameter outside a Kronecker rule whose exact block is dense.
        low_rank_above: Keep the output factor of layers with more outputs low rank (None:
            never).

    Raises:
        ValueError: For a ``Conv1D`` with more than ``low_rank_above`` outputs.
    """
    uses: dict[int, list[tuple[nn.Module, str]]] = {}
    for use, slot in engine.slot.items():
        uses.setdefault(slot, []).append(use)
    plan = []
    for slot, p in enumerate(engine.needed):
        owners = uses.get(slot, [])
        if len(owners) == 1 and (grouped := grouped_rule(*owners[0])) is not None:
            map_name, kind, rule = grouped
            plan.append(Block(kind, owners[0][0], rule, map=map_name))
            continue
        rule = kfac_rule(owners[0][0]) if len(owners) == 1 else None
        name = owners[0][1] if owners else None
        if rule is not None and name in ("weight", "bias"):
            module = owners[0][0]
            size = p.shape[-1] if rule.inputs_first and name == "weight" else p.shape[0]
            low_rank = low_rank_above is not None and size > low_rank_above and not rule.one_hot
            if low_rank and rule.inputs_first:  # laid out (D_in, D_out): G is the second factor
                raise ValueError(
                    f"module {module_name(engine.model, module)!r} ({type(module).__name__}) "
                    f"has {size} outputs, more than LARGE_OUTPUT_THRESHOLD={low_rank_above}, and "
                    "its weight is laid out (in, out): its output factor cannot be kept diagonal "
                    "plus low rank. Use subset_of_weights='last_layer', hessian_structure='diag', "
                    "or freeze it (requires_grad=False)."
                )
            plan.append(Block("kron" if name == "weight" else "bias", module, rule, low_rank))
        else:
            plan.append(Block("dense" if p.numel() <= dense_limit else "diag"))
    return plan


def block_shapes(plan: list[Block], params: Iterable[Tensor]) -> list[list[tuple[int, ...]]]:
    """The factor shapes of every block of ``plan`` for the parameters ``params``.

    A low-rank output factor's shape is a ``LowRankShape``.
    """
    shapes = []
    for block, p in zip(plan, params, strict=True):
        n = p.numel()
        square = LowRankShape if block.low_rank else lambda size: (size, size)
        if block.kind == "diag":
            shapes.append([(n,)])
        elif block.kind != "kron":
            shapes.append([square(n)])
        else:
            m = p.shape[0]
            shapes.append([(m,) if block.rule.one_hot else square(m), (n // m, n // m)])
    return shapes


def check_kronecker_layers(model: nn.Module, params: Iterable[Tensor], backend: str) -> None:
    """Refuse parameters outside Linear and convolution layers for a third-party KFAC.

    Args:
        model: The model (or the part of it the backend runs on).
        params: Parameters of interest.
        backend: Name of the backend, for the message.

    Raises:
        ValueError: Naming the first module that owns one of ``params`` and has no plain
            Kronecker rule, and the alternatives.
    """
    wanted = {id(p) for p in params}
    for name, module in model.named_modules():
        if not any(id(p) in wanted for p in module.parameters(recurse=False)):
            continue
        rule = kfac_rule(module)
        if rule is None or not rule.plain:
            base = KFAC_RULES.get(type(module))
            reason = base.check(module) if base is not None and base.plain else None
            raise ValueError(
                f"module {name or '<root>'!r} ({type(module).__name__}) owns parameters that "
                f"{backend} cannot Kronecker-factor"
                f"{': ' + reason if reason else ' (it factors Linear and Conv layers only)'}. "
                "Use backend=CurvlinopsGGN, whose KFAC takes every layer (embeddings, "
                "normalisation layers, any module through exact blocks), or "
                "hessian_structure='diag', or freeze them (requires_grad=False)."
            )


def check_gradient_factor_first(engine: EngineParameters, why: str) -> None:
    """Refuse Kronecker blocks ``A ⊗ G`` (output-gradient factor second) of an engine's layers.

    Args:
        engine: A ``PerSampleEngine``.
        why: What needs the output-gradient factor first, for the message.

    Raises:
        ValueError: Naming the first such layer (an embedding, transformers' ``Conv1D``).
    """
    for block in plan_blocks(engine):
        if block.kind == "kron" and block.rule.inputs_first:
            raise ValueError(
                f"{why} needs the output-gradient factor first in every Kronecker block, but "
                f"module {module_name(engine.model, block.module)!r} "
                f"({type(block.module).__name__}) has it second; use one sigma_noise for all "
                "outputs, or hessian_structure='diag' or 'full'."
            )


def check_output_columns(engine: EngineParameters, n_columns: int, low_rank_above: int) -> None:
    """Refuse ``n_columns`` exact-GGN columns per position above the large-output threshold.

    The exact GGN of C outputs has C columns per output position: a (B, C, C) column tensor and
    C backward passes per batch, out of reach for a vocabulary; a sampled or empirical Fisher
    has a few.

    Args:
        engine: A ``PerSampleEngine``.
        n_columns: Curvature columns per output position (the outputs per position).
        low_rank_above: The large-output threshold.

    Raises:
        ValueError: Naming the first layer with a low-rank output factor, the size and the
            alternatives, when ``n_columns > low_rank_above``.
    """
    if n_columns <= low_rank_above:
        return
    plan = plan_blocks(engine, low_rank_above=low_rank_above)
    large = [b.module for b in plan if b.low_rank and b.kind == "kron"]
    # name the output layer: the large layer with as many outputs as the model, else the first
    large.sort(key=lambda module: module.weight.shape[0] != n_columns)
    where = (
        f" (layer {module_name(engine.model, large[0])!r}, {type(large[0]).__name__}, keeps a "
        "diagonal-plus-low-rank output factor)"
        if large
        else ""
    )
    raise ValueError(
        f"the model has C={n_columns} outputs per position, more than LARGE_OUTPUT_THRESHOLD="
        f"{low_rank_above}{where}: the exact GGN's Kronecker factors need C curvature columns per "
        "position (a (B, C, C) tensor and C backward passes per batch). Use the Monte-Carlo "
        "Fisher (backend_kwargs={'stochastic': True}, num_samples columns per data point), "
        "backend=CurvlinopsEF (one column), or subset_of_weights='last_layer' (the exact GGN "
        "of the head in closed form)."
    )
