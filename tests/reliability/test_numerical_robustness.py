"""Hard numerics: log-determinants, samples and predictions stay finite, or the error says why.

Singular curvature with tiny priors, huge priors, float32 models on many data points, half
precision (refused: see README, "Half precision"), indefinite curvature.
"""

from __future__ import annotations

import math

import pytest
import torch
from corpus import EXTRA
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from conftest import CASE_BUILDERS, Oracle, assert_close
from laplace import DiagLaplace, FullLaplace, Laplace
from laplace.structures import NotPositiveDefiniteError

#: Weight-space structures: (subset, structure).
STRUCTURES = [
    ("all", "full"),
    ("all", "diag"),
    ("all", "kron"),
    ("all", "lowrank"),
    ("last_layer", "full"),
    ("last_layer", "diag"),
    ("last_layer", "kron"),
    ("subnetwork", "full"),
]
IDS = ["/".join(s) for s in STRUCTURES]


def _fit(subset, structure, case, **kwargs):
    extra = {**EXTRA.get(subset, {}), **EXTRA.get(structure, {}), **kwargs}
    la = Laplace(case.model, case.likelihood, subset, structure, **extra)
    la.fit(case.loader())
    return la


def _all_finite(la, X) -> bool:
    out = la(X)
    outputs = out if isinstance(out, tuple) else (out,)
    return all(bool(torch.isfinite(t).all()) for t in (*outputs, la.sample(4)))


@pytest.mark.parametrize("prior", [1e-12, 1e-300])
@pytest.mark.parametrize(("subset", "structure"), STRUCTURES, ids=IDS)
def test_singular_curvature_with_tiny_prior_is_finite_or_explained(subset, structure, prior):
    """The softmax GGN is singular (rank C−1 per point): only the prior makes P definite."""
    case = CASE_BUILDERS["mlp_classification"]()
    la = _fit(subset, structure, case, prior_precision=prior)
    try:
        marglik = la.log_marginal_likelihood()
        finite = _all_finite(la, case.X[:5])
    except NotPositiveDefiniteError as error:  # a dense Cholesky below machine precision
        assert structure == "full" and prior == 1e-300
        assert "increase the prior precision" in str(error) and "float64" in str(error)
        return
    assert bool(torch.isfinite(marglik)) and finite


def test_tiny_prior_log_det_matches_the_dense_oracle():
    case = CASE_BUILDERS["mlp_classification"]()
    la = _fit("all", "full", case, prior_precision=1e-8)
    ggn = Oracle(case.model, "classification").ggn(case.X)
    expected = torch.linalg.eigvalsh(ggn + 1e-8 * torch.eye(len(ggn), dtype=ggn.dtype))
    assert_close(la.log_det_posterior_precision, expected.log().sum(), rtol=1e-6)


@pytest.mark.parametrize(("subset", "structure"), STRUCTURES, ids=IDS)
def test_huge_prior_precision_stays_finite(subset, structure):
    """With p₀ = 1e300 the posterior is the MAP up to ~1e-150: finite, tiny variances."""
    case = CASE_BUILDERS["mlp_regression_3out"]()
    la = _fit(subset, structure, case, prior_precision=1e300)
    assert bool(torch.isfinite(la.log_marginal_likelihood()))
    _, f_var = la(case.X[:4])
    assert bool(torch.isfinite(f_var).all()) and float(f_var.abs().max()) < 1e-290
    samples = la.sample(3)
    assert bool(torch.isfinite(samples).all())
    assert_close(samples, la.mean.expand(3, -1), rtol=0, atol=1e-140)


#: log det P of a float32 fit on 100k points against float64: the KFAC factors' small
#: eigenvalues are resolved relative to the largest one (~1e-7), the worst case (3.7e-4).
FLOAT32_LOG_DET_RTOL = 1e-3


def _float32_case(n: int):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 16), nn.Tanh(), nn.Linear(16, 3))
    X = torch.randn(n, 3)
    return model, DataLoader(TensorDataset(X, torch.randint(0, 3, (n,))), batch_size=n // 10)


#: Structures fitted on 100k float32 points in ``make test``; the others are slow cases.
FLOAT32_QUICK = [("all", "full"), ("all", "kron"), ("last_layer", "diag")]


@pytest.mark.parametrize(
    ("subset", "structure"),
    [
        pytest.param(*s, marks=() if s in FLOAT32_QUICK else pytest.mark.slow)
        for s in STRUCTURES
        if s[1] != "lowrank"
    ],
    ids=lambda s: s,
)
def test_float32_model_on_many_points(subset, structure):
    """float32 sums over 100k points agree with a float64 fit; the posterior is finite."""
    model, loader = _float32_case(100_000)
    extra = {**EXTRA.get(subset, {}), "prior_precision": 1.0}
    la32 = Laplace(model, "classification", subset, structure, **extra)
    la32.fit(loader)
    la64 = Laplace(model.double(), "classification", subset, structure, **extra)
    la64.fit(DataLoader(TensorDataset(*(t.double() if t.is_floating_point() else t
                                       for t in loader.dataset.tensors)),
                        batch_size=loader.batch_size))  # fmt: skip
    model.float()
    assert bool(torch.isfinite(la32.log_marginal_likelihood()))
    assert_close(la32.log_det_posterior_precision.double(), la64.log_det_posterior_precision,
                 rtol=FLOAT32_LOG_DET_RTOL, atol=0)  # fmt: skip
    assert bool(torch.isfinite(la32.sample(5)).all())


def test_float32_dense_cholesky_failure_says_why():
    """A tiny prior under 100k points' curvature is below float32 resolution: say so."""
    model, loader = _float32_case(100_000)
    la = FullLaplace(model, "classification", prior_precision=1e-6)
    la.fit(loader)
    with pytest.raises(NotPositiveDefiniteError, match=r"float32.*prior precision.*float64"):
        la.log_marginal_likelihood()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize(("subset", "structure"), [*STRUCTURES, ("all", "gp")], ids=[*IDS, "gp"])
def test_half_precision_networks_get_a_float32_posterior(subset, structure, dtype):
    case = CASE_BUILDERS["mlp_classification"]()
    model = case.model.to(dtype)
    extra = {**EXTRA.get(subset, {}), **EXTRA.get(structure, {})}
    la = Laplace(model, "classification", subset, structure, **extra)
    la.fit(DataLoader(TensorDataset(case.X.to(dtype), case.y), batch_size=5))
    assert la.mean.dtype == torch.float32
    assert math.isfinite(la.log_marginal_likelihood().item())
    probs = la(case.X[:3].to(dtype), link_approx="probit")
    assert probs.dtype == torch.float32 and bool(probs.isfinite().all())


def test_indefinite_curvature_is_explained_not_nan():
    """A diagonal with negative entries (an indefinite Hessian) and a tiny prior."""
    case = CASE_BUILDERS["mlp_classification"]()
    la = DiagLaplace(case.model, "classification", prior_precision=1e-6)
    la.fit(case.loader())
    la.H = la.H - 2 * la.H.max()
    for action in (lambda: la.log_marginal_likelihood(), lambda: la.sample(3)):
        with pytest.raises(NotPositiveDefiniteError, match=r"not positive definite.*Hessian"):
            action()


@pytest.mark.parametrize(
    ("subset", "structure"), [*STRUCTURES, ("all", "gp"), ("last_layer", "gp")], ids=str
)
def test_a_single_data_point_fits(subset, structure):
    """N = 1 (one row of curvature, rank ≤ C) gives a finite posterior everywhere."""
    case = CASE_BUILDERS["mlp_classification"]()
    case.X, case.y = case.X[:1], case.y[:1]
    extra = {"n_subset": 1} if structure == "gp" else {}
    la = _fit(subset, structure, case, **extra)
    assert la.n_data == 1
    assert bool(torch.isfinite(la.log_marginal_likelihood()))
    assert bool(torch.isfinite(la(case.X)).all())
