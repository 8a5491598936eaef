"""The diagonal-plus-low-rank (INF) posterior against dense float64 oracles.

``P = U diag(h·λ) Uᵀ + h·max(diag(H) − diag(U diag(λ) Uᵀ), 0) + diag(p₀)``: its diagonal is the
exact curvature's, and its log-determinant, covariance, GLM variances and samples are those of
that dense matrix.
"""

from __future__ import annotations

import io

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from conftest import (
    CASE_BUILDERS,
    Oracle,
    assert_close,
    assert_marglik_gradient_matches_finite_differences,
    assert_marglik_matches,
)
from laplace import DiagLowRankLaplace, FullLaplace, Laplace, LowRankLaplace
from laplace.curvature import CurvlinopsEF
from laplace.curvature.solvers import products
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
