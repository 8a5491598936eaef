"""The curvature pass of a fit (``CurvatureSum``): a batch with NaN or inf curvature is refused."""

from __future__ import annotations

import pytest
import torch

from laplace import FullLaplace


def test_nan_in_curvature(clf):
    with torch.no_grad():
        clf.model[0].weight[0, 0] = float("inf")
    la = FullLaplace(clf.model, "classification")
    with pytest.raises(RuntimeError, match="NaN or inf"):
        la.fit(clf.loader())
