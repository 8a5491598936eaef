"""The KFAC start of the low-rank eigensolver against dense float64 oracles."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from conftest import CASE_BUILDERS, Case, Oracle, assert_close
from laplace import LowRankLaplace
from laplace.curvature import CurvlinopsEF, CurvlinopsGGN
from laplace.curvature.engine.block_product import SampleVectors
from laplace.curvature.solvers.eigen import top_eigenpairs
from laplace.curvature.solvers.kfac_start import _Candidates, kfac_start
from laplace.curvature.solvers.products import curvature_product
from laplace.utils.matrix import Kron

#: Ritz values and products in float64 against eigh of the dense curvature.
DENSE_RTOL = 1e-8


def _sequence_case() -> Case:
    """A linear layer applied at 4 positions per data point, then pooled (T > 1 for KFAC)."""
    torch.manual_seed(4)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Flatten(), nn.Linear(16, 3)).double()
    X = torch.randn(10, 4, 3, dtype=torch.float64)
    return Case("sequence", "classification", model, X, torch.randint(0, 3, (10,)), 4)


CASES = {**CASE_BUILDERS, "sequence": _sequence_case}


NAMES = ["mlp_regression_3out", "mlp_classification", "cnn_classification", "sequence"]


def _factors(case: Case, backend) -> Kron:
    total = None
    for X, y in case.loader():
        _, H = backend.kron(X, y, N=len(case.X))
        total = H if total is None else total + H
    return total


def _dense_candidates(candidates: _Candidates, params) -> torch.Tensor:
    """The candidates as dense (P, M) columns, built with ``torch.kron`` at the slot offsets."""
    offsets = torch.tensor([0] + [p.numel() for p in params]).cumsum(0)
    V = torch.zeros(int(offsets[-1]), candidates.n, dtype=torch.float64)
    for block in candidates.blocks:
        for a, (i, j) in enumerate(zip(block.g_index, block.a_index)):
            column = (
                block.QG[:, i] if block.QA is None else torch.kron(block.QG[:, i], block.QA[:, j])
            )
            V[offsets[block.slot] : offsets[block.slot + 1], block.start + a] = column
    return V


def _block_eigenvalues(factors: Kron) -> torch.Tensor:
    dense = [F[0] if len(F) == 1 else torch.kron(F[0], F[1]) for F in factors.kfacs]
    return torch.cat([torch.linalg.eigvalsh(block) for block in dense]).clamp(min=0)


@pytest.mark.parametrize("name", NAMES)
def test_candidates_are_the_top_kronecker_eigenvectors_and_project_per_sample_vectors(name):
    case = CASES[name]()
    oracle = Oracle(case.model, case.likelihood)
    backend = CurvlinopsGGN(case.model, case.likelihood)
    factors = _factors(case, backend)
    n_candidates = len(oracle.theta) // 2
    candidates = _Candidates(factors, n_candidates)
    V = _dense_candidates(candidates, backend.params)
    assert candidates.n == n_candidates
    assert_close(V.T @ V, torch.eye(n_candidates, dtype=torch.float64))
    blocks = [F[0] if len(F) == 1 else torch.kron(F[0], F[1]) for F in factors.kfacs]
    kron_matrix = torch.block_diag(*blocks)
    chosen = (V.T @ kron_matrix @ V).diagonal().sort(descending=True).values
    top = _block_eigenvalues(factors).sort(descending=True).values[:n_candidates]
    assert_close(chosen, top)  # the M Kronecker eigenvectors of largest eigenvalue
    X, y = case.X[:5], case.y[:5]
    trace = backend.trace(X)
    columns = torch.stack(list(backend.curvature_columns(trace.f.detach(), y)))
    vectors = SampleVectors(trace, columns)
    G = torch.einsum("bcp,kbc->kbp", oracle.jacobian(X), columns)
    assert_close(candidates.project(trace, vectors.output_gradients), G @ V)
    C = torch.randn(n_candidates, 3, dtype=torch.float64)
    offsets = [0, *torch.tensor([p.numel() for p in backend.params]).cumsum(0).tolist()]
    assert_close(candidates.vectors(C, len(oracle.theta), offsets), V @ C)


@pytest.mark.parametrize("backend_cls", [CurvlinopsGGN, CurvlinopsEF], ids=["ggn", "ef"])
@pytest.mark.parametrize("name", NAMES)
def test_kfac_start_is_rayleigh_ritz_of_the_curvature_on_the_candidates(name, backend_cls):
    case = CASES[name]()
    oracle = Oracle(case.model, case.likelihood)
    backend = backend_cls(case.model, case.likelihood)
    H = oracle.ggn(case.X) if backend_cls is CurvlinopsGGN else oracle.ef(case.X, case.y)
    product = curvature_product(backend, case.loader(), len(case.X))
    width, n_candidates = 4, len(oracle.theta) // 2
    start = kfac_start(product, width, n_candidates)
    V = _dense_candidates(_Candidates(_factors(case, backend), n_candidates), backend.params)
    ritz = torch.linalg.eigvalsh(V.T @ H @ V)
    assert_close(start.values, ritz.flip(0)[:width], rtol=DENSE_RTOL, atol=1e-10)
    assert_close(start.Q.T @ start.Q, torch.eye(width, dtype=torch.float64))
    assert_close(start.HQ, H @ start.Q)
    projector = V @ V.T
    assert_close(projector @ start.Q, start.Q)  # Q lies in the span of the candidates


def test_kfac_start_needs_kfac_layers_and_a_native_product():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4), nn.Linear(4, 2)).double()
    loader = DataLoader(TensorDataset(torch.randn(8, 3).double(), torch.randn(8, 2).double()))
    product = curvature_product(CurvlinopsGGN(model, "regression"), loader, 8)
    assert kfac_start(product, 3, 10) is None


@pytest.mark.parametrize("name", ["mlp_classification", "cnn_classification", "sequence"])
def test_kfac_start_then_krylov_passes_converge_to_the_dense_top_k(name):
    case = CASES[name]()
    oracle = Oracle(case.model, case.likelihood)
    product = curvature_product(CurvlinopsGGN(case.model, case.likelihood), case.loader(), 20)
    k = 3
    U, values, errors = top_eigenpairs(product, k, max_iter=8, oversampling=2, candidates=12)
    exact, vectors = torch.linalg.eigh(oracle.ggn(case.X))
    assert_close(values, exact.flip(0)[:k], rtol=DENSE_RTOL, atol=0)
    assert_close(
        (U.T @ vectors.flip(1)[:, :k]).abs(), torch.eye(k, dtype=torch.float64), atol=1e-6
    )
    assert bool((errors <= 1e-6).all())


@pytest.mark.parametrize("max_iter", [0, 2], ids=["nystrom", "krylov"])
def test_low_rank_fit_from_a_kfac_start_follows_the_model_device(device, max_iter):
    case = CASE_BUILDERS["cnn_classification"]()
    exact = torch.linalg.eigvalsh(Oracle(case.model, case.likelihood).ggn(case.X)).flip(0)[:3]
    options = {"n_eigenvalues": 3, "candidates": 12, "max_iter": max_iter}
    la = LowRankLaplace(case.model.to(device), case.likelihood, backend_kwargs=options)
    la.fit(case.loader())
    U, values = la.H
    for t in (U, values, la.eigenvalue_errors):
        assert t.device.type == device.type and t.dtype == torch.float64
    assert bool((values.cpu() <= exact * (1 + 1e-9)).all())  # Rayleigh–Ritz and Nyström
    assert_close(U.T @ U, torch.eye(3, dtype=torch.float64, device=device))
    probs = la(case.X[:4].to(device), link_approx="probit")
    assert probs.device.type == device.type
