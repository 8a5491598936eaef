"""laplace-torch's ``laplace.utils`` path, a façade re-exporting each name from its owner.

As laplace-torch's, it loads ``laplace.utils.utils`` and ``laplace.utils.metrics``;
``RunningNLLMetric`` (a torchmetrics metric) is imported when it is first read.
"""

from typing import TYPE_CHECKING

from laplace.utils import functional_utils
from laplace.utils import metrics as metrics
from laplace.utils import utils as utils
from laplace.utils.enums import (
    FeatureReduction,
    FunctionalApproximation,
    HessianStructure,
    Likelihood,
    LinkApprox,
    PredType,
    PriorStructure,
    SubsetOfWeights,
    TuningMethod,
)
from laplace.utils.feature_extractor import FeatureExtractor
from laplace.utils.functional_utils import *  # noqa: F403 (the names of its __all__)
from laplace.utils.lazy import lazy_attributes
from laplace.utils.matrix import Kron, KronDecomposed
from laplace.utils.subnetmask import (
    LargestMagnitudeSubnetMask,
    LargestVarianceDiagLaplaceSubnetMask,
    LargestVarianceSWAGSubnetMask,
    LastLayerSubnetMask,
    ModuleNameSubnetMask,
    ParamNameSubnetMask,
    RandomSubnetMask,
    SubnetMask,
)
from laplace.utils.swag import fit_diagonal_swag_var
from laplace.utils.utils import *  # noqa: F403 (the names of its __all__)

if TYPE_CHECKING:
    from laplace.utils.running_nll import RunningNLLMetric

__all__ = [
    *functional_utils.__all__,
    *utils.__all__,
    "FeatureExtractor",
    "FeatureReduction",
    "FunctionalApproximation",
    "HessianStructure",
    "Kron",
    "KronDecomposed",
    "LargestMagnitudeSubnetMask",
    "LargestVarianceDiagLaplaceSubnetMask",
    "LargestVarianceSWAGSubnetMask",
    "LastLayerSubnetMask",
    "Likelihood",
    "LinkApprox",
    "ModuleNameSubnetMask",
    "ParamNameSubnetMask",
    "PredType",
    "PriorStructure",
    "RandomSubnetMask",
    "RunningNLLMetric",
    "SubnetMask",
    "SubsetOfWeights",
    "TuningMethod",
    "fit_diagonal_swag_var",
]

__getattr__ = lazy_attributes(__name__, {"RunningNLLMetric": "laplace.utils.running_nll"})
