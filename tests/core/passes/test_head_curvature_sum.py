"""The last layer's curvature pass (``HeadCurvatureSum``): buffer flushes sum to one pass."""

from __future__ import annotations

from conftest import CASE_BUILDERS, assert_close
from laplace import FullLLLaplace
from laplace.core.passes import head_curvature_sum


def test_buffer_flushes_sum_up(monkeypatch):
    case = CASE_BUILDERS["cnn_classification"]()
    whole = FullLLLaplace(case.model, "classification")
    whole.fit(case.loader())
    monkeypatch.setattr(head_curvature_sum, "BUFFER_ELEMENTS", 10)
    flushed = FullLLLaplace(case.model, "classification")
    flushed.fit(case.loader())
    assert_close(flushed.H, whole.H)
