"""String enums for every option that users pass as plain strings.

Each enum derives from ``str`` so ``HessianStructure.FULL == "full"`` holds and plain strings
work at the public boundary; :func:`parse_enum` validates once with a message that lists the
accepted values.
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


class Likelihood(str, Enum):
    """Observation model of the data (the built-in ones; see :mod:`laplace.likelihoods`).

    ``BINARY_CLASSIFICATION`` (independent Bernoulli labels, multi-label for several outputs)
    and ``HETEROSCEDASTIC_REGRESSION`` (the network predicts its mean and log-variance) are
    laplace-ng additions; laplace-torch's three members keep their values.
    """

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
    """Convert a user value to a member of ``enum_cls`` or fail naming the accepted values.

    Args:
        enum_cls: The enum to parse into.
        value: A member of ``enum_cls`` or its string value.
        argument: Name of the user-facing argument, used in the error message.

    Returns:
        The enum member.

    Raises:
        ValueError: If ``value`` is not one of the enum's values.
    """
    try:
        return enum_cls(value)
    except ValueError:
        accepted = ", ".join(repr(m.value) for m in enum_cls)
        raise ValueError(
            f"{argument}={value!r} is not supported; accepted values: {accepted}."
        ) from None
