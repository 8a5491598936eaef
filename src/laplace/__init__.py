"""laplace-ng: Laplace approximations for deep learning, a drop-in for laplace-torch 0.3.

``from laplace import Laplace`` gives the factory; the classes live in the same modules as in
laplace-torch (``laplace.baselaplace``, ``laplace.curvature``, ``laplace.utils``).
"""

from laplace.baselaplace import (
    ELLA,
    BaseFunctionalLaplace,
    BaseLaplace,
    DiagLaplace,
    FullLaplace,
    FunctionalLaplace,
    KronLaplace,
    LowRankLaplace,
    ParametricLaplace,
    VaLLA,
)
from laplace.laplace import Laplace
from laplace.lllaplace import (
    DiagLLLaplace,
    FullLLLaplace,
    FunctionalLLLaplace,
    KronLLLaplace,
    LLLaplace,
)
from laplace.marglik_training import marglik_training
from laplace.subnetlaplace import DiagSubnetLaplace, FullSubnetLaplace, SubnetLaplace
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
    "ELLA",
    "BaseFunctionalLaplace",
    "BaseLaplace",
    "DiagLLLaplace",
    "DiagLaplace",
    "DiagSubnetLaplace",
    "FullLLLaplace",
    "FullLaplace",
    "FullSubnetLaplace",
    "FunctionalApproximation",
    "FunctionalLLLaplace",
    "FunctionalLaplace",
    "HessianStructure",
    "KronLLLaplace",
    "KronLaplace",
    "LLLaplace",
    "Laplace",
    "Likelihood",
    "LinkApprox",
    "LowRankLaplace",
    "ParametricLaplace",
    "PredType",
    "PriorStructure",
    "SubnetLaplace",
    "SubsetOfWeights",
    "TuningMethod",
    "VaLLA",
    "marglik_training",
]
