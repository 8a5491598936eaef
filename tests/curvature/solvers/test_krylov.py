"""The Krylov solvers of the matrix-free posterior against dense float64 linear algebra.

``conjugate_gradients`` is compared with ``torch.linalg.solve`` on random symmetric positive
definite matrices (with and without a preconditioner, with zero right-hand sides, and with
columns that converge at different iterations: its report must count exactly the products of
the columns still active); ``block_conjugate_gradients`` the same way, and on a low-rank
curvature plus a prior (a posterior precision) against each column solved alone.
``lanczos_quadrature`` is compared with ``zᵀ f(A) z`` from an
eigendecomposition: exact once the steps span the Krylov space (reorthogonalised), exact for
``tr f(A)`` with the orthogonal probes of ``rademacher_probes`` when they number P, and accurate
for a smooth ``f`` without reorthogonalisation.
"""

from __future__ import annotations

import pytest
import torch

from conftest import assert_close
from laplace.curvature.solvers.krylov import (
    LanczosQuadrature,
    block_conjugate_gradients,
    conjugate_gradients,
    lanczos_quadrature,
    rademacher_probes,
)

P = 30
#: Relative residual asked of conjugate gradients in the comparisons with a direct solve.
CG_TOL = 1e-12
#: Relative error of a solution at ``CG_TOL`` (the condition number is about 100).
RTOL_SOLVE = 1e-9
#: Relative error of an exact (reorthogonalised, full-length) Lanczos quadrature.
RTOL_QUADRATURE = 1e-10
#: True relative residual of a solve at ``CG_TOL``: its recursive residual drifts from the
#: true one by rounding (the scaled systems have condition numbers up to 1e6).
ROUNDING_RESIDUAL = 10 * CG_TOL
#: Lanczos steps without reorthogonalisation, and the relative error of their quadrature of
#: ``log`` (spectrum in [1, 100]: Gauss quadrature of an analytic function converges
#: geometrically, about 1e-13 after 60 steps; the Ritz values have converged and orthogonality
#: is lost by then).
PLAIN_STEPS, RTOL_QUADRATURE_PLAIN = 60, 1e-10


def spd(n: int = P, seed: int = 0, condition: float = 100.0) -> torch.Tensor:
    """A random symmetric positive definite matrix with eigenvalues in [1, ``condition``].

    Args:
        n: Its size.
        seed: Seed of its eigenvectors and eigenvalues.
        condition: Its largest eigenvalue (the smallest is 1).

    Returns:
        Shape (n, n), float64.
    """
    generator = torch.Generator().manual_seed(seed)
    Q, _ = torch.linalg.qr(torch.randn(n, n, generator=generator, dtype=torch.float64))
    values = torch.logspace(0, torch.log10(torch.tensor(condition)), n, dtype=torch.float64)
    values = values[torch.randperm(n, generator=generator)]
    return Q @ torch.diag(values) @ Q.T


def counting(A: torch.Tensor) -> tuple[list[int], callable]:
    """A block product with ``A`` that records the number of columns of every call and writes
    its result into the memory the solver offers.

    Args:
        A: The matrix (P, P).

    Returns:
        The list of column counts (filled as the product is called) and the product.
    """
    calls: list[int] = []

    def matmat(V: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
        calls.append(V.shape[1])
        return torch.matmul(A, V, out=out)  # in the memory offered: it must be free

    return calls, matmat


def matrix_function(A: torch.Tensor, f) -> torch.Tensor:
    """``f(A)`` of a symmetric matrix by its eigendecomposition."""
    values, vectors = torch.linalg.eigh(A)
    return vectors @ torch.diag(f(values)) @ vectors.T


# ------------------------------------------------------------------------ conjugate gradients
def badly_scaled_system(preconditioned: bool):
    """An SPD system with a badly scaled diagonal, 4 right-hand sides, and the Jacobi
    preconditioner that undoes the scaling (None unless ``preconditioned``)."""
    scale = torch.logspace(0, 2, P, dtype=torch.float64)
    A = scale[:, None] * spd() * scale[None, :]
    B = torch.randn(P, 4, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    diagonal = A.diagonal()
    precondition = (lambda R: R / diagonal[:, None]) if preconditioned else None
    return A, B, precondition


@pytest.mark.parametrize("preconditioned", [False, True])
def test_cg_solves_a_random_spd_system(preconditioned):
    A, B, precondition = badly_scaled_system(preconditioned)
    calls, matmat = counting(A)
    X, report = conjugate_gradients(matmat, B, CG_TOL, 10 * P, precondition)
    assert_close(X, torch.linalg.solve(A, B), rtol=RTOL_SOLVE, atol=0)
    residuals = (A @ X - B).norm(dim=0) / B.norm(dim=0)
    assert report.converged
    assert (report.relative_residuals <= CG_TOL).all()
    # the recursive residuals it reports are the true ones up to rounding
    assert (residuals <= ROUNDING_RESIDUAL).all()
    assert report.products == sum(calls)
    assert report.iterations == len(calls)
    assert report.tol == CG_TOL
    assert "iterations" in str(report) and "products" in str(report)


def test_preconditioner_saves_iterations_on_a_badly_scaled_system():
    A = spd(condition=10.0)
    scale = torch.logspace(0, 3, P, dtype=torch.float64)
    A = scale[:, None] * A * scale[None, :]
    B = torch.randn(P, 2, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    diagonal = A.diagonal()
    _, plain = conjugate_gradients(lambda V, out: A @ V, B, 1e-8, 20 * P)
    _, jacobi = conjugate_gradients(
        lambda V, out: A @ V, B, 1e-8, 20 * P, lambda R: R / diagonal[:, None]
    )
    assert jacobi.converged
    assert jacobi.iterations < plain.iterations


def test_cg_counts_products_of_active_columns_only():
    A = spd(seed=3)
    _, vectors = torch.linalg.eigh(A)
    generator = torch.Generator().manual_seed(4)
    B = torch.randn(P, 4, generator=generator, dtype=torch.float64)
    B[:, 1] = 0  # a zero right-hand side: never active
    B[:, 2] = vectors[:, 5]  # an eigenvector: solved in one iteration
    calls, matmat = counting(A)
    X, report = conjugate_gradients(matmat, B, 1e-10, 10 * P)
    assert_close(X, torch.linalg.solve(A, B), rtol=1e-7, atol=1e-14)
    assert torch.equal(X[:, 1], torch.zeros(P, dtype=torch.float64))
    assert report.relative_residuals[1] == 0
    assert report.converged
    # each column's iterations, solved alone: the block counts their sum
    alone = [
        conjugate_gradients(lambda V, out: A @ V, B[:, [j]], 1e-10, 10 * P)[1] for j in range(4)
    ]
    assert alone[1].products == 0 and alone[2].products == 1
    assert report.products == sum(r.products for r in alone) == sum(calls)
    assert report.iterations == max(r.iterations for r in alone)
    assert calls[0] == 3 and calls[1] == 2  # the zero column never, the eigenvector once
    assert report.products < 3 * report.iterations


@pytest.mark.parametrize("overwrite", [False, True])
def test_cg_updates_in_place_and_overwrites_the_right_hand_sides_only_when_asked(overwrite):
    """All columns active at first (the iterates are the solution itself), one leaving the
    block after one iteration (the others are compacted): the same solution, and ``B`` is
    untouched unless its memory may hold the residuals."""
    A = spd(seed=7)
    _, vectors = torch.linalg.eigh(A)
    B = torch.randn(P, 3, generator=torch.Generator().manual_seed(8), dtype=torch.float64)
    B[:, 1] = vectors[:, 3]  # solved in one iteration
    original = B.clone()
    calls, matmat = counting(A)
    X, report = conjugate_gradients(matmat, B, CG_TOL, 10 * P, overwrite=overwrite)
    assert_close(X, torch.linalg.solve(A, original), rtol=RTOL_SOLVE, atol=0)
    assert calls[0] == 3 and calls[1] == 2
    assert report.converged
    assert torch.equal(B, original) != overwrite


# ------------------------------------------------------------------ block conjugate gradients
#: Block CG against single-column CG on a posterior precision with random right-hand sides:
#: the shared Krylov space must save at least this factor of iterations.
BLOCK_ITERATION_SAVING = 3


def posterior_precision(n: int = 200, rank: int = 120, prior: float = 1e-2) -> torch.Tensor:
    """``U diag(λ) Uᵀ + prior·I`` with ``rank`` eigenvalues log-spread over [1e-4, 1]."""
    generator = torch.Generator().manual_seed(11)
    U, _ = torch.linalg.qr(torch.randn(n, rank, generator=generator, dtype=torch.float64))
    values = torch.logspace(-4, 0, rank, dtype=torch.float64)
    return U @ torch.diag(values) @ U.T + prior * torch.eye(n, dtype=torch.float64)


@pytest.mark.parametrize("preconditioned", [False, True])
def test_block_cg_solves_a_random_spd_system(preconditioned):
    A, B, precondition = badly_scaled_system(preconditioned)
    B[:, 2] = 0  # solved by zero, outside the block
    calls, matmat = counting(A)
    X, report = block_conjugate_gradients(matmat, B, CG_TOL, 10 * P, precondition)
    assert_close(X, torch.linalg.solve(A, B), rtol=RTOL_SOLVE, atol=0)
    assert torch.equal(X[:, 2], torch.zeros(P, dtype=torch.float64))
    residuals = (A @ X - B).norm(dim=0) / B.norm(dim=0).clamp_min(1e-300)
    assert report.converged and (report.relative_residuals <= CG_TOL).all()
    assert (residuals <= ROUNDING_RESIDUAL).all()
    assert calls == [3] * report.iterations and report.products == sum(calls)


def test_block_cg_shares_its_krylov_space_between_the_columns():
    A = posterior_precision()
    root = torch.linalg.cholesky(A)
    generator = torch.Generator().manual_seed(12)
    B = root @ torch.randn(len(A), 16, generator=generator, dtype=torch.float64)  # samples' b
    _, block = block_conjugate_gradients(lambda V, out: A @ V, B, 1e-3, 1000)
    _, alone = conjugate_gradients(lambda V, out: A @ V, B, 1e-3, 1000)
    assert block.converged and alone.converged
    assert BLOCK_ITERATION_SAVING * block.iterations <= alone.iterations
    assert block.products < alone.products


@pytest.mark.parametrize("overwrite", [False, True])
def test_block_cg_overwrites_the_right_hand_sides_only_when_asked(overwrite):
    A = spd(seed=7)
    B = torch.randn(P, 3, generator=torch.Generator().manual_seed(8), dtype=torch.float64)
    original = B.clone()
    X, report = block_conjugate_gradients(lambda V, out: A @ V, B, CG_TOL, 10 * P, None, overwrite)
    assert_close(X, torch.linalg.solve(A, original), rtol=RTOL_SOLVE, atol=0)
    assert report.converged
    assert torch.equal(B, original) != overwrite


@pytest.mark.parametrize(
    "solver, max_iter",
    [(conjugate_gradients, 3), (block_conjugate_gradients, 2)],
    ids=["cg", "block_cg"],
)
def test_solvers_report_non_convergence_and_keep_the_last_iterate(solver, max_iter):
    A = spd(seed=5, condition=1e4)
    B = torch.randn(P, 3, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    calls, matmat = counting(A)
    X, report = solver(matmat, B, 1e-10, max_iter)
    assert not report.converged
    assert report.iterations == max_iter and report.products == 3 * max_iter == sum(calls)
    residuals = (A @ X - B).norm(dim=0) / B.norm(dim=0)
    assert_close(report.relative_residuals, residuals, rtol=1e-8, atol=0)
    assert (report.relative_residuals > 1e-10).all()
    # all right-hand sides zero: nothing to do
    X, report = solver(matmat, torch.zeros(P, 2, dtype=torch.float64), 1e-8, 5)
    assert report.converged and report.products == 0 and report.iterations == 0
    assert torch.equal(X, torch.zeros(P, 2, dtype=torch.float64))


# ----------------------------------------------------------------------------------- probes
def test_probes_are_random_signs_or_scaled_orthogonal_columns():
    like = torch.empty(0, dtype=torch.float64)
    signs = rademacher_probes(P, 7, torch.Generator().manual_seed(0), like)
    assert signs.shape == (P, 7) and signs.dtype == torch.float64
    assert set(signs.unique().tolist()) == {-1.0, 1.0}
    again = rademacher_probes(P, 7, torch.Generator().manual_seed(0), like)
    assert torch.equal(signs, again)
    for n in (P, P + 5):
        Z = rademacher_probes(P, n, torch.Generator().manual_seed(0), like)
        assert Z.shape == (P, P)
        assert_close(Z @ Z.T, P * torch.eye(P, dtype=torch.float64), rtol=0, atol=1e-12)


# --------------------------------------------------------------------------------- Lanczos
def test_lanczos_quadrature_is_exact_per_probe_with_full_steps():
    A = spd(seed=7)
    probes = torch.randn(P, 5, generator=torch.Generator().manual_seed(8), dtype=torch.float64)
    calls, matmat = counting(A)
    quadrature = lanczos_quadrature(matmat, probes, P, reorthogonalize=True)
    assert isinstance(quadrature, LanczosQuadrature)
    assert quadrature.nodes.shape == quadrature.weights.shape == (5, P)
    assert quadrature.products == sum(calls) <= 5 * P
    for f in (torch.log, torch.reciprocal, torch.sqrt):
        expected = (probes * (matrix_function(A, f) @ probes)).sum(0)
        assert_close(quadrature.estimates(f), expected, rtol=RTOL_QUADRATURE, atol=0)
    # the weights of a probe sum to its squared norm (f = 1)
    assert_close(quadrature.weights.sum(1), probes.square().sum(0), rtol=1e-12, atol=0)


def test_lanczos_with_orthogonal_probes_gives_the_exact_log_determinant():
    A = spd(seed=9)
    like = torch.empty(0, dtype=torch.float64)
    probes = rademacher_probes(P, P, torch.Generator().manual_seed(10), like)
    quadrature = lanczos_quadrature(lambda V, out: A @ V, probes, P, reorthogonalize=True)
    estimate = quadrature.estimates(torch.log).mean()
    assert_close(estimate, torch.linalg.slogdet(A)[1], rtol=RTOL_QUADRATURE, atol=0)
    trace_inverse = quadrature.estimates(torch.reciprocal).mean()
    assert_close(trace_inverse, torch.linalg.inv(A).trace(), rtol=RTOL_QUADRATURE, atol=0)


def test_lanczos_stops_a_probe_whose_krylov_space_closes():
    # three distinct eigenvalues: every Krylov space has dimension at most 3
    values = torch.tensor([1.0, 4.0, 9.0], dtype=torch.float64).repeat_interleave(P // 3)
    Q, _ = torch.linalg.qr(torch.randn(P, P, generator=torch.Generator().manual_seed(11)).double())
    A = Q @ torch.diag(values) @ Q.T
    probes = torch.randn(P, 4, generator=torch.Generator().manual_seed(12), dtype=torch.float64)
    calls, matmat = counting(A)
    quadrature = lanczos_quadrature(matmat, probes, 10, reorthogonalize=True)
    assert quadrature.products == sum(calls) == 4 * 3
    assert (quadrature.weights[:, 3:] == 0).all()
    expected = (probes * (matrix_function(A, torch.log) @ probes)).sum(0)
    assert_close(quadrature.estimates(torch.log), expected, rtol=RTOL_QUADRATURE, atol=1e-12)


def test_lanczos_without_reorthogonalisation_is_accurate_for_a_smooth_function():
    """Three vectors per probe, the product written into the memory of the one no longer
    needed; with ``overwrite`` the probes' memory holds the first vectors."""
    A = spd(n=200, seed=13)
    probes = torch.randn(200, 3, generator=torch.Generator().manual_seed(14), dtype=torch.float64)
    calls, matmat = counting(A)
    quadrature = lanczos_quadrature(matmat, probes, PLAIN_STEPS, reorthogonalize=False)
    assert quadrature.products == 3 * PLAIN_STEPS == sum(calls)
    expected = (probes * (matrix_function(A, torch.log) @ probes)).sum(0)
    assert_close(quadrature.estimates(torch.log), expected, rtol=RTOL_QUADRATURE_PLAIN, atol=0)
    overwritten = probes.clone()
    again = lanczos_quadrature(matmat, overwritten, PLAIN_STEPS, False, overwrite=True)
    assert torch.equal(again.nodes, quadrature.nodes)
    assert torch.equal(again.weights, quadrature.weights)
    assert not torch.equal(overwritten, probes)


def test_block_cg_of_one_column_is_cg():
    A, B, _ = badly_scaled_system(False)
    X_block, block = block_conjugate_gradients(lambda V, out: A @ V, B[:, :1], CG_TOL, 10 * P)
    X_cg, cg = conjugate_gradients(lambda V, out: A @ V, B[:, :1], CG_TOL, 10 * P)
    assert torch.equal(X_block, X_cg)
    assert (block.iterations, block.products) == (cg.iterations, cg.products)
