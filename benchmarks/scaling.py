"""Scaling table: fit and GLM-predictive time and peak memory against data size and width.

For Diag, Kron, low-rank (k = 50, default solver) and last-layer Kron Laplace on the benchmark
MLP (or ``--model cnn``) with every hidden width scaled by 1, 2 and 4, fitted on N = 1k, 4k and
16k points, and predicting 1,000 test points. Every configuration runs in its own subprocess
(its own peak memory). Growth exponents are least-squares slopes on log-log axes: of the fit
time against N at each width, and of fit and predictive time against the parameter count P at
each N; memory exponents likewise.

Usage: ``python benchmarks/scaling.py [--model mlp|cnn] [--structures ...] [--sizes ...]
[--widths ...] [--threads T] [--clock wall|cpu]``; prints the table and the exponents and writes
``benchmarks/results/scaling_<model>.json``. Slow (minutes): not part of ``make bench``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
STRUCTURES = ("diag", "kron", "lowrank", "ll-kron")
N_PREDICT = 1000


def run_config(
    model_name: str, structure: str, n: int, width: int, threads: int, clock: str
) -> dict:
    import torch
    from harness import BATCH, MODELS, PeakRSS, data, seconds, training_loader, use_clock

    from laplace import Laplace

    torch.set_num_threads(threads)
    use_clock(clock)
    torch.manual_seed(0)
    model = MODELS[model_name](width).eval()
    subset, hessian = ("last_layer", "kron") if structure == "ll-kron" else ("all", structure)
    kwargs = {"backend_kwargs": {"n_eigenvalues": 50}} if structure == "lowrank" else {}
    la = Laplace(model, "classification", subset, hessian, **kwargs)
    loader = training_loader(model_name, n)
    la.fit(training_loader(model_name, BATCH))  # warm-up: first-call costs are not per point
    with PeakRSS() as fit_mem:
        fit_s = seconds(lambda: la.fit(loader))
    X_test, _ = data(model_name, N_PREDICT, 1)
    la(X_test[:10], link_approx="probit")
    with PeakRSS() as pred_mem:
        pred_s = seconds(lambda: la(X_test, link_approx="probit"))
    n_params = sum(p.numel() for p in model.parameters())
    return {
        "structure": structure,
        "n_data": n,
        "width": width,
        "n_params": n_params,
        "fit_s": fit_s,
        "fit_MB": fit_mem.extra / 2**20,
        "predict_s": pred_s,
        "predict_MB": pred_mem.extra / 2**20,
        "load_avg_1min": os.getloadavg()[0],
    }


def slope(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of log y against log x."""
    lx, ly = [math.log(x) for x in xs], [math.log(max(y, 1e-9)) for y in ys]
    mx, my = sum(lx) / len(lx), sum(ly) / len(ly)
    return sum((a - mx) * (b - my) for a, b in zip(lx, ly)) / sum((a - mx) ** 2 for a in lx)


def exponents(rows: list[dict], structure: str, key: str) -> dict[str, dict[int, float]]:
    """Growth exponents of ``key`` in N (per width) and in P (per N) for one structure."""
    mine = [r for r in rows if r["structure"] == structure]
    out: dict[str, dict[int, float]] = {"N": {}, "P": {}}
    for width in sorted({r["width"] for r in mine}):
        pts = sorted((r["n_data"], r[key]) for r in mine if r["width"] == width)
        if len(pts) > 1:
            out["N"][width] = slope([p[0] for p in pts], [p[1] for p in pts])
    for n in sorted({r["n_data"] for r in mine}):
        pts = sorted((r["n_params"], r[key]) for r in mine if r["n_data"] == n)
        if len(pts) > 1:
            out["P"][n] = slope([p[0] for p in pts], [p[1] for p in pts])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["mlp", "cnn"], default="mlp")
    parser.add_argument("--structures", nargs="+", choices=STRUCTURES, default=list(STRUCTURES))
    parser.add_argument("--sizes", nargs="+", type=int, default=[1000, 4000, 16000])
    parser.add_argument("--widths", nargs="+", type=int, default=[1, 2, 4])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--clock", choices=["wall", "cpu"], default="wall")
    parser.add_argument("--one", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        structure, n, width = args.one
        row = run_config(args.model, structure, int(n), int(width), args.threads, args.clock)
        print(json.dumps(row))
        return
    rows = []
    print(
        f"{'structure':9s} {'N':>6s} {'width':>5s} {'P':>9s} {'fit s':>8s} {'fit MB':>8s} "
        f"{'pred s':>8s} {'pred MB':>8s} {'load':>5s}"
    )
    for structure in args.structures:
        for width in args.widths:
            for n in args.sizes:
                cmd = [sys.executable, __file__, "--model", args.model, "--threads"]
                cmd += [str(args.threads), "--clock", args.clock]
                out = subprocess.run(
                    [*cmd, "--one", structure, str(n), str(width)],
                    capture_output=True,
                    text=True,
                    check=True,
                )
                row = json.loads(out.stdout.strip().splitlines()[-1])
                rows.append(row)
                print(
                    f"{structure:9s} {n:6d} {width:5d} {row['n_params']:9d} {row['fit_s']:8.3f} "
                    f"{row['fit_MB']:8.1f} {row['predict_s']:8.3f} {row['predict_MB']:8.1f} "
                    f"{row['load_avg_1min']:5.1f}",
                    flush=True,
                )
    summary = {}
    print("\ngrowth exponents (log-log least squares)")
    for structure in args.structures:
        summary[structure] = {k: exponents(rows, structure, k) for k in ("fit_s", "predict_s")}
        fit, pred = summary[structure]["fit_s"], summary[structure]["predict_s"]
        n_exp = ", ".join(f"x{w}: {e:.2f}" for w, e in fit["N"].items())
        p_fit = ", ".join(f"N={n}: {e:.2f}" for n, e in fit["P"].items())
        p_pred = ", ".join(f"N={n}: {e:.2f}" for n, e in pred["P"].items())
        print(f"{structure:9s} fit ~ N^ ({n_exp}); fit ~ P^ ({p_fit}); predict ~ P^ ({p_pred})")
    RESULTS.mkdir(exist_ok=True)
    out_file = RESULTS / f"scaling_{args.model}.json"
    out_file.write_text(json.dumps({"rows": rows, "exponents": summary}, indent=2))
    print(f"results written to {out_file}")


if __name__ == "__main__":
    main()
