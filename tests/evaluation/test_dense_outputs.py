"""``evaluate`` on predictions with extra output dimensions: scored position by position.

Segmentation probabilities (B, C, H, W) with labels (B, H, W), sequence probabilities
(B, T, C) with labels (B, T), ``ignore_index`` positions left out, and dense regression: each
must give the metrics of the same predictions flattened to rows (B·positions, C) by hand.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from laplace.evaluation import evaluate

IGNORED = -100
#: torchmetrics' accuracy and calibration error are float32; NLL and Brier are float64 here.
RTOL_F32, RTOL_F64 = 1e-6, 1e-10


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


def _rows_reference(probs: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
    """Metrics of rows (N, C) and labels (N,) computed directly (no torchmetrics)."""
    keep = labels != IGNORED
    probs, labels = probs[keep], labels[keep]
    onehot = torch.nn.functional.one_hot(labels, probs.shape[-1])
    return {
        "accuracy": (probs.argmax(-1) == labels).double().mean().item(),
        "nll": -probs[torch.arange(len(labels)), labels].log().mean().item(),
        "brier": (probs - onehot).square().sum(-1).mean().item(),
        "n": int(keep.sum()),
    }


def _dense_case(shape: str, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Probabilities, labels with some ignored positions, and the same as rows (N, C)."""
    gen = torch.Generator().manual_seed(seed)
    B, C, H, W, T = 6, 4, 3, 5, 7
    if shape == "segmentation":
        logits = torch.randn(B, C, H, W, generator=gen, dtype=torch.float64)
        probs = logits.softmax(1)
        labels = torch.randint(C, (B, H, W), generator=gen)
        rows = probs.movedim(1, -1).reshape(-1, C)
    else:
        probs = torch.randn(B, T, C, generator=gen, dtype=torch.float64).softmax(-1)
        labels = torch.randint(C, (B, T), generator=gen)
        rows = probs.reshape(-1, C)
    labels[torch.rand(labels.shape, generator=gen) < 0.25] = IGNORED
    return probs, labels, rows


@pytest.mark.parametrize("shape", ["segmentation", "sequence"])
def test_dense_classification_is_scored_per_kept_position(shape):
    probs, labels, rows = _dense_case(shape)
    loader = DataLoader(TensorDataset(probs, labels), batch_size=4)
    result = evaluate(_identity, loader, likelihood="classification")
    expected = _rows_reference(rows, labels.reshape(-1))
    assert result["n"] == expected["n"]
    assert result["accuracy"] == pytest.approx(expected["accuracy"], rel=RTOL_F32)
    for name in ("nll", "brier"):
        assert result[name] == pytest.approx(expected[name], rel=RTOL_F64)
    flat_loader = DataLoader(
        TensorDataset(rows, labels.reshape(-1)), batch_size=len(labels.reshape(-1))
    )
    flat = evaluate(_identity, flat_loader, likelihood="classification")
    assert result["ece"] == pytest.approx(flat["ece"], rel=RTOL_F32)


def test_dense_ood_scores_are_mean_entropies_over_positions():
    probs, labels, _ = _dense_case("segmentation")
    confident = torch.nn.functional.one_hot(probs.argmax(1), probs.shape[1]).movedim(-1, 1)
    confident = (0.97 * confident + 0.01).double()
    loader = DataLoader(TensorDataset(confident, labels), batch_size=3)
    ood = DataLoader(TensorDataset(probs, labels), batch_size=3)
    result = evaluate(_identity, loader, ood_loader=ood, likelihood="classification")
    assert result["ood_auroc"] == pytest.approx(1.0)


def test_ambiguous_class_dimension_needs_class_dim():
    gen = torch.Generator().manual_seed(0)
    probs = torch.rand(4, 3, 3, generator=gen, dtype=torch.float64).softmax(1)
    labels = torch.randint(3, (4, 3), generator=gen)
    loader = DataLoader(TensorDataset(probs, labels), batch_size=4)
    with pytest.raises(ValueError, match="class_dim"):
        evaluate(_identity, loader, likelihood="classification")
    result = evaluate(_identity, loader, likelihood="classification", class_dim=1)
    expected = _rows_reference(probs.movedim(1, -1).reshape(-1, 3), labels.reshape(-1))
    assert result["nll"] == pytest.approx(expected["nll"], rel=RTOL_F64)


def test_dense_regression_is_scored_as_independent_outputs():
    gen = torch.Generator().manual_seed(2)
    mean = torch.randn(5, 2, 3, generator=gen, dtype=torch.float64)
    var = torch.rand(5, 2, 3, generator=gen, dtype=torch.float64) + 0.1
    target = mean + var.sqrt() * torch.randn(5, 2, 3, generator=gen, dtype=torch.float64)

    def predictive(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x[:, 0], x[:, 1]

    inputs = torch.stack([mean, var], 1)
    result = evaluate(predictive, DataLoader(TensorDataset(inputs, target), batch_size=2))
    normal = torch.distributions.Normal(mean, var.sqrt())
    nll = -normal.log_prob(target).flatten(1).sum(1).mean().item()
    assert result["nll"] == pytest.approx(nll, rel=RTOL_F64)
    rmse = (mean - target).square().mean().sqrt().item()
    assert result["rmse"] == pytest.approx(rmse, rel=RTOL_F64)
