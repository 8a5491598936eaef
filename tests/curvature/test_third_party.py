"""The third-party backends (ASDL, BackPACK) in use: MC Fisher, hooks, switching, Laplace fits.

What they cannot compute is refused naming a backend that can (KFAC of layers without a
Kronecker rule among them).
"""

from __future__ import annotations

import pytest
import torch
from backend_cases import BACKENDS, THIRD_PARTY, ids, lora_case
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from conftest import ATOL_F64, CASE_BUILDERS, Oracle, assert_close
from laplace import KronLaplace, Laplace
from laplace.curvature import (
    AsdlGGN,
    AsdlHessian,
    BackPackEF,
    BackPackGGN,
    CurvlinopsGGN,
    GGNInterface,
)

MC_ROWS = [row for row in BACKENDS if row.cls in (AsdlGGN, BackPackGGN)]


@pytest.mark.parametrize("name", ["mlp_regression_3out", "mlp_classification"])
@pytest.mark.parametrize("row", MC_ROWS, ids=ids(MC_ROWS))
def test_monte_carlo_fisher_converges_to_ggn(row, name):
    case = CASE_BUILDERS[name]()
    X, y = case.X[:6], case.y[:6]
    n_samples = 300
    backend = row.cls(case.model, case.likelihood, stochastic=True, num_samples=n_samples)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        h_mc = backend.diag(X, y)[1]
    exact = Oracle(case.model, case.likelihood).ggn(X).diagonal()
    # Per entry, the MC diagonal is a mean of S i.i.d. terms gᵢ² whose variance is bounded by
    # their second moment; 6σ from that bound, estimated with the exact fourth moment below.
    J = Oracle(case.model, case.likelihood).jacobian(X)
    if case.likelihood == "regression":  # gᵢ = aᵢᵀε: Var(gᵢ²) = 2|aᵢ|⁴ per sample
        var = 2 * J.square().sum(1).square().sum(0)
    else:  # gᵢ = Jᵢᵀ(p − e_y), enumerate y
        p = torch.softmax(case.model(X), -1).detach()
        g = torch.einsum("bcp,bkc->bkp", J, p.unsqueeze(1) - torch.eye(p.shape[-1]).double())
        var = torch.einsum("bk,bkp->p", p, g**4)
    tol = 6 * (var / n_samples).sqrt() + ATOL_F64
    assert ((h_mc - exact).abs() <= tol).all()
    assert (h_mc - exact).abs().max() > 0


def _assert_clean(model: torch.nn.Module, reference: dict) -> None:
    for module in model.modules():
        assert not module._forward_hooks and not module._forward_pre_hooks
        assert not module._backward_hooks and not module._backward_pre_hooks
        assert module._is_full_backward_hook is None
        assert set(vars(module)) == reference[id(module)]
    for p in model.parameters():
        assert not vars(p) and p.grad is None


@pytest.mark.parametrize("row", THIRD_PARTY, ids=ids(THIRD_PARTY))
def test_backends_leave_no_state_on_the_model(row):
    case = CASE_BUILDERS["cnn_classification"]()
    model = case.model
    reference = {id(m): set(vars(m)) for m in model.modules()}
    backend = row.cls(model, case.likelihood)
    for structure in row.structures:
        if structure == "kron":
            backend.kron(case.X, case.y, N=12)
        else:
            getattr(backend, structure)(case.X, case.y)
    backend.jacobians(case.X)
    backend.gradients(case.X, case.y)
    _assert_clean(model, reference)


ORDERS = [
    (CurvlinopsGGN, AsdlGGN, BackPackGGN, AsdlGGN),
    (BackPackGGN, AsdlGGN, CurvlinopsGGN, BackPackEF),
    (AsdlGGN, BackPackGGN, AsdlHessian, BackPackGGN),
]


@pytest.mark.parametrize("structure", ["diag", "kron"])
@pytest.mark.parametrize("order", ORDERS, ids=["-".join(c.__name__ for c in o) for o in ORDERS])
def test_switching_backends_in_any_order(order, structure):
    case = CASE_BUILDERS["mlp_classification"]()
    loader = DataLoader(TensorDataset(case.X, case.y), batch_size=7)
    reference = {id(m): set(vars(m)) for m in case.model.modules()}
    results = []
    for backend in order:
        if structure == "kron" and backend in (AsdlHessian, BackPackEF):
            continue
        la = Laplace(
            case.model, "classification", "all", hessian_structure=structure, backend=backend
        )
        la.fit(loader)
        if issubclass(backend, GGNInterface):
            results.append(la.posterior_precision if structure == "diag" else la.log_det_ratio)
        _assert_clean(case.model, reference)
    for result in results[1:]:
        assert_close(result, results[0])


def test_unsupported_combinations_name_a_working_backend(classification_case):
    case = classification_case
    with pytest.raises(NotImplementedError, match="CurvlinopsGGN"):
        AsdlHessian(case.model, "classification").kron(case.X, case.y, N=20)
    with pytest.raises(NotImplementedError, match="AsdlEF"):
        BackPackEF(case.model, "classification").kron(case.X, case.y, N=20)
    custom = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.PReLU()).double()
    with pytest.raises(ValueError, match=r"\['PReLU'\].*CurvlinopsGGN"):
        AsdlGGN(custom, "regression")
    model, X, y = lora_case()
    with pytest.raises(ValueError, match="CurvlinopsGGN or AsdlGGN"):
        BackPackGGN(model, "classification").kron(X, y, N=14)


@pytest.mark.parametrize("subset", ["all", "last_layer"])
@pytest.mark.parametrize("structure", ["full", "diag", "kron"])
@pytest.mark.parametrize("row", BACKENDS, ids=ids(BACKENDS))
def test_laplace_accepts_every_backend(row, structure, subset):
    case = CASE_BUILDERS["mlp_regression_3out"]()
    kwargs = {"subset_of_weights": subset, "hessian_structure": structure}
    la = Laplace(case.model, "regression", backend=row.cls, **kwargs)
    if structure not in row.structures:
        with pytest.raises(NotImplementedError):
            la.fit(case.loader())
        return
    la.fit(case.loader())
    ref = Laplace(case.model, "regression", backend=CurvlinopsGGN, **kwargs)
    ref.fit(case.loader())
    if row.kind == "hessian":  # indefinite away from a minimum: no posterior to predict with
        return
    if row.kind == "ggn":
        assert_close(la.log_marginal_likelihood(), ref.log_marginal_likelihood())
    f_mu, f_var = la(case.X[:4])
    assert f_mu.shape == (4, 3) and f_var.shape == (4, 3, 3)


# --------------------------------------------------------------------------------- errors
@pytest.mark.parametrize("backend", [AsdlGGN, BackPackGGN])
@pytest.mark.parametrize(
    ("layer", "name"), [(nn.LayerNorm(4), "LayerNorm"), (nn.Embedding(5, 4), "Embedding")]
)
def test_third_party_kfac_names_the_module_and_the_alternatives(backend, layer, name):
    model = nn.Sequential(layer, nn.Flatten(), nn.Linear(4, 2))
    with pytest.raises(ValueError, match=rf"'0' \({name}\).*CurvlinopsGGN.*'diag'"):
        KronLaplace(model, "classification", backend=backend)
