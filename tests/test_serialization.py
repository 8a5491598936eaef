"""state_dict round trips, validation, weights_only loading and device moves."""

from __future__ import annotations

import io

import pytest
import torch

from conftest import CASE_BUILDERS, assert_close
from laplace import DiagLaplace, FullLaplace


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
