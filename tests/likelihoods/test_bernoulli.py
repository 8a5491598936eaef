"""``likelihood="binary_classification"``: targets, backends, low rank, tuning, training, state.

The curvature, marginal likelihood and predictive are checked against oracles in
``test_likelihoods.py``; this file covers what surrounds them.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from likelihood_cases import binary_case
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from conftest import assert_close
from laplace import Laplace, marglik_training
from laplace.curvature import AsdlGGN, BackPackEF, BackPackGGN, CurvlinopsEF, CurvlinopsHessian
from laplace.evaluation import evaluate
from laplace.utils.enums import Likelihood
from laplace.utils.errors import DataError, LabelError

BINARY = Likelihood.BINARY_CLASSIFICATION


def test_enum_member_and_string_are_the_same_likelihood():
    case = binary_case(3, seed=3)
    la = Laplace(case.model, BINARY, "all", "diag")
    assert la.likelihood == "binary_classification" == BINARY


@pytest.mark.parametrize(
    "targets",
    [
        lambda y: y,  # (B,) integers
        lambda y: y.unsqueeze(-1),  # (B, 1)
        lambda y: y.double(),  # floats
        lambda y: y.bool(),  # booleans
    ],
    ids=["int", "column", "float", "bool"],
)
def test_target_forms_give_the_same_fit(targets):
    case = binary_case()
    reference = Laplace(case.model, BINARY, "all", "diag")
    reference.fit(case.loader())
    la = Laplace(case.model, BINARY, "all", "diag")
    la.fit(DataLoader(TensorDataset(case.X, targets(case.y)), batch_size=7))
    assert_close(la.H, reference.H)
    assert_close(la.loss, reference.loss)


@pytest.mark.parametrize(
    ("y", "error", "match"),
    [
        (torch.full((20,), 2), LabelError, "binary label 2 is not 0 or 1"),
        (torch.full((20, 3), 0.5), DataError, r"shape \(B, 1\) or \(B,\)"),
        (torch.full((20,), 1.5, dtype=torch.float64), ValueError, r"in \[0, 1\]"),
    ],
)
def test_bad_targets_are_refused_before_any_curvature(y, error, match):
    case = binary_case()
    la = Laplace(case.model, BINARY, "all", "full")
    with pytest.raises(error, match=match):
        la.fit(DataLoader(TensorDataset(case.X, y), batch_size=7))
    assert not la._fitted


@pytest.mark.parametrize(
    ("n_labels", "backend", "native"),
    [(1, BackPackGGN, None), (3, BackPackEF, CurvlinopsEF)],
    ids=["binary-GGN", "multilabel-EF"],
)
def test_backpack_agrees_with_the_native_backend(n_labels, backend, native):
    case = binary_case(n_labels, seed=3)
    reference = Laplace(case.model, BINARY, "all", "diag", backend=native)
    reference.fit(case.loader())
    la = Laplace(case.model, BINARY, "all", "diag", backend=backend)
    la.fit(case.loader())
    assert_close(la.H, reference.H)


def test_backends_that_cannot_are_refused_naming_one_that_can():
    case = binary_case(3, seed=3)
    la = Laplace(case.model, BINARY, "all", "diag", backend=BackPackGGN)
    with pytest.raises(ValueError, match=r"one output only.*3 labels.*CurvlinopsGGN"):
        la.fit(case.loader())
    with pytest.raises(ValueError, match=r"AsdlGGN supports .*BCEWithLogitsLoss.*CurvlinopsGGN"):
        Laplace(case.model, BINARY, "all", "diag", backend=AsdlGGN)


def test_exact_hessian_and_full_rank_low_rank():
    case = binary_case(3, seed=3)
    full = Laplace(case.model, BINARY, "all", "full")
    full.fit(case.loader())
    hessian = Laplace(case.model, BINARY, "all", "full", backend=CurvlinopsHessian)
    hessian.fit(case.loader())
    assert hessian.H.shape == full.H.shape and torch.isfinite(hessian.H).all()
    n_params = full.n_params
    low = Laplace(case.model, BINARY, "all", "lowrank", backend_kwargs={"n_eigenvalues": 20})
    low.fit(case.loader())
    U, eigenvalues = low.H
    top = torch.linalg.eigvalsh(full.H).flip(0)[: len(eigenvalues)]
    assert_close(eigenvalues.sort(descending=True).values, top, rtol=1e-6, atol=1e-8)
    assert U.shape[0] == n_params


def test_tuning_by_marglik_and_by_grid_search():
    case = binary_case(3, seed=3)
    la = Laplace(case.model, BINARY, "all", "kron")
    la.fit(case.loader())
    la.optimize_prior_precision(n_steps=20)
    assert la.prior_precision.shape == (1,)
    val = DataLoader(TensorDataset(case.X[:10], case.y[:10]), batch_size=5)
    la.optimize_prior_precision(method="gridsearch", val_loader=val, grid_size=5)
    default_loss = la.prior_precision.clone()
    la.optimize_prior_precision(method="gridsearch", val_loader=val, grid_size=5, loss="nll")
    assert_close(la.prior_precision, default_loss)  # the default is the Bernoulli NLL
    la.optimize_prior_precision(method="gridsearch", val_loader=val, grid_size=5, loss="ece")


def test_evaluate_reports_per_label_metrics():
    case = binary_case(3, seed=3)
    la = Laplace(case.model, BINARY, "last_layer", "full")
    la.fit(case.loader())
    result = evaluate(la, case.loader())
    assert set(result) >= {"accuracy", "nll", "brier", "ece", "per_label"}
    assert len(result["per_label"]["nll"]) == 3


def test_marglik_training_and_state_dict():
    torch.manual_seed(0)
    X = torch.randn(60, 3, dtype=torch.float64)
    y = (X[:, :2] > 0).double()
    model = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 2)).double()
    loader = DataLoader(TensorDataset(X, y), batch_size=20)
    la, model, margliks, losses = marglik_training(
        model, loader, likelihood=BINARY, n_epochs=40, optimizer_kwargs={"lr": 0.05}
    )
    assert losses[-1] < losses[0] and margliks[-1] < margliks[0]
    accuracy = ((la(X) > 0.5).double() == y).double().mean()
    assert accuracy > 0.9
    fresh = Laplace(model, BINARY, "all", "kron")
    fresh.load_state_dict(la.state_dict())
    assert fresh.state_dict()["likelihood"] == "binary_classification"
    assert_close(fresh(X[:5]), la(X[:5]))


def test_what_is_refused():
    case = binary_case()
    la = Laplace(case.model, BINARY, "all", "diag")
    la.fit(case.loader())
    with pytest.raises(ValueError, match="label probabilities have no joint form"):
        la(case.X[:3], joint=True)
    with pytest.raises(ValueError, match="sigma_noise must be 1"):
        Laplace(case.model, BINARY, "all", "diag", sigma_noise=0.5)


def test_swag_subnetwork_mask_trains_with_the_binary_loss():
    from laplace.utils import LargestVarianceSWAGSubnetMask

    case = binary_case()
    mask = LargestVarianceSWAGSubnetMask(case.model, 5, likelihood=BINARY, swag_n_snapshots=3)
    indices = mask.select(case.loader())
    la = Laplace(case.model, BINARY, "subnetwork", "full", subnetwork_indices=indices)
    la.fit(case.loader())
    assert la.H.shape == (5, 5) and la(case.X[:2]).shape == (2, 1)


def test_ella_with_a_complete_basis_is_the_full_laplace_glm_predictive():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()  # 26 weights
    X = torch.randn(40, 3, dtype=torch.float64)
    y = (torch.rand(40, 2) < 0.5).double()
    loader = DataLoader(TensorDataset(X, y), batch_size=7)
    ella = Laplace(
        model, BINARY, "all", "gp", functional_approximation="nystrom",
        subsample_size=40, n_eigenvalues=26, prior_precision=1.7,
    )  # fmt: skip
    ella.fit(loader)
    full = Laplace(model, BINARY, "all", "full", prior_precision=1.7)
    full.fit(loader)
    X_test = torch.randn(6, 3, dtype=torch.float64)
    assert_close(ella(X_test), full(X_test))
    f_mu, f_var = full._glm_predictive_distribution(X_test)
    p = torch.sigmoid(f_mu / (1 + torch.pi / 8 * f_var.diagonal(dim1=1, dim2=2)).sqrt())
    y_test = (torch.rand(6, 2) < 0.5).double()
    expected = -(y_test * p.log() + (1 - y_test) * (1 - p).log()).sum()
    likelihood = ella._likelihood_model
    assert_close(likelihood.predictive_nll(f_mu, f_var, y_test, torch.ones(())), expected)
    val = DataLoader(TensorDataset(X_test, y_test), batch_size=3)
    ella.optimize_prior_precision(method="gridsearch", val_loader=val, grid_size=5)
    assert ella.prior_precision.item() in torch.logspace(-4, 4, 5, dtype=torch.float64).tolist()


@pytest.mark.parametrize("alpha", [0.0, 0.5])
def test_valla_bernoulli_energy_estimates_its_expectation(alpha):
    from laplace.likelihoods.bernoulli import bernoulli_alpha_energy

    mean = torch.tensor([[0.3], [-1.2], [2.0]], dtype=torch.float64)
    var = torch.tensor([0.5, 2.0, 1.0], dtype=torch.float64)
    y = torch.tensor([[1.0], [0.0], [1.0]], dtype=torch.float64)
    nodes, weights = (torch.from_numpy(a) for a in np.polynomial.hermite_e.hermegauss(80))
    f = mean + var.sqrt().unsqueeze(1) * nodes  # (3, 80): Gauss-Hermite in N(m, v)
    log_p = -torch.nn.functional.binary_cross_entropy_with_logits(
        f, y.expand_as(f), reduction="none"
    )
    w = weights / weights.sum()
    exact = (log_p * w).sum() if alpha == 0 else ((alpha * log_p).exp() @ w).log().sum() / alpha
    gen = torch.Generator().manual_seed(0)
    estimate = bernoulli_alpha_energy(
        y, mean, torch.diag_embed(var.unsqueeze(1)), alpha, 40_000, gen
    )
    assert abs(float(estimate - exact)) < 0.02  # seeded; Monte-Carlo s.d. of the sum ≈ 0.009


def test_valla_fits_binary_labels_with_an_output_per_inducing_point():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 2)).double()
    X = torch.randn(60, 3, dtype=torch.float64)
    y = (torch.rand(60, 2) < torch.sigmoid(2 * X[:, :2])).double()
    loader = DataLoader(TensorDataset(X, y), batch_size=10)
    la = Laplace(
        model, BINARY, "all", "gp", functional_approximation="variational",
        num_inducing=10, inducing_locations="random",
    )  # fmt: skip
    la.fit(loader, iterations=20)
    assert la._likelihood_model.inducing_outputs(y[:5]).tolist() == [0, 1, 0, 1, 0]
    probs = la(X[:4])
    assert probs.shape == (4, 2) and bool(((probs > 0) & (probs < 1)).all())
    history = la.fit_history_["objective"]
    assert history[-1] < history[0]
    with pytest.raises(ValueError, match="mc_softmax_samples"):
        Laplace(
            model, BINARY, "all", "gp", functional_approximation="variational",
            num_inducing=10, inducing_locations="random", alpha=0.5,
        )  # fmt: skip
