"""Subnetwork Laplace against dense float64 oracles restricted to the selected indices."""

from __future__ import annotations

import math

import pytest
import torch

from conftest import CASE_BUILDERS, Oracle, assert_close
from laplace import DiagSubnetLaplace, FullSubnetLaplace, Laplace, SubnetLaplace
from laplace.curvature import CurvlinopsEF, CurvlinopsHessian

STRUCTURES = {"full": FullSubnetLaplace, "diag": DiagSubnetLaplace}


def _indices(n_params: int, k: int, seed: int = 0) -> torch.Tensor:
    # Unsorted on purpose: the posterior follows the order of the given indices.
    return torch.randperm(n_params, generator=torch.Generator().manual_seed(seed))[:k]


def _dense_posterior(case, oracle, idx, structure, prior=1.0, sigma=1.0, backend=None):
    G = oracle.ef(case.X, case.y) if backend is CurvlinopsEF else oracle.ggn(case.X)
    H = G[idx][:, idx]
    if structure == "diag":
        H = torch.diag(H.diagonal())
    return H, H / sigma**2 + prior * torch.eye(len(idx), dtype=H.dtype)


@pytest.mark.parametrize("structure", list(STRUCTURES))
@pytest.mark.parametrize("case_name", ["mlp_regression_3out", "mlp_classification"])
@pytest.mark.parametrize("backend", [None, CurvlinopsEF], ids=["ggn", "ef"])
def test_subnet_posterior_matches_restricted_oracle(structure, case_name, backend):
    case = CASE_BUILDERS[case_name]()
    oracle = Oracle(case.model, case.likelihood)
    idx = _indices(len(oracle.theta), 9)
    sigma = 0.7 if case.likelihood == "regression" else 1.0
    la = Laplace(
        case.model,
        case.likelihood,
        subset_of_weights="subnetwork",
        hessian_structure=structure,
        subnetwork_indices=idx,
        sigma_noise=sigma,
        prior_precision=0.5,
        backend=backend,
    )
    assert isinstance(la, STRUCTURES[structure]) and isinstance(la, SubnetLaplace)
    la.fit(case.loader())
    H, P = _dense_posterior(case, oracle, idx, structure, 0.5, sigma, backend)
    assert_close(la.H if structure == "full" else torch.diag(la.H), H)
    assert la.mean.shape == oracle.theta.shape and la.n_params == len(oracle.theta)
    assert la.n_params_subnet == 9
    assert_close(la.mean_subnet, oracle.theta[idx])
    assert_close(la.log_det_posterior_precision, torch.logdet(P))
    # marglik with the dense oracle
    loss = oracle.loss(case.X, case.y)
    if case.likelihood == "regression":
        n_c = case.X.shape[0] * case.n_outputs
        log_lik = -loss / sigma**2 - 0.5 * n_c * math.log(2 * math.pi * sigma**2)
    else:
        log_lik = -loss
    scatter = 0.5 * oracle.theta[idx].square().sum()
    expected = log_lik - 0.5 * (torch.logdet(P) - 9 * math.log(0.5) + scatter)
    assert_close(la.log_marginal_likelihood(), expected)
    # GLM predictive: J_S P⁻¹ J_Sᵀ
    J = oracle.jacobian(case.X[:4])[:, :, idx]
    f_var = J @ torch.linalg.inv(P) @ J.transpose(1, 2)
    if case.likelihood == "regression":
        f_mu, var = la(case.X[:4])
        assert_close(var, f_var)
        assert_close(f_mu, oracle.f(oracle.theta, case.X[:4]))
    else:
        _, var = la._glm_predictive_distribution(case.X[:4])
        assert_close(var, f_var)


@pytest.mark.parametrize("structure", list(STRUCTURES))
def test_samples_are_full_vectors_with_map_outside_the_subnetwork(structure):
    case = CASE_BUILDERS["mlp_regression_1out"]()
    oracle = Oracle(case.model, case.likelihood)
    idx = _indices(len(oracle.theta), 6, seed=3)
    la = STRUCTURES[structure](case.model, "regression", subnetwork_indices=idx)
    la.fit(case.loader())
    n = 20_000
    samples = la.sample(n, generator=torch.Generator().manual_seed(0))
    assert samples.shape == (n, len(oracle.theta))
    others = torch.ones(len(oracle.theta), dtype=torch.bool)
    others[idx] = False
    assert torch.equal(samples[:, others], oracle.theta[others].expand(n, -1))
    _, P = _dense_posterior(case, oracle, idx, structure)
    cov = torch.linalg.inv(P)
    scale = cov.diagonal().max()
    # Monte-Carlo error of a covariance entry: ~ scale · sqrt(2 / n); allow 5 standard errors.
    assert_close(torch.cov(samples[:, idx].T), cov, rtol=0, atol=5 * scale * math.sqrt(2 / n))
    assert_close(
        samples[:, idx].mean(0), oracle.theta[idx], rtol=0, atol=5 * scale.sqrt() / n**0.5
    )


def test_nn_predictive_uses_assembled_samples():
    case = CASE_BUILDERS["mlp_classification"]()
    idx = torch.tensor([0, 5, 11, 30, 40])
    la = FullSubnetLaplace(case.model, "classification", subnetwork_indices=idx)
    la.fit(case.loader())
    probs = la(
        case.X[:3],
        pred_type="nn",
        link_approx="mc",
        n_samples=7,
        generator=torch.Generator().manual_seed(1),
    )
    thetas = la.sample(7, generator=torch.Generator().manual_seed(1))
    oracle = Oracle(case.model, "classification")
    expected = torch.stack([torch.softmax(oracle.f(t, case.X[:3]), -1) for t in thetas]).mean(0)
    assert_close(probs, expected)
    assert_close(la.assemble_full_samples(la.mean_subnet[None])[0], oracle.theta)


def test_prior_structures_and_tuning():
    case = CASE_BUILDERS["mlp_regression_3out"]()
    idx = torch.tensor([1, 4, 9, 17, 30])
    la = FullSubnetLaplace(case.model, "regression", subnetwork_indices=idx)
    la.fit(case.loader())
    la.prior_precision = torch.arange(1.0, 6.0, dtype=torch.float64)
    assert la.prior_precision_diag.shape == (5,)
    with pytest.raises(ValueError, match="diagonal"):
        la.prior_precision = torch.ones(la.n_layers, dtype=torch.float64)
    with pytest.raises(ValueError, match="n_params=5"):
        la.prior_mean = torch.zeros(la.n_params, dtype=torch.float64)
    la.optimize_prior_precision(method="marglik", prior_structure="diag", n_steps=3)
    assert la.prior_precision.shape == (5,)
    la.optimize_prior_precision(method="marglik", n_steps=3)
    assert la.prior_precision.shape == (1,)
    with pytest.raises(ValueError, match="layerwise"):
        la.optimize_prior_precision(method="marglik", prior_structure="layerwise")


@pytest.mark.parametrize(
    ("bad", "match"),
    [
        (None, "needs subnetwork_indices"),
        ([0, 1], "torch.long"),
        (torch.tensor([0.0, 1.0]), "torch.long"),
        (torch.tensor([], dtype=torch.long), "non-empty"),
        (torch.tensor([[0, 1]]), "1-D"),
        (torch.tensor([0, 1000]), "n_params"),
        (torch.tensor([-1, 2]), "n_params"),
        (torch.tensor([3, 3]), "duplicate"),
    ],
)
def test_invalid_indices_are_refused(bad, match):
    case = CASE_BUILDERS["mlp_regression_1out"]()
    with pytest.raises(ValueError, match=match):
        Laplace(
            case.model,
            "regression",
            subset_of_weights="subnetwork",
            hessian_structure="full",
            subnetwork_indices=bad,
        )


def test_factory_and_backend_errors():
    case = CASE_BUILDERS["mlp_regression_1out"]()
    with pytest.raises(ValueError, match="needs subnetwork_indices"):
        Laplace(case.model, "regression", subset_of_weights="subnetwork", hessian_structure="diag")
    with pytest.raises(ValueError, match="GGN or empirical-Fisher"):
        FullSubnetLaplace(
            case.model, "regression", torch.tensor([0, 1]), backend=CurvlinopsHessian
        )
    with pytest.raises(ValueError, match="asdl_fisher_kwargs"):
        FullSubnetLaplace(case.model, "regression", torch.tensor([0]), asdl_fisher_kwargs={})
    with pytest.raises(ValueError, match="kron"):
        Laplace(
            case.model,
            "regression",
            subset_of_weights="subnetwork",
            hessian_structure="kron",
            subnetwork_indices=torch.tensor([0]),
        )


@pytest.mark.parametrize("structure", list(STRUCTURES))
def test_state_dict_round_trip(structure, tmp_path):
    case = CASE_BUILDERS["mlp_classification"]()
    idx = torch.tensor([2, 7, 8, 20])
    la = STRUCTURES[structure](
        case.model, "classification", subnetwork_indices=idx, prior_precision=2.0
    )
    la.fit(case.loader())
    torch.save(la.state_dict(), tmp_path / "la.pt")
    state = torch.load(tmp_path / "la.pt", weights_only=True)
    other = STRUCTURES[structure](case.model, "classification", subnetwork_indices=idx)
    other.load_state_dict(state)
    assert_close(other.H, la.H)
    assert_close(other.log_marginal_likelihood(), la.log_marginal_likelihood())
    wrong = STRUCTURES[structure](
        case.model, "classification", subnetwork_indices=torch.tensor([2, 7, 8, 21])
    )
    with pytest.raises(ValueError, match="subnetwork_indices"):
        wrong.load_state_dict(state)
