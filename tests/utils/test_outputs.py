"""Outputs with extra dimensions: the curvature, loss, marginal likelihood and predictives.

Per-pixel logits (B, C, H, W) with targets (B, H, W), token logits (B, T, C) with targets
(B, T) and dense regression outputs of any shape: every position is an independent observation,
positions labelled ``ignore_index`` count nothing. The references are dense float64 GGNs of the
loss summed over positions (``PositionOracle``), with the Jacobians of ``torch.func``.

Every position is predicted from its own Gaussian ``N(fₜ, Jₜ Σ Jₜᵀ)`` (``Jₜ`` the Jacobian of
position t's C outputs, ``Σ`` the posterior covariance, both dense from ``torch.func``), and the
predictions come back in the outputs' shape: probabilities (B, C, H, W) or (B, T, C), regression
means and variances of every output.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from conftest import (
    CASE_BUILDERS,
    POSITION_CASES,
    PositionOracle,
    TokenClassifier,
    assert_close,
    freeze_all_but,
)
from laplace import Laplace, curvature, marglik_training
from laplace.curvature import CurvlinopsEF, CurvlinopsGGN, CurvlinopsHessian
from laplace.utils import RunningNLLMetric, validate
from laplace.utils.errors import DataError

#: Subnetwork entries of the position cases (both layers of every model).
SUBNET = torch.tensor([0, 3, 7, 12, 20, 25, 31])


def _fit(case, subset="all", structure="full", **kwargs):
    if subset == "subnetwork":
        kwargs["subnetwork_indices"] = SUBNET
    la = Laplace(case.model, case.likelihood, subset, structure, **kwargs)
    la.fit(case.loader())
    return la


def _oracle(case, subset="all"):
    model = freeze_all_but(case.model, "head") if subset == "last_layer" else case.model
    return PositionOracle(model, case.likelihood, case.class_dim)


@pytest.mark.parametrize("structure", ["full", "diag"])
@pytest.mark.parametrize("subset", ["all", "last_layer", "subnetwork"])
@pytest.mark.parametrize("name", list(POSITION_CASES))
def test_curvature_is_the_ggn_of_the_loss_summed_over_positions(name, subset, structure):
    case = POSITION_CASES[name]()
    la = _fit(case, subset, structure)
    oracle = _oracle(case, subset)
    ggn = oracle.ggn(case.X, case.y)
    if subset == "subnetwork":
        ggn = ggn[SUBNET][:, SUBNET]
    assert_close(la.H, ggn if structure == "full" else ggn.diagonal())
    assert_close(la.loss, oracle.loss(case.X, case.y))
    assert la.n_data == len(case.X)


@pytest.mark.parametrize("subset", ["all", "last_layer"])
@pytest.mark.parametrize("name", ["pixel_classification", "token_classification"])
def test_empirical_fisher_is_that_of_the_summed_loss_of_each_data_point(name, subset):
    case = POSITION_CASES[name]()
    la = _fit(case, subset, backend=CurvlinopsEF)
    assert_close(la.H, _oracle(case, subset).ef(case.X, case.y))


def test_hessian_backend_differentiates_the_summed_position_loss():
    case = POSITION_CASES["token_classification"]()
    la = _fit(case, backend=CurvlinopsHessian)
    assert_close(la.H, _oracle(case).hessian(case.X, case.y))


def test_monte_carlo_fisher_of_positions_is_unbiased_and_drops_ignored_positions():
    case = POSITION_CASES["token_classification"]()
    torch.manual_seed(0)
    n_samples = 1000
    options = {"stochastic": True, "num_samples": n_samples}
    la = _fit(case, "last_layer", backend=CurvlinopsGGN, backend_kwargs=options)
    ggn = _oracle(case, "last_layer").ggn(case.X, case.y)
    # Each entry is a mean of bounded products: its error shrinks like 1/√S (0.5·max/√S seen
    # here); counting the dropped positions would move the largest entries by 0.2·max.
    assert_close(la.H, ggn, rtol=0.0, atol=3 * ggn.abs().max().item() / math.sqrt(n_samples))


def test_ignored_positions_count_nothing():
    case = POSITION_CASES["token_classification"]()
    la = _fit(case)
    relabelled = case.y.clone()
    dropped = relabelled == -100
    relabelled[dropped] = 255
    other = Laplace(case.model, "classification", "all", "full", ignore_index=255)
    other.fit(DataLoader(TensorDataset(case.X, relabelled), batch_size=3))
    assert_close(other.H, la.H)
    assert_close(other.loss, la.loss)
    changed = case.y.clone()
    changed[dropped] = 0  # the same positions counted: the curvature changes
    assert not torch.allclose(_oracle(case).ggn(case.X, changed), la.H)


def test_ignore_index_drops_data_points_of_outputs_without_extra_dimensions():
    case = CASE_BUILDERS["mlp_classification"]()
    y = case.y.clone()
    y[::3] = -100
    la = Laplace(case.model, "classification", "all", "full")
    la.fit(DataLoader(TensorDataset(case.X, y), batch_size=7))
    kept = y != -100
    ref = Laplace(case.model, "classification", "all", "full")
    ref.fit(DataLoader(TensorDataset(case.X[kept], y[kept]), batch_size=7))
    assert_close(la.H, ref.H)
    assert_close(la.loss, ref.loss)
    assert la.n_data == len(case.X)


def test_log_marginal_likelihood_of_positions():
    case = POSITION_CASES["pixel_classification"]()
    la = _fit(case, prior_precision=0.7)
    oracle = _oracle(case)
    P = oracle.ggn(case.X, case.y) + 0.7 * torch.eye(len(oracle.theta), dtype=torch.float64)
    expected = -oracle.loss(case.X, case.y) - 0.5 * (
        torch.logdet(P) - len(oracle.theta) * math.log(0.7) + 0.7 * oracle.theta.square().sum()
    )
    assert_close(la.log_marginal_likelihood(), expected)


def test_regression_normaliser_counts_every_output():
    case = POSITION_CASES["pixel_regression"]()
    la = _fit(case, sigma_noise=0.8)
    n_values = case.y.numel()
    assert la.n_outputs * la.n_data == n_values
    expected = -la.loss / 0.64 - 0.5 * n_values * math.log(2 * math.pi * 0.64)
    assert_close(la.log_likelihood, expected)


def test_last_layer_kron_of_positions_equals_all_weights_kron_of_the_head():
    case = POSITION_CASES["token_classification"]()
    ll = _fit(case, "last_layer", "kron")
    head = freeze_all_but(case.model, "head")
    full = Laplace(head, "classification", "all", "kron")
    full.fit(case.loader())
    for ours, theirs in zip(ll.H_facs.kfacs, full.H_facs.kfacs):
        for a, b in zip(ours, theirs):
            assert_close(a, b)
    assert_close(ll.loss, full.loss)


def test_kron_expands_positions_into_rows_of_its_factors():
    # One linear layer on every token: G = Σ Λₙₜ over kept tokens, A = Σ aₙₜ aₙₜᵀ / (N·T).
    torch.manual_seed(3)
    model = nn.Linear(3, 4).double()
    X = torch.randn(6, 5, 3, dtype=torch.float64)
    y = torch.randint(0, 4, (6, 5))
    y[1, 3:] = -100
    la = Laplace(model, "classification", "all", "kron")
    la.fit(DataLoader(TensorDataset(X, y), batch_size=4))
    p = torch.softmax(model(X), -1).detach().reshape(-1, 4)
    Lam = (torch.diag_embed(p) - p[:, :, None] * p[:, None, :]) * (y != -100).reshape(-1, 1, 1)
    a = X.reshape(-1, 3)
    G, A = la.H_facs.kfacs[0]
    assert_close(G, Lam.sum(0))
    assert_close(A, a.T @ a / 30)
    assert_close(la.H_facs.kfacs[1][0], Lam.sum(0))


# ------------------------------------------------------------------------------- errors
def _token_data(n_tokens: int, n_classes: int):
    model = TokenClassifier(n_out=n_classes).double()
    X = torch.randn(4, n_tokens, 3, dtype=torch.float64)
    y = torch.randint(0, n_classes, (4, n_tokens))
    return model, DataLoader(TensorDataset(X, y), batch_size=4)


def test_an_ambiguous_class_dimension_asks_for_class_dim():
    model, loader = _token_data(n_tokens=4, n_classes=4)  # (B, 4, 4) outputs, (B, 4) targets
    la = Laplace(model, "classification", "all", "diag")
    with pytest.raises(ValueError, match=r"\(4, 4, 4\).*\(4, 4\).*ambiguous.*class_dim"):
        la.fit(loader)
    la = Laplace(model, "classification", "all", "diag", class_dim=-1)
    la.fit(loader)
    probabilities = la(torch.randn(2, 4, 3, dtype=torch.float64))
    assert_close(probabilities.sum(-1), torch.ones(2, 4))


def test_targets_that_do_not_fit_the_outputs_are_refused_with_the_shapes():
    model, _ = _token_data(n_tokens=5, n_classes=4)
    X = torch.randn(4, 5, 3, dtype=torch.float64)
    loader = DataLoader(TensorDataset(X, torch.randint(0, 4, (4, 3))), batch_size=4)
    shapes = r"outputs of shape \(4, 5, 4\) and targets of shape \(4, 3\)"
    with pytest.raises(DataError, match=shapes):
        Laplace(model, "classification", "all", "full").fit(loader)
    with pytest.raises(DataError, match="class_dim"):
        Laplace(model, "classification", "all", "full", class_dim=1).fit(
            DataLoader(TensorDataset(X, torch.randint(0, 4, (4, 5))), batch_size=4)
        )
    with pytest.raises(ValueError, match="class_dim=3 is not a dimension"):
        Laplace(model, "classification", "all", "full", class_dim=3).fit(loader)


def test_labels_outside_the_classes_are_refused_at_positions_too():
    case = POSITION_CASES["pixel_classification"]()
    y = case.y.clone()
    y[1, 0, 0] = 3
    with pytest.raises(IndexError, match="class label 3"):
        Laplace(case.model, "classification", "all", "diag").fit(
            DataLoader(TensorDataset(case.X, y), batch_size=3)
        )


@pytest.mark.parametrize(
    ("likelihood", "kwargs", "message"),
    [
        ("classification", {"backend": "BackPackGGN"}, "BackPackGGN takes model outputs"),
        ("classification", {"backend": "AsdlEF"}, "AsdlEF takes model outputs"),
        ("heteroscedastic_regression", {}, "'heteroscedastic_regression' takes model outputs"),
        ("classification", {"hessian_structure": "gp", "n_subset": 4}, "FunctionalLaplace"),
        ("regression", {"sigma_noise": torch.ones(3)}, "one σ per output"),
    ],
)
def test_what_takes_outputs_b_c_only_says_so(likelihood, kwargs, message):
    case = POSITION_CASES["pixel_classification"]()
    kwargs = dict(kwargs)
    if "backend" in kwargs:
        kwargs["backend"] = getattr(curvature, kwargs["backend"])
    structure = kwargs.pop("hessian_structure", "full")
    y = case.y.clamp_min(0) if likelihood == "classification" else torch.randn(7, 3, 5, 4)
    loader = DataLoader(TensorDataset(case.X, y.to(torch.float64) if y.is_floating_point() else y))
    la = Laplace(case.model, likelihood, "all", structure, **kwargs)
    with pytest.raises(ValueError, match=message):
        la.fit(loader)


def test_low_rank_eigenpairs_are_those_of_the_summed_position_ggn():
    case = POSITION_CASES["pixel_classification"]()
    options = {"n_eigenvalues": 6, "max_iter": 8}
    la = _fit(case, structure="lowrank", backend_kwargs=options)
    eigenvalues = torch.linalg.eigvalsh(_oracle(case).ggn(case.X, case.y)).flip(0)[:6]
    assert_close(la.H[1], eigenvalues, rtol=1e-6)


def test_validation_scores_the_positions_that_count():
    case = POSITION_CASES["token_classification"]()
    la = _fit(case, structure="diag")
    score = validate(la, case.loader(), RunningNLLMetric())
    rows, labels = la(case.X).reshape(-1, 4), case.y.reshape(-1)
    kept = labels != -100
    expected = -rows[kept, labels[kept]].log().mean()
    assert_close(torch.tensor(score), expected)
    la.optimize_prior_precision(method="gridsearch", val_loader=case.loader(), grid_size=3)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda c: marglik_training(c.model, c.loader(), n_epochs=1), "marglik_training takes"),
        (
            lambda c: _fit(c, structure="lowrank", backend_kwargs={"solver": "lanczos"}),
            "solver='randomized'",
        ),
    ],
    ids=["marglik_training", "lowrank_operators"],
)
def test_routes_without_outputs_with_extra_dimensions_name_the_one_to_use(call, message):
    with pytest.raises(ValueError, match=message):
        call(POSITION_CASES["pixel_classification"]())


@pytest.mark.parametrize(("subset", "structure"), [("all", "kron"), ("last_layer", "diag")])
def test_a_loaded_state_predicts_with_the_class_dimension_found_in_the_fit(subset, structure):
    case = POSITION_CASES["token_classification"]()
    la = _fit(case, subset, structure)
    X = case.X[:3]
    state = la.state_dict()
    assert state["output_layout"] == [3, 1, 5 * 4]  # rank, class dim of (T, C), outputs per point
    loaded = Laplace(case.model, "classification", subset, structure)
    loaded.load_state_dict(state)
    assert_close(loaded(X), la(X))
    fresh = Laplace(case.model, "classification", subset, structure)
    fresh.load_state_dict({k: v for k, v in state.items() if k != "output_layout"})
    with pytest.raises(ValueError, match="class_dim"):
        fresh(X)  # without it the class dimension of (B, T, C) = (3, 5, 4) is unknown
    with pytest.raises(ValueError, match="output layout"):
        fresh.load_state_dict({**state, "output_layout": [3, 2]})


def test_a_failed_fit_forgets_the_class_dimension_it_found():
    case = POSITION_CASES["token_classification"]()
    la = Laplace(case.model, "classification", "all", "diag")
    bad = case.y.clone()
    bad[-1, 0] = 99  # a label outside the 4 classes, in the last batch
    with pytest.raises(ValueError, match="99"):
        la.fit(DataLoader(TensorDataset(case.X, bad), batch_size=3))
    with pytest.raises(ValueError, match="class_dim"):
        la._likelihood_model.layout(torch.Size((2, 5, 4)))  # nothing was kept
    la.fit(case.loader())
    assert la._likelihood_model.outputs.found == [3, 1, 20]


def test_last_layer_kron_normalises_each_batch_by_its_own_positions():
    case = POSITION_CASES["token_classification"]()
    X, y = case.X[:6], case.y[:6]
    batches = [(X[:3], y[:3]), (X[3:, :3], y[3:, :3])]  # T = 5, then 3: padded per batch

    class PaddedPerBatch(DataLoader):
        def __iter__(self):
            return iter(batches)

    la = Laplace(case.model, "classification", "last_layer", "kron")
    la.fit(PaddedPerBatch(TensorDataset(X, y)))
    expected = 0
    for Xb, _ in batches:  # expand: A = Σ_batches Σ_rows φφᵀ / (N·T_batch)
        h = torch.tanh(case.model.embed(Xb))
        phi = (h + h.mean(1, keepdim=True)).flatten(0, 1).detach()
        expected = expected + phi.T @ phi / (len(X) * Xb.shape[1])
    assert_close(la.H_facs.kfacs[0][1], expected)


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
