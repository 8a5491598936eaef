"""Last-layer Laplace against the all-weights classes on a frozen body and dense oracles."""

from __future__ import annotations

import io
import math
import pickle

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Subset, TensorDataset

from conftest import CASE_BUILDERS, Oracle, assert_close, freeze_all_but, transformer_case
from laplace import (
    DiagLaplace,
    DiagLLLaplace,
    FullLaplace,
    FullLLLaplace,
    KronLaplace,
    KronLLLaplace,
    Laplace,
    LLLaplace,
)
from laplace.curvature import CurvlinopsEF, CurvlinopsGGN, CurvlinopsHessian
from laplace.lllaplace import FeatureExtractor, FeatureReduction
from laplace.utils.errors import NotFittedError
from laplace.utils.matrix import Kron

STRUCTURES = {
    "full": (FullLLLaplace, FullLaplace),
    "kron": (KronLLLaplace, KronLaplace),
    "diag": (DiagLLLaplace, DiagLaplace),
}


CASES = ["mlp_regression_3out", "mlp_classification", "cnn_classification"]


def head_name(model: nn.Module) -> str:
    return [n for n, m in model.named_modules() if isinstance(m, nn.Linear)][-1]


def hyper(case) -> dict:
    sigma = 0.7 if case.likelihood == "regression" else 1.0
    return {"sigma_noise": sigma, "prior_precision": 0.9, "temperature": 1.3}


def fit_pair(case, structure, backend=CurvlinopsGGN, **kwargs):
    """The last-layer Laplace and the all-weights Laplace of the frozen-body model, fitted."""
    ll_cls, all_cls = STRUCTURES[structure]
    ll = ll_cls(case.model, case.likelihood, backend=backend, **hyper(case), **kwargs)
    ll.fit(case.loader())
    frozen = freeze_all_but(case.model, head_name(case.model))
    full = all_cls(frozen, case.likelihood, backend=backend, **hyper(case))
    full.fit(case.loader())
    return ll, full


def assert_same_curvature(ll, full):
    if isinstance(ll, KronLLLaplace):
        for ours, theirs in zip(ll.H_facs.kfacs, full.H_facs.kfacs):
            for a, b in zip(ours, theirs):
                assert_close(a, b)
    else:
        assert_close(ll.H, full.H)


@pytest.mark.parametrize("structure", list(STRUCTURES))
@pytest.mark.parametrize("name", CASES)
def test_equals_frozen_body_posterior(name, structure):
    case = CASE_BUILDERS[name]()
    ll, full = fit_pair(case, structure)
    assert ll.n_params == full.n_params and ll.n_layers == full.n_layers == 2
    assert ll.n_outputs == full.n_outputs and ll.n_data == full.n_data
    assert_close(ll.mean, full.mean)
    assert_close(ll.loss, full.loss)
    assert_same_curvature(ll, full)
    assert_close(ll.log_marginal_likelihood(), full.log_marginal_likelihood())
    X = case.X[:6]
    if case.likelihood == "regression":
        for kwargs in ({}, {"joint": True}, {"diagonal_output": True}):
            for a, b in zip(ll(X, **kwargs), full(X, **kwargs)):
                assert_close(a, b)
    else:
        for link in ("probit", "bridge", "bridge_norm"):
            assert_close(ll(X, link_approx=link), full(X, link_approx=link))
    f_mu, f_var = ll.functional_variance_fast(X)
    ref_mu, ref_var = full._glm_predictive_distribution(X, diagonal_output=True)
    assert_close(f_mu, ref_mu)
    assert_close(f_var, ref_var)
    g1, g2 = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    assert_close(ll.sample(4, g1), full.sample(4, g2))
    nn_ll = ll(X, pred_type="nn", link_approx="mc", n_samples=5, generator=g1)
    nn_full = full(X, pred_type="nn", link_approx="mc", n_samples=5, generator=g2)
    for a, b in zip(nn_ll, nn_full) if isinstance(nn_ll, tuple) else [(nn_ll, nn_full)]:
        assert_close(a, b)


@pytest.mark.parametrize("name", CASES)
def test_full_and_diag_equal_dense_oracle(name):
    case = CASE_BUILDERS[name]()
    frozen = freeze_all_but(case.model, head_name(case.model))
    ggn = Oracle(frozen, case.likelihood).ggn(case.X)
    full = FullLLLaplace(case.model, case.likelihood)
    full.fit(case.loader())
    assert_close(full.H, ggn)
    diag = DiagLLLaplace(case.model, case.likelihood)
    diag.fit(case.loader())
    assert_close(diag.H, ggn.diagonal())
    # GLM covariance J P⁻¹ Jᵀ written out densely
    J = Oracle(frozen, case.likelihood).jacobian(case.X[:4])
    P = ggn + torch.eye(len(ggn), dtype=ggn.dtype)
    expected = J @ torch.linalg.inv(P) @ J.transpose(1, 2)
    assert_close(full._functional_moments(case.X[:4])[1], expected)


def test_kron_equals_exact_blocks_for_one_output():
    case = CASE_BUILDERS["mlp_regression_1out"]()
    la = KronLLLaplace(case.model, "regression")
    la.fit(case.loader())
    ggn = Oracle(freeze_all_but(case.model, "2"), "regression").ggn(case.X)
    blocks = la.H_facs.to_matrix()
    assert_close(blocks[:5, :5], ggn[:5, :5])
    assert_close(blocks[5:, 5:], ggn[5:, 5:])


@pytest.mark.parametrize("structure", list(STRUCTURES))
@pytest.mark.parametrize("name", ["mlp_regression_3out", "mlp_classification"])
def test_closed_form_equals_backend_route(name, structure):
    case = CASE_BUILDERS[name]()
    assert STRUCTURES[structure][0](case.model, case.likelihood).backend is CurvlinopsGGN
    la = STRUCTURES[structure][0](case.model, case.likelihood, last_layer_name="2")
    loader = case.loader(batch_size=len(case.X))

    def no_autograd(*args, **kwargs):
        raise AssertionError("the closed form must not trace the model")

    la.backend.trace = no_autograd
    la.fit(loader)
    del la.backend.trace
    route = {"full": la.backend.full, "diag": la.backend.diag}
    if structure == "kron":
        loss, H = la.backend.kron(case.X, case.y, N=len(case.X))
        for ours, theirs in zip(la.H_facs.kfacs, H.kfacs):
            for a, b in zip(ours, theirs):
                assert_close(a, b)
    else:
        loss, H = route[structure](case.X, case.y)
        assert_close(la.H, H)
    assert_close(la.loss, loss)


@pytest.mark.parametrize(
    ("backend", "dense"),
    [(CurvlinopsEF, "ef"), (CurvlinopsHessian, "hessian")],
    ids=["ef", "hessian"],
)
@pytest.mark.parametrize("name", ["mlp_regression_3out", "mlp_classification"])
def test_other_backends(name, backend, dense):
    case = CASE_BUILDERS[name]()
    oracle = Oracle(freeze_all_but(case.model, "2"), case.likelihood)
    expected = oracle.ef(case.X, case.y) if dense == "ef" else oracle.hessian(case.X, case.y)
    la = FullLLLaplace(case.model, case.likelihood, backend=backend)
    la.fit(case.loader())
    assert_close(la.H, expected)
    diag = DiagLLLaplace(case.model, case.likelihood, backend=backend)
    diag.fit(case.loader())
    assert_close(diag.H, expected.diagonal())


@pytest.mark.parametrize("reduction", list(FeatureReduction), ids=lambda r: r.value)
def test_transformer_with_dict_inputs(reduction):
    model, loader = transformer_case(reduction.value)
    batch = next(iter(loader))
    frozen = freeze_all_but(model, "score")
    for structure in ("full", "diag"):
        ll_cls, all_cls = STRUCTURES[structure]
        ll = ll_cls(model, "classification", feature_reduction=reduction)
        ll.fit(loader)
        assert ll.model.last_layer_name == "score" and ll.n_params == 3 * 6 + 3
        full = all_cls(frozen, "classification")
        full.fit(loader)
        assert_close(ll.H, full.H)
        assert_close(ll.log_marginal_likelihood(), full.log_marginal_likelihood())
        assert_close(ll(batch), full(batch))
    kron = KronLLLaplace(model, "classification", feature_reduction=reduction.value)
    kron.fit(loader)
    probs = kron(batch)
    assert probs.shape == (4, 3) and torch.isfinite(probs).all()


@pytest.mark.parametrize("structure", ["full", "diag"])
def test_sequence_features_without_reduction_use_autograd(structure):
    model, loader = transformer_case("average")
    batch = next(iter(loader))
    ll_cls, all_cls = STRUCTURES[structure]
    ll = ll_cls(model, "classification")
    ll.fit(loader)
    full = all_cls(freeze_all_but(model, "score"), "classification")
    full.fit(loader)
    assert_close(ll.H, full.H)
    assert_close(ll(batch), full(batch))
    g1, g2 = torch.Generator().manual_seed(0), torch.Generator().manual_seed(0)
    nn_ll = ll(batch, pred_type="nn", link_approx="mc", n_samples=3, generator=g1)
    assert_close(nn_ll, full(batch, pred_type="nn", link_approx="mc", n_samples=3, generator=g2))


def test_reward_modeling_pairs():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 1), nn.Flatten(-2)).double()
    X = torch.randn(12, 2, 3, dtype=torch.float64)
    loader = DataLoader(TensorDataset(X, torch.randint(0, 2, (12,))), batch_size=5)
    for structure in ("kron", "diag"):
        ll = Laplace(model, "reward_modeling", "last_layer", structure, last_layer_name="2")
        ll.fit(loader)
        full = STRUCTURES[structure][1](freeze_all_but(model, "2"), "reward_modeling")
        full.fit(loader)
        assert_same_curvature(ll, full)
        X_test = torch.randn(4, 1, 3, dtype=torch.float64)
        for a, b in zip(ll(X_test), full(X_test)):
            assert_close(a, b)


def test_last_layer_found_lazily():
    case = CASE_BUILDERS["mlp_classification"]()
    la = FullLLLaplace(case.model, "classification", prior_precision=torch.full((24,), 2.0))
    assert isinstance(la.model, FeatureExtractor) and la.model.model is case.model
    assert la.n_params is None and la.n_layers is None and la.mean is None
    with pytest.raises(RuntimeError, match="call fit\\(\\) first"):
        la(case.X[:2])
    la.fit(case.loader())
    assert la.model.last_layer is case.model[2] and la.n_params == 24
    assert_close(la.prior_precision_diag, torch.full((24,), 2.0, dtype=torch.float64))
    bad = DiagLLLaplace(case.model, "classification", prior_precision=torch.ones(5))
    with pytest.raises(ValueError, match="length 5"):
        bad.fit(case.loader())


def test_last_layer_by_name():
    case = CASE_BUILDERS["mlp_classification"]()
    la = DiagLLLaplace(case.model, "classification", last_layer_name="2")
    assert la.n_params == 24 and la.n_layers == 2
    assert_close(la.mean, torch.zeros(24, dtype=torch.float64))  # unfitted: the prior mean
    with pytest.raises(RuntimeError, match="call fit\\(\\) first"):
        la(case.X[:2])
    with pytest.raises(ValueError, match="not a module of the model"):
        DiagLLLaplace(case.model, "classification", last_layer_name="head")


@pytest.mark.parametrize("structure", ["full", "diag"])
def test_marglik_gradients_and_tuning(structure):
    case = CASE_BUILDERS["mlp_regression_3out"]()
    ll, full = fit_pair(case, structure)
    grads = []
    for la in (ll, full):
        prior = torch.tensor([0.5, 2.0], dtype=torch.float64, requires_grad=True)
        sigma = torch.tensor(0.8, dtype=torch.float64, requires_grad=True)
        la.log_marginal_likelihood(prior, sigma).backward()
        grads.append((prior.grad, sigma.grad))
    assert_close(grads[0][0], grads[1][0])
    assert_close(grads[0][1], grads[1][1])
    for la in (ll, full):
        la.sigma_noise = 0.7
        la.optimize_prior_precision(method="marglik", n_steps=20, prior_structure="layerwise")
    assert_close(ll.prior_precision, full.prior_precision)


def test_sample_statistics():
    case = CASE_BUILDERS["mlp_classification"]()
    la = FullLLLaplace(case.model, "classification")
    la.fit(case.loader())
    n = 20000
    samples = la.sample(n, torch.Generator().manual_seed(0))
    cov = la.posterior_covariance
    scale = cov.diagonal().sqrt()
    # entries of a sample covariance have standard deviation ≤ √2·σᵢσⱼ/√n
    tol = 5 * math.sqrt(2 / n)
    assert_close((samples.mean(0) - la.mean) / scale, torch.zeros(24), atol=5 / math.sqrt(n))
    assert_close(
        torch.cov(samples.T) / torch.outer(scale, scale),
        cov / torch.outer(scale, scale),
        atol=tol,
        rtol=0,
    )


@pytest.mark.parametrize("structure", ["full", "kron"])
def test_online_fit_equals_one_fit(structure):
    case = CASE_BUILDERS["mlp_classification"]()
    ll_cls = STRUCTURES[structure][0]
    once = ll_cls(case.model, "classification")
    once.fit(case.loader())
    online = ll_cls(case.model, "classification")
    dataset = TensorDataset(case.X, case.y)
    online.fit(DataLoader(Subset(dataset, range(8)), batch_size=5))
    online.fit(DataLoader(Subset(dataset, range(8, 20)), batch_size=5), override=False)
    assert_same_curvature(online, once)
    assert_close(online.log_marginal_likelihood(), once.log_marginal_likelihood())


@pytest.mark.parametrize("structure", list(STRUCTURES))
def test_state_dict_and_pickle(structure):
    case = CASE_BUILDERS["mlp_regression_3out"]()
    ll_cls = STRUCTURES[structure][0]
    la = ll_cls(case.model, "regression", sigma_noise=0.5)
    la.fit(case.loader())
    buffer = io.BytesIO()
    torch.save(la.state_dict(), buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)
    assert state["last_layer_name"] == "2"
    restored = ll_cls(case.model, "regression")  # last layer unknown until loaded
    restored.load_state_dict(state)
    clone = pickle.loads(pickle.dumps(la))
    for other in (restored, clone):
        assert_close(other.log_marginal_likelihood(), la.log_marginal_likelihood())
        for a, b in zip(other(case.X[:3]), la(case.X[:3])):
            assert_close(a, b)
    with pytest.raises(ValueError, match="last layer '2'"):
        ll_cls(case.model, "regression", last_layer_name="0").load_state_dict(state)


def test_factory_defaults_and_classes():
    case = CASE_BUILDERS["mlp_classification"]()
    la = Laplace(case.model, "classification")
    assert type(la) is KronLLLaplace
    assert isinstance(la, KronLaplace) and isinstance(la, LLLaplace)
    for structure, cls in [("full", FullLLLaplace), ("diag", DiagLLLaplace)]:
        la = Laplace(case.model, "classification", "last_layer", structure)
        assert type(la) is cls and isinstance(la, STRUCTURES[structure][1])
    with pytest.raises(TypeError, match="abstract"):
        LLLaplace(case.model, "classification")
    with pytest.raises(ValueError, match="asdl_fisher_kwargs"):
        FullLLLaplace(case.model, "classification", asdl_fisher_kwargs={})


def test_kron_refuses_diagonal_prior():
    case = CASE_BUILDERS["mlp_classification"]()
    la = KronLLLaplace(case.model, "classification", prior_precision=torch.ones(24))
    with pytest.raises(ValueError, match="diagonal prior"):
        la.fit(case.loader())


def test_input_gradients_match_frozen_body():
    case = CASE_BUILDERS["mlp_classification"]()
    frozen = freeze_all_but(case.model, "2")
    grads = []
    for la in (
        FullLLLaplace(case.model, "classification", enable_backprop=True),
        FullLaplace(frozen, "classification", enable_backprop=True),
    ):
        la.fit(case.loader())
        X = case.X[:3].clone().requires_grad_(True)
        la(X)[:, 0].sum().backward()
        grads.append(X.grad)
    assert grads[0].abs().sum() > 0
    assert_close(grads[0], grads[1])


def test_kron_h_is_decomposed():
    case = CASE_BUILDERS["mlp_classification"]()
    la = KronLLLaplace(case.model, "classification")
    la.fit(case.loader())
    assert isinstance(la.H_facs, Kron)
    assert type(la.posterior_precision).__name__ == "KronDecomposed"


@pytest.mark.parametrize("cls", [FullLLLaplace, DiagLLLaplace, KronLLLaplace])
def test_last_layer_unknown_keeps_none_and_raises_attribute_errors(cls):
    case = CASE_BUILDERS["mlp_classification"]()
    la = cls(case.model, "classification", prior_mean=0.5)
    assert la.mean is None and la.H is None and la.n_params is None
    assert la.backend is CurvlinopsGGN  # the class chosen, readable before the layer is known
    for name in ("posterior_precision", "prior_precision_diag", "log_det_ratio"):
        assert not hasattr(la, name)  # the error is an AttributeError ...
        assert getattr(la, name, "default") == "default"
        with pytest.raises(RuntimeError, match="last layer is not known yet"):
            getattr(la, name)  # ... and a RuntimeError, with our message
    with pytest.raises(NotFittedError, match="last layer is not known yet"):
        la._init_H()
    # once the layer is found (first batch of fit) the fitted posterior replaces the prior
    la.fit(case.loader())
    assert la.mean.shape == (la.n_params,) == (24,)
    assert_close(la.mean, torch.cat([case.model[2].weight.flatten(), case.model[2].bias]))


@pytest.mark.parametrize("structure", list(STRUCTURES))
def test_a_frozen_head_is_covered_as_a_trainable_one(structure):
    """A head left frozen (e.g. LoRA fine-tuning of the body) gets the same posterior."""
    case = CASE_BUILDERS["mlp_classification"]()
    ll_cls, _ = STRUCTURES[structure]
    trainable = ll_cls(case.model, case.likelihood, **hyper(case))
    trainable.fit(case.loader())
    frozen_model = freeze_all_but(case.model, head_name(case.model))
    for p in frozen_model.parameters():
        p.requires_grad_(False)
    frozen = ll_cls(frozen_model, case.likelihood, **hyper(case))
    frozen.fit(case.loader())
    assert frozen.n_params == trainable.n_params
    assert_same_curvature(frozen, trainable)
    assert_close(frozen.log_marginal_likelihood(), trainable.log_marginal_likelihood())
    assert_close(frozen(case.X[:6]), trainable(case.X[:6]))
