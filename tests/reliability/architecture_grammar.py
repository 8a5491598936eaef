"""A grammar of tiny float64 architectures that challenge a per-module view of curvature.

A :class:`Blueprint` is a plain, printable description of a model and its data: an input stage
(tokens, tokens in a dict, continuous sequences or vectors, with or without a position
table), a list of :class:`Block` patterns, a readout over the sequence and a head; or a tiny
Hugging Face model (GPT-2, BERT, Llama) from a config. :func:`build` turns it into a model in
eval mode, its inputs, targets and loader, so a failing example printed by hypothesis is
rebuilt with ``build(Blueprint(...))``.

Patterns (``BLOCK_KINDS``): a Linear called twice, a custom module with raw parameters used in
its own forward, an adapter calling ``F.linear(x, base.weight)`` beside ``base(x)``, in-place
ops on non-leaf tensors, LayerNorm and BatchNorm in eval mode, activation checkpointing,
``nn.MultiheadAttention`` (batch- or sequence-first, causal or padding masks, ``need_weights``
either way), ``nn.TransformerEncoderLayer`` and ``nn.LSTM`` / ``nn.GRU`` / ``nn.RNN`` (either
layout, one or two directions, with or without a connection around the layer); any pattern
may run under activation checkpointing (``Block.checkpointed``). Heads: a
Linear, a Linear sharing the token table's weight, or a bare ``h @ wte.weight.T``. Position
tables are looked up broadcast ``wpe(arange(T)[None])`` or without a batch dimension
``wpe(arange(T))``, with T equal to the batch size in some examples.
"""

from __future__ import annotations

from copy import deepcopy
from dataclasses import dataclass, replace

import torch
from hypothesis import strategies as st
from torch import nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, TensorDataset

from conftest import DictDataset

#: Largest number of trainable parameters of a drawn model (the dense oracle stays fast).
MAX_PARAMETERS = 400

#: Patterns that read (B, D) vectors or (B, T, D) sequences alike.
POINTWISE_BLOCKS = ("reuse", "raw-parameters", "adapter", "in-place", "norm", "checkpoint")
#: Patterns that mix the positions of a sequence.
SEQUENCE_BLOCKS = ("attention", "encoder-layer", "recurrent")
#: The recurrent pattern's layers.
RECURRENT_CELLS = {"lstm": nn.LSTM, "gru": nn.GRU, "rnn": nn.RNN}
BLOCK_KINDS = POINTWISE_BLOCKS + SEQUENCE_BLOCKS

#: Input stages: token ids, token ids under ``"input_ids"`` of a dict, continuous sequences
#: (B, T, d) and vectors (B, d).
INPUTS = ("tokens", "dict", "sequence", "vector")
#: Tiny Hugging Face models, token ids in (plain or in a dict), (B, C) logits out.
HF_MODELS = ("gpt2", "bert", "llama")


@dataclass(frozen=True)
class Block:
    """One pattern of the body, applied to hidden states (B, D) or (B, T, D).

    Attributes:
        kind: One of ``BLOCK_KINDS``.
        heads: Attention heads (attention, encoder layer).
        batch_first: Layout (attention, encoder layer, recurrent).
        mask: ``None``, ``"causal"`` or ``"padding"`` (attention).
        need_weights: Whether attention also returns its weights (attention).
        norm: ``"layer"`` or ``"batch"`` (norm).
        cell: A ``RECURRENT_CELLS`` key (recurrent).
        bidirectional: Whether the layer runs both directions (recurrent).
        residual: Whether the block adds its input to the layer's output (recurrent).
        checkpointed: Whether the block runs under activation checkpointing (any kind; the
            ``"checkpoint"`` kind is a Linear and tanh that always does).
    """

    kind: str
    heads: int = 1
    batch_first: bool = True
    mask: str | None = None
    need_weights: bool = False
    norm: str = "layer"
    cell: str = "lstm"
    bidirectional: bool = False
    residual: bool = False
    checkpointed: bool = False


@dataclass(frozen=True)
class Blueprint:
    """A tiny model and its data, rebuilt identically by :func:`build`.

    Attributes:
        inputs: One of ``INPUTS``, or ``"hf-<name>"`` for a ``HF_MODELS`` model on tokens.
        likelihood: ``"classification"`` or ``"regression"``.
        width: Hidden width D.
        seq_len: Sequence length T (token and sequence inputs).
        n_points: Data points N.
        batch_size: Batch size of the loader (equal to T in some examples).
        positions: ``None``, ``"broadcast"`` (a (1, T) lookup) or ``"batchless"``
            (``wpe(arange(T))``).
        blocks: The body's patterns, in order.
        readout: ``"mean"``, ``"first"`` or ``"last"`` position of a sequence.
        head: ``"linear"``, ``"shared"`` (``head.weight = wte.weight``) or ``"bare"``
            (``h @ wte.weight.T``); tied heads have one output per token of the vocabulary.
        table: How else token inputs use the table: ``None``, ``"row"`` (its row 0 added
            to every lookup, read off the weight) or ``"twin"`` (a second ``nn.Embedding``
            holding the same weight looks up the reversed tokens).
        n_out: Outputs of a linear head.
        vocab: Vocabulary size of token inputs.
        dict_inputs: Whether a Hugging Face model takes its tokens in a dict.
        seed: Seed of the weights and the data.
    """

    inputs: str
    likelihood: str
    width: int
    seq_len: int
    n_points: int
    batch_size: int
    positions: str | None = None
    blocks: tuple[Block, ...] = ()
    readout: str = "mean"
    head: str = "linear"
    table: str | None = None
    n_out: int = 2
    vocab: int = 5
    dict_inputs: bool = False
    seed: int = 0

    @property
    def takes_dicts(self) -> bool:
        """Whether the model's inputs are ``{"input_ids": X}`` dicts."""
        return self.inputs == "dict" or self.dict_inputs

    @property
    def takes_tokens(self) -> bool:
        """Whether the inputs are token ids."""
        return self.inputs in ("tokens", "dict") or self.inputs.startswith("hf-")


# ----------------------------------------------------------------------------- patterns


class ReusedLinear(nn.Module):
    """The same Linear called twice: ``tanh(L(tanh(L(h))))``."""

    def __init__(self, width: int):
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, h):
        return torch.tanh(self.linear(torch.tanh(self.linear(h))))


class RawParameters(nn.Module):
    """A custom module whose bare ``nn.Parameter``\\ s scale and shift its Linear's output."""

    def __init__(self, width: int):
        super().__init__()
        self.proj = nn.Linear(width, width)
        self.scale = nn.Parameter(1.0 + 0.3 * torch.randn(width))
        self.shift = nn.Parameter(0.3 * torch.randn(width))

    def forward(self, h):
        return torch.tanh(self.proj(h) * self.scale + self.shift)


class Adapter(nn.Module):
    """An adapter reusing ``base.weight`` through ``F.linear`` beside the call of ``base``."""

    def __init__(self, width: int):
        super().__init__()
        self.base = nn.Linear(width, width)
        self.down = nn.Linear(width, width, bias=False)

    def forward(self, h):
        adapted = self.down(torch.tanh(F.linear(0.5 * h, self.base.weight)))
        return torch.tanh(self.base(h)) + adapted


class InPlace(nn.Module):
    """``add_`` of a residual to a Linear's output, then ``ReLU(inplace=True)`` on it."""

    def __init__(self, width: int):
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.relu = nn.ReLU(inplace=True)

    def forward(self, h):
        z = self.linear(h)
        return self.relu(z.add_(torch.tanh(h)))


class Norm(nn.Module):
    """LayerNorm, or BatchNorm1d in eval mode with drawn running statistics, over D."""

    def __init__(self, width: int, kind: str):
        super().__init__()
        self.norm = nn.LayerNorm(width) if kind == "layer" else nn.BatchNorm1d(width)
        with torch.no_grad():
            self.norm.weight.uniform_(0.5, 1.5)
            self.norm.bias.normal_(0.0, 0.3)
            if kind == "batch":
                self.norm.running_mean.normal_(0.0, 0.5)
                self.norm.running_var.uniform_(0.5, 2.0)

    def forward(self, h):
        if isinstance(self.norm, nn.BatchNorm1d) and h.ndim == 3:
            return self.norm(h.transpose(1, 2)).transpose(1, 2)
        return self.norm(h)


class Checkpointed(nn.Module):
    """A module run under ``checkpoint(..., use_reentrant=False)``: a backward pass runs its
    forward again (a Linear and tanh by default).

    ``torch.func`` transforms do not run through checkpointing: the oracle's copy of the model
    (:func:`without_checkpointing`) calls the same layers directly.
    """

    def __init__(self, width: int, inner: nn.Module | None = None):
        super().__init__()
        self.inner = nn.Sequential(nn.Linear(width, width), nn.Tanh()) if inner is None else inner
        self.checkpointing = True

    def forward(self, h):
        if self.checkpointing:
            return checkpoint(self.inner, h, use_reentrant=False)
        return self.inner(h)


def without_checkpointing(model: nn.Module) -> nn.Module:
    """A deep copy of ``model`` (same function, ties kept) whose blocks skip checkpointing."""
    copy = deepcopy(model)
    for module in copy.modules():
        if isinstance(module, Checkpointed):
            module.checkpointing = False
    return copy


class Attention(nn.Module):
    """``nn.MultiheadAttention`` on (B, T, D) with a residual, in the drawn layout and mask.

    The padding mask hides the positions (never the first) whose first feature exceeds the
    second: it depends on the data point only, not on its place in the batch.
    """

    def __init__(self, width: int, block: Block):
        super().__init__()
        self.block = block
        self.mha = nn.MultiheadAttention(width, block.heads, batch_first=block.batch_first)

    def forward(self, h):
        T = h.shape[1]
        options = {}
        if self.block.mask == "causal":
            options["attn_mask"] = torch.triu(torch.ones(T, T, dtype=torch.bool), 1)
        elif self.block.mask == "padding":
            padding = (h[..., 0] > h[..., 1]).detach()
            padding[:, 0] = False
            options["key_padding_mask"] = padding
        x = h if self.block.batch_first else h.transpose(0, 1)
        a, _ = self.mha(x, x, x, need_weights=self.block.need_weights, **options)
        return h + (a if self.block.batch_first else a.transpose(0, 1))


class EncoderLayer(nn.Module):
    """``nn.TransformerEncoderLayer`` (dropout 0) on (B, T, D) in the drawn layout."""

    def __init__(self, width: int, block: Block):
        super().__init__()
        self.batch_first = block.batch_first
        self.layer = nn.TransformerEncoderLayer(
            width, block.heads, dim_feedforward=3, dropout=0.0, batch_first=block.batch_first
        )

    def forward(self, h):
        if self.batch_first:
            return self.layer(h)
        return self.layer(h.transpose(0, 1)).transpose(0, 1)


class Recurrent(nn.Module):
    """A recurrent layer on (B, T, D) in the drawn layout, its directions summed back to D.

    With ``residual`` the block returns ``h +`` the layer's output: the earlier layers then
    reach the output around the layer as well as through it.
    """

    def __init__(self, width: int, block: Block):
        super().__init__()
        self.block = block
        self.rnn = RECURRENT_CELLS[block.cell](
            width, width, batch_first=block.batch_first, bidirectional=block.bidirectional
        )

    def forward(self, h):
        out, _ = self.rnn(h if self.block.batch_first else h.transpose(0, 1))
        out = out if self.block.batch_first else out.transpose(0, 1)
        if self.block.bidirectional:
            out = out[..., : h.shape[-1]] + out[..., h.shape[-1] :]
        return h + out if self.block.residual else out


def block_module(block: Block, width: int) -> nn.Module:
    """The module of ``block`` on hidden states of width ``width``."""
    simple = {
        "reuse": ReusedLinear,
        "raw-parameters": RawParameters,
        "adapter": Adapter,
        "in-place": InPlace,
        "checkpoint": Checkpointed,
    }
    if block.kind in simple:
        module = simple[block.kind](width)
    elif block.kind == "norm":
        module = Norm(width, block.norm)
    elif block.kind == "attention":
        module = Attention(width, block)
    elif block.kind == "recurrent":
        module = Recurrent(width, block)
    else:
        module = EncoderLayer(width, block)
    return Checkpointed(width, module) if block.checkpointed else module


class Composed(nn.Module):
    """Input stage → blocks → readout → head, as a :class:`Blueprint` describes."""

    def __init__(self, blueprint: Blueprint, n_features: int = 3):
        super().__init__()
        self.blueprint = blueprint
        D = blueprint.width
        if blueprint.takes_tokens:
            self.wte = nn.Embedding(blueprint.vocab, D)
            if blueprint.table == "twin":
                self.twin = nn.Embedding(blueprint.vocab, D)
                self.twin.weight = self.wte.weight
        else:
            self.inp = nn.Linear(n_features, D)
        if blueprint.positions is not None:
            self.wpe = nn.Embedding(blueprint.seq_len, D)
        self.blocks = nn.ModuleList(block_module(b, D) for b in blueprint.blocks)
        if blueprint.head == "linear":
            self.head = nn.Linear(D, blueprint.n_out)
        elif blueprint.head == "shared":
            self.head = nn.Linear(D, blueprint.vocab, bias=False)
            self.head.weight = self.wte.weight

    def forward(self, inputs):
        blueprint = self.blueprint
        x = inputs["input_ids"] if isinstance(inputs, dict) else inputs
        h = self.wte(x) if blueprint.takes_tokens else self.inp(x)
        if blueprint.table == "row":
            h = h + self.wte.weight[0]
        elif blueprint.table == "twin":
            h = h * self.twin(x.flip(1))
        if blueprint.positions is not None:
            positions = torch.arange(x.shape[1], device=x.device)
            if blueprint.positions == "broadcast":
                positions = positions[None]
            h = h + self.wpe(positions)
        for block in self.blocks:
            h = block(h)
        if h.ndim == 3:
            h = {"mean": h.mean(1), "first": h[:, 0], "last": h[:, -1]}[blueprint.readout]
        h = torch.tanh(h)
        if blueprint.head == "bare":
            return h @ self.wte.weight.T
        return self.head(h)


class HuggingFaceClassifier(nn.Module):
    """A tiny Hugging Face model giving (B, C) logits: the last token's (GPT-2, Llama) or the
    sequence classifier's (BERT)."""

    def __init__(self, blueprint: Blueprint):
        super().__init__()
        self.model = hugging_face_model(blueprint)
        self.last_token = not blueprint.inputs.endswith("bert")

    def forward(self, inputs):
        tokens = inputs["input_ids"] if isinstance(inputs, dict) else inputs
        logits = self.model(input_ids=tokens).logits
        return logits[:, -1] if self.last_token else logits


def hugging_face_model(blueprint: Blueprint) -> nn.Module:
    """GPT-2 (tied LM head), BERT (sequence classifier) or Llama from a tiny config."""
    import transformers

    name = blueprint.inputs.removeprefix("hf-")
    common = {"vocab_size": blueprint.vocab, "attn_implementation": "eager"}
    if name == "gpt2":
        config = transformers.GPT2Config(
            n_layer=1, n_head=2, n_embd=blueprint.width, n_positions=8, n_inner=4, **common
        )
        return transformers.GPT2LMHeadModel(config)
    if name == "bert":
        config = transformers.BertConfig(
            hidden_size=blueprint.width,
            num_hidden_layers=1,
            num_attention_heads=2,
            intermediate_size=4,
            max_position_embeddings=8,
            type_vocab_size=1,
            num_labels=blueprint.n_out,
            **common,
        )
        return transformers.BertForSequenceClassification(config)
    config = transformers.LlamaConfig(
        hidden_size=blueprint.width,
        intermediate_size=4,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=8,
        tie_word_embeddings=blueprint.head == "shared",
        **common,
    )
    return transformers.LlamaForCausalLM(config)


# ------------------------------------------------------------------------------ examples


@dataclass
class Example:
    """A built blueprint: the model (float64, eval mode), its inputs and targets.

    Attributes:
        blueprint: What was built.
        model: The model.
        X: Inputs as the model takes them (a ``{"input_ids": X}`` dict for dict inputs).
        y: Targets: classes (N,) or regression targets (N, C).
        loader: Batches of ``blueprint.batch_size``, dicts for dict inputs.
        head_name: The name of the last layer (an ``nn.Linear``) when the model ends in one
            whose parameters only it uses, else None.
    """

    blueprint: Blueprint
    model: nn.Module
    X: torch.Tensor | dict[str, torch.Tensor]
    y: torch.Tensor
    loader: DataLoader
    head_name: str | None

    @property
    def n_parameters(self) -> int:
        """Trainable parameters (a tied weight counted once)."""
        return sum(p.numel() for p in self.model.parameters())


def build(blueprint: Blueprint) -> Example:
    """The model and data of ``blueprint``, identical on every call."""
    torch.manual_seed(blueprint.seed)
    if blueprint.inputs.startswith("hf-"):
        model = HuggingFaceClassifier(blueprint)
    else:
        model = Composed(blueprint)
    model = model.double().eval()
    generator = torch.Generator().manual_seed(blueprint.seed + 1)
    N, T = blueprint.n_points, blueprint.seq_len
    if blueprint.takes_tokens:
        inputs = torch.randint(0, blueprint.vocab, (N, T), generator=generator)
    else:
        shape = (N, T, 3) if blueprint.inputs == "sequence" else (N, 3)
        inputs = torch.randn(shape, generator=generator, dtype=torch.float64)
    with torch.no_grad():
        n_out = model({"input_ids": inputs} if blueprint.takes_dicts else inputs).shape[-1]
    if blueprint.likelihood == "classification":
        y = torch.randint(0, n_out, (N,), generator=generator)
    else:
        y = torch.randn(N, n_out, generator=generator, dtype=torch.float64)
    if blueprint.takes_dicts:
        dataset, X = DictDataset(inputs, y), {"input_ids": inputs}
    else:
        dataset, X = TensorDataset(inputs, y), inputs
    head_name = {"linear": "head", "hf-bert": "model.classifier"}.get(
        blueprint.inputs if blueprint.inputs.startswith("hf-") else blueprint.head
    )
    loader = DataLoader(dataset, batch_size=blueprint.batch_size)
    return Example(blueprint, model, X, y, loader, head_name)


# ---------------------------------------------------------------------------- strategies


@st.composite
def blocks(draw, width: int, sequence: bool) -> Block:
    """One pattern of the body for hidden states of width ``width`` (options it reads only)."""
    kind = draw(st.sampled_from(BLOCK_KINDS if sequence else POINTWISE_BLOCKS))
    checkpointed = kind != "checkpoint" and draw(st.sampled_from([False, False, False, True]))
    if kind == "norm":
        norm = draw(st.sampled_from(["layer", "batch"]))
        return Block(kind, norm=norm, checkpointed=checkpointed)
    if kind not in SEQUENCE_BLOCKS:
        return Block(kind, checkpointed=checkpointed)
    if kind == "recurrent":
        return Block(
            kind,
            checkpointed=checkpointed,
            batch_first=draw(st.booleans()),
            cell=draw(st.sampled_from(sorted(RECURRENT_CELLS))),
            bidirectional=draw(st.booleans()),
            residual=draw(st.booleans()),
        )
    heads = draw(st.sampled_from([h for h in (1, 2) if width % h == 0]))
    if kind == "encoder-layer":
        batch_first = draw(st.booleans())
        return Block(kind, heads=heads, batch_first=batch_first, checkpointed=checkpointed)
    return Block(
        kind,
        checkpointed=checkpointed,
        heads=heads,
        batch_first=draw(st.booleans()),
        mask=draw(st.sampled_from([None, "causal", "padding"])),
        need_weights=draw(st.booleans()),
    )


@st.composite
def blueprints(draw, hugging_face: bool = True) -> Blueprint:
    """A random :class:`Blueprint` of at most ``MAX_PARAMETERS`` parameters.

    Args:
        draw: Hypothesis's draw.
        hugging_face: Whether tiny Hugging Face models may be drawn (when ``transformers``
            imports).
    """
    kinds = list(INPUTS)
    if hugging_face and transformers_available():
        kinds += [f"hf-{name}" for name in HF_MODELS]
    inputs = draw(st.sampled_from(kinds))
    likelihood = draw(st.sampled_from(["classification", "classification", "regression"]))
    seq_len = draw(st.integers(2, 5))
    n_points = draw(st.integers(2, 7))
    same_as_sequence = st.just(seq_len) if seq_len <= n_points else st.nothing()
    batch_size = draw(st.one_of(same_as_sequence, st.integers(1, n_points)))
    common = {
        "likelihood": likelihood,
        "seq_len": seq_len,
        "n_points": n_points,
        "batch_size": batch_size,
        "n_out": draw(st.integers(1 if likelihood == "regression" else 2, 3)),
        "vocab": draw(st.integers(3, 5)),
        "seed": draw(st.integers(0, 2**16)),
    }
    if inputs.startswith("hf-"):
        name = inputs.removeprefix("hf-")
        tied = {"gpt2": st.just("shared"), "bert": st.just("linear")}
        return Blueprint(
            inputs,
            width=4,
            head=draw(tied.get(name, st.sampled_from(["linear", "shared"]))),
            dict_inputs=draw(st.booleans()),
            **common,
        )
    width = draw(st.integers(2, 5))
    sequence = inputs != "vector"
    tokens = inputs in ("tokens", "dict")
    body = draw(st.lists(blocks(width, sequence), min_size=1, max_size=3))
    blueprint = Blueprint(
        inputs,
        width=width,
        positions=draw(st.sampled_from([None, "broadcast", "batchless"])) if sequence else None,
        blocks=tuple(body),
        readout=draw(st.sampled_from(["mean", "first", "last"])),
        head=draw(st.sampled_from(["linear", "shared", "bare"] if tokens else ["linear"])),
        table=draw(st.sampled_from([None, None, "row", "twin"])) if tokens else None,
        **common,
    )
    while len(blueprint.blocks) > 1 and n_parameters(blueprint) > MAX_PARAMETERS:
        blueprint = replace(blueprint, blocks=blueprint.blocks[:-1])
    return blueprint


def n_parameters(blueprint: Blueprint) -> int:
    """Trainable parameters of the model of ``blueprint`` (without building its data)."""
    model = Composed(blueprint)
    return sum(p.numel() for p in model.parameters())


def transformers_available() -> bool:
    """Whether ``transformers`` imports."""
    try:
        import transformers  # noqa: F401
    except ImportError:
        return False
    return True
