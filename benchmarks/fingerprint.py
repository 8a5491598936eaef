"""Float64 fingerprint of the benchmark scenarios: the numbers a refactoring must not change.

Each scenario fits a benchmark model (``harness.py``) in float64 through the public API and
records what users read: the log marginal likelihood, the prior precision after 20 marglik
steps and the marginal likelihood there, the GLM probit (or Gaussian) predictive and the NN
predictive of 16 test points with a seeded generator, and seeded posterior samples. Two runs
are equal when every recorded tensor is equal to the bit; ``--compare`` reports the largest
relative difference of each scenario that is not.

    python benchmarks/fingerprint.py OUT.pt            # this checkout's src/
    python benchmarks/fingerprint.py --compare A.pt B.pt

Run it on two revisions (``git worktree add`` the older one and point ``PYTHONPATH`` at its
``src/``) to check that a step changed no number.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

import torch
from torch.utils.data import DataLoader, TensorDataset

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from harness import MODELS, data, regression_loader, regression_mlp  # noqa: E402

#: (model, subset_of_weights, hessian_structure): laplace-torch's tuning scenarios and every
#: structure the benchmark models fit.
SCENARIOS = [
    ("regression", "all", "full"),
    ("regression", "all", "kron"),
    ("regression", "last_layer", "diag"),
    ("mlp", "all", "diag"),
    ("mlp", "all", "kron"),
    ("mlp", "all", "ekfac"),
    ("mlp", "all", "lowrank"),
    ("mlp", "last_layer", "full"),
    ("cnn", "last_layer", "kron"),
    ("cnn", "last_layer", "diag"),
    ("cnn", "all", "kron"),
    ("cnn", "all", "diag"),
]
N_TRAIN, N_TEST = 96, 16


def fit(model_name: str, subset: str, structure: str):
    """A float64 fit of one scenario."""
    from laplace import Laplace

    torch.manual_seed(0)
    if model_name == "regression":
        model, likelihood = regression_mlp(), "regression"
        X, y = regression_loader(N_TRAIN).dataset.tensors
        X_test = torch.linspace(-1.0, 9.0, N_TEST).unsqueeze(-1)
    else:
        model, likelihood = MODELS[model_name](), "classification"
        X, y = data(model_name, N_TRAIN, 0)
        X_test, _ = data(model_name, N_TEST, 1)
    y = y.double() if y.is_floating_point() else y
    loader = DataLoader(TensorDataset(X.double(), y), batch_size=32)
    la = Laplace(model.double().eval(), likelihood, subset, structure)
    la.fit(loader)
    return la, X_test.double()


def record(model_name: str, subset: str, structure: str) -> dict[str, torch.Tensor]:
    """The numbers one scenario's user reads, detached."""
    la, X_test = fit(model_name, subset, structure)
    out = {"log_marglik": la.log_marginal_likelihood()}
    la.optimize_prior_precision(method="marglik", n_steps=20)
    out["prior_precision"] = la.prior_precision
    out["tuned_log_marglik"] = la.log_marginal_likelihood()
    glm = la(X_test, pred_type="glm", link_approx="probit")
    out.update(zip(("glm_mean", "glm_var"), glm) if isinstance(glm, tuple) else [("glm", glm)])
    nn_pred = la(
        X_test,
        pred_type="nn",
        link_approx="mc",
        n_samples=8,
        generator=torch.Generator().manual_seed(3),
    )
    out.update(
        zip(("nn_mean", "nn_var"), nn_pred) if isinstance(nn_pred, tuple) else [("nn", nn_pred)]
    )
    out["samples"] = la.sample(4, generator=torch.Generator().manual_seed(5))
    return {key: value.detach().cpu() for key, value in out.items()}


def compare(first: dict, second: dict) -> int:
    """Print each scenario's verdict; the number of scenarios that differ."""
    differing = 0
    for name in sorted(set(first) | set(second)):
        if name not in first or name not in second:
            print(f"{name:40s} only in {'the second' if name in second else 'the first'}")
            differing += 1
            continue
        worst = 0.0
        for key, a in first[name].items():
            b = second[name][key]
            if a.shape != b.shape:
                worst = float("inf")
            elif not torch.equal(a, b):
                worst = max(worst, ((a - b).abs().max() / a.abs().max().clamp_min(1e-300)).item())
        differing += worst > 0
        print(
            f"{name:40s} {'bit-equal' if worst == 0 else f'max relative difference {worst:.1e}'}"
        )
    return differing


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", nargs="?", help="file to write the fingerprint to (.pt)")
    parser.add_argument("--compare", nargs=2, metavar=("A", "B"))
    args = parser.parse_args()
    if args.compare:
        first, second = (torch.load(path) for path in args.compare)
        sys.exit(1 if compare(first, second) else 0)
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    results = {":".join(spec): record(*spec) for spec in SCENARIOS}
    torch.save(results, args.out)
    print(f"{len(results)} scenarios written to {args.out}")


if __name__ == "__main__":
    main()
