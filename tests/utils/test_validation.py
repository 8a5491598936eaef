"""Validation losses (``laplace.utils.validation``): ``get_nll`` and ``validate``."""

from __future__ import annotations

import math

import pytest
import torch
import torchmetrics
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from conftest import DictDataset, assert_close
from laplace.utils import LinkApprox, PredType, RunningNLLMetric, get_nll, validate

F64 = torch.float64


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


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
