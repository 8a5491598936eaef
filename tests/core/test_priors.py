"""Bad input fails early with a clear message naming the problem."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from conftest import CASE_BUILDERS
from laplace import DiagLaplace, FullLaplace, Laplace


@pytest.fixture
def clf():
    return CASE_BUILDERS["mlp_classification"]()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"likelihood": "poisson"}, "likelihood='poisson'.*'classification'"),
        ({"hessian_structure": "block"}, "hessian_structure='block'.*'kron'"),
        ({"subset_of_weights": "half"}, "subset_of_weights='half'.*'all'"),
    ],
)
def test_factory_rejects_unknown_options(clf, kwargs, match):
    args = {
        "likelihood": "classification",
        "subset_of_weights": "all",
        "hessian_structure": "diag",
        **kwargs,
    }
    with pytest.raises(ValueError, match=match):
        Laplace(clf.model, **args)


def test_factory_rejects_unsupported_combination(clf):
    with pytest.raises(ValueError, match="valid structures for this subset: diag, full"):
        Laplace(
            clf.model, "classification", subset_of_weights="subnetwork", hessian_structure="kron"
        )


def test_factory_routes_function_space_approximations(clf):
    for approximation, name in [("nystrom", "ELLA"), ("variational", "VaLLA")]:
        with pytest.raises(TypeError, match=name):  # their required arguments are missing
            Laplace(
                clf.model,
                "classification",
                "all",
                "gp",
                functional_approximation=approximation,
            )


def test_reward_modeling_rejects_full(clf):
    with pytest.raises(ValueError, match="reward_modeling"):
        Laplace(clf.model, "reward_modeling", subset_of_weights="all", hessian_structure="full")


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"pred_type": "bayes"}, "pred_type='bayes'.*'glm'"),
        ({"link_approx": "logit"}, "link_approx='logit'.*'probit'"),
        ({"pred_type": "nn"}, "only link_approx='mc'"),
    ],
)
def test_predictive_rejects_bad_options(clf, kwargs, match):
    la = DiagLaplace(clf.model, "classification")
    la.fit(clf.loader())
    with pytest.raises(ValueError, match=match):
        la(clf.X[:2], **kwargs)


def test_use_before_fit_is_refused(clf):
    la = FullLaplace(clf.model, "classification")
    for action in (
        lambda: la(clf.X[:2]),
        la.log_marginal_likelihood,
        lambda: la.sample(2),
        lambda: la.optimize_prior_precision(),
        la.state_dict,
    ):
        with pytest.raises(RuntimeError, match="call fit"):
            action()


@pytest.mark.parametrize("prior", [torch.ones(3), torch.tensor([-1.0]), 0.0, torch.ones(2, 2)])
def test_bad_prior_precision(clf, prior):
    with pytest.raises(ValueError, match="prior_precision"):
        DiagLaplace(clf.model, "classification", prior_precision=prior)


def test_bad_prior_precision_on_assignment(clf):
    la = DiagLaplace(clf.model, "classification")
    with pytest.raises(ValueError, match="length 3"):
        la.prior_precision = torch.ones(3)


def test_bad_prior_mean(clf):
    with pytest.raises(ValueError, match="prior_mean"):
        DiagLaplace(clf.model, "classification", prior_mean=torch.zeros(5))


def test_sigma_noise_must_be_one_for_classification(clf):
    with pytest.raises(ValueError, match="sigma_noise must be 1"):
        DiagLaplace(clf.model, "classification", sigma_noise=2.0)
    la = DiagLaplace(clf.model, "classification")
    with pytest.raises(ValueError, match="sigma_noise must be 1"):
        la.sigma_noise = 0.5


def test_non_positive_sigma_and_temperature():
    reg = CASE_BUILDERS["mlp_regression_1out"]()
    with pytest.raises(ValueError, match="sigma_noise must be positive"):
        DiagLaplace(reg.model, "regression", sigma_noise=0.0)
    with pytest.raises(ValueError, match="temperature"):
        DiagLaplace(reg.model, "regression", temperature=0.0)


def test_empty_loader(clf):
    la = DiagLaplace(clf.model, "classification")
    empty = DataLoader(TensorDataset(clf.X[:0], clf.y[:0]), batch_size=4)
    with pytest.raises(ValueError, match="empty"):
        la.fit(empty)


def test_nan_in_data(clf):
    X = clf.X.clone()
    X[3, 1] = float("nan")
    la = DiagLaplace(clf.model, "classification")
    with pytest.raises(ValueError, match="NaN"):
        la.fit(DataLoader(TensorDataset(X, clf.y), batch_size=4))


def test_nan_in_curvature(clf):
    with torch.no_grad():
        clf.model[0].weight[0, 0] = float("inf")
    la = FullLaplace(clf.model, "classification")
    with pytest.raises(RuntimeError, match="NaN or inf"):
        la.fit(clf.loader())


def test_model_without_trainable_parameters(clf):
    for p in clf.model.parameters():
        p.requires_grad_(False)
    with pytest.raises(ValueError, match="requires_grad"):
        DiagLaplace(clf.model, "classification")


def test_bad_batches(clf):
    la = DiagLaplace(clf.model, "classification")
    with pytest.raises(ValueError, match="dict_key_y"):
        la.fit(DataLoader([{"input_ids": clf.X[0], "y": clf.y[0]}], batch_size=1))


def test_regression_target_shape_mismatch():
    reg = CASE_BUILDERS["mlp_regression_3out"]()
    la = DiagLaplace(reg.model, "regression")
    bad = DataLoader(TensorDataset(reg.X, reg.y[:, :2]), batch_size=5)
    with pytest.raises(ValueError, match="targets"):
        la.fit(bad)


def test_bad_backend(clf):
    with pytest.raises(TypeError, match="backend"):
        DiagLaplace(clf.model, "classification", backend=object)


def test_asdl_fisher_kwargs_are_ignored_by_other_backends(clf):
    la = DiagLaplace(clf.model, "classification", asdl_fisher_kwargs={"n_mc_samples": 3})
    la.fit(clf.loader())
    assert la.H.shape == (la.n_params,)
