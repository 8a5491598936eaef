"""Predictives of outputs with extra dimensions: the outputs' shape, against dense references.

Every position is predicted from its own Gaussian ``N(fₜ, Jₜ Σ Jₜᵀ)`` (``Jₜ`` the Jacobian of
position t's C outputs, ``Σ`` the posterior covariance, both dense from ``torch.func``), and the
predictions come back in the outputs' shape: probabilities (B, C, H, W) or (B, T, C), regression
means and variances of every output.
"""

from __future__ import annotations

import math

import pytest
import torch

from conftest import POSITION_CASES, PositionOracle, assert_close, freeze_all_but
from laplace import Laplace
from test_output_dims import SUBNET

#: Monte-Carlo draws of the sampled predictives.
N_SAMPLES = 4000


def _setup(name: str, subset: str, structure: str):
    case = POSITION_CASES[name]()
    kwargs = {"subnetwork_indices": SUBNET} if subset == "subnetwork" else {}
    la = Laplace(case.model, case.likelihood, subset, structure, prior_precision=0.5, **kwargs)
    la.fit(case.loader())
    model = freeze_all_but(case.model, "head") if subset == "last_layer" else case.model
    oracle = PositionOracle(model, case.likelihood, case.class_dim)
    torch.manual_seed(11)
    X = torch.randn(3, *case.X.shape[1:], dtype=torch.float64)
    return case, la, oracle, X


def _covariance(la, structure: str) -> torch.Tensor:
    if structure == "kron":
        return torch.linalg.inv(la.posterior_precision.to_matrix())
    return la.posterior_covariance


def _jacobian(oracle, X, subset: str) -> torch.Tensor:
    J = oracle.jacobian(X)
    return J[..., SUBNET] if subset == "subnetwork" else J


def _restore(rows: torch.Tensor, like: torch.Tensor, class_dim: int) -> torch.Tensor:
    """Rows (B·T, C) in the shape of ``like`` (B, …) with the classes at ``class_dim``."""
    moved = like.movedim(class_dim, -1)
    return rows.reshape(moved.shape).movedim(-1, class_dim)


CLASSIFICATION = [
    (name, subset, structure)
    for name in ("pixel_classification", "token_classification")
    for subset in ("all", "last_layer", "subnetwork")
    for structure in ("full", "diag", "kron")
    if not (subset == "subnetwork" and structure == "kron")
]


@pytest.mark.parametrize(("name", "subset", "structure"), CLASSIFICATION)
def test_probit_predictive_of_every_position(name, subset, structure):
    case, la, oracle, X = _setup(name, subset, structure)
    f = oracle.f(oracle.theta, X).detach()
    J = oracle.rows(_jacobian(oracle, X, subset), jacobian=True)
    variances = torch.einsum("rcp,pq,rcq->rc", J, _covariance(la, structure), J)
    probabilities = torch.softmax(oracle.rows(f) / (1 + math.pi / 8 * variances).sqrt(), -1)
    expected = _restore(probabilities, f, case.class_dim)
    assert_close(la(X, link_approx="probit"), expected)
    for link in ("bridge", "mc"):
        out = la(X, link_approx=link, n_samples=20)
        assert out.shape == f.shape
        assert_close(out.sum(case.class_dim), torch.ones_like(f.sum(case.class_dim)))


@pytest.mark.parametrize("subset", ["all", "last_layer", "subnetwork"])
def test_regression_predictive_means_and_variances_of_every_output(subset):
    _, la, oracle, X = _setup("pixel_regression", subset, "full")
    f = oracle.f(oracle.theta, X).detach()
    J = _jacobian(oracle, X, subset)
    variances = torch.einsum("b...p,pq,b...q->b...", J, la.posterior_covariance, J)
    f_mu, f_var = la(X)
    assert_close(f_mu, f)
    assert_close(f_var, variances)
    flat = J.reshape(-1, J.shape[-1])
    joint_mu, joint_cov = la(X, joint=True)
    assert_close(joint_mu, f.reshape(-1))
    assert_close(joint_cov, flat @ la.posterior_covariance @ flat.T)


@pytest.mark.parametrize("subset", ["all", "last_layer"])
@pytest.mark.parametrize("name", ["pixel_classification", "token_classification"])
def test_sampled_networks_predict_in_the_outputs_shape(name, subset):
    case, la, oracle, X = _setup(name, subset, "full")
    thetas = la.sample(50, generator=torch.Generator().manual_seed(3))
    outputs = torch.stack([oracle.f(theta, X) for theta in thetas]).detach()
    expected = torch.softmax(outputs, dim=case.class_dim + 1)
    generator = torch.Generator().manual_seed(3)
    out = la(X, pred_type="nn", link_approx="mc", n_samples=50, generator=generator)
    assert_close(out, expected.mean(0))
    samples = la.predictive_samples(
        X, pred_type="nn", n_samples=50, generator=torch.Generator().manual_seed(3)
    )
    assert_close(samples, expected)


def test_sampled_regression_networks_give_every_output_a_variance():
    _, la, oracle, X = _setup("pixel_regression", "all", "diag")
    thetas = la.sample(30, generator=torch.Generator().manual_seed(4))
    outputs = torch.stack([oracle.f(theta, X) for theta in thetas]).detach()
    mean, var = la(
        X,
        pred_type="nn",
        link_approx="mc",
        n_samples=30,
        generator=torch.Generator().manual_seed(4),
    )
    assert_close(mean, outputs.mean(0))
    assert_close(var, outputs.var(0))


@pytest.mark.parametrize("name", list(POSITION_CASES))
def test_glm_output_samples_have_the_outputs_shape_and_moments(name):
    case, la, oracle, X = _setup(name, "all", "full")
    f = oracle.f(oracle.theta, X).detach()
    J = oracle.jacobian(X)
    variances = torch.einsum("b...p,pq,b...q->b...", J, la.posterior_covariance, J)
    generator = torch.Generator().manual_seed(5)
    samples = la.functional_samples(X, n_samples=N_SAMPLES, generator=generator)
    assert samples.shape == (N_SAMPLES, *f.shape)
    # Means of N_SAMPLES Gaussian draws: within 5 standard errors.
    tolerance = 5 * (variances / N_SAMPLES).sqrt().max().item()
    assert_close(samples.mean(0), f, rtol=0.0, atol=tolerance)
    assert_close(samples.var(0), variances, rtol=0.15, atol=1e-12)
    predictive = la.predictive_samples(X, n_samples=7, generator=generator)
    assert predictive.shape == (7, *f.shape)
    if case.likelihood == "classification":
        ones = torch.ones_like(f.sum(case.class_dim)).expand(7, *f.sum(case.class_dim).shape)
        assert_close(predictive.sum(case.class_dim + 1), ones)


def test_last_layer_variances_of_positions_come_back_in_the_outputs_shape():
    _, la, oracle, X = _setup("token_classification", "last_layer", "diag")
    f_mu, f_var = la.functional_variance_fast(X)
    J = oracle.jacobian(X)
    assert f_mu.shape == f_var.shape == J.shape[:-1]
    assert_close(f_var, torch.einsum("b...p,p,b...p->b...", J, la.posterior_variance, J))
