"""Hyperparameters (``laplace.core.priors``): prior precision, prior mean, σ and temperature.

Bad values fail early with a clear message naming the argument, at construction and on
assignment; laplace-torch's helpers ``expand_prior_precision`` and ``fix_prior_prec_structure``
(exported from ``laplace.utils``) expand and check the prior precision's structures.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from conftest import CASE_BUILDERS, assert_close
from laplace import DiagLaplace
from laplace.utils import expand_prior_precision, fix_prior_prec_structure


@pytest.mark.parametrize("prior", [torch.ones(3), torch.tensor([-1.0]), 0.0, torch.ones(2, 2)])
def test_bad_prior_precision(clf, prior):
    with pytest.raises(ValueError, match="prior_precision"):
        DiagLaplace(clf.model, "classification", prior_precision=prior)


def test_bad_prior_precision_on_assignment(clf):
    la = DiagLaplace(clf.model, "classification")
    with pytest.raises(ValueError, match="length 3"):
        la.prior_precision = torch.ones(3)


def test_bad_prior_mean(clf):
    with pytest.raises(ValueError, match="prior_mean"):
        DiagLaplace(clf.model, "classification", prior_mean=torch.zeros(5))


def test_sigma_noise_must_be_one_for_classification(clf):
    with pytest.raises(ValueError, match="sigma_noise must be 1"):
        DiagLaplace(clf.model, "classification", sigma_noise=2.0)
    la = DiagLaplace(clf.model, "classification")
    with pytest.raises(ValueError, match="sigma_noise must be 1"):
        la.sigma_noise = 0.5


def test_non_positive_sigma_and_temperature():
    reg = CASE_BUILDERS["mlp_regression_1out"]()
    with pytest.raises(ValueError, match="sigma_noise must be positive"):
        DiagLaplace(reg.model, "regression", sigma_noise=0.0)
    with pytest.raises(ValueError, match="temperature"):
        DiagLaplace(reg.model, "regression", temperature=0.0)


F64 = torch.float64


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
