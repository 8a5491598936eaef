"""The diagonal-plus-low-rank output factor (``DiagLowRank``) and Kron blocks holding it.

Checked against the dense matrices they stand for: sums, truncation, state, and the
structured Kronecker posterior's products and log-determinant.
"""

from __future__ import annotations

import pytest
import torch

from conftest import assert_close
from laplace.utils.diag_lowrank import (
    DiagLowRank,
    DiagLowRankBatch,
    factor_from_state,
    factor_state,
)
from laplace.utils.matrix import Kron, StructuredKron, StructuredKronDecomposed


def softmax_batch(n: int = 6, n_classes: int = 5, seed: int = 0) -> DiagLowRankBatch:
    gen = torch.Generator().manual_seed(seed)
    p = torch.softmax(2 * torch.randn(n, n_classes, generator=gen, dtype=torch.float64), -1)
    return DiagLowRankBatch(p, p.unsqueeze(-1), -1)


def test_softmax_factor_is_diag_of_summed_p_minus_p_pt():
    M = softmax_batch()
    G = M.sum()
    p = M.diag
    assert G.sign == -1 and G.rank == len(p)
    assert_close(G.diag, p.sum(0))
    assert_close(G.to_dense(), M.to_dense().sum(0))
    assert_close(G.to_dense(), torch.diag(p.sum(0)) - p.T @ p)
    X = torch.randn(5, 3, dtype=torch.float64)
    assert_close(G @ X, G.to_dense() @ X)
    assert_close(G.diagonal(), G.to_dense().diagonal())
    shifted = DiagLowRank(G.diag + 1, G.U, -1)  # G + I, positive definite
    assert_close(shifted.logdet(), torch.logdet(shifted.to_dense()))


@pytest.mark.parametrize("sign", [-1, 1])
def test_truncation_drops_the_smallest_directions_and_counts_them(sign):
    M = softmax_batch(n=9)
    M = DiagLowRankBatch(M.diag, M.columns, sign)
    exact = M.sum()
    kept = M.sum(max_rank=2)
    assert kept.rank == 2
    dropped_part = exact.U @ exact.U.T - kept.U @ kept.U.T  # R = Σ dropped σᵢ² uᵢuᵢᵀ ⪰ 0
    eigenvalues = torch.linalg.eigvalsh(dropped_part)
    assert bool((eigenvalues > -1e-12).all())
    assert_close(kept.dropped, dropped_part.trace())
    singular = torch.linalg.svdvals(exact.U)
    assert_close(kept.dropped, singular[2:].square().sum())
    assert_close(eigenvalues.max(), singular[2].square())
    if sign < 0:  # softmax: G + R ⪰ G, the diagonal part untouched
        assert_close(kept.diag, exact.diag)
        assert_close(exact.to_dense() + dropped_part, kept.to_dense())
    else:  # Fisher: R's diagonal moves into d, so diag(G) stays exact and G_kept ⪰ 0
        assert_close(kept.diag, exact.diag + dropped_part.diagonal())
        assert_close(kept.to_dense().diagonal(), exact.to_dense().diagonal())
        assert bool((torch.linalg.eigvalsh(kept.to_dense()) > -1e-12).all())


def test_sums_accumulate_in_place_and_bound_the_rank():
    total = DiagLowRank.zeros(5, max_rank=3, dtype=torch.float64)
    parts = [softmax_batch(n=4, seed=s).sum() for s in range(3)]
    for part in parts:
        total.add_(part)
    assert total.rank == 3 and total.sign == -1
    exact = sum(parts[1:], parts[0])
    assert exact.rank == 12
    assert_close(total.diag, exact.diag)
    assert bool(total.dropped > 0)
    with pytest.raises(ValueError, match="sign"):
        total + DiagLowRankBatch(torch.ones(2, 5), torch.ones(2, 5, 1), 1).sum()


def test_state_round_trip_keeps_the_factor():
    G = softmax_batch().sum(max_rank=2)
    like = DiagLowRank.zeros(len(G), max_rank=2, dtype=torch.float64)
    again = factor_from_state(factor_state(G), like)
    assert_close(again.to_dense(), G.to_dense())
    assert_close(again.dropped, G.dropped)
    with pytest.raises(ValueError, match="lacks the entries"):
        factor_from_state({"diag": G.diag}, like)


# ------------------------------------------------------------ the structured Kronecker posterior
@pytest.mark.parametrize("damping", [False, True], ids=["plain", "damped"])
@pytest.mark.parametrize("sign", [-1, 1])
def test_structured_kron_posterior_equals_the_dense_kron_posterior(sign, damping):
    M = softmax_batch(n=8, n_classes=5)
    M = DiagLowRankBatch(M.diag, M.columns, sign)
    G = M.sum()
    phi = torch.randn(8, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    A = phi.T @ phi / 8
    # the third block has dense factors: blocks of both kinds in one matrix
    structured = StructuredKron([[G, A], [G], [G.to_dense(), A]])
    dense = Kron([[G.to_dense(), A], [G.to_dense()], [G.to_dense(), A]])
    assert_close(structured.to_matrix(), dense.to_matrix())
    assert_close(structured.diag(), dense.diag())
    h, deltas = torch.tensor(1.7, dtype=torch.float64), torch.tensor([0.3, 0.9, 0.5])
    ours = structured.decompose(damping=damping) * h + deltas.double()
    theirs = dense.decompose(damping=damping) * h + deltas.double()
    assert isinstance(ours, StructuredKronDecomposed)
    P = theirs.to_matrix()
    covariance = torch.linalg.inv(P)
    assert_close(ours.logdet(), torch.logdet(P))
    assert_close(ours.to_matrix(), P)
    assert_close(ours.to_matrix(-1), covariance)
    root = ours.to_matrix(-0.5)
    assert_close(root @ root.T, covariance)
    assert_close(ours.diag(), P.diagonal())
    assert_close(ours.diag(-1), covariance.diagonal())
    W = torch.randn(4, 2, len(P), dtype=torch.float64)
    assert_close(ours.inv_square_form(W), W @ covariance @ W.mT)
    assert_close(ours.bmm(W[:, 0], exponent=1), W[:, 0] @ P)
    with pytest.raises(ValueError, match="exponent"):
        ours.bmm(W[:, 0], exponent=0.5)
    with pytest.raises(ValueError, match="no eigendecomposition"):
        _ = ours.eigenvectors


def test_log_det_is_differentiable_in_the_prior_precision():
    G = softmax_batch().sum()
    A = torch.eye(2, dtype=torch.float64) * 0.6
    delta = torch.tensor(0.4, dtype=torch.float64, requires_grad=True)
    ours = StructuredKron([[G, A], [G]]).decompose() + delta
    theirs = Kron([[G.to_dense(), A], [G.to_dense()]]).decompose() + delta
    (grad_ours,) = torch.autograd.grad(ours.logdet(), delta)
    (grad_theirs,) = torch.autograd.grad(theirs.logdet(), delta)
    assert_close(grad_ours, grad_theirs)
