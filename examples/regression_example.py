"""Sinusoid regression: MAP, full Laplace over all weights, evidence tuning of (p₀, σ).

Data: y = sin(x) + ε, ε ~ N(0, 0.3²), 150 points with x in [0, 8]. A 1-50-1 tanh MLP is trained to
its MAP, a full Laplace approximation over all 151 weights is fitted, and the prior precision p₀
and the noise σ are tuned by maximising the log marginal likelihood (σ̂ should land near 0.3).
The GLM predictive band is plotted. Then ``marglik_training`` trains a fresh network and its
hyperparameters jointly, and the same plot is drawn for it. Both predictives are scored on 500
held-out points from the training range with ``laplace.evaluation.evaluate`` (NLL, RMSE, CRPS,
interval coverage) and their PIT calibration curves are drawn side by side.

Runs offline in a few seconds on a CPU. Writes ``regression.png`` and ``metrics.json`` under
``outputs/regression_example/`` (or ``--output DIR``) and prints the folder.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from pathlib import Path

os.environ.setdefault("MPLBACKEND", "Agg")

import matplotlib.pyplot as plt
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from laplace import Laplace, marglik_training
from laplace.evaluation import evaluate, plot_calibration_curve, plot_predictive_band

SIGMA_TRUE = 0.3
DEFAULT_OUTPUT = Path(__file__).resolve().parent.parent / "outputs" / "regression_example"


# --8<-- [start:data_and_map]
def sinusoid_data(n: int = 150, seed: int = 711):
    gen = torch.Generator().manual_seed(seed)
    X = torch.rand(n, 1, generator=gen) * 8
    y = torch.sin(X) + SIGMA_TRUE * torch.randn(n, 1, generator=gen)
    return X, y


def make_model() -> nn.Module:
    torch.manual_seed(711)
    return nn.Sequential(nn.Linear(1, 50), nn.Tanh(), nn.Linear(50, 1))


def train_map(loader: DataLoader, n_epochs: int = 1000) -> nn.Module:
    model = make_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(n_epochs):
        for X, y in loader:
            optimizer.zero_grad()
            nn.functional.mse_loss(model(X), y).backward()
            optimizer.step()
    return model


# --8<-- [end:data_and_map]


# --8<-- [start:tune_evidence]
def tune_evidence(la, n_steps: int = 1000) -> None:
    """Adam on (log p₀, log σ) ascending the differentiable log marginal likelihood."""
    log_prior, log_sigma = torch.zeros(1, requires_grad=True), torch.zeros(1, requires_grad=True)
    optimizer = torch.optim.Adam([log_prior, log_sigma], lr=1e-1)
    for _ in range(n_steps):
        optimizer.zero_grad()
        neg_marglik = -la.log_marginal_likelihood(log_prior.exp(), log_sigma.exp())
        neg_marglik.backward()
        optimizer.step()
    la.prior_precision = log_prior.detach().exp()
    la.sigma_noise = log_sigma.detach().exp()


# --8<-- [end:tune_evidence]


def decorate(ax, X_test: torch.Tensor) -> None:
    """The true function and the range of the training data."""
    ax.plot(X_test.squeeze(-1), torch.sin(X_test).squeeze(-1), "k--", lw=1, label="sin(x)")
    ax.axvspan(0, 8, color="0.93", zorder=0)
    ax.set_ylim(-3, 3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT)
    parser.add_argument("--marglik-epochs", type=int, default=1000)
    args = parser.parse_args()
    torch.set_num_threads(1)
    X, y = sinusoid_data()
    loader = DataLoader(TensorDataset(X, y), batch_size=150)
    test_loader = DataLoader(TensorDataset(*sinusoid_data(500, seed=712)), batch_size=250)
    X_plot = torch.linspace(-5, 13, 500).unsqueeze(-1)

    # 1. MAP, then a post-hoc full Laplace with evidence tuning of (p₀, σ).
    start = time.perf_counter()
    model = train_map(loader)
    train_s = time.perf_counter() - start
    start = time.perf_counter()
    # --8<-- [start:fit]
    la = Laplace(model, "regression", subset_of_weights="all", hessian_structure="full")
    la.fit(loader)
    tune_evidence(la)
    # --8<-- [end:fit]
    laplace_s = time.perf_counter() - start

    # 2. marglik_training: weights and hyperparameters jointly (Immer et al., 2021).
    start = time.perf_counter()
    # --8<-- [start:marglik_training]
    la_ml, _, margliks, _ = marglik_training(
        make_model(),
        loader,
        likelihood="regression",
        hessian_structure="full",
        optimizer_kwargs={"lr": 1e-2},
        n_epochs=args.marglik_epochs,
        n_epochs_burnin=100,
        marglik_frequency=50,
        n_hypersteps=50,
        prior_structure="scalar",
    )
    # --8<-- [end:marglik_training]
    marglik_s = time.perf_counter() - start

    # Held-out points from the training range: NLL, RMSE, CRPS, coverage, PIT curve.
    # --8<-- [start:evaluate]
    levels = (0.5, 0.9, 0.95)
    test = {
        "post-hoc Laplace": evaluate(la, test_loader, coverage_levels=levels),
        "marglik_training": evaluate(la_ml, test_loader, coverage_levels=levels),
    }
    _, f_var = la(X_plot)
    pred_std = (f_var.squeeze(-1).squeeze(-1) + la.sigma_noise.square()).sqrt().detach()
    # --8<-- [end:evaluate]
    inside = (X_plot.squeeze(-1) > 0) & (X_plot.squeeze(-1) < 8)
    metrics = {
        "n_params": la.n_params,
        "sigma_true": SIGMA_TRUE,
        "sigma_hat": la.sigma_noise.item(),
        "sigma_hat_relative_error": abs(la.sigma_noise.item() - SIGMA_TRUE) / SIGMA_TRUE,
        "prior_precision": la.prior_precision.item(),
        "log_marginal_likelihood": la.log_marginal_likelihood().item(),
        "mean_pred_std_in_data_range": pred_std[inside].mean().item(),
        "mean_pred_std_outside_data_range": pred_std[~inside].mean().item(),
        "marglik_training_sigma_hat": la_ml.sigma_noise.item(),
        "marglik_training_prior_precision": la_ml.prior_precision.mean().item(),
        "marglik_training_neg_log_marglik": float(margliks[-1]) if margliks else None,
        "train_map_seconds": round(train_s, 2),
        "laplace_fit_and_tuning_seconds": round(laplace_s, 2),
        "marglik_training_seconds": round(marglik_s, 2),
    }
    assert math.isfinite(metrics["log_marginal_likelihood"])

    fig, axes = plt.subplots(1, 3, figsize=(15, 4), gridspec_kw={"width_ratios": (1.3, 1.3, 1)})
    for ax, laplace, title in (
        (axes[0], la, f"MAP + full Laplace, evidence-tuned (σ̂ = {metrics['sigma_hat']:.3f})"),
        (axes[1], la_ml, f"marglik_training (σ̂ = {metrics['marglik_training_sigma_hat']:.3f})"),
    ):
        plot_predictive_band(laplace, X_plot, data=(X, y), ax=ax, title=title)
        decorate(ax, X_plot)
    axes[0].legend(loc="lower left", fontsize=7)
    for name, result in test.items():
        plot_calibration_curve(result, ax=axes[2], label=name, title="held-out data, PIT")
    fig.tight_layout()
    args.output.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.output / "regression.png", dpi=120)
    summary = {**metrics, "test": test}
    (args.output / "metrics.json").write_text(json.dumps(summary, indent=2))

    print("Full Laplace over all weights, sinusoid regression (true σ = 0.3):")
    for key, value in metrics.items():
        print(f"  {key:42s} {value:.4g}" if isinstance(value, float) else f"  {key:42s} {value}")
    print("held-out data from the training range (500 points):")
    print(f"  {'predictive':18s} {'NLL':>7s} {'RMSE':>7s} {'CRPS':>7s} {'cov. 90%':>9s}")
    for name, m in test.items():
        print(
            f"  {name:18s} {m['nll']:7.4f} {m['rmse']:7.4f} {m['crps']:7.4f} "
            f"{m['coverage']['0.9']:9.3f}"
        )
    print(f"figures and metrics written to {args.output}/ (regression.png, metrics.json)")


if __name__ == "__main__":
    main()
