"""Constructors: laplace-torch's parameter lists, and objects rebuilt from their attributes.

Downstream libraries introspect the constructors (lightning-uq-box rebuilds a Laplace object from
``{a: getattr(la, a) for a in la.__init__.__code__.co_varnames if hasattr(la, a)}``), so every
public class has laplace-torch's explicit parameter list (names, order, defaults; our additions
only after it, with defaults) and stores each argument under its own name.
"""

from __future__ import annotations

import ast
import importlib
import inspect
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from conftest import CASE_BUILDERS, assert_close
from laplace import (
    ELLA,
    BaseFunctionalLaplace,
    BaseLaplace,
    DiagLaplace,
    DiagLLLaplace,
    DiagSubnetLaplace,
    FullLaplace,
    FullLLLaplace,
    FullSubnetLaplace,
    FunctionalLaplace,
    FunctionalLLLaplace,
    KronLaplace,
    KronLLLaplace,
    LowRankLaplace,
    VaLLA,
)
from laplace import curvature as C
from laplace import utils as U
from laplace.curvature import CurvatureInterface
from laplace.utils import FeatureExtractor

_BASE = (
    "model likelihood sigma_noise=1.0 prior_precision=1.0 prior_mean=0.0 temperature=1.0 "
    "enable_backprop=False dict_key_x='input_ids' dict_key_y='labels' backend=None"
)
_LL = (
    "model likelihood sigma_noise=1.0 prior_precision=1.0 prior_mean=0.0 temperature=1.0 "
    "enable_backprop=False feature_reduction=None dict_key_x='input_ids' dict_key_y='labels' "
    "backend=None last_layer_name=None"
)
_SUBNET = (
    "model likelihood subnetwork_indices sigma_noise=1.0 prior_precision=1.0 prior_mean=0.0 "
    "temperature=1.0 backend=None backend_kwargs=None asdl_fisher_kwargs=None"
)
_GP = "sigma_noise=1.0 prior_precision=1.0 prior_mean=0.0 temperature=1.0 enable_backprop=False "
_KEYS = "dict_key_x='input_ids' dict_key_y='labels'"
_BACKEND = f"model likelihood last_layer=False subnetwork_indices=None {_KEYS}"
_NO_SUBNET = f"model likelihood last_layer=False {_KEYS}"

#: laplace-torch 0.3's constructor parameters (``name`` required, ``name=default``).
LAPLACE_TORCH = {
    "laplace.BaseLaplace": f"{_BASE} backend_kwargs=None asdl_fisher_kwargs=None",
    "laplace.ParametricLaplace": f"{_BASE} backend_kwargs=None asdl_fisher_kwargs=None",
    "laplace.FullLaplace": f"{_BASE} backend_kwargs=None",
    "laplace.DiagLaplace": f"{_BASE} backend_kwargs=None asdl_fisher_kwargs=None",
    "laplace.KronLaplace": f"{_BASE} damping=False backend_kwargs=None asdl_fisher_kwargs=None",
    "laplace.LowRankLaplace": (
        "model likelihood backend=CurvatureInterface sigma_noise=1 prior_precision=1 "
        f"prior_mean=0 temperature=1 enable_backprop=False {_KEYS} backend_kwargs=None"
    ),
    "laplace.LLLaplace": f"{_LL} backend_kwargs=None asdl_fisher_kwargs=None",
    "laplace.FullLLLaplace": f"{_LL} backend_kwargs=None asdl_fisher_kwargs=None",
    "laplace.DiagLLLaplace": f"{_LL} backend_kwargs=None asdl_fisher_kwargs=None",
    "laplace.KronLLLaplace": f"{_LL} damping=False backend_kwargs=None asdl_fisher_kwargs=None",
    "laplace.SubnetLaplace": _SUBNET,
    "laplace.FullSubnetLaplace": _SUBNET,
    "laplace.DiagSubnetLaplace": _SUBNET,
    "laplace.BaseFunctionalLaplace": f"{_BASE} backend_kwargs=None asdl_fisher_kwargs=None",
    "laplace.FunctionalLaplace": (
        f"model likelihood n_subset {_GP}{_KEYS} backend=BackPackGGN backend_kwargs=None "
        "independent_outputs=False seed=0"
    ),
    "laplace.FunctionalLLLaplace": (
        f"model likelihood n_subset {_GP}feature_reduction=None {_KEYS} last_layer_name=None "
        "backend=BackPackGGN backend_kwargs=None independent_outputs=False seed=0"
    ),
    "laplace.ELLA": (
        f"model likelihood subsample_size n_eigenvalues {_GP}{_KEYS} backend=None "
        "backend_kwargs=None seed=1234"
    ),
    "laplace.VaLLA": (
        f"model likelihood inducing_locations num_inducing=None inducing_classes=None {_GP}"
        f"{_KEYS} backend=None backend_kwargs=None seed=0 alpha=1.0 mc_softmax_samples=0"
    ),
    "laplace.curvature.CurvatureInterface": _BACKEND,
    "laplace.curvature.GGNInterface": f"{_BACKEND} stochastic=False num_samples=1",
    "laplace.curvature.EFInterface": _BACKEND,
    "laplace.curvature.CurvlinopsInterface": _BACKEND,
    "laplace.curvature.CurvlinopsGGN": f"{_BACKEND} stochastic=False",
    "laplace.curvature.CurvlinopsEF": _BACKEND,
    "laplace.curvature.CurvlinopsHessian": _BACKEND,
    "laplace.curvature.AsdlInterface": _BACKEND,
    "laplace.curvature.AsdlGGN": f"{_BACKEND} stochastic=False",
    "laplace.curvature.AsdlEF": _NO_SUBNET,
    "laplace.curvature.AsdlHessian": _NO_SUBNET,
    "laplace.curvature.BackPackInterface": _BACKEND,
    "laplace.curvature.BackPackGGN": f"{_BACKEND} stochastic=False",
    "laplace.curvature.BackPackEF": _BACKEND,
    "laplace.curvature.asdfghjkl.AsdfghjklInterface": _BACKEND,
    "laplace.curvature.asdfghjkl.AsdfghjklGGN": f"{_BACKEND} stochastic=False",
    "laplace.curvature.asdfghjkl.AsdfghjklEF": _NO_SUBNET,
    "laplace.curvature.asdfghjkl.AsdfghjklHessian": f"{_NO_SUBNET} low_rank=10",
    "laplace.utils.FeatureExtractor": (
        "model last_layer_name=None enable_backprop=False feature_reduction=None"
    ),
    "laplace.utils.SubnetMask": "model",
    "laplace.utils.RandomSubnetMask": "model n_params_subnet",
    "laplace.utils.LargestMagnitudeSubnetMask": "model n_params_subnet",
    "laplace.utils.LargestVarianceDiagLaplaceSubnetMask": (
        "model n_params_subnet diag_laplace_model"
    ),
    "laplace.utils.LargestVarianceSWAGSubnetMask": (
        "model n_params_subnet likelihood='classification' swag_n_snapshots=40 "
        "swag_snapshot_freq=1 swag_lr=0.01"
    ),
    "laplace.utils.ParamNameSubnetMask": "model parameter_names",
    "laplace.utils.ModuleNameSubnetMask": "model module_names",
    "laplace.utils.LastLayerSubnetMask": "model last_layer_name=None",
    "laplace.utils.Kron": "kfacs",
    "laplace.utils.KronDecomposed": "eigenvectors eigenvalues deltas=None damping=False",
    "laplace.utils.RunningNLLMetric": "ignore_index=-100",
    "laplace.utils.SoDSampler": "N M seed=0",
}

#: Defaults we change on purpose (docs/migration.md, "Behaviour that differs"): None selects
#: CurvlinopsGGN, which works without the unpublished asdfghjkl package and gives the same
#: Jacobians.
DIFFERENT_DEFAULTS = {
    ("laplace.LowRankLaplace", "backend"): None,
    ("laplace.FunctionalLaplace", "backend"): None,
    ("laplace.FunctionalLLLaplace", "backend"): None,
}


def _class(path: str) -> type:
    module, name = path.rsplit(".", 1)
    return getattr(importlib.import_module(module), name)


def _parse(spec: str) -> list[tuple[str, Any]]:
    params = []
    for item in spec.split():
        name, _, default = item.partition("=")
        params.append((name, inspect.Parameter.empty if not _ else default))
    return params


def _same_default(ours: Any, theirs: str) -> bool:
    """Whether our default equals laplace-torch's (a literal, or a class given by its name)."""
    if isinstance(ours, type):
        return ours.__name__ == theirs
    return ours == ast.literal_eval(theirs)  # 1 == 1.0; a str enum equals its value


@pytest.mark.parametrize("path", list(LAPLACE_TORCH))
def test_constructor_has_laplace_torch_parameter_list(path):
    cls = _class(path)
    params = list(inspect.signature(cls.__init__).parameters.values())[1:]
    kinds = {p.kind for p in params}
    assert inspect.Parameter.VAR_POSITIONAL not in kinds, "no *args constructors"
    assert inspect.Parameter.VAR_KEYWORD not in kinds, "no **kwargs constructors"
    expected = _parse(LAPLACE_TORCH[path])
    ours = params[: len(expected)]
    assert [p.name for p in ours] == [name for name, _ in expected]
    assert all(p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD for p in ours)
    for p, (name, default) in zip(ours, expected):
        if default is inspect.Parameter.empty:
            assert p.default is inspect.Parameter.empty, name
        elif (path, name) in DIFFERENT_DEFAULTS:
            assert p.default == DIFFERENT_DEFAULTS[path, name]
        else:
            assert _same_default(p.default, default), f"{name}={p.default!r}, not {default}"
    for extra in params[len(expected) :]:  # our additions come last and are optional
        assert extra.default is not inspect.Parameter.empty, extra.name
    names = cls.__init__.__code__.co_varnames
    assert names[: 1 + len(params)] == ("self", *(p.name for p in params))


# --------------------------------------------------------------------- rebuilt from attributes
def _rebuild(obj: Any) -> Any:
    """lightning-uq-box's rebuild: every ``__init__`` variable the object has as an attribute."""
    names = obj.__init__.__code__.co_varnames
    return type(obj)(**{a: getattr(obj, a) for a in names if hasattr(obj, a)})


def _equivalent(a: Any, b: Any) -> bool:
    """Whether two constructor arguments configure the same object."""
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and bool(torch.equal(a.detach(), b.detach()))
    if isinstance(a, FeatureExtractor) and isinstance(b, FeatureExtractor):
        return a.model is b.model and a.last_layer_name == b.last_layer_name
    if isinstance(a, CurvatureInterface) or isinstance(b, CurvatureInterface):
        return type(a) is type(b) and _equivalent(vars(a).get("model"), vars(b).get("model"))
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_equivalent(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_equivalent(a[k], b[k]) for k in a)
    return a is b or a == b


def _assert_same_configuration(original: Any, rebuilt: Any) -> None:
    assert type(rebuilt) is type(original)
    for name in list(inspect.signature(type(original).__init__).parameters)[1:]:
        if hasattr(original, name):
            assert _equivalent(getattr(rebuilt, name), getattr(original, name)), name


REG = CASE_BUILDERS["mlp_regression_1out"]
SUBNET = torch.tensor([3, 11, 20, 25])
#: Laplace classes with non-default arguments; the regression case has 26 weights.
LAPLACE_RECIPES: dict[str, Callable[[nn.Module], Any]] = {
    "BaseLaplace": lambda m: BaseLaplace(m, "regression", sigma_noise=0.7, temperature=0.9),
    "BaseFunctionalLaplace": lambda m: BaseFunctionalLaplace(m, "regression", prior_mean=0.2),
    "FullLaplace": lambda m: FullLaplace(
        m, "regression", sigma_noise=0.7, prior_precision=2.0, backend=C.CurvlinopsEF
    ),
    "DiagLaplace": lambda m: DiagLaplace(
        m,
        "regression",
        prior_precision=torch.linspace(1, 2, 26, dtype=torch.float64),
        temperature=0.9,
        backend_kwargs={"kfac_approx": "reduce"},
    ),
    "KronLaplace": lambda m: KronLaplace(
        m, "regression", prior_precision=torch.tensor([1.0, 2.0, 3.0, 4.0]), damping=True
    ),
    "LowRankLaplace": lambda m: LowRankLaplace(
        m, "regression", sigma_noise=0.5, backend_kwargs={"n_eigenvalues": 3, "seed": 1}
    ),
    "FullLLLaplace": lambda m: FullLLLaplace(m, "regression", prior_mean=0.1),
    "DiagLLLaplace": lambda m: DiagLLLaplace(m, "regression", last_layer_name="2"),
    "KronLLLaplace": lambda m: KronLLLaplace(m, "regression", damping=True, sigma_noise=0.6),
    "KronLLLaplace(backend)": lambda m: KronLLLaplace(m, "regression", backend=C.CurvlinopsEF),
    "FullSubnetLaplace": lambda m: FullSubnetLaplace(
        m, "regression", SUBNET, prior_precision=2.0, backend=C.CurvlinopsEF
    ),
    "DiagSubnetLaplace": lambda m: DiagSubnetLaplace(m, "regression", SUBNET, temperature=0.5),
    "FunctionalLaplace": lambda m: FunctionalLaplace(m, "regression", n_subset=8, seed=3),
    "FunctionalLLLaplace": lambda m: FunctionalLLLaplace(m, "regression", 8, sigma_noise=0.5),
    "ELLA": lambda m: ELLA(m, "regression", subsample_size=8, n_eigenvalues=3, seed=5),
    "VaLLA": lambda m: VaLLA(m, "regression", "random", num_inducing=4, seed=1),
}
#: Classes without a fit of their own, or whose fit is not reproducible from the attributes
#: alone (VaLLA's optimisation starts from its learnt inducing points).
CONFIGURATION_ONLY = {"BaseLaplace", "BaseFunctionalLaplace", "VaLLA"}


def _fit(la: Any, loader) -> None:
    if isinstance(la, VaLLA):
        la.fit(loader, iterations=5)
    else:
        la.fit(loader)


def _predictions(la: Any, X: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return la(X) if isinstance(la, BaseFunctionalLaplace) else la(X, pred_type="glm")


@pytest.mark.parametrize("name", list(LAPLACE_RECIPES))
def test_laplace_objects_rebuild_from_their_attributes_before_and_after_fit(name):
    case = REG()
    la = LAPLACE_RECIPES[name](case.model)
    before = _rebuild(la)
    _assert_same_configuration(la, before)
    if name in CONFIGURATION_ONLY - {"VaLLA"}:
        return
    _fit(la, case.loader())
    if hasattr(la, "prior_precision") and not isinstance(la, BaseFunctionalLaplace):
        la.prior_precision = la.prior_precision * 1.5  # tuned after fit: kept by the rebuild
    after = _rebuild(la)
    _assert_same_configuration(la, after)
    if name in CONFIGURATION_ONLY:
        return
    before.prior_precision = la.prior_precision  # it was rebuilt before the tuning
    for rebuilt in (before, after):
        _fit(rebuilt, case.loader())
        for ours, theirs in zip(_predictions(rebuilt, case.X[:5]), _predictions(la, case.X[:5])):
            assert_close(ours, theirs)


def _backend_recipes() -> dict[str, Callable[[nn.Module], Any]]:
    subnet = {"subnetwork_indices": SUBNET}
    return {
        "CurvlinopsGGN": lambda m: C.CurvlinopsGGN(
            m, "regression", stochastic=True, num_samples=3
        ),
        "CurvlinopsEF": lambda m: C.CurvlinopsEF(m, "regression", kfac_approx="reduce", **subnet),
        "CurvlinopsHessian": lambda m: C.CurvlinopsHessian(m, "regression", dict_key_x="x"),
        "AsdlGGN": lambda m: C.AsdlGGN(m, "regression", asdl_fisher_kwargs={"n_mc_samples": 2}),
        "AsdlEF": lambda m: C.AsdlEF(m, "regression", **subnet),
        "AsdlHessian": lambda m: C.AsdlHessian(m, "regression"),
        "BackPackGGN": lambda m: C.BackPackGGN(m, "regression", stochastic=True),
        "BackPackEF": lambda m: C.BackPackEF(m, "regression", **subnet),
        "FeatureExtractor": lambda m: FeatureExtractor(m, "2", feature_reduction="average"),
        "RandomSubnetMask": lambda m: U.RandomSubnetMask(m, 5),
        "LargestMagnitudeSubnetMask": lambda m: U.LargestMagnitudeSubnetMask(m, 5),
        "LargestVarianceSWAGSubnetMask": lambda m: U.LargestVarianceSWAGSubnetMask(
            m, 5, "regression", swag_n_snapshots=3
        ),
        "ParamNameSubnetMask": lambda m: U.ParamNameSubnetMask(m, ["0.weight"]),
        "ModuleNameSubnetMask": lambda m: U.ModuleNameSubnetMask(m, ["2"]),
        "LastLayerSubnetMask": lambda m: U.LastLayerSubnetMask(m, "2"),
        "RunningNLLMetric": lambda m: U.RunningNLLMetric(ignore_index=3),
        "SoDSampler": lambda m: U.SoDSampler(10, 4, seed=2),
        "Kron": lambda m: U.Kron([[torch.eye(2), 2 * torch.eye(3)], [torch.eye(2)]]),
    }


@pytest.mark.parametrize("name", list(_backend_recipes()))
def test_backends_and_utilities_rebuild_from_their_attributes(name):
    obj = _backend_recipes()[name](REG().model)
    _assert_same_configuration(obj, _rebuild(obj))


@pytest.mark.parametrize("name", list(LAPLACE_RECIPES))
def test_every_property_is_computable_or_an_attribute_error(name):
    # hasattr/getattr(la, name, default) on any property, before and after fit, never raise
    case = REG()
    la = LAPLACE_RECIPES[name](case.model)
    for fitted in (False, True):
        if fitted and name not in CONFIGURATION_ONLY - {"VaLLA"}:
            _fit(la, case.loader())
        for attribute in dir(type(la)):
            if isinstance(inspect.getattr_static(type(la), attribute), property):
                assert hasattr(la, attribute) in (True, False)
