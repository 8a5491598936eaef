"""The attribution guard against dense float64 oracles, on models outside a per-module view.

Attention modules whose ``out_proj`` is never called, weights used outside their module and
tables looked up without a batch dimension (``architectures.py``): diag and full must equal
the exact GGN, the GLM variances ``J P⁻¹ Jᵀ``, and Kron must give every parameter with
curvature a block equal to its documented definition or refuse it by name.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from cases.architectures import PATTERNS, BatchedPositionTable, PositionTable, build
from conftest import Oracle, assert_close, freeze_all_but
from laplace import Laplace
from laplace.curvature import AsdlGGN, CurvlinopsGGN
from laplace.curvature.engine import guard
from laplace.curvature.engine.kfac_rules import plan_blocks

pytestmark = pytest.mark.oracle

#: The acceptance tolerance of the issue: diag and full equal the dense GGN to 1e-8.
RTOL = 1e-8
ATOL = 1e-10
#: GLM variances go through a Cholesky factor or an eigenbasis.
RTOL_VARIANCE = 1e-7


def loader(X: torch.Tensor, y: torch.Tensor, batch_size: int | None = None) -> DataLoader:
    return DataLoader(TensorDataset(X, y), batch_size=batch_size or len(X))


@pytest.mark.parametrize("name", list(PATTERNS))
@pytest.mark.parametrize("structure", ["diag", "full"])
def test_diag_and_full_equal_the_dense_ggn(name, structure):
    model, X, y = build(name)
    la = Laplace(model, "classification", "all", structure, prior_precision=0.7)
    la.fit(loader(X, y))
    ggn = Oracle(model, "classification").ggn(X)
    assert_close(la.H, ggn.diagonal() if structure == "diag" else ggn, rtol=RTOL, atol=ATOL)
    J = Oracle(model, "classification").jacobian(X)
    covariance = torch.linalg.inv(
        la.posterior_precision if structure == "full" else torch.diag(la.posterior_precision)
    )
    expected = J @ covariance @ J.transpose(1, 2)
    assert_close(la._functional_moments(X)[1], expected, rtol=RTOL_VARIANCE, atol=ATOL)


@pytest.mark.parametrize("name", ["mha-batch-first", "encoder-layer", "adapter", "vit"])
def test_lowrank_equals_the_top_of_the_dense_ggn(name):
    model, X, y = build(name)
    la = Laplace(model, "classification", "all", "lowrank", backend_kwargs={"n_eigenvalues": 3})
    la.fit(loader(X, y))
    _, values = la.H
    exact = torch.linalg.eigvalsh(Oracle(model, "classification").ggn(X)).flip(0)[:3]
    assert_close(values, exact, rtol=1e-6, atol=1e-9)


def _slots(model):
    start = 0
    for name, p in model.named_parameters():
        yield name, slice(start, start + p.numel()), p
        start += p.numel()


#: Kronecker-factored weights used outside their module's calls: refused by name.
KRON_REFUSED = {"tied-head": "'wte'", "adapter": "'base'", "table-row-read": "'wte'"}

#: The patterns the engine reads whole (per-layer rules, no autograd fallback): attention by
#: its own rule, position tables lifted, sequence-first layers read batch-first.
SEEN_WHOLE = [name for name in PATTERNS if name not in KRON_REFUSED]


@pytest.mark.parametrize("name", [n for n in PATTERNS if n not in KRON_REFUSED])
def test_kron_gives_every_curved_parameter_its_block(name):
    """Exact blocks (single factor) equal the GGN's; Kronecker blocks are nonzero."""
    model, X, y = build(name)
    la = Laplace(model, "classification", "all", "kron")
    la.fit(loader(X, y))
    ggn = Oracle(model, "classification").ggn(X)
    plan = plan_blocks(la.backend.engine)
    blocks = zip(_slots(model), la.H_facs.kfacs, plan, strict=True)
    for (p_name, rows, _), block, kind in blocks:
        exact = ggn[rows, rows]
        if kind.kind == "dense":
            assert_close(block[0], exact, rtol=RTOL, atol=ATOL)
        elif kind.kind == "diag":
            assert_close(block[0], exact.diagonal(), rtol=RTOL, atol=ATOL)
        if bool(exact.abs().amax() > 1e-12):
            assert any(bool(F.abs().amax() > 0) for F in block), p_name


@pytest.mark.parametrize("name", list(KRON_REFUSED))
def test_kron_refuses_a_kronecker_factored_weight_it_cannot_factor(name):
    model, X, y = build(name)
    la = Laplace(model, "classification", "all", "kron")
    with pytest.raises(ValueError, match=rf"{KRON_REFUSED[name]}.*Kronecker block, but"):
        la.fit(loader(X, y))


def test_a_batchless_table_has_the_kfac_block_of_its_batched_lookup():
    """With T = B the rows of ``wpe(arange(T))`` are positions, not data points."""
    model, X, y = build("position-table-T-equals-B")
    reference = BatchedPositionTable().double()
    reference.load_state_dict(model.state_dict())
    blocks = []
    for m in (model, reference):
        la = Laplace(m, "classification", "all", "kron")
        la.fit(loader(X, y))
        blocks.append(la.H_facs.kfacs)
    for ours, expected in zip(*blocks, strict=True):
        for F, G in zip(ours, expected, strict=True):
            assert_close(F, G, rtol=RTOL, atol=ATOL)
    backend = CurvlinopsGGN(model, "classification")
    backend.diag(X, y)
    assert backend.engine.shared == {model.wpe: "lift"}


def test_a_broadcast_table_is_exact_for_any_sequence_length():
    model = PositionTable().double()
    ggn_for = Oracle(model, "classification").ggn
    for n, seq in [(4, 4), (3, 5), (6, 2)]:
        X = torch.randint(0, 5, (n, seq))
        y = torch.randint(0, 3, (n,))
        _, diag = CurvlinopsGGN(model, "classification").diag(X, y)
        assert_close(diag, ggn_for(X).diagonal(), rtol=RTOL, atol=ATOL)


def test_the_verdict_is_checked_once_per_signature(monkeypatch):
    checks = []
    verify = guard.verify
    monkeypatch.setattr(
        "laplace.curvature.engine.per_sample.verify", lambda *a: checks.append(1) or verify(*a)
    )
    model, X, y = build("adapter", n=12)
    la = Laplace(model, "classification", "all", "diag")
    la.fit(loader(X, y, batch_size=4))
    la.fit(loader(X, y, batch_size=4))
    assert len(checks) == 1
    verdict = next(iter(la.backend.engine.verdicts.values()))
    slots = {name: i for i, (name, _, _) in enumerate(_slots(model))}
    assert list(verdict.exact) == [slots["base.weight"]]
    assert "only part of its gradient" in verdict.exact[slots["base.weight"]]


@pytest.mark.parametrize("name", SEEN_WHOLE)
def test_attention_tables_and_sequence_first_layers_need_no_fallback(name):
    model, X, _ = build(name)
    trace = CurvlinopsGGN(model, "classification").trace(X)
    assert trace.layerwise, trace.exact_reasons


class SequenceFirstReLU(torch.nn.Module):
    """(B, T, 2) read sequence-first by a Linear and a ReLU at every position, the last read out.

    With T equal to the batch size the Linear's outputs (T, B, 3) look like one row per data
    point; their rows are positions, each mixing the data points.
    """

    def __init__(self):
        super().__init__()
        self.inner = torch.nn.Linear(2, 3)
        self.head = torch.nn.Linear(3, 3)

    def forward(self, x):
        return self.head(torch.relu(self.inner(x.transpose(0, 1)))[-1])


@pytest.mark.parametrize("structure", ["diag", "full"])
def test_rows_mixed_where_the_checked_batch_has_dead_units_are_caught_by_their_values(structure):
    """On the first batch, the first data point's units are all inactive at the position read
    out, so the gradients of the Linear's rows scale as one data point's each; the second batch
    mixes them. The check of the rows' values (a data point's inputs changed) sees the mix
    on the first batch, so every batch is exact."""
    model = SequenceFirstReLU().double().eval()
    with torch.no_grad():
        model.inner.weight.copy_(torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]]))
        model.inner.bias.zero_()
    X = torch.rand(4, 2, 2, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    X = X + 0.5
    X[0, -1] = -1.0  # every unit of the first data point inactive at the last position
    y = torch.tensor([0, 1, 2, 0])
    la = Laplace(model, "classification", "all", structure)
    la.fit(loader(X, y, batch_size=2))
    ggn = Oracle(model, "classification").ggn(X)
    assert_close(la.H, ggn.diagonal() if structure == "diag" else ggn, rtol=RTOL, atol=ATOL)


class PositionsBeforeReLU(torch.nn.Module):
    """(B, T, 3) plus a table looked up without a batch dimension, ``wpe(arange(T))`` (T, 3),
    a ReLU and the mean over positions. With T equal to the batch size the table's rows look
    like one row per data point; they are positions, each reached by every data point."""

    def __init__(self, length: int):
        super().__init__()
        self.wpe = torch.nn.Embedding(length, 3)
        self.head = torch.nn.Linear(3, 3)

    def forward(self, x):
        positions = torch.arange(x.shape[1], device=x.device)
        return self.head(torch.relu(x + self.wpe(positions)).mean(1))


@pytest.mark.parametrize("structure", ["diag", "full"])
def test_position_rows_where_the_checked_batch_has_dead_units_are_caught_by_their_values(
    structure,
):
    """On the first batch (T = B = 2) the first data point's units are inactive at position 1
    and the second's at position 0, so each row of the table's gradient scales as one data
    point's (the gradient check passes); the second batch reaches both rows with both points.
    The rows' values do not move when the batch is shifted by one data point, which no row of
    a data point does: every batch is exact (without the check the table's diagonal is off)."""
    model = PositionsBeforeReLU(2).double().eval()
    with torch.no_grad():
        model.wpe.weight.uniform_(0.1, 0.2)
    X = 0.5 + torch.rand(4, 2, 3, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    X[0, 1] = -1.0
    X[1, 0] = -1.0
    y = torch.tensor([0, 1, 2, 0])
    la = Laplace(model, "classification", "all", structure)
    la.fit(loader(X, y, batch_size=2))
    ggn = Oracle(model, "classification").ggn(X)
    assert_close(la.H, ggn.diagonal() if structure == "diag" else ggn, rtol=RTOL, atol=ATOL)


def test_a_model_the_engine_sees_whole_has_an_empty_verdict():
    _, X, _ = build("position-table-T-not-B")
    backend = CurvlinopsGGN(BatchedPositionTable().double(), "classification")
    trace = backend.trace(X)
    assert trace.layerwise and trace.exact_slots == []
    assert [v.exact for v in backend.engine.verdicts.values()] == [{}]


#: Per pattern, the tables the guard proves are used only by lookups (it then never forms
#: their (V, D) gradient); a table read or multiplied outside its lookups is not among them,
#: nor a batch-less table (its lifted lookup is not the call autograd records).
LOOKED_UP_ONLY = {
    "position-table-T-not-B": {"wte.weight"},
    "tied-head": set(),
    "table-row-read": set(),
    "shared-tables": {"encoder.weight"},
}


@pytest.mark.parametrize("name", list(LOOKED_UP_ONLY))
def test_tables_used_only_by_lookups_are_checked_on_their_looked_up_rows(name, monkeypatch):
    proven = []
    looked_up_only = guard._looked_up_only

    def spy(*args):
        proven.append(looked_up_only(*args))
        return proven[-1]

    monkeypatch.setattr(guard, "_looked_up_only", spy)
    model, X, _ = build(name)
    backend = CurvlinopsGGN(model, "classification")
    backend.trace(X)
    names = [name for name, _, _ in _slots(model)]
    assert {names[slot] for slot in proven[0]} == LOOKED_UP_ONLY[name]


#: The models a library reading curvature off module calls would get wrong (ASDL's diagonal
#: was off by 3e-2 to 5e-1 on them, silently).
MISREAD_BY_LIBRARIES = [
    "tied-head",
    "adapter",
    "position-table-T-equals-B",
    "position-table-T-not-B",
]


@pytest.mark.parametrize("name", MISREAD_BY_LIBRARIES)
@pytest.mark.parametrize("backend", ["AsdlGGN", "BackPackGGN"])
def test_third_party_backends_refuse_what_they_would_misread(name, backend):
    from laplace import curvature

    model, X, y = build(name)
    with pytest.raises(ValueError, match=r"would read this model's curvature wrong.*Curvlinops"):
        getattr(curvature, backend)(model, "classification").diag(X, y)


class SequenceModel(torch.nn.Module):
    """Inputs (B, T, 3) → Linear → LayerNorm → tanh → mean over positions → Linear."""

    def __init__(self):
        super().__init__()
        self.inp = torch.nn.Linear(3, 4)
        self.norm = torch.nn.LayerNorm(4)
        self.head = torch.nn.Linear(4, 3)

    def forward(self, x):
        return self.head(torch.tanh(self.norm(self.inp(x))).mean(1))


@pytest.mark.parametrize("structure", ["diag", "full"])
@pytest.mark.parametrize("backend", ["AsdlGGN", "AsdlEF"])
def test_asdl_refuses_a_fisher_over_positions_and_keeps_what_it_reads_exactly(structure, backend):
    """ASDL's diag and full Fisher square each position's gradient (diag off by 0.1 here)."""
    from laplace import curvature

    torch.manual_seed(0)
    model = SequenceModel().double().eval()
    X, y = torch.randn(4, 2, 3, dtype=torch.float64), torch.randint(0, 3, (4,))
    la = Laplace(model, "classification", "all", structure, backend=getattr(curvature, backend))
    with pytest.raises(ValueError, match=r"module 'inp' \(Linear\) takes inputs of shape"):
        la.fit(loader(X, y))
    asdl = AsdlGGN(model, "classification")
    assert_close(
        asdl.gradients(X, y)[0], CurvlinopsGGN(model, "classification").gradients(X, y)[0]
    )
    model.norm.requires_grad_(False)  # ASDL factors Linear layers only
    la = Laplace(model, "classification", "all", "kron", backend=AsdlGGN)
    la.fit(loader(X, y))  # its factors sum the positions


def test_the_gradient_check_in_row_chunks_gives_the_same_verdicts(monkeypatch):
    """Large layers are checked a few rows at a time (a (T, T) mask is not split with them)."""
    monkeypatch.setattr(guard, "GUARD_CHUNK_ELEMENTS", 7)
    for name in PATTERNS:
        model, X, _ = build(name)
        trace = CurvlinopsGGN(model, "classification").trace(X)
        assert trace.layerwise == (name in SEEN_WHOLE), (name, trace.exact_reasons)


@pytest.mark.parametrize("name", list(PATTERNS))
def test_last_layer_equals_the_ggn_of_the_head(name):
    model, X, y = build(name)
    la = Laplace(model, "classification", "last_layer", "full", prior_precision=0.7)
    la.fit(loader(X, y))
    head = next(n for n, m in model.named_modules() if m is la.model.last_layer)
    oracle = Oracle(freeze_all_but(model, head), "classification")
    assert_close(la.H, oracle.ggn(X), rtol=RTOL, atol=ATOL)
    J = oracle.jacobian(X)
    expected = J @ torch.linalg.inv(la.posterior_precision) @ J.transpose(1, 2)
    assert_close(la._functional_moments(X)[1], expected, rtol=RTOL_VARIANCE, atol=ATOL)


@pytest.mark.parametrize("name", list(PATTERNS))
def test_matfree_products_and_the_inf_diagonal_equal_the_dense_ggn(name):
    """Matrix-free ``H V`` for ``V = I`` and diagonal plus low rank's exact diagonal."""
    model, X, y = build(name)
    ggn = Oracle(model, "classification").ggn(X)
    matfree = Laplace(model, "classification", "all", "matfree")
    matfree.fit(loader(X, y))
    eye = torch.eye(len(ggn), dtype=torch.float64)
    assert_close(matfree.H.matmat(eye), ggn, rtol=RTOL, atol=ATOL)
    inf = Laplace(
        model, "classification", "all", "diag_lowrank", backend_kwargs={"n_eigenvalues": 2}
    )
    inf.fit(loader(X, y))
    assert_close(inf.H[2], ggn.diagonal(), rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("name", [n for n in PATTERNS if n not in KRON_REFUSED])
def test_ekfac_keeps_the_exact_blocks_of_kron(name):
    model, X, y = build(name)
    la = Laplace(model, "classification", "all", "ekfac")
    la.fit(loader(X, y))
    ggn = Oracle(model, "classification").ggn(X)
    plan = plan_blocks(la.backend.engine)
    for (_, rows, _), block, kind in zip(_slots(model), la.H_facs.kfacs, plan, strict=True):
        if kind.kind == "dense":
            assert_close(block[0], ggn[rows, rows], rtol=RTOL, atol=ATOL)


def test_convolutions_and_linear_layers_need_no_fallback():
    """The gradient check's summed forms (no per-sample gradients) of Linear and convolution
    layers, grouped and strided, in one, two and three dimensions, agree with autograd."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(2, 4, 3, stride=2, padding=1),
        torch.nn.Tanh(),
        torch.nn.Conv2d(4, 4, 3, groups=2, padding=1, padding_mode="circular"),
        torch.nn.Flatten(1),
        torch.nn.Unflatten(1, (4, 16)),
        torch.nn.Conv1d(4, 3, 2, dilation=2),
        torch.nn.Flatten(1),
        torch.nn.Linear(42, 3),
    ).double()
    X = torch.randn(5, 2, 8, 8, dtype=torch.float64)
    trace = CurvlinopsGGN(model, "classification").trace(X)
    assert trace.layerwise, trace.exact_reasons
    conv3d = torch.nn.Sequential(
        torch.nn.Conv3d(1, 2, 2), torch.nn.Flatten(1), torch.nn.Linear(54, 2)
    ).double()
    trace = CurvlinopsGGN(conv3d, "classification").trace(torch.randn(3, 1, 4, 4, 4).double())
    assert trace.layerwise, trace.exact_reasons


class _CastOutput(torch.nn.Module):
    """A float64 network whose logits the model casts down to float32."""

    def __init__(self, cast: bool = True):
        super().__init__()
        self.cast = cast
        self.body = torch.nn.Sequential(
            torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2)
        ).double()

    def forward(self, x):
        f = self.body(x)
        return f.float() if self.cast else f


#: The loss Hessian of float32 logits is float32: the curvature carries its round-off.
RTOL_FLOAT32_LOGITS = 1e-5


@pytest.mark.parametrize("structure", ["diag", "full"])
def test_a_float64_network_with_float32_logits_keeps_its_rules_and_float64(structure):
    """Used directly (no posterior type set), the engine keeps the output gradients in the
    layers' float64, the type of their recorded inputs: the rules apply, no parameter falls
    back, and the curvature is float64, as ASDL's on the same model."""
    torch.manual_seed(0)
    model = _CastOutput()
    X, y = torch.randn(6, 3, dtype=torch.float64), torch.randint(0, 2, (6,))
    backend = CurvlinopsGGN(model, "classification")
    _, H = getattr(backend, structure)(X, y)
    assert not any(v.exact for v in backend.engine.verdicts.values())
    assert H.dtype == torch.float64
    reference = _CastOutput(cast=False)
    reference.load_state_dict(model.state_dict())
    ggn = Oracle(reference, "classification").ggn(X)
    expected = ggn.diagonal() if structure == "diag" else ggn
    assert_close(H, expected, rtol=RTOL_FLOAT32_LOGITS, atol=1e-7)
    if structure == "diag":  # ASDL is refused where the native rules would not apply
        _, asdl = AsdlGGN(model, "classification").diag(X, y)
        assert asdl.dtype == torch.float64
