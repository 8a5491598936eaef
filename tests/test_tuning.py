"""Prior-precision tuning: marginal likelihood and grid search."""

from __future__ import annotations

import numpy as np
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


def _validation_data(case, n=16, seed=5):
    gen = torch.Generator().manual_seed(seed)
    X = case.X[:n] + 0.5 * torch.randn(case.X[:n].shape, generator=gen, dtype=case.X.dtype)
    return X, case.y[:n]


def _classification_loss(probs, y, name):
    from torchmetrics.functional.classification import multiclass_calibration_error

    if name in ("nll", None):  # None: the default loss, the validation NLL
        return -probs[torch.arange(len(y)), y].log().mean().item()
    if name == "ece":
        return multiclass_calibration_error(probs, y, probs.shape[-1]).item()
    onehot = torch.nn.functional.one_hot(y, probs.shape[-1])
    return (probs - onehot).square().sum(-1).mean().item()


def _regression_loss(f_mu, cov, y, name):
    from scipy import stats

    mu, t = f_mu.detach().numpy(), y.numpy()
    if name is None:  # the default loss, the mean squared error
        return float(np.mean((mu - t) ** 2))
    if name == "crps":
        std = cov.diagonal(dim1=-2, dim2=-1).sqrt().detach().numpy()
        z = (t - mu) / std
        crps = std * (z * (2 * stats.norm.cdf(z) - 1) + 2 * stats.norm.pdf(z) - 1 / np.sqrt(np.pi))
        return float(crps.mean())
    cov = cov.detach().numpy()
    return float(
        np.mean([-stats.multivariate_normal.logpdf(t[i], mu[i], cov[i]) for i in range(len(t))])
    )


def _brute_force(la, grid, X, y, name):
    """The validation loss of each candidate from the predictive and independent formulas."""
    losses = []
    for p in grid:
        la.prior_precision = p
        if la.likelihood == "classification":
            losses.append(_classification_loss(la(X, link_approx="probit"), y, name))
        else:
            f_mu, f_var = la(X)
            noise = la.sigma_noise.item() ** 2 * torch.eye(f_var.shape[-1], dtype=f_var.dtype)
            losses.append(_regression_loss(f_mu, f_var + noise, y, name))
    return losses


@pytest.mark.parametrize(
    ("name", "loss"),
    [
        ("mlp_classification", "ece"),
        ("mlp_classification", "brier"),
        ("mlp_classification", "nll"),
        ("mlp_regression_3out", "crps"),
        ("mlp_regression_3out", "nll"),
        ("mlp_classification", None),
        ("mlp_regression_3out", None),
    ],
)
def test_gridsearch_picks_the_lowest_validation_loss(name, loss):
    case = CASE_BUILDERS[name]()
    kwargs = {"sigma_noise": 0.8} if case.likelihood == "regression" else {}
    la = DiagLaplace(case.model, case.likelihood, **kwargs)
    la.fit(case.loader())
    X_val, y_val = _validation_data(case)
    val_loader = DataLoader(TensorDataset(X_val, y_val), batch_size=5)
    la.optimize_prior_precision(
        method="gridsearch",
        val_loader=val_loader,
        loss=loss,
        grid_size=9,
        log_prior_prec_min=-3,
        log_prior_prec_max=3,
    )
    chosen = la.prior_precision.clone()
    grid = torch.logspace(-3, 3, 9, dtype=torch.float64)
    losses = torch.tensor(_brute_force(la, grid, X_val, y_val, loss))
    if not (loss is None and case.likelihood == "regression"):  # the GLM mean ignores the prior
        assert losses.max() - losses.min() > 1e-3, "the grid must matter for this test to bite"
    assert_close(chosen, grid[int(losses.argmin())].reshape(1))


def test_gridsearch_by_ece_differs_from_gridsearch_by_nll():
    """ECE and NLL disagree on this data, so picking by name really switches the metric."""
    case = CASE_BUILDERS["mlp_classification"]()
    la = DiagLaplace(case.model, case.likelihood)
    la.fit(case.loader())
    X_val, y_val = _validation_data(case)
    grid = torch.logspace(-3, 3, 9, dtype=torch.float64)
    ece = torch.tensor(_brute_force(la, grid, X_val, y_val, "ece"))
    nll = torch.tensor(_brute_force(la, grid, X_val, y_val, "nll"))
    assert int(ece.argmin()) != int(nll.argmin())


@pytest.mark.parametrize(
    ("name", "loss", "match"),
    [
        ("mlp_classification", "accuracy", "'brier', 'crps', 'ece', 'nll'"),
        ("mlp_classification", "crps", "likelihood='classification'.*'nll', 'brier', 'ece'"),
        ("mlp_regression_1out", "ece", "likelihood='regression'.*'nll', 'crps'"),
    ],
)
def test_gridsearch_rejects_unknown_metric_names_before_any_work(name, loss, match):
    case = CASE_BUILDERS[name]()
    la = DiagLaplace(case.model, case.likelihood, prior_precision=0.3)
    la.fit(case.loader())
    with pytest.raises(ValueError, match=match):
        la.optimize_prior_precision(method="gridsearch", val_loader=case.loader(), loss=loss)
    assert la.prior_precision.item() == pytest.approx(0.3)
