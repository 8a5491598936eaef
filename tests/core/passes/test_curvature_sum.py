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


ROUTES = {"full": "full", "diag": "diag", "kron": "kron", "ekfac": "kron_statistics"}


@pytest.mark.parametrize("structure", list(ROUTES))
def test_every_batch_is_added_into_one_running_sum(structure, clf, monkeypatch):
    """The native engine adds each batch to the pass's running sum (``into``) and returns it:
    a fit holds one curvature, which sums the batches' own (EKFAC's factors too, while its
    statistics are kept)."""
    la = Laplace(clf.model, "classification", "all", hessian_structure=structure)
    backend, route = la.backend, ROUTES[structure]
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
    kron = structure in ("kron", "ekfac")
    fitted = la.H_facs if kron else la.H
    if kron:
        fitted, expected = fitted.to_matrix(), expected.to_matrix()
    assert_close(fitted, expected, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("structure", ["diag", "kron"])
def test_a_route_a_subclass_defines_itself_gets_no_running_sum(structure, clf):
    """A user's backend subclass overriding a route (laplace-torch's signature, its own
    keywords) is not handed ``into``; its batches are summed as they come."""
    from laplace.curvature import CurvlinopsGGN

    route = "kron" if structure == "kron" else "diag"
    seen = []

    def own_route(self, *args, **kwargs):
        seen.append(sorted(kwargs))
        return getattr(CurvlinopsGGN, route)(self, *args, **kwargs)

    Strict = type("Strict", (CurvlinopsGGN,), {route: own_route})
    la = Laplace(clf.model, "classification", "all", structure, backend=Strict)
    reference = Laplace(clf.model, "classification", "all", structure)
    la.fit(clf.loader())
    reference.fit(clf.loader())
    assert seen and all("into" not in keys for keys in seen)
    H, expected = (la.H_facs, reference.H_facs) if structure == "kron" else (la.H, reference.H)
    if structure == "kron":
        H, expected = H.to_matrix(), expected.to_matrix()
    assert_close(H, expected, rtol=1e-12, atol=1e-14)
