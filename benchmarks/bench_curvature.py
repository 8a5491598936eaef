"""Time the exact diagonal GGN against one forward plus ten backward passes.

Usage: ``python benchmarks/bench_curvature.py [--threads 2] [--n 2000] [--batch 128]``.
Prints, per model, the seconds of both and their ratio (target: ratio ≤ 3).
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn

from laplace.curvature import CurvlinopsGGN


def mlp() -> nn.Module:
    return nn.Sequential(
        nn.Flatten(),
        nn.Linear(784, 256),
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
        nn.Linear(1568, 128),
        nn.ReLU(),
        nn.Linear(128, 10),
    )


def batches(n: int, batch: int):
    gen = torch.Generator().manual_seed(0)
    X = torch.randn(n, 1, 28, 28, generator=gen)
    y = torch.randint(0, 10, (n,), generator=gen)
    return [(X[i : i + batch], y[i : i + batch]) for i in range(0, n, batch)]


def forward_ten_backward(model: nn.Module, data) -> None:
    params = [p for p in model.parameters() if p.requires_grad]
    for X, _ in data:
        f = model(X)
        for c in range(10):
            torch.autograd.grad(f[:, c].sum(), params, retain_graph=c < 9)


def diag_ggn(model: nn.Module, data) -> None:
    backend = CurvlinopsGGN(model, "classification")
    for X, y in data:
        backend.diag(X, y)


def best_of(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--n", type=int, default=2000)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    data = batches(args.n, args.batch)
    print(f"N={args.n} batch={args.batch} threads={args.threads}")
    print(f"{'model':<6}{'params':>9}{'fwd+10bwd s':>13}{'diag GGN s':>12}{'ratio':>8}")
    for name, build in [("mlp", mlp), ("cnn", cnn)]:
        model = build()
        n_params = sum(p.numel() for p in model.parameters())
        base = best_of(lambda m=model: forward_ten_backward(m, data), args.repeats)
        ours = best_of(lambda m=model: diag_ggn(m, data), args.repeats)
        print(f"{name:<6}{n_params:>9}{base:>13.3f}{ours:>12.3f}{ours / base:>8.2f}")


if __name__ == "__main__":
    main()
