"""The ASDL backends: a LoRA model fits over all its (adapter) weights."""

from __future__ import annotations

from backend_cases import lora_case
from torch.utils.data import DataLoader, TensorDataset

from conftest import Oracle, assert_close
from laplace import Laplace
from laplace.curvature import AsdlGGN


def test_lora_fits_with_asdl_over_all_weights():
    model, X, y = lora_case()
    loader = DataLoader(TensorDataset(X, y), batch_size=5)
    oracle = Oracle(model, "classification")
    for structure in ("diag", "full"):
        la = Laplace(
            model,
            "classification",
            subset_of_weights="all",
            hessian_structure=structure,
            backend=AsdlGGN,
        )
        la.fit(loader)
        assert la.n_params == 2 * (3 * 2 + 2 * 6) + 0  # adapters only: A (r×in), B (out×r)
        H = oracle.ggn(X)
        assert_close(la.H, H if structure == "full" else H.diagonal())
