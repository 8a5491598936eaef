"""The curvature pass of a fit (``CurvatureSum``): a batch with NaN or inf curvature is refused;
the native engine adds every batch into one running sum."""

from __future__ import annotations

import pytest
import torch

from conftest import assert_close
from laplace import FullLaplace, Laplace


def test_nan_in_curvature(clf):
    with torch.no_grad():
        clf.model[0].weight[0, 0] = float("inf")
    la = FullLaplace(clf.model, "classification")
    with pytest.raises(RuntimeError, match="NaN or inf"):
        la.fit(clf.loader())


@pytest.mark.parametrize("structure", ["full", "diag", "kron"])
def test_every_batch_is_added_into_one_running_sum(structure, clf, monkeypatch):
    """The native engine adds each batch to the pass's running sum (``into``) and returns it:
    a fit holds one curvature, which sums the batches' own."""
    la = Laplace(clf.model, "classification", "all", hessian_structure=structure)
    backend, route = la.backend, "kron" if structure == "kron" else structure
    batches = list(clf.loader())
    assert len(batches) > 2
    expected = None
    for X, y in batches:
        H = getattr(backend, route)(X, y, N=len(clf.X))[1]
        expected = H if expected is None else expected + H
    calls = []
    native = getattr(backend, route)

    def spy(*args, **kwargs):
        result = native(*args, **kwargs)
        calls.append((kwargs.get("into"), result[1]))
        return result

    monkeypatch.setattr(backend, route, spy)
    la.fit(clf.loader())
    sums = {id(into) for into, _ in calls}
    assert len(calls) == len(batches) and len(sums) == 1
    assert all(H is into for into, H in calls)
    fitted = la.H_facs if structure == "kron" else la.H
    if structure == "kron":
        fitted, expected = fitted.to_matrix(), expected.to_matrix()
    assert_close(fitted, expected, rtol=1e-12, atol=1e-14)
