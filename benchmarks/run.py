"""Benchmarks: fit time against a forward/backward floor, and predictive time and peak memory.

Models, data and the measuring rules are in ``benchmarks/harness.py``; the low-rank,
subnetwork and Kronecker cases of the performance-frontier issue in ``benchmarks/frontier.py``;
all-weights Kron on tiny transformers in ``benchmarks/transformer.py``.
``--large`` adds the real-size cases of ``benchmarks/large.py`` (a ResNet-50) and
``benchmarks/large_llm.py`` (a 1.1B-parameter Llama with LoRA), which the default run leaves out.
Each case runs in its own subprocess so peak memory is its own; times are medians over the
repeats and a fit's ratio to its floor is the median of per-repeat ratios, floor and fit
alternating (see the harness).

Usage: ``python benchmarks/run.py [--cases NAME ...] [--repeats R] [--threads T]
[--clock wall|cpu] [--device cpu|cuda]``; prints a table and writes
``benchmarks/results/run.json``. ``--device cuda`` (``make bench-gpu``) runs the cases whose
models and data come from the harness (``GPU_CASES``) on a GPU, peak memory being the device's,
and writes ``benchmarks/results/run-cuda.json``. ``--backends`` instead times ``fit`` per
curvature backend × structure on both models and writes ``benchmarks/results/backends.json``.
The scaling
table (N and width) is ``benchmarks/scaling.py``. The ``tune-bayesopt-*`` case times
``optimize_prior_precision(method="bayesopt")`` (15 evaluations) beside a 21-point grid
search. The ``guard-overhead-*`` cases time a fit whose attribution guard checks its first
batch against the same fit with the verdict cached; every other case reports the seconds the
guard spent checking (``guard_s``) and their share of one timed call per engine checked
(``guard_share``, the first check, cold; ``guard_warm_share``, a fit's check once more after
its timed calls, ``harness.GuardTimer``). The ``fit-ekfac-vs-kron-*`` cases
alternate EKFAC's and Kron's fits in one process and report their per-pair ratio. The
``binary-*`` cases time ``likelihood="binary_classification"`` against ``"classification"``
on the MLP; the ``positions-*`` cases (``benchmarks/positions.py``) outputs with extra dimensions;
``large-vocab-ll-kron`` is the 32,000-class head of ``benchmarks/large_vocab.py``; the
``fit-*-bert*``, ``fit-*-lstm`` and ``fit-*-gru`` cases (``benchmarks/bert.py``) all-weights
fits of a 4-layer BERT (trainable position embeddings, float32 and bfloat16) and of a 2-layer
LSTM (GRU) classifier;
the ``matfree-*`` cases (``benchmarks/matfree.py``) the matrix-free posterior of a
million-weight MLP, beside ``FullLaplace`` on a small one, and its preconditioners. The
``import-time`` case times ``import laplace`` beyond ``import torch`` in fresh interpreters, and
laplace-torch's beside it with ``LAPLACE_TORCH_PYTHON=/path/to/python``. The ``marglik-*`` cases
time 100 steps of ``optimize_prior_precision(method="marglik")`` after a fresh fit, on the
scenarios of laplace-torch's own tests and examples (its regression example's MLP for the full
posterior, the MLP and CNN here for the others); ``fit-marglik-kron-cnn`` times the fit too
(laplace-torch eigen-decomposes Kron's factors in its fit, laplace-ng in the first step), and
``predict-calls-kron-mlp`` 100 GLM probit predictions of 8 points each (the per-call overhead).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

import torch
from bert import BERT_CASES
from frontier import FRONTIER_CASES
from harness import (
    BATCH,
    MODELS,
    N_CLASSES,
    N_TEST,
    N_TRAIN,
    GuardTimer,
    PeakRSS,
    data,
    forward_pass,
    forward_plus_10_backward,
    guard_overhead,
    measure_fit,
    measure_predict,
    regression_loader,
    regression_mlp,
    synchronize,
    timed,
    training_loader,
    use_clock,
    use_device,
)
from large import LARGE_CASES
from large_llm import LARGE_LLM_CASES
from large_vocab import LARGE_VOCAB_CASES
from large_vocab_all import LARGE_VOCAB_ALL_CASES
from matfree import MATFREE_CASES
from positions import POSITION_CASES
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from transformer import TRANSFORMER_CASES

RESULTS = Path(__file__).resolve().parent / "results"
#: The cases that only ``--large`` runs: ResNet-50 and the 1.1B Llama with LoRA.
REAL_SIZE_CASES = {**LARGE_CASES, **LARGE_LLM_CASES}


def case_fit(model_name: str, structure: str, repeats: int) -> dict:
    from laplace import Laplace

    model = MODELS[model_name]().eval()
    loader = training_loader(model_name)
    la = Laplace(model, "classification", subset_of_weights="all", hessian_structure=structure)
    floor = partial(forward_plus_10_backward, model, loader)
    return measure_fit(la, loader, repeats, f"fit {structure} {model_name}", floor)


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


def case_fit_against_kron(
    model_name: str, structure: str, repeats: int, decomposed: bool = False
) -> dict:
    """``structure``'s fit against Kron's fit of the same model, the two alternating in one
    process, so that the machine's drift cancels in the per-pair ratio; with ``decomposed``
    Kron's fit and its first eigendecomposition (which EKFAC's fit contains)."""
    from laplace import Laplace

    model = MODELS[model_name]().eval()
    loader = training_loader(model_name)
    kron = Laplace(model, "classification", subset_of_weights="all", hessian_structure="kron")
    kron.fit(loader)

    def kron_floor() -> None:
        kron.fit(loader)
        if decomposed:
            kron.log_det_posterior_precision  # noqa: B018 (decomposes the fitted factors)

    la = Laplace(model, "classification", subset_of_weights="all", hessian_structure=structure)
    floor = "Kron fit + decomposition" if decomposed else "Kron fit"
    case = f"fit {structure} vs {floor.lower()} {model_name}"
    row = measure_fit(la, loader, repeats, case, kron_floor)
    return {**row, "floor": floor}


def case_guard_overhead(model_name: str, structure: str, repeats: int) -> dict:
    """The attribution guard's share of an all-weights fit (``harness.guard_overhead``)."""
    from laplace import Laplace

    model = MODELS[model_name]().eval()
    la = Laplace(model, "classification", subset_of_weights="all", hessian_structure=structure)
    row = guard_overhead(la, training_loader(model_name), repeats)
    return {"case": f"guard overhead {structure} {model_name}", **row}


def case_fit_ll(model_name: str, structure: str, repeats: int) -> dict:
    from laplace import Laplace

    model = MODELS[model_name]().eval()
    loader = training_loader(model_name)
    la = Laplace(model, "classification", "last_layer", structure)
    row = measure_fit(
        la,
        loader,
        repeats,
        f"fit last-layer {structure} {model_name}",
        partial(forward_pass, model, loader),
    )
    return {**row, "floor": "1 forward"}


def case_marglik(
    model_name: str,
    structure: str,
    repeats: int,
    subset: str = "last_layer",
    with_fit: bool = False,
) -> dict:
    """100 marglik steps (``optimize_prior_precision(method="marglik", n_steps=100)``) after a
    fresh fit; with ``with_fit`` the fit is timed too (laplace-torch eigendecomposes Kron's
    factors in the fit, laplace-ng on first use). ``model_name="regression"`` is
    laplace-torch's regression example (``harness.regression_mlp``)."""
    from laplace import Laplace

    if model_name == "regression":
        model, loader, likelihood = regression_mlp().eval(), regression_loader(), "regression"
    else:
        model, loader = MODELS[model_name]().eval(), training_loader(model_name)
        likelihood = "classification"

    def tune():  # a fresh fit each time, so the one-off factorisation is included
        la = Laplace(model, likelihood, subset, structure)
        synchronize()
        start = time.perf_counter()
        la.fit(loader)
        synchronize()
        fitted = time.perf_counter()
        la.optimize_prior_precision(method="marglik", n_steps=100)
        synchronize()
        end = time.perf_counter()
        return la, (end - start) if with_fit else (end - fitted)

    with PeakRSS() as mem:
        la, tune_s = min((tune() for _ in range(repeats)), key=lambda r: r[1])
    what = "fit + 100 marglik steps" if with_fit else "marglik 100 steps"
    return {
        "case": f"{what} {subset.replace('_', '-')} {structure} {model_name}",
        "n_params": la.n_params,
        "seconds": tune_s,
        "peak_extra_MB": mem.extra / 2**20,
    }


def case_predict_calls(
    model_name: str, structure: str, repeats: int, n_calls: int = 100, n_test: int = 8
) -> dict:
    """``n_calls`` GLM probit predictions of ``n_test`` points each: the per-call overhead."""
    from laplace import Laplace

    model = MODELS[model_name]().eval()
    la = Laplace(model, "classification", subset_of_weights="all", hessian_structure=structure)
    la.fit(training_loader(model_name))
    X_test, _ = data(model_name, n_test, 1)
    la(X_test, pred_type="glm", link_approx="probit")  # warm the posterior factorisation

    def predict() -> None:
        for _ in range(n_calls):
            la(X_test, pred_type="glm", link_approx="probit")

    with PeakRSS() as mem:
        seconds = timed(predict, repeats)
    return {
        "case": f"{n_calls} glm probit calls {structure} {model_name} ({n_test} points)",
        "n_params": la.n_params,
        "seconds": seconds,
        "peak_extra_MB": mem.extra / 2**20,
    }


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


def case_tune_bayesopt(model_name: str, structure: str, repeats: int, n_val: int = N_TEST) -> dict:
    """Prior tuning by Bayesian optimisation (15 evaluations) beside a 21-point grid search.

    Both search the same range by the validation NLL of the GLM probit predictive of a
    last-layer approximation, in turns (medians over the repeats); each has its own peak memory.
    Optuna is imported before the clock starts.
    """
    import optuna  # noqa: F401  (imported once, outside the timings)

    from laplace import Laplace

    model = MODELS[model_name]().eval()
    la = Laplace(model, "classification", "last_layer", structure)
    la.fit(training_loader(model_name))
    val_loader = DataLoader(TensorDataset(*data(model_name, n_val, 1)), batch_size=500)
    searches = {
        "bayesopt": {"method": "bayesopt", "n_steps": 15, "seed": 0},
        "grid": {"method": "gridsearch", "grid_size": 21},
    }
    times: dict[str, list[float]] = {name: [] for name in searches}
    peaks: dict[str, float] = dict.fromkeys(searches, 0.0)
    chosen = {}
    for _ in range(repeats):
        for name, options in searches.items():
            search = partial(la.optimize_prior_precision, val_loader=val_loader, loss="nll")
            with PeakRSS() as mem:
                times[name].append(timed(partial(search, **options), 1))
            peaks[name] = max(peaks[name], mem.extra / 2**20)
            chosen[name] = la.prior_precision.item()
    bayesopt_s, grid_s = statistics.median(times["bayesopt"]), statistics.median(times["grid"])
    return {
        "case": f"bayesopt 15 vs grid 21 last-layer {structure} {model_name} ({n_val} val)",
        "n_params": la.n_params,
        "seconds": bayesopt_s,
        "grid_seconds": grid_s,
        "ratio": bayesopt_s / grid_s,
        "floor": "the 21-point grid search",
        "chosen_prior_precision": chosen,
        "repeats_s": times,
        "peak_extra_MB": peaks["bayesopt"],
        "grid_peak_extra_MB": peaks["grid"],
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


#: An interpreter with laplace-torch 0.3 installed, for its figure beside ours in ``import-time``.
LAPLACE_TORCH_PYTHON = os.environ.get("LAPLACE_TORCH_PYTHON")

_IMPORT_TIMER = (
    "import time\n"
    "start = time.perf_counter()\n"
    "import torch\n"
    "middle = time.perf_counter()\n"
    "import laplace\n"
    "print(time.perf_counter() - middle, middle - start)"
)


def _import_seconds(python: str, env: dict[str, str], repeats: int) -> dict:
    """Median over ``repeats`` fresh interpreters of ``import laplace`` after ``import torch``."""
    beyond, torch_s = [], []
    for _ in range(repeats):
        out = subprocess.run(
            [python, "-c", _IMPORT_TIMER], check=True, capture_output=True, text=True, env=env
        ).stdout.split()
        beyond.append(float(out[-2]))
        torch_s.append(float(out[-1]))
    return {
        "beyond_torch_s": statistics.median(beyond),
        "torch_s": statistics.median(torch_s),
        "repeats_s": beyond,
    }


def case_import_time(model_name: str, structure: str, repeats: int) -> dict:
    """``import laplace`` beyond ``import torch``: median of fresh interpreters (at least 5).

    laplace-torch's figure is measured beside it when ``LAPLACE_TORCH_PYTHON`` names an
    interpreter that has it (without this checkout on its path).
    """
    repeats = max(repeats, 5)
    ours = _import_seconds(sys.executable, dict(os.environ), repeats)
    row = {
        "case": "import laplace (beyond import torch)",
        "seconds": ours["beyond_torch_s"],
        "import_torch_s": ours["torch_s"],
        "repeats_s": ours["repeats_s"],
        "peak_extra_MB": 0.0,
    }
    if LAPLACE_TORCH_PYTHON:
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        reference = _import_seconds(LAPLACE_TORCH_PYTHON, env, repeats)
        row["laplace_torch_s"] = reference["beyond_torch_s"]
        row["note"] = f"laplace-torch 0.3: {reference['beyond_torch_s']:.3f} s"
    return row


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
    "fit-ekfac-mlp": (case_fit, "mlp", "ekfac"),
    "fit-ekfac-cnn": (case_fit, "cnn", "ekfac"),
    "predict-ekfac-cnn-100": (partial(case_predict, n_test=100), "cnn", "ekfac"),
    "fit-ekfac-vs-kron-mlp": (case_fit_against_kron, "mlp", "ekfac"),
    "fit-ekfac-vs-kron-cnn": (case_fit_against_kron, "cnn", "ekfac"),
    "fit-ekfac-vs-kron-decomposed-cnn": (
        partial(case_fit_against_kron, decomposed=True),
        "cnn",
        "ekfac",
    ),
    **{
        f"guard-overhead-{structure}-{model_name}": (case_guard_overhead, model_name, structure)
        for model_name in ("mlp", "cnn")
        for structure in ("diag", "kron", "ekfac")
    },
    **BACKEND_CASES,
    "fit-ll-full-cnn": (case_fit_ll, "cnn", "full"),
    "fit-ll-kron-cnn": (case_fit_ll, "cnn", "kron"),
    "fit-ll-diag-cnn": (case_fit_ll, "cnn", "diag"),
    "fit-ll-ekfac-cnn": (case_fit_ll, "cnn", "ekfac"),
    "marglik-fullll-mlp": (case_marglik, "mlp", "full"),
    "marglik-diag-mlp": (partial(case_marglik, subset="all"), "mlp", "diag"),
    "marglik-full-regression": (partial(case_marglik, subset="all"), "regression", "full"),
    "marglik-kron-mlp": (partial(case_marglik, subset="all"), "mlp", "kron"),
    "marglik-kronll-cnn": (case_marglik, "cnn", "kron"),
    "marglik-diagll-cnn": (case_marglik, "cnn", "diag"),
    "marglik-kron-cnn": (partial(case_marglik, subset="all"), "cnn", "kron"),
    "fit-marglik-kron-cnn": (partial(case_marglik, subset="all", with_fit=True), "cnn", "kron"),
    "predict-calls-kron-mlp": (case_predict_calls, "mlp", "kron"),
    "predict-ll-kron-cnn": (partial(case_predict, subset="last_layer"), "cnn", "kron"),
    **FRONTIER_CASES,
    **TRANSFORMER_CASES,
    "marglik-training-kron-mlp": (case_marglik_training, "mlp", "kron"),
    "predict-gp-sod-mlp": (case_predict_gp, "mlp", 100),
    "evaluate-kron-cnn": (case_evaluate, "cnn", "kron"),
    "binary-diag-mlp": (case_binary_vs_classification, "mlp", "diag"),
    "binary-kron-mlp": (case_binary_vs_classification, "mlp", "kron"),
    "tune-bayesopt-ll-kron-mlp": (case_tune_bayesopt, "mlp", "kron"),
    **POSITION_CASES,
    **LARGE_VOCAB_CASES,
    **LARGE_VOCAB_ALL_CASES,
    **BERT_CASES,
    **MATFREE_CASES,
    "import-time": (case_import_time, "", ""),
    **REAL_SIZE_CASES,
}


#: The cases whose models and data come from the harness or follow its device (``bert.py``), so
#: that ``--device cuda`` puts them on the GPU (the others build their own; the Lanczos
#: reference of ``lowrank-accuracy-mlp`` runs SciPy on the host).
GPU_CASES = [
    name
    for name in CASES
    if name not in BACKEND_CASES
    and name not in TRANSFORMER_CASES
    and name not in POSITION_CASES
    and name not in LARGE_VOCAB_CASES
    and name not in LARGE_VOCAB_ALL_CASES
    and name not in MATFREE_CASES
    and name != "lowrank-accuracy-mlp"
    and name != "import-time"
    and name not in REAL_SIZE_CASES
]


def run_one(
    name: str, repeats: int, threads: int = 2, clock: str = "wall", device: str = "cpu"
) -> dict:
    torch.set_num_threads(threads)
    use_clock(clock)
    use_device(device)
    torch.manual_seed(0)
    fn, model_name, structure = CASES[name]
    # torch imports it on the process's first autograd.grad given gradients (sympy, about 1 s):
    # a cost of the process, not of whichever case or check first calls it
    importlib.import_module("torch.fx.experimental.symbolic_shapes")
    # and torch._dynamo on the process's first torch.optim optimizer (seconds): laplace-torch's
    # fit imports it (untimed in the marglik cases), laplace-ng's tuning never does
    importlib.import_module("torch._dynamo")
    with GuardTimer() as guard:
        row = fn(model_name, structure, repeats)
    row.update(guard.columns(row["seconds"]))
    where = {"device": device}
    if device == "cuda":
        where["gpu"] = torch.cuda.get_device_name()
    return {
        **row,
        "threads": threads,
        "clock": clock,
        **where,
        "load_avg_1min": os.getloadavg()[0],
    }


def format_row(row: dict) -> str:
    """One printed line: time, memory, ratio to the floor, machine load, notes."""
    extras = ""
    if "ratio" in row:
        extras = f"  {row['ratio']:6.2f}x {row.get('floor', '1 fwd + 10 bwd')}"
    if "ratio_to_predictive" in row:
        extras = f"  {row['ratio_to_predictive']:6.3f}x the predictive alone"
    if "predict_ratio" in row:
        extras = (
            f"  binary / classification: fit {row['ratio']:.2f}, "
            f"predictive {row['predict_ratio']:.2f}"
        )
    if "guard_share" in row:
        extras += f"  guard {100 * row['guard_share']:.1f}%"
    if "guard_warm_share" in row:
        extras += f" (warm {100 * row['guard_warm_share']:.1f}%)"
    if "first_use_peak_extra_MB" in row:
        extras += (
            f"  estimate {row['estimate_MB']:.0f} MB, peak to the first use "
            f"+{row['first_use_peak_extra_MB']:.0f} MB"
        )
    if "note" in row:
        extras += f"  {row['note']}"
    params = f"P={row['n_params']:>7d}" if "n_params" in row else " " * 9
    return (
        f"{row['case']:44s} {params}  {row['seconds']:8.3f} s  "
        f"peak +{row['peak_extra_MB']:7.1f} MB  load {row['load_avg_1min']:4.1f}{extras}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default_cases = [name for name in CASES if name not in BACKEND_CASES | REAL_SIZE_CASES]
    parser.add_argument("--cases", nargs="*", default=default_cases, choices=list(CASES))
    parser.add_argument(
        "--backends",
        action="store_true",
        help="run the fit time per backend × structure cases (results/backends.json)",
    )
    parser.add_argument(
        "--large",
        action="store_true",
        help="run the real-size cases (benchmarks/large.py: ResNet-50; benchmarks/large_llm.py: "
        "a 1.1B Llama with LoRA) after the default ones",
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    parser.add_argument(
        "--clock",
        choices=["wall", "cpu"],
        default="wall",
        help="wall time (default) or process CPU time (robust to load with --threads 1)",
    )
    parser.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default="cpu",
        help="cuda: the cases of GPU_CASES on a GPU (default cases: all of them)",
    )
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.device == "cuda":
        if not torch.cuda.is_available():
            sys.exit("--device cuda needs a CUDA GPU: torch.cuda.is_available() is False here")
        if args.clock == "cpu":
            parser.error("--clock cpu does not count GPU time: use --clock wall on a GPU")
        if args.backends:
            parser.error("--backends runs on the CPU only")
        if "--cases" not in sys.argv:
            args.cases = GPU_CASES
        elif unsupported := [name for name in args.cases if name not in GPU_CASES]:
            parser.error(f"not GPU cases (they build their own models): {', '.join(unsupported)}")
    if args.one:
        row = run_one(args.one, args.repeats, args.threads, args.clock, args.device)
        print(json.dumps(row))
        return
    if args.backends:
        args.cases = list(BACKEND_CASES)
    if args.large:
        args.cases = [*args.cases, *(name for name in REAL_SIZE_CASES if name not in args.cases)]
    rows = []
    for name in args.cases:
        options = ["--repeats", str(args.repeats), "--threads", str(args.threads)]
        options += ["--device", args.device]
        out = subprocess.run(
            [sys.executable, __file__, "--one", name, *options, "--clock", args.clock],
            capture_output=True,
            text=True,
            check=True,
        )
        row = json.loads(out.stdout.strip().splitlines()[-1])
        rows.append(row)
        print(format_row(row), flush=True)
    RESULTS.mkdir(exist_ok=True)
    stem = "backends" if args.backends else "run" if args.device == "cpu" else "run-cuda"
    out_file = RESULTS / f"{stem}.json"
    out_file.write_text(json.dumps(rows, indent=2))
    print(f"results written to {out_file}")


if __name__ == "__main__":
    main()
