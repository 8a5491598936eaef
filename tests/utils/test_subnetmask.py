"""Subnetwork masks select what their definitions say."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from conftest import CASE_BUILDERS
from laplace import DiagLaplace, FullSubnetLaplace
from laplace.utils import (
    LargestMagnitudeSubnetMask,
    LargestVarianceDiagLaplaceSubnetMask,
    LargestVarianceSWAGSubnetMask,
    LastLayerSubnetMask,
    ModuleNameSubnetMask,
    ParamNameSubnetMask,
    RandomSubnetMask,
    SubnetMask,
    fit_diagonal_swag_var,
)


@pytest.fixture
def case():
    return CASE_BUILDERS[
        "mlp_classification"
    ]()  # Linear(3,5) ReLU Linear(5,4): 15+5+20+4 = 44 weights


def _ranges(model):
    out, start = {}, 0
    for name, p in model.named_parameters():
        out[name] = torch.arange(start, start + p.numel())
        start += p.numel()
    return out


def test_largest_magnitude_is_top_k_abs(case):
    theta = torch.cat([p.detach().flatten() for p in case.model.parameters()])
    idx = LargestMagnitudeSubnetMask(case.model, n_params_subnet=7).select()
    assert idx.dtype == torch.long and torch.equal(idx, idx.sort().values)
    assert set(idx.tolist()) == set(theta.abs().topk(7).indices.tolist())


def test_random_mask_respects_the_seed(case):
    torch.manual_seed(5)
    a = RandomSubnetMask(case.model, n_params_subnet=10).select()
    torch.manual_seed(5)
    b = RandomSubnetMask(case.model, n_params_subnet=10).select()
    torch.manual_seed(6)
    c = RandomSubnetMask(case.model, n_params_subnet=10).select()
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert len(a.unique()) == 10 and int(a.max()) < 44


def test_param_and_module_names_map_to_index_ranges(case):
    ranges = _ranges(case.model)
    idx = ParamNameSubnetMask(case.model, ["2.weight", "0.bias"]).select()
    assert torch.equal(idx, torch.cat([ranges["0.bias"], ranges["2.weight"]]))
    idx = ModuleNameSubnetMask(case.model, ["2"]).select()
    assert torch.equal(idx, torch.cat([ranges["2.weight"], ranges["2.bias"]]))
    loader = case.loader()
    idx = LastLayerSubnetMask(case.model).select(loader)
    assert torch.equal(idx, torch.cat([ranges["2.weight"], ranges["2.bias"]]))
    idx = LastLayerSubnetMask(case.model, last_layer_name="0").select()
    assert torch.equal(idx, torch.cat([ranges["0.weight"], ranges["0.bias"]]))


def test_largest_variance_diag_laplace(case):
    diag = DiagLaplace(case.model, "classification")
    mask = LargestVarianceDiagLaplaceSubnetMask(case.model, 6, diag)
    idx = mask.select(case.loader())
    assert set(idx.tolist()) == set(diag.posterior_variance.topk(6).indices.tolist())
    la = FullSubnetLaplace(case.model, "classification", subnetwork_indices=idx)
    la.fit(case.loader())
    assert la.H.shape == (6, 6)


def test_largest_variance_swag(case):
    torch.manual_seed(0)
    before = [p.detach().clone() for p in case.model.parameters()]
    variances = fit_diagonal_swag_var(
        case.model, case.loader(), nn.CrossEntropyLoss(), n_snapshots_total=4
    )
    assert variances.shape == (44,) and bool((variances > 0).all())
    assert all(torch.equal(a, b) for a, b in zip(before, case.model.parameters()))
    torch.manual_seed(0)
    mask = LargestVarianceSWAGSubnetMask(case.model, 5, swag_n_snapshots=4)
    idx = mask.select(case.loader())
    assert set(idx.tolist()) == set(variances.topk(5).indices.tolist())
    with pytest.raises(ValueError, match="likelihood"):
        LargestVarianceSWAGSubnetMask(case.model, 5, likelihood="reward_modeling")


def test_mask_errors(case):
    with pytest.raises(ValueError, match="n_params_subnet"):
        LargestMagnitudeSubnetMask(case.model, n_params_subnet=50)
    mask = LargestMagnitudeSubnetMask(case.model, 3)
    with pytest.raises(AttributeError, match="select"):
        _ = mask.indices
    mask.select()
    assert mask.n_params_subnet == 3
    with pytest.raises(ValueError, match="already selected"):
        mask.select()
    with pytest.raises(ValueError, match="do not exist"):
        ParamNameSubnetMask(case.model, ["nope"]).select()
    with pytest.raises(ValueError, match="empty"):
        ModuleNameSubnetMask(case.model, []).select()
    with pytest.raises(ValueError, match="children"):
        ModuleNameSubnetMask(case.model, [""]).select()
    with pytest.raises(ValueError, match="no trainable parameters"):
        ModuleNameSubnetMask(case.model, ["1"]).select()
    with pytest.raises(ValueError, match="train_loader"):
        LargestVarianceDiagLaplaceSubnetMask(
            case.model, 3, DiagLaplace(case.model, "classification")
        ).select()
    base = SubnetMask(case.model)
    with pytest.raises(ValueError, match="binary"):
        base.convert_subnet_mask_to_indices(torch.full((44,), 2))
    with pytest.raises(ValueError, match="1-D"):
        base.convert_subnet_mask_to_indices(torch.zeros(44))
    assert torch.equal(
        base.convert_subnet_mask_to_indices(torch.arange(44) % 10 == 0),
        torch.arange(0, 44, 10),
    )
