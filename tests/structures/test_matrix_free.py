"""The matrix-free posterior (``hessian_structure="matfree"``) against the exact dense one.

``MatFreeLaplace`` has the precision ``P = H/(σ²T) + diag(p₀)`` of ``FullLaplace`` on the same
model and data (whose dense ``H`` is itself checked against the ``torch.func`` oracles of
``conftest.py``), used only through products. Tested here, on float64 tiny models:

- the products: ``H V`` for ``V = I`` is the exact GGN / empirical Fisher, the preconditioner's
  diagonal its diagonal; a Monte-Carlo Fisher is one fixed symmetric PSD matrix;
- the GLM predictive by conjugate gradients (Jacobian-free trace route and dense rows, joint
  covariance, probit probabilities) equals ``FullLaplace``'s, for scalar, layer-wise and
  diagonal priors and the GGN and EF backends; the sampled route is within its Monte-Carlo
  error and ``predictive="auto"`` picks it only for more output rows than samples;
- sample-then-optimise draws have the exact posterior covariance (within Monte-Carlo error);
- stochastic Lanczos quadrature: the exact ``log det P`` with spanning probes, and otherwise
  estimates (and the prior derivative ``tr P⁻¹``) within three of their reported standard
  errors over seeds; the marginal likelihood's gradients in the prior precision and σ (exact,
  or equal to finite differences of the estimate), prior tuning;
- state dicts, refusals of bad settings, non-convergence, the unfitted prior and a distributed
  fit on two gloo processes.
"""

from __future__ import annotations

import dataclasses
import datetime
import io
import os
import socket
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils.data import DataLoader, SequentialSampler, Subset, TensorDataset

from conftest import CASE_BUILDERS, Oracle, assert_close, assert_marglik_matches
from laplace import FullLaplace, KronLaplace, Laplace, MatFreeLaplace
from laplace.curvature import CurvlinopsEF, CurvlinopsGGN, CurvlinopsHessian
from laplace.curvature.solvers import products
from laplace.structures.jacobians import LayerTrace
from laplace.structures.matrix_free import ConvergenceError, MatFreePosterior, NoProductDataError
from laplace.utils.data import in_fixed_order
from laplace.utils.distributed import DistributedFitError, all_gather

#: Conjugate-gradient tolerance of the comparisons with the dense posterior.
EXACT_TOL = 1e-10
#: Relative error (to the largest entry) of CG predictive variances at ``EXACT_TOL``.
RTOL_PREDICTIVE = 1e-6
#: Products with the identity against the dense curvature.
RTOL_CURVATURE, ATOL_CURVATURE = 1e-10, 1e-12
#: Log-determinant and marginal likelihood from spanning probes (P probes of P steps).
RTOL_LOG_DET = 1e-8
#: Gradients of the estimated marginal likelihood against central differences of it.
FD_STEP, RTOL_FD, ATOL_FD = 1e-6, 1e-6, 1e-7
#: A prior precision found by tuning the estimate against the dense one's.
RTOL_TUNED = 1e-4
#: Sampled GLM variances: S posterior samples give a variance with relative standard deviation
#: √(2/S); five of them.
VARIANCE_SAMPLES = 4000
RTOL_SAMPLED_VARIANCE = 5 * (2 / VARIANCE_SAMPLES) ** 0.5
#: Monte-Carlo tolerance of a sample correlation: about 5 standard errors of 20,000 draws
#: (the standard error of a correlation is at most √(2/S)); ``mc_atol`` scales it to S draws.
MC_DRAWS, MC_ATOL = 20_000, 0.04
#: Draws of the quick sample-covariance check (the 20,000 of ``MC_DRAWS`` run as slow).
QUICK_DRAWS = 4000
#: Tolerance of the sample-then-optimise solves in the Monte-Carlo checks (its error is far
#: below their Monte-Carlo error).
SAMPLING_TOL = 1e-6
#: A solver block of 4 KiB: one CG column (six vectors of 44 weights) per block, and too little
#: for a reorthogonalised Lanczos basis.
SMALL_BLOCK_BYTES = 4096
#: Stochastic Lanczos quadrature over seeds: probes, steps, seeds, the estimates' allowed
#: distance in reported standard errors, and the misses allowed (a Student t with 9 degrees of
#: freedom exceeds 3 with probability 0.015: 0.3 misses expected in 20 seeds).
SLQ_PROBES, SLQ_STEPS, SLQ_SEEDS, SLQ_SIGMAS, SLQ_MISSES = 10, 40, 20, 3.0, 1
PRIOR, SIGMA = 0.7, 0.8
CASES = ["mlp_classification", "mlp_regression_3out", "cnn_classification"]
BACKENDS = {"ggn": None, "ef": CurvlinopsEF}


def mc_atol(draws: int) -> float:
    """``MC_ATOL`` scaled from ``MC_DRAWS`` to ``draws`` draws (as 1/√S)."""
    return MC_ATOL * (MC_DRAWS / draws) ** 0.5


def build(name: str, backend=None, prior_precision=PRIOR, batch_size=None, **options):
    """A case with a ``FullLaplace`` and a ``MatFreeLaplace`` fitted on the same data.

    Args:
        name: A key of ``CASE_BUILDERS``.
        backend: The curvature backend of both (None: the default GGN).
        prior_precision: Prior precision of both.
        batch_size: Batch size of the training loader (None: the case's).
        **options: Solver settings of the ``MatFreeLaplace``.

    Returns:
        ``(case, full, la)``; regression cases have ``sigma_noise = SIGMA``.
    """
    case = CASE_BUILDERS[name]()
    kwargs = {"backend": backend, "prior_precision": prior_precision}
    if case.likelihood == "regression":
        kwargs["sigma_noise"] = SIGMA
    full = FullLaplace(case.model, case.likelihood, **kwargs)
    full.fit(case.loader(batch_size))
    la = MatFreeLaplace(case.model, case.likelihood, **kwargs, **options)
    la.fit(case.loader(batch_size))
    return case, full, la


def exact_options(n_params: int, **options) -> dict:
    """Settings whose every result is exact: tight CG, spanning probes, full Lanczos runs.

    Args:
        n_params: P, the number of probes and of Lanczos steps.
        **options: Further (or overriding) settings.
    """
    return {
        "tol": EXACT_TOL,
        "predictive": "cg",
        "preconditioner": "diag",
        "n_probes": n_params,
        "lanczos_steps": n_params,
        **options,
    }


def n_params_of(name: str) -> int:
    """Number of weights of a case's model."""
    return sum(p.numel() for p in CASE_BUILDERS[name]().model.parameters())


def assert_relative(actual: torch.Tensor, expected: torch.Tensor, rtol: float) -> None:
    """``actual`` equals ``expected`` to ``rtol`` relative to the largest entry of ``expected``."""
    expected = torch.as_tensor(expected).detach()
    assert_close(actual, expected, rtol=rtol, atol=rtol * float(expected.abs().max()))


def query_points(case, n: int = 5) -> torch.Tensor:
    """Test inputs of a case's shape, from a fixed generator.

    Args:
        case: A ``conftest.Case``.
        n: Number of points.
    """
    generator = torch.Generator().manual_seed(123)
    return torch.randn(n, *case.X.shape[1:], generator=generator, dtype=torch.float64)


def count_trace_route(monkeypatch) -> list:
    """A list that grows by one per call of the Jacobian-free ``LayerTrace`` closed form."""
    calls = []
    original = MatFreePosterior.closed_forms[LayerTrace]
    monkeypatch.setitem(
        MatFreePosterior.closed_forms,
        LayerTrace,
        lambda posterior, J: calls.append(1) or original(posterior, J),
    )
    return calls


# ------------------------------------------------------------------------------ products
@pytest.mark.parametrize("family", list(BACKENDS))
@pytest.mark.parametrize("name", ["mlp_classification", "cnn_classification"])
def test_products_with_the_identity_are_the_exact_curvature(name, family):
    case, full, la = build(name, backend=BACKENDS[family], preconditioner="diag")
    oracle = Oracle(case.model, case.likelihood)
    exact = oracle.ef(case.X, case.y) if family == "ef" else oracle.ggn(case.X)
    P = la.n_params
    assert la.product_count == 0  # fit keeps the data and the diagonal, no product
    dense = la.H.matmat(torch.eye(P, dtype=torch.float64))
    assert la.product_count == P
    assert_close(dense, exact, RTOL_CURVATURE, ATOL_CURVATURE)
    assert_close(dense, full.H, RTOL_CURVATURE, ATOL_CURVATURE)
    assert_close(la.H.diagonal, exact.diagonal(), RTOL_CURVATURE, ATOL_CURVATURE)
    # the posterior precision as an operator on vectors and blocks
    V = torch.randn(P, 3, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    assert la.posterior_precision.shape == (P, P)
    assert_close(la.posterior_precision @ V, full.posterior_precision @ V, RTOL_CURVATURE)
    assert_close(la.posterior_precision @ V[:, 0], full.posterior_precision @ V[:, 0])


@pytest.mark.parametrize("name", ["mlp_classification", "cnn_classification"])
def test_single_vectors_and_batches_recorded_on_every_pass_give_the_exact_curvature(name):
    """A single vector takes a Linear weight's part in place in the result; with no batch kept
    between passes, each is recorded anew and released once used: one batch held at a time."""
    _, full, la = build(name, batch_size=4, cache_bytes=0)
    eye = torch.eye(la.n_params, dtype=torch.float64)
    columns = torch.cat([la.H.matmat(eye[:, [j]]) for j in range(0, la.n_params, 97)], dim=1)
    assert_close(columns, full.H[:, ::97], RTOL_CURVATURE, ATOL_CURVATURE)
    assert_close(la.H.matmat(eye), full.H, RTOL_CURVATURE, ATOL_CURVATURE)
    product = la.H.product
    assert not product._kept
    held = []
    for vectors in product.batches():
        assert all(not earlier.output_gradients for earlier in held)
        assert vectors.output_gradients
        held.append(vectors)


def test_a_shuffling_loader_is_read_in_order_for_products(monkeypatch):
    """Products keep some batches between passes: a loader that shuffles on every pass must not
    give later passes other points in the places of the kept ones (matrix-free and low-rank)."""
    case = CASE_BUILDERS["mlp_classification"]()
    shuffled = DataLoader(TensorDataset(case.X, case.y), batch_size=5, shuffle=True)
    assert isinstance(in_fixed_order(shuffled).sampler, SequentialSampler)
    assert in_fixed_order(case.loader(5)) is not None
    full = FullLaplace(case.model, case.likelihood)
    full.fit(shuffled)
    eye = torch.eye(full.n_params, dtype=torch.float64)
    probe = MatFreeLaplace(case.model, case.likelihood)
    probe.fit(shuffled)
    probe.H.matmat(eye[:, :1])
    some_batches = 2 * probe.H.product._kept[0].nbytes  # keeps two of the four batches
    la = MatFreeLaplace(case.model, case.likelihood, cache_bytes=some_batches)
    la.fit(shuffled)
    for _ in range(2):  # the first pass keeps batches, the second reuses them
        assert_close(la.H.matmat(eye), full.H, RTOL_CURVATURE, ATOL_CURVATURE)
    kept = la.H.product._kept
    assert 0 < len(kept) < len(shuffled)  # some batches kept, not all
    monkeypatch.setattr(products, "PASS_CACHE_BYTES", some_batches)
    exact = {"n_eigenvalues": 3, "solver": "lanczos"}
    lowrank = Laplace(case.model, case.likelihood, "all", "lowrank", backend_kwargs=exact)
    lowrank.fit(shuffled)
    top = torch.linalg.eigvalsh(full.H).flip(0)[:3]
    assert_close(lowrank.H[1], top, rtol=1e-8, atol=1e-10)


def test_monte_carlo_fisher_is_one_symmetric_psd_matrix():
    options = {
        "backend": CurvlinopsGGN,
        "backend_kwargs": {"stochastic": True},
        "preconditioner": "diag",
    }
    case, _, la = build("mlp_classification", **options)
    eye = torch.eye(la.n_params, dtype=torch.float64)
    dense = la.H.matmat(eye)
    assert torch.equal(dense, la.H.matmat(eye))  # every pass samples the same targets
    assert_close(dense, dense.T, rtol=0, atol=ATOL_CURVATURE)
    assert torch.linalg.eigvalsh(dense).min() >= -ATOL_CURVATURE * float(dense.abs().max())
    assert_close(la.H.diagonal, dense.diagonal(), RTOL_CURVATURE, ATOL_CURVATURE)
    exact = Oracle(case.model, case.likelihood).ggn(case.X)
    assert (dense - exact).abs().max() > 1e-3 * exact.abs().max()  # a sampled matrix
    # the same matrix when no batch is kept between passes (each pass records them again)
    uncached = MatFreeLaplace(case.model, case.likelihood, cache_bytes=0, **options)
    uncached.fit(case.loader())
    assert_close(uncached.H.matmat(eye), dense, RTOL_CURVATURE, ATOL_CURVATURE)
    other = MatFreeLaplace(case.model, case.likelihood, seed=1, **options)
    other.fit(case.loader())
    assert (other.H.matmat(eye) - dense).abs().max() > 1e-3 * dense.abs().max()
    # the CG predictive is that of the dense posterior on this matrix
    full = FullLaplace(case.model, case.likelihood, prior_precision=PRIOR)
    full.fit(case.loader())
    full.H = dense
    cg = MatFreeLaplace(
        case.model,
        case.likelihood,
        prior_precision=PRIOR,
        tol=EXACT_TOL,
        predictive="cg",
        **options,
    )
    cg.fit(case.loader())
    X = query_points(case)
    _, f_var = cg._glm_predictive_distribution(X)
    assert_relative(f_var, full._glm_predictive_distribution(X)[1], RTOL_PREDICTIVE)


# ---------------------------------------------------------------------------- predictive
@pytest.mark.parametrize("family", list(BACKENDS))
@pytest.mark.parametrize("name", CASES)
def test_cg_predictive_equals_full_laplace(name, family, monkeypatch):
    case, full, la = build(name, backend=BACKENDS[family], tol=EXACT_TOL, predictive="cg")
    calls = count_trace_route(monkeypatch)
    X = query_points(case, 3)
    f_mu, f_var = la._glm_predictive_distribution(X)
    assert calls  # the Jacobian-free route
    expected_mu, expected_var = full._glm_predictive_distribution(X)
    assert_close(f_mu, expected_mu)
    assert_relative(f_var, expected_var, RTOL_PREDICTIVE)
    report = la.solve_report
    assert report.converged and (report.relative_residuals <= EXACT_TOL).all()
    assert len(report.relative_residuals) == len(X) * case.n_outputs
    # dense Jacobian rows
    J = Oracle(case.model, case.likelihood).jacobian(X)
    assert_relative(la.functional_variance(J), full.functional_variance(J), RTOL_PREDICTIVE)
    if case.likelihood == "classification":
        probs = la(X, link_approx="probit")
        assert_relative(probs, full(X, link_approx="probit"), RTOL_PREDICTIVE)
    else:
        f_mu, f_var = la(X)
        assert_relative(f_var, full(X)[1], RTOL_PREDICTIVE)


@pytest.mark.parametrize("prior", ["layerwise", "diag"])
@pytest.mark.parametrize("name", ["mlp_regression_3out", "cnn_classification"])
def test_cg_predictive_with_layerwise_and_diagonal_priors(name, prior):
    case = CASE_BUILDERS[name]()
    n_layers = len(list(case.model.parameters()))
    n = n_layers if prior == "layerwise" else n_params_of(name)
    precision = torch.linspace(0.3, 3.0, n, dtype=torch.float64)
    _, full, la = build(name, prior_precision=precision, tol=EXACT_TOL, predictive="cg")
    X = query_points(case)
    assert_relative(
        la._glm_predictive_distribution(X)[1],
        full._glm_predictive_distribution(X)[1],
        RTOL_PREDICTIVE,
    )


def test_joint_regression_covariance_equals_full_laplace():
    case, full, la = build("mlp_regression_3out", tol=EXACT_TOL, predictive="samples")
    X = query_points(case, 4)
    f_mu, f_cov = la._glm_predictive_distribution(X, joint=True)  # always by CG
    expected_mu, expected_cov = full._glm_predictive_distribution(X, joint=True)
    assert f_cov.shape == (12, 12)
    assert_close(f_mu, expected_mu)
    assert_relative(f_cov, expected_cov, RTOL_PREDICTIVE)
    assert len(la.solve_report.relative_residuals) == 12


def test_sampled_variances_are_within_monte_carlo_error():
    options = {"predictive": "samples", "variance_samples": VARIANCE_SAMPLES, "tol": SAMPLING_TOL}
    case, full, la = build("mlp_classification", batch_size=20, **options)
    X = query_points(case)
    _, f_var = la._glm_predictive_distribution(X)
    _, expected = full._glm_predictive_distribution(X)
    assert len(la.solve_report.relative_residuals) == VARIANCE_SAMPLES
    variances, expected_variances = (
        f_var.diagonal(dim1=1, dim2=2),
        expected.diagonal(dim1=1, dim2=2),
    )
    relative = (variances / expected_variances - 1).abs()
    assert relative.max() < RTOL_SAMPLED_VARIANCE, relative.max()
    assert relative.max() > 1e-6  # not the CG values: the Monte-Carlo estimate
    # the samples are kept for these hyperparameters: a second call solves nothing
    products = la.product_count
    _, again = la._glm_predictive_distribution(X[:2])
    assert la.product_count == products
    assert_close(again, f_var[:2], rtol=1e-12, atol=0)


def test_auto_predictive_takes_samples_only_for_more_rows_than_samples():
    name, S = "mlp_classification", 10  # 4 outputs: 2 points are 8 rows, 3 points 12
    options = {"variance_samples": S, "tol": EXACT_TOL}
    case, full, auto = build(name, predictive="auto", **options)
    X = query_points(case, 3)
    _, few = auto._glm_predictive_distribution(X[:2])
    assert len(auto.solve_report.relative_residuals) == 8  # CG on the 8 rows
    assert_relative(few, full._glm_predictive_distribution(X[:2])[1], RTOL_PREDICTIVE)
    _, many = auto._glm_predictive_distribution(X)
    assert len(auto.solve_report.relative_residuals) == S  # S posterior samples
    *_, sampled = build(name, predictive="samples", **options)
    assert_close(many, sampled._glm_predictive_distribution(X)[1], rtol=1e-10, atol=1e-14)
    *_, cg = build(name, predictive="cg", **options)
    _, exact = cg._glm_predictive_distribution(X)
    assert_relative(exact, full._glm_predictive_distribution(X)[1], RTOL_PREDICTIVE)
    assert (many - exact).abs().max() > 1e-3 * exact.abs().max()  # ten samples: far off


def test_sampled_predictive_costs_the_same_products_for_any_number_of_points():
    """The sampled route's solves do not depend on the test points: 2 points and 300 (more than
    one chunk) cost the same curvature-vector products (samples not kept between calls: a
    small solver block)."""
    name = "mlp_classification"
    one_column = 7 * n_params_of(name) * 8  # a solver block of one float64 column
    case, _, la = build(name, predictive="samples", variance_samples=8, block_bytes=one_column)
    X = query_points(case, 300)  # more than a chunk of 256 points
    costs = []
    for n in (2, 300, 2):
        before = la.product_count
        la._glm_predictive_distribution(X[:n])
        costs.append(la.product_count - before)
    assert costs[0] == costs[1] == costs[2] > 0
    assert la.H.sample_cache is None


def test_small_solver_blocks_give_the_same_results():
    """A solver block of a few KiB: CG a column at a time, Lanczos without reorthogonalisation."""
    name = "mlp_classification"
    P = n_params_of(name)
    case, full, la = build(name, block_bytes=SMALL_BLOCK_BYTES, **exact_options(P))
    B = torch.randn(P, 6, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    X = la._posterior.solve(B)
    assert len(la.solve_report.relative_residuals) == 6 and la.solve_report.converged
    assert_relative(X, full.posterior_covariance @ B, RTOL_PREDICTIVE)
    inputs = query_points(case)
    assert_relative(
        la._glm_predictive_distribution(inputs)[1],
        full._glm_predictive_distribution(inputs)[1],
        RTOL_PREDICTIVE,
    )
    assert_close(la.log_det_posterior_precision, full.log_det_posterior_precision, RTOL_LOG_DET)
    assert la.log_det_report.products == P * P  # no reorthogonalisation: every step is run


# ------------------------------------------------------------------------------- samples
@pytest.mark.parametrize("draws", [QUICK_DRAWS, pytest.param(MC_DRAWS, marks=pytest.mark.slow)])
def test_samples_have_the_dense_posterior_covariance(draws):
    options = {"prior_precision": 2.0, "batch_size": 20, "tol": SAMPLING_TOL}
    _, full, la = build("mlp_regression_3out", **options)
    covariance = full.posterior_covariance
    samples = la.sample(draws, generator=torch.Generator().manual_seed(0))
    assert samples.shape == (draws, la.n_params)
    empirical = torch.cov((samples - la.mean).T)
    std = covariance.diagonal().sqrt()
    assert ((empirical - covariance) / torch.outer(std, std)).abs().max() < mc_atol(draws)
    mean_error = (samples.mean(0) - la.mean) / std
    assert mean_error.abs().max() < 5 / draws**0.5
    again = la.sample(3, generator=torch.Generator().manual_seed(0))
    assert_close(again, la.sample(3, generator=torch.Generator().manual_seed(0)), 1e-12, 0)


# ------------------------------------------------------------------------- log-determinant
def priors_of(kind: str, name: str) -> torch.Tensor | float:
    """A scalar, layer-wise or diagonal prior precision for a case's model."""
    if kind == "scalar":
        return PRIOR
    model = CASE_BUILDERS[name]().model
    n = len(list(model.parameters())) if kind == "layerwise" else n_params_of(name)
    return torch.linspace(0.3, 3.0, n, dtype=torch.float64)


@pytest.mark.parametrize(
    ("name", "kind"),
    [
        ("mlp_classification", "scalar"),
        ("mlp_classification", "layerwise"),
        ("mlp_classification", "diag"),
        ("mlp_regression_3out", "scalar"),
        ("cnn_classification", "scalar"),
    ],
)
def test_log_det_is_exact_with_spanning_probes(name, kind):
    P = n_params_of(name)
    _, full, la = build(name, prior_precision=priors_of(kind, name), **exact_options(P))
    assert_close(la.log_det_posterior_precision, full.log_det_posterior_precision, RTOL_LOG_DET)
    report = la.log_det_report
    assert report.standard_error == 0 and report.n_probes == P and report.steps == P
    assert 0 < report.products <= P * P
    assert_close(la.log_marginal_likelihood(), full.log_marginal_likelihood(), RTOL_LOG_DET)
    if kind == "scalar":
        assert_close(report.prior_gradient, full.posterior_covariance.trace(), RTOL_LOG_DET)
        assert report.prior_gradient_standard_error == 0
    else:
        assert report.prior_gradient is None


def test_a_constant_diagonal_prior_takes_the_scalar_path():
    name = "mlp_classification"
    options = {"n_probes": 6, "lanczos_steps": 15}
    case, _, scalar = build(name, **options)
    constant = torch.full((scalar.n_params,), PRIOR, dtype=torch.float64)
    diagonal = MatFreeLaplace(case.model, case.likelihood, prior_precision=constant, **options)
    diagonal.fit(case.loader())
    assert_close(
        diagonal.log_det_posterior_precision, scalar.log_det_posterior_precision, 1e-12, 0
    )
    assert diagonal.log_det_report.prior_gradient is not None  # Lanczos on H itself
    # the diagonal path, at a prior that differs in one weight, is on D^-1/2 H D^-1/2
    constant[0] = 2 * PRIOR
    diagonal.prior_precision = constant
    assert torch.isfinite(diagonal.log_det_posterior_precision)
    assert diagonal.log_det_report.prior_gradient is None


@pytest.mark.parametrize("kind", ["scalar", "diag"])
def test_log_det_estimates_are_within_their_standard_errors_over_seeds(kind):
    name = "mlp_classification"
    prior = priors_of(kind, name)
    options = {"n_probes": SLQ_PROBES, "lanczos_steps": SLQ_STEPS, "preconditioner": None}
    case, full, _ = build(name, prior_precision=prior)
    loader = case.loader(len(case.X))  # one batch: one pass per Lanczos step is quick
    exact = float(full.log_det_posterior_precision)
    trace = float(full.posterior_covariance.trace())
    misses, gradient_misses, estimates = 0, 0, []
    for seed in range(SLQ_SEEDS):
        la = MatFreeLaplace(
            case.model, case.likelihood, prior_precision=prior, seed=seed, **options
        )
        la.fit(loader)
        estimate = float(la.log_det_posterior_precision)
        report = la.log_det_report
        assert report.estimate == estimate and report.n_probes == SLQ_PROBES
        assert report.steps == SLQ_STEPS and report.standard_error > 0
        estimates.append(estimate)
        misses += abs(estimate - exact) > SLQ_SIGMAS * report.standard_error
        if kind == "scalar":
            error = abs(report.prior_gradient - trace)
            gradient_misses += error > SLQ_SIGMAS * report.prior_gradient_standard_error
    assert len(set(estimates)) == SLQ_SEEDS  # every seed its own probes
    assert misses <= SLQ_MISSES, (misses, exact, estimates)
    assert gradient_misses <= SLQ_MISSES


@pytest.mark.parametrize("name", ["mlp_classification", "mlp_regression_3out"])
def test_marglik_gradients_equal_full_laplace_with_spanning_probes(name):
    case, full, la = build(name, **exact_options(n_params_of(name)))
    la.log_marginal_likelihood()
    products = la.product_count
    assert products > 0
    assert_marglik_matches(la, full, case.likelihood, [0.7, 3.0], RTOL_LOG_DET, RTOL_LOG_DET)
    assert la.product_count == products  # every (prior, σ) from the one Lanczos run


def test_marglik_gradients_equal_finite_differences_of_the_estimate():
    _, _, la = build("mlp_regression_3out", n_probes=5, lanczos_steps=20)
    prior = torch.tensor(0.9, dtype=torch.float64, requires_grad=True)
    sigma = torch.tensor(SIGMA, dtype=torch.float64, requires_grad=True)
    grads = torch.autograd.grad(la.log_marginal_likelihood(prior, sigma), (prior, sigma))
    assert la.log_det_report.standard_error > 0  # an estimate
    products = la.product_count
    with torch.no_grad():
        for i, (p, s) in enumerate([(FD_STEP, 0.0), (0.0, FD_STEP)]):
            up = la.log_marginal_likelihood(prior + p, sigma + s)
            down = la.log_marginal_likelihood(prior - p, sigma - s)
            assert_close((up - down) / (2 * FD_STEP), grads[i], rtol=RTOL_FD, atol=ATOL_FD)
    assert la.product_count == products


def test_gradient_wrt_a_layerwise_prior_is_refused():
    _, _, la = build("mlp_regression_3out", n_probes=4, lanczos_steps=10)
    prior = torch.linspace(0.5, 2.0, la.n_layers, dtype=torch.float64, requires_grad=True)
    with pytest.raises(ValueError, match="scalar prior"):
        la.log_marginal_likelihood(prior)
    with torch.no_grad():
        assert torch.isfinite(la.log_marginal_likelihood(prior.detach()))


@pytest.mark.parametrize("method", ["marglik", "gridsearch"])
def test_prior_tuning_finds_the_dense_posteriors_prior(method):
    name = "mlp_classification"
    case, full, la = build(name, batch_size=20, **exact_options(n_params_of(name)))
    if method == "marglik":
        la.log_marginal_likelihood()
        products = la.product_count
        kwargs = {"n_steps": 50}
    else:
        val = DataLoader(TensorDataset(case.X[:6], case.y[:6]), batch_size=6)
        kwargs = {"val_loader": val, "grid_size": 3}
    for approx in (la, full):
        approx.optimize_prior_precision(method=method, **kwargs)
    assert_close(la.prior_precision, full.prior_precision, rtol=RTOL_TUNED, atol=0)
    assert not torch.equal(la.prior_precision, torch.tensor([PRIOR], dtype=torch.float64))
    if method == "marglik":
        assert la.product_count == products  # tuned from the one Lanczos run


# ----------------------------------------------------------------------------- state dict
def round_trip(state: dict) -> dict:
    """``state`` through ``torch.save`` / ``torch.load(weights_only=True)``."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True, map_location="cpu")


def test_state_dict_keeps_the_quadrature_and_settings_not_the_data():
    options = {
        "tol": 1e-9,
        "n_probes": 7,
        "lanczos_steps": 12,
        "seed": 3,
        "max_iter": 77,
        "preconditioner": "diag",
    }
    case, _, la = build("mlp_classification", **options)
    marglik = la.log_marginal_likelihood()
    other_prior = la.log_marginal_likelihood(torch.tensor(2.5, dtype=torch.float64))
    la.prior_precision = PRIOR
    state = round_trip(la.state_dict())
    other = MatFreeLaplace(case.model, case.likelihood, prior_precision=PRIOR)
    other.load_state_dict(state)
    assert other.solver_options == la.solver_options
    assert other.solver_options.n_probes == 7 and other.solver_options.max_iter == 77
    assert torch.equal(other.log_marginal_likelihood(), marglik)
    assert torch.equal(
        other.log_marginal_likelihood(torch.tensor(2.5, dtype=torch.float64)), other_prior
    )
    assert other.product_count == 0 and other.H.product is None
    assert_close(other.H.diagonal, la.H.diagonal, rtol=0, atol=0)
    for action in (lambda: other(case.X[:2]), lambda: other.sample(2)):
        with pytest.raises(NoProductDataError, match=r"fit\(") as raised:
            action()
        assert isinstance(raised.value, RuntimeError)
    other.prior_precision = PRIOR
    other.fit(case.loader())  # the data again: predictions work
    assert_close(other(case.X[:2]), la(case.X[:2]), rtol=1e-12, atol=1e-14)
    kron = KronLaplace(case.model, case.likelihood)
    kron.fit(case.loader())
    with pytest.raises(ValueError, match="cls_name is 'KronLaplace'"):
        other.load_state_dict(kron.state_dict())


def test_state_dict_without_a_log_det_needs_the_data_for_the_marglik():
    case, _, la = build("mlp_classification")
    other = MatFreeLaplace(case.model, case.likelihood, prior_precision=PRIOR)
    other.load_state_dict(round_trip(la.state_dict()))
    with pytest.raises(NoProductDataError, match=r"fit\("):
        other.log_marginal_likelihood()


# ---------------------------------------------------------------------------- refusals
@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("tol", 0.0),
        ("tol", -1e-3),
        ("tol", 1.0),
        ("tol", 2.0),
        ("max_iter", 0),
        ("n_probes", 0),
        ("lanczos_steps", 0),
        ("variance_samples", 0),
        ("preconditioner", "kron"),
        ("predictive", "exact"),
    ],
)
def test_bad_settings_are_refused_by_name(option, value):
    case = CASE_BUILDERS["mlp_classification"]()
    with pytest.raises(ValueError, match=option):
        MatFreeLaplace(case.model, case.likelihood, **{option: value})


def test_hessian_backend_and_online_fit_are_refused():
    case = CASE_BUILDERS["mlp_classification"]()
    with pytest.raises(ValueError, match="GGN or empirical-Fisher"):
        MatFreeLaplace(case.model, case.likelihood, backend=CurvlinopsHessian)
    la = Laplace(case.model, case.likelihood, "all", "matfree")
    assert isinstance(la, MatFreeLaplace)
    la.fit(case.loader())
    H = la.H
    with pytest.raises(ValueError, match=r"override=False"):
        la.fit(case.loader(), override=False)
    assert la.H is H and la.n_data == len(case.X)


def test_non_convergence_warns_naming_the_residual_or_raises_when_strict():
    case, _, la = build("mlp_classification", max_iter=2, tol=1e-12, predictive="cg")
    X = query_points(case, 2)
    with pytest.warns(RuntimeWarning, match="relative residual") as record:
        la._glm_predictive_distribution(X)
    assert "max_iter=2" in str(record[0].message)
    assert not la.solve_report.converged and la.solve_report.iterations == 2
    *_, strict = build("mlp_classification", max_iter=2, tol=1e-12, strict=True)
    with pytest.raises(ConvergenceError, match="max_iter=2") as raised:
        strict.sample(3, generator=torch.Generator().manual_seed(0))
    assert isinstance(raised.value, RuntimeError)


def test_changed_solver_settings_take_effect():
    name = "mlp_classification"
    _, full, la = build(name, n_probes=4, lanczos_steps=10)
    assert torch.isfinite(la.log_det_posterior_precision)
    assert la.log_det_report.n_probes == 4
    la.solver_options = dataclasses.replace(la.solver_options, **exact_options(n_params_of(name)))
    assert_close(la.log_det_posterior_precision, full.log_det_posterior_precision, RTOL_LOG_DET)
    assert la.log_det_report.n_probes == la.n_params


# ------------------------------------------------------------------------------ unfitted
@pytest.mark.parametrize("kind", ["scalar", "layerwise"])
def test_unfitted_posterior_is_the_prior(kind):
    name = "mlp_regression_3out"
    case = CASE_BUILDERS[name]()
    prior = priors_of(kind, name)
    la = MatFreeLaplace(case.model, case.likelihood, prior_precision=prior, n_probes=3)
    p0 = la.prior_precision_diag
    assert_close(la.log_det_posterior_precision, p0.log().sum(), rtol=1e-12, atol=0)
    assert la.product_count == 0
    V = torch.randn(la.n_params, 2, generator=torch.Generator().manual_seed(0)).double()
    assert_close(la.posterior_precision @ V, p0[:, None] * V, rtol=1e-14, atol=0)
    with pytest.raises(RuntimeError, match=r"call fit\(\) first"):
        la.sample(2)
    draws = la._posterior.sample_deviations(QUICK_DRAWS, torch.Generator().manual_seed(1))
    std = p0.rsqrt()
    correlation = torch.cov(draws.T) / torch.outer(std, std)
    eye = torch.eye(la.n_params, dtype=torch.float64)
    assert_close(correlation, eye, rtol=0, atol=mc_atol(QUICK_DRAWS))


# --------------------------------------------------------------------------- distributed
WORLD = 2


def _free_port() -> int:
    """A free TCP port on localhost."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _distributed_case():
    """The case, solver settings and test inputs of the distributed comparison."""
    name = "mlp_classification"
    case = CASE_BUILDERS[name]()
    return case, exact_options(n_params_of(name), prior_precision=PRIOR), query_points(case)


def _results(la, X: torch.Tensor) -> dict:
    """What the distributed and the single-process fits are compared on."""
    f_mu, f_var = la._glm_predictive_distribution(X)
    return {
        "curvature": la.H.matmat(torch.eye(la.n_params, dtype=torch.float64)),
        "diagonal": la.H.diagonal.clone(),
        "f_mu": f_mu,
        "f_var": f_var,
        "log_det": la.log_det_posterior_precision.detach().clone(),
        "marglik": la.log_marginal_likelihood().detach().clone(),
        "n_data": torch.tensor(la.n_data),
    }


def _worker(rank: int, port: int, out_dir: str) -> None:
    """Fit on this rank's uneven shard (two thirds on rank 0) and save the results.

    First what every rank computes on the same inputs (saved as ``rank{r}.pt``), then the GLM
    predictive of this rank's own shard of the test inputs, gathered over the ranks as
    ``tests/utils/test_distributed.py`` does for the other structures (``rank{r}-sharded.pt``).
    """
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", rank=rank, world_size=WORLD, timeout=datetime.timedelta(seconds=30)
    )
    for step in ("common", "sharded"):
        try:
            if step == "common":
                case, options, X = _distributed_case()
                data = TensorDataset(case.X, case.y)
                split = 2 * len(data) // 3
                part = range(split) if rank == 0 else range(split, len(data))
                la = MatFreeLaplace(case.model, case.likelihood, **options)
                la.fit(DataLoader(Subset(data, list(part)), batch_size=5), distributed=True)
                results = _results(la, X)
                results["samples"] = la.sample(4, generator=torch.Generator().manual_seed(0))
                name = f"rank{rank}.pt"
            else:
                name = f"rank{rank}-sharded.pt"
                results = {}
                try:  # conjugate gradients on different inputs: refused on every rank
                    la._glm_predictive_distribution(X[rank::WORLD])
                except DistributedFitError as error:
                    results["cg_error"] = str(error)
                la.solver_options = dataclasses.replace(la.solver_options, predictive="samples")
                f_mu, f_var = la._glm_predictive_distribution(X[rank::WORLD])
                results["f_mu"], results["f_var"] = all_gather(f_mu), all_gather(f_var)
                results["f_mu_all"], results["f_var_all"] = la._glm_predictive_distribution(X)
        except Exception:  # reported to the parent through the results file
            results = {"error": traceback.format_exc()}
        torch.save(results, os.path.join(out_dir, name))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def distributed_run(tmp_path_factory):
    """The results directory of one spawn of the two ranks, and how the spawn ended."""
    out_dir = tmp_path_factory.mktemp("matfree-distributed")
    try:
        mp.spawn(_worker, args=(_free_port(), str(out_dir)), nprocs=WORLD)
        ended = "both ranks exited normally"
    except mp.ProcessExitedException as error:  # e.g. gloo aborting a rank
        ended = f"a rank died: {error}"
    return out_dir, ended


def _load_ranks(out_dir, suffix: str, ended: str) -> list[dict]:
    """Each rank's saved results, failing with how the spawn ended if one is missing."""
    ranks = []
    for r in range(WORLD):
        path = out_dir / f"rank{r}{suffix}.pt"
        assert path.exists(), f"rank {r} saved no results ({ended})"
        results = torch.load(path, weights_only=False)
        assert "error" not in results, f"rank {r} raised:\n{results['error']}"
        ranks.append(results)
    return ranks


def _single_process():
    """The single-process fit on all the data, its test inputs and results."""
    case, options, X = _distributed_case()
    la = MatFreeLaplace(case.model, case.likelihood, **options)
    la.fit(case.loader(5))
    return la, X, _results(la, X)


@pytest.mark.slow  # two processes import torch and laplace (about 40 s on 2 cores)
def test_distributed_fit_equals_single_process(distributed_run):
    out_dir, ended = distributed_run
    ranks = _load_ranks(out_dir, "", ended)
    _, _, expected = _single_process()
    for results in ranks:
        for key, value in expected.items():
            assert_close(results[key], value, rtol=RTOL_LOG_DET, atol=1e-10)
    # every rank draws the same samples (the sketches are summed over the ranks)
    assert_close(ranks[0]["samples"], ranks[1]["samples"], rtol=1e-12, atol=1e-14)


@pytest.mark.slow  # shares the spawn of test_distributed_fit_equals_single_process
def test_distributed_predictions_on_each_ranks_own_inputs(distributed_run):
    """Each rank predicting its own points: refused by name for conjugate gradients (their
    products are collective), and the sampled route's variances of the shards are those of
    all points (the samples are the same on every rank)."""
    out_dir, ended = distributed_run
    ranks = _load_ranks(out_dir, "-sharded", ended)
    for results in ranks:
        assert "predictive='samples'" in results["cg_error"]
        order = torch.cat([torch.arange(len(results["f_mu_all"]))[r::WORLD] for r in range(WORLD)])
        assert_close(results["f_mu"], results["f_mu_all"][order], rtol=1e-12, atol=1e-14)
        assert_close(results["f_var"], results["f_var_all"][order], rtol=1e-10, atol=1e-14)
