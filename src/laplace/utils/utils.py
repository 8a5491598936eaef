"""laplace-torch's ``laplace.utils.utils`` path, a façade; docs/architecture.md lists its names."""

from laplace.core.priors import expand_prior_precision, fix_prior_prec_structure
from laplace.utils.data import SoDSampler
from laplace.utils.errors import is_real_scalar as _is_valid_scalar
from laplace.utils.layers import is_batchnorm as _is_batchnorm
from laplace.utils.layers import parameters_per_layer
from laplace.utils.linalg import (
    block_diag,
    diagonal_add_scalar,
    invsqrt_precision,
    kron,
    normal_samples,
    symeig,
)
from laplace.utils.public import at_public_path
from laplace.utils.validation import get_nll, validate

__all__ = [
    "SoDSampler",
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

at_public_path(__name__, SoDSampler)
