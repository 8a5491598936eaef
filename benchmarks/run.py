"""Benchmarks: fit time against a forward/backward baseline, and predictive time and peak memory.

Set-up of the foundation issue: CPU, 2 threads, N=2000, 10 classes, an MLP 64-256-256-10
(85k params, on 64 input features) and a CNN on 28×28 inputs (conv 16 s2, conv 32 s2, linear 128,
linear 10; 207k params). Each case runs in its own subprocess so peak memory is its own.

Usage: ``python benchmarks/run.py [--cases NAME ...] [--repeats R] [--threads T]``; prints a
table and writes ``benchmarks/results/run.json``. ``--backends`` instead times ``fit`` per
curvature backend × structure on both models and writes ``benchmarks/results/backends.json``.
The ``binary-*`` cases time ``likelihood="binary_classification"`` against ``"classification"``
on the MLP.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import threading
import time
from functools import partial
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

RESULTS = Path(__file__).resolve().parent / "results"
N_TRAIN, N_TEST, N_CLASSES, BATCH = 2000, 1000, 10, 100


def mlp() -> nn.Module:
    return nn.Sequential(
        nn.Flatten(),
        nn.Linear(64, 256),
        nn.ReLU(),
        nn.Linear(256, 256),
        nn.ReLU(),
        nn.Linear(256, 10),
    )


def cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, stride=2, padding=1),
        nn.ReLU(),
        nn.Conv2d(16, 32, 3, stride=2, padding=1),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(32 * 7 * 7, 128),
        nn.ReLU(),
        nn.Linear(128, 10),
    )


MODELS = {"mlp": mlp, "cnn": cnn}
INPUT_SHAPES = {"mlp": (64,), "cnn": (1, 28, 28)}


def data(model_name: str, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    X = torch.randn(n, *INPUT_SHAPES[model_name], generator=gen)
    return X, torch.randint(0, N_CLASSES, (n,), generator=gen)


class PeakRSS:
    """Peak resident memory above the level at entry, sampled every 2 ms (bytes)."""

    def __enter__(self):
        self.base = self.peak = self._rss()
        self._stop = False
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop = True
        self._thread.join()

    @property
    def extra(self) -> int:
        return self.peak - self.base

    @staticmethod
    def _rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096

    def _watch(self):
        while not self._stop:
            self.peak = max(self.peak, self._rss())
            time.sleep(0.002)


def timed(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def forward_plus_10_backward(model: nn.Module, loader: DataLoader) -> None:
    params = [p for p in model.parameters() if p.requires_grad]
    for X, _ in loader:
        f = model(X)
        for c in range(10):
            torch.autograd.grad(f[:, c].sum(), params, retain_graph=c < 9)


def training_loader(model_name: str) -> DataLoader:
    return DataLoader(TensorDataset(*data(model_name, N_TRAIN, 0)), batch_size=BATCH)


def measure_fit(la, loader: DataLoader, repeats: int, case: str, **extra) -> dict:
    """Best-of-``repeats`` fit time and peak extra memory of a Laplace approximation."""
    with PeakRSS() as mem:
        fit_s = timed(lambda: la.fit(loader), repeats)
    return {
        "case": case,
        "n_params": la.n_params,
        "seconds": fit_s,
        **{key: value(fit_s) if callable(value) else value for key, value in extra.items()},
        "peak_extra_MB": mem.extra / 2**20,
    }


def measure_predict(la, model_name: str, n_test: int, repeats: int, case: str) -> dict:
    """GLM probit predictive time and peak extra memory on ``n_test`` points of a fitted ``la``."""
    X_test, _ = data(model_name, n_test, 1)
    la(X_test[:10], link_approx="probit")  # warm the posterior factorisation
    with PeakRSS() as mem:
        pred_s = timed(lambda: la(X_test, pred_type="glm", link_approx="probit"), repeats)
    return {
        "case": case,
        "n_params": la.n_params,
        "seconds": pred_s,
        "peak_extra_MB": mem.extra / 2**20,
    }


def case_fit(model_name: str, structure: str, repeats: int) -> dict:
    from laplace import Laplace

    model = MODELS[model_name]().eval()
    loader = training_loader(model_name)
    baseline = timed(lambda: forward_plus_10_backward(model, loader), repeats)
    la = Laplace(model, "classification", subset_of_weights="all", hessian_structure=structure)
    return measure_fit(
        la,
        loader,
        repeats,
        f"fit {structure} {model_name}",
        baseline_fwd_10bwd_s=baseline,
        ratio=lambda fit_s: fit_s / baseline,
    )


def case_predict(
    model_name: str, structure: str, repeats: int, n_test: int = N_TEST, subset: str = "all"
) -> dict:
    from laplace import Laplace

    model = MODELS[model_name]().eval()
    if structure == "full" and subset == "all":  # a dense P×P needs a small P: train the head
        for p in list(model.parameters())[:-2]:
            p.requires_grad_(False)
    la = Laplace(model, "classification", subset_of_weights=subset, hessian_structure=structure)
    la.fit(training_loader(model_name))
    label = "last-layer " if subset == "last_layer" else ""
    case = f"glm probit {label}{structure} {model_name} ({n_test} points)"
    return measure_predict(la, model_name, n_test, repeats, case)


def case_backend_fit(model_name: str, structure: str, repeats: int, backend: str) -> dict:
    from laplace import Laplace
    from laplace.curvature import CURVATURE_BACKENDS

    model = MODELS[model_name]().eval()
    la = Laplace(
        model,
        "classification",
        subset_of_weights="all",
        hessian_structure=structure,
        backend=CURVATURE_BACKENDS[backend],
    )
    case = f"fit {structure} {model_name} {backend}"
    return measure_fit(la, training_loader(model_name), repeats, case)


#: Fit time per backend × structure (``--backends``).
BACKEND_CASES = {
    f"backend-{backend}-{structure}-{model_name}": (
        partial(case_backend_fit, backend=backend),
        model_name,
        structure,
    )
    for model_name in ("mlp", "cnn")
    for structure in ("diag", "kron")
    for backend in ("curvlinops_ggn", "asdl_ggn", "backpack_ggn", "curvlinops_ef", "asdl_ef")
}


def forward_pass(model: nn.Module, loader: DataLoader) -> None:
    with torch.no_grad():
        for X, _ in loader:
            model(X)


def case_fit_ll(model_name: str, structure: str, repeats: int) -> dict:
    from laplace import Laplace

    model = MODELS[model_name]().eval()
    loader = training_loader(model_name)
    baseline = timed(lambda: forward_pass(model, loader), repeats)
    la = Laplace(model, "classification", "last_layer", structure)
    return measure_fit(
        la,
        loader,
        repeats,
        f"fit last-layer {structure} {model_name}",
        baseline_forward_s=baseline,
        ratio_to_forward=lambda fit_s: fit_s / baseline,
    )


def case_marglik_ll(model_name: str, structure: str, repeats: int) -> dict:
    from laplace import Laplace

    model = MODELS[model_name]().eval()
    loader = training_loader(model_name)

    def tune():  # a fresh fit each time, so the one-off factorisation is included
        la = Laplace(model, "classification", "last_layer", structure)
        la.fit(loader)
        start = time.perf_counter()
        la.optimize_prior_precision(method="marglik", n_steps=100)
        return la, time.perf_counter() - start

    with PeakRSS() as mem:
        la, tune_s = min((tune() for _ in range(repeats)), key=lambda r: r[1])
    return {
        "case": f"marglik 100 steps last-layer {structure} {model_name}",
        "n_params": la.n_params,
        "seconds": tune_s,
        "peak_extra_MB": mem.extra / 2**20,
    }


def case_fit_lowrank(model_name: str, structure: str, repeats: int, k: int = 50) -> dict:
    from laplace import Laplace

    model = MODELS[model_name]().eval()
    la = Laplace(
        model,
        "classification",
        subset_of_weights="all",
        hessian_structure="lowrank",
        backend_kwargs={"n_eigenvalues": k, "solver": structure, "tol": 1e-4},
    )
    case = f"fit lowrank k={k} ({structure}) {model_name}"
    return measure_fit(la, training_loader(model_name), repeats, case)


def case_fit_subnet(model_name: str, structure: str, repeats: int, k: int = 1000) -> dict:
    from laplace import Laplace
    from laplace.utils import LargestMagnitudeSubnetMask

    model = MODELS[model_name]().eval()
    indices = LargestMagnitudeSubnetMask(model, n_params_subnet=k).select()
    la = Laplace(
        model,
        "classification",
        subset_of_weights="subnetwork",
        hessian_structure=structure,
        subnetwork_indices=indices,
    )
    case = f"fit subnetwork {structure} K={k} {model_name}"
    return measure_fit(la, training_loader(model_name), repeats, case)


def case_marglik_training(model_name: str, structure: str, repeats: int) -> dict:
    from laplace import marglik_training
    from laplace.curvature import CurvlinopsGGN

    loader = training_loader(model_name)

    def train() -> None:
        torch.manual_seed(0)
        marglik_training(
            MODELS[model_name](),
            loader,
            "classification",
            structure,
            backend=CurvlinopsGGN,
            n_epochs=10,
            n_hypersteps=10,
        )

    with PeakRSS() as mem:
        seconds = timed(train, repeats)
    return {
        "case": f"marglik_training {structure} {model_name}, 10 epochs x 10 hypersteps",
        "seconds": seconds,
        "peak_extra_MB": mem.extra / 2**20,
    }


def case_predict_gp(model_name: str, n_subset: int, repeats: int, n_test: int = N_TEST) -> dict:
    from laplace import Laplace

    model = MODELS[model_name]().eval()
    la = Laplace(model, "classification", "all", "gp", n_subset=n_subset)
    fit_s = timed(lambda: la.fit(training_loader(model_name)), 1)
    X_test, _ = data(model_name, n_test, 1)
    with PeakRSS() as mem:
        pred_s = timed(lambda: la(X_test, link_approx="probit"), repeats)
    return {
        "case": f"FunctionalLaplace (SoD M={n_subset}) probit {model_name} ({n_test} points)",
        "n_params": la.n_params,
        "fit_seconds": fit_s,
        "seconds": pred_s,
        "peak_extra_MB": mem.extra / 2**20,
    }


def case_evaluate(model_name: str, structure: str, repeats: int, n_test: int = 10_000) -> dict:
    """``evaluate`` against the GLM probit predictive alone on the same test batches.

    Both are timed in turns in one process (the machine is shared, so the medians count); the
    predictive in one call on all test points is timed too, for reference.
    """
    from laplace import Laplace
    from laplace.evaluation import evaluate

    model = MODELS[model_name]().eval()
    la = Laplace(model, "classification", subset_of_weights="all", hessian_structure=structure)
    la.fit(training_loader(model_name))
    X_test, y_test = data(model_name, n_test, 1)
    test_loader = DataLoader(TensorDataset(X_test, y_test), batch_size=500)
    la(X_test[:10], link_approx="probit")  # warm the factorisation

    def predictive_alone() -> None:
        for X, _ in test_loader:
            la(X, pred_type="glm", link_approx="probit")

    def evaluation() -> None:
        evaluate(la, test_loader, pred_type="glm", link_approx="probit")

    def one_call() -> None:
        la(X_test, pred_type="glm", link_approx="probit")

    pred_s, eval_s, one_call_s = [], [], []
    with PeakRSS() as mem:
        for _ in range(repeats):
            pred_s.append(timed(predictive_alone, 1))
            eval_s.append(timed(evaluation, 1))
            one_call_s.append(timed(one_call, 1))
    pred, seconds = statistics.median(pred_s), statistics.median(eval_s)
    return {
        "case": f"evaluate glm probit {structure} {model_name} ({n_test} points)",
        "n_params": la.n_params,
        "seconds": seconds,
        "predictive_alone_s": pred,
        "ratio_to_predictive": seconds / pred,
        "ratio_of_fastest": min(eval_s) / min(pred_s),
        "predictive_one_call_s": statistics.median(one_call_s),
        "repeats_s": {"evaluate": eval_s, "predictive": pred_s, "one_call": one_call_s},
        "peak_extra_MB": mem.extra / 2**20,
    }


def case_binary_vs_classification(model_name: str, structure: str, repeats: int) -> dict:
    """Fit and GLM probit predictive of ``binary_classification`` against ``classification``.

    The same network and inputs, its 10 outputs read as 10 independent labels (one-hot
    targets) or as 10 classes; the two are timed in turns in one process (the machine is
    shared, so the medians count), with the forward + 10 backward baseline of ``case_fit``.
    """
    from laplace import Laplace

    model = MODELS[model_name]().eval()
    X, y = data(model_name, N_TRAIN, 0)
    loaders = {
        "classification": DataLoader(TensorDataset(X, y), batch_size=BATCH),
        "binary_classification": DataLoader(
            TensorDataset(X, nn.functional.one_hot(y, N_CLASSES).float()), batch_size=BATCH
        ),
    }
    X_test, _ = data(model_name, N_TEST, 1)
    las = {name: Laplace(model, name, "all", structure) for name in loaders}
    fit_s: dict[str, list[float]] = {name: [] for name in las}
    predict_s: dict[str, list[float]] = {name: [] for name in las}
    baseline_s = []
    with PeakRSS() as mem:
        for _ in range(repeats):
            baseline_s.append(
                timed(lambda: forward_plus_10_backward(model, loaders["classification"]), 1)
            )
            for name, la in las.items():
                fit_s[name].append(timed(lambda la=la, name=name: la.fit(loaders[name]), 1))
                la(X_test[:10])  # warm the posterior factorisation
                predict_s[name].append(timed(lambda la=la: la(X_test, link_approx="probit"), 1))
    fit = {name: statistics.median(times) for name, times in fit_s.items()}
    predict = {name: statistics.median(times) for name, times in predict_s.items()}
    baseline = statistics.median(baseline_s)
    binary, categorical = "binary_classification", "classification"
    return {
        "case": f"binary vs classification {structure} {model_name}",
        "n_params": las[binary].n_params,
        "seconds": fit[binary],
        "fit_s": fit,
        "predict_s": predict,
        "baseline_fwd_10bwd_s": baseline,
        "fit_ratio_to_baseline": {name: value / baseline for name, value in fit.items()},
        "ratio": fit[binary] / fit[categorical],
        "predict_ratio": predict[binary] / predict[categorical],
        "repeats_s": {"fit": fit_s, "predict": predict_s, "baseline": baseline_s},
        "peak_extra_MB": mem.extra / 2**20,
    }


CASES = {
    "fit-diag-mlp": (case_fit, "mlp", "diag"),
    "fit-diag-cnn": (case_fit, "cnn", "diag"),
    "predict-diag-mlp": (case_predict, "mlp", "diag"),
    "predict-diag-cnn": (case_predict, "cnn", "diag"),
    "predict-full-mlp": (case_predict, "mlp", "full"),
    "fit-kron-mlp": (case_fit, "mlp", "kron"),
    "fit-kron-cnn": (case_fit, "cnn", "kron"),
    "predict-kron-cnn-100": (partial(case_predict, n_test=100), "cnn", "kron"),
    "predict-kron-cnn-1000": (case_predict, "cnn", "kron"),
    **BACKEND_CASES,
    "fit-ll-full-cnn": (case_fit_ll, "cnn", "full"),
    "fit-ll-kron-cnn": (case_fit_ll, "cnn", "kron"),
    "fit-ll-diag-cnn": (case_fit_ll, "cnn", "diag"),
    "marglik-fullll-mlp": (case_marglik_ll, "mlp", "full"),
    "predict-ll-kron-cnn": (partial(case_predict, subset="last_layer"), "cnn", "kron"),
    "fit-lowrank-cnn": (case_fit_lowrank, "cnn", "randomized"),
    "fit-lowrank-lanczos-cnn": (case_fit_lowrank, "cnn", "lanczos"),
    "fit-lowrank-lobpcg-cnn": (case_fit_lowrank, "cnn", "lobpcg"),
    "fit-subnet-full-cnn": (case_fit_subnet, "cnn", "full"),
    "marglik-training-kron-mlp": (case_marglik_training, "mlp", "kron"),
    "predict-gp-sod-mlp": (case_predict_gp, "mlp", 100),
    "evaluate-kron-cnn": (case_evaluate, "cnn", "kron"),
    "binary-diag-mlp": (case_binary_vs_classification, "mlp", "diag"),
    "binary-kron-mlp": (case_binary_vs_classification, "mlp", "kron"),
}


def run_one(name: str, repeats: int, threads: int = 2) -> dict:
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    fn, model_name, structure = CASES[name]
    return fn(model_name, structure, repeats)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default_cases = [name for name in CASES if name not in BACKEND_CASES]
    parser.add_argument("--cases", nargs="*", default=default_cases, choices=list(CASES))
    parser.add_argument(
        "--backends",
        action="store_true",
        help="run the fit time per backend × structure cases (results/backends.json)",
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--threads",
        type=int,
        default=2,
        help="torch threads per case (1 is steadier on a machine shared with other jobs)",
    )
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(run_one(args.one, args.repeats, args.threads)))
        return
    if args.backends:
        args.cases = list(BACKEND_CASES)
    rows = []
    for name in args.cases:
        out = subprocess.run(
            [
                sys.executable,
                __file__,
                "--one",
                name,
                "--repeats",
                str(args.repeats),
                "--threads",
                str(args.threads),
            ],
            capture_output=True,
            text=True,
            check=True,
        )
        row = json.loads(out.stdout.strip().splitlines()[-1])
        rows.append(row)
        extras = f"  ratio to fwd+10bwd {row['ratio']:.2f}" if "ratio" in row else ""
        if "ratio_to_forward" in row:
            extras = f"  ratio to 1 forward {row['ratio_to_forward']:.2f}"
        if "predict_ratio" in row:
            extras = (
                f"  binary / classification: fit {row['ratio']:.2f}, "
                f"predictive {row['predict_ratio']:.2f}"
            )
        if "ratio_to_predictive" in row:
            extras = f"  ratio to the predictive alone {row['ratio_to_predictive']:.3f}"
        print(
            f"{row['case']:42s} P={row['n_params']:>7d}  {row['seconds']:8.3f} s  "
            f"peak +{row['peak_extra_MB']:7.1f} MB{extras}",
            flush=True,
        )
    RESULTS.mkdir(exist_ok=True)
    out_file = RESULTS / ("backends.json" if args.backends else "run.json")
    out_file.write_text(json.dumps(rows, indent=2))
    print(f"results written to {out_file}")


if __name__ == "__main__":
    main()
