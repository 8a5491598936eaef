import math

import pytest
import torch
import torchmetrics
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from conftest import DictDataset, assert_close
from laplace.utils import (
    LinkApprox,
    PredType,
    RunningNLLMetric,
    SoDSampler,
    _is_batchnorm,
    _is_valid_scalar,
    block_diag,
    diagonal_add_scalar,
    expand_prior_precision,
    fix_prior_prec_structure,
    get_nll,
    invsqrt_precision,
    kron,
    normal_samples,
    parameters_per_layer,
    symeig,
    validate,
)

F64 = torch.float64


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _spd(n: int, seed: int = 0, batch: tuple[int, ...] = ()) -> torch.Tensor:
    A = torch.randn(*batch, n, n, generator=_gen(seed), dtype=F64)
    return A @ A.mT + 0.5 * torch.eye(n, dtype=F64)


# --------------------------------------------------------------------------- get_nll


def test_get_nll_is_mean_negative_log_prob():
    probs = torch.softmax(torch.randn(9, 4, generator=_gen(0), dtype=F64), -1)
    y = torch.randint(0, 4, (9,), generator=_gen(1))
    expected = -sum(math.log(probs[i, y[i]].item()) for i in range(9)) / 9
    assert_close(get_nll(probs, y), torch.tensor(expected, dtype=F64))


def test_get_nll_rejects_bad_shapes():
    with pytest.raises(ValueError, match="out_dist"):
        get_nll(torch.ones(4), torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError, match="targets"):
        get_nll(torch.full((4, 2), 0.5), torch.zeros(3, dtype=torch.long))


# --------------------------------------------------------------------------- validate


class StubLaplace:
    """Minimal stand-in for a fitted Laplace: a linear model and a fixed predictive."""

    def __init__(self, regression: bool, n_out: int = 3):
        torch.manual_seed(0)
        self.model = nn.Linear(2, n_out).double()
        self.regression = regression
        self.calls: list[dict] = []

    def predictive(self, X: torch.Tensor):
        f = self.model(X)
        if self.regression:
            # an input-dependent full covariance (B, C, C)
            return f, torch.diag_embed(f**2 + 1.0) + 0.1
        return torch.softmax(f, dim=-1)

    def __call__(self, X, pred_type, link_approx, n_samples, fitting=False, **kwargs):
        x = X["input_ids"] if isinstance(X, dict) else X
        self.calls.append(
            dict(
                pred_type=pred_type,
                link_approx=link_approx,
                n_samples=n_samples,
                fitting=fitting,
                device=x.device,
                grad=torch.is_grad_enabled(),
            )
        )
        return self.predictive(x)


class DictStub(StubLaplace):
    pass


def _data(n=11, n_out=3, regression=False):
    X = torch.randn(n, 2, generator=_gen(2), dtype=F64)
    if regression:
        y = torch.randn(n, n_out, generator=_gen(3), dtype=F64)
    else:
        y = torch.randint(0, n_out, (n,), generator=_gen(3))
    return X, y


def test_validate_classification_callable_and_metric_match_nll():
    la = StubLaplace(regression=False)
    X, y = _data()
    loader = DataLoader(TensorDataset(X, y), batch_size=4)
    with torch.no_grad():
        probs = la.predictive(X)
    expected = -probs[torch.arange(len(y)), y].log().mean().item()
    assert math.isclose(validate(la, loader, get_nll), expected, rel_tol=1e-12)
    assert math.isclose(validate(la, loader, RunningNLLMetric()), expected, rel_tol=1e-6)


def test_validate_passes_predictive_options_and_disables_grad():
    la = StubLaplace(regression=False)
    la.model.train()
    X, y = _data()
    validate(
        la,
        DataLoader(TensorDataset(X, y), batch_size=5),
        get_nll,
        pred_type="nn",
        link_approx="mc",
        n_samples=7,
    )
    assert not la.model.training
    assert len(la.calls) == 3
    for call in la.calls:
        assert call["pred_type"] == PredType.NN
        assert call["link_approx"] == LinkApprox.MC
        assert call["n_samples"] == 7
        assert call["fitting"] is True
        assert call["grad"] is False


def test_validate_resets_running_metric():
    la = StubLaplace(regression=False)
    X, y = _data()
    loader = DataLoader(TensorDataset(X, y), batch_size=4)
    metric = RunningNLLMetric()
    first = validate(la, loader, metric)
    assert validate(la, loader, metric) == first


def test_validate_regression_callable_receives_full_variance():
    la = StubLaplace(regression=True)
    X, y = _data(regression=True)
    seen = {}

    def gaussian_nll(mu, var, target):
        seen["shapes"] = (mu.shape, var.shape, target.shape)
        dist = torch.distributions.MultivariateNormal(mu, covariance_matrix=var)
        return -dist.log_prob(target).mean()

    result = validate(la, DataLoader(TensorDataset(X, y), batch_size=4), gaussian_nll)
    assert seen["shapes"] == ((11, 3), (11, 3, 3), (11, 3))
    with torch.no_grad():
        mu, var = la.predictive(X)
    expected = -torch.distributions.MultivariateNormal(mu, var).log_prob(y).mean().item()
    assert math.isclose(result, expected, rel_tol=1e-12)


def test_validate_regression_two_argument_metric_gets_mean_only():
    la = StubLaplace(regression=True)
    X, y = _data(regression=True)
    metric = torchmetrics.MeanSquaredError(num_outputs=3).set_dtype(F64)
    result = validate(la, DataLoader(TensorDataset(X, y), batch_size=4), metric)
    with torch.no_grad():
        mu, _ = la.predictive(X)
    expected = ((mu - y) ** 2).mean(0).sum().item()  # per-output MSE, summed
    assert math.isclose(result, expected, rel_tol=1e-12)


class VarianceMetric(torchmetrics.Metric):
    full_state_update = False

    def __init__(self):
        super().__init__()
        self.add_state("total", default=torch.tensor(0.0, dtype=F64), dist_reduce_fx="sum")

    def update(self, mu, var, target):
        self.total += var.diagonal(dim1=-2, dim2=-1).sum()

    def compute(self):
        return self.total


def test_validate_regression_three_argument_metric_gets_variance():
    la = StubLaplace(regression=True)
    X, y = _data(regression=True)
    result = validate(la, DataLoader(TensorDataset(X, y), batch_size=4), VarianceMetric())
    with torch.no_grad():
        _, var = la.predictive(X)
    assert math.isclose(result, var.diagonal(dim1=-2, dim2=-1).sum().item(), rel_tol=1e-12)


def test_validate_dict_batches_use_dict_key_y():
    la = StubLaplace(regression=False, n_out=2)
    X, y = _data(n_out=2)
    loader = DataLoader(DictDataset(X, y, key_y="target"), batch_size=4)
    with torch.no_grad():
        probs = la.predictive(X)
    expected = -probs[torch.arange(len(y)), y].log().mean().item()
    assert math.isclose(
        validate(la, loader, get_nll, dict_key_y="target"), expected, rel_tol=1e-12
    )
    with pytest.raises(ValueError, match="dict_key_y"):
        validate(la, loader, get_nll)


def test_validate_moves_inputs_to_model_device(device):
    la = StubLaplace(regression=False)
    la.model.to(device)
    X, y = _data()
    validate(la, DataLoader(TensorDataset(X, y), batch_size=6), get_nll)
    assert all(call["device"].type == device.type for call in la.calls)


def test_validate_rejects_bad_arguments():
    la = StubLaplace(regression=False)
    X, y = _data()
    loader = DataLoader(TensorDataset(X, y), batch_size=4)
    with pytest.raises(TypeError, match="loss"):
        validate(la, loader, "nll")
    with pytest.raises(ValueError, match="pred_type"):
        validate(la, loader, get_nll, pred_type="bogus")
    with pytest.raises(ValueError, match="link_approx"):
        validate(la, loader, get_nll, link_approx="bogus")
    with pytest.raises(ValueError, match="n_samples"):
        validate(la, loader, get_nll, n_samples=0)
    with pytest.raises(ValueError, match="no batches"):
        validate(la, [], get_nll)
    with pytest.raises(ValueError, match=r"\(X, y\) pair"):
        validate(la, [(X, y, y)], get_nll)


# --------------------------------------------------------------------------- parameters_per_layer


def test_parameters_per_layer_counts_every_tensor():
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2, bias=False))
    model[0].bias.requires_grad_(False)  # frozen tensors are still counted
    assert parameters_per_layer(model) == [12, 4, 8]


# --------------------------------------------------------------------------- linear algebra


@pytest.mark.parametrize("batch", [(), (3,)], ids=["single", "batched"])
def test_invsqrt_precision_is_lower_cholesky_of_covariance(batch):
    M = _spd(5, seed=4, batch=batch)
    L = invsqrt_precision(M)
    assert_close(L, torch.tril(L))
    assert_close(L @ L.mT, torch.linalg.inv(M), rtol=1e-8, atol=1e-10)
    eye = torch.eye(5, dtype=F64).expand_as(M)
    assert_close(L.mT @ M @ L, eye, rtol=1e-8, atol=1e-10)
    assert (L.diagonal(dim1=-2, dim2=-1) > 0).all()


def test_invsqrt_precision_errors():
    with pytest.raises(ValueError, match="M"):
        invsqrt_precision(torch.ones(2, 3))
    with pytest.raises(torch.linalg.LinAlgError):
        invsqrt_precision(-torch.eye(3, dtype=F64))


def test_kron_matches_index_formula():
    A = torch.randn(2, 3, generator=_gen(5), dtype=F64)
    B = torch.randn(4, 5, generator=_gen(6), dtype=F64)
    K = kron(A, B)
    assert K.shape == (8, 15)
    expected = torch.empty(8, 15, dtype=F64)
    for i in range(2):
        for j in range(3):
            for k in range(4):
                for m in range(5):
                    expected[i * 4 + k, j * 5 + m] = A[i, j] * B[k, m]
    assert_close(K, expected)


def test_kron_rejects_non_matrices():
    with pytest.raises(ValueError, match="t1"):
        kron(torch.ones(3), torch.ones(2, 2))
    with pytest.raises(ValueError, match="t2"):
        kron(torch.ones(2, 2), torch.ones(2, 2, 2))


def test_diagonal_add_scalar():
    X = torch.randn(4, 4, generator=_gen(7), dtype=F64)
    out = diagonal_add_scalar(X, 2.5)
    assert_close(out, X + 2.5 * torch.eye(4, dtype=F64))
    assert out is not X
    # tensor values (one per diagonal entry) and non-square matrices
    d = torch.arange(1.0, 4.0, dtype=F64)
    assert_close(diagonal_add_scalar(X[:3, :3], d), X[:3, :3] + torch.diag(d))
    wide = torch.zeros(2, 3, dtype=F64)
    assert_close(diagonal_add_scalar(wide, 1.0), torch.eye(2, 3, dtype=F64))
    tall = torch.zeros(3, 2, dtype=F64)
    assert_close(diagonal_add_scalar(tall, 1.0), torch.eye(3, 2, dtype=F64))
    # differentiable in the value
    value = torch.tensor(1.0, dtype=F64, requires_grad=True)
    diagonal_add_scalar(X, value).sum().backward()
    assert value.grad.item() == 4.0
    with pytest.raises(ValueError, match="X"):
        diagonal_add_scalar(torch.ones(3), 1.0)


def test_symeig_reconstructs_psd_matrix():
    M = _spd(6, seed=8)
    L, W = symeig(M)
    assert_close(W @ torch.diag(L) @ W.T, M, rtol=1e-8, atol=1e-10)
    assert_close(W.T @ W, torch.eye(6, dtype=F64), rtol=1e-8, atol=1e-10)
    assert (L[1:] >= L[:-1]).all()


def test_symeig_clamps_negative_eigenvalues_and_reads_upper_triangle():
    M = torch.tensor([[1.0, 2.0], [2.0, 1.0]], dtype=F64)  # eigenvalues -1 and 3
    L, _ = symeig(M)
    assert_close(L, torch.tensor([0.0, 3.0], dtype=F64))
    upper_only = torch.tensor([[1.0, 2.0], [-50.0, 1.0]], dtype=F64)
    assert_close(symeig(upper_only)[0], L)


def test_symeig_retries_with_jitter(monkeypatch):
    M = _spd(4, seed=9)
    original = torch.linalg.eigh
    calls = []

    def flaky(A, UPLO="L"):
        calls.append(A.clone())
        if len(calls) == 1:
            raise torch.linalg.LinAlgError("did not converge")
        return original(A, UPLO=UPLO)

    monkeypatch.setattr(torch.linalg, "eigh", flaky)
    L, W = symeig(M)
    assert len(calls) == 2
    assert_close(calls[1], M + torch.eye(4, dtype=F64))
    assert_close(L, original(M)[0], rtol=1e-8, atol=1e-10)
    assert_close(W @ torch.diag(L) @ W.T, M, rtol=1e-8, atol=1e-10)


def test_symeig_raises_when_jitter_fails(monkeypatch):
    def broken(A, UPLO="L"):
        raise torch.linalg.LinAlgError("did not converge")

    monkeypatch.setattr(torch.linalg, "eigh", broken)
    with pytest.raises(torch.linalg.LinAlgError, match="jitter"):
        symeig(torch.eye(3, dtype=F64))


def test_symeig_rejects_non_square():
    with pytest.raises(ValueError, match="M"):
        symeig(torch.ones(2, 3))


def test_block_diag():
    A = torch.randn(2, 2, generator=_gen(10), dtype=F64)
    B = torch.randn(3, 3, generator=_gen(11), dtype=F64)
    M = block_diag([A, B])
    expected = torch.zeros(5, 5, dtype=F64)
    expected[:2, :2] = A
    expected[2:, 2:] = B
    assert_close(M, expected)
    with pytest.raises(ValueError, match="blocks"):
        block_diag([])
    with pytest.raises(ValueError, match=r"blocks\[1\]"):
        block_diag([A, torch.ones(3)])


# --------------------------------------------------------------------------- sampling


def test_normal_samples_diagonal_statistics():
    S = 40_000
    mean = torch.tensor([[1.0, -2.0, 0.5], [0.0, 3.0, -1.0]], dtype=F64)
    var = torch.tensor([[0.5, 2.0, 1.0], [4.0, 0.1, 0.0]], dtype=F64)
    samples = normal_samples(mean, var, S, generator=_gen(12))
    assert samples.shape == (S, 2, 3)
    # 5 standard errors: mean error ~ sd/√S, variance error ~ var·√(2/S)
    assert ((samples.mean(0) - mean).abs() <= 5 * (var / S).sqrt() + 1e-12).all()
    assert ((samples.var(0) - var).abs() <= 5 * var * math.sqrt(2 / S) + 1e-12).all()


def test_normal_samples_full_covariance_statistics():
    S = 40_000
    mean = torch.randn(3, 2, generator=_gen(13), dtype=F64)
    cov = _spd(2, seed=14, batch=(3,))
    samples = normal_samples(mean, cov, S, generator=_gen(15))
    assert samples.shape == (S, 3, 2)
    centred = samples - samples.mean(0)
    emp_cov = torch.einsum("sbi,sbj->bij", centred, centred) / (S - 1)
    sd = cov.diagonal(dim1=-2, dim2=-1).sqrt()
    # Var of a sample covariance entry is (Σ_ii Σ_jj + Σ_ij²)/S ≤ 2 Σ_ii Σ_jj / S
    tol = 5 * math.sqrt(2 / S) * sd.unsqueeze(-1) * sd.unsqueeze(-2)
    assert ((emp_cov - cov).abs() <= tol).all()
    assert ((samples.mean(0) - mean).abs() <= 5 * sd / math.sqrt(S)).all()


def test_normal_samples_diag_and_full_agree_for_diagonal_covariance():
    mean = torch.randn(4, 3, generator=_gen(16), dtype=F64)
    var = torch.rand(4, 3, generator=_gen(17), dtype=F64) + 0.1
    a = normal_samples(mean, var, 6, generator=_gen(18))
    b = normal_samples(mean, torch.diag_embed(var), 6, generator=_gen(18))
    assert_close(a, b)
    # one standard-normal draw of shape (C, S) is shared by the batch
    z = torch.randn(3, 6, generator=_gen(18), dtype=F64)
    assert_close(a, (mean.unsqueeze(-1) + var.sqrt().unsqueeze(-1) * z).permute(2, 0, 1))


def test_normal_samples_rejects_bad_input():
    mean = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="mean"):
        normal_samples(torch.zeros(3), torch.ones(3), 5)
    with pytest.raises(ValueError, match="var"):
        normal_samples(mean, torch.ones(2, 4), 5)
    with pytest.raises(ValueError, match="var"):
        normal_samples(mean, -torch.ones(2, 3), 5)
    with pytest.raises(ValueError, match="n_samples"):
        normal_samples(mean, torch.ones(2, 3), 0)


def test_sod_sampler_draws_distinct_indices_deterministically():
    sampler = SoDSampler(20, 6, seed=1)
    idx = [int(i) for i in sampler]
    assert len(sampler) == 6 and len(set(idx)) == 6
    assert all(0 <= i < 20 for i in idx)
    assert idx == [int(i) for i in SoDSampler(20, 6, seed=1)]
    with pytest.raises(ValueError, match="M"):
        SoDSampler(5, 6)


# --------------------------------------------------------------------------- priors


def test_is_batchnorm():
    for bn in (nn.BatchNorm1d(3), nn.BatchNorm2d(3), nn.BatchNorm3d(3)):
        assert _is_batchnorm(bn)
    for other in (nn.LayerNorm(3), nn.Linear(2, 2), nn.GroupNorm(1, 3)):
        assert not _is_batchnorm(other)


@pytest.mark.parametrize(
    ("value", "valid"),
    [
        (1, True),
        (2.5, True),
        (True, True),
        (torch.tensor(1.0), True),
        (torch.tensor([1.0]), True),
        (torch.tensor([1.0, 2.0]), False),
        (torch.ones(1, 1), False),
        ("a", False),
        (1j, False),
        (None, False),
        ([1.0], False),
    ],
)
def test_is_valid_scalar(value, valid):
    assert _is_valid_scalar(value) is valid


def _model_with_frozen_tensor():
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    model[0].bias.requires_grad_(False)
    return model  # trainable: weight (12), weight (8), bias (2) -> 22 parameters, 3 tensors


def test_expand_prior_precision_structures():
    model = _model_with_frozen_tensor()
    assert_close(
        expand_prior_precision(torch.tensor([2.0], dtype=F64), model),
        torch.full((22,), 2.0, dtype=F64),
    )
    assert_close(
        expand_prior_precision(torch.tensor(3.0, dtype=F64), model),
        torch.full((22,), 3.0, dtype=F64),
    )
    layerwise = expand_prior_precision(torch.tensor([1.0, 2.0, 3.0], dtype=F64), model)
    assert_close(layerwise, torch.tensor([1.0] * 12 + [2.0] * 8 + [3.0] * 2, dtype=F64))
    layerwise32 = expand_prior_precision(torch.tensor([1.0, 2.0, 3.0]), model)
    assert layerwise32.dtype == F64
    diag = torch.arange(22, dtype=F64)
    assert_close(expand_prior_precision(diag, model), diag)


def test_expand_prior_precision_errors():
    model = _model_with_frozen_tensor()
    with pytest.raises(ValueError, match="length"):
        expand_prior_precision(torch.ones(4, dtype=F64), model)
    with pytest.raises(ValueError, match="prior_prec"):
        expand_prior_precision(torch.ones(3, 1, dtype=F64), model)


@pytest.mark.parametrize(("structure", "length"), [("scalar", 1), ("layerwise", 3), ("diag", 7)])
def test_fix_prior_prec_structure(structure, length):
    out = fix_prior_prec_structure(0.5, structure, 3, 7, "cpu", F64)
    assert_close(out, torch.full((length,), 0.5, dtype=F64))
    out32 = fix_prior_prec_structure(torch.tensor(2.0), structure, 3, 7, "cpu", torch.float32)
    assert out32.dtype == torch.float32 and out32.shape == (length,)


def test_fix_prior_prec_structure_errors():
    with pytest.raises(ValueError, match=r"prior_structure.*'scalar'"):
        fix_prior_prec_structure(1.0, "bogus", 3, 7, "cpu", F64)
    with pytest.raises(ValueError, match="prior_prec_init"):
        fix_prior_prec_structure(-1.0, "scalar", 3, 7, "cpu", F64)
    with pytest.raises(ValueError, match="prior_prec_init"):
        fix_prior_prec_structure(float("nan"), "scalar", 3, 7, "cpu", F64)
    with pytest.raises(TypeError, match="prior_prec_init"):
        fix_prior_prec_structure(torch.ones(2), "scalar", 3, 7, "cpu", F64)
    with pytest.raises(ValueError, match="n_layers"):
        fix_prior_prec_structure(1.0, "layerwise", 0, 7, "cpu", F64)
    with pytest.raises(ValueError, match="n_params"):
        fix_prior_prec_structure(1.0, "diag", 3, -1, "cpu", F64)


@pytest.mark.parametrize("n_cols", [5, 300, 517])
def test_symmetric_gram_equals_full_product(n_cols):
    from laplace.utils.linalg import symmetric_gram

    G = torch.randn(40, n_cols, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    assert_close(symmetric_gram(G, panel=64), G.T @ G)
