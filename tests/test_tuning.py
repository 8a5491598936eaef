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


# --------------------------------------------------------------------------- marglik steps
# A tuning step recomputes only what depends on the prior precision: the posterior keeps the
# curvature scaled by 1/(σ²T) (``Posterior.with_prior``), Kron its eigenvalue products, the
# approximation h = 1/(σ²T) and the MAP's squared deviations from the prior mean. These checks
# hold the steps to torch.optim.Adam on the public log marginal likelihood with every cache
# dropped, entry for entry, and the caches to every change they depend on.

TUNED = {
    "full": ("mlp_regression_3out", "all", "full"),
    "diag": ("mlp_regression_3out", "all", "diag"),
    "kron": ("mlp_classification", "all", "kron"),
    "ekfac": ("cnn_classification", "all", "ekfac"),
    "last_layer_kron": ("cnn_classification", "last_layer", "kron"),
    "last_layer_diag": ("mlp_regression_1out", "last_layer", "diag"),
    "subnetwork": ("mlp_classification", "subnetwork", "full"),
}


def _tuned(name: str, **kwargs):
    from laplace import Laplace

    case_name, subset, structure = TUNED[name]
    case = CASE_BUILDERS[case_name]()
    extra = {"subnetwork_indices": torch.tensor([0, 3, 7, 11])} if subset == "subnetwork" else {}
    sigma = {"sigma_noise": 0.7} if case.likelihood == "regression" else {}
    la = Laplace(case.model, case.likelihood, subset, structure, **extra, **sigma, **kwargs)
    la.fit(case.loader())
    return la


def _forget_caches(la) -> None:
    for name in ("_posterior_cache", "_deviation_cache", "_h_factor_cache"):
        la.__dict__.pop(name, None)


@pytest.mark.parametrize("prior_structure", ["scalar", "layerwise"])
@pytest.mark.parametrize("name", list(TUNED))
def test_marglik_steps_are_torch_adam_on_the_uncached_marglik(name, prior_structure):
    if name == "subnetwork" and prior_structure == "layerwise":
        pytest.skip("a subnetwork takes a scalar or diagonal prior")
    la = _tuned(name)
    init = 0.5
    la.optimize_prior_precision(n_steps=12, init_prior_prec=init, prior_structure=prior_structure)
    tuned = la.prior_precision

    reference = _tuned(name)
    n = 1 if prior_structure == "scalar" else reference.n_layers
    log_prior = torch.full((n,), init, dtype=torch.float64).log().requires_grad_(True)
    optimizer = torch.optim.Adam([log_prior], lr=0.1)
    for _ in range(12):
        _forget_caches(reference)
        optimizer.zero_grad()
        (-reference.log_marginal_likelihood(log_prior.exp())).backward()
        optimizer.step()
    assert torch.equal(tuned, log_prior.detach().exp())


def test_marglik_tuning_leaves_a_prior_without_gradient_unchanged(monkeypatch):
    """As torch.optim.Adam skips a parameter without a gradient."""
    la = _tuned("diag")
    constant = torch.zeros((), dtype=torch.float64, requires_grad=True)
    monkeypatch.setattr(la, "log_marginal_likelihood", lambda prior_precision: constant * 1)
    la.optimize_prior_precision(n_steps=3, init_prior_prec=0.25)
    assert torch.equal(la.prior_precision, torch.tensor([0.25], dtype=torch.float64))


@pytest.mark.parametrize("name", ["full", "diag", "kron", "last_layer_kron"])
def test_marglik_follows_in_place_changes_of_the_hyperparameters(name):
    la = _tuned(name)
    la.log_marginal_likelihood()  # fills the caches
    if la.likelihood == "regression":
        with torch.no_grad():
            la.sigma_noise.mul_(1.3)
    with torch.no_grad():
        la.prior_precision.mul_(2.0)
        la.prior_mean = torch.zeros(()) + 0.1
    cached = la.log_marginal_likelihood()
    _forget_caches(la)
    assert torch.equal(cached, la.log_marginal_likelihood())
    with torch.no_grad():
        la.prior_mean.add_(0.2)
    cached = la.log_marginal_likelihood()
    _forget_caches(la)
    assert torch.equal(cached, la.log_marginal_likelihood())


@pytest.mark.parametrize("name", ["diag", "kron", "ekfac"])
def test_a_tuning_step_shares_the_scaled_curvature(name):
    la = _tuned(name)
    posterior = la._posterior
    prior = torch.tensor([0.3], dtype=torch.float64, requires_grad=True)
    la.prior_precision = prior
    stepped = la._posterior
    assert stepped is not posterior and stepped.scaled is posterior.scaled
    expected = type(posterior)(la.H, la._H_factor, prior, la._prior_sizes)
    assert torch.equal(stepped.log_det, expected.log_det)
    assert torch.equal(stepped.prior_diag, expected.prior_diag)
