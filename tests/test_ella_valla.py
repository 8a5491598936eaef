"""Function-space Laplace with a Nyström basis (ELLA) and inducing points (VaLLA)."""

from __future__ import annotations

import io

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from conftest import CASE_BUILDERS, assert_close
from laplace import ELLA, Laplace, VaLLA
from laplace.baselaplace import ELLA as ELLAFromBaselaplace

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
