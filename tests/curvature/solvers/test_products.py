"""Native curvature–block products and the block Krylov eigensolver against dense oracles."""

from __future__ import annotations

import pytest
import torch
from tests.conftest import CASE_BUILDERS, Oracle, assert_close

from laplace.curvature import CurvlinopsEF, CurvlinopsGGN, CurvlinopsHessian
from laplace.curvature.engine import block_product
from laplace.curvature.engine.block_product import BlockSum, ParameterBlock, SampleVectors
from laplace.curvature.solvers.eigen import top_eigenpairs
from laplace.curvature.solvers.products import NativeProduct, OperatorProduct, curvature_product

CASES = ["mlp_regression_3out", "mlp_classification", "cnn_classification"]
DENSE = {
    CurvlinopsGGN: lambda oracle, case: oracle.ggn(case.X),
    CurvlinopsEF: lambda oracle, case: oracle.ef(case.X, case.y),
}
#: Ritz values from a converged Krylov basis against ``eigh`` (float64).
EIGEN_RTOL = 1e-8


def _block(n_params: int, m: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n_params, m, generator=gen, dtype=torch.float64)


@pytest.mark.parametrize("backend", list(DENSE), ids=["ggn", "ef"])
@pytest.mark.parametrize("case_name", CASES)
def test_native_product_is_dense_curvature_times_block(case_name, backend):
    case = CASE_BUILDERS[case_name]()
    oracle = Oracle(case.model, case.likelihood)
    product = curvature_product(backend(case.model, case.likelihood), case.loader(), len(case.X))
    assert isinstance(product, NativeProduct)
    V = _block(product.n_params, 5)
    assert_close(product.matmat(V), DENSE[backend](oracle, case) @ V)


def test_sketch_is_per_sample_vectors_times_gaussian_weights():
    case = CASE_BUILDERS["cnn_classification"]()
    oracle = Oracle(case.model, case.likelihood)
    backend = CurvlinopsGGN(case.model, case.likelihood)
    sketch = curvature_product(backend, case.loader(), 12).sketch(
        3, torch.Generator().manual_seed(7)
    )
    replay = torch.Generator().manual_seed(7)
    expected = 0
    for X, y in case.loader():
        columns = torch.stack(list(backend.curvature_columns(oracle.f(oracle.theta, X), y)))
        G = torch.einsum("bcp,kbc->kbp", oracle.jacobian(X), columns)
        W = torch.randn(*G.shape[:2], 3, generator=replay, dtype=torch.float64)
        expected = expected + torch.einsum("kbp,kbm->pm", G, W)
    assert_close(sketch, expected)


def test_monte_carlo_fisher_product_is_one_fixed_matrix():
    case = CASE_BUILDERS["mlp_classification"]()
    backend = CurvlinopsGGN(case.model, case.likelihood, stochastic=True, num_samples=2)
    product = curvature_product(backend, case.loader(), len(case.X), seed=3)
    V, W = _block(product.n_params, 3, 1), _block(product.n_params, 3, 2)
    HV = product.matmat(V)
    assert_close(product.matmat(V), HV)
    assert_close(V.T @ product.matmat(W), HV.T @ W)


def test_products_without_the_per_sample_cache(monkeypatch):
    case = CASE_BUILDERS["cnn_classification"]()
    oracle = Oracle(case.model, case.likelihood)
    monkeypatch.setattr(block_product, "PER_SAMPLE_CACHE_BYTES", 0)
    product = curvature_product(CurvlinopsGGN(case.model, case.likelihood), case.loader(), 12)
    V = _block(product.n_params, 4)
    assert_close(product.matmat(V), oracle.ggn(case.X) @ V)


def test_subnetwork_vectors_use_the_restricted_rows():
    case = CASE_BUILDERS["mlp_classification"]()
    oracle = Oracle(case.model, case.likelihood)
    idx = torch.tensor([40, 3, 17, 25, 8])
    backend = CurvlinopsGGN(case.model, case.likelihood, subnetwork_indices=idx)
    trace = backend.trace(case.X)
    columns = torch.stack(list(backend.curvature_columns(trace.f.detach(), case.y)))
    G = torch.einsum("bcp,kbc->kbp", oracle.jacobian(case.X)[:, :, idx], columns)
    vectors = SampleVectors(trace, columns)
    assert not vectors.layerwise
    V = _block(len(idx), 2)
    assert_close(vectors.project(ParameterBlock(trace.engine, V)), G @ V)
    total = BlockSum(trace.engine, 2, V)
    vectors.backproject(G @ V, total)
    assert_close(total.result(), torch.einsum("kbp,kbq->pq", G, G) @ V)


def test_hessian_backends_use_the_operator_product():
    case = CASE_BUILDERS["mlp_regression_3out"]()
    oracle = Oracle(case.model, case.likelihood)
    backend = CurvlinopsHessian(case.model, case.likelihood)
    product = curvature_product(backend, case.loader(), len(case.X))
    assert isinstance(product, OperatorProduct) and product.sketch(2, None) is None
    V = _block(product.n_params, 3)
    assert_close(product.matmat(V), oracle.hessian(case.X, case.y) @ V)


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
