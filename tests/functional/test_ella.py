"""Function-space Laplace with a Nyström basis (ELLA) and inducing points (VaLLA)."""

from __future__ import annotations

import io
import math

import pytest
import torch
from torch.utils.data import DataLoader, SubsetRandomSampler, TensorDataset

from conftest import CASE_BUILDERS, assert_close
from laplace import ELLA, Laplace, VaLLA
from laplace.baselaplace import ELLA as ELLAFromBaselaplace
from laplace.curvature import AsdlEF
from laplace.evaluation import evaluate
from test_backprop_and_reward import PairScorer  # (B, 2, D) pairs → (B, 2); (B, D) → (B, 1)

#: ELLA with a complete basis vs FullLaplace: both are exact, only round-off differs.
EXACT_RTOL, EXACT_ATOL = 1e-7, 1e-12
#: Absolute gap allowed between a rank-10 ELLA and the exact predictive variances.
LOW_RANK_ATOL = 0.02
HYPER = {"sigma_noise": 0.6, "prior_precision": 1.7, "temperature": 0.9}


def regression_data(n: int = 40, seed: int = 0):
    case = CASE_BUILDERS["mlp_regression_1out"]()  # 26 parameters
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(n, 3, dtype=torch.float64, generator=g)
    y = torch.randn(n, 1, dtype=torch.float64, generator=g)
    return case.model, X, DataLoader(TensorDataset(X, y), batch_size=7)


def ella(model, loader, subsample_size, n_eigenvalues, **kwargs):
    la = Laplace(
        model,
        kwargs.pop("likelihood", "regression"),
        "all",
        "gp",
        functional_approximation="nystrom",
        subsample_size=subsample_size,
        n_eigenvalues=n_eigenvalues,
        **kwargs,
    )
    la.fit(loader)
    return la


def full_laplace(model, loader):
    full = Laplace(model, "regression", "all", "full", **HYPER)
    full.fit(loader)
    return full


def test_ella_with_all_eigenvalues_equals_the_full_laplace_glm_predictive():
    model, _, loader = regression_data()
    la = ella(model, loader, 40, 26, **HYPER)  # N > P: the basis spans all of R^P
    assert type(la) is ELLA is ELLAFromBaselaplace
    full = full_laplace(model, loader)
    X_test = torch.randn(6, 3, dtype=torch.float64)
    for joint in (False, True):
        for a, b in zip(la(X_test, joint=joint), full(X_test, joint=joint)):
            assert_close(a, b, rtol=EXACT_RTOL, atol=EXACT_ATOL)
    Js, _ = full.backend.jacobians(X_test)
    assert_close(la.functional_variance(Js), full.functional_variance(Js), EXACT_RTOL, EXACT_ATOL)


def test_ella_with_the_whole_subset_is_exact_at_the_training_inputs():
    model, X, loader = regression_data(n=15)  # N < P: exact on the span of the data
    la = ella(model, loader, 15, 15, **HYPER)
    full = full_laplace(model, loader)
    for a, b in zip(la(X, joint=True), full(X, joint=True)):
        assert_close(a, b, rtol=EXACT_RTOL, atol=EXACT_ATOL)


def test_ella_with_fewer_eigenvalues_is_a_psd_approximation_close_to_exact():
    model, _, loader = regression_data()
    la = ella(model, loader, 40, 10, **HYPER)
    exact = full_laplace(model, loader)
    X_test = torch.randn(8, 3, dtype=torch.float64)
    _, cov = la.predictive_moments(X_test, joint=True)
    assert bool((torch.linalg.eigvalsh(cov) > -1e-12).all())
    assert_close(la(X_test)[1], exact(X_test)[1], rtol=0.0, atol=LOW_RANK_ATOL)
    assert la.dual_directions.shape == (26, 10)
    assert_close(la.dual_directions.T @ la.dual_directions, torch.eye(10), atol=1e-10)


def test_ella_classification_shapes_samples_and_history():
    case = CASE_BUILDERS["mlp_classification"]()
    la = ella(case.model, case.loader(), 12, 6, likelihood="classification")
    probs = la(case.X[:5])
    assert probs.shape == (5, 4)
    assert_close(probs.sum(-1), torch.ones(5))
    assert la.functional_samples(case.X[:5], n_samples=3).shape == (3, 5, 4)
    assert la.predictive_samples(case.X[:5], n_samples=3).shape == (3, 5, 4)
    assert la.fit_history_["processed_examples"][-1] == 20.0
    balanced = ella(case.model, case.loader(), 8, 4, likelihood="classification")
    balanced.fit(case.loader(), balanced=True, val_loader=case.loader())
    assert len(balanced.fit_history_["val_nll"]) == 1


def test_ella_gridsearch_and_missing_marglik():
    model, _, loader = regression_data()
    la = ella(model, loader, 20, 8)
    la.optimize_prior_precision(val_loader=loader, grid_size=5)
    assert len(la.fit_history_["tuning"]) == 5
    best = min(la.fit_history_["tuning"], key=lambda r: r["val_nll"])
    assert float(la.prior_precision) == pytest.approx(best["prior_precision"])
    with pytest.raises(NotImplementedError, match="gridsearch"):
        la.optimize_prior_precision(method="marglik")
    with pytest.raises(NotImplementedError, match="marginal likelihood"):
        la.log_marginal_likelihood()


def test_ella_state_dict_round_trip_with_weights_only():
    model, _, loader = regression_data()
    la = ella(model, loader, 20, 8, **HYPER)
    buffer = io.BytesIO()
    torch.save(la.state_dict(), buffer)
    buffer.seek(0)
    restored = ELLA(model, "regression", 1, 1)
    restored.load_state_dict(torch.load(buffer, weights_only=True))
    X_test = torch.randn(4, 3, dtype=torch.float64)
    for a, b in zip(restored(X_test), la(X_test)):
        assert_close(a, b)
    with torch.no_grad():
        next(model.parameters()).add_(1.0)
    with pytest.raises(ValueError, match="MAP weights"):
        ELLA(model, "regression", 1, 1).load_state_dict(la.state_dict())


def test_ella_predicts_with_its_final_posterior_after_validation_steps_and_refits():
    model, X, loader = regression_data()  # 6 batches: validations after batches 2, 4 and 6
    plain = ella(model, loader, 20, 8, **HYPER)
    validated = ELLA(model, "regression", 20, 8, **HYPER)
    validated.fit(loader, val_loader=loader, val_steps=2)
    assert len(validated.fit_history_["val_nll"]) == 3
    first_data = DataLoader(torch.utils.data.Subset(loader.dataset, range(25)), batch_size=7)
    refitted = ella(model, first_data, 20, 8, **HYPER)
    refitted(X[:2])
    refitted.fit(loader)
    for la in (validated, refitted):
        for a, b in zip(la(X[:4]), plain(X[:4])):
            assert_close(a, b)


def test_ella_bad_inputs_raise_clear_errors():
    model, _, loader = regression_data()
    with pytest.raises(ValueError, match="n_eigenvalues <= subsample_size"):
        ELLA(model, "regression", subsample_size=5, n_eigenvalues=6)
    with pytest.raises(ValueError, match="subset_of_weights='all'"):
        Laplace(model, "regression", "last_layer", "gp", functional_approximation="nystrom")
    with pytest.raises(ValueError, match="scalar prior_precision"):
        ELLA(model, "regression", 5, 2, prior_precision=torch.ones(3))
    with pytest.raises(ValueError, match="exceeds"):
        ELLA(model, "regression", 50, 2).fit(loader)
    with pytest.raises(ValueError, match="numerical rank"):
        ELLA(model, "regression", 40, 30).fit(loader)
    with pytest.raises(RuntimeError, match="fit"):
        ELLA(model, "regression", 5, 2)(torch.randn(2, 3, dtype=torch.float64))


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


# ------------------------------------------------------------------------- reward modelling
def reward_setup():
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    X = torch.randn(14, 2, 3, dtype=torch.float64, generator=g)
    y = torch.randint(0, 2, (14,), generator=g)
    return PairScorer().double(), X, DataLoader(TensorDataset(X, y), batch_size=5)


@pytest.mark.parametrize("method", ["ella", "valla"])
def test_reward_modeling_fits_on_pairs_and_predicts_rewards(method):
    model, _, loader = reward_setup()
    if method == "ella":
        la = ELLA(model, "reward_modeling", subsample_size=6, n_eigenvalues=4)
        la.fit(loader)
    else:
        la = VaLLA(model, "reward_modeling", "random", num_inducing=5)
        la.fit(loader, iterations=4, lr=1e-2)
        assert la.inducing_locations.shape == (5, 3)  # items of 3 pairs
        assert bool((la.inducing_classes == 0).all())
    x_test = torch.randn(4, 3, dtype=torch.float64)
    f_mu, f_var = la(x_test)
    assert f_mu.shape == (4, 1) and f_var.shape == (4, 1, 1) and bool((f_var > 0).all())
    assert_close(f_mu, model(x_test))
    assert la.predictive_samples(x_test, n_samples=2).shape == (2, 4, 1)


def test_reward_modeling_valla_needs_pairs():
    model, X, _ = reward_setup()
    loader = DataLoader(TensorDataset(X[:, 0], torch.zeros(14, dtype=torch.long)), batch_size=5)
    with pytest.raises(ValueError, match=r"pairs of shape \(B, 2, ...\)"):
        VaLLA(model, "reward_modeling", "random", num_inducing=3).fit(loader, iterations=1)


def test_reward_modeling_ella_predicts_pair_probabilities_when_fitting():
    torch.manual_seed(0)
    model = PairScorer().double()
    X = torch.randn(12, 2, 3, dtype=torch.float64)
    y = torch.randint(0, 2, (12,))
    la = Laplace(
        model,
        "reward_modeling",
        subset_of_weights="all",
        hessian_structure="gp",
        functional_approximation="nystrom",
        n_eigenvalues=5,
        subsample_size=10,
    )
    la.fit(DataLoader(TensorDataset(X, y), batch_size=5))
    probs = la(X[:3], pred_type="gp", fitting=True)
    assert probs.shape == (3, 2)
    assert_close(probs.sum(-1), torch.ones(3, dtype=torch.float64))
    f_mu, f_var = la(torch.randn(4, 3, dtype=torch.float64), pred_type="gp")
    assert f_mu.shape == (4, 1) and f_var.shape == (4, 1, 1)


# ------------------------------------------------ hyperparameters, checkpoints and Jacobians
def valla(model, X, likelihood="regression", **kwargs):
    return Laplace(
        model,
        likelihood,
        "all",
        "gp",
        functional_approximation="variational",
        inducing_locations=X[:4].clone(),
        **kwargs,
    )


@pytest.mark.parametrize("value", [0.0, -1.0, math.nan, math.inf])
@pytest.mark.parametrize("structure", ["nystrom", "variational", "full"])
def test_temperature_is_checked_on_every_assignment(structure, value):
    model, X, loader = regression_data()
    if structure == "nystrom":
        la = ella(model, loader, 10, 3)
    elif structure == "variational":
        la = valla(model, X)
    else:
        la = Laplace(model, "regression", "all", "full")
    with pytest.raises(ValueError, match="temperature must be positive"):
        la.temperature = value
    assert la.temperature == 1.0  # a refused value changes nothing
    la.temperature = 2.5
    assert la.temperature == 2.5


@pytest.mark.parametrize("structure", ["nystrom", "variational"])
def test_ella_and_valla_keep_a_centred_prior_after_construction(structure):
    model, X, loader = regression_data()
    la = ella(model, loader, 10, 3) if structure == "nystrom" else valla(model, X)
    with pytest.raises(ValueError, match="prior_mean=0"):
        la.prior_mean = 1.0
    assert torch.all(la.prior_mean == 0)
    la.prior_mean = 0.0  # zero stays allowed
    with pytest.raises(ValueError, match="prior_mean=0"):
        valla(model, X, prior_mean=0.5) if structure == "variational" else ella(
            model, loader, 10, 3, prior_mean=0.5
        )


def test_functional_predictive_is_the_call_with_positional_options():
    case = CASE_BUILDERS["mlp_classification"]()
    la = ella(case.model, case.loader(), 8, 3, likelihood="classification")
    probit = la.predictive(case.X[:5], "gp", "probit", 10)
    assert_close(probit, la(case.X[:5]))
    assert_close(probit.sum(-1), torch.ones(5, dtype=probit.dtype))


@pytest.mark.parametrize("structure", ["nystrom", "variational"])
def test_loading_a_checkpoint_puts_the_model_in_evaluation_mode(structure):
    # Dropout between two layers: in training mode a prediction would be random.
    torch.manual_seed(3)
    model = torch.nn.Sequential(
        torch.nn.Linear(3, 8), torch.nn.Dropout(0.5), torch.nn.Linear(8, 1)
    ).double()
    X = torch.randn(24, 3, dtype=torch.float64)
    loader = DataLoader(TensorDataset(X, X.sum(-1, keepdim=True)), batch_size=6)
    fitted = ella(model, loader, 8, 3) if structure == "nystrom" else valla(model, X)
    if structure == "variational":
        fitted.fit(loader, iterations=2)
    state = fitted.state_dict()
    model.train()
    restored = (
        Laplace(model, "regression", "all", "gp", functional_approximation="nystrom",
                subsample_size=8, n_eigenvalues=3)
        if structure == "nystrom"
        else valla(model, X)
    )  # fmt: skip
    restored.load_state_dict(state)
    assert not model.training
    for a, b in zip(restored(X[:4]), fitted(X[:4])):
        assert_close(a, b)


def test_validation_nll_is_a_tensor_and_the_history_holds_floats():
    model, _, loader = regression_data()
    la = Laplace(
        model, "regression", "all", "gp", functional_approximation="nystrom",
        subsample_size=10, n_eigenvalues=3,
    )  # fmt: skip
    la.fit(loader, val_loader=loader)
    score = la._validation_nll(loader)
    assert isinstance(score, torch.Tensor) and score.dim() == 0
    assert all(type(value) is float for value in la.fit_history_["val_nll"])
    assert la.fit_history_["val_nll"][-1] == pytest.approx(float(score))


@pytest.mark.parametrize("structure", ["nystrom", "variational"])
def test_functional_variance_refuses_jacobians_of_another_width(structure):
    model, X, loader = regression_data()
    la = ella(model, loader, 10, 3) if structure == "nystrom" else valla(model, X)
    if structure == "variational":
        la.fit(loader, iterations=1)
    Js, _ = la.backend.jacobians(X[:3])
    assert la.functional_variance(Js).shape == (3, 1, 1)
    for method in (la.functional_variance, la.functional_covariance):
        with pytest.raises(ValueError, match="Invalid Jacobians shape"):
            method(Js[..., :-1])


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


@pytest.mark.parametrize(
    ("call", "phrase"),
    [
        (lambda m, X, loader: ella(m, loader, 10, 3, likelihood="classification", sigma_noise=2.0),
         "only available for regression"),
        (lambda m, X, loader: ella(m, loader, 2.5, 1), "n_eigenvalues"),
        (lambda m, X, loader: ella(m, loader, 10, 3).fit(loader, val_steps=0),
         "val_steps must be positive"),
        (lambda m, X, loader: Laplace(m, "regression", "all", "diag",
                                 functional_approximation="nystrom"),
         "requires hessian_structure"),
        (lambda m, X, loader: ella(
            torch.nn.Linear(1, 1, bias=False).double(),
            DataLoader(TensorDataset(torch.ones(4, 1).double(), torch.ones(4, 1).double())),
            2, 2),
         "insufficient positive rank"),
    ],
)  # fmt: skip
def test_errors_carry_laplace_torchs_wording(call, phrase):
    # Code written against laplace-torch matches these phrases; ours follow them.
    model, X, loader = regression_data()
    with pytest.raises(ValueError, match=phrase):
        call(model, X, loader)


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


@pytest.mark.parametrize("structure", ["nystrom", "variational", "full"])
def test_one_hot_integer_class_targets_fit_as_their_labels(structure):
    case = CASE_BUILDERS["mlp_classification"]()
    one_hot = torch.nn.functional.one_hot(case.y, case.model(case.X[:1]).shape[-1])
    options = {
        "nystrom": {
            "functional_approximation": "nystrom",
            "subsample_size": 8,
            "n_eigenvalues": 4,
        },
        "variational": {
            "functional_approximation": "variational",
            "inducing_locations": case.X[:4],
        },
        "full": {"backend": AsdlEF},  # ASDL reads the targets itself
    }[structure]
    predictions = []
    for targets in (case.y, one_hot):
        loader = DataLoader(TensorDataset(case.X, targets), batch_size=10)
        la = Laplace(case.model, "classification", "all", "gp" if structure != "full" else "full",
                     **options)  # fmt: skip
        la.fit(loader, **({"iterations": 3, "lr": 1e-2} if structure == "variational" else {}))
        predictions.append(la(case.X[:5]))
    assert_close(predictions[0], predictions[1])


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


# ------------------------------------------------------------------ checkpoints and identity
def _functional(structure, model, X, **kwargs):
    if structure == "nystrom":
        return ELLA(model, "regression", subsample_size=6, n_eigenvalues=3, **kwargs)
    return VaLLA(model, "regression", X[:3].clone(), **kwargs)


def _fitted_functional(structure, model, X, loader, **kwargs):
    la = _functional(structure, model, X, **kwargs)
    la.fit(loader, **({"iterations": 2} if structure == "variational" else {}))
    return la


@pytest.mark.parametrize("structure", ["nystrom", "variational"])
def test_functional_checkpoints_refuse_another_model_or_other_keys(structure):
    _, X, loader = regression_data(n=12)

    def net(activation=torch.nn.Tanh, frozen=0):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(3, 4), activation(), torch.nn.Linear(4, 1))
        model[frozen].requires_grad_(False)
        return model.double()

    state = _fitted_functional(structure, net(), X, loader).state_dict()
    refusals = {
        r"param_names .* trainable coordinates": net(frozen=2),
        r"module_tree .*'1', 'Tanh'.*'1', 'ReLU'.* same pretrained model": net(torch.nn.ReLU),
    }
    for phrase, model in refusals.items():
        la = _functional(structure, model, X)
        with pytest.raises(ValueError, match=phrase):
            la.load_state_dict(state)
        assert not la._fitted  # a refused state changes nothing
    for key in ("dict_key_x", "dict_key_y"):
        la = _functional(structure, net(), X, **{key: "other"})
        with pytest.raises(ValueError, match=f"{key} is '(input_ids|labels)', expected 'other'"):
            la.load_state_dict(state)
    _functional(structure, net(), X).load_state_dict(state)


# ------------------------------------------------------------------- hooks a subclass can use
class FirstPointsELLA(ELLA):
    """ELLA whose Nyström subset is the first ``subsample_size`` points of the dataset."""

    def _indices(self, loader, balanced):
        return torch.arange(self.subsample_size)


def test_ella_basis_spans_the_jacobians_of_the_points_its_indices_hook_chooses():
    model, X, loader = regression_data(n=20)  # one output: each point's Jacobian row is J(x)
    la = FirstPointsELLA(model, "regression", subsample_size=5, n_eigenvalues=5)
    la.fit(loader)
    V = la.dual_directions
    J = la.backend.jacobians(X)[0][:, 0].double()  # (N, P)
    projected = J @ V @ V.T
    assert_close(projected[:5], J[:5], rtol=1e-9, atol=1e-12)
    assert float((projected[5:] - J[5:]).norm()) > 1e-3  # other points leave the span
    phi, f = la._features(X[:3])
    assert_close(phi, (J[:3] @ V)[:, None], rtol=1e-12, atol=1e-12)
    assert_close(f, model(X[:3]))
    assert la.feature_gram.shape == (5, 5)


def test_ella_indices_hook_draws_among_the_points_the_loader_reaches_and_balances_classes():
    X = torch.randn(12, 3, generator=torch.Generator().manual_seed(0))
    y = torch.tensor([0] * 11 + [1])
    case = CASE_BUILDERS["mlp_classification"]()
    la = ELLA(case.model.float(), "classification", subsample_size=4, n_eigenvalues=2, seed=3)
    sampled = DataLoader(TensorDataset(X, y), batch_size=4, sampler=SubsetRandomSampler(range(8)))
    assert set(la._indices(sampled, balanced=False).tolist()) <= set(range(8))
    everything = DataLoader(TensorDataset(X, y), batch_size=4)
    balanced = la._indices(everything, balanced=True)
    assert len(balanced) == 4 and 11 in balanced.tolist()  # the one point of class 1
    with pytest.raises(ValueError, match="balanced=True needs classification"):
        ELLA(torch.nn.Linear(3, 1), "regression", 4, 2)._indices(everything, balanced=True)


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


# --------------------------------------------------------- regression targets (B,) of one output
def _fit_with_targets(structure, model, X, y, y_val):
    """An ELLA or VaLLA fitted on targets ``y`` with ``y_val`` as validation targets."""
    la = _functional(structure, model, X)
    loader = DataLoader(TensorDataset(X, y), batch_size=5)
    val_loader = DataLoader(TensorDataset(X[:8], y_val[:8]), batch_size=3)
    fit_options = {"iterations": 4, "lr": 1e-2} if structure == "variational" else {}
    la.fit(loader, val_loader=val_loader, val_steps=2, **fit_options)
    return la


@pytest.mark.parametrize("structure", ["nystrom", "variational"])
@pytest.mark.parametrize("val_targets", ["vector", "column"])
def test_vector_targets_of_one_output_fit_as_their_column(structure, val_targets):
    model, X, loader = regression_data(n=15)
    y = loader.dataset.tensors[1]  # (N, 1)
    column = _fit_with_targets(structure, model, X, y, y)
    y_val = y[:, 0] if val_targets == "vector" else y
    vector = _fit_with_targets(structure, model, X, y[:, 0], y_val)
    assert column.fit_history_ == vector.fit_history_
    assert len(vector.fit_history_["val_nll"]) >= 2
    for a, b in zip(vector(X[:4]), column(X[:4])):
        assert torch.equal(a, b)
    scores = [evaluate(la, DataLoader(TensorDataset(X, targets), batch_size=5))
              for la, targets in ((vector, y[:, 0]), (column, y))]  # fmt: skip
    assert scores[0]["nll"] == scores[1]["nll"] and scores[0]["rmse"] == scores[1]["rmse"]


def test_ella_tunes_its_prior_precision_on_vector_validation_targets():
    model, X, loader = regression_data(n=15)
    y = loader.dataset.tensors[1]
    histories = []
    for targets in (y, y[:, 0]):
        la = _fitted_functional("nystrom", model, X, loader)
        val_loader = DataLoader(TensorDataset(X[:8], targets[:8]), batch_size=3)
        la.optimize_prior_precision(val_loader=val_loader, grid_size=5)
        histories.append(la.fit_history_["tuning"])
    assert histories[0] == histories[1]


@pytest.mark.parametrize("structure", ["nystrom", "variational"])
def test_vector_targets_of_two_outputs_are_refused(structure):
    case = CASE_BUILDERS["mlp_regression_3out"]()  # outputs (N, 3)
    vector = DataLoader(TensorDataset(case.X, case.y[:, 0]), batch_size=5)
    shapes = r"targets of shape \(5,\) do not match the model output of shape \(5, 3\)"
    fit_options = {"iterations": 2} if structure == "variational" else {}
    la = _functional(structure, case.model, case.X)
    with pytest.raises(ValueError, match=shapes):
        la.fit(vector, **fit_options)
    column = DataLoader(TensorDataset(case.X, case.y), batch_size=5)
    with pytest.raises(ValueError, match=shapes):  # the validation targets
        la.fit(column, val_loader=vector, **fit_options)
