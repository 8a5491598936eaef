"""laplace-torch's backends for the unpublished ``asdfghjkl`` fork, kept as names only.

The classes import, subclass and ``isinstance``-check like laplace-torch's; creating one raises
an ``ImportError`` naming the replacement.
"""

from __future__ import annotations

import torch
from torch import nn

from laplace.curvature.curvature import CurvatureInterface, EFInterface, GGNInterface
from laplace.utils.enums import Likelihood

__all__ = ["AsdfghjklEF", "AsdfghjklGGN", "AsdfghjklHessian", "AsdfghjklInterface"]

#: What to use instead of each class.
_REPLACEMENTS = {
    "AsdfghjklInterface": "AsdlInterface",
    "AsdfghjklGGN": "AsdlGGN or CurvlinopsGGN",
    "AsdfghjklEF": "AsdlEF or CurvlinopsEF",
    "AsdfghjklHessian": "AsdlHessian or CurvlinopsHessian",
}


def _refuse(name: str) -> None:
    raise ImportError(
        f"{name} is laplace-torch's backend for the unpublished 'asdfghjkl' fork, which "
        f"laplace-ng does not use. Use backend={_REPLACEMENTS[name]} from laplace.curvature "
        "(the Asdl* classes need pip install 'laplace-ng[asdl]'); for a low-rank posterior use "
        "hessian_structure='lowrank', whose eigensolvers work with every backend."
    )


class AsdfghjklInterface(CurvatureInterface):
    """laplace-torch's base of the ``asdfghjkl`` backends; creating one raises ``ImportError``.

    Raises:
        ImportError: Always, naming the backend to use instead.
    """

    def __init__(
        self,
        model: nn.Module,
        likelihood: Likelihood | str,
        last_layer: bool = False,
        subnetwork_indices: torch.LongTensor | None = None,
        dict_key_x: str = "input_ids",
        dict_key_y: str = "labels",
    ) -> None:
        _refuse("AsdfghjklInterface")


class AsdfghjklGGN(AsdfghjklInterface, GGNInterface):
    """laplace-torch's ``asdfghjkl`` GGN; creating one raises ``ImportError``.

    Raises:
        ImportError: Always, naming the backend to use instead.
    """

    def __init__(
        self,
        model: nn.Module,
        likelihood: Likelihood | str,
        last_layer: bool = False,
        subnetwork_indices: torch.LongTensor | None = None,
        dict_key_x: str = "input_ids",
        dict_key_y: str = "labels",
        stochastic: bool = False,
    ) -> None:
        _refuse("AsdfghjklGGN")


class AsdfghjklEF(AsdfghjklInterface, EFInterface):
    """laplace-torch's ``asdfghjkl`` empirical Fisher; creating one raises ``ImportError``.

    Raises:
        ImportError: Always, naming the backend to use instead.
    """

    def __init__(
        self,
        model: nn.Module,
        likelihood: Likelihood | str,
        last_layer: bool = False,
        dict_key_x: str = "input_ids",
        dict_key_y: str = "labels",
    ) -> None:
        _refuse("AsdfghjklEF")


class AsdfghjklHessian(AsdfghjklInterface):
    """laplace-torch's ``asdfghjkl`` Hessian (its ``LowRankLaplace`` default).

    Raises:
        ImportError: Always, naming the backend to use instead.
    """

    def __init__(
        self,
        model: nn.Module,
        likelihood: Likelihood | str,
        last_layer: bool = False,
        dict_key_x: str = "input_ids",
        dict_key_y: str = "labels",
        low_rank: int = 10,
    ) -> None:
        _refuse("AsdfghjklHessian")
