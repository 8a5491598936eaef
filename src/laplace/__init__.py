"""laplace-ng: Laplace approximations for deep learning, a drop-in for laplace-torch 0.3.

A façade: it re-exports each name from the module that owns it, and nothing in the package
imports ``laplace`` itself. As laplace-torch's, ``import laplace`` loads ``laplace.baselaplace``,
``laplace.utils.utils``, ``laplace.curvature.asdl`` and ``laplace.curvature.backpack``.
"""

from importlib.metadata import PackageNotFoundError, version

from laplace import baselaplace as baselaplace
from laplace import utils as utils
from laplace.core.base_laplace import BaseLaplace
from laplace.core.passes.data_loop import set_progress_bars
from laplace.functional import (
    ELLA,
    BaseFunctionalLaplace,
    FunctionalLaplace,
    FunctionalLLLaplace,
    VaLLA,
)
from laplace.laplace import Laplace
from laplace.lllaplace import (
    DiagLLLaplace,
    EKFACLLLaplace,
    FullLLLaplace,
    KronLLLaplace,
    LLLaplace,
)
from laplace.marglik_training import marglik_training
from laplace.parametric.diag_laplace import DiagLaplace
from laplace.parametric.full_laplace import FullLaplace
from laplace.parametric.kron_laplace import EKFACLaplace, KronLaplace
from laplace.parametric.lowrank_laplace import DiagLowRankLaplace, LowRankLaplace
from laplace.parametric.matfree_laplace import MatFreeLaplace
from laplace.parametric.parametric_laplace import ParametricLaplace
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
    "DiagLowRankLaplace",
    "DiagSubnetLaplace",
    "EKFACLLLaplace",
    "EKFACLaplace",
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
    "MatFreeLaplace",
    "ParametricLaplace",
    "PredType",
    "PriorStructure",
    "SubnetLaplace",
    "SubsetOfWeights",
    "TuningMethod",
    "VaLLA",
    "marglik_training",
    "set_progress_bars",
]

try:
    __version__ = version("laplace-ng")
except PackageNotFoundError:  # imported from a source tree that was never installed
    __version__ = "0+unknown"
