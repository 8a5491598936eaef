"""Low-rank Laplace and the diagonal-plus-low-rank (INF) posterior against dense float64 oracles.

Low rank: eigenpairs against eigh of the dense curvature, the posterior against the dense
rank-k one. INF: ``P = U diag(h·λ) Uᵀ + h·max(diag(H) − diag(U diag(λ) Uᵀ), 0) + diag(p₀)``:
its diagonal is the exact curvature's, and its log-determinant, covariance, GLM variances and
samples are those of that dense matrix.
"""

from __future__ import annotations

import io
import math

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from conftest import (
    CASE_BUILDERS,
    Oracle,
    assert_close,
    assert_marglik_gradient_matches_finite_differences,
    assert_marglik_matches,
    dict_case,
)
from laplace import DiagLowRankLaplace, FullLaplace, Laplace, LowRankLaplace
from laplace.curvature import CurvlinopsEF, CurvlinopsHessian
from laplace.curvature.solvers import products
from laplace.structures import LowRankPosterior
from laplace.structures.diagonal import DiagonalPosterior
from laplace.structures.jacobians import LayerTrace
from laplace.structures.low_rank import lowrank_functional_variance

RTOL, ATOL = 1e-8, 1e-10


#: Monte-Carlo tolerance of a sample correlation: about 5 standard errors of 20,000 draws.
MC_DRAWS, MC_ATOL = 20_000, 0.04


K = 4


EXACT = {"n_eigenvalues": K, "solver": "lanczos"}


def loader(X, y, batch_size: int = 6) -> DataLoader:
    return DataLoader(TensorDataset(X, y), batch_size=batch_size)


def fitted(name: str, backend=None, prior_precision=1.0, solver=EXACT):
    case = CASE_BUILDERS[name]()
    la = DiagLowRankLaplace(
        case.model,
        case.likelihood,
        backend=backend,
        prior_precision=prior_precision,
        backend_kwargs=solver,
    )
    la.fit(loader(case.X, case.y))
    return case, la


def dense_curvature(la) -> torch.Tensor:
    """``U diag(λ) Uᵀ + max(diag(H) − diag(U diag(λ) Uᵀ), 0)``, σ-free."""
    U, eigenvalues, diagonal = la.H
    low_rank = U @ torch.diag(eigenvalues) @ U.T
    return low_rank + torch.diag((diagonal - low_rank.diagonal()).clamp(min=0))


def dense_precision(la) -> torch.Tensor:
    h = 1 / (la.sigma_noise.square() * la.temperature)
    return h * dense_curvature(la) + torch.diag(la.prior_precision_diag)


CASES = ["mlp_classification", "cnn_classification", "mlp_regression_3out"]


@pytest.mark.parametrize("family", ["ggn", "ef"])
@pytest.mark.parametrize("name", CASES)
def test_the_diagonal_is_the_exact_curvatures_and_the_top_directions_are_kept(name, family):
    case, la = fitted(name, backend=CurvlinopsEF if family == "ef" else None)
    oracle = Oracle(case.model, case.likelihood)
    exact = oracle.ef(case.X, case.y) if family == "ef" else oracle.ggn(case.X)
    U, eigenvalues, diagonal = la.H
    assert_close(diagonal, exact.diagonal(), RTOL, ATOL)
    # Lanczos: the exact top-k eigenpairs, so the correction is never clipped
    values, vectors = torch.linalg.eigh(exact)
    assert_close(eigenvalues, values.flip(0)[:K], 1e-7, 1e-9)
    assert_close((U.T @ vectors[:, -K:].flip(1)).abs(), torch.eye(K, dtype=U.dtype), 1e-6, 1e-6)
    (_, _), D = la.posterior_precision
    assert_close(dense_precision(la).diagonal(), exact.diagonal() + la.prior_precision_diag)
    assert_close(D, la._posterior.correction + la.prior_precision_diag)
    assert (la._posterior.correction >= 0).all()


@pytest.mark.parametrize("name", ["mlp_classification", "cnn_classification"])
def test_the_diagonal_from_the_eigensolvers_kept_batches_is_exact(name, monkeypatch):
    passes = []
    original = DiagonalPosterior.batch_curvature.__func__
    monkeypatch.setattr(
        DiagonalPosterior,
        "batch_curvature",
        classmethod(lambda cls, *a: passes.append(1) or original(cls, *a)),
    )
    case, la = fitted(name, solver={"n_eigenvalues": K})  # randomized: batches kept
    assert not passes  # no diag pass
    exact = Oracle(case.model, case.likelihood).ggn(case.X).diagonal()
    assert_close(la.H[2], exact, RTOL, ATOL)
    monkeypatch.setattr(products, "PASS_CACHE_BYTES", 0)  # none kept: recorded once more
    _, la = fitted(name, solver={"n_eigenvalues": K})
    assert not passes
    assert_close(la.H[2], exact, RTOL, ATOL)
    fitted(name, solver=EXACT)  # Lanczos on curvlinops' operator: one diag pass
    assert passes


def test_correction_is_clipped_where_approximate_eigenpairs_overshoot():
    _, la = fitted("mlp_classification", solver={"n_eigenvalues": K})  # KFAC start
    U, eigenvalues, diagonal = la.H
    raw = diagonal - U.square() @ eigenvalues
    assert_close(la._posterior.correction, raw.clamp(min=0))


@pytest.mark.parametrize("name", ["mlp_classification", "mlp_regression_3out"])
def test_marglik_and_its_gradients_equal_full_laplace_on_the_dense_matrix(name):
    case, la = fitted(name, solver={"n_eigenvalues": K})
    full = FullLaplace(case.model, case.likelihood)
    full.fit(loader(case.X, case.y))
    full.H = dense_curvature(la)
    priors = (
        [0.7],
        torch.linspace(0.5, 2.0, la.n_layers).tolist(),
        [0.5 + i / la.n_params for i in range(la.n_params)],
    )
    assert_marglik_matches(la, full, case.likelihood, priors)


def test_marglik_gradient_equals_finite_differences():
    _, la = fitted("mlp_regression_3out", solver={"n_eigenvalues": K})
    assert_marglik_gradient_matches_finite_differences(la)


@pytest.mark.parametrize("name", ["mlp_classification", "cnn_classification"])
def test_glm_variance_is_jacobian_free_and_matches_the_dense_reference(name):
    case, la = fitted(name, prior_precision=0.5, solver={"n_eigenvalues": K})
    J = Oracle(case.model, case.likelihood).jacobian(case.X)
    expected = J @ torch.linalg.inv(dense_precision(la)) @ J.transpose(1, 2)
    trace = la.backend.trace(case.X)
    f_var = lowrank_functional_variance(la._posterior, LayerTrace(trace))
    assert f_var is not None
    assert_close(f_var, expected, rtol=1e-8, atol=1e-12)
    _, f_var = la._functional_moments(case.X)
    assert_close(f_var, expected, rtol=1e-8, atol=1e-12)


def test_samples_have_the_dense_posterior_covariance():
    _, la = fitted("mlp_regression_3out", prior_precision=2.0, solver={"n_eigenvalues": K})
    covariance = torch.linalg.inv(dense_precision(la))
    scale = la._posterior.scale
    assert_close(scale @ scale.T, covariance, rtol=1e-8, atol=1e-12)
    samples = la.sample(MC_DRAWS, generator=torch.Generator().manual_seed(0))
    empirical = torch.cov((samples - la.mean).T)
    std = covariance.diagonal().sqrt()
    assert ((empirical - covariance) / torch.outer(std, std)).abs().max() < MC_ATOL


def test_state_dict_round_trip():
    case, la = fitted("cnn_classification", prior_precision=0.3, solver={"n_eigenvalues": K})
    buffer = io.BytesIO()
    torch.save(la.state_dict(), buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True, map_location="cpu")
    other = DiagLowRankLaplace(case.model, case.likelihood, prior_precision=0.3)
    other.load_state_dict(state)
    assert torch.equal(other.log_marginal_likelihood(), la.log_marginal_likelihood())
    assert torch.equal(other(case.X[:3]), la(case.X[:3]))
    lowrank = LowRankLaplace(case.model, case.likelihood, backend_kwargs={"n_eigenvalues": K})
    lowrank.fit(loader(case.X, case.y))
    with pytest.raises(ValueError, match="cls_name is 'LowRankLaplace'"):
        other.load_state_dict(lowrank.state_dict())
    state["H"] = {k: v for k, v in state["H"].items() if k != "diagonal"}
    with pytest.raises(ValueError, match="'diagonal'"):
        other.load_state_dict(state)


def test_online_fit_keeps_the_earlier_low_rank_part_and_the_exact_diagonal():
    case = CASE_BUILDERS["mlp_regression_3out"]()
    first, second = slice(0, 12), slice(12, None)
    la = DiagLowRankLaplace(case.model, case.likelihood, backend_kwargs=EXACT)
    la.fit(loader(case.X[first], case.y[first]))
    U0, eigenvalues0, _ = la.H
    la.fit(loader(case.X[second], case.y[second]), override=False)
    oracle = Oracle(case.model, case.likelihood)
    _, eigenvalues, diagonal = la.H
    assert_close(diagonal, oracle.ggn(case.X).diagonal(), RTOL, ATOL)
    operator = oracle.ggn(case.X[second]) + U0 @ torch.diag(eigenvalues0) @ U0.T
    assert_close(eigenvalues, torch.linalg.eigvalsh(operator).flip(0)[:K], 1e-7, 1e-9)
    assert la.n_data == len(case.X)


def test_factory_and_refusals():
    case = CASE_BUILDERS["mlp_classification"]()
    la = Laplace(
        case.model, "classification", subset_of_weights="all", hessian_structure="diag_lowrank"
    )
    assert isinstance(la, DiagLowRankLaplace) and isinstance(la, LowRankLaplace)
    with pytest.raises(ValueError, match="diag_lowrank"):
        Laplace(case.model, "classification", hessian_structure="diag_lowrank")
    with pytest.raises(ValueError, match="n_eigenvalues"):
        DiagLowRankLaplace(case.model, "classification", backend_kwargs={"n_eigenvalues": 0})


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
