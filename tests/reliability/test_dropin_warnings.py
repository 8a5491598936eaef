"""Every warning laplace-torch 0.3 emits on a public call: laplace-ng emits it, or it is gone.

The table was built from laplace-torch 0.3's source (every ``warnings.warn`` call in its
``laplace`` package): each row is the public call that reaches it, the category and the
message. laplace-ng emits the same category and message on the same call (users filter and
assert them), or the row says why its cause no longer exists, and ``docs/migration.md`` says
so too.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from conftest import CASE_BUILDERS
from laplace import DiagLaplace, FunctionalLaplace, marglik_training

MIGRATION_NOTES = Path(__file__).resolve().parents[2] / "docs" / "migration.md"


@dataclass(frozen=True)
class LaplaceTorchWarning:
    """One ``warnings.warn`` of laplace-torch 0.3.

    Attributes:
        call: The public call that emits it.
        category: Its warning class.
        message: Its message, word for word.
        trigger: Makes the call in laplace-ng (None where the warning is gone).
        gone: Why laplace-ng does not emit it (None where it does).
    """

    call: str
    category: type[Warning]
    message: str
    trigger: Callable[[], object] | None = None
    gone: str | None = None


def _fitted_diag(case_name: str, **kwargs: object) -> tuple[DiagLaplace, object]:
    case = CASE_BUILDERS[case_name]()
    la = DiagLaplace(case.model, case.likelihood, **kwargs)
    la.fit(case.loader())
    return la, case


def _classification_tuning() -> None:
    la, _ = _fitted_diag("mlp_classification")
    la.optimize_prior_precision(method="marglik", n_steps=1)


def _marglik_with_val_loader() -> None:
    la, case = _fitted_diag("mlp_regression_1out")
    la.optimize_prior_precision(method="marglik", n_steps=1, val_loader=case.loader())


def _fitted_gp(**kwargs: object) -> tuple[FunctionalLaplace, object]:
    case = CASE_BUILDERS["mlp_regression_3out"]()
    la = FunctionalLaplace(case.model, "regression", n_subset=8, **kwargs)
    la.fit(case.loader())
    return la, case


def _gp_with_independent_outputs() -> None:
    _fitted_gp(independent_outputs=True)


def _gp_marglik_tuning() -> None:
    la, _ = _fitted_gp()
    la.optimize_prior_precision(method="marglik", n_steps=1)


def _gp_prediction_after_prior_change() -> None:
    la, case = _fitted_gp()
    la.prior_precision = 2.0
    la(case.X[:2])


def _load_state(**changed: object) -> None:
    la, case = _fitted_diag("mlp_regression_1out")
    other = DiagLaplace(case.model, "regression", **changed)
    other.load_state_dict(la.state_dict())


def _marglik_training_with_weight_decay() -> None:
    case = CASE_BUILDERS["mlp_regression_1out"]()
    marglik_training(
        case.model,
        case.loader(),
        "regression",
        hessian_structure="diag",
        optimizer_kwargs={"weight_decay": 1e-3},
        n_epochs=1,
        n_hypersteps=1,
    )


TABLE = [
    LaplaceTorchWarning(
        "BaseLaplace.optimize_prior_precision, classification or reward modelling (every call)",
        UserWarning,
        "By default `link_approx` is `probit`. Make sure to set it equals to the way you want to "
        "call `la(test_data, pred_type=..., link_approx=...)`.",
        _classification_tuning,
    ),
    LaplaceTorchWarning(
        "BaseLaplace.optimize_prior_precision(method='marglik', val_loader=...)",
        UserWarning,
        "`val_loader` will be ignored when `method` == 'marglik'. Do you mean to set "
        "`method = 'gridsearch'`?",
        _marglik_with_val_loader,
    ),
    LaplaceTorchWarning(
        "FunctionalLaplace.fit, multi-output regression with independent_outputs=True",
        UserWarning,
        "Using FunctionalLaplace with the diagonal approximation of a GP kernel is not "
        "recommended in the case of multivariate regression. Predictive variance will likely "
        "be overestimated.",
        _gp_with_independent_outputs,
    ),
    LaplaceTorchWarning(
        "FunctionalLaplace.optimize_prior_precision(method='marglik')",
        UserWarning,
        "Use of method='marglik' in case of FunctionalLaplace is discouraged, rather use "
        "method='CV'.",
        _gp_marglik_tuning,
    ),
    LaplaceTorchWarning(
        "FunctionalLaplace prediction after the prior precision changed since fit",
        UserWarning,
        "The prior precision has changed since fit; recomputing the GP posterior.",
        _gp_prediction_after_prior_change,
    ),
    LaplaceTorchWarning(
        "load_state_dict of a state with another temperature",
        UserWarning,
        "Different `temperature` parameters detected. Some calculation might be off!",
        lambda: _load_state(temperature=2.0),
    ),
    LaplaceTorchWarning(
        "load_state_dict of a state with another enable_backprop",
        UserWarning,
        "Different `enable_backprop` values. You might encounter error when differentiating "
        "the predictive mean and variance.",
        lambda: _load_state(enable_backprop=True),
    ),
    LaplaceTorchWarning(
        "marglik_training(optimizer_kwargs={'weight_decay': ...})",
        UserWarning,
        "Weight decay is handled and optimized. Will be set to 0.",
        _marglik_training_with_weight_decay,
    ),
    LaplaceTorchWarning(
        "load_state_dict of a state with a prior mean into a None prior mean",
        UserWarning,
        "Loading non-`None` prior mean into a `None` prior mean. You might get wrong results.",
        gone="a prior mean is never None: laplace-torch's own setter refuses None too",
    ),
    LaplaceTorchWarning(
        "ParametricLaplace GLM predictive with an ASDL backend",
        UserWarning,
        "ASDL backend is used which does not support backprop through the functional "
        "variance, but `self.enable_backprop = True`. Falling back to using "
        "`self.backend.functorch_jacobians` which can be memory intensive for large models.",
        gone="no fallback: the GLM predictive takes no Jacobians from the backend",
    ),
    LaplaceTorchWarning(
        "AsdlInterface.kron (and AsdfghjklInterface.kron) of a model with BatchNorm",
        UserWarning,
        "BatchNorm unsupported for Kron, ignore.",
        gone="no parameter is silently left out: its Kron is refused by name, or is exact",
    ),
]


def _ids(row: LaplaceTorchWarning) -> str:
    return re.sub(r"\W+", "-", row.message[:40]).strip("-")


@pytest.mark.parametrize("row", [r for r in TABLE if r.gone is None], ids=_ids)
def test_laplace_torch_warning_is_emitted(row):
    with pytest.warns(row.category, match=re.escape(row.message)):
        row.trigger()


@pytest.mark.parametrize("row", [r for r in TABLE if r.gone is not None], ids=_ids)
def test_gone_warning_is_in_the_migration_notes(row):
    notes = " ".join(MIGRATION_NOTES.read_text().split())
    assert row.message in notes, f"docs/migration.md does not say why {row.call} is silent"


def test_gone_asdl_predictive_warning_is_not_emitted():
    pytest.importorskip("asdl")
    from laplace.curvature import AsdlGGN

    la, case = _fitted_diag("mlp_regression_1out", backend=AsdlGGN)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        la(case.X[:2])


def test_classification_warning_on_every_call():
    la, _ = _fitted_diag("mlp_classification")
    for _ in range(2):
        with pytest.warns(UserWarning, match="By default `link_approx` is `probit`"):
            la.optimize_prior_precision(method="marglik", n_steps=1)


def test_regression_tuning_without_val_loader_is_silent():
    la, _ = _fitted_diag("mlp_regression_1out")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        la.optimize_prior_precision(method="marglik", n_steps=1)
    assert torch.isfinite(la.prior_precision).all()
