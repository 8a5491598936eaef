"""Per-sample vectors times parameter blocks (``block_product``) against dense float64 oracles."""

from __future__ import annotations

import torch

from conftest import CASE_BUILDERS, Oracle, assert_close
from laplace.curvature import CurvlinopsGGN
from laplace.curvature.engine import block_product
from laplace.curvature.engine.block_product import BlockSum, ParameterBlock, SampleVectors
from laplace.curvature.solvers.products import curvature_product


def _block(n_params: int, m: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n_params, m, generator=gen, dtype=torch.float64)


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
