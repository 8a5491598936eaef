"""Public Laplace classes over all weights, at laplace-torch's module path (a façade).

``BaseLaplace`` lives in ``laplace.core.base_laplace``, the parametric classes in
``laplace.parametric``; all of them report this module as theirs (``at_public_path``).
"""

from laplace.core.base_laplace import BaseLaplace
from laplace.functional import ELLA, BaseFunctionalLaplace, FunctionalLaplace, VaLLA
from laplace.parametric.diag_laplace import DiagLaplace
from laplace.parametric.full_laplace import FullLaplace
from laplace.parametric.kron_laplace import EKFACLaplace, KronLaplace
from laplace.parametric.lowrank_laplace import DiagLowRankLaplace, LowRankLaplace
from laplace.parametric.matfree_laplace import MatFreeLaplace
from laplace.parametric.parametric_laplace import ParametricLaplace
from laplace.utils.public import at_public_path

__all__ = [
    "ELLA",
    "BaseFunctionalLaplace",
    "BaseLaplace",
    "DiagLaplace",
    "DiagLowRankLaplace",
    "EKFACLaplace",
    "FullLaplace",
    "FunctionalLaplace",
    "KronLaplace",
    "LowRankLaplace",
    "MatFreeLaplace",
    "ParametricLaplace",
    "VaLLA",
]

at_public_path(
    __name__,
    ELLA,
    BaseFunctionalLaplace,
    BaseLaplace,
    DiagLaplace,
    DiagLowRankLaplace,
    EKFACLaplace,
    FullLaplace,
    FunctionalLaplace,
    KronLaplace,
    LowRankLaplace,
    MatFreeLaplace,
    ParametricLaplace,
    VaLLA,
)
