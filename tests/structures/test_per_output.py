"""One observation noise per output: ``sigma_noise`` of shape (C,) for regression.

The reference is the dense posterior precision ``Σ_c J_cᵀ J_c / (σ_c² T) + δ I`` from exact
Jacobians (``torch.func``), the Gaussian log-density of the targets, and finite differences of
the marginal likelihood in every ``σ_c``.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from conftest import CASE_BUILDERS, Oracle, assert_close
from laplace import FunctionalLaplace, Laplace, marglik_training
from laplace.curvature import CurvlinopsEF, CurvlinopsGGN

SIGMA = torch.tensor([0.5, 1.5, 3.0], dtype=torch.float64)
FD_STEP = 1e-6


def _case():
    return CASE_BUILDERS["mlp_regression_3out"]()


def _oracle_precision(oracle: Oracle, X, sigma, prior_precision, temperature=1.0):
    J = oracle.jacobian(X)
    weights = 1 / (sigma.square() * temperature)
    ggn = torch.einsum("bcp,c,bcq->pq", J, weights, J)
    return ggn + prior_precision * torch.eye(J.shape[-1], dtype=J.dtype)


def _oracle_marglik(oracle: Oracle, X, y, sigma, prior_precision):
    f = oracle.f(oracle.theta, X).detach()
    log_lik = torch.distributions.Normal(f, sigma).log_prob(y).sum()
    precision = _oracle_precision(oracle, X, sigma, prior_precision)
    n_params = len(oracle.theta)
    log_det_ratio = torch.logdet(precision) - n_params * math.log(prior_precision)
    return log_lik - 0.5 * (log_det_ratio + prior_precision * oracle.theta.square().sum())


def _fitted(structure, subset="all", sigma=SIGMA, case=None, **kwargs):
    case = case or _case()
    la = Laplace(case.model, "regression", subset, structure, sigma_noise=sigma, **kwargs)
    la.fit(case.loader())
    return case, la


@pytest.mark.parametrize("temperature", [1.0, 2.0])
@pytest.mark.parametrize("structure", ["full", "diag"])
def test_posterior_precision_weighs_each_output_by_its_noise(structure, temperature):
    case, la = _fitted(structure, prior_precision=0.3, temperature=temperature)
    expected = _oracle_precision(Oracle(case.model, "regression"), case.X, SIGMA, 0.3, temperature)
    assert_close(la.posterior_precision, expected if structure == "full" else expected.diagonal())
    assert la.H.shape[0] == 3 and la.loss.shape == (3,)


def test_kron_of_one_layer_on_one_point_is_exact():
    torch.manual_seed(0)
    model = nn.Linear(4, 3, bias=False).double()
    X, y = torch.randn(1, 4, dtype=torch.float64), torch.randn(1, 3, dtype=torch.float64)
    la = Laplace(model, "regression", "all", "kron", sigma_noise=SIGMA, prior_precision=0.3)
    la.fit(DataLoader(TensorDataset(X, y), batch_size=1))
    expected = _oracle_precision(Oracle(model, "regression"), X, SIGMA, 0.3)
    assert_close(la.posterior_precision.to_matrix(), expected)


@pytest.mark.parametrize("structure", ["full", "diag", "kron"])
def test_last_layer_precision(structure):
    case, la = _fitted(structure, "last_layer", prior_precision=0.3)
    for name, p in case.model.named_parameters():
        p.requires_grad_(name.startswith("2."))
    expected = _oracle_precision(Oracle(case.model, "regression"), case.X, SIGMA, 0.3)
    if structure == "kron":  # a linear head with Λ = diag(1/σ²): exact but for W–b blocks
        n_w = 5 * 3
        expected[:n_w, n_w:] = expected[n_w:, :n_w] = 0
        assert_close(la.posterior_precision.to_matrix(), expected)
    else:
        actual = la.posterior_precision
        assert_close(actual, expected if structure == "full" else expected.diagonal())


def test_subnetwork_precision():
    indices = torch.tensor([1, 4, 9, 22, 30, 37])
    case, la = _fitted("full", "subnetwork", prior_precision=0.3, subnetwork_indices=indices)
    expected = _oracle_precision(Oracle(case.model, "regression"), case.X, SIGMA, 0.3)
    oracle_ggn = expected - 0.3 * torch.eye(len(expected), dtype=torch.float64)
    subnet = oracle_ggn[indices][:, indices] + 0.3 * torch.eye(6, dtype=torch.float64)
    assert_close(la.posterior_precision, subnet)


def test_log_likelihood_has_one_normaliser_per_output():
    case, la = _fitted("diag")
    f = case.model(case.X).detach()
    expected = torch.distributions.Normal(f, SIGMA).log_prob(case.y).sum()
    assert_close(la.log_likelihood, expected)
    la.temperature = 2.0
    residual = 0.5 * (case.y - f).square().sum(0)
    constant = 0.5 * len(case.X) * torch.log(2 * math.pi * SIGMA.square()).sum()
    assert_close(la.log_likelihood, -(residual / SIGMA.square()).sum() / 2.0 - constant)


def test_marginal_likelihood_and_its_gradients_in_every_sigma():
    case, la = _fitted("full")
    oracle = Oracle(case.model, "regression")
    sigma = SIGMA.clone().requires_grad_(True)
    delta = torch.tensor(0.7, dtype=torch.float64, requires_grad=True)
    value = la.log_marginal_likelihood(delta, sigma)
    assert_close(value, _oracle_marglik(oracle, case.X, case.y, SIGMA, 0.7))
    value.backward()
    for c in range(3):
        step = torch.zeros(3, dtype=torch.float64)
        step[c] = FD_STEP
        finite = (
            _oracle_marglik(oracle, case.X, case.y, SIGMA + step, 0.7)
            - _oracle_marglik(oracle, case.X, case.y, SIGMA - step, 0.7)
        ) / (2 * FD_STEP)
        assert_close(sigma.grad[c], finite, rtol=1e-6, atol=1e-6)
    finite = (
        _oracle_marglik(oracle, case.X, case.y, SIGMA, 0.7 + FD_STEP)
        - _oracle_marglik(oracle, case.X, case.y, SIGMA, 0.7 - FD_STEP)
    ) / (2 * FD_STEP)
    assert_close(delta.grad, finite, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("structure", ["diag", "kron"])
def test_marginal_likelihood_gradient_in_sigma_for_diag_and_kron(structure):
    _, la = _fitted(structure)
    sigma = SIGMA.clone().requires_grad_(True)
    la.log_marginal_likelihood(sigma_noise=sigma).backward()
    for c in range(3):
        step = torch.zeros(3, dtype=torch.float64)
        step[c] = FD_STEP
        with torch.no_grad():
            finite = (
                la.log_marginal_likelihood(sigma_noise=SIGMA + step)
                - la.log_marginal_likelihood(sigma_noise=SIGMA - step)
            ) / (2 * FD_STEP)
        assert_close(sigma.grad[c], finite, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("structure", ["full", "diag", "kron"])
def test_equal_noise_per_output_is_one_noise(structure):
    case, per_output = _fitted(structure, sigma=torch.full((3,), 0.8, dtype=torch.float64))
    _, single = _fitted(structure, sigma=0.8)
    expected = single.log_marginal_likelihood().reshape(())
    assert_close(per_output.log_marginal_likelihood(), expected)
    assert_close(per_output(case.X[:4])[1], single(case.X[:4])[1])
    per_output.sigma_noise = 0.8  # one σ for a per-output fit
    assert_close(per_output.log_marginal_likelihood(), expected)


def test_glm_predictive_uses_the_per_output_posterior():
    case, la = _fitted("full", prior_precision=0.3)
    oracle = Oracle(case.model, "regression")
    precision = _oracle_precision(oracle, case.X, SIGMA, 0.3)
    J = oracle.jacobian(case.X[:4])
    _, f_var = la(case.X[:4])
    assert_close(f_var, J @ torch.linalg.inv(precision) @ J.transpose(1, 2))
    assert la.sample(5).shape == (5, len(oracle.theta))


def test_state_dict_round_trip():
    for structure in ("full", "kron"):
        case, la = _fitted(structure)
        fresh = Laplace(case.model, "regression", "all", structure, sigma_noise=SIGMA)
        fresh.load_state_dict(la.state_dict())
        assert_close(fresh.log_marginal_likelihood(), la.log_marginal_likelihood())


def test_refusals_name_what_works():
    case = _case()
    with pytest.raises(ValueError, match="'full', 'diag' and 'kron'"):
        Laplace(case.model, "regression", "all", "lowrank", sigma_noise=SIGMA)
    with pytest.raises(ValueError, match=r"CurvlinopsGGN .*got CurvlinopsEF"):
        Laplace(case.model, "regression", "all", "full", sigma_noise=SIGMA, backend=CurvlinopsEF)
    with pytest.raises(ValueError, match="one sigma_noise for all outputs"):
        FunctionalLaplace(case.model, "regression", n_subset=5, sigma_noise=SIGMA)
    _, la = _fitted("diag", sigma=1.0)
    with pytest.raises(ValueError, match=r"fitted with one σ.*Set sigma_noise first"):
        la.sigma_noise = SIGMA
    assert la.sigma_noise.numel() == 1  # unchanged
    _, la = _fitted("diag")
    with pytest.raises(ValueError, match="sigma_noise has 2 entries"):
        la.log_marginal_likelihood(sigma_noise=SIGMA[:2])
    assert_close(la.sigma_noise, SIGMA)


@pytest.mark.parametrize("backend", ["AsdlGGN", "BackPackGGN"])
def test_third_party_backends_are_refused(backend):
    from laplace import curvature

    case = _case()
    with pytest.raises(ValueError, match="CurvlinopsGGN"):
        Laplace(
            case.model,
            "regression",
            "all",
            "diag",
            sigma_noise=SIGMA,
            backend=getattr(curvature, backend),
        )


def test_monte_carlo_fisher_per_output():
    case = _case()
    torch.manual_seed(0)
    la = Laplace(
        case.model,
        "regression",
        "all",
        "diag",
        sigma_noise=SIGMA,
        backend=CurvlinopsGGN,
        backend_kwargs={"stochastic": True, "num_samples": 2000},
    )
    la.fit(case.loader())
    J = Oracle(case.model, "regression").jacobian(case.X)
    exact = torch.einsum("bcp,bcp->cp", J, J)
    assert_close(la.H, exact, rtol=0.15, atol=0.05 * float(exact.max()))


def test_marglik_training_learns_one_noise_per_output():
    torch.manual_seed(0)
    X = torch.linspace(-2, 2, 120, dtype=torch.float64).unsqueeze(-1)
    noise = torch.tensor([0.05, 0.5], dtype=torch.float64)
    y = torch.cat([torch.sin(2 * X), torch.cos(X)], 1) + noise * torch.randn(120, 2).double()
    model = nn.Sequential(nn.Linear(1, 32), nn.Tanh(), nn.Linear(32, 2)).double()
    loader = DataLoader(TensorDataset(X, y), batch_size=40, shuffle=True)
    la, _, margliks, _ = marglik_training(
        model,
        loader,
        likelihood="regression",
        hessian_structure="kron",
        backend=CurvlinopsGGN,
        n_epochs=150,
        optimizer_kwargs={"lr": 1e-2},
        sigma_noise_init=torch.ones(2, dtype=torch.float64),
    )
    assert la.sigma_noise.shape == (2,)
    assert float(la.sigma_noise[0]) < 0.15 and 0.3 < float(la.sigma_noise[1]) < 0.8
    assert margliks[-1] < margliks[0]


@pytest.mark.parametrize("structure", ["full", "kron"])
def test_online_fit_equals_one_fit_on_all_the_data(structure):
    case, la = _fitted(structure)
    first = DataLoader(TensorDataset(case.X[:12], case.y[:12]), batch_size=5)
    second = DataLoader(TensorDataset(case.X[12:], case.y[12:]), batch_size=5)
    online = Laplace(case.model, "regression", "all", structure, sigma_noise=SIGMA)
    online.fit(first)
    online.fit(second, override=False)
    assert_close(online.log_marginal_likelihood(), la.log_marginal_likelihood())
    assert_close(online.loss, la.loss)


def test_evaluate_and_grid_search_add_each_outputs_noise():
    from laplace.evaluation import evaluate

    case, la = _fitted("diag")
    f_mu, f_var = la(case.X)
    predictive = torch.distributions.MultivariateNormal(f_mu, f_var + torch.diag(SIGMA.square()))
    expected = -predictive.log_prob(case.y).mean()
    assert_close(evaluate(la, case.loader())["nll"], expected)
    la.optimize_prior_precision(
        method="gridsearch", val_loader=case.loader(), grid_size=3, loss="nll"
    )
