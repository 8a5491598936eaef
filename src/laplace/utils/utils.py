"""laplace-torch's ``laplace.utils.utils`` path: a façade, nothing in the package imports it.

Each name lives in the module that owns its concept; this module only re-exports them:

- :mod:`laplace.priors`: ``expand_prior_precision``, ``fix_prior_prec_structure``;
- :mod:`laplace.utils.layers`: ``parameters_per_layer``, ``_is_batchnorm``;
- :mod:`laplace.utils.linalg`: ``block_diag``, ``diagonal_add_scalar``, ``invsqrt_precision``,
  ``kron``, ``normal_samples``, ``symeig``;
- :mod:`laplace.utils.validation`: ``get_nll``, ``validate``;
- :mod:`laplace.data`: ``SoDSampler``; :mod:`laplace.errors`: ``_is_valid_scalar``.
"""

from laplace.data import SoDSampler
from laplace.errors import is_real_scalar as _is_valid_scalar
from laplace.priors import expand_prior_precision, fix_prior_prec_structure
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
