"""Function-space (GP) Laplace: the subset-of-data ``FunctionalLaplace``."""

from __future__ import annotations

import io

import pytest
import torch
from functional_cases import fitted_gp

from conftest import CASE_BUILDERS, Oracle, assert_close
from laplace import FullLaplace, Laplace
from laplace.baselaplace import BaseFunctionalLaplace, FunctionalLaplace
from laplace.lllaplace import FunctionalLLLaplace


@pytest.mark.parametrize("subset", ["all", "last_layer"])
def test_whole_data_subset_equals_the_full_laplace_glm_predictive(subset):
    case = CASE_BUILDERS["mlp_regression_3out"]()
    kwargs = {"sigma_noise": 0.6, "prior_precision": 1.7, "temperature": 0.9}
    gp = fitted_gp(case, subset, **kwargs)
    assert isinstance(gp, FunctionalLaplace if subset == "all" else FunctionalLLLaplace)
    full = Laplace(case.model, "regression", subset, "full", **kwargs)
    full.fit(case.loader())
    X_test = torch.randn(5, 3, dtype=torch.float64)
    for a, b in zip(gp(X_test), full(X_test)):
        assert_close(a, b, rtol=1e-6, atol=1e-10)
    for a, b in zip(gp(X_test, joint=True), full(X_test, joint=True)):
        assert_close(a, b, rtol=1e-6, atol=1e-10)
    assert_close(gp(X_test, diagonal_output=True)[1], full(X_test, diagonal_output=True)[1])
    assert_close(gp.gp_kernel_prior_variance, 1 / torch.tensor([1.7], dtype=torch.float64))


def test_gp_marglik_regression_equals_the_exact_gp_evidence():
    case = CASE_BUILDERS["mlp_regression_1out"]()
    gp = fitted_gp(case, sigma_noise=0.5, prior_precision=2.0)
    oracle = Oracle(case.model, "regression")
    J = oracle.jacobian(case.X)[:, 0]
    f = oracle.f(oracle.theta, case.X).detach()
    cov = J @ J.T / 2.0 + 0.25 * torch.eye(len(case.X), dtype=torch.float64)
    mu = (case.y - f).reshape(-1) + J @ oracle.theta
    expected_log_det = torch.logdet(cov)
    expected_scatter = mu @ torch.linalg.solve(cov, mu)
    assert_close(gp.log_det_ratio, expected_log_det)
    assert_close(gp.scatter, expected_scatter, rtol=1e-6)
    lml = gp.log_likelihood - 0.5 * (expected_log_det + expected_scatter)
    assert_close(gp.log_marginal_likelihood(), lml, rtol=1e-6)


def test_marglik_is_differentiable_and_prior_tuning_runs():
    case = CASE_BUILDERS["mlp_regression_1out"]()
    gp = fitted_gp(case, n_subset=12)
    log_prior = torch.zeros(1, dtype=torch.float64, requires_grad=True)
    log_sigma = torch.zeros(1, dtype=torch.float64, requires_grad=True)
    lml = gp.log_marginal_likelihood(log_prior.exp(), log_sigma.exp())
    lml.backward()
    assert log_prior.grad.abs() > 0 and log_sigma.grad.abs() > 0
    gp.sigma_noise = 1.0
    with pytest.warns(UserWarning, match="discouraged, rather use method=.CV."):
        gp.optimize_prior_precision(method="marglik", n_steps=5)
    assert gp.prior_precision.shape == (1,)
    gp.optimize_prior_precision(method="gridsearch", val_loader=case.loader(), grid_size=5)
    assert gp.prior_precision.shape == (1,)


@pytest.mark.parametrize("independent_outputs", [False, True])
@pytest.mark.parametrize("link_approx", ["probit", "bridge", "bridge_norm", "mc"])
def test_classification_predictive(independent_outputs, link_approx):
    case = CASE_BUILDERS["mlp_classification"]()
    gp = fitted_gp(case, n_subset=10, independent_outputs=independent_outputs)
    probs = gp(case.X[:4], link_approx=link_approx, generator=torch.Generator().manual_seed(0))
    assert probs.shape == (4, 4)
    assert_close(probs.sum(-1), torch.ones(4, dtype=torch.float64))
    mean, var = gp.predictive_moments(case.X[:4])
    assert mean.shape == (4, 4) and var.shape == (4, 4, 4)
    assert torch.isfinite(gp.log_marginal_likelihood())
    samples = gp.predictive_samples(case.X[:4], n_samples=6)
    assert samples.shape == (6, 4, 4)


def test_independent_outputs_keeps_the_diagonal_of_the_kernel():
    case = CASE_BUILDERS["mlp_regression_3out"]()
    with pytest.warns(UserWarning, match="diagonal approximation of a GP kernel"):
        gp = fitted_gp(case, independent_outputs=True)
    _, f_var = gp(case.X[:3])
    assert f_var.shape == (3, 3, 3)
    off_diagonal = f_var - torch.diag_embed(f_var.diagonal(dim1=1, dim2=2))
    assert off_diagonal.abs().max() == 0
    # Each output is an exact GP with the kernel J_c J_cᵀ / δ (M = N).
    J = Oracle(case.model, "regression").jacobian(case.X)
    Js = Oracle(case.model, "regression").jacobian(case.X[:3])
    for c in range(3):
        K = J[:, c] @ J[:, c].T
        k = Js[:, c] @ J[:, c].T
        expected = (Js[:, c].square().sum(-1)) - (
            k @ torch.linalg.solve(K + torch.eye(20, dtype=torch.float64), k.T)
        ).diagonal()
        assert_close(f_var[:, c, c], expected, rtol=1e-6)


def test_functional_samples_and_joint_shapes():
    case = CASE_BUILDERS["mlp_regression_3out"]()
    gp = fitted_gp(case, n_subset=8)
    g = torch.Generator().manual_seed(0)
    assert gp.functional_samples(case.X[:4], n_samples=5, generator=g).shape == (5, 4, 3)
    joint = gp.functional_samples(case.X[:4], n_samples=5, joint=True, diagonal_output=True)
    assert joint.shape == (5, 4, 3)
    f_mu, f_cov = gp.predictive_moments(case.X[:4], joint=True)
    assert f_mu.shape == (12,) and f_cov.shape == (12, 12)


def test_enable_backprop_gradients_equal_finite_differences():
    case = CASE_BUILDERS["mlp_regression_3out"]()
    gp = fitted_gp(case, n_subset=10, enable_backprop=True)
    x = case.X[:2].clone().requires_grad_()

    def objective(inputs):
        f_mu, f_var = gp(inputs)
        return f_mu.sum() + f_var.sum()

    (grad,) = torch.autograd.grad(objective(x), x)
    eps = 1e-6
    numeric = torch.zeros_like(x)
    for i in range(x.numel()):
        step = torch.zeros(x.numel(), dtype=x.dtype)
        step[i] = eps
        step = step.view_as(x)
        numeric.view(-1)[i] = (objective(x + step) - objective(x - step)).detach() / (2 * eps)
    assert_close(grad, numeric, rtol=1e-5, atol=1e-7)


def test_state_dict_round_trip():
    case = CASE_BUILDERS["mlp_regression_3out"]()
    gp = fitted_gp(case, n_subset=8, sigma_noise=0.8)
    buffer = io.BytesIO()
    torch.save(gp.state_dict(), buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)
    fresh = FunctionalLaplace(case.model, "regression", n_subset=3)
    fresh.load_state_dict(state)
    for a, b in zip(fresh(case.X[:3]), gp(case.X[:3])):
        assert_close(a, b)
    assert_close(fresh.log_marginal_likelihood(), gp.log_marginal_likelihood())
    with pytest.raises(ValueError):
        FullLaplace(case.model, "regression").load_state_dict(state)


def test_bad_input_is_refused_clearly():
    case = CASE_BUILDERS["mlp_regression_1out"]()
    gp = Laplace(case.model, "regression", "all", "gp", n_subset=50)
    assert isinstance(gp, BaseFunctionalLaplace)
    with pytest.raises(RuntimeError, match="call fit"):
        gp(case.X[:2])
    with pytest.raises(ValueError, match="larger than the training set"):
        gp.fit(case.loader())
    with pytest.raises(ValueError, match="subnetwork"):
        Laplace(
            case.model,
            "regression",
            "subnetwork",
            "gp",
            n_subset=5,
            subnetwork_indices=torch.tensor([0]),
        )
    with pytest.raises(ValueError, match="reward_modeling"):
        Laplace(case.model, "reward_modeling", "all", "gp", n_subset=5)
    with pytest.raises(ValueError, match="isotropic"):
        FunctionalLaplace(case.model, "regression", n_subset=5, prior_precision=torch.ones(4))
    with pytest.raises(ValueError, match="n_subset"):
        FunctionalLaplace(case.model, "regression", n_subset=0)
    with pytest.raises(ValueError, match="functional_approximation"):
        Laplace(case.model, "regression", "all", "gp", functional_approximation="exact")
    with pytest.raises(ValueError, match="subset_of_weights='all'"):
        Laplace(case.model, "regression", "last_layer", "gp", functional_approximation="nystrom")
    gp = fitted_gp(case, n_subset=5)
    with pytest.raises(ValueError, match="pred_type='gp'"):
        gp(case.X[:2], pred_type="glm")
    with pytest.raises(ValueError, match="at least one input"):
        gp(case.X[:0])


def test_data_loader_with_dict_batches():
    from conftest import dict_case

    model, loader = dict_case()
    gp = Laplace(model, "classification", "all", "gp", n_subset=10)
    gp.fit(loader)
    batch = next(iter(loader))
    assert gp(batch).shape == (5, 2)
