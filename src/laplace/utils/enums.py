"""String enums for every option that users pass as plain strings.

``HessianStructure.FULL == "full"`` holds; ``parse_enum`` validates once at the public boundary.
"""

from __future__ import annotations

from enum import Enum
from typing import TypeVar

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
    "parse_enum",
]


class SubsetOfWeights(str, Enum):
    """Which parameters are treated probabilistically."""

    ALL = "all"
    LAST_LAYER = "last_layer"
    SUBNETWORK = "subnetwork"


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


class Likelihood(str, Enum):
    """Observation model of the data (the built-in ones, docs/likelihoods.md)."""

    REGRESSION = "regression"
    CLASSIFICATION = "classification"
    REWARD_MODELING = "reward_modeling"
    BINARY_CLASSIFICATION = "binary_classification"
    HETEROSCEDASTIC_REGRESSION = "heteroscedastic_regression"


class PredType(str, Enum):
    """Predictive: linearised (GLM), sampled network (NN), or function-space (GP)."""

    GLM = "glm"
    NN = "nn"
    GP = "gp"


class LinkApprox(str, Enum):
    """Approximation of the softmax link under a Gaussian over logits."""

    MC = "mc"
    PROBIT = "probit"
    BRIDGE = "bridge"
    BRIDGE_NORM = "bridge_norm"


class TuningMethod(str, Enum):
    """How ``optimize_prior_precision`` searches the prior precision."""

    MARGLIK = "marglik"
    GRIDSEARCH = "gridsearch"
    BAYESOPT = "bayesopt"


class PriorStructure(str, Enum):
    """Shape of the prior precision: one value, one per parameter tensor, or one per weight."""

    SCALAR = "scalar"
    DIAG = "diag"
    LAYERWISE = "layerwise"


class FunctionalApproximation(str, Enum):
    """Kernel approximation of function-space (GP) Laplace."""

    SOD = "sod"
    NYSTROM = "nystrom"
    VARIATIONAL = "variational"


class FeatureReduction(str, Enum):
    """How (B, ..., D) last-layer inputs are reduced to (B, D) features (transformer heads)."""

    PICK_FIRST = "pick_first"
    PICK_LAST = "pick_last"
    AVERAGE = "average"


E = TypeVar("E", bound=Enum)


def parse_enum(enum_cls: type[E], value: E | str, argument: str) -> E:
    """The member of ``enum_cls`` for ``value`` (a member or its string).

    Raises:
        ValueError: Naming ``argument`` and the accepted values, for any other value.
    """
    try:
        return enum_cls(value)
    except ValueError:
        accepted = ", ".join(repr(m.value) for m in enum_cls)
        raise ValueError(
            f"{argument}={value!r} is not supported; accepted values: {accepted}."
        ) from None
