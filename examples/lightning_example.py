"""Laplace from a Lightning callback: fit when training ends, report calibration as torchmetrics.

A ``LightningModule`` trains an MLP classifier on scikit-learn's handwritten digits (no
download). ``LaplaceCallback`` fits a last-layer KFAC Laplace approximation on the trainer's
training data when ``trainer.fit`` ends, tunes its prior precision by the marginal likelihood and
attaches it to the module as ``module.laplace``; ``test_step`` then predicts with it and updates
torchmetrics (accuracy, calibration error, and ``laplace.utils.RunningNLLMetric``) beside the MAP
network's. Writes ``metrics.json`` under ``outputs/lightning_example/`` (or ``--output DIR``)
and prints the folder. A few seconds on a CPU.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

os.environ.setdefault("PL_DISABLE_FORK", "1")

import lightning as L
import torch
from sklearn.datasets import load_digits
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics import MetricCollection
from torchmetrics.classification import MulticlassAccuracy, MulticlassCalibrationError

from laplace import Laplace
from laplace.utils import RunningNLLMetric

DEFAULT_OUTPUT = Path(__file__).resolve().parent.parent / "outputs" / "lightning_example"


def calibration_metrics() -> MetricCollection:
    return MetricCollection(
        {
            "accuracy": MulticlassAccuracy(num_classes=10),
            "ece": MulticlassCalibrationError(num_classes=10, n_bins=15),
            "nll": RunningNLLMetric(),
        }
    )


# --8<-- [start:module]
class Classifier(L.LightningModule):
    """An MLP classifier; after ``fit`` with ``LaplaceCallback``, ``self.laplace`` predicts."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 10)
        )
        self.laplace = None
        self.map_metrics = calibration_metrics()
        self.laplace_metrics = calibration_metrics()

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        X, y = batch
        return nn.functional.cross_entropy(self.net(X), y)

    def test_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        X, y = batch
        self.map_metrics.update(self.net(X).softmax(-1), y)
        self.laplace_metrics.update(self.laplace(X, link_approx="probit"), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3, weight_decay=1e-2)


class LaplaceCallback(L.Callback):
    """Fits a Laplace approximation of ``module.net`` when training ends."""

    def __init__(self, **laplace_kwargs) -> None:
        self.laplace_kwargs = laplace_kwargs

    def on_fit_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        la = Laplace(module.net, "classification", **self.laplace_kwargs)
        la.fit(trainer.train_dataloader)
        la.optimize_prior_precision(method="marglik")
        module.laplace = la


# --8<-- [end:module]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT)
    parser.add_argument("--epochs", type=int, default=30)
    args = parser.parse_args()
    torch.manual_seed(0)
    digits = load_digits()
    X = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target)
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    train, test = perm[:1200], perm[1200:]
    train_loader = DataLoader(TensorDataset(X[train], y[train]), batch_size=64, shuffle=True)
    test_loader = DataLoader(TensorDataset(X[test], y[test]), batch_size=200)

    # --8<-- [start:fit]
    module = Classifier()
    trainer = L.Trainer(
        max_epochs=args.epochs,
        callbacks=[LaplaceCallback(subset_of_weights="last_layer", hessian_structure="kron")],
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, train_loader)
    trainer.test(module, test_loader, verbose=False)
    results = {
        "MAP": module.map_metrics.compute(),
        "Laplace (last-layer KFAC, marglik)": module.laplace_metrics.compute(),
    }
    # --8<-- [end:fit]

    summary = {name: {k: float(v) for k, v in m.items()} for name, m in results.items()}
    summary["prior_precision"] = module.laplace.prior_precision.tolist()
    args.output.mkdir(parents=True, exist_ok=True)
    (args.output / "metrics.json").write_text(json.dumps(summary, indent=2))
    print(f"{'predictive':36s} {'acc':>7s} {'NLL':>7s} {'ECE':>7s}")
    for name, m in summary.items():
        if name != "prior_precision":
            print(f"{name:36s} {m['accuracy']:7.4f} {m['nll']:7.4f} {m['ece']:7.4f}")
    print(f"metrics written to {args.output}/ (metrics.json)")


if __name__ == "__main__":
    main()
