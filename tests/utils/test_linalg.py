"""Dense linear algebra helpers (``laplace.utils.linalg``) against their definitions."""

from __future__ import annotations

import math

import pytest
import torch

from conftest import assert_close
from laplace.utils import (
    block_diag,
    diagonal_add_scalar,
    invsqrt_precision,
    kron,
    normal_samples,
    symeig,
)

F64 = torch.float64


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _spd(n: int, seed: int = 0, batch: tuple[int, ...] = ()) -> torch.Tensor:
    A = torch.randn(*batch, n, n, generator=_gen(seed), dtype=F64)
    return A @ A.mT + 0.5 * torch.eye(n, dtype=F64)


@pytest.mark.parametrize("batch", [(), (3,)], ids=["single", "batched"])
def test_invsqrt_precision_is_lower_cholesky_of_covariance(batch):
    M = _spd(5, seed=4, batch=batch)
    L = invsqrt_precision(M)
    assert_close(L, torch.tril(L))
    assert_close(L @ L.mT, torch.linalg.inv(M), rtol=1e-8, atol=1e-10)
    eye = torch.eye(5, dtype=F64).expand_as(M)
    assert_close(L.mT @ M @ L, eye, rtol=1e-8, atol=1e-10)
    assert (L.diagonal(dim1=-2, dim2=-1) > 0).all()


def test_invsqrt_precision_errors():
    with pytest.raises(ValueError, match="M"):
        invsqrt_precision(torch.ones(2, 3))
    with pytest.raises(torch.linalg.LinAlgError):
        invsqrt_precision(-torch.eye(3, dtype=F64))


def test_kron_matches_index_formula():
    A = torch.randn(2, 3, generator=_gen(5), dtype=F64)
    B = torch.randn(4, 5, generator=_gen(6), dtype=F64)
    K = kron(A, B)
    assert K.shape == (8, 15)
    expected = torch.empty(8, 15, dtype=F64)
    for i in range(2):
        for j in range(3):
            for k in range(4):
                for m in range(5):
                    expected[i * 4 + k, j * 5 + m] = A[i, j] * B[k, m]
    assert_close(K, expected)


def test_kron_rejects_non_matrices():
    with pytest.raises(ValueError, match="t1"):
        kron(torch.ones(3), torch.ones(2, 2))
    with pytest.raises(ValueError, match="t2"):
        kron(torch.ones(2, 2), torch.ones(2, 2, 2))


def test_diagonal_add_scalar():
    X = torch.randn(4, 4, generator=_gen(7), dtype=F64)
    out = diagonal_add_scalar(X, 2.5)
    assert_close(out, X + 2.5 * torch.eye(4, dtype=F64))
    assert out is not X
    # tensor values (one per diagonal entry) and non-square matrices
    d = torch.arange(1.0, 4.0, dtype=F64)
    assert_close(diagonal_add_scalar(X[:3, :3], d), X[:3, :3] + torch.diag(d))
    wide = torch.zeros(2, 3, dtype=F64)
    assert_close(diagonal_add_scalar(wide, 1.0), torch.eye(2, 3, dtype=F64))
    tall = torch.zeros(3, 2, dtype=F64)
    assert_close(diagonal_add_scalar(tall, 1.0), torch.eye(3, 2, dtype=F64))
    # differentiable in the value
    value = torch.tensor(1.0, dtype=F64, requires_grad=True)
    diagonal_add_scalar(X, value).sum().backward()
    assert value.grad.item() == 4.0
    with pytest.raises(ValueError, match="X"):
        diagonal_add_scalar(torch.ones(3), 1.0)


def test_symeig_reconstructs_psd_matrix():
    M = _spd(6, seed=8)
    L, W = symeig(M)
    assert_close(W @ torch.diag(L) @ W.T, M, rtol=1e-8, atol=1e-10)
    assert_close(W.T @ W, torch.eye(6, dtype=F64), rtol=1e-8, atol=1e-10)
    assert (L[1:] >= L[:-1]).all()


def test_symeig_clamps_negative_eigenvalues_and_reads_upper_triangle():
    M = torch.tensor([[1.0, 2.0], [2.0, 1.0]], dtype=F64)  # eigenvalues -1 and 3
    L, _ = symeig(M)
    assert_close(L, torch.tensor([0.0, 3.0], dtype=F64))
    upper_only = torch.tensor([[1.0, 2.0], [-50.0, 1.0]], dtype=F64)
    assert_close(symeig(upper_only)[0], L)


def test_symeig_retries_with_jitter(monkeypatch):
    M = _spd(4, seed=9)
    original = torch.linalg.eigh
    calls = []

    def flaky(A, UPLO="L"):
        calls.append(A.clone())
        if len(calls) == 1:
            raise torch.linalg.LinAlgError("did not converge")
        return original(A, UPLO=UPLO)

    monkeypatch.setattr(torch.linalg, "eigh", flaky)
    L, W = symeig(M)
    assert len(calls) == 2
    assert_close(calls[1], M + torch.eye(4, dtype=F64))
    assert_close(L, original(M)[0], rtol=1e-8, atol=1e-10)
    assert_close(W @ torch.diag(L) @ W.T, M, rtol=1e-8, atol=1e-10)


def test_symeig_raises_when_jitter_fails(monkeypatch):
    def broken(A, UPLO="L"):
        raise torch.linalg.LinAlgError("did not converge")

    monkeypatch.setattr(torch.linalg, "eigh", broken)
    with pytest.raises(torch.linalg.LinAlgError, match="jitter"):
        symeig(torch.eye(3, dtype=F64))


def test_symeig_rejects_non_square():
    with pytest.raises(ValueError, match="M"):
        symeig(torch.ones(2, 3))


def test_block_diag():
    A = torch.randn(2, 2, generator=_gen(10), dtype=F64)
    B = torch.randn(3, 3, generator=_gen(11), dtype=F64)
    M = block_diag([A, B])
    expected = torch.zeros(5, 5, dtype=F64)
    expected[:2, :2] = A
    expected[2:, 2:] = B
    assert_close(M, expected)
    with pytest.raises(ValueError, match="blocks"):
        block_diag([])
    with pytest.raises(ValueError, match=r"blocks\[1\]"):
        block_diag([A, torch.ones(3)])


def test_normal_samples_diagonal_statistics():
    S = 40_000
    mean = torch.tensor([[1.0, -2.0, 0.5], [0.0, 3.0, -1.0]], dtype=F64)
    var = torch.tensor([[0.5, 2.0, 1.0], [4.0, 0.1, 0.0]], dtype=F64)
    samples = normal_samples(mean, var, S, generator=_gen(12))
    assert samples.shape == (S, 2, 3)
    # 5 standard errors: mean error ~ sd/√S, variance error ~ var·√(2/S)
    assert ((samples.mean(0) - mean).abs() <= 5 * (var / S).sqrt() + 1e-12).all()
    assert ((samples.var(0) - var).abs() <= 5 * var * math.sqrt(2 / S) + 1e-12).all()


def test_normal_samples_full_covariance_statistics():
    S = 40_000
    mean = torch.randn(3, 2, generator=_gen(13), dtype=F64)
    cov = _spd(2, seed=14, batch=(3,))
    samples = normal_samples(mean, cov, S, generator=_gen(15))
    assert samples.shape == (S, 3, 2)
    centred = samples - samples.mean(0)
    emp_cov = torch.einsum("sbi,sbj->bij", centred, centred) / (S - 1)
    sd = cov.diagonal(dim1=-2, dim2=-1).sqrt()
    # Var of a sample covariance entry is (Σ_ii Σ_jj + Σ_ij²)/S ≤ 2 Σ_ii Σ_jj / S
    tol = 5 * math.sqrt(2 / S) * sd.unsqueeze(-1) * sd.unsqueeze(-2)
    assert ((emp_cov - cov).abs() <= tol).all()
    assert ((samples.mean(0) - mean).abs() <= 5 * sd / math.sqrt(S)).all()


def test_normal_samples_diag_and_full_agree_for_diagonal_covariance():
    mean = torch.randn(4, 3, generator=_gen(16), dtype=F64)
    var = torch.rand(4, 3, generator=_gen(17), dtype=F64) + 0.1
    a = normal_samples(mean, var, 6, generator=_gen(18))
    b = normal_samples(mean, torch.diag_embed(var), 6, generator=_gen(18))
    assert_close(a, b)
    # one standard-normal draw of shape (C, S) is shared by the batch
    z = torch.randn(3, 6, generator=_gen(18), dtype=F64)
    assert_close(a, (mean.unsqueeze(-1) + var.sqrt().unsqueeze(-1) * z).permute(2, 0, 1))


def test_normal_samples_rejects_bad_input():
    mean = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="mean"):
        normal_samples(torch.zeros(3), torch.ones(3), 5)
    with pytest.raises(ValueError, match="var"):
        normal_samples(mean, torch.ones(2, 4), 5)
    with pytest.raises(ValueError, match="var"):
        normal_samples(mean, -torch.ones(2, 3), 5)
    with pytest.raises(ValueError, match="n_samples"):
        normal_samples(mean, torch.ones(2, 3), 0)


@pytest.mark.parametrize("n_cols", [5, 300, 517])
def test_symmetric_gram_equals_full_product(n_cols):
    from laplace.utils.linalg import symmetric_gram

    G = torch.randn(40, n_cols, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    assert_close(symmetric_gram(G, panel=64), G.T @ G)


@pytest.mark.parametrize("n_cols", [5, 300, 517])
def test_upper_gram_sums_mirrored_once_equal_the_full_products(n_cols):
    """Rank updates added in place above the diagonal, mirrored at the end, sum the Grams."""
    from laplace.utils.linalg import add_gram_upper_, mirror_upper_

    gen = torch.Generator().manual_seed(0)
    updates = [torch.randn(m, n_cols, dtype=torch.float64, generator=gen) for m in (3, 40)]
    out = torch.zeros(n_cols, n_cols, dtype=torch.float64)
    for G, alpha in zip(updates, (1.0, 0.5)):
        add_gram_upper_(out, G, alpha=alpha, panel=64)
    expected = updates[0].T @ updates[0] + 0.5 * updates[1].T @ updates[1]
    assert_close(mirror_upper_(out, panel=64), expected)
