"""Low-rank Laplace: eigenpairs against eigh of the dense curvature, posterior against dense."""

from __future__ import annotations

import math

import pytest
import torch
from tests.conftest import CASE_BUILDERS, Oracle, assert_close, dict_case

from laplace import Laplace, LowRankLaplace
from laplace.curvature import CurvlinopsEF, CurvlinopsHessian
from laplace.structures import LowRankPosterior

K = 4
CURVATURES = {
    None: lambda o, c: o.ggn(c.X),
    CurvlinopsEF: lambda o, c: o.ef(c.X, c.y),
    CurvlinopsHessian: lambda o, c: o.hessian(c.X, c.y),
}


def _top_k(H: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    values, vectors = torch.linalg.eigh(H)
    return vectors[:, -k:].flip(1), values[-k:].flip(0)


def _assert_same_eigenpairs(U, lam, U_ref, lam_ref):
    assert_close(lam, lam_ref, rtol=1e-8, atol=1e-9)
    # Eigenvectors up to sign.
    assert_close((U * (U * U_ref).sum(0).sign()), U_ref, rtol=0, atol=1e-6)


@pytest.mark.parametrize("solver", ["lanczos", "lobpcg"])
@pytest.mark.parametrize("backend", list(CURVATURES), ids=["ggn", "ef", "hessian"])
@pytest.mark.parametrize("case_name", ["mlp_regression_3out", "mlp_classification"])
def test_eigenpairs_match_dense_top_k(case_name, backend, solver):
    case = CASE_BUILDERS[case_name]()
    oracle = Oracle(case.model, case.likelihood)
    la = LowRankLaplace(
        case.model,
        case.likelihood,
        backend=backend,
        backend_kwargs={"n_eigenvalues": K, "solver": solver, "tol": 1e-12},
    )
    la.fit(case.loader())
    U_ref, lam_ref = _top_k(CURVATURES[backend](oracle, case), K)
    _assert_same_eigenpairs(*la.H, U_ref, lam_ref)
    assert_close(la.loss, oracle.loss(case.X, case.y))


def _dense_from_rank_k(la):
    (U, lam), prior = la.posterior_precision
    return U @ torch.diag(lam) @ U.T + torch.diag(prior)


@pytest.mark.parametrize("case_name", ["mlp_regression_3out", "mlp_classification"])
def test_marglik_and_predictive_equal_dense_rank_k_posterior(case_name):
    case = CASE_BUILDERS[case_name]()
    oracle = Oracle(case.model, case.likelihood)
    sigma = 0.8 if case.likelihood == "regression" else 1.0
    prior = torch.linspace(0.5, 2.0, len(oracle.theta), dtype=torch.float64)
    la = Laplace(
        case.model,
        case.likelihood,
        subset_of_weights="all",
        hessian_structure="lowrank",
        sigma_noise=sigma,
        prior_precision=prior,
        backend_kwargs={"low_rank": K},
    )
    assert isinstance(la, LowRankLaplace)
    la.fit(case.loader())
    U, lam = la.H
    assert U.shape == (len(oracle.theta), K)
    P = U @ torch.diag(lam / sigma**2) @ U.T + torch.diag(prior)
    assert_close(_dense_from_rank_k(la), P)
    assert_close(la.log_det_posterior_precision, torch.logdet(P))
    loss = oracle.loss(case.X, case.y)
    log_lik = -loss / sigma**2
    if case.likelihood == "regression":
        log_lik = log_lik - 0.5 * case.X.shape[0] * case.n_outputs * math.log(
            2 * math.pi * sigma**2
        )
    scatter = (oracle.theta.square() * prior).sum()
    expected = log_lik - 0.5 * (torch.logdet(P) - prior.log().sum() + scatter)
    assert_close(la.log_marginal_likelihood(), expected)
    delta = torch.randn(len(oracle.theta), dtype=torch.float64)
    assert_close(la.square_norm(la.mean + delta), delta @ P @ delta)
    J = oracle.jacobian(case.X[:5])
    cov = torch.linalg.inv(P)
    assert_close(la.functional_variance(J), J @ cov @ J.transpose(1, 2))
    J_flat = J.reshape(-1, J.shape[-1])
    assert_close(la.functional_covariance(J), J_flat @ cov @ J_flat.T)
    _, f_var = la._glm_predictive_distribution(case.X[:5])
    assert_close(f_var, J @ cov @ J.transpose(1, 2))
    # V and Kinv give the same Woodbury form as laplace-torch's functional variance.
    JV = J @ la.V
    woodbury = torch.einsum("ncp,nkp->nck", J / prior, J) - JV @ la.Kinv @ JV.transpose(1, 2)
    assert_close(woodbury, J @ cov @ J.transpose(1, 2))


def test_sample_statistics():
    case = CASE_BUILDERS["mlp_regression_1out"]()
    la = LowRankLaplace(
        case.model, "regression", prior_precision=2.0, backend_kwargs={"n_eigenvalues": 3}
    )
    la.fit(case.loader())
    n = 20_000
    samples = la.sample(n, generator=torch.Generator().manual_seed(0))
    assert samples.shape == (n, la.n_params)
    cov = torch.linalg.inv(_dense_from_rank_k(la))
    scale = cov.diagonal().max()
    assert_close(torch.cov(samples.T), cov, rtol=0, atol=5 * scale * math.sqrt(2 / n))
    assert_close(samples.mean(0), la.mean, rtol=0, atol=5 * (scale / n).sqrt())


def test_dict_inputs_and_state_dict(tmp_path):
    model, loader = dict_case()
    la = LowRankLaplace(model, "classification", backend_kwargs={"n_eigenvalues": 3})
    la.fit(loader)
    torch.save(la.state_dict(), tmp_path / "la.pt")
    other = LowRankLaplace(model, "classification", backend_kwargs={"n_eigenvalues": 3})
    other.load_state_dict(torch.load(tmp_path / "la.pt", weights_only=True))
    assert_close(other.H[0], la.H[0])
    assert_close(other.eigenvalue_errors, la.eigenvalue_errors)
    assert_close(other.log_marginal_likelihood(), la.log_marginal_likelihood())


def test_errors():
    case = CASE_BUILDERS["mlp_regression_1out"]()
    with pytest.raises(ValueError, match="solver"):
        LowRankLaplace(case.model, "regression", backend_kwargs={"solver": "power"})
    with pytest.raises(ValueError, match="n_eigenvalues"):
        LowRankLaplace(case.model, "regression", backend_kwargs={"n_eigenvalues": 0})
    la = LowRankLaplace(case.model, "regression", backend_kwargs={"n_eigenvalues": 100})
    with pytest.raises(ValueError, match="n_eigenvalues"):
        la.fit(case.loader())
    la = LowRankLaplace(case.model, "regression", backend_kwargs={"n_eigenvalues": 2})
    with pytest.raises(ValueError, match="override"):
        la.fit(case.loader(), override=False)
    with pytest.raises(RuntimeError, match="fit"):
        la.log_marginal_likelihood()
    with pytest.raises(NotImplementedError, match="whole training set"):
        LowRankPosterior.batch_curvature(None, None, None, 0)


@pytest.mark.parametrize("backend", list(CURVATURES), ids=["ggn", "ef", "hessian"])
@pytest.mark.parametrize("case_name", ["mlp_regression_3out", "mlp_classification"])
def test_default_block_krylov_solver_matches_dense_top_k(case_name, backend):
    case = CASE_BUILDERS[case_name]()
    oracle = Oracle(case.model, case.likelihood)
    la = LowRankLaplace(
        case.model,
        case.likelihood,
        backend=backend,
        backend_kwargs={"n_eigenvalues": K, "oversampling": 2, "max_iter": 20, "tol": 1e-9},
    )
    la.fit(case.loader())
    assert la.n_params > K + 2  # the block does not span the whole space
    U_ref, lam_ref = _top_k(CURVATURES[backend](oracle, case), K)
    _assert_same_eigenpairs(*la.H, U_ref, lam_ref)
    assert la.eigenvalue_errors.shape == (K,) and bool((la.eigenvalue_errors <= 1e-8).all())


@pytest.mark.parametrize("case_name", ["mlp_regression_3out", "cnn_classification"])
def test_glm_predictive_needs_no_jacobians(case_name, monkeypatch):
    case = CASE_BUILDERS[case_name]()
    oracle = Oracle(case.model, case.likelihood)
    prior = torch.linspace(0.5, 2.0, len(oracle.theta), dtype=torch.float64)
    la = LowRankLaplace(
        case.model, case.likelihood, prior_precision=prior, backend_kwargs={"n_eigenvalues": K}
    )
    la.fit(case.loader())
    monkeypatch.setattr(la.backend, "jacobians", None)  # any Jacobian call would fail
    J = oracle.jacobian(case.X[:5])
    expected = J @ torch.linalg.inv(_dense_from_rank_k(la)) @ J.transpose(1, 2)
    f_mu, f_var = la._glm_predictive_distribution(case.X[:5])
    assert_close(f_var, expected)
    assert_close(f_mu, oracle.f(oracle.theta, case.X[:5]))


@pytest.mark.parametrize("structure", ["diag", "lowrank"])
def test_glm_predictive_of_grouped_convolutions_falls_back_to_jacobians(structure):
    """The layer-wise route models ungrouped layers only; grouped ones take the Jacobians."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv1d(2, 4, 3, groups=2),
        torch.nn.Tanh(),
        torch.nn.Flatten(),
        torch.nn.Linear(20, 3),
    ).double()
    X = torch.randn(10, 2, 7, dtype=torch.float64)
    y = torch.randint(0, 3, (10,))
    kwargs = {"backend_kwargs": {"n_eigenvalues": K}} if structure == "lowrank" else {}
    la = Laplace(model, "classification", "all", structure, prior_precision=0.7, **kwargs)
    la.fit(torch.utils.data.DataLoader(torch.utils.data.TensorDataset(X, y), batch_size=5))
    J = Oracle(model, "classification").jacobian(X[:3])
    _, f_var = la._glm_predictive_distribution(X[:3])
    assert_close(f_var, la.functional_variance(J))
