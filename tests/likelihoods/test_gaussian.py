"""Gaussian regression: targets of another shape than the outputs are refused."""

from __future__ import annotations

import pytest
from torch.utils.data import DataLoader, TensorDataset

from conftest import CASE_BUILDERS
from laplace import DiagLaplace


def test_regression_target_shape_mismatch():
    reg = CASE_BUILDERS["mlp_regression_3out"]()
    la = DiagLaplace(reg.model, "regression")
    bad = DataLoader(TensorDataset(reg.X, reg.y[:, :2]), batch_size=5)
    with pytest.raises(ValueError, match="targets"):
        la.fit(bad)
