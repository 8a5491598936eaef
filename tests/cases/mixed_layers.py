"""A network that mixes every kind of KFAC block, its token data and its fit.

``MixedNet`` runs tokens (B, T) through an embedding (a diagonal token-count factor),
LayerNorm, transformers' ``Conv1D`` (``A ⊗ G``), a module without any rule, BatchNorm,
GroupNorm, RMSNorm and a Linear head, so one :class:`KronLaplace` holds Kronecker blocks,
blocks with a diagonal factor and exact blocks. The KFAC engine's tests, the Kronecker and
diagonal structures' tests and EKFAC's tests fit it.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from laplace import KronLaplace

VOCAB, PAD = 7, 0


def _conv1d() -> type[nn.Module]:
    """transformers' ``Conv1D``; a test that builds a ``MixedNet`` skips without transformers."""
    return pytest.importorskip("transformers.pytorch_utils").Conv1D


class Scale(nn.Module):
    """A module without any rule: its parameter takes the ``torch.func`` fallback."""

    def __init__(self, n: int):
        super().__init__()
        self.weight = nn.Parameter(1 + 0.3 * torch.randn(n))

    def forward(self, x):
        return x * self.weight


class MixedNet(nn.Module):
    """Tokens (B, T) → embedding, LayerNorm, Conv1D, Scale, BatchNorm, GroupNorm, RMSNorm, head."""

    def __init__(self, dim: int = 4, hidden: int = 5, n_out: int = 3):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim, padding_idx=PAD)
        self.norm = nn.LayerNorm(dim)
        self.proj = _conv1d()(hidden, dim)
        self.scale = Scale(hidden)
        self.batch_norm = nn.BatchNorm1d(hidden)
        self.group_norm = nn.GroupNorm(1, hidden)
        self.rms = nn.RMSNorm(hidden)
        self.head = nn.Linear(hidden, n_out)

    def forward(self, tokens):
        h = torch.tanh(self.proj(self.norm(self.embed(tokens))))
        h = self.group_norm(self.batch_norm(self.scale(h).transpose(1, 2))).transpose(1, 2)
        return self.head(self.rms(h).mean(1))


def mixed_net(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    model = MixedNet().double().eval()
    with torch.no_grad():
        for module in (model.norm, model.batch_norm, model.group_norm, model.rms):
            for p in module.parameters():
                p.add_(0.5 * torch.randn_like(p))
        model.proj.weight.normal_(0, 0.5)
        model.proj.bias.normal_(0, 0.2)
        model.batch_norm.running_mean.normal_(0, 0.3)
        model.batch_norm.running_var.uniform_(0.5, 1.5)
    return model


def tokens(n: int, T: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    X = torch.randint(0, VOCAB, (n, T), generator=gen)
    return X, torch.randint(0, 3, (n,), generator=gen)


def loader(X, y, batch_size: int = 4) -> DataLoader:
    return DataLoader(TensorDataset(X, y), batch_size=batch_size)


def oracle_blocks(model: nn.Module, matrix: torch.Tensor) -> list[torch.Tensor]:
    sizes = [p.numel() for p in model.parameters()]
    starts = [0, *torch.tensor(sizes).cumsum(0).tolist()]
    return [matrix[a:b, a:b] for a, b in itertools.pairwise(starts)]


def fitted(model, X, y, likelihood="classification", **kwargs) -> KronLaplace:
    la = KronLaplace(model, likelihood, **kwargs)
    la.fit(loader(X, y))
    return la
