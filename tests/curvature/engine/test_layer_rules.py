"""The per-layer rules of the native per-sample engine beyond Linear/Conv2d, against the oracle.

Covers the generic ``torch.func`` fallback (LayerNorm, Embedding, a raw parameter, a parameter
on the root module), weight sharing, sequence inputs, the other convolution variants, and models
whose layers do not see the data points along their first dimension (batched-backward fallback).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from conftest import Oracle, assert_close
from laplace.curvature import CurvlinopsEF, CurvlinopsGGN
from laplace.curvature.engine import layer_rules
from laplace.curvature.engine.block_product import BlockSum, ParameterBlock, SampleVectors


class _Scale(nn.Module):
    """A custom module with a raw parameter used in its forward."""

    def __init__(self, dim: int):
        super().__init__()
        self.log_scale = nn.Parameter(torch.linspace(-0.5, 0.5, dim))

    def forward(self, x):
        return x * self.log_scale.exp()


class _Shared(nn.Module):
    """A Linear called twice, plus a parameter owned by the root module."""

    def __init__(self):
        super().__init__()
        self.inner = nn.Linear(4, 4)
        self.head = nn.Linear(4, 3)
        self.offset = nn.Parameter(torch.tensor([0.1, -0.2, 0.3]))

    def forward(self, x):
        h = torch.tanh(self.inner(x))
        return self.head(torch.tanh(self.inner(h))) + self.offset


class _Tied(nn.Module):
    """Two Linear modules sharing one weight tensor."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4, bias=False)
        self.b.weight = self.a.weight
        self.out = nn.Linear(4, 2)

    def forward(self, x):
        return self.out(torch.tanh(self.b(torch.tanh(self.a(x)))))


class _Sequence(nn.Module):
    """Embedding, Linear on (B, T, D), LayerNorm, mean pooling."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(7, 4)
        self.mix = nn.Linear(4, 5)
        self.norm = nn.LayerNorm(5)
        self.out = nn.Linear(5, 3)

    def forward(self, tokens):
        h = self.norm(torch.tanh(self.mix(self.embed(tokens))))
        return self.out(h.mean(1))


class _PairScorer(nn.Module):
    """A reward model: scores (B, 2, D) pairs as 2B rows, so layers never see B rows."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))

    def forward(self, x):
        return self.net(x.reshape(-1, x.shape[-1])).reshape(x.shape[0], -1)


class _SequenceFirstAttention(nn.Module):
    """Self-attention run sequence-first (T, B, D), as nn.MultiheadAttention defaults to."""

    def __init__(self):
        super().__init__()
        self.attn = nn.MultiheadAttention(4, 2)
        self.out = nn.Linear(4, 2)

    def forward(self, x):
        h = x.transpose(0, 1)
        h, _ = self.attn(h, h, h, need_weights=False)
        return self.out(h.mean(0))


def _mlp_with_custom():
    return nn.Sequential(nn.Linear(3, 4), _Scale(4), nn.Tanh(), nn.Linear(4, 2))


def _convs():
    return nn.Sequential(
        nn.Conv1d(2, 4, 3, padding=2, dilation=2, padding_mode="reflect", groups=2),
        nn.Tanh(),
        nn.Conv1d(4, 3, 2, stride=2, bias=False),
        nn.Flatten(),
        nn.Linear(12, 2),
    )


def _conv3d():
    return nn.Sequential(
        nn.Conv3d(1, 2, 2, stride=(1, 2, 1), padding=1), nn.Flatten(), nn.LazyLinear(2)
    )


MODELS = {
    "custom_param": (_mlp_with_custom, lambda g: torch.randn(8, 3, generator=g)),
    "shared_and_root": (_Shared, lambda g: torch.randn(8, 4, generator=g)),
    "tied_weights": (_Tied, lambda g: torch.randn(8, 4, generator=g)),
    "sequence": (_Sequence, lambda g: torch.randint(0, 7, (8, 5), generator=g)),
    "conv1d_grouped": (_convs, lambda g: torch.randn(8, 2, 9, generator=g)),
    "conv3d": (_conv3d, lambda g: torch.randn(8, 1, 3, 4, 3, generator=g)),
    "batch_folded_rows": (_PairScorer, lambda g: torch.randn(8, 2, 3, generator=g)),
    "sequence_first": (_SequenceFirstAttention, lambda g: torch.randn(8, 5, 4, generator=g)),
}


@pytest.fixture(params=list(MODELS), ids=list(MODELS))
def model_and_inputs(request):
    build, inputs = MODELS[request.param]
    torch.manual_seed(0)
    X = inputs(torch.Generator().manual_seed(1))
    model = build()
    model(X if X.dtype == torch.long else X.float())  # materialise lazy modules
    model = model.double()
    return model, X if X.dtype == torch.long else X.double()


@pytest.mark.filterwarnings("ignore:There is a performance drop:UserWarning")
@pytest.mark.parametrize("likelihood", ["regression", "classification"])
def test_engine_matches_oracle(model_and_inputs, likelihood):
    model, X = model_and_inputs
    oracle = Oracle(model, likelihood)
    n_out = model(X).shape[-1]
    y = torch.randn(len(X), n_out, dtype=torch.float64)
    if likelihood == "classification":
        y = torch.arange(len(X)) % n_out
    ggn = CurvlinopsGGN(model, likelihood)
    expected = oracle.ggn(X)
    assert_close(ggn.full(X, y)[1], expected)
    assert_close(ggn.diag(X, y)[1], expected.diagonal())
    assert_close(ggn.jacobians(X)[0], oracle.jacobian(X))
    assert_close(ggn.gradients(X, y)[0], oracle.per_sample_gradients(X, y))
    ef = CurvlinopsEF(model, likelihood)
    assert_close(ef.diag(X, y)[1], oracle.ef(X, y).diagonal())
    for module in model.modules():
        assert not module._forward_hooks


@pytest.mark.filterwarnings("ignore:There is a performance drop:UserWarning")
def test_block_products_match_oracle(model_and_inputs):
    """``G V`` and ``Gᵀ W`` of the per-sample vectors ``Jₙᵀ vₙₖ`` against the dense Jacobian."""
    model, X = model_and_inputs
    oracle = Oracle(model, "regression")
    J = oracle.jacobian(X)  # (B, C, P)
    gen = torch.Generator().manual_seed(2)
    columns = torch.randn(3, *J.shape[:2], generator=gen, dtype=torch.float64)
    G = torch.einsum("bcp,kbc->kbp", J, columns)
    V = torch.randn(J.shape[-1], 4, generator=gen, dtype=torch.float64)
    W = torch.randn(3, J.shape[0], 4, generator=gen, dtype=torch.float64)
    trace = CurvlinopsGGN(model, "regression").trace(X)
    vectors = SampleVectors(trace, columns)
    assert_close(vectors.project(ParameterBlock(trace.engine, V)), G @ V)
    total = BlockSum(trace.engine, 4, V)
    vectors.backproject(W, total)
    vectors.backproject(2 * W, total)  # accumulates over calls
    assert_close(total.result(), 3 * torch.einsum("kbp,kbm->pm", G, W))


@pytest.mark.filterwarnings("ignore:There is a performance drop:UserWarning")
@pytest.mark.parametrize("gather_cost", [0, layer_rules.GATHER_COST], ids=["gather", "default"])
def test_subnetwork_rows_match_oracle(model_and_inputs, gather_cost, monkeypatch):
    """Per-sample gradients of chosen entries only (gathers, or the layer's then selected)."""
    monkeypatch.setattr(layer_rules, "GATHER_COST", gather_cost)
    model, X = model_and_inputs
    oracle = Oracle(model, "classification")
    n_params = len(oracle.theta)
    idx = torch.randperm(n_params, generator=torch.Generator().manual_seed(3))[: n_params // 3]
    y = torch.arange(len(X)) % model(X).shape[-1]
    ggn = CurvlinopsGGN(model, "classification", subnetwork_indices=idx)
    assert_close(ggn.jacobians(X)[0], oracle.jacobian(X)[:, :, idx])
    expected = oracle.ggn(X)[idx][:, idx]
    assert_close(ggn.full(X, y)[1], expected)
    assert_close(ggn.diag(X, y)[1], expected.diagonal())
