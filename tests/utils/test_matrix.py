"""``Kron`` and ``KronDecomposed`` against their dense float64 counterparts."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from conftest import assert_close, kron_dense_blocks
from laplace.utils.matrix import Kron

EXPONENTS = [1, -1, 0.5, -0.5]


def _spd(n: int, gen: torch.Generator, rank: int | None = None) -> torch.Tensor:
    X = torch.randn(n, rank or n + 2, generator=gen, dtype=torch.float64)
    return X @ X.T / X.shape[1]


def random_kron(seed: int = 0) -> Kron:
    """Weight block (3 ⊗ 4), bias block (3), rank-deficient weight block (2 ⊗ 5), bias (2)."""
    gen = torch.Generator().manual_seed(seed)
    return Kron(
        [
            [_spd(3, gen), _spd(4, gen)],
            [_spd(3, gen)],
            [_spd(2, gen, rank=1), _spd(5, gen, rank=3)],
            [_spd(2, gen)],
        ]
    )


def dense_blocks(K: Kron) -> list[torch.Tensor]:
    return [F[0] if len(F) == 1 else torch.kron(F[0], F[1]) for F in K.kfacs]


def dense_power(blocks: list[torch.Tensor], deltas, exponent: float) -> torch.Tensor:
    powered = []
    for block, delta in zip(blocks, deltas):
        w, V = torch.linalg.eigh(block + delta * torch.eye(len(block), dtype=block.dtype))
        powered.append((V * w.pow(exponent)) @ V.T)
    return torch.block_diag(*powered)


def damped_dense(K: Kron, delta: torch.Tensor) -> torch.Tensor:
    """Dense ``(F₀ + √δ I) ⊗ (F₁ + √δ I)`` per two-factor block, ``F + δ I`` per one-factor one."""
    root, blocks = delta.sqrt(), []
    for F in K.kfacs:
        Fs = [Fi if Fi.ndim == 2 else torch.diag(Fi) for Fi in F]
        eye = [torch.eye(len(Fi), dtype=Fi.dtype) for Fi in Fs]
        if len(F) == 1:
            blocks.append(Fs[0] + delta * eye[0])
        else:
            blocks.append(torch.kron(Fs[0] + root * eye[0], Fs[1] + root * eye[1]))
    return torch.block_diag(*blocks)


def test_init_from_model_shapes_and_zeros():
    model = nn.Sequential(nn.Conv2d(2, 3, 3), nn.Flatten(), nn.Linear(4, 5, bias=False))
    K = Kron.init_from_model(model, torch.device("cpu"), torch.float64)
    assert [[tuple(F.shape) for F in b] for b in K.kfacs] == [
        [(3, 3), (18, 18)],
        [(3, 3)],
        [(5, 5), (4, 4)],
    ]
    assert len(K) == 3
    assert all(F.dtype == torch.float64 and not F.any() for b in K.kfacs for F in b)
    same = Kron.init_from_model(model.parameters(), torch.device("cpu"), torch.float64)
    assert len(same) == 3


def test_kron_dense_views_and_arithmetic():
    K, K2 = random_kron(0), random_kron(1)
    dense = torch.block_diag(*dense_blocks(K))
    assert_close(K.to_matrix(), dense)
    assert_close(K.diag(), dense.diagonal())
    summed = Kron([[a + b for a, b in zip(F, F2)] for F, F2 in zip(K.kfacs, K2.kfacs)])
    assert_close((K + K2).to_matrix(), torch.block_diag(*dense_blocks(summed)))  # factor-wise
    assert_close((K * 2.5).to_matrix(), 2.5 * dense)
    assert_close((0.5 * K).to_matrix(), 0.5 * dense)
    full_rank = Kron([K.kfacs[0], K.kfacs[1], K.kfacs[3]])
    assert_close(full_rank.logdet(), torch.linalg.slogdet(full_rank.to_matrix())[1])


@pytest.mark.parametrize("shape", [(), (6,), (2, 5)], ids=["vector", "matrix", "batched"])
def test_kron_bmm(shape):
    K = random_kron(2)
    P = K.to_matrix().shape[0]
    W = torch.randn(*shape, P, dtype=torch.float64)
    assert_close(K.bmm(W), (W.reshape(-1, P) @ K.to_matrix()).reshape(W.shape))
    assert_close(K @ W, K.bmm(W))
    D = K.decompose() + torch.tensor(0.5, dtype=torch.float64)
    assert_close(D @ W, D.bmm(W, exponent=1))


def test_kron_in_place_sum_adds_into_its_own_factors():
    K, K2 = random_kron(0), random_kron(1)
    expected = (K + K2).to_matrix()
    factors = [F for block in K.kfacs for F in block]
    K += K2
    assert_close(K.to_matrix(), expected)
    assert all(F is G for F, G in zip(factors, [F for block in K.kfacs for F in block]))
    with pytest.raises(ValueError, match="block structures"):
        K += Kron(K2.kfacs[:2])


def test_kron_in_place_sum_promotes_like_the_sum():
    """float32 ``+=`` float64 gives float64 factors, as ``+`` does (laplace-torch's ``+=``)."""
    K32 = Kron([[F.float() for F in block] for block in random_kron(0).kfacs])
    K64 = random_kron(1)
    expected = K32 + K64
    K32 += K64
    assert all(F.dtype == torch.float64 for block in K32.kfacs for F in block)
    assert_close(K32.to_matrix(), expected.to_matrix())
    K64 += Kron([[F.float() for F in block] for block in random_kron(2).kfacs])
    assert all(F.dtype == torch.float64 for block in K64.kfacs for F in block)


def test_decomposing_diagonal_factors_shows_identity_eigenvectors():
    K = Kron([[_positive(3, torch.Generator().manual_seed(0))]])
    (Q,) = K.decompose().eigenvectors[0]
    assert_close(Q, torch.eye(3, dtype=torch.float64))


@pytest.mark.parametrize("damping", [False, True], ids=["plain", "damped"])
def test_deferred_decomposition_equals_the_eager_one(damping, monkeypatch):
    K = random_kron(6)
    eager = K.decompose(damping=damping)
    calls, original = [], Kron._eigenpairs
    monkeypatch.setattr(Kron, "_eigenpairs", lambda self: calls.append(1) or original(self))
    deferred = K.decompose(damping=damping, deferred=True)
    assert len(deferred) == len(eager) and not calls  # nothing decomposed yet
    deltas = torch.tensor([0.3, 1.1, 0.5, 2.0], dtype=torch.float64)
    assert_close((deferred * 1.3 + deltas).to_matrix(-1), (eager * 1.3 + deltas).to_matrix(-1))
    assert_close((deferred + deltas).logdet(), (eager + deltas).logdet())
    _ = deferred.eigenvalues, deferred.eigenvectors
    assert calls == [1]  # once, on first use


def test_kron_refuses_other_exponents_and_mismatched_sums():
    K = random_kron(0)
    with pytest.raises(ValueError, match="decompose"):
        K.bmm(torch.zeros(K.to_matrix().shape[0], dtype=torch.float64), exponent=-1)
    with pytest.raises(ValueError, match="block structures"):
        K + Kron(K.kfacs[:2])
    with pytest.raises(ValueError, match="scalar"):
        K * torch.ones(2)


@pytest.mark.parametrize("prior", ["scalar", "layerwise"])
@pytest.mark.parametrize("exponent", EXPONENTS)
def test_decomposed_matches_dense_powers(prior, exponent):
    K = random_kron(3)
    deltas = torch.tensor([0.7]) if prior == "scalar" else torch.tensor([0.3, 1.1, 0.5, 2.0])
    deltas = deltas.double()
    D = K.decompose() * 1.7 + deltas
    blocks = [1.7 * b for b in dense_blocks(K)]
    expected = dense_power(blocks, deltas.expand(4), exponent)
    assert_close(D.to_matrix(exponent), expected, rtol=1e-7, atol=1e-9)
    assert_close(D.diag(exponent), expected.diagonal(), rtol=1e-7, atol=1e-9)
    W = torch.randn(3, 2, expected.shape[0], dtype=torch.float64)
    assert_close(D.bmm(W, exponent), W @ expected, rtol=1e-7, atol=1e-9)
    assert_close(D.bmm(W[0, 0], exponent), W[0, 0] @ expected, rtol=1e-7, atol=1e-9)
    assert_close(D.bmm(W[0], exponent), W[0] @ expected, rtol=1e-7, atol=1e-9)


def test_decomposed_logdet_inv_square_form_and_len():
    K = random_kron(4)
    deltas = torch.tensor([0.3, 1.1, 0.5, 2.0], dtype=torch.float64)
    D = K.decompose() + deltas
    dense = dense_power(dense_blocks(K), deltas, 1)
    assert len(D) == 4
    assert_close(D.logdet(), torch.linalg.slogdet(dense)[1])
    W = torch.randn(3, 2, dense.shape[0], dtype=torch.float64)
    assert_close(D.inv_square_form(W), W @ torch.linalg.inv(dense) @ W.transpose(1, 2))
    assert_close(K.decompose().to_matrix(), K.to_matrix())


def test_decomposed_damping_mixes_the_prior_into_each_factor():
    K = random_kron(5)
    delta = torch.tensor(0.4, dtype=torch.float64)
    D = K.decompose(damping=True) + delta
    dense = damped_dense(K, delta)
    assert_close(D.to_matrix(), dense)
    assert_close(D.logdet(), torch.linalg.slogdet(dense)[1])
    assert (D * 2.0).damping and (D + delta).damping


def test_decomposed_is_differentiable_in_deltas_and_scale():
    K = random_kron(6)
    deltas = torch.tensor([0.3, 1.1, 0.5, 2.0], dtype=torch.float64, requires_grad=True)
    scale = torch.tensor(1.3, dtype=torch.float64, requires_grad=True)
    torch.autograd.gradcheck(lambda d, s: (K.decompose() * s + d).logdet(), (deltas, scale))


def test_decomposed_refuses_a_diagonal_delta():
    K = random_kron(0)
    with pytest.raises(ValueError, match="one value per block"):
        K.decompose() + torch.ones(K.to_matrix().shape[0], dtype=torch.float64)


# ------------------------------------------------- mixed blocks: diagonal factors and blocks
def _positive(n: int, gen: torch.Generator) -> torch.Tensor:
    return torch.rand(n, generator=gen, dtype=torch.float64) + 0.2


def mixed_kron(seed: int = 0) -> Kron:
    """Diagonal ⊗ dense (an embedding), dense ⊗ diagonal, both diagonal, dense, diagonal."""
    gen = torch.Generator().manual_seed(seed)
    return Kron(
        [
            [_positive(5, gen), _spd(3, gen)],
            [_spd(2, gen), _positive(4, gen)],
            [_positive(2, gen), _positive(3, gen)],
            [_spd(4, gen)],
            [_positive(6, gen)],
        ]
    )


def test_mixed_kron_dense_views_products_and_shapes():
    K = mixed_kron(0)
    dense = torch.block_diag(*kron_dense_blocks(K))
    assert K.shapes == [[(5,), (3, 3)], [(2, 2), (4,)], [(2,), (3,)], [(4, 4)], [(6,)]]
    assert_close(K.to_matrix(), dense)
    assert_close(K.diag(), dense.diagonal())
    assert_close(K.logdet(), torch.linalg.slogdet(dense)[1])
    W = torch.randn(3, 2, dense.shape[0], dtype=torch.float64)
    assert_close(K.bmm(W), W @ dense)
    zeros = Kron.zeros(K.shapes, torch.device("cpu"), torch.float64)
    assert zeros.shapes == K.shapes and not zeros.to_matrix().any()
    zeros += K
    assert_close(zeros.to_matrix(), dense)


@pytest.mark.parametrize("exponent", EXPONENTS)
def test_mixed_decomposed_matches_dense_powers(exponent):
    K = mixed_kron(1)
    deltas = torch.tensor([0.3, 1.1, 0.5, 2.0, 0.7], dtype=torch.float64)
    D = K.decompose() * 1.3 + deltas
    # a diagonal factor keeps no eigenvector matrix; its public eigenvectors are the identity
    implicit = [[Q is None for Q in D.factor_bases(i)] for i in range(len(D))]
    assert implicit == [[True, False], [False, True], [True, True], [False], [True]]
    for bases, public in zip(map(D.factor_bases, range(len(D))), D.eigenvectors):
        for Q, shown in zip(bases, public):
            assert_close(shown, torch.eye(len(shown), dtype=shown.dtype) if Q is None else Q)
    expected = dense_power([1.3 * b for b in kron_dense_blocks(K)], deltas, exponent)
    assert_close(D.to_matrix(exponent), expected, rtol=1e-7, atol=1e-9)
    assert_close(D.diag(exponent), expected.diagonal(), rtol=1e-7, atol=1e-9)
    W = torch.randn(3, 2, expected.shape[0], dtype=torch.float64)
    assert_close(D.bmm(W, exponent), W @ expected, rtol=1e-7, atol=1e-9)
    if exponent == -1:
        assert_close(D.inv_square_form(W), W @ expected @ W.transpose(1, 2))
        assert_close(D.logdet(), -torch.linalg.slogdet(expected)[1])


def test_mixed_decomposed_damping_and_deferred():
    K = mixed_kron(2)
    delta = torch.tensor(0.4, dtype=torch.float64)
    dense = damped_dense(K, delta)
    for deferred in (False, True):
        D = K.decompose(damping=True, deferred=deferred) + delta
        assert_close(D.to_matrix(), dense)
        assert_close(D.logdet(), torch.linalg.slogdet(dense)[1])
