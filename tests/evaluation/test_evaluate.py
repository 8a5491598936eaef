"""``evaluate`` on fitted Laplace approximations: one batched pass, the predictive's numbers."""

from __future__ import annotations

import json

import pytest
import torch
from scipy import stats
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics.functional.classification import multiclass_calibration_error

from conftest import CASE_BUILDERS, dict_case
from laplace import Laplace
from laplace.evaluation import evaluate

RTOL_F32 = 1e-6


def _fitted(case_name: str, subset: str = "all", structure: str = "kron", **kwargs):
    case = CASE_BUILDERS[case_name]()
    la = Laplace(case.model, case.likelihood, subset, structure, **kwargs)
    la.fit(case.loader())
    return case, la


class CountingPredictive:
    """Wraps a Laplace approximation and records the batch sizes it is called with."""

    def __init__(self, la):
        self.la, self.calls = la, []
        self.model, self.likelihood, self.sigma_noise = la.model, la.likelihood, la.sigma_noise

    def __call__(self, x, **kwargs):
        self.calls.append(len(x))
        return self.la(x, **kwargs)


@pytest.mark.parametrize(
    ("subset", "structure"),
    [("all", "kron"), ("all", "diag"), ("last_layer", "full")],
    ids=["kron", "diag", "ll-full"],
)
@pytest.mark.parametrize("link_approx", ["probit", "bridge"])
def test_classification_metrics_are_those_of_the_predictive(subset, structure, link_approx):
    case, la = _fitted("mlp_classification", subset, structure, prior_precision=0.5)
    counting = CountingPredictive(la)
    result = evaluate(counting, case.loader(batch_size=6), link_approx=link_approx)
    assert counting.calls == [6, 6, 6, 2]  # one pass, batch by batch
    probs = la(case.X, link_approx=link_approx)
    y = case.y
    assert result["accuracy"] == pytest.approx((probs.argmax(-1) == y).double().mean().item())
    nll = -probs[torch.arange(len(y)), y].log().mean().item()
    assert result["nll"] == pytest.approx(nll, rel=1e-10)
    onehot = torch.nn.functional.one_hot(y, probs.shape[-1])
    assert result["brier"] == pytest.approx((probs - onehot).square().sum(-1).mean().item())
    ece = multiclass_calibration_error(probs, y, probs.shape[-1], n_bins=15).item()
    assert result["ece"] == pytest.approx(ece, rel=RTOL_F32)
    assert json.loads(json.dumps(result)) == result


@pytest.mark.parametrize("structure", ["full", "kron"])
def test_regression_metrics_use_the_functional_variance_plus_sigma_squared(structure):
    case, la = _fitted("mlp_regression_3out", "all", structure, sigma_noise=0.6)
    result = evaluate(la, case.loader(batch_size=8), coverage_levels=(0.5, 0.9))
    f_mu, f_var = la(case.X)
    cov = f_var + 0.36 * torch.eye(3, dtype=f_var.dtype)
    nll = [
        -stats.multivariate_normal.logpdf(y.numpy(), m.numpy(), c.numpy())
        for y, m, c in zip(case.y, f_mu.detach(), cov.detach(), strict=True)
    ]
    assert result["nll"] == pytest.approx(sum(nll) / len(nll), rel=1e-10)
    rmse = (f_mu - case.y).square().mean().sqrt().item()
    assert result["rmse"] == pytest.approx(rmse, rel=1e-10)
    std = cov.diagonal(dim1=-2, dim2=-1).sqrt()
    z = ((case.y - f_mu) / std).detach().numpy()
    assert result["coverage"]["0.9"] == pytest.approx((abs(z) <= stats.norm.ppf(0.95)).mean())
    assert set(result) == {"nll", "rmse", "crps", "coverage", "calibration_curve", "n"}
    # an explicit sigma_noise replaces la.sigma_noise
    other = evaluate(la, case.loader(), sigma_noise=2.0)
    assert other["nll"] != pytest.approx(result["nll"])


def test_functional_laplace_and_pred_type_nn():
    case, gp = _fitted("mlp_classification", "all", "gp", n_subset=10)
    assert 0 <= evaluate(gp, case.loader())["ece"] <= 1
    reg_case, la = _fitted("mlp_regression_1out", "all", "diag")
    torch.manual_seed(0)
    result = evaluate(la, reg_case.loader(), pred_type="nn", link_approx="mc", n_samples=50)
    assert result["n"] == 20 and result["crps"] > 0


def test_dict_batches_and_the_map_network_as_a_callable():
    model, loader = dict_case()
    la = Laplace(model, "classification", "all", "diag")
    la.fit(loader)
    assert evaluate(la, loader)["n"] == 16
    map_result = evaluate(lambda batch: model(batch).softmax(-1), loader)
    assert map_result["n"] == 16 and 0 <= map_result["accuracy"] <= 1


def test_inputs_are_moved_to_the_model_device(device):
    case = CASE_BUILDERS["mlp_classification"]()
    la = Laplace(case.model.to(device), "classification", "all", "diag")
    la.fit(DataLoader(TensorDataset(case.X.to(device), case.y.to(device)), batch_size=7))
    result = evaluate(la, case.loader())  # a CPU loader
    expected = evaluate(lambda x: la(x).cpu(), case.loader(), likelihood="classification")
    assert result == expected


def test_the_ood_loader_of_shifted_inputs_is_detected():
    case, la = _fitted("mlp_classification", "all", "kron", prior_precision=0.1)
    far = DataLoader(TensorDataset(50 * case.X), batch_size=8)
    result = evaluate(la, case.loader(), ood_loader=far)
    assert result["ood_auroc"] > 0.5
    assert evaluate(la, case.loader(), ood_loader=case.loader())["ood_auroc"] == 0.5


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"n_bins": 0}, "n_bins"),
        ({"n_bins": 2.5}, "n_bins"),
        ({"coverage_levels": (0.5, 1.0)}, "coverage_levels"),
        ({"coverage_levels": ()}, "coverage_levels"),
        ({"joint": True}, "joint"),
        ({"likelihood": "poisson"}, "'classification', 'regression'"),
    ],
)
def test_bad_options_fail_before_any_prediction(kwargs, match):
    case, la = _fitted("mlp_classification", "all", "diag")
    counting = CountingPredictive(la)
    with pytest.raises(ValueError, match=match):
        evaluate(counting, case.loader(), **kwargs)
    assert counting.calls == []


def test_bad_data_fails_clearly():
    case, la = _fitted("mlp_classification", "all", "diag")
    empty = DataLoader(TensorDataset(case.X[:0], case.y[:0]), batch_size=4)
    with pytest.raises(ValueError, match="no batches"):
        evaluate(la, empty)
    soft = DataLoader(TensorDataset(case.X, torch.rand(20, 4, dtype=torch.float64)), batch_size=5)
    with pytest.raises(ValueError, match="integer labels"):
        evaluate(la, soft)
    _, reg = _fitted("mlp_regression_3out", "all", "diag")
    wrong = DataLoader(TensorDataset(case.X, torch.randn(20, 2)), batch_size=5)
    with pytest.raises(ValueError, match="do not match"):
        evaluate(reg, wrong)
    with pytest.raises(ValueError, match="probability tensor"):
        evaluate(reg, case.loader(), likelihood="classification")


def test_the_predictive_runs_in_the_callers_autograd_mode():
    """Backends such as ASDL need gradients to predict: evaluate must not switch them off."""
    pytest.importorskip("asdl")
    from laplace.curvature import CURVATURE_BACKENDS

    case = CASE_BUILDERS["mlp_classification"]()
    la = Laplace(
        case.model, case.likelihood, "all", "diag", backend=CURVATURE_BACKENDS["asdl_ggn"]
    )
    la.fit(case.loader())
    result = evaluate(la, case.loader())
    probs = la(case.X)
    assert result["nll"] == pytest.approx(-probs[torch.arange(20), case.y].log().mean().item())
    modes = []

    def predictive(x):
        modes.append(torch.is_grad_enabled())
        return case.model(x).softmax(-1)  # outputs with a graph: evaluate detaches them

    evaluate(predictive, case.loader())
    with torch.no_grad():
        evaluate(predictive, case.loader())
    assert modes == [True] * 3 + [False] * 3
