"""Function-space (GP) Laplace approximations.

:class:`BaseFunctionalLaplace` owns the predictives; :class:`FunctionalLaplace` and
:class:`FunctionalLLLaplace` approximate the GP posterior on a subset of the data, :class:`ELLA`
with a Nyström feature map. The public paths are laplace-torch's: :mod:`laplace.baselaplace`,
:mod:`laplace.lllaplace` and :mod:`laplace`.
"""

from laplace.functional.base import BaseFunctionalLaplace
from laplace.functional.ella import ELLA
from laplace.functional.sod import FunctionalLaplace
from laplace.functional.sod_ll import FunctionalLLLaplace
from laplace.functional.valla import VaLLA

__all__ = ["ELLA", "BaseFunctionalLaplace", "FunctionalLLLaplace", "FunctionalLaplace", "VaLLA"]
