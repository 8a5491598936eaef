"""Models that break a per-module view of curvature, with float64 data for each.

Three patterns where reading curvature from module calls goes wrong without a guard
(``laplace.curvature.engine.guard``):

- ``nn.MultiheadAttention``: its ``out_proj`` is a ``Linear`` the module never calls (the weight
  goes into ``F.multi_head_attention_forward``), batch-first or sequence-first, with masks, in
  ``nn.TransformerEncoderLayer`` / ``DecoderLayer`` and a small ViT built from modules;
- a parameter used outside its module: a head tied as ``h @ wte.weight.T``, an adapter calling
  ``F.linear(h, base.weight)``;
- a table looked up without a batch dimension, ``wpe(arange(T))``, with T equal to the batch
  size or not.

Plain torch only: the same file builds the models in a throwaway laplace-torch 0.3 venv, for
the numbers written into ``reliability/test_guard_reference.py``.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

VOCAB, WIDTH, N_CLASSES = 5, 4, 3


class Attention(nn.Module):
    """Inputs (B, T, 3) → Linear → tanh → MultiheadAttention → mean over T → Linear."""

    def __init__(self, batch_first: bool = True, mask: str | None = None, kdim: int | None = None):
        super().__init__()
        self.batch_first, self.mask = batch_first, mask
        self.inp = nn.Linear(3, WIDTH)
        self.mha = nn.MultiheadAttention(WIDTH, 2, batch_first=batch_first, kdim=kdim, vdim=kdim)
        self.keys = nn.Linear(3, kdim) if kdim else None
        self.head = nn.Linear(WIDTH, N_CLASSES)

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        kv = torch.tanh(self.keys(x)) if self.keys is not None else h
        T = x.shape[1]
        options = {}
        if self.mask == "causal":
            options["attn_mask"] = torch.triu(torch.ones(T, T, dtype=torch.bool), 1)
        elif self.mask == "padding":
            padding = torch.zeros(x.shape[0], T, dtype=torch.bool)
            padding[::2, -1] = True
            options["key_padding_mask"] = padding
        if not self.batch_first:
            h, kv = h.transpose(0, 1), kv.transpose(0, 1)
        a, _ = self.mha(h, kv, kv, need_weights=self.mask is None, **options)
        if not self.batch_first:
            a = a.transpose(0, 1)
        return self.head(a.mean(1))


class EncoderClassifier(nn.Module):
    """Inputs (B, T, 3) → Linear → ``nn.TransformerEncoderLayer`` → mean → Linear."""

    def __init__(self, batch_first: bool = True):
        super().__init__()
        self.batch_first = batch_first
        self.inp = nn.Linear(3, WIDTH)
        self.layer = nn.TransformerEncoderLayer(
            WIDTH, 2, dim_feedforward=6, dropout=0.0, batch_first=batch_first
        )
        self.head = nn.Linear(WIDTH, N_CLASSES)

    def forward(self, x):
        h = self.inp(x)
        if not self.batch_first:
            h = h.transpose(0, 1)
        h = self.layer(h)
        if not self.batch_first:
            h = h.transpose(0, 1)
        return self.head(h.mean(1))


class DecoderClassifier(nn.Module):
    """Inputs (B, T, 3): the first half of T decodes against the second (a decoder layer)."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(3, WIDTH)
        self.layer = nn.TransformerDecoderLayer(
            WIDTH, 2, dim_feedforward=6, dropout=0.0, batch_first=True
        )
        self.head = nn.Linear(WIDTH, N_CLASSES)

    def forward(self, x):
        h = self.inp(x)
        half = h.shape[1] // 2
        return self.head(self.layer(h[:, :half], h[:, half:]).mean(1))


class TinyViT(nn.Module):
    """A torchvision-style ViT from modules: patches, class token, position table, encoder."""

    def __init__(self):
        super().__init__()
        self.patch = nn.Conv2d(1, WIDTH, kernel_size=2, stride=2)
        self.class_token = nn.Parameter(torch.randn(1, 1, WIDTH) * 0.1)
        self.position = nn.Parameter(torch.randn(1, 5, WIDTH) * 0.1)
        self.encoder = nn.TransformerEncoderLayer(
            WIDTH, 2, dim_feedforward=6, dropout=0.0, batch_first=True, norm_first=True
        )
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, N_CLASSES)

    def forward(self, x):
        tokens = self.patch(x).flatten(2).transpose(1, 2)  # (B, 4, WIDTH)
        tokens = torch.cat([self.class_token.expand(len(x), -1, -1), tokens], 1) + self.position
        return self.head(self.norm(self.encoder(tokens))[:, 0])


class TiedHead(nn.Module):
    """Tokens (B, T) → Embedding → Linear → tanh → mean; logits ``h @ wte.weight.T`` (V)."""

    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(VOCAB, WIDTH)
        self.mix = nn.Linear(WIDTH, WIDTH)

    def forward(self, tokens):
        h = torch.tanh(self.mix(self.wte(tokens))).mean(1)
        return h @ self.wte.weight.T


class Adapter(nn.Module):
    """An adapter reusing a base layer's weight through ``F.linear`` beside the base's call."""

    def __init__(self):
        super().__init__()
        self.base = nn.Linear(3, WIDTH)
        self.down = nn.Linear(WIDTH, 2, bias=False)
        self.head = nn.Linear(WIDTH + 2, N_CLASSES)

    def forward(self, x):
        h = torch.tanh(self.base(x))
        adapted = self.down(torch.tanh(F.linear(x * 0.5, self.base.weight)))
        return self.head(torch.cat([h, adapted], -1))


class PositionTable(nn.Module):
    """Tokens (B, T) → ``wte(tokens) + wpe(arange(T))`` (no batch dim) → tanh → mean → Linear."""

    def __init__(self, max_len: int = 8):
        super().__init__()
        self.wte = nn.Embedding(VOCAB, WIDTH)
        self.wpe = nn.Embedding(max_len, WIDTH)
        self.head = nn.Linear(WIDTH, N_CLASSES)

    def forward(self, tokens):
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        return self.head(torch.tanh(self.wte(tokens) + self.wpe(positions)).mean(1))


class BatchedPositionTable(PositionTable):
    """``PositionTable`` with the positions given one row per data point (the KFAC reference)."""

    def forward(self, tokens):
        positions = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
        return self.head(torch.tanh(self.wte(tokens) + self.wpe(positions)).mean(1))


class TableRowRead(nn.Module):
    """Tokens (B, T) → Embedding → tanh → mean → Linear, plus the table's row 0 read directly
    as a bias of the lookups (a use no lookup shows)."""

    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(VOCAB, WIDTH)
        self.head = nn.Linear(WIDTH, N_CLASSES)

    def forward(self, tokens):
        return self.head(torch.tanh(self.wte(tokens) + self.wte.weight[0]).mean(1))


class SharedTables(nn.Module):
    """Two ``nn.Embedding`` modules holding one weight (tied encoder and decoder tables), each
    looking up its own tokens, the second's output scaled in place."""

    def __init__(self):
        super().__init__()
        self.encoder = nn.Embedding(VOCAB, WIDTH)
        self.decoder = nn.Embedding(VOCAB, WIDTH)
        self.decoder.weight = self.encoder.weight
        self.head = nn.Linear(WIDTH, N_CLASSES)

    def forward(self, tokens):
        decoded = self.decoder(tokens.flip(1))
        decoded.mul_(0.5)
        return self.head(torch.tanh(self.encoder(tokens) * decoded).mean(1))


def _tokens(n: int, seq: int, generator: torch.Generator) -> torch.Tensor:
    return torch.randint(0, VOCAB, (n, seq), generator=generator)


#: name → (model builder, input builder (n, generator) → X, number of classes).
PATTERNS = {
    "mha-batch-first": (lambda: Attention(True), lambda n, g: torch.randn(n, 4, 3, generator=g)),
    "mha-sequence-first": (
        lambda: Attention(False),
        lambda n, g: torch.randn(n, 4, 3, generator=g),
    ),
    "mha-causal-mask": (
        lambda: Attention(True, "causal"),
        lambda n, g: torch.randn(n, 4, 3, generator=g),
    ),
    "mha-padding-mask": (
        lambda: Attention(True, "padding"),
        lambda n, g: torch.randn(n, 4, 3, generator=g),
    ),
    "mha-kdim": (
        lambda: Attention(True, kdim=3),
        lambda n, g: torch.randn(n, 4, 3, generator=g),
    ),
    "encoder-layer": (EncoderClassifier, lambda n, g: torch.randn(n, 4, 3, generator=g)),
    "encoder-layer-sequence-first": (
        lambda: EncoderClassifier(False),
        lambda n, g: torch.randn(n, 4, 3, generator=g),
    ),
    "encoder-layer-sequence-first-T-not-B": (
        lambda: EncoderClassifier(False),
        lambda n, g: torch.randn(n, n + 1, 3, generator=g),
    ),
    "decoder-layer": (DecoderClassifier, lambda n, g: torch.randn(n, 4, 3, generator=g)),
    "vit": (TinyViT, lambda n, g: torch.randn(n, 1, 4, 4, generator=g)),
    "tied-head": (TiedHead, lambda n, g: _tokens(n, 3, g)),
    "adapter": (Adapter, lambda n, g: torch.randn(n, 3, generator=g)),
    "position-table-T-equals-B": (PositionTable, lambda n, g: _tokens(n, n, g)),
    "position-table-T-not-B": (PositionTable, lambda n, g: _tokens(n, 3, g)),
    "table-row-read": (TableRowRead, lambda n, g: _tokens(n, 3, g)),
    "shared-tables": (SharedTables, lambda n, g: _tokens(n, 3, g)),
}


def build(name: str, n: int = 4, seed: int = 0) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """The model of pattern ``name`` (float64, eval mode) with inputs and class targets."""
    make_model, make_inputs = PATTERNS[name]
    torch.manual_seed(seed)
    model = make_model().double().eval()
    generator = torch.Generator().manual_seed(seed + 1)
    X = make_inputs(n, generator)
    X = X.double() if X.is_floating_point() else X
    n_classes = VOCAB if name == "tied-head" else N_CLASSES
    y = torch.randint(0, n_classes, (n,), generator=generator)
    return model, X, y
