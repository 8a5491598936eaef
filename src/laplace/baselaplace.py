"""Public Laplace classes over all weights, at laplace-torch's module path.

The classes are a façade over composable pieces: a likelihood object (:mod:`laplace.likelihoods`),
a parameter subset (:mod:`laplace.core.subsets`), a posterior structure
(:mod:`laplace.posteriors`), a curvature backend (:mod:`laplace.curvature`), predictive links
(:mod:`laplace.utils.predictive`) and tuning (:mod:`laplace.core.tuning`). ``BaseLaplace`` lives in
:mod:`laplace.core.base`, the parametric classes in :mod:`laplace.parametric.base` and
:mod:`laplace.parametric.kron`.
"""

from laplace.core.base import BaseLaplace
from laplace.functional import ELLA, BaseFunctionalLaplace, FunctionalLaplace, VaLLA
from laplace.parametric.base import DiagLaplace, FullLaplace, ParametricLaplace
from laplace.parametric.kron import KronLaplace
from laplace.parametric.lowrank import LowRankLaplace

__all__ = [
    "ELLA",
    "BaseFunctionalLaplace",
    "BaseLaplace",
    "DiagLaplace",
    "FullLaplace",
    "FunctionalLaplace",
    "KronLaplace",
    "LowRankLaplace",
    "ParametricLaplace",
    "VaLLA",
]
