"""What ELLA and VaLLA share (``BaseFunctionalLaplace``): hyperparameters, checkpoints, targets.

Reward modelling on pairs, temperature checks on every assignment, a centred prior,
checkpoints that refuse another model, functional variances of the right width and vector
targets of one output, for both function-space approximations.
"""

from __future__ import annotations

import math

import pytest
import torch
from functional_cases import (
    _fitted_functional,
    _functional,
    ella,
    regression_data,
    reward_setup,
    valla,
)
from torch.utils.data import DataLoader, TensorDataset

from conftest import CASE_BUILDERS, assert_close
from laplace import ELLA, Laplace, VaLLA
from laplace.curvature import AsdlEF
from laplace.evaluation import evaluate


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
