"""Function-space (GP) Laplace approximations (see ``docs/function_space.md``).

``BaseFunctionalLaplace`` turns the latent moments of the posterior a class holds into
predictions: ``FunctionalLaplace`` and ``FunctionalLLLaplace`` a GP on a subset of the
data, ``ELLA`` a Gaussian over Nyström features, ``VaLLA`` a variational posterior with
inducing points. The public paths are laplace-torch's: ``laplace.baselaplace``,
[`laplace.lllaplace`][laplace.lllaplace] and ``laplace``.
"""

from laplace.functional.base_functional import BaseFunctionalLaplace
from laplace.functional.ella import ELLA
from laplace.functional.sod import FunctionalLaplace
from laplace.functional.sod_ll import FunctionalLLLaplace
from laplace.functional.valla import VaLLA

__all__ = ["ELLA", "BaseFunctionalLaplace", "FunctionalLLLaplace", "FunctionalLaplace", "VaLLA"]
