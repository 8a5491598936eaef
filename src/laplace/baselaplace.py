"""Public Laplace classes over all weights, at laplace-torch's module path.

The classes are a façade over composable pieces: a likelihood object (:mod:`laplace.likelihoods`),
a parameter subset (:mod:`laplace.subsets`), a posterior structure (:mod:`laplace.posteriors`), a
curvature backend (:mod:`laplace.curvature`), predictive links (:mod:`laplace.predictive`) and
tuning (:mod:`laplace.tuning`). ``BaseLaplace`` lives in :mod:`laplace.base`, the parametric
classes in :mod:`laplace.parametric` and :mod:`laplace.kronlaplace`.
"""

from laplace.base import BaseLaplace
from laplace.functional import ELLA, BaseFunctionalLaplace, FunctionalLaplace, VaLLA
from laplace.kronlaplace import KronLaplace
from laplace.lowranklaplace import LowRankLaplace
from laplace.parametric import DiagLaplace, FullLaplace, ParametricLaplace

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
