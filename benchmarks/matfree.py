"""Cases of the matrix-free issue: the exact-GGN posterior of a million-weight network.

``matfree-mlp-1m``: an MLP 784-1270-10 (1,009,660 weights), 1,000 training points of 10
classes (a random teacher network's labels, trained on for 20 epochs so that the curvature is a
trained network's), float32. Its phases, each with the curvature-vector products it made
(``la.product_count``), the passes over the data, wall seconds, the ratio to the fwd + 10 bwd
floor over the training data measured in the same process, and the peak extra memory against
the parameters' memory:

1. ``fit`` (the loss pass and the preconditioner's diagonal, if any);
2. one marginal-likelihood evaluation (stochastic Lanczos quadrature, 10 probes of 30 steps);
3. ``optimize_prior_precision(method="marglik")`` afterwards (no further product);
4. the GLM probit predictive of 100 test points (sampled route, 64 posterior samples by
   sample-then-optimise to a relative residual of 1e-3; the Monte-Carlo relative error of a
   variance is about √(2/64) = 0.18).

The products are made over batches of 50 points (one batch recorded at a time). The
process's first vectorised backward pass sets torch's vmap up once (about 33 MB whatever the
model, ``one_time_vmap_setup_MB``): it is made on a tiny tensor before the phases.

The memory-bounded settings (``cache_bytes=0``: no batches kept between passes; solver blocks
of one column) are those of the acceptance line (peak extra memory ≤ 10 × the parameters'); the
``matfree-mlp-1m-fast`` case keeps the default settings (batches kept within 128 MiB, solver
blocks within 64 MiB).

``matfree-vs-full-mlp``: an MLP 64-96-96-10 (16,522 weights) on 1,000 points beside
``FullLaplace`` at the prior precision the dense marginal likelihood picks: fit, one marginal
likelihood, the predictive of 100 points (sampled route) and of 10 points (conjugate gradients
to the default 1e-4, each output row solved), with the errors of the variances and of the
log-determinant against the dense posterior.

``matfree-product-sources``: seconds per curvature-vector product on the large MLP from the
native per-layer engine (batches kept between passes, or recorded anew on every pass) and from
curvlinops' ``GGNLinearOperator``, for blocks of 1 and 8 vectors.

``matfree-preconditioners``: conjugate-gradient iterations to 1e-3 of 16 posterior samples
without a preconditioner, with the diagonal posterior and with the KFAC posterior
(``KronLaplace``'s precision) as preconditioners, on a trained MLP (784-64-10) and CNN, at the
prior precision the marginal likelihood picks.

``matfree-sample-solves``: the 64 posterior samples of a predictive solved to 1e-3 column by
column (``conjugate_gradients``, each column its own Krylov space) and in one block sharing a
Krylov space (``block_conjugate_gradients``, what ``MatFreeLaplace`` runs where a solver block
holds several columns): iterations, products and seconds, on the MLP 784-64-10, the MLP
64-96-96-10 and the CNN at the prior precision the marginal likelihood picks.
"""

from __future__ import annotations

import dataclasses
import itertools
import statistics
import sys
import time
from functools import partial

import torch
from harness import PeakRSS, forward_plus_10_backward, seconds
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

#: Training points, classes, batch size and epochs of the teacher-labelled data.
N_TRAIN, N_CLASSES, BATCH, EPOCHS = 1000, 10, 100, 20
#: Batch size of the large case's products (each pass records one batch at a time).
LARGE_BATCH = 50
#: Solver settings of the large case.
TOL, N_PROBES, LANCZOS_STEPS, VARIANCE_SAMPLES = 1e-3, 10, 30, 64


def _teacher_data(shape: tuple[int, ...], n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Standard normal inputs labelled by a random linear teacher (10 classes)."""
    generator = torch.Generator().manual_seed(seed)
    X = torch.randn(n, *shape, generator=generator)
    teacher = torch.randn(X[0].numel(), N_CLASSES, generator=torch.Generator().manual_seed(99))
    return X, (X.flatten(1) @ teacher).argmax(1)


def _trained(model: nn.Module, X: torch.Tensor, y: torch.Tensor) -> nn.Module:
    """``model`` after ``EPOCHS`` epochs of Adam on ``(X, y)``."""
    torch.manual_seed(0)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    for _ in range(EPOCHS):
        for start in range(0, len(X), BATCH):
            optimizer.zero_grad()
            loss = nn.functional.cross_entropy(
                model(X[start : start + BATCH]), y[start : start + BATCH]
            )
            loss.backward()
            optimizer.step()
    return model.eval()


def _mlp(widths: list[int]) -> nn.Module:
    layers: list[nn.Module] = [nn.Flatten()]
    for d_in, d_out in itertools.pairwise(widths):
        layers += [nn.Linear(d_in, d_out), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


def _cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 8, 3, stride=2, padding=1),
        nn.ReLU(),
        nn.Conv2d(8, 16, 3, stride=2, padding=1),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(16 * 7 * 7, 32),
        nn.ReLU(),
        nn.Linear(32, N_CLASSES),
    )


def _setting(shape: tuple[int, ...], model: nn.Module) -> tuple[nn.Module, DataLoader]:
    X, y = _teacher_data(shape, N_TRAIN, 0)
    return _trained(model, X, y), DataLoader(TensorDataset(X, y), batch_size=BATCH)


def _phase(la, name: str, fn, floor_s: float, parameter_bytes: int) -> dict:
    """Products, passes, seconds, floor ratio and peak extra memory of one call."""
    products, passes = la.product_count, la.H.passes if la.H is not None else 0
    with PeakRSS() as memory:
        elapsed = seconds(fn)
    print(f"{name}: {elapsed:.1f} s, {la.product_count - products} products", file=sys.stderr)
    return {
        "phase": name,
        "products": la.product_count - products,
        "passes": la.H.passes - passes,
        "seconds": elapsed,
        "ratio_to_floor": elapsed / floor_s,
        "peak_extra_MB": memory.extra / 2**20,
        "peak_extra_per_parameter_memory": memory.extra / parameter_bytes,
    }


def _first_batched_backward() -> int:
    """Peak extra memory (bytes) of the process's first vectorised backward pass.

    torch sets vmap up once per process (about 33 MB, whatever the model); the large case makes
    this set-up on a tiny tensor before its phases are measured, and reports it apart.
    """
    x = torch.ones(2, 3, requires_grad=True)
    columns = torch.ones(2, 2, 3)
    with PeakRSS() as memory:
        torch.autograd.grad(x.square(), [x], grad_outputs=columns, is_grads_batched=True)
    return memory.extra


def case_matfree_large(_: str, settings: str, repeats: int) -> dict:
    from laplace import Laplace

    vmap_setup = _first_batched_backward()
    model, loader = _setting((784,), _mlp([784, 1270, N_CLASSES]))
    loader = DataLoader(loader.dataset, batch_size=LARGE_BATCH)
    parameter_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    floor_s = statistics.median(
        seconds(partial(forward_plus_10_backward, model, loader)) for _ in range(max(1, repeats))
    )
    bounded = settings == "memory-bounded"
    options = {"cache_bytes": 0, "block_bytes": 6 * parameter_bytes} if bounded else {}
    la = Laplace(
        model,
        "classification",
        subset_of_weights="all",
        hessian_structure="matfree",
        tol=TOL,
        n_probes=N_PROBES,
        lanczos_steps=LANCZOS_STEPS,
        variance_samples=VARIANCE_SAMPLES,
        preconditioner=None,
        **options,
    )
    X_test, _ = _teacher_data((784,), 100, 1)
    phases = [
        _phase(la, "fit", partial(la.fit, loader), floor_s, parameter_bytes),
        _phase(la, "marglik (SLQ)", la.log_marginal_likelihood, floor_s, parameter_bytes),
        _phase(
            la,
            "optimize_prior_precision (marglik)",
            partial(la.optimize_prior_precision, method="marglik"),
            floor_s,
            parameter_bytes,
        ),
    ]
    start = time.perf_counter()
    phases.append(
        _phase(la, "predict 100 (samples)", partial(la, X_test), floor_s, parameter_bytes)
    )
    report = la.solve_report
    return {
        "case": f"matfree MLP 784-1270-10 ({settings})",
        "n_params": la.n_params,
        "seconds": time.perf_counter() - start,
        "floor_s": floor_s,
        "parameter_MB": parameter_bytes / 2**20,
        "one_time_vmap_setup_MB": vmap_setup / 2**20,
        "prior_precision": float(la.prior_precision),
        "log_det": la.log_det_report.estimate,
        "log_det_standard_error": la.log_det_report.standard_error,
        "predictive_worst_relative_residual": float(report.relative_residuals.max()),
        "predictive_cg_iterations": report.iterations,
        "variance_monte_carlo_relative_error": (2 / VARIANCE_SAMPLES) ** 0.5,
        "phases": phases,
    }


def case_matfree_vs_full(_: str, __: str, repeats: int) -> dict:
    from laplace import Laplace

    model, loader = _setting((64,), _mlp([64, 96, 96, N_CLASSES]))
    X_test, _ = _teacher_data((64,), 100, 1)
    full = Laplace(model, "classification", "all", "full")
    with PeakRSS() as memory:
        fit_s = seconds(partial(full.fit, loader))
        marglik_s = seconds(full.log_marginal_likelihood)
        predict_s = seconds(partial(full._glm_predictive_distribution, X_test))
    full.optimize_prior_precision(method="marglik")
    prior = float(full.prior_precision)
    _, full_var = full._glm_predictive_distribution(X_test)
    rows = {
        "full": {
            "fit_s": fit_s,
            "marglik_s": marglik_s,
            "predict_100_s": predict_s,
            "peak_extra_MB": memory.extra / 2**20,
        }
    }
    la = Laplace(model, "classification", "all", "matfree", prior_precision=prior)
    with PeakRSS() as memory:
        fit_s = seconds(partial(la.fit, loader))
        marglik_s = seconds(la.log_marginal_likelihood)
        marglik_products = la.product_count
        before = la.product_count
        predict_s = seconds(partial(la._glm_predictive_distribution, X_test))
        sampled_products = la.product_count - before
        _, sampled_var = la._glm_predictive_distribution(X_test)
        la.solver_options = dataclasses.replace(la.solver_options, predictive="cg")
        before = la.product_count
        cg_s = seconds(partial(la._glm_predictive_distribution, X_test[:10]))
        cg_products = la.product_count - before
        _, cg_var = la._glm_predictive_distribution(X_test[:10])
    rows["matfree"] = {
        "fit_s": fit_s,
        "marglik_s": marglik_s,
        "marglik_products": marglik_products,
        "predict_100_samples_s": predict_s,
        "predict_100_samples_products": sampled_products,
        "predict_10_cg_s": cg_s,
        "predict_10_cg_products": cg_products,
        "cg_iterations": la.solve_report.iterations,
        "peak_extra_MB": memory.extra / 2**20,
    }
    scale = full_var.abs().max()
    return {
        "case": "matfree vs full, MLP 64-96-96-10",
        "n_params": la.n_params,
        "seconds": predict_s,
        "prior_precision": prior,
        **rows,
        "log_det_relative_error": float(
            abs(la.log_det_posterior_precision - full.log_det_posterior_precision)
            / abs(full.log_det_posterior_precision)
        ),
        "log_det_standard_error": la.log_det_report.standard_error,
        "cg_variance_max_error_over_max": float((cg_var - full_var[:10]).abs().max() / scale),
        "samples_variance_max_error_over_max": float((sampled_var - full_var).abs().max() / scale),
    }


def _kron_solve(precision, R: torch.Tensor) -> torch.Tensor:
    """``M⁻¹ R`` for the KFAC posterior precision ``M`` and a block ``R`` (P, m)."""
    return precision.bmm(R.T.contiguous(), exponent=-1).T


def case_preconditioners(_: str, __: str, repeats: int) -> dict:
    from laplace import Laplace
    from laplace.curvature.solvers.krylov import conjugate_gradients

    out = {}
    for name, shape, model in [
        ("mlp 784-64-10", (784,), _mlp([784, 64, N_CLASSES])),
        ("cnn", (1, 28, 28), _cnn()),
    ]:
        model, loader = _setting(shape, model)
        la = Laplace(model, "classification", "all", "matfree")
        la.fit(loader)
        la.optimize_prior_precision(method="marglik")
        la.solver_options = dataclasses.replace(la.solver_options, preconditioner="diag")
        la.fit(loader)  # keeps the curvature's diagonal
        kron = Laplace(model, "classification", "all", "kron", prior_precision=la.prior_precision)
        kron.fit(loader)
        kron_precision = kron.posterior_precision
        posterior = la._posterior
        b = posterior.draw_precision_samples(16, torch.Generator().manual_seed(0))
        row = {"prior_precision": float(la.prior_precision)}
        for label, precondition in [
            ("none", None),
            ("diag", posterior.precondition),
            ("kron", partial(_kron_solve, kron_precision)),
        ]:
            start = time.perf_counter()
            _, report = conjugate_gradients(
                lambda V, out, posterior=posterior: posterior.matmat(V), b, TOL, 2000, precondition
            )
            row[label] = {"iterations": report.iterations, "seconds": time.perf_counter() - start}
        out[name] = row
    return {"case": "matfree preconditioners", "n_params": 0, "seconds": 0.0, **out}


def case_product_sources(_: str, __: str, repeats: int) -> dict:
    from laplace.curvature import CurvlinopsGGN
    from laplace.curvature.solvers.products import curvature_product

    model, loader = _setting((784,), _mlp([784, 1270, N_CLASSES]))
    n_params = sum(p.numel() for p in model.parameters())
    backend = CurvlinopsGGN(model, "classification")
    data = list(loader)
    out = {}
    for source, native, cache_bytes in [
        ("native, batches kept", True, None),
        ("native, nothing kept", True, 0),
        ("curvlinops GGNLinearOperator", False, None),
    ]:
        product = curvature_product(backend, data, N_TRAIN, native=native)
        if cache_bytes is not None:
            product.cache_bytes = cache_bytes
        for m in (1, 8):
            V = torch.randn(n_params, m, generator=torch.Generator().manual_seed(0))
            product.matmat(V)  # the first pass records (and keeps) the batches
            times = [seconds(partial(product.matmat, V)) for _ in range(max(1, repeats))]
            out[f"{source}, block {m}"] = statistics.median(times) / m
    return {
        "case": "matfree products per vector (s), MLP 784-1270-10, 1,000 points",
        "n_params": n_params,
        "seconds": out["native, batches kept, block 1"],
        "seconds_per_product": out,
    }


def case_sample_solves(_: str, __: str, repeats: int) -> dict:
    from laplace import Laplace
    from laplace.curvature.solvers.krylov import block_conjugate_gradients, conjugate_gradients

    out = {}
    for name, shape, model in [
        ("mlp 784-64-10", (784,), _mlp([784, 64, N_CLASSES])),
        ("mlp 64-96-96-10", (64,), _mlp([64, 96, 96, N_CLASSES])),
        ("cnn", (1, 28, 28), _cnn()),
    ]:
        model, loader = _setting(shape, model)
        la = Laplace(model, "classification", "all", "matfree")
        la.fit(loader)
        la.optimize_prior_precision(method="marglik")
        posterior = la._posterior
        b = posterior.draw_precision_samples(VARIANCE_SAMPLES, torch.Generator().manual_seed(0))
        row = {"n_params": la.n_params, "prior_precision": float(la.prior_precision)}
        solvers = [("per_column", conjugate_gradients), ("block", block_conjugate_gradients)]
        for label, solver in solvers:
            start = time.perf_counter()
            _, report = solver(
                lambda V, out, posterior=posterior: posterior.matmat(V), b, TOL, 2000
            )
            row[label] = {
                "iterations": report.iterations,
                "products": report.products,
                "seconds": time.perf_counter() - start,
            }
        out[name] = row
    total = sum(row[label]["seconds"] for row in out.values() for label in ("per_column", "block"))
    return {"case": "matfree sample solves", "n_params": 0, "seconds": total, **out}


MATFREE_CASES = {
    "matfree-mlp-1m": (case_matfree_large, "mlp", "memory-bounded"),
    "matfree-mlp-1m-fast": (case_matfree_large, "mlp", "default"),
    "matfree-vs-full-mlp": (case_matfree_vs_full, "mlp", ""),
    "matfree-preconditioners": (case_preconditioners, "mlp", ""),
    "matfree-sample-solves": (case_sample_solves, "", ""),
    "matfree-product-sources": (case_product_sources, "mlp", ""),
}
