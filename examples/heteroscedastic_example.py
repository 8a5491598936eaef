"""Heteroscedastic regression: the network predicts its noise, Laplace adds the epistemic part.

300 points ``y = sin(x) + σ(x) ε`` on [0, 6] with noise that grows with x,
``σ(x) = 0.05 + 0.12 x``. An MLP 1-50-50-2 outputs the mean ``μ(x)`` and the log-variance
``s(x) = log σ²(x)`` and is trained to its MAP with the Gaussian negative log-likelihood
(``nn.GaussianNLLLoss`` on ``(μ, e^s)``). A full Laplace approximation over all weights with
``likelihood="heteroscedastic_regression"`` (the GGN with the Gaussian's Fisher
``diag(e^{−s}, ½)``) has its prior precision tuned by the marginal likelihood; its GLM
predictive gives the mean, the epistemic variance of the mean and the expected aleatoric
variance ``E[e^s]``. The figure draws the two bands (±2 standard deviations) on [−2, 8], beyond
the data on both sides, with the true noise level: the aleatoric band follows σ(x) inside the
data, the epistemic band widens outside it. ``laplace.evaluation.evaluate`` scores the Laplace
predictive and the MAP network's ``N(μ, e^s)`` on 500 held-out points from the data range.
Writes ``heteroscedastic.png`` and ``metrics.json`` under ``outputs/heteroscedastic_example/``
(or ``--output DIR``) and prints the folder. A few seconds on 2 CPU cores.
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
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from laplace import Laplace
from laplace.evaluation import evaluate
from laplace.likelihoods import HeteroscedasticPrediction

DEFAULT_OUTPUT = Path(__file__).resolve().parent.parent / "outputs" / "heteroscedastic_example"
LIKELIHOOD = "heteroscedastic_regression"


def noise_std(x: torch.Tensor) -> torch.Tensor:
    return 0.05 + 0.12 * x


def data(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    x = 6 * torch.rand(n, 1, generator=generator)
    y = torch.sin(x) + noise_std(x) * torch.randn(n, 1, generator=generator)
    return x, y


def train_map(loader: DataLoader, n_epochs: int = 600) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(1, 50), nn.Tanh(), nn.Linear(50, 50), nn.Tanh(), nn.Linear(50, 2)
    )
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3, weight_decay=1e-4)
    loss_fn = nn.GaussianNLLLoss()
    for _ in range(n_epochs):
        for x, y in loader:
            optimizer.zero_grad()
            mu, log_var = model(x).chunk(2, dim=-1)
            loss_fn(mu, y, log_var.exp()).backward()
            optimizer.step()
    return model.eval()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT)
    args = parser.parse_args()
    torch.set_num_threads(1)
    X, y = data(300, seed=0)
    X_test, y_test = data(500, seed=1)
    loader = DataLoader(TensorDataset(X, y), batch_size=50, shuffle=True)

    start = time.perf_counter()
    model = train_map(loader)
    seconds = {"MAP": time.perf_counter() - start}
    start = time.perf_counter()
    la = Laplace(model, LIKELIHOOD, subset_of_weights="all", hessian_structure="full")
    la.fit(DataLoader(TensorDataset(X, y), batch_size=300))
    la.optimize_prior_precision(method="marglik")
    seconds["Laplace"] = time.perf_counter() - start

    def map_predictive(x: torch.Tensor) -> HeteroscedasticPrediction:
        mu, log_var = model(x).chunk(2, dim=-1)
        return HeteroscedasticPrediction(mu, torch.zeros_like(mu), log_var.exp())

    test_loader = DataLoader(TensorDataset(X_test, y_test), batch_size=250)
    metrics = {
        "MAP": evaluate(map_predictive, test_loader, likelihood=LIKELIHOOD),
        "Laplace": evaluate(la, test_loader),
    }

    grid = torch.linspace(-2, 8, 400).unsqueeze(-1)
    prediction = la(grid, diagonal_output=True)
    mean = prediction.mean.squeeze(-1).detach()
    epistemic = prediction.epistemic_variance.squeeze(-1).sqrt().detach()
    aleatoric = prediction.aleatoric_variance.squeeze(-1).sqrt().detach()
    total = prediction.variance.squeeze(-1).sqrt().detach()
    x = grid.squeeze(-1)
    fig, ax = plt.subplots(figsize=(8, 4.6))
    ax.fill_between(x, mean - 2 * total, mean + 2 * total, color="C0", alpha=0.2,
                    label="±2 std total (aleatoric + epistemic)")  # fmt: skip
    ax.fill_between(x, mean - 2 * epistemic, mean + 2 * epistemic, color="C1", alpha=0.5,
                    label="±2 std epistemic")  # fmt: skip
    ax.plot(x, mean, color="C0", label="predictive mean")
    inside = (x >= 0) & (x <= 6)
    for sign in (-1, 1):
        ax.plot(x[inside], torch.sin(x[inside]) + sign * 2 * noise_std(x[inside]), color="k",
                ls="--", lw=1, label="true ±2σ(x)" if sign > 0 else None)  # fmt: skip
        ax.plot(x, mean + sign * 2 * aleatoric, color="C2", lw=1,
                label="±2 std aleatoric E[e^s]^½" if sign > 0 else None)  # fmt: skip
    ax.scatter(X.squeeze(-1), y.squeeze(-1), s=6, color="k", alpha=0.5, label="training data")
    ax.axvspan(0, 6, color="grey", alpha=0.07)
    ax.set(xlabel="x", ylabel="y", ylim=(-5, 5), title="Heteroscedastic Laplace (full GGN)")
    ax.legend(loc="lower left", fontsize=8, ncol=2)
    fig.tight_layout()
    args.output.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.output / "heteroscedastic.png", dpi=110)

    probe = torch.tensor([[0.5], [3.0], [5.5], [-1.5], [7.5]])
    at_probe = la(probe, diagonal_output=True)
    summary = {
        "data": "300 points y = sin(x) + (0.05 + 0.12 x) ε on [0, 6]; 500 test points",
        "prior_precision": la.prior_precision.item(),
        "metrics": metrics,
        "seconds": seconds,
        "probe_x": probe.squeeze(-1).tolist(),
        "true_noise_std": [
            float(noise_std(v)) if 0 <= v <= 6 else None for v in probe.squeeze(-1)
        ],
        "aleatoric_std": at_probe.aleatoric_variance.sqrt().squeeze(-1).tolist(),
        "epistemic_std": at_probe.epistemic_variance.sqrt().squeeze(-1).tolist(),
    }
    (args.output / "metrics.json").write_text(json.dumps(summary, indent=2))
    print(f"{summary['data']}; MLP 1-50-50-2 [μ, log σ²]")
    print(f"prior precision (marginal likelihood): {la.prior_precision.item():.3g}")
    print(f"  {'x':>5s} {'true σ':>8s} {'aleatoric':>10s} {'epistemic':>10s}")
    for x_, true, alea, epi in zip(
        summary["probe_x"], summary["true_noise_std"], summary["aleatoric_std"],
        summary["epistemic_std"], strict=True,
    ):  # fmt: skip
        true_text = f"{true:8.3f}" if true is not None else f"{'-':>8s}"
        print(f"  {x_:5.1f} {true_text} {alea:10.3f} {epi:10.3f}")
    print(f"\n  {'method':8s} {'NLL':>7s} {'RMSE':>7s} {'CRPS':>7s} {'cov. 90%':>9s} {'time':>7s}")
    for name, m in metrics.items():
        print(
            f"  {name:8s} {m['nll']:7.3f} {m['rmse']:7.3f} {m['crps']:7.3f} "
            f"{m['coverage']['0.9']:9.3f} {seconds[name]:6.2f}s"
        )
    print(f"\nfigure and metrics: {args.output}")


if __name__ == "__main__":
    main()
