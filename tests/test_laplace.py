"""The ``Laplace`` factory: str enums, the class it builds, and the options it refuses."""

from __future__ import annotations

import pytest

from conftest import CASE_BUILDERS
from laplace import DiagLaplace, FullLaplace, HessianStructure, Laplace, Likelihood
from laplace.baselaplace import BaseLaplace, ParametricLaplace


@pytest.mark.parametrize(
    ("structure", "cls"),
    [("full", FullLaplace), ("diag", DiagLaplace), (HessianStructure.DIAG, DiagLaplace)],
)
def test_factory_builds_the_class(structure, cls):
    case = CASE_BUILDERS["mlp_classification"]()
    la = Laplace(
        case.model,
        "classification",
        subset_of_weights="all",
        hessian_structure=structure,
        prior_precision=2.0,
    )
    assert type(la) is cls
    assert isinstance(la, ParametricLaplace) and isinstance(la, BaseLaplace)
    assert la.likelihood == "classification" == Likelihood.CLASSIFICATION
    assert la.prior_precision.item() == 2.0


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"likelihood": "poisson"}, "likelihood='poisson'.*'classification'"),
        ({"hessian_structure": "block"}, "hessian_structure='block'.*'kron'"),
        ({"subset_of_weights": "half"}, "subset_of_weights='half'.*'all'"),
    ],
)
def test_factory_rejects_unknown_options(clf, kwargs, match):
    args = {
        "likelihood": "classification",
        "subset_of_weights": "all",
        "hessian_structure": "diag",
        **kwargs,
    }
    with pytest.raises(ValueError, match=match):
        Laplace(clf.model, **args)


def test_factory_rejects_unsupported_combination(clf):
    with pytest.raises(ValueError, match="valid structures for this subset: diag, full"):
        Laplace(
            clf.model, "classification", subset_of_weights="subnetwork", hessian_structure="kron"
        )


def test_factory_routes_function_space_approximations(clf):
    for approximation, name in [("nystrom", "ELLA"), ("variational", "VaLLA")]:
        with pytest.raises(TypeError, match=name):  # their required arguments are missing
            Laplace(
                clf.model,
                "classification",
                "all",
                "gp",
                functional_approximation=approximation,
            )


def test_reward_modeling_rejects_full(clf):
    with pytest.raises(ValueError, match="reward_modeling"):
        Laplace(clf.model, "reward_modeling", subset_of_weights="all", hessian_structure="full")
