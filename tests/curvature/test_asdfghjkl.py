"""laplace-torch's ``laplace.curvature.asdfghjkl`` path: it imports and names what to use."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from laplace import LowRankLaplace


def test_asdfghjkl_module_imports_and_names_what_to_use():
    from laplace.curvature import CurvatureInterface, EFInterface, GGNInterface
    from laplace.curvature.asdfghjkl import (
        AsdfghjklEF,
        AsdfghjklGGN,
        AsdfghjklHessian,
        AsdfghjklInterface,
    )

    assert issubclass(AsdfghjklGGN, GGNInterface) and issubclass(AsdfghjklEF, EFInterface)
    assert issubclass(AsdfghjklHessian, AsdfghjklInterface)
    assert issubclass(AsdfghjklInterface, CurvatureInterface)
    model = nn.Linear(3, 2)
    for cls, replacement in [
        (AsdfghjklHessian, "AsdlHessian or CurvlinopsHessian"),
        (AsdfghjklGGN, "AsdlGGN or CurvlinopsGGN"),
        (AsdfghjklEF, "AsdlEF or CurvlinopsEF"),
    ]:
        with pytest.raises(ImportError, match=f"backend={replacement}.*lowrank"):
            cls(model, "classification")
    la = LowRankLaplace(model, "classification", backend=AsdfghjklHessian)
    loader = DataLoader(TensorDataset(torch.randn(4, 3), torch.tensor([0, 1, 0, 1])), batch_size=2)
    with pytest.raises(ImportError, match="AsdfghjklHessian"):
        la.fit(loader)
