"""The Curvlinops backends against the dense torch.func oracles on the shared tiny cases.

Curvature, Jacobians and gradients, laplace-torch's attributes, and the options: backprop
through Jacobians, subnetworks, MC Fisher, last layer, dict inputs, frozen parameters, dtypes.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from conftest import ATOL_F64, CASE_BUILDERS, Oracle, assert_close, dict_case
from laplace.curvature import (
    CURVATURE_BACKENDS,
    DEFAULT_BACKEND,
    CurvatureInterface,
    CurvlinopsEF,
    CurvlinopsGGN,
    CurvlinopsHessian,
)

BACKENDS = [CurvlinopsGGN, CurvlinopsEF, CurvlinopsHessian]


IDS = [b.__name__ for b in BACKENDS]


def test_enable_backprop_differentiates_wrt_inputs(case):
    backend = CurvlinopsGGN(case.model, case.likelihood)
    X = case.X[:4].clone().requires_grad_(True)
    Js, f = backend.jacobians(X, enable_backprop=True)
    assert Js.requires_grad and f.requires_grad
    weights = torch.randn(Js.shape, dtype=Js.dtype, generator=torch.Generator().manual_seed(0))
    (grad_x,) = torch.autograd.grad((Js * weights).sum() + f.sum(), X)

    X_ref = X.detach().clone().requires_grad_(True)
    Js_ref, f_ref = backend.functorch_jacobians(X_ref, enable_backprop=True)
    (expected,) = torch.autograd.grad((Js_ref * weights).sum() + f_ref.sum(), X_ref)
    assert_close(grad_x, expected)


def test_outputs_are_detached_by_default(classification_case):
    backend = CurvlinopsGGN(classification_case.model, "classification")
    Js, f = backend.jacobians(classification_case.X)
    assert not Js.requires_grad and not f.requires_grad


@pytest.mark.parametrize("backend_cls", BACKENDS, ids=IDS)
def test_subnetwork_indices_restrict_everything(case, backend_cls):
    oracle = Oracle(case.model, case.likelihood)
    n_params = oracle.theta.numel()
    indices = torch.randperm(n_params, generator=torch.Generator().manual_seed(1))[:7]
    backend = backend_cls(case.model, case.likelihood, subnetwork_indices=indices)
    full = backend_cls(case.model, case.likelihood)
    _, H_all = full.full(case.X, case.y)
    _, H = backend.full(case.X, case.y)
    assert_close(H, H_all[indices][:, indices])
    _, h = backend.diag(case.X, case.y)
    assert_close(h, H_all.diagonal()[indices])
    Js, _ = backend.jacobians(case.X)
    assert_close(Js, oracle.jacobian(case.X)[:, :, indices])
    assert_close(backend.functorch_jacobians(case.X)[0], Js)
    Gs, _ = backend.gradients(case.X, case.y)
    assert_close(Gs, oracle.per_sample_gradients(case.X, case.y)[:, indices])


def _mc_fisher_std(oracle: Oracle, X, n_samples: int) -> torch.Tensor:
    """Exact standard deviation of each entry of the S-sample MC Fisher, shape (P, P)."""
    J = oracle.jacobian(X)
    if oracle.likelihood == "regression":
        # g = Jᵀε, ε ~ N(0, I): Var(gᵢ gⱼ) = |aᵢ|²|aⱼ|² + (aᵢ·aⱼ)² with aᵢ = J[:, i].
        gram = torch.einsum("bci,bcj->bij", J, J)
        norms = gram.diagonal(dim1=1, dim2=2)
        var = (norms.unsqueeze(2) * norms.unsqueeze(1) + gram.square()).sum(0)
    else:
        # g = Jᵀ(p − e_y), y ~ Cat(p): enumerate the classes.
        p = torch.softmax(oracle.f(oracle.theta, X), -1).detach()
        eye = torch.eye(p.shape[-1], dtype=p.dtype)
        g = torch.einsum("bcp,bkc->bkp", J, p.unsqueeze(1) - eye)  # (B, class, P)
        outer = g.unsqueeze(-1) * g.unsqueeze(-2)
        mean = torch.einsum("bk,bkij->bij", p, outer)
        var = torch.einsum("bk,bkij->ij", p, (outer - mean.unsqueeze(1)).square())
    return (var / n_samples).sqrt()


@pytest.mark.parametrize("name", ["mlp_regression_3out", "mlp_classification"])
def test_monte_carlo_fisher_converges_to_ggn(name):
    case = CASE_BUILDERS[name]()
    X, y = case.X[:6], case.y[:6]
    n_samples = 2000
    backend = CurvlinopsGGN(case.model, case.likelihood, stochastic=True, num_samples=n_samples)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        _, H_mc = backend.full(X, y)
        _, h_mc = backend.diag(X, y)
    oracle = Oracle(case.model, case.likelihood)
    exact = oracle.ggn(X)
    tol = 5.0 * _mc_fisher_std(oracle, X, n_samples) + ATOL_F64  # 5σ per entry
    assert ((H_mc - exact).abs() <= tol).all()
    assert ((h_mc - exact.diagonal()).abs() <= tol.diagonal()).all()
    assert (H_mc - exact).abs().max() > 0  # it really samples


class _LastLayerModel(nn.Module):
    """Stand-in for a feature extractor: ``forward_with_features`` and ``last_layer``."""

    def __init__(self, bias: bool):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(3, 4), nn.Tanh())
        self.last_layer = nn.Linear(4, 2, bias=bias)

    def forward_with_features(self, x):
        phi = self.body(x)
        return self.last_layer(phi), phi

    def forward(self, x):
        return self.forward_with_features(x)[0]


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
def test_last_layer_jacobians_closed_form(bias):
    torch.manual_seed(0)
    model = _LastLayerModel(bias).double()
    X = torch.randn(5, 3, dtype=torch.float64)
    backend = CurvlinopsGGN(model, "classification", last_layer=True)
    assert backend.params == list(model.last_layer.parameters())
    Js, f = backend.last_layer_jacobians(X)
    expected = Oracle(model.last_layer, "classification").jacobian(model.body(X))
    assert_close(Js, expected)
    assert_close(f, model(X))
    assert_close(backend.jacobians(X)[0], expected)
    y = torch.tensor([0, 1, 1, 0, 1])
    _, H = backend.full(X, y)
    assert_close(H, Oracle(model.last_layer, "classification").ggn(model.body(X)))


def _dict_ef(model, X, y):
    grads = []
    for n in range(len(y)):
        f = model({"input_ids": X["input_ids"][n : n + 1]})
        loss = nn.functional.cross_entropy(f, y[n : n + 1], reduction="sum")
        grads.append(
            torch.cat([g.flatten() for g in torch.autograd.grad(loss, model.parameters())])
        )
    G = torch.stack(grads)
    return G.T @ G


@pytest.mark.parametrize("backend_cls", BACKENDS, ids=IDS)
def test_dict_inputs(backend_cls):
    model, loader = dict_case()
    X = next(iter(loader))
    y = X["labels"]
    backend = backend_cls(model, "classification")
    oracle = Oracle(model, "classification")
    expected = {
        CurvlinopsGGN: lambda: oracle.ggn(X),
        CurvlinopsEF: lambda: _dict_ef(model, X, y),
        CurvlinopsHessian: lambda: oracle.hessian(X, y),
    }[backend_cls]()
    loss, H = backend.full(X, y)
    assert_close(H, expected)
    assert_close(loss, oracle.loss(X, y))
    assert_close(backend.jacobians(X)[0], oracle.jacobian(X))


def test_frozen_parameters_are_excluded(classification_case):
    model = classification_case.model
    model[0].bias.requires_grad_(False)
    oracle = Oracle(model, "classification")
    backend = CurvlinopsGGN(model, "classification")
    assert len(backend.params) == 3
    _, H = backend.full(classification_case.X, classification_case.y)
    assert_close(H, oracle.ggn(classification_case.X))
    assert_close(
        backend.jacobians(classification_case.X)[0], oracle.jacobian(classification_case.X)
    )


@pytest.mark.parametrize("backend_cls", BACKENDS, ids=IDS)
@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
def test_no_state_left_on_model(classification_case, backend_cls, train):
    model = classification_case.model.train(train)
    sentinel = [torch.full_like(p, 3.0) for p in model.parameters()]
    for p, s in zip(model.parameters(), sentinel):
        p.grad = s.clone()
    backend = backend_cls(model, "classification")
    X, y = classification_case.X, classification_case.y
    backend.full(X, y)
    backend.diag(X, y)
    backend.jacobians(X)
    backend.gradients(X, y)
    for module in model.modules():
        assert not module._forward_hooks and not module._forward_pre_hooks
        assert not module._backward_hooks
    for p, s in zip(model.parameters(), sentinel):
        assert torch.equal(p.grad, s)
    assert model.training is train


def test_inplace_activation_after_layer():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 5), nn.ReLU(inplace=True), nn.Linear(5, 2)).double()
    X = torch.randn(9, 3, dtype=torch.float64)
    oracle = Oracle(model, "regression")
    backend = CurvlinopsGGN(model, "regression")
    assert_close(backend.full(X, torch.zeros(9, 2))[1], oracle.ggn(X))
    assert_close(backend.jacobians(X)[0], oracle.jacobian(X))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
def test_dtype_and_device_follow_the_model(device, dtype):
    case = CASE_BUILDERS["cnn_classification"]()
    model = case.model.to(device=device, dtype=dtype)
    X, y = case.X.to(device=device, dtype=dtype), case.y.to(device)
    backend = CurvlinopsGGN(model, "classification", subnetwork_indices=torch.arange(0, 40, 3))
    rtol, atol = (1e-4, 1e-5) if dtype == torch.float32 else (1e-7, 1e-9)
    loss, h = backend.diag(X, y)
    Js, f = backend.jacobians(X)
    for t in (loss, h, Js, f):
        assert t.dtype == dtype and t.device.type == device.type
    J_ref = backend.functorch_jacobians(X)[0]
    assert_close(Js, J_ref, rtol=rtol, atol=atol)
    Lam = torch.softmax(f, -1)
    Lam = torch.diag_embed(Lam) - Lam.unsqueeze(-1) * Lam.unsqueeze(-2)
    assert_close(h, torch.einsum("bcp,bcd,bdp->p", J_ref, Lam, J_ref), rtol=rtol, atol=atol)


GRADIENT_BACKENDS = [CurvlinopsGGN, CurvlinopsEF, CurvlinopsHessian]


BACKEND_IDS = [b.__name__ for b in GRADIENT_BACKENDS]


def _reference(backend_cls, oracle: Oracle, X, y) -> torch.Tensor:
    if issubclass(backend_cls, CurvlinopsGGN):
        return oracle.ggn(X)
    if issubclass(backend_cls, CurvlinopsEF):
        return oracle.ef(X, y)
    return oracle.hessian(X, y)


@pytest.mark.parametrize("backend_cls", GRADIENT_BACKENDS, ids=BACKEND_IDS)
def test_full_and_diag_match_oracle(case, backend_cls):
    oracle = Oracle(case.model, case.likelihood)
    backend = backend_cls(case.model, case.likelihood)
    expected = _reference(backend_cls, oracle, case.X, case.y)
    loss, H = backend.full(case.X, case.y)
    assert_close(H, expected)
    assert_close(loss, oracle.loss(case.X, case.y))
    loss_d, h = backend.diag(case.X, case.y)
    assert_close(h, expected.diagonal())
    assert_close(loss_d, oracle.loss(case.X, case.y))
    assert not H.requires_grad and not h.requires_grad


@pytest.mark.parametrize("backend_cls", GRADIENT_BACKENDS, ids=BACKEND_IDS)
def test_jacobians_and_gradients_match_oracle(case, backend_cls):
    oracle = Oracle(case.model, case.likelihood)
    backend = backend_cls(case.model, case.likelihood)
    Js, f = backend.jacobians(case.X)
    assert_close(Js, oracle.jacobian(case.X))
    assert_close(f, case.model(case.X))
    Js_func, f_func = backend.functorch_jacobians(case.X)
    assert_close(Js_func, Js)
    assert_close(f_func, f)
    Gs, loss = backend.gradients(case.X, case.y)
    assert_close(Gs, oracle.per_sample_gradients(case.X, case.y))
    assert_close(loss, oracle.loss(case.X, case.y))


def test_attributes_follow_laplace_torch(regression_case, classification_case):
    reg = CurvlinopsGGN(regression_case.model, "regression")
    cls = CurvlinopsGGN(classification_case.model, "classification", stochastic=True)
    assert (reg.factor, cls.factor) == (0.5, 1.0)
    assert isinstance(reg.lossfunc, torch.nn.MSELoss)
    assert isinstance(cls.lossfunc, torch.nn.CrossEntropyLoss)
    assert reg.likelihood == "regression" and cls.stochastic and cls.num_samples == 1
    assert reg.params == list(regression_case.model.parameters())
    assert reg.last_layer is False and reg.subnetwork_indices is None
    assert DEFAULT_BACKEND is CurvlinopsGGN
    assert all(issubclass(b, CurvatureInterface) for b in CURVATURE_BACKENDS.values())


def test_unknown_likelihood_is_refused(regression_case):
    with pytest.raises(ValueError, match="accepted values"):
        CurvlinopsGGN(regression_case.model, "poisson")
