"""``FunctionalLLLaplace``: the last-layer GP is the all-weights GP on a frozen body."""

from __future__ import annotations

from functional_cases import fitted_gp

from conftest import CASE_BUILDERS, assert_close, freeze_all_but
from laplace import Laplace


def test_last_layer_gp_equals_all_weights_gp_on_a_frozen_body():
    case = CASE_BUILDERS["mlp_classification"]()
    ll = fitted_gp(case, "last_layer", n_subset=9)
    frozen = Laplace(freeze_all_but(case.model, "2"), "classification", "all", "gp", n_subset=9)
    frozen.fit(case.loader())
    assert_close(ll(case.X[:5]), frozen(case.X[:5]))
    assert_close(ll.log_marginal_likelihood(), frozen.log_marginal_likelihood())
