"""Prior-precision tuning: marginal likelihood and grid search."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from conftest import CASE_BUILDERS, assert_close
from laplace import DiagLaplace, FullLaplace


@pytest.mark.parametrize("cls", [FullLaplace, DiagLaplace], ids=["full", "diag"])
@pytest.mark.parametrize("prior_structure", ["scalar", "layerwise", "diag"])
def test_marglik_tuning_increases_marglik(cls, prior_structure):
    case = CASE_BUILDERS["mlp_classification"]()
    la = cls(case.model, case.likelihood, prior_precision=1.0)
    la.fit(case.loader())
    before = la.log_marginal_likelihood().item()
    la.optimize_prior_precision(method="marglik", prior_structure=prior_structure, n_steps=50)
    expected_len = {"scalar": 1, "layerwise": la.n_layers, "diag": la.n_params}[prior_structure]
    assert la.prior_precision.shape == (expected_len,)
    assert not la.prior_precision.requires_grad
    assert la.log_marginal_likelihood().item() > before


def test_marglik_tuning_default_is_scalar():
    case = CASE_BUILDERS["mlp_regression_1out"]()
    la = FullLaplace(case.model, case.likelihood)
    la.fit(case.loader())
    la.optimize_prior_precision()
    assert la.prior_precision.shape == (1,)


def test_marglik_tuning_keeps_structure_of_tensor_init():
    case = CASE_BUILDERS["mlp_regression_1out"]()
    la = DiagLaplace(case.model, case.likelihood)
    la.fit(case.loader())
    init = torch.ones(la.n_layers, dtype=torch.float64)
    la.optimize_prior_precision(init_prior_prec=init, prior_structure="scalar", n_steps=5)
    assert la.prior_precision.shape == (la.n_layers,)


def brute_force_losses(la, grid, X, y):
    losses = []
    for p in grid:
        la.prior_precision = p
        if la.likelihood == "classification":
            probs = la(X, link_approx="probit")
            losses.append(-probs[torch.arange(len(y)), y].log().mean().item())
        else:
            f_mu, _ = la(X)
            losses.append(((f_mu - y) ** 2).mean().item())
    return losses


@pytest.mark.parametrize("name", ["mlp_classification", "mlp_regression_3out"])
def test_gridsearch_picks_best_validation_loss(name):
    case = CASE_BUILDERS[name]()
    la = DiagLaplace(case.model, case.likelihood)
    la.fit(case.loader())
    torch.manual_seed(5)
    X_val, y_val = case.X[:10] + 0.3 * torch.randn_like(case.X[:10]), case.y[:10]
    val_loader = DataLoader(TensorDataset(X_val, y_val), batch_size=4)
    la.optimize_prior_precision(
        method="gridsearch",
        val_loader=val_loader,
        grid_size=9,
        log_prior_prec_min=-2,
        log_prior_prec_max=2,
    )
    chosen = la.prior_precision.clone()
    grid = torch.logspace(-2, 2, 9, dtype=torch.float64)
    losses = brute_force_losses(la, grid, X_val, y_val)
    assert_close(chosen, grid[int(torch.tensor(losses).argmin())].reshape(1))


def test_gridsearch_accepts_callable_loss():
    case = CASE_BUILDERS["mlp_classification"]()
    la = FullLaplace(case.model, case.likelihood)
    la.fit(case.loader())
    calls = []

    def loss(probs, targets):
        calls.append(len(targets))
        return torch.nn.functional.nll_loss(probs.log(), targets)

    la.optimize_prior_precision(
        method="gridsearch", val_loader=case.loader(), loss=loss, grid_size=3
    )
    assert calls and la.prior_precision.shape == (1,)


def test_gridsearch_needs_val_loader():
    case = CASE_BUILDERS["mlp_classification"]()
    la = DiagLaplace(case.model, case.likelihood)
    la.fit(case.loader())
    with pytest.raises(ValueError, match="val_loader"):
        la.optimize_prior_precision(method="gridsearch")
