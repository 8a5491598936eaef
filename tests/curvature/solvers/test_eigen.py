"""The eigensolvers: block Krylov and the Nyström finish, against dense float64 eigh."""

from __future__ import annotations

import pytest
import torch

from conftest import CASE_BUILDERS, Oracle, assert_close
from laplace.curvature import CurvlinopsGGN
from laplace.curvature.solvers.eigen import _nystrom, top_eigenpairs
from laplace.curvature.solvers.kfac_start import KfacStart
from laplace.curvature.solvers.products import curvature_product

CASES = ["mlp_regression_3out", "mlp_classification", "cnn_classification"]


#: Ritz values from a converged Krylov basis against ``eigh`` (float64).
EIGEN_RTOL = 1e-8


def _dense_top(H: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    values, vectors = torch.linalg.eigh(H)
    return values.flip(0)[:k], vectors.flip(1)[:, :k]


@pytest.mark.parametrize("case_name", CASES)
def test_block_krylov_converges_to_the_dense_top_k(case_name):
    case = CASE_BUILDERS[case_name]()
    oracle = Oracle(case.model, case.likelihood)
    product = curvature_product(CurvlinopsGGN(case.model, case.likelihood), case.loader(), 20)
    k, oversampling = 4, 4
    passes = (product.n_params - 1) // (k + oversampling)  # the basis never spans everything
    U, values, errors = top_eigenpairs(product, k, max_iter=passes, oversampling=oversampling)
    expected, vectors = _dense_top(oracle.ggn(case.X), k)
    assert_close(values, expected, rtol=EIGEN_RTOL, atol=0)
    assert_close((U.T @ vectors).abs(), torch.eye(k, dtype=torch.float64), rtol=0, atol=1e-6)
    assert bool((errors <= 1e-6).all())


@pytest.mark.parametrize("passes", [1, 2])
def test_block_krylov_error_bounds_hold_before_convergence(passes):
    """Each reported λᵢ lies within errorsᵢ·λᵢ of an exact eigenvalue; Ritz values lie below."""
    case = CASE_BUILDERS["cnn_classification"]()
    oracle = Oracle(case.model, case.likelihood)
    product = curvature_product(CurvlinopsGGN(case.model, case.likelihood), case.loader(), 12)
    k = 6
    U, values, errors = top_eigenpairs(product, k, max_iter=passes, oversampling=2)
    exact = torch.linalg.eigvalsh(oracle.ggn(case.X))
    distance = (values[:, None] - exact[None, :]).abs().min(1).values
    assert bool((distance <= errors * values * (1 + 1e-9) + 1e-12).all())
    assert bool((values <= exact.flip(0)[:k] * (1 + 1e-12)).all())
    residual = (oracle.ggn(case.X) @ U - U * values).norm(dim=0) / values
    assert_close(errors, residual, rtol=1e-6, atol=1e-12)


def _dense_nystrom(Q: torch.Tensor, H: torch.Tensor) -> torch.Tensor:
    Y = H @ Q
    return Y @ torch.linalg.solve(Q.T @ Y, Y.T)


def test_nystrom_finish_is_the_eigendecomposition_of_the_nystrom_approximation():
    gen = torch.Generator().manual_seed(0)
    X = torch.randn(30, 12, generator=gen, dtype=torch.float64)
    H = X.T @ X
    Q = torch.linalg.qr(torch.randn(12, 5, generator=gen, dtype=torch.float64)).Q
    ritz = torch.linalg.eigvalsh(Q.T @ H @ Q).flip(0)
    pairs = _nystrom(KfacStart(Q, H @ Q, ritz), 4)
    approximation = _dense_nystrom(Q, H)
    expected = torch.linalg.eigvalsh(approximation).flip(0)[:4]
    assert_close(pairs.values, expected, rtol=1e-10, atol=1e-12)
    assert_close(approximation @ pairs.vectors, pairs.vectors * pairs.values, atol=1e-9)
    assert_close(pairs.vectors.T @ pairs.vectors, torch.eye(4, dtype=torch.float64))
    exact = torch.linalg.eigvalsh(H).flip(0)[:4]
    assert bool((pairs.values <= exact * (1 + 1e-12)).all())  # lower bounds
    assert bool((pairs.values >= ritz[:4] * (1 - 1e-12)).all())  # better than Rayleigh–Ritz
    assert_close(pairs.errors, (pairs.values - ritz[:4]) / pairs.values)
