"""The GLM predictive's double dispatch: Jacobian kinds × posterior structures.

Every posterior structure computes ``J P⁻¹ Jᵀ`` for every Jacobian kind (dense rows, a linear
head's features, a recorded layer trace), by a closed form or through the kind's dense rows, and
each result equals the dense float64 oracle built from ``torch.func`` Jacobians and the
posterior's precision written out as a (P, P) matrix. A layer-wise closed form that does not
apply takes its dense rows from the same recorded pass: the model runs once per chunk.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from conftest import CASE_BUILDERS, Oracle, assert_close, freeze_all_but
from laplace import Laplace
from laplace.curvature import CurvlinopsGGN
from laplace.structures import (
    DensePosterior,
    DiagonalPosterior,
    KronPosterior,
    LowRankPosterior,
    jacobians,
)
from laplace.structures.jacobians import HeadFeatures, Jacobian, JacobianRows, LayerTrace
from laplace.structures.kron_glm import LAYERWISE_CHUNK_ROWS
from laplace.structures.memory_budgets import jacobian_chunk_rows

#: ``J P⁻¹ Jᵀ`` by a closed form or by dense rows against the oracle (float64, tiny models).
RTOL_VARIANCE = 1e-8
ATOL_VARIANCE = 1e-12

STRUCTURES = ["full", "diag", "kron", "lowrank"]
KINDS = ["rows", "trace", "head"]
#: The kinds each structure has a closed form for (the others go through the dense rows).
CLOSED_FORMS = {
    "full": {HeadFeatures},
    "diag": {HeadFeatures, LayerTrace},
    "kron": {HeadFeatures, LayerTrace},
    "lowrank": {LayerTrace},
}
#: The model outputs per structure case: one regression and one classification case each.
CASES = ["mlp_regression_3out", "mlp_classification", "cnn_classification"]


def dense_precision(posterior) -> torch.Tensor:
    """The posterior precision ``P`` as a dense (P, P) matrix."""
    if isinstance(posterior, DensePosterior):
        return posterior.precision
    if isinstance(posterior, DiagonalPosterior):
        return torch.diag(posterior.precision)
    if isinstance(posterior, KronPosterior):
        return posterior.precision.to_matrix()
    assert isinstance(posterior, LowRankPosterior)
    (U, eigenvalues), prior_diag = posterior.precision
    return (U * eigenvalues) @ U.T + torch.diag(prior_diag)


def fitted(model: nn.Module, likelihood: str, structure: str, X, y, **kwargs):
    if structure == "lowrank":
        kwargs["backend_kwargs"] = {"n_eigenvalues": 3}
    la = Laplace(model, likelihood, "all", structure, prior_precision=0.8, **kwargs)
    la.fit(DataLoader(TensorDataset(X, y), batch_size=7))
    return la


def kind_of(name: str, model: nn.Module, likelihood: str, X) -> Jacobian:
    """A Jacobian kind over the trainable parameters of ``model`` on inputs ``X``."""
    if name == "rows":
        return JacobianRows(Oracle(model, likelihood).jacobian(X))
    if name == "trace":
        return LayerTrace(CurvlinopsGGN(model, likelihood).trace(X))
    head = model[-1]
    with torch.no_grad():
        phi = model[:-1](X)
    return HeadFeatures(phi, head.out_features, head.bias is not None)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("structure", STRUCTURES)
@pytest.mark.parametrize("case_name", CASES)
def test_every_structure_and_kind_equals_the_dense_oracle(case_name, structure, kind):
    case = CASE_BUILDERS[case_name]()
    # Features are the head's inputs: the posterior then covers the head only.
    model = freeze_all_but(case.model, str(len(case.model) - 1)) if kind == "head" else case.model
    la = fitted(model, case.likelihood, structure, case.X, case.y)
    posterior = la._posterior
    J = Oracle(model, case.likelihood).jacobian(case.X[:6])
    expected = J @ torch.linalg.solve(dense_precision(posterior), J.transpose(1, 2))
    f_var = posterior.functional_variance(kind_of(kind, model, case.likelihood, case.X[:6]))
    assert_close(f_var, expected, rtol=RTOL_VARIANCE, atol=ATOL_VARIANCE)
    assert set(type(posterior).closed_forms) == CLOSED_FORMS[structure]


@pytest.mark.parametrize(
    ("structure", "kind"),
    [("full", "trace"), ("lowrank", "head"), ("full", "rows"), ("diag", "rows")],
)
def test_a_kind_without_closed_form_goes_through_its_dense_rows(structure, kind, monkeypatch):
    case = CASE_BUILDERS["mlp_regression_3out"]()
    model = freeze_all_but(case.model, "2") if kind == "head" else case.model
    la = fitted(model, case.likelihood, structure, case.X, case.y)
    J = kind_of(kind, model, case.likelihood, case.X[:5])
    calls = []
    dense = type(J).dense
    monkeypatch.setattr(type(J), "dense", lambda self: calls.append(1) or dense(self))
    rows = Oracle(model, case.likelihood).jacobian(case.X[:5])
    assert_close(la._posterior.functional_variance(J), la.functional_variance(rows))
    assert calls == [1]


def test_closed_forms_do_not_form_dense_rows(monkeypatch):
    case = CASE_BUILDERS["cnn_classification"]()
    monkeypatch.setattr(LayerTrace, "dense", None)  # a call would fail
    monkeypatch.setattr(HeadFeatures, "dense", None)
    for structure in ("diag", "kron", "lowrank"):
        la = fitted(case.model, case.likelihood, structure, case.X, case.y)
        la._posterior.functional_variance(kind_of("trace", case.model, "classification", case.X))
    head_only = freeze_all_but(case.model, "4")
    for structure in ("full", "diag", "kron"):
        la = fitted(head_only, case.likelihood, structure, case.X, case.y)
        la._posterior.functional_variance(kind_of("head", head_only, "classification", case.X))


def test_per_output_noise_posteriors_dispatch_to_their_structure():
    case = CASE_BUILDERS["mlp_regression_3out"]()
    sigma = torch.tensor([0.5, 1.0, 2.0], dtype=torch.float64)
    for structure in ("full", "diag", "kron"):
        la = fitted(case.model, "regression", structure, case.X, case.y, sigma_noise=sigma)
        posterior = la._posterior
        assert posterior.closed_forms is posterior.inner.closed_forms
        J = Oracle(case.model, "regression").jacobian(case.X[:4])
        expected = J @ torch.linalg.solve(dense_precision(posterior.inner), J.transpose(1, 2))
        for kind in ("rows", "trace"):
            f_var = posterior.functional_variance(
                kind_of(kind, case.model, "regression", case.X[:4])
            )
            assert_close(f_var, expected, rtol=RTOL_VARIANCE, atol=ATOL_VARIANCE)


# --------------------------------------------------------------- one forward pass per chunk
class LayerNormNet(nn.Module):
    """A LayerNorm owns parameters: the layer-wise routes use their per-sample gradients."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 5), nn.LayerNorm(5), nn.Tanh(), nn.Linear(5, 2))

    def forward(self, x):
        return self.net(x)


class RowFolding(nn.Module):
    """Its first layer sees two rows per data point: the Kronecker layer-wise route declines."""

    def __init__(self):
        super().__init__()
        self.inner = nn.Linear(2, 3)
        self.outer = nn.Linear(6, 2)

    def forward(self, x):
        return self.outer(torch.tanh(self.inner(x.reshape(-1, 2))).reshape(len(x), 6))


def _forward_calls(model: nn.Module) -> list[int]:
    calls: list[int] = []
    model.register_forward_pre_hook(lambda module, args: calls.append(1))
    return calls


@pytest.mark.parametrize(
    ("net", "subset", "structure"),
    [
        (LayerNormNet, "all", "diag"),
        (LayerNormNet, "all", "lowrank"),
        (RowFolding, "all", "lowrank"),
        (RowFolding, "all", "kron"),
        (LayerNormNet, "subnetwork", "diag"),
        (LayerNormNet, "all", "full"),
        (RowFolding, "all", "diag"),
    ],
)
def test_a_declined_layer_wise_route_reuses_the_recorded_pass(net, subset, structure):
    torch.manual_seed(0)
    model = net().double()
    X = torch.randn(9, 4, dtype=torch.float64)
    y = torch.randn(9, 2, dtype=torch.float64)
    kwargs = {"backend_kwargs": {"n_eigenvalues": 3}} if structure == "lowrank" else {}
    if subset == "subnetwork":
        kwargs["subnetwork_indices"] = torch.arange(0, 40, 3)
    la = Laplace(model, "regression", subset, structure, prior_precision=0.8, **kwargs)
    la.fit(DataLoader(TensorDataset(X, y), batch_size=5))
    calls = _forward_calls(model)
    f_mu, f_var = la(X)  # one chunk
    assert len(calls) == 1
    J = Oracle(model, "regression").jacobian(X)
    if subset == "subnetwork":
        J = J[:, :, kwargs["subnetwork_indices"]]
    assert_close(f_var, la.functional_variance(J), rtol=RTOL_VARIANCE, atol=ATOL_VARIANCE)
    assert_close(f_mu, model(X))


# ------------------------------------------------------------------------------- chunk size
@pytest.mark.parametrize(
    ("case_name", "subset", "structure", "layerwise"),
    [
        ("cnn_classification", "all", "kron", True),
        ("cnn_classification", "all", "diag", True),
        ("cnn_classification", "all", "lowrank", True),
        ("cnn_classification", "all", "full", False),
        ("cnn_classification", "last_layer", "kron", False),
        ("cnn_classification", "subnetwork", "diag", False),
        ("layer_norm", "all", "diag", True),
    ],
)
def test_the_chunk_size_comes_from_the_kind(case_name, subset, structure, layerwise):
    if case_name == "layer_norm":
        torch.manual_seed(0)
        model, likelihood = LayerNormNet().double(), "regression"
        X, y = torch.randn(9, 4, dtype=torch.float64), torch.randn(9, 2, dtype=torch.float64)
    else:
        case = CASE_BUILDERS[case_name]()
        model, likelihood, X, y = case.model, case.likelihood, case.X, case.y
    kwargs = {"backend_kwargs": {"n_eigenvalues": 3}} if structure == "lowrank" else {}
    if subset == "subnetwork":
        kwargs["subnetwork_indices"] = torch.arange(0, 100, 7)
    la = Laplace(model, likelihood, subset, structure, **kwargs)
    la.fit(DataLoader(TensorDataset(X, y), batch_size=5))
    width = len(la.prior_precision_diag)  # P, or K entries of a subnetwork
    assert width == (la.n_params if subset != "subnetwork" else 15)
    jacobian_rows = jacobian_chunk_rows(la.n_outputs, width, torch.float64)
    assert la._chunk_rows(len(X)) == (LAYERWISE_CHUNK_ROWS if layerwise else jacobian_rows)


@pytest.mark.parametrize("structure", ["kron", "diag"])
def test_a_layer_wise_chunk_records_at_most_its_bytes_of_layer_outputs(monkeypatch, structure):
    """The engine keeps the bytes of a point's recorded layer outputs; a layer-wise prediction
    takes as many points per chunk as ``LAYERWISE_CHUNK_BYTES`` of them hold (a ResNet-50's
    100 test images took 6.4 GB in one chunk), and its moments are those of one chunk."""
    case = CASE_BUILDERS["cnn_classification"]()
    la = Laplace(case.model, case.likelihood, "all", structure)
    la.fit(DataLoader(TensorDataset(case.X, case.y), batch_size=5))
    outputs = []
    hooks = [
        m.register_forward_hook(lambda m, a, out: outputs.append(out))
        for m in case.model.modules()
        if any(p.requires_grad for p in m.parameters(recurse=False))
    ]
    with torch.no_grad():
        case.model(case.X[:1])
    for hook in hooks:
        hook.remove()
    row_bytes = sum(z.numel() * z.element_size() for z in outputs)
    assert la.backend.engine.row_bytes == row_bytes
    f_mu, f_var = la._glm_predictive_distribution(case.X)  # one chunk
    monkeypatch.setattr(jacobians, "LAYERWISE_CHUNK_BYTES", 3 * row_bytes + 1)
    assert la._chunk_rows(len(case.X)) == 3
    passes = []
    trace = la.backend.engine.trace

    def counted(*args, **kwargs):
        passes.append(1)
        return trace(*args, **kwargs)

    monkeypatch.setattr(la.backend.engine, "trace", counted)
    chunked = la._glm_predictive_distribution(case.X)
    assert len(passes) == -(-len(case.X) // 3)
    assert_close(chunked[0], f_mu)
    assert_close(chunked[1], f_var, rtol=RTOL_VARIANCE, atol=ATOL_VARIANCE)
