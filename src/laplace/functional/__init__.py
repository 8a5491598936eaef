"""Function-space (GP) Laplace approximations (see ``docs/function_space.md``).

:class:`BaseFunctionalLaplace` turns the latent moments of the posterior a class holds into
predictions: :class:`FunctionalLaplace` and :class:`FunctionalLLLaplace` a GP on a subset of the
data, :class:`ELLA` a Gaussian over Nyström features, :class:`VaLLA` a variational posterior with
inducing points. The public paths are laplace-torch's: :mod:`laplace.baselaplace`,
:mod:`laplace.lllaplace` and :mod:`laplace`.
"""

from laplace.functional.base import BaseFunctionalLaplace
from laplace.functional.ella import ELLA
from laplace.functional.sod import FunctionalLaplace
from laplace.functional.sod_ll import FunctionalLLLaplace
from laplace.functional.valla import VaLLA

__all__ = ["ELLA", "BaseFunctionalLaplace", "FunctionalLLLaplace", "FunctionalLaplace", "VaLLA"]
