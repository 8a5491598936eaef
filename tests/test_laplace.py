"""The Laplace factory, str enums, and dtype/device following."""

from __future__ import annotations

import pytest
import torch

from conftest import CASE_BUILDERS
from laplace import DiagLaplace, FullLaplace, HessianStructure, Laplace, Likelihood
from laplace.baselaplace import BaseLaplace, ParametricLaplace


@pytest.mark.parametrize(
    ("structure", "cls"),
    [("full", FullLaplace), ("diag", DiagLaplace), (HessianStructure.DIAG, DiagLaplace)],
)
def test_factory_builds_the_class(structure, cls):
    case = CASE_BUILDERS["mlp_classification"]()
    la = Laplace(
        case.model,
        "classification",
        subset_of_weights="all",
        hessian_structure=structure,
        prior_precision=2.0,
    )
    assert type(la) is cls
    assert isinstance(la, ParametricLaplace) and isinstance(la, BaseLaplace)
    assert la.likelihood == "classification" == Likelihood.CLASSIFICATION
    assert la.prior_precision.item() == 2.0


def test_parametric_laplace_is_abstract():
    case = CASE_BUILDERS["mlp_classification"]()
    with pytest.raises(TypeError, match="abstract"):
        ParametricLaplace(case.model, "classification")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("cls", [FullLaplace, DiagLaplace], ids=["full", "diag"])
def test_tensors_follow_model_device_and_dtype(cls, dtype, device):
    case = CASE_BUILDERS["mlp_classification"]()
    model = case.model.to(device=device, dtype=dtype)
    X, y = case.X.to(dtype), case.y
    la = cls(model, "classification")
    la.fit(torch.utils.data.DataLoader(torch.utils.data.TensorDataset(X, y), batch_size=8))
    for t in (
        la.H,
        la.mean,
        la.prior_precision,
        la.prior_precision_diag,
        la.log_marginal_likelihood(),
        la.sample(3),
    ):
        assert t.dtype == dtype and t.device.type == device.type
    probs = la(X[:4].to(device))
    assert probs.dtype == dtype and probs.device.type == device.type
