"""String enums for every option that users pass as plain strings.

``HessianStructure.FULL == "full"`` holds. Each enum parses its argument itself:
``PredType("glm")`` is ``PredType.GLM``, and an unknown value raises a ``ValueError`` naming the
argument and the accepted values (the enum's ``_missing_``), so a public method converts once at
its boundary with the enum's own constructor.
"""

from __future__ import annotations

from enum import Enum
from typing import Any

__all__ = [
    "FeatureReduction",
    "FunctionalApproximation",
    "HessianStructure",
    "Likelihood",
    "LinkApprox",
    "PredType",
    "PriorStructure",
    "SubsetOfWeights",
    "TuningMethod",
]


def _refuse_unknown(argument: str) -> classmethod:
    """The ``_missing_`` hook of the option enum that ``argument`` takes.

    ``Enum`` calls it for a value that is no member's; it raises instead of returning a member.

    Raises:
        ValueError: Naming ``argument`` and the accepted values.
    """

    def missing(cls: type[Enum], value: Any) -> Enum:
        accepted = ", ".join(repr(member.value) for member in cls)
        raise ValueError(f"{argument}={value!r} is not supported; accepted values: {accepted}.")

    return classmethod(missing)


class SubsetOfWeights(str, Enum):
    """Which parameters are treated probabilistically."""

    ALL = "all"
    LAST_LAYER = "last_layer"
    SUBNETWORK = "subnetwork"

    _missing_ = _refuse_unknown("subset_of_weights")


class HessianStructure(str, Enum):
    """Structure of the curvature (and so of the posterior precision)."""

    FULL = "full"
    KRON = "kron"
    DIAG = "diag"
    LOWRANK = "lowrank"
    GP = "gp"
    EKFAC = "ekfac"
    DIAG_LOWRANK = "diag_lowrank"
    MATFREE = "matfree"

    _missing_ = _refuse_unknown("hessian_structure")


class Likelihood(str, Enum):
    """Observation model of the data (the built-in ones, docs/likelihoods.md)."""

    REGRESSION = "regression"
    CLASSIFICATION = "classification"
    REWARD_MODELING = "reward_modeling"
    BINARY_CLASSIFICATION = "binary_classification"
    HETEROSCEDASTIC_REGRESSION = "heteroscedastic_regression"

    _missing_ = _refuse_unknown("likelihood")


class PredType(str, Enum):
    """Predictive: linearised (GLM), sampled network (NN), or function-space (GP)."""

    GLM = "glm"
    NN = "nn"
    GP = "gp"

    _missing_ = _refuse_unknown("pred_type")


class LinkApprox(str, Enum):
    """Approximation of the softmax link under a Gaussian over logits."""

    MC = "mc"
    PROBIT = "probit"
    BRIDGE = "bridge"
    BRIDGE_NORM = "bridge_norm"

    _missing_ = _refuse_unknown("link_approx")


class TuningMethod(str, Enum):
    """How ``optimize_prior_precision`` searches the prior precision."""

    MARGLIK = "marglik"
    GRIDSEARCH = "gridsearch"
    BAYESOPT = "bayesopt"

    _missing_ = _refuse_unknown("method")


class PriorStructure(str, Enum):
    """Shape of the prior precision: one value, one per parameter tensor, or one per weight."""

    SCALAR = "scalar"
    DIAG = "diag"
    LAYERWISE = "layerwise"

    _missing_ = _refuse_unknown("prior_structure")


class FunctionalApproximation(str, Enum):
    """Kernel approximation of function-space (GP) Laplace."""

    SOD = "sod"
    NYSTROM = "nystrom"
    VARIATIONAL = "variational"

    _missing_ = _refuse_unknown("functional_approximation")


class FeatureReduction(str, Enum):
    """How (B, ..., D) last-layer inputs are reduced to (B, D) features (transformer heads)."""

    PICK_FIRST = "pick_first"
    PICK_LAST = "pick_last"
    AVERAGE = "average"

    _missing_ = _refuse_unknown("feature_reduction")
