"""laplace-ng: Laplace approximations for deep learning, a drop-in for laplace-torch 0.3.

``from laplace import Laplace`` gives the factory; the classes live in the same modules as in
laplace-torch (``laplace.baselaplace``, ``laplace.curvature``, ``laplace.utils``).
"""

from laplace.baselaplace import (
    BaseLaplace,
    DiagLaplace,
    FullLaplace,
    KronLaplace,
    ParametricLaplace,
)
from laplace.laplace import Laplace
from laplace.lllaplace import DiagLLLaplace, FullLLLaplace, KronLLLaplace, LLLaplace
from laplace.utils.enums import (
    FunctionalApproximation,
    HessianStructure,
    Likelihood,
    LinkApprox,
    PredType,
    PriorStructure,
    SubsetOfWeights,
    TuningMethod,
)

__all__ = [
    "BaseLaplace",
    "DiagLLLaplace",
    "DiagLaplace",
    "FullLLLaplace",
    "FullLaplace",
    "FunctionalApproximation",
    "HessianStructure",
    "KronLLLaplace",
    "KronLaplace",
    "LLLaplace",
    "Laplace",
    "Likelihood",
    "LinkApprox",
    "ParametricLaplace",
    "PredType",
    "PriorStructure",
    "SubsetOfWeights",
    "TuningMethod",
]
