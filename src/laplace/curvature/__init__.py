"""Curvature backends: Jacobians, per-sample gradients, and GGN / EF / Hessian curvature.

``CURVATURE_BACKENDS`` maps short names to backend classes; ``DEFAULT_BACKEND`` is the exact
GGN. The ASDL and BackPACK backends are optional extras, imported on first use.
"""

from __future__ import annotations

from laplace.curvature import asdl as asdl
from laplace.curvature import backpack as backpack
from laplace.curvature.asdfghjkl import (
    AsdfghjklEF,
    AsdfghjklGGN,
    AsdfghjklHessian,
    AsdfghjklInterface,
)
from laplace.curvature.curvature import CurvatureInterface, EFInterface, GGNInterface
from laplace.curvature.curvlinops import (
    CurvlinopsEF,
    CurvlinopsGGN,
    CurvlinopsHessian,
    CurvlinopsInterface,
)
from laplace.curvature.registry import (
    OPTIONAL_BACKENDS,
    BackendRegistry,
    available_optional,
    load_optional,
)

__all__ = [
    "CURVATURE_BACKENDS",
    "DEFAULT_BACKEND",
    "AsdfghjklEF",
    "AsdfghjklGGN",
    "AsdfghjklHessian",
    "AsdfghjklInterface",
    "CurvatureInterface",
    "CurvlinopsEF",
    "CurvlinopsGGN",
    "CurvlinopsHessian",
    "CurvlinopsInterface",
    "EFInterface",
    "GGNInterface",
    # the optional backends whose library is installed (so that `import *` never fails)
    *available_optional(),
]

#: Backend classes by name; the optional ones are imported when looked up.
CURVATURE_BACKENDS: BackendRegistry = BackendRegistry(
    {
        "curvlinops_ggn": CurvlinopsGGN,
        "curvlinops_ef": CurvlinopsEF,
        "curvlinops_hessian": CurvlinopsHessian,
        "asdl_ggn": "AsdlGGN",
        "asdl_ef": "AsdlEF",
        "asdl_hessian": "AsdlHessian",
        "backpack_ggn": "BackPackGGN",
        "backpack_ef": "BackPackEF",
    }
)

#: The backend used when none is given.
DEFAULT_BACKEND: type[CurvatureInterface] = CurvlinopsGGN


def __getattr__(name: str) -> type[CurvatureInterface]:
    if name in OPTIONAL_BACKENDS:
        return load_optional(name)
    raise AttributeError(f"module 'laplace.curvature' has no attribute {name!r}")
