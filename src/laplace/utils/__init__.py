"""Utilities: option enums, linear-algebra and prior helpers, validation and metrics."""

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
from laplace.utils.matrix import Kron, KronDecomposed
from laplace.utils.metrics import RunningNLLMetric
from laplace.utils.utils import (
    SoDSampler,
    _is_batchnorm,
    _is_valid_scalar,
    block_diag,
    diagonal_add_scalar,
    expand_prior_precision,
    fix_prior_prec_structure,
    get_nll,
    invsqrt_precision,
    kron,
    normal_samples,
    parameters_per_layer,
    symeig,
    validate,
)

__all__ = [
    "FeatureExtractor",
    "FeatureReduction",
    "FunctionalApproximation",
    "HessianStructure",
    "Kron",
    "KronDecomposed",
    "Likelihood",
    "LinkApprox",
    "PredType",
    "PriorStructure",
    "RunningNLLMetric",
    "SoDSampler",
    "SubsetOfWeights",
    "TuningMethod",
    "_is_batchnorm",
    "_is_valid_scalar",
    "block_diag",
    "diagonal_add_scalar",
    "expand_prior_precision",
    "fix_prior_prec_structure",
    "get_nll",
    "invsqrt_precision",
    "kron",
    "normal_samples",
    "parameters_per_layer",
    "symeig",
    "validate",
]
