"""KronLaplace and KFAC curvature against factors built by hand and dense float64 oracles."""

from __future__ import annotations

import io
import math

import pytest
import torch
from curvlinops import KFACLinearOperator
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from conftest import CASE_BUILDERS, Case, Oracle, assert_close
from laplace import KronLaplace, Laplace
from laplace.baselaplace import FullLaplace
from laplace.curvature import BackPackGGN, CurvlinopsEF, CurvlinopsGGN, CurvlinopsHessian
from laplace.likelihoods import make_likelihood
from laplace.utils.matrix import Kron, KronDecomposed

RTOL, ATOL = 1e-7, 1e-10


# ------------------------------------------------------------------- KFAC by definition
def _positions(module: nn.Module, inp: torch.Tensor, out_grad: torch.Tensor):
    """Layer inputs (R, T, D_in) and output gradients (R, T, D_out) per position."""
    if isinstance(module, nn.Conv2d):
        patches = F.unfold(inp, module.kernel_size, module.dilation, module.padding, module.stride)
        return patches.transpose(1, 2), out_grad.flatten(2).transpose(1, 2)
    return inp.reshape(inp.shape[0], -1, inp.shape[-1]), out_grad.reshape(
        out_grad.shape[0], -1, out_grad.shape[-1]
    )


def kfac_by_definition(
    case: Case, approx: str = "expand", fisher: str = "ggn", num_samples: int = 1
) -> list:
    """Per parameter tensor the KFAC block factors, from hooks and the definition.

    ``A = Σ a aᵀ / (N·T)`` (expand) or ``Σ ā āᵀ / N`` (reduce); ``G = Σ g gᵀ`` over output
    columns (``L`` with ``L Lᵀ = Λ`` for the GGN, the loss gradient for the EF, loss gradients
    at targets drawn from the model, scaled by ``1/√S``, for the MC Fisher).
    """
    model, X, y = case.model, case.X, case.y
    records: list[tuple[nn.Module, torch.Tensor, torch.Tensor]] = []
    hooks = [
        m.register_forward_hook(lambda m, i, o: records.append((m, i[0].detach(), o)))
        for m in model.modules()
        if isinstance(m, (nn.Linear, nn.Conv2d))
    ]
    f = model(X)
    for h in hooks:
        h.remove()
    oracle = Oracle(model, case.likelihood)
    fd = f.detach()
    if fisher == "ggn":
        w, V = torch.linalg.eigh(oracle.output_hessian(fd))
        L = V * w.clamp(min=0).sqrt().unsqueeze(1)
        columns = L.unbind(-1)
    elif fisher == "mc":
        draws = [make_likelihood(case.likelihood).sample_targets(fd) for _ in range(num_samples)]
        columns = [_loss_gradient(case, fd, y_hat) / math.sqrt(num_samples) for y_hat in draws]
    else:
        columns = [_loss_gradient(case, fd, y)]
    N, factor = len(X), 0.5 if case.likelihood == "regression" else 1.0
    A, G = {}, {}
    for m, inp, out in records:
        a, _ = _positions(m, inp, out.detach())
        a = a.flatten(0, 1) / math.sqrt(a.shape[1]) if approx == "expand" else a.mean(1)
        A[m] = A.get(m, 0) + a.T @ a / N
    for v in columns:
        grads = torch.autograd.grad(f, [o for _, _, o in records], v, retain_graph=True)
        for (m, inp, _), g in zip(records, grads):
            _, g = _positions(m, inp, g)
            g = g.flatten(0, 1) if approx == "expand" else g.sum(1)
            G[m] = G.get(m, 0) + g.T @ g
    blocks = []
    for m in model.modules():
        if m in A:
            blocks.append([G[m] / math.sqrt(factor), A[m] * math.sqrt(factor)])
            if m.bias is not None:
                blocks.append([G[m]])
    return blocks


def _loss_gradient(case: Case, f: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    if case.likelihood == "regression":
        return f - y
    return torch.softmax(f, -1) - F.one_hot(y, f.shape[-1]).double()


def fitted(case: Case, **kwargs) -> KronLaplace:
    la = KronLaplace(case.model, case.likelihood, **kwargs)
    la.fit(case.loader())
    return la


def _assert_blocks(actual: Kron, expected: list, **tol):
    assert len(actual) == len(expected)
    for got, want in zip(actual.kfacs, expected):
        assert len(got) == len(want)
        for g, w in zip(got, want):
            assert_close(g, w, **tol)


@pytest.mark.parametrize("approx", ["expand", "reduce"])
def test_kfac_factors_equal_their_definition(case, approx):
    la = fitted(case, backend_kwargs={"kfac_approx": approx})
    _assert_blocks(la.H_facs, kfac_by_definition(case, approx), rtol=RTOL, atol=ATOL)
    assert isinstance(la.H, KronDecomposed)
    assert isinstance(la.posterior_precision, KronDecomposed)


@pytest.mark.parametrize("name", ["mlp_regression_3out", "mlp_classification"])
def test_empirical_fisher_kfac_equals_its_definition(name):
    case = CASE_BUILDERS[name]()
    la = fitted(case, backend=CurvlinopsEF)
    _assert_blocks(la.H_facs, kfac_by_definition(case, fisher="ef"), rtol=RTOL, atol=ATOL)


def test_single_linear_layer_with_one_output_is_the_exact_ggn():
    torch.manual_seed(0)
    case = Case("linear", "regression", nn.Linear(3, 1).double(), *_data(20, 3, 1))
    ggn = Oracle(case.model, "regression").ggn(case.X)
    la = fitted(case)
    assert_close(torch.kron(*la.H_facs.kfacs[0]), ggn[:3, :3])
    assert_close(la.H_facs.kfacs[1][0], ggn[3:, 3:])


def test_kfac_agrees_with_curvlinops_factors():
    case = CASE_BUILDERS["cnn_classification"]()
    for approx in ("expand", "reduce"):
        ours = KronLaplace(case.model, case.likelihood, backend_kwargs={"kfac_approx": approx})
        ours.fit(case.loader(batch_size=len(case.X)))
        params = list(case.model.parameters())
        op = KFACLinearOperator(
            case.model,
            nn.CrossEntropyLoss(reduction="sum"),
            params,
            [(case.X, case.y)],
            fisher_type="type-2",
            separate_weight_and_bias=True,
            check_deterministic=False,
            kfac_approx=approx,
        )
        op.compute_kronecker_factors()
        layers = [n for n, m in case.model.named_modules() if isinstance(m, nn.Conv2d | nn.Linear)]
        for i, name in enumerate(layers):
            weight, bias = ours.H_facs.kfacs[2 * i : 2 * i + 2]
            B, A = op._gradient_covariances[name], op._input_covariances[name]
            assert_close(torch.kron(*weight), torch.kron(B, A))
            assert_close(bias[0], B)


def test_mc_fisher_kfac_equals_its_definition_on_the_same_samples():
    case = CASE_BUILDERS["mlp_classification"]()
    backend = CurvlinopsGGN(case.model, "classification", stochastic=True, num_samples=3)
    torch.manual_seed(0)
    _, H = backend.kron(case.X, case.y, N=len(case.X))
    torch.manual_seed(0)
    expected = kfac_by_definition(case, fisher="mc", num_samples=3)
    _assert_blocks(H, expected, rtol=RTOL, atol=ATOL)


def _data(n, d_in, d_out):
    return torch.randn(n, d_in, dtype=torch.float64), torch.randn(n, d_out, dtype=torch.float64)


# ----------------------------------------------------------- posterior vs dense oracle
def dense_twin(la: KronLaplace, case: Case) -> FullLaplace:
    """A FullLaplace whose curvature is the dense KFAC matrix."""
    full = FullLaplace(case.model, case.likelihood, sigma_noise=la.sigma_noise)
    full.fit(case.loader())
    full.H = la.H_facs.to_matrix()
    full.prior_precision = la.prior_precision
    return full


@pytest.mark.parametrize("name", ["mlp_regression_3out", "cnn_classification"])
def test_marglik_and_its_gradients_equal_full_laplace_on_dense_kfac(name):
    case = CASE_BUILDERS[name]()
    la = fitted(case)
    full = dense_twin(la, case)
    sigma0 = 0.8 if case.likelihood == "regression" else 1.0
    for prior0 in ([0.7], torch.linspace(0.5, 2.0, la.n_layers).tolist()):
        results = []
        for model in (la, full):
            prior = torch.tensor(prior0, dtype=torch.float64, requires_grad=True)
            sigma = torch.tensor(sigma0, dtype=torch.float64, requires_grad=True)
            value = model.log_marginal_likelihood(prior, sigma)
            inputs = (prior, sigma) if case.likelihood == "regression" else (prior,)
            results.append((value, *torch.autograd.grad(value, inputs)))
        for ours, dense in zip(*results):
            assert_close(ours, dense, rtol=1e-9, atol=1e-9)


def test_glm_predictive_matches_dense_and_jacobian_routes(case):
    sigma = 0.6 if case.likelihood == "regression" else 1.0
    la = fitted(
        case,
        sigma_noise=sigma,
        prior_precision=torch.linspace(0.5, 2, 4 + 2 * (case.name[:3] == "cnn")).double(),
    )
    J = Oracle(case.model, case.likelihood).jacobian(case.X)
    P = la.H_facs.to_matrix() / sigma**2 + torch.diag(la.prior_precision_diag)
    expected = J @ torch.linalg.inv(P) @ J.transpose(1, 2)
    f_mu, f_var = la._functional_moments(case.X)
    assert_close(f_var, expected, rtol=1e-8, atol=1e-12)
    assert_close(f_mu, case.model(case.X))
    f_var_jac = la.functional_variance(la.backend.jacobians(case.X)[0])
    assert_close(f_var, f_var_jac, rtol=1e-8, atol=1e-12)
    if case.likelihood == "regression":
        _, f_cov = la(case.X[:4], joint=True)
        J4 = J[:4].reshape(-1, J.shape[-1])
        assert_close(f_cov, J4 @ torch.linalg.inv(P) @ J4.T, rtol=1e-8, atol=1e-12)
    else:
        assert_close(la(case.X[:4]), dense_twin(la, case)(case.X[:4]), rtol=1e-8, atol=1e-12)


def test_glm_predictive_is_differentiable_in_the_inputs():
    case = CASE_BUILDERS["mlp_regression_3out"]()
    la = fitted(case, enable_backprop=True)
    X = case.X[:5].clone().requires_grad_(True)
    grads = []

    def jacobian_route(x):
        Js, f_mu = la.backend.jacobians(x, enable_backprop=True)
        return f_mu, la.functional_variance(Js)

    for moments in (la._functional_moments, jacobian_route):
        f_mu, f_var = moments(X)
        grads.append(torch.autograd.grad(f_mu.sum() + f_var.sum(), X)[0])
    assert_close(grads[0], grads[1], rtol=1e-8, atol=1e-12)


def test_nn_predictive_and_sample_covariance():
    case = CASE_BUILDERS["mlp_regression_1out"]()
    la = fitted(case, prior_precision=2.0)
    f_mu, f_var = la(case.X[:3], pred_type="nn", link_approx="mc", n_samples=50)
    assert f_mu.shape == (3, 1) and f_var.shape == (3, 1)
    n = 40_000
    samples = la.sample(n, generator=torch.Generator().manual_seed(0))
    cov = la.posterior_precision.to_matrix(exponent=-1)
    centered = samples - la.mean
    emp = centered.T @ centered / n
    # Standard error of a sample covariance entry: sqrt((Σᵢᵢ Σⱼⱼ + Σᵢⱼ²) / n).
    se = ((cov.diagonal()[:, None] * cov.diagonal()[None, :] + cov.square()) / n).sqrt()
    assert ((emp - cov).abs() <= 5 * se).all(), float(((emp - cov).abs() / se).max())
    assert (centered.mean(0).abs() <= 5 * (cov.diagonal() / n).sqrt()).all()


# ---------------------------------------------------------------- state and online fits
def test_state_dict_round_trip_with_weights_only():
    case = CASE_BUILDERS["cnn_classification"]()
    la = fitted(case, prior_precision=0.5)
    buffer = io.BytesIO()
    torch.save(la.state_dict(), buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True, map_location="cpu")
    other = KronLaplace(case.model, case.likelihood)
    other.load_state_dict(state)
    assert isinstance(other.H, KronDecomposed) and isinstance(other.H_facs, Kron)
    assert_close(other.log_marginal_likelihood(), la.log_marginal_likelihood())
    _assert_blocks(other.H_facs, la.H_facs.kfacs)
    state["H"] = state["H"][:-1]
    with pytest.raises(ValueError, match="Kronecker factors of shapes"):
        other.load_state_dict(state)


def test_online_fit_equals_one_fit_on_all_data():
    case = CASE_BUILDERS["mlp_classification"]()
    la = fitted(case)
    online = KronLaplace(case.model, case.likelihood)
    halves = [slice(0, 8), slice(8, None)]
    for i, part in enumerate(halves):
        loader = DataLoader(TensorDataset(case.X[part], case.y[part]), batch_size=5)
        online.fit(loader, override=i == 0)
    _assert_blocks(online.H_facs, la.H_facs.kfacs, rtol=1e-10, atol=1e-12)
    assert_close(online.log_marginal_likelihood(), la.log_marginal_likelihood())


# ------------------------------------------------------------------- factory and errors
def test_factory_and_reward_modeling():
    case = CASE_BUILDERS["mlp_classification"]()
    la = Laplace(case.model, "classification", subset_of_weights="all", hessian_structure="kron")
    assert type(la) is KronLaplace

    class PairScorer(nn.Module):  # scores (B, 2, D) pairs as 2B rows, single inputs as B rows
        def __init__(self):
            super().__init__()
            self.net = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))

        def forward(self, x):
            return self.net(x).squeeze(-1) if x.dim() == 3 else self.net(x)

    torch.manual_seed(0)
    model = PairScorer().double()
    X, y = torch.randn(12, 2, 3, dtype=torch.float64), torch.randint(0, 2, (12,))
    reward = Laplace(model, "reward_modeling", subset_of_weights="all", hessian_structure="kron")
    reward.fit(DataLoader(TensorDataset(X, y), batch_size=5))
    f_mu, f_var = reward(X[:, 0])
    assert f_mu.shape == (12, 1) and f_var.shape == (12, 1, 1)
    assert torch.isfinite(reward.log_marginal_likelihood())


def test_unsupported_layer_is_named():
    # The native KFAC takes every layer (tests/curvature/engine/test_kfac.py); BackPACK's does not.
    model = nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4), nn.Linear(4, 2))
    with pytest.raises(ValueError, match=r"'1' \(LayerNorm\).*CurvlinopsGGN"):
        KronLaplace(model, "classification", backend=BackPackGGN)


def test_hessian_backend_has_no_kron_and_bad_options_are_refused():
    case = CASE_BUILDERS["mlp_classification"]()
    backend = CurvlinopsHessian(case.model, "classification")
    with pytest.raises(NotImplementedError, match=r"CurvlinopsGGN.*CurvlinopsEF"):
        backend.kron(case.X, case.y, N=20)
    with pytest.raises(ValueError, match="kfac_approx"):
        CurvlinopsGGN(case.model, "classification", kfac_approx="blockwise")
    with pytest.raises(ValueError, match="diagonal prior"):
        KronLaplace(case.model, "classification", prior_precision=torch.ones(44))
