"""Per-sample parameter gradients of one module call, from its inputs and output gradients.

A recorded call ``z = m(a; θ_m)`` and the gradient ``g = ∂(vᵀ f)/∂z`` of an output column ``v``
determine the per-sample gradients ``∂(vₙᵀ fₙ)/∂θ_m`` of the module's direct parameters.
``PER_SAMPLE_RULES``, keyed by exact module type, has closed forms for Linear, convolution,
embedding and normalisation layers (BatchNorm with its running statistics);
``generic_per_sample`` differentiates any other module alone with ``torch.func``.
``SELECTED_RULES`` give chosen entries only (a subnetwork), at a cost that does not grow
with the layer.
"""

from __future__ import annotations

import inspect
import math
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Any, TypeVar

import torch
from torch import Tensor, nn
from torch.func import functional_call, vjp, vmap
from torch.nn import functional as F
from torch.utils._pytree import tree_flatten, tree_map

__all__ = [
    "GATHER_COST",
    "PER_SAMPLE_RULES",
    "RECURRENT_LAYERS",
    "SELECTED_RULES",
    "UNBATCHED_ARGUMENTS",
    "UNCALLED_CHILDREN",
    "ModuleCall",
    "attention_arguments",
    "attention_output",
    "attention_pullback",
    "call_rows",
    "conv_patches",
    "generic_per_sample",
    "per_sample_grads",
    "recurrent_input_gradients",
    "recurrent_pullback",
    "recurrent_weight_rows",
    "selected_per_sample_grads",
    "tiled_call",
    "without_batching_notes",
]

T = TypeVar("T")


@dataclass
class ModuleCall:
    """One recorded call of a module that owns trainable parameters.

    Attributes:
        module: The called module.
        args: Positional inputs of the call (detached unless gradients w.r.t. them are needed).
        kwargs: Keyword inputs of the call.
        outputs: The output tensors that carry gradient (leaves of the output pytree).
        output_slots: Positions of ``outputs`` among the tensor leaves of the output pytree.
        names: Names of the module's direct parameters to differentiate.
        cache: Scratch space for a rule (for example an unfolded convolution input).
        sequence_input: A recurrent layer's input sequence as the model passed it, attached to
            the graph (None for other layers, or where it carries no gradient): a backward
            pass of output columns can go on from it past the layer
            (``capture.OutputGradients``).
        input_nodes: The autograd nodes that made the call's inputs, where the call's own
            operations begin (``guard``: which operations read a parameter).
    """

    module: nn.Module
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    outputs: list[Tensor]
    output_slots: list[int]
    names: list[str]
    cache: dict[str, Tensor] = field(default_factory=dict)
    sequence_input: Tensor | None = None
    input_nodes: frozenset[object] = frozenset()


Rule = Callable[[ModuleCall, Sequence[Tensor]], dict[str, Tensor]]


@contextmanager
def without_batching_notes() -> Iterator[None]:
    """Silence torch's note that an operation loops in a vectorised pass.

    Such an operation (the fused attention kernels) is taken sample by sample inside ``vmap``
    or ``is_grads_batched``: the result is the same, and the note is about torch's kernels,
    not the user's model.
    """
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message="There is a performance drop because we have not"
        )
        yield


def _linear_weight(a: Tensor, g: Tensor) -> Tensor:
    """Per-sample weight gradients ``Σₜ gₜ aₜᵀ`` of ``z = W a + b``, shape (B, O, I).

    Inputs ``a`` (B, ..., I) and output gradients ``g`` (B, ..., O), summed over any extra
    (sequence) dims.
    """
    if a.dim() == 2:
        return g.unsqueeze(2) * a.unsqueeze(1)
    return torch.einsum("bto,bti->boi", g.flatten(1, -2), a.flatten(1, -2))


def _linear_bias(g: Tensor) -> Tensor:
    """Per-sample bias gradients of ``z = W a + b``: g (B, ..., O) → ``Σₜ gₜ`` (B, O)."""
    return g if g.dim() == 2 else g.flatten(1, -2).sum(1)


def _linear(call: ModuleCall, grads: Sequence[Tensor]) -> dict[str, Tensor]:
    """Per-sample gradients of ``nn.Linear``: ``Σₜ gₜ aₜᵀ`` over any extra (sequence) dims."""
    a, g = call.args[0], grads[0]
    out = {}
    if "weight" in call.names:
        out["weight"] = _linear_weight(a, g)
    if "bias" in call.names:
        out["bias"] = _linear_bias(g)
    return out


def conv_patches(call: ModuleCall) -> Tensor:
    """Input patches of a convolution call, shape (B, G, L, C_in/G · k), cached on the call.

    Patches are strided views of the padded input (no ``im2col``), copied once into the layout
    that makes every per-sample weight gradient one batched matmul.
    """
    if "patches" not in call.cache:
        m, a = call.module, call.args[0]
        pad = m._reversed_padding_repeated_twice
        if any(pad):
            mode = "constant" if m.padding_mode == "zeros" else m.padding_mode
            a = F.pad(a, pad, mode=mode)
        n = len(m.kernel_size)
        for i, (k, s, d) in enumerate(zip(m.kernel_size, m.stride, m.dilation)):
            a = a.unfold(2 + i, d * (k - 1) + 1, s)[..., ::d]
        # a: (B, C_in, *out_spatial, *kernel) -> (B, G, L, C_in/G · k)
        batch, groups = a.shape[0], m.groups
        a = a.reshape(batch, groups, -1, *a.shape[2:])
        a = a.permute(0, 1, *range(3, 3 + n), 2, *range(3 + n, 3 + 2 * n))
        call.cache["patches"] = a.reshape(batch, groups, math.prod(a.shape[2 : 2 + n]), -1)
    return call.cache["patches"]


def _conv(call: ModuleCall, grads: Sequence[Tensor]) -> dict[str, Tensor]:
    """Per-sample gradients of ``nn.Conv1d/2d/3d``: output gradients times input patches."""
    m, g = call.module, grads[0].flatten(2)
    out = {}
    if "weight" in call.names:
        patches = conv_patches(call)
        g = g.reshape(g.shape[0], m.groups, -1, g.shape[-1])
        out["weight"] = (g @ patches).reshape(g.shape[0], *m.weight.shape)
    if "bias" in call.names:
        out["bias"] = grads[0].flatten(2).sum(-1)
    return out


def _embedding(call: ModuleCall, grads: Sequence[Tensor]) -> dict[str, Tensor]:
    """Per-sample gradients of ``nn.Embedding``: each position's gradient added to its row."""
    m, x, g = call.module, call.args[0], grads[0]
    if m.scale_grad_by_freq:  # the gradient depends on the token frequencies of the call
        return generic_per_sample(call, grads)
    index = x.reshape(len(x), -1, 1).expand(-1, -1, m.embedding_dim)
    out = g.new_zeros(len(x), m.num_embeddings, m.embedding_dim)
    out.scatter_add_(1, index, g.reshape(len(x), -1, m.embedding_dim))
    if m.padding_idx is not None:
        out[:, m.padding_idx] = 0
    return {"weight": out}


def _affine(call: ModuleCall, g: Tensor, x_hat: Tensor, param_dims: int) -> dict[str, Tensor]:
    """Per-sample gradients of ``z = weight ⊙ x̂ + bias`` over the trailing ``param_dims`` dims.

    ``Σₜ gₜ ⊙ x̂ₜ`` for the weight and ``Σₜ gₜ`` for the bias, summed over the positions between
    the batch dimension and the parameter's dimensions.
    """
    positions = tuple(range(1, g.dim() - param_dims))
    out = {}
    if "weight" in call.names:
        out["weight"] = (g * x_hat).sum(positions) if positions else g * x_hat
    if "bias" in call.names:
        out["bias"] = g.sum(positions) if positions else g
    return out


def _normalisation(
    normalise: Callable[[nn.Module, Tensor], Tensor], channels: bool = False
) -> Rule:
    """The rule of a normalisation layer ``weight ⊙ x̂ + bias``, ``x̂ = normalise(module, input)``.

    The parameters scale the channels (dim 1) with ``channels``, else the trailing
    ``normalized_shape`` dims.
    """

    def rule(call: ModuleCall, grads: Sequence[Tensor]) -> dict[str, Tensor]:
        g, x_hat = grads[0], normalise(call.module, call.args[0])
        if channels:
            return _affine(call, g.movedim(1, -1), x_hat.movedim(1, -1), 1)
        return _affine(call, g, x_hat, len(call.module.normalized_shape))

    return rule


def _running_batch_norm(m: nn.Module, a: Tensor) -> Tensor:
    """``x̂`` of ``nn.BatchNorm1d/2d/3d`` normalising with running statistics.

    Raises:
        ValueError: When the layer normalises with batch statistics (training mode, or no
            running statistics): its outputs then couple the data points of a batch.
    """
    if m.training or m.running_mean is None:
        raise ValueError(
            f"{type(m).__name__} normalises with batch statistics (training mode or "
            "track_running_stats=False), which couple the data points of a batch: per-sample "
            "gradients need its running statistics; call model.eval() first."
        )
    return F.batch_norm(a, m.running_mean.to(a), m.running_var.to(a), eps=m.eps)


_BATCH_NORM = _normalisation(_running_batch_norm, channels=True)


def _batch_dims(tree: T, batch_size: int) -> T:
    """``vmap`` in-dims for a pytree: 0 for tensors with a leading batch dim, else None."""
    return tree_map(
        lambda v: (
            0 if isinstance(v, Tensor) and v.dim() > 0 and v.shape[0] == batch_size else None
        ),
        tree,
    )


def generic_per_sample(call: ModuleCall, grads: Sequence[Tensor]) -> dict[str, Tensor]:
    """Per-sample gradients of any module's direct parameters via ``torch.func``.

    The module is re-run per sample with only its direct parameters as differentiable inputs
    (its children's parameters stay fixed), and a VJP against the recorded output gradient gives
    the sample's parameter gradient.

    Args:
        call: The recorded call.
        grads: Gradients w.r.t. ``call.outputs``, each of shape (B, ...).

    Returns:
        Per-sample gradients, one (B, *param.shape) tensor per name in ``call.names``.
    """
    module, batch = call.module, grads[0].shape[0]
    params = {name: getattr(module, name) for name in call.names}
    arg_dims, kwarg_dims = _batch_dims(call.args, batch), _batch_dims(call.kwargs, batch)

    def add_batch_dim(tree: T, dims: T) -> T:
        return tree_map(lambda v, d: v.unsqueeze(0) if d == 0 else v, tree, dims)

    def single(theta, args, kwargs, g):
        args, kwargs = add_batch_dim(args, arg_dims), add_batch_dim(kwargs, kwarg_dims)

        def outputs(theta):
            leaves = tree_flatten(functional_call(module, theta, args, kwargs))[0]
            tensors = [leaf for leaf in leaves if isinstance(leaf, Tensor)]
            return tuple(tensors[i] for i in call.output_slots)

        _, pullback = vjp(outputs, theta)
        return pullback(tuple(gi.unsqueeze(0) for gi in g))[0]

    in_dims = (None, arg_dims, kwarg_dims, 0)
    with without_batching_notes():
        return vmap(single, in_dims=in_dims)(params, call.args, call.kwargs, tuple(grads))


#: Recurrent layers, by exact type, that PyTorch's cell equations unroll
#: (``recurrent_pullback``); a vectorised backward pass of output columns goes through the
#: unrolling instead of their fused kernel (``capture.recurrent_cut``).
RECURRENT_LAYERS = (nn.RNN, nn.LSTM, nn.GRU)


def _recurrent_cell(module: nn.RNNBase) -> Callable[[Tensor, Tensor, Tensor, Tensor], tuple]:
    """One time step ``(ih, hh, h, c) → (h', c')`` of a recurrent layer, PyTorch's equations.

    ``ih = W_ih xₜ + b_ih`` and ``hh = W_hh hₜ₋₁ + b_hh`` are the two linear maps of the step;
    ``c`` is the LSTM's cell state (unused by the others).
    """
    if isinstance(module, nn.LSTM):

        def lstm(ih: Tensor, hh: Tensor, h: Tensor, c: Tensor) -> tuple[Tensor, Tensor]:
            i, f, g, o = (ih + hh).chunk(4, -1)
            c = f.sigmoid() * c + i.sigmoid() * g.tanh()
            return o.sigmoid() * c.tanh(), c

        return lstm
    if isinstance(module, nn.GRU):

        def gru(ih: Tensor, hh: Tensor, h: Tensor, c: Tensor) -> tuple[Tensor, Tensor]:
            (ih_r, ih_z, ih_n), (hh_r, hh_z, hh_n) = ih.chunk(3, -1), hh.chunk(3, -1)
            r, z = (ih_r + hh_r).sigmoid(), (ih_z + hh_z).sigmoid()
            return (1 - z) * (ih_n + r * hh_n).tanh() + z * h, c

        return gru
    activation = torch.tanh if module.nonlinearity == "tanh" else torch.relu
    return lambda ih, hh, h, c: (activation(ih + hh), c)


def _unrolled_recurrence(call: ModuleCall) -> tuple[dict[str, tuple], list[Tensor], Tensor]:
    """A recurrent call unrolled with PyTorch's cell equations, for its recorded rows.

    A call tiled for several columns (``tiled_call``) is unrolled for its R recorded rows only.
    Each layer's ``ih`` is one product for all time steps, which the steps read through one
    ``unbind`` (a gradient w.r.t. it is assembled once, not once per step). The cells of
    ``nn.LSTM`` and ``nn.RNN`` read ``ih + hh`` only, so both maps have the same gradient and
    ``hh`` is not kept; the GRU's reads ``hh``'s parts on their own (``r ⊙ hh_n``).

    Returns:
        Per direction of each layer (by parameter suffix), its inputs (R, T, D), the linear
        maps ``ih`` (R, T, G) and ``hh`` (T of (R, G); none where they share ``ih``'s gradient)
        in the graph, and the previous hidden states (R, T, H); the unrolled outputs that the
        call records, in the graph; and the input sequence (R, T, D), the graph's leaf.

    Raises:
        ValueError: If they are not the layer's outputs (a subclass with its own forward).
    """
    m, rows = call.module, len(call.outputs[0])
    x = call.args[0][:rows]
    directions = 2 if m.bidirectional else 1
    hx = call.args[1] if len(call.args) > 1 else call.kwargs.get("hx")
    if hx is None:
        hx = x.new_zeros(rows, m.num_layers * directions, m.hidden_size)
    h0, c0 = (h[:rows] for h in (hx if isinstance(hx, (tuple, list)) else (hx, hx)))
    cell, steps, last = _recurrent_cell(m), {}, []
    keep_hh = isinstance(m, nn.GRU)
    with torch.enable_grad():
        h0, c0 = h0.detach().requires_grad_(), c0.detach()
        sequence = layer_input = x.detach().requires_grad_()
        for layer in range(m.num_layers):
            sequences = []
            for direction in range(directions):
                suffix = f"_l{layer}{'_reverse' if direction else ''}"
                W_ih, W_hh = (
                    getattr(m, f"weight_{w}{suffix}").detach().to(x) for w in ("ih", "hh")
                )
                b_ih, b_hh = (
                    getattr(m, f"bias_{b}{suffix}").detach().to(x) if m.bias else 0
                    for b in ("ih", "hh")
                )
                inputs = layer_input.flip(1) if direction else layer_input
                ih = inputs @ W_ih.T + b_ih
                h, c = h0[:, layer * directions + direction], c0[:, layer * directions + direction]
                hh, previous, hidden = [], [], []
                for ih_t in ih.unbind(1):
                    previous.append(h)
                    hh.append(h @ W_hh.T + b_hh)
                    h, c = cell(ih_t, hh[-1], h, c)
                    hidden.append(h)
                previous = torch.stack(previous, 1).detach()
                steps[suffix] = (inputs.detach(), ih, previous, hh if keep_hh else [])
                last.append((h, c))
                hidden = torch.stack(hidden, 1)
                sequences.append(hidden.flip(1) if direction else hidden)
            layer_input = torch.cat(sequences, -1)
        states = [torch.stack(s, 1) for s in zip(*last)]  # h_n, c_n: (R, layers·directions, H)
        unrolled = [layer_input, *states[: 2 if isinstance(m, nn.LSTM) else 1]]
        unrolled = [unrolled[i] for i in call.output_slots]
        for mine, recorded in zip(unrolled, call.outputs):
            # The layer may run in a narrower type than the unrolling (half precision, or a
            # float64 posterior): compare in the unrolling's type, to the layer's roundoff.
            roundoff = 32 * torch.finfo(recorded.dtype).eps
            rtol, atol = max(1e-4, roundoff), max(1e-5, roundoff)
            if not torch.allclose(mine, recorded.detach().to(mine), rtol, atol):
                raise ValueError(
                    f"{type(m).__name__}: the recurrent equations do not give the layer's "
                    "outputs (a subclass with its own forward?); no per-sample rule applies."
                )
    return steps, unrolled, sequence


def recurrent_pullback(
    call: ModuleCall, grads: Sequence[Tensor]
) -> dict[str, tuple[Tensor, Tensor, Tensor, Tensor]]:
    """A recurrent call's output gradients of K columns pulled back to every step's linear maps.

    The call is unrolled once per row count and kept in ``call.cache``
    (``_unrolled_recurrence``), so other chunks of columns reuse it; the K columns go back
    through it together, in one vectorised backward pass. Where ``recurrent_input_gradients``
    pulled the same gradients back already, its result is taken (once).

    Args:
        call: A recorded ``nn.RNN``, ``nn.LSTM`` or ``nn.GRU`` call (batch-first, R rows).
        grads: Per recorded output, the gradients of K columns (K, R, ...).

    Returns:
        Per direction of each layer (by parameter suffix): its inputs ``xₜ`` (R, T, D), the
        previous hidden states ``hₜ₋₁`` (R, T, H), and the gradients w.r.t. ``ihₜ = W_ih xₜ +
        b_ih`` and ``hhₜ = W_hh hₜ₋₁ + b_hh``, (K, R, T, G) each (one tensor for both where
        the cell reads ``ih + hh`` only).

    Raises:
        ValueError: For packed sequences, LSTM projections (``proj_size``), dropout between
            layers in training mode, or a subclass whose outputs the equations do not give.
    """
    pulled = call.cache.pop("pulled", None)
    if pulled is not None and _same_memory(pulled[0], grads[0]):
        return pulled[1]  # type: ignore[return-value]
    return _pullback(call, grads, to_input=False)[0]


def _same_memory(a: Tensor, b: Tensor) -> bool:
    """Whether ``b`` is ``a`` or a view of the same numbers (``a.detach()``); ``a`` is held."""
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()


def recurrent_input_gradients(call: ModuleCall, grads: Sequence[Tensor]) -> Tensor:
    """The K columns' gradients w.r.t. a recurrent call's input sequence, (K, R, T, D).

    From the pullback of ``recurrent_pullback``, which its next call with the same ``grads``
    (or their detached views) takes from ``call.cache`` instead of pulling them back again.

    Args:
        call: As ``recurrent_pullback``; its ``hx`` carries no gradient.
        grads: As ``recurrent_pullback``.

    Raises:
        ValueError: As ``recurrent_pullback``.
    """
    out, d_input = _pullback(call, grads, to_input=True)
    call.cache["pulled"] = (grads[0], out)  # type: ignore[assignment]
    return d_input


def _pullback(
    call: ModuleCall, grads: Sequence[Tensor], to_input: bool
) -> tuple[dict[str, tuple[Tensor, Tensor, Tensor, Tensor]], Tensor | None]:
    """``recurrent_pullback``'s result, and the gradients w.r.t. the input where asked."""
    m, x = call.module, call.args[0]
    if not isinstance(x, Tensor):
        raise ValueError(
            f"{type(m).__name__} called on a {type(x).__name__}: per-sample curvature of a "
            "recurrent layer needs padded sequences (nn.utils.rnn.pad_packed_sequence); "
            "packed ones work with hessian_structure='diag' or 'full' (no exact blocks)."
        )
    if getattr(m, "proj_size", 0) or (m.training and m.dropout):
        raise ValueError(
            f"{type(m).__name__} with proj_size or dropout in training mode has no per-sample "
            "rule; set proj_size=0 or call model.eval()."
        )
    key = f"unrolled{len(call.outputs[0])}"
    if key not in call.cache:
        call.cache[key] = _unrolled_recurrence(call)  # type: ignore[assignment]
    steps, unrolled, sequence = call.cache[key]
    maps = [t for _, ih, _, hh in steps.values() for t in (ih, *hh)]
    wanted = [*maps, sequence] if to_input else maps
    with without_batching_notes():
        pulled = torch.autograd.grad(
            unrolled,
            wanted,
            list(grads),
            allow_unused=True,
            retain_graph=True,
            is_grads_batched=True,
        )
    k = len(grads[0])
    found = iter(g if g is not None else t.new_zeros(k, *t.shape) for t, g in zip(wanted, pulled))
    out = {}
    for suffix, (inputs, _, previous, hh) in steps.items():
        d_ih = next(found)
        d_hh = torch.stack([next(found) for _ in hh], 2) if hh else d_ih
        out[suffix] = (inputs, previous, d_ih, d_hh)
    return out, next(found, None)


def recurrent_weight_rows(a: Tensor, d: Tensor) -> Tensor:
    """Per-row gradients ``Σₜ δₖᵣₜ aᵣₜᵀ`` (K, R, G, D) of a step map's weight.

    Of the map's inputs ``a`` (R, T, D) (``xₜ`` or ``hₜ₋₁``) and the gradients ``d``
    (K, R, T, G) of ``recurrent_pullback``, computed in ``d``'s type.
    """
    return torch.einsum("krtg,rtd->krgd", d, a.to(d.dtype))


def _recurrent(call: ModuleCall, grads: Sequence[Tensor]) -> dict[str, Tensor]:
    """Per-sample gradients of ``nn.RNN``, ``nn.LSTM`` and ``nn.GRU`` (recorded batch-first).

    Written here because the fused recurrent kernels have no ``vmap`` batching rule: the layer
    is unrolled over time for the whole batch with PyTorch's cell equations, the output
    gradients are pulled back to every step's two linear maps ``ihₜ = W_ih xₜ + b_ih`` and
    ``hhₜ = W_hh hₜ₋₁ + b_hh`` (``recurrent_pullback``; the data points stay independent),
    and ``Σₜ δihₜ xₜᵀ``, ``Σₜ δhhₜ hₜ₋₁ᵀ`` and the bias sums are formed per data point. A call
    tiled for k columns (k·R rows, ``tiled_call``) is unrolled for its R rows and its k
    columns pulled back together.

    Raises:
        ValueError: As ``recurrent_pullback``.
    """
    rows = len(call.outputs[0])
    columns = [g.unflatten(0, (len(g) // rows, rows)) for g in grads]
    out = {}
    for suffix, (inputs, previous, d_ih, d_hh) in recurrent_pullback(call, columns).items():
        for name, a, d in (("ih", inputs, d_ih), ("hh", previous, d_hh)):
            if f"weight_{name}{suffix}" in call.names:
                out[f"weight_{name}{suffix}"] = recurrent_weight_rows(a, d).flatten(0, 1)
            if f"bias_{name}{suffix}" in call.names:
                out[f"bias_{name}{suffix}"] = d.sum(2).flatten(0, 1)
    return out


def attention_arguments(call: ModuleCall) -> dict[str, Any]:
    """The arguments of a recorded ``nn.MultiheadAttention`` call, by name, defaults filled."""
    module = call.module
    bound = inspect.signature(type(module).forward).bind(module, *call.args, **call.kwargs)
    bound.apply_defaults()
    return dict(bound.arguments)


def _attention_parts(call: ModuleCall) -> tuple[list[Tensor], list[Tensor], Tensor, list[Tensor]]:
    """An attention call recomputed for its rows with its projections in the graph.

    The query, key and value projections are formed here (``x W_qᵀ + b_q``, ...) and the
    attention itself by ``F.multi_head_attention_forward`` with identity projections, so masks,
    scaling, ``bias_k``/``bias_v`` and ``add_zero_attn`` follow PyTorch; the output projection
    ``a W_oᵀ + b_o`` is formed here too.

    Returns:
        The inputs (query, key, value), their projections in the graph, the attention output
        ``a`` before the output projection (R, L, E), and the recomputed outputs that the call
        records, in the graph.

    Raises:
        ValueError: For dropout in training mode (it couples nothing but is random).
        RuntimeError: If the recomputation does not give the layer's outputs.
    """
    m, arguments = call.module, attention_arguments(call)
    if m.training and m.dropout:
        raise ValueError(
            "MultiheadAttention with dropout in training mode has no per-sample rule; call "
            "model.eval() first."
        )
    inputs = [arguments[name].detach() for name in ("query", "key", "value")]
    _, length, width = inputs[0].shape
    if m._qkv_same_embed_dim:
        weights = list(m.in_proj_weight.detach().chunk(3))
    else:
        weights = [getattr(m, f"{n}_proj_weight").detach() for n in "qkv"]
    biases = [None] * 3 if m.in_proj_bias is None else list(m.in_proj_bias.detach().chunk(3))
    attn_mask = arguments["attn_mask"]
    if attn_mask is not None and attn_mask.dim() == 2 and attn_mask.shape[0] != length:
        attn_mask = attn_mask[:length]  # rows tiled for more columns: the mask is per position
    eye = torch.eye(width, dtype=inputs[0].dtype, device=inputs[0].device)
    with torch.enable_grad():
        projections = [
            F.linear(x, w.to(x), b if b is None else b.to(x)).requires_grad_()
            for x, w, b in zip(inputs, weights, biases)
        ]
        first = [p.transpose(0, 1) for p in projections]  # the functional takes (L, R, E)
        a, attention = F.multi_head_attention_forward(
            *first,
            width,
            m.num_heads,
            None,
            None,
            m.bias_k if m.bias_k is None else m.bias_k.detach().to(eye),
            m.bias_v if m.bias_v is None else m.bias_v.detach().to(eye),
            m.add_zero_attn,
            0.0,
            eye,
            None,
            training=False,
            key_padding_mask=arguments["key_padding_mask"],
            need_weights=arguments["need_weights"],
            attn_mask=attn_mask,
            use_separate_proj_weight=True,
            q_proj_weight=eye,
            k_proj_weight=eye,
            v_proj_weight=eye,
            average_attn_weights=arguments["average_attn_weights"],
            is_causal=arguments["is_causal"],
        )
        a = a.transpose(0, 1)
        bias = m.out_proj.bias
        output = F.linear(
            a, m.out_proj.weight.detach().to(a), bias if bias is None else bias.detach().to(a)
        )
        recomputed = [output, attention]
    recomputed = [recomputed[i] for i in call.output_slots]
    for mine, recorded in zip(recomputed, call.outputs):
        roundoff = 32 * torch.finfo(recorded.dtype).eps
        rtol, atol = max(1e-4, roundoff), max(1e-5, roundoff)
        if not torch.allclose(mine[: len(recorded)], recorded.detach().to(mine), rtol, atol):
            raise RuntimeError(
                "MultiheadAttention: the recomputed attention does not give the layer's outputs"
            )
    return inputs, projections, a.detach(), recomputed


def attention_pullback(
    call: ModuleCall, grads: Sequence[Tensor]
) -> tuple[list[Tensor], list[Tensor], Tensor]:
    """An attention call's output gradients pulled back to its query, key and value projections.

    The attention is recomputed once per row count and kept in ``call.cache``
    (``_attention_parts``), so the other columns of the same rows reuse it.

    Args:
        call: A recorded ``nn.MultiheadAttention`` call (batch-first, R rows).
        grads: The gradients w.r.t. its recorded outputs, R rows each.

    Returns:
        The inputs (query, key, value), the gradients w.r.t. their projections (R, L or S, E),
        zero where a projection does not reach the outputs, and the attention output ``a``
        before the output projection (R, L, E).
    """
    key = f"attention{len(call.args[0]) if call.args else len(call.kwargs['query'])}"
    if key not in call.cache:
        call.cache[key] = _attention_parts(call)  # type: ignore[assignment]
    inputs, projections, a, recomputed = call.cache[key]
    pulled = torch.autograd.grad(
        recomputed, projections, list(grads), allow_unused=True, retain_graph=True
    )
    pulled = [torch.zeros_like(p) if d is None else d for p, d in zip(projections, pulled)]
    return inputs, pulled, a


def attention_output(call: ModuleCall) -> Tensor:
    """The attention output ``a`` (R, L, E) an attention call feeds its ``out_proj``."""
    key = f"attention{len(call.args[0]) if call.args else len(call.kwargs['query'])}"
    if key not in call.cache:
        call.cache[key] = _attention_parts(call)  # type: ignore[assignment]
    return call.cache[key][2]


def _attention(call: ModuleCall, grads: Sequence[Tensor]) -> dict[str, Tensor]:
    """Per-sample gradients of ``nn.MultiheadAttention``'s projections (recorded batch-first).

    Written here because the module never calls its ``out_proj`` and its fused kernels have no
    ``vmap`` rule: the output gradients are pulled back to the query, key and value projections
    through the recomputed attention (``attention_pullback``), and the Linear rule gives each
    projection's ``Σₜ δₜ xₜᵀ`` and bias sums per data point; the output projection's are
    ``Σₜ gₜ aₜᵀ`` and ``Σₜ gₜ``. ``bias_k``/``bias_v`` have no rule here (the attribution guard
    takes them through autograd).
    """
    inputs, pulled, a = attention_pullback(call, grads)
    out = {}
    per_projection = [_linear_weight(x, d) for x, d in zip(inputs, pulled)]
    if "in_proj_weight" in call.names:
        out["in_proj_weight"] = torch.cat(per_projection, 1)
    for name, value in zip(("q_proj_weight", "k_proj_weight", "v_proj_weight"), per_projection):
        if name in call.names:
            out[name] = value
    if "in_proj_bias" in call.names:
        out["in_proj_bias"] = torch.cat([_linear_bias(d) for d in pulled], 1)
    if "out_proj.weight" in call.names:
        out["out_proj.weight"] = _linear_weight(a, grads[0])
    if "out_proj.bias" in call.names:
        out["out_proj.bias"] = _linear_bias(grads[0])
    return out


#: Children whose parameters a module uses without calling them, so the module's own calls
#: give their gradients (``nn.MultiheadAttention`` passes ``out_proj``'s weight and bias to
#: ``F.multi_head_attention_forward``).
UNCALLED_CHILDREN: dict[type[nn.Module], tuple[str, ...]] = {nn.MultiheadAttention: ("out_proj",)}


#: Arguments of a module's calls that are not per row even when their leading size is the
#: batch's (a (T, T) attention mask with T = B): kept whole when a call's rows are split.
UNBATCHED_ARGUMENTS: dict[type[nn.Module], tuple[str, ...]] = {
    nn.MultiheadAttention: ("attn_mask",)
}


def tiled_call(call: ModuleCall, k: int) -> ModuleCall:
    """The call repeated for ``k`` output columns: inputs with its rows along dim 0 tiled."""
    rows = call.outputs[0].shape[0]

    def tile(v: object) -> object:
        if isinstance(v, Tensor) and v.dim() > 0 and v.shape[0] == rows:
            return v.unsqueeze(0).expand(k, *v.shape).reshape(k * rows, *v.shape[1:])
        return v

    args, kwargs = tree_map(tile, call.args), tree_map(tile, call.kwargs)
    return ModuleCall(call.module, args, kwargs, call.outputs, call.output_slots, call.names)


def call_rows(call: ModuleCall, rows: slice, n_rows: int) -> ModuleCall:
    """The call restricted to some of its ``n_rows`` rows (inputs and outputs along dim 0)."""
    keep = UNBATCHED_ARGUMENTS.get(type(call.module), ())
    args, kwargs = call.args, call.kwargs
    if keep:  # by name, so that those arguments are recognised wherever they were passed
        bound = inspect.signature(type(call.module).forward).bind(call.module, *args, **kwargs)
        args, kwargs = (), {k: v for k, v in list(bound.arguments.items())[1:]}

    def take(name: str | None, v: object) -> object:
        if name in keep or not (isinstance(v, Tensor) and v.dim() and v.shape[0] == n_rows):
            return v
        return v[rows]

    args = tuple(tree_map(partial(take, None), a) for a in args)
    kwargs = {k: tree_map(partial(take, k), v) for k, v in kwargs.items()}
    outputs = [z[rows] for z in call.outputs]
    return ModuleCall(call.module, args, kwargs, outputs, call.output_slots, call.names)


#: Closed-form per-sample gradient rules, keyed by exact module type.
PER_SAMPLE_RULES: dict[type[nn.Module], Rule] = {
    nn.Linear: _linear,
    nn.Conv1d: _conv,
    nn.Conv2d: _conv,
    nn.Conv3d: _conv,
    nn.Embedding: _embedding,
    nn.LayerNorm: _normalisation(lambda m, a: F.layer_norm(a, m.normalized_shape, eps=m.eps)),
    nn.RMSNorm: _normalisation(lambda m, a: F.rms_norm(a, m.normalized_shape, eps=m.eps)),
    nn.GroupNorm: _normalisation(lambda m, a: F.group_norm(a, m.num_groups, eps=m.eps), True),
    nn.BatchNorm1d: _BATCH_NORM,
    nn.BatchNorm2d: _BATCH_NORM,
    nn.BatchNorm3d: _BATCH_NORM,
    **dict.fromkeys(RECURRENT_LAYERS, _recurrent),
    nn.MultiheadAttention: _attention,
}


def _take_last(t: Tensor, index: Tensor) -> Tensor:
    """``t[..., index]``, gathered from a 2-D view (several times faster than on N-D)."""
    return torch.index_select(t.reshape(-1, t.shape[-1]), 1, index).reshape(*t.shape[:-1], -1)


def _linear_selected(
    call: ModuleCall, grads: Sequence[Tensor], entries: dict[str, Tensor]
) -> dict[str, Tensor]:
    """Selected entries of ``nn.Linear`` per-sample gradients: ``Σₜ gₜₒ aₜᵢ`` for weight (o, i).

    The selected input columns are gathered once per call (cached) for all output columns. On
    (B, D_in) inputs, gradients with leading dims (K, B, D_out) give (K, B, n) at once.
    """
    a, g = call.args[0], grads[0]
    out = {}
    if "weight" in entries:
        rows, cols = entries["weight"] // a.shape[-1], entries["weight"] % a.shape[-1]
        if "selected_inputs" not in call.cache:
            call.cache["selected_inputs"] = a[..., cols]
        product = _take_last(g, rows) * call.cache["selected_inputs"]
        out["weight"] = product if a.dim() == 2 else product.flatten(1, -2).sum(1)
    if "bias" in entries:
        selected = _take_last(g, entries["bias"])
        out["bias"] = selected if a.dim() == 2 else selected.flatten(1, -2).sum(1)
    return out


def _conv_selected(
    call: ModuleCall, grads: Sequence[Tensor], entries: dict[str, Tensor]
) -> dict[str, Tensor]:
    """Selected entries of convolution per-sample gradients: output gradients times patches."""
    m, g = call.module, grads[0].flatten(2)  # (B, D_out, L)
    out = {}
    if "weight" in entries:
        patches = conv_patches(call)  # (B, G, L, D_in/G · k)
        per_out = patches.shape[-1]
        rows, cols = entries["weight"] // per_out, entries["weight"] % per_out
        group = rows // (m.out_channels // m.groups)
        selected = patches.transpose(1, 2)[:, :, group, cols]  # (B, L, n)
        out["weight"] = (g[:, rows] * selected.transpose(1, 2)).sum(-1)
    if "bias" in entries:
        out["bias"] = g[:, entries["bias"]].sum(-1)
    return out


#: Per-sample gradients of selected entries, keyed by exact module type.
SELECTED_RULES: dict[
    type[nn.Module], Callable[[ModuleCall, Sequence[Tensor], dict[str, Tensor]], dict[str, Tensor]]
] = {
    nn.Linear: _linear_selected,
    nn.Conv1d: _conv_selected,
    nn.Conv2d: _conv_selected,
    nn.Conv3d: _conv_selected,
}


#: A gathered product costs about as much as this many multiply-adds of a matrix product.
GATHER_COST = 16


def selected_per_sample_grads(
    call: ModuleCall, grads: Sequence[Tensor], entries: dict[str, Tensor]
) -> dict[str, Tensor]:
    """Per-sample gradients of chosen entries of a call's direct parameters.

    A layer applied at T > 1 positions (convolutions, sequences) sums T gathered products per
    entry; once that costs more than the matrix product giving the whole layer's per-sample
    gradients (``n · GATHER_COST ≥`` the layer's size), those are computed and selected.

    Args:
        call: The recorded call.
        grads: Gradients w.r.t. ``call.outputs``.
        entries: Per parameter name, indices into the flattened parameter (on its device).

    Returns:
        One (B, len(entries[name])) tensor per name in ``entries``.
    """
    rule = SELECTED_RULES.get(type(call.module))
    if rule is not None:
        g, module = grads[0], call.module
        positions = g[0].numel() // module.weight.shape[0]
        n_selected = sum(len(index) for index in entries.values())
        size = sum(getattr(module, name).numel() for name in entries)
        if positions == 1 or n_selected * GATHER_COST < size:
            return rule(call, grads, entries)
    full = per_sample_grads(call, grads)
    return {name: full[name].flatten(1)[:, index] for name, index in entries.items()}


def per_sample_grads(call: ModuleCall, grads: Sequence[Tensor]) -> dict[str, Tensor]:
    """Per-sample gradients of a call's direct parameters, by closed form when one exists.

    Args:
        call: The recorded call.
        grads: Gradients w.r.t. ``call.outputs``.

    Returns:
        One (B, *param.shape) tensor per name in ``call.names``.
    """
    rule = PER_SAMPLE_RULES.get(type(call.module), generic_per_sample)
    return rule(call, grads)
