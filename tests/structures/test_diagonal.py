"""The diagonal structure's layer-wise GLM variances on a network mixing every kind of layer."""

from __future__ import annotations

from cases.mixed_layers import loader, mixed_net, tokens
from conftest import Oracle, assert_close
from laplace import DiagLaplace
from laplace.structures.diagonal import diag_functional_variance


def test_diag_glm_predictive_of_the_mixed_model_is_jacobian_free():
    model = mixed_net()
    X, y = tokens(10, 3)
    la = DiagLaplace(model, "classification", prior_precision=0.7)
    la.fit(loader(X, y))
    trace = la.backend.trace(X)
    f_var = diag_functional_variance(trace, la.posterior_precision)
    assert f_var is not None
    J = Oracle(model, "classification").jacobian(X)
    expected = (J / la.posterior_precision) @ J.transpose(1, 2)
    assert_close(f_var, expected, rtol=1e-8, atol=1e-12)
