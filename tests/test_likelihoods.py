"""Likelihood objects: output-Hessian factors against the closed-form Hessians."""

from __future__ import annotations

import pytest
import torch
from tests.conftest import assert_close

from laplace.likelihoods import make_likelihood


@pytest.mark.parametrize("n_classes", [1, 2, 5])
@pytest.mark.parametrize("spread", [1.0, 30.0], ids=["moderate", "confident"])
def test_softmax_hessian_factor_has_rank_c_minus_one(n_classes, spread):
    gen = torch.Generator().manual_seed(0)
    f = spread * torch.randn(6, 3, n_classes, generator=gen, dtype=torch.float64)
    likelihood = make_likelihood("classification")
    L = likelihood.output_hessian_sqrt(f)
    assert L.shape == (6, 3, n_classes, max(1, n_classes - 1))
    p = torch.softmax(f, -1)
    expected = torch.diag_embed(p) - p.unsqueeze(-1) * p.unsqueeze(-2)
    assert_close(L @ L.transpose(-1, -2), expected, rtol=1e-10, atol=1e-15)


def test_gaussian_hessian_factor_is_the_identity():
    f = torch.randn(4, 3, dtype=torch.float64)
    L = make_likelihood("regression").output_hessian_sqrt(f)
    assert_close(L, torch.eye(3, dtype=torch.float64).expand(4, -1, -1))
