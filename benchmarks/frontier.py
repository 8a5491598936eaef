"""Cases of the performance-frontier issue: low-rank and subnetwork fits and predictives.

Each fit is timed against the floor of ``benchmarks/harness.py`` (one forward + 10 backward
passes) in the same process; ``fit-inf-*`` is the diagonal-plus-low-rank fit (the low-rank
fit and one diag pass). ``lowrank-accuracy-mlp`` measures the trade-off of the randomized
solver: for the KFAC start alone (the default), with one and two Krylov passes after it, and
for 3 and 6 passes after a sketch, the fit's ratio to the floor, the largest relative error of
the top-50 eigenvalues against Lanczos (ARPACK on curvlinops products, tolerance 1e-5) next to
the largest error the fit reports (``la.eigenvalue_errors``), and the error of the eigenvalue
vector relative to its norm.
"""

from __future__ import annotations

from functools import partial

from harness import (
    MODELS,
    against_floor,
    forward_plus_10_backward,
    measure_fit,
    measure_predict,
    seconds,
    training_loader,
)

#: Eigenpairs of the low-rank cases, and entries of the subnetwork cases.
N_EIGENVALUES, N_SUBNET = 50, 1000
#: Lanczos tolerance of the reference eigenvalues.
REFERENCE_TOL = 1e-5
#: (start, Krylov passes after it) of the accuracy case; the first is the default.
SETTINGS = [("kfac", 0), ("kfac", 1), ("kfac", 2), ("sketch", 3), ("sketch", 6)]


def _lowrank(model, structure: str = "lowrank", **options):
    from laplace import Laplace

    kwargs = {"n_eigenvalues": N_EIGENVALUES, **options}
    return Laplace(model, "classification", "all", structure, backend_kwargs=kwargs)


def _reported(la) -> str:
    errors = getattr(la, "eigenvalue_errors", None)
    return "" if errors is None else f"largest reported error {float(errors.max()):.3f}"


def case_fit_lowrank(
    model_name: str, solver: str, repeats: int, structure: str = "lowrank"
) -> dict:
    model = MODELS[model_name]().eval()
    loader = training_loader(model_name)
    la = _lowrank(model, structure, solver=solver)
    floor = partial(forward_plus_10_backward, model, loader)
    case = f"fit {structure} k={N_EIGENVALUES} ({solver}) {model_name}"
    row = measure_fit(la, loader, repeats, case, floor)
    return {**row, "note": _reported(la)}


def case_lowrank_accuracy(model_name: str, _: str, repeats: int) -> dict:
    model = MODELS[model_name]().eval()
    loader = training_loader(model_name)
    reference = _lowrank(model, solver="lanczos", tol=REFERENCE_TOL)
    lanczos_s = seconds(lambda: reference.fit(loader))
    exact = reference.H[1]
    floor = partial(forward_plus_10_backward, model, loader)
    table = []
    for start, passes in SETTINGS:
        la = _lowrank(model, start=start, max_iter=passes)
        times = against_floor(partial(la.fit, loader), floor, repeats)
        k = min(len(exact), len(la.H[1]))
        difference = exact[:k] - la.H[1][:k]
        table.append(
            {
                "start": start,
                "passes": passes,
                **times,
                "max_rel_error": float((difference / exact[:k]).abs().max()),
                "norm_rel_error": float(difference.norm() / exact[:k].norm()),
                "max_reported_error": float(la.eigenvalue_errors.max()),
            }
        )
    note = "; ".join(
        f"{r['start']} + {r['passes']} passes: {r['ratio']:.1f}x, max error "
        f"{r['max_rel_error']:.4f} "
        f"(reported {r['max_reported_error']:.3f}), norm error {r['norm_rel_error']:.4f}"
        for r in table
    )
    return {
        "case": f"lowrank k={N_EIGENVALUES} accuracy vs Lanczos {model_name}",
        "n_params": reference.n_params,
        "seconds": lanczos_s,
        "peak_extra_MB": float("nan"),
        "table": table,
        "note": f"(seconds: Lanczos) {note}",
    }


def case_predict_lowrank(model_name: str, structure: str, repeats: int, n_test: int = 100) -> dict:
    la = _lowrank(MODELS[model_name]().eval(), structure)
    la.fit(training_loader(model_name))
    case = f"glm probit {structure} k={N_EIGENVALUES} {model_name} ({n_test} points)"
    return measure_predict(la, model_name, n_test, repeats, case)


def _subnetwork(model, structure: str):
    from laplace import Laplace
    from laplace.utils import LargestMagnitudeSubnetMask

    indices = LargestMagnitudeSubnetMask(model, n_params_subnet=N_SUBNET).select()
    return Laplace(
        model,
        "classification",
        subset_of_weights="subnetwork",
        hessian_structure=structure,
        subnetwork_indices=indices,
    )


def case_fit_subnet(model_name: str, structure: str, repeats: int) -> dict:
    model = MODELS[model_name]().eval()
    loader = training_loader(model_name)
    floor = partial(forward_plus_10_backward, model, loader)
    case = f"fit subnetwork {structure} K={N_SUBNET} {model_name}"
    return measure_fit(_subnetwork(model, structure), loader, repeats, case, floor)


def case_predict_subnet(model_name: str, structure: str, repeats: int, n_test: int = 100) -> dict:
    la = _subnetwork(MODELS[model_name]().eval(), structure)
    la.fit(training_loader(model_name))
    case = f"glm probit subnetwork {structure} K={N_SUBNET} {model_name} ({n_test} points)"
    return measure_predict(la, model_name, n_test, repeats, case)


FRONTIER_CASES = {
    "fit-lowrank-mlp": (case_fit_lowrank, "mlp", "randomized"),
    "fit-lowrank-cnn": (case_fit_lowrank, "cnn", "randomized"),
    "lowrank-accuracy-mlp": (case_lowrank_accuracy, "mlp", ""),
    "predict-lowrank-cnn-100": (case_predict_lowrank, "cnn", "lowrank"),
    "fit-inf-mlp": (partial(case_fit_lowrank, structure="diag_lowrank"), "mlp", "randomized"),
    "fit-inf-cnn": (partial(case_fit_lowrank, structure="diag_lowrank"), "cnn", "randomized"),
    "predict-inf-cnn-100": (case_predict_lowrank, "cnn", "diag_lowrank"),
    "fit-subnet-full-mlp": (case_fit_subnet, "mlp", "full"),
    "fit-subnet-full-cnn": (case_fit_subnet, "cnn", "full"),
    "predict-subnet-full-cnn-100": (case_predict_subnet, "cnn", "full"),
}
