"""The subset kernel's caching: the subset-of-data GP predicting with every subset Jacobian
recomputed or kept gives the same numbers, and with kept factors a prediction traces only the
test points."""

from __future__ import annotations

import pytest

import laplace.functional.kernel as kernel_module
from conftest import CASE_BUILDERS, assert_close
from laplace import Laplace
from laplace.curvature.engine.per_sample import PerSampleEngine

#: Kernels of the two kinds are sums of the same products in another order.
KERNEL_RTOL, KERNEL_ATOL = 1e-10, 1e-12


@pytest.mark.parametrize("independent", [False, True])
def test_gp_predictions_equal_with_subset_jacobians_kept_or_recomputed(monkeypatch, independent):
    case = CASE_BUILDERS["mlp_classification"]()
    kwargs = {"n_subset": 12, "independent_outputs": independent}
    kept = Laplace(case.model, "classification", "all", "gp", **kwargs)
    kept.fit(case.loader())
    monkeypatch.setattr(kernel_module, "CACHE_BYTES", 0)  # nothing kept: recomputed each time
    recomputed = Laplace(case.model, "classification", "all", "gp", **kwargs)
    recomputed.fit(case.loader())
    for joint in (False, True):
        expected = kept.predictive_moments(case.X[:5], joint=joint)
        actual = recomputed.predictive_moments(case.X[:5], joint=joint)
        for a, b in zip(actual, expected):
            assert_close(a, b, KERNEL_RTOL, KERNEL_ATOL)


def test_predictions_trace_only_the_test_points_once_the_subset_is_fitted(monkeypatch):
    case = CASE_BUILDERS["mlp_classification"]()
    gp = Laplace(case.model, "classification", "all", "gp", n_subset=15)
    gp.fit(case.loader(batch_size=4))
    traced = []
    original = PerSampleEngine.trace

    def counted(self, X, create_graph=False):
        traced.append(len(X))
        return original(self, X, create_graph)

    monkeypatch.setattr(PerSampleEngine, "trace", counted)
    gp(case.X[:7])
    gp(case.X[:3])
    assert traced == [7, 3]
