"""VaLLA: function-space Laplace with variational inducing points."""

from __future__ import annotations

import io
import math

import pytest
import torch
from functional_cases import HYPER, regression_data, reward_setup, valla
from torch.utils.data import DataLoader, SubsetRandomSampler, TensorDataset

from conftest import CASE_BUILDERS, PairScorer, assert_close
from laplace import ELLA, Laplace, VaLLA


@pytest.mark.parametrize("inducing", ["tensor", "random", "kmeans"])
def test_valla_elbo_increases_and_regression_predictive_shapes(inducing):
    model, X, _ = regression_data(n=20)
    loader = DataLoader(TensorDataset(X, torch.randn(20, 1, dtype=torch.float64)), batch_size=20)
    Z = X[:5].clone() if inducing == "tensor" else inducing
    la = Laplace(
        model,
        "regression",
        "all",
        "gp",
        functional_approximation="variational",
        inducing_locations=Z,
        num_inducing=5,
    )
    assert type(la) is VaLLA
    la.fit(loader, iterations=20, lr=1e-2)
    objective = la.fit_history_["objective"]  # the negative ELBO
    assert len(objective) == 20 and objective[-1] < objective[0]
    f_mu, f_var = la(X[:3])
    assert f_mu.shape == (3, 1) and f_var.shape == (3, 1, 1) and bool((f_var > 0).all())
    assert la(X[:3], joint=True)[1].shape == (3, 3)


def test_valla_classification_predictive_and_bad_inputs():
    case = CASE_BUILDERS["mlp_classification"]()
    la = VaLLA(case.model, "classification", "random", num_inducing=6)
    la.fit(case.loader(batch_size=20), iterations=5, lr=1e-2)
    probs = la(case.X[:3])
    assert probs.shape == (3, 4)
    assert_close(probs.sum(-1), torch.ones(3))
    assert la.functional_samples(case.X[:3], n_samples=2).shape == (2, 3, 4)
    with pytest.raises(ValueError, match="'random', 'kmeans'"):
        VaLLA(case.model, "classification", "grid", num_inducing=3)
    with pytest.raises(ValueError, match="num_inducing"):
        VaLLA(case.model, "classification", "random")
    with pytest.raises(ValueError, match="num_inducing"):
        VaLLA(case.model, "classification", case.X[:4], num_inducing=3)
    with pytest.raises(NotImplementedError, match="fit"):
        la.optimize_prior_precision()
    with pytest.raises(ValueError, match="subset_of_weights='all'"):
        Laplace(
            case.model,
            "classification",
            "last_layer",
            "gp",
            functional_approximation="variational",
        )


# --------------------------------------------------------------------- VaLLA: alpha, MC, state
#: Objective of one MC estimate vs an independent estimate: a few standard errors of S draws.
MC_SAMPLES = 4000


MC_ATOL = 5 / MC_SAMPLES**0.5


def fitted_valla(alpha=1.0, iterations=3, **kwargs):
    model, X, loader = regression_data(n=20)
    la = VaLLA(model, "regression", X[:5].clone(), alpha=alpha, **HYPER, **kwargs)
    la.fit(loader, iterations=iterations, lr=1e-2)
    return la, X, loader


def dense_posterior(la):
    """Dense ``Σ_q = (δI + J_Zᵀ L Lᵀ J_Z)⁻¹`` (P, P) in float64, the oracle of the QR route."""
    Js, _ = la.backend.jacobians(la.inducing_locations.detach())
    JZ = Js[torch.arange(la.num_inducing), la.inducing_classes].double()
    L = la._factor_matrix().detach().double()
    delta = float(la.prior_precision)
    eye = torch.eye(JZ.shape[1], dtype=torch.float64)
    return torch.linalg.inv(delta * eye + JZ.T @ L @ L.T @ JZ), delta


@pytest.mark.parametrize("alpha", [1.0, 0.5, 0.0])
def test_valla_regression_alpha_objective_matches_quadrature_and_dense_kl(alpha):
    import numpy as np

    la, _, loader = fitted_valla(alpha)
    Xb, yb = next(iter(loader))
    Sigma, delta = dense_posterior(la)
    Js, f = la.backend.jacobians(Xb)
    J, m = Js[:, 0].double(), f[:, 0].double().detach()
    v = torch.einsum("bp,pq,bq->b", J, Sigma, J)
    s2 = float(la.sigma_noise) ** 2
    nodes, weights = (torch.as_tensor(a) for a in np.polynomial.hermite_e.hermegauss(60))
    fs = m[:, None] + v.sqrt()[:, None] * nodes[None]  # (B, 60) quadrature nodes of q(f)
    log_p = -0.5 * (yb - fs).square() / s2 - 0.5 * math.log(2 * math.pi * s2)
    w = weights / weights.sum()
    # alpha = 0: E_q[log p]; else (1/alpha) log E_q[p^alpha]
    ell = (log_p * w).sum(1) if alpha == 0 else torch.logsumexp(alpha * log_p + w.log(), 1) / alpha
    P = Sigma.shape[0]
    kl = 0.5 * (delta * Sigma.trace() - P - P * math.log(delta) - torch.logdet(Sigma))
    expected = -(20 / len(yb)) * ell.sum() / HYPER["temperature"] + kl
    assert_close(la._objective(Xb, yb).detach(), expected, rtol=1e-9, atol=1e-9)
    _, f_var = la(Xb)
    assert_close(f_var[:, 0, 0], v, rtol=1e-9, atol=1e-12)


def test_valla_alpha_to_zero_is_the_elbo_and_default_alpha_is_one():
    la, X, loader = fitted_valla(0.0)
    Xb, yb = next(iter(loader))
    elbo = la._objective(Xb, yb).detach()
    la.alpha = 1e-9
    assert_close(la._objective(Xb, yb).detach(), elbo, rtol=1e-7)
    assert VaLLA(la.model, "regression", X[:2]).alpha == 1.0
    assert VaLLA(la.model, "regression", X[:2]).mc_softmax_samples == 0


def test_valla_mc_softmax_objective_is_seeded_and_estimates_the_alpha_energy():
    case = CASE_BUILDERS["mlp_classification"]()
    loader = case.loader(batch_size=20)
    kwargs = {"inducing_classes": torch.arange(4), "seed": 3}
    runs = []
    for _ in range(2):
        la = VaLLA(
            case.model, "classification", case.X[:4], alpha=0.5, mc_softmax_samples=4, **kwargs
        )
        la.fit(loader, iterations=3, lr=1e-2)
        runs.append(la.fit_history_["objective"])
    assert runs[0] == runs[1]  # the generator is seeded with `seed`
    assert isinstance(la.generator, torch.Generator)
    la.mc_softmax_samples = MC_SAMPLES
    X, y = next(iter(loader))
    with torch.no_grad():
        estimate = la._objective(X, y)
        f, cov, A, R = la._gp.objective_moments(X)
    draws = torch.distributions.MultivariateNormal(f, cov + 1e-12 * torch.eye(4)).sample(
        (MC_SAMPLES,)
    )
    log_p = draws.log_softmax(-1).gather(-1, y.view(1, -1, 1).expand(MC_SAMPLES, -1, 1))
    ell = (torch.logsumexp(0.5 * log_p.squeeze(-1), 0) - math.log(MC_SAMPLES)) / 0.5
    kl = (
        R.diagonal().abs().log().sum()
        - 0.5 * torch.linalg.solve_triangular(R.T, A, upper=False).square().sum()
    )
    reference = -ell.sum() + kl  # N = B: the minibatch is the data
    assert abs(float(estimate - reference)) / len(y) < MC_ATOL


def test_valla_alpha_and_mc_arguments_are_validated():
    case = CASE_BUILDERS["mlp_classification"]()
    with pytest.raises(ValueError, match="mc_softmax_samples > 0"):
        VaLLA(case.model, "classification", case.X[:3], alpha=0.5)
    with pytest.raises(ValueError, match=r"alpha must be a number in \[0, 1\]"):
        VaLLA(case.model, "classification", case.X[:3], alpha=1.5)
    with pytest.raises(ValueError, match="non-negative integer"):
        VaLLA(case.model, "classification", case.X[:3], mc_softmax_samples=-1)


def test_valla_matches_laplace_torch_reference_numbers():
    """Golden numbers of laplace-torch 0.3's VaLLA on the same model, data and inducing inputs."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(3, 5), torch.nn.Tanh(), torch.nn.Linear(5, 1)
    ).double()
    g = torch.Generator().manual_seed(0)
    X = torch.randn(20, 3, dtype=torch.float64, generator=g)
    y = torch.randn(20, 1, dtype=torch.float64, generator=g)
    loader = DataLoader(TensorDataset(X, y), batch_size=7)
    X_test = torch.randn(6, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    la = VaLLA(model, "regression", X[:5].clone(), sigma_noise=0.7, prior_precision=1.3,
               temperature=0.9, alpha=0.5)  # fmt: skip
    la.fit(loader, iterations=15, lr=1e-2)
    objective = la.fit_history_["objective"]
    assert objective[0] == pytest.approx(34.504532908924766, rel=1e-10)
    assert objective[-1] == pytest.approx(47.40048358853253, rel=1e-10)
    f_mu, f_var = la(X_test)
    assert_close(
        f_mu[:2, 0],
        torch.tensor([-0.008071016391005659, 0.07240408023791231], dtype=torch.float64),
        1e-10,
    )
    assert_close(
        f_var[:2, 0, 0],
        torch.tensor([0.2649810634795099, 0.4826179040876342], dtype=torch.float64),
        1e-10,
    )


def test_valla_state_dict_round_trip_weights_only_and_map_location():
    case = CASE_BUILDERS["mlp_classification"]()
    loader = case.loader(batch_size=20)
    la = VaLLA(case.model, "classification", case.X[:4], inducing_classes=torch.arange(4),
               alpha=0.5, mc_softmax_samples=3)  # fmt: skip
    la.fit(loader, iterations=3, lr=1e-2)
    buffer = io.BytesIO()
    torch.save(la.state_dict(), buffer)
    buffer.seek(0)
    state = torch.load(buffer, map_location="cpu", weights_only=True)
    restored = VaLLA(case.model, "classification", "random", num_inducing=2, alpha=0.5,
                     mc_softmax_samples=1)  # fmt: skip
    restored.load_state_dict(state)
    assert_close(restored(case.X[:5]), la(case.X[:5]))
    assert restored.num_inducing == 4 and restored.mc_softmax_samples == 3
    assert restored.fit_history_ == la.fit_history_
    la.fit(loader, iterations=2, lr=1e-2, override=False)  # continues with the same MC draws
    restored.fit(loader, iterations=2, lr=1e-2, override=False)
    assert restored.fit_history_["objective"] == la.fit_history_["objective"]

    regression, _, _ = fitted_valla(0.3)
    with pytest.raises(ValueError, match="likelihood"):
        VaLLA(case.model, "regression", case.X[:2]).load_state_dict(state)
    with pytest.raises(ValueError, match="'VaLLA'"):
        ELLA(case.model, "classification", 1, 1).load_state_dict(state)
    bad = dict(state, L=state["L"][:-1])
    with pytest.raises(ValueError, match="inconsistent VaLLA state"):
        VaLLA(case.model, "classification", case.X[:2]).load_state_dict(bad)
    with pytest.raises(ValueError, match=r"param_shapes .* trainable coordinates"):
        VaLLA(regression.model, "classification", case.X[:2]).load_state_dict(state)
    reg_state = regression.state_dict()
    assert reg_state["alpha"] == 0.3 and reg_state["log_noise_variance"].numel() == 1


def test_reward_modeling_valla_needs_pairs():
    model, X, _ = reward_setup()
    loader = DataLoader(TensorDataset(X[:, 0], torch.zeros(14, dtype=torch.long)), batch_size=5)
    with pytest.raises(ValueError, match=r"pairs of shape \(B, 2, ...\)"):
        VaLLA(model, "reward_modeling", "random", num_inducing=3).fit(loader, iterations=1)


def test_valla_fit_checks_options_changed_after_construction():
    case = CASE_BUILDERS["mlp_classification"]()
    la = valla(case.model, case.X, likelihood="classification")
    la.alpha = 1.5
    with pytest.raises(ValueError, match="alpha must be"):
        la.fit(case.loader(), iterations=1)
    la.alpha, la.mc_softmax_samples = 1.0, -2
    with pytest.raises(ValueError, match="mc_softmax_samples"):
        la.fit(case.loader(), iterations=1)
    la.mc_softmax_samples = 0
    la.fit(case.loader(), iterations=1)
    la.inducing_classes = la.inducing_classes[:1]  # one class for four inducing points
    with pytest.raises(ValueError, match=r"inducing_classes must have shape \(4,\)"):
        la.fit(case.loader(), iterations=1, override=False)


# ------------------------------------------------ data the loader reaches, targets, metadata
def test_valla_scales_its_data_term_to_the_points_the_loader_reaches():
    model, X, _ = regression_data(n=20)
    y = torch.randn(20, 1, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    dataset = TensorDataset(X, y)
    dropping = DataLoader(dataset, batch_size=7, drop_last=True)  # yields rows 0..13 only
    yielded = DataLoader(TensorDataset(X[:14], y[:14]), batch_size=7)
    histories = []
    for loader in (dropping, yielded):
        la = VaLLA(model, "regression", X[:4].clone(), **HYPER)
        la.fit(loader, iterations=3, lr=1e-2)
        assert la.n_data == 14
        histories.append(torch.tensor(la.fit_history_["objective"]))
    assert_close(histories[0], histories[1])
    sampled = DataLoader(dataset, batch_size=7, sampler=SubsetRandomSampler(range(5)))
    la.fit(sampled, iterations=1)
    assert la.n_data == 5


class DictPairScorer(PairScorer):
    """``PairScorer`` reading its pairs or items from ``input_ids`` of a dict batch."""

    def forward(self, data):
        return super().forward(data["input_ids"])


def test_valla_reward_inducing_items_keep_the_metadata_of_their_pair():
    _, X, loader = reward_setup()
    y = loader.dataset.tensors[1]
    rows = [{"input_ids": X[i], "labels": y[i], "source": f"pair{i}", "index": torch.tensor(i)}
            for i in range(len(X))]  # fmt: skip
    la = VaLLA(DictPairScorer().double(), "reward_modeling", "random", num_inducing=4)
    la.fit(DataLoader(rows, batch_size=5), iterations=1)
    Z = la.inducing_locations
    pairs = [int((item == X).all(-1).any(-1).nonzero()) for item in Z["input_ids"]]
    assert len(set(pairs)) == 2  # the two items of each of two pairs
    assert Z["source"] == [f"pair{i}" for i in pairs]
    assert Z["index"].tolist() == pairs


def test_valla_latent_distribution_is_the_dense_posterior_and_feeds_the_objective():
    la, _, loader = fitted_valla(0.5)
    Xb, yb = next(iter(loader))
    f, cov, A, R = la._latent_distribution(Xb)
    assert cov.requires_grad  # differentiable in the variational parameters, for fit
    Sigma, delta = dense_posterior(la)
    Js, f_model = la.backend.jacobians(Xb)
    J = Js.double()
    assert_close(f, f_model)
    assert_close(cov, J @ Sigma @ J.transpose(1, 2), rtol=1e-9, atol=1e-12)
    Jz = la.backend.jacobians(la.inducing_locations.detach())[0][:, 0].double()
    L = la._factor_matrix().detach().double()
    assert_close(A.detach(), L.T @ Jz / delta**0.5, rtol=1e-9, atol=1e-12)
    eye = torch.eye(la.num_inducing, dtype=torch.float64)
    assert_close((R.T @ R).detach(), eye + A.detach() @ A.detach().T, rtol=1e-9, atol=1e-12)
    joint_f, joint_cov, _, _ = la._latent_distribution(Xb, joint=True)
    assert joint_f.shape == f.shape and joint_cov.shape == (len(Xb), len(Xb))

    class PointMassVaLLA(VaLLA):  # no latent variance: the data term is the plain likelihood
        def _latent_distribution(self, X, joint=False):
            f, cov, A, R = super()._latent_distribution(X, joint)
            return f, torch.zeros_like(cov), A, R

    point = PointMassVaLLA(la.model, "regression", la.inducing_locations.detach(), **HYPER)
    point.fit(loader, iterations=2, lr=1e-2)
    f, _, A, _ = VaLLA._latent_distribution(point, Xb)
    f, A, s2 = f.detach(), A.detach(), point.sigma_noise.square()
    log_lik = (-0.5 * (yb - f).square() / s2 - 0.5 * torch.log(2 * math.pi * s2)).sum()
    gram = A @ A.T
    kl = 0.5 * (torch.logdet(eye + gram) - torch.trace(torch.linalg.solve(eye + gram, gram)))
    expected = -(point.n_data / len(yb)) * log_lik / point.temperature + kl
    assert_close(point._objective(Xb, yb).detach(), expected, rtol=1e-9, atol=1e-9)
