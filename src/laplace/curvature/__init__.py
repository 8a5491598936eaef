"""Curvature backends: Jacobians, per-sample gradients, and GGN / EF / Hessian curvature.

:data:`CURVATURE_BACKENDS` maps short names to backend classes so callers never test class
names; :data:`DEFAULT_BACKEND` is the exact GGN.
"""

from laplace.curvature.curvature import CurvatureInterface, EFInterface, GGNInterface
from laplace.curvature.curvlinops import (
    CurvlinopsEF,
    CurvlinopsGGN,
    CurvlinopsHessian,
    CurvlinopsInterface,
)

__all__ = [
    "CURVATURE_BACKENDS",
    "DEFAULT_BACKEND",
    "CurvatureInterface",
    "CurvlinopsEF",
    "CurvlinopsGGN",
    "CurvlinopsHessian",
    "CurvlinopsInterface",
    "EFInterface",
    "GGNInterface",
]

#: Backend classes by name.
CURVATURE_BACKENDS: dict[str, type[CurvatureInterface]] = {
    "curvlinops_ggn": CurvlinopsGGN,
    "curvlinops_ef": CurvlinopsEF,
    "curvlinops_hessian": CurvlinopsHessian,
}

#: The backend used when none is given.
DEFAULT_BACKEND: type[CurvatureInterface] = CurvlinopsGGN
