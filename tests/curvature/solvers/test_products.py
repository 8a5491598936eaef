"""Curvature–block products (native and operator) and their pass cache, against dense oracles."""

from __future__ import annotations

import pytest
import torch

from conftest import CASE_BUILDERS, Oracle, assert_close
from laplace.curvature import CurvlinopsEF, CurvlinopsGGN, CurvlinopsHessian
from laplace.curvature.engine.block_product import SampleVectors
from laplace.curvature.solvers.products import NativeProduct, OperatorProduct, curvature_product

CASES = ["mlp_regression_3out", "mlp_classification", "cnn_classification"]


DENSE = {
    CurvlinopsGGN: lambda oracle, case: oracle.ggn(case.X),
    CurvlinopsEF: lambda oracle, case: oracle.ef(case.X, case.y),
}


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


def test_hessian_backends_use_the_operator_product():
    case = CASE_BUILDERS["mlp_regression_3out"]()
    oracle = Oracle(case.model, case.likelihood)
    backend = CurvlinopsHessian(case.model, case.likelihood)
    product = curvature_product(backend, case.loader(), len(case.X))
    assert isinstance(product, OperatorProduct) and product.sketch(2, None) is None
    V = _block(product.n_params, 3)
    assert_close(product.matmat(V), oracle.hessian(case.X, case.y) @ V)


@pytest.mark.parametrize("kept_batches", [0, 1, 2, 99], ids=["none", "one", "two", "all"])
def test_kept_batches_give_the_same_products_on_every_pass(kept_batches):
    """Monte-Carlo columns too: the generator resumes after the kept batches."""
    case = CASE_BUILDERS["cnn_classification"]()
    backend = CurvlinopsGGN(case.model, case.likelihood, stochastic=True, num_samples=2)
    trace = backend.trace(case.X[:5])
    columns = torch.stack(list(backend.curvature_columns(trace.f.detach(), case.y[:5])))
    batch_bytes = SampleVectors(trace, columns).nbytes  # batches of 5, 5 and 2 points
    reference = NativeProduct(backend, case.loader(), seed=5, cache_bytes=0)
    product = NativeProduct(backend, case.loader(), seed=5, cache_bytes=batch_bytes * kept_batches)
    V = torch.randn(product.n_params, 3, dtype=torch.float64)
    expected = reference.matmat(V)
    for _ in range(3):
        assert_close(product.matmat(V), expected)
    assert len(product._kept) == min(kept_batches, 3)


class _TokenLSTM(torch.nn.Module):
    """Token ids (B, 4) → embedding → LSTM → last step → 3 logits."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(7, 3)
        self.lstm = torch.nn.LSTM(3, 4, batch_first=True)
        self.head = torch.nn.Linear(4, 3)

    def forward(self, tokens):
        return self.head(self.lstm(self.embed(tokens))[0][:, -1])


@pytest.mark.parametrize("kept_batches", [0, 99], ids=["none", "all"])
def test_native_product_through_a_recurrent_layer_after_an_embedding(kept_batches):
    """The columns' backward pass is cut at the layer (its pullback kept for its rule, counted
    in a kept batch's bytes): the products are the dense GGN's."""
    torch.manual_seed(0)
    model = _TokenLSTM().double().eval()
    gen = torch.Generator().manual_seed(1)
    tokens, y = torch.randint(0, 7, (10, 4), generator=gen), torch.randint(0, 3, (10,))
    data = [(tokens[:6], y[:6]), (tokens[6:], y[6:])]
    backend = CurvlinopsGGN(model, "classification")
    product = NativeProduct(backend, data, cache_bytes=0 if kept_batches == 0 else None)
    V = _block(product.n_params, 3)
    expected = Oracle(model, "classification").ggn(tokens) @ V
    for _ in range(2):
        assert_close(product.matmat(V), expected)
    assert len(product._kept) == min(kept_batches, 2)
