"""Binary and multi-label classification with ``likelihood="binary_classification"``.

Two problems from data that ship with scikit-learn (no download):

- **binary**: the breast cancer data (569 tumours, 30 features, malignant or benign), an MLP
  30-32-32-1 trained with ``BCEWithLogitsLoss``;
- **multi-label**: the handwritten digits (1,797 8×8 images) with four yes/no labels per
  image, is the digit even, at least 5, prime, a multiple of 3, and an MLP 64-64-64-4 with one
  logit per label.

Each network is trained to its MAP without weight decay, so it ends up over-confident. Then
last-layer and all-weights KFAC Laplace approximations are fitted, their prior precision tuned
by the marginal likelihood (and for all weights also by grid search on the validation
Bernoulli NLL, 10% of the data), and their GLM probit predictive (``σ(μ/√(1 + π v/8))`` per label)
scored with ``laplace.evaluation.evaluate`` against the MAP network's ``σ(f)``: mean negative
log-likelihood and expected calibration error per label (15 bins), accuracy, Brier score.
The figure shows the reliability curve of the pooled label probabilities and the NLL and ECE of
each predictive. Writes ``binary.png`` and ``metrics.json`` under
``outputs/binary_classification_example/`` (or ``--output DIR``) and prints the folder. A few
seconds on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

os.environ.setdefault("MPLBACKEND", "Agg")

import matplotlib.pyplot as plt
import torch
from sklearn.datasets import load_breast_cancer, load_digits
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from laplace import Laplace
from laplace.evaluation import evaluate

DEFAULT_OUTPUT = (
    Path(__file__).resolve().parent.parent / "outputs" / "binary_classification_example"
)
LIKELIHOOD = "binary_classification"
LAPLACES = {
    "LA last-layer KFAC (marglik)": ("last_layer", "marglik"),
    "LA all-weights KFAC (marglik)": ("all", "marglik"),
    "LA all-weights KFAC (val. NLL)": ("all", "gridsearch"),
}
N_BINS = 10


def breast_cancer() -> tuple[torch.Tensor, torch.Tensor]:
    bunch = load_breast_cancer()
    X = torch.tensor(bunch.data, dtype=torch.float32)
    X = (X - X.mean(0)) / X.std(0)
    return X, torch.tensor(bunch.target, dtype=torch.float32).unsqueeze(-1)


def digit_labels() -> tuple[torch.Tensor, torch.Tensor]:
    bunch = load_digits()
    digit = torch.tensor(bunch.target)
    labels = torch.stack(
        [
            digit % 2 == 0,
            digit >= 5,
            torch.isin(digit, torch.tensor([2, 3, 5, 7])),
            digit % 3 == 0,
        ],
        dim=1,
    )
    return torch.tensor(bunch.data, dtype=torch.float32) / 16.0, labels.float()


def split(X: torch.Tensor, y: torch.Tensor, seed: int = 0):
    """50% train, 10% validation, 40% test."""
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    n_train, n_val = int(0.5 * len(y)), int(0.1 * len(y))
    parts = perm[:n_train], perm[n_train : n_train + n_val], perm[n_train + n_val :]
    return [(X[part], y[part]) for part in parts]


def train_map(X: torch.Tensor, y: torch.Tensor, n_epochs: int) -> nn.Module:
    torch.manual_seed(0)
    width = 64 if X.shape[1] > 32 else 32
    model = nn.Sequential(
        nn.Linear(X.shape[1], width),
        nn.ReLU(),
        nn.Linear(width, width),
        nn.ReLU(),
        nn.Linear(width, y.shape[1]),
    )
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    loader = DataLoader(TensorDataset(X, y), batch_size=64, shuffle=True)
    for _ in range(n_epochs):
        for xb, yb in loader:
            optimizer.zero_grad()
            nn.functional.binary_cross_entropy_with_logits(model(xb), yb).backward()
            optimizer.step()
    return model.eval()


def reliability(predictive, X: torch.Tensor, y: torch.Tensor) -> dict[str, list[float]]:
    """Mean predicted probability and observed frequency of the labels in each bin."""
    with torch.no_grad():
        probs = predictive(X).flatten()
    targets = y.flatten()
    bins = torch.clamp((probs * N_BINS).long(), max=N_BINS - 1)
    counts = torch.bincount(bins, minlength=N_BINS).clamp_min(1)
    mean_prob = torch.bincount(bins, probs, minlength=N_BINS) / counts
    frequency = torch.bincount(bins, targets, minlength=N_BINS) / counts
    keep = torch.bincount(bins, minlength=N_BINS) > 0
    return {"confidence": mean_prob[keep].tolist(), "frequency": frequency[keep].tolist()}


def run(name: str, X: torch.Tensor, y: torch.Tensor, n_epochs: int) -> dict:
    (X_train, y_train), (X_val, y_val), (X_test, y_test) = split(X, y)
    start = time.perf_counter()
    model = train_map(X_train, y_train, n_epochs)
    seconds = {"MAP": time.perf_counter() - start}
    fit_loader = DataLoader(TensorDataset(X_train, y_train), batch_size=256)
    val_loader = DataLoader(TensorDataset(X_val, y_val), batch_size=256)
    test_loader = DataLoader(TensorDataset(X_test, y_test), batch_size=256)
    predictives = {"MAP": lambda x: torch.sigmoid(model(x).double())}  # 1.0 in float32
    prior_precisions = {}
    for label, (subset, method) in LAPLACES.items():
        start = time.perf_counter()
        la = Laplace(model, LIKELIHOOD, subset_of_weights=subset, hessian_structure="kron")
        la.fit(fit_loader)
        la.optimize_prior_precision(method=method, val_loader=val_loader)  # val.: Bernoulli NLL
        seconds[label] = time.perf_counter() - start
        predictives[label] = la
        prior_precisions[label] = la.prior_precision.item()
    metrics = {
        label: evaluate(predictive, test_loader, likelihood=LIKELIHOOD, link_approx="probit")
        if label != "MAP"
        else evaluate(predictive, test_loader, likelihood=LIKELIHOOD)
        for label, predictive in predictives.items()
    }
    curves = {label: reliability(p, X_test, y_test) for label, p in predictives.items()}
    return {
        "data": f"{name}: {len(y_train)} train / {len(y_val)} validation / {len(y_test)} test, "
        f"{y.shape[1]} label(s)",
        "metrics": metrics,
        "reliability": curves,
        "prior_precision": prior_precisions,
        "seconds": seconds,
    }


def plot(results: dict[str, dict], path: Path) -> None:
    fig, axes = plt.subplots(2, len(results), figsize=(5.2 * len(results), 8.4))
    for col, (name, result) in enumerate(results.items()):
        ax = axes[0, col]
        ax.plot([0, 1], [0, 1], color="grey", lw=1, ls="--", label="calibrated")
        for label, curve in result["reliability"].items():
            ax.plot(curve["confidence"], curve["frequency"], marker="o", label=label)
        ax.set(
            title=f"{name}: reliability",
            xlabel="predicted probability",
            ylabel="observed frequency",
        )
        ax.legend(loc="upper left", fontsize=8)
        ax = axes[1, col]
        labels = list(result["metrics"])
        x = torch.arange(len(labels), dtype=torch.float32)
        for offset, key in ((-0.2, "nll"), (0.2, "ece")):
            values = [result["metrics"][label][key] for label in labels]
            ax.bar((x + offset).tolist(), values, width=0.4, label=key.upper())
        short = [
            label.replace("LA last-layer", "LL")
            .replace("LA all-weights", "all")
            .replace(" (", "\n(")
            for label in labels
        ]
        ax.set_xticks(x.tolist(), short, fontsize=8)
        ax.set(title=f"{name}: test NLL and ECE (lower is better)")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT)
    args = parser.parse_args()
    torch.set_num_threads(1)
    results = {
        "breast cancer (binary)": run("breast cancer", *breast_cancer(), n_epochs=100),
        "digits (multi-label)": run("digits", *digit_labels(), n_epochs=150),
    }
    args.output.mkdir(parents=True, exist_ok=True)
    plot(results, args.output / "binary.png")
    summary = {
        name: {
            **result,
            "nll_ece": {
                label: {"nll": m["nll"], "ece": m["ece"]} for label, m in result["metrics"].items()
            },
        }
        for name, result in results.items()
    }
    (args.output / "metrics.json").write_text(json.dumps(summary, indent=2))
    for result in results.values():
        print(f"\n{result['data']} (GLM probit predictive)")
        print(f"  {'method':31s} {'acc':>7s} {'NLL':>7s} {'ECE':>7s} {'Brier':>7s} {'time':>7s}")
        for label, m in result["metrics"].items():
            print(
                f"  {label:31s} {m['accuracy']:7.3f} {m['nll']:7.3f} {m['ece']:7.3f} "
                f"{m['brier']:7.3f} {result['seconds'][label]:6.2f}s"
            )
    print(f"\nfigure and metrics: {args.output}")


if __name__ == "__main__":
    main()
