"""Public Laplace classes over all weights, at laplace-torch's module path.

The classes are a façade over composable pieces: a likelihood object (``laplace.likelihoods``),
a parameter subset (``laplace.core.subsets``), a posterior structure
(``laplace.posteriors``), a curvature backend (``laplace.curvature``), predictive links
(``laplace.utils.predictive``) and tuning (``laplace.core.tuning``). ``BaseLaplace`` lives in
``laplace.core.base``, the parametric classes in ``laplace.parametric.base`` and
``laplace.parametric.kron``; all of them report this module as theirs (``at_public_path``).
"""

from laplace.core.base import BaseLaplace
from laplace.functional import ELLA, BaseFunctionalLaplace, FunctionalLaplace, VaLLA
from laplace.parametric.base import DiagLaplace, FullLaplace, ParametricLaplace
from laplace.parametric.kron import EKFACLaplace, KronLaplace
from laplace.parametric.lowrank import DiagLowRankLaplace, LowRankLaplace
from laplace.parametric.matfree import MatFreeLaplace
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
