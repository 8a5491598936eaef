"""The BackPACK backends: a fit emits no full-backward-hook warning."""

from __future__ import annotations

import pytest
from torch.utils.data import DataLoader, TensorDataset

from conftest import CASE_BUILDERS
from laplace import Laplace
from laplace.curvature import BackPackEF, BackPackGGN


@pytest.mark.parametrize("backend", [BackPackGGN, BackPackEF], ids=lambda cls: cls.__name__)
@pytest.mark.parametrize("structure", ["diag", "full"])
def test_backpack_fit_emits_no_backward_hook_warning(backend, structure, recwarn):
    case = CASE_BUILDERS["mlp_classification"]()
    loader = DataLoader(TensorDataset(case.X, case.y), batch_size=8)
    la = Laplace(case.model, "classification", hessian_structure=structure, backend=backend)
    la.fit(loader)
    la(case.X[:4])
    hooks = [w for w in recwarn if "Full backward hook" in str(w.message)]
    assert not hooks, [str(w.message) for w in hooks]
