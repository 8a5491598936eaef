"""Full and Diag Laplace over all weights against dense float64 oracles, and the unfitted state.

Before ``fit`` the posterior is the prior (laplace-torch's unfitted state). With no data the
curvature is zero: ``H`` is a zero curvature in the structure's own form, ``mean`` is the prior
mean, and every posterior quantity that needs no data (precision, log-determinants,
``scatter``, ``square_norm``, ``log_prob``) is that of the prior ``N(μ₀, diag(p₀)⁻¹)``, checked
here against ``torch.distributions``. Predictions, samples and the marginal likelihood (which
needs the data's log-likelihood) refuse with a clear error.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.distributions import Normal
from torch.utils.data import DataLoader, TensorDataset

from conftest import CASE_BUILDERS, Oracle, assert_close
from laplace import (
    DiagLaplace,
    DiagLLLaplace,
    DiagSubnetLaplace,
    FullLaplace,
    FullLLLaplace,
    FullSubnetLaplace,
    KronLaplace,
    KronLLLaplace,
    Laplace,
    LowRankLaplace,
)
from laplace.baselaplace import ParametricLaplace
from laplace.curvature import CurvlinopsEF, CurvlinopsGGN, CurvlinopsHessian
from laplace.utils.matrix import Kron

STRUCTURES = {"full": FullLaplace, "diag": DiagLaplace}


def dense_curvature(oracle: Oracle, X, y, backend) -> torch.Tensor:
    if backend is CurvlinopsEF:
        return oracle.ef(X, y)
    if backend is CurvlinopsHessian:
        return oracle.hessian(X, y)
    return oracle.ggn(X)


def oracle_precision(la, H_dense: torch.Tensor) -> torch.Tensor:
    """Dense P = H/(σ²T) + diag(p₀), restricted to the diagonal for Diag."""
    H = H_dense if isinstance(la, FullLaplace) else torch.diag(H_dense.diagonal())
    h = 1 / (la.sigma_noise.square() * la.temperature)
    return h * H + torch.diag(la.prior_precision_diag)


def oracle_log_marglik(la, loss, H_dense, prior_diag, sigma):
    """Dense Laplace evidence written out independently of the library."""
    N, C, T = la.n_data, la.n_outputs, la.temperature
    H = H_dense if isinstance(la, FullLaplace) else torch.diag(H_dense.diagonal())
    P = H / (sigma**2 * T) + torch.diag(prior_diag)
    if la.likelihood == "regression":
        log_lik = -loss / (sigma**2 * T) - 0.5 * N * C * torch.log(2 * math.pi * sigma**2)
    else:
        log_lik = -loss / T
    delta = la.mean - la.prior_mean
    log_det_ratio = torch.linalg.slogdet(P)[1] - prior_diag.log().sum()
    return log_lik - 0.5 * (log_det_ratio + (delta * prior_diag) @ delta)


@pytest.fixture(params=list(STRUCTURES))
def structure(request):
    return request.param


def fitted(case, structure, backend=CurvlinopsGGN, **kwargs):
    sigma = 0.7 if case.likelihood == "regression" else 1.0
    la = STRUCTURES[structure](
        case.model,
        case.likelihood,
        sigma_noise=sigma,
        prior_precision=0.9,
        temperature=kwargs.pop("temperature", 1.3),
        backend=backend,
        **kwargs,
    )
    la.fit(case.loader())
    return la


@pytest.mark.parametrize(
    "backend", [CurvlinopsGGN, CurvlinopsEF, CurvlinopsHessian], ids=["ggn", "ef", "hessian"]
)
def test_curvature_loss_and_counts(case, structure, backend):
    la = fitted(case, structure, backend)
    oracle = Oracle(case.model, case.likelihood)
    H = dense_curvature(oracle, case.X, case.y, backend)
    expected = H if structure == "full" else H.diagonal()
    assert_close(la.H, expected)
    assert_close(la.loss, oracle.loss(case.X, case.y))
    assert la.n_data == len(case.X)
    assert la.n_outputs == case.n_outputs
    assert la.n_params == len(oracle.theta)
    assert_close(la.mean, oracle.theta)


def test_log_dets_scatter_and_marglik(case, structure):
    la = fitted(case, structure, prior_mean=0.1)
    la.prior_precision = torch.linspace(0.5, 2.0, la.n_layers, dtype=torch.float64)
    oracle = Oracle(case.model, case.likelihood)
    H = oracle.ggn(case.X)
    P = oracle_precision(la, H)
    prior_diag = la.prior_precision_diag
    assert_close(la.log_det_posterior_precision, torch.linalg.slogdet(P)[1])
    assert_close(la.log_det_prior_precision, prior_diag.log().sum())
    assert_close(la.log_det_ratio, torch.linalg.slogdet(P)[1] - prior_diag.log().sum())
    delta = oracle.theta - 0.1
    assert_close(la.scatter, (delta * prior_diag) @ delta)
    loss = oracle.loss(case.X, case.y)
    expected = oracle_log_marglik(la, loss, H, prior_diag, la.sigma_noise)
    assert_close(la.log_marginal_likelihood(), expected)
    posterior = la.posterior_precision
    assert_close(posterior if structure == "full" else torch.diag(posterior), P)


@pytest.mark.parametrize("prior_shape", ["scalar", "layerwise", "diag"])
def test_marglik_gradients(structure, prior_shape):
    case = CASE_BUILDERS["mlp_regression_3out"]()
    la = fitted(case, structure)
    n = {"scalar": 1, "layerwise": la.n_layers, "diag": la.n_params}[prior_shape]
    prior = torch.linspace(0.5, 1.5, n, dtype=torch.float64).requires_grad_()
    sigma = torch.tensor(0.8, dtype=torch.float64, requires_grad=True)
    grads = torch.autograd.grad(la.log_marginal_likelihood(prior, sigma), (prior, sigma))

    oracle = Oracle(case.model, case.likelihood)
    H, loss = oracle.ggn(case.X), oracle.loss(case.X, case.y)
    prior2 = prior.detach().clone().requires_grad_()
    sigma2 = sigma.detach().clone().requires_grad_()
    sizes = torch.tensor([p.numel() for p in case.model.parameters()])
    prior_diag = (
        prior2.expand(la.n_params)
        if n == 1
        else (prior2 if n == la.n_params else torch.repeat_interleave(prior2, sizes))
    )
    expected = oracle_log_marglik(la, loss, H, prior_diag, sigma2)
    expected_grads = torch.autograd.grad(expected, (prior2, sigma2))
    for g, e in zip(grads, expected_grads):
        assert_close(g, e)


def test_functional_variance_and_covariance(case, structure):
    la = fitted(case, structure)
    oracle = Oracle(case.model, case.likelihood)
    cov = torch.linalg.inv(oracle_precision(la, oracle.ggn(case.X)))
    Js = oracle.jacobian(case.X[:5])
    assert_close(la.functional_variance(Js), torch.einsum("bcp,pq,bdq->bcd", Js, cov, Js))
    flat = Js.reshape(-1, Js.shape[-1])
    assert_close(la.functional_covariance(Js), flat @ cov @ flat.T)
    assert_close(la.posterior_covariance, cov)


def test_glm_predictive(case, structure):
    la = fitted(case, structure)
    oracle = Oracle(case.model, case.likelihood)
    cov = torch.linalg.inv(oracle_precision(la, oracle.ggn(case.X)))
    X = case.X[:6]
    Js = oracle.jacobian(X)
    f_mu = oracle.f(oracle.theta, X).detach()
    f_var = torch.einsum("bcp,pq,bdq->bcd", Js, cov, Js)
    if case.likelihood == "regression":
        mean, var = la(X)
        assert_close(mean, f_mu)
        assert_close(var, f_var)
        mean, var = la(X, diagonal_output=True)
        assert_close(var, f_var.diagonal(dim1=1, dim2=2))
        mean, cov_joint = la(X, joint=True)
        flat = Js.reshape(-1, Js.shape[-1])
        assert_close(mean, f_mu.reshape(-1))
        assert_close(cov_joint, flat @ cov @ flat.T)
    else:
        kappa = 1 / torch.sqrt(1 + math.pi / 8 * f_var.diagonal(dim1=1, dim2=2))
        assert_close(la(X), torch.softmax(kappa * f_mu, -1))
        for link in ["bridge", "bridge_norm", "mc"]:
            probs = la(X, link_approx=link, n_samples=50)
            assert probs.shape == f_mu.shape
            assert_close(probs.sum(-1), torch.ones(len(X), dtype=torch.float64))


def test_glm_predictive_chunks_match_single_pass(monkeypatch):
    import laplace.structures.memory_budgets as glm

    case = CASE_BUILDERS["mlp_classification"]()
    la = fitted(case, "diag")
    whole = la(case.X, link_approx="probit")
    monkeypatch.setattr(glm, "JACOBIAN_CHUNK_BYTES", 1)  # one test point per chunk
    assert_close(la(case.X, link_approx="probit"), whole)


def test_sample_covariance_matches_posterior(structure):
    case = CASE_BUILDERS["mlp_regression_1out"]()
    la = fitted(case, structure)
    n = 20_000
    samples = la.sample(n, generator=torch.Generator().manual_seed(0))
    assert samples.shape == (n, la.n_params)
    cov = la.posterior_covariance
    empirical = torch.cov(samples.T)
    # Standard error of a sample covariance entry: sqrt((Σii Σjj + Σij²) / n).
    std_err = ((cov.diagonal()[:, None] * cov.diagonal()[None, :] + cov**2) / n).sqrt()
    assert bool(((empirical - cov).abs() <= 5 * std_err + 1e-12).all())
    assert bool(((samples.mean(0) - la.mean).abs() <= 5 * (cov.diagonal() / n).sqrt()).all())


def test_nn_predictive_and_samples(case, structure):
    la = fitted(case, structure)
    gen = torch.Generator().manual_seed(1)
    X = case.X[:4]
    C = case.n_outputs
    assert la.predictive_samples(X, n_samples=7, generator=gen).shape == (7, 4, C)
    assert la.predictive_samples(X, pred_type="nn", n_samples=7).shape == (7, 4, C)
    out = la(X, pred_type="nn", link_approx="mc", n_samples=30, generator=gen)
    if case.likelihood == "regression":
        assert out[0].shape == (4, C) and out[1].shape == (4, C)
    else:
        assert out.shape == (4, C)
        assert_close(out.sum(-1), torch.ones(4, dtype=torch.float64))


def test_nn_predictive_uses_posterior_samples():
    case = CASE_BUILDERS["mlp_regression_1out"]()
    la = fitted(case, "full")
    X = case.X[:3]
    thetas = la.sample(5, generator=torch.Generator().manual_seed(3))
    oracle = Oracle(case.model, case.likelihood)
    expected = torch.stack([oracle.f(t, X) for t in thetas])
    got = la.functional_samples(
        X, pred_type="nn", n_samples=5, generator=torch.Generator().manual_seed(3)
    )
    assert_close(got, expected)


def test_online_fit_accumulates(structure):
    case = CASE_BUILDERS["mlp_classification"]()
    la_all = fitted(case, structure)
    la = STRUCTURES[structure](case.model, case.likelihood, prior_precision=0.9, temperature=1.3)
    half = len(case.X) // 2
    la.fit(DataLoader(TensorDataset(case.X[:half], case.y[:half]), batch_size=4))
    la.fit(DataLoader(TensorDataset(case.X[half:], case.y[half:]), batch_size=4), override=False)
    assert_close(la.H, la_all.H)
    assert_close(la.loss, la_all.loss)
    assert la.n_data == la_all.n_data


def test_frozen_parameters_are_excluded(structure):
    case = CASE_BUILDERS["mlp_regression_3out"]()
    case.model[0].weight.requires_grad_(False)
    la = fitted(case, structure)
    oracle = Oracle(case.model, case.likelihood)
    assert (
        la.n_params
        == len(oracle.theta)
        == sum(p.numel() for p in case.model.parameters() if p.requires_grad)
    )
    H = oracle.ggn(case.X)
    assert_close(la.H, H if structure == "full" else H.diagonal())


def test_dict_batches(structure):
    from conftest import dict_case

    model, loader = dict_case()
    la = Laplace(model, "classification", subset_of_weights="all", hessian_structure=structure)
    la.fit(loader)
    X = torch.cat([b["input_ids"] for b in loader])
    oracle = Oracle(model, "classification")
    H = oracle.ggn({"input_ids": X})
    assert_close(la.H, H if structure == "full" else H.diagonal())
    probs = la({"input_ids": X[:3]})
    assert probs.shape == (3, 2)


def test_log_prob_is_the_gaussian_density(structure):
    case = CASE_BUILDERS["mlp_regression_1out"]()
    la = fitted(case, structure)
    value = la.mean + 0.01
    cov = la.posterior_covariance
    dist = torch.distributions.MultivariateNormal(la.mean, covariance_matrix=cov)
    assert_close(la.log_prob(value), dist.log_prob(value))
    delta = value - la.mean
    assert_close(la.square_norm(value), delta @ torch.linalg.inv(cov) @ delta, rtol=1e-6)


def test_reward_modeling_fits_as_classification_and_predicts_as_regression():
    class PairScorer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Sequential(
                torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1)
            )

        def forward(self, x):
            if x.dim() == 3:
                return self.net(x.reshape(-1, x.shape[-1])).reshape(x.shape[0], 2)
            return self.net(x)

    torch.manual_seed(0)
    model = PairScorer().double()
    X = torch.randn(12, 2, 3, dtype=torch.float64)
    y = torch.randint(0, 2, (12,))
    loader = DataLoader(TensorDataset(X, y), batch_size=5)
    la = Laplace(model, "reward_modeling", subset_of_weights="all", hessian_structure="diag")
    la.fit(loader)
    assert_close(la.H, Oracle(model, "classification").ggn(X).diagonal())
    assert_close(la.log_likelihood, -Oracle(model, "classification").loss(X, y))
    X_test = torch.randn(4, 3, dtype=torch.float64)
    f_mu, f_var = la(X_test)
    assert f_mu.shape == (4, 1) and f_var.shape == (4, 1, 1)
    oracle = Oracle(model, "regression")
    Js = oracle.jacobian(X_test)
    expected = torch.einsum("bcp,p,bdp->bcd", Js, 1 / la.posterior_precision, Js)
    assert_close(f_var, expected)
    assert la(X[:3], fitting=True).shape == (3, 2)


def test_enable_backprop_differentiates_the_glm_predictive_in_x(structure):
    case = CASE_BUILDERS["mlp_regression_3out"]()
    la = fitted(case, structure, enable_backprop=True)
    x = case.X[:2].clone().requires_grad_()

    def objective(inputs):
        f_mu, f_var = la(inputs)
        return f_mu.sum() + f_var.diagonal(dim1=1, dim2=2).sum()

    (grad,) = torch.autograd.grad(objective(x), x)
    eps = 1e-6
    numeric = torch.zeros_like(x)
    for i in range(x.numel()):
        step = torch.zeros_like(x).flatten()
        step[i] = eps
        step = step.view_as(x)
        numeric.view(-1)[i] = (objective(x + step) - objective(x - step)).detach() / (2 * eps)
    assert_close(grad, numeric, rtol=1e-5, atol=1e-7)


def test_posterior_follows_changes_of_the_curvature(structure):
    case = CASE_BUILDERS["mlp_regression_1out"]()
    la = fitted(case, structure)
    before = la.log_det_posterior_precision.clone()
    la.H = 2 * la.H
    assert not torch.allclose(la.log_det_posterior_precision, before)
    la.H.mul_(0.5)
    assert_close(la.log_det_posterior_precision, before)


class _TokenMixer(torch.nn.Module):
    """A Linear applied to every token of (B, T, D) inputs, then mean pooling and a head."""

    def __init__(self, with_norm: bool):
        super().__init__()
        self.mix = torch.nn.Linear(3, 4)
        self.norm = torch.nn.LayerNorm(4) if with_norm else torch.nn.Identity()
        self.head = torch.nn.Linear(4, 2)

    def forward(self, x):
        return self.head(self.norm(torch.tanh(self.mix(x))).mean(1))


@pytest.mark.parametrize("with_norm", [False, True], ids=["jacobian_free", "jacobian_fallback"])
def test_diag_glm_predictive_on_weight_sharing_and_other_layers(with_norm):
    torch.manual_seed(0)
    model = _TokenMixer(with_norm).double()
    X = torch.randn(10, 5, 3, dtype=torch.float64)
    y = torch.randint(0, 2, (10,))
    la = DiagLaplace(model, "classification", prior_precision=0.7)
    la.fit(DataLoader(TensorDataset(X, y), batch_size=4))
    oracle = Oracle(model, "classification")
    Js = oracle.jacobian(X[:4])
    expected = torch.einsum("bcp,p,bdp->bcd", Js, 1 / la.posterior_precision, Js)
    f_mu, f_var = la._glm_predictive_distribution(X[:4])
    assert_close(f_var, expected)
    assert_close(f_mu, oracle.f(oracle.theta, X[:4]))


def test_parametric_laplace_is_abstract():
    case = CASE_BUILDERS["mlp_classification"]()
    with pytest.raises(TypeError, match="abstract"):
        ParametricLaplace(case.model, "classification")


# ---------------------------------------------------------------- before fit: the prior
SUBNET = torch.tensor([7, 2, 30, 11])


#: (class, extra constructor arguments); last-layer classes name their layer.
CLASSES = {
    "full": (FullLaplace, {}),
    "diag": (DiagLaplace, {}),
    "kron": (KronLaplace, {}),
    "lowrank": (LowRankLaplace, {}),
    "full_ll": (FullLLLaplace, {"last_layer_name": "2"}),
    "diag_ll": (DiagLLLaplace, {"last_layer_name": "2"}),
    "kron_ll": (KronLLLaplace, {"last_layer_name": "2"}),
    "full_subnet": (FullSubnetLaplace, {"subnetwork_indices": SUBNET}),
    "diag_subnet": (DiagSubnetLaplace, {"subnetwork_indices": SUBNET}),
}


#: A prior precision per class: scalar, layer-wise or diagonal (P = 38 weights, 18 in the head).
PRIORS = {
    "full": torch.tensor([0.5, 1.5, 2.0, 3.0]),
    "diag": torch.linspace(0.5, 3.0, 38),
    "kron": torch.tensor([0.5, 1.5, 2.0, 3.0]),
    "lowrank": 2.0,
    "full_ll": torch.tensor([0.5, 2.0]),
    "diag_ll": torch.linspace(0.5, 3.0, 18),
    "kron_ll": torch.tensor([0.5, 2.0]),
    "full_subnet": torch.linspace(0.5, 3.0, 4),
    "diag_subnet": 2.0,
}


def _build(name: str, **kwargs):
    case = CASE_BUILDERS["mlp_regression_3out"]()
    cls, extra = CLASSES[name]
    return case, cls(case.model, "regression", **extra, **kwargs)


def _covered_weights(name: str, model) -> torch.Tensor:
    """The model's values of the weights the posterior covers, shape (P,)."""
    if name.endswith("subnet"):
        return torch.cat([p.detach().flatten() for p in model.parameters()])[SUBNET]
    layer = model[2] if name.endswith("_ll") else model
    return torch.cat([p.detach().flatten() for p in layer.parameters()])


def _dense(H) -> torch.Tensor:
    """A curvature or precision in any structure's form as a dense matrix."""
    if isinstance(H, Kron):
        return H.to_matrix()
    if isinstance(H, tuple):  # low rank: (U, λ), or the precision ((U, λ), diagonal)
        (U, eigenvalues), diagonal = H if isinstance(H[0], tuple) else (H, None)
        dense = U @ torch.diag(eigenvalues) @ U.T
        return dense if diagonal is None else dense + torch.diag(diagonal)
    if hasattr(H, "to_matrix"):  # KronDecomposed
        return H.to_matrix()
    return torch.diag(H) if H.dim() == 1 else H


@pytest.mark.parametrize("name", list(CLASSES))
def test_unfitted_posterior_is_the_prior(name):
    case, la = _build(name, prior_precision=PRIORS[name], prior_mean=0.3)
    theta_map = _covered_weights(name, case.model)
    P = len(theta_map)
    p0 = la.prior_precision_diag
    assert p0.shape == (P,)
    # H: a zero curvature in the structure's own form
    kind = name.split("_")[0]
    if kind in ("full", "diag"):
        assert la.H.shape == ((P, P) if kind == "full" else (P,))
    elif kind == "kron":
        assert isinstance(la.H, Kron) and la.H_facs is None
        assert [[tuple(F.shape) for F in b] for b in la.H.kfacs] == [
            [(p.shape[0], p.shape[0]), (p.shape[1], p.shape[1])]
            if p.dim() == 2
            else [(len(p),) * 2]
            for p in la.params
        ]
    else:
        assert la.H[0].shape == (P, 0) and la.H[1].shape == (0,)
    assert_close(_dense(la.H), torch.zeros(P, P, dtype=torch.float64))
    # mean: the prior mean (the subnetwork's other weights stay at the MAP)
    mean = la.mean_subnet if name.endswith("subnet") else la.mean
    assert_close(mean, torch.full((P,), 0.3, dtype=torch.float64))
    if name.endswith("subnet"):
        theta = torch.cat([p.detach().flatten() for p in case.model.parameters()])
        theta[SUBNET] = 0.3
        assert_close(la.mean, theta)
    # the posterior precision is the prior's, in the structure's representation
    assert_close(_dense(la.posterior_precision), torch.diag(p0))
    # marginal-likelihood pieces that need no data
    zero = torch.tensor(0.0, dtype=torch.float64)
    assert_close(la.log_det_prior_precision, p0.log().sum())
    assert_close(la.log_det_posterior_precision, p0.log().sum())
    assert_close(la.log_det_ratio, zero)
    assert_close(la.scatter, zero)
    # square_norm and log_prob are those of the prior N(μ₀, diag(p₀)⁻¹)
    value = theta_map + 0.1
    prior = Normal(torch.full((P,), 0.3, dtype=torch.float64), p0.rsqrt())
    assert_close(la.square_norm(value), ((value - 0.3).square() * p0).sum())
    assert_close(la.log_prob(value), prior.log_prob(value).sum())
    unnormalised = -0.5 * ((value - 0.3).square() * p0).sum()
    assert_close(la.log_prob(value, normalized=False), unnormalised)


@pytest.mark.parametrize("name", list(CLASSES))
def test_predictions_samples_and_marglik_need_fit(name):
    case, la = _build(name)
    for action in (
        lambda: la(case.X[:2]),
        lambda: la.predictive_samples(case.X[:2], n_samples=2),
        lambda: la.sample(2),
        la.log_marginal_likelihood,
        lambda: la.log_likelihood,
        la.state_dict,
    ):
        with pytest.raises(RuntimeError, match="call fit\\(\\) first"):
            action()


@pytest.mark.parametrize("name", ["full", "diag", "kron", "lowrank", "full_subnet"])
def test_init_H_resets_to_the_prior_and_fit_starts_from_it(name):
    case, la = _build(name, prior_precision=2.0)
    zero = _dense(la.H).clone()
    la.fit(case.loader())
    fitted = la.log_det_posterior_precision.clone()
    assert not torch.allclose(fitted, la.log_det_prior_precision)
    la._init_H()
    assert_close(_dense(la.H), zero)
    assert_close(la.log_det_posterior_precision, la.log_det_prior_precision)
    # fit(override=False) on an unfitted approximation equals a plain fit
    if name != "lowrank":
        _, fresh = _build(name, prior_precision=2.0)
        fresh.fit(case.loader(), override=False)
        assert_close(fresh.log_det_posterior_precision, fitted)


def test_unfitted_mean_follows_the_prior_mean_and_fit_sets_the_map():
    case, la = _build("diag")
    assert_close(la.mean, torch.zeros(la.n_params, dtype=torch.float64))
    la.prior_mean = torch.full((la.n_params,), -1.0, dtype=torch.float64)
    assert_close(la.mean, la.prior_mean)
    la.fit(case.loader())
    theta = torch.cat([p.detach().flatten() for p in case.model.parameters()])
    assert_close(la.mean, theta)
    assert_close(la.scatter, ((theta + 1.0).square() * la.prior_precision_diag).sum())


@pytest.mark.parametrize("name", ["full", "kron", "full_ll"])
def test_a_failed_first_fit_leaves_the_prior(name):
    case, la = _build(name, prior_mean=0.3)
    X = case.X.clone()
    X[9, 0] = float("nan")  # the second batch fails
    with pytest.raises(ValueError, match="NaN"):
        la.fit(DataLoader(TensorDataset(X, case.y), batch_size=7))
    P = len(_covered_weights(name, case.model))
    assert_close(_dense(la.H), torch.zeros(P, P, dtype=torch.float64))
    assert_close(la.mean, torch.full((P,), 0.3, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="call fit"):
        la(case.X[:2])
