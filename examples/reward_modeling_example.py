"""Reward modelling from pairwise preferences with a Laplace posterior over the reward network.

A hidden reward r(x) = -‖x - c‖² on the plane scores points; pairs (x₀, x₁) are labelled by a
Bradley-Terry draw, P(x₁ preferred) = σ(r(x₁) - r(x₀)). A reward MLP is trained on the pairs
(cross-entropy on the two rewards, as in laplace-torch's ``likelihood="reward_modeling"``), then a
KFAC Laplace approximation is fitted with ``likelihood="reward_modeling"``: it is trained as a
classifier over the pair and predicts each point's reward like a regression model, a mean and a
variance. The figure shows the predicted reward and its standard deviation, which grows away from
the data; ``laplace.evaluation.evaluate`` scores the preference probabilities of held-out pairs
(MAP network and Laplace predictive). Writes ``reward.png`` and ``metrics.json`` under
``outputs/reward_modeling_example/``.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

os.environ.setdefault("MPLBACKEND", "Agg")

import matplotlib.pyplot as plt
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from laplace import Laplace
from laplace.evaluation import evaluate

DEFAULT_OUTPUT = Path(__file__).resolve().parent.parent / "outputs" / "reward_modeling_example"
CENTRE = torch.tensor([0.5, -0.5])


def true_reward(x: torch.Tensor) -> torch.Tensor:
    return -(x - CENTRE).square().sum(-1)


class PairReward(nn.Module):
    """Reward network: (B, 2, D) pairs → (B, 2) rewards, (B, D) points → (B, 1) rewards."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(2, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh())
        self.head = nn.Linear(32, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 3:
            return self.head(self.net(x.reshape(-1, 2))).reshape(x.shape[0], 2)
        return self.head(self.net(x))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT)
    args = parser.parse_args()
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    pairs = torch.rand(400, 2, 2, generator=gen) * 2 - 1  # points in [-1, 1]²
    p_second = torch.sigmoid(true_reward(pairs[:, 1]) - true_reward(pairs[:, 0]))
    labels = torch.bernoulli(p_second, generator=gen).long()
    loader = DataLoader(TensorDataset(pairs, labels), batch_size=50, shuffle=True)

    torch.manual_seed(0)
    model = PairReward()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(100):
        for x, y in loader:
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()

    la = Laplace(model, "reward_modeling", subset_of_weights="all", hessian_structure="kron")
    la.fit(DataLoader(TensorDataset(pairs, labels), batch_size=100))
    la.optimize_prior_precision(method="marglik")

    grid = torch.linspace(-3, 3, 121)
    xx, yy = torch.meshgrid(grid, grid, indexing="xy")
    points = torch.stack([xx.reshape(-1), yy.reshape(-1)], -1)
    f_mu, f_var = la(points)
    mean = f_mu.detach().reshape(121, 121)
    std = f_var.detach().reshape(121, 121).sqrt()
    inside = (points.abs() <= 1).all(-1).reshape(121, 121)
    rank_corr = torch.corrcoef(
        torch.stack([mean[inside], true_reward(points)[inside.reshape(-1)]])
    )
    test_pairs = torch.rand(500, 2, 2, generator=gen) * 2 - 1
    better = (true_reward(test_pairs[:, 1]) > true_reward(test_pairs[:, 0])).long()
    pair_loader = DataLoader(TensorDataset(test_pairs, better), batch_size=250)
    # Preference probabilities of the pairs: the MAP network's, and the Laplace predictive's as
    # during fitting (fitting=True gives the pair probabilities instead of rewards).
    map_pairs = evaluate(lambda x: model(x).softmax(-1), pair_loader)
    la_pairs = evaluate(la, pair_loader, likelihood="classification", fitting=True)
    metrics = {
        "pair_accuracy": map_pairs["accuracy"],
        "pair_nll_map": map_pairs["nll"],
        "pair_nll_laplace": la_pairs["nll"],
        "pair_ece_map": map_pairs["ece"],
        "pair_ece_laplace": la_pairs["ece"],
        "reward_correlation_in_data_range": rank_corr[0, 1].item(),
        "mean_std_in_data_range": std[inside].mean().item(),
        "mean_std_outside_data_range": std[~inside].mean().item(),
        "prior_precision": la.prior_precision.mean().item(),
    }
    args.output.mkdir(parents=True, exist_ok=True)
    (args.output / "metrics.json").write_text(json.dumps(metrics, indent=2))
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, values, title in ((axes[0], mean, "predicted reward"), (axes[1], std, "reward std")):
        im = ax.imshow(values, extent=(-3, 3, -3, 3), origin="lower", cmap="viridis")
        ax.plot([-1, 1, 1, -1, -1], [-1, -1, 1, 1, -1], "w--", lw=1)
        ax.plot(*CENTRE, "r*", ms=10)
        ax.set_title(title)
        fig.colorbar(im, ax=ax)
    fig.tight_layout()
    fig.savefig(args.output / "reward.png", dpi=110)
    print("Reward modelling (Bradley-Terry pairs), KFAC Laplace over all weights:")
    for key, value in metrics.items():
        print(f"  {key:36s} {value:.4g}")
    print(f"figures and metrics written to {args.output}/ (reward.png, metrics.json)")


if __name__ == "__main__":
    main()
