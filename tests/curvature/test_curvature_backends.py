"""Every backend against the dense torch.func oracles on the shared tiny cases."""

from __future__ import annotations

import pytest
import torch

from conftest import Oracle, assert_close
from laplace.curvature import (
    CURVATURE_BACKENDS,
    DEFAULT_BACKEND,
    CurvatureInterface,
    CurvlinopsEF,
    CurvlinopsGGN,
    CurvlinopsHessian,
)

GRADIENT_BACKENDS = [CurvlinopsGGN, CurvlinopsEF, CurvlinopsHessian]
BACKEND_IDS = [b.__name__ for b in GRADIENT_BACKENDS]


def _reference(backend_cls, oracle: Oracle, X, y) -> torch.Tensor:
    if issubclass(backend_cls, CurvlinopsGGN):
        return oracle.ggn(X)
    if issubclass(backend_cls, CurvlinopsEF):
        return oracle.ef(X, y)
    return oracle.hessian(X, y)


@pytest.mark.parametrize("backend_cls", GRADIENT_BACKENDS, ids=BACKEND_IDS)
def test_full_and_diag_match_oracle(case, backend_cls):
    oracle = Oracle(case.model, case.likelihood)
    backend = backend_cls(case.model, case.likelihood)
    expected = _reference(backend_cls, oracle, case.X, case.y)
    loss, H = backend.full(case.X, case.y)
    assert_close(H, expected)
    assert_close(loss, oracle.loss(case.X, case.y))
    loss_d, h = backend.diag(case.X, case.y)
    assert_close(h, expected.diagonal())
    assert_close(loss_d, oracle.loss(case.X, case.y))
    assert not H.requires_grad and not h.requires_grad


@pytest.mark.parametrize("backend_cls", GRADIENT_BACKENDS, ids=BACKEND_IDS)
def test_jacobians_and_gradients_match_oracle(case, backend_cls):
    oracle = Oracle(case.model, case.likelihood)
    backend = backend_cls(case.model, case.likelihood)
    Js, f = backend.jacobians(case.X)
    assert_close(Js, oracle.jacobian(case.X))
    assert_close(f, case.model(case.X))
    Js_func, f_func = backend.functorch_jacobians(case.X)
    assert_close(Js_func, Js)
    assert_close(f_func, f)
    Gs, loss = backend.gradients(case.X, case.y)
    assert_close(Gs, oracle.per_sample_gradients(case.X, case.y))
    assert_close(loss, oracle.loss(case.X, case.y))


def test_attributes_follow_laplace_torch(regression_case, classification_case):
    reg = CurvlinopsGGN(regression_case.model, "regression")
    cls = CurvlinopsGGN(classification_case.model, "classification", stochastic=True)
    assert (reg.factor, cls.factor) == (0.5, 1.0)
    assert isinstance(reg.lossfunc, torch.nn.MSELoss)
    assert isinstance(cls.lossfunc, torch.nn.CrossEntropyLoss)
    assert reg.likelihood == "regression" and cls.stochastic and cls.num_samples == 1
    assert reg.params == list(regression_case.model.parameters())
    assert reg.last_layer is False and reg.subnetwork_indices is None
    assert DEFAULT_BACKEND is CurvlinopsGGN
    assert all(issubclass(b, CurvatureInterface) for b in CURVATURE_BACKENDS.values())


def test_unknown_likelihood_is_refused(regression_case):
    with pytest.raises(ValueError, match="accepted values"):
        CurvlinopsGGN(regression_case.model, "poisson")
