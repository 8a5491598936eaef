"""The KFAC rule tables: attention's grouped rules, and the plan of large layers' blocks.

The documented definition (``GROUPED_KFAC_RULES``): the input projection is a Linear map
applied once per distinct input among query, key and value, the output projection a Linear
map over the attention output. ``LinearAttention`` computes the same function with
``nn.Linear`` layers called exactly so, whose blocks are the Linear rule's (tested against
oracles in ``parametric/test_kron_laplace.py``): the attention layer's blocks, EKFAC's
eigenvalues and the Kron posterior's GLM variances must equal the copy's.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from conftest import assert_close
from laplace import Laplace
from laplace.curvature import CurvlinopsEF
from laplace.curvature.engine.kfac_rules import plan_blocks
from laplace.structures.jacobians import LayerTrace

pytestmark = pytest.mark.oracle


#: Both sides form the same products in float64; only their order may differ.
RTOL = 1e-10


ATOL = 1e-12


WIDTH, HEADS, N_CLASSES = 4, 2, 3


class LinearAttention(nn.Module):
    """``nn.MultiheadAttention``'s function with its projections as ``nn.Linear`` layers.

    The packed input projection is called once per distinct input tensor (by identity) and
    each projection takes its part of the outputs; separate projections (kdim, vdim ≠ E) are
    three Linears with the packed bias's thirds.
    """

    def __init__(self, mha: nn.MultiheadAttention):
        super().__init__()
        E = self.embed_dim = mha.embed_dim
        self.heads, self.batch_first = mha.num_heads, mha.batch_first
        self.packed = mha._qkv_same_embed_dim
        biases = mha.in_proj_bias.detach().chunk(3)
        if self.packed:
            self.in_proj = nn.Linear(E, 3 * E).to(mha.in_proj_weight)
            self.in_proj.weight.data.copy_(mha.in_proj_weight.detach())
            self.in_proj.bias.data.copy_(mha.in_proj_bias.detach())
        else:
            self.projections = nn.ModuleList()
            for name, bias in zip(("q_proj_weight", "k_proj_weight", "v_proj_weight"), biases):
                weight = getattr(mha, name).detach()
                linear = nn.Linear(weight.shape[1], E).to(weight)
                linear.weight.data.copy_(weight)
                linear.bias.data.copy_(bias)
                self.projections.append(linear)
        self.out_proj = nn.Linear(E, E).to(mha.out_proj.weight)
        self.out_proj.load_state_dict(mha.out_proj.state_dict())

    def _project(self, inputs):
        if not self.packed:
            return [linear(x) for linear, x in zip(self.projections, inputs)]
        E, done, out = self.embed_dim, [], []
        for i, x in enumerate(inputs):
            projected = next((y for seen, y in done if seen is x), None)
            if projected is None:
                projected = self.in_proj(x)
                done.append((x, projected))
            out.append(projected[..., i * E : (i + 1) * E])
        return out

    def forward(self, query, key, value, need_weights=True, attn_mask=None, key_padding_mask=None):
        inputs = [query, key, value]
        if not self.batch_first:
            inputs = [x.transpose(0, 1) for x in inputs]
            if key is query:
                inputs[1] = inputs[0]
            if value is key:
                inputs[2] = inputs[1]
        q, k, v = (
            p.unflatten(-1, (self.heads, -1)).transpose(1, 2) for p in self._project(inputs)
        )
        scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
        if attn_mask is not None:
            scores = scores.masked_fill(attn_mask, float("-inf"))
        if key_padding_mask is not None:
            scores = scores.masked_fill(key_padding_mask[:, None, None, :], float("-inf"))
        a = (scores.softmax(-1) @ v).transpose(1, 2).flatten(2)
        out = self.out_proj(a)
        return (out if self.batch_first else out.transpose(0, 1)), None


class AttentionModel(nn.Module):
    """Inputs (B, T, 3) → Linears → attention over ``uses`` → mean → Linear.

    ``uses``: "self" (query = key = value), "decoder" (the first two positions attend to the
    other three, key = value), "distinct" (three different inputs), "kdim" (key and value of
    other widths: separate projection weights).
    """

    def __init__(self, uses: str, batch_first: bool = True, mask: str | None = None):
        super().__init__()
        self.uses, self.batch_first, self.mask = uses, batch_first, mask
        kdim = 5 if uses == "kdim" else None
        self.inp = nn.Linear(3, WIDTH)
        self.keys = nn.Linear(3, kdim or WIDTH)
        self.values = nn.Linear(3, kdim or WIDTH)
        self.mha = nn.MultiheadAttention(
            WIDTH, HEADS, batch_first=batch_first, kdim=kdim, vdim=kdim
        )
        self.head = nn.Linear(WIDTH, N_CLASSES)

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        if self.uses == "self":
            q = k = v = h
        elif self.uses == "decoder":
            q, k = h[:, :2], h[:, 2:]
            v = k
        else:
            q, k, v = h, torch.tanh(self.keys(x)), torch.sin(self.values(x))
        options = {}
        if self.mask == "causal":
            options["attn_mask"] = torch.triu(torch.ones(len(q[0]), len(k[0]), dtype=bool), 1)
        elif self.mask == "padding":
            padding = torch.zeros(len(x), k.shape[1], dtype=torch.bool)
            padding[::2, -1] = True
            options["key_padding_mask"] = padding
        if not self.batch_first:
            q, k, v = (t.transpose(0, 1) for t in (q, k, v))
            k = q if self.uses == "self" else k
            v = k if self.uses in ("self", "decoder") else v
        a, _ = self.mha(q, k, v, need_weights=False, **options)
        if not self.batch_first:
            a = a.transpose(0, 1)
        return self.head(a.mean(1))


CASES = {
    "self": {"uses": "self"},
    "self-sequence-first": {"uses": "self", "batch_first": False},
    "self-causal": {"uses": "self", "mask": "causal"},
    "self-padding": {"uses": "self", "mask": "padding"},
    "decoder": {"uses": "decoder"},
    "decoder-sequence-first": {"uses": "decoder", "batch_first": False},
    "distinct": {"uses": "distinct"},
    "kdim": {"uses": "kdim"},
}


def _pair(case: str, n: int = 6):
    torch.manual_seed(0)
    model = AttentionModel(**CASES[case]).double().eval()
    reference = AttentionModel(**CASES[case]).double().eval()
    reference.load_state_dict(model.state_dict())
    reference.mha = LinearAttention(model.mha)
    generator = torch.Generator().manual_seed(1)
    X = torch.randn(n, 5, 3, generator=generator, dtype=torch.float64)
    y = torch.randint(0, N_CLASSES, (n,), generator=generator)
    return model, reference, DataLoader(TensorDataset(X, y), batch_size=4)


def _blocks(la, model):
    return dict(zip((name for name, _ in model.named_parameters()), la.H_facs.kfacs))


#: The attention layer's parameters and their copies in ``LinearAttention``.
PACKED = {
    "mha.in_proj_weight": "mha.in_proj.weight",
    "mha.in_proj_bias": "mha.in_proj.bias",
    "mha.out_proj.weight": "mha.out_proj.weight",
    "mha.out_proj.bias": "mha.out_proj.bias",
}


SEPARATE = {
    "mha.q_proj_weight": "mha.projections.0.weight",
    "mha.k_proj_weight": "mha.projections.1.weight",
    "mha.v_proj_weight": "mha.projections.2.weight",
    "mha.out_proj.weight": "mha.out_proj.weight",
    "mha.out_proj.bias": "mha.out_proj.bias",
}


@pytest.mark.parametrize("approx", ["expand", "reduce"])
@pytest.mark.parametrize("case", list(CASES))
def test_attention_blocks_equal_those_of_its_linear_maps(case, approx):
    model, reference, loader = _pair(case)
    blocks = []
    for m in (model, reference):
        la = Laplace(m, "classification", "all", "kron", backend_kwargs={"kfac_approx": approx})
        la.fit(loader)
        blocks.append(_blocks(la, m))
    ours, expected = blocks
    copies = SEPARATE if case == "kdim" else PACKED
    for name, copy in copies.items():
        assert len(ours[name]) == len(expected[copy]), name
        for F, G in zip(ours[name], expected[copy], strict=True):
            assert bool(F.abs().amax() > 0), name
            assert_close(F, G, rtol=RTOL, atol=ATOL)
    for name in ("inp.weight", "head.weight", "head.bias"):
        for F, G in zip(ours[name], expected[name], strict=True):
            assert_close(F, G, rtol=RTOL, atol=ATOL)
    if case == "kdim":  # the packed bias of separate projections: one use per projection
        thirds = [expected[f"mha.projections.{i}.bias"][0] for i in range(3)]
        assert_close(ours["mha.in_proj_bias"][0], torch.block_diag(*thirds), rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("case", ["self", "decoder", "distinct", "kdim"])
def test_attention_ekfac_and_glm_variances_equal_those_of_its_linear_maps(case, monkeypatch):
    """Also: the GLM variances come layer by layer, without the Jacobian rows."""
    model, reference, loader = _pair(case)
    X = next(iter(loader))[0]
    results = []
    for m in (model, reference):
        values = []
        for structure in ("ekfac", "kron", "diag"):
            la = Laplace(m, "classification", "all", structure, prior_precision=0.5)
            la.fit(loader)
            values.append(la.log_marginal_likelihood())
            with monkeypatch.context() as patch:
                patch.setattr(LayerTrace, "dense", _no_jacobian_rows)
                values.append(la._functional_moments(X)[1])
        results.append(values)
    for ours, expected in zip(*results, strict=True):
        assert_close(ours, expected, rtol=1e-9, atol=ATOL)


def _no_jacobian_rows(self):
    raise AssertionError("the GLM variances fell back to Jacobian rows")


def test_plan_marks_only_plain_layers_above_the_threshold():
    model = nn.Sequential(nn.Embedding(9, 6), nn.Linear(6, 3), nn.LayerNorm(3), nn.Linear(3, 7))
    engine = CurvlinopsEF(model, "classification").engine
    marks = [block.low_rank for block in plan_blocks(engine, low_rank_above=5)]
    assert marks == [False, False, False, False, False, True, True]
    assert not any(block.low_rank for block in plan_blocks(engine))
