"""EKFAC (eigenvalue-corrected KFAC) against dense float64 oracles.

Per Kronecker block the corrected eigenvalues are ``diag(Qᵀ H Q)`` of the exact GGN / EF block
in KFAC's eigenbasis ``Q``; the posterior is ``Q diag(h·s + δ) Qᵀ`` per block, so its marginal
likelihood, GLM variances and samples follow from that dense matrix.
"""

from __future__ import annotations

import io

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from cases.mixed_layers import loader, mixed_net, oracle_blocks, tokens
from conftest import (
    CASE_BUILDERS,
    Oracle,
    assert_close,
    assert_marglik_gradient_matches_finite_differences,
    assert_marglik_matches,
    kron_dense_blocks,
)
from laplace import EKFACLaplace, EKFACLLLaplace, FullLaplace, KronLaplace, Laplace
from laplace.core.passes import eigenvalue_correction
from laplace.curvature import AsdlGGN, BackPackGGN, CurvlinopsEF, CurvlinopsGGN
from laplace.curvature.engine import kfac as kfac_module
from laplace.structures import large_output
from laplace.structures.kronecker import kron_functional_variance

RTOL, ATOL = 1e-8, 1e-10
#: Monte-Carlo tolerance of a sample covariance: a few standard errors of 20,000 draws.
MC_DRAWS, MC_ATOL = 20_000, 0.05


def basis(Q: torch.Tensor | None, n: int) -> torch.Tensor:
    return torch.eye(n, dtype=torch.float64) if Q is None else Q


def block_basis(H, i: int) -> torch.Tensor:
    """The dense eigenbasis ``Q₀ ⊗ Q₁`` (or ``Q₀``) of block ``i``."""
    sizes = [len(v) for v in H.eigenvalues[i]]
    Qs = [basis(Q, n).contiguous() for Q, n in zip(H.factor_bases(i), sizes)]
    return Qs[0] if len(Qs) == 1 else torch.kron(*Qs)


def ekfac_dense_blocks(H) -> list[torch.Tensor]:
    """Each block as a dense matrix: ``Q diag(s) Qᵀ`` where corrected, else the factors'."""
    blocks = []
    for i, K in enumerate(kron_dense_blocks(H.factors)):
        s = H.corrections[i]
        if s is None:
            blocks.append(K)
        else:
            Q = block_basis(H, i)
            blocks.append(Q @ torch.diag(s.flatten()) @ Q.T)
    return blocks


def dense_precision(la, sigma: float = 1.0) -> torch.Tensor:
    return torch.block_diag(*ekfac_dense_blocks(la.H)) / sigma**2 + torch.diag(
        la.prior_precision_diag
    )


def cnn_case():
    case = CASE_BUILDERS["cnn_classification"]()
    return case.model, case.X, case.y, "classification"


def mlp_regression_case():
    case = CASE_BUILDERS["mlp_regression_3out"]()
    return case.model, case.X, case.y, "regression"


def mixed_case():
    X, y = tokens(9, 4)
    return mixed_net(), X, y, "classification"


CASES = {"mixed": mixed_case, "cnn": cnn_case, "mlp-regression": mlp_regression_case}


def count_eigenvalue_passes(monkeypatch) -> list:
    """A list that grows by one per batch of an eigenvalue pass (``kron_eigenvalues``)."""
    calls = []
    original = CurvlinopsGGN.kron_eigenvalues
    monkeypatch.setattr(
        CurvlinopsGGN,
        "kron_eigenvalues",
        lambda self, *a, **k: calls.append(1) or original(self, *a, **k),
    )
    return calls


def fit_ekfac(model, X, y, likelihood, **kwargs) -> EKFACLaplace:
    la = EKFACLaplace(model, likelihood, **kwargs)
    la.fit(loader(X, y))
    return la


#: Which statistics a weight keeps for its eigenvalues: the cheaper (``_keeps_rows``), always
#: the per-row gradients, or always the inputs and gradients.
ROUTES = {
    "cheaper": kfac_module._keeps_rows,
    "rows": lambda a, grads: True,
    "inputs": lambda a, grads: False,
}


# ------------------------------------------------------------------ eigenvalues vs the oracle
@pytest.mark.parametrize("route", list(ROUTES))
@pytest.mark.parametrize("family", ["ggn", "ef"])
@pytest.mark.parametrize("name", list(CASES))
def test_corrected_eigenvalues_are_the_exact_blocks_diagonal_in_the_kfac_eigenbasis(
    name, family, route, monkeypatch
):
    monkeypatch.setattr(kfac_module, "_keeps_rows", ROUTES[route])
    model, X, y, likelihood = CASES[name]()
    backend = CurvlinopsEF if family == "ef" else None
    la = fit_ekfac(model, X, y, likelihood, backend=backend)
    oracle = Oracle(model, likelihood)
    exact = oracle.ef(X, y) if family == "ef" else oracle.ggn(X)
    expected_blocks = oracle_blocks(model, exact)
    corrected = [i for i, s in enumerate(la.H.corrections) if s is not None]
    assert corrected  # every case has Kronecker blocks
    for i, s in enumerate(la.H.corrections):
        if s is None:  # an exact block: the factor is the exact block itself
            (F,) = la.H_facs.kfacs[i]
            want = expected_blocks[i]
            assert_close(F if F.ndim == 2 else torch.diag(F), want, RTOL, ATOL)
            continue
        Q = block_basis(la.H, i)
        want = (Q.T @ expected_blocks[i] @ Q).diagonal()
        assert s.shape == la.H.spectrum(i).shape
        assert_close(s.flatten(), want, RTOL, ATOL)


@pytest.mark.parametrize("name", list(CASES))
def test_another_pass_gives_the_kept_statistics_eigenvalues(name, monkeypatch):
    model, X, y, likelihood = CASES[name]()
    kept = fit_ekfac(model, X, y, likelihood)
    monkeypatch.setattr(eigenvalue_correction, "EKFAC_CACHE_BYTES", 0)
    calls = count_eigenvalue_passes(monkeypatch)
    passed = fit_ekfac(model, X, y, likelihood)
    assert len(calls) == len(loader(X, y))  # a second pass, batch by batch
    for ours, theirs in zip(kept.H.corrections, passed.H.corrections, strict=True):
        assert (ours is None) == (theirs is None)
        if ours is not None:
            assert_close(ours, theirs, RTOL, ATOL)


def test_last_layer_keeps_features_and_output_curvatures_not_another_pass(monkeypatch):
    model, X, y, likelihood = CASES["cnn"]()
    calls = count_eigenvalue_passes(monkeypatch)
    kept = EKFACLLLaplace(model, likelihood)
    kept.fit(loader(X, y))
    assert not calls
    monkeypatch.setattr(eigenvalue_correction, "EKFAC_CACHE_BYTES", 0)
    passed = EKFACLLLaplace(model, likelihood)
    passed.fit(loader(X, y))
    assert calls
    for ours, theirs in zip(kept.H.corrections, passed.H.corrections, strict=True):
        assert_close(ours, theirs, RTOL, ATOL)


@pytest.mark.parametrize("name", list(CASES))
def test_ekfac_fits_every_block_at_least_as_well_as_kfac(name):
    model, X, y, likelihood = CASES[name]()
    la = fit_ekfac(model, X, y, likelihood)
    expected = oracle_blocks(model, Oracle(model, likelihood).ggn(X))
    kfac = kron_dense_blocks(la.H_facs)
    ekfac = ekfac_dense_blocks(la.H)
    gains = []
    for want, ours, theirs in zip(expected, ekfac, kfac, strict=True):
        ours_error, kfac_error = (ours - want).norm(), (theirs - want).norm()
        assert ours_error <= kfac_error * (1 + 1e-10) + ATOL
        gains.append(float(kfac_error - ours_error))
    assert max(gains) > 1e-3  # a block where the correction matters


def test_last_layer_eigenvalues_are_the_heads_exact_blocks_diagonal():
    model, X, y, likelihood = CASES["cnn"]()
    la = EKFACLLLaplace(model, likelihood)
    la.fit(loader(X, y))
    head = model[-1]
    features = model[:-1](X).detach()
    head_oracle = Oracle(head, likelihood)
    blocks = oracle_blocks(head, head_oracle.ggn(features))
    for i, s in enumerate(la.H.corrections):
        Q = block_basis(la.H, i)
        assert_close(s.flatten(), (Q.T @ blocks[i] @ Q).diagonal(), RTOL, ATOL)


# ------------------------------------------------------------------ the Gaussian it defines
@pytest.mark.parametrize("name", ["mixed", "mlp-regression"])
def test_marglik_and_its_gradients_equal_full_laplace_on_the_dense_ekfac(name):
    model, X, y, likelihood = CASES[name]()
    la = fit_ekfac(model, X, y, likelihood)
    full = FullLaplace(model, likelihood)
    full.fit(loader(X, y))
    full.H = torch.block_diag(*ekfac_dense_blocks(la.H))
    priors = ([0.7], torch.linspace(0.5, 2.0, la.n_layers).tolist())
    assert_marglik_matches(la, full, likelihood, priors)


@pytest.mark.parametrize("subset", ["all", "last_layer"])
def test_a_diagonal_prior_enters_as_its_diagonal_in_the_eigenbasis(subset):
    model, X, y, likelihood = CASES["cnn"]()
    la = Laplace(model, likelihood, subset_of_weights=subset, hessian_structure="ekfac")
    la.fit(loader(X, y))
    prior = torch.linspace(0.2, 3.0, la.n_params, dtype=torch.float64)
    la.prior_precision = prior
    blocks, o = [], 0
    for i, curvature in enumerate(ekfac_dense_blocks(la.H)):
        n = len(curvature)
        Q = block_basis(la.H, i)
        projected = (Q.T @ torch.diag(prior[o : o + n]) @ Q).diagonal()
        blocks.append(curvature + Q @ torch.diag(projected) @ Q.T - torch.diag(prior[o : o + n]))
        o += n
    # the precision is the dense EKFAC curvature plus the prior, rotated diagonal in Q
    expected = torch.block_diag(*blocks) + torch.diag(prior)
    assert_close(la.posterior_precision.to_matrix(), expected, RTOL, ATOL)
    full = FullLaplace(model, likelihood) if subset == "all" else None
    if full is not None:
        full.fit(loader(X, y))
        full.H = expected - torch.diag(prior)
        full.prior_precision = prior
        assert_close(la.log_marginal_likelihood(), full.log_marginal_likelihood(), 1e-9, 1e-9)
    # differentiable: finite differences along a direction
    direction = torch.linspace(-1, 1, la.n_params, dtype=torch.float64)
    p = prior.clone().requires_grad_(True)
    (grad,) = torch.autograd.grad(la.log_marginal_likelihood(p), p)
    step = 1e-6
    with torch.no_grad():
        up = la.log_marginal_likelihood(prior + step * direction)
        down = la.log_marginal_likelihood(prior - step * direction)
    assert_close((up - down) / (2 * step), grad @ direction, rtol=1e-6, atol=1e-7)
    la.optimize_prior_precision(method="marglik", prior_structure="diag", n_steps=5)
    assert la.prior_precision.shape == (la.n_params,)
    damped = type(la)(model, likelihood, damping=True)
    damped.fit(loader(X, y))
    damped.prior_precision = prior
    with pytest.raises(ValueError, match="damping=False"):
        damped.log_marginal_likelihood()


def test_marglik_gradient_equals_finite_differences():
    model, X, y, likelihood = CASES["mlp-regression"]()
    assert_marglik_gradient_matches_finite_differences(fit_ekfac(model, X, y, likelihood))


def test_glm_predictive_is_jacobian_free_and_matches_the_dense_reference():
    model, X, y, likelihood = CASES["mixed"]()
    la = fit_ekfac(model, X, y, likelihood, prior_precision=torch.linspace(0.5, 2, 13).double())
    J = Oracle(model, likelihood).jacobian(X)
    expected = J @ torch.linalg.inv(dense_precision(la)) @ J.transpose(1, 2)
    f_var = kron_functional_variance(la.backend.trace(X), la.posterior_precision)
    assert f_var is not None
    assert_close(f_var, expected, rtol=1e-8, atol=1e-12)
    _, f_var = la._functional_moments(X)
    assert_close(f_var, expected, rtol=1e-8, atol=1e-12)


def test_last_layer_glm_predictive_matches_the_dense_reference():
    model, X, y, likelihood = CASES["cnn"]()
    la = EKFACLLLaplace(model, likelihood, prior_precision=0.3)
    la.fit(loader(X, y))
    features = model[:-1](X).detach()
    J = Oracle(model[-1], likelihood).jacobian(features)
    expected = J @ torch.linalg.inv(dense_precision(la)) @ J.transpose(1, 2)
    _, f_var = la._functional_moments(X)
    assert_close(f_var, expected, rtol=1e-8, atol=1e-12)


def test_samples_have_the_dense_posterior_covariance():
    model, X, y, likelihood = CASES["mlp-regression"]()
    la = fit_ekfac(model, X, y, likelihood, prior_precision=2.0)
    covariance = torch.linalg.inv(dense_precision(la))
    samples = la.sample(MC_DRAWS, generator=torch.Generator().manual_seed(0))
    empirical = torch.cov((samples - la.mean).T)
    scale = covariance.diagonal().sqrt()
    correlation_error = (empirical - covariance) / torch.outer(scale, scale)
    assert correlation_error.abs().max() < MC_ATOL
    # exactly: deviations are P^{-1/2} z
    root = la.posterior_precision.to_matrix(exponent=-0.5)
    assert_close(root @ root.T, covariance, rtol=1e-8, atol=1e-12)


def test_nn_predictive_and_damping():
    model, X, y, likelihood = CASES["cnn"]()
    la = fit_ekfac(model, X, y, likelihood, damping=True, prior_precision=0.5)
    probs = la(X[:4], pred_type="nn", link_approx="mc", n_samples=7)
    assert probs.shape == (4, 3)
    assert_close(probs.sum(-1), torch.ones(4, dtype=torch.float64))
    P = la.posterior_precision
    for i, s in enumerate(la.H.corrections):
        if s is None or s.ndim != 2:
            continue
        l0, l1 = P.eigenvalues[i]
        root = torch.tensor(0.5, dtype=torch.float64).sqrt()
        want = torch.outer(l0 + root, l1 + root) - torch.outer(l0, l1) + s
        assert_close(P.spectrum(i), want)


# ------------------------------------------------------------------ state, online, refusals
def test_state_dict_round_trip_keeps_the_eigenbasis():
    model, X, y, likelihood = CASES["mixed"]()
    la = fit_ekfac(model, X, y, likelihood, prior_precision=0.5)
    buffer = io.BytesIO()
    torch.save(la.state_dict(), buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True, map_location="cpu")
    other = EKFACLaplace(model, likelihood, prior_precision=0.5)
    other.load_state_dict(state)
    assert torch.equal(other.log_marginal_likelihood(), la.log_marginal_likelihood())
    assert torch.equal(other(X[:3]), la(X[:3]))
    kron = KronLaplace(model, likelihood)
    kron.fit(loader(X, y))
    with pytest.raises(ValueError, match="EKFAC"):
        other.load_state_dict(kron.state_dict())


def test_online_fit_projects_the_earlier_eigenvalues_into_the_merged_basis():
    model, X, y, likelihood = CASES["mlp-regression"]()
    first, second = slice(0, 12), slice(12, None)
    online = fit_ekfac(model, X[first], y[first], likelihood)
    earlier = online.H
    online.fit(loader(X[second], y[second]), override=False)
    kron = KronLaplace(model, likelihood)
    kron.fit(loader(X, y))
    for got, want in zip(online.H_facs.kfacs, kron.H_facs.kfacs, strict=True):
        for g, w in zip(got, want, strict=True):
            assert_close(g, w, RTOL, ATOL)
    oracle = Oracle(model, likelihood)
    new_blocks = oracle_blocks(model, oracle.ggn(X[second]))
    earlier_blocks = ekfac_dense_blocks(earlier)
    for i, s in enumerate(online.H.corrections):
        Q = block_basis(online.H, i)
        want = (Q.T @ (new_blocks[i] + earlier_blocks[i]) @ Q).diagonal()
        assert_close(s.flatten(), want, RTOL, ATOL)
    assert online.n_data == len(X)


def test_online_fit_on_the_same_data_equals_one_fit_on_it_twice():
    model, X, y, likelihood = CASES["mixed"]()
    online = fit_ekfac(model, X, y, likelihood)
    online.fit(loader(X, y), override=False)
    twice = fit_ekfac(model, torch.cat([X, X]), torch.cat([y, y]), likelihood)
    assert_close(online.log_marginal_likelihood(), twice.log_marginal_likelihood(), 1e-8, 1e-8)


@pytest.mark.parametrize("backend", [AsdlGGN, BackPackGGN])
def test_third_party_backends_are_refused_by_name(backend):
    model, X, y, likelihood = CASES["mlp-regression"]()
    la = EKFACLaplace(model, likelihood, backend=backend)
    with pytest.raises(ValueError, match=r"ekfac.*native KFAC"):
        la.fit(loader(X, y))
    assert la.H is not None and not la._fitted


def test_refusals_name_the_alternatives():
    model, _, _, likelihood = CASES["mlp-regression"]()
    with pytest.raises(ValueError, match="ekfac"):
        Laplace(model, likelihood, subset_of_weights="subnetwork", hessian_structure="ekfac")
    la = Laplace(model, likelihood, subset_of_weights="all", hessian_structure="ekfac")
    assert isinstance(la, EKFACLaplace) and isinstance(la, KronLaplace)
    head = Laplace(model, likelihood, hessian_structure="ekfac")
    assert isinstance(head, EKFACLLLaplace)
    with pytest.raises(ValueError, match="one sigma_noise per output"):
        la.sigma_noise = torch.ones(3, dtype=torch.float64)


def test_many_outputs_are_refused_at_construction(monkeypatch):
    model, _, _, likelihood = CASES["mlp-regression"]()
    monkeypatch.setattr(large_output, "LARGE_OUTPUT_THRESHOLD", 2)
    with pytest.raises(ValueError, match="LARGE_OUTPUT_THRESHOLD"):
        EKFACLaplace(model, likelihood)


def test_float32_model_gives_a_float32_posterior():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 6), nn.Tanh(), nn.Linear(6, 2))
    X, y = torch.randn(30, 3), torch.randint(0, 2, (30,))
    la = Laplace(model, "classification", hessian_structure="ekfac")
    la.fit(DataLoader(TensorDataset(X, y), batch_size=8))
    assert all(s is None or s.dtype == torch.float32 for s in la.H.corrections)
    assert la(X[:2]).dtype == torch.float32
    la.optimize_prior_precision(method="marglik", n_steps=20)
    assert la.prior_precision.dtype == torch.float32
