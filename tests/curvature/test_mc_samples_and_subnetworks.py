"""Per-call Monte-Carlo samples of the stochastic GGN, and every GGN/EF backend on a subnetwork.

The Monte-Carlo Fisher with k sampled targets per data point is an unbiased estimate of the
exact GGN whose squared Frobenius error has expectation ``v / k``, where ``v`` is computed
exactly here by enumerating the classes of each data point:

    v = Σₙ Σ_c pₙ_c ‖Aₙ(c) − Jₙᵀ Λₙ Jₙ‖²_F,   Aₙ(c) = Jₙᵀ gₙ(c) gₙ(c)ᵀ Jₙ,  gₙ(c) = pₙ − e_c.

By Markov's inequality the error exceeds ``T · v / k`` with probability at most ``1/T``; the
tests use a fixed seed and ``T = MARKOV_FACTOR``, so the tolerance shrinks as ``1/k``.
"""

from __future__ import annotations

import pytest
import torch
from backend_cases import BACKENDS, ids

from conftest import CASE_BUILDERS, Oracle, assert_close
from laplace import Laplace
from laplace.curvature import CurvlinopsEF, CurvlinopsGGN

#: Markov factor T of the Monte-Carlo tolerance ``T · v / k`` (false alarm at most 1/T).
MARKOV_FACTOR = 25.0
SAMPLE_COUNTS = [1, 10, 100, 1000]


def _single_sample_terms(case, oracle):
    """Per point and class: probability p (N, C), ``Aₙ(c)`` (N, C, P, P), exact ``Gₙ``."""
    J = oracle.jacobian(case.X)
    p = torch.softmax(oracle.f(oracle.theta, case.X), dim=-1).detach()
    g = p[:, None, :] - torch.eye(p.shape[1], dtype=p.dtype)  # (N, C, C): g_n(c)
    Jg = torch.einsum("nkp,nck->ncp", J, g)  # Jₙᵀ gₙ(c)
    A = Jg[..., :, None] * Jg[..., None, :]
    G_n = torch.einsum("nc,ncpq->npq", p, A)  # the exact per-point GGN
    return p, A, g, G_n


def test_mc_ggn_approaches_the_exact_ggn_as_the_sample_count_grows():
    case = CASE_BUILDERS["mlp_classification"]()
    oracle = Oracle(case.model, case.likelihood)
    p, A, _, G_n = _single_sample_terms(case, oracle)
    assert_close(G_n.sum(0), oracle.ggn(case.X))
    v = torch.einsum("nc,ncpq->", p, (A - G_n[:, None]).square())
    backend = CurvlinopsGGN(case.model, "classification", stochastic=True)
    torch.manual_seed(0)
    errors = []
    for k in SAMPLE_COUNTS:
        _, G_k = backend.full(case.X, case.y, mc_samples=k)
        errors.append((G_k - oracle.ggn(case.X)).square().sum())
        assert errors[-1] <= MARKOV_FACTOR * v / k, f"k={k}: {errors[-1]} > {MARKOV_FACTOR}·v/k"
    assert errors[-1] < errors[0] / 10


def test_mc_kron_approaches_the_exact_output_curvature_as_the_sample_count_grows():
    # The last bias's KFAC block is Σₙ Mₙ with Mₙ the output-space curvature: Λₙ exactly, or
    # the mean of gₙ(ŷ) gₙ(ŷ)ᵀ over k sampled targets.
    case = CASE_BUILDERS["mlp_classification"]()
    oracle = Oracle(case.model, case.likelihood)
    p, _, g, _ = _single_sample_terms(case, oracle)
    outer = g[..., :, None] * g[..., None, :]  # (N, C, C, C)
    Lam = torch.einsum("nc,ncij->nij", p, outer)
    w = torch.einsum("nc,ncij->", p, (outer - Lam[:, None]).square())
    N = len(case.X)
    exact = CurvlinopsGGN(case.model, "classification").kron(case.X, case.y, N=N)[1]
    assert_close(exact.kfacs[-1][0], Lam.sum(0))
    backend = CurvlinopsGGN(case.model, "classification", stochastic=True)
    torch.manual_seed(1)
    for k in SAMPLE_COUNTS:
        bias_block = backend.kron(case.X, case.y, N, mc_samples=k)[1].kfacs[-1][0]
        error = (bias_block - Lam.sum(0)).square().sum()
        assert error <= MARKOV_FACTOR * w / k, f"k={k}: {error} > {MARKOV_FACTOR}·w/k"


@pytest.mark.parametrize("route", ["full", "diag", "kron"])
def test_mc_samples_per_call_equals_num_samples(route):
    case = CASE_BUILDERS["mlp_classification"]()
    args = {"N": len(case.X)} if route == "kron" else {}
    per_call = CurvlinopsGGN(case.model, "classification", stochastic=True)
    configured = CurvlinopsGGN(case.model, "classification", stochastic=True, num_samples=7)
    torch.manual_seed(3)
    _, H_call = getattr(per_call, route)(case.X, case.y, mc_samples=7, **args)
    torch.manual_seed(3)
    _, H_configured = getattr(configured, route)(case.X, case.y, **args)
    dense = [H.to_matrix() if route == "kron" else H for H in (H_call, H_configured)]
    assert_close(dense[0], dense[1])


def test_mc_samples_is_refused_where_nothing_is_sampled():
    case = CASE_BUILDERS["mlp_classification"]()
    for backend in (
        CurvlinopsGGN(case.model, "classification"),
        CurvlinopsEF(case.model, "classification"),
    ):
        with pytest.raises(ValueError, match="mc_samples"):
            backend.full(case.X, case.y, mc_samples=4)
    stochastic = CurvlinopsGGN(case.model, "classification", stochastic=True)
    with pytest.raises(ValueError, match="mc_samples must be a positive integer"):
        stochastic.diag(case.X, case.y, mc_samples=0)
    with pytest.raises(ValueError, match="unknown keyword arguments \\['samples'\\]"):
        stochastic.full(case.X, case.y, samples=4)


SUBNET_BACKENDS = [b for b in BACKENDS if b.kind in ("ggn", "ef")]


@pytest.mark.parametrize("structure", ["full", "diag"])
@pytest.mark.parametrize("case_name", ["mlp_regression_3out", "mlp_classification"])
@pytest.mark.parametrize("row", SUBNET_BACKENDS, ids=ids(SUBNET_BACKENDS))
def test_every_ggn_and_ef_backend_fits_a_subnetwork(row, case_name, structure):
    case = CASE_BUILDERS[case_name]()
    oracle = Oracle(case.model, case.likelihood)
    idx = torch.tensor([30, 3, 17, 8, 25])
    la = Laplace(
        case.model,
        case.likelihood,
        "subnetwork",
        structure,
        subnetwork_indices=idx,
        backend=row.cls,
    )
    la.fit(case.loader())
    expected = row.reference(oracle, case.X, case.y)[idx][:, idx]
    assert_close(la.H, expected if structure == "full" else expected.diagonal())
