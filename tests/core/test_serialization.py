"""state_dict round trips, validation, weights_only loading and device moves."""

from __future__ import annotations

import io

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from conftest import CASE_BUILDERS, assert_close
from laplace import DiagLaplace, FullLaplace
from laplace.core.serialization import identity_mismatch


def roundtrip(state, **load_kwargs):
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True, **load_kwargs)


@pytest.mark.parametrize("cls", [FullLaplace, DiagLaplace], ids=["full", "diag"])
def test_roundtrip_weights_only(cls, device):
    case = CASE_BUILDERS["mlp_regression_3out"]()
    la = cls(case.model, "regression", sigma_noise=0.5, prior_precision=2.0, temperature=0.9)
    la.fit(case.loader())
    la.prior_precision = torch.full((la.n_layers,), 3.0, dtype=torch.float64)
    state = roundtrip(la.state_dict(), map_location=device)

    model2 = CASE_BUILDERS["mlp_regression_3out"]().model.to(device)
    la2 = cls(model2, "regression")
    la2.load_state_dict(state)
    assert la2.H.device.type == device.type
    assert_close(la2.H.cpu(), la.H)
    assert_close(la2.log_marginal_likelihood().cpu(), la.log_marginal_likelihood())
    f2, v2 = la2(case.X[:3].to(device))
    f1, v1 = la(case.X[:3])
    assert_close(f2.cpu(), f1)
    assert_close(v2.cpu(), v1)
    assert la2.temperature == 0.9
    assert_close(la2.sigma_noise.cpu(), la.sigma_noise)


def test_rejects_wrong_class_and_likelihood():
    case = CASE_BUILDERS["mlp_regression_3out"]()
    la = FullLaplace(case.model, "regression")
    la.fit(case.loader())
    with pytest.raises(ValueError, match="cls_name"):
        DiagLaplace(case.model, "regression").load_state_dict(la.state_dict())


def test_rejects_wrong_architecture():
    case = CASE_BUILDERS["mlp_regression_3out"]()
    la = FullLaplace(case.model, "regression")
    la.fit(case.loader())
    other = CASE_BUILDERS["mlp_regression_1out"]().model
    with pytest.raises(ValueError, match="param_shapes"):
        FullLaplace(other, "regression").load_state_dict(la.state_dict())


def test_rejects_model_with_other_modules_of_the_same_parameters():
    def net(activation):
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(3, 4), activation(), torch.nn.Linear(4, 1))

    loader = DataLoader(TensorDataset(torch.randn(8, 3), torch.randn(8, 1)), batch_size=4)
    tanh = FullLaplace(net(torch.nn.Tanh), "regression")
    tanh.fit(loader)
    message = r"module_tree .*\['1', 'Tanh', ''\].*\['1', 'ReLU', ''\].*same pretrained model"
    with pytest.raises(ValueError, match=message):
        FullLaplace(net(torch.nn.ReLU), "regression").load_state_dict(tanh.state_dict())
    leaky = FullLaplace(net(torch.nn.LeakyReLU), "regression")
    leaky.fit(loader)
    steeper = FullLaplace(net(lambda: torch.nn.LeakyReLU(0.2)), "regression")
    with pytest.raises(ValueError, match=r"negative_slope=0\.2"):  # the module's settings count
        steeper.load_state_dict(leaky.state_dict())


def test_long_identity_entries_are_reported_by_their_first_difference():
    saved = [
        [f"layer{i}", "Linear", "in_features=64, out_features=64, bias=True"] for i in range(9)
    ]
    current = [*saved[:5], [saved[5][0], "Conv1d", saved[5][2]], *saved[6:8]]
    message = identity_mismatch("module_tree", saved, current)
    assert "differs at entry 5 (of 9 saved, 8 here): ['layer5', 'Linear'," in message
    assert "['layer5', 'Conv1d'," in message and "same pretrained model" in message
    assert "entry 8 (of 9 saved, 8 here): ['layer8'" in identity_mismatch("x", saved, saved[:8])
    assert identity_mismatch("x", [1], [2]).endswith("its x is [1], expected [2].")


def test_rejects_model_with_other_weights():
    case = CASE_BUILDERS["mlp_regression_3out"]()
    la = FullLaplace(case.model, "regression")
    la.fit(case.loader())
    model2 = CASE_BUILDERS["mlp_regression_3out"]().model
    with torch.no_grad():
        model2[0].weight.add_(1.0)
    with pytest.raises(ValueError, match="weights differ"):
        FullLaplace(model2, "regression").load_state_dict(la.state_dict())


def test_rejects_wrong_curvature_shape():
    case = CASE_BUILDERS["mlp_regression_3out"]()
    la = FullLaplace(case.model, "regression")
    la.fit(case.loader())
    state = la.state_dict()
    state["H"] = state["H"][:-1]
    with pytest.raises(ValueError, match="H"):
        FullLaplace(case.model, "regression").load_state_dict(state)
